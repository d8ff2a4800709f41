"""The bootstrap: how ranks find each other and agree while a communicator is built and closed.

Every construction-time exchange (the ranks' backends and GPUs, the wire fingerprint, CUDA IPC handles, memory
verdicts, symmetric allocations, the cross-memory attach probe) and every bounded wait of ``close()`` goes through
one small interface, :class:`Bootstrap`: ``rank``, ``size``, a bounded ``allgather`` of one picklable object per
rank, ``barrier``, ``bcast``, ``split_node``, ``dup`` / ``free`` and ``abort``. Nothing of the ring protocol
travels here: once built, the collectives move rows through the symmetric buffer only.

:class:`MpiBootstrap` (over an mpi4py intra-communicator) is the implementation today. Its waits are built from
nonblocking point-to-point messages on a dedicated tag, polled with short sleeps, so that a rank whose peers
never arrive (they failed, exited, or never call) gets a :class:`CollectiveTimeoutError` naming them after
``timeout_s`` instead of blocking in ``MPI_Allgather`` / ``MPI_Barrier`` forever. The host backend's shared-memory
window is MPI's as well (``MpiBootstrap.comm``): that is the data path's memory, not an exchange.

Messages of an exchange that timed out may stay queued (their peer arrives later). A later exchange skips the
leftover "confirm" / "withdrawn" messages and raises on a leftover of another step, but a leftover "here" of the
same step can still be taken for a fresh one (then that exchange fails with "withdrawn"): after a construction or
close timeout, build no further communicator on that bootstrap; the job is meant to end
(``Config.abort_on_failure``).
"""
from __future__ import annotations

import time
from typing import Any, List, Protocol, runtime_checkable

from mpi4py import MPI

from ..common.errors import SymBufferError, SymBufferTimeoutError

__all__ = ["Bootstrap", "MpiBootstrap", "CollectiveTimeoutError", "as_bootstrap", "world", "TAG"]

#: Point-to-point tag of every bounded exchange (a user's traffic on the same communicator and tag during
#: construction would be mistaken for ours; after construction the exchanges run on the SymBuffer's own ``dup``).
TAG = 0x5359  # 'SY'

# Send requests of timed-out exchanges, kept so that their pickled buffers stay alive until MPI is done with them.
_ORPHANS: list = []


class CollectiveTimeoutError(SymBufferTimeoutError):
    """A bounded construction or close step (``role`` "construction" or "close") waited ``timeout_s`` for ranks that
    never arrived (or that gave up waiting themselves: ``withdrawn``); ``missing`` lists them (``peer`` is the
    first), ``what`` names the step."""

    def __init__(self, *, rank: int, missing: List[int], what: str, role: str, timeout_s: float,
                 withdrawn: bool = False, late: bool = False):
        # SymBufferTimeoutError's attributes, without its ring-specific message
        self.rank, self.peer, self.channel, self.role = rank, (missing[0] if missing else -1), -1, role
        self.head, self.tail, self.timeout_s, self.op = -1, -1, timeout_s, what
        self.missing = list(missing)
        self.what = what
        self.withdrawn = withdrawn
        names = ", ".join(str(r) for r in missing)
        ranks = f"rank{'s' if len(missing) > 1 else ''} {names}"
        if withdrawn:
            text = (f"{what}: on rank {rank}: {ranks} gave up waiting (timeout_s expired there) before every rank "
                    f"arrived; this rank must not go on alone")
        elif late:
            text = (f"{what}: timeout after {timeout_s:g} s on rank {rank}: this rank heard from {ranks} only after "
                    f"its timeout expired, and withdrew (the peers leave too)")
        else:
            text = (f"{what}: timeout after {timeout_s:g} s on rank {rank}: {ranks} never arrived (failed, exited, "
                    f"or not calling {what} on this communicator)")
        RuntimeError.__init__(self, text)


@runtime_checkable
class Bootstrap(Protocol):
    """What building and closing a communicator needs from the process group (collective methods: every rank calls
    them in the same order).

    ``rank``, ``size``: this process's rank and the number of ranks. Every wait is bounded by ``timeout_s``
    (seconds): a peer that never arrives gives :class:`CollectiveTimeoutError` (``role`` "construction" or
    "close") naming the missing ranks; ``what`` names the step in errors (ranks calling different steps raise
    :class:`~cupy_symbuf.SymBufferError`). ``on_slow``: ``(seconds, fn)``, ``fn(missing_ranks)`` called once when
    a wait takes longer than that.
    """

    rank: int
    size: int

    def allgather(self, obj: Any, timeout_s: float, what: str, *, role: str = "construction",
                  on_slow=None) -> list:
        """Every rank's ``obj`` (picklable), as a list indexed by rank."""
        ...

    def barrier(self, timeout_s: float, what: str, *, role: str = "close", on_slow=None) -> None:
        """Return once every rank has arrived."""
        ...

    def bcast(self, obj: Any, timeout_s: float, what: str, *, root: int = 0, role: str = "construction") -> Any:
        """``root``'s ``obj`` on every rank."""
        ...

    def split_node(self) -> "Bootstrap":
        """A new bootstrap over the ranks of this node (by shared memory), ordered by rank; :meth:`free` it."""
        ...

    def dup(self) -> "Bootstrap":
        """A new bootstrap over the same ranks whose messages never meet this one's; :meth:`free` it."""
        ...

    def free(self) -> None:
        """Release what :meth:`dup` / :meth:`split_node` made (collective)."""
        ...

    def discard_leftovers(self) -> int:
        """Drop this bootstrap's queued messages of exchanges that timed out; returns how many (call on every rank,
        after a barrier, before freeing a bootstrap that saw a timeout)."""
        ...

    def abort(self, code: int = 1) -> None:
        """End every process of the job (``MPI_Abort``-like); does not return."""
        ...


