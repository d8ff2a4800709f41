# Public face of cupy_symbuf.transport.symmetric (cupy_symbuf/transport/symmetric.py):
# keeps ``cupy_symbuf.symmetric`` importable, every public name and
# attribute access to the rest. Symmetric arrays: collective allocations every peer can address.
from .transport.symmetric import *  # noqa: F401,F403
from .transport.symmetric import __all__  # noqa: F401
from . import transport as _layer

__doc__ = _layer.symmetric.__doc__  # help() and docs/api.md show the module's own text


def __getattr__(name):
    return getattr(_layer.symmetric, name)
