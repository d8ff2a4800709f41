"""The handle of a normal-mode dispatch: :class:`DispatchHandle`, the cached layout that
:func:`~cupy_symbuf.moe.combine` and a cached :func:`~cupy_symbuf.moe.dispatch` take, and :func:`make_ref`, its
reference to the communicator that made it. The host path (:mod:`cupy_symbuf.moe.normal`) and the GPU half
(:mod:`cupy_symbuf.moe.normal_cuda`) both make handles; :mod:`cupy_symbuf.moe.normal` re-exports the class as part of
its public API."""
from __future__ import annotations

import weakref
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Callable, Optional, Tuple

import numpy as np

from .routing import align_counts
from ..wire import protocol as P

__all__ = ["DispatchHandle", "make_ref", "new_handle", "handle_fields", "handle_from"]


def make_ref(comm) -> Callable[[], Any]:
    """A handle's ``_comm_ref``: a callable returning ``comm`` (a weak reference; ``comm`` itself, kept alive, for a
    class without ``__weakref__``)."""
    try:
        return weakref.ref(comm)
    except TypeError:  # a class without __weakref__: keep it alive instead
        return lambda: comm


@dataclass(frozen=True, eq=False)
class DispatchHandle:
    """The cached layout of one :func:`dispatch`, needed by :func:`combine` and by a cached dispatch.

    Immutable (frozen dataclass; its NumPy arrays are read-only). Counterpart of DeepEP's intranode handle
    ``(rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix, recv_src_idx, is_token_in_rank,
    send_head)`` in ``deep_ep/buffer.py``. It belongs to the communicator that made it; passing it to another one
    raises ``ValueError``.

    Attributes
    ----------
    rank, world_size : int
        Of the communicator that made the handle.
    backend : str
        ``"host"`` or ``"cuda"``.
    num_experts : int
        Global number of experts; ``num_local_experts = num_experts // world_size``.
    num_tokens : int
        Tokens this rank dispatched (rows of ``x`` / ``topk_idx``; rows of ``combined_x``).
    num_topk : int
        Columns of ``topk_idx``.
    hidden : int
        Columns of the dispatched ``x`` (``combine``'s ``x`` must have the same).
    is_token_in_rank : xp.ndarray, bool ``[num_tokens, world_size]``
        Whether token ``t`` was sent to rank ``r`` (at least one of its experts lives there).
    send_token_idx : xp.ndarray, int64 ``[sum(send_counts)]``
        Source token indices of the sent rows, grouped by destination rank (rank 0's first), ascending within a
        rank: rows ``send_offsets[r]:send_offsets[r + 1]`` went to rank ``r``.
    send_counts : numpy.ndarray, int64 ``[world_size]``
        Tokens sent to each rank (= ``num_tokens_per_rank`` of the layout).
    recv_counts : numpy.ndarray, int64 ``[world_size]``
        Tokens received from each rank; ``recv_x`` rows ``recv_offsets[s]:recv_offsets[s + 1]`` came from rank
        ``s``.
    num_recv_tokens_per_expert_raw : tuple of int ``[num_local_experts]``
        Received (token, local expert) pairs per local expert, not aligned.
    expert_alignment : int
        The alignment the dispatch that made the handle used.
    dispatch_id : int
        Which dispatch of its communicator made it: the number of its count exchange (increasing, not consecutive:
        every count exchange counts, e.g. an ``alltoallv`` without ``recv_counts``; the same on every rank, since
        every rank takes part in each). :func:`combine` and a cached
        :func:`dispatch` fold it into the signature of their call headers, which every receiver checks: ranks
        passing handles of different dispatches fail the call on every rank
        (:class:`~cupy_symbuf.SymBufferMismatchError` on the ranks that receive a header with another id,
        :class:`~cupy_symbuf.SymBufferAbortedError` on any other) instead of returning rows of the wrong tokens.
        A dispatch captured in a CUDA graph keeps the id of its capture in every replay, and so do a combine or
        cached dispatch captured with its handle.
    recv_src_idx : xp.ndarray int64 ``[num_recv_tokens]`` or None
        Source token index of each received row (a dispatch routed by ``is_token_in_rank``; None otherwise).
    count_matrix : numpy.ndarray int64 ``[world_size, world_size]`` or None
        ``count_matrix[s, r]``: tokens rank ``s`` sent to rank ``r`` (every rank's ``num_tokens_per_rank``), from
        the count exchange of a dispatch routed by ``is_token_in_rank``; None otherwise and in worst-case mode on
        the GPU (the counts never reach the host there).
    src_num_tokens : numpy.ndarray int64 ``[world_size]`` or None
        ``num_tokens`` of every rank's dispatch (same availability as ``count_matrix``).
    """

    _comm_ref: Callable[[], Any] = field(repr=False)
    rank: int
    world_size: int
    backend: str
    num_experts: int
    num_tokens: int
    num_topk: int
    hidden: int
    is_token_in_rank: Any = field(repr=False)
    send_token_idx: Any = field(repr=False)
    send_counts: np.ndarray = field(repr=False)
    recv_counts: np.ndarray = field(repr=False)
    num_recv_tokens_per_expert_raw: Optional[Tuple[int, ...]] = field(repr=False)
    expert_alignment: int = 1
    num_worst_tokens: int = 0
    routing: Any = field(default=None, repr=False)
    send_rows: int = 0
    dispatch_id: int = 0
    recv_src_idx: Any = field(default=None, repr=False)
    count_matrix: Optional[np.ndarray] = field(default=None, repr=False)
    src_num_tokens: Optional[np.ndarray] = field(default=None, repr=False)

    @property
    def num_local_experts(self) -> int:
        """``num_experts // world_size``."""
        return self.num_experts // self.world_size

    @property
    def num_recv_tokens(self) -> int:
        """Rows of ``recv_x`` (``sum(recv_counts)``, or ``num_worst_tokens`` in worst-case mode); rows
        ``combine``'s ``x`` must have."""
        if self.num_worst_tokens:
            return self.num_worst_tokens
        counts = self.recv_counts
        got = self.__dict__.get("_recv_total")  # (counts, their sum): a combine's shape check costs no NumPy sum
        if got is None or got[0] is not counts:
            got = self.__dict__["_recv_total"] = (counts, int(counts.sum()))
        return got[1]

    @property
    def num_recv_tokens_device(self):
        """0-d int64 array (``xp``): rows really received (``<= num_recv_tokens``). On the GPU it lives in device
        memory and is read without a host synchronisation only in stream order (``int()`` of it waits)."""
        if self.routing is not None:
            return self.routing.num_recv_tokens
        return np.asarray(int(self.recv_counts.sum()), dtype=np.int64)

    def _host_counts(self, name: str) -> np.ndarray:
        counts = self.send_counts if name == "send" else self.recv_counts
        if counts is None:
            raise ValueError(f"DispatchHandle.{name}_offsets: a worst-case (num_worst_tokens) GPU dispatch keeps its "
                             f"counts on the device (handle.routing.table, num_recv_tokens_device); they never "
                             f"reach the host")
        return counts

    @property
    def send_offsets(self) -> np.ndarray:
        """int64 ``[world_size + 1]``: exclusive prefix sum of ``send_counts``."""
        return np.concatenate([[0], np.cumsum(self._host_counts("send"))]).astype(np.int64)

    @property
    def recv_offsets(self) -> np.ndarray:
        """int64 ``[world_size + 1]``: exclusive prefix sum of ``recv_counts``."""
        return np.concatenate([[0], np.cumsum(self._host_counts("recv"))]).astype(np.int64)

    def num_recv_tokens_per_expert(self, expert_alignment: Optional[int] = None):
        """Received tokens per local expert, each rounded up to ``expert_alignment`` (default: the handle's): a
        list of int, or for a worst-case GPU handle an int64 device array (computed without a host read)."""
        a = self.expert_alignment if expert_alignment is None else expert_alignment
        if self.num_recv_tokens_per_expert_raw is None:
            raw = self.routing.sums[1:1 + self.num_local_experts]
            skip = self.routing.table[P.CT_SKIP] != 0
            return (raw + (a - 1)) // a * a * (~skip)
        return align_counts(self.num_recv_tokens_per_expert_raw, a)

    def belongs_to(self, comm) -> bool:
        """True when ``comm`` is the communicator that made this handle (or its internal engine)."""
        owner = self._comm_ref()
        return owner is comm or owner is getattr(comm, "__dict__", {}).get("_engine_obj")


