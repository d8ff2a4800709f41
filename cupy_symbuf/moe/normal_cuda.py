"""The GPU half of normal mode (handles with device routing; the kernels of :mod:`cupy_symbuf.moe.gpu`): the eager
dispatch (layout kernel, count exchange on the device, ring exchange with the per-peer units from the device counts
table, receive fix-up); the cached dispatch and the combine, each run from the record the first call of its shape
keeps on the handle (:class:`_CachedRecord`, :class:`_CombineRecord`); the row exchange of a device-count call and its
receive arrays; the combine's reduction launch. :func:`~cupy_symbuf.moe.normal.dispatch` and
:func:`~cupy_symbuf.moe.normal.combine` run the call and call these; the host path is in
:mod:`cupy_symbuf.moe.normal`."""
from __future__ import annotations

import numpy as np

from . import gpu as _gpu
from .checks import check_weights, check_x, combine_kind, row_bytes, topk_value_error
from .normal_handle import handle_fields, handle_from, make_ref, new_handle
from .routing import align_counts
from ..common import dtypes as _dt
from ..common.checks import check_array, check_out
from ..transport.outputs import OutputPool
from ..wire.channel_layout import check_row_fits

__all__ = ["cached_device", "cached_repeat", "combine_repeat", "REPEAT_DISPATCH", "REPEAT_COMBINE", "dispatch_cuda",
           "eager_key", "eager_record", "eager_from_record", "new_eager_record", "remember", "layout_key",
           "device_outputs", "exchange_device", "reduce_cuda", "combine_device"]

_F32, _I64 = np.dtype(np.float32), np.dtype(np.int64)
_add_reduce = np.add.reduce


class _CachedRecord:
    """What a GPU cached dispatch of one call shape (handle, ``x``'s dtype and strides, no ``out``) derives before
    its launch, kept on the handle for the next call of that shape: the checked kind, the row signature, the
    exchange plan, whether ``x``'s rows need a contiguous copy, and the per-expert counts of an eager handle at each
    alignment asked (a new list is returned on every call); ``ring``: the prepared ring launch (made by the first
    call; False where the handle's send index is not int64 C-contiguous: then the arrays are handed over per call)."""

    __slots__ = ("x_shape", "kind", "sig", "plan", "ring", "copy_x", "counts", "repeat")


def cached_device(comm, op, x, h, align: int, stream, capturing: bool):
    """A cached dispatch on the GPU without ``out`` for a plain CuPy ``x`` (the handle's routing on the device): the
    argument checks made in full on the first call of a shape and remembered (:class:`_CachedRecord`), one
    allocation (``recv_x``) and one ring launch per call. Returns dispatch's tuple."""
    cp = comm.xp
    key = ("cached", x.dtype, x.strides)
    rec = h.__dict__.get("_records", {}).get(key)
    if rec is not None and (x.shape != rec.x_shape or x.data.device_id != cp.cuda.runtime.getDevice()):
        rec = None  # (the full checks below say what is wrong)
    if rec is None:
        xv, _, kind = check_x(op, comm, x, h.num_tokens, None)
        rec = _CachedRecord()
        rec.x_shape, rec.kind, rec.sig = xv.shape, kind, f"cached|{kind}"
        cx = _rows_contiguous(cp, xv)
        rec.copy_x = cx is not xv
        rec.plan = comm.device_plan(op, rec.sig, [cx], True) if cx.shape[1] else None
        rec.ring = rec.repeat = None
        rec.counts = {}
        _records(h)[key] = rec
        x = cx  # (copied once: the copy below returns it as it is)
    if rec.copy_x:
        x = cp.ascontiguousarray(x)
    recv_x = cp.empty((h.num_recv_tokens, x.shape[1]), dtype=x.dtype)
    if rec.plan is not None:
        if capturing:  # read / written by every replay (the caller's x too)
            comm.keep_for_graph(x, recv_x, capturing=True)
        index = h.send_token_idx
        if rec.ring is None:  # the record's first call: the ring launch prepared from this call's arrays
            rec.ring = comm.prepare_rows_device(op, rec.sig, [x], [recv_x], True) \
                if index.dtype == _I64 and index._c_contiguous else False
        if rec.ring:
            comm.launch_rows_device(op, rec.ring, [x.data.ptr], [recv_x.data.ptr], index.data.ptr,
                                    h.routing.table_ptr, tag=h.dispatch_id, stream=stream)
        else:
            comm.exchange_rows_device(op, [x], index, [recv_x], rec.sig, h.routing.table_ptr, tag=h.dispatch_id,
                                      plan=rec.plan, stream=stream)
    if h.num_worst_tokens:  # an int64 device array, made anew (a returned array is never handed out twice)
        return recv_x, None, None, h.num_recv_tokens_per_expert(align), h
    counts = rec.counts.get(align)
    if counts is None:
        counts = rec.counts[align] = h.num_recv_tokens_per_expert(align)
    if rec.ring and not rec.copy_x and not capturing:  # this shape's fast path (made once per record)
        if rec.repeat is None:
            rec.repeat = _repeat_dispatch(comm, op, h, x, rec, recv_x) or False
        if rec.repeat:
            h.__dict__[REPEAT_DISPATCH] = rec.repeat
    return recv_x, None, None, list(counts), h


#: the handle's ``__dict__`` key of its cached dispatch's :class:`_Repeat` (the last call shape it ran)
REPEAT_DISPATCH = "_repeat_dispatch"
#: the handle's ``__dict__`` key of its combine's :class:`_Repeat`
REPEAT_COMBINE = "_repeat_combine"


