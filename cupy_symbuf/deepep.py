# Public face of cupy_symbuf.compat.deepep (cupy_symbuf/compat/deepep.py):
# keeps ``cupy_symbuf.deepep`` importable, every public name and
# attribute access to the rest. A DeepEP-shaped module (Buffer, Config, EventOverlap) over cupy_symbuf.
from .compat.deepep import *  # noqa: F401,F403
from .compat.deepep import __all__  # noqa: F401
from . import compat as _layer

__doc__ = _layer.deepep.__doc__  # help() and docs/api.md show the module's own text


def __getattr__(name):
    return getattr(_layer.deepep, name)
