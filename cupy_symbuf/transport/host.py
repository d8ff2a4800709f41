"""Host twin of the GPU kernels: the same ring protocol and wire format over the MPI shared-memory window, with
NumPy copies.

A row exchange interprets the agreed :class:`~cupy_symbuf.wire.plan.ExchangePlan`, as the GPU kernel interprets the
descriptor made from the same plan: per peer a run in the same wire format (a byte run cut on 16-byte
boundaries for one part in row order, else packed rows gathered from the parts through the token index and
scattered into the receive parts), cut into the same channel shares and into ring chunks by the same rule
(``layout.chunk_rows``, as many chunks as the GPU's copy warps for pipelining, but none smaller than
``protocol.HOST_CHUNK_LEAST_BYTES``, where a chunk's fixed Python cost would dominate), each
(channel, peer) run preceded by its call header (``wire/protocol.py``), which the receiver checks before it consumes
a byte. A run that fits one ring slot, goes direct or is rejected takes channel 0 alone
(``protocol.host_run_channels``: one loop on one core gains nothing from a second channel but its header round
trip); channel 0's header says how many channels carry the run, so a receiver starts the other channels' runs
only once it has read it; a run of at most ``HOST_CHUNK_LEAST_BYTES`` rides in its header's slot, after the header
words (``protocol.host_run_inline``). A rank's rows to itself are copied directly (no ring, no scratch), as on the GPU.

Direct mode (``plan.direct``: the send part is a symmetric array, ``Communicator.empty``): the sender's headers
say ``MODE_DIRECT`` and carry where its run to that receiver lies in its symmetric segment; no payload
follows. At the first of a sender's headers it reads, the receiver copies that sender's whole run straight out of
the sender's array (one copy per byte and one read per peer, like MPI's cross-memory attach; the sender's other
channels' headers must name the same place), then releases ``head`` past the header; the sender's call ends once
every peer's ``head`` has passed every channel's header (so its array is not changed while a peer still reads
it). The mode is the sender's: a receiver follows what each header says.

One progress loop per rank drives every (channel, peer) send run and receive run without blocking on any
one of them (the GPU gives each its own warp group; here a run that cannot move is skipped), so no peer can
block another. Ordering: payload copy, ``Win.Sync()`` (memory barrier), then the ``tail`` store; the receiver
reads ``tail``, ``Win.Sync()``, copies out, ``Win.Sync()``, then stores ``head``. Waiting yields the CPU (CI runs
4 ranks on 2 cores).
"""
from __future__ import annotations

import ctypes
import errno
import math
import os
import time

import numpy as np

from ..common.address import address_of
from . import cma as _cma
from .base import Transport, implements
from . import trace as _trace
from ..common.log import logger
from ..wire import protocol as P
from ..common.errors import SymBufferError, SymBufferMismatchError, SymBufferTimeoutError, aborted_error, mismatch_error
from ..wire.channel_layout import ChannelLayout

#: CUPY_SYMBUF_DEBUG=1: check every slot offset against its region and the ring invariants (read once).
DEBUG = os.environ.get("CUPY_SYMBUF_DEBUG", "") not in ("", "0")

__all__ = ["HostTransport", "Prepared"]


_U8 = np.dtype(np.uint8)


def _bytes2d(a: np.ndarray) -> np.ndarray:
    """``a`` (rows, i.e. all axes after the first, contiguous in memory) as ``uint8 [rows, row_width_bytes]``; a
    view (writes go to ``a``)."""
    return a.reshape(a.shape[0], math.prod(a.shape[1:])).view(np.uint8)


class _Side:
    """One side (send or receive) of a row exchange: where run unit ``u`` of peer ``p``'s run lives.

    ``fill``/``drain`` copy units ``[u, u + n)`` of a peer run between the parts and a packed ring slot;
    ``units`` / ``first`` are the plan's per-peer units and first units (``ExchangePlan``).
    """

    __slots__ = ("byte_run", "units", "first", "flat", "parts", "index", "row_bytes")

    def __init__(self, parts, index, units, first, byte_run: bool, row_bytes: int):
        self.byte_run = byte_run
        self.units = units
        self.first = first
        self.index = index
        self.row_bytes = row_bytes
        self.flat = self.parts = None
        if byte_run:
            flat = parts[0].reshape(-1)  # (a view of a C-contiguous part: the caller's contract; else a copy)
            self.flat = flat if flat.dtype is _U8 else flat.view(np.uint8)
        else:
            self.parts = []
            off = 0
            for a in parts:
                b = _bytes2d(a)
                self.parts.append((b, off, off + b.shape[1]))
                off += b.shape[1]

    def _tokens(self, p: int, u: int, n: int):
        r = int(self.first[p]) + u
        return self.index[r: r + n] if self.index is not None else slice(r, r + n)

    def fill(self, slot: np.ndarray, p: int, u: int, n: int) -> None:
        if self.byte_run:
            r = int(self.first[p]) + u
            slot[:n] = self.flat[r: r + n]
            return
        rows = slot[: n * self.row_bytes].reshape(n, self.row_bytes)
        tok = self._tokens(p, u, n)
        for b, lo, hi in self.parts:
            rows[:, lo:hi] = b[tok]

    def drain(self, slot: np.ndarray, p: int, u: int, n: int) -> None:
        r = int(self.first[p]) + u
        if self.byte_run:
            self.flat[r: r + n] = slot[:n]
            return
        rows = slot[: n * self.row_bytes].reshape(n, self.row_bytes)
        for b, lo, hi in self.parts:
            b[r: r + n] = rows[:, lo:hi]

    def copy_to(self, other: "_Side", me: int, n: int) -> None:
        """This rank's own ``n`` units, straight from the send parts into the receive parts (no ring, no scratch
        when both sides have the same part widths; else through one packed buffer)."""
        s0, r0 = int(self.first[me]), int(other.first[me])
        if self.byte_run:
            other.flat[r0: r0 + n] = self.flat[s0: s0 + n]
            return
        if [hi - lo for _, lo, hi in self.parts] == [hi - lo for _, lo, hi in other.parts]:
            tok = self._tokens(me, 0, n)
            for (src, _, _), (dst, _, _) in zip(self.parts, other.parts):
                if isinstance(tok, slice):
                    dst[r0: r0 + n] = src[tok]
                else:
                    np.take(src, tok, axis=0, out=dst[r0: r0 + n])
            return
        scratch = np.empty(n * self.row_bytes, dtype=np.uint8)
        self.fill(scratch, me, 0, n)
        other.drain(scratch, me, 0, n)


class _Static:
    """What one (channel, peer) run of a plan needs on every call, computed once per plan (``engine_data``):
    its share ``[lo, hi)`` and chunking, its state line, the counter lines it reads and writes, its ring, and
    the sender's header template."""

    __slots__ = ("c", "p", "lo", "hi", "per_chunk", "nchunks", "state", "counter", "remote", "ring", "ring_off",
                 "header", "slots")

    def __init__(self, c, p, lo, hi, per_chunk, nchunks, state, counter, remote, ring, ring_off, header, slots):
        self.c, self.p, self.lo, self.hi, self.per_chunk, self.nchunks = c, p, lo, hi, per_chunk, nchunks
        self.state, self.counter, self.remote, self.ring, self.ring_off = state, counter, remote, ring, ring_off
        self.header = header
        self.slots = slots  # per ring slot: (uint8 [chunk_bytes], its first HDR_WORDS as int64, the rest): no slicing