class _Repeat:
    """The fast path of a GPU cached dispatch or combine: the call shape the handle ran last without ``out=`` and
    outside a CUDA graph capture (the arrays' dtype object, shape and strides, on the GPU that was current then; a
    combine's weights alike, or None, and the very object it passed as ``dtype``), whose full checks passed, and
    what a call of exactly that shape does: its ring launch with a descriptor of its own
    (:meth:`~cupy_symbuf.transport.engine.Engine.repeat_prepare`: the handle's send index, counts table and
    dispatch id stay written), the pools its outputs (and a combine's received rows) come from
    (:class:`~cupy_symbuf.transport.outputs.OutputPool`), the per-expert counts (cached dispatch) and the
    reduction's prepared launch (combine). A call whose arguments differ in anything runs the full path (which
    makes the record of the new shape the fast one). The call signature the ring kernel's headers carry is the one
    the full path writes (the plan's, with the handle's dispatch id): every receiver checks it as before."""

    __slots__ = ("dtype", "shape", "strides", "w_dtype", "w_shape", "w_strides", "device", "ring", "outs", "back",
                 "back_memory", "back_bytes", "back_w_off", "counts", "red", "dtype_arg")


def _repeat_dispatch(comm, op, h, x, rec, recv_x):
    """The cached-dispatch :class:`_Repeat` of a call of ``x``'s shape with handle ``h`` that ran the full path (its
    record ``rec`` prepared the ring launch; ``recv_x``: the call's output, for its shape and dtype); None where
    the calls must take the full path (one rank)."""
    ring = comm.repeat_prepare(op, rec.ring, h.send_token_idx.data.ptr, h.routing.table_ptr, tag=h.dispatch_id)
    if ring is None:
        return None
    cp = comm.xp
    r = _Repeat()
    r.dtype, r.shape, r.strides, r.w_dtype = x.dtype, x.shape, x.strides, None
    r.device = x.data.device_id
    r.ring, r.counts, r.back, r.red, r.dtype_arg = ring, rec.counts, None, None, None
    shape, dtype = recv_x.shape, recv_x.dtype
    r.outs = OutputPool(lambda: (cp.empty(shape, dtype),))
    return r


def cached_repeat(comm, op, h, r: _Repeat, x, align):
    """A cached dispatch of ``x`` with handle ``h`` (made by ``comm``, ``r`` its :class:`_Repeat`) and no other
    argument but ``expert_alignment`` (``align``) when the call has the repeat record's shape (else None, having
    done nothing): one output from the record's pool, one ring launch. Returns dispatch's tuple. Outside a CUDA
    graph capture only (None while the current stream is being captured)."""
    cp = comm.xp
    if type(x) is not cp.ndarray or x.dtype is not r.dtype or x.shape != r.shape or x.strides != r.strides or \
            type(align) is not int or h._comm_ref() is not comm:
        return None
    counts = r.counts.get(align)
    if counts is None or x.data.device_id != r.device or r.device != cp.cuda.runtime.getDevice():
        return None
    stream = cp.cuda.get_current_stream()
    if stream.is_capturing():
        return None
    return _run_repeat(comm, op, r, stream, x.data.ptr, 0)[0], None, None, list(counts), h


def _back_rows(comm, r: _Repeat, stream_ptr: int) -> int:
    """The address of a new allocation for a combine's received rows (``r.back_bytes``), kept in ``r.back`` for the
    calls on the stream ``stream_ptr`` (the rows are written and read by the call's two kernels, in that stream's
    order, and never handed out: the next call on the stream may write them again; at most two streams kept)."""
    mem = comm.xp.cuda.alloc(r.back_bytes)
    if len(r.back) >= 2:
        r.back.clear()
        r.back_memory.clear()
    r.back[stream_ptr], r.back_memory[stream_ptr] = mem.ptr, mem
    return mem.ptr


def _run_repeat(comm, op, r: _Repeat, stream, x_ptr: int, w_ptr: int) -> tuple:
    """The call of a fast path whose arguments matched its :class:`_Repeat` ``r`` (``x_ptr``: x's address; a
    combine's ``w_ptr``: the weights', 0: none) on ``stream``, outside a capture: the communicator's entry checks
    and guard, as :meth:`~cupy_symbuf.transport.engine.Engine.call`; the outputs (and a combine's received rows)
    from the pools, where an allocation that fails is a rejection told to the peers; the ring launch and a
    combine's reduction. Returns the outputs."""
    comm.check_open()
    guard = comm.guard
    took = False
    try:
        took = guard.enter(op, comm)
        try:  # (nothing before the launch can fail but an allocation or an interrupt: told to the peers)
            sp = stream.ptr
            outs = r.outs.take(sp)
            if r.red is None:  # a cached dispatch: x's rows into the output
                ptrs = x_ptr, outs[0].data.ptr
            else:  # a combine: the rows back (x's, the weights' after them), then the reduction into the outputs
                back = r.back.get(sp) or _back_rows(comm, r, sp)
                back_w = back + r.back_w_off if w_ptr else 0
                ptrs = (x_ptr, w_ptr, back, back_w) if w_ptr else (x_ptr, back)
        except BaseException:
            comm.reject(op, notify=False)
            raise
        comm.launch_repeat(r.ring, ptrs, stream)
        if r.red is not None:
            _gpu.reduce_run(r.red, back, outs[0].data.ptr, x_ptr, back_w, outs[1].data.ptr if w_ptr else 0, w_ptr,
                            stream)
        return outs
    finally:
        if took:
            guard.leave()


def _dispatch_sig(kind, xv, scales, idx, weights, n_exp) -> str:
    return (f"{kind}|hidden={xv.shape[1]}|scales={scales is not None}|topk={idx.shape[1]}|"
            f"weights={weights is not None}|num_experts={n_exp}")


class _EagerRecord:
    """What a GPU eager dispatch of one call shape derives from its arguments before its first launch, kept in the
    communicator's per-call-shape memo (:attr:`~cupy_symbuf.transport.engine.Engine.call_memo`) under
    :func:`eager_key` once a call of that shape returned: the checked kind, whether ``topk_idx`` is cast to int64
    and copied to C order, the row bytes and signature, the receive parts' widths and dtypes and the prepared ring
    launch (plan and descriptor) and the layout launch's fields (:func:`~cupy_symbuf.moe.gpu.layout_fields`).
    Nothing in it depends on the values of the arrays or on the routing (the counts are read anew every call)."""

    __slots__ = ("kind", "cast_idx", "copy_idx", "rb", "sig", "out_parts", "ring", "sent", "copy_rows", "layout",
                 "fast")


