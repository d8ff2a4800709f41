"""The host backend's wire of low-latency mode (the NumPy twin of ``cuda_src/low_latency.cu``): the flag lines
(published seq word last, awaited with a bounded wait that polls the communicator's abort word), the payload, meta
and partial rows stored into the peers' regions, and the receive side's unpacking and sums. One :class:`HostWire`
per host-backend :class:`~cupy_symbuf.moe.low_latency.LowLatencyBuffer`, which runs the call protocol and calls
these methods; the bits it produces equal the kernels'."""
from __future__ import annotations

import time
from typing import Optional

import numpy as np

from ..collectives import quant as _quant
from ..common import dtypes as _dt
from ..common.errors import SymBufferRejectedError, SymBufferTimeoutError, mismatch_error
from ..transport.status import low_latency_rejection
from ..wire import protocol as P
from .low_latency_regions import LINE, OPS, REJECTED

__all__ = ["HostWire"]

#: ctrl words (u64) of each kind's ctrl line on the host path: the sequence number (calls completed). (The
#: kernels count the blocks that left in word LL_CTRL_EXIT instead: seq = that count / grid + 1.)
_CTRL_SEQ = 0
#: words (u64) of a flag line: LL_LINE_SEQ .. LL_LINE_WHY
_LINE_WORDS = P.LL_LINE_WHY + 1


