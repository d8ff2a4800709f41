"""Dtype helpers shared by the NumPy (host) and CuPy (GPU) paths.

Neither NumPy nor every CuPy build has native ``bfloat16`` / ``float8_e4m3fn`` arithmetic. NumPy gets the dtypes
from ``ml_dtypes`` (optional); CuPy >= 14 knows the ``bfloat16`` dtype but code that must also run on older CuPy
holds bf16 as raw ``uint16`` bits and fp8 as raw ``uint8`` bits. The helpers here therefore

- recognise a dtype by name and itemsize (``"bfloat16"`` with 2 bytes, ``"float8_e4m3fn"`` with 1 byte), so an
  ``ml_dtypes`` dtype, a CuPy dtype of that name and the raw-bits integer stand-ins are all accepted, and
- convert bf16 <-> float32 on the raw bits with plain integer ops of the array module ``xp`` (``numpy`` or
  ``cupy``), so the conversion runs on the device for CuPy input and gives the same bits on both backends.

bfloat16 is the high 16 bits of an IEEE float32: widening is ``bits << 16``; narrowing rounds to nearest, ties to
even (the rounding of ``ml_dtypes``, PyTorch and CUDA's ``__float2bfloat16_rn``), and keeps NaN a (quiet) NaN.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

try:  # optional: only needed to *name* bf16/fp8 dtypes on NumPy
    import ml_dtypes as _ml_dtypes  # type: ignore
except Exception:  # pragma: no cover - depends on the environment
    _ml_dtypes = None

__all__ = [
    "BFLOAT16", "FLOAT16", "FLOAT32", "FLOAT8_E4M3",
    "bfloat16_dtype", "float8_e4m3fn_dtype",
    "is_bfloat16", "is_float8_e4m3", "float_kind",
    "bf16_bits_to_float32", "float32_to_bf16_bits", "to_float32", "from_float32", "raw_bits",
]

#: Kind names returned by :func:`float_kind`.
BFLOAT16 = "bfloat16"
FLOAT16 = "float16"
FLOAT32 = "float32"
FLOAT8_E4M3 = "float8_e4m3"

_FP8_E4M3_NAMES = ("float8_e4m3fn", "float8_e4m3")


def bfloat16_dtype() -> Optional[np.dtype]:
    """``np.dtype(ml_dtypes.bfloat16)``, or ``None`` when ``ml_dtypes`` is not installed."""
    return None if _ml_dtypes is None else np.dtype(_ml_dtypes.bfloat16)


def float8_e4m3fn_dtype() -> Optional[np.dtype]:
    """``np.dtype(ml_dtypes.float8_e4m3fn)``, or ``None`` when ``ml_dtypes`` is not installed."""
    return None if _ml_dtypes is None else np.dtype(_ml_dtypes.float8_e4m3fn)


def _dtype(dtype: Any) -> Optional[np.dtype]:
    """``np.dtype(dtype)`` or ``None`` if it cannot be interpreted (a CuPy dtype is a NumPy dtype)."""
    if isinstance(dtype, str) and dtype.lower() == BFLOAT16:
        return bfloat16_dtype()
    try:
        return np.dtype(dtype)
    except Exception:
        return None


#: Answers of :func:`is_bfloat16` / :func:`float_kind` per (dtype object, options): NumPy's ``dtype.name`` is a
#: Python-level property (several microseconds), and the hot paths ask about the same few dtypes on every call.
_MEMO: dict = {}
_MEMO_MAX = 256


def _memo(key, compute):
    try:
        return _MEMO[key]
    except KeyError:
        pass
    except TypeError:  # an unhashable dtype-like: answered, not remembered
        return compute()
    value = compute()
    if len(_MEMO) < _MEMO_MAX:
        _MEMO[key] = value
    return value


def is_bfloat16(dtype: Any) -> bool:
    """True for a 2-byte dtype named ``bfloat16`` (``ml_dtypes.bfloat16``, CuPy's ``bfloat16``) or the string
    ``"bfloat16"``. Raw ``uint16`` bits are *not* bfloat16 by themselves (see :func:`float_kind`)."""
    if isinstance(dtype, str):
        return dtype.lower() == BFLOAT16
    return _memo(("bf16", dtype), lambda: _is_bfloat16(dtype))


def _is_bfloat16(dtype: Any) -> bool:
    dt = _dtype(dtype)
    return dt is not None and dt.itemsize == 2 and dt.name == BFLOAT16


def is_float8_e4m3(dtype: Any) -> bool:
    """True for a 1-byte dtype named ``float8_e4m3fn`` (or ``float8_e4m3``), e.g. ``ml_dtypes.float8_e4m3fn``."""
    if isinstance(dtype, str):
        return dtype.lower() in _FP8_E4M3_NAMES
    dt = _dtype(dtype)
    return dt is not None and dt.itemsize == 1 and dt.name in _FP8_E4M3_NAMES


def float_kind(dtype: Any, *, raw_uint16: Optional[str] = None, raw_uint8: Optional[str] = None) -> Optional[str]:
    """Classify ``dtype`` as :data:`BFLOAT16`, :data:`FLOAT16`, :data:`FLOAT32` or :data:`FLOAT8_E4M3`.

    ``raw_uint16`` / ``raw_uint8``: the kind to report for plain ``uint16`` / ``uint8`` (raw bits), e.g.
    ``raw_uint16=BFLOAT16``; by default they are not floats. Returns ``None`` for anything else.
    """
    if isinstance(dtype, str):
        return _float_kind(dtype, raw_uint16, raw_uint8)
    return _memo(("kind", dtype, raw_uint16, raw_uint8), lambda: _float_kind(dtype, raw_uint16, raw_uint8))


def _float_kind(dtype: Any, raw_uint16: Optional[str], raw_uint8: Optional[str]) -> Optional[str]:
    if is_bfloat16(dtype):
        return BFLOAT16
    if is_float8_e4m3(dtype):
        return FLOAT8_E4M3
    dt = _dtype(dtype)
    if dt is None:
        return None
    if dt == np.float16:
        return FLOAT16
    if dt == np.float32:
        return FLOAT32
    if dt == np.uint16:
        return raw_uint16
    if dt == np.uint8:
        return raw_uint8
    return None


def raw_bits(a, xp=None):
    """View ``a`` (itemsize 1, 2, 4 or 8) as unsigned integers of the same size (a view, never a copy: a
    same-itemsize view keeps any strides). ``xp`` is accepted for symmetry and unused."""
    udt = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize]
    return a if a.dtype == udt else a.view(udt)


def bf16_bits_to_float32(xp, bits):
    """bfloat16 raw bits (``uint16`` array, or a bfloat16 array) -> ``float32`` array of the same shape, exact."""
    u = raw_bits(bits, xp).astype(np.uint32)
    u <<= np.uint32(16)
    return u.view(np.float32)


def float32_to_bf16_bits(xp, f):
    """``float32`` array -> bfloat16 raw bits (``uint16``), round to nearest, ties to even; NaN stays a quiet NaN,
    +-inf stay infinite, values beyond the bf16 range round to +-inf (as ``ml_dtypes`` does)."""
    f = xp.asarray(f, dtype=np.float32)
    u = xp.ascontiguousarray(f).view(np.uint32)
    lsb = (u >> np.uint32(16)) & np.uint32(1)
    rounded = (u + (lsb + np.uint32(0x7FFF))) >> np.uint32(16)     # wraps only for NaN patterns, handled below
    quiet_nan = (u >> np.uint32(16)) | np.uint32(0x0040)
    out = xp.where(xp.isnan(f), quiet_nan, rounded)
    return out.astype(np.uint16)


def to_float32(xp, a, kind: str):
    """Widen ``a`` of float kind ``kind`` (:data:`BFLOAT16` raw bits or bf16 dtype, :data:`FLOAT16`,
    :data:`FLOAT32`) to a ``float32`` array (exact for every kind)."""
    if kind == BFLOAT16:
        return bf16_bits_to_float32(xp, a)
    if kind in (FLOAT16, FLOAT32):
        return a.astype(np.float32)
    raise TypeError(f"to_float32: unsupported float kind {kind!r}")


def from_float32(xp, f, kind: str, out_dtype):
    """Narrow the ``float32`` array ``f`` to kind ``kind`` and return it with dtype ``out_dtype`` (for bf16,
    ``out_dtype`` is the caller's 2-byte dtype: a bfloat16 dtype or ``uint16`` for raw bits). Rounds to nearest
    even."""
    if kind == BFLOAT16:
        bits = float32_to_bf16_bits(xp, f)
        return bits if np.dtype(out_dtype) == np.uint16 else bits.view(out_dtype)
    if kind in (FLOAT16, FLOAT32):
        return f.astype(out_dtype)
    raise TypeError(f"from_float32: unsupported float kind {kind!r}")
