"""Optional CuPy: ``import cupy_symbuf`` works with no CuPy and no GPU."""
from __future__ import annotations

import functools

try:  # pragma: no cover - depends on the machine
    import cupy  # type: ignore
except Exception:  # ImportError, or a broken CUDA install
    cupy = None

__all__ = ["cupy", "cuda_available", "is_cupy_array", "array_module"]


@functools.lru_cache(maxsize=None)
def cuda_available() -> bool:
    """True when CuPy imports and at least one GPU is visible."""
    if cupy is None:
        return False
    try:
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def is_cupy_array(x) -> bool:
    return cupy is not None and isinstance(x, cupy.ndarray)


def array_module(backend: str):
    """``numpy`` for the host backend, ``cupy`` for the cuda backend."""
    if backend == "cuda":
        return cupy
    import numpy
    return numpy
