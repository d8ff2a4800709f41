"""Exceptions raised by cupy_symbuf."""
from __future__ import annotations

from ..wire import protocol as P

__all__ = ["SymBufferError", "SymBufferTimeoutError", "SymBufferClosedError", "SymBufferMismatchError",
           "SymBufferAbortedError", "SymBufferRejectedError", "SymBufferLeakWarning"]


class SymBufferError(RuntimeError):
    """Base class of cupy_symbuf runtime errors (not argument errors, which are ValueError/TypeError)."""


class SymBufferClosedError(SymBufferError):
    """A SymBuffer or Communicator was used after ``close()``."""


class SymBufferTimeoutError(SymBufferError):
    """A spin-wait on a channel ring (or the notify step) exceeded ``Config.timeout_s``.

    Attributes ``rank``, ``peer``, ``channel``, ``role`` ("send", "recv" or "notify"), ``head`` and ``tail``
    (ring counters in chunks; for notify, ``head`` is the epoch awaited and ``tail`` the epoch seen) say which
    wait expired. The ring counters of this communicator (and of its peers) are then inconsistent: it refuses
    further calls; close it on every rank and build a new Communicator. A LowLatencyBuffer's wait for a peer's flag
    line (``op`` ``low_latency_dispatch`` / ``low_latency_combine``, channel -1) raises it too, ``head`` the value
    awaited and ``tail`` the one seen.
    """

    def __init__(self, *, rank: int, peer: int, channel: int, role: str, head: int, tail: int,
                 timeout_s: float, op: str = ""):
        self.rank, self.peer, self.channel, self.role = rank, peer, channel, role
        self.head, self.tail, self.timeout_s, self.op = head, tail, timeout_s, op
        what = {"send": "sender waiting for the peer to hand slots back (head): the ring is full (tail - head == "
                        "capacity), or in direct / copy-engine mode the peer is still copying out of this rank's "
                        "sendbuf",
                "recv": "receiver waiting for data (tail == head)",
                "notify": "notify waiting for the peer's count (head = epoch awaited, tail = epoch seen)"}
        what = what.get(role, role)
        hint = "is not calling the same collective (or recv_counts given to alltoallv differ from what the peers send)"
        if op.startswith("low_latency_"):  # a LowLatencyBuffer's flag lines (channel -1)
            what = "waiting for the peer's flag line of this call (head = the value awaited, tail = the value seen)"
            hint = ("is not making the same calls of this LowLatencyBuffer in the same order (a combine where the "
                    "peer dispatches, or the other way round, waits here)")
        super().__init__(
            f"{op + ': ' if op else ''}timeout after {timeout_s:g} s on rank {rank}, peer {peer}, channel {channel}: "
            f"{what}; head={head} tail={tail}. A peer rank probably failed or {hint}.")


class SymBufferMismatchError(SymBufferError):
    """Ranks disagree on a collective: the call header a peer sent (or its notify slot, or its construction
    fingerprint) differs from this rank's call, so the data cannot be trusted.

    Attributes ``rank``, ``peer``, ``channel`` (-1 for the notify step), ``op`` (this rank's operation), ``field``
    (what differed, e.g. "operation", "row signature", "row count sent to this rank"), ``expected`` (this rank's
    value) and ``got`` (the peer's). Raised on every rank involved (the detecting rank sets the abort word on all
    ranks); the communicator is then unusable: close it on every rank.
    """

    def __init__(self, message: str, *, rank: int = -1, peer: int = -1, channel: int = -1, op: str = "",
                 field: str = "", expected=None, got=None):
        self.rank, self.peer, self.channel, self.op = rank, peer, channel, op
        self.field, self.expected, self.got = field, expected, got
        super().__init__(message)


