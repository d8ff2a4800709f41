# Public face of cupy_symbuf.common.dtypes (cupy_symbuf/common/dtypes.py):
# keeps ``cupy_symbuf.dtypes`` importable, every public name and
# attribute access to the rest. The dtype table (bfloat16, float8_e4m3 bits) shared by the host and GPU paths.
from .common.dtypes import *  # noqa: F401,F403
from .common.dtypes import __all__  # noqa: F401
from . import common as _layer

__doc__ = _layer.dtypes.__doc__  # help() and docs/api.md show the module's own text


def __getattr__(name):
    return getattr(_layer.dtypes, name)
