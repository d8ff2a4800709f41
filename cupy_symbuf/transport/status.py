"""The device error record and the launch ledger of one communicator (GPU): how a kernel's failure, or a peer's
rejection of a queued call, reaches the host.

Every kernel a communicator launches (the ring, count-exchange and copy-engine kernels of ``transport/cuda.py``,
the low-latency kernels of ``moe/low_latency.py``) is numbered by the communicator's one :class:`LaunchLedger` and
writes into its one host-mapped error record, :class:`DeviceStatus` (``STATUS_*`` int64 words of
``wire/protocol.py``; the kernels' side is ``report_error`` / ``record_rejection`` of ``cuda_src/protocol.cuh``).
The host decodes the record here only: :meth:`DeviceStatus.check` raises a fatal failure (timeout, mismatch,
abort, broken invariant) naming the operation whose launch failed; :meth:`DeviceStatus.take_rejected` and
:meth:`DeviceStatus.rejected_error` report a peer's rejection of a queued call (not fatal).
"""
from __future__ import annotations

import ctypes
from typing import Optional

import numpy as np

from ..common import backend as _compat
from ..common.errors import (SymBufferMismatchError, SymBufferRejectedError, SymBufferTimeoutError, aborted_error,
                             mismatch_error)
from ..wire import protocol as P

__all__ = ["Pinned", "LaunchLedger", "DeviceStatus", "OPS_KEPT", "low_latency_rejection"]

#: Launches whose operation (and plan) the ledger remembers: a record naming an older launch says "an earlier
#: collective".
OPS_KEPT = 256


def low_latency_rejection(why: int, who: int, rank: int, own: int = 0, theirs: int = 0) -> str:
    """Why a low-latency call (``moe/low_latency.py``) was rejected, as the rank ``rank`` tells it: ``why`` the
    ``REJECT_*`` reason (host path: decided from the flag lines; GPU: ``STATUS_REJECTED_WHY``), ``who`` the rank it
    names, ``own`` / ``theirs`` the words the reason compares (``REJECT_HANDLE``: this rank's and ``who``'s
    dispatch ids; ``REJECT_TOPK``: ``who``'s dispatch id). The one wording of both backends."""
    if why == P.REJECT_HANDLE and min(own, theirs) < 0:  # (a rejected dispatch stores its id negated)
        whose, d = (f"rank {who}'s", -theirs) if theirs < 0 and who != rank else ("this rank's", -min(own, theirs))
        return (f"{whose} combine handle is of dispatch #{d}, which a rank rejected (it delivered nothing, so its "
                f"handle cannot be combined; on the GPU synchronize() after a dispatch raises that rejection before "
                f"its handle is used)")
    if why == P.REJECT_HANDLE:
        return (f"the ranks passed combine handles of different dispatches: this rank's handle is of dispatch #{own}, "
                f"rank {who}'s of dispatch #{theirs} (LowLatencyHandle.dispatch_id): every rank must combine with "
                f"the handle of the same dispatch")
    if why == P.REJECT_TOPK:
        if who == rank:
            return (f"this rank's topk_idx differs from the one the dispatch of its handle (#{theirs}) sent: combine "
                    f"takes that dispatch's topk_idx (equal values; a copy is fine)")
        return f"rank {who} rejected this call: its topk_idx differs from the one its dispatch sent (see its error)"
    if why == P.REJECT_SWITCH:
        return (f"rank {who} did not make this dispatch: it asked for another LowLatencyBuffer (deepep.Buffer: another "
                f"num_max_dispatch_tokens_per_rank, hidden, num_experts or dtype; see rank {who}'s error)")
    return rejection_text(who)


def rejection_text(who: int) -> str:
    """What a peer's rejection of a call says about rank ``who``, the one wording of every backend and call kind
    (its arguments failed its checks, or an exception such as ``KeyboardInterrupt`` came before anything moved)."""
    return (f"rank {who} rejected this call (its own arguments failed its checks, or it was interrupted before "
            f"anything moved; see rank {who}'s error)")


class Pinned:
    """Host-mapped pinned int64 array (``count`` words, zeroed), written by kernels and read by the host without a
    copy (UVA). ``ptr``: its address (device and host); ``array``: a NumPy view of it; :meth:`free` releases it."""

    def __init__(self, count: int):
        rt = _compat.cupy.cuda.runtime
        self.nbytes = 8 * count
        self.ptr = rt.hostAlloc(self.nbytes, rt.hostAllocMapped)
        self.array = np.ctypeslib.as_array((ctypes.c_int64 * count).from_address(self.ptr))
        self.array[:] = 0

    def free(self) -> None:
        if self.ptr:
            _compat.cupy.cuda.runtime.freeHost(self.ptr)
            self.ptr = 0


