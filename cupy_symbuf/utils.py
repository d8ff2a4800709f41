"""Small helpers for programs that use cupy_symbuf."""
from __future__ import annotations

from mpi4py import MPI

from .common import backend as _compat

__all__ = ["select_device"]


def select_device(comm: MPI.Comm = MPI.COMM_WORLD) -> int:
    """Make GPU ``local_rank % device_count`` current for this rank (CuPy), and return its ordinal.

    ``local_rank`` is the rank within the node (``MPI.COMM_TYPE_SHARED``). With more ranks than GPUs, ranks share
    GPUs round-robin (run MPS then). Returns -1 and does nothing when no GPU is visible.
    """
    if not _compat.cuda_available():
        return -1
    cp = _compat.cupy
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    ordinal = local.Get_rank() % cp.cuda.runtime.getDeviceCount()
    local.Free()
    cp.cuda.Device(ordinal).use()
    return ordinal
