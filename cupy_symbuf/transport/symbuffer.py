"""Symmetric buffer: one equally sized buffer per rank, every peer's buffer mapped by every rank.

``backend="cuda"``: a plain ``cudaMalloc`` per rank; CUDA IPC handles are all-gathered with mpi4py and peers are
opened with ``cudaIpcMemLazyEnablePeerAccess`` on the caller's current device (never our own handle). GPUs are
identified by UUID / PCI bus id, never by ordinal, since ordinals differ under ``CUDA_VISIBLE_DEVICES``.

``backend="cuda"``, ``transport="staged"`` (chosen by ``"auto"`` when some pair of the GPUs has no peer access, or a
peer's IPC handle does not open): the whole symmetric buffer in host memory, the MPI shared-memory window of the
host backend, pinned and mapped into this rank's GPU with ``cudaHostRegister(Mapped | Portable)``; each rank's
device address of every rank's part is the mapped address of that part (``cudaHostGetDevicePointer``). The kernels
run unchanged on these addresses (their ``.sys``-scope release / acquire orders the stores and loads over PCIe);
every byte crosses PCIe twice. :func:`choose_transport` is the decision.

``backend="host"``: an ``MPI.Win.Allocate_shared`` window on the node communicator; peers' bases from
``Win.Shared_query``. Same design, NumPy views, used by CPU workloads and CI. Over a bootstrap that is not MPI (a
``torch.distributed`` group), the window of the host backend and of the staged transport is POSIX shared memory
named through the bootstrap (:class:`~cupy_symbuf.transport.shm.PosixSharedWindow`), each rank's part page-aligned.
"""
from __future__ import annotations

import mmap
import os
import socket
import sys
import warnings
from typing import Optional

import numpy as np

from . import agree as _agree
from ..common import backend as _compat
from . import lifecycle as _lifecycle
from .bootstrap import as_bootstrap
from ..common.log import logger
from ..common.config import TRANSPORTS
from ..common.errors import SymBufferClosedError, SymBufferError

__all__ = ["SymBuffer", "resolve_backend", "choose_transport", "TRANSPORTS"]

_BACKENDS = ("auto", "cuda", "host")


def _mpi():
    """mpi4py's MPI module, imported where a window is allocated on an MPI communicator (mpi4py is optional)."""
    from mpi4py import MPI
    return MPI
#: cudaHostRegisterPortable | cudaHostRegisterMapped (driver_types.h; CuPy names no constants for them)
_HOST_REGISTER_FLAGS = 0x01 | 0x02
_PAGE = mmap.PAGESIZE


