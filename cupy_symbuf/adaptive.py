# Public face of cupy_symbuf.transport.adaptive (cupy_symbuf/transport/adaptive.py):
# keeps ``cupy_symbuf.adaptive`` importable, every public name and
# attribute access to the rest. Adaptive channels: per-peer work sharing of the ring kernel.
from .transport.adaptive import *  # noqa: F401,F403
from .transport.adaptive import __all__  # noqa: F401
from . import transport as _layer

__doc__ = _layer.adaptive.__doc__  # help() and docs/api.md show the module's own text


def __getattr__(name):
    return getattr(_layer.adaptive, name)