def eager_key(cp, x, topk_idx, weights, num_experts, expert_alignment, num_worst_tokens):
    """The memo key of a GPU eager dispatch without ``out`` (:class:`_EagerRecord`), or None (checked in full every
    call): plain CuPy arrays ``x``, ``topk_idx`` and ``weights`` (or None), by dtype, shape and strides, and the
    three integer arguments as plain ints (a bool or NumPy integer equal to one is checked in full)."""
    nd = cp.ndarray
    if type(x) is not nd or type(topk_idx) is not nd or not (weights is None or type(weights) is nd) or \
            type(num_experts) is not int or type(expert_alignment) is not int or type(num_worst_tokens) is not int:
        return None
    return ("dispatch", x.dtype, x.shape, x.strides, topk_idx.dtype, topk_idx.shape, topk_idx.strides,
            None if weights is None else (weights.dtype, weights.shape, weights.strides), num_experts,
            expert_alignment, num_worst_tokens)


def layout_key(cp, topk_idx, num_experts):
    """The memo key of a GPU ``get_dispatch_layout`` whose checks passed before (remembered: whether ``topk_idx`` is
    cast to int64), or None (checked in full every call): a plain CuPy ``topk_idx`` by dtype, shape and strides,
    ``num_experts`` a plain int."""
    if type(topk_idx) is not cp.ndarray or type(num_experts) is not int:
        return None
    return ("get_dispatch_layout", topk_idx.dtype, topk_idx.shape, topk_idx.strides, num_experts)


def eager_record(comm, key, x, topk_idx, weights):
    """The :class:`_EagerRecord` remembered under ``key`` (:func:`eager_key`, not None) when every array lives on the
    current GPU, else None (the full checks then say what is wrong)."""
    rec = comm.call_memo.get(key)
    if rec is not None:
        dev = comm.xp.cuda.runtime.getDevice()
        if x.data.device_id != dev or topk_idx.data.device_id != dev or \
                (weights is not None and weights.data.device_id != dev):
            return None
    return rec


def new_eager_record(kind: str, cast_idx: bool) -> _EagerRecord:
    """A new :class:`_EagerRecord` of a call checked in full (``cast_idx``: its ``topk_idx`` was cast to int64), for
    :func:`dispatch_cuda` to fill and the caller to :func:`remember` once the call returned."""
    rec = _EagerRecord()
    rec.kind, rec.cast_idx = kind, cast_idx
    rec.fast = None
    return rec


def remember(comm, key, rec) -> None:
    """Keep ``rec`` under ``key`` in the communicator's per-call-shape memo (bounded: a new entry past 256 clears
    it)."""
    memo = comm.call_memo
    if len(memo) >= 256:
        memo.clear()
    memo[key] = rec


def eager_from_record(comm, op, rec, x, topk_idx, weights, n_exp: int, align: int, worst: int, *, stream,
                      capturing):
    """:func:`dispatch_cuda` of a call whose shape passed every argument check before (``rec``); an eager one
    whose record holds its prepared launches by :func:`_eager_fast`."""
    idx = topk_idx.astype(np.int64) if rec.cast_idx else topk_idx
    if not worst and rec.ring and rec.layout is not None:
        return _eager_fast(comm, op, rec, x, idx, weights, n_exp, align, stream, capturing)
    return dispatch_cuda(comm, op, x, None, rec.kind, idx, weights, n_exp, align, worst, stream=stream,
                         capturing=capturing, rec=rec)


class _EagerFast:
    """What :func:`_eager_fast` keeps per record (made by its first call): the receive parts' row bytes (x, top-k
    ids, weights), the fix-up's launcher, this rank's first expert and the handle's fields that the record's key
    fixes (:func:`~cupy_symbuf.moe.normal_handle.handle_fields`)."""

    __slots__ = ("row_bytes", "fixup", "first_expert", "handle_fields")