def choose_transport(requested: str, topology=None) -> tuple:
    """Where the cuda SymBuffer of ``topology``'s ranks lives: ``("ipc" | "staged", reason)``. Local, no
    communication: every rank holds the same records, so every rank computes the same answer.

    Parameters
    ----------
    requested : {"auto", "ipc", "staged"}
        ``Config.transport`` (the same on every rank).
    topology : Topology, optional
        The ranks' :class:`~cupy_symbuf.Topology` (cuda backend), from which the link of every pair of ranks is
        read. None: nothing is known about the pairs (``"auto"`` then tries CUDA IPC).

    Returns
    -------
    transport : str
        ``"staged"`` when requested, or when ``requested == "auto"`` and some pair of ranks has link kind
        ``"none"`` (no peer access, in either rank's answer); else ``"ipc"`` (pairs of kind ``"unknown"``, e.g. a
        peer GPU this process cannot see, are tried through IPC: a handle that then fails to open makes the
        SymBuffer fall back to ``"staged"``).
    reason : str
        One line saying why (the pairs without peer access, named by rank and PCI bus id).

    Raises
    ------
    ValueError
        ``requested`` not one of :data:`TRANSPORTS`, or ``topology`` not of the cuda backend.
    RuntimeError
        ``requested == "ipc"`` and some pair has no peer access.
    NotImplementedError
        Two ranks on different nodes (neither CUDA IPC nor the staged shared-memory window spans nodes).
    """
    if requested not in TRANSPORTS:
        raise ValueError(f"choose_transport: requested must be one of {TRANSPORTS}, got {requested!r}")
    if topology is not None and topology.backend != "cuda":
        raise ValueError(f"choose_transport: topology must be of the cuda backend, got {topology.backend!r}")
    W = 0 if topology is None else topology.world_size
    pairs = [(a, b) for a in range(W) for b in range(a + 1, W)]
    for a, b in pairs:
        if topology.node_of(a) != topology.node_of(b):
            raise NotImplementedError(
                f"SymBuffer: ranks {a} and {b} are on different nodes ({topology.host_of(a)}, {topology.host_of(b)}): "
                f"neither CUDA IPC nor the staged transport's shared-memory window spans nodes (multi-node "
                f"scale-out comes later)")
    if requested == "staged":
        return "staged", "requested (Config.transport='staged' / CUPY_SYMBUF_TRANSPORT=staged)"
    lacking, unknown, kinds = [], 0, {}
    for a, b in pairs:
        both = {topology.link(a, b).kind, topology.link(b, a).kind}
        if "none" in both:
            lacking.append((a, b))
        elif both == {"unknown"}:
            unknown += 1
        k = topology.link(a, b).kind
        kinds[k] = kinds.get(k, 0) + 1
    if lacking:
        def gpu(r):
            g = topology.gpu_of(r)
            return g["pci_bus_id"] if g else "?"
        named = ", ".join(f"ranks {a} and {b} (GPUs {gpu(a)}, {gpu(b)})" for a, b in lacking[:4])
        more = f" and {len(lacking) - 4} more pairs" if len(lacking) > 4 else ""
        text = f"no peer access between {named}{more}"
        if requested == "ipc":
            raise RuntimeError(f"SymBuffer: Config.transport='ipc' but there is {text}: CUDA IPC needs every pair "
                               f"of GPUs peer-accessible (NVLink / PCIe P2P) or the same GPU; transport='auto' or "
                               f"'staged' puts the buffer in host memory instead")
        return "staged", text
    if requested == "ipc":
        return "ipc", "requested (Config.transport='ipc')"
    if topology is None:
        return "ipc", "peer access not known: CUDA IPC tried (staged if a handle does not open)"
    if unknown:
        return "ipc", (f"peer access of {unknown} pair{'s' if unknown > 1 else ''} unknown (a peer GPU this process "
                       f"cannot see): CUDA IPC tried (staged if a handle does not open)")
    seen = ", ".join(f"{k} {kinds[k]}" for k in sorted(kinds) if k != "unknown") or "a single rank"
    return "ipc", f"every pair of GPUs is the same GPU or peer-accessible (pairs by link: {seen})"


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


def gpu_identity(device_id: int) -> dict:
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


def _host_device_pointer(rt, host_ptr: int) -> int:
    """The device address of registered, mapped host memory at ``host_ptr`` (``cudaHostGetDevicePointer``; CuPy
    without it: the ``devicePointer`` of ``cudaPointerGetAttributes``, the same address)."""
    get = getattr(rt, "hostGetDevicePointer", None)
    if get is not None:
        dev = int(get(host_ptr, 0))
    else:
        dev = int(rt.pointerGetAttributes(host_ptr).devicePointer)
    if not dev:
        raise RuntimeError(f"no device pointer for the registered host memory at {host_ptr:#x}")
    return dev


def _register_ranges(rt, ranges: list) -> list:
    """``cudaHostRegister(Portable | Mapped)`` the pages of every ``(address, bytes)`` of ``ranges`` once (ranges
    sharing a page are merged); returns ``[(start, bytes, device_start)]``. On a failure the ranges registered so
    far are unregistered and the error raised."""
    spans = []
    for addr, size in sorted(r for r in ranges if r[1] > 0):
        start, end = addr // _PAGE * _PAGE, -(-(addr + size) // _PAGE) * _PAGE
        if spans and start < spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], end)
        else:
            spans.append([start, end])
    done = []
    try:
        for start, end in spans:
            rt.hostRegister(start, end - start, _HOST_REGISTER_FLAGS)
            done.append((start, end - start, None))
            done[-1] = (start, end - start, _host_device_pointer(rt, start))
    except BaseException:
        for start, _, _ in done:
            try:
                rt.hostUnregister(start)
            except Exception:  # noqa: BLE001 - the first error is the one reported
                pass
        raise
    return done