def _sleep(spins: int) -> None:
    # yield at once (CI runs 4 ranks on 2 cores), then back off to 5 ms
    time.sleep(0 if spins < 20 else min(0.005, 1e-5 * spins))


_HERE, _CONFIRM, _WITHDRAWN = "here", "confirm", "withdrawn"
#: Seconds added to a peer's ``timeout_s`` for its "confirm" or "withdrawn" to reach this rank (second round).
DELIVERY_GRACE_S = 1.0


class MpiBootstrap:
    """:class:`Bootstrap` over an mpi4py intra-communicator ``comm`` (kept as the attribute ``comm``: the host
    backend's shared-memory window is allocated on it). Implements :class:`Bootstrap`."""

    def __init__(self, comm: MPI.Comm):
        if not isinstance(comm, MPI.Comm) or comm == MPI.COMM_NULL:
            raise TypeError(f"MpiBootstrap: comm must be an mpi4py intra-communicator, got {comm!r}")
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()

    def __repr__(self) -> str:
        return f"MpiBootstrap(rank={self.rank}, size={self.size})"

    # ---- bounded exchanges ------------------------------------------------------------------------------------
    def allgather(self, obj: Any, timeout_s: float, what: str, *, role: str = "construction",
                  on_slow=None) -> list:
        """Every rank's ``obj``, like ``comm.allgather(obj)`` but bounded by ``timeout_s``.

        Two rounds of point-to-point messages: "here" (with ``obj`` and this rank's ``timeout_s``), then "confirm"
        once a rank has heard from everyone. A rank whose first-round wait expires sends "withdrawn" to every peer
        and raises :class:`CollectiveTimeoutError` naming the ranks it did not hear from; a peer that arrives late
        then finds "withdrawn" in the second round and raises too, instead of going on alone into a blocking step
        (a window free, a Split) that the withdrawn rank never joins. Every rank thus leaves the same way, which
        takes two rules:

        * a rank confirms only before its own deadline (one that heard from everyone too late withdraws instead);
        * the second round is not cut by this rank's first deadline: once every "here" is in, each peer decides
          (confirm or withdraw) before its own deadline, at most that peer's ``timeout_s`` after its "here" was
          received, so the second round waits that long (plus :data:`DELIVERY_GRACE_S`). A second round cut at the
          first deadline let a rank withdraw after its "confirm" had gone out: the peer that received it went on
          into ``MPI_Win_free`` alone and never returned (a ``close()`` that hung under CPU load).

        The second round takes milliseconds unless a peer stalls between the rounds; only a peer that dies there
        (or stalls past that bound) can still leave the others split.
        Raises :class:`~cupy_symbuf.SymBufferError` when a peer's message belongs to another step (``what``
        differs: a stale message of an earlier exchange that timed out, or ranks calling different steps).
        """
        comm, rank, size = self.comm, self.rank, self.size
        out: list = [None] * size
        out[rank] = obj
        if size == 1:
            return out
        peers = [r for r in range(size) if r != rank]
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        state = {"deadline": deadline, "t0": t0, "on_slow": on_slow}
        sends: list = []
        try:
            sends += [comm.isend((_HERE, what, (timeout_s, obj)), dest=r, tag=TAG) for r in peers]
            got = self._gather(_HERE, what, peers, state, role, timeout_s)
            heard = time.monotonic()
            if heard > deadline:  # heard from everyone, but too late: a peer may have withdrawn already
                raise CollectiveTimeoutError(rank=rank, missing=sorted(state.get("late") or peers), what=what,
                                             role=role, timeout_s=timeout_s, late=True)
            for r, (_, v) in got.items():
                out[r] = v
            sends += [comm.isend((_CONFIRM, what, None), dest=r, tag=TAG) for r in peers]
            state["deadline"] = heard + max(t for t, _ in got.values()) + DELIVERY_GRACE_S
            self._gather(_CONFIRM, what, peers, state, role, timeout_s)
            return out
        except BaseException:
            # any way out but a return (a timeout, a peer's withdrawal, ranks calling different steps, Ctrl-C): the
            # peers, perhaps already in the second round, must not wait for our confirm nor go on without us
            try:
                sends += [comm.isend((_WITHDRAWN, what, None), dest=r, tag=TAG) for r in peers]
            except Exception:  # pragma: no cover - the original error matters more
                pass
            raise
        finally:
            pending = [req for req in sends if not req.test()[0]]
            _ORPHANS.extend(pending)  # small messages complete eagerly; these keep their buffers alive if not

    def _gather(self, kind: str, what: str, peers: list, state: dict, role: str, timeout_s: float) -> dict:
        """One message of ``kind`` from every rank of ``peers``, by the deadline in ``state``."""
        comm, rank = self.comm, self.rank
        waiting = list(peers)
        got: dict = {}
        spins = 0
        while waiting:
            progressed = False
            for r in list(waiting):
                msg = comm.improbe(source=r, tag=TAG)
                if msg is None:
                    continue
                their_kind, their_what, their_obj = msg.recv()
                if their_what != what:
                    raise SymBufferError(f"{what}: rank {rank} received rank {r}'s message for {their_what!r}: the "
                                         f"ranks are not calling the same step (or a message of an earlier step "
                                         f"that timed out arrived late)")
                if kind == _HERE and their_kind != _HERE:
                    continue  # a rank's first message of an exchange is "here": this one is left from a failed one
                if their_kind == _WITHDRAWN:
                    raise CollectiveTimeoutError(rank=rank, missing=[r], what=what, role=role, timeout_s=timeout_s,
                                                 withdrawn=True)
                if their_kind != kind:
                    raise SymBufferError(f"{what}: rank {rank} expected a {kind!r} message from rank {r}, got "
                                         f"{their_kind!r} (ranks out of step)")
                got[r] = their_obj
                waiting.remove(r)
                progressed = True
                if time.monotonic() > state["deadline"]:
                    state.setdefault("late", []).append(r)
            if not waiting:
                break
            now = time.monotonic()
            if state["on_slow"] is not None and now - state["t0"] > state["on_slow"][0]:
                state["on_slow"][1](sorted(waiting))
                state["on_slow"] = None
            if now > state["deadline"]:
                raise CollectiveTimeoutError(rank=rank, missing=sorted(waiting), what=what, role=role,
                                             timeout_s=timeout_s)
            spins = 0 if progressed else spins + 1
            _sleep(spins)
        return got

    def barrier(self, timeout_s: float, what: str, *, role: str = "close", on_slow=None) -> None:
        """``comm.Barrier()`` bounded by ``timeout_s`` (:class:`CollectiveTimeoutError` names the missing ranks)."""
        self.allgather(None, timeout_s, what, role=role, on_slow=on_slow)

    def bcast(self, obj: Any, timeout_s: float, what: str, *, root: int = 0, role: str = "construction") -> Any:
        """``root``'s ``obj`` on every rank, bounded by ``timeout_s`` (an allgather in which only ``root`` sends
        its object: construction's messages are small)."""
        if not 0 <= root < self.size:
            raise ValueError(f"{what}: root must be a rank in [0, {self.size}), got {root!r}")
        return self.allgather(obj if self.rank == root else None, timeout_s, what, role=role)[root]

    # ---- groups -------------------------------------------------------------------------------------------
    def split_node(self) -> "MpiBootstrap":
        return MpiBootstrap(self.comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank))

    def dup(self) -> "MpiBootstrap":
        return MpiBootstrap(self.comm.Dup())

    def free(self) -> None:
        if self.comm not in (MPI.COMM_NULL, MPI.COMM_WORLD, MPI.COMM_SELF):
            self.comm.Free()

    def discard_leftovers(self) -> int:
        n = 0
        while True:
            msg = self.comm.improbe(source=MPI.ANY_SOURCE, tag=TAG)
            if msg is None:
                return n
            msg.recv()
            n += 1

    def abort(self, code: int = 1) -> None:
        self.comm.Abort(code)


def as_bootstrap(group) -> Bootstrap:
    """``group`` as a :class:`Bootstrap`: a Bootstrap as it is, an mpi4py intra-communicator wrapped in
    :class:`MpiBootstrap` (``TypeError`` naming ``group`` otherwise)."""
    if isinstance(group, MPI.Comm):
        return MpiBootstrap(group)
    if isinstance(group, Bootstrap):
        return group
    raise TypeError(f"expected an mpi4py intra-communicator or a Bootstrap, got {type(group).__name__} {group!r}")


def world() -> Bootstrap:
    """Every process of the job (``MPI.COMM_WORLD``): the group :func:`~cupy_symbuf.transport.lifecycle.abort_job`
    ends."""
    return MpiBootstrap(MPI.COMM_WORLD)

