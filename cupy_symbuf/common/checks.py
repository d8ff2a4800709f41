"""The package's argument checks: integers, arrays (array module, device, dtype, shape, contiguity), counts, outputs.

Every check runs before any collective step, so a rejected call raises on the caller's rank, touches no ring, and
leaves the communicator usable. One message style: ``"<op>: argument '<name>' must <rule>, got <value>"`` (the
operation, the argument, the rule, what was passed). ``TypeError`` for a wrong type, array module, device or dtype;
``ValueError`` for a wrong value, range, shape or layout.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import numpy as np

from . import backend as _compat

__all__ = ["type_name", "check_int", "as_array", "check_array", "check_counts", "check_out"]


def type_name(obj) -> str:
    """``"<module>.<qualname>"`` of ``obj``'s type (e.g. ``"builtins.float"``, ``"numpy.ndarray"``), for messages."""
    t = type(obj)
    return f"{t.__module__}.{t.__qualname__}"


def check_int(op: str, name: str, value, *, minimum: Optional[int] = None, maximum: Optional[int] = None,
              what: str = "") -> int:
    """Return ``value`` as a Python int after checking it is an integer (Python or NumPy, not a bool) in
    ``[minimum, maximum]`` (both inclusive; None: unbounded on that side).

    ``what`` names the kind of value in the range message (e.g. ``"a rank"``: "must be a rank in [0, 3]").
    Raises ``TypeError`` (not an integer) or ``ValueError`` (out of range), naming ``op`` and ``name``.
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{op}: argument '{name}' must be an int, got {type_name(value)}")
    v = int(value)
    if (minimum is not None and v < minimum) or (maximum is not None and v > maximum):
        if minimum is not None and maximum is not None:
            rule = f"in [{minimum}, {maximum}]"
        else:
            rule = f">= {minimum}" if minimum is not None else f"<= {maximum}"
        raise ValueError(f"{op}: argument '{name}' must be {what + ' ' if what else ''}{rule}, got {v}")
    return v


def _from_dlpack(op: str, name: str, x, xp, where: str, wanted: str):
    """``x`` (not an array of ``xp``) imported zero-copy through DLPack into ``xp`` (NumPy or CuPy); ``TypeError``
    when it has no ``__dlpack__`` (a NumPy array offered to CuPy included: "must be {wanted} backend") or the import
    fails ("could not be imported through DLPack {where}")."""
    if not hasattr(x, "__dlpack__") or isinstance(x, np.ndarray):
        raise TypeError(f"{op}: argument '{name}' must be {wanted} backend, got {type(x).__module__}."
                        f"{type(x).__name__}")
    try:
        return xp.from_dlpack(x)
    except Exception as exc:
        raise TypeError(f"{op}: argument '{name}' could not be imported through DLPack {where} ({exc})") from exc


def as_array(op: str, name: str, x, backend: str, *, min_ndim: int = 1, ndim: Optional[int] = None,
             dtypes: Optional[Sequence] = None, contiguous: bool = True):
    """Return ``x`` as a NumPy (host) or CuPy (cuda) array after checking it.

    Objects with ``__dlpack__`` (PyTorch tensors) are imported zero-copy. Non-contiguous input is copied when
    ``contiguous``. Raises ``TypeError`` for a wrong array type/device or dtype, ``ValueError`` for a wrong ndim.
    """
    cp = _compat.cupy
    if backend == "cuda":
        if not _compat.is_cupy_array(x):
            x = _from_dlpack(op, name, x, cp, "onto the GPU", "a CuPy array (or a DLPack GPU tensor) on the cuda")
        # (the pointer's device id against the current device: what x.device.id and cupy.cuda.Device().id say,
        # without building two Device objects per call)
        dev = cp.cuda.runtime.getDevice()
        if x.data.device_id != dev:
            raise TypeError(f"{op}: argument '{name}' lives on GPU {x.data.device_id} but this communicator uses GPU "
                            f"{dev}")
    else:
        if _compat.is_cupy_array(x):
            raise TypeError(f"{op}: argument '{name}' is a CuPy array but this communicator uses the host backend; "
                            f"pass a NumPy array")
        if not isinstance(x, np.ndarray):
            x = _from_dlpack(op, name, x, np, "to the host", "a NumPy array (or a DLPack CPU tensor) on the host")
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
        if backend != "cuda":
            x = np.ascontiguousarray(x)
        elif x.ndim == 0 or not x._c_contiguous:  # (CuPy's flag read without a call: the hot path's usual case)
            x = cp.ascontiguousarray(x)
    return x


def check_array(op: str, name: str, a, backend: str, *,
                dims: Optional[Tuple[Tuple[str, Optional[int]], ...]] = None, dtypes: Optional[Sequence] = None,
                c_contiguous: bool = False):
    """Return ``a`` as an array of the backend (:func:`as_array`: NumPy on the host, CuPy on this GPU, DLPack
    tensors imported zero-copy; strides kept, never copied) after checking its shape, dtype and layout.

    ``dims``: one ``(label, size)`` per axis, ``size`` None when any size is allowed, e.g.
    ``(("num_tokens", 128), ("num_topk", None))``; ``dtypes``: the allowed dtypes (the first is the preferred one
    in the message); ``c_contiguous``: the array must be C-contiguous (it is written or read in place as whole rows).
    Raises ``TypeError`` (array module, device, dtype) or ``ValueError`` (number of axes, sizes, layout), naming
    ``op`` and ``name``.
    """
    a = as_array(op, name, a, backend, min_ndim=0, contiguous=False)
    if dims is not None:
        shape = a.shape
        if not (len(shape) == len(dims) and all(size is None or shape[i] == size
                                                for i, (_, size) in enumerate(dims))):
            _raise_dims(op, name, shape, dims)
    if dtypes is not None and a.dtype not in dtypes:
        allowed = " or ".join(str(np.dtype(d)) for d in dtypes)
        raise TypeError(f"{op}: argument '{name}' must be {allowed}, got dtype {a.dtype}")
    if c_contiguous and not a.flags.c_contiguous:
        raise ValueError(f"{op}: argument '{name}' must be C-contiguous (whole rows are read or written in place), "
                         f"got strides {a.strides}")
    return a


def _raise_dims(op: str, name: str, shape, dims) -> None:
    spec = "[" + ", ".join(label for label, _ in dims) + "]"
    if len(shape) != len(dims):
        raise ValueError(f"{op}: argument '{name}' must be {len(dims)}-D {spec}, got shape {tuple(shape)}")
    for axis, (label, size) in enumerate(dims):
        if size is not None and shape[axis] != size:
            raise ValueError(f"{op}: argument '{name}' must have shape {spec} with {label} = {size}, got shape "
                             f"{tuple(shape)} (axis {axis} is {shape[axis]})")


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


def byte_extent(a) -> tuple:
    """``[lo, hi)``: the device addresses a CuPy array's elements span, for any strides (negative too: ``a.data.ptr``
    is the first element's address, not the lowest); NumPy's ``may_share_memory`` bounds, for the GPU path."""
    lo = hi = a.data.ptr
    for n, st in zip(a.shape, a.strides):
        if st < 0:
            lo += (n - 1) * st
        else:
            hi += (n - 1) * st
    return lo, hi + a.itemsize


def check_out(op: str, out, backend: str, shape: tuple, dtype, *, inputs=()):
    """Validate a caller's output array ``out=`` (returned as the backend's array): the backend's module, exactly
    ``shape`` and ``dtype``, C-contiguous (the kernels write rows in place), and sharing no memory with any of
    ``inputs`` (a collective reads them while it writes). Raises ``TypeError`` (module, dtype) or ``ValueError``
    (shape, layout, overlap) naming ``out``."""
    out = as_array(op, "out", out, backend, min_ndim=0, contiguous=False)
    if out.shape != tuple(shape):  # (both array modules' shape is a tuple; a dtype compares with any dtype-like)
        raise ValueError(f"{op}: argument 'out' must have shape {tuple(shape)}, got {tuple(out.shape)}")
    if out.dtype != dtype:
        raise TypeError(f"{op}: argument 'out' must have dtype {np.dtype(dtype)}, got {out.dtype}")
    if not out.flags.c_contiguous:
        raise ValueError(f"{op}: argument 'out' must be C-contiguous (the transport writes whole rows into it)")
    if not getattr(out.flags, "writeable", True):  # CuPy arrays have no such flag (always writeable)
        raise ValueError(f"{op}: argument 'out' must be writeable (the received rows are written into it)")
    if out.size and backend != "cuda":  # NumPy's bounds test in C (the same extents test as below)
        for a in inputs:
            if a is not None and np.may_share_memory(out, a):
                raise ValueError(f"{op}: argument 'out' overlaps an input in memory; the collective reads its "
                                 f"inputs while it writes 'out'")
    elif out.size:
        lo = out.data.ptr
        hi = lo + out.nbytes
        for a in inputs:
            if a is None or not a.size:
                continue
            alo, ahi = (a.data.ptr, a.data.ptr + a.nbytes) if a.flags.c_contiguous else byte_extent(a)
            if alo < hi and lo < ahi:
                raise ValueError(f"{op}: argument 'out' overlaps an input in memory; the collective reads its "
                                 f"inputs while it writes 'out'")
    return out
