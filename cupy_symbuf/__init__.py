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
from .moe.low_latency import LowLatencyBuffer, LowLatencyHandle, LowLatencyRecvHook, bench_low_latency  # noqa: F401
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