class LaunchLedger:
    """Numbers a communicator's kernel launches (1, 2, ...; the number a failing wait writes into the record,
    ``STATUS_SEQ``) and remembers the operation and plan of the last :data:`OPS_KEPT` of them."""

    __slots__ = ("seq", "_ops", "_plans")

    def __init__(self) -> None:
        #: launches so far (the number of the last one)
        self.seq = 0
        self._ops = [""] * OPS_KEPT
        self._plans = [None] * OPS_KEPT

    def next(self, op: str, plan=None) -> int:
        """Number a launch of ``op`` (``plan``: its :class:`~cupy_symbuf.wire.plan.ExchangePlan`, for messages in
        rows); returns its number."""
        n = self.seq + 1
        self.seq = n
        self._ops[n % OPS_KEPT] = op
        self._plans[n % OPS_KEPT] = plan
        return n

    def op(self, seq: int) -> str:
        """The operation of launch ``seq``; ``""`` when it is unknown (0, or too old)."""
        return self._ops[seq % OPS_KEPT] if 0 < seq and 0 <= self.seq - seq < OPS_KEPT else ""

    def plan(self, seq: int):
        """The plan of launch ``seq`` (None when it had none or is too old)."""
        return self._plans[seq % OPS_KEPT] if 0 < seq and 0 <= self.seq - seq < OPS_KEPT else None


