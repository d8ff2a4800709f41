"""Layer 4: mixture-of-experts all-to-all: normal mode (``get_dispatch_layout`` / ``dispatch`` / ``combine``, DeepEP
semantics; ``normal``, with its GPU half ``normal_cuda`` and its handle ``normal_handle``), its GPU kernels (``gpu``),
the argument checks of the MoE calls (``checks``, also used by the hierarchical dispatch), where tokens go
(``routing``), low-latency mode (``low_latency``) and PyTorch autograd (``autograd``).

This package is also the public face ``cupy_symbuf.moe``: it re-exports the normal mode's functions.
"""
from .normal import *  # noqa: F401,F403
from .normal import __all__  # noqa: F401
from . import normal as _normal


def __getattr__(name):
    return getattr(_normal, name)