@implements(Transport)
class HostTransport:
    """Runs row exchanges and the notify step over a host :class:`~cupy_symbuf.SymBuffer` (a
    :class:`~cupy_symbuf.transport.base.Transport`)."""

    def __init__(self, buf, layout: ChannelLayout, timeout_s: float):
        self.buf = buf
        self.layout = layout
        self.timeout_s = timeout_s
        self.rank = buf.rank
        self.world_size = buf.world_size
        self.views = [buf.host_view(r) for r in range(self.world_size)]
        #: the communicator's symmetric arrays (:class:`~cupy_symbuf.symmetric.SymmetricHeap`), for direct mode
        self.heap = None
        #: every rank's pid when every rank can read every other's memory by cross-memory attach (:meth:`probe_cma`)
        self.cma_pids = None
        #: the channel telemetry (:class:`~cupy_symbuf.transport.trace.Recorder`) with ``Config(trace=True)``, else None
        self.trace = None
        L = layout
        self._abort = [self._i64(r, L.abort_offset, P.HDR_WORDS) for r in range(self.world_size)]
        #: Config(adaptive=True): the home map's workers per peer (send, recv), the order the progress loop serves
        #: the runs in (most workers first; adaptive.py), or None: channel then peer order
        self.visit = None
        #: relaxed calls (``sync="relaxed"``) in direct mode return before the peers handed their header slots
        #: back: (head line, counter awaited, channel, peer, the send parts) per run, awaited by the next
        #: collective (settle); the parts are kept alive until then (a contiguous copy or packed rows the library
        #: made for the call would otherwise be freed while a peer still reads them by cross-memory attach)
        self._pending = []
        #: (epoch parity, values per rank) -> the count exchange's slot views (:meth:`_notify_views`)
        self._notify_slots = {}
        #: (rank, ring offset) -> the views of that ring's slots (:meth:`_slot_views`)
        self._rings = {}
        #: cross-memory attach reads (its iovecs made once; this transport's calls are serialised)
        self._reader = _cma.Reader()
        #: the epoch of this rank's last count exchange (:meth:`notify`): a peer's notify slot of a later one, seen
        #: while this rank waits for its ring call header, means the ranks' calls start differently (FIELD_FORM)
        self._epoch = 0
        #: peer -> (its channel-0 ring tail in this rank's buffer, this rank's receiver state line of it), and
        #: (parity, peer) -> the epoch word of its notify slot here (:meth:`_form_lines`)
        self._form_cache = {}

    def set_home(self, load) -> None:
        """Adaptive channels: serve the runs in the order of ``load``'s home map (:class:`~cupy_symbuf.adaptive.
        ChannelLoad`; the peers with more workers first), the host twin of the GPU's warp homes."""
        from .adaptive import workers_per_peer
        self.visit = tuple(workers_per_peer(load.home[r], self.world_size, self.rank) for r in (0, 1))

    def settle(self, op: str) -> None:
        """Wait until every peer has copied the rows of this rank's earlier ``sync="relaxed"`` calls out of its
        sendbufs (their heads reached those calls' header slots): the guarantee a relaxed call defers to the next
        collective or ``synchronize()``. Bounded by ``timeout_s`` (then the abort word is set on every rank and
        :class:`SymBufferTimeoutError` names the rank, peer, channel, head and the counter awaited); polls the
        abort word."""
        if not self._pending:
            return
        start = time.monotonic()
        idle = 0
        while True:
            left = [w for w in self._pending if int(w[0][0]) < w[1]]
            if len(left) < len(self._pending):
                start, idle = time.monotonic(), 0  # bounded from the last progress, as the exchange loop is
            self._pending = left
            if not left:
                break
            self.check_abort(op)
            waited = time.monotonic() - start
            if waited > self.timeout_s:
                line, want, c, p, _ = self._pending[0]
                self.set_abort(P.ERR_TIMEOUT, p, c)
                raise SymBufferTimeoutError(rank=self.rank, peer=p, channel=c, role="send", head=int(line[0]),
                                            tail=want, timeout_s=self.timeout_s, op=op)
            idle += 1
            _yield(idle, waited)
        self.buf.sync()  # the peers' reads of our memory happened before their head stores we saw

    def synchronize(self, op: str = "synchronize") -> None:
        """:meth:`settle` (a host call completes before it returns: only relaxed calls leave anything owed)."""
        self.settle(op)

    def close(self) -> None:
        """Nothing of its own to release (the symmetric buffer is the communicator's); never a recorded error."""
        return None

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

    def probe_cma(self, bootstrap, timeout_s: float) -> bool:
        """Collective, at construction: can every rank read every other rank's memory by cross-memory attach
        (``process_vm_readv``)? Each rank publishes a probe word, every rank reads every peer's; when all succeed
        ``cma_pids`` is set and plain sendbufs may go ``MODE_CMA``. Bounded (the allgather of ``bootstrap``,
        a :class:`~cupy_symbuf.transport.bootstrap.Bootstrap`).
        ``CUPY_SYMBUF_CMA=0`` on any rank turns it off for the communicator (every rank then uses the rings for
        plain sendbufs)."""
        if self.world_size == 1:
            return False
        token = np.array([0x53594D42CA, os.getpid(), self.rank], dtype=np.int64)
        allowed = _cma.supported() and os.environ.get("CUPY_SYMBUF_CMA", "1").strip().lower() not in (
            "0", "false", "no", "off")
        mine = (os.getpid(), token.__array_interface__["data"][0]) if allowed else None
        everyone = bootstrap.allgather(mine, timeout_s, "cross-memory attach probe")
        ok = all(e is not None for e in everyone)
        if ok:
            got = np.zeros(3, np.int64)
            for r, (pid, addr) in enumerate(everyone):
                if r == self.rank:
                    continue
                try:
                    _cma.read_into(pid, addr, got.view(np.uint8))
                except OSError:
                    ok = False
                    break
                if got.tolist() != [0x53594D42CA, pid, r]:
                    ok = False
                    break
        results = bootstrap.allgather(ok, timeout_s, "cross-memory attach probe (results)")
        del token  # alive until every rank has read it (the second exchange)
        if all(results):
            self.cma_pids = [pid for pid, _ in everyone]
        return self.cma_pids is not None

    # ---- row exchange ---------------------------------------------------------------------------------------
    def exchange_rows(self, plan, send_parts, send_index, recv_parts, op: str, direct=None, *, tag: int = 0,
                      relaxed: bool = False) -> list:
        """Run one call of ``plan`` (:class:`~cupy_symbuf.wire.plan.ExchangePlan`): every (channel, peer) run sends
        its call header and its chunks and receives the peer's; returns the ranks whose header said they rejected
        the call (their rows are not delivered; the rings stay in step). ``send_parts``: arrays ``[n, ...]`` with
        contiguous rows; ``send_index``: int64 ``[sum(send_counts)]`` or None; ``recv_parts``: C-contiguous.
        ``direct`` (``plan.direct``): ``(MODE_DIRECT, SymmetricAllocation, byte offset)`` of a send part in a
        symmetric array, or ``(MODE_CMA, pid, address)`` of a plain one (cross-memory attach); each peer then
        copies its rows straight out of it and this call returns once every peer has, or (``relaxed``) once every
        header is out and every row received: the peers' copies are then awaited by the next call (:meth:`settle`).
        ``tag``: folded into the signature of this call's headers (``protocol.call_signature``; every peer must
        pass the same).

        Raises :class:`SymBufferMismatchError` (a peer's header differs: rank, peer, channel, field, both values),
        :class:`SymBufferTimeoutError` or :class:`SymBufferAbortedError`; the first two set the abort word on every
        rank first.
        """
        me, W = self.rank, self.world_size
        if self._abort[me][P.ABORT_FLAG]:  # a peer found a difference first: this rank names it too, if it is the form
            self._check_form_ring(op, plan, [p for p in range(W) if p != me])
            self.check_abort(op)
        if self._pending:
            self.settle(op)  # earlier relaxed calls: their sendbufs are the caller's again once this returns
        send = recv = None
        if not plan.reject:
            send = _Side(send_parts, send_index, plan.send_units, plan.send_first, plan.byte_run, plan.row_bytes)
            recv = _Side(recv_parts, None, plan.recv_units, plan.recv_first, plan.byte_run, plan.row_bytes)
        n_self = int(plan.send_units[me]) if not plan.reject else 0
        if W == 1:
            if n_self:
                t0 = time.monotonic()
                send.copy_to(recv, me, n_self)
                if self.trace is not None:
                    self.trace.begin(plan.op_code)
                    self.trace.add(_trace.SELF, t0, -1, -1, n_self * plan.unit_bytes, 0, 0)
            return []
        statics = plan.engine_data
        if statics is None:
            statics = plan.engine_data = self._statics(plan)
            logger.debug("%s: new plan: %s", op, plan)
        is_direct = plan.direct
        sig = P.call_signature(plan.sig, tag) if tag else plan.sig
        tagged = sig != plan.sig  # the plan's headers carry plan.sig: this call's goes in as each is sent
        tr = self.trace
        if tr is not None:
            tr.begin(plan.op_code)
        unit = plan.unit_bytes
        idle_t0 = None
        pulled = False
        sends = [x.start() for x in statics[0]]
        recvs = [r.start() for r in statics[1]]
        more = statics[2]
        if self.visit is not None:  # adaptive: the hot peers' runs first in every pass (stable: then channels)
            sw, rw = self.visit
            sends.sort(key=lambda x: -sw[x.p])
            recvs.sort(key=lambda r: -rw[r.p])
        if is_direct:
            mode, where, base = direct
            for x in sends:  # (the run's own header: every call of a direct plan sets these three words)
                x.header[P.HDR_MODE] = mode
                x.header[P.HDR_DIRECT_ALLOC] = where.id if mode == P.MODE_DIRECT else where
                x.header[P.HDR_DIRECT_OFFSET] = base + int(plan.send_first[x.p])
                x.pos = x.end  # no payload chunks: the peer copies them out of the symmetric array
        rejected = set()
        L = self.layout
        num_slots = L.num_slots
        sync = self.buf.sync
        last_progress = time.monotonic()
        idle = 0
        while sends or recvs:
            progressed = False
            for x in list(sends):
                head = int(x.counter[0])
                sync()
                if DEBUG:
                    self._check_ring(op, x, head, x.pos_counter, "send")
                moved = 0
                while (x.header is not None or x.pos < x.end) and x.pos_counter - head < num_slots:
                    slot, hdr, body = x.slots[x.pos_counter % num_slots]
                    if x.header is not None:  # the call header goes first, in its own slot
                        hdr[:] = x.header
                        hdr[P.HDR_SEQ] = x.seq
                        if tagged:
                            hdr[P.HDR_SIG] = sig
                        x.header = None
                        if x.inline:  # a short run rides in the header's slot, after the header words
                            t0 = time.monotonic() if tr is not None else 0.0
                            send.fill(body, x.p, x.pos, x.end - x.pos)
                            if tr is not None:
                                tr.add(_trace.SEND, t0, x.c, x.p, (x.end - x.pos) * unit, head, x.pos_counter + 1)
                            x.pos = x.end
                    else:
                        n = min(x.per_chunk, x.end - x.pos)
                        t0 = time.monotonic() if tr is not None else 0.0
                        send.fill(slot, x.p, x.pos, n)
                        x.pos += n
                        if tr is not None:
                            tr.add(_trace.SEND, t0, x.c, x.p, n * unit, head, x.pos_counter + 1)
                    x.pos_counter += 1
                    moved += 1
                if moved:
                    sync()  # payload before tail
                    x.remote[0] = x.pos_counter
                    progressed = True
                # done once all is written; in direct mode once the peer has consumed the header too (it copied
                # its rows out of our symmetric array)
                if x.header is None and x.pos >= x.end and (not is_direct or relaxed or head >= x.pos_counter):
                    if is_direct and head < x.pos_counter:  # relaxed: the next call waits for this head
                        self._pending.append((x.counter, x.pos_counter, x.c, x.p, send_parts))
                    x.state[P.STATE_COUNTER], x.state[P.STATE_SEQ] = x.pos_counter, x.seq
                    sends.remove(x)
                    progressed = True
            for r in list(recvs):
                tail = int(r.counter[0])
                if tail <= r.pos_counter:
                    continue
                sync()  # tail before payload
                if DEBUG:
                    self._check_ring(op, r, r.pos_counter, tail, "recv")
                while r.pos_counter < tail and (not r.checked or r.pos < r.end or r.drain > 0):  # still to consume
                    slot, hdr, body = r.slots[r.pos_counter % num_slots]
                    if not r.checked:
                        hdr = hdr.tolist()
                        self._check_header(op, plan, r, hdr, sig)
                        r.checked = True
                        if hdr[P.HDR_NCHANNELS] > 1 and r.c == 0 and hdr[P.HDR_STATUS] == P.HDR_OK:
                            # the run continues on other channels, each behind its own header
                            recvs.extend(m.start() for m in more[r.p][: hdr[P.HDR_NCHANNELS] - 1])
                        if hdr[P.HDR_STATUS] == P.HDR_REJECTED:
                            rejected.add(r.p)
                            r.end = r.pos       # nothing follows
                        elif plan.reject:
                            r.drain = int(hdr[P.HDR_NCHUNKS])  # skip the peer's payload without copying
                        elif hdr[P.HDR_MODE] != P.MODE_RING:  # the sender's mode: copy out of its array
                            t0 = time.monotonic() if tr is not None else 0.0
                            n = self._pull(op, plan, r, hdr, recv)
                            pulled = True
                            if tr is not None:
                                tr.add(_trace.PULL, t0, r.c, r.p, n * unit, r.pos_counter + 1, tail)
                        elif r.inline:  # the run is in the header's slot (the header said 0 chunks, as expected)
                            t0 = time.monotonic() if tr is not None else 0.0
                            recv.drain(body, r.p, r.pos, r.end - r.pos)
                            if tr is not None:
                                tr.add(_trace.RECV, t0, r.c, r.p, (r.end - r.pos) * unit, r.pos_counter + 1, tail)
                            r.pos = r.end
                    elif r.drain:
                        r.drain -= 1
                    else:
                        n = min(r.per_chunk, r.end - r.pos)
                        t0 = time.monotonic() if tr is not None else 0.0
                        recv.drain(slot, r.p, r.pos, n)
                        r.pos += n
                        if tr is not None:
                            tr.add(_trace.RECV, t0, r.c, r.p, n * unit, r.pos_counter + 1, tail)
                    r.pos_counter += 1
                sync()  # reads of the slots (and of the peer's symmetric array) before head
                r.remote[0] = r.pos_counter
                progressed = True
                if r.checked and r.pos >= r.end and r.drain <= 0:  # all consumed
                    r.state[P.STATE_COUNTER], r.state[P.STATE_SEQ] = r.pos_counter, r.seq
                    recvs.remove(r)
            if n_self:  # to ourselves, straight from the send rows to the receive rows (as on the GPU); after the
                # first headers and chunks are out, so the peers copy while this rank does
                t0 = time.monotonic() if tr is not None else 0.0
                send.copy_to(recv, me, n_self)
                if tr is not None:
                    tr.add(_trace.SELF, t0, -1, -1, n_self * unit, 0, 0)
                n_self = 0
                progressed = True
            if progressed:
                if idle_t0 is not None:  # tracing: the idle spell that just ended
                    tr.add(_trace.IDLE, idle_t0, -1, -1, 0, idle_sends, idle_recvs)
                    idle_t0 = None
                last_progress = time.monotonic()
                idle = 0
                continue
            idle += 1
            if tr is not None and idle_t0 is None:
                idle_t0, idle_sends, idle_recvs = time.monotonic(), len(sends), len(recvs)
            if recvs:  # the peers whose channel-0 call header of this call has not arrived (also once the abort
                # word is set: a peer found a difference first, and this rank names it too if it is the form)
                waiting = [r.p for r in recvs if r.c == 0 and r.checked is False]
                self._check_form_ring(op, plan, waiting)
                if self._abort[me][P.ABORT_FLAG]:  # (set after that look: the peer's slot came before it)
                    self._check_form_ring(op, plan, waiting)
            self.check_abort(op)
            if time.monotonic() - last_progress > self.timeout_s:
                if recvs:
                    r = recvs[0]
                    self.set_abort(P.ERR_TIMEOUT, r.p, r.c)
                    raise SymBufferTimeoutError(rank=me, peer=r.p, channel=r.c, role="recv", head=r.pos_counter,
                                                tail=int(r.counter[0]), timeout_s=self.timeout_s, op=op)
                x = sends[0]
                self.set_abort(P.ERR_TIMEOUT, x.p, x.c)
                raise SymBufferTimeoutError(rank=me, peer=x.p, channel=x.c, role="send", head=int(x.counter[0]),
                                            tail=x.pos_counter, timeout_s=self.timeout_s, op=op)
            _yield(idle, time.monotonic() - last_progress)
        if idle_t0 is not None:
            tr.add(_trace.IDLE, idle_t0, -1, -1, 0, idle_sends, idle_recvs)
        if pulled:
            # Rows copied straight out of a peer's memory are right only if that peer was still inside the call
            # while we read: a peer whose call failed sets the abort word before its program can touch its
            # sendbuf again, so a fence and one look at the abort word after the last copy tell a clean read from
            # a torn one (raised, never returned).
            sync()
            self.check_abort(op)
        return sorted(rejected) if rejected else []

    def _pull(self, op: str, plan, r: "_Run", hdr: list, recv: _Side) -> int:
        """Direct modes, at the checked call header of peer ``r.p`` (its words as Python ints; a direct run has
        this one header, on channel 0: ``protocol.host_run_channels``): copy the peer's whole run (one copy of each
        byte, one read per peer) straight out of the peer's symmetric array (segment and offset from the header,
        checked to lie inside the segment) or, ``MODE_CMA``, out of its plain array by ``process_vm_readv`` (the
        pid checked against the peer's). The run may not change before the peer's call ends: the sender waits for
        the ``head`` past its header, which this rank releases only after the copy. Returns the units copied."""
        mode, where, base = hdr[P.HDR_MODE], hdr[P.HDR_DIRECT_ALLOC], hdr[P.HDR_DIRECT_OFFSET]
        r.pos = r.end
        n = int(plan.recv_units[r.p])
        dst = int(plan.recv_first[r.p])
        if mode == P.MODE_CMA:
            nbytes = recv.flat.nbytes
            self._pull_cma(op, r, where, base, address_of(recv.flat) + dst if n and dst + n <= nbytes else 0,
                           n, dst, nbytes)
            return n
        alloc = self.heap.by_id(where) if self.heap is not None else None
        if alloc is None or base < 0 or base + n > alloc.nbytes:
            self.set_abort(P.ERR_MISMATCH, r.p, r.c, P.FIELD_OFFSET)
            state = "no live symmetric segment" if alloc is None else f"{alloc.nbytes} bytes"
            raise SymBufferMismatchError(
                f"{op}: rank {r.p}'s call header (channel {r.c}) points at {n} bytes at offset {base} of its "
                f"symmetric segment {where} ({state} here): the ranks' symmetric "
                f"allocations differ (every rank must make the same Communicator.empty calls in the same order)",
                rank=self.rank, peer=r.p, channel=r.c, op=op, field=P.FIELD_NAMES[P.FIELD_OFFSET],
                expected=n, got=base)
        if n:
            recv.flat[dst: dst + n] = alloc.peer_bytes(r.p)[base: base + n]
        return n

    def _pull_cma(self, op: str, r: "_Run", pid: int, addr: int, dst_address: int, n: int, dst: int,
                  out_nbytes: int) -> None:
        """``MODE_CMA``: copy peer ``r.p``'s ``n`` bytes at ``addr`` in process ``pid`` (checked against the peer's
        pid) to ``dst_address``, byte ``dst`` of an output of ``out_nbytes`` bytes, by ``process_vm_readv``. A
        failed read sets the abort word and raises :class:`SymBufferError` (:meth:`_cma_error`)."""
        try:
            if pid != self.cma_pids[r.p]:
                raise OSError(0, f"the header names pid {pid}, rank {r.p} is pid {self.cma_pids[r.p]}")
            if n:
                if dst + n > out_nbytes:  # (a raw write below: the plan and the output must agree)
                    raise AssertionError(f"{op}: internal: rank {r.p}'s {n} bytes at {dst} overrun the "
                                         f"output's {out_nbytes}")
                self._reader.read(pid, addr, dst_address, n)
        except OSError as exc:
            raise self._cma_error(op, r, pid, addr, n, exc) from None

    def _cma_error(self, op: str, r: "_Run", pid: int, addr: int, n: int, exc: OSError) -> SymBufferError:
        """A failed cross-memory attach read of peer ``r.p``'s ``n`` bytes at ``addr`` (pid ``pid``): sets the
        abort word (the peers raise :class:`SymBufferAbortedError`) and returns the error to raise."""
        gone = exc.errno == errno.ESRCH
        self.set_abort(P.ERR_LOCAL if gone else P.ERR_MISMATCH, r.p, r.c, P.FIELD_OFFSET)
        why = (f"rank {r.p}'s process (pid {pid}) is gone: it exited or was killed in the middle of the "
               f"call" if gone else f"{exc}")
        return SymBufferError(
            f"{op}: rank {self.rank} could not read rank {r.p}'s rows by cross-memory attach (channel "
            f"{r.c}, {n} bytes at {addr:#x}): {why}. The communicator is unusable (the other ranks "
            f"raise SymBufferAbortedError).")

    # ---- prepared calls: a call shape's exchange with its per-call set-up made once ------------------------
    def prepare_exchange(self, plan):
        """A :class:`Prepared` exchange of ``plan`` for :meth:`run_prepared`, or None when the plan is not one it
        runs: a byte run (one part, rows in order, C-contiguous on both sides), not rejected, more than one rank,
        direct only by cross-memory attach, every send run one ring slot (direct, or a run in its header's slot,
        or nothing), no telemetry and no ``CUPY_SYMBUF_DEBUG``. The receive side takes whatever the peers send."""
        if (plan.reject or not plan.byte_run or self.world_size == 1 or self.trace is not None or DEBUG or
                self.visit is not None or (plan.direct and self.cma_pids is None)):
            return None
        statics = plan.engine_data
        if statics is None:
            statics = plan.engine_data = self._statics(plan)
        sends = statics[0]
        if len(sends) != self.world_size - 1 or any(x.c or not (plan.direct or x.nchunks == 0) for x in sends):
            return None
        return Prepared(self, plan, statics)

    def run_prepared(self, prep: "Prepared", op: str, x_addr: int, out, out_addr: int) -> list:
        """One call of ``prep`` (:meth:`prepare_exchange`): the same protocol, headers and checks as
        :meth:`exchange_rows` for a C-contiguous send part at ``x_addr`` and the C-contiguous output ``out`` at
        ``out_addr`` (the shapes of the plan: the caller's contract), with the per-call set-up of the plan made once.
        Returns the ranks that rejected the call; raises as :meth:`exchange_rows`."""
        if prep.abort.value or self._pending:
            if prep.abort.value:
                me = self.rank
                self._check_form_ring(op, prep.plan, [p for p in range(self.world_size) if p != me])
                self.check_abort(op)
            self.settle(op)
        sync, ns, cma = prep.sync, prep.ns, prep.cma
        # every call header out (a run in its header's slot, or the place of the rows for cross-memory attach)
        for x, st, head, tail, hdr_of, tmpl, off, n, bodies in prep.sends:
            pc = st[0]
            seq = st[1] + 1
            if pc - head.value >= ns:  # the peer is still draining an earlier call's chunks
                x.pos_counter, x.seq = pc, seq
                self._wait_prepared(op, prep.plan, x, "send", pc - ns + 1)
            k = pc % ns
            tmpl[P.HDR_SEQ] = seq
            if cma:
                tmpl[P.HDR_DIRECT_OFFSET] = x_addr + off
            elif n:
                _memmove(bodies[k], x_addr + off, n)
            hdr_of[k][:] = tmpl
        sync()  # headers and payload before the tails
        for s in prep.sends:
            s[3].value = s[1][0] + 1
        if prep.n_self:  # the rows to itself, while the peers read theirs
            _memmove(out_addr + prep.r_self, x_addr + prep.s_self, prep.n_self)
        rejected = pulled = None
        for r, st, tail, head, hdr_of, bodies, want_units, pid, dst in prep.recvs:
            pc = st[0]
            seq = st[1] + 1
            if tail.value <= pc:
                r.start()
                self._wait_prepared(op, prep.plan, r, "recv", pc + 1)
            sync()  # tail before the header and the payload
            k = pc % ns
            hdr = hdr_of[k].tolist()
            if (hdr[P.HDR_MAGIC] == P.HDR_MAGIC_VALUE and hdr[P.HDR_SEQ] == seq and hdr[P.HDR_OP] == prep.op_code and
                    hdr[P.HDR_STATUS] == P.HDR_OK and hdr[P.HDR_SIG] == prep.sig and hdr[P.HDR_UNITS] == want_units
                    and hdr[P.HDR_NCHUNKS] == 0 and hdr[P.HDR_NCHANNELS] == 1):
                mode = hdr[P.HDR_MODE]
                if mode == P.MODE_CMA and hdr[P.HDR_DIRECT_ALLOC] == pid:
                    if want_units:
                        try:
                            self._reader.read(pid, hdr[P.HDR_DIRECT_OFFSET], out_addr + dst, want_units)
                        except OSError as exc:
                            r.start()
                            raise self._cma_error(op, r, pid, hdr[P.HDR_DIRECT_OFFSET], want_units, exc) from None
                    pulled = True
                elif mode == P.MODE_RING and r.inline:  # the run is in the header's slot
                    if want_units:
                        _memmove(out_addr + dst, bodies[k], want_units)
                else:
                    mode = None
            else:
                mode = None
            if mode is None:  # anything else: the full check, and the loop's ways
                r.start()
                self._check_header(op, prep.plan, r, hdr, prep.sig)
                r.checked = True
                if hdr[P.HDR_STATUS] == P.HDR_REJECTED:
                    rejected = (rejected or []) + [r.p]
                elif hdr[P.HDR_MODE] == P.MODE_CMA:
                    self._pull_cma(op, r, hdr[P.HDR_DIRECT_ALLOC], hdr[P.HDR_DIRECT_OFFSET], out_addr + dst,
                                   want_units, dst, prep.out_nbytes)
                    pulled = True
                else:  # a symmetric array, or chunks
                    pulled = self._recv_rest(op, prep.plan, r, hdr, out) or pulled
                    continue
            sync()  # reads of the slot (and of the peer's memory) before head
            head.value = pc + 1
            st[0], st[1] = pc + 1, seq
        for x, st, head, tail, hdr_of, tmpl, off, n, bodies in prep.sends:
            pc = st[0] + 1
            if cma and head.value < pc:  # the peer reads this rank's rows until its head passes the header
                x.pos_counter = pc
                self._wait_prepared(op, prep.plan, x, "send", pc)
            st[0] = pc
            st[1] += 1
        if pulled:  # as exchange_rows: a clean read from a peer still inside the call, not a torn one
            sync()
            if prep.abort.value:
                self.check_abort(op)
        return sorted(rejected) if rejected else []

    def _wait_prepared(self, op: str, plan, run: "_Run", role: str, want: int) -> None:
        """:meth:`run_prepared`'s bounded wait: until ``run``'s counter line (the peer's head for a sender, its
        tail for a receiver) reaches ``want``. Polls the abort word and, waiting for a peer's first call header,
        the call form (``_check_form_ring``); past ``timeout_s`` sets the abort word and raises
        :class:`SymBufferTimeoutError` naming the rank, peer, channel and counters."""
        line = run.counter
        if int(line[0]) >= want:
            return
        start = time.monotonic()
        idle = 0
        while int(line[0]) < want:
            idle += 1
            if role == "recv" and run.c == 0 and not run.checked:
                self._check_form_ring(op, plan, [run.p])
                if self._abort[self.rank][P.ABORT_FLAG]:
                    self._check_form_ring(op, plan, [run.p])
            self.check_abort(op)
            waited = time.monotonic() - start
            if waited > self.timeout_s:
                self.set_abort(P.ERR_TIMEOUT, run.p, run.c)
                if role == "recv":
                    raise SymBufferTimeoutError(rank=self.rank, peer=run.p, channel=run.c, role=role,
                                                head=run.pos_counter, tail=int(line[0]), timeout_s=self.timeout_s,
                                                op=op)
                raise SymBufferTimeoutError(rank=self.rank, peer=run.p, channel=run.c, role=role, head=int(line[0]),
                                            tail=want, timeout_s=self.timeout_s, op=op)
            _yield(idle, waited)
            if int(line[0]) >= want:
                break

    def _recv_rest(self, op: str, plan, r: "_Run", hdr: list, out) -> bool:
        """:meth:`run_prepared`, a peer's run that is not in its header's slot nor read by cross-memory attach (its
        checked header ``hdr`` at ``r.pos_counter``): a symmetric array (read as :meth:`_pull` does), or ring chunks,
        on channel 0 and the channels its header names, each drained in turn behind its own checked header (this
        rank's own headers are all out: nothing it waits for here waits for it). Returns whether rows were read out
        of the peer's memory."""
        recv = _Side([out], None, plan.recv_units, plan.recv_first, True, plan.row_bytes)
        ns = self.layout.num_slots
        sync = self.buf.sync
        if hdr[P.HDR_MODE] != P.MODE_RING:
            self._pull(op, plan, r, hdr, recv)
            r.pos_counter += 1
            sync()
            r.remote[0] = r.pos_counter
            r.state[P.STATE_COUNTER], r.state[P.STATE_SEQ] = r.pos_counter, r.seq
            return True
        runs = [r] + [m.start() for m in plan.engine_data[2].get(r.p, [])[: hdr[P.HDR_NCHANNELS] - 1]]
        for i, run in enumerate(runs):
            if i:  # another channel's header
                self._wait_prepared(op, plan, run, "recv", run.pos_counter + 1)
                sync()
                self._check_header(op, plan, run, run.slots[run.pos_counter % ns][1].tolist(), plan.sig)
                run.checked = True
            run.pos_counter += 1  # the header's slot
            sync()
            run.remote[0] = run.pos_counter
            while run.pos < run.end:
                self._wait_prepared(op, plan, run, "recv", run.pos_counter + 1)
                sync()
                n = min(run.per_chunk, run.end - run.pos)
                recv.drain(run.slots[run.pos_counter % ns][0], run.p, run.pos, n)
                run.pos += n
                run.pos_counter += 1
                sync()
                run.remote[0] = run.pos_counter
            run.state[P.STATE_COUNTER], run.state[P.STATE_SEQ] = run.pos_counter, run.seq
        return False

    def _statics(self, plan) -> tuple:
        """``(sends, recvs, more)``: the :class:`_Run` of every (channel, peer) run of ``plan`` on this rank, made
        from its :class:`_Static` (kept in ``plan.engine_data``; each call restarts them): the send runs on the
        channels each peer's run takes (``plan.run_channels``), the receive runs of channel 0, and per peer the
        receive runs of the other channels, started when that peer's channel-0 header names them
        (``HDR_NCHANNELS``)."""
        L, me = self.layout, self.rank
        out = ([], [], {})
        for sender, units_of in ((True, plan.send_units), (False, plan.recv_units)):
            for c in range(L.num_channels):
                for p in range(self.world_size):
                    if p == me:
                        continue
                    single = sender and (plan.direct or plan.reject)  # (a receiver expects the rings' cut)
                    if sender and c >= plan.run_channels(units_of[p], single):
                        continue  # the run goes on fewer channels: nothing at all on this one
                    lo, hi = plan.channel_range(units_of[p], c, single) if not plan.reject else (0, 0)
                    inline = not plan.reject and plan.run_inline(units_of[p], single)
                    per, nch = plan.rows_per_chunk(lo, hi), 0 if inline else plan.num_chunks(lo, hi)
                    if sender:
                        st = _Static(c, p, lo, hi, per, nch, self._u64(me, L.send_tail_offset(c, p), 2),
                                     self._u64(me, L.head_offset(c, p)), self._u64(p, L.tail_offset(c, me)),
                                     self.views[p], L.ring_offset(c, me), plan.header(0, p, c),
                                     self._slot_views(p, L.ring_offset(c, me)))
                    else:
                        st = _Static(c, p, lo, hi, per, nch, self._u64(me, L.recv_head_offset(c, p), 2),
                                     self._u64(me, L.tail_offset(c, p)), self._u64(p, L.head_offset(c, me)),
                                     self.views[me], L.ring_offset(c, p), None,
                                     self._slot_views(me, L.ring_offset(c, p)))
                    run = _Run(st, sender)
                    run.nchan = plan.run_channels(units_of[p], single)  # (receiver: what a ring header must say)
                    run.inline = inline
                    if sender or c == 0:
                        out[0 if sender else 1].append(run)
                    else:  # started once channel 0's header of the call says this channel carries the run too
                        out[2].setdefault(p, []).append(run)
        return out

    def _slot_views(self, rank: int, ring_off: int) -> list:
        """The slots of the ring at ``ring_off`` in ``rank``'s buffer: per slot ``(uint8 [chunk_bytes] view, int64
        [HDR_WORDS] view of its start, uint8 view of the rest: a short run's payload after its call header)``, made
        once per ring and shared by every plan."""
        key = (rank, ring_off)
        got = self._rings.get(key)
        if got is None:
            chunk, view = self.layout.chunk_bytes, self.views[rank]
            got = []
            for i in range(self.layout.num_slots):
                slot = view[ring_off + i * chunk: ring_off + (i + 1) * chunk]
                got.append((slot, slot[: 8 * P.HDR_WORDS].view(np.int64), slot[8 * P.HDR_WORDS:]))
            self._rings[key] = got
        return got

    def _check_header(self, op: str, plan, r: "_Run", hdr: list, sig: int) -> None:
        """The receiver's check of a peer's call header (its words as Python ints) against this rank's call
        signature ``sig``, before any payload (same order as the kernel)."""
        if hdr[P.HDR_MAGIC] == P.HDR_MAGIC_VALUE and hdr[P.HDR_SEQ] == r.seq and hdr[P.HDR_OP] == plan.op_code:
            if hdr[P.HDR_STATUS] != P.HDR_OK or plan.reject:
                return
            mode = hdr[P.HDR_MODE]
            if hdr[P.HDR_SIG] == sig and hdr[P.HDR_UNITS] == plan.recv_units[r.p] and (
                    (mode == P.MODE_RING and hdr[P.HDR_NCHUNKS] == r.nchunks and hdr[P.HDR_NCHANNELS] == r.nchan)
                    or (hdr[P.HDR_NCHUNKS] == 0 and hdr[P.HDR_NCHANNELS] == 1 and (
                        mode == P.MODE_DIRECT or (mode == P.MODE_CMA and self.cma_pids)))):
                return  # the common case: all agree
        checks = [(P.FIELD_MAGIC, P.HDR_MAGIC_VALUE, int(hdr[P.HDR_MAGIC])),
                  (P.FIELD_SEQ, r.seq, int(hdr[P.HDR_SEQ])),
                  (P.FIELD_OP, plan.op_code, int(hdr[P.HDR_OP]))]
        if hdr[P.HDR_STATUS] == P.HDR_OK and not plan.reject:
            mode = int(hdr[P.HDR_MODE])
            known = (P.MODE_RING, P.MODE_DIRECT) + ((P.MODE_CMA,) if self.cma_pids else ())
            checks += [(P.FIELD_MODE, mode if mode in known else P.MODE_RING, mode),
                       (P.FIELD_SIG, sig, int(hdr[P.HDR_SIG])),
                       (P.FIELD_UNITS, int(plan.recv_units[r.p]), int(hdr[P.HDR_UNITS]))]
        for field, expected, got in checks:
            if expected != got:
                self.set_abort(P.ERR_MISMATCH, r.p, r.c, field)
                raise mismatch_error(op, self.rank, r.p, r.c, field, expected, got, plan)
        direct = hdr[P.HDR_MODE] != P.MODE_RING
        k = int(hdr[P.HDR_NCHANNELS])
        if hdr[P.HDR_STATUS] != P.HDR_OK:
            want_k = 1  # a rejected run: channel 0's header alone
        elif plan.reject:
            want_k = k if 1 <= k <= self.layout.num_channels else 1  # (this rank follows what the peer sends)
        else:
            want_k = 1 if direct else r.nchan
        if k != want_k:
            # the same units spread over other channels: the engines cut differently
            self.set_abort(P.ERR_INVARIANT, r.p, r.c, P.FIELD_RING)
            raise SymBufferMismatchError(
                f"{op}: rank {self.rank} expects rank {r.p}'s rows on {want_k} channel(s), its call header (channel "
                f"{r.c}) says {k}: the ranks run different engines or builds", rank=self.rank, peer=r.p,
                channel=r.c, op=op, field=P.FIELD_NAMES[P.FIELD_RING], expected=want_k, got=k)
        mine, theirs = 0 if direct or r.inline else plan.num_chunks(r.pos, r.end), int(hdr[P.HDR_NCHUNKS])
        if hdr[P.HDR_STATUS] == P.HDR_OK and not plan.reject and mine != theirs:
            # same units, other chunking: the engines cut differently (the kernel reports the same)
            self.set_abort(P.ERR_INVARIANT, r.p, r.c, P.FIELD_RING)
            raise SymBufferMismatchError(
                f"{op}: rank {self.rank} and rank {r.p} cut channel {r.c} into different chunks ({mine} vs "
                f"{theirs}): the ranks run different engines or builds", rank=self.rank, peer=r.p, channel=r.c,
                op=op, field=P.FIELD_NAMES[P.FIELD_RING], expected=mine, got=theirs)

    def _check_ring(self, op: str, st: "_Run", head: int, tail: int, role: str) -> None:
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
        if self._pending:
            self.settle(op)
        me = self.rank
        self._epoch = epoch
        W, M = send_meta.shape
        H = P.NOTIFY_HDR_WORDS
        key = (epoch % 2, M)
        slots = self._notify_slots.get(key)
        if slots is None:
            slots = self._notify_slots[key] = self._notify_views(*key)
        outgoing, incoming = slots
        for p in range(W):
            slot = outgoing[p]
            slot[P.NOTIFY_OP], slot[P.NOTIFY_STATUS], slot[P.NOTIFY_SIG] = op_code, status, sig
            slot[H:] = send_meta[p]
        self.buf.sync()
        for p in range(W):
            outgoing[p][P.NOTIFY_EPOCH] = epoch
        out = np.empty((W, H - 1 + M), dtype=np.int64)
        start = time.monotonic()
        idle = 0
        for s in range(W):
            slot = incoming[s]
            while int(slot[P.NOTIFY_EPOCH]) < epoch:
                idle += 1
                self._check_form_notify(op, incoming, epoch, op_code, (s,))
                if self._abort[me][P.ABORT_FLAG]:  # a peer found a difference first: this rank names it too, if
                    self._check_form_notify(op, incoming, epoch, op_code, range(W))  # it is the form
                    self.check_abort(op)
                if time.monotonic() - start > self.timeout_s:
                    self.set_abort(P.ERR_TIMEOUT, s, -1)
                    raise SymBufferTimeoutError(rank=me, peer=s, channel=-1, role="notify", head=epoch,
                                                tail=int(slot[P.NOTIFY_EPOCH]), timeout_s=self.timeout_s, op=op)
                _yield(idle, time.monotonic() - start)
                self.buf.sync()
            self.buf.sync()
            out[s] = slot[1:]
        return out


    # ---- the call's form: a count exchange first, or call headers at once (FIELD_FORM) --------------------------
    def _form_lines(self, p: int) -> tuple:
        """``(tail line, receiver state line)`` of peer ``p``'s channel-0 ring in this rank's buffer (uint64 views)."""
        got = self._form_cache.get(p)
        if got is None:
            L, me = self.layout, self.rank
            got = self._form_cache[p] = (self._u64(me, L.tail_offset(0, p)), self._u64(me, L.recv_head_offset(0, p), 2))
        return got

    def _epoch_word(self, epoch: int, p: int) -> np.ndarray:
        """The epoch word of peer ``p``'s notify slot of ``epoch``'s parity in this rank's buffer (int64 [1])."""
        key = (epoch % 2, p)
        got = self._form_cache.get(key)
        if got is None:
            got = self._form_cache[key] = self._i64(self.rank, self.layout.notify_slot_offset(epoch % 2, p))
        return got

    def _ring_header_op(self, p: int):
        """The op code of a call header peer ``p`` sent on channel 0 that this rank has not consumed (0 when the slot
        holds no call header), or None when its channel-0 ring holds nothing new. Every ring call sends a channel-0
        header to every peer, the first thing of the call."""
        tail, state = self._form_lines(p)
        mine = int(state[P.STATE_COUNTER])
        if int(tail[0]) <= mine:
            return None
        self.buf.sync()  # tail before the slot
        hdr = self._slot_views(self.rank, self.layout.ring_offset(0, p))[mine % self.layout.num_slots][1]
        return int(hdr[P.HDR_OP]) if int(hdr[P.HDR_MAGIC]) == P.HDR_MAGIC_VALUE else 0

    def peers_waiting(self) -> list:
        """The peers that have begun a call this rank never joined (sorted; one look, no waiting): the first thing
        of every call reaches every peer at once, either a count exchange (the peer's notify slot of the epoch after
        this rank's last one) or a channel-0 call header (the peer's ring tail past what this rank's receiver
        consumed: every call this rank made consumed all its peers sent it in that call). A peer still finishing a
        call this rank completed, or not in a call, is not named. Read at exit, when this rank makes no more calls
        (``Communicator`` at exit: such a peer waits for this rank)."""
        me, nxt = self.rank, self._epoch + 1
        out = []
        for p in range(self.world_size):
            if p == me:
                continue
            tail, state = self._form_lines(p)
            if int(tail[0]) > int(state[P.STATE_COUNTER]) or int(self._epoch_word(nxt, p)[0]) >= nxt:
                out.append(p)
        return out

    def _check_form_notify(self, op: str, incoming: list, epoch: int, op_code: int, peers) -> None:
        """Inside the count exchange of ``epoch`` (``incoming``: every rank's slot here), of ``peers``: a peer whose
        channel-0 call header of a new call arrived while its slot of this epoch did not is in a call without a count
        exchange (it publishes its slot before any header of a call that has one). Then the
        abort word is set and :class:`SymBufferMismatchError` (FIELD_FORM) names that peer. The caller checks the
        rank it waits for on every poll and, once the abort word is set (a peer found the difference first), every
        peer before it raises the abort, so that this rank names the difference too."""
        me = self.rank
        for p in peers:
            if p == me or int(incoming[p][P.NOTIFY_EPOCH]) >= epoch:
                continue
            theirs = self._ring_header_op(p)
            if theirs is None:
                continue
            self.buf.sync()  # the header before the peer's slot: had it published its slot, it is visible now
            if int(incoming[p][P.NOTIFY_EPOCH]) >= epoch:
                continue
            self.set_abort(P.ERR_MISMATCH, p, 0, P.FIELD_FORM)
            raise mismatch_error(op, me, p, 0, P.FIELD_FORM, P.form_word(op_code, True), P.form_word(theirs, False))

    def _check_form_ring(self, op: str, plan, peers: list) -> None:
        """In a ring call (no count exchange), ``peers``: those whose channel-0 call header of this call this rank
        has not consumed yet. One whose header has not arrived either, but whose notify slot of the next epoch has,
        is in a call that starts with a count exchange (a peer in this rank's form sends that header before anything
        of its next call). Then the abort word is set and :class:`SymBufferMismatchError` (FIELD_FORM) names it."""
        nxt = self._epoch + 1
        for p in peers:
            tail, state = self._form_lines(p)
            word = self._epoch_word(nxt, p)
            if int(tail[0]) > int(state[P.STATE_COUNTER]) or int(word[0]) < nxt:
                continue
            self.buf.sync()  # the peer's slot before its header: had it sent the header, it is visible now
            if int(tail[0]) > int(state[P.STATE_COUNTER]):
                continue
            theirs = int(self._i64(self.rank, self.layout.notify_slot_offset(nxt % 2, p), P.NOTIFY_HDR_WORDS)[
                P.NOTIFY_OP])
            self.set_abort(P.ERR_MISMATCH, p, 0, P.FIELD_FORM)
            raise mismatch_error(op, self.rank, p, 0, P.FIELD_FORM, P.form_word(plan.op_code, False),
                                 P.form_word(theirs, True))

    def _notify_views(self, parity: int, M: int) -> tuple:
        """The count exchange's slots of ``parity`` for ``M`` values per rank, as int64 ``[NOTIFY_HDR_WORDS + M]``
        views: ``(this rank's slot in every rank's buffer, every rank's slot in this rank's buffer)``."""
        L, me, n = self.layout, self.rank, 8 * (P.NOTIFY_HDR_WORDS + M)
        off = L.notify_slot_offset(parity, me)
        outgoing = [self.views[p][off: off + n].view(np.int64) for p in range(self.world_size)]
        incoming = []
        for s in range(self.world_size):
            off = L.notify_slot_offset(parity, s)
            incoming.append(self.views[me][off: off + n].view(np.int64))
        return outgoing, incoming


