"""The GPU path of :mod:`cupy_symbuf.moe`: layout, count exchange and per-peer counts stay on the device.

DeepEP's design (``get_dispatch_layout`` as a kernel, ``notify_dispatch`` exchanging the counts on the device and
the host waiting once through host-mapped memory, or not at all with ``num_worst_tokens``), built from our parts:

* ``symbuf_moe_layout`` (``cuda_src/moe.cu``, one launch): ``is_token_in_rank``, the counts per rank and per
  expert, the count exchange's values ``[world_size, 1 + num_local_experts]``, the send position of every
  (token, rank) pair (``pos``; the combine reads it back) and ``send_idx`` (the token of every send row), and the
  number of ``topk_idx`` values out of range (the count exchange then rejects the call on every rank).
* ``symbuf_notify`` in device-count mode (``cuda_src/ring_exchange.cu``): writes two counts tables
  (``protocol.CT_*``: this call's units per peer and the reverse call's, for ``combine``) and the per-expert sums
  into the handle's device block; the ring kernel reads its units from there (``DESC_COUNTS``), so one launch
  descriptor serves every routing (the plan is cached per row format, never per count).
* ``symbuf_moe_layout_notify`` (``cuda_src/ring_exchange.cu``): the two above in one launch, for an eager dispatch
  (:func:`layout_notify_fields`, ``CudaTransport.notify_layout_device``).
* eager mode: the host reads the receive counts once (the notify's host-mapped result) to size the outputs;
  worst-case mode (``num_worst_tokens``): outputs sized for the worst case and nothing read on the host, so the
  whole dispatch / combine can be captured in a CUDA graph.
* ``symbuf_moe_recv_fixup``: local expert ids, weights of other ranks' slots zeroed, rows past the real count set
  to ``-1`` / ``0`` (worst case), per-expert counts aligned on the device.
"""
from __future__ import annotations

import functools

import numpy as np

from ..common import backend as _compat
from ..transport import kernels as _kernels
from ..wire import protocol as P

SOURCE = "moe.cu"
LAYOUT_KERNEL = "symbuf_moe_layout"
FIXUP_KERNEL = "symbuf_moe_recv_fixup"
CT = P.CT_WORDS
#: The layout kernel keeps one int32 counter per expert in dynamic shared memory next to ~13 KiB of static arrays,
#: all within the 48 KiB a block gets without opting in (tests/test_kernels_compile.py checks the sum).
MAX_EXPERTS = 8192


def _ptr(a) -> int:
    """Device address of an array, an address given as an int, or 0 for None."""
    if a is None:
        return 0
    return a if isinstance(a, int) else a.data.ptr


def _launcher(eng, name: str):
    """The engine's own :class:`~cupy_symbuf.transport.kernels.Launcher` of ``moe.cu``'s kernel ``name`` (its GPU
    is fixed: no device lookup per call; its argument struct: ``wire/kernel_args.py`` ``KERNELS[name]``; shared with
    no other communicator, so two threads with two communicators never fill one struct at once)."""
    cache = eng.__dict__.setdefault("_moe_launchers", {})
    fn = cache.get(name)
    if fn is None:
        fn = cache[name] = _kernels.new_launcher(SOURCE, name)
    return fn


def contiguous(idx):
    return idx if idx.flags.c_contiguous else _compat.cupy.ascontiguousarray(idx)


