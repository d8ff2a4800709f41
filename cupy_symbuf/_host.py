"""Host twin of the GPU kernels: the same ring protocol and wire format over the MPI shared-memory window, with
NumPy copies.

A row exchange moves, per peer, a stream of rows in the same wire format as on the GPU (``layout.stream_units``): a
byte stream (channel cuts on 16-byte boundaries) for one part in row order, else packed rows (cuts on row
boundaries, whole rows per chunk, each row gathered from its parts through the token index when sending and
scattered into the receive parts); chunks are cut by ``layout.chunk_rows`` with one copy worker (the GPU has one per
copy warp). A rank's rows to itself are copied directly, as on the GPU.

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

from .errors import SymBufferTimeoutError
from .layout import ChannelLayout, channel_row_range, check_row_fits, chunk_rows, is_byte_stream, stream_units

__all__ = ["HostTransport"]


def _bytes2d(a: np.ndarray) -> np.ndarray:
    """``a`` (rows, i.e. all axes after the first, contiguous in memory) as ``uint8 [rows, row_width_bytes]``; a
    view (writes go to ``a``)."""
    return a.reshape(a.shape[0], math.prod(a.shape[1:])).view(np.uint8)


class _Side:
    """One side (send or receive) of a row exchange: where stream unit ``u`` of peer ``p``'s stream lives.

    ``fill``/``drain`` copy units ``[u, u + n)`` of a peer stream between the parts and a packed ring slot.
    """

    def __init__(self, parts, index, counts, byte_stream: bool, row_bytes: int):
        self.byte_stream = byte_stream
        if byte_stream:
            a = parts[0]
            self.flat = (a if a.flags.c_contiguous else np.ascontiguousarray(a)).reshape(-1).view(np.uint8)
            self.units = counts * row_bytes
        else:
            self.parts = []
            off = 0
            for a in parts:
                b = _bytes2d(a)
                self.parts.append((b, off, off + b.shape[1]))
                off += b.shape[1]
            self.units = counts.copy()
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

    def _u64(self, rank: int, offset: int) -> np.ndarray:
        return self.views[rank][offset: offset + 8].view(np.uint64)

    # ---- row exchange ---------------------------------------------------------------------------------------
    def exchange_rows(self, send_parts, send_index, send_counts, recv_parts, recv_counts, op: str) -> None:
        """Host twin of :meth:`CudaTransport.exchange_rows` (same arguments, NumPy arrays, same wire format)."""
        L = self.layout
        byte_stream = is_byte_stream(len(send_parts), send_index is not None)
        row_bytes = sum(a.dtype.itemsize * math.prod(a.shape[1:]) for a in send_parts)
        check_row_fits(op, row_bytes, L.chunk_bytes, byte_stream)   # on every rank, before the early return
        if row_bytes == 0 or (not send_counts.any() and not recv_counts.any()):
            return
        send = _Side(send_parts, send_index, send_counts, byte_stream, row_bytes)
        recv = _Side(recv_parts, None, recv_counts, byte_stream, row_bytes)
        unit, align = stream_units(byte_stream, row_bytes)
        me = self.rank
        # to ourselves: no ring (as on the GPU)
        n_self = int(send.units[me])
        if n_self:
            scratch = np.empty(n_self * unit, dtype=np.uint8)
            send.fill(scratch, me, 0, n_self)
            recv.drain(scratch, me, 0, n_self)
        sends, recvs = [], []
        for c in range(L.num_channels):
            for p in range(self.world_size):
                if p == me:
                    continue
                lo, hi = channel_row_range(int(send.units[p]), c, L.num_channels, align)
                if hi > lo:
                    state = self._u64(me, L.send_tail_offset(c, p))
                    sends.append({"c": c, "p": p, "pos": lo, "end": hi, "tail": int(state[0]), "state": state,
                                  "per_chunk": chunk_rows(hi - lo, unit, L.chunk_bytes),
                                  "head_line": self._u64(me, L.head_offset(c, p)),
                                  "remote_tail": self._u64(p, L.tail_offset(c, me)),
                                  "ring": self.views[p], "ring_off": L.ring_offset(c, me)})
                lo, hi = channel_row_range(int(recv.units[p]), c, L.num_channels, align)
                if hi > lo:
                    state = self._u64(me, L.recv_head_offset(c, p))
                    recvs.append({"c": c, "p": p, "pos": lo, "end": hi, "head": int(state[0]), "state": state,
                                  "per_chunk": chunk_rows(hi - lo, unit, L.chunk_bytes),
                                  "tail_line": self._u64(me, L.tail_offset(c, p)),
                                  "remote_head": self._u64(p, L.head_offset(c, me)),
                                  "ring": self.views[me], "ring_off": L.ring_offset(c, p)})
        chunk = L.chunk_bytes
        num_slots = L.num_slots
        sync = self.buf.sync
        last_progress = time.monotonic()
        idle = 0
        while sends or recvs:
            progressed = False
            for s in list(sends):
                head = int(s["head_line"][0])
                sync()
                moved = 0
                while s["pos"] < s["end"] and s["tail"] - head < num_slots:
                    n = min(s["per_chunk"], s["end"] - s["pos"])
                    off = s["ring_off"] + (s["tail"] % num_slots) * chunk
                    send.fill(s["ring"][off: off + chunk], s["p"], s["pos"], n)
                    s["pos"] += n
                    s["tail"] += 1
                    moved += 1
                if moved:
                    sync()  # payload before tail
                    s["remote_tail"][0] = s["tail"]
                    s["state"][0] = s["tail"]
                    progressed = True
                if s["pos"] >= s["end"]:
                    sends.remove(s)
            for r in list(recvs):
                tail = int(r["tail_line"][0])
                if tail > r["head"]:
                    sync()  # tail before payload
                    while r["head"] < tail and r["pos"] < r["end"]:
                        n = min(r["per_chunk"], r["end"] - r["pos"])
                        off = r["ring_off"] + (r["head"] % num_slots) * chunk
                        recv.drain(r["ring"][off: off + chunk], r["p"], r["pos"], n)
                        r["pos"] += n
                        r["head"] += 1
                    sync()  # reads of the slots before head
                    r["remote_head"][0] = r["head"]
                    r["state"][0] = r["head"]
                    progressed = True
                    if r["pos"] >= r["end"]:
                        recvs.remove(r)
            if progressed:
                last_progress = time.monotonic()
                idle = 0
                continue
            idle += 1
            if time.monotonic() - last_progress > self.timeout_s:
                if recvs:
                    r = recvs[0]
                    raise SymBufferTimeoutError(rank=me, peer=r["p"], channel=r["c"], role="recv", head=r["head"],
                                                tail=int(r["tail_line"][0]), timeout_s=self.timeout_s, op=op)
                s = sends[0]
                raise SymBufferTimeoutError(rank=me, peer=s["p"], channel=s["c"], role="send",
                                            head=int(s["head_line"][0]), tail=s["tail"], timeout_s=self.timeout_s,
                                            op=op)
            _yield(idle)

    # ---- notify ---------------------------------------------------------------------------------------------
    def notify(self, send_meta: np.ndarray, epoch: int, op: str = "notify") -> np.ndarray:
        """Count exchange: ``send_meta`` int64 ``[world_size, M]``; returns ``[world_size, M]`` whose row ``s``
        is rank ``s``'s row ``self.rank``. Slots double-buffered by ``epoch % 2``."""
        L = self.layout
        me = self.rank
        W, M = send_meta.shape
        parity = epoch % 2
        for p in range(W):
            off = L.notify_slot_offset(parity, me)
            self.views[p][off + 8: off + 8 + 8 * M].view(np.int64)[:] = send_meta[p]
        self.buf.sync()
        for p in range(W):
            off = L.notify_slot_offset(parity, me)
            self.views[p][off: off + 8].view(np.int64)[0] = epoch
        out = np.empty((W, M), dtype=np.int64)
        start = time.monotonic()
        idle = 0
        for s in range(W):
            off = L.notify_slot_offset(parity, s)
            flag = self.views[me][off: off + 8].view(np.int64)
            while int(flag[0]) < epoch:
                idle += 1
                if time.monotonic() - start > self.timeout_s:
                    raise SymBufferTimeoutError(rank=me, peer=s, channel=-1, role="notify", head=epoch,
                                                tail=int(flag[0]), timeout_s=self.timeout_s, op=op)
                _yield(idle)
                self.buf.sync()
            self.buf.sync()
            out[s] = self.views[me][off + 8: off + 8 + 8 * M].view(np.int64)
        return out


def _yield(idle: int) -> None:
    """Give the core away: sched_yield first, then short sleeps (oversubscribed CI: 4 ranks on 2 cores)."""
    if idle < 64:
        os.sched_yield()
    else:
        time.sleep(min(1e-3, 1e-6 * idle))
