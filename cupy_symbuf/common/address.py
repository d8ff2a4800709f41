"""The address of an array's data, for every layer that hands addresses to the transports or compares them: a NumPy
array (host memory), a CuPy array (device memory), an address already taken (an int) or None (0)."""
from __future__ import annotations

import ctypes

import numpy as np

__all__ = ["address_of", "address_range"]

_CHAR, _addressof, _ndarray = ctypes.c_char, ctypes.addressof, np.ndarray


def address_of(a) -> int:
    """The address of the first element of ``a`` (its lowest byte when ``a`` is C-contiguous; for negative strides
    not the lowest): a NumPy array (host address), a CuPy array (device address, ``a.data.ptr``), an int (an address
    already taken: returned as is), or None (0). Any shape and dtype; an empty array gives its (unread) pointer.

    A NumPy array is tried first, and through a ctypes view of its buffer: for a writeable C-contiguous array of at
    least one byte of a dtype the buffer protocol can describe that costs a fraction of ``__array_interface__``
    (which builds a dict of the array's description: ~1 us hot and several right after a large copy has evicted
    the caches); a read-only, empty or non-contiguous array, or a dtype the buffer protocol cannot describe
    (bfloat16, fp8), falls back to ``__array_interface__``. The host engine takes several addresses per call, so
    this order keeps its repeat path cheap; the GPU path pays one ``isinstance`` before ``data.ptr``."""
    if isinstance(a, _ndarray):
        try:
            return _addressof(_CHAR.from_buffer(a))
        except (TypeError, ValueError, BufferError):  # read-only, empty, non-contiguous, or an undescribed dtype
            return a.__array_interface__["data"][0]
    if a is None:
        return 0
    if isinstance(a, int):
        return a
    return a.data.ptr


def address_range(a) -> tuple:
    """``(lo, hi)``: the bytes ``[lo, hi)`` a C-contiguous NumPy or CuPy array ``a`` occupies (``hi - lo`` is
    ``a.nbytes``), for overlap tests between buffers. (A strided CuPy array's span: :func:`checks.byte_extent`.)"""
    lo = address_of(a)
    return lo, lo + a.nbytes