def _eager_fast(comm, op, rec, xv, idx, weights, n_exp: int, align: int, stream, capturing):
    """A repeated GPU eager dispatch without ``out`` or scales (``rec``: its :class:`_EagerRecord`, with the ring
    launch and the fused layout + count exchange prepared by earlier calls): the same steps, checks and launches as
    :func:`dispatch_cuda` (one pool call for the routing, one launch of the layout and the count exchange, the one
    host wait, one pool call for the receive arrays, the ring launch, the fix-up launch), with what the record
    fixes read from it instead of derived again."""
    cp = comm.xp
    W, rank = comm.world_size, comm.rank
    num_tokens, num_topk = idx.shape
    epr = n_exp // W
    if rec.copy_idx:
        idx = cp.ascontiguousarray(idx)
    fast = rec.fast
    if fast is None:
        fast = rec.fast = _EagerFast()
        fast.row_bytes = [n * dt.itemsize for n, dt in rec.out_parts]
        fast.fixup = _gpu.fixup_launcher(comm)
        fast.first_expert = rank * epr
        fast.handle_fields = handle_fields(
            _comm_ref=make_ref(comm), rank=rank, world_size=W, backend=comm.backend, num_experts=n_exp,
            num_tokens=num_tokens, num_topk=num_topk, hidden=xv.shape[1], expert_alignment=align, num_worst_tokens=0)
    rt = _gpu.Routing(num_tokens, num_topk, W, 1 + epr)
    recv_vals, sent_vals = comm.notify_device(
        op, rt.meta_ptr, 1 + epr, rec.sig, table=rt.table_ptr, sums=rt.sums_ptr, local_reject=rt.bad_ptr,
        self_error=_bad_error(op, rt, idx, n_exp, num_topk), sig_what=_sig_what(rank, rec.rb, rec.sig),
        capturing=capturing, layout=_gpu.layout_notify_args(rec.layout, idx.data.ptr, rt))
    dispatch_id = comm.epoch
    recv_counts, send_counts = recv_vals[:, 0].copy(), sent_vals[:, 0].copy()
    raw = tuple(_add_reduce(recv_vals[:, 1:], 0).tolist())
    n_recv = sum(recv_counts.tolist())
    send_rows = sum(send_counts.tolist())
    send_idx = rt.send_rows_idx(send_rows)
    send_counts.setflags(write=False)
    recv_counts.setflags(write=False)
    # the receive arrays (x, top-k ids, weights) from one allocation, each at a multiple of 256 bytes
    nd = cp.ndarray
    sizes = [(n_recv * b + 255) & ~255 for b in fast.row_bytes]
    total = sum(sizes)
    if total:
        mem = cp.cuda.alloc(total)
        outs, off = [], 0
        for (n, dt), size in zip(rec.out_parts, sizes):
            outs.append(nd((n_recv, n), dt, memptr=mem + off))
            off += size
    else:
        outs = [cp.empty((n_recv, n), dt) for n, dt in rec.out_parts]  # (no bytes: no rows, or rows of width 0)
    send = [xv, idx, weights]
    for i in rec.copy_rows:  # (rows whose elements are not contiguous, as _rows_contiguous finds them)
        send[i] = cp.ascontiguousarray(send[i])
    # (never inside a CUDA graph capture: notify_device refused it, on every rank alike, before any step)
    comm.launch_rows_device(op, rec.ring, [send[i].data.ptr for i in rec.sent], [outs[i].data.ptr for i in rec.sent],
                            send_idx.data.ptr, rt.table_ptr, tag=0, stream=stream)
    recv_gidx = outs[1]
    recv_w = outs[2] if weights is not None else None
    if n_recv * num_topk:
        _gpu.fixup_run(fast.fixup, recv_gidx.data.ptr, 0 if recv_w is None else recv_w.data.ptr, n_recv, num_topk,
                       fast.first_expert, epr, rt.sums_ptr, align, stream)
    h = handle_from(fast.handle_fields, is_token_in_rank=rt.in_rank, send_token_idx=send_idx,
                    send_counts=send_counts, recv_counts=recv_counts, num_recv_tokens_per_expert_raw=raw,
                    routing=rt, send_rows=send_rows, dispatch_id=dispatch_id,
                    _recv_total=(recv_counts, n_recv))  # (the row count summed here: a combine's check reads it)
    return outs[0], recv_gidx, recv_w, align_counts(raw, align), h


def _bad_error(op, rt, idx, n_exp: int, num_topk: int):
    """The error of this rank's dispatch whose layout found a ``topk_idx`` value out of range (read from the device
    after the count exchange told every rank), as a function for :meth:`Engine.notify_device`'s ``self_error``."""
    def bad_error():
        flat = int(rt.bad[1].get())
        t, k = divmod(flat, num_topk)
        return ValueError(topk_value_error(op, n_exp, int(idx[t, k].get()), t, k,
                                           " (found by the layout kernel; nothing was sent)"))
    return bad_error


def _sig_what(rank: int, rb: int, sig: str):
    """The text of a row-format disagreement found by a dispatch's count exchange, as a function (made only when
    the signatures differ)."""
    return lambda: (f"ranks disagree on the dispatched row size in bytes (hidden * itemsize + scales + top-k), on "
                    f"num_experts or on where out lies: rank {rank} has {rb} bytes ({sig}); all ranks must pass the "
                    f"same hidden, dtype, num_topk, choice of topk_weights and num_experts, and a symmetric out must "
                    f"be the same allocation at the same offset on every rank")


