"""Mixture-of-experts dispatch and combine with DeepEP's normal-mode (intranode) semantics.

The semantics follow DeepEP's ``Buffer.get_dispatch_layout``, ``Buffer.dispatch`` and ``Buffer.combine``
(``deep_ep/buffer.py``, https://github.com/deepseek-ai/DeepEP), intranode case. This module is the reference
design on the host backend (NumPy, the reference the tests check against); the cuda backend runs the same
semantics with the control on the device (:mod:`cupy_symbuf.moe.gpu`: the layout kernel, the count exchange
writing device counts tables, the ring kernel reading its counts from them, a receive fix-up kernel), and reads
only the receive counts on the host, once, through host-mapped memory; in worst-case mode (``num_worst_tokens``)
nothing at all.

This module holds the public calls, their argument checks and the host path; the GPU half (the device-routing
dispatch, cached dispatch and combine, and their launches) is :mod:`cupy_symbuf.moe.normal_cuda`, the handle
:mod:`cupy_symbuf.moe.normal_handle` (:class:`DispatchHandle`, re-exported here).

Data flow
---------
The functions take the communicator's internal interface (``cupy_symbuf.transport.engine.Engine``: ``call``, ``notify``,
``exchange_rows``, ``xp``, ``backend``, ``rank``, ``world_size``, ``config``), never ``Communicator`` privates.

``dispatch`` = layout (``xp``) -> count exchange ``Engine.notify`` (DeepEP's ``notify_dispatch``: every rank
sends each peer ``[num_tokens_to_peer, num_tokens_to_each_of_peer's_experts...]`` and the row format as the
notify signature; every rank takes part, also with zero tokens) -> one row exchange ``Engine.exchange_rows`` with
the receive counts already known (no second count exchange), each ring run behind its call header. A row is ``x`` | fp8 scales | ``topk_idx`` (global expert ids) | ``topk_weights``
of one (token, destination rank); a cached dispatch (with ``handle``) sends only ``x`` | scales.
On the GPU the ring kernel (``cuda_src/ring_exchange.cu``) gathers each row's parts from the caller's arrays through
the token index straight into the channel rings and scatters them from the rings into the output arrays (no packed
copy); ring slots hold whole rows, so a row must fit in ``Config.chunk_bytes`` there (``ValueError`` otherwise).
On the host the rows are packed with NumPy, sent through the same ring protocol and unpacked.

``combine`` = the row exchange back (rows ``x`` | ``topk_weights``) with both count vectors taken from the handle
-> float32 accumulation, one source rank at a time in rank order (a token appears at most once per rank, so the
summation order is fixed: results are bitwise reproducible) -> rounded once to ``x``'s dtype. On the GPU the
accumulation of ``x`` and ``topk_weights`` is one kernel launch (``cuda_src/moe.cu``, ``symbuf_combine_reduce_*``);
on the host NumPy scatter-adds. A repeated GPU combine or cached dispatch of one call shape (handle, dtype, strides)
runs from a record its first call kept on the handle (the checked kind, the row signature, the prepared launches),
checking only the arrays' type, shape and device; so does a repeated eager GPU dispatch (no handle, no ``out``:
its record in the communicator's per-call-shape memo, keyed by the arrays' dtypes, shapes and strides and the
integer arguments) and ``get_dispatch_layout``. A combine or cached dispatch of the very shape the handle ran last,
without ``out`` and outside a CUDA graph capture, compares a few words and launches: its ring launch keeps a
descriptor of its own, and its outputs come from a pool of the record that hands an array out again only once
nothing refers to it, a view of it or its memory, and only on the stream it was made on (as CuPy's pool would).

Expert placement
----------------
Experts are placed contiguously: with ``num_local_experts = num_experts // world_size``, expert ``e`` lives on rank
``e // num_local_experts`` and is that rank's local expert ``e % num_local_experts``. ``num_experts`` must be a
positive multiple of ``world_size``.

Dtypes
------
``x`` may be bfloat16 (``ml_dtypes.bfloat16`` on NumPy, CuPy's ``bfloat16`` dtype, or raw ``uint16`` bits, which
dispatch moves unchanged and ``combine(..., dtype="bfloat16")`` interprets), float16 or float32; or the fp8 tuple
``(x_fp8, scales)`` with ``x_fp8`` float8_e4m3fn (``ml_dtypes.float8_e4m3fn`` or raw ``uint8`` bits) and
``scales`` float32 ``[num_tokens, hidden // 128]`` (any strides). Outputs have the input dtypes.

Errors
------
Every argument is validated before the first collective step, so a rejected call (made on every rank, as the
collective contract requires) leaves the communicator usable. ``TypeError``: wrong array module for the backend,
wrong dtype, a handle that is not a :class:`DispatchHandle`. ``ValueError``: shapes, ranges, divisibility, a
handle from another communicator. Messages name the operation, the argument and the rule (the checks are
:mod:`cupy_symbuf.moe.checks` and :mod:`cupy_symbuf.common.checks`).
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from . import gpu as _gpu
from .checks import (FP8_BLOCK, NOTIFY_EXTRA, check_cached, check_counts, check_device_experts, check_expert_alignment,
                     check_handle, check_num_experts, check_topk_idx, check_weights, check_x, combine_kind,
                     count_value_error, row_bytes)
from .normal_cuda import (REPEAT_COMBINE, REPEAT_DISPATCH, cached_device, cached_repeat, combine_device,
                          combine_repeat, device_outputs, dispatch_cuda, eager_from_record, eager_key, eager_record,
                          exchange_device, layout_key, new_eager_record, reduce_cuda, remember)
from .normal_handle import DispatchHandle, make_ref
from .routing import token_layout
from ..collectives import wire_dtype as _wire
from ..common import dtypes as _dt
from ..common.checks import check_array, check_int, check_out
from ..common.errors import SymBufferMismatchError
from ..wire.channel_layout import check_row_fits
from ..transport.engine import check_sync

__all__ = ["DispatchHandle", "get_dispatch_layout", "dispatch", "combine", "FP8_BLOCK"]


# ------------------------------------------------------------------------------------------------ validation
# (the MoE checks shared with the hierarchical dispatch are moe.checks; these read this module's buffers)


def _check_out(op: str, comm, out, xv, scales, inputs=()) -> Optional[list]:
    """Validate dispatch's ``out``: for an array ``x``, an array of ``x``'s dtype (or the unsigned integer type of
    its size: raw bits) ``[capacity, hidden]``; for an fp8 tuple, a tuple ``(out_x, out_scales)`` of ``[capacity,
    hidden]`` (x_fp8's dtype) and ``[capacity, hidden // 128]`` float32; C-contiguous, writeable, sharing no memory
    with ``x``, the scales or the other ``inputs`` (topk_idx, topk_weights). Returns the arrays (viewed as the
    transport's dtypes) or None."""
    if out is None:
        return None
    fp8 = scales is not None
    if fp8 != isinstance(out, tuple) or (fp8 and len(out) != 2):
        raise TypeError(f"{op}: argument 'out' must be " + ("a tuple (out_x, out_scales) for an fp8 tuple x" if fp8 else
                                                 "an array (a tuple only for an fp8 tuple x)") +
                        f", got {type(out).__name__}")
    wanted = [(xv, "out[0]" if fp8 else "out")] + ([(scales, "out[1]")] if fp8 else [])
    arrays = []
    for (ref, name), a in zip(wanted, out if fp8 else (out,)):
        a = check_array(op, name, a, comm.backend,
                        dims=(("capacity", None), ("hidden" if ref is xv else f"hidden // {FP8_BLOCK}", ref.shape[1])))
        raw = np.dtype(_UINT_OF_SIZE[ref.dtype.itemsize])
        if a.dtype != ref.dtype and a.dtype != raw:
            raise TypeError(f"{op}: argument '{name}' must have dtype {ref.dtype} (the received rows'), or {raw} "
                            f"(their raw bits), got {a.dtype}")
        if not a.flags.c_contiguous:
            raise ValueError(f"{op}: argument '{name}' must be C-contiguous (rows are written in place), got strides "
                             f"{a.strides}")
        if not getattr(a.flags, "writeable", True):  # CuPy arrays have no such flag (always writeable)
            raise ValueError(f"{op}: argument '{name}' must be writeable (the received rows are written into it)")
        comm.check_live(op, name, a)
        for other, what in [(xv, "x"), (scales, "the scales of x"), *inputs] + [(b, "out[0]") for b in arrays]:
            if other is not None and a.size and other.size and comm.xp.may_share_memory(a, other):
                raise ValueError(f"{op}: argument '{name}' must not share memory with {what} (it is written while "
                                 f"the inputs are still being read)")
        arrays.append(a if a.dtype == ref.dtype else a.view(ref.dtype))
    if arrays[1:] and arrays[1].shape[0] != arrays[0].shape[0]:
        raise ValueError(f"{op}: arguments 'out[0]' and 'out[1]' must have the same rows (capacity), got "
                         f"{arrays[0].shape[0]} and {arrays[1].shape[0]}")
    return arrays


def _check_capacity(op: str, outs, rows: int, what: str) -> None:
    if outs is not None and outs[0].shape[0] < rows:
        raise ValueError(f"{op}: argument 'out' must hold the {rows} rows this rank receives ({what}), got "
                         f"{outs[0].shape[0]} rows, fewer than that")


# ------------------------------------------------------------------------------------------------ helpers


def _to_host(comm, a) -> np.ndarray:
    return a.get() if comm.backend == "cuda" else np.asarray(a)


_UINT_OF_SIZE = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


# ------------------------------------------------------------------------------------------------ API


def get_dispatch_layout(comm, topk_idx, num_experts: int):
    """Where each token goes, computed locally (GPU: one kernel; host: NumPy); no communication.

    DeepEP: ``Buffer.get_dispatch_layout`` (``deep_ep/buffer.py``), intranode (no RDMA ranks).

    Parameters
    ----------
    topk_idx : xp.ndarray ``[num_tokens, num_topk]``, int64 (int32 accepted)
        Expert chosen by each token in each of its top-k slots; ``-1`` means no expert (the slot is ignored).
        Expert ``e`` lives on rank ``e // (num_experts // world_size)``.
    num_experts : int
        Global number of experts, a positive multiple of ``world_size``.

    Returns
    -------
    num_tokens_per_rank : xp.ndarray ``[world_size]`` int32
        Tokens to send to each rank; a token counts once per rank however many of its experts live there.
    num_tokens_per_expert : xp.ndarray ``[num_experts]`` int32
        (token, slot) pairs naming each expert (``-1`` slots not counted).
    is_token_in_rank : xp.ndarray ``[num_tokens, world_size]`` bool
        Whether token ``t`` goes to rank ``r``. A row whose slots are all ``-1`` is all False.

    Raises
    ------
    TypeError
        ``topk_idx`` not an array of the backend's module, or not int64/int32; ``num_experts`` not an int.
    ValueError
        ``topk_idx`` not 2-D or without columns; a value ``< -1`` or ``>= num_experts`` (on the GPU the layout is
        one kernel and nothing is read on the host: such values are left out of the counts and raised by the next
        ``synchronize()``, or at once with ``Config.blocking``); ``num_experts`` not a positive multiple of
        ``world_size`` (GPU: or more than 8192).

    Notes
    -----
    On the GPU the layout is one kernel (``cuda_src/moe.cu`` ``symbuf_moe_layout``, after DeepEP's
    ``get_dispatch_layout`` kernel), queued on the current stream; the outputs are valid in stream order.
    """
    op = "get_dispatch_layout"
    comm.check_open()
    cuda = comm.backend == "cuda"
    if cuda:
        # a call shape whose checks passed before (topk_idx's dtype, shape and strides, num_experts as an int): only
        # the device is checked again (what the checks decided is the cast to int64, nothing else)
        key = layout_key(comm.xp, topk_idx, num_experts)
        cast = None if key is None else comm.call_memo.get(key)
        if cast is not None and topk_idx.data.device_id != comm.xp.cuda.runtime.getDevice():
            cast = None  # (the full checks say what is wrong)
        with comm.keep_allocations_for_graph():  # captured: the int64 / contiguous copy of topk_idx is read by replays
            if cast is not None:
                return _gpu.get_dispatch_layout(comm, op, topk_idx.astype(np.int64) if cast[0] else topk_idx,
                                                num_experts)
            n_exp = check_num_experts(op, comm, num_experts)
            idx = check_topk_idx(op, comm, topk_idx, n_exp, check_range=False)
            check_device_experts(op, n_exp, _gpu.MAX_EXPERTS)
            if key is not None:
                remember(comm, key, (idx is not topk_idx,))
            return _gpu.get_dispatch_layout(comm, op, idx, n_exp)
    n_exp = check_num_experts(op, comm, num_experts)
    idx = check_topk_idx(op, comm, topk_idx, n_exp)
    return token_layout(comm.xp, idx, n_exp, comm.world_size)


def dispatch(comm, x, topk_idx=None, topk_weights=None, num_experts: Optional[int] = None, *,
             handle: Optional[DispatchHandle] = None, expert_alignment: int = 1, num_worst_tokens: int = 0,
             wire_dtype: Optional[str] = None, out=None, is_token_in_rank=None, num_tokens_per_rank=None,
             num_tokens_per_expert=None):
    """Send each token to every rank that holds at least one of its experts, once per rank. Collective.

    DeepEP: ``Buffer.dispatch`` (``deep_ep/buffer.py``), intranode normal mode; the layout that DeepEP takes as
    ``num_tokens_per_rank``/``is_token_in_rank``/``num_tokens_per_expert`` arguments is computed here from
    ``topk_idx`` and ``num_experts`` (see :func:`get_dispatch_layout`). Every rank must call it, also with zero
    tokens; all ranks must pass the same ``num_experts``, ``hidden``, dtype and choice of ``topk_weights``
    (checked through the count exchange; a mismatch raises ``ValueError`` on every rank before data moves). A cached
    dispatch with ``handle`` has no count exchange: there every rank must pass a handle of the same dispatch and
    the same dtype, checked in the call headers (a difference is a fatal
    :class:`~cupy_symbuf.SymBufferMismatchError`, see :attr:`DispatchHandle.dispatch_id`).

    Parameters
    ----------
    x : xp.ndarray ``[num_tokens, hidden]``, or tuple ``(x_fp8, scales)``
        Tokens: bfloat16 (or raw ``uint16`` bfloat16 bits), float16 or float32; any strides. Or ``x_fp8``
        ``[num_tokens, hidden]`` float8_e4m3fn (or raw ``uint8`` bits) with ``hidden % 128 == 0`` and ``scales``
        ``[num_tokens, hidden // 128]`` float32 of any strides (e.g. column-major), which travel with their tokens.
    topk_idx : xp.ndarray ``[num_tokens, num_topk]`` int64 (int32 accepted), or None with ``handle``
        Global expert per top-k slot; ``-1`` = none. A slot is never sent or counted when ``-1``. Required without
        ``handle``; must be None with ``handle``.
    topk_weights : xp.ndarray ``[num_tokens, num_topk]`` float32, optional
        Gate weights travelling with ``topk_idx``. Must be None with ``handle``.
    num_experts : int
        Global number of experts, a positive multiple of ``world_size``. Required without ``handle``; with
        ``handle`` it may be omitted or must equal the handle's.
    handle : DispatchHandle, optional (keyword-only)
        From an earlier ``dispatch`` on this communicator with the same routing: skips the layout and the count
        exchange and sends only ``x`` (any dtype above; ``num_tokens`` must equal the handle's). Every rank must
        pass a handle of the same dispatch (``handle.dispatch_id`` equal on every rank).
    expert_alignment : int >= 1 (keyword-only)
        Round each entry of ``num_recv_tokens_per_expert`` up to a multiple of this.
    num_worst_tokens : int >= 0 (keyword-only)
        Worst-case mode (DeepEP's ``num_worst_tokens``) when > 0: the receive outputs have exactly this many rows
        and nothing is read on the host (GPU: the layout, the count exchange and the per-peer counts stay on the
        device), so the call can be captured in a CUDA graph and replayed with new data and routing. Rows past the
        real count hold ``-1`` in ``recv_topk_idx`` and ``0`` in ``recv_topk_weights`` on every call and replay,
        whatever the memory held (``recv_x`` rows there are unspecified on the GPU, zeros on the host); the real
        count is ``handle.num_recv_tokens_device`` (a 0-d device array) and ``num_recv_tokens_per_expert`` is an
        int64 array of ``xp`` instead of a list. It must bound what this rank can receive (``num_tokens *
        world_size`` always does): more is fatal (:class:`~cupy_symbuf.SymBufferMismatchError` with field
        "capacity", raised on the GPU by ``synchronize``; the peers abort). On the GPU, errors a worst-case call
        finds on the device (a ``topk_idx`` value out of range on some rank, ranks disagreeing on the row format)
        skip the call on every rank (outputs: no rows) and are raised by ``synchronize()`` as
        :class:`~cupy_symbuf.SymBufferRejectedError`; the communicator stays usable. With ``handle``: 0 or the
        handle's.
    wire_dtype : {None, "fp8"} (keyword-only)
        ``"fp8"``: low-precision transfer: ``x`` (bfloat16 / float16 / float32, ``hidden % 128 == 0``) is quantised
        per 1x128 block to float8_e4m3fn with a float32 scale (:func:`cupy_symbuf.quant.quantize_fp8`, the
        quantiser of the low-latency kernels), the codes and scales travel (1 + 4/128 bytes per element instead
        of 2 or 4), and ``recv_x`` comes back dequantised in ``x``'s dtype. Error per element at most
        ``|x| * 2**-4 + scale * 2**-10`` (``quant.error_bound``), plus, for float16 / bfloat16 ``x``, half an ulp
        of that dtype from rounding the dequantised value back into it. A cached dispatch may use it too. Not with an
        fp8 tuple ``x``. Every rank must make the same choice (the rows' format is in the signature every
        receiver checks: a difference raises ``ValueError`` on every rank after the count exchange, but in a
        cached dispatch, which has none, it is a fatal call-header mismatch). Finite values only: an inf makes
        its whole 128-element block NaN; a NaN arrives as NaN in its own element (the block's amax ignores NaN).
        Not with ``out``.
    out : xp.ndarray ``[capacity, hidden]`` of ``x``'s dtype, or tuple ``(out_x, out_scales)`` for an fp8 tuple
        ``x`` (``out_scales`` ``[capacity, hidden // 128]`` float32), C-contiguous (keyword-only)
        Where the received tokens go: ``recv_x`` is ``out[:num_recv_tokens]`` (``num_worst_tokens`` rows in
        worst-case mode), a view in ``x``'s dtype; no output is allocated. ``out`` may also be the unsigned integer
        type of the element size (raw bits, e.g. ``uint16`` for bfloat16 on CuPy); it must be writeable and share
        no memory with ``x`` or the other inputs (``ValueError``). It must hold every row this rank receives: checked
        before anything moves where the count is known (a cached dispatch; worst-case mode needs ``capacity >=
        num_worst_tokens``), else a ``ValueError`` told to the peers as a rejection; in an eager dispatch the
        count exchange finds it, and more rows than ``capacity`` are fatal as for ``num_worst_tokens``
        (:class:`~cupy_symbuf.SymBufferMismatchError`, field "capacity"). **Direct mode** (GPU): when ``out``
        (each part of it) is a symmetric array of this communicator (:meth:`Communicator.empty`), the peers write
        their rows straight into it (one copy per byte instead of two through the rings; protocol MODE_PUSH,
        after TRT-LLM's one-sided all-to-all and DeepEP V2, which write each token once into its final receive
        slot); the top-k ids and weights still travel through the rings. Every rank must then pass the same
        allocation at the same offset (the row signature says so; a difference raises ``ValueError`` on every
        rank from the count exchange, or in a cached dispatch is a fatal call-header mismatch).
        ``Config.mode="ring"`` keeps the rings. The caller owns ``out``: a later dispatch into the same ``out``
        overwrites the rows an earlier handle's ``recv_x`` views (the peers write only after this rank's call has
        begun, in stream order, so no earlier use of ``out`` on this rank is overtaken).
    is_token_in_rank : xp.ndarray bool ``[num_tokens, world_size]``, optional (keyword-only)
        **Routing by a rank mask** (DeepEP's routing: its ``dispatch`` moves the tokens where this mask says, and
        ``topk_idx`` only travels with them): token ``t`` goes to rank ``r`` where ``is_token_in_rank[t, r]``;
        no layout is computed. Needs ``num_tokens_per_expert``; ``topk_idx`` / ``topk_weights`` become optional
        (both or neither) and travel as data (``recv_topk_idx`` as above: local ids where the expert lives here,
        else ``-1``). The handle then also carries ``recv_src_idx`` (the source token of every received row, sent
        with it), ``count_matrix`` and ``src_num_tokens`` (from the count exchange; not in worst-case mode on the
        GPU), from which DeepEP's handle matrices are derived. Worst-case mode needs ``topk_idx`` (as DeepEP).
        Every rank must make the same choice (the row format differs; checked in the count exchange).
    num_tokens_per_rank : xp.ndarray ``[world_size]`` int32/int64, optional (keyword-only)
        With ``is_token_in_rank``: must equal its column sums (host backend: ``ValueError`` before anything
        moves; GPU: compared on the device, a difference rejects the call on every rank, this rank raising
        ``ValueError``, the peers :class:`~cupy_symbuf.SymBufferRejectedError`).
    num_tokens_per_expert : xp.ndarray ``[num_experts]`` int32/int64 (keyword-only)
        With ``is_token_in_rank``: the (token, slot) pairs this rank sends each expert, exchanged as the receive
        counts per local expert (``num_recv_tokens_per_expert``); its length is ``num_experts``; every entry
        ``>= 0`` (checked as ``num_tokens_per_rank`` is: host ``ValueError`` before anything moves; GPU on the
        device, a negative entry rejecting the call on every rank).

    Returns
    -------
    recv_x : xp.ndarray ``[num_recv_tokens, hidden]`` of ``x``'s dtype, or tuple ``(recv_x_fp8, recv_scales)``
        with ``recv_scales`` ``[num_recv_tokens, hidden // 128]`` float32 (C-contiguous). With
        ``num_worst_tokens``, every ``recv_*`` array has ``num_worst_tokens`` rows (the real ones first). Rows are
        ordered by source rank, then by source token index (rows of source ``s`` are
        ``handle.recv_offsets[s]:...[s + 1]``).
    recv_topk_idx : xp.ndarray ``[num_recv_tokens, num_topk]`` int64, or None for a cached dispatch
        Local expert index (``e - rank * num_local_experts``) where the slot's expert lives on this rank, else ``-1``
        (other ranks' experts and ``-1`` slots alike).
    recv_topk_weights : xp.ndarray ``[num_recv_tokens, num_topk]`` float32, or None
        The sent weights, ``0.0`` where ``recv_topk_idx`` is ``-1`` (as DeepEP). None for a cached dispatch or when
        ``topk_weights`` was None.
    num_recv_tokens_per_expert : list of int ``[num_local_experts]``
        Received (token, slot) pairs per local expert, each rounded up to ``expert_alignment``. (DeepEP returns
        None in cached mode; here the cached counts are returned, aligned with this call's alignment.)
    handle : DispatchHandle
        The layout, for :func:`combine` and cached dispatches (in cached mode: the handle passed in).

    Raises
    ------
    TypeError
        An array not of the backend's module (e.g. NumPy on the cuda backend); a dtype outside those above;
        ``handle`` not a :class:`DispatchHandle`.
    ValueError
        ``topk_idx`` value ``< -1`` or ``>= num_experts``; ``num_experts`` not a positive multiple of
        ``world_size`` (or too many local experts for ``Config.max_notify_ints``); rows of ``x``, ``topk_idx``,
        ``topk_weights`` or ``scales`` disagreeing, or ``num_topk`` of ``topk_weights`` differing from
        ``topk_idx``'s; fp8 ``hidden`` not divisible by 128 or ``scales`` not ``[num_tokens, hidden // 128]``;
        ``handle`` from another communicator, or given together with ``topk_idx``/``topk_weights``/a different
        ``num_experts``; ``expert_alignment`` not in ``[1, 2**30]``; with ``is_token_in_rank``,
        ``num_tokens_per_rank`` not its column sums or a negative ``num_tokens_per_expert`` entry (the peers raise
        :class:`~cupy_symbuf.SymBufferRejectedError`; GPU worst-case mode: every rank's ``synchronize()`` raises
        that); after the count exchange, ranks disagreeing on the row size, or
        (GPU) a row (``hidden * itemsize`` + scales + ``num_topk * 8``, + ``num_topk * 4`` with weights) larger
        than ``Config.chunk_bytes`` (ring slots hold whole rows; every rank raises alike, the communicator stays
        usable).
    SymBufferMismatchError
        A cached dispatch where ranks pass handles of different dispatches or ``x`` of different dtypes: found in
        the call headers by every rank that receives a differing one (the others raise
        :class:`~cupy_symbuf.SymBufferAbortedError`); no rank returns rows; the communicator is unusable.
    """
    op = "dispatch"
    if handle is not None and topk_idx is None and topk_weights is None and num_experts is None and \
            wire_dtype is None and out is None and is_token_in_rank is None and num_tokens_per_rank is None and \
            num_tokens_per_expert is None and num_worst_tokens == 0 and type(handle) is DispatchHandle:
        # a GPU cached dispatch of the call shape the handle ran last (its arguments passed every check then):
        # one output from a pool, one launch (normal_cuda.cached_repeat; None: any difference, the full path)
        rep = handle.__dict__.get(REPEAT_DISPATCH)
        if rep is not None:
            res = cached_repeat(comm, op, handle, rep, x, expert_alignment)
            if res is not None:
                return res
    stream, capturing = comm.capture_state()  # (once per call: handed down)
    # captured in a CUDA graph: every array the call allocates (copies, routing, outputs, CuPy's workspaces) lives
    # as long as the communicator, since each replay reads and writes them
    with comm.keep_allocations_for_graph(capturing):
        # the count exchange comes first without a handle; a call rejected here is told to the peers (Engine.call)
        with comm.call(op, notify=handle is None):
            back = None
            if wire_dtype is not None:
                x, back = _wire_fp8(op, comm, x, wire_dtype)
            if wire_dtype is not None and out is not None:
                raise ValueError(f"{op}: out and wire_dtype cannot be combined (the received rows are dequantised "
                                 f"into a new array)")
            if is_token_in_rank is not None and handle is None:
                res = _dispatch_mask(comm, op, x, topk_idx, topk_weights, num_experts, is_token_in_rank,
                                     num_tokens_per_rank, num_tokens_per_expert, expert_alignment, num_worst_tokens,
                                     out)
            else:
                if num_tokens_per_rank is not None or num_tokens_per_expert is not None:
                    raise ValueError(f"{op}: num_tokens_per_rank / num_tokens_per_expert go with is_token_in_rank "
                                     f"(routing by a rank mask), without handle")
                res = _dispatch(comm, op, x, topk_idx, topk_weights, num_experts, handle, expert_alignment,
                                num_worst_tokens, out, stream=stream, capturing=capturing)
        if back is not None:
            res = (back(*res[0]),) + tuple(res[1:])
    return res


def _wire_fp8(op, comm, x, wire_dtype):
    """``dispatch(wire_dtype="fp8")``: the ``(codes, scales)`` tuple that travels and the function that turns the
    received pair back into ``x``'s dtype."""
    if not isinstance(wire_dtype, str) or wire_dtype != "fp8":  # (an array would compare elementwise)
        raise ValueError(f"{op}: wire_dtype must be None or 'fp8', got {wire_dtype!r}")
    if isinstance(x, tuple):
        raise ValueError(f"{op}: wire_dtype='fp8' quantises x itself; pass x as one array, not an (x_fp8, scales) "
                         f"tuple")
    xv, _, kind = check_x(op, comm, x, None, None)
    if xv.shape[1] % FP8_BLOCK:
        raise ValueError(f"{op}: wire_dtype='fp8' needs hidden divisible by {FP8_BLOCK}, got hidden={xv.shape[1]}")
    dtype = xv.dtype
    q, scales = _wire.quantize(xv, kind, "fp8")  # GPU: one kernel reading x itself

    def back(recv_q, recv_scales):
        return _wire.dequantize(recv_q, recv_scales, kind, dtype, "fp8")
    return (q, scales), back


def _dispatch(comm, op, x, topk_idx, topk_weights, num_experts, handle, expert_alignment, num_worst_tokens,
              out=None, *, stream=None, capturing=None):
    xp = comm.xp
    key = None
    if handle is None and out is None and comm.backend == "cuda":
        # a GPU eager dispatch of a call shape whose arguments passed every check before (nothing of it depends on
        # the arrays' values): its record, or the key its record is kept under once this call returns
        key = eager_key(xp, x, topk_idx, topk_weights, num_experts, expert_alignment, num_worst_tokens)
        rec = None if key is None else eager_record(comm, key, x, topk_idx, topk_weights)
        if rec is not None:
            return eager_from_record(comm, op, rec, x, topk_idx, topk_weights, num_experts, expert_alignment,
                                     num_worst_tokens, stream=stream, capturing=capturing)
    align = check_expert_alignment(op, expert_alignment)
    worst = check_int(op, "num_worst_tokens", num_worst_tokens, minimum=0)

    if handle is not None:
        h = check_handle(op, handle, DispatchHandle, comm, "dispatch")
        check_cached(op, h, topk_idx, topk_weights, num_experts)
        if worst and worst != h.num_worst_tokens:
            raise ValueError(f"{op}: argument 'num_worst_tokens' must be 0 or the handle's ({h.num_worst_tokens}) "
                             f"with handle, got {worst}")
        if h.routing is not None and out is None and type(x) is xp.ndarray and capturing is not None:
            return cached_device(comm, op, x, h, align, stream, capturing)
        xv, scales, kind = check_x(op, comm, x, h.num_tokens, None)
        outs = _check_out(op, comm, out, xv, scales)
        if outs is not None:
            _check_capacity(op, outs, h.num_worst_tokens or h.num_recv_tokens,
                            "num_worst_tokens" if h.num_worst_tokens else "the handle's count")
        if h.routing is not None:  # GPU: the units come from the handle's device counts table
            recv_x, recv_scales, _, _ = exchange_device(comm, op, xv, scales, None, None, h.send_token_idx,
                                                        h.num_recv_tokens, f"cached|{kind}", h.routing.table_ptr,
                                                        user_outs=outs, tag=h.dispatch_id, stream=stream,
                                                        capturing=capturing)
        else:
            recv_x, recv_scales, _, _ = _exchange(comm, op, xv, scales, None, None, h.send_token_idx,
                                                  h.send_counts, h.recv_counts, f"cached|{kind}", user_outs=outs,
                                                  tag=h.dispatch_id)
            if h.num_worst_tokens:
                recv_x, recv_scales = _pad_rows(xp, recv_x, h.num_worst_tokens, 0, outs, 0), \
                    _pad_rows(xp, recv_scales, h.num_worst_tokens, 0, outs, 1)
        out_x = (recv_x, recv_scales) if scales is not None else recv_x
        counts = h.num_recv_tokens_per_expert(align)
        if h.num_worst_tokens and isinstance(counts, list):  # host: an array, as the first call's and the GPU's
            counts = xp.asarray(np.asarray(counts, np.int64))
        return out_x, None, None, counts, h

    n_exp = check_num_experts(op, comm, num_experts)
    if topk_idx is None:
        raise ValueError(f"{op}: argument 'topk_idx' is required without a handle")
    xv, scales, kind = check_x(op, comm, x, None, None)
    num_tokens = xv.shape[0]
    cuda = comm.backend == "cuda"
    idx = check_topk_idx(op, comm, topk_idx, n_exp, num_tokens, check_range=not cuda)
    weights = check_weights(op, comm, topk_weights, num_tokens, idx.shape[1], "num_tokens (rows of x)")
    outs = _check_out(op, comm, out, xv, scales, [(idx, "topk_idx"), (weights, "topk_weights")])
    if worst:
        _check_capacity(op, outs, worst, "num_worst_tokens")
    if cuda:
        check_device_experts(op, n_exp, _gpu.MAX_EXPERTS)
        fill = None
        if key is not None:
            fill = new_eager_record(kind, idx is not topk_idx)
        res = dispatch_cuda(comm, op, xv, scales, kind, idx, weights, n_exp, align, worst, outs, stream=stream,
                            capturing=capturing, fill=fill)
        if fill is not None:
            remember(comm, key, fill)
        return res

    # ---- layout and count exchange (notify_dispatch)
    w_size, rank = comm.world_size, comm.rank
    epr = n_exp // w_size
    per_rank, per_expert, in_rank = token_layout(xp, idx, n_exp, w_size)
    _, send_token_idx = xp.nonzero(xp.ascontiguousarray(in_rank.T))      # grouped by dest, ascending tokens
    # contiguous: CuPy's nonzero returns strided column views of one [N, 2] array
    send_token_idx = xp.ascontiguousarray(send_token_idx, dtype=np.int64)
    send_counts = _to_host(comm, per_rank).astype(np.int64)
    rb = row_bytes(xv, scales, idx.shape[1], weights is not None)
    # before the count exchange, so that a row too large for a slot is a rejection told to the peers
    check_row_fits(op, rb, comm.config.chunk_bytes, byte_run=False)
    meta = np.zeros((w_size, epr + NOTIFY_EXTRA), dtype=np.int64)
    meta[:, 0] = send_counts
    meta[:, 1:1 + epr] = _to_host(comm, per_expert).astype(np.int64).reshape(w_size, epr)
    # every rank checks every rank's row format (dtype, hidden, scales, top-k, weights) in the count exchange
    sig = (f"{kind}|hidden={xv.shape[1]}|scales={scales is not None}|topk={idx.shape[1]}|"
           f"weights={weights is not None}|num_experts={n_exp}")
    recv_meta = comm.notify(op, meta, sig, sig_what=(
        f"ranks disagree on the dispatched row size in bytes (hidden * itemsize + scales + top-k) or on "
        f"num_experts: rank {rank} has {rb} bytes ({sig}); all ranks must pass the same hidden, dtype, "
        f"num_topk, choice of topk_weights and num_experts"))
    dispatch_id = comm.epoch  # this dispatch's count exchange: the same number on every rank
    recv_counts = recv_meta[:, 0].copy()
    raw_per_expert = tuple(int(c) for c in recv_meta[:, 1:1 + epr].sum(axis=0))
    n_recv = int(recv_counts.sum())
    if outs is not None and n_recv > outs[0].shape[0]:  # as the GPU's count exchange: fatal (see worst below)
        raise comm.fatal(SymBufferMismatchError(
            f"{op}: rank {rank} receives {n_recv} rows, more than out holds ({outs[0].shape[0]}, its capacity)",
            rank=rank, op=op, field="capacity", expected=int(outs[0].shape[0]), got=n_recv))
    if worst and n_recv > worst:
        # between the steps, before any row moves (as the GPU's count exchange): fatal, and comm.fatal sets the
        # abort word, so the peers' row exchange of this very call fails instead of returning
        raise comm.fatal(SymBufferMismatchError(
            f"{op}: rank {rank} receives {n_recv} rows, more than num_worst_tokens={worst} (the output "
            f"capacity; it must bound what any rank can receive, e.g. num_tokens * world_size)", rank=rank, op=op,
            field="capacity", expected=worst, got=n_recv))

    # ---- data
    recv_x, recv_scales, recv_gidx, recv_w = _exchange(comm, op, xv, scales, idx, weights, send_token_idx,
                                                       send_counts, recv_counts, sig, user_outs=outs)
    local = recv_gidx - rank * epr
    mine = (recv_gidx >= 0) & (local >= 0) & (local < epr)
    recv_topk_idx = xp.where(mine, local, -1).astype(np.int64, copy=False)
    recv_topk_weights = None
    if recv_w is not None:
        recv_topk_weights = xp.where(mine, recv_w, np.float32(0)).astype(np.float32, copy=False)

    if worst:  # outputs of the worst-case size: rows past the real count are -1 / 0 (x, scales: 0)
        recv_x, recv_scales = _pad_rows(xp, recv_x, worst, 0, outs, 0), _pad_rows(xp, recv_scales, worst, 0, outs, 1)
        recv_topk_idx = _pad_rows(xp, recv_topk_idx, worst, -1)
        recv_topk_weights = _pad_rows(xp, recv_topk_weights, worst, 0)
    send_counts.setflags(write=False)
    recv_counts.setflags(write=False)
    h = DispatchHandle(_comm_ref=make_ref(comm), rank=rank, world_size=w_size, backend=comm.backend,
                       num_experts=n_exp, num_tokens=num_tokens, num_topk=int(idx.shape[1]),
                       hidden=int(xv.shape[1]), is_token_in_rank=in_rank, send_token_idx=send_token_idx,
                       send_counts=send_counts, recv_counts=recv_counts,
                       num_recv_tokens_per_expert_raw=raw_per_expert, expert_alignment=align,
                       num_worst_tokens=worst, send_rows=int(send_counts.sum()), dispatch_id=dispatch_id)
    out_x = (recv_x, recv_scales) if scales is not None else recv_x
    counts = h.num_recv_tokens_per_expert(align)
    if worst:  # as the GPU's: an array, not a list (no host read there)
        counts = xp.asarray(np.asarray(counts, np.int64))
    return out_x, recv_topk_idx, recv_topk_weights, counts, h


def _dispatch_mask(comm, op, x, topk_idx, topk_weights, num_experts, is_token_in_rank, num_tokens_per_rank,
                   num_tokens_per_expert, expert_alignment, num_worst_tokens, out):
    """:func:`dispatch` routed by the caller's rank mask (DeepEP's routing): the caller's ``is_token_in_rank``
    decides where each token goes and its ``num_tokens_per_expert`` is what the count exchange carries per local
    expert; ``topk_idx`` / ``topk_weights`` (optional) travel as data. The count exchange's row to rank ``r`` is
    ``[tokens to r, r's experts' counts..., this rank's tokens to every rank..., num_tokens]`` (every rank learns
    the whole count matrix), and every row carries its source token index (``handle.recv_src_idx``)."""
    xp = comm.xp
    cuda = comm.backend == "cuda"
    w_size, rank = comm.world_size, comm.rank
    align = check_expert_alignment(op, expert_alignment)
    worst = check_int(op, "num_worst_tokens", num_worst_tokens, minimum=0)
    if num_tokens_per_expert is None:
        raise ValueError(f"{op}: argument 'num_tokens_per_expert' is required with is_token_in_rank (its length "
                         f"is num_experts; it gives the receive counts per local expert)")
    per_expert = check_array(op, "num_tokens_per_expert", num_tokens_per_expert, comm.backend,
                             dims=(("num_experts", None),), dtypes=(np.int32, np.int64))
    if not cuda:  # the GPU checks its entries on the device (the count exchange's reject word, below)
        check_counts(op, "num_tokens_per_expert", per_expert)
    if per_expert.shape[0] % w_size:  # (its length is num_experts: name the argument that has it wrong)
        raise ValueError(f"{op}: argument 'num_tokens_per_expert' must have one entry per expert (num_experts, a "
                         f"multiple of world_size ({w_size})), got {int(per_expert.shape[0])} entries")
    n_exp = check_num_experts(op, comm, int(per_expert.shape[0]))
    if num_experts is not None and check_int(op, "num_experts", num_experts, minimum=1) != n_exp:
        raise ValueError(f"{op}: argument 'num_experts' must equal len(num_tokens_per_expert) ({n_exp}), got "
                         f"{num_experts}")
    epr = n_exp // w_size
    M = 1 + epr + w_size + 1
    if M > comm.config.max_notify_ints:
        raise ValueError(f"{op}: routing by is_token_in_rank exchanges num_experts // world_size + world_size + 2 = "
                         f"{M} values per rank, more than Config.max_notify_ints={comm.config.max_notify_ints}")
    xv, scales, kind = check_x(op, comm, x, None, None)
    num_tokens = int(xv.shape[0])
    in_rank = check_array(op, "is_token_in_rank", is_token_in_rank, comm.backend,
                          dims=(("num_tokens (rows of x)", num_tokens), ("world_size", w_size)), dtypes=(np.bool_,))
    per_rank = None
    if num_tokens_per_rank is not None:
        per_rank = check_array(op, "num_tokens_per_rank", num_tokens_per_rank, comm.backend,
                               dims=(("world_size", w_size),), dtypes=(np.int32, np.int64))
    if (topk_idx is None) != (topk_weights is None):
        raise ValueError(f"{op}: with is_token_in_rank, topk_idx and topk_weights go together (both or neither, "
                         f"as DeepEP)")
    idx = weights = None
    if topk_idx is not None:
        idx = check_topk_idx(op, comm, topk_idx, n_exp, num_tokens, check_range=not cuda)
        weights = check_weights(op, comm, topk_weights, num_tokens, idx.shape[1], "num_tokens (rows of x)")
    if worst and idx is None:
        raise ValueError(f"{op}: num_worst_tokens needs topk_idx and topk_weights (as DeepEP)")
    outs = _check_out(op, comm, out, xv, scales, [(idx, "topk_idx"), (weights, "topk_weights")])
    if worst:
        _check_capacity(op, outs, worst, "num_worst_tokens")
    if cuda and worst:
        check_device_experts(op, n_exp, _gpu.MAX_EXPERTS)
    num_topk = 0 if idx is None else int(idx.shape[1])
    rb = row_bytes(xv, scales, num_topk, weights is not None) + 8
    check_row_fits(op, rb, comm.config.chunk_bytes, byte_run=False)
    sig = (f"{kind}|hidden={xv.shape[1]}|scales={scales is not None}|topk={num_topk}|"
           f"weights={weights is not None}|num_experts={n_exp}|route=mask")
    sig_what = (f"ranks disagree on the dispatched row format or on num_experts: rank {rank} has {rb} bytes "
                f"({sig}); all ranks must pass the same hidden, dtype, num_topk, choice of topk_idx/topk_weights and "
                f"num_experts, and all route by is_token_in_rank")
    tokens = xp.arange(num_tokens, dtype=np.int64)
    src = tokens.reshape(num_tokens, 1)
    in_rank = xp.ascontiguousarray(in_rank)
    counts = in_rank.sum(axis=0, dtype=np.int64)                       # tokens to each rank

    def fill_meta(meta):
        meta[:, 0] = counts
        meta[:, 1:1 + epr] = per_expert.reshape(w_size, epr)
        meta[:, 1 + epr:1 + epr + w_size] = counts[None, :]
        meta[:, M - 1] = num_tokens

    if not cuda:
        if per_rank is not None and not np.array_equal(np.asarray(per_rank, np.int64), counts):
            raise ValueError(f"{op}: argument 'num_tokens_per_rank' must equal the column sums of is_token_in_rank "
                             f"({counts.tolist()}), got {np.asarray(per_rank).tolist()}")
        _, send_token_idx = np.nonzero(in_rank.T)                      # grouped by destination, ascending tokens
        send_token_idx = np.ascontiguousarray(send_token_idx, dtype=np.int64)
        send_counts = counts.copy()
        meta = np.zeros((w_size, M), dtype=np.int64)
        fill_meta(meta)
        recv_meta = comm.notify(op, meta, sig, sig_what=sig_what)
        dispatch_id = comm.epoch
        recv_counts = recv_meta[:, 0].copy()
        raw = tuple(int(c) for c in recv_meta[:, 1:1 + epr].sum(axis=0))
        count_matrix = recv_meta[:, 1 + epr:1 + epr + w_size].copy()
        src_num_tokens = recv_meta[:, M - 1].copy()
        n_recv = int(recv_counts.sum())
        if worst and n_recv > worst:
            raise comm.fatal(SymBufferMismatchError(
                f"{op}: rank {rank} receives {n_recv} rows, more than num_worst_tokens={worst} (the output "
                f"capacity; it must bound what any rank can receive, e.g. num_tokens * world_size)", rank=rank,
                op=op, field="capacity", expected=worst, got=n_recv))
        if outs is not None and n_recv > outs[0].shape[0]:
            raise comm.fatal(SymBufferMismatchError(
                f"{op}: rank {rank} receives {n_recv} rows, more than out holds ({outs[0].shape[0]}, its capacity)",
                rank=rank, op=op, field="capacity", expected=int(outs[0].shape[0]), got=n_recv))
        idx_src, src_alone = _with_src(xp, idx, src)
        recv_x, recv_scales, recv_gidx, recv_w, *rest = _exchange(
            comm, op, xv, scales, idx_src, weights, send_token_idx, send_counts, recv_counts, sig, user_outs=outs,
            src=src_alone)
        recv_gidx, recv_src = _split_src(xp, recv_gidx, rest)
        recv_topk_idx = recv_topk_weights = None
        if recv_gidx is not None:
            local = recv_gidx - rank * epr
            mine = (recv_gidx >= 0) & (local >= 0) & (local < epr)
            recv_topk_idx = np.where(mine, local, -1).astype(np.int64, copy=False)
            recv_topk_weights = np.where(mine, recv_w, np.float32(0)).astype(np.float32, copy=False)
        if worst:
            recv_x, recv_scales = _pad_rows(xp, recv_x, worst, 0, outs, 0), _pad_rows(xp, recv_scales, worst, 0, outs, 1)
            recv_topk_idx = _pad_rows(xp, recv_topk_idx, worst, -1)
            recv_topk_weights = _pad_rows(xp, recv_topk_weights, worst, 0)
            recv_src = _pad_rows(xp, recv_src.reshape(-1, 1), worst, -1).reshape(-1)
        send_counts.setflags(write=False)
        recv_counts.setflags(write=False)
        h = DispatchHandle(_comm_ref=make_ref(comm), rank=rank, world_size=w_size, backend=comm.backend,
                           num_experts=n_exp, num_tokens=num_tokens, num_topk=num_topk, hidden=int(xv.shape[1]),
                           is_token_in_rank=in_rank, send_token_idx=send_token_idx, send_counts=send_counts,
                           recv_counts=recv_counts, num_recv_tokens_per_expert_raw=raw, expert_alignment=align,
                           num_worst_tokens=worst, send_rows=int(send_counts.sum()), dispatch_id=dispatch_id,
                           recv_src_idx=recv_src, count_matrix=count_matrix, src_num_tokens=src_num_tokens)
        counts_out = h.num_recv_tokens_per_expert(align)
        if worst:
            counts_out = xp.asarray(np.asarray(counts_out, np.int64))
        return (recv_x, recv_scales) if scales is not None else recv_x, recv_topk_idx, recv_topk_weights, \
            counts_out, h

    # ---- GPU: the routing block filled from the mask with array operations on the current stream (no host read)
    cp = xp
    rt = _gpu.Routing(num_tokens, max(1, num_topk), w_size, M)
    base = 2 * _gpu.CT + M
    bad = rt.block[base:base + 2]
    fill_meta(rt.block[base + 2:base + 2 + w_size * M].reshape(w_size, M))
    # the reject word (the count exchange rejects the call on every rank when it is not 0): negative entries of
    # num_tokens_per_expert plus entries of num_tokens_per_rank differing from the mask's column sums
    wrong = (per_expert < 0).sum(dtype=np.int64)
    if per_rank is not None:
        wrong += (per_rank != counts).sum(dtype=np.int64)
    bad[0] = wrong
    bad[1] = -1
    rt.in_rank[...] = in_rank
    first = cp.cumsum(counts) - counts
    pos = cp.where(in_rank, cp.cumsum(in_rank, axis=0, dtype=np.int64) - 1 + first[None, :], -1)
    rt.pos[...] = pos
    scatter = cp.empty(num_tokens * w_size + 1, np.int64)
    scatter[cp.where(in_rank, pos, num_tokens * w_size).ravel()] = cp.broadcast_to(
        tokens[:, None], (num_tokens, w_size)).ravel()
    rt.send_idx[:num_tokens * w_size] = scatter[:num_tokens * w_size]
    if idx is not None:
        idx = _gpu.contiguous(idx)
    idx_src, src_alone = _with_src(cp, idx, src)
    outs_dev = device_outputs(cp, worst, xv, scales, idx_src, weights, outs, src_alone) if worst else None
    comm.keep_for_graph(idx, in_rank, per_rank, per_expert)  # the caller's arrays (or copies) a replay reads

    def bad_error():  # which rule the reject word broke, read on the host once the call was rejected
        got = per_expert.get()
        if int(got.min()) < 0:
            i = int(np.argmax(got < 0))
            return ValueError(count_value_error(op, "num_tokens_per_expert", int(got[i]), i,
                                                " (found on the device; nothing was sent)"))
        return ValueError(f"{op}: argument 'num_tokens_per_rank' must equal the column sums of is_token_in_rank "
                          f"({counts.get().tolist()}), got {per_rank.get().tolist()}")
    res = comm.notify_device(op, rt.meta_ptr, M, sig, table=rt.table_ptr, sums=rt.sums_ptr,
                             local_reject=rt.bad_ptr,
                             capacity=worst if worst else (outs[0].shape[0] if outs else -1), worst=bool(worst),
                             self_error=bad_error, sig_what=lambda: sig_what)
    dispatch_id = comm.epoch
    count_matrix = src_num_tokens = None
    if worst:
        send_counts = recv_counts = raw = None
        n_recv = worst
        send_rows = num_tokens * w_size
        send_idx = rt.send_idx
    else:
        recv_vals, sent_vals = res
        recv_counts, send_counts = recv_vals[:, 0].copy(), sent_vals[:, 0].copy()
        raw = tuple(recv_vals[:, 1:1 + epr].sum(axis=0).tolist())
        count_matrix = recv_vals[:, 1 + epr:1 + epr + w_size].copy()
        src_num_tokens = recv_vals[:, M - 1].copy()
        n_recv = int(recv_counts.sum())
        send_rows = int(send_counts.sum())
        send_idx = rt.send_idx[:send_rows]
        send_counts.setflags(write=False)
        recv_counts.setflags(write=False)
    recv_x, recv_scales, recv_gidx, recv_w, *rest = exchange_device(
        comm, op, xv, scales, idx_src, weights, send_idx, n_recv, sig, rt.table_ptr, outs_dev, user_outs=outs,
        src=src_alone)
    recv_gidx, recv_src = _split_src(cp, recv_gidx, rest)
    counts_out = cp.empty(epr, np.int64) if worst else None
    if recv_gidx is not None:
        _gpu.fixup(comm, recv_gidx, recv_w, n_recv, epr, table_ptr=rt.table_ptr if worst else 0, sums=rt.sums_ptr,
                   counts_out=counts_out, align=align)
    h = DispatchHandle(_comm_ref=make_ref(comm), rank=rank, world_size=w_size, backend=comm.backend,
                       num_experts=n_exp, num_tokens=num_tokens, num_topk=num_topk, hidden=int(xv.shape[1]),
                       is_token_in_rank=rt.in_rank, send_token_idx=send_idx, send_counts=send_counts,
                       recv_counts=recv_counts, num_recv_tokens_per_expert_raw=raw, expert_alignment=align,
                       num_worst_tokens=worst, routing=rt, send_rows=send_rows, dispatch_id=dispatch_id,
                       recv_src_idx=recv_src.reshape(-1), count_matrix=count_matrix, src_num_tokens=src_num_tokens)
    out_x = (recv_x, recv_scales) if scales is not None else recv_x
    return out_x, recv_gidx, recv_w, counts_out if worst else h.num_recv_tokens_per_expert(align), h


def _pad_rows(xp, a, rows: int, fill, outs=None, k: int = 0):
    """``a`` with rows appended up to ``rows``, filled with ``fill`` (None stays None); ``outs``: the caller's
    ``out`` arrays, ``a`` the first rows of ``outs[k]``: filled in there."""
    if a is None or a.shape[0] == rows:
        return a
    if outs is not None:
        outs[k][a.shape[0]:rows] = fill
        return outs[k][:rows]
    out = xp.full((rows,) + tuple(a.shape[1:]), fill, dtype=a.dtype)
    out[:a.shape[0]] = a
    return out


def _rows_part(xp, a):
    """``a`` (2-D, any dtype) as an unsigned-int view whose rows are contiguous (copied only when they are not),
    for the transport's row gather."""
    if a.shape[0] and a.shape[1] > 1 and a.strides[1] != a.dtype.itemsize:
        a = xp.ascontiguousarray(a)
    return a.view(_UINT_OF_SIZE[a.dtype.itemsize])


def _with_src(xp, idx, src):
    """The int64 parts of a mask-routed dispatch: with top-k indices, the source token index travels as one more
    column of ``topk_idx`` (``[num_tokens, num_topk + 1]``: a row has at most four parts, and x, scales, indices
    and weights may use them all); without, as a part of its own. Returns ``(idx part, src part or None)``."""
    if idx is None:
        return None, src
    return xp.concatenate([idx.astype(np.int64, copy=False), src.reshape(-1, 1)], axis=1), None


def _split_src(xp, recv_idx, rest):
    """Undo :func:`_with_src` on the received rows: ``(recv topk_idx [n, num_topk] C-contiguous or None,
    recv source token index [n])``."""
    if recv_idx is None:
        return None, rest[0].reshape(-1)
    return xp.ascontiguousarray(recv_idx[:, :-1]), xp.ascontiguousarray(recv_idx[:, -1])


def _exchange(comm, op, xv, scales, idx, weights, send_token_idx, send_counts, recv_counts, sig: str,
              user_outs=None, tag: int = 0, src=None):
    """Send rows ``send_token_idx`` of ``x`` | scales | idx | weights (None parts left out) and receive them into
    new C-contiguous arrays. ``send_token_idx`` None sends every row in order (combine). The rows are gathered
    from the parts straight into the channel rings by the transport (one kernel on the GPU; no packed copy) and
    scattered from the rings into the outputs. Returns ``(recv_x, recv_scales, recv_idx, recv_weights)``.
    ``user_outs``: dispatch's ``out`` arrays (x, scales), received into in place. ``tag``: the handle's
    ``dispatch_id`` (combine, cached dispatch; 0: none), which every rank must pass alike (see
    :meth:`~cupy_symbuf.transport.engine.Engine.exchange_rows`). ``src``: an int64 ``[num_tokens, 1]`` part sent
    last (the source token indices); then a fifth result, its received rows.
    """
    xp = comm.xp
    n_recv = int(recv_counts.sum())
    parts = [(xv, xv.dtype, xv.shape[1])]
    for a, dt in ((scales, np.float32), (idx, np.int64), (weights, np.float32), (src, np.int64)):
        if a is not None:
            parts.append((a, np.dtype(dt), a.shape[1]))
    send_parts, recv_parts, outs = [], [], []
    for k, (a, dt, n) in enumerate(parts):
        out = user_outs[k][:n_recv] if user_outs is not None and k < len(user_outs) else \
            xp.empty((n_recv, n), dtype=dt)
        outs.append(out)
        if n == 0:
            continue
        send_parts.append(_rows_part(xp, a))
        recv_parts.append(out.view(_UINT_OF_SIZE[out.dtype.itemsize]))
    if send_parts:
        comm.exchange_rows(op, send_parts, send_token_idx, np.asarray(send_counts, np.int64), recv_parts,
                           np.asarray(recv_counts, np.int64), sig, tag=tag)
    recv_x = outs[0]
    k = 1
    recv_scales = recv_idx = recv_w = None
    if scales is not None:
        recv_scales = outs[k]
        k += 1
    if idx is not None:
        recv_idx = outs[k]
        k += 1
    if weights is not None:
        recv_w = outs[k]
        k += 1
    if src is not None:
        return recv_x, recv_scales, recv_idx, recv_w, outs[k]
    return recv_x, recv_scales, recv_idx, recv_w


def _combine_positions(xp, h: "DispatchHandle"):
    """int64 ``[num_tokens, world_size]``: row of the combine's received array holding token ``t``'s row from rank
    ``r`` (rows from rank ``r`` are its tokens in ascending order at ``send_offsets[r]``), or -1."""
    in_rank = h.is_token_in_rank
    offs = xp.asarray(h.send_offsets[:-1].astype(np.int64))
    rank_pos = xp.cumsum(in_rank, axis=0, dtype=np.int64) - 1
    return xp.ascontiguousarray(xp.where(in_rank, rank_pos + offs[None, :], -1))


def combine(comm, x, handle: DispatchHandle, topk_weights=None, *, dtype=None, out=None, sync: str = "strong"):
    """Return each dispatched token's rows to its source rank and sum them there. Collective.

    DeepEP: ``Buffer.combine`` (``deep_ep/buffer.py``), intranode: a plain sum **without** weights (weight the
    expert outputs before calling), accumulated in float32. Every rank must call it with a handle from the same
    ``dispatch`` (checked: see Raises), and all ranks must make the same choice of ``topk_weights`` (None or not)
    and ``dtype``.

    Parameters
    ----------
    x : xp.ndarray ``[num_recv_tokens, hidden]``
        One row per row of the dispatch's ``recv_x`` (same order; ``num_recv_tokens = handle.num_recv_tokens``,
        ``hidden = handle.hidden``), typically the expert outputs already weighted and summed locally. bfloat16
        (or raw ``uint16`` bits with ``dtype="bfloat16"``), float16 or float32; any strides.
    handle : DispatchHandle
        From ``dispatch`` on this communicator; every rank passes a handle of the same dispatch (the same
        ``handle.dispatch_id``); the same handle may be combined any number of times.
    topk_weights : xp.ndarray ``[num_recv_tokens, num_topk]`` float32, optional
        Per received row, reduced the same way (DeepEP passes ``recv_topk_weights`` here).
    out : xp.ndarray ``[num_tokens, hidden]`` of ``x``'s dtype, optional (keyword-only)
        Where to write ``combined_x`` (no allocation for it; C-contiguous, not overlapping ``x``); returned.
    dtype : optional, keyword-only
        How to read ``x``: ``None`` (from ``x.dtype``), ``"bfloat16"`` / ``ml_dtypes.bfloat16`` (``x`` may then be
        raw ``uint16`` bits: CuPy builds without a bfloat16 dtype hold bf16 so), ``numpy.float16`` or
        ``numpy.float32`` (must equal ``x.dtype``).
    sync : {"strong", "relaxed"}, keyword-only
        Selective synchronisation (:meth:`Communicator.alltoall`): combine gathers its rows through the rings,
        which hold their own copy, so both return with every peer done with ``x``; ``"relaxed"`` is accepted so
        that training loops can ask for it uniformly.

    Returns
    -------
    combined_x : xp.ndarray ``[num_tokens, hidden]``, ``x``'s dtype
        ``combined_x[t]`` = sum over the ranks token ``t`` was sent to of that rank's row for ``t``, in float32,
        ranks in ascending order, rounded to nearest even once at the end. Tokens sent nowhere (all ``topk_idx``
        ``-1``) are zeros.
    combined_topk_weights : xp.ndarray ``[num_tokens, num_topk]`` float32, or None
        Same sum of the ``topk_weights`` rows; None when ``topk_weights`` is None.

    Raises
    ------
    TypeError
        An array not of the backend's module; ``x`` not bfloat16/float16/float32 (``uint16`` without
        ``dtype="bfloat16"``); ``topk_weights`` not float32; ``handle`` not a :class:`DispatchHandle`.
    ValueError
        ``handle`` from another communicator; ``x`` not ``[handle.num_recv_tokens, handle.hidden]``;
        ``topk_weights`` not ``[handle.num_recv_tokens, handle.num_topk]``; (GPU) a row ``hidden * itemsize``
        (``+ num_topk * 4`` with ``topk_weights``) bytes larger than ``Config.chunk_bytes``.
    SymBufferMismatchError
        Ranks passing handles of different dispatches (or ``x`` of different dtypes / ``topk_weights`` choices):
        found in the call headers by every rank that receives a differing one (the others raise
        :class:`~cupy_symbuf.SymBufferAbortedError`); no rank returns rows; the communicator is unusable. GPU:
        from the call with ``Config.blocking``, else from ``synchronize()``.

    Notes
    -----
    GPU: the row exchange takes its per-peer counts from the dispatch's device counts table (the reverse of the
    dispatch's) and the reduction reads the send positions the layout kernel made: no host work beyond the two
    launches (the rows back; x and the weights reduced in one), and a combine of a worst-case handle can be
    captured in a CUDA graph.
    """
    op = "combine"
    if out is None and sync == "strong" and type(handle) is DispatchHandle:
        # a GPU combine of the call shape the handle ran last (its arguments passed every check then): outputs from
        # a pool, one ring and one reduction launch (normal_cuda.combine_repeat; None: any difference, the full path)
        rep = handle.__dict__.get(REPEAT_COMBINE)
        if rep is not None:
            res = combine_repeat(comm, op, handle, rep, x, topk_weights, dtype)
            if res is not None:
                return res
    with comm.call(op, notify=False):
        stream, capturing = comm.capture_state()  # (once per call: handed down)
        # captured: the copies, the returned rows and the outputs live as long as the communicator (see dispatch)
        with comm.keep_allocations_for_graph(capturing):
            if sync != "strong":
                check_sync(op, sync)
            h = check_handle(op, handle, DispatchHandle, comm, "dispatch")
            if h.routing is not None:  # GPU
                return combine_device(comm, op, x, h, topk_weights, dtype, out, stream, capturing)
            return _combine(comm, op, x, h, topk_weights, dtype, out)


def _combine(comm, op, x, h, topk_weights, dtype, out=None):
    """combine of a handle without device routing (the host path)."""
    xp = comm.xp
    n_recv = h.num_recv_tokens
    x = check_array(op, "x", x, comm.backend, dims=(("num_recv_tokens", n_recv), ("hidden", h.hidden)))
    kind = combine_kind(op, x, dtype)
    weights = check_weights(op, comm, topk_weights, n_recv, h.num_topk, "num_recv_tokens")
    if out is not None:
        out = check_out(op, out, comm.backend, (h.num_tokens, h.hidden), x.dtype, inputs=(x, weights))

    # rows of x are grouped by source rank (h.recv_counts); they come back grouped by destination (h.send_counts)
    sig = f"{kind}|hidden={h.hidden}|weights={weights is not None}"
    n_real = int(h.recv_counts.sum())
    if n_real != n_recv:  # worst-case mode (host): the rows past the real count stay here
        x = x[:n_real]
        weights = None if weights is None else weights[:n_real]
    back_x, _, _, back_w = _exchange(comm, op, x, None, None, weights, None, h.recv_counts, h.send_counts, sig,
                                     tag=h.dispatch_id)

    num_tokens = h.num_tokens
    if comm.backend == "cuda":  # (a GPU handle without device routing: the reduction kernel over host positions)
        return reduce_cuda(comm, back_x, _combine_positions(xp, h), kind, x.dtype, num_tokens, out=out,
                           w_back=back_w)
    acc = xp.zeros((num_tokens, h.hidden), dtype=np.float32)
    acc_w = xp.zeros((num_tokens, h.num_topk), dtype=np.float32) if weights is not None else None
    if back_x.shape[0]:
        back_f = _dt.to_float32(xp, back_x, kind)
        offs = h.send_offsets
        for r in range(h.world_size):
            lo, hi = int(offs[r]), int(offs[r + 1])
            if hi == lo:
                continue
            tok = h.send_token_idx[lo:hi]              # unique within one rank: the scatter-add is race-free
            acc[tok] += back_f[lo:hi]
            if acc_w is not None:
                acc_w[tok] += back_w[lo:hi]
    out_dtype = x.dtype
    combined = _dt.from_float32(xp, acc, kind, out_dtype)
    if out is not None:
        out[...] = combined
        combined = out
    return combined, acc_w