class _Run:
    """One (channel, peer) side of a plan on the host: the call header slot, then payload chunks (none in direct
    mode). Made once per plan from its :class:`_Static` (kept in ``plan.engine_data``); every call restarts it
    (:meth:`start`) from the counters in its state line, so nothing of an earlier call, finished or failed,
    carries over."""

    __slots__ = ("c", "p", "pos_counter", "seq", "pos", "end", "per_chunk", "nchunks", "state", "counter", "remote",
                 "ring", "ring_off", "header", "checked", "drain", "slots", "lo", "hi", "sender_header", "nchan",
                 "inline")

    def __init__(self, st: _Static, sender: bool):
        self.c, self.p, self.per_chunk, self.nchunks, self.state = st.c, st.p, st.per_chunk, st.nchunks, st.state
        self.counter, self.remote, self.ring, self.ring_off = st.counter, st.remote, st.ring, st.ring_off
        self.slots = st.slots
        self.lo, self.hi = st.lo, st.hi
        self.sender_header = st.header if sender else None  # (this run's own: a direct call fills its mode and place)
        self.start()

    def start(self) -> "_Run":
        """Begin a call: counters from the state line, the share ``[lo, hi)`` still to move, the header (sender)
        still to send or (receiver) to check. Returns itself."""
        self.pos_counter, seq = self.state.tolist()
        self.seq = seq + 1
        self.pos, self.end = self.lo, self.hi
        self.header = self.sender_header  # sender: the header still to send (None once sent)
        self.checked = None if self.header is not None else False  # receiver: the peer's header checked
        self.drain = 0             # receiver of a rejecting rank: peer chunks still to skip
        return self

