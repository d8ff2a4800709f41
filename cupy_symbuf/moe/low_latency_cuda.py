"""The GPU part of low-latency mode: the launches of ``cuda_src/low_latency.cu`` (``symbuf_ll_dispatch``,
``symbuf_ll_combine``) and their argument structs (``wire/kernel_args.py``: ``LLDispatchArgs`` / ``LLCombineArgs``,
int64 words by value). One :class:`GpuLaunches` per GPU :class:`~cupy_symbuf.moe.low_latency.LowLatencyBuffer`:
the grid every rank agrees on, the prebuilt struct of every call shape and output set (:class:`_Entry`: a call
rewrites its input addresses and launch number, then ``cuLaunchKernel``), the hot path's keys, the launch of a
rejected call, the blocking check of the communicator's error record, and the per-block profile stamps. The buffer
runs the call protocol (checks, handles, hooks, counters) and calls these."""
from __future__ import annotations

import ctypes

import numpy as np

from ..common import backend as _compat
from ..common.errors import SymBufferError
from ..transport import agree as _agree
from ..wire import kernel_args as _kernel_args
from ..wire import protocol as P
from .low_latency_regions import BOTH, KINDS, LINE, OPS, REJECTED

__all__ = ["GpuLaunches", "LL_DISPATCH_FIELDS", "LL_COMBINE_FIELDS", "LL_SOURCE", "SMEM_DYNAMIC_MAX"]

LL_SOURCE = "low_latency.cu"
#: The kernels' argument structs (``wire/kernel_args.py``: ``LLDispatchArgs`` / ``LLCombineArgs``, int64 words by
#: value) and their field names in order.
_STRUCTS = ("LLDispatchArgs", "LLCombineArgs")
LL_DISPATCH_FIELDS = _kernel_args.fields(_STRUCTS[0])
LL_COMBINE_FIELDS = _kernel_args.fields(_STRUCTS[1])
_THREADS = 512
#: dynamic shared memory of the dispatch kernel's receive masks, at most: a block's 48 KiB less 1 KiB for the
#: kernels' static shared memory (LLBlockState and the token counts, 600 bytes)
SMEM_DYNAMIC_MAX = 47 * 1024


class _Entry:
    """Prebuilt kernel arguments (``ctypes`` structs of ``wire/kernel_args.py``) of one call shape, one per output
    set, and the outputs the calls return."""

    __slots__ = ("which", "fn", "smem", "args", "ptrs", "params", "outs", "n", "K", "use_fp8")

    def __init__(self, which: int, fn: int, smem: int) -> None:
        self.which, self.fn, self.smem = which, fn, smem
        self.args, self.ptrs, self.params, self.outs = [], [], [], []
        self.n = self.K = 0
        self.use_fp8 = False

    def add(self, a: ctypes.Structure) -> None:
        ptrs = (ctypes.c_void_p * 1)(ctypes.addressof(a))
        self.args.append(a)
        self.ptrs.append(ptrs)
        self.params.append(ctypes.addressof(ptrs))