class HostWire:
    """The host wire of one LowLatencyBuffer ``buf``: its geometry and regions (copied from ``buf``), its
    communicator's engine (abort word) and NumPy views of every rank's symmetric buffer. The buffer calls
    :meth:`rejected`, :meth:`dispatch_send` / :meth:`dispatch_recv`, :meth:`combine_send` / :meth:`combine_recv`
    and :meth:`calls_done`; errors are raised as the buffer documents them."""

    def __init__(self, buf) -> None:
        self.buffer, self._engine = buf.buffer, buf._engine
        self.rank, self.world_size = buf.rank, buf.world_size
        self.N, self.H, self.L, self.itemsize, self.kind = buf.N, buf.H, buf.L, buf.itemsize, buf.kind
        self.timeout_s = buf.timeout_s
        for k in ("row_bytes", "d0", "d_half", "d_flags", "d_meta", "d_rows", "c0", "c_half", "c_wflags",
                  "c_weights", "c_pflags", "c_prows"):
            setattr(self, k, getattr(buf, k))
        self._views = [self.buffer.host_view(r) for r in range(self.world_size)]

    def calls_done(self) -> list:
        """The calls the flag-line protocol has completed on this rank, ``[dispatch, combine]``: the ctrl lines'
        sequence words."""
        return [int(self._u64(self.rank, w * LINE)[_CTRL_SEQ]) for w in (0, 1)]

    def _u64(self, r: int, off: int, n: int = 1) -> np.ndarray:
        return self._views[r][off: off + 8 * n].view(np.uint64)

    def _wait(self, op: str, line: np.ndarray, seq: int, peer: int, sig: Optional[int]) -> int:
        """Bounded wait for ``line[LL_LINE_SEQ] == seq`` (the communicator's abort word polled); returns the line's n word
        (``REJECTED``: ``peer`` rejected the call). A line not marked rejected must carry ``sig`` (None: not
        checked)."""
        tr = self._engine.transport
        sync = self.buffer.sync
        start = time.monotonic()
        spins = 0
        while True:
            sync()
            v = int(line[P.LL_LINE_SEQ])
            if v == seq:
                break
            if v > seq:
                tr.set_abort(P.ERR_MISMATCH, peer, -1, P.FIELD_SEQ)
                raise mismatch_error(op, self.rank, peer, -1, P.FIELD_SEQ, seq, v)
            tr.check_abort(op)
            if time.monotonic() - start > self.timeout_s:
                tr.set_abort(P.ERR_TIMEOUT, peer, -1)
                raise SymBufferTimeoutError(rank=self.rank, peer=peer, channel=-1, role="recv", head=seq, tail=v,
                                            timeout_s=self.timeout_s, op=op)
            spins += 1
            time.sleep(0 if spins < 100 else 1e-4)
        words = line.view(np.int64)
        ns, got = int(words[P.LL_LINE_N]), int(words[P.LL_LINE_SIG])
        if ns != REJECTED and sig is not None and got != sig:
            tr.set_abort(P.ERR_MISMATCH, peer, -1, P.FIELD_SIG)
            raise mismatch_error(op, self.rank, peer, -1, P.FIELD_SIG, sig, got)
        return ns

    def _line(self, r: int, off: int) -> np.ndarray:
        """The words (u64 ``LL_LINE_*``) of the flag line at ``off`` of rank ``r``'s buffer."""
        return self._u64(r, off, _LINE_WORDS)

    def _rejected_by(self, op: str, who: int, why: int = P.REJECT_ARGS, own: int = 0,
                     theirs: int = 0) -> SymBufferRejectedError:
        """What a rank raises when rank ``who`` made the call rejected for reason ``why`` (``REJECT_*``, with the
        words it names; host path: every rank is past the call)."""
        return SymBufferRejectedError(
            f"{op}: {low_latency_rejection(why, who, self.rank, own, theirs)}; nothing was delivered and the "
            f"LowLatencyBuffer stays usable", rank=self.rank, rejecting_rank=who, op=op)

    def _line_rejection(self, line: np.ndarray) -> tuple:
        """``(why, token)`` of a flag line marked rejected."""
        words = line.view(np.int64)
        return int(words[P.LL_LINE_WHY]), int(words[P.LL_LINE_TAG])

    def rejected(self, which: int, tag: int = 0, why: int = P.REJECT_ARGS) -> list:
        """The host twin of a rejected launch: this rank's flag lines of the call marked rejected (no payload;
        carrying ``tag`` and ``why``), then every source's line awaited (so the halves stay free as for any call),
        the sequence advanced. Returns every source's ``(n, tag)`` (n ``LL_REJECTED`` or its token count)."""
        op, me = OPS[which], self.rank
        self._engine.transport.check_abort(op)
        ctrl = self._u64(me, which * LINE, 3)
        seq = int(ctrl[_CTRL_SEQ]) + 1
        flags = self.d0 + (seq & 1) * self.d_half + self.d_flags if which == 0 else \
            self.c0 + (seq & 1) * self.c_half + self.c_wflags
        self._publish(flags, seq, REJECTED, 0, tag, why)
        lines = []
        for src in range(self.world_size):
            line = self._line(me, flags + src * LINE)
            lines.append((self._wait(op, line, seq, src, None), self._line_rejection(line)[1]))
        ctrl[_CTRL_SEQ] = seq
        return lines

    def _publish(self, off: int, seq: int, n: int, sig: int, tag: int = 0, why: int = 0) -> None:
        """Flag line ``rank`` at ``off`` of every rank: [seq, n, sig, tag, why], the seq word last (after a memory
        barrier)."""
        self.buffer.sync()
        for d in range(self.world_size):
            line = self._line(d, off + self.rank * LINE).view(np.int64)
            line[P.LL_LINE_N], line[P.LL_LINE_SIG], line[P.LL_LINE_TAG], line[P.LL_LINE_WHY] = n, sig, tag, why
        self.buffer.sync()
        for d in range(self.world_size):
            self._u64(d, off + self.rank * LINE)[P.LL_LINE_SEQ] = seq
        self.buffer.sync()

    def dispatch_send(self, op, x, topk, n, K, use_fp8, ue8m0, sig) -> tuple:
        """Dispatch's send phase (host twin): payload and meta into every destination, then the flag lines;
        returns ``(seq, half, K)`` for :meth:`dispatch_recv` and the meta sent (int32 ``[n, K]``, for the
        handle)."""
        W, me, N, H, L, R = self.world_size, self.rank, self.N, self.H, self.L, self.row_bytes
        self._engine.transport.check_abort(op)
        ctrl = self._u64(me, 0, 3)
        seq = int(ctrl[_CTRL_SEQ]) + 1
        half = self.d0 + (seq & 1) * self.d_half
        ranks = np.where(topk >= 0, topk // L, -1)
        if use_fp8:
            q, sc = _quant.quantize_fp8(_dt.to_float32(np, x, self.kind), ue8m0)
            payload = np.concatenate([q, np.ascontiguousarray(sc).view(np.uint8)], axis=1) if n else \
                np.zeros((0, H + H // 32), np.uint8)
        else:
            payload = np.ascontiguousarray(x).view(np.uint8).reshape(n, H * self.itemsize)
        meta = topk.astype(np.int32).reshape(-1)
        for d in range(W):
            v = self._views[d]
            mo = half + self.d_meta + me * N * K * 4
            v[mo: mo + n * K * 4].view(np.int32)[:] = meta
            rows = v[half + self.d_rows + me * N * R: half + self.d_rows + (me + 1) * N * R].reshape(N, R)
            sel = np.nonzero((ranks == d).any(axis=1))[0]
            rows[sel, : payload.shape[1]] = payload[sel]
        self._publish(half + self.d_flags, seq, n, sig)
        return (seq, half, K), meta.reshape(n, K)

    def dispatch_recv(self, op, seq, half, K, use_fp8, sig, s) -> None:
        """Dispatch's receive phase (host twin): every source's flag line awaited, then the rows unpacked into
        output set ``s``."""
        W, me, N, H, L, R = self.world_size, self.rank, self.N, self.H, self.L, self.row_bytes
        ctrl = self._u64(me, 0, 3)
        ntok = np.zeros(W, np.int64)
        rejecting = []
        for src in range(W):
            line = self._line(me, half + self.d_flags + src * LINE)
            ns = self._wait(op, line, seq, src, sig)
            if ns == REJECTED:
                why, token = self._line_rejection(line)
                rejecting.append((src, why, 0, token))
            elif not 0 <= ns <= N:
                self._engine.transport.set_abort(P.ERR_MISMATCH, src, -1, P.FIELD_UNITS)
                raise mismatch_error(op, me, src, -1, P.FIELD_UNITS, N, ns)
            else:
                ntok[src] = ns
        if rejecting:  # every rank saw the same lines: each is past the call, nothing is consumed
            ctrl[_CTRL_SEQ] = seq
            raise self._rejected_by(op, *rejecting[0])
        self.buffer.sync()
        v = self._views[me]
        metas = v[half + self.d_meta: half + self.d_meta + W * N * K * 4].view(np.int32).reshape(W, N, K)
        staging = v[half + self.d_rows: half + self.d_rows + W * N * R].reshape(W, N, R)
        rowb = H if use_fp8 else H * self.itemsize
        recv = s["recv_q"].reshape(L * W * N, H) if use_fp8 else s["recv_x"].reshape(L * W * N, rowb)
        inv = s["inv"]
        src_info = s["src_info"].reshape(-1)
        counts = np.zeros((L, W), np.int64)
        ent = []  # (el, s, t, j) of every entry naming a local expert
        for src in range(W):
            ns = int(ntok[src])
            m = metas[src, :ns].astype(np.int64)
            inv[src, :ns] = -1
            local = (m >= 0) & (m < L * W) & (m // L == me)
            t_idx, j_idx = np.nonzero(local)
            ent.append((m[t_idx, j_idx] - me * L, np.full(t_idx.size, src), t_idx, j_idx))
        el = np.concatenate([e[0] for e in ent]).astype(np.int64)
        ss = np.concatenate([e[1] for e in ent]).astype(np.int64)
        tt = np.concatenate([e[2] for e in ent]).astype(np.int64)
        jj = np.concatenate([e[3] for e in ent]).astype(np.int64)
        # one row per distinct (expert, source, token), ordered by (expert, source, token)
        key = (el * W + ss) * N + tt
        uniq, first_of = np.unique(key, return_inverse=True)
        u_el, u_s, u_t = uniq // (W * N), (uniq // N) % W, uniq % N
        np.add.at(counts, (u_el, u_s), 1)
        starts = np.concatenate([[0], np.cumsum(np.bincount(u_el, minlength=L))[:-1]]).astype(np.int64)
        pos = np.arange(uniq.size) - starts[u_el]
        row = u_el * W * N + pos
        inv[ss, tt, jj] = row[first_of]
        src_info[row] = u_t
        recv[row] = staging[u_s, u_t, :rowb]
        if use_fp8:
            nb = H // _quant.QUANT_BLOCK
            sc_out = s["recv_scales"].reshape(L * W * N, nb)
            sc_out[row] = staging[u_s, u_t, H: H + 4 * nb].copy().view(np.float32).reshape(-1, nb)
        base = np.concatenate([np.zeros((L, 1), np.int64), np.cumsum(counts, axis=1)[:, :-1]], axis=1)
        s["layout_range"][:] = (base << 32) | counts
        s["recv_count"][:] = counts.sum(axis=1).astype(np.int32)
        s["recv_ntok"][:] = ntok.astype(np.int32)
        ctrl[_CTRL_SEQ] = seq

    def combine_send(self, op, x, topk, w, n, K, handle, sig) -> tuple:
        """Combine's send phase (host twin): the weights to every rank (their flag line carrying the handle's
        dispatch id), every source's weights awaited, then this rank's partial rows to their sources and the
        partials flag lines; returns ``(seq, half, rejecting, sig)`` for :meth:`combine_recv` (``rejecting``:
        :meth:`_rejected_by`'s arguments after ``op`` for the lowest rank that made the call rejected (it rejected
        its arguments, or its handle's dispatch id differs from this rank's), else None: nothing was sent)."""
        W, me, N, H, L = self.world_size, self.rank, self.N, self.H, self.L
        self._engine.transport.check_abort(op)
        seq = int(self._u64(me, LINE)[_CTRL_SEQ]) + 1
        half = self.c0 + (seq & 1) * self.c_half
        RC = self.row_bytes
        for d in range(W):
            o = half + self.c_weights + me * N * K * 4
            self._views[d][o: o + n * K * 4].view(np.float32)[:] = np.ascontiguousarray(w).reshape(-1)
        did = handle.dispatch_id
        self._publish(half + self.c_wflags, seq, n, sig, did)
        ntok = handle.recv_tokens_per_rank
        rejecting = []
        for src in range(W):
            line = self._line(me, half + self.c_wflags + src * LINE)
            ns = self._wait(op, line, seq, src, sig)
            why, theirs = self._line_rejection(line)
            if ns == REJECTED:
                rejecting.append((src, why, did, theirs))
            elif theirs != did:  # the ranks' handles come from different dispatches: every rank sees it alike
                rejecting.append((src, P.REJECT_HANDLE, did, theirs))
            elif ns != int(ntok[src]):  # one dispatch, other counts: broken
                self._engine.transport.set_abort(P.ERR_MISMATCH, src, -1, P.FIELD_UNITS)
                raise mismatch_error(op, me, src, -1, P.FIELD_UNITS, int(ntok[src]), ns)
        if rejecting:  # decided alike on every rank (from the lines every rank reads) before any partial is sent
            return seq, half, rejecting[0], sig
        self.buffer.sync()
        v = self._views[me]
        wts = v[half + self.c_weights: half + self.c_weights + W * N * K * 4].view(np.float32).reshape(W, N, K)
        xf = _dt.to_float32(np, x.reshape(L * W * N, H), self.kind)
        for src in range(W):
            ns = int(ntok[src])
            inv = handle.inv[src, :ns]
            has = (inv >= 0).any(axis=1)
            acc = np.zeros((ns, H), np.float32)
            for j in range(K):
                ok = inv[:, j] >= 0
                acc[ok] = acc[ok] + wts[src, :ns, j, None][ok] * xf[inv[ok, j]]
            bits = _dt.from_float32(np, acc, self.kind, np.dtype(x.dtype)).view(np.uint8).reshape(ns, H * self.itemsize)
            dst = self._views[src]
            o = half + self.c_prows + me * N * RC
            prow = dst[o: o + N * RC].reshape(N, RC)
            sel = np.nonzero(has)[0]
            prow[sel, : bits.shape[1]] = bits[sel]
        self._publish(half + self.c_pflags, seq, 0, sig)
        return seq, half, None, sig

    def combine_recv(self, op, seq, half, rejecting, sig, topk, n, dtype, out) -> None:
        """Combine's receive phase (host twin): every rank's partials flag line awaited, the partial rows summed in
        rank order into ``out``; a call rejected by rank ``rejecting`` raises here."""
        W, me, N, H, L = self.world_size, self.rank, self.N, self.H, self.L
        ctrl = self._u64(me, LINE, 3)
        if rejecting is not None:
            ctrl[_CTRL_SEQ] = seq
            raise self._rejected_by(op, *rejecting)
        v = self._views[me]
        RC = self.row_bytes
        for d in range(W):
            self._wait(op, self._line(me, half + self.c_pflags + d * LINE), seq, d, sig)
        self.buffer.sync()
        ranks = np.where((topk >= 0) & (topk < L * W), topk // L, -1)
        acc = np.zeros((n, H), np.float32)
        rb = H * self.itemsize
        for d in range(W):
            ok = (ranks == d).any(axis=1)
            o = half + self.c_prows + d * N * RC
            prow = v[o: o + N * RC].reshape(N, RC)[:n, :rb][ok]
            acc[ok] = acc[ok] + _dt.to_float32(np, prow.copy().view(np.dtype(dtype)), self.kind)
        out[:n] = _dt.from_float32(np, acc, self.kind, np.dtype(dtype)).view(np.uint8).reshape(n, rb)
        ctrl[_CTRL_SEQ] = seq
