"""Host twin of the GPU kernels: the same ring protocol over the MPI shared-memory window, with NumPy copies.

One progress loop per rank drives every (channel, peer) send stream and receive stream without blocking on any
one of them (the GPU gives each its own warp group; here a stream that cannot move is skipped), so no peer can
block another. Ordering: payload copy, ``Win.Sync()`` (memory barrier), then the ``tail`` store; the receiver
reads ``tail``, ``Win.Sync()``, copies out, ``Win.Sync()``, then stores ``head``. Waiting yields the CPU (CI runs
4 ranks on 2 cores).
"""
from __future__ import annotations

import os
import time

import numpy as np

from .errors import SymBufferTimeoutError
from .layout import ChannelLayout, channel_byte_range, num_chunks

__all__ = ["HostTransport"]


class HostTransport:
    """Runs alltoallv byte streams and the notify step over a host :class:`~cupy_symbuf.SymBuffer`."""

    def __init__(self, buf, layout: ChannelLayout, timeout_s: float):
        self.buf = buf
        self.layout = layout
        self.timeout_s = timeout_s
        self.rank = buf.rank
        self.world_size = buf.world_size
        self.views = [buf.host_view(r) for r in range(self.world_size)]

    def _u64(self, rank: int, offset: int) -> np.ndarray:
        return self.views[rank][offset: offset + 8].view(np.uint64)

    # ---- row streams -----------------------------------------------------------------------------------------
    def exchange_rows(self, send_parts, send_index, send_counts, recv_parts, recv_counts, op: str) -> None:
        """Host twin of :meth:`CudaTransport.exchange_rows` (same arguments, NumPy arrays): rows are packed
        into one contiguous byte array (NumPy gathers), streamed through the rings, and unpacked into the parts."""
        n_send = int(send_counts.sum())
        n_recv = int(recv_counts.sum())
        widths = [a.shape[1] * a.dtype.itemsize for a in send_parts]
        row_bytes = sum(widths)
        if row_bytes == 0 or (n_send == 0 and n_recv == 0):
            return
        if len(send_parts) == 1 and send_index is None and send_parts[0].flags.c_contiguous:
            packed = send_parts[0].reshape(-1).view(np.uint8)
        else:
            packed = np.empty((n_send, row_bytes), dtype=np.uint8)
            col = 0
            for a, w in zip(send_parts, widths):
                rows = a if send_index is None else a[send_index]
                packed[:, col: col + w] = np.ascontiguousarray(rows).view(np.uint8).reshape(n_send, w)
                col += w
            packed = packed.reshape(-1)
        if len(recv_parts) == 1:
            dst = recv_parts[0].reshape(-1).view(np.uint8)
        else:
            dst = np.empty(n_recv * row_bytes, dtype=np.uint8)
        send_len = send_counts * row_bytes
        recv_len = recv_counts * row_bytes
        send_off = np.concatenate([[0], np.cumsum(send_len)[:-1]]).astype(np.int64)
        recv_off = np.concatenate([[0], np.cumsum(recv_len)[:-1]]).astype(np.int64)
        self.alltoallv(packed, send_off, send_len, dst, recv_off, recv_len, op=op)
        if len(recv_parts) > 1:
            rows = dst.reshape(n_recv, row_bytes)
            col = 0
            for a, w in zip(recv_parts, widths):
                a.view(np.uint8).reshape(n_recv, w)[:] = rows[:, col: col + w]
                col += w

    # ---- alltoallv ------------------------------------------------------------------------------------------
    def alltoallv(self, src: np.ndarray, send_off, send_len, dst: np.ndarray, recv_off, recv_len,
                  op: str = "alltoallv") -> None:
        """Move ``send_len[p]`` bytes at ``src[send_off[p]:]`` to every peer ``p`` and receive ``recv_len[p]``
        bytes into ``dst[recv_off[p]:]``; ``src``/``dst`` are flat ``uint8`` arrays."""
        L = self.layout
        me = self.rank
        C = L.num_channels
        chunk = L.chunk_bytes
        sends, recvs = [], []
        for c in range(C):
            for p in range(self.world_size):
                lo, hi = channel_byte_range(int(send_len[p]), c, C)
                n = num_chunks(hi - lo, chunk)
                if n:
                    state = self._u64(me, L.send_tail_offset(c, p))
                    sends.append({"c": c, "p": p, "pos": int(send_off[p]) + lo, "end": int(send_off[p]) + hi,
                                  "left": n, "tail": int(state[0]), "state": state,
                                  "head_line": self._u64(me, L.head_offset(c, p)),
                                  "remote_tail": self._u64(p, L.tail_offset(c, me)),
                                  "ring": self.views[p], "ring_off": L.ring_offset(c, me)})
                lo, hi = channel_byte_range(int(recv_len[p]), c, C)
                n = num_chunks(hi - lo, chunk)
                if n:
                    state = self._u64(me, L.recv_head_offset(c, p))
                    recvs.append({"c": c, "p": p, "pos": int(recv_off[p]) + lo, "end": int(recv_off[p]) + hi,
                                  "left": n, "head": int(state[0]), "state": state,
                                  "tail_line": self._u64(me, L.tail_offset(c, p)),
                                  "remote_head": self._u64(p, L.head_offset(c, me)),
                                  "ring": self.views[me], "ring_off": L.ring_offset(c, p)})
        last_progress = time.monotonic()
        idle = 0
        num_slots = L.num_slots
        sync = self.buf.sync
        while sends or recvs:
            progressed = False
            for s in list(sends):
                head = int(s["head_line"][0])
                sync()
                moved = 0
                while s["left"] and s["tail"] - head < num_slots:
                    n = min(chunk, s["end"] - s["pos"])
                    off = s["ring_off"] + (s["tail"] % num_slots) * chunk
                    s["ring"][off: off + n] = src[s["pos"]: s["pos"] + n]
                    s["pos"] += n
                    s["tail"] += 1
                    s["left"] -= 1
                    moved += 1
                if moved:
                    sync()  # payload before tail
                    s["remote_tail"][0] = s["tail"]
                    s["state"][0] = s["tail"]
                    progressed = True
                if not s["left"]:
                    sends.remove(s)
            for r in list(recvs):
                tail = int(r["tail_line"][0])
                if tail > r["head"]:
                    sync()  # tail before payload
                    take = min(tail - r["head"], r["left"])
                    for _ in range(take):
                        n = min(chunk, r["end"] - r["pos"])
                        off = r["ring_off"] + (r["head"] % num_slots) * chunk
                        dst[r["pos"]: r["pos"] + n] = r["ring"][off: off + n]
                        r["pos"] += n
                        r["head"] += 1
                        r["left"] -= 1
                    sync()  # reads of the slots before head
                    r["remote_head"][0] = r["head"]
                    r["state"][0] = r["head"]
                    progressed = True
                    if not r["left"]:
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
