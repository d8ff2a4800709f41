# Public face of cupy_symbuf.transport.symbuffer (cupy_symbuf/transport/symbuffer.py):
# keeps ``cupy_symbuf.symbuffer`` importable, every public name and
# attribute access to the rest. SymBuffer: one equally sized buffer per rank, mapped by every peer.
from .transport.symbuffer import *  # noqa: F401,F403
from .transport.symbuffer import __all__  # noqa: F401
from . import transport as _layer

__doc__ = _layer.symbuffer.__doc__  # help() and docs/api.md show the module's own text


def __getattr__(name):
    return getattr(_layer.symbuffer, name)
