# Public face of cupy_symbuf.transport.tuning (cupy_symbuf/transport/tuning.py):
# keeps ``cupy_symbuf.tuning`` importable, every public name and
# attribute access to the rest. The tuning table: per machine and transport, the measured best channel layout.
from .transport.tuning import *  # noqa: F401,F403
from .transport.tuning import __all__  # noqa: F401
from . import transport as _layer

__doc__ = _layer.tuning.__doc__  # help() and docs/api.md show the module's own text


def __getattr__(name):
    return getattr(_layer.tuning, name)
