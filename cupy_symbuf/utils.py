"""Small helpers for programs that use cupy_symbuf."""
from __future__ import annotations

import os

from .common import backend as _compat

__all__ = ["select_device"]


def select_device(comm=None) -> int:
    """Make GPU ``local_rank % device_count`` current for this rank (CuPy), and return its ordinal.

    ``comm``: an mpi4py communicator, a ``torch.distributed`` process group, or None (torch's default group when
    ``torch.distributed`` is initialised, else ``MPI.COMM_WORLD``). ``local_rank`` is the rank within the node:
    ``MPI.COMM_TYPE_SHARED`` for MPI; for torch, ``LOCAL_RANK`` from the environment (torchrun sets it) when the
    group is the default one, else the rank among the group's ranks of this host. With more ranks than GPUs, ranks
    share GPUs round-robin (run MPS then). Returns -1 and does nothing when no GPU is visible.
    """
    if not _compat.cuda_available():
        return -1
    cp = _compat.cupy
    from .transport.bootstrap import MpiBootstrap, as_bootstrap
    boot = as_bootstrap(comm)
    if isinstance(boot, MpiBootstrap):
        from mpi4py import MPI
        c = boot.comm
        local = c.Split_type(MPI.COMM_TYPE_SHARED, key=c.Get_rank())
        local_rank = local.Get_rank()
        local.Free()
    elif comm is None and os.environ.get("LOCAL_RANK", "").isdigit():
        local_rank = int(os.environ["LOCAL_RANK"])
    else:
        node = boot.split_node()
        local_rank = node.rank
        node.free()
    ordinal = local_rank % cp.cuda.runtime.getDeviceCount()
    cp.cuda.Device(ordinal).use()
    return ordinal