#: the fields of DispatchHandle that have a default, with it (new_handle)
_DEFAULTS = {f.name: f.default for f in fields(DispatchHandle) if f.default is not MISSING}
_NUM_FIELDS = len(fields(DispatchHandle))
_FIELD_NAMES = tuple(f.name for f in fields(DispatchHandle))
_FIELD_SET = frozenset(_FIELD_NAMES)


def new_handle(**values) -> DispatchHandle:
    """``DispatchHandle(**values)`` without the frozen dataclass's ``__init__`` (one ``object.__setattr__`` per field:
    about 2.5 us for its 22 fields, a tenth of that here): the same instance dictionary (every field, defaults
    where not given). ``TypeError`` when ``values`` miss a field without default or name one that is not a field
    (a name outside the fields that takes a missing one's place is caught by the tests, which compare the two)."""
    d = dict(_DEFAULTS)
    d.update(values)
    if len(d) != _NUM_FIELDS:
        raise TypeError(f"new_handle: the fields of DispatchHandle are {[f.name for f in fields(DispatchHandle)]}, "
                        f"got {sorted(values)}")
    h = object.__new__(DispatchHandle)
    h.__dict__.update(d)
    return h


def handle_fields(**values) -> dict:
    """The fields ``values`` of a :class:`DispatchHandle` and the defaults of those not given, for
    :func:`handle_from` (a caller keeps it for the handles of one call shape). ``TypeError`` for a name that is not
    a field."""
    d = dict(_DEFAULTS)
    d.update(values)
    extra = set(values) - _FIELD_SET
    if extra:
        raise TypeError(f"handle_fields: not fields of DispatchHandle: {sorted(extra)}")
    return d


def handle_from(fixed: dict, **values) -> DispatchHandle:
    """:func:`new_handle` of ``fixed`` (:func:`handle_fields`) with ``values`` added: the fields both leave out must
    be none (``TypeError`` otherwise); names that are not fields go into the instance dictionary as they are (a
    handle's private caches, e.g. ``_recv_total``)."""
    h = object.__new__(DispatchHandle)
    d = h.__dict__
    d.update(fixed)
    d.update(values)
    if not d.keys() >= _FIELD_SET:
        raise TypeError(f"handle_from: fields of DispatchHandle missing: "
                        f"{sorted(set(_FIELD_NAMES) - set(d))}")
    return h