def dispatch_cuda(comm, op, xv, scales, kind, idx, weights, n_exp: int, align: int, worst: int, user_outs=None, *,
                  stream=None, capturing=None, rec=None, fill=None):
    """The GPU dispatch (:mod:`cupy_symbuf.moe.gpu`): layout kernel -> count exchange on the device (counts
    tables; eager: both in one launch, ``symbuf_moe_layout_notify``) -> [eager: one host read of the receive
    counts] -> ring exchange with the units from the device table -> receive fix-up. With ``worst`` nothing is read
    on the host. ``rec``: the :class:`_EagerRecord` of this call
    shape (its checks, signature and plan); ``fill``: without ``rec``, a new :class:`_EagerRecord` whose ``kind``
    and ``cast_idx`` the caller set, filled here with the rest (the caller remembers it once the call returned)."""
    cp = comm.xp
    w_size, rank = comm.world_size, comm.rank
    epr = n_exp // w_size
    num_tokens, num_topk = idx.shape
    M = 1 + epr
    push = None
    if rec is None:
        rb = row_bytes(xv, scales, num_topk, weights is not None)
        check_row_fits(op, rb, comm.config.chunk_bytes, byte_run=False)
        sig = _dispatch_sig(kind, xv, scales, idx, weights, n_exp)
        push = comm.push_targets(user_outs) if user_outs is not None else None
        if push is not None:  # the outputs' layout is agreed by the count exchange's signature check
            sig += push[2]
        cidx = _gpu.contiguous(idx)
        if fill is not None:  # (no out, no scales: push is None)
            fill.rb, fill.sig, fill.ring, fill.layout = rb, sig, None, None
            fill.copy_idx = cidx is not idx
            fill.out_parts = _out_parts(xv, scales, idx, weights)
        idx = cidx
        rec = fill
    else:
        rb, sig = rec.rb, rec.sig
        if rec.copy_idx:
            idx = cp.ascontiguousarray(idx)
    rt = _gpu.Routing(num_tokens, num_topk, w_size, M)
    meta = rt.meta_ptr
    fused = None
    if not worst:  # eager: the layout and the count exchange in one launch (symbuf_moe_layout_notify)
        lf = None if rec is None else rec.layout
        if lf is None:
            lf = _gpu.layout_notify_fields(comm, num_tokens, num_topk, n_exp, M)
            if rec is not None:
                rec.layout = lf
        fused = _gpu.layout_notify_args(lf, idx.data.ptr, rt)
    elif rec is None:
        _gpu.layout(comm, idx, n_exp, in_rank=rt.in_rank, meta=meta, bad=rt.bad_ptr, pos=rt.pos_ptr,
                    send_idx=rt.send_idx_ptr, stream=stream)
    else:
        if rec.layout is None:
            rec.layout = _gpu.layout_fields(comm, num_tokens, num_topk, n_exp)
        _gpu.layout_run(rec.layout, idx.data.ptr, rt, stream)

    # worst case: the outputs exist before the count exchange (an allocation that fails is a rejection, not a
    # failure between the steps)
    outs = device_outputs(cp, worst, xv, scales, idx, weights, user_outs, parts=rec and rec.out_parts) \
        if worst else None
    res = comm.notify_device(op, meta, M, sig, table=rt.table_ptr, sums=rt.sums_ptr, local_reject=rt.bad_ptr,
                             capacity=worst if worst else (user_outs[0].shape[0] if user_outs else -1),
                             worst=bool(worst), self_error=_bad_error(op, rt, idx, n_exp, num_topk),
                             sig_what=_sig_what(rank, rb, sig), capturing=capturing, layout=fused)
    dispatch_id = comm.epoch  # this dispatch's count exchange (in a capture: the capture's, kept by every replay)
    if worst:
        send_counts = recv_counts = raw = None
        n_recv = worst
        send_rows = num_tokens * min(w_size, num_topk)
        send_idx = rt.send_idx
    else:
        recv_vals, sent_vals = res
        recv_counts, send_counts = recv_vals[:, 0].copy(), sent_vals[:, 0].copy()
        raw = tuple(recv_vals[:, 1:1 + epr].sum(axis=0).tolist())
        n_recv = sum(recv_counts.tolist())  # (counts of rows: far from int64's range; a Python sum of W ints)
        send_rows = sum(send_counts.tolist())
        send_idx = rt.send_rows_idx(send_rows)
        send_counts.setflags(write=False)
        recv_counts.setflags(write=False)
    recv_x, recv_scales, recv_gidx, recv_w = exchange_device(comm, op, xv, scales, idx, weights, send_idx, n_recv,
                                                             sig, rt.table_ptr, outs, user_outs=user_outs,
                                                             push=push, stream=stream, capturing=capturing, rec=rec)
    counts_out = cp.empty(epr, np.int64) if worst else None
    _gpu.fixup(comm, recv_gidx, recv_w, n_recv, epr, table_ptr=rt.table_ptr if worst else 0, sums=rt.sums_ptr,
               counts_out=counts_out, align=align, stream=stream)
    h = new_handle(_comm_ref=make_ref(comm), rank=rank, world_size=w_size, backend=comm.backend,
                   num_experts=n_exp, num_tokens=num_tokens, num_topk=int(num_topk),
                   hidden=int(xv.shape[1]), is_token_in_rank=rt.in_rank, send_token_idx=send_idx,
                   send_counts=send_counts, recv_counts=recv_counts, num_recv_tokens_per_expert_raw=raw,
                   expert_alignment=align, num_worst_tokens=worst, routing=rt, send_rows=send_rows,
                   dispatch_id=dispatch_id)
    if not worst:  # (the handle's row count, summed above: a combine's shape check reads it)
        h.__dict__["_recv_total"] = (recv_counts, n_recv)
    out_x = (recv_x, recv_scales) if scales is not None else recv_x
    counts = counts_out if worst else h.num_recv_tokens_per_expert(align)
    return out_x, recv_gidx, recv_w, counts, h


def _row_elements_strided(a) -> bool:
    """Whether ``a`` (2-D or None) has rows whose elements are not one contiguous run (a copy is sent instead)."""
    return a is not None and a.shape[0] > 0 and a.shape[1] > 1 and a.strides[1] != a.dtype.itemsize


def _rows_contiguous(xp, a):
    """``a`` (2-D or None) itself when its rows are contiguous runs of elements, else a C-contiguous copy."""
    return xp.ascontiguousarray(a) if _row_elements_strided(a) else a


def _out_parts(xv, scales, idx, weights, src=None) -> list:
    """``[(row width in elements, dtype)]`` of the receive arrays of :func:`exchange_device`, one per part that is
    not None (x, scales, top-k ids, weights, source indices)."""
    parts = [(xv.shape[1], xv.dtype)]
    for a, dt in ((scales, _F32), (idx, _I64), (weights, _F32), (src, _I64)):
        if a is not None:
            parts.append((a.shape[1], dt))
    return parts


def device_outputs(xp, n_recv: int, xv, scales, idx, weights, user_outs=None, src=None, *, parts=None) -> list:
    """The receive arrays of :func:`exchange_device` (``n_recv`` rows; one per part that is not None; the first
    rows of dispatch's ``out`` arrays where given: x's, and the scales' after it). ``parts``: :func:`_out_parts`
    of these arguments, when the caller kept it."""
    if parts is None:
        parts = _out_parts(xv, scales, idx, weights, src)
    mine = list(user_outs or ())
    given = [mine[0] if mine else None] + [None] * (len(parts) - 1)
    if scales is not None and mine[1:]:
        given[1] = mine[1]
    # the arrays this call makes, from one allocation (one pool call; each array is new on every call)
    sizes = [0 if g is not None else (n_recv * n * dt.itemsize + 255) & ~255 for (n, dt), g in zip(parts, given)]
    total = sum(sizes)
    mem = xp.cuda.alloc(total) if total else None
    outs, off = [], 0
    nd = xp.ndarray
    for (n, dt), g, size in zip(parts, given, sizes):
        if g is not None:
            outs.append(g[:n_recv])
        else:
            outs.append(nd((n_recv, n), dt, memptr=mem + off) if mem is not None else xp.empty((n_recv, n), dt))
            off += size
    return outs