class SymBufferAbortedError(SymBufferError):
    """Another rank (or this one) aborted the communicator: :meth:`Communicator.abort`, a timeout or a mismatch
    found there. ``aborting_rank`` names it, ``reason`` says why; the communicator is unusable."""

    def __init__(self, message: str, *, rank: int = -1, aborting_rank: int = -1, reason: str = "", op: str = ""):
        self.rank, self.aborting_rank, self.reason, self.op = rank, aborting_rank, reason, op
        super().__init__(message)


class SymBufferRejectedError(ValueError):
    """A collective was rejected by another rank's argument checks (the peer raised ``ValueError``/``TypeError``
    for its own arguments and told its peers through the call header or the count exchange). Nothing was
    delivered from that call; the communicator stays usable. ``rejecting_rank`` names the rank, ``op`` the call.
    """

    def __init__(self, message: str, *, rank: int = -1, rejecting_rank: int = -1, op: str = ""):
        self.rank, self.rejecting_rank, self.op = rank, rejecting_rank, op
        super().__init__(message)


# ---- the messages both engines raise (host engine, GPU error record) ---------------------------------------

def aborted_error(op: str, rank: int, line) -> SymBufferAbortedError:
    """The error a wait raises when the abort word (``protocol.ABORT_*`` words in ``line``) is set."""
    who, reason = int(line[P.ABORT_RANK]), int(line[P.ABORT_REASON])
    peer, channel, detail = int(line[P.ABORT_PEER]), int(line[P.ABORT_CHANNEL]), int(line[P.ABORT_DETAIL])
    why = P.ERR_NAMES.get(reason, f"reason {reason}")
    if reason == P.ERR_MISMATCH:
        why += f" ({P.FIELD_NAMES.get(detail, detail)})"
    where = f" with peer {peer}" if peer >= 0 else ""
    where += f" on channel {channel}" if channel >= 0 else ""
    return SymBufferAbortedError(
        f"{op}: rank {rank}: the communicator was aborted by rank {who}: {why}{where}. The communicator is "
        f"unusable: close it on every rank.", rank=rank, aborting_rank=who, reason=why, op=op)


def _signature_detail(op: str, peer: int, expected: int, got: int, plan) -> str:
    """What a call header's signature difference means. A combine or cached dispatch folds its handle's
    ``dispatch_id`` into the plan's signature (``protocol.call_signature``): with the plan at hand this rank's id
    is read back exactly, the peer's only if its rows are this rank's kind (else the number is arbitrary)."""
    mine = P.call_tag(plan.sig, expected) if plan is not None and not plan.reject else 0
    if not mine:
        if op.split(" ")[0] in ("combine", "dispatch"):
            return ("the peer's dtype, row shape or parts differ from this rank's, or (combine, cached dispatch) "
                    "the ranks passed handles of different dispatches")
        return "the peer's dtype, row shape or parts differ from this rank's"
    theirs = P.call_tag(plan.sig, got)
    which = f" (#{theirs}, if its rows have this rank's dtype and row shape)" if 0 < theirs < 1 << 24 else ""
    return (f"this rank passed the handle of dispatch #{mine} (DispatchHandle.dispatch_id), rank {peer} the handle "
            f"of another dispatch{which} or rows of another dtype or row shape; every rank must pass handles of "
            f"the same dispatch")


def _form_error(op: str, rank: int, peer: int, channel: int, expected: int, got: int) -> SymBufferMismatchError:
    """FIELD_FORM: this rank's call (``expected``, a ``protocol.form_word``) starts with a count exchange and the
    peer's (``got``) with call headers, or the other way round."""
    mine, theirs = P.form_text(expected), P.form_text(got)
    both = P.op_name(expected & (P.FORM_COUNTS - 1)), P.op_name(got & (P.FORM_COUNTS - 1))
    if both == ("alltoallv", "alltoallv"):
        rule = "every rank must pass recv_counts to alltoallv, or no rank (then the counts are exchanged)"
    elif both == ("dispatch", "dispatch"):
        rule = "every rank must pass a handle to dispatch (a cached dispatch), or no rank (an eager one)"
    else:
        rule = "every rank must make the same collective calls in the same order"
    if expected & P.FORM_COUNTS:
        found = f"rank {peer} sent a call header while this rank waited for its count"
    else:
        found = f"rank {peer} started a count exchange while this rank waited for its call header"
    return SymBufferMismatchError(
        f"{op}: ranks disagree on the form of the call: rank {rank} called {mine}, rank {peer} called {theirs} "
        f"({found}); {rule}. No data was returned; the communicator is unusable (every other rank raises this "
        f"error too, naming a peer in the other form, or SymBufferAbortedError, in this call or its next).",
        rank=rank, peer=peer, channel=channel, op=op,
        field=P.FIELD_NAMES[P.FIELD_FORM], expected=expected, got=got)


