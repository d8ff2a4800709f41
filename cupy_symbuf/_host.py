"""Host twin of the GPU kernels: the same ring protocol and wire format over the MPI shared-memory window, with
NumPy copies.

A row exchange interprets the agreed :class:`~cupy_symbuf._plan.ExchangePlan`, as the GPU kernel interprets the
descriptor made from the same plan: per peer a stream in the same wire format (a byte stream cut on 16-byte
boundaries for one part in row order, else packed rows gathered from the parts through the token index and
scattered into the receive parts), cut into the same channel shares and the same ring chunks (the GPU's copy-warp
count, ``_plan.kernel_geometry``), each (channel, peer) stream preceded by its call header (``_protocol``), which
the receiver checks before it consumes a byte. A rank's rows to itself are copied directly, as on the GPU.

One progress loop per rank drives every (channel, peer) send stream and receive stream without blocking on any
one of them (the GPU gives each its own warp group; here a stream that cannot move is skipped), so no peer can
block another. Ordering: payload copy, ``Win.Sync()`` (memory barrier), then the ``tail`` store; the receiver
reads ``tail``, ``Win.Sync()``, copies out, ``Win.Sync()``, then stores ``head``. Waiting yields the CPU (CI runs
4 ranks on 2 cores).
"""
from __future__ import annotations

import math
import os
import time

import numpy as np

from . import _protocol as P
from .errors import SymBufferMismatchError, SymBufferTimeoutError, aborted_error, mismatch_error
from .layout import ChannelLayout

#: CUPY_SYMBUF_DEBUG=1: check every slot offset against its region and the ring invariants (read once).
DEBUG = os.environ.get("CUPY_SYMBUF_DEBUG", "") not in ("", "0")

__all__ = ["HostTransport"]


def _bytes2d(a: np.ndarray) -> np.ndarray:
    """``a`` (rows, i.e. all axes after the first, contiguous in memory) as ``uint8 [rows, row_width_bytes]``; a
    view (writes go to ``a``)."""
    return a.reshape(a.shape[0], math.prod(a.shape[1:])).view(np.uint8)


class _Side:
    """One side (send or receive) of a row exchange: where stream unit ``u`` of peer ``p``'s stream lives.

    ``fill``/``drain`` copy units ``[u, u + n)`` of a peer stream between the parts and a packed ring slot.
    """

    def __init__(self, parts, index, units, byte_stream: bool, row_bytes: int):
        self.byte_stream = byte_stream
        self.units = units  # per peer: bytes of a byte stream, else rows (ExchangePlan.send_units / recv_units)
        if byte_stream:
            a = parts[0]
            self.flat = (a if a.flags.c_contiguous else np.ascontiguousarray(a)).reshape(-1).view(np.uint8)
        else:
            self.parts = []
            off = 0
            for a in parts:
                b = _bytes2d(a)
                self.parts.append((b, off, off + b.shape[1]))
                off += b.shape[1]
        self.index = index
        self.row_bytes = row_bytes
        self.first = np.concatenate([[0], np.cumsum(self.units)[:-1]]).astype(np.int64)

    def _tokens(self, p: int, u: int, n: int):
        r = int(self.first[p]) + u
        return self.index[r: r + n] if self.index is not None else slice(r, r + n)

    def fill(self, slot: np.ndarray, p: int, u: int, n: int) -> None:
        if self.byte_stream:
            r = int(self.first[p]) + u
            slot[:n] = self.flat[r: r + n]
            return
        rows = slot[: n * self.row_bytes].reshape(n, self.row_bytes)
        tok = self._tokens(p, u, n)
        for b, lo, hi in self.parts:
            rows[:, lo:hi] = b[tok]

    def drain(self, slot: np.ndarray, p: int, u: int, n: int) -> None:
        r = int(self.first[p]) + u
        if self.byte_stream:
            self.flat[r: r + n] = slot[:n]
            return
        rows = slot[: n * self.row_bytes].reshape(n, self.row_bytes)
        for b, lo, hi in self.parts:
            b[r: r + n] = rows[:, lo:hi]


