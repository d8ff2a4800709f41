"""Bounded agreement between ranks: the collectives of construction and ``close()`` that must never hang.

:func:`exchange_all` (an allgather of one picklable object per rank) and :func:`barrier` are built from
nonblocking point-to-point messages on a dedicated tag, polled with short sleeps, so that a rank whose peers never
arrive (they failed, exited, or never call) gets a :class:`CollectiveTimeoutError` naming them after ``timeout_s``
instead of blocking in ``MPI_Allgather``/``MPI_Barrier`` forever.

:func:`fingerprint` lists everything that shapes the wire (resolved ``Config``, layout, backend, kernel variant and
warp split, compile-time defines, package and protocol version); :func:`check_agreement` compares every rank's
fingerprint and raises ``ValueError`` naming the field, the values and the ranks, alike on every rank.

Messages of an exchange that timed out may stay queued (their peer arrives later). A later exchange skips the
leftover "confirm"/"withdrawn" messages and raises on a leftover of another step, but a leftover "here" of the same
step can still be taken for a fresh one (then that exchange fails with "withdrawn"): after a construction or close
timeout, build no further communicator on that ``comm``; the job is meant to end (``Config.abort_on_failure``).
"""
from __future__ import annotations

import os
import time
from typing import Any, List

from mpi4py import MPI

from ..common.errors import SymBufferTimeoutError

__all__ = ["CollectiveTimeoutError", "exchange_all", "barrier", "discard_leftovers", "fingerprint", "check_agreement",
           "raise_if_any_failed", "LOCAL_POLICY_FIELDS"]

#: Point-to-point tag of every bounded exchange (a user's traffic on the same communicator and tag during
#: construction would be mistaken for ours; after construction the exchanges run on the SymBuffer's own Dup).
TAG = 0x5359  # 'SY'
#: Config fields that are local policy: ranks may differ on them without changing the wire.
LOCAL_POLICY_FIELDS = ("timeout_s", "blocking", "abort_on_failure", "mode", "trace", "adaptive", "adaptive_interval")

# Send requests of timed-out exchanges, kept so that their pickled buffers stay alive until MPI is done with them.
_ORPHANS: list = []


class CollectiveTimeoutError(SymBufferTimeoutError):
    """A bounded construction or close step (``role`` "construction" or "close") waited ``timeout_s`` for ranks that
    never arrived (or that gave up waiting themselves: ``withdrawn``; or that this rank heard from only after its
    deadline: ``late``); ``missing`` lists them (``peer`` is the first), ``what`` names the step."""

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


def _sleep(spins: int) -> None:
    # yield at once (CI runs 4 ranks on 2 cores), then back off to 5 ms
    time.sleep(0 if spins < 20 else min(0.005, 1e-5 * spins))


_HERE, _CONFIRM, _WITHDRAWN = "here", "confirm", "withdrawn"
#: Seconds added to a peer's ``timeout_s`` for its "confirm" or "withdrawn" to reach this rank (second round).
DELIVERY_GRACE_S = 1.0


def exchange_all(comm: MPI.Comm, obj: Any, timeout_s: float, what: str, *, role: str = "construction",
                 on_slow=None) -> list:
    """Every rank's ``obj`` (a list indexed by rank), like ``comm.allgather(obj)`` but bounded by ``timeout_s``.

    Two rounds of point-to-point messages: "here" (with ``obj`` and this rank's ``timeout_s``), then "confirm" once
    a rank has heard from everyone. A rank whose first-round wait expires sends "withdrawn" to every peer and raises
    :class:`CollectiveTimeoutError` naming the ranks it did not hear from; a peer that arrives late then finds
    "withdrawn" in the second round and raises too, instead of going on alone into a blocking step (a window free,
    a Split) that the withdrawn rank never joins. Every rank thus leaves the same way, which takes two rules:

    * a rank confirms only before its own deadline (one that heard from everyone too late withdraws instead), and
    * the second round is not cut by this rank's first deadline: once every "here" is in, each peer has entered and
      decides (confirm or withdraw) before its own deadline, at most that peer's ``timeout_s`` after its "here"
      was received, so the second round waits that long (plus :data:`DELIVERY_GRACE_S`). A second round cut at the
      first deadline let a rank withdraw after its "confirm" had gone out: the peer that received it went on into
      ``MPI_Win_free`` alone and never returned. The second round takes milliseconds unless a peer stalls between
      the rounds; only a peer that dies there (or stalls past that bound) can still leave the others split.

    Raises :class:`~cupy_symbuf.SymBufferError` when a peer's message belongs to another step (``what`` differs: a
    stale message of an earlier exchange that timed out, or ranks calling different steps).
    ``on_slow``: ``(seconds, fn)``: ``fn(missing_ranks)`` is called once when the wait takes longer than that.
    """
    rank, size = comm.Get_rank(), comm.Get_size()
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
        got = _gather(comm, _HERE, what, peers, state, role, timeout_s)
        heard = time.monotonic()
        if heard > deadline:  # heard from everyone, but too late: a peer may have withdrawn already
            raise CollectiveTimeoutError(rank=rank, missing=sorted(state.get("late") or peers), what=what,
                                         role=role, timeout_s=timeout_s, late=True)
        for r, (_, v) in got.items():
            out[r] = v
        sends += [comm.isend((_CONFIRM, what, None), dest=r, tag=TAG) for r in peers]
        state["deadline"] = heard + max(t for t, _ in got.values()) + DELIVERY_GRACE_S
        _gather(comm, _CONFIRM, what, peers, state, role, timeout_s)
        return out
    except CollectiveTimeoutError:
        # also after a peer's withdrawal: peers already in the second round must not wait for our confirm
        sends += [comm.isend((_WITHDRAWN, what, None), dest=r, tag=TAG) for r in peers]
        raise
    finally:
        pending = [req for req in sends if not req.test()[0]]
        _ORPHANS.extend(pending)  # small messages complete eagerly; these keep their buffers alive if not


