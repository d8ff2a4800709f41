# Public face of cupy_symbuf.moe.autograd (cupy_symbuf/moe/autograd.py):
# keeps ``cupy_symbuf.autograd`` importable, every public name and
# attribute access to the rest. PyTorch autograd functions over dispatch / combine / alltoall.
from .moe.autograd import *  # noqa: F401,F403
from .moe.autograd import __all__  # noqa: F401
from . import moe as _layer

__doc__ = _layer.autograd.__doc__  # help() and docs/api.md show the module's own text


def __getattr__(name):
    return getattr(_layer.autograd, name)