_memmove = ctypes.memmove


class Prepared:
    """A plan's exchange made ready for :meth:`HostTransport.run_prepared` (:meth:`HostTransport.prepare_exchange`): per
    send run its state line, the peer's head and tail as ctypes words, its header slots, its own header template
    (mode and pid set once for cross-memory attach), the byte offset and length of its rows in the send part and its
    slots' payload addresses; per channel-0 receive run its words, slots, the units and pid its peer's header must
    name and where its rows go; the rows to itself as byte offsets. Runs are the plan's (``engine_data``), shared
    with :meth:`HostTransport.exchange_rows`: both keep their counters in the state lines."""

    __slots__ = ("plan", "cma", "sends", "recvs", "n_self", "s_self", "r_self", "out_nbytes", "sync", "ns", "abort",
                 "op_code", "sig")

    def __init__(self, tr: "HostTransport", plan, statics):
        me = tr.rank
        self.plan, self.cma = plan, bool(plan.direct)
        self.op_code, self.sig = plan.op_code, plan.sig
        self.sync, self.ns = tr.buf._win.Sync, tr.layout.num_slots
        self.abort = ctypes.c_int64.from_buffer(tr._abort[me][P.ABORT_FLAG:P.ABORT_FLAG + 1])
        self.sends = []
        for x in statics[0]:
            tmpl = x.sender_header.copy()
            if self.cma:
                tmpl[P.HDR_MODE], tmpl[P.HDR_DIRECT_ALLOC] = P.MODE_CMA, tr.cma_pids[me]
            n = 0 if self.cma else x.hi - x.lo
            self.sends.append((x, _words(x.state, 2), _words(x.counter), _words(x.remote), [s[1] for s in x.slots],
                               tmpl, int(plan.send_first[x.p]) + x.lo, n, [address_of(s[2]) for s in x.slots]))
        self.recvs = []
        for r in statics[1]:
            units = int(plan.recv_units[r.p])
            self.recvs.append((r, _words(r.state, 2), _words(r.counter), _words(r.remote), [s[1] for s in r.slots],
                               [address_of(s[2]) for s in r.slots], units,
                               tr.cma_pids[r.p] if tr.cma_pids else -1, int(plan.recv_first[r.p])))
        self.n_self = int(plan.send_units[me])
        self.s_self, self.r_self = int(plan.send_first[me]), int(plan.recv_first[me])
        self.out_nbytes = int(plan.recv_units.sum())


def _words(line: np.ndarray, n: int = 1):
    """The first ``n`` words of a uint64 line of the symmetric buffer as ctypes (``.value`` / ``[i]``: Python ints,
    one load or store each)."""
    return (ctypes.c_uint64 * n).from_buffer(line) if n > 1 else ctypes.c_uint64.from_buffer(line)


def _yield(idle: int, waited_s: float) -> None:
    """Give the core away while waiting: ``sched_yield`` for the first ``SPIN_S`` seconds of a wait (a peer a chunk
    or a copy behind answers within that; a yield hands the core to any other runnable rank, so oversubscribed CI,
    4 ranks on 2 cores, still progresses), then sleeps growing to 1 ms. On the 2-core machine this, sleeping after
    64 polls, and never sleeping measured the same within its run-to-run noise (docs/perf-notes.md v10); a time
    bound keeps a peer that is one large copy behind from finding this rank asleep."""
    if waited_s < SPIN_S:
        os.sched_yield()
    else:
        time.sleep(min(1e-3, 1e-6 * idle))


#: Seconds a host wait spins (with sched_yield) before it sleeps.
SPIN_S = 0.005
