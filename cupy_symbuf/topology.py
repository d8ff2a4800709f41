# Public face of cupy_symbuf.transport.topology (cupy_symbuf/transport/topology.py):
# keeps ``cupy_symbuf.topology`` importable, every public name and
# attribute access to the rest. Topology discovery: which ranks share a GPU, a node, NVLink.
from .transport.topology import *  # noqa: F401,F403
from .transport.topology import __all__  # noqa: F401
from . import transport as _layer

__doc__ = _layer.topology.__doc__  # help() and docs/api.md show the module's own text


def __getattr__(name):
    return getattr(_layer.topology, name)
