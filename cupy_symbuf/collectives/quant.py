"""The one fp8 (e4m3) block quantiser, NumPy form: bit for bit the device function of ``cuda_src/quant.cuh``.

Per block of :data:`QUANT_BLOCK` (128) consecutive elements of a row (``hidden % 128 == 0``):

* ``amax = max(max |x|, 1e-4)`` (float32),
* ``scale = amax / 448`` (float32 division, round to nearest even); with ``ue8m0`` the scale is rounded **up** to a
  power of two (``2 ** ceil(log2(scale))``: exponent + 1 when a mantissa bit is set), so ``scale >= amax / 448``,
* ``inv = 1 / scale`` (float32), ``q = e4m3(x * inv)``: the float32 product rounded to nearest even to
  float8_e4m3fn, saturating to +-448 (PTX ``cvt.rn.satfinite.e4m3x2.f32``; here integer arithmetic on the float32
  bits, so ``ml_dtypes`` is not needed).

Dequantised ``x' = float(q) * scale``. **Error bound** (finite x): ``|x - x'| <= |x| * 2**-4 + scale * 2**-10``
(half an e4m3 ulp: 3 mantissa bits in the normal range, spacing ``2**-9`` in the subnormal range), plus float32
rounding of ``inv`` and of the product (relative ``2**-23`` each; :func:`error_bound` includes them). NaN input is
not supported (the amax ignores NaN on the GPU; the codes of NaN elements are NaN).

Every function but the error bounds (NumPy, for tests) takes NumPy or CuPy arrays and returns arrays of the same
module (the same elementwise integer
arithmetic on both), so the wire quantisation of ``dispatch`` / ``alltoallv`` (``wire_dtype="fp8"``) runs where
the data is. :func:`quantize_int8` / :func:`dequantize_int8` are the int8 form (``scale = amax / 127``).
"""
from __future__ import annotations

import numpy as np

from ..wire import protocol as _protocol

__all__ = ["QUANT_BLOCK", "FP8_MAX", "AMAX_FLOOR", "quantize_fp8", "dequantize_fp8", "quantize_fp8_from",
           "dequantize_fp8_to", "fp8_e4m3_to_float32",
           "float32_to_fp8_e4m3", "block_scales", "error_bound", "quantize_int8", "dequantize_int8",
           "int8_error_bound"]


def _xp(a):
    """NumPy, or CuPy for a CuPy array."""
    from ..common import backend as _compat
    return _compat.cupy if _compat.is_cupy_array(a) else np


#: Elements per scale, the largest finite e4m3 value and the amax floor: the wire's constants
#: (``wire/protocol.py`` ``QUANT_*``, generated into the kernels' header).
QUANT_BLOCK = _protocol.QUANT_BLOCK
FP8_MAX = np.float32(_protocol.QUANT_FP8_MAX)
AMAX_FLOOR = np.float32(_protocol.QUANT_AMAX_FLOOR)


def float32_to_fp8_e4m3(v: np.ndarray) -> np.ndarray:
    """float32 -> float8_e4m3fn bits (uint8), round to nearest even, saturating to +-448 (satfinite); NaN -> 0x7F."""
    xp = _xp(v)
    v = xp.ascontiguousarray(v, dtype=np.float32)
    u = v.view(np.uint32)
    sign = ((u >> np.uint32(24)) & np.uint32(0x80)).astype(np.uint8)
    a = xp.abs(v)
    au = a.view(np.uint32).astype(np.uint64)
    # normal range: round the float32 mantissa to 3 bits (nearest even), rebias the exponent (127 -> 7)
    r = (au + np.uint64(0x7FFFF) + ((au >> np.uint64(20)) & np.uint64(1))) >> np.uint64(20)
    normal = r.astype(np.int64) - ((127 - 7) << 3)
    # subnormal range (|v| < 2**-6): multiples of 2**-9, nearest even (2**-6 itself rounds to code 8 = 2**-6)
    sub = xp.rint(a * np.float32(512.0)).astype(np.int64)
    code = xp.where(a < np.float32(2.0 ** -6), sub, normal)
    code = xp.minimum(code, 0x7E).astype(np.uint8)
    code = xp.where(xp.isnan(v), np.uint8(0x7F), code | sign)
    return code.astype(np.uint8)


_TABLE = None
_TABLES = {}  # per array module