def mismatch_error(op: str, rank: int, peer: int, channel: int, field: int, expected, got,
                   plan=None) -> SymBufferMismatchError:
    """A peer's call header differs from this rank's call (both engines use this text)."""
    name = P.FIELD_NAMES.get(field, f"field {field}")
    if field == P.FIELD_CAPACITY:  # found by this rank's count exchange (no peer, no header): as the host path says it
        return SymBufferMismatchError(
            f"{op}: rank {rank} receives {got} rows, more than the output capacity {expected} (num_worst_tokens / "
            f"recv_capacity must bound what any rank can receive, e.g. num_tokens * world_size); nothing was copied "
            f"on this rank; the communicator is unusable (every other rank raises SymBufferAbortedError)",
            rank=rank, op=op, field="capacity", expected=expected, got=got)
    if field == P.FIELD_OP:
        detail = f"this rank called {P.op_name(expected)}, rank {peer} called {P.op_name(got)}"
    elif field == P.FIELD_UNITS:
        def rows(units):  # byte runs count bytes on the wire
            if plan is not None and plan.byte_run and plan.row_bytes > 1:
                return f"{units // plan.row_bytes} rows ({units} bytes)" if units % plan.row_bytes == 0 else \
                    f"{units} bytes"
            return f"{units} rows"
        detail = f"this rank expects {rows(expected)} from rank {peer} (its recv_counts), rank {peer} sends {rows(got)}"
    elif field == P.FIELD_MODE and expected == P.MODE_SMALL:
        detail = (f"this rank's call goes by the small-message protocol (at most Config.small_bytes per rank), rank "
                  f"{peer} sent this call through the rings (transfer mode {got}): its call has another size")
    elif field == P.FIELD_MODE:
        detail = (f"transfer mode {got} is none of ring ({P.MODE_RING}), direct ({P.MODE_DIRECT}) or cross-memory "
                  f"attach ({P.MODE_CMA}): not this protocol")
    elif field == P.FIELD_SIG:
        detail = _signature_detail(op, peer, expected, got, plan)
    elif field == P.FIELD_FORM:
        return _form_error(op, rank, peer, channel, expected, got)
    else:
        detail = f"expected {expected}, got {got}"
    return SymBufferMismatchError(
        f"{op}: ranks disagree on the call: rank {rank} received from rank {peer} (channel {channel}) a call header "
        f"whose {name} differs: {detail}. No data was returned; the communicator is unusable (every other rank "
        f"raises SymBufferAbortedError, in this call or its next).",
        rank=rank, peer=peer, channel=channel, op=op, field=name, expected=expected, got=got)


class SymBufferLeakWarning(UserWarning):
    """An open :class:`~cupy_symbuf.Communicator` was dropped without ``close()``: its symmetric buffer and MPI
    communicator stay allocated until the program exits (freeing is collective, so the garbage collector cannot do
    it). Shown by Python's default filters (unlike ``ResourceWarning``), once per process, naming where the
    communicator was created; ``cupy_symbuf.info()["live_communicators"]`` counts the ones still allocated.
    Silence it with ``warnings.filterwarnings("ignore", category=SymBufferLeakWarning)``."""