def _mapped_address(registered: list, addr: int) -> int:
    """The device address of host address ``addr`` inside one of the ``registered`` ranges."""
    for start, size, dev in registered:
        if start <= addr < start + size:
            return dev + (addr - start)
    raise RuntimeError(f"host address {addr:#x} lies in no registered range")


class SymBuffer:
    """One ``nbytes`` buffer per rank of ``comm``, with every peer's buffer mapped locally.

    Parameters
    ----------
    comm : mpi4py.MPI.Comm, torch.distributed.ProcessGroup, Bootstrap or None
        The ranks, all on one node (``MPI.COMM_TYPE_SHARED``; for a torch group: one hostname); collective.
        Construction and ``close()`` exchange only through it (as a
        :class:`~cupy_symbuf.transport.bootstrap.Bootstrap`, see
        :func:`~cupy_symbuf.transport.bootstrap.as_bootstrap`; None: torch's default group when initialised, else
        ``MPI.COMM_WORLD``); the host backend's and the staged transport's memory is an MPI shared-memory window
        on it (POSIX shared memory when it is not MPI).
    nbytes : int
        Bytes per rank (>= 0), identical on every rank.
    backend : {"auto", "cuda", "host"}
        See module docstring. ``"auto"`` picks cuda when CuPy imports and a GPU is visible.
    timeout_s : float, optional
        Bound on construction's and ``close()``'s waits for the peers (default ``Config().timeout_s``): a peer that
        never arrives gives :class:`~cupy_symbuf.SymBufferTimeoutError` naming it instead of a hang.
    transport : {"auto", "ipc", "staged"}
        (cuda; ignored on host) Where the buffers live, as ``Config.transport``: ``"ipc"`` GPU memory mapped
        through CUDA IPC, ``"staged"`` host memory (the MPI shared-memory window, ``cudaHostRegister``-mapped into
        the GPU; every byte crosses PCIe twice), ``"auto"`` :func:`choose_transport` over the ranks' peer access,
        then staged as well when a peer's IPC handle fails to open. The same on every rank.

    Raises
    ------
    ValueError
        ``nbytes`` negative or different across ranks (the message names both sizes), unknown ``backend`` or
        ``transport``, ranks asking for different transports, or the buffers do not fit in free memory (bytes
        needed and available named: GPU memory for ``ipc``, the node's shared memory for ``staged`` and host);
        raised on every rank alike.
    SymBufferTimeoutError
        A peer did not construct within ``timeout_s`` (role "construction", ``missing`` lists the ranks).
    NotImplementedError
        ``comm`` spans more than one node (scale-out is not implemented yet).
    RuntimeError
        ``backend="cuda"`` without CuPy or a GPU; ``transport="ipc"`` and a pair without peer access or a peer's
        IPC handle that does not open (on every rank alike); ``cudaHostRegister`` of the staged window failing.

    Attributes
    ----------
    rank, world_size, backend, nbytes
    bootstrap : Bootstrap
        This buffer's own duplicate of ``comm`` (:class:`~cupy_symbuf.transport.bootstrap.Bootstrap`): every later
        agreement step of its owner (symmetric allocations, probes, close) runs on it.
    comm : mpi4py.MPI.Comm or None
        The mpi4py communicator under ``bootstrap`` (the window's); None for a bootstrap that is not MPI.
    transport : str
        ``"ipc"`` or ``"staged"`` (cuda), ``"shared_memory"`` (host): what construction chose, the same on every
        rank.
    transport_reason : str
        Why (one line; e.g. the pairs without peer access).
    peer_ptrs : list of int
        (cuda) device address of every rank's buffer as mapped in this process; entry ``rank`` is our own pointer
        (staged: addresses of host memory mapped into this GPU).
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
    bootstrap = None
    comm = None

    def __init__(self, comm, nbytes: int, *, backend: str = "auto", timeout_s: Optional[float] = None,
                 transport: str = "auto", _managed: bool = False):
        try:
            boot = as_bootstrap(comm)
        except TypeError:
            raise TypeError(f"SymBuffer: comm must be an mpi4py intra-communicator, a torch.distributed "
                            f"ProcessGroup, None or a Bootstrap, got {comm!r}") from None
        if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)) or int(nbytes) < 0:
            raise ValueError(f"SymBuffer: nbytes must be an int >= 0, got {nbytes!r}")
        nbytes = int(nbytes)
        if transport not in TRANSPORTS:
            raise ValueError(f"SymBuffer: transport must be one of {TRANSPORTS}, got {transport!r}")
        if timeout_s is None:
            from ..common.config import Config
            timeout_s = Config().timeout_s
        self.timeout_s = float(timeout_s)
        self._closed = True
        self._managed = _managed  # owned by a Communicator, which closes it and warns for it
        self.backend = resolve_backend(backend)
        # Agree on size and backend (one rank on cuda and another on host would deadlock later), bounded: a peer
        # that never constructs gives a timeout naming it. On the host the memory verdict travels with them.
        me = boot.rank
        verdict = None
        if self.backend == "host":
            verdict = _memory_verdict(nbytes, boot.size, "host")
        sizes = boot.allgather((nbytes, self.backend, verdict, transport), self.timeout_s, "SymBuffer construction")
        for r, (n, b, _, t) in enumerate(sizes):
            if n != nbytes:
                raise ValueError(f"SymBuffer: nbytes must be the same on every rank: rank {me} asked "
                                 f"for {nbytes} bytes but rank {r} asked for {n} bytes")
            if b != self.backend:
                raise ValueError(f"SymBuffer: backend must resolve the same on every rank: rank {me} "
                                 f"has {self.backend!r} but rank {r} has {b!r}")
            if t != transport and self.backend == "cuda":
                raise ValueError(f"SymBuffer: transport must be the same on every rank: rank {me} asked for "
                                 f"{transport!r} but rank {r} for {t!r}")
        _agree.raise_if_any_failed([v for _, _, v, _ in sizes], "SymBuffer")
        # every rank is here: the blocking collectives below complete
        node = boot.split_node()
        node_size = node.size
        node.free()
        if node_size != boot.size:
            raise NotImplementedError(
                f"SymBuffer: comm spans more than one node ({boot.size} ranks, {node_size} on this node); "
                f"only single-node communicators are supported for now (multi-node scale-out comes later)")
        self.bootstrap = boot.dup()
        self.comm = getattr(self.bootstrap, "comm", None)
        _lifecycle.count("comm", 1)
        self.rank = self.bootstrap.rank
        self.world_size = self.bootstrap.size
        self.nbytes = nbytes
        self._win = None  # MPI.Win, or a PosixSharedWindow over a bootstrap that is not MPI
        self._host_views: list = []
        self._local_ptr = 0
        self._opened: list = []
        self.peer_ptrs: list = []
        self.peer_ptrs_device = None
        self.gpu_identities: list = []
        self._registered: list = []  # staged: (host start, bytes, device start) of every cudaHostRegister'ed range
        self.transport = "shared_memory" if self.backend == "host" else None
        self.transport_reason = ("" if self.backend != "host" else "host backend: an MPI shared-memory window"
                                 if self.comm is not None else "host backend: POSIX shared memory")
        try:
            if self.backend == "cuda":
                self._init_cuda(transport)
            else:
                self._init_host()
        except BaseException:
            self._free_comm()
            raise
        self._pid = os.getpid()
        self._closed = False
        self._token = None if _managed else _lifecycle.register(self, state=self._lifecycle_state,
                                                                depart=self._depart)

    def _lifecycle_state(self) -> tuple:
        """For :mod:`~cupy_symbuf.transport.lifecycle`: ``(pid that made it, open, failure, abort policy)``."""
        return self._pid, not self._closed, None, None

    def _depart(self, reason: str) -> None:
        """For :mod:`~cupy_symbuf.transport.lifecycle`: the job is ending; peers stop waiting for this rank
        (``lifecycle.depart``)."""
        _lifecycle.depart(self.bootstrap, reason)

    def _free_comm(self) -> None:
        if self.bootstrap is not None:
            self.bootstrap.free()
            self.bootstrap = self.comm = None
            _lifecycle.count("comm", -1)

    def _posix_window(self, part_bytes: int):
        """The shared-memory window over a bootstrap that is not MPI: ``world_size`` page-aligned parts of
        ``part_bytes`` in POSIX shared memory (:class:`~cupy_symbuf.transport.shm.PosixSharedWindow`)."""
        from .shm import PosixSharedWindow
        win = PosixSharedWindow(self.bootstrap, part_bytes, self.timeout_s)
        _lifecycle.count("win", 1)
        self._win = win
        return win

    # ---- host ---------------------------------------------------------------------------------------------
    def _init_host(self) -> None:
        if self.comm is None:
            win = self._posix_window(-(-self.nbytes // _PAGE) * _PAGE)
            self._host_views = [win.part(r)[: self.nbytes] for r in range(self.world_size)]
        else:
            MPI = _mpi()
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
        self.bootstrap.barrier(self.timeout_s, "SymBuffer construction (zeroed)", role="construction")

    def sync(self) -> None:
        """Memory barrier over the window (host backend; ``MPI_Win_sync``). No-op on cuda."""
        if self._win is not None:
            self._win.Sync()

    def host_view(self, rank: int) -> np.ndarray:
        """(host, or cuda with the staged transport) ``uint8 [nbytes]`` NumPy view of ``rank``'s buffer (staged: the
        host memory the GPUs read and write; reading it while a kernel runs sees its stores in no defined order)."""
        self._check_open()
        if self.backend != "host" and self.transport != "staged":
            raise ValueError("SymBuffer.host_view: only for backend='host' or the staged transport")
        if not 0 <= rank < self.world_size:
            raise IndexError(f"SymBuffer.host_view: rank {rank} not in [0, {self.world_size})")
        return self._host_views[rank]

    # ---- cuda ---------------------------------------------------------------------------------------------
    def _init_cuda(self, requested: str) -> None:
        cp = _compat.cupy
        self.device_id = cp.cuda.Device().id
        ident = gpu_identity(self.device_id)
        ident["hostname"] = socket.gethostname()
        place = None
        if requested != "staged" and self.world_size > 1:  # peer access towards every GPU this process sees
            from .topology import local_record
            place = local_record("cuda", self.device_id, nvml=False)
        got = self.bootstrap.allgather((ident, place), self.timeout_s, "SymBuffer construction (GPUs)")
        self.gpu_identities = [i for i, _ in got]
        topo = None
        if place is not None:
            from .topology import Topology
            topo = Topology("cuda", [dict(p, shm=0) for _, p in got])  # one node (checked above)
        # every rank holds the same records: the same choice everywhere (or the same error)
        transport, reason = choose_transport(requested, topo)
        if transport == "ipc":
            failure = self._map_ipc(ident)
            if failure is not None:
                if requested == "ipc":
                    raise RuntimeError(
                        f"SymBuffer: {failure}. With Config.transport='ipc' every pair of GPUs must be peer-accessible "
                        f"(NVLink / PCIe P2P) or the same GPU; transport='auto' or 'staged' puts the buffer in host "
                        f"memory instead")
                transport, reason = "staged", f"CUDA IPC failed: {failure}"
        if transport == "staged":
            self._map_staged()
        self.transport, self.transport_reason = transport, reason
        self.peer_ptrs_device = cp.array(np.array(self.peer_ptrs, dtype=np.uint64))
        cp.cuda.runtime.deviceSynchronize()
        everyone = self.bootstrap.allgather(transport, self.timeout_s, "SymBuffer construction (mapped)")
        if any(t != transport for t in everyone):  # pragma: no cover - the choice is deterministic
            raise SymBufferError(f"SymBuffer: the ranks chose different transports {everyone}")
        if requested == "auto" and transport == "staged":
            if self.rank == 0:
                logger.warning("SymBuffer: staged transport (the buffer in pinned host memory; every byte crosses "
                               "PCIe twice): %s", reason)
        else:
            logger.debug("SymBuffer: %s transport (%s)", transport, reason)

    def _map_ipc(self, ident: dict) -> Optional[str]:
        """GPU memory through CUDA IPC: ``cudaMalloc``, handles all-gathered, every peer's opened. Returns None, or
        (on every rank alike, everything undone) the first rank's text of a handle that did not open."""
        rt = _compat.cupy.cuda.runtime
        key = (ident["uuid"], ident["pci_bus_id"], ident["hostname"])
        sharing = sum(1 for i in self.gpu_identities if (i["uuid"], i["pci_bus_id"], i["hostname"]) == key)
        _agree.raise_if_any_failed(
            self.bootstrap.allgather(_memory_verdict(self.nbytes, sharing, "cuda"), self.timeout_s,
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
        infos = self.bootstrap.allgather((handle, err), self.timeout_s, "SymBuffer construction (IPC)")
        try:
            _agree.raise_if_any_failed([e for _, e in infos], "SymBuffer", RuntimeError)
        except RuntimeError:
            if ptr:
                rt.free(ptr)
            self._local_ptr = 0
            raise
        ptrs = []
        failure = None
        for r, (h, _) in enumerate(infos):
            if r == self.rank or not self.nbytes:
                ptrs.append(ptr)  # never open our own handle
                continue
            try:
                p = rt.ipcOpenMemHandle(h, rt.cudaIpcMemLazyEnablePeerAccess)
            except Exception as exc:  # noqa: BLE001 - told to every rank below
                failure = (f"rank {self.rank} (GPU {ident['pci_bus_id']}) could not open rank {r}'s CUDA IPC handle "
                           f"(GPU {self.gpu_identities[r]['pci_bus_id']}): {type(exc).__name__}: {exc}")
                break
            self._opened.append(p)
            ptrs.append(p)
        failures = self.bootstrap.allgather(failure, self.timeout_s, "SymBuffer construction (IPC opened)")
        first = next((f for f in failures if f is not None), None)
        if first is None:
            self.peer_ptrs = ptrs
            return None
        for p in self._opened:  # undo on every rank: mappings first, then (nobody maps it any more) the buffer
            rt.ipcCloseMemHandle(p)
        self._opened = []
        self.bootstrap.barrier(self.timeout_s, "SymBuffer construction (IPC undone)", role="construction")
        if ptr:
            rt.free(ptr)
        self._local_ptr = 0
        return first

    def _map_staged(self) -> None:
        """Host memory: the MPI shared-memory window of the host backend (each rank's part rounded up to whole
        pages), every part registered with ``cudaHostRegister(Portable | Mapped)`` in this process, ``peer_ptrs``
        the parts' device addresses."""
        rt = _compat.cupy.cuda.runtime
        _agree.raise_if_any_failed(
            self.bootstrap.allgather(_memory_verdict(self.nbytes, self.world_size, "host"), self.timeout_s,
                                     "SymBuffer construction (host memory)"), "SymBuffer")
        seg = -(-self.nbytes // _PAGE) * _PAGE  # whole pages: no two ranks' parts share one (a page registers once)
        # One page more per rank, and each part starts on the first page boundary inside its allocation: MPI puts
        # a window's parts after its own headers (Open MPI 4.1: 8 bytes past a 16-byte boundary), which would leave
        # every ring slot, symmetric array and the low-latency kernels' 16-byte accesses misaligned. The skip is the
        # same in every process (shared mappings start on page boundaries).
        if self.comm is None:  # POSIX shared memory: every part starts on a page boundary already
            win = self._posix_window(seg)
        else:
            MPI = _mpi()
            win = MPI.Win.Allocate_shared(seg + _PAGE if seg else 0, 1, comm=self.comm)
            _lifecycle.count("win", 1)
            win.Lock_all(MPI.MODE_NOCHECK)
            self._win = win
        bases = []
        for r in range(self.world_size):
            if self.comm is None:
                view = win.part(r)
            elif seg:
                buf, _ = win.Shared_query(r)
                raw = np.frombuffer(buf, dtype=np.uint8)
                skip = -int(raw.__array_interface__["data"][0]) % _PAGE
                view = raw[skip: skip + seg]
            else:
                view = np.zeros(0, np.uint8)
            self._host_views.append(view[: self.nbytes])
            bases.append(int(view.__array_interface__["data"][0]) if seg else 0)
            if seg and bases[-1] % _PAGE:
                raise AssertionError(f"SymBuffer: internal: rank {r}'s part of the window is not page-aligned")
        self._host_views[self.rank][:] = 0
        win.Sync()
        err = None
        ptrs = [0] * self.world_size
        if seg:
            try:
                self._registered = _register_ranges(rt, [(b, seg) for b in bases])
                ptrs = [_mapped_address(self._registered, b) for b in bases]
            except Exception as exc:  # noqa: BLE001 - told to every rank below
                err = (f"cudaHostRegister / device pointer of the shared-memory window ({self.world_size} x {seg} "
                       f"bytes) failed: {type(exc).__name__}: {exc}")
        errs = self.bootstrap.allgather(err, self.timeout_s, "SymBuffer construction (host registered)")
        try:
            _agree.raise_if_any_failed(errs, "SymBuffer", RuntimeError)
        except RuntimeError:
            self._free_staged()
            raise
        self.peer_ptrs = ptrs
        self._local_ptr = ptrs[self.rank]

    def _free_staged(self) -> None:
        """Unregister this process's ranges of the window, then free the window (collective). The window is freed
        even when an unregistration fails (the peers wait in its collective free), and the first such error is
        raised after."""
        rt = _compat.cupy.cuda.runtime
        first = None
        for start, _size, _dev in self._registered:
            try:
                rt.hostUnregister(start)
            except Exception as exc:  # noqa: BLE001 - raised below, after the collective free
                first = first or exc
        self._registered = []
        self._host_views = []
        if self._win is not None:
            self._win.Unlock_all()
            self._win.Free()
            self._win = None
            _lifecycle.count("win", -1)
        if first is not None:
            raise first

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
        mem = cp.cuda.UnownedMemory(self.peer_ptrs[rank] + offset_bytes, size, self,
                                    self.device_id if self.transport == "staged" else -1)
        return cp.ndarray(shape, dtype, memptr=cp.cuda.MemoryPointer(mem, 0))

    def _check_open(self) -> None:
        if self._closed:
            raise SymBufferClosedError("SymBuffer is closed (or failed to initialise); create a new one")

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran (or construction failed)."""
        return self._closed

    def close(self, *, on_arrival=None, on_slow=None, interrupt=None) -> None:
        """Unmap peers and free the buffer; collective over ``comm``, bounded by ``timeout_s``. Idempotent.

        ``on_arrival``: called with no arguments on every rank once every rank is in close() (after the bounded
        barrier), while the buffer is still mapped (``Communicator.close`` reads its abort word there); must not
        raise. ``on_slow``: ``(seconds, fn)``, ``fn(missing_ranks)`` called once (while the buffer is still
        mapped) when the first barrier waits longer than that; by default, while an exception propagates, a note on stderr. ``interrupt``: the bootstrap's (called
        every ``DEPARTED_POLL_S`` of that barrier, while the buffer is still mapped; ``Communicator.close`` at exit
        looks there for peers waiting for this rank).

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
        slow = on_slow if on_slow is not None else self._slow_note()
        if self.backend == "cuda":
            rt = _compat.cupy.cuda.runtime
            try:
                rt.deviceSynchronize()
            finally:
                # nobody may still write into a buffer we are about to free (raises when a peer never comes: the
                # buffer is then left allocated, our mappings of the peers are still closed below)
                try:
                    self.bootstrap.barrier(self.timeout_s, what, on_slow=slow, interrupt=interrupt)
                    if on_arrival is not None:
                        on_arrival()
                finally:
                    for p in self._opened:
                        rt.ipcCloseMemHandle(p)
                    self._opened = []
                    self.peer_ptrs_device = None
            self.bootstrap.barrier(self.timeout_s, what + " (unmapped)")
            if self.transport == "staged":
                self._free_staged()  # the window's memory is not cudaMalloc'ed: unregister, free the window
            elif self._local_ptr:
                rt.free(self._local_ptr)
            self._local_ptr = 0
        else:
            # raises: window, comm left allocated
            self.bootstrap.barrier(self.timeout_s, what, on_slow=slow, interrupt=interrupt)
            if on_arrival is not None:
                on_arrival()
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
        return f"SymBuffer(backend={self.backend!r}, transport={self.transport!r}, nbytes={self.nbytes}, {state})"
