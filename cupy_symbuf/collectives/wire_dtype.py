"""The quantised wire: float rows (float32, float16, bfloat16) sent as fp8 or int8 codes with one float32 scale per
block of :data:`~cupy_symbuf.quant.QUANT_BLOCK` (128) elements, and turned back into their own dtype on arrival.

The one implementation behind every collective that takes ``wire_dtype``: ``alltoallv(wire_dtype="fp8" | "int8")``
moves packed rows (:func:`pack_rows` / :func:`unpack_rows`), MoE ``dispatch(wire_dtype="fp8")`` moves the
``(codes, scales)`` pair as an fp8 tuple (:func:`quantize` / :func:`dequantize`). The quantisers are those of
:mod:`cupy_symbuf.quant` (fp8: the device function of the low-latency kernels, bit for bit); NumPy or CuPy arrays,
the work runs where the rows are. Argument checks stay with the collectives (each names its own arguments).
"""
from __future__ import annotations

import numpy as np

from ..common import backend as _compat
from ..common import dtypes as _dt
from . import quant

__all__ = ["WIRE_DTYPES", "PACKED_DTYPE", "quantize", "dequantize", "packed_width", "pack_rows", "unpack_rows"]

#: The wire formats, by ``wire_dtype`` name.
WIRE_DTYPES = ("fp8", "int8")

#: wire_dtype -> the dtype of the packed rows: fp8 (uint8) and int8 (int8) differ, so ranks mixing them fail the
#: row-signature check instead of decoding each other's codes.
PACKED_DTYPE = {"fp8": np.uint8, "int8": np.int8}

#: float kind of the source rows -> the middle axis of the packed rows ``[n, code, width // code]``: the source dtype
#: travels in the packed row shape, so the row-signature check compares it too.
_KIND_CODE = {_dt.FLOAT32: 1, _dt.FLOAT16: 2, _dt.BFLOAT16: 4}


def _xp(a):
    """NumPy, or CuPy for a CuPy array."""
    return _compat.cupy if _compat.is_cupy_array(a) else np


def quantize(rows, kind: str, wire_dtype: str):
    """``(codes, scales)`` of ``rows`` ``[n, per_row]`` of float kind ``kind`` (``per_row % 128 == 0``): codes
    ``[n, per_row]`` (fp8: float8_e4m3fn bits, :func:`quant.quantize_fp8_from`, one kernel reading the rows in their
    own type on the GPU; int8: :func:`quant.quantize_int8`, ``scale = amax / 127``) and float32 scales
    ``[n, per_row // 128]``."""
    if wire_dtype == "fp8":
        return quant.quantize_fp8_from(rows, kind)
    return quant.quantize_int8(_dt.to_float32(_xp(rows), rows, kind))


def dequantize(codes, scales, kind: str, dtype, wire_dtype: str):
    """The rows of :func:`quantize` back in ``dtype`` (holding float kind ``kind``): ``code * scale`` per block,
    rounded to nearest even into ``dtype``; shape of ``codes``."""
    if wire_dtype == "fp8":
        return quant.dequantize_fp8_to(codes, scales, kind, dtype)
    return _dt.from_float32(_xp(codes), quant.dequantize_int8(codes, scales), kind, dtype)


def packed_width(per_row: int) -> int:
    """Bytes of one packed row of ``per_row`` elements: one code per element, a float32 scale per 128."""
    return per_row + 4 * (per_row // quant.QUANT_BLOCK)


def pack_rows(rows, kind: str, wire_dtype: str):
    """``rows`` ``[n, per_row]`` of float kind ``kind`` quantised and packed for the wire: an array of
    ``PACKED_DTYPE[wire_dtype]`` ``[n, code, packed_width(per_row) // code]`` (each row: its codes, then its scales'
    bytes; ``code`` 1 / 2 / 4 for float32 / float16 / bfloat16 sources), one contiguous block of rows."""
    xp = _xp(rows)
    n, per_row = rows.shape
    packed_dtype = PACKED_DTYPE[wire_dtype]
    q, scales = quantize(rows, kind, wire_dtype)
    width = packed_width(per_row)
    code = _KIND_CODE[kind]
    packed = xp.concatenate([q.view(packed_dtype), scales.view(packed_dtype).reshape(n, width - per_row)], axis=1)
    return packed.reshape(n, code, width // code)


def unpack_rows(recv, per_row: int, kind: str, dtype, wire_dtype: str):
    """Received packed rows (``[m, ...]``, :func:`pack_rows` of rows of ``per_row`` elements) dequantised into
    ``dtype``: ``[m, per_row]``. Floating-point warnings are silenced (capacity mode: rows past the count hold
    anything)."""
    xp = _xp(recv)
    m = int(recv.shape[0])
    recv = recv.reshape(m, packed_width(per_row))
    codes = recv[:, :per_row]
    scales = xp.ascontiguousarray(recv[:, per_row:]).view(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        return dequantize(codes, scales, kind, dtype, wire_dtype)
