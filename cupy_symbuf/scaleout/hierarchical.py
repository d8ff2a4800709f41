"""All-to-all and MoE dispatch / combine across nodes: our channels inside a node, MPI between nodes (DeepEP's
internode design on existing engines). Host backend (tested); the GPU form (``backend="cuda"``) stages the step
between nodes through host memory.

:class:`HierarchicalCommunicator` splits the ranks into nodes of ``node_size`` consecutive ranks (the real nodes,
``MPI.COMM_TYPE_SHARED``, by default; ``node_size=k`` or ``CUPY_SYMBUF_NODE_SIZE=k`` makes *virtual* nodes on one
machine, which use no shared window between them, so the inter-node path really runs in tests). Rank ``g`` is
``(node n, local index l)`` with ``g = n * k + l``. An ``alltoallv``:

1. exchanges the counts of every rank with every rank (a bounded exchange: what each will receive);
2. **crosses nodes once**: rank ``(n, l)`` sends every row meant for a rank of node ``m`` to ``(m, l)``, the rank
   with its own local index there, in one ``MPI.Alltoallv`` over the "rail" of ranks sharing ``l``;
3. **fans out inside the node** through a :class:`~cupy_symbuf.Communicator` of the node's ranks
   (``alltoallv`` over its symmetric buffer): ``(m, l)`` forwards each row to its destination ``(m, l')``;
4. puts the rows in source-rank order (the order of a flat ``alltoallv``).

MoE ``dispatch`` (DeepEP ``Buffer.dispatch``, internode: ``deep_ep/buffer.py`` ``internode_dispatch``,
``csrc/kernels/internode.cu``) does the same per token: a token crosses nodes **once per destination node** (not
once per destination rank), to the rank with the same local index there, carrying its row, its ``topk_idx`` and
its weights; that forwarding rank hands it on with the node communicator's own :meth:`Communicator.dispatch`
to every rank of its node holding one of the token's experts. ``combine`` reverses the path: the node
communicator's :meth:`Communicator.combine` brings each expert output back to the forwarding rank and **reduces
it there** (the sum over the node's ranks, float32), then the partial sum crosses nodes once back to the token's
source rank, which adds the partial sums of the nodes. Results are those of a flat ``dispatch`` / ``combine`` on
all ranks (dispatch bitwise; combine up to the order of the float32 sum, see :meth:`HierarchicalCommunicator.combine`).

Between nodes the rows travel as packed bytes through MPI's own ``Alltoallv`` (its waits are MPI's); on the
cuda backend they are copied to host memory first (``cupy.asnumpy``) and back after (``cupy.asarray``): this
machine's Open MPI is not CUDA-aware. The array module is chosen in one place (``_xp``, ``_to_host``,
``_to_device`` of the communicator). The model of what the design buys at scale is ``docs/scaling.md``.
"""
from __future__ import annotations

import operator
import os
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Tuple

import numpy as np

from ..transport import agree as _agree
from ..transport.bootstrap import as_bootstrap
from ..common import backend as _compat
from ..common.address import address_of
from ..common import dtypes as _dt
from ..common.checks import check_array
from ..moe import checks as _moe_checks
from ..moe.routing import align_counts, token_layout
from ..common.errors import SymBufferRejectedError
from ..wire.channel_layout import check_row_fits
from ..transport.guard import CallGuard, collective, guarded

__all__ = ["HierarchicalCommunicator", "HierarchicalDispatchHandle", "node_size_from_env"]

#: Backends of the node communicator.
BACKENDS = ("host", "cuda", "auto")
#: What carries the step between nodes (HierarchicalCommunicator's ``inter_node``).
INTER_NODE = ("auto", "mpi", "nccl")
#: The exchange communicators of failed HierarchicalCommunicators, never freed (see ``close``).
_LEFT_ALLOCATED: list = []

_GUARD = operator.attrgetter("_guard")


def _told(op: str):
    """The rejection of a hierarchical collective: its first step, the bounded agreement, carries this rank's
    error (the peers raise SymBufferRejectedError naming this rank; nothing moves)."""
    def reject(h, arguments, exc):
        if h._closed or h._broken:
            return None
        try:
            h._agree(op, None, exc, "")
        except BaseException as e:  # the agreement raises exc itself after telling the peers
            if e is not exc:
                raise
        return "SymBufferRejectedError naming this rank"
    return reject


def node_size_from_env() -> Optional[int]:
    """``CUPY_SYMBUF_NODE_SIZE`` as an int >= 1, or None when unset; ``ValueError`` naming it otherwise."""
    v = os.environ.get("CUPY_SYMBUF_NODE_SIZE", "").strip()
    if not v:
        return None
    try:
        k = int(v)
    except ValueError:
        raise ValueError(f"CUPY_SYMBUF_NODE_SIZE must be an int >= 1, got {v!r}") from None
    if k < 1:
        raise ValueError(f"CUPY_SYMBUF_NODE_SIZE must be an int >= 1, got {v!r}")
    return k


def _offsets(counts) -> np.ndarray:
    """Exclusive prefix sum (int64, ``len(counts) + 1`` entries)."""
    return np.concatenate([[0], np.cumsum(np.asarray(counts, np.int64))]).astype(np.int64)


def _readonly(a):
    """``a`` marked read-only when it is a NumPy array (CuPy arrays have no such flag)."""
    if isinstance(a, np.ndarray):
        a.setflags(write=False)
    return a


