"""Symmetric buffer: one equally sized buffer per rank, every peer's buffer mapped by every rank.

``backend="cuda"``: a plain ``cudaMalloc`` per rank; CUDA IPC handles are all-gathered with mpi4py and peers are
opened with ``cudaIpcMemLazyEnablePeerAccess`` on the caller's current device (never our own handle). GPUs are
identified by UUID / PCI bus id, never by ordinal, since ordinals differ under ``CUDA_VISIBLE_DEVICES``.

``backend="host"``: an ``MPI.Win.Allocate_shared`` window on the node communicator; peers' bases from
``Win.Shared_query``. Same design, NumPy views, used by CPU workloads and CI.
"""
from __future__ import annotations

import socket
from typing import Optional

import numpy as np
from mpi4py import MPI

from . import _compat
from .errors import SymBufferClosedError

__all__ = ["SymBuffer", "resolve_backend"]

_BACKENDS = ("auto", "cuda", "host")


def resolve_backend(backend: str) -> str:
    """Map ``"auto"`` to ``"cuda"`` when CuPy imports and a GPU is visible, else ``"host"``."""
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "cuda" if _compat.cuda_available() else "host"
    if backend == "cuda" and not _compat.cuda_available():
        raise RuntimeError("backend='cuda' needs CuPy and a visible GPU (cupy.cuda.runtime.getDeviceCount() == 0 "
                           "or CuPy is not installed); use backend='host' or 'auto'")
    return backend


def _gpu_identity(device_id: int) -> dict:
    """UUID and PCI bus id of a CUDA device (stable across processes, unlike the ordinal)."""
    cp = _compat.cupy
    props = cp.cuda.runtime.getDeviceProperties(device_id)
    uuid = props.get("uuid", b"")
    if isinstance(uuid, (bytes, bytearray)):
        uuid = bytes(uuid).hex()
    try:
        bus = cp.cuda.Device(device_id).pci_bus_id
    except Exception:  # pragma: no cover
        bus = "%04x:%02x:%02x.0" % (props.get("pciDomainID", 0), props.get("pciBusID", 0), props.get("pciDeviceID", 0))
    return {"uuid": str(uuid), "pci_bus_id": str(bus).lower(), "sm_count": int(props.get("multiProcessorCount", 0))}