class DeviceStatus:
    """The error record of one communicator's kernels (host-mapped int64 ``[STATUS_WORDS]``) and its
    :class:`LaunchLedger`, with the one decoder of the record.

    ``ptr``: the record's address, handed to every kernel; ``words``: the record as a NumPy array (``words[
    STATUS_FLAG]`` != 0: a kernel failed; the record stays set, so a failed communicator refuses further calls and
    queued waits give up at once). ``read_abort_line()``: the communicator's abort line (int64 ``[16]``), read to
    name the aborting rank.
    """

    def __init__(self, rank: int, timeout_s: float, read_abort_line) -> None:
        self.rank = rank
        self.timeout_s = timeout_s
        self.ledger = LaunchLedger()
        self._record = Pinned(P.STATUS_WORDS)
        self.ptr = self._record.ptr
        self.words = self._record.array
        #: a failure was raised by :meth:`check` (close() need not raise it again)
        self.reported = False
        #: STATUS_REJECTED_WHY of the last rejection taken (REJECT_*), and the words it names
        #: (STATUS_REJECTED_OWN / STATUS_REJECTED_PEER)
        self.rejected_why = P.REJECT_ARGS
        self.rejected_words = (0, 0)
        self._read_abort_line = read_abort_line

    def check(self, op: str, stream=None) -> None:
        """Raise the error a kernel recorded, if any; with ``stream``, wait for it first.

        Without ``stream`` this reads the host-mapped record without waiting: a failure shows as soon as a wait
        has recorded it. The record stays set. The error names the operation whose kernel failed, and ``op`` (the
        call that found it) when that was a later one: ``"<failed op> (queued earlier; found by <op>)"``.

        Raises
        ------
        SymBufferTimeoutError, SymBufferMismatchError, SymBufferAbortedError
            As recorded (see :meth:`error`).
        """
        if stream is not None:
            stream.synchronize()
        st = self.words
        if not st[P.STATUS_FLAG]:
            return
        if stream is None:  # order our reads of the fields after the flag (and let the failing kernels end)
            _compat.cupy.cuda.runtime.deviceSynchronize()
        info = [int(v) for v in st]
        seq = info[P.STATUS_SEQ]
        failed = self.ledger.op(seq)
        # after our own launch (stream given, same launch) the failure is this call's; else an earlier call's
        where = op if stream is not None and seq == self.ledger.seq and failed == op else \
            f"{failed or 'an earlier collective'} (queued earlier; found by {op})"
        self.reported = True
        raise self.error(where, info, self.ledger.plan(seq))

    def error(self, where: str, info: list, plan=None) -> Exception:
        """The exception of the record words ``info`` (ints, ``STATUS_*``) for operation ``where``: ``ERR_MISMATCH``
        :class:`~cupy_symbuf.SymBufferMismatchError` naming the field (and ``plan``'s rows), ``ERR_ABORTED``
        :class:`~cupy_symbuf.SymBufferAbortedError` naming the aborting rank (from the abort line), ``ERR_INVARIANT``
        a :class:`~cupy_symbuf.SymBufferMismatchError` of the debug checks, else (``ERR_TIMEOUT``)
        :class:`~cupy_symbuf.SymBufferTimeoutError`."""
        kind, field = info[P.STATUS_KIND], info[P.STATUS_FIELD]
        rank, peer, channel = info[P.STATUS_RANK], info[P.STATUS_PEER], info[P.STATUS_CHANNEL]
        head, tail = info[P.STATUS_HEAD], info[P.STATUS_TAIL]
        role = P.ROLE_NAMES.get(info[P.STATUS_ROLE], str(info[P.STATUS_ROLE]))
        if kind == P.ERR_MISMATCH:
            return mismatch_error(where, rank, peer, channel, field, head, tail, plan)
        if kind == P.ERR_ABORTED:
            return aborted_error(where, rank, self._read_abort_line())
        if kind == P.ERR_INVARIANT:
            return SymBufferMismatchError(
                f"{where}: CUPY_SYMBUF_DEBUG: {P.FIELD_NAMES.get(field, field)} on rank {rank}, peer {peer}, "
                f"channel {channel} ({role}: head={head} tail={tail})", rank=rank, peer=peer, channel=channel,
                op=where, field=P.FIELD_NAMES.get(field, str(field)), expected=head, got=tail)
        return SymBufferTimeoutError(rank=rank, peer=peer, channel=channel, role=role, head=head, tail=tail,
                                     timeout_s=self.timeout_s, op=where)

    def op_name(self, seq: int) -> str:
        """The operation of launch ``seq`` for messages (``"a queued collective"`` when unknown)."""
        return self.ledger.op(seq) or "a queued collective"

    def take_rejected(self) -> Optional[tuple]:
        """``(rejecting rank, launch seq)`` recorded by a kernel that saw a peer's rejection of its call
        (``STATUS_REJECTED_BY``), or None; clears it (and keeps its ``STATUS_REJECTED_WHY`` in
        :attr:`rejected_why`, ``STATUS_REJECTED_OWN`` / ``_PEER`` in :attr:`rejected_words`)."""
        st = self.words
        who = int(st[P.STATUS_REJECTED_BY])
        if not who:
            return None
        seq = int(st[P.STATUS_REJECTED_SEQ])
        self.rejected_why = int(st[P.STATUS_REJECTED_WHY])
        self.rejected_words = (int(st[P.STATUS_REJECTED_OWN]), int(st[P.STATUS_REJECTED_PEER]))
        for w in (P.STATUS_REJECTED_BY, P.STATUS_REJECTED_SEQ, P.STATUS_REJECTED_WHY, P.STATUS_REJECTED_OWN,
                  P.STATUS_REJECTED_PEER):
            st[w] = 0
        return who - 1, seq

    def rejected_error(self, op: str, who: int, seq: int) -> SymBufferRejectedError:
        """The :class:`~cupy_symbuf.SymBufferRejectedError` of a rejection :meth:`take_rejected` returned (rank
        ``who``, launch ``seq``), found by ``op``."""
        failed = self.op_name(seq)
        if self.rejected_why in (P.REJECT_HANDLE, P.REJECT_TOPK, P.REJECT_SWITCH):
            return SymBufferRejectedError(
                f"{failed} (queued earlier; found by {op}): "
                f"{low_latency_rejection(self.rejected_why, who, self.rank, *self.rejected_words)}; nothing was "
                f"delivered (zero counts / rows) and the LowLatencyBuffer stays usable", rank=self.rank,
                rejecting_rank=who, op=failed)
        if self.rejected_why == P.REJECT_SIG:
            return SymBufferRejectedError(
                f"{failed} (queued earlier; found by {op}): ranks disagree on the row format (dtype, hidden, "
                f"top-k, weights or num_experts): rank {who}'s differs from this rank's; nothing was exchanged "
                f"and the communicator stays usable", rank=self.rank, rejecting_rank=who, op=failed)
        if who == self.rank:
            what = "send_counts negative or not summing to the rows of sendbuf" if failed == "alltoallv" else \
                "a topk_idx value outside [-1, num_experts)"
            return SymBufferRejectedError(
                f"{failed} (queued earlier; found by {op}): this rank rejected its own arguments on the device "
                f"({what}); nothing was exchanged and the communicator stays usable", rank=self.rank,
                rejecting_rank=who, op=failed)
        return SymBufferRejectedError(
            f"{failed} (queued earlier; found by {op}): {rejection_text(who)}; the rows from rank {who} were not "
            f"delivered; the communicator stays usable", rank=self.rank, rejecting_rank=who, op=failed)

    def free(self) -> None:
        """Release the record (after every kernel that writes it ended)."""
        self._record.free()