@dataclass(frozen=True, eq=False)
class HierarchicalDispatchHandle:
    """The cached layout of one :meth:`HierarchicalCommunicator.dispatch`, needed by its ``combine`` and by a
    cached dispatch (``dispatch(x, handle=h)``). Immutable; it belongs to the communicator that made it.

    The counterpart of DeepEP's internode handle (``deep_ep/buffer.py`` ``internode_dispatch``: ``is_token_in_rank``,
    the rank / channel prefix matrices of the RDMA and NVLink stages, ``recv_src_meta``, ``send_rdma_head``,
    ``send_nvl_head``); its public attributes are those of the flat :class:`~cupy_symbuf.moe.DispatchHandle`.

    Attributes
    ----------
    seq : int
        Which dispatch of its communicator made it (1, 2, ...: the same on every rank; ranks passing handles of
        different dispatches to one call are refused by the call's agreement).
    rank, world_size, node_size : int
        Of the communicator that made the handle.
    backend : str
        ``"host"`` or ``"cuda"``.
    num_experts, num_tokens, num_topk, hidden : int
        As :class:`~cupy_symbuf.moe.DispatchHandle`.
    is_token_in_rank : xp.ndarray, bool ``[num_tokens, world_size]``
        Whether token ``t`` was sent to rank ``r``.
    is_token_in_node : xp.ndarray, bool ``[num_tokens, num_nodes]``
        Whether token ``t`` crossed to node ``m`` (to the rank with this rank's local index there).
    send_counts : numpy.ndarray, int64 ``[world_size]``
        Tokens sent to each rank (counted as a flat dispatch would; they travel per node).
    recv_counts : numpy.ndarray, int64 ``[world_size]``
        Tokens received from each rank; ``recv_x`` rows ``recv_offsets[s]:recv_offsets[s + 1]`` came from rank ``s``.
    rail_token_idx : xp.ndarray, int64 ``[sum(rail_send_counts)]``
        The tokens sent over the rail, grouped by destination node (node 0's first), ascending within a node.
    rail_send_counts, rail_recv_counts : numpy.ndarray, int64 ``[num_nodes]``
        Tokens this rank sent to each node over the rail (MPI), and tokens it received from each node's rank with
        its local index, to forward inside its node.
    recv_order : xp.ndarray, int64 ``[num_recv_tokens]``
        ``recv_x[i]`` is row ``recv_order[i]`` of the node dispatch's output (which is grouped by forwarding
        rank, then source node, then token).
    num_recv_tokens_per_expert_raw : tuple of int ``[num_local_experts]``
        Received (token, local expert) pairs per local expert, not aligned.
    expert_alignment : int
        The alignment the dispatch used.
    node_handle : DispatchHandle
        The node communicator's handle of the forwarding step.
    """

    _owner: Callable[[], Any] = field(repr=False)
    seq: int
    rank: int
    world_size: int
    node_size: int
    backend: str
    num_experts: int
    num_tokens: int
    num_topk: int
    hidden: int
    is_token_in_rank: Any = field(repr=False)
    is_token_in_node: Any = field(repr=False)
    send_counts: np.ndarray = field(repr=False)
    recv_counts: np.ndarray = field(repr=False)
    rail_token_idx: Any = field(repr=False)        # xp int64: tokens sent over the rail, grouped by node
    rail_send_counts: np.ndarray = field(repr=False)
    rail_recv_counts: np.ndarray = field(repr=False)
    node_handle: Any = field(repr=False)
    recv_order: Any = field(repr=False)            # xp int64: recv_x[i] = node dispatch's recv_x[recv_order[i]]
    num_recv_tokens_per_expert_raw: Tuple[int, ...] = field(repr=False)
    expert_alignment: int = 1

    @property
    def num_local_experts(self) -> int:
        """``num_experts // world_size``."""
        return self.num_experts // self.world_size

    @property
    def num_recv_tokens(self) -> int:
        """Rows of ``recv_x`` (``sum(recv_counts)``); rows ``combine``'s ``x`` must have."""
        return int(self.recv_counts.sum())

    @property
    def send_offsets(self) -> np.ndarray:
        """int64 ``[world_size + 1]``: exclusive prefix sum of ``send_counts``."""
        return _offsets(self.send_counts)

    @property
    def recv_offsets(self) -> np.ndarray:
        """int64 ``[world_size + 1]``: exclusive prefix sum of ``recv_counts``."""
        return _offsets(self.recv_counts)

    def num_recv_tokens_per_expert(self, expert_alignment: Optional[int] = None) -> list:
        """Received tokens per local expert (list of int), each rounded up to ``expert_alignment`` (default: the
        handle's)."""
        a = self.expert_alignment if expert_alignment is None else expert_alignment
        return align_counts(self.num_recv_tokens_per_expert_raw, a)

    def belongs_to(self, comm) -> bool:
        """True when ``comm`` is the :class:`HierarchicalCommunicator` that made this handle."""
        return self._owner() is comm


