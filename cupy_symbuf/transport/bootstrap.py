"""The bootstrap: how ranks find each other and agree while a communicator is built and closed.

Every construction-time exchange (the ranks' backends and GPUs, the wire fingerprint, CUDA IPC handles, memory
verdicts, symmetric allocations, the cross-memory attach probe) and every bounded wait of ``close()`` goes through
one small interface, :class:`Bootstrap`: ``rank``, ``size``, a bounded ``allgather`` of one picklable object per
rank, ``barrier``, ``bcast``, ``split_node``, ``dup`` / ``free``, ``depart`` and ``abort``. Nothing of the ring protocol
travels here: once built, the collectives move rows through the symmetric buffer only.

Two implementations: :class:`MpiBootstrap` over an mpi4py intra-communicator (jobs started by ``mpiexec``) and
:class:`TorchBootstrap` over a ``torch.distributed`` process group (jobs started by ``torchrun``; its exchanges go
through the job's c10d store). :func:`as_bootstrap` picks one for what the caller passed (None: torch's default
group when initialised, else ``MPI.COMM_WORLD``). MpiBootstrap's waits are built from nonblocking point-to-point
messages on a dedicated tag, polled with short sleeps, so that a rank whose peers never arrive (they failed,
exited, or never call) gets a :class:`CollectiveTimeoutError` naming them after ``timeout_s`` instead of blocking in
``MPI_Allgather`` / ``MPI_Barrier`` forever; TorchBootstrap's poll store counters the same way. The host backend's
shared-memory window is MPI's under MpiBootstrap (``MpiBootstrap.comm``), POSIX shared memory named through the
bootstrap otherwise: that is the data path's memory, not an exchange. mpi4py is imported only when an MPI
communicator is used (or None is passed with torch.distributed not initialised).

Messages of an exchange that timed out (or was left any other way) may stay queued: their peer arrives later.
They are never taken for a later exchange: MpiBootstrap numbers the exchanges of each MPI communicator (a count
every rank keeps per communicator, cached on it as an MPI attribute, so it outlives the per-call bootstraps of
:func:`as_bootstrap`, starts at 0 on a new ``Dup`` / ``Split``, and goes with a freed handle) and drops a message of
an earlier number; TorchBootstrap's store keys carry a fresh prefix per bootstrap and the exchange's number. So a
construction retried on the same communicator after a timeout works at once. Closing is the exception to "same step
or error": a rank that closes (role :data:`CLOSE`) while its peers wait in another step releases them at once, and
its close meets theirs (see :class:`Bootstrap`), leaving no message of the abandoned step behind.
"""
from __future__ import annotations

import os
import pickle
import socket
import sys
import threading
import time
import zlib
from typing import Any, List, Optional, Protocol, runtime_checkable

from ..common.errors import SymBufferError, SymBufferTimeoutError

__all__ = ["Bootstrap", "MpiBootstrap", "TorchBootstrap", "CollectiveTimeoutError", "as_bootstrap", "world",
           "world_rank", "mpi_in_use", "is_group", "abort_process", "TAG"]


def _mpi():
    """mpi4py's ``MPI`` module (importing it initialises MPI); ``ImportError`` when mpi4py is not installed."""
    from mpi4py import MPI
    return MPI


def _is_mpi_comm(obj) -> bool:
    """``obj`` is an mpi4py communicator (never imports mpi4py: an object of it exists only once it is imported)."""
    mod = sys.modules.get("mpi4py.MPI")
    return mod is not None and isinstance(obj, mod.Comm)


def _is_torch_group(obj) -> bool:
    """``obj`` is a ``torch.distributed`` ProcessGroup (never imports torch)."""
    dist = sys.modules.get("torch.distributed")
    return dist is not None and isinstance(obj, getattr(dist, "ProcessGroup", ()))


def _torch_initialized() -> bool:
    dist = sys.modules.get("torch.distributed")
    try:
        return dist is not None and dist.is_available() and dist.is_initialized()
    except Exception:  # pragma: no cover - a broken torch install is "no torch group"
        return False


def is_group(obj) -> bool:
    """``obj`` is something :func:`as_bootstrap` takes besides None: an mpi4py communicator, a torch.distributed
    ProcessGroup or a :class:`Bootstrap` (imports neither mpi4py nor torch)."""
    return _is_mpi_comm(obj) or _is_torch_group(obj) or isinstance(obj, Bootstrap)


def mpi_in_use() -> bool:
    """True when mpi4py is imported and MPI is initialised and not finalised (a job launched by ``mpiexec``, or a
    program that imported ``mpi4py.MPI``); never imports mpi4py."""
    mod = sys.modules.get("mpi4py.MPI")
    try:
        return mod is not None and bool(mod.Is_initialized()) and not mod.Is_finalized()
    except Exception:  # pragma: no cover
        return False

#: Point-to-point tag of every bounded exchange (a user's traffic on the same communicator and tag during
#: construction would be mistaken for ours; after construction the exchanges run on the SymBuffer's own ``dup``).
TAG = 0x5359  # 'SY'

# Send requests of timed-out exchanges, kept so that their pickled buffers stay alive until MPI is done with them.
_ORPHANS: list = []


