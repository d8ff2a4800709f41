# Public face of cupy_symbuf.common.config (cupy_symbuf/common/config.py):
# keeps ``cupy_symbuf.config`` importable, every public name and
# attribute access to the rest. Config: the frozen, self-validating communicator configuration.
from .common.config import *  # noqa: F401,F403
from .common.config import __all__  # noqa: F401
from . import common as _layer

__doc__ = _layer.config.__doc__  # help() and docs/api.md show the module's own text


def __getattr__(name):
    return getattr(_layer.config, name)