def exchange_device(comm, op, xv, scales, idx, weights, send_token_idx, n_recv: int, sig: str, table_ptr: int,
                    outs=None, *, user_outs=None, push=None, tag: int = 0, src=None, stream=None, capturing=None,
                    rec=None):
    """:func:`cupy_symbuf.moe.normal._exchange` (the host path's row exchange) of a device-count call (GPU):
    ``n_recv`` output rows (the real count, or the worst-case capacity; ``outs``: already allocated by
    :func:`device_outputs`), the per-peer units read by the ring kernel from the counts table at ``table_ptr``.
    ``user_outs``: dispatch's ``out`` arrays (x, scales); ``push``: their
    :meth:`~cupy_symbuf.transport.engine.Engine.push_targets` (None: computed here; its text is added to ``sig``);
    ``tag``, ``src``: as in ``normal._exchange``; ``stream``, ``capturing``: :meth:`Engine.capture_state` when the
    caller has it (None: asked); ``rec``: the call shape's :class:`_EagerRecord` (its receive parts and prepared
    ring launch, made and kept in it by its first call; ``send_token_idx`` then the routing's int64 C-contiguous
    send index)."""
    xp = comm.xp
    if outs is None:
        outs = device_outputs(xp, n_recv, xv, scales, idx, weights, user_outs, src,
                              parts=None if rec is None else rec.out_parts)
    if rec is not None and rec.ring is not None:  # a repeated eager call: its parts as the first call found them
        send = [xv, idx, weights]
        for i in rec.copy_rows:  # (rows whose elements are not contiguous, as _rows_contiguous finds them)
            send[i] = xp.ascontiguousarray(send[i])
        if capturing:
            comm.keep_for_graph(*send, *outs, capturing=True)
        send_ptrs, recv_ptrs = [], []
        for i in rec.sent:
            send_ptrs.append(send[i].data.ptr)
            recv_ptrs.append(outs[i].data.ptr)
        comm.launch_rows_device(op, rec.ring, send_ptrs, recv_ptrs, send_token_idx.data.ptr, table_ptr, tag=tag,
                                stream=stream)
        return outs[0], None, outs[1], outs[2] if weights is not None else None
    if user_outs is not None and push is None:
        push = comm.push_targets(user_outs)
        if push is not None:
            sig += push[2]
    ids = list(push[0]) if push is not None else None
    send_parts, recv_parts, push_ids = [], [], []
    # the GPU transport reads parts by address, row stride and row bytes only: no unsigned-int views (a CuPy view
    # costs about a microsecond each); rows are copied only where their elements are not contiguous
    for k, (a, out) in enumerate(zip([p for p in (xv, scales, idx, weights, src) if p is not None], outs)):
        if out.shape[1] == 0:
            continue
        send_parts.append(_rows_contiguous(xp, a))
        recv_parts.append(out)
        push_ids.append(ids[k] if ids is not None and k < len(ids) else -1)
    # read / written by every replay of a captured call: the caller's arrays among them too (what the call allocates
    # is kept by dispatch's and combine's keep_allocations_for_graph)
    comm.keep_for_graph(*send_parts, *outs, capturing=capturing)
    if send_parts and rec is not None:  # (no push; the send index is the routing's own, int64 C-contiguous)
        # the record's first call: the ring launch prepared from this call's arrays, and which parts move and which
        # are copied (x, topk_idx, weights: fixed by the record's key)
        parts = [xv, idx, weights]
        rec.sent = [i for i, out in enumerate(outs) if out.shape[1]]
        rec.copy_rows = [i for i in rec.sent if _row_elements_strided(parts[i])]
        rec.ring = comm.prepare_rows_device(op, sig, send_parts, recv_parts, True)
        comm.launch_rows_device(op, rec.ring, [a.data.ptr for a in send_parts], [a.data.ptr for a in recv_parts],
                                send_token_idx.data.ptr, table_ptr, tag=tag, stream=stream)
    elif send_parts:
        comm.exchange_rows_device(op, send_parts, send_token_idx, recv_parts, sig, table_ptr,
                                  push=(push_ids, push[1]) if push is not None else None, tag=tag, stream=stream)
    it = iter(outs[1:])
    recv_x = outs[0]
    recv_scales = next(it) if scales is not None else None
    recv_idx = next(it) if idx is not None else None
    recv_w = next(it) if weights is not None else None
    if src is not None:
        return recv_x, recv_scales, recv_idx, recv_w, next(it)
    return recv_x, recv_scales, recv_idx, recv_w


_REDUCE_KERNELS = {_dt.BFLOAT16: "symbuf_combine_reduce_bf16", _dt.FLOAT16: "symbuf_combine_reduce_f16",
                   _dt.FLOAT32: "symbuf_combine_reduce_f32"}


def reduce_cuda(comm, back, pos, kind: str, out_dtype, num_tokens: int, *, out=None, w_back=None):
    """``(out, w_out)``: ``out[t] = sum_r back[pos[t, r]]`` in float32 (cuda_src/moe.cu), returned as
    ``out_dtype``, and with ``w_back`` (float32 rows) the same sum of its rows in the same launch (else None)."""
    from ..common import backend as _compat
    cp = _compat.cupy
    hidden = back.shape[1]
    if out is None:
        out = cp.empty((num_tokens, hidden), dtype=out_dtype)
    w_out = None if w_back is None else cp.empty((num_tokens, w_back.shape[1]), np.float32)
    if num_tokens and (hidden or w_out is not None):
        if not back.shape[0]:  # nothing came back (every token sent nowhere): the kernel reads no row
            back = cp.empty((1, hidden), back.dtype)
        _gpu.reduce(back, pos, out, num_tokens, hidden, _gpu.reduce_launcher(comm, _REDUCE_KERNELS[kind]),
                    w_back=w_back, w_out=w_out)
    return out, w_out


class _CombineRecord:
    """What a GPU combine of one call shape (handle, ``x``'s dtype and strides, ``dtype``, the weights' dtype and
    strides, whether ``out`` is given) derives before its launches, kept on the handle for the next call of that
    shape: the checked kind, the row signature, the exchange plan and its prepared ring launch (made by the first
    call), the reduction's prepared launch (:class:`~cupy_symbuf.moe.gpu.ReduceLaunch`) and the byte layout of the
    call's allocations. A repeated call then checks the arrays' type, shape and device only (the dtype and
    strides are the key)."""

    __slots__ = ("x_shape", "w_shape", "kind", "copy_x", "copy_w", "sig", "plan", "ring", "red", "send_x", "send_w",
                 "x_dtype", "back_x_bytes", "back_w_off", "back_bytes", "out_x_bytes", "out_w_off", "out_bytes",
                 "repeat")