class CollectiveTimeoutError(SymBufferTimeoutError):
    """A bounded construction or close step (``role`` "construction" or "close") waited ``timeout_s`` for ranks that
    never arrived (or that gave up waiting themselves: ``withdrawn``; or that left, ending the job: ``departed``,
    their reason, see :meth:`Bootstrap.depart`; or that are closing the communicator this step belongs to:
    ``closing``, see :data:`CLOSE`); ``missing`` lists them (``peer`` is the first), ``what`` names the step."""

    def __init__(self, *, rank: int, missing: List[int], what: str, role: str, timeout_s: float,
                 withdrawn: bool = False, late: bool = False, departed: Optional[str] = None,
                 closing: bool = False):
        # SymBufferTimeoutError's attributes, without its ring-specific message
        self.rank, self.peer, self.channel, self.role = rank, (missing[0] if missing else -1), -1, role
        self.head, self.tail, self.timeout_s, self.op = -1, -1, timeout_s, what
        self.missing = list(missing)
        self.what = what
        self.withdrawn = withdrawn
        self.departed = departed
        self.closing = closing
        names = ", ".join(str(r) for r in missing)
        ranks = f"rank{'s' if len(missing) > 1 else ''} {names}"
        if departed is not None:
            text = (f"{what}: on rank {rank}: {ranks} left without taking part (ending the job: {departed}); this "
                    f"rank did not wait for {'them' if len(missing) > 1 else 'it'}")
        elif closing:
            text = (f"{what}: on rank {rank}: {ranks} left this communicator (closing it: an exception, abort(), "
                    f"the end of its program or close() there) and will not take part; this rank did not wait for "
                    f"{'them' if len(missing) > 1 else 'it'}")
        elif withdrawn:
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
    :class:`~cupy_symbuf.SymBufferError`). The k-th step of every rank on a group is the same step (close steps
    counted apart): a peer's message of an exchange that timed out or was left (it arrived late) is never taken for
    a later one, so a step retried on the same group after a timeout meets at once; a rank that never called a step
    its peers timed out in takes its next call for it (it finds them gone: ``withdrawn``). ``on_slow``:
    ``(seconds, fn)``, ``fn(missing_ranks)`` called once when a wait takes longer than that. ``interrupt``: a
    callable (no arguments) called when a wait starts and every :data:`DEPARTED_POLL_S` while it waits; an
    exception it raises leaves the exchange as any failure does (the peers are told: ``withdrawn``) and propagates
    (a symmetric allocation step reads the communicator's abort word there).

    Steps of ``role`` :data:`CLOSE` are the closing of what this bootstrap serves (its last steps). A rank that
    waits in a step of another role and finds a peer closing raises :class:`CollectiveTimeoutError`
    (``closing``) naming it at once, instead of a step mismatch or waiting ``timeout_s``; the peer's close
    messages are kept for this rank's own close. A close step passes over the peers' messages of other steps
    (steps this rank leaves by closing: their senders leave them when they find it closing). So a rank that fails
    (or just closes) while its peers are in a step of the object releases them at once, and every rank's close
    then meets the others'.

    Optional (``MpiBootstrap`` and ``TorchBootstrap`` have it; a bootstrap without it is simply not asked):
    ``peers_in_other_steps()``, the peers that have begun a step that is not a close and that this rank has not
    joined (sorted; local, never waits). A rank whose program has ended (its exit-time close: it takes part in no
    further step) learns from it that those peers wait for it; a peer that left such a step (it withdrew or is
    closing) is not named.
    """

    rank: int
    size: int

    def allgather(self, obj: Any, timeout_s: float, what: str, *, role: str = "construction",
                  on_slow=None, interrupt=None) -> list:
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

    def depart(self, reason: str) -> None:
        """This rank takes part in no further exchange of this bootstrap: its process is about to end the job
        (``abort_on_failure``). A peer waiting in an exchange (a ``close()`` while an exception propagates) or
        entering one then raises :class:`CollectiveTimeoutError` (``departed``: ``reason``) at once, instead of
        waiting ``timeout_s`` for this rank. Local, never raises, never waits."""
        ...

    def abort(self, code: int = 1) -> None:
        """End every process of the job (``MPI_Abort``-like); does not return."""
        ...


def _sleep(spins: int) -> None:
    # yield at once (CI runs 4 ranks on 2 cores), then back off to 5 ms
    time.sleep(0 if spins < 20 else min(0.005, 1e-5 * spins))


_HERE, _CONFIRM, _WITHDRAWN = "here", "confirm", "withdrawn"
#: The role of a bootstrap's closing steps (see :class:`Bootstrap`).
CLOSE = "close"
#: Seconds added to a peer's ``timeout_s`` for its "confirm" or "withdrawn" to reach this rank (second round).
DELIVERY_GRACE_S = 1.0
#: Seconds between two looks of a TorchBootstrap wait at its peers' departures (:meth:`Bootstrap.depart`).
DEPARTED_POLL_S = 0.02


class _Exchanges:
    """This rank's record of the bounded exchanges on one MPI communicator, shared by every :class:`MpiBootstrap`
    over it: ``next``, the number of this rank's next exchange that is not a close (every rank counts the same
    steps, on entry); ``close_next``, the same for close steps (role :data:`CLOSE`, numbered apart); ``done``, the
    number of this rank's last exchange (not a close) that completed (-1: none yet); ``current``, closing (bool) ->
    the number of the step of that kind this rank is in (None between steps); ``stale``, how many messages
    of earlier exchanges were dropped; ``held``, rank -> its messages met before this rank's step of them (in
    order); ``stepping``, rank -> whether its last message met outside a step of this rank of it (passed over by a
    close step, or read by ``peers_in_other_steps``) began a step that is not a close."""

    __slots__ = ("next", "close_next", "done", "current", "stale", "held", "stepping")

    def __init__(self):
        self.next = 0
        self.close_next = 0
        self.done = -1
        self.current: "dict[bool, Optional[int]]" = {False: None, True: None}
        self.stale = 0
        self.held: "dict[int, list]" = {}
        self.stepping: "dict[int, bool]" = {}


_KEYVAL = None  # the MPI attribute key of a communicator's _Exchanges (made at first use)
_KEYVAL_LOCK = threading.Lock()


def _exchanges(comm) -> _Exchanges:
    """``comm``'s :class:`_Exchanges`, cached on the communicator itself (an MPI attribute: not copied by
    ``Dup``, deleted by ``Free``, so a freed handle that MPI reuses for a new communicator starts afresh)."""
    global _KEYVAL
    with _KEYVAL_LOCK:
        if _KEYVAL is None:
            _KEYVAL = _mpi().Comm.Create_keyval()
        got = comm.Get_attr(_KEYVAL)
        if got is None:
            got = _Exchanges()
            comm.Set_attr(_KEYVAL, got)
        return got


class MpiBootstrap:
    """:class:`Bootstrap` over an mpi4py intra-communicator ``comm`` (kept as the attribute ``comm``: the host
    backend's shared-memory window is allocated on it). Implements :class:`Bootstrap`.

    The exchanges that are not a close are numbered per communicator: this rank's count lives on ``comm`` (see
    :func:`as_bootstrap`: a bootstrap is made per call), every message carries its exchange's number, and a message
    of an earlier number (an exchange that timed out or was left, whose peer arrived late) is dropped, counted in
    :attr:`stale_dropped`, never taken for the current one. The same number with another step name is ranks
    calling different steps (:class:`~cupy_symbuf.SymBufferError`). A "here" of a later number means its sender
    made exchanges this rank never joined (its messages were dropped here, or this rank skipped steps): this rank
    takes that number and sends its "here" again, so the ranks meet at the highest count. Close steps (role
    :data:`CLOSE`) are numbered apart, by the same rules among themselves: a close message of an earlier close step
    (one that timed out) neither meets a later close step nor tells another step that its sender is closing; the
    rest of the close protocol (see :class:`Bootstrap`) sees only current messages."""

    def __init__(self, comm):
        MPI = _mpi()
        if not isinstance(comm, MPI.Comm) or comm == MPI.COMM_NULL:
            raise TypeError(f"MpiBootstrap: comm must be an mpi4py intra-communicator, got {comm!r}")
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self._x = _exchanges(comm)  # this communicator's exchange count and held messages (see _Exchanges)
        self._held = self._x.held  # rank -> its messages met before this rank's step of them (in order)
        #: rank -> whether its last message met outside a step of this rank (passed over by a close step, or read
        #: by peers_in_other_steps) began a step that is not a close
        self._stepping = self._x.stepping

    @property
    def stale_dropped(self) -> int:
        """Messages of earlier exchanges on this communicator that this rank dropped (their exchange had timed out
        or been left here before they arrived)."""
        return self._x.stale

    def __repr__(self) -> str:
        return f"MpiBootstrap(rank={self.rank}, size={self.size})"

    # ---- bounded exchanges ------------------------------------------------------------------------------------
    def allgather(self, obj: Any, timeout_s: float, what: str, *, role: str = "construction",
                  on_slow=None, interrupt=None) -> list:
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
        Every message carries whether its step closes (role :data:`CLOSE`); a peer's close message met in a wait
        of another role is kept back (``_held``) for this rank's own close, and a close step drops the peers'
        messages of other steps (see :class:`Bootstrap`).
        Every message of a step that is not a close carries the exchange's number (see the class docstring): a
        message of an earlier exchange (one that timed out or was left, on this bootstrap or on another over the
        same communicator) is dropped, so a retry after a timeout meets only its own messages.
        Raises :class:`~cupy_symbuf.SymBufferError` when a peer's message of this exchange belongs to another step
        (``what`` differs: ranks calling different steps).
        """
        comm, rank, size = self.comm, self.rank, self.size
        out: list = [None] * size
        out[rank] = obj
        closing = role == CLOSE
        # counted on entry, whatever happens next: every rank that calls the step counts it
        if closing:
            number = self._x.close_next
            self._x.close_next += 1
        else:
            number = self._x.next
            self._x.next += 1
        if size == 1:
            return out
        peers = [r for r in range(size) if r != rank]
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        sends: list = []

        def here():  # (again after taking a peer's higher number: see _gather)
            sends.extend(comm.isend((_HERE, what, (timeout_s, obj), closing, state["n"]), dest=r, tag=TAG)
                         for r in peers)

        state = {"deadline": deadline, "t0": t0, "on_slow": on_slow, "interrupt": interrupt, "closing": closing,
                 "n": number, "here": here}
        self._x.current[closing] = number  # peers_in_other_steps (called by interrupt) keeps this step's messages
        if interrupt is not None:
            try:
                interrupt()  # before anything is sent: nothing of this exchange reaches the peers
            except BaseException:
                self._x.current[closing] = None
                raise
        try:
            here()
            got = self._gather(_HERE, what, peers, state, role, timeout_s)
            heard = time.monotonic()
            if heard > deadline:  # heard from everyone, but too late: a peer may have withdrawn already
                raise CollectiveTimeoutError(rank=rank, missing=sorted(state.get("late") or peers), what=what,
                                             role=role, timeout_s=timeout_s, late=True)
            for r, (_, v) in got.items():
                out[r] = v
            sends += [comm.isend((_CONFIRM, what, None, closing, state["n"]), dest=r, tag=TAG) for r in peers]
            state["deadline"] = heard + max(t for t, _ in got.values()) + DELIVERY_GRACE_S
            self._gather(_CONFIRM, what, peers, state, role, timeout_s)
            if not closing:
                self._x.done = state["n"]
            return out
        except BaseException:
            # any way out but a return (a timeout, a peer's withdrawal, ranks calling different steps, Ctrl-C): the
            # peers, perhaps already in the second round, must not wait for our confirm nor go on without us
            try:
                sends += [comm.isend((_WITHDRAWN, what, None, closing, state["n"]), dest=r, tag=TAG)
                          for r in peers]
            except Exception:  # pragma: no cover - the original error matters more
                pass
            raise
        finally:
            self._x.current[closing] = None
            pending = [req for req in sends if not req.test()[0]]
            _ORPHANS.extend(pending)  # small messages complete eagerly; these keep their buffers alive if not

    def _next(self, r: int):
        """Rank ``r``'s next message to this bootstrap (one kept back first, see :meth:`_gather`), or None."""
        held = self._held.get(r)
        if held:
            return held.pop(0)
        msg = self.comm.improbe(source=r, tag=TAG)
        return None if msg is None else msg.recv()

    def _stale(self, m) -> bool:
        """Message ``m`` (read outside a wait for it: by :meth:`peers_in_other_steps`, perhaps from a wait's
        ``interrupt``) belongs to an exchange (a close step or not: counted apart) that this rank has left: it timed
        out or was left here, and the peer's message arrived late. The messages of a step this rank is in are
        not."""
        if len(m) <= 4 or m[4] is None:
            return False
        closing = bool(m[3])
        now = self._x.current[closing]
        return m[4] < (now if now is not None else self._x.close_next if closing else self._x.next)

    def _gather(self, kind: str, what: str, peers: list, state: dict, role: str, timeout_s: float) -> dict:
        """One message of ``kind`` from every rank of ``peers``, by the deadline in ``state``; messages of earlier
        exchanges are dropped, a peer's "here" of a later one makes this rank take its number (see the class
        docstring)."""
        rank = self.rank
        waiting = list(peers)
        got: dict = {}
        spins = 0
        interrupt, next_look = state.get("interrupt"), 0.0
        ahead: set = set()  # peers whose next message belongs to a later exchange (kept for it)
        aside: dict = {}  # rank -> its messages of close steps it left, kept for this rank's own close steps
        try:
            while waiting:
                progressed = False
                for r in list(waiting):
                    if r in ahead:
                        continue
                    m = self._next(r)
                    if m is None:
                        continue
                    their_kind, their_what, their_obj = m[:3]
                    their_closing = len(m) > 3 and bool(m[3])
                    their_n = m[4] if len(m) > 4 else None
                    if their_n is not None:
                        alike = their_closing == state["closing"]  # a step of this step's kind (close or not)
                        mine = state["n"] if alike else self._x.close_next if their_closing else self._x.next
                        if their_n < mine:  # an exchange that timed out or was left here: its sender left it too
                            if their_kind == _WITHDRAWN and their_n == self._x.done and not their_closing and alike:
                                # rank r withdrew from the exchange this rank completed last (it stalled past its
                                # second round's bound): it is not coming to this one
                                raise CollectiveTimeoutError(rank=rank, missing=[r], what=what, role=role,
                                                             timeout_s=timeout_s, withdrawn=True)
                            self._x.stale += 1
                            progressed = True
                            continue
                        if their_n > mine and alike and their_what == what:
                            if kind == _HERE and their_kind == _HERE:
                                # rank r made exchanges this rank never joined: meet at its number (the peers still at
                                # this one do the same on r's "here"; the ones ahead drop ours)
                                state["n"] = self._x.current[their_closing] = their_n
                                if their_closing:
                                    self._x.close_next = their_n + 1
                                else:
                                    self._x.next = their_n + 1
                                state["here"]()
                                got.clear()
                                state.pop("late", None)
                                waiting[:] = [p for p in peers if p != r]
                                got[r] = their_obj
                                progressed = True
                                break
                            self._held.setdefault(r, []).insert(0, m)  # for this rank's later step
                            ahead.add(r)
                            continue
                    if their_closing and not state["closing"] and their_n is not None \
                            and self._left_close(r, their_n, [m] + aside.get(r, [])):
                        # rank r withdrew from close step their_n (it timed out there: this rank never came): it
                        # is not closing; its messages of that step wait for this rank's own close step of that
                        # number, which takes them as its late arrival (as a step that is not a close does)
                        aside.setdefault(r, []).append(m)
                        progressed = True
                        continue
                    if their_closing and not state["closing"]:
                        # rank r is closing: it left this step (or never came) and takes part in no other; its message
                        # waits for this rank's own close
                        self._held.setdefault(r, []).insert(0, m)
                        raise CollectiveTimeoutError(rank=rank, missing=[r], what=what, role=role, timeout_s=timeout_s,
                                                     closing=True)
                    if state["closing"]:
                        self._note(r, m)
                    if state["closing"] and not their_closing:
                        continue  # a step this rank leaves by closing: rank r leaves it too once it finds this close
                    if their_what != what:
                        raise SymBufferError(f"{what}: rank {rank} received rank {r}'s message for {their_what!r}: the "
                                             f"ranks are not calling the same step")
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
                if interrupt is not None and now >= next_look:
                    next_look = now + DEPARTED_POLL_S
                    interrupt()
                if state["on_slow"] is not None and now - state["t0"] > state["on_slow"][0]:
                    state["on_slow"][1](sorted(waiting))
                    state["on_slow"] = None
                if now > state["deadline"]:
                    raise CollectiveTimeoutError(rank=rank, missing=sorted(waiting), what=what, role=role,
                                                 timeout_s=timeout_s)
                spins = 0 if progressed else spins + 1
                _sleep(spins)
        finally:
            for r, ms in aside.items():  # back in front of what came after them, in order
                self._held[r] = ms + self._held.get(r, [])
        return got

    def _arrived(self, r: int):
        """Rank ``r``'s messages to this bootstrap that have arrived and were not read yet, in order (read as
        iterated)."""
        while True:
            msg = self.comm.improbe(source=r, tag=TAG)
            if msg is None:
                return
            yield msg.recv()

    def _left_close(self, r: int, n: int, met: list) -> bool:
        """Rank ``r`` withdrew from close step ``n``: its "withdrawn" of that step arrived (among ``met``, its
        messages this wait has read, or in ``_held``; the messages of ``r`` that arrived are read into ``_held``, in
        order, to look)."""
        self._held.setdefault(r, []).extend(self._arrived(r))
        return any(x[0] == _WITHDRAWN and len(x) > 4 and bool(x[3]) and x[4] == n
                   for x in met + self._held.get(r, []))

    def _note(self, r: int, m) -> None:
        """Rank ``r``'s message ``m``, met outside a step of this rank of it: a "here" of a step that is not a close
        begins a step rank ``r`` waits in; its withdrawal or any close message ends that (see
        :meth:`peers_in_other_steps`)."""
        closing = len(m) > 3 and bool(m[3])
        if closing or m[0] == _WITHDRAWN:
            self._stepping[r] = False
        elif m[0] == _HERE:
            self._stepping[r] = True

    def peers_in_other_steps(self) -> list:
        """See :class:`Bootstrap` (``peers_in_other_steps``): the peers' messages that arrived are read now (kept, in
        order, for this rank's next step, which reads them first) and, with those a close step passed over, say
        which peers began a step that is not a close."""
        for r in range(self.size):
            if r == self.rank:
                continue
            for m in self._arrived(r):
                if self._stale(m):  # of a step this rank has left: its sender is not waiting in it for this rank
                    self._x.stale += 1
                    continue
                self._held.setdefault(r, []).append(m)
                self._note(r, m)
        return sorted(r for r, waits in self._stepping.items() if waits)

    def barrier(self, timeout_s: float, what: str, *, role: str = "close", on_slow=None, interrupt=None) -> None:
        """``comm.Barrier()`` bounded by ``timeout_s`` (:class:`CollectiveTimeoutError` names the missing ranks)."""
        self.allgather(None, timeout_s, what, role=role, on_slow=on_slow, interrupt=interrupt)

    def bcast(self, obj: Any, timeout_s: float, what: str, *, root: int = 0, role: str = "construction") -> Any:
        """``root``'s ``obj`` on every rank, bounded by ``timeout_s`` (an allgather in which only ``root`` sends
        its object: construction's messages are small)."""
        if not 0 <= root < self.size:
            raise ValueError(f"{what}: root must be a rank in [0, {self.size}), got {root!r}")
        return self.allgather(obj if self.rank == root else None, timeout_s, what, role=role)[root]

    # ---- groups -------------------------------------------------------------------------------------------
    def split_node(self) -> "MpiBootstrap":
        return MpiBootstrap(self.comm.Split_type(_mpi().COMM_TYPE_SHARED, key=self.rank))

    def split(self, color: int, key: int) -> "MpiBootstrap":
        """A new bootstrap over the ranks that pass the same ``color``, ordered by ``key`` (``MPI_Comm_split``;
        blocking, like :meth:`dup`); :meth:`free` it."""
        return MpiBootstrap(self.comm.Split(color, key))

    def dup(self) -> "MpiBootstrap":
        return MpiBootstrap(self.comm.Dup())

    def free(self) -> None:
        """Free what :meth:`dup` / :meth:`split` / :meth:`split_node` made (``MPI.COMM_WORLD`` and ``COMM_SELF`` are
        kept); the messages of ours already queued on it are dropped first (MPI may hand a freed communicator's
        unreceived messages to a later one), and its exchange count goes with it."""
        MPI = _mpi()
        if self.comm not in (MPI.COMM_NULL, MPI.COMM_WORLD, MPI.COMM_SELF):
            self.discard_leftovers()
            self.comm.Free()

    def discard_leftovers(self) -> int:
        MPI = _mpi()
        n = sum(len(v) for v in self._held.values())
        self._held.clear()
        while True:
            msg = self.comm.improbe(source=MPI.ANY_SOURCE, tag=TAG)
            if msg is None:
                return n
            msg.recv()
            n += 1

    def depart(self, reason: str) -> None:
        """Nothing to tell: under MPI the job ends by ``MPI_Abort``, which ends every rank at once, the ones waiting
        for this rank included."""

    def abort(self, code: int = 1) -> None:
        self.comm.Abort(code)


