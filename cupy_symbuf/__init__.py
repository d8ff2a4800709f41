"""cupy_symbuf: fast all-to-all over a symmetric buffer of per-channel lock-free ring buffers.

``SymBuffer`` maps every rank's equally sized buffer (CUDA IPC on GPUs, an MPI shared-memory window on the host);
``Communicator`` runs ``alltoall``, ``alltoallv`` and MoE ``get_dispatch_layout``/``dispatch``/``combine``
(DeepEP semantics) over its channels. Importing needs neither CuPy nor a GPU.
"""
from . import layout
from .transport.streams import CollectiveEvent
from .communicator import Communicator
from .common.config import Config
from .common.errors import (SymBufferAbortedError, SymBufferClosedError, SymBufferError, SymBufferMismatchError,
                     SymBufferLeakWarning, SymBufferRejectedError, SymBufferTimeoutError)
from .wire.channel_layout import ChannelLayout
from .moe.low_latency import LowLatencyBuffer, LowLatencyHandle, LowLatencyRecvHook  # noqa: F401
from .transport.symbuffer import SymBuffer
from .collectives.delta import DeltaExchange
from .scaleout.hierarchical import HierarchicalCommunicator
from .transport.topology import Topology
from .diagnostics.info import info

from .common.version import __version__
__all__ = ["SymBuffer", "Communicator", "CollectiveEvent", "Config", "ChannelLayout", "layout", "SymBufferError",
           "SymBufferTimeoutError", "SymBufferClosedError", "SymBufferMismatchError", "SymBufferAbortedError",
           "SymBufferRejectedError", "SymBufferLeakWarning", "DeltaExchange", "HierarchicalCommunicator", "Topology", "info",
           "__version__"]


def __getattr__(name):
    if name == "bench_low_latency":  # the benchmark package imports mpi4py: loaded when first asked for
        from .bench.low_latency import bench_low_latency
        return bench_low_latency
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