class SymBuffer:
    """One ``nbytes`` buffer per rank of ``comm``, with every peer's buffer mapped locally.

    Parameters
    ----------
    comm : mpi4py.MPI.Comm
        Intra-communicator whose ranks all live on one node (``MPI.COMM_TYPE_SHARED``); collective.
    nbytes : int
        Bytes per rank (>= 0), identical on every rank.
    backend : {"auto", "cuda", "host"}
        See module docstring. ``"auto"`` picks cuda when CuPy imports and a GPU is visible.

    Raises
    ------
    ValueError
        ``nbytes`` negative or different across ranks (the message names both sizes), or unknown ``backend``.
    NotImplementedError
        ``comm`` spans more than one node (scale-out is not implemented yet).
    RuntimeError
        ``backend="cuda"`` without CuPy or a GPU.

    Attributes
    ----------
    rank, world_size, backend, nbytes
    peer_ptrs : list of int
        (cuda) device address of every rank's buffer as mapped in this process; entry ``rank`` is our own pointer.
    peer_ptrs_device : cupy.ndarray
        (cuda) the same as a ``uint64 [world_size]`` device array, for kernels.
    gpu_identities : list of dict
        (cuda) ``{"uuid", "pci_bus_id", "sm_count", "hostname"}`` of every rank's GPU.
    """

    def __init__(self, comm: MPI.Comm, nbytes: int, *, backend: str = "auto"):
        if not isinstance(comm, MPI.Comm) or comm == MPI.COMM_NULL:
            raise TypeError(f"SymBuffer: comm must be an mpi4py intra-communicator, got {comm!r}")
        if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)) or int(nbytes) < 0:
            raise ValueError(f"SymBuffer: nbytes must be an int >= 0, got {nbytes!r}")
        nbytes = int(nbytes)
        self._closed = True
        self.backend = resolve_backend(backend)
        # Agree on the backend too: one rank on cuda and another on host would deadlock later.
        sizes = comm.allgather((nbytes, self.backend))
        for r, (n, b) in enumerate(sizes):
            if n != nbytes:
                raise ValueError(f"SymBuffer: nbytes must be the same on every rank: rank {comm.Get_rank()} asked "
                                 f"for {nbytes} bytes but rank {r} asked for {n} bytes")
            if b != self.backend:
                raise ValueError(f"SymBuffer: backend must resolve the same on every rank: rank {comm.Get_rank()} "
                                 f"has {self.backend!r} but rank {r} has {b!r}")
        node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
        node_size = node.Get_size()
        node.Free()
        if node_size != comm.Get_size():
            raise NotImplementedError(
                f"SymBuffer: comm spans more than one node ({comm.Get_size()} ranks, {node_size} on this node); "
                f"only single-node communicators are supported for now (multi-node scale-out comes later)")
        self.comm = comm.Dup()
        self.rank = self.comm.Get_rank()
        self.world_size = self.comm.Get_size()
        self.nbytes = nbytes
        self._win: Optional[MPI.Win] = None
        self._host_views: list = []
        self._local_ptr = 0
        self._opened: list = []
        self.peer_ptrs: list = []
        self.peer_ptrs_device = None
        self.gpu_identities: list = []
        try:
            if self.backend == "cuda":
                self._init_cuda()
            else:
                self._init_host()
        except BaseException:
            self.comm.Free()
            raise
        self._closed = False

    # ---- host ---------------------------------------------------------------------------------------------
    def _init_host(self) -> None:
        win = MPI.Win.Allocate_shared(self.nbytes, 1, comm=self.comm)
        win.Lock_all(MPI.MODE_NOCHECK)  # passive-target epoch, so Win.Sync() is a memory barrier
        self._win = win
        for r in range(self.world_size):
            buf, _ = win.Shared_query(r)
            view = np.frombuffer(buf, dtype=np.uint8) if self.nbytes else np.zeros(0, np.uint8)
            self._host_views.append(view[: self.nbytes])
        self._host_views[self.rank][:] = 0
        win.Sync()
        self.comm.Barrier()

    def sync(self) -> None:
        """Memory barrier over the window (host backend; ``MPI_Win_sync``). No-op on cuda."""
        if self._win is not None:
            self._win.Sync()

    def host_view(self, rank: int) -> np.ndarray:
        """(host) ``uint8 [nbytes]`` NumPy view of ``rank``'s buffer."""
        self._check_open()
        if self.backend != "host":
            raise ValueError("SymBuffer.host_view: only for backend='host'")
        if not 0 <= rank < self.world_size:
            raise IndexError(f"SymBuffer.host_view: rank {rank} not in [0, {self.world_size})")
        return self._host_views[rank]

    # ---- cuda ---------------------------------------------------------------------------------------------
    def _init_cuda(self) -> None:
        cp = _compat.cupy
        rt = cp.cuda.runtime
        self.device_id = cp.cuda.Device().id
        ident = _gpu_identity(self.device_id)
        ident["hostname"] = socket.gethostname()
        ptr = 0
        handle = b""
        if self.nbytes:
            ptr = rt.malloc(self.nbytes)  # a plain cudaMalloc: IPC handles cover whole allocations
            rt.memset(ptr, 0, self.nbytes)
            handle = bytes(rt.ipcGetMemHandle(ptr))
        self._local_ptr = ptr
        infos = self.comm.allgather((ident, handle))
        self.gpu_identities = [i for i, _ in infos]
        ptrs = []
        try:
            for r, (_, h) in enumerate(infos):
                if r == self.rank or not self.nbytes:
                    ptrs.append(ptr)  # never open our own handle
                else:
                    p = rt.ipcOpenMemHandle(h, rt.cudaIpcMemLazyEnablePeerAccess)
                    self._opened.append(p)
                    ptrs.append(p)
        except Exception as exc:
            raise RuntimeError(
                f"SymBuffer: rank {self.rank} (GPU {ident['pci_bus_id']}) could not open a peer's CUDA IPC handle: "
                f"{exc}. All ranks' GPUs must be peer-accessible (NVLink/PCIe P2P) or the same GPU") from exc
        self.peer_ptrs = ptrs
        self.peer_ptrs_device = cp.array(np.array(ptrs, dtype=np.uint64))
        cp.cuda.runtime.deviceSynchronize()
        self.comm.Barrier()

    @property
    def ranks_per_gpu(self) -> int:
        """(cuda) how many ranks of ``comm`` share this rank's GPU (by UUID/PCI bus id); 1 on host."""
        if self.backend != "cuda":
            return 1
        me = self.gpu_identities[self.rank]
        return sum(1 for i in self.gpu_identities
                   if (i["uuid"], i["pci_bus_id"], i["hostname"]) == (me["uuid"], me["pci_bus_id"], me["hostname"]))

    @property
    def local_ptr(self) -> int:
        """(cuda) device address of this rank's own buffer."""
        self._check_open()
        return self._local_ptr

    # ---- common -------------------------------------------------------------------------------------------
    def peer_view(self, rank: int, dtype=np.uint8, shape=None, offset_bytes: int = 0):
        """View of ``rank``'s buffer as a NumPy (host) or CuPy (cuda) array.

        Parameters
        ----------
        rank : int
            Peer rank in ``[0, world_size)``; our own rank gives our own buffer.
        dtype : dtype
            Element type of the view.
        shape : int or tuple, optional
            Default: as many elements as fit after ``offset_bytes``.
        offset_bytes : int
            Byte offset from the start of the buffer; a multiple of ``dtype``'s itemsize.

        Raises
        ------
        IndexError
            ``rank`` out of range, or the view does not fit in ``nbytes``.
        ValueError
            ``offset_bytes`` not aligned to the itemsize.
        """
        self._check_open()
        if not 0 <= rank < self.world_size:
            raise IndexError(f"SymBuffer.peer_view: rank {rank} not in [0, {self.world_size})")
        dtype = np.dtype(dtype)
        if offset_bytes < 0 or offset_bytes % dtype.itemsize:
            raise ValueError(f"SymBuffer.peer_view: offset_bytes ({offset_bytes}) must be >= 0 and a multiple of "
                             f"the itemsize ({dtype.itemsize})")
        if shape is None:
            shape = ((self.nbytes - offset_bytes) // dtype.itemsize,)
        elif isinstance(shape, (int, np.integer)):
            shape = (int(shape),)
        shape = tuple(int(s) for s in shape)
        if any(s < 0 for s in shape):
            raise ValueError(f"SymBuffer.peer_view: shape must not have negative sizes, got {shape}")
        size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if offset_bytes + size > self.nbytes:
            raise IndexError(f"SymBuffer.peer_view: {size} bytes at offset {offset_bytes} exceed nbytes={self.nbytes}")
        if self.backend == "host":
            return self._host_views[rank][offset_bytes: offset_bytes + size].view(dtype).reshape(shape)
        cp = _compat.cupy
        if size == 0:
            return cp.empty(shape, dtype)
        mem = cp.cuda.UnownedMemory(self.peer_ptrs[rank] + offset_bytes, size, self)
        return cp.ndarray(shape, dtype, memptr=cp.cuda.MemoryPointer(mem, 0))

    def _check_open(self) -> None:
        if self._closed:
            raise SymBufferClosedError("SymBuffer is closed (or failed to initialise); create a new one")

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Unmap peers and free the buffer; collective over ``comm``. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.backend == "cuda":
            rt = _compat.cupy.cuda.runtime
            rt.deviceSynchronize()
            self.comm.Barrier()  # nobody may still write into a buffer we are about to free
            for p in self._opened:
                rt.ipcCloseMemHandle(p)
            self._opened = []
            self.comm.Barrier()
            if self._local_ptr:
                rt.free(self._local_ptr)
            self._local_ptr = 0
            self.peer_ptrs_device = None
        else:
            self.comm.Barrier()
            self._host_views = []
            self._win.Unlock_all()
            self._win.Free()
            self._win = None
        self.comm.Free()

    def __enter__(self) -> "SymBuffer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"rank={self.rank}/{self.world_size}"
        return f"SymBuffer(backend={self.backend!r}, nbytes={self.nbytes}, {state})"