class TorchBootstrap:
    """:class:`Bootstrap` over a ``torch.distributed`` process group (gloo, nccl, any backend): every exchange goes
    through the job's c10d key-value store (``TCPStore`` under ``torchrun``), never through the group's collectives,
    so that every wait is bounded and nothing of the group's own traffic (a user's ``all_reduce`` on a GPU stream)
    can meet ours.

    ``group``: a ProcessGroup this process belongs to, or None for the default group
    (``torch.distributed.init_process_group`` must have run). ``rank`` / ``size`` are the group's; ``members``
    the global ranks of the group's ranks.

    :meth:`allgather` keeps :class:`MpiBootstrap`'s two rounds and guarantees (see its docstring): the keys of
    exchange ``n`` of this bootstrap are ``<prefix>/<n>/here/<rank>`` (this rank's pickled object, step name and
    ``timeout_s``), ``.../confirm/<rank>`` and ``.../withdrawn/<rank>``, with the counters ``.../n_here``,
    ``.../n_confirm``, ``.../n_withdrawn`` polled (``Store.add(key, 0)``, nonblocking) with short sleeps. A rank
    that leaves an exchange any way but a return sets its ``withdrawn`` key; peers in either round see it and raise
    :class:`CollectiveTimeoutError` (``withdrawn``). Exchanges are numbered, so a late message of an exchange that
    timed out is never taken for a later one (:meth:`discard_leftovers` has nothing to drop). A rank deletes its
    keys of exchange ``n - 1`` once exchange ``n`` completed (every peer has left ``n - 1`` by then).
    :meth:`depart` sets ``<prefix>/departed/<rank>`` (its reason) and the counter ``<prefix>/n_departed``, which
    every wait reads when it starts and every :data:`DEPARTED_POLL_S` after. Close steps (role :data:`CLOSE`) are
    numbered apart (``<prefix>/c<n>/...``), so they meet whatever other steps each rank left unfinished; a rank's
    first close step sets ``<prefix>/closing/<rank>`` and counts ``<prefix>/n_closing``, which the waits of the
    other steps read with the departures (the closing peer named: :class:`CollectiveTimeoutError` ``closing``).

    The key prefix of a bootstrap made by :func:`as_bootstrap` names the group (its c10d name and its members) and
    counts the bootstraps made over that group in this process; :meth:`dup` and :meth:`split` derive their
    children's prefixes from the parent's. So, as with MPI's ``Comm_dup``, every rank must make them in the same order. :meth:`split` and
    :meth:`split_node` make no torch group: the children are bootstraps over the same store (what they need).
    """

    _made: "dict[tuple, int]" = {}
    _made_lock = threading.Lock()

    def __init__(self, group=None, *, _store=None, _members=None, _prefix=None):
        import torch.distributed as dist
        if _store is not None:  # a child of dup / split
            self.group = group
            self.members = list(_members)
            self._store = _store
            self._prefix = _prefix
        else:
            if not dist.is_available() or not dist.is_initialized():
                raise RuntimeError("TorchBootstrap: torch.distributed is not initialised: call "
                                   "torch.distributed.init_process_group(...) first (torchrun sets the environment "
                                   "it reads), or pass an mpi4py communicator")
            if group is None:
                group = dist.group.WORLD
            if not _is_torch_group(group):
                raise TypeError(f"TorchBootstrap: group must be a torch.distributed ProcessGroup or None, got "
                                f"{type(group).__name__} {group!r}")
            if dist.get_rank(group) < 0:
                raise ValueError("TorchBootstrap: this process is not a member of group")
            self.group = group
            self.members = [int(r) for r in dist.get_process_group_ranks(group)]
            from torch.distributed import distributed_c10d as c10d
            self._store = c10d._get_default_store()
            try:  # the c10d name every rank gives this group: different groups of the same members stay apart
                name = str(c10d._get_process_group_name(group))
            except Exception:  # pragma: no cover - an older torch
                name = ""
            key = (name,) + tuple(self.members)
            with TorchBootstrap._made_lock:
                n = TorchBootstrap._made.get(key, 0)
                TorchBootstrap._made[key] = n + 1
            self._prefix = f"cupy_symbuf/g{zlib.crc32(repr(key).encode()):08x}.{len(self.members)}/b{n}"
        me = dist.get_rank()
        if me not in self.members:
            raise ValueError(f"TorchBootstrap: global rank {me} is not a member of the group {self.members}")
        self.rank = self.members.index(me)
        self.size = len(self.members)
        self._seq = 0
        self._close_seq = 0  # close steps (role CLOSE) are numbered apart, "c<n>"
        self._closing = False  # this rank has entered a close step (its "closing" key is set)
        self._children = 0

    def __repr__(self) -> str:
        return f"TorchBootstrap(rank={self.rank}, size={self.size})"

    def _key(self, seq: int, *parts) -> str:
        return "/".join((self._prefix, str(seq)) + tuple(str(p) for p in parts))

    # ---- bounded exchanges ------------------------------------------------------------------------------------
    def allgather(self, obj: Any, timeout_s: float, what: str, *, role: str = "construction",
                  on_slow=None, interrupt=None) -> list:
        """Every rank's ``obj`` bounded by ``timeout_s``: :meth:`MpiBootstrap.allgather`'s two rounds and errors,
        over the store (see the class docstring)."""
        rank, size = self.rank, self.size
        out: list = [None] * size
        out[rank] = obj
        closing = role == CLOSE
        if closing:  # close steps are numbered apart: they meet whatever other steps each rank left unfinished
            n = self._close_seq
            self._close_seq += 1
            seq, prev = f"c{n}", (f"c{n - 1}" if n > 0 else None)
        else:
            seq = self._seq
            self._seq += 1
            prev = seq - 1 if seq > 0 else None
        if size == 1:
            return out
        store, key = self._store, self._key
        peers = [r for r in range(size) if r != rank]
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        state = {"deadline": deadline, "t0": t0, "on_slow": on_slow, "interrupt": interrupt, "closing": closing}
        if interrupt is not None:
            interrupt()  # before anything is written: nothing of this exchange reaches the peers
        if closing and not self._closing:
            self._closing = True
            try:  # the peers' waits in other steps read it (_check_departed)
                store.set(f"{self._prefix}/closing/{rank}", b"1")
                store.add(f"{self._prefix}/n_closing", 1)
            except Exception:  # noqa: BLE001 - the close's own exchange reports a broken store
                pass
        try:
            store.set(key(seq, "here", rank), pickle.dumps((what, timeout_s, obj)))
            store.add(key(seq, "n_here"), 1)
            self._wait(seq, "here", what, peers, state, role, timeout_s)
            heard = time.monotonic()
            if heard > deadline:  # heard from everyone, but too late: a peer may have withdrawn already
                raise CollectiveTimeoutError(rank=rank, missing=sorted(state.get("late") or peers), what=what,
                                             role=role, timeout_s=timeout_s, late=True)
            got = store.multi_get([key(seq, "here", r) for r in peers])
            times = []
            for r, raw in zip(peers, got):
                their_what, their_timeout, their_obj = pickle.loads(raw)
                if their_what != what:
                    raise SymBufferError(f"{what}: rank {rank} received rank {r}'s message for {their_what!r}: the "
                                         f"ranks are not calling the same step")
                out[r] = their_obj
                times.append(float(their_timeout))
            store.set(key(seq, "confirm", rank), b"1")
            store.add(key(seq, "n_confirm"), 1)
            state["deadline"] = heard + max(times) + DELIVERY_GRACE_S
            self._wait(seq, "confirm", what, peers, state, role, timeout_s)
        except BaseException:
            # any way out but a return: the peers must not wait for our confirm nor go on without us
            try:
                store.set(key(seq, "withdrawn", rank), pickle.dumps(what))
                store.add(key(seq, "n_withdrawn"), 1)
            except Exception:  # pragma: no cover - the original error matters more
                pass
            raise
        if prev is not None:  # every peer has left exchange prev (it confirmed seq's "here" after): drop ours of it
            try:
                for part in ("here", "confirm"):
                    store.delete_key(key(prev, part, rank))
                if rank == 0:
                    for part in ("n_here", "n_confirm"):
                        store.delete_key(key(prev, part))
            except Exception:  # noqa: BLE001 - a key left in the store is harmless
                pass
        return out

    def _wait(self, seq, kind: str, what: str, peers: list, state: dict, role: str, timeout_s: float) -> None:
        """Until every rank's ``kind`` ("here" / "confirm") key is set, by the deadline in ``state``; a peer's
        ``withdrawn`` key raises :class:`CollectiveTimeoutError` (``withdrawn``) naming it."""
        store, key, rank = self._store, self._key, self.rank
        counter = key(seq, "n_" + kind)
        spins = 0
        last = -1
        while True:
            n = store.add(counter, 0)
            if n >= self.size:
                if time.monotonic() > state["deadline"] and kind == "here":
                    state["late"] = [r for r in peers]
                return
            if store.add(key(seq, "n_withdrawn"), 0) > 0:
                # a peer that withdrew before confirming never confirms this exchange
                gone = [r for r in peers if store.check([key(seq, "withdrawn", r)])
                        and not store.check([key(seq, "confirm", r)])]
                if gone:
                    raise CollectiveTimeoutError(rank=rank, missing=gone, what=what, role=role, timeout_s=timeout_s,
                                                 withdrawn=True)
            now = time.monotonic()
            if now >= state.get("departed_poll", 0.0):
                state["departed_poll"] = now + DEPARTED_POLL_S
                self._check_departed(seq, kind, what, peers, role, timeout_s, state["closing"])
                if state["interrupt"] is not None:
                    state["interrupt"]()
            if state["on_slow"] is not None and now - state["t0"] > state["on_slow"][0]:
                state["on_slow"][1](self._missing(seq, kind, peers))
                state["on_slow"] = None
            if now > state["deadline"]:
                raise CollectiveTimeoutError(rank=rank, missing=self._missing(seq, kind, peers), what=what,
                                             role=role, timeout_s=timeout_s)
            spins = 0 if n != last else spins + 1
            last = n
            _sleep(spins)

    def _missing(self, seq: int, kind: str, peers: list) -> list:
        return [r for r in peers if not self._store.check([self._key(seq, kind, r)])]

    def _check_departed(self, seq, kind: str, what: str, peers: list, role: str, timeout_s: float,
                        closing: bool = False) -> None:
        """Raise :class:`CollectiveTimeoutError` (``departed``) naming the peers that departed (:meth:`depart`)
        without their ``kind`` key of exchange ``seq``; in a step that does not close (``closing`` false), the
        same (``closing``) for the peers that are closing (see :class:`Bootstrap`)."""
        store = self._store
        if not closing and store.add(f"{self._prefix}/n_closing", 0) > 0:
            gone = [r for r in peers if store.check([f"{self._prefix}/closing/{r}"])
                    and not store.check([self._key(seq, kind, r)])]
            if gone:
                raise CollectiveTimeoutError(rank=self.rank, missing=gone, what=what, role=role, timeout_s=timeout_s,
                                             closing=True)
        if store.add(f"{self._prefix}/n_departed", 0) <= 0:
            return
        gone = [r for r in peers if store.check([f"{self._prefix}/departed/{r}"])
                and not store.check([self._key(seq, kind, r)])]
        if gone:
            try:
                reason = pickle.loads(store.get(f"{self._prefix}/departed/{gone[0]}"))
            except Exception:  # noqa: BLE001 - the reason is for the message only
                reason = "reason unknown"
            raise CollectiveTimeoutError(rank=self.rank, missing=gone, what=what, role=role, timeout_s=timeout_s,
                                         departed=str(reason))

    def peers_in_other_steps(self) -> list:
        """See :class:`Bootstrap` (``peers_in_other_steps``): the peers whose "here" key of this rank's next step (not a
        close; the step numbers of the others are this rank's) is set, and that neither withdrew from it nor are
        closing. One counter read when no peer began it."""
        store, seq = self._store, self._seq
        if self.size == 1 or store.add(self._key(seq, "n_here"), 0) <= 0:
            return []
        return [r for r in range(self.size) if r != self.rank and store.check([self._key(seq, "here", r)])
                and not store.check([self._key(seq, "withdrawn", r)])
                and not store.check([f"{self._prefix}/closing/{r}"])]

    def barrier(self, timeout_s: float, what: str, *, role: str = "close", on_slow=None, interrupt=None) -> None:
        """A barrier bounded by ``timeout_s`` (:class:`CollectiveTimeoutError` names the missing ranks)."""
        self.allgather(None, timeout_s, what, role=role, on_slow=on_slow, interrupt=interrupt)

    def bcast(self, obj: Any, timeout_s: float, what: str, *, root: int = 0, role: str = "construction") -> Any:
        """``root``'s ``obj`` on every rank, bounded by ``timeout_s``."""
        if not 0 <= root < self.size:
            raise ValueError(f"{what}: root must be a rank in [0, {self.size}), got {root!r}")
        return self.allgather(obj if self.rank == root else None, timeout_s, what, role=role)[root]

    # ---- groups -------------------------------------------------------------------------------------------
    def _child(self, tag: str, members: list) -> "TorchBootstrap":
        n = self._children
        self._children += 1
        return TorchBootstrap(self.group, _store=self._store, _members=members, _prefix=f"{self._prefix}/{tag}{n}")

    def split(self, color: int, key: int, *, timeout_s: Optional[float] = None) -> "TorchBootstrap":
        """A new bootstrap over the ranks that pass the same ``color``, ordered by ``(key, rank)`` (as
        ``MPI_Comm_split``); one bounded allgather (``timeout_s``, default ``Config().timeout_s``)."""
        if timeout_s is None:
            from ..common.config import Config
            timeout_s = Config().timeout_s
        everyone = self.allgather((int(color), int(key)), timeout_s, "TorchBootstrap.split")
        mine = sorted((k, r) for r, (c, k) in enumerate(everyone) if c == int(color))
        return self._child(f"s{int(color)}.", [self.members[r] for _, r in mine])

    def split_node(self) -> "TorchBootstrap":
        """The ranks of this host (by ``socket.gethostname()``), ordered by rank."""
        hosts = self.allgather(socket.gethostname(), _default_timeout(), "TorchBootstrap.split_node")
        colors = {h: i for i, h in enumerate(dict.fromkeys(hosts))}
        mine = [r for r in range(self.size) if hosts[r] == hosts[self.rank]]
        return self._child(f"n{colors[hosts[self.rank]]}.", [self.members[r] for r in mine])

    def dup(self) -> "TorchBootstrap":
        return self._child("d", self.members)

    def free(self) -> None:
        pass  # nothing is held but store keys, deleted as exchanges complete

    def discard_leftovers(self) -> int:
        return 0  # exchanges are numbered: a late key of one that timed out is never read by another

    def depart(self, reason: str) -> None:
        """See :meth:`Bootstrap.depart`: sets this rank's ``departed`` key (``reason``) and counts it; the peers'
        waits read it (see the class docstring)."""
        try:
            self._store.set(f"{self._prefix}/departed/{self.rank}", pickle.dumps(str(reason)))
            self._store.add(f"{self._prefix}/n_departed", 1)
        except Exception:  # noqa: BLE001 - the job is ending; the peers' waits stay bounded by timeout_s
            pass

    def abort(self, code: int = 1) -> None:
        """End this process at once (``os._exit(code)``, after flushing stdout / stderr): torchrun (or any
        launcher that watches its workers) then ends the job's other processes."""
        _exit_now(code)