def _layout_threads(n: int, W: int) -> int:
    """Threads of the layout kernel's one block for ``n`` tokens and ``W`` ranks (a warp per rank at least)."""
    return max(32 * W, min(1024, max(32, (n + 31) // 32 * 32)))


def layout(eng, idx, num_experts: int, *, per_rank=None, per_expert=None, in_rank=None, meta=None, bad=None,
           sticky: bool = False, pos=None, send_idx=None, stream=None) -> None:
    """Launch the layout kernel on the current stream for int64 C-contiguous ``idx [N, K]`` (outputs: device
    arrays, addresses as ints, or None; see ``cuda_src/moe.cu``; ``stream``: the current stream, when the caller has
    it)."""
    n, k = idx.shape
    W = eng.world_size
    threads = _layout_threads(n, W)
    sticky_ptr = eng.transport.layout_error.ptr if sticky else 0
    launch = _launcher(eng, LAYOUT_KERNEL)
    # MoeLayoutArgs in order (layout_run: the same)
    launch.pack(idx.data.ptr, n, k, num_experts, W, _ptr(per_rank), _ptr(per_expert), _ptr(in_rank), _ptr(meta),
                _ptr(bad), sticky_ptr, _ptr(pos), _ptr(send_idx))
    launch(1, threads, shared_mem=4 * num_experts, stream=stream)


def layout_fields(eng, n: int, k: int, num_experts: int) -> tuple:
    """``(launcher, threads, fields)`` of a dispatch's layout launch (:func:`layout`) for ``idx [n, k]``: ``fields``
    the ``MoeLayoutArgs`` in order with 0 for every address, for a caller that keeps them per call shape and writes
    the addresses per call (:func:`layout_run`)."""
    W = eng.world_size
    return _launcher(eng, LAYOUT_KERNEL), _layout_threads(n, W), (0, n, k, num_experts, W, 0, 0, 0, 0, 0, 0, 0, 0)


def layout_run(prepared: tuple, idx_ptr: int, rt: "Routing", stream=None) -> None:
    """The layout launch of a dispatch (:func:`layout_fields` kept per call shape) writing ``rt``'s routing: the
    same fields as :func:`layout` with ``in_rank``, ``meta``, ``bad``, ``pos`` and ``send_idx`` of ``rt``."""
    launch, threads, f = prepared
    # MoeLayoutArgs in order: idx, num_tokens, num_topk, num_experts, world_size, per_rank, per_expert, in_rank,
    # meta, bad, bad_sticky, pos, send_idx
    launch.pack(idx_ptr, f[1], f[2], f[3], f[4], 0, 0, rt.in_rank_ptr, rt.meta_ptr, rt.bad_ptr, 0, rt.pos_ptr,
                rt.send_idx_ptr)
    launch(1, threads, shared_mem=4 * f[3], stream=stream)


def layout_notify_fields(eng, n: int, k: int, num_experts: int, M: int) -> tuple:
    """``(num_tokens, num_topk, num_experts, threads, shared_mem)`` of an eager dispatch's fused layout and count
    exchange launch (``symbuf_moe_layout_notify``, :meth:`~cupy_symbuf.transport.engine.Engine.notify_device`'s
    ``layout``) for ``idx [n, k]`` and ``M`` values per rank: threads enough for both bodies (the layout's
    :func:`_layout_threads`, the count exchange's ``max(W, M)``), the layout's ``num_experts`` int32 counters in
    dynamic shared memory (``tests/test_kernels_compile.py`` checks that ``MAX_EXPERTS`` of them fit next to both
    bodies' static arrays)."""
    W = eng.world_size
    threads = max(_layout_threads(n, W), min(1024, (max(W, M) + 31) // 32 * 32))
    return n, k, num_experts, threads, 4 * num_experts


def layout_notify_args(fields: tuple, idx_ptr: int, rt: "Routing") -> tuple:
    """The ``layout`` tuple of one call (:meth:`CudaTransport.notify_layout_device`): ``fields``
    (:func:`layout_notify_fields`) with ``idx``'s address and ``rt``'s routing outputs."""
    n, k, e, threads, smem = fields
    return idx_ptr, n, k, e, rt.in_rank_ptr, rt.pos_ptr, rt.send_idx_ptr, threads, smem


def reduce_launcher(eng, kernel: str):
    """The engine's :class:`~cupy_symbuf.transport.kernels.Launcher` of the combine reduction ``kernel``
    (``symbuf_combine_reduce_*``; a caller may keep it for repeated calls)."""
    return _launcher(eng, kernel)


def _self_rows(a, width: int) -> tuple:
    """``(address or 0, row stride in elements)`` of a combine input read for this rank's own rows (None: (0, 0))."""
    if a is None:
        return 0, 0
    return (a.data.ptr if a.shape[0] else 0), (a.strides[0] // a.dtype.itemsize if a.shape[0] > 1 else width)


class ReduceLaunch:
    """What a combine reduction launch (``symbuf_combine_reduce_*``) takes from its call shape, made by
    :func:`reduce_prepare` and kept for repeated calls (:func:`reduce_run` adds the call's addresses): the launcher,
    the fields that do not change between calls of the shape, and the grid and block of the vector (16-byte loads)
    and scalar variants (which one runs depends on the addresses' alignment)."""

    __slots__ = ("launch", "num_tokens", "hidden", "world_size", "pos", "self_stride", "table", "rank",
                 "w_self_stride", "k", "vec_ok", "grid", "block_vec", "block", "self_has_rows")


def reduce_prepare(launch, item: int, hidden: int, pos_ptr: int, world_size: int, num_tokens: int, *,
                   self_rows=None, table_ptr: int = 0, rank: int = 0, num_topk: int = 0,
                   w_self_rows=None) -> ReduceLaunch:
    """The :class:`ReduceLaunch` of a reduction of rows of ``item``-byte elements (see :func:`reduce`; ``pos_ptr``:
    the address of ``pos`` ``[num_tokens, world_size]``; ``num_topk`` 0: no weights)."""
    r = ReduceLaunch()
    row = hidden * item
    _, self_stride = _self_rows(self_rows, hidden)
    _, w_self_stride = _self_rows(w_self_rows, num_topk)
    r.launch, r.num_tokens, r.hidden, r.world_size, r.pos = launch, num_tokens, hidden, world_size, pos_ptr
    r.self_stride, r.table, r.rank, r.w_self_stride, r.k = self_stride, table_ptr, rank, w_self_stride, num_topk
    r.self_has_rows = self_rows is not None and self_rows.shape[0] > 0
    r.vec_ok = row % 16 == 0 and (self_stride * item) % 16 == 0
    r.grid = min(num_tokens, 65535)
    r.block_vec = min(256, max(32, (max(row // 16, num_topk) + 31) // 32 * 32))
    r.block = min(256, max(32, (max(hidden, num_topk) + 31) // 32 * 32))
    return r


def reduce_run(r: ReduceLaunch, back_ptr: int, out_ptr: int, self_ptr: int = 0, w_back_ptr: int = 0,
               w_out_ptr: int = 0, w_self_ptr: int = 0, stream=None) -> None:
    """Launch the reduction ``r`` with this call's addresses (``self_ptr``: the combine input's, 0 when it has no
    rows; ``w_back_ptr``, ``w_out_ptr``, ``w_self_ptr`` 0: no weights) on ``stream`` (None: the current one)."""
    vec = r.vec_ok and not (back_ptr | out_ptr | self_ptr) & 15  # 16 bytes per load
    r.launch.pack(back_ptr, r.pos, out_ptr, r.num_tokens, r.hidden, r.world_size, 1 if vec else 0, self_ptr,
                  r.self_stride, r.table, r.rank, w_back_ptr, w_out_ptr, w_self_ptr, r.w_self_stride, r.k)
    r.launch(r.grid, r.block_vec if vec else r.block, stream=stream)


def reduce(back, pos, out, num_tokens: int, hidden: int, launch, *, self_rows=None, table_ptr: int = 0,
           rank: int = 0, w_back=None, w_out=None, w_self_rows=None, stream=None) -> None:
    """Launch a combine reduction (``symbuf_combine_reduce_*``, one launch for x and the top-k weights):
    ``out[t] = sum_r row(t, r)`` in float32, ranks in order, where ``row(t, r)`` is ``back[pos[t, r]]``, or with
    ``self_rows`` (the combine's input, rows of ``back``'s dtype, any row stride) this rank's own row read straight
    from it (the ring moved none: the reverse counts table has no units to itself; ``table_ptr``: the dispatch's
    counts table); with ``w_out`` (float32 ``[num_tokens, num_topk]``) the same sum of the weights' rows
    ``w_back`` (float32 ``[rows, num_topk]``, C-contiguous) and ``w_self_rows`` in the same launch. ``launch``: the
    kernel's :func:`reduce_launcher`; ``stream``: the current stream (None: asked)."""
    k = 0 if w_out is None else w_out.shape[1]
    r = reduce_prepare(launch, back.dtype.itemsize, hidden, pos.data.ptr, pos.shape[1], num_tokens,
                       self_rows=self_rows, table_ptr=table_ptr, rank=rank, num_topk=k, w_self_rows=w_self_rows)
    reduce_run(r, back.data.ptr, out.data.ptr, _self_rows(self_rows, hidden)[0],
               0 if w_out is None else w_back.data.ptr, 0 if w_out is None else w_out.data.ptr,
               _self_rows(w_self_rows, k)[0], stream)


def get_dispatch_layout(eng, op: str, idx, num_experts: int):
    """``(num_tokens_per_rank int32 [W], num_tokens_per_expert int32 [E], is_token_in_rank bool [N, W])`` from one
    kernel launch, nothing read on the host: ``topk_idx`` values out of range are left out of the counts and
    raised by the next ``synchronize()`` (at once with ``Config.blocking``)."""
    cp = _compat.cupy
    W = eng.world_size
    n = idx.shape[0]
    # one allocation for the three outputs (one pool call; new arrays on every call): [per rank | per expert], then
    # is_token_in_rank at the next 256 bytes
    off = (4 * (W + num_experts) + 255) // 256 * 256
    mem = cp.cuda.alloc(off + n * W)
    per_rank = cp.ndarray((W,), np.int32, memptr=mem)
    per_expert = cp.ndarray((num_experts,), np.int32, memptr=mem + 4 * W)
    in_rank = cp.ndarray((n, W), dtype=bool, memptr=mem + off)
    eng.transport.layout_error_what = (idx.shape, num_experts)
    layout(eng, contiguous(idx), num_experts, per_rank=per_rank, per_expert=per_expert, in_rank=in_rank,
           sticky=True)
    if eng.config.blocking:
        cp.cuda.get_current_stream().synchronize()
        eng.transport.check_layout_error(op)
    return per_rank, per_expert, in_rank


@functools.lru_cache(maxsize=64)
def _routing_layout(n: int, W: int, M: int) -> tuple:
    """``(block words, pos offset, send_idx offset, in_rank offset, total bytes)`` of a :class:`Routing`'s one
    allocation: the block (see the class), ``pos``, ``send_idx`` and ``in_rank``, each at a multiple of 256 bytes."""
    words = 2 * CT + M + 2 + W * M  # (+ the count exchange's values, [W, M])
    offs, total = [], 0
    for size in (8 * words, 8 * n * W, 8 * max(1, n * W), n * W):
        offs.append(total)
        total += (size + 255) // 256 * 256
    return (words,) + tuple(offs[1:]) + (total,)


class Routing:
    """What one dispatch's layout and count exchange made on the device (kept by the handle).

    ``block`` int64 ``[2 * CT_WORDS + M + 2]``: the counts table of the dispatch, that of the combine (the reverse
    call), the per-expert sums of the count exchange (``[0]`` = rows received), and the layout's bad-value count.
    ``pos`` int64 ``[N, W]``, ``send_idx`` int64 ``[N * W]``, ``in_rank`` bool ``[N, W]``.
    """

    __slots__ = ("M", "W", "n", "table_ptr", "rev_table_ptr", "sums_ptr", "bad_ptr", "meta_ptr", "pos_ptr",
                 "send_idx_ptr", "in_rank", "in_rank_ptr", "_mem", "_words", "_idx_len", "_block", "_pos", "_send_idx")

    def __init__(self, n: int, k: int, W: int, M: int):
        cp = _compat.cupy
        # the four arrays from one allocation (they live as long as the handle, together): one pool call, not four
        words, pos_off, idx_off, in_rank_off, total = _routing_layout(n, W, M)
        mem = self._mem = cp.cuda.alloc(total)
        self.M, self.W, self.n = M, W, n
        # the parts by address on the hot path (views cost us each): the counts table, the reverse one, the
        # per-expert sums, the bad-value count and the count exchange's values (in the block), pos, send_idx
        t = self.table_ptr = mem.ptr
        self.rev_table_ptr, self.sums_ptr = t + 8 * CT, t + 8 * 2 * CT
        self.bad_ptr = t + 8 * (2 * CT + M)
        self.meta_ptr = self.bad_ptr + 16
        self.pos_ptr, self.send_idx_ptr = t + pos_off, t + idx_off
        self.in_rank = cp.ndarray((n, W), dtype=bool, memptr=mem + in_rank_off)
        self.in_rank_ptr = t + in_rank_off
        # block, pos and send_idx: arrays made when first asked for
        self._words, self._idx_len = words, max(1, n * W)
        self._block = self._pos = self._send_idx = None

    @property
    def pos(self):
        """int64 ``[N, W]``: the send position of every (token, rank) pair (-1: not sent)."""
        a = self._pos
        if a is None:
            a = self._pos = _compat.cupy.ndarray((self.n, self.W), np.int64,
                                                 memptr=self._mem + (self.pos_ptr - self.table_ptr))
        return a

    @property
    def block(self):
        """int64 ``[2 * CT_WORDS + M + 2 + W * M]`` (see the class)."""
        b = self._block
        if b is None:
            b = self._block = _compat.cupy.ndarray((self._words,), np.int64, memptr=self._mem)
        return b

    @property
    def send_idx(self):
        """int64 ``[max(1, N * W)]``: the token of every send row (grouped by destination rank)."""
        a = self._send_idx
        if a is None:
            a = self._send_idx = _compat.cupy.ndarray((self._idx_len,), np.int64,
                                                      memptr=self._mem + (self.send_idx_ptr - self.table_ptr))
        return a

    def send_rows_idx(self, rows: int):
        """A new int64 ``[rows]`` array over the first ``rows`` entries of :attr:`send_idx` (``rows <= N * W``; the
        same memory as ``send_idx[:rows]``, made without the full array)."""
        return _compat.cupy.ndarray((rows,), np.int64, memptr=self._mem + (self.send_idx_ptr - self.table_ptr))

    # views of the block (errors, worst-case counts)

    @property
    def table(self):
        return self.block[:CT]

    @property
    def sums(self):
        return self.block[2 * CT:2 * CT + self.M]

    @property
    def bad(self):
        return self.block[2 * CT + self.M:2 * CT + self.M + 2]

    @property
    def num_recv_tokens(self):
        """0-d int64 device array: rows this rank received (0 when the call was skipped)."""
        return self.block[P.CT_RECV_TOTAL]


def fixup(eng, gidx, w, rows: int, epr: int, *, table_ptr: int, sums, counts_out, align: int, stream=None) -> None:
    """Launch the receive fix-up (``cuda_src/moe.cu``) on the current stream; ``table_ptr`` 0: every row is real;
    ``stream``: the current stream, when the caller has it."""
    k = gidx.shape[1]
    n = rows * k
    if n == 0 and counts_out is None:
        return
    launch = _launcher(eng, FIXUP_KERNEL)
    # MoeFixupArgs in order: gidx, w, rows, num_topk, first_expert, epr, table, sums, counts_out, align
    launch.pack(gidx.data.ptr if n else 0, _ptr(w) if n else 0, rows, k, eng.rank * epr, epr, table_ptr, _ptr(sums),
                _ptr(counts_out), align)
    launch(max(1, min(1024, (n + 255) // 256)), 256, stream=stream)


def fixup_launcher(eng):
    """The engine's launcher of the receive fix-up (a caller may keep it for repeated calls: :func:`fixup_run`)."""
    return _launcher(eng, FIXUP_KERNEL)


def fixup_run(launch, gidx_ptr: int, w_ptr: int, rows: int, num_topk: int, first_expert: int, epr: int,
              sums_ptr: int, align: int, stream=None) -> None:
    """:func:`fixup` of an eager dispatch (every row real, no per-expert counts on the device) by address:
    ``rows * num_topk > 0`` (the caller skips an empty one); ``w_ptr`` 0: no weights."""
    # MoeFixupArgs in order: gidx, w, rows, num_topk, first_expert, epr, table, sums, counts_out, align
    launch.pack(gidx_ptr, w_ptr, rows, num_topk, first_expert, epr, 0, sums_ptr, 0, align)
    launch(max(1, min(1024, (rows * num_topk + 255) // 256)), 256, stream=stream)
