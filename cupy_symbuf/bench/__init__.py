"""Layer 8: the benchmark (``python -m cupy_symbuf.bench``): the driver (``driver``) and one module per op.

This package is also the public face ``cupy_symbuf.bench``: it re-exports the driver's names.
"""
from .driver import *  # noqa: F401,F403
from . import driver as _driver


def __getattr__(name):
    return getattr(_driver, name)
