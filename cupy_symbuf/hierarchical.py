# Public face of cupy_symbuf.scaleout.hierarchical (cupy_symbuf/scaleout/hierarchical.py):
# keeps ``cupy_symbuf.hierarchical`` importable, every public name and
# attribute access to the rest. HierarchicalCommunicator: all-to-all across nodes in two steps.
from .scaleout.hierarchical import *  # noqa: F401,F403
from .scaleout.hierarchical import __all__  # noqa: F401
from . import scaleout as _layer

__doc__ = _layer.hierarchical.__doc__  # help() and docs/api.md show the module's own text


def __getattr__(name):
    return getattr(_layer.hierarchical, name)
