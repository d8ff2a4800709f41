# Public face of cupy_symbuf.collectives.quant (cupy_symbuf/collectives/quant.py):
# keeps ``cupy_symbuf.quant`` importable, every public name and
# attribute access to the rest. Block quantisers (fp8 e4m3, int8) of the wire: host and GPU.
from .collectives.quant import *  # noqa: F401,F403
from .collectives.quant import __all__  # noqa: F401
from . import collectives as _layer

__doc__ = _layer.quant.__doc__  # help() and docs/api.md show the module's own text


def __getattr__(name):
    return getattr(_layer.quant, name)