class HostTransport:
    """Runs row exchanges and the notify step over a host :class:`~cupy_symbuf.SymBuffer`."""

    def __init__(self, buf, layout: ChannelLayout, timeout_s: float):
        self.buf = buf
        self.layout = layout
        self.timeout_s = timeout_s
        self.rank = buf.rank
        self.world_size = buf.world_size
        self.views = [buf.host_view(r) for r in range(self.world_size)]
        L = layout
        self._abort = [self._i64(r, L.abort_offset, P.HDR_WORDS) for r in range(self.world_size)]

    def _u64(self, rank: int, offset: int, n: int = 1) -> np.ndarray:
        return self.views[rank][offset: offset + 8 * n].view(np.uint64)

    def _i64(self, rank: int, offset: int, n: int = 1) -> np.ndarray:
        return self.views[rank][offset: offset + 8 * n].view(np.int64)

    # ---- abort word ------------------------------------------------------------------------------------------
    def set_abort(self, reason: int, peer: int = -1, channel: int = -1, detail: int = 0) -> None:
        """Write this rank's abort into every rank's abort line (fields first, then the flag): every wait of
        every rank leaves with :class:`SymBufferAbortedError` naming this rank. The first abort seen wins."""
        if self._abort[self.rank][P.ABORT_FLAG]:
            return
        for line in self._abort:
            line[P.ABORT_RANK], line[P.ABORT_REASON] = self.rank, reason
            line[P.ABORT_PEER], line[P.ABORT_CHANNEL], line[P.ABORT_DETAIL] = peer, channel, detail
        self.buf.sync()
        for line in self._abort:
            line[P.ABORT_FLAG] = 1
        self.buf.sync()

    def check_abort(self, op: str) -> None:
        """Raise :class:`SymBufferAbortedError` when the abort word of this rank is set."""
        line = self._abort[self.rank]
        if line[P.ABORT_FLAG]:
            self.buf.sync()
            raise aborted_error(op, self.rank, line)

    # ---- row exchange ---------------------------------------------------------------------------------------
    def exchange_rows(self, plan, send_parts, send_index, recv_parts, op: str) -> list:
        """Run one call of ``plan`` (:class:`~cupy_symbuf._plan.ExchangePlan`): every (channel, peer) stream sends
        its call header and its chunks and receives the peer's; returns the ranks whose header said they rejected
        the call (their rows are not delivered; the rings stay in step). ``send_parts``: arrays ``[n, ...]`` with
        contiguous rows; ``send_index``: int64 ``[sum(send_counts)]`` or None; ``recv_parts``: C-contiguous.

        Raises :class:`SymBufferMismatchError` (a peer's header differs: rank, peer, channel, field, both values),
        :class:`SymBufferTimeoutError` or :class:`SymBufferAbortedError`; the first two set the abort word on every
        rank first.
        """
        L = self.layout
        me, W = self.rank, self.world_size
        self.check_abort(op)
        send = recv = None
        if not plan.reject:
            send = _Side(send_parts, send_index, plan.send_units, plan.byte_stream, plan.row_bytes)
            recv = _Side(recv_parts, None, plan.recv_units, plan.byte_stream, plan.row_bytes)
            n_self = int(plan.send_units[me])
            if n_self:  # to ourselves: no ring (as on the GPU)
                scratch = np.empty(n_self * plan.unit_bytes, dtype=np.uint8)
                send.fill(scratch, me, 0, n_self)
                recv.drain(scratch, me, 0, n_self)
        if W == 1:
            return []
        pairs = [(c, p) for c in range(L.num_channels) for p in range(W) if p != me]
        sends = [self._stream(plan, c, p, sender=True) for c, p in pairs]
        recvs = [self._stream(plan, c, p, sender=False) for c, p in pairs]
        rejected = set()
        chunk, num_slots = L.chunk_bytes, L.num_slots
        sync = self.buf.sync
        last_progress = time.monotonic()
        idle = 0
        while sends or recvs:
            progressed = False
            for s in list(sends):
                head = int(s.counter[0])
                sync()
                if DEBUG:
                    self._check_ring(op, s, head, s.pos_counter, "send")
                moved = 0
                while s.pending() and s.pos_counter - head < num_slots:
                    off = s.ring_off + (s.pos_counter % num_slots) * chunk
                    slot = s.ring[off: off + chunk]
                    if s.header is not None:  # the call header goes first, in its own slot
                        slot[: 8 * P.HDR_WORDS].view(np.int64)[:] = s.header
                        s.header = None
                    else:
                        n = min(s.per_chunk, s.end - s.pos)
                        send.fill(slot, s.p, s.pos, n)
                        s.pos += n
                    s.pos_counter += 1
                    moved += 1
                if moved:
                    sync()  # payload before tail
                    s.remote[0] = s.pos_counter
                    progressed = True
                if not s.pending():
                    s.state[P.STATE_COUNTER], s.state[P.STATE_SEQ] = s.pos_counter, s.seq
                    sends.remove(s)
            for r in list(recvs):
                tail = int(r.counter[0])
                if tail <= r.pos_counter:
                    continue
                sync()  # tail before payload
                if DEBUG:
                    self._check_ring(op, r, r.pos_counter, tail, "recv")
                while r.pos_counter < tail and r.pending():
                    off = r.ring_off + (r.pos_counter % num_slots) * chunk
                    slot = r.ring[off: off + chunk]
                    if not r.checked:
                        hdr = slot[: 8 * P.HDR_WORDS].view(np.int64).copy()
                        self._check_header(op, plan, r, hdr)
                        r.checked = True
                        if hdr[P.HDR_STATUS] == P.HDR_REJECTED:
                            rejected.add(r.p)
                            r.end = r.pos       # nothing follows
                        elif plan.reject:
                            r.drain = int(hdr[P.HDR_NCHUNKS])  # skip the peer's payload without copying
                    elif r.drain:
                        r.drain -= 1
                    else:
                        n = min(r.per_chunk, r.end - r.pos)
                        recv.drain(slot, r.p, r.pos, n)
                        r.pos += n
                    r.pos_counter += 1
                sync()  # reads of the slots before head
                r.remote[0] = r.pos_counter
                progressed = True
                if not r.pending():
                    r.state[P.STATE_COUNTER], r.state[P.STATE_SEQ] = r.pos_counter, r.seq
                    recvs.remove(r)
            if progressed:
                last_progress = time.monotonic()
                idle = 0
                continue
            idle += 1
            self.check_abort(op)
            if time.monotonic() - last_progress > self.timeout_s:
                if recvs:
                    r = recvs[0]
                    self.set_abort(P.ERR_TIMEOUT, r.p, r.c)
                    raise SymBufferTimeoutError(rank=me, peer=r.p, channel=r.c, role="recv", head=r.pos_counter,
                                                tail=int(r.counter[0]), timeout_s=self.timeout_s, op=op)
                s = sends[0]
                self.set_abort(P.ERR_TIMEOUT, s.p, s.c)
                raise SymBufferTimeoutError(rank=me, peer=s.p, channel=s.c, role="send", head=int(s.counter[0]),
                                            tail=s.pos_counter, timeout_s=self.timeout_s, op=op)
            _yield(idle)
        return sorted(rejected)

    def _stream(self, plan, c: int, p: int, *, sender: bool) -> "_Stream":
        """This call's side of the (channel ``c``, peer ``p``) ring: its state line (counter and calls), its share
        of the peer's stream, and the lines it reads (``counter``, in our buffer) and writes (``remote``, in the
        peer's): a sender reads head and writes tail into ``p``'s ring; a receiver the mirror image."""
        L, me = self.layout, self.rank
        state = self._u64(me, (L.send_tail_offset if sender else L.recv_head_offset)(c, p), 2)
        first, seq = int(state[P.STATE_COUNTER]), int(state[P.STATE_SEQ]) + 1
        units = (plan.send_units if sender else plan.recv_units)[p]
        lo, hi = plan.channel_range(units, c) if not plan.reject else (0, 0)
        if sender:
            return _Stream(c, p, first, seq, lo, hi, plan.rows_per_chunk(lo, hi), state,
                           counter=self._u64(me, L.head_offset(c, p)), remote=self._u64(p, L.tail_offset(c, me)),
                           ring=self.views[p], ring_off=L.ring_offset(c, me), header=plan.header(seq, p, c))
        return _Stream(c, p, first, seq, lo, hi, plan.rows_per_chunk(lo, hi), state,
                       counter=self._u64(me, L.tail_offset(c, p)), remote=self._u64(p, L.head_offset(c, me)),
                       ring=self.views[me], ring_off=L.ring_offset(c, p), header=None)

    def _check_header(self, op: str, plan, r: "_Stream", hdr: np.ndarray) -> None:
        """The receiver's check of a peer's call header, before any payload (same order as the kernel)."""
        checks = [(P.FIELD_MAGIC, P.HDR_MAGIC_VALUE, int(hdr[P.HDR_MAGIC])),
                  (P.FIELD_SEQ, r.seq, int(hdr[P.HDR_SEQ])),
                  (P.FIELD_OP, plan.op_code, int(hdr[P.HDR_OP]))]
        if hdr[P.HDR_STATUS] == P.HDR_OK and not plan.reject:
            checks += [(P.FIELD_SIG, plan.sig, int(hdr[P.HDR_SIG])),
                       (P.FIELD_UNITS, int(plan.recv_units[r.p]), int(hdr[P.HDR_UNITS]))]
        for field, expected, got in checks:
            if expected != got:
                self.set_abort(P.ERR_MISMATCH, r.p, r.c, field)
                raise mismatch_error(op, self.rank, r.p, r.c, field, expected, got, plan)
        mine, theirs = plan.num_chunks(r.pos, r.end), int(hdr[P.HDR_NCHUNKS])
        if hdr[P.HDR_STATUS] == P.HDR_OK and not plan.reject and mine != theirs:
            # same units, other chunking: the engines cut differently (the kernel reports the same)
            self.set_abort(P.ERR_INVARIANT, r.p, r.c, P.FIELD_RING)
            raise SymBufferMismatchError(
                f"{op}: rank {self.rank} and rank {r.p} cut channel {r.c} into different chunks ({mine} vs "
                f"{theirs}): the ranks run different engines or builds", rank=self.rank, peer=r.p, channel=r.c,
                op=op, field=P.FIELD_NAMES[P.FIELD_RING], expected=mine, got=theirs)

    def _check_ring(self, op: str, st: "_Stream", head: int, tail: int, role: str) -> None:
        """CUPY_SYMBUF_DEBUG: ring invariants ``head <= tail <= head + capacity`` and the slot inside its region."""
        L = self.layout
        ok = head <= tail <= head + L.num_slots
        region_end = L.region_offset(st.c, st.p if role == "recv" else self.rank) + L.region_bytes
        slot_end = st.ring_off + (st.pos_counter % L.num_slots + 1) * L.chunk_bytes
        if not ok or slot_end > region_end:
            field = P.FIELD_RING if not ok else P.FIELD_OFFSET
            self.set_abort(P.ERR_INVARIANT, st.p, st.c, field)
            raise SymBufferMismatchError(
                f"{op}: CUPY_SYMBUF_DEBUG: {P.FIELD_NAMES[field]} on rank {self.rank}, peer {st.p}, channel {st.c} "
                f"({role}: head={head} tail={tail} capacity={L.num_slots}, slot end {slot_end} region end "
                f"{region_end})", rank=self.rank, peer=st.p, channel=st.c, op=op, field=P.FIELD_NAMES[field],
                expected=head, got=tail)

    # ---- notify ---------------------------------------------------------------------------------------------
    def notify(self, send_meta: np.ndarray, epoch: int, op: str = "notify", *, op_code: int = 0, status: int = 0,
               sig: int = 0, wait: bool = True) -> np.ndarray:
        """Count exchange: ``send_meta`` int64 ``[world_size, M]``; returns int64 ``[world_size, 3 + M]`` whose row
        ``s`` is rank ``s``'s ``[op, status, signature, values for this rank...]``. Slots double-buffered by
        ``epoch % 2``; every wait is bounded and polls the abort word. (``wait``: the GPU engine's; the host
        engine always completes the exchange.)"""
        L = self.layout
        me = self.rank
        W, M = send_meta.shape
        parity = epoch % 2
        H = P.NOTIFY_HDR_WORDS
        off = L.notify_slot_offset(parity, me)
        for p in range(W):
            slot = self.views[p][off: off + 8 * (H + M)].view(np.int64)
            slot[P.NOTIFY_OP], slot[P.NOTIFY_STATUS], slot[P.NOTIFY_SIG] = op_code, status, sig
            slot[H:] = send_meta[p]
        self.buf.sync()
        for p in range(W):
            self.views[p][off: off + 8].view(np.int64)[P.NOTIFY_EPOCH] = epoch
        out = np.empty((W, H - 1 + M), dtype=np.int64)
        start = time.monotonic()
        idle = 0
        for s in range(W):
            off = L.notify_slot_offset(parity, s)
            slot = self.views[me][off: off + 8 * (H + M)].view(np.int64)
            while int(slot[P.NOTIFY_EPOCH]) < epoch:
                idle += 1
                self.check_abort(op)
                if time.monotonic() - start > self.timeout_s:
                    self.set_abort(P.ERR_TIMEOUT, s, -1)
                    raise SymBufferTimeoutError(rank=me, peer=s, channel=-1, role="notify", head=epoch,
                                                tail=int(slot[P.NOTIFY_EPOCH]), timeout_s=self.timeout_s, op=op)
                _yield(idle)
                self.buf.sync()
            self.buf.sync()
            out[s] = slot[1:]
        return out