class GpuLaunches:
    """The GPU launches of one LowLatencyBuffer ``buf`` (collective to make: the ranks agree on the grid).
    ``failed(exc)`` is the buffer's: called with a failure the error record names, before it is raised."""

    def __init__(self, buf, num_blocks, smem: int, failed) -> None:
        from cupy_backends.cuda.api import driver

        from ..transport import kernels as _kernels
        cp = _compat.cupy
        self.comm, self.buffer, self._engine, self._failed = buf.comm, buf.buffer, buf._engine, failed
        self.rank, self.world_size, self.timeout_s = buf.rank, buf.world_size, buf.timeout_s
        self.N, self.H, self.L, self.kind, self.row_bytes = buf.N, buf.H, buf.L, buf.kind, buf.row_bytes
        for k in ("d0", "d_half", "d_flags", "d_meta", "d_rows", "c0", "c_half", "c_wflags", "c_weights",
                  "c_pflags", "c_prows"):
            setattr(self, k, getattr(buf, k))
        #: the buffer's output sets (the dicts, shared: the buffer adds the fp8 outputs on first use)
        self._sets, self._combine_out = buf._sets, buf._combine_out
        sm = int(self.buffer.gpu_identities[self.rank].get("sm_count") or 132)
        self.grid = num_blocks or max(1, min(128, sm // max(1, self.buffer.ranks_per_gpu)))
        grids = _agree.exchange_all(self.buffer.bootstrap, self.grid, self.timeout_s, "LowLatencyBuffer grid")
        self.grid = min(grids)  # every rank the same grid (counters compare against seq * grid)
        #: the communicator's error record and launch ledger (transport/status.py): the kernels write the record,
        #: their launches are numbered among the communicator's, and one decoder raises what they recorded
        self.status = self._engine.transport.status
        self._number_launch = self.status.ledger.next  # (bound once: the hot path's one call into the ledger)
        self._ctrl_ptr = self.buffer.local_ptr
        self._k = [_kernels.get_function(LL_SOURCE, "symbuf_ll_dispatch"),
                   _kernels.get_function(LL_SOURCE, "symbuf_ll_combine")]
        self._smem = [smem, 0]
        self._args = [_kernel_args.host_struct(name)() for name in _STRUCTS]
        self._idx = [frozenset(LL_DISPATCH_FIELDS), frozenset(LL_COMBINE_FIELDS)]
        for s in self._sets:  # the id (sequence number) of the dispatch whose outputs the set holds, device-written
            s["dispatch_id"] = cp.zeros(1, np.int64)
        W, N = self.world_size, self.N
        common = {"ll_bases": self.buffer.peer_ptrs_device.data.ptr, "N": N, "H": self.H, "L": self.L, "W": W,
                  "rank": self.rank, "kind": KINDS[self.kind], "status": self.status.ptr,
                  "comm_bases": self.comm.buffer.peer_ptrs_device.data.ptr,
                  "abort_offset": self.comm.layout.abort_offset, "timeout_ns": int(self.timeout_s * 1e9),
                  "grid": self.grid, "row_bytes": self.row_bytes}
        self._put(0, self._args[0], half0=self.d0, half_bytes=self.d_half, flags_off=self.d_flags,
                  meta_off=self.d_meta, rows_off=self.d_rows, ctrl=self._ctrl_ptr, **common)
        self._put(1, self._args[1], half0=self.c0, half_bytes=self.c_half, wflags_off=self.c_wflags,
                  weights_off=self.c_weights, pflags_off=self.c_pflags, prows_off=self.c_prows,
                  ctrl=self._ctrl_ptr + LINE, d_half0=self.d0, d_half_bytes=self.d_half, d_meta_off=self.d_meta,
                  **common)
        # Hot path (see :meth:`issue`): the kernel argument struct of every (call kind, argument shapes, output set) is
        # built once (_Entry); a call rewrites only its input addresses and launch number, then cuLaunchKernel
        # (the driver copies the struct at launch, so it may be rewritten while the launch is queued).
        self._fns = [int(k.kernel.ptr) for k in self._k]
        self._launch_kernel = driver.launchKernel
        self._get_stream = cp.cuda.get_current_stream
        self._entries = [{}, {}]     # normalised key -> _Entry (dispatch, combine)
        self.fastkeys = [{}, {}]     # the caller's argument key (shapes, dtypes, flags) -> _Entry
        self.fast = cp.ndarray       # fast path only for CuPy arrays (a DLPack import is a new CuPy array anyway)
        self.dev = int(cp.cuda.Device().id)
        self.st = self.status.words
        self.hsets = [(s["recv_count"], s["src_info"], s["layout_range"], s["recv_ntok"], s["inv"]) for s in self._sets]
        self.hptrs = [(s["inv"].data.ptr, s["recv_ntok"].data.ptr, s["dispatch_id"].data.ptr) for s in self._sets]
        self._prof = 0
        self._rejected_entries = [None, None]  # the argument struct of a rejected call, per kind (issue_rejected)
        cp.cuda.runtime.deviceSynchronize()

    def _put(self, which: int, a: ctypes.Structure, **kw) -> None:
        """Write the fields of ``kw`` that struct ``which`` has (the others are the other kind's)."""
        names = self._idx[which]
        for k, v in kw.items():
            if k in names:
                setattr(a, k, int(v))

    def entry(self, which: int, key: tuple, **kw) -> "_Entry":
        """The prebuilt argument structs of one call shape (both output sets), made on first use."""
        ent = self._entries[which].get(key)
        if ent is None:
            ent = _Entry(which, self._fns[which], self._smem[which])
            for p in (0, 1):
                a = type(self._args[which]).from_buffer_copy(self._args[which])
                self._put(which, a, prof=self._prof, **kw)
                self._put(which, a, **self._set_words(which, p, kw))
                ent.add(a)
            self._entries[which][key] = ent
        return ent

    def _set_words(self, which: int, p: int, kw: dict) -> dict:
        s = self._sets[p]
        if which == 1:
            return {"out": self._combine_out[p].data.ptr}
        fp8 = bool(kw.get("use_fp8"))
        return {"recv_x": (s["recv_q"] if fp8 else s["recv_x"]).data.ptr,
                "recv_scales": s["recv_scales"].data.ptr if fp8 else 0, "recv_count": s["recv_count"].data.ptr,
                "src_info": s["src_info"].data.ptr, "layout_range": s["layout_range"].data.ptr,
                "inv": s["inv"].data.ptr, "recv_ntok": s["recv_ntok"].data.ptr,
                "dispatch_id": s["dispatch_id"].data.ptr}

    def same(self, given, checked) -> bool:
        """``given`` (the caller's argument) is a contiguous CuPy array that validation passed through unchanged
        (no copy, no dtype conversion): later calls with the same shapes and dtypes may skip validation."""
        return (type(given) is self.fast and given._c_contiguous and given.dtype == checked.dtype
                and given.shape == checked.shape and given.data.ptr == checked.data.ptr)

    def set_profile(self, ptr: int) -> None:
        """Point every argument struct's ``prof`` word at a device array ``u64 [grid][LL_PROF_STAMPS]`` (0: off)."""
        self._prof = int(ptr)
        for which in (0, 1):
            self._args[which].prof = self._prof
            rejected = self._rejected_entries[which]
            for ent in list(self._entries[which].values()) + ([rejected] if rejected is not None else []):
                for a in ent.args:
                    a.prof = self._prof

    def issue_dispatch(self, ent: "_Entry", p: int, x_ptr: int, topk_ptr: int, phase: int = BOTH):
        a = ent.args[p]
        a.x = x_ptr
        a.topk = topk_ptr
        return self.issue(ent, p, a, OPS[0], phase=phase)

    def issue_combine(self, ent: "_Entry", p: int, x_ptr: int, topk_ptr: int, w_ptr: int, hptrs: tuple,
                       phase: int = BOTH):
        """``hptrs``: the handle's output set's (inv, recv_ntok, dispatch_id) addresses (``_hptrs``)."""
        a = ent.args[p]
        a.x = x_ptr
        a.topk = topk_ptr
        a.weights = w_ptr
        a.inv, a.recv_ntok, a.dispatch_id = hptrs
        return self.issue(ent, p, a, OPS[1], phase=phase)

    def issue_rejected(self, which: int, tag: int = 0, why: int = P.REJECT_ARGS):
        """Launch the kernel of kind ``which`` as a call this rank rejected (``n = LL_REJECTED``, no inputs): it
        publishes this rank's flag lines marked rejected (dispatch: carrying ``tag`` and ``why``), waits for every
        peer's, and writes no output. Returns the stream."""
        ent = self._rejected_entries[which]
        if ent is None:
            ent = _Entry(which, self._fns[which], self._smem[which])
            a = type(self._args[which]).from_buffer_copy(self._args[which])
            self._put(which, a, prof=self._prof, n=REJECTED, k=1, sig=0)
            if which == 0:
                self._put(which, a, **self._set_words(0, 0, {}))
            else:  # valid addresses, never read by a rejected launch
                self._put(which, a, out=self._combine_out[0].data.ptr, inv=self._sets[0]["inv"].data.ptr,
                          recv_ntok=self._sets[0]["recv_ntok"].data.ptr,
                          dispatch_id=self._sets[0]["dispatch_id"].data.ptr)
            ent.add(a)
            self._rejected_entries[which] = ent
        a = ent.args[0]
        if which == 0:  # (the driver copies the struct at launch: reset for the next rejection)
            a.tag, a.why = tag, why
        try:
            return self.issue(ent, 0, a, OPS[which], rejecting=True)
        finally:
            if which == 0:
                a.tag, a.why = 0, P.REJECT_ARGS

    def issue(self, ent: "_Entry", p: int, a: ctypes.Structure, op: str, rejecting: bool = False,
               phase: int = BOTH, stream=None):
        """Number the launch (for the error record) and launch ``ent``'s argument struct ``p`` (``a``) with the
        kernel phase ``phase`` (``LL_PHASE_*``) on ``stream`` (default: the current stream); returns the stream.
        With ``Config(blocking=True)`` wait for it and raise its failure, or (unless this rank is ``rejecting`` the
        call: it raises its own error) a peer's rejection."""
        a.launch_seq = self._number_launch(op)
        a.phase = phase
        if stream is None:
            stream = self._get_stream()
        self._launch_kernel(ent.fn, self.grid, 1, 1, _THREADS, 1, 1, ent.smem, stream.ptr, ent.params[p], 0)
        if self.comm.config.blocking:
            self.check_record(op, stream)
            rejected = None if rejecting else self.status.take_rejected()
            if rejected is not None:
                raise self.status.rejected_error(op, *rejected)
        return stream

    def check_record(self, op: str, stream=None) -> None:
        """Raise the error a kernel of the communicator recorded (:meth:`DeviceStatus.check
        <cupy_symbuf.transport.status.DeviceStatus.check>`, with ``stream``: after waiting for it); this buffer
        and the communicator are then unusable."""
        try:
            self.status.check(op, stream)
        except SymBufferError as exc:
            self._failed(exc)
            raise


    def dispatch_lines(self) -> list:
        """Every source's ``(n, tag)`` in the dispatch flag lines of the launch that completed last (the caller
        waited for it): ``n`` ``LL_REJECTED`` or the source's token count."""
        ctrl = self.buffer.peer_view(self.rank, np.uint64, (LINE // 8,)).get()
        seq = int(ctrl[P.LL_CTRL_EXIT]) // self.grid  # the launch that just completed
        off = self.d0 + (seq & 1) * self.d_half + self.d_flags
        words = self.buffer.peer_view(self.rank, np.int64, (self.world_size, LINE // 8), off).get()
        return [(int(w[P.LL_LINE_N]), int(w[P.LL_LINE_TAG])) for w in words]

    def calls_done(self) -> list:
        """The calls the kernels have completed on this rank, ``[dispatch, combine]``: the blocks counted in
        LL_CTRL_EXIT / grid, after waiting for the current stream."""
        _compat.cupy.cuda.get_current_stream().synchronize()
        words = self.buffer.peer_view(self.rank, np.uint64, (2, LINE // 8)).get()
        return [int(words[w, P.LL_CTRL_EXIT]) // self.grid for w in (0, 1)]