class HierarchicalCommunicator:
    """``alltoall`` / ``alltoallv`` and MoE ``dispatch`` / ``combine`` over nodes (see the module docstring).
    Collective to build and to close.

    Parameters
    ----------
    comm : mpi4py.MPI.Intracomm, torch.distributed.ProcessGroup or None
        All the ranks (None: torch's default group when initialised, else ``MPI.COMM_WORLD``). With a torch group,
        the control exchanges go through its store (:class:`~cupy_symbuf.transport.bootstrap.TorchBootstrap`) and
        the step between nodes is ``torch.distributed.all_to_all_single`` of host memory over a gloo group per
        rail (``inter_node="mpi"`` names that host-memory step).
    config : Config, optional
        For the node's :class:`~cupy_symbuf.Communicator`.
    node_size : int, optional
        Ranks per node (virtual nodes of consecutive ranks); default ``CUPY_SYMBUF_NODE_SIZE``, else the real
        nodes (then every node must hold the same number of consecutive ranks).
    backend : {"host", "cuda", "auto"}
        The node communicator's backend. ``"cuda"``: inputs and outputs are CuPy arrays on each rank's current
        GPU (select it first, e.g. :func:`cupy_symbuf.utils.select_device`), the node communicator runs the GPU
        kernels and the step between nodes is staged through host memory (device -> NumPy, ``MPI.Alltoallv``,
        NumPy -> device). ``"auto"``: ``"cuda"`` where CuPy sees a GPU, else ``"host"``. Every rank must resolve
        to the same backend.
    inter_node : {"auto", "mpi", "nccl"}
        What carries the step between nodes. ``"mpi"``: ``MPI.Alltoallv`` over the rail (on the cuda backend
        staged through host memory: the MPI here need not be CUDA-aware). ``"nccl"`` (cuda only): NCCL grouped
        send / receive over the rail on the current stream, device memory to device memory (CuPy's binding; one
        NCCL communicator per rail, made at construction); it needs every rail's ranks on distinct GPUs (NCCL
        refuses two ranks on one GPU, as under MPS). ``"auto"`` (default): ``"nccl"`` where that holds on every
        rail and CuPy has NCCL, else ``"mpi"``. The choice is the same on every rank (agreed at construction);
        ``"nccl"`` where it cannot run is a ``ValueError`` on every rank. Design: DeepEP's internode kernels move
        the same bytes over RDMA; NCCL point-to-point is the existing engine for it here.

    Attributes
    ----------
    node, local_rank, num_nodes, node_size : int
        This rank's node and index in it, the number of nodes and ranks per node.
    backend : str
        ``"host"`` or ``"cuda"``.
    inter_node : str
        ``"mpi"`` or ``"nccl"``: what carries the step between nodes.
    node_comm : Communicator
        The node's communicator (our channels).

    Raises
    ------
    ValueError
        ``node_size`` not dividing the world size, ranks disagreeing on it or on the backend, real nodes of
        unequal size or of non-consecutive ranks, a backend not in ``("host", "cuda", "auto")`` (on every rank).
    RuntimeError
        ``backend="cuda"`` where CuPy sees no GPU (on every rank, through the same exchange).
    ValueError, RuntimeError, SymBufferTimeoutError
        A node's :class:`~cupy_symbuf.Communicator` could not be built (e.g. a ``Config`` that differs between
        the ranks of one node): that node's ranks raise its error, the ranks of the other nodes a ``ValueError``
        (``RuntimeError`` for other failures) naming the rank; no rank gets a communicator.

    Notes
    -----
    Tested on the host backend (1, 2, 4 ranks, every split) and on the cuda backend as 2 x 2 virtual nodes on one
    H200 under MPS (``tests/test_hierarchical.py``, 91 passed per rank, MPI between the virtual nodes). The
    ``inter_node="nccl"`` step has not run on GPUs (NCCL needs one GPU per rank).

    Failure: a call whose bounded agreement fails (a peer that does not call within ``Config.timeout_s``, ranks
    calling different collectives: :class:`~cupy_symbuf.SymBufferTimeoutError` / ``SymBufferError``), or whose
    step between nodes fails, leaves the ranks out of step: the communicator is then unusable (every later call
    raises ``SymBufferError`` naming the first failure) and, like a failed :class:`~cupy_symbuf.Communicator`,
    closing it ends the job under ``Config.abort_on_failure``. A rejected call (bad arguments, ranks
    disagreeing on the row format) is not a failure: it raises on every rank and the communicator stays usable.
    """

    def __init__(self, comm, config=None, *, node_size: Optional[int] = None, backend: str = "host",
                 inter_node: str = "auto"):
        from ..communicator import Communicator
        from ..transport.symbuffer import resolve_backend
        self._guard = CallGuard()  # one thread at a time inside this communicator's calls
        boot = as_bootstrap(comm)
        W, me = boot.size, boot.rank
        err = None
        k = node_size
        try:  # the bound of this first exchange: the node communicator's (its Config or the environment's)
            from ..common.config import Config
            timeout = (config if config is not None else Config()).timeout_s
        except (TypeError, ValueError, AttributeError):
            timeout = 60.0  # a bad config is the node Communicator's to report
        try:
            if not isinstance(backend, str) or backend not in BACKENDS:
                raise ValueError(f"HierarchicalCommunicator: backend must be one of {BACKENDS}, got {backend!r}")
            if not isinstance(inter_node, str) or inter_node not in INTER_NODE:
                raise ValueError(f"HierarchicalCommunicator: inter_node must be one of {INTER_NODE}, got "
                                 f"{inter_node!r}")
            backend = resolve_backend(backend)
            if k is None:
                k = node_size_from_env()
            if k is None:  # the real nodes: consecutive ranks of equal count
                node = boot.split_node()
                k = node.size
                members = node.allgather(me, timeout, "HierarchicalCommunicator (node members)")
                node.free()
                first = members[0]
                if members != list(range(first, first + k)) or first % k:
                    raise ValueError(f"HierarchicalCommunicator: the ranks of a node must be consecutive and "
                                     f"aligned (node of rank {me}: ranks {members}); pass node_size")
            if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1 or W % k:
                raise ValueError(f"HierarchicalCommunicator: node_size must be an int >= 1 dividing the world size "
                                 f"{W}, got {k!r}")
        except (ValueError, RuntimeError) as exc:
            err = exc
        everyone = _agree.exchange_all(boot, (None if err else (int(k), backend, inter_node),
                                              None if err is None else str(err)), timeout, "HierarchicalCommunicator")
        if err is not None:
            raise err
        bad = [(r, e) for r, (_, e) in enumerate(everyone) if e]
        if bad:
            raise ValueError(f"HierarchicalCommunicator: rank {bad[0][0]} rejected its arguments ({bad[0][1]})")
        if len({v[0] for v, _ in everyone}) != 1:
            raise ValueError(f"HierarchicalCommunicator: ranks disagree on node_size: {[v[0] for v, _ in everyone]}")
        if len({v[1] for v, _ in everyone}) != 1:
            raise ValueError(f"HierarchicalCommunicator: ranks disagree on the backend: "
                             f"{[v[1] for v, _ in everyone]} (every rank must resolve to the same one)")
        if len({v[2] for v, _ in everyone}) != 1:
            raise ValueError(f"HierarchicalCommunicator: ranks disagree on inter_node: {[v[2] for v, _ in everyone]}")
        k = int(k)
        self.world = comm
        self.world_size, self.rank = W, me
        self.node_size, self.num_nodes = k, W // k
        self.node, self.local_rank = divmod(me, k)
        self.backend = backend
        self._seq = 0  # dispatches made (the same on every rank): names a handle's dispatch across ranks
        self._ctl = boot.dup()  # our bounded exchanges and count steps, apart from the user's traffic on comm
        self._node_mpi = boot.split(self.node, self.local_rank)
        self._rail_boot = boot.split(self.local_rank, self.node)  # ranks with this local index, one per node
        self._rail = getattr(self._rail_boot, "comm", None)  # its MPI communicator (None over torch.distributed)
        self._rail_group = None  # over torch.distributed: the rail's gloo group (the step between nodes)
        if self._rail is None and self.num_nodes > 1:
            import torch.distributed as dist
            self._rail_group = dist.new_group(self._rail_boot.members, backend="gloo",
                                              use_local_synchronization=True)
        self._nccl = None
        self._staging: dict = {}  # cuda, MPI step: pinned host buffers reused by every call (_stage)
        self._broken: Optional[str] = None  # set when a bounded exchange or the step between nodes failed
        try:
            # the node communicators are built per node: a failure there (e.g. a Config differing inside one node)
            # is told to every rank, so that no rank of another node goes on with a communicator of its own
            node_err = None
            try:
                self.node_comm = Communicator(self._node_mpi, config, backend=backend)
            except Exception as exc:  # noqa: BLE001 - told to every rank first
                node_err = exc
            built = _agree.exchange_all(self._ctl, None if node_err is None else
                                        (type(node_err).__name__, str(node_err)), timeout,
                                        "HierarchicalCommunicator (node communicators)")
            if node_err is not None:
                raise node_err
            self._guard.device = self.node_comm._guard.device  # (cuda: made current in the calling thread)
            bad = next(((r, b) for r, b in enumerate(built) if b), None)
            if bad is not None:
                r, (kind, text) = bad
                raise (ValueError if kind in ("ValueError", "TypeError") else RuntimeError)(
                    f"HierarchicalCommunicator: the node communicator of rank {r} (node {r // k}) could not be "
                    f"built ({kind}: {text}); no rank's communicator was made")
            self.inter_node = self._choose_inter_node(inter_node)
        except BaseException:
            if getattr(self, "node_comm", None) is not None:
                self.node_comm.close()
            self._ctl.free()
            self._node_mpi.free()
            self._rail_boot.free()
            raise
        self._closed = False

    def _choose_inter_node(self, want: str) -> str:
        """The engine of the step between nodes (see ``inter_node``), the same on every rank: every rank's reason
        why NCCL cannot carry its rail (or None) is gathered, then the rail's NCCL communicator is made."""
        why = None
        if self.backend != "cuda":
            why = "the host backend moves host memory"
        elif want != "mpi":
            gpu = None
            try:
                import importlib
                importlib.import_module("cupy.cuda.nccl")
                gpu = _compat.cupy.cuda.Device().pci_bus_id
            except Exception as exc:  # noqa: BLE001 - the reason is told to every rank
                why = f"CuPy's NCCL binding is not available ({type(exc).__name__}: {exc})"
            gpus = self._rail_allgather(gpu)  # every rank of the rail takes part, whatever it found
            if why is None and len(set(gpus)) != len(gpus):
                why = f"two ranks of a rail share a GPU ({gpus}); NCCL refuses two ranks on one GPU"
        if want == "mpi":
            return "mpi"
        reasons = _agree.exchange_all(self._ctl, why, self.node_comm.config.timeout_s,
                                      "HierarchicalCommunicator (inter_node)")
        bad = next(((r, w) for r, w in enumerate(reasons) if w), None)
        if bad is not None:
            if want == "nccl":
                raise ValueError(f"HierarchicalCommunicator: inter_node='nccl' cannot run: rank {bad[0]}: {bad[1]}")
            return "mpi"
        from cupy.cuda import nccl
        uid = self._rail_allgather(nccl.get_unique_id() if self.node == 0 else None)[0]
        self._nccl = nccl.NcclCommunicator(self.num_nodes, uid, self.node)  # rail rank = node index
        return "nccl"

    def _rail_allgather(self, obj) -> list:
        """Every rail rank's ``obj`` (indexed by node): MPI's allgather over the rail, or the rail bootstrap's
        bounded one."""
        if self._rail is not None:
            return self._rail.allgather(obj)
        return self._rail_boot.allgather(obj, self.node_comm.config.timeout_s, "HierarchicalCommunicator (rail)")

    def _rail_bytes(self, send, send_bytes, recv_bytes):
        """The step between nodes for flat uint8 ``send`` (grouped by destination node, ``send_bytes[m]`` bytes to
        rank ``(m, local_rank)``): returns the flat uint8 bytes received, grouped by source node. MPI: one
        ``Alltoallv`` of host memory (``send`` is copied to the host first when it is a device array); the result
        is NumPy (on the cuda backend a view of the pinned staging buffer ``"landed"``, valid until the next call).
        NCCL: grouped ``send`` / ``recv`` per rail peer on the current stream; ``send`` must be of the
        backend's array module and so is the result."""
        sc, rc = np.asarray(send_bytes, np.int64), np.asarray(recv_bytes, np.int64)
        so, ro = _offsets(sc), _offsets(rc)
        if self._nccl is None:
            host = self._to_host(send)
            landed = self._stage("landed", int(rc.sum())) if self.backend == "cuda" else np.empty(int(rc.sum()),
                                                                                                  np.uint8)
            if self._rail is not None:
                from mpi4py import MPI
                self._rail.Alltoallv([host, (sc, so[:-1]), MPI.BYTE], [landed, (rc, ro[:-1]), MPI.BYTE])
            elif self.num_nodes == 1:
                landed[:] = host[: landed.size]
            else:
                import torch
                import torch.distributed as dist
                dist.all_to_all_single(torch.from_numpy(landed), torch.from_numpy(np.ascontiguousarray(host)),
                                       output_split_sizes=rc.tolist(), input_split_sizes=sc.tolist(),
                                       group=self._rail_group)
            return landed
        from cupy.cuda import nccl
        xp = self._xp
        landed = xp.empty(int(rc.sum()), np.uint8)
        sp, rp = address_of(send), address_of(landed)
        stream = _compat.cupy.cuda.get_current_stream().ptr if xp is not np else 0
        nccl.groupStart()
        try:
            for m in range(self.num_nodes):
                if sc[m]:
                    self._nccl.send(sp + int(so[m]), int(sc[m]), nccl.NCCL_UINT8, m, stream)
                if rc[m]:
                    self._nccl.recv(rp + int(ro[m]), int(rc[m]), nccl.NCCL_UINT8, m, stream)
        finally:
            nccl.groupEnd()
        return landed

    # ---- the array module: the one place that knows host from device ----------------------------------------
    @property
    def _xp(self):
        """NumPy (host backend) or CuPy (cuda backend)."""
        return _compat.array_module(self.backend)

    def _to_host(self, a) -> np.ndarray:
        """``a`` as a NumPy array for MPI (a device -> host copy on the cuda backend)."""
        return _compat.cupy.asnumpy(a) if self.backend == "cuda" else np.asarray(a)

    def _to_device(self, a):
        """A NumPy array as the backend's array (a host -> device copy on the cuda backend)."""
        return _compat.cupy.asarray(a) if self.backend == "cuda" else a

    def _stage(self, name: str, nbytes: int) -> np.ndarray:
        """uint8 ``[nbytes]``: a view of the pinned host buffer ``name`` (``"send"``, ``"landed"``), grown as needed
        and reused by every call (cuda backend, MPI step). Pinned memory copies to and from the GPU at about 2.6x the
        rate of pageable memory (one H200: 16 MiB in 1.24 ms against 3.26 ms, docs/benchmarks.md); every use is
        synchronous (a blocking copy, then MPI's blocking ``Alltoallv``, then a synchronised copy back), so one
        call's bytes are consumed before the next call writes the buffer."""
        buf = self._staging.get(name)
        if buf is None or buf.size < nbytes:
            mem = _compat.cupy.cuda.alloc_pinned_memory(max(1, nbytes))
            buf = self._staging[name] = np.frombuffer(mem, np.uint8, max(1, nbytes))  # holds mem alive
        return buf[:nbytes]

    def _to_host_staged(self, a, name: str) -> np.ndarray:
        """``a`` (device) copied into the pinned staging buffer ``name``, as a NumPy array of ``a``'s dtype and
        shape, valid until the next call (:meth:`_stage`); the host backend's arrays as they are."""
        if self.backend != "cuda":
            return np.asarray(a)
        a = self._xp.ascontiguousarray(a)
        if a.nbytes == 0:
            return np.empty(a.shape, a.dtype)
        out = self._stage(name, a.nbytes).view(a.dtype).reshape(a.shape)
        a.get(out=out)  # waits for the stream that produced a, then for the copy
        return out

    def _to_device_staged(self, h):
        """NumPy ``h`` (a staging buffer's view) as a new device array, the copy finished before returning (the
        buffer is reused by the next call); device arrays and the host backend's as they are."""
        if self.backend != "cuda" or not isinstance(h, np.ndarray):
            return h
        cp = _compat.cupy
        d = cp.empty(h.shape, h.dtype)
        if h.size:
            d.set(np.ascontiguousarray(h))
            cp.cuda.get_current_stream().synchronize()
        return d

    def _input(self, op: str, name: str, a):
        """A C-contiguous array of the backend from the caller's ``a`` (``TypeError`` naming it otherwise)."""
        from ..common.checks import as_array  # host too: a list is refused, as by the flat collectives and alltoallv
        return self._xp.ascontiguousarray(as_array(op, name, a, self.backend, min_ndim=0, contiguous=False))

    # ---- collectives ----------------------------------------------------------------------------------------
    @collective("HierarchicalCommunicator.alltoallv", guard=_GUARD, reject=_told("HierarchicalCommunicator.alltoallv"))
    def alltoallv(self, sendbuf, send_counts):
        """Variable all-to-all over the nodes: the same arguments and result as :meth:`Communicator.alltoallv`.

        Parameters
        ----------
        sendbuf : numpy.ndarray (host) or cupy.ndarray (cuda) ``[rows, ...]``, any dtype
            Rows grouped by destination global rank (rank 0's first).
        send_counts : int ``[world_size]``
            Rows for each rank, summing to ``rows``.

        Returns
        -------
        recvbuf : array ``[sum(recv_counts), ...]`` of ``sendbuf``'s dtype and row shape
            Rows in source-rank order.
        recv_counts : numpy.ndarray, int64 ``[world_size]``
            Rows from each rank.

        Raises
        ------
        ValueError, TypeError
            Bad ``sendbuf`` / ``send_counts`` (the flat :meth:`Communicator.alltoallv`'s checks) on the rank that
            passed them; ranks disagreeing on dtype (by name: ml_dtypes' fp8 types differ) or row shape, on every
            rank. The first step is a bounded exchange of every rank's counts and row format, so nothing moves
            before these are known.
        SymBufferRejectedError
            On the other ranks, when one rank's arguments failed its checks (nothing was exchanged; the
            communicator stays usable).

        Notes
        -----
        The step between nodes is MPI's own ``Alltoallv`` (its waits are MPI's); on the cuda backend the rows
        are copied to host memory for it and back after.
        """
        return self._alltoallv(sendbuf, send_counts, None)

    def _alltoallv(self, sendbuf, send_counts, err, op=None):
        """The body of :meth:`alltoallv` (``op``: the name errors give); ``err``: an error the caller already found
        (told to every rank)."""
        self._check_open()
        op = op or "HierarchicalCommunicator.alltoallv"
        k, N, W = self.node_size, self.num_nodes, self.world_size
        xp = self._xp
        sig = None
        x = counts = None
        try:
            if err is not None:
                raise err
            from ..transport.engine import row_signature
            from ..common.checks import as_array, check_counts
            x = self._xp.ascontiguousarray(as_array(op, "sendbuf", sendbuf, self.backend, contiguous=False))
            counts = check_counts(op, "send_counts", send_counts, W, total=int(x.shape[0]))
            sig = {"rows": row_signature(x)}  # dtype by name too: ml_dtypes' 1-byte types share dtype.str '<V1'
        except Exception as exc:  # noqa: BLE001 - any argument error is told to every rank before anything moves
            err = exc
        # 1. every rank's counts, dtype and row shape (one bounded exchange): a rank's bad arguments are its own
        # error there and a SymBufferRejectedError on the others; ranks whose rows differ raise ValueError
        everyone = self._agree(op, sig, err, "every rank must send rows of the same dtype and row shape",
                               counts.tolist() if counts is not None else None)
        C = np.array(everyone, np.int64)  # C[s, d] = rows s sends to d
        row_shape = x.shape[1:]
        row_bytes = x.dtype.itemsize * int(np.prod(row_shape))
        recv_counts = C[:, self.rank].copy()
        # 2. across nodes: to (m, l) the rows for node m's ranks, in destination order
        by_node = counts.reshape(N, k).sum(axis=1)
        rail_recv = np.array([C[m * k + self.local_rank, self.node * k: (self.node + 1) * k].sum()
                              for m in range(N)], np.int64)  # what (m, l) sends to us
        lx = x if self._nccl is not None else self._to_host_staged(x, "send")  # NCCL: device memory, MPI: host
        lxp = xp if self._nccl is not None else np
        flat = lx.reshape(lx.shape[0], -1).view(np.uint8).reshape(-1) if x.size else lxp.zeros(0, np.uint8)
        landed = self._rail_step(flat, by_node * row_bytes, rail_recv * row_bytes)
        if self._nccl is None and self.backend == "cuda":  # back to the GPU at once: the reordering runs there
            landed, lxp = self._to_device_staged(landed), xp
        landed = landed.reshape(-1, row_bytes) if row_bytes else lxp.zeros((int(rail_recv.sum()), 0), np.uint8)
        # landed holds, per source node m (rank (m, l)), rows for our node's ranks l' = 0..k-1 in order
        # 3. inside the node: forward each row to its local destination, grouped by destination, then by source node
        pieces, fwd_counts = [], np.zeros(k, np.int64)
        starts = np.concatenate([[0], np.cumsum(rail_recv)])
        for lp in range(k):
            for m in range(N):
                src = m * k + self.local_rank
                block = C[src, self.node * k: (self.node + 1) * k]
                lo = int(starts[m] + block[:lp].sum())
                pieces.append(landed[lo: lo + int(block[lp])])
                fwd_counts[lp] += int(block[lp])
        fwd = lxp.concatenate(pieces) if pieces else lxp.zeros((0, row_bytes), np.uint8)
        got, got_counts = self.node_comm.alltoallv(self._to_device(fwd), fwd_counts)
        # got: from each local rank l (in order), rows of sources (m, l) for m = 0..N-1, in that order
        # 4. source-rank order: global source g = m * k + l
        out = xp.empty((int(recv_counts.sum()), row_bytes), np.uint8)
        dst_start = np.concatenate([[0], np.cumsum(recv_counts)])
        pos = 0
        for lsrc in range(k):
            for m in range(N):
                g = m * k + lsrc
                n = int(recv_counts[g])
                out[dst_start[g]: dst_start[g] + n] = got[pos: pos + n]
                pos += n
        if pos != got.shape[0]:
            raise AssertionError(f"internal: {got.shape[0]} rows forwarded, {pos} expected")
        return out.view(x.dtype).reshape((out.shape[0],) + row_shape), recv_counts

    @collective("HierarchicalCommunicator.alltoall", guard=_GUARD, reject=_told("HierarchicalCommunicator.alltoall"))
    def alltoall(self, sendbuf):
        """Equal blocks: :meth:`alltoallv` with one row each.

        Parameters
        ----------
        sendbuf : array ``[world_size, ...]``, any dtype
            Block ``j`` goes to rank ``j``.

        Returns
        -------
        recvbuf : array ``[world_size, ...]``
            Block ``j`` from rank ``j``.

        Raises
        ------
        ValueError
            ``sendbuf.shape[0] != world_size`` on any rank (on every rank).
        """
        err = None
        x = None
        try:
            x = self._input("HierarchicalCommunicator.alltoall", "sendbuf", sendbuf)
        except Exception as exc:  # noqa: BLE001 - told to every rank by the count exchange
            err = TypeError(f"HierarchicalCommunicator.alltoall: sendbuf: {exc}")
        if err is None and (x.ndim < 1 or x.shape[0] != self.world_size):  # told to every rank likewise
            err = ValueError(f"HierarchicalCommunicator.alltoall: sendbuf must have shape[0] == world_size "
                             f"({self.world_size}), got {x.shape}")
        if err is not None:
            x = self._xp.zeros((self.world_size, 0))
        y, _ = self._alltoallv(x, np.ones(self.world_size, np.int64), err, "HierarchicalCommunicator.alltoall")
        return y

    # ---- MoE: DeepEP's internode dispatch / combine -------------------------------------------------------
    def _group(self) -> _moe_checks.GroupInfo:
        """What the MoE argument checks (:mod:`cupy_symbuf.moe.checks`) read of this communicator: all nodes'
        ranks, the backend, and the node communicator's Config (``max_notify_ints``: the node dispatch's count
        exchange carries the per-expert counts)."""
        return _moe_checks.GroupInfo(backend=self.backend, xp=self._xp, world_size=self.world_size,
                                     config=self.node_comm.config)

    def _check_handle(self, op: str, handle) -> HierarchicalDispatchHandle:
        return _moe_checks.check_handle(op, handle, HierarchicalDispatchHandle, self,
                                        "HierarchicalCommunicator.dispatch")

    def _agree(self, op: str, sig: Optional[dict], err: Optional[BaseException], rule: str, counts=None) -> list:
        """The bounded agreement before a call moves anything: every rank's row format ``sig`` (a dict) or its
        argument error, and its ``counts`` (any picklable value, returned for every rank: the count exchange
        rides along). Raises on every rank alike: the rank's own error; a peer's as
        :class:`~cupy_symbuf.SymBufferRejectedError`; ranks disagreeing on ``sig`` as ``ValueError`` naming the
        field, the values and the ranks (``rule`` says what must agree). Nothing has moved then: the
        communicator stays usable."""
        text = None if err is None else f"{type(err).__name__}: {err}"
        everyone = self._exchange(self._ctl, (sig, text, counts), op)
        if err is not None:
            raise err
        bad = [(r, e) for r, (_, e, _) in enumerate(everyone) if e]
        if bad:
            r, e = bad[0]
            raise SymBufferRejectedError(f"{op}: rank {r} rejected its arguments ({e}); nothing was exchanged",
                                         rank=self.rank, rejecting_rank=r, op=op)
        try:
            _agree.check_agreement([s for s, _, _ in everyone], op)
        except ValueError as exc:
            raise ValueError(f"{exc}; {rule}") from None
        return [c for _, _, c in everyone]

    def _rail_exchange(self, parts, send_counts, recv_counts, op: str = "HierarchicalCommunicator"):
        """Rows of the 2-D arrays ``parts`` (the same rows each, in send order: grouped by destination node) to
        the rail peers, ``send_counts[m]`` rows to node ``m``, ``recv_counts[m]`` from it, as packed bytes in one
        ``MPI.Alltoallv`` (staged through host memory on the cuda backend). Returns the received parts (arrays of
        the backend, C-contiguous, the parts' dtypes and columns).

        Before the ``Alltoallv`` (whose waits are MPI's, unbounded) the rail peers agree in one bounded exchange
        that each has its rows ready: a rank whose packing failed, or (cuda) whose node step before it failed in
        its kernel (``Communicator`` calls are queued; the copy to the host waits for them, then the node
        communicator's error record is read), raises its error and the others a ``SymBufferError`` naming it,
        instead of the others waiting forever or shipping rows a failed kernel left."""
        from ..common.errors import SymBufferError
        xp = self._xp
        n_send, n_recv = int(np.sum(send_counts)), int(np.sum(recv_counts))
        widths = [int(p.shape[1]) * p.dtype.itemsize for p in parts]
        rb = sum(widths)
        err = None
        try:
            packed = xp.empty((n_send, rb), np.uint8)
            o = 0
            for p, w in zip(parts, widths):
                if w and n_send:
                    packed[:, o:o + w] = xp.ascontiguousarray(p).view(np.uint8).reshape(n_send, w)
                o += w
            sendbuf = (packed if self._nccl is not None else self._to_host_staged(packed, "send")).reshape(-1)
            if self.backend == "cuda":
                self.node_comm.engine.transport.check(op)  # a failure a queued node kernel recorded
        except Exception as exc:  # noqa: BLE001 - told to the rail peers first
            err = exc
        ready = self._exchange(self._rail_boot, None if err is None else f"{type(err).__name__}: {err}", op + " (rail)")
        if err is not None:
            raise err
        bad = [(r, e) for r, e in enumerate(ready) if e]
        if bad:
            raise SymBufferError(f"{op}: the rank of node {bad[0][0]} on this rank's rail failed before the step "
                                 f"between nodes ({bad[0][1]}); nothing crossed nodes")
        landed = self._rail_step(sendbuf, np.asarray(send_counts, np.int64) * rb,
                                 np.asarray(recv_counts, np.int64) * rb)
        landed = self._to_device_staged(landed.reshape(n_recv, rb))
        out, o = [], 0
        for p, w in zip(parts, widths):
            # a copy always: a one-row slice counts as C-contiguous, and its view at byte o would be misaligned for
            # the part's dtype (e.g. int64 top-k ids after 7 bf16 columns)
            piece = landed[:, o:o + w].copy()
            out.append(piece.view(p.dtype).reshape(n_recv, p.shape[1]) if w else
                       xp.empty((n_recv, p.shape[1]), p.dtype))
            o += w
        return out

    def _result_order(self, recv_counts: np.ndarray):
        """int64 ``[sum(recv_counts)]``: row ``i`` of the result (source-rank order, ``g = n * k + l``) is row
        ``order[i]`` of the node dispatch's output, which is grouped by forwarding rank ``l``, then by source node
        ``n`` (the forwarder's rows came over the rail in node order), then by token."""
        k, N = self.node_size, self.num_nodes
        block = recv_counts.reshape(N, k)  # [n, l]
        start = _offsets(block.T.reshape(-1))[:-1].reshape(k, N)  # where block (l, n) starts
        parts = [np.arange(start[l, n], start[l, n] + block[n, l], dtype=np.int64)
                 for n in range(N) for l in range(k)]
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    @collective("HierarchicalCommunicator.dispatch", guard=_GUARD, reject=_told("HierarchicalCommunicator.dispatch"))
    def dispatch(self, x, topk_idx=None, topk_weights=None, num_experts: Optional[int] = None, *,
                 handle: Optional[HierarchicalDispatchHandle] = None, expert_alignment: int = 1):
        """Send each token to every rank holding one of its experts, crossing nodes once per destination node.
        Collective.

        The semantics, arguments and results of the flat :meth:`Communicator.dispatch` (DeepEP
        ``Buffer.dispatch``, ``deep_ep/buffer.py``) on all ranks, experts placed contiguously over the world
        (expert ``e`` on rank ``e // (num_experts // world_size)``). The path is DeepEP's internode dispatch
        (``internode_dispatch``, ``csrc/kernels/internode.cu``): the token's row, ``topk_idx`` and weights go
        once to each node holding one of its experts, to the rank with this rank's local index there (one
        ``MPI.Alltoallv`` over the rail), which forwards them inside its node with the node communicator's
        :meth:`Communicator.dispatch` to the ranks holding the experts. Every rank must call it, also with zero
        tokens.

        Parameters
        ----------
        x : xp.ndarray ``[num_tokens, hidden]``, or tuple ``(x_fp8, scales)``
            bfloat16 (or raw ``uint16`` bits), float16 or float32, any strides; or ``x_fp8`` float8_e4m3fn (or raw
            ``uint8``) ``[num_tokens, hidden]``, ``hidden % 128 == 0``, with ``scales`` float32
            ``[num_tokens, hidden // 128]``. NumPy on the host backend, CuPy on cuda.
        topk_idx : xp.ndarray ``[num_tokens, num_topk]`` int64 (int32 accepted), or None with ``handle``
            Global expert per top-k slot; ``-1`` = no expert (never sent or counted).
        topk_weights : xp.ndarray ``[num_tokens, num_topk]`` float32, optional
            Gate weights travelling with ``topk_idx``. None with ``handle``.
        num_experts : int
            Global number of experts, a positive multiple of ``world_size``. With ``handle``: None or the
            handle's.
        handle : HierarchicalDispatchHandle, optional (keyword-only)
            From an earlier dispatch of this communicator: the same routes, only ``x`` travels (a cached
            dispatch; ``num_tokens`` must be the handle's).
        expert_alignment : int >= 1 (keyword-only)
            Round each entry of ``num_recv_tokens_per_expert`` up to a multiple of this.

        Returns
        -------
        recv_x : xp.ndarray ``[num_recv_tokens, hidden]`` of ``x``'s dtype, or tuple ``(recv_x_fp8, recv_scales)``
            Rows ordered by source rank, then by source token index (rows of source ``s`` are
            ``handle.recv_offsets[s]:...[s + 1]``): bitwise the flat dispatch's.
        recv_topk_idx : xp.ndarray ``[num_recv_tokens, num_topk]`` int64, or None for a cached dispatch
            Local expert index (``e - rank * num_local_experts``) where the slot's expert lives on this rank, else
            ``-1``.
        recv_topk_weights : xp.ndarray ``[num_recv_tokens, num_topk]`` float32, or None
            The sent weights, ``0.0`` where ``recv_topk_idx`` is ``-1``; None for a cached dispatch or without
            ``topk_weights``.
        num_recv_tokens_per_expert : list of int ``[num_local_experts]``
            Received (token, slot) pairs per local expert, rounded up to ``expert_alignment``.
        handle : HierarchicalDispatchHandle
            For :meth:`combine` and cached dispatches (the one passed in, for a cached dispatch).

        Raises
        ------
        TypeError
            An array not of the backend's module; a dtype outside those above; ``handle`` not a
            :class:`HierarchicalDispatchHandle`; ``num_experts`` / ``expert_alignment`` not an int.
        ValueError
            As the flat dispatch: ``topk_idx`` value ``< -1`` or ``>= num_experts``; ``num_experts`` not a positive
            multiple of ``world_size`` (or too many local experts for ``Config.max_notify_ints``); rows or
            ``num_topk`` of the arrays disagreeing; fp8 shapes; a row larger than the node communicator's
            ``Config.chunk_bytes``; ``handle`` from another communicator or with ``topk_idx`` / ``topk_weights`` /
            another ``num_experts``; ``expert_alignment`` not in ``[1, 2**30]``; ranks disagreeing on the row
            layout (dtype, hidden, scales, ``num_topk``, choice of ``topk_weights``, ``num_experts``) or, in a
            cached dispatch, passing handles of different dispatches.
        SymBufferRejectedError
            (a ``ValueError``) on the other ranks when one rank rejected its arguments.

        Every check runs before anything moves and is agreed in one bounded exchange (``Config.timeout_s``), so a
        bad argument or a mismatch on one rank fails on every rank and the communicator stays usable.

        Notes
        -----
        Not (yet) here: ``num_worst_tokens``, ``wire_dtype``, ``out``, ``stream`` / ``async_op``. Steps: the
        bounded agreement; one ``MPI.Alltoall`` of two int64 per rank pair (tokens to each rank, and tokens to
        each node over the rail); the rail ``MPI.Alltoallv`` of the rows; the node communicator's dispatch (its
        own count exchange and row exchange); a reordering copy into source-rank order.
        """
        self._check_open()
        op = "HierarchicalCommunicator.dispatch"
        grp = self._group()
        err, sig = None, None
        try:
            align = _moe_checks.check_expert_alignment(op, expert_alignment)
            if handle is not None:
                h = self._check_handle(op, handle)
                _moe_checks.check_cached(op, h, topk_idx, topk_weights, num_experts)
                xv, scales, kind = _moe_checks.check_x(op, grp, x, h.num_tokens, None)
                rb = _moe_checks.row_bytes(xv, scales, 0, False)
                check_row_fits(op, rb, self.node_comm.config.chunk_bytes, byte_run=False)
                sig = {"cached": True, "dtype": kind, "hidden": int(xv.shape[1]), "scales": scales is not None,
                       "handle (the dispatch it came from)": h.seq}
            else:
                n_exp = _moe_checks.check_num_experts(op, grp, num_experts)
                if topk_idx is None:
                    raise ValueError(f"{op}: argument 'topk_idx' is required without a handle")
                xv, scales, kind = _moe_checks.check_x(op, grp, x, None, None)
                idx = _moe_checks.check_topk_idx(op, grp, topk_idx, n_exp, xv.shape[0])
                weights = _moe_checks.check_weights(op, grp, topk_weights, xv.shape[0], idx.shape[1],
                                                    "num_tokens (rows of x)")
                rb = _moe_checks.row_bytes(xv, scales, idx.shape[1], weights is not None)
                check_row_fits(op, rb, self.node_comm.config.chunk_bytes, byte_run=False)
                sig = {"cached": False, "dtype": kind, "hidden": int(xv.shape[1]), "scales": scales is not None,
                       "num_topk": int(idx.shape[1]), "topk_weights": weights is not None, "num_experts": n_exp}
                layout = self._layout(idx, n_exp)
        except Exception as exc:  # noqa: BLE001 - every rank is told, then this rank raises it
            err = exc
        # the count exchange rides along: tokens to every rank, tokens to every node
        counts = self._agree(op, sig, err, "all ranks must pass the same hidden, dtype, num_topk, choice of "
                                           "topk_weights and num_experts (cached: handles of the same dispatch)",
                             None if handle is not None or err is not None else
                             (layout[2].tolist(), layout[3].tolist()))
        if handle is not None:
            return self._dispatch_cached(h, xv, scales, align)
        return self._dispatch(op, xv, scales, idx, weights, n_exp, align, layout, counts)

    def _layout(self, idx, n_exp: int):
        """``(is_token_in_rank [T, W], is_token_in_node [T, N], tokens to each rank [W], tokens to each node [N])``
        (the last two NumPy int64)."""
        xp = self._xp
        T = idx.shape[0]
        _, _, in_rank = token_layout(xp, idx, n_exp, self.world_size)
        in_node = in_rank.reshape(T, self.num_nodes, self.node_size).any(axis=2) if T else \
            xp.zeros((T, self.num_nodes), bool)
        return (in_rank, in_node, self._to_host(in_rank.sum(axis=0)).astype(np.int64),
                self._to_host(in_node.sum(axis=0)).astype(np.int64))

    def _dispatch(self, op, xv, scales, idx, weights, n_exp: int, align: int, layout, counts):
        xp = self._xp
        k, N, W = self.node_size, self.num_nodes, self.world_size
        T, K = idx.shape
        epr = n_exp // W
        in_rank, in_node, send_counts, rail_send = layout
        # what each rank receives in the end, and what the rail peers (m, l) send to this node
        recv_counts = np.array([c[0][self.rank] for c in counts], np.int64)
        rail_recv = np.array([counts[m * k + self.local_rank][1][self.node] for m in range(N)], np.int64)
        # 1. across nodes, once per destination node: rows, top-k ids, weights (grouped by node, tokens ascending)
        _, rail_idx = xp.nonzero(xp.ascontiguousarray(in_node.T))
        rail_idx = xp.ascontiguousarray(rail_idx, dtype=np.int64)
        parts = [xv[rail_idx]] + ([scales[rail_idx]] if scales is not None else []) + [idx[rail_idx]] + \
            ([weights[rail_idx]] if weights is not None else [])
        landed = self._rail_exchange(parts, rail_send, rail_recv, op)
        lx = landed[0]
        ls = landed[1] if scales is not None else None
        lidx = landed[2 if scales is not None else 1]
        lw = landed[-1] if weights is not None else None
        # 2. inside the node: the node communicator's dispatch, experts numbered within the node
        lo = self.node * k * epr
        node_idx = xp.where((lidx >= lo) & (lidx < lo + k * epr), lidx - lo, -1).astype(np.int64)
        nx, nidx, nw, _, nh = self.node_comm.dispatch((lx, ls) if scales is not None else lx, node_idx, lw, k * epr,
                                                      expert_alignment=align)
        # 3. source-rank order
        if [int(c) for c in nh.recv_counts] != [int(c) for c in recv_counts.reshape(N, k).sum(axis=0)]:
            raise AssertionError(f"internal: node dispatch received {list(nh.recv_counts)} rows per forwarder, "
                                 f"the counts say {recv_counts.reshape(N, k).sum(axis=0).tolist()}")
        order = xp.asarray(self._result_order(recv_counts))
        recv_x = (nx[0][order], nx[1][order]) if scales is not None else nx[order]
        recv_topk_idx = nidx[order]
        recv_topk_weights = nw[order] if nw is not None else None
        self._seq += 1
        for a in (send_counts, recv_counts, rail_send, rail_recv):
            _readonly(a)
        h = HierarchicalDispatchHandle(
            _owner=weakref.ref(self), seq=self._seq, rank=self.rank, world_size=W, node_size=k,
            backend=self.backend, num_experts=n_exp, num_tokens=T, num_topk=K, hidden=int(xv.shape[1]),
            is_token_in_rank=_readonly(in_rank), is_token_in_node=_readonly(in_node), send_counts=send_counts,
            recv_counts=recv_counts, rail_token_idx=_readonly(rail_idx), rail_send_counts=rail_send,
            rail_recv_counts=rail_recv, node_handle=nh, recv_order=_readonly(order),
            num_recv_tokens_per_expert_raw=tuple(int(c) for c in nh.num_recv_tokens_per_expert_raw),
            expert_alignment=align)
        return recv_x, recv_topk_idx, recv_topk_weights, h.num_recv_tokens_per_expert(align), h

    def _dispatch_cached(self, h: HierarchicalDispatchHandle, xv, scales, align: int):
        sent = h.rail_token_idx
        parts = [xv[sent]] + ([scales[sent]] if scales is not None else [])
        landed = self._rail_exchange(parts, h.rail_send_counts, h.rail_recv_counts, "HierarchicalCommunicator.dispatch")
        arg = (landed[0], landed[1]) if scales is not None else landed[0]
        nx = self.node_comm.dispatch(arg, handle=h.node_handle)[0]
        order = h.recv_order
        recv_x = (nx[0][order], nx[1][order]) if scales is not None else nx[order]
        return recv_x, None, None, h.num_recv_tokens_per_expert(align), h

    @collective("HierarchicalCommunicator.combine", guard=_GUARD, reject=_told("HierarchicalCommunicator.combine"))
    def combine(self, x, handle: HierarchicalDispatchHandle, topk_weights=None, *, dtype=None):
        """Return each dispatched token's rows to its source rank and sum them there, reducing inside each node
        first. Collective.

        The semantics and arguments of the flat :meth:`Communicator.combine` (DeepEP ``Buffer.combine``: a plain
        sum without weights; weight the expert outputs first). The path is DeepEP's internode combine
        (``internode_combine``, ``csrc/kernels/internode.cu``), the reverse of :meth:`dispatch`: the node
        communicator's :meth:`Communicator.combine` brings every rank's rows for a token back to the rank that
        forwarded it and sums them there (float32, the node's ranks in ascending order, rounded to ``x``'s
        dtype); that partial sum crosses nodes once, back to the source rank (the rail ``MPI.Alltoallv``), which
        adds the nodes' partial sums in float32, nodes in ascending order, and rounds once.

        Parameters
        ----------
        x : xp.ndarray ``[handle.num_recv_tokens, handle.hidden]``
            One row per row of the dispatch's ``recv_x`` (same order). bfloat16 (or raw ``uint16`` bits with
            ``dtype="bfloat16"``), float16 or float32; any strides.
        handle : HierarchicalDispatchHandle
            From :meth:`dispatch` of this communicator.
        topk_weights : xp.ndarray ``[handle.num_recv_tokens, handle.num_topk]`` float32, optional
            Reduced the same way.
        dtype : optional (keyword-only)
            How to read ``x``: None (its dtype), ``"bfloat16"`` (``x`` may be raw ``uint16`` bits), float16 or
            float32 (must equal ``x.dtype``).

        Returns
        -------
        combined_x : xp.ndarray ``[handle.num_tokens, handle.hidden]``, ``x``'s dtype
            ``combined_x[t]`` = the sum of the rows for ``t`` of the ranks ``t`` went to; tokens sent nowhere are
            zeros. Equal to the flat combine's up to the summation order: float32 x exactly the same terms in
            another association (a difference of a few float32 ulps of the sum); bfloat16 / float16 x also rounds
            each node's partial sum once to ``x``'s dtype before it crosses nodes (as DeepEP's internode
            combine, which sends bf16 partial sums over RDMA), so a result may differ from the flat one by about
            an ulp of ``x``'s dtype per node it was sent to. With one node (``node_size == world_size``) or one
            rank per node it is bitwise the flat combine.
        combined_topk_weights : xp.ndarray ``[handle.num_tokens, handle.num_topk]`` float32, or None
            The same sum of the ``topk_weights`` rows (float32 throughout).

        Raises
        ------
        TypeError
            An array not of the backend's module; ``x`` not bfloat16 / float16 / float32 (``uint16`` without
            ``dtype="bfloat16"``); ``topk_weights`` not float32; ``handle`` not a
            :class:`HierarchicalDispatchHandle`.
        ValueError
            ``handle`` from another communicator; ``x`` or ``topk_weights`` of the wrong shape; ranks
            disagreeing on the dtype or the choice of ``topk_weights`` or passing handles of different dispatches.
        SymBufferRejectedError
            (a ``ValueError``) on the other ranks when one rank rejected its arguments.

        All checks run before anything moves, agreed in one bounded exchange: a bad argument on one rank fails on
        every rank, and the communicator stays usable.
        """
        self._check_open()
        op = "HierarchicalCommunicator.combine"
        grp = self._group()
        err, sig = None, None
        try:
            h = self._check_handle(op, handle)
            n_recv = h.num_recv_tokens
            x = check_array(op, "x", x, self.backend, dims=(("num_recv_tokens", n_recv), ("hidden", h.hidden)))
            kind = _moe_checks.combine_kind(op, x, dtype)
            weights = _moe_checks.check_weights(op, grp, topk_weights, n_recv, h.num_topk, "num_recv_tokens")
            rb = h.hidden * x.dtype.itemsize + (h.num_topk * 4 if weights is not None else 0)
            check_row_fits(op, rb, self.node_comm.config.chunk_bytes, byte_run=False)
            sig = {"dtype": kind, "topk_weights": weights is not None,
                   "handle (the dispatch it came from)": h.seq}
        except Exception as exc:  # noqa: BLE001 - every rank is told, then this rank raises it
            err = exc
        self._agree(op, sig, err, "all ranks must pass handles of the same dispatch, the same dtype and the same "
                                  "choice of topk_weights")
        xp = self._xp
        # 1. back to the forwarding ranks, in the node dispatch's row order, reduced there
        order = h.recv_order
        nx = xp.empty((n_recv, h.hidden), x.dtype)
        nx[order] = x
        nw = None
        if weights is not None:
            nw = xp.empty((n_recv, h.num_topk), np.float32)
            nw[order] = weights
        part_x, part_w = self.node_comm.combine(nx, h.node_handle, nw, dtype=dtype)
        # 2. each partial sum crosses nodes once, back to its source rank (rows grouped by the node they came from)
        parts = [part_x] + ([part_w] if part_w is not None else [])
        back = self._rail_exchange(parts, h.rail_recv_counts, h.rail_send_counts, op)
        # 3. the source adds the nodes' partial sums (float32, nodes ascending), rounds once
        acc = xp.zeros((h.num_tokens, h.hidden), np.float32)
        acc_w = xp.zeros((h.num_tokens, h.num_topk), np.float32) if weights is not None else None
        offs = _offsets(h.rail_send_counts)
        sent = h.rail_token_idx
        back_f = _dt.to_float32(xp, back[0], kind) if back[0].size else None
        for m in range(self.num_nodes):
            lo, hi = int(offs[m]), int(offs[m + 1])
            if hi == lo:
                continue
            tok = sent[lo:hi]  # a token goes to a node once: the scatter-add is race-free
            if back_f is not None:
                acc[tok] += back_f[lo:hi]
            if acc_w is not None:
                acc_w[tok] += back[1][lo:hi]
        return _dt.from_float32(xp, acc, kind, x.dtype), acc_w

    # ---- lifecycle ------------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            from ..common.errors import SymBufferClosedError
            raise SymBufferClosedError("HierarchicalCommunicator is closed")
        if self._broken:
            from ..common.errors import SymBufferError
            raise SymBufferError(f"HierarchicalCommunicator is unusable after an earlier failure: {self._broken}")

    def _fail(self, exc: BaseException) -> None:
        """Mark this communicator unusable after ``exc`` left the ranks out of step: a bounded exchange that failed
        (a timeout, ranks calling different collectives) leaves its messages queued, where a later call would take
        them for its own, and the step between nodes (MPI's, unbounded) may have moved part of its bytes. The node
        communicator is marked failed too, so that closing ends the job under ``Config.abort_on_failure``, as for
        a failed :class:`~cupy_symbuf.Communicator`."""
        if not self._broken:
            self._broken = f"{type(exc).__name__}: {exc}"
        nc = getattr(self, "node_comm", None)
        if nc is not None:
            nc.engine.mark_broken(f"HierarchicalCommunicator: {self._broken}")

    def _exchange(self, comm, obj, what: str) -> list:
        """``_agree.exchange_all`` bounded by the node communicator's ``timeout_s``; its failure marks this
        communicator unusable (:meth:`_fail`)."""
        try:
            return _agree.exchange_all(comm, obj, self.node_comm.config.timeout_s, what)
        except BaseException as exc:
            self._fail(exc)
            raise

    def _rail_step(self, send, send_bytes, recv_bytes):
        """:meth:`_rail_bytes`; a failure there (MPI's or NCCL's) marks this communicator unusable."""
        try:
            return self._rail_bytes(send, send_bytes, recv_bytes)
        except BaseException as exc:
            self._fail(exc)
            raise

    @guarded("HierarchicalCommunicator.close", guard=_GUARD)
    def close(self) -> None:
        """Close the node communicator and free the MPI communicators (collective); idempotent. After a failure
        (see Notes of the class) the communicators of the bounded exchanges stay allocated: messages of the failed
        exchange may still be queued there, and MPI could hand them to a communicator made later."""
        if self._closed:
            return
        self._closed = True
        try:
            self.node_comm.close()
        finally:
            if self._nccl is not None:
                self._nccl.destroy()
                self._nccl = None
            self._staging = {}
            self._node_mpi.free()
            if self._broken:
                _LEFT_ALLOCATED.extend((self._rail_boot, self._ctl))
            else:
                self._rail_boot.free()
                self._ctl.free()

    def __enter__(self) -> "HierarchicalCommunicator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
