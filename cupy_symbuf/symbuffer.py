"""Symmetric buffer: one equally sized buffer per rank, every peer's buffer mapped by every rank.

``backend="cuda"``: a plain ``cudaMalloc`` per rank; CUDA IPC handles are all-gathered with mpi4py and peers are
opened with ``cudaIpcMemLazyEnablePeerAccess`` on the caller's current device (never our own handle). GPUs are
identified by UUID / PCI bus id, never by ordinal, since ordinals differ under ``CUDA_VISIBLE_DEVICES``.

``backend="host"``: an ``MPI.Win.Allocate_shared`` window on the node communicator; peers' bases from
``Win.Shared_query``. Same design, NumPy views, used by CPU workloads and CI.
"""
from __future__ import annotations

import os
import socket
import sys
import warnings
from typing import Optional

import numpy as np
from mpi4py import MPI

from . import _agree, _compat, _lifecycle
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
    name = props.get("name", b"")
    name = bytes(name).split(b"\0")[0].decode(errors="replace") if isinstance(name, (bytes, bytearray)) else str(name)
    return {"uuid": str(uuid), "pci_bus_id": str(bus).lower(), "sm_count": int(props.get("multiProcessorCount", 0)),
            "name": name}


def _host_available_bytes() -> tuple:
    """``(bytes, what)``: memory a shared-memory window of the node can still take: the smaller of the free space
    of ``/dev/shm`` and ``MemAvailable`` of ``/proc/meminfo`` (either missing: the other; both: ``(None, ...)``)."""
    found = []
    try:
        st = os.statvfs("/dev/shm")
        found.append((st.f_bavail * st.f_frsize, "free in /dev/shm"))
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append((int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"))
                    break
    except (OSError, ValueError, IndexError):
        pass
    if not found:
        return None, "unknown"
    return min(found)


def _gpu_free_bytes() -> tuple:
    """``(bytes, what)``: free memory of the current GPU (``cudaMemGetInfo``), shared by the ranks on it."""
    free, _total = _compat.cupy.cuda.runtime.memGetInfo()
    return int(free), f"free on GPU {_compat.cupy.cuda.Device().id} (cudaMemGetInfo)"


def _memory_verdict(nbytes: int, sharing: int, backend: str) -> Optional[str]:
    """``None`` when ``sharing`` buffers of ``nbytes`` fit in what is free (host: the node's shared memory for all
    ranks; cuda: the GPU's free memory for the ranks on it), else the error text naming needed and available."""
    if not nbytes:
        return None
    try:
        available, what = _gpu_free_bytes() if backend == "cuda" else _host_available_bytes()
    except Exception:  # pragma: no cover - a probe that fails does not block allocation
        return None
    needed = sharing * nbytes
    if available is None or needed <= available:
        return None
    where = "ranks on this node" if backend == "host" else "ranks on this GPU"
    return (f"the symmetric buffers need {needed} bytes ({sharing} {where} x {nbytes} bytes, "
            f"{needed / 2**30:.2f} GiB) but only {available} bytes ({available / 2**30:.2f} GiB) are available "
            f"({what}); reduce Config.num_slots, chunk_bytes, num_sms or max_notify_ints")


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
    timeout_s : float, optional
        Bound on construction's and ``close()``'s waits for the peers (default ``Config().timeout_s``): a peer that
        never arrives gives :class:`~cupy_symbuf.SymBufferTimeoutError` naming it instead of a hang.

    Raises
    ------
    ValueError
        ``nbytes`` negative or different across ranks (the message names both sizes), unknown ``backend``, or the
        buffers do not fit in free memory (bytes needed and available named); raised on every rank alike.
    SymBufferTimeoutError
        A peer did not construct within ``timeout_s`` (role "construction", ``missing`` lists the ranks).
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

    Notes
    -----
    Freeing is collective, so a SymBuffer garbage-collected unclosed is not freed: it warns (``ResourceWarning``)
    and its memory stays allocated. Buffers still open at interpreter exit are closed (bounded) by an ``atexit``
    handler, newest first. After ``os.fork()`` the child never closes or frees the parent's buffers.
    """

    _closed = True  # until construction completes (also seen by __del__ of a half-built object)
    _pid = -1

    def __init__(self, comm: MPI.Comm, nbytes: int, *, backend: str = "auto", timeout_s: Optional[float] = None,
                 _managed: bool = False):
        if not isinstance(comm, MPI.Comm) or comm == MPI.COMM_NULL:
            raise TypeError(f"SymBuffer: comm must be an mpi4py intra-communicator, got {comm!r}")
        if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)) or int(nbytes) < 0:
            raise ValueError(f"SymBuffer: nbytes must be an int >= 0, got {nbytes!r}")
        nbytes = int(nbytes)
        if timeout_s is None:
            from .config import Config
            timeout_s = Config().timeout_s
        self.timeout_s = float(timeout_s)
        self._closed = True
        self._managed = _managed  # owned by a Communicator, which closes it and warns for it
        self.backend = resolve_backend(backend)
        # Agree on size and backend (one rank on cuda and another on host would deadlock later), bounded: a peer
        # that never constructs gives a timeout naming it. On the host the memory verdict travels with them.
        me = comm.Get_rank()
        verdict = None
        if self.backend == "host":
            verdict = _memory_verdict(nbytes, comm.Get_size(), "host")
        sizes = _agree.exchange_all(comm, (nbytes, self.backend, verdict), self.timeout_s,
                                    "SymBuffer construction")
        for r, (n, b, _) in enumerate(sizes):
            if n != nbytes:
                raise ValueError(f"SymBuffer: nbytes must be the same on every rank: rank {me} asked "
                                 f"for {nbytes} bytes but rank {r} asked for {n} bytes")
            if b != self.backend:
                raise ValueError(f"SymBuffer: backend must resolve the same on every rank: rank {me} "
                                 f"has {self.backend!r} but rank {r} has {b!r}")
        _agree.raise_if_any_failed([v for _, _, v in sizes], "SymBuffer")
        # every rank is here: the blocking collectives below complete
        node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
        node_size = node.Get_size()
        node.Free()
        if node_size != comm.Get_size():
            raise NotImplementedError(
                f"SymBuffer: comm spans more than one node ({comm.Get_size()} ranks, {node_size} on this node); "
                f"only single-node communicators are supported for now (multi-node scale-out comes later)")
        self.comm = comm.Dup()
        _lifecycle.count("comm", 1)
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
            self._free_comm()
            raise
        self._pid = os.getpid()
        self._closed = False
        self._token = None if _managed else _lifecycle.register(self)

    def _free_comm(self) -> None:
        if self.comm is not None:
            self.comm.Free()
            self.comm = None
            _lifecycle.count("comm", -1)

    # ---- host ---------------------------------------------------------------------------------------------
    def _init_host(self) -> None:
        win = MPI.Win.Allocate_shared(self.nbytes, 1, comm=self.comm)
        _lifecycle.count("win", 1)
        win.Lock_all(MPI.MODE_NOCHECK)  # passive-target epoch, so Win.Sync() is a memory barrier
        self._win = win
        for r in range(self.world_size):
            buf, _ = win.Shared_query(r)
            view = np.frombuffer(buf, dtype=np.uint8) if self.nbytes else np.zeros(0, np.uint8)
            self._host_views.append(view[: self.nbytes])
        self._host_views[self.rank][:] = 0
        win.Sync()
        _agree.barrier(self.comm, self.timeout_s, "SymBuffer construction (zeroed)", role="construction")

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
        idents = _agree.exchange_all(self.comm, ident, self.timeout_s, "SymBuffer construction (GPUs)")
        key = (ident["uuid"], ident["pci_bus_id"], ident["hostname"])
        sharing = sum(1 for i in idents if (i["uuid"], i["pci_bus_id"], i["hostname"]) == key)
        _agree.raise_if_any_failed(
            _agree.exchange_all(self.comm, _memory_verdict(self.nbytes, sharing, "cuda"), self.timeout_s,
                                "SymBuffer construction (memory)"), "SymBuffer")
        ptr = 0
        handle = b""
        err = None
        if self.nbytes:
            try:
                ptr = rt.malloc(self.nbytes)  # a plain cudaMalloc: IPC handles cover whole allocations
                rt.memset(ptr, 0, self.nbytes)
                handle = bytes(rt.ipcGetMemHandle(ptr))
            except Exception as exc:  # tell the peers instead of leaving them waiting
                err = f"cudaMalloc/IPC handle of {self.nbytes} bytes failed: {exc}"
        self._local_ptr = ptr
        infos = _agree.exchange_all(self.comm, (ident, handle, err), self.timeout_s, "SymBuffer construction (IPC)")
        try:
            _agree.raise_if_any_failed([e for _, _, e in infos], "SymBuffer", RuntimeError)
        except RuntimeError:
            if ptr:
                rt.free(ptr)
            self._local_ptr = 0
            raise
        self.gpu_identities = [i for i, _, _ in infos]
        ptrs = []
        try:
            for r, (_, h, _) in enumerate(infos):
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
        _agree.barrier(self.comm, self.timeout_s, "SymBuffer construction (mapped)", role="construction")

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
        """True once :meth:`close` ran (or construction failed)."""
        return self._closed

    def close(self) -> None:
        """Unmap peers and free the buffer; collective over ``comm``, bounded by ``timeout_s``. Idempotent.

        A peer that never closes (failed, exited) gives :class:`~cupy_symbuf.SymBufferTimeoutError` (role "close",
        ``missing`` names the ranks) within ``timeout_s``; this rank's buffer then stays allocated (a peer may still
        write into it) and the SymBuffer is closed all the same. In a process forked from the one that made the
        buffer, close() only forgets it (nothing is freed: it belongs to the parent).
        """
        if self._closed:
            return
        self._closed = True
        _lifecycle.unregister(getattr(self, "_token", None))
        if os.getpid() != self._pid:
            return
        what = "SymBuffer.close"
        slow = self._slow_note()
        if self.backend == "cuda":
            rt = _compat.cupy.cuda.runtime
            try:
                rt.deviceSynchronize()
            finally:
                # nobody may still write into a buffer we are about to free (raises when a peer never comes: the
                # buffer is then left allocated, our mappings of the peers are still closed below)
                try:
                    _agree.barrier(self.comm, self.timeout_s, what, on_slow=slow)
                finally:
                    for p in self._opened:
                        rt.ipcCloseMemHandle(p)
                    self._opened = []
                    self.peer_ptrs_device = None
            _agree.barrier(self.comm, self.timeout_s, what + " (unmapped)")
            if self._local_ptr:
                rt.free(self._local_ptr)
            self._local_ptr = 0
        else:
            _agree.barrier(self.comm, self.timeout_s, what, on_slow=slow)  # raises: window, comm left allocated
            self._host_views = []
            self._win.Unlock_all()
            self._win.Free()  # collective, but every rank is here now
            self._win = None
            _lifecycle.count("win", -1)
        self._free_comm()

    def _slow_note(self):
        """When close() runs while an exception propagates (``with`` exit, ``finally``) and the peers are slow to
        close, say so at once: a peer's failure may end the job (``MPI.Abort``) before that exception is printed."""
        pending = sys.exc_info()[1]
        if pending is None:
            return None
        rank, t = self.rank, self.timeout_s

        def note(missing):
            _lifecycle.say(rank, f"close() waits (up to {t:g} s) for rank(s) {', '.join(map(str, missing))} while "
                                 f"this exception propagates: {type(pending).__name__}: {pending}")
        return (0.5, note)

    def __del__(self):
        if self._closed or self._pid != os.getpid() or getattr(self, "_managed", False):
            return
        try:
            warnings.warn(f"unclosed {self!r}: freeing is collective, so it stays allocated until exit (call "
                          f"close() on every rank, or use 'with')", ResourceWarning, source=self)
        except Exception:  # pragma: no cover - interpreter shutting down
            pass

    def __enter__(self) -> "SymBuffer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"rank={self.rank}/{self.world_size}"
        return f"SymBuffer(backend={self.backend!r}, nbytes={self.nbytes}, {state})"