#: per handle: at most this many combine / cached-dispatch records (a new one past it clears them)
_RECORDS_MAX = 16


def _records(h) -> dict:
    """The handle's dict of call records (:class:`_CombineRecord`, :class:`_CachedRecord`): made on first use, kept
    with the handle (it dies with it); bounded by :data:`_RECORDS_MAX`."""
    recs = h.__dict__.get("_records")
    if recs is None:
        recs = h.__dict__["_records"] = {}
    elif len(recs) >= _RECORDS_MAX:
        recs.clear()
    return recs


def _round_up(n: int, to: int = 256) -> int:
    return (n + to - 1) // to * to


def _combine_record(comm, op, x, h, weights, dtype, out, key) -> tuple:
    """Check a GPU combine's arguments in full and make its :class:`_CombineRecord` (remembered under ``key``
    when there is one). Returns ``(record, x, weights, cx, cw)``: the arrays as checked, and as sent (``cx`` /
    ``cw``: a C-contiguous copy where the record copies them, else the same array)."""
    cp = comm.xp
    n_recv = h.num_recv_tokens
    x = check_array(op, "x", x, comm.backend, dims=(("num_recv_tokens", n_recv), ("hidden", h.hidden)))
    kind = combine_kind(op, x, dtype)
    weights = check_weights(op, comm, weights, n_recv, h.num_topk, "num_recv_tokens")
    rec = _CombineRecord()
    rec.x_shape, rec.w_shape = x.shape, None if weights is None else weights.shape
    rec.kind, rec.x_dtype = kind, x.dtype
    # rows with contiguous elements (any row stride): the reduction reads this rank's own rows from them
    cx, cw = _rows_contiguous(cp, x), _rows_contiguous(cp, weights)
    rec.copy_x, rec.copy_w = cx is not x, cw is not weights
    rec.sig = f"{kind}|hidden={h.hidden}|weights={weights is not None}"
    rec.send_x = cx.shape[1] > 0
    rec.send_w = weights is not None and cw.shape[1] > 0
    parts = ([cx] if rec.send_x else []) + ([cw] if rec.send_w else [])
    rec.plan = comm.device_plan(op, rec.sig, parts, False) if parts else None
    rec.ring = rec.repeat = None  # (made by the record's first call, from its arrays)
    # the rows that come back (x's, then the weights') in one allocation, the outputs in another (the returned
    # arrays are new on every call: nothing is handed out twice)
    rows, n = h.send_rows, h.num_tokens
    k = 0 if weights is None else h.num_topk
    rt = h.routing
    rec.red = _gpu.reduce_prepare(_gpu.reduce_launcher(comm, _REDUCE_KERNELS[kind]), x.dtype.itemsize, h.hidden,
                                  rt.pos_ptr, h.world_size, n, self_rows=cx, table_ptr=rt.table_ptr, rank=h.rank,
                                  num_topk=k, w_self_rows=cw)
    rec.back_x_bytes = rows * h.hidden * x.dtype.itemsize
    rec.back_w_off = _round_up(rec.back_x_bytes)
    rec.back_bytes = rec.back_w_off + rows * k * 4
    rec.out_x_bytes = 0 if out is not None else n * h.hidden * x.dtype.itemsize
    rec.out_w_off = _round_up(rec.out_x_bytes)
    rec.out_bytes = rec.out_w_off + n * k * 4
    if key is not None:
        _records(h)[key] = rec
    return rec, x, weights, cx, cw


def _two_arrays(cp, shape, dtype, w_off: int, nbytes: int, w_shape) -> tuple:
    """``(a, w, memory)``: C-contiguous ``a`` (``shape`` of ``dtype``; None: none) and float32 ``w`` (``w_shape``;
    None: none) from one allocation of ``nbytes``, ``w`` at byte ``w_off`` (a multiple of 256); ``memory`` the
    allocation (None where there is none)."""
    if not nbytes:  # (nothing to hold: empty arrays)
        return (None if shape is None else cp.empty(shape, dtype), None if w_shape is None else
                cp.empty(w_shape, np.float32), None)
    mem = cp.cuda.alloc(nbytes)
    a = None if shape is None else cp.ndarray(shape, dtype, memptr=mem)
    w = None if w_shape is None else cp.ndarray(w_shape, np.float32, memptr=mem + w_off)
    return a, w, mem