class _Stream:
    """One (channel, peer) side of a call on the host: the call header slot, then payload chunks."""

    __slots__ = ("c", "p", "pos_counter", "seq", "pos", "end", "per_chunk", "state", "counter", "remote", "ring",
                 "ring_off", "header", "checked", "drain")

    def __init__(self, c, p, first, seq, lo, hi, per_chunk, state, *, counter, remote, ring, ring_off, header):
        self.c, self.p, self.pos_counter, self.seq = c, p, first, seq
        self.pos, self.end, self.per_chunk, self.state = lo, hi, per_chunk, state
        self.counter, self.remote, self.ring, self.ring_off = counter, remote, ring, ring_off
        self.header = header       # sender: the header still to send (None once sent)
        self.checked = None if header is not None else False  # receiver: the peer's header checked
        self.drain = 0             # receiver of a rejecting rank: peer chunks still to skip

    def pending(self) -> bool:
        """Sender: the header or chunks still to write; receiver: the header or chunks still to consume."""
        if self.is_sender:
            return self.header is not None or self.pos < self.end
        return not self.checked or self.pos < self.end or self.drain > 0

    @property
    def is_sender(self) -> bool:
        return self.checked is None


def _yield(idle: int) -> None:
    """Give the core away: sched_yield first, then short sleeps (oversubscribed CI: 4 ranks on 2 cores)."""
    if idle < 64:
        os.sched_yield()
    else:
        time.sleep(min(1e-3, 1e-6 * idle))
