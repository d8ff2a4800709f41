"""One validation helper for every array argument: array module, device, dtype, shape, counts.

Every check runs before any collective step, so a rejected call raises on the caller's rank, touches no ring, and
leaves the communicator usable. Messages name the operation, the argument and the rule.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from . import backend as _compat

__all__ = ["as_array", "check_counts"]


def as_array(op: str, name: str, x, backend: str, *, min_ndim: int = 1, ndim: Optional[int] = None,
             dtypes: Optional[Sequence] = None, contiguous: bool = True):
    """Return ``x`` as a NumPy (host) or CuPy (cuda) array after checking it.

    Objects with ``__dlpack__`` (PyTorch tensors) are imported zero-copy. Non-contiguous input is copied when
    ``contiguous``. Raises ``TypeError`` for a wrong array type/device or dtype, ``ValueError`` for a wrong ndim.
    """
    cp = _compat.cupy
    if backend == "cuda":
        if not _compat.is_cupy_array(x):
            if hasattr(x, "__dlpack__") and not isinstance(x, np.ndarray):
                try:
                    x = cp.from_dlpack(x)
                except Exception as exc:
                    raise TypeError(f"{op}: argument '{name}' could not be imported through DLPack onto the GPU "
                                    f"({exc})") from exc
            else:
                raise TypeError(f"{op}: argument '{name}' must be a CuPy array (or a DLPack GPU tensor) on the cuda "
                                f"backend, got {type(x).__module__}.{type(x).__name__}")
        dev = cp.cuda.Device().id
        if x.device.id != dev:
            raise TypeError(f"{op}: argument '{name}' lives on GPU {x.device.id} but this communicator uses GPU {dev}")
    else:
        if _compat.is_cupy_array(x):
            raise TypeError(f"{op}: argument '{name}' is a CuPy array but this communicator uses the host backend; "
                            f"pass a NumPy array")
        if not isinstance(x, np.ndarray):
            if hasattr(x, "__dlpack__"):
                try:
                    x = np.from_dlpack(x)
                except Exception as exc:
                    raise TypeError(f"{op}: argument '{name}' could not be imported through DLPack to the host "
                                    f"({exc})") from exc
            else:
                raise TypeError(f"{op}: argument '{name}' must be a NumPy array (or a DLPack CPU tensor) on the host "
                                f"backend, got {type(x).__module__}.{type(x).__name__}")
    if x.dtype.hasobject:
        raise TypeError(f"{op}: argument '{name}' has dtype {x.dtype}, which holds Python object references; only "
                        f"plain-data dtypes can be moved between ranks")
    if ndim is not None and x.ndim != ndim:
        raise ValueError(f"{op}: argument '{name}' must have {ndim} dimensions, got shape {tuple(x.shape)}")
    if x.ndim < min_ndim:
        raise ValueError(f"{op}: argument '{name}' must have at least {min_ndim} dimension(s), got shape "
                         f"{tuple(x.shape)}")
    if dtypes is not None and np.dtype(x.dtype) not in [np.dtype(d) for d in dtypes]:
        raise TypeError(f"{op}: argument '{name}' must have dtype in {[str(np.dtype(d)) for d in dtypes]}, "
                        f"got {x.dtype}")
    if contiguous:  # after the ndim checks: ascontiguousarray turns a 0-d array into 1-d
        x = cp.ascontiguousarray(x) if backend == "cuda" else np.ascontiguousarray(x)
    return x


def check_counts(op: str, name: str, counts, world_size: int, total: Optional[int] = None) -> np.ndarray:
    """Validate per-rank row counts: ``[world_size]`` integers >= 0 summing to ``total`` (if given).

    Returns them as a NumPy int64 array (a CuPy array is copied to the host). Raises ``TypeError``/``ValueError``.
    """
    if _compat.is_cupy_array(counts):
        counts = counts.get()
    elif hasattr(counts, "__dlpack__") and not isinstance(counts, np.ndarray):
        try:
            counts = np.from_dlpack(counts)
        except Exception:
            counts = np.asarray(counts.cpu()) if hasattr(counts, "cpu") else counts
    arr = np.asarray(counts)
    if arr.dtype == object or not (np.issubdtype(arr.dtype, np.integer) or arr.size == 0):
        raise TypeError(f"{op}: argument '{name}' must hold integers, got dtype {arr.dtype}")
    if arr.shape != (world_size,):
        raise ValueError(f"{op}: argument '{name}' must have shape ({world_size},) (one count per rank), got "
                         f"{arr.shape}")
    if arr.size and (arr.min() < 0 or int(arr.max()) > np.iinfo(np.int64).max):
        raise ValueError(f"{op}: argument '{name}' must be >= 0 and fit in int64, got {arr.tolist()}")
    arr = arr.astype(np.int64)
    # the int64 sum may wrap (e.g. [0, n + 2, 2**63 - 1, 2**63 - 1]): sum exactly unless it cannot overflow
    exact = int(arr.sum()) if not arr.size or int(arr.max()) <= (1 << 62) // arr.size else sum(arr.tolist())
    if exact >= 1 << 62:
        raise ValueError(f"{op}: argument '{name}' sums to {exact} rows, more than the transport can address "
                         f"(2**62)")
    if total is not None and exact != total:
        raise ValueError(f"{op}: argument '{name}' must sum to the number of rows ({total}), got sum {exact}")
    return arr


def check_out(op: str, out, backend: str, shape: tuple, dtype, *, inputs=()):
    """Validate a caller's output array ``out=`` (returned as the backend's array): the backend's module, exactly
    ``shape`` and ``dtype``, C-contiguous (the kernels write rows in place), and sharing no memory with any of
    ``inputs`` (a collective reads them while it writes). Raises ``TypeError`` (module, dtype) or ``ValueError``
    (shape, layout, overlap) naming ``out``."""
    out = as_array(op, "out", out, backend, min_ndim=0, contiguous=False)
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"{op}: argument 'out' must have shape {tuple(shape)}, got {tuple(out.shape)}")
    if np.dtype(out.dtype) != np.dtype(dtype):
        raise TypeError(f"{op}: argument 'out' must have dtype {np.dtype(dtype)}, got {out.dtype}")
    if not out.flags.c_contiguous:
        raise ValueError(f"{op}: argument 'out' must be C-contiguous (the transport writes whole rows into it)")
    if not getattr(out.flags, "writeable", True):  # CuPy arrays have no such flag (always writeable)
        raise ValueError(f"{op}: argument 'out' must be writeable (the received rows are written into it)")
    if out.size:
        lo = out.data.ptr if backend == "cuda" else out.ctypes.data
        hi = lo + out.nbytes
        for a in inputs:
            if a is None or not a.size:
                continue
            alo = a.data.ptr if backend == "cuda" else a.ctypes.data
            ahi = alo + (a.nbytes if a.flags.c_contiguous else (a.shape[0] - 1) * abs(a.strides[0]) + a.nbytes)
            if alo < hi and lo < ahi:
                raise ValueError(f"{op}: argument 'out' overlaps an input in memory; the collective reads its "
                                 f"inputs while it writes 'out'")
    return out