def _default_timeout() -> float:
    from ..common.config import Config
    return Config().timeout_s


def _exit_now(code: int) -> None:
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except Exception:  # pragma: no cover
            pass
    os._exit(int(code) or 1)


_HOW_TO_START = ("start the job with torchrun and call torch.distributed.init_process_group(...) first (then pass "
                 "its group or None), or with mpiexec and install mpi4py (then pass an mpi4py communicator such as "
                 "MPI.COMM_WORLD, or None)")


def as_bootstrap(group=None) -> Bootstrap:
    """``group`` as a :class:`Bootstrap`: a Bootstrap as it is; an mpi4py intra-communicator wrapped in
    :class:`MpiBootstrap`; a ``torch.distributed`` ProcessGroup in :class:`TorchBootstrap`; ``None``: torch's
    default group when ``torch.distributed.is_initialized()``, else ``MPI.COMM_WORLD`` when mpi4py imports.

    Raises ``TypeError`` naming ``group`` for anything else, ``RuntimeError`` saying how to start a job for None
    with neither."""
    if _is_mpi_comm(group):
        return MpiBootstrap(group)
    if _is_torch_group(group):
        return TorchBootstrap(group)
    if group is None:
        if _torch_initialized():
            return TorchBootstrap(None)
        try:
            MPI = _mpi()
        except ImportError:
            raise RuntimeError(f"no process group: torch.distributed is not initialised and mpi4py is not "
                               f"installed; {_HOW_TO_START}") from None
        return MpiBootstrap(MPI.COMM_WORLD)
    if isinstance(group, Bootstrap):
        return group
    raise TypeError(f"expected an mpi4py intra-communicator, a torch.distributed ProcessGroup, None or a Bootstrap, "
                    f"got {type(group).__name__} {group!r}")


