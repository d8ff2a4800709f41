# Public face of cupy_symbuf.collectives.delta (cupy_symbuf/collectives/delta.py):
# keeps ``cupy_symbuf.delta`` importable, every public name and
# attribute access to the rest. DeltaExchange: repeated alltoall sent as quantised differences.
from .collectives.delta import *  # noqa: F401,F403
from .collectives.delta import __all__  # noqa: F401
from . import collectives as _layer

__doc__ = _layer.delta.__doc__  # help() and docs/api.md show the module's own text


def __getattr__(name):
    return getattr(_layer.delta, name)