def fp8_e4m3_to_float32(q) -> np.ndarray:
    """float8_e4m3fn bits (uint8, or an ml_dtypes float8_e4m3fn array) -> float32, exact."""
    global _TABLE
    if _TABLE is None:
        c = np.arange(256)
        s = np.where(c & 0x80, -1.0, 1.0)
        e, m = (c >> 3) & 0xF, c & 7
        val = np.where(e == 0, m * 2.0 ** -9, (1 + m / 8.0) * 2.0 ** (e - 7.0))
        val = np.where((c & 0x7F) == 0x7F, np.nan, val)
        _TABLE = (s * val).astype(np.float32)
    xp = _xp(q)
    q = xp.asarray(q)
    table = _TABLES.get(xp.__name__)
    if table is None:
        table = _TABLES[xp.__name__] = xp.asarray(_TABLE)
    return table[q.view(np.uint8) if q.dtype.itemsize == 1 else q.astype(np.uint8)]


def block_scales(xf: np.ndarray, ue8m0: bool = False) -> np.ndarray:
    """float32 scales ``[..., hidden // 128]`` of float32 rows ``xf [..., hidden]``."""
    xp = _xp(xf)
    blocks = xf.reshape(xf.shape[:-1] + (xf.shape[-1] // QUANT_BLOCK, QUANT_BLOCK))
    if not blocks.size:
        amax = xp.zeros(blocks.shape[:-1], np.float32)
    elif xp is np:
        amax = np.fmax.reduce(np.abs(blocks), axis=-1)
    else:  # NaN ignored, as fmax.reduce and the GPU quantiser do
        a = xp.abs(blocks)
        amax = xp.where(xp.isnan(a), np.float32(0), a).max(axis=-1)
    amax = xp.fmax(amax.astype(np.float32), AMAX_FLOOR)  # fmax: an all-NaN block's NaN amax takes the floor, as
    # on the GPU (fmaxf)
    scale = (amax / FP8_MAX).astype(np.float32)
    if ue8m0:
        u = scale.view(np.uint32).astype(np.uint64)
        scale = ((u + np.uint64(0x7FFFFF)) & np.uint64(0xFF800000)).astype(np.uint32).view(np.float32)
    return scale


#: Launch shape of the fused GPU (de)quantiser (cuda_src/quant.cu): warps per block and a cap on the blocks (the
#: kernels are grid-stride loops, one warp per 128-element block).
_GPU_THREADS = 256
_GPU_MAX_BLOCKS = 4096


#: Suffix of the fused kernels' entry points per float kind (cuda_src/quant.cu, SYMBUF_QUANT_ENTRY), and the
#: alignment in bytes their vector loads / stores of the caller's rows need (4 elements of the kind).
_GPU_KIND = {"float32": ("", 16), "float16": ("_f16", 8), "bfloat16": ("_bf16", 8)}


#: The dtype the kernels read and write for each float kind (bfloat16 as raw bits: CuPy has no bfloat16).
_NATURAL = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}


def _gpu_launch(name: str, num_blocks: int, **fields) -> None:
    """Run kernel ``name`` of ``cuda_src/quant.cu`` over ``num_blocks`` 128-element blocks on the current stream;
    ``fields``: the rest of its argument struct (``QuantArgs`` / ``DequantArgs``, ``wire/kernel_args.py``)."""
    from ..transport import kernels as _kernels
    warps = _GPU_THREADS // 32
    grid = max(1, min(_GPU_MAX_BLOCKS, -(-num_blocks // warps)))
    launch = _kernels.get_launcher("quant.cu", name)
    launch.fill(num_blocks=num_blocks, **fields)
    launch(grid, _GPU_THREADS)


def quantize_fp8(xf, ue8m0: bool = False):
    """``(q, scales)``: ``q`` uint8 e4m3 bits with ``xf``'s shape, ``scales`` float32 ``[..., hidden // 128]``.

    ``xf``: float32 (or anything exactly convertible: bf16 widened, fp16) array whose last axis is a multiple of
    128. Bitwise equal to the GPU quantiser (``cuda_src/quant.cuh``). On CuPy arrays it runs as one kernel
    (``cuda_src/quant.cu``, ``symbuf_quant_fp8``: one warp per block), the NumPy arithmetic below being its
    specification."""
    xp = _xp(xf)
    xf = xp.ascontiguousarray(xf, dtype=np.float32)
    if xf.shape[-1] % QUANT_BLOCK:
        raise ValueError(f"quantize_fp8: the last axis ({xf.shape[-1]}) must be a multiple of {QUANT_BLOCK}")
    if xp is not np:
        return _gpu_quant(xf, "float32", ue8m0)
    scale = block_scales(xf, ue8m0)
    inv = (np.float32(1.0) / scale).astype(np.float32)
    blocks = xf.reshape(xf.shape[:-1] + (xf.shape[-1] // QUANT_BLOCK, QUANT_BLOCK))
    prod = (blocks * inv[..., None]).astype(np.float32)
    return float32_to_fp8_e4m3(prod).reshape(xf.shape), scale


def dequantize_fp8(q, scales) -> np.ndarray:
    """float32 ``float(q) * scale`` per 128-element block (CuPy arrays: one kernel, ``symbuf_dequant_fp8``)."""
    xp = _xp(q)
    if xp is not np:
        out = _gpu_dequant(q, scales, "float32")
        if out is not None:
            return out
    f = fp8_e4m3_to_float32(q)
    xp = _xp(f)
    blocks = f.reshape(f.shape[:-1] + (f.shape[-1] // QUANT_BLOCK, QUANT_BLOCK))
    return (blocks * xp.asarray(scales, np.float32)[..., None]).reshape(f.shape)


def _gpu_quant(x, kind: str, ue8m0: bool):
    """The fused quantiser on CuPy ``x`` (C-contiguous, elements of float kind ``kind`` in their own type, last
    axis a multiple of 128): ``(q, scales)``."""
    suffix, align = _GPU_KIND[kind]
    if x.data.ptr % align:  # a view starting inside an allocation: the kernel loads 4 elements at a time
        x = x.copy()
    xp = _xp(x)
    q = xp.empty(x.shape, np.uint8)
    scale = xp.empty(x.shape[:-1] + (x.shape[-1] // QUANT_BLOCK,), np.float32)
    nb = x.size // QUANT_BLOCK
    if nb:
        _gpu_launch("symbuf_quant_fp8" + suffix, nb, x=x.data.ptr, ue8m0=1 if ue8m0 else 0, q=q.data.ptr,
                    scales=scale.data.ptr)
    return q, scale


def _gpu_dequant(q, scales, kind: str):
    """The fused dequantiser on CuPy codes ``q`` writing float kind ``kind`` (its natural dtype: float32, float16,
    uint16 bits for bfloat16), or None where the shapes do not fit the kernel (the caller's elementwise path)."""
    xp = _xp(q)
    if q.ndim < 1 or q.shape[-1] % QUANT_BLOCK:
        return None
    codes = xp.ascontiguousarray(q).view(np.uint8) if q.dtype.itemsize == 1 else xp.ascontiguousarray(
        q.astype(np.uint8))
    s = xp.ascontiguousarray(xp.asarray(scales, np.float32))
    if s.size * QUANT_BLOCK != codes.size:
        return None
    if codes.data.ptr % 4:  # the kernel loads 4 codes at a time
        codes = codes.copy()
    if s.data.ptr % 4:
        s = s.copy()
    out = xp.empty(codes.shape, _NATURAL[kind])  # a fresh allocation: aligned for the kernel's vector stores
    nb = codes.size // QUANT_BLOCK
    if nb:
        _gpu_launch("symbuf_dequant_fp8" + _GPU_KIND[kind][0], nb, q=codes.data.ptr, scales=s.data.ptr,
                    out=out.data.ptr)
    return out


def _check_kind(fn: str, name: str, dtype, kind: str) -> None:
    """``ValueError`` for a ``kind`` that is no float kind of the wire, ``TypeError`` when ``dtype`` does not hold
    ``kind`` values (bfloat16: the ml_dtypes dtype or ``uint16`` raw bits)."""
    from ..common import dtypes as _dt
    if kind not in _NATURAL:
        raise ValueError(f"{fn}: kind must be one of {sorted(_NATURAL)}, got {kind!r}")
    if _dt.float_kind(dtype, raw_uint16=_dt.BFLOAT16) != kind:
        what = "the bfloat16 dtype or uint16 raw bits" if kind == "bfloat16" else kind
        raise TypeError(f"{fn}: {name} must hold {kind} values ({what}) for kind={kind!r}, got dtype {np.dtype(dtype)}")


def quantize_fp8_from(x, kind: str, ue8m0: bool = False):
    """``(q, scales)`` of rows ``x`` of float kind ``kind``: bit for bit
    ``quantize_fp8(dtypes.to_float32(xp, x, kind), ue8m0)``.

    ``kind``: ``dtypes.FLOAT32`` / ``FLOAT16`` / ``BFLOAT16`` (bfloat16 as raw ``uint16`` bits or the ml_dtypes
    dtype). On CuPy arrays it is one kernel that reads ``x`` in its own type (``symbuf_quant_fp8_f16`` / ``_bf16``):
    no float32 copy of the rows, which on one GPU cost more HBM traffic than the fp8 wire saved (docs/perf-notes.md).
    Raises ``ValueError`` when the last axis is not a multiple of 128 or ``kind`` is not one of the three,
    ``TypeError`` when ``x``'s dtype does not hold ``kind`` values."""
    from ..common import dtypes as _dt
    _check_kind("quantize_fp8_from", "x", x.dtype, kind)
    xp = _xp(x)
    if xp is np:
        return quantize_fp8(_dt.to_float32(xp, x, kind), ue8m0)
    x = xp.ascontiguousarray(x)
    if x.ndim < 1 or x.shape[-1] % QUANT_BLOCK:
        raise ValueError(f"quantize_fp8_from: the last axis ({x.shape[-1] if x.ndim else 0}) must be a multiple of "
                         f"{QUANT_BLOCK}")
    return _gpu_quant(x, kind, ue8m0)


def dequantize_fp8_to(q, scales, kind: str, out_dtype):
    """``float(q) * scale`` per 128-element block, narrowed to float kind ``kind`` and returned with dtype
    ``out_dtype``: bit for bit ``dtypes.from_float32(xp, dequantize_fp8(q, scales), kind, out_dtype)``, NaN
    payloads aside (a NaN stays NaN; the GPU's float32 product gives its canonical one). On CuPy arrays one kernel
    writing the caller's type (``symbuf_dequant_fp8_f16`` / ``_bf16``), no float32 temporary. Raises
    ``ValueError`` for a ``kind`` not of the three, ``TypeError`` when ``out_dtype`` does not hold ``kind`` values."""
    from ..common import dtypes as _dt
    _check_kind("dequantize_fp8_to", "out_dtype", out_dtype, kind)
    xp = _xp(q)
    out = _gpu_dequant(q, scales, kind) if xp is not np else None
    if out is None:
        return _dt.from_float32(xp, dequantize_fp8(q, scales), kind, out_dtype)
    if kind == "bfloat16":
        return out if np.dtype(out_dtype) == np.uint16 else out.view(out_dtype)
    return out if np.dtype(out_dtype) == np.dtype(_NATURAL[kind]) else out.astype(out_dtype)


def error_bound(xf, scales) -> np.ndarray:
    """The documented bound of ``|x - dequantize_fp8(quantize_fp8(x))|`` per element (float64)."""
    xf = np.asarray(xf, np.float64)
    s = np.repeat(np.asarray(scales, np.float64), QUANT_BLOCK, axis=-1)
    return np.abs(xf) * (2.0 ** -4 + 2.0 ** -21) + s * 2.0 ** -10


def quantize_int8(xf, block: int = QUANT_BLOCK):
    """``(q, scales)``: int8 codes with ``xf``'s shape and float32 scales ``[..., last // block]`` per block of
    ``block`` elements of the last axis: ``scale = amax / 127`` (0 for an all-zero block), ``q = rint(x / scale)``
    clipped to +-127. NumPy or CuPy. Error bound: :func:`int8_error_bound`. A block whose amax is below
    ``127 * 2**-149`` (about 1.8e-43, subnormal) gets scale 0, since ``amax / 127`` underflows, and decodes to
    zeros: its error is then up to amax itself, outside that bound."""
    xp = _xp(xf)
    xf = xp.ascontiguousarray(xf, dtype=np.float32)
    if xf.shape[-1] % block:
        raise ValueError(f"quantize_int8: the last axis ({xf.shape[-1]}) must be a multiple of {block}")
    blocks = xf.reshape(xf.shape[:-1] + (xf.shape[-1] // block, block))
    amax = xp.abs(blocks).max(axis=-1) if blocks.size else xp.zeros(blocks.shape[:-1], np.float32)
    scale = (amax / np.float32(127)).astype(np.float32)
    inv = xp.where(scale > 0, np.float32(1) / xp.where(scale > 0, scale, np.float32(1)), np.float32(0))
    q = xp.clip(xp.rint(blocks * inv[..., None]), -127, 127).astype(np.int8)
    return q.reshape(xf.shape), scale


def dequantize_int8(q, scales, block: int = QUANT_BLOCK):
    """float32 ``q * scale`` per block of ``block`` elements of the last axis (NumPy or CuPy)."""
    xp = _xp(q)
    blocks = q.reshape(q.shape[:-1] + (q.shape[-1] // block, block)).astype(np.float32)
    return (blocks * xp.asarray(scales, np.float32)[..., None]).reshape(q.shape)


def int8_error_bound(scales, block: int = QUANT_BLOCK) -> np.ndarray:
    """The bound of ``|x - dequantize_int8(quantize_int8(x))|`` per element (NumPy float64): half a step,
    ``scale / 2``, plus float32 rounding (``2**-22`` of ``127 * scale``)."""
    s = np.repeat(np.asarray(scales, np.float64), block, axis=-1)
    return s * (0.5 + 127 * 2.0 ** -22)
