# Public face of cupy_symbuf.common.errors (cupy_symbuf/common/errors.py):
# keeps ``cupy_symbuf.errors`` importable, every public name and
# attribute access to the rest. The exception hierarchy every collective raises.
from .common.errors import *  # noqa: F401,F403
from .common.errors import __all__  # noqa: F401
from . import common as _layer

__doc__ = _layer.errors.__doc__  # help() and docs/api.md show the module's own text


def __getattr__(name):
    return getattr(_layer.errors, name)