def _gather(comm, kind: str, what: str, peers: list, state: dict, role: str, timeout_s: float) -> dict:
    """One message of ``kind`` from every rank of ``peers``, by the deadline in ``state``."""
    from ..common.errors import SymBufferError
    rank = comm.Get_rank()
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
                                     f"ranks are not calling the same step (or a message of an earlier step that "
                                     f"timed out arrived late)")
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


def barrier(comm: MPI.Comm, timeout_s: float, what: str, *, role: str = "close", on_slow=None) -> None:
    """``comm.Barrier()`` bounded by ``timeout_s`` (:class:`CollectiveTimeoutError` names the missing ranks)."""
    exchange_all(comm, None, timeout_s, what, role=role, on_slow=on_slow)


def discard_leftovers(comm: MPI.Comm) -> int:
    """Receive and drop every message of ours already queued on ``comm`` (leftovers of exchanges that timed out);
    returns how many. Call it on every rank, after a barrier, before freeing a communicator that saw a timeout:
    MPI may hand a freed communicator's unreceived messages to a later one."""
    n = 0
    while True:
        msg = comm.improbe(source=MPI.ANY_SOURCE, tag=TAG)
        if msg is None:
            return n
        msg.recv()
        n += 1


def raise_if_any_failed(verdicts: list, where: str, exc_type=ValueError) -> None:
    """``verdicts[r]`` is ``None`` or rank ``r``'s error text (a local check failed there): raise on every rank, alike,
    naming the first failing rank."""
    for r, v in enumerate(verdicts):
        if v is not None:
            raise exc_type(f"{where}: rank {r}: {v}")


# ---- construction fingerprint ------------------------------------------------------------------------------

def fingerprint(config, layout, backend: str) -> dict:
    """Everything that shapes the wire, as ``{field: value}`` (plain, comparable values), in a fixed order."""
    import dataclasses

    from .. import __version__
    from . import kernels as _kernels
    from ..wire import plan as _plan
    from ..wire import protocol as _protocol
    fp: dict = {}
    for f in dataclasses.fields(config):
        if f.name not in LOCAL_POLICY_FIELDS:
            fp[f"config.{f.name}"] = getattr(config, f.name)
    fp["config.copy_engine"] = getattr(config, "mode", "auto") == "copy_engine"  # a CE call needs every rank in it
    for name in ("world_size", "num_channels", "num_slots", "chunk_bytes", "max_notify_ints", "total_bytes"):
        fp[f"layout.{name}"] = getattr(layout, name)
    fp["backend"] = backend
    try:
        geo = _plan.kernel_geometry(layout.world_size)
        for name in ("max_threads", "ring_warps", "self_warps", "num_copy", "threads"):
            fp[f"kernel.{name}"] = getattr(geo, name)
    except ValueError as exc:  # world too large for the GPU kernel: the same on every rank of this size
        fp["kernel"] = f"n/a ({exc})"
    fp["defines"] = " ".join(_kernels._tuning_defines())  # as this process compiles (read once)
    if hasattr(_kernels, "_debug_defines"):
        fp["debug"] = " ".join(_kernels._debug_defines())
    else:  # pragma: no cover
        fp["debug"] = os.environ.get("CUPY_SYMBUF_DEBUG", "")
    if backend == "cuda" and hasattr(_kernels, "build_id"):
        fp["kernel.build_id"] = _kernels.build_id("ring_exchange.cu", _plan.ring_kernel_defines(layout.world_size))
    fp["package_version"] = __version__
    fp["protocol_version"] = _protocol.PROTOCOL_VERSION
    return fp


def check_agreement(fingerprints: list, where: str) -> None:
    """Raise ``ValueError`` (the same text on every rank) naming the first field where ranks differ, the values and
    the ranks holding each."""
    base = fingerprints[0]
    keys = list(base)
    for fp in fingerprints[1:]:
        keys += [k for k in fp if k not in keys]
    for key in keys:
        values = [fp.get(key, "<missing>") for fp in fingerprints]
        if any(v != values[0] for v in values):
            groups: dict = {}
            for r, v in enumerate(values):
                groups.setdefault(repr(v), []).append(r)
            parts = []
            for v, ranks in groups.items():
                who = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ",".join(map(str, ranks))
                parts.append(f"{who} {'has' if len(ranks) == 1 else 'have'} {v}")
            raise ValueError(f"{where}: ranks disagree on {key}: " + ", ".join(parts) +
                             " (every field that shapes the wire must be the same on every rank)")