def combine_device(comm, op, x, h, weights, dtype, out, stream, capturing: bool):
    """The GPU combine (a handle with device routing): one ring launch (the rows back, per-peer units from the
    dispatch's reverse counts table), one reduction launch (x and the weights); a repeated call of one shape uses
    its :class:`_CombineRecord` (the arguments' type, shape and device checked; the launches prepared, the received
    rows by address)."""
    cp = comm.xp
    nd = cp.ndarray
    rec = key = None
    if type(x) is nd and (weights is None or type(weights) is nd):
        try:
            key = ("combine", x.dtype, x.strides, dtype,
                   None if weights is None else (weights.dtype, weights.strides), out is None)
            rec = h.__dict__.get("_records", {}).get(key)
        except TypeError:  # an unhashable dtype argument: checked in full every call
            key = None
        if rec is not None:
            dev = cp.cuda.runtime.getDevice()
            if x.shape != rec.x_shape or x.data.device_id != dev or (weights is not None and (
                    weights.shape != rec.w_shape or weights.data.device_id != dev)):
                rec = None  # (the full checks below say what is wrong)
    cx = cw = None
    if rec is None:
        rec, x, weights, cx, cw = _combine_record(comm, op, x, h, weights, dtype, out, key)
    if out is not None:
        out = check_out(op, out, comm.backend, (h.num_tokens, h.hidden), x.dtype, inputs=(x, weights))
    if rec.copy_x:  # (the record's first call: the copy it made)
        x = cp.ascontiguousarray(x) if cx is None else cx
    if rec.copy_w:
        weights = cp.ascontiguousarray(weights) if cw is None else cw
    rows, n = h.send_rows, h.num_tokens
    # the rows that come back, x's then the weights' (at back_w_off), in one allocation, read by address only
    mem = cp.cuda.alloc(rec.back_bytes) if rec.back_bytes else None
    back = 0 if mem is None else mem.ptr
    back_w = 0 if mem is None or weights is None else back + rec.back_w_off
    if rec.plan is not None:
        if capturing:  # read / written by every replay (the caller's arrays too)
            comm.keep_for_graph(x, weights, mem, capturing=True)
        if rec.ring is None:  # the record's first call: the ring launch prepared from this call's arrays
            shapes = ([((rows, h.hidden), x.dtype, back)] if rec.send_x else []) + \
                ([((rows, h.num_topk), _F32, back_w)] if rec.send_w else [])
            recv = [nd(sh, dt, memptr=mem + (p - back)) if mem is not None else cp.empty(sh, dt)
                    for sh, dt, p in shapes]
            rec.ring = comm.prepare_rows_device(op, rec.sig, ([x] if rec.send_x else []) +
                                                ([weights] if rec.send_w else []), recv, False)
        comm.launch_rows_device(op, rec.ring, ([x.data.ptr] if rec.send_x else []) +
                                ([weights.data.ptr] if rec.send_w else []),
                                ([back] if rec.send_x else []) + ([back_w] if rec.send_w else []), None,
                                h.routing.rev_table_ptr, tag=h.dispatch_id, stream=stream)
    combined, acc_w, _ = _two_arrays(cp, None if out is not None else (n, h.hidden), x.dtype, rec.out_w_off,
                                     rec.out_bytes, None if weights is None else (n, h.num_topk))
    if out is not None:
        combined = out
    if n and (h.hidden or acc_w is not None):
        if not rows:  # nothing came back (every token sent nowhere): the kernel reads no row
            mem = cp.cuda.alloc(max(16, h.hidden * x.dtype.itemsize))
            back = mem.ptr
        red = rec.red
        _gpu.reduce_run(red, back, combined.data.ptr, x.data.ptr if red.self_has_rows else 0, back_w,
                        0 if acc_w is None else acc_w.data.ptr,
                        0 if weights is None or not weights.shape[0] else weights.data.ptr, stream)
    if out is None and not capturing and not rec.copy_x and not rec.copy_w and rec.send_x and \
            (weights is None or rec.send_w) and rows and n and x.shape[0]:  # this shape's fast path (made once)
        if rec.repeat is None:
            rec.repeat = _repeat_combine(comm, op, h, x, weights, dtype, rec, combined, acc_w) or False
        if rec.repeat:
            h.__dict__[REPEAT_COMBINE] = rec.repeat
    return combined, acc_w


def _repeat_combine(comm, op, h, x, weights, dtype_arg, rec, combined, acc_w):
    """The combine :class:`_Repeat` of a call with handle ``h`` and ``dtype=dtype_arg`` that ran the full path with
    record ``rec`` (its ring launch prepared; x's and the weights' rows sent in place; rows to receive and tokens to
    reduce; no ``out``): the received rows from a pool of their own (one allocation per stream, never handed out),
    the outputs ``combined`` / ``acc_w`` (their shapes and dtypes) from another. None where the calls must take the
    full path (one rank)."""
    ring = comm.repeat_prepare(op, rec.ring, None, h.routing.rev_table_ptr, tag=h.dispatch_id)
    if ring is None:
        return None
    cp = comm.xp
    r = _Repeat()
    r.dtype, r.shape, r.strides = x.dtype, x.shape, x.strides
    r.w_dtype, r.w_shape, r.w_strides = (None, None, None) if weights is None else \
        (weights.dtype, weights.shape, weights.strides)
    r.device, r.dtype_arg = x.data.device_id, dtype_arg
    r.ring, r.red, r.back_w_off = ring, rec.red, rec.back_w_off
    r.back, r.back_memory, r.back_bytes = {}, {}, rec.back_bytes  # (per stream: _back_rows)
    shape, dtype, w_off, nbytes = combined.shape, combined.dtype, rec.out_w_off, rec.out_bytes
    w_shape = None if acc_w is None else acc_w.shape
    if w_shape is None:
        r.outs = OutputPool(lambda: (cp.empty(shape, dtype),))
    else:
        r.outs = OutputPool(lambda: _two_arrays(cp, shape, dtype, w_off, nbytes, w_shape)[:2])
    return r


def combine_repeat(comm, op, h, r: _Repeat, x, weights, dtype_arg):
    """A combine of ``x`` (and ``weights``) with handle ``h`` (made by ``comm``, ``r`` its combine :class:`_Repeat`),
    no ``out`` and ``dtype=dtype_arg``, when the call has the repeat record's shape and the very ``dtype`` object of
    the call that made it (else None, having done nothing): the received rows and the outputs from the record's
    pools, one ring launch, one reduction launch. Returns ``(combined_x, combined_topk_weights or None)``. Outside a
    CUDA graph capture only (None while capturing)."""
    cp = comm.xp
    nd = cp.ndarray
    if type(x) is not nd or x.dtype is not r.dtype or x.shape != r.shape or x.strides != r.strides or \
            dtype_arg is not r.dtype_arg or h._comm_ref() is not comm:
        return None
    if weights is None:
        if r.w_dtype is not None:
            return None
    elif type(weights) is not nd or weights.dtype is not r.w_dtype or weights.shape != r.w_shape or \
            weights.strides != r.w_strides or weights.data.device_id != r.device:
        return None
    if x.data.device_id != r.device or r.device != cp.cuda.runtime.getDevice():
        return None
    stream = cp.cuda.get_current_stream()
    if stream.is_capturing():
        return None
    if weights is None:
        return _run_repeat(comm, op, r, stream, x.data.ptr, 0)[0], None
    return _run_repeat(comm, op, r, stream, x.data.ptr, weights.data.ptr)