def world() -> Bootstrap:
    """Every process of the job: the group :func:`~cupy_symbuf.transport.lifecycle.abort_job` ends.
    ``MPI.COMM_WORLD`` when MPI is initialised (an ``mpiexec`` job), else torch's default group when
    ``torch.distributed`` is initialised (a ``torchrun`` job), else ``MPI.COMM_WORLD`` when mpi4py imports;
    ``RuntimeError`` otherwise."""
    if mpi_in_use():
        return MpiBootstrap(_mpi().COMM_WORLD)
    if _torch_initialized():
        return TorchBootstrap(None)
    return as_bootstrap(None)


def world_rank() -> int:
    """This process's rank in the job (``MPI.COMM_WORLD``'s under MPI, else torch's default group's), -1 when
    neither is initialised; makes no bootstrap and never imports mpi4py or torch."""
    try:
        if mpi_in_use():
            return int(sys.modules["mpi4py.MPI"].COMM_WORLD.Get_rank())
        if _torch_initialized():
            return int(sys.modules["torch.distributed"].get_rank())
    except Exception:  # pragma: no cover
        pass
    return -1


def abort_process(code: int = 1) -> None:
    """End the job from this process: ``MPI.COMM_WORLD.Abort(code)`` when MPI is initialised, else
    ``os._exit(code)`` (torchrun ends the other processes when one exits non-zero). Does not return."""
    if mpi_in_use():
        _mpi().COMM_WORLD.Abort(code)
    _exit_now(code)
