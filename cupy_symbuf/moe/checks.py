"""Argument checks of the MoE calls (normal-mode dispatch / combine, flat and hierarchical).

The generic checks (integers, arrays: module, device, dtype, shape) are :mod:`cupy_symbuf.common.checks`; this
module adds what is MoE's: the tokens ``x`` (an array or an fp8 ``(x_fp8, scales)`` tuple), ``topk_idx``,
``topk_weights``, ``num_experts``, ``expert_alignment``, the dtype a combine reads ``x`` as, and the size of one
dispatched row. Messages follow the package's one style (``"<op>: argument '<name>' must ..., got ..."``).

The checks read a few facts of the communicator the call runs on, declared by :class:`MoeGroup` (the transport
``Engine`` of a :class:`~cupy_symbuf.Communicator` has them; a caller that has no engine, such as
:class:`~cupy_symbuf.hierarchical.HierarchicalCommunicator`, builds a :class:`GroupInfo`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Protocol

import numpy as np

from ..collectives.quant import QUANT_BLOCK
from ..common import dtypes as _dt
from ..common.checks import check_array, check_int, type_name

__all__ = ["FP8_BLOCK", "MAX_EXPERT_ALIGNMENT", "NOTIFY_EXTRA", "MoeGroup", "GroupInfo", "check_num_experts",
           "check_expert_alignment", "check_topk_idx", "topk_value_error", "check_x", "check_weights", "check_handle",
           "check_cached", "check_device_experts", "check_counts", "count_value_error",
           "combine_kind", "row_bytes"]

#: Elements of ``x`` per fp8 scale: ``scales`` is ``[num_tokens, hidden // FP8_BLOCK]`` (DeepEP's 1x128 blocks;
#: the quantiser's block).
FP8_BLOCK = QUANT_BLOCK

#: expert_alignment's bound: the aligned per-expert counts are int32 (DeepEP's num_recv_tokens_per_expert_list).
MAX_EXPERT_ALIGNMENT = 1 << 30

#: Extra int64 columns of the dispatch count exchange besides the per-expert counts:
#: ``[num_tokens_to_rank, per-local-expert counts...]`` (the row format travels as the notify signature).
NOTIFY_EXTRA = 1


class MoeGroup(Protocol):
    """What the MoE argument checks read of a communicator: the ranks the experts are spread over.

    ``backend``: ``"host"`` or ``"cuda"`` (arrays must be NumPy or CuPy on this GPU); ``xp``: the array module
    (``numpy`` or ``cupy``); ``world_size``: ranks holding experts (``num_experts`` must be a multiple of it);
    ``config``: the :class:`~cupy_symbuf.Config` of the communicator whose count exchange carries the per-expert
    counts (its ``max_notify_ints`` bounds ``num_experts // world_size``).
    """

    backend: str
    xp: Any
    world_size: int
    config: Any


@dataclass(frozen=True)
class GroupInfo:
    """A plain :class:`MoeGroup`, for callers whose communicator has no engine (the hierarchical one: its
    ``world_size`` is all nodes' ranks, its ``config`` the node communicator's, whose dispatch counts the
    experts)."""

    backend: str
    xp: Any
    world_size: int
    config: Any


def check_num_experts(op: str, group: MoeGroup, num_experts) -> int:
    """``num_experts`` as an int: given, >= 1, a multiple of ``group.world_size`` (expert ``e`` lives on rank
    ``e // (num_experts // world_size)``), with ``num_experts // world_size + NOTIFY_EXTRA <=
    group.config.max_notify_ints`` (one int64 per local expert in the count exchange). Raises ``TypeError`` /
    ``ValueError``."""
    if num_experts is None:
        raise ValueError(f"{op}: argument 'num_experts' is required (without a handle)")
    n = check_int(op, "num_experts", num_experts, minimum=1)
    w = group.world_size
    if n % w:
        raise ValueError(f"{op}: argument 'num_experts' must be a multiple of world_size ({w}) so that expert e "
                         f"lives on rank e // (num_experts // world_size), got {n}")
    max_ints = group.config.max_notify_ints
    if n // w + NOTIFY_EXTRA > max_ints:
        raise ValueError(f"{op}: argument 'num_experts' must be <= {(max_ints - NOTIFY_EXTRA) * w} = world_size "
                         f"({w}) * (Config.max_notify_ints ({max_ints}) - {NOTIFY_EXTRA}) (the count exchange sends "
                         f"one int64 per local expert of each peer), got {n}")
    return n


def check_expert_alignment(op: str, expert_alignment) -> int:
    """``expert_alignment`` as an int in ``[1, MAX_EXPERT_ALIGNMENT]``. Raises ``TypeError`` / ``ValueError``."""
    return check_int(op, "expert_alignment", expert_alignment, minimum=1, maximum=MAX_EXPERT_ALIGNMENT)


def check_topk_idx(op: str, group: MoeGroup, topk_idx, num_experts: int, num_tokens: Optional[int] = None, *,
                   check_range: bool = True):
    """``topk_idx`` ``[num_tokens, num_topk]`` (``num_topk >= 1``; ``num_tokens`` None: any) int64 or int32,
    returned as int64 (a copy only when it was int32). ``check_range``: every value is -1 (no expert) or in
    ``[0, num_experts)`` (False: a device kernel checks them instead, with no host synchronisation). Raises
    ``TypeError`` (module, dtype) / ``ValueError`` (shape, values; a bad value is named with its position)."""
    topk_idx = check_array(op, "topk_idx", topk_idx, group.backend,
                           dims=(("num_tokens (rows of x)", num_tokens), ("num_topk", None)),
                           dtypes=(np.int64, np.int32))
    if topk_idx.shape[1] < 1:
        raise ValueError(f"{op}: argument 'topk_idx' must have num_topk >= 1 columns, got shape "
                         f"{tuple(topk_idx.shape)}")
    idx = topk_idx.astype(np.int64, copy=False)
    if idx.size and check_range:
        lo, hi = int(idx.min()), int(idx.max())
        if lo < -1 or hi >= num_experts:
            bad = (idx < -1) | (idx >= num_experts)
            flat = int(group.xp.argmax(bad.ravel()))
            t, k = divmod(flat, idx.shape[1])
            raise ValueError(topk_value_error(op, num_experts, int(idx[t, k]), t, k))
    return idx


def topk_value_error(op: str, num_experts: int, value: int, t: int, k: int, where: str = "") -> str:
    """The message for a ``topk_idx`` value out of range at ``[t, k]`` (``where``: how it was found)."""
    return (f"{op}: argument 'topk_idx' must hold -1 (no expert) or an expert in [0, num_experts={num_experts}), "
            f"got {value} at [{t}, {k}]{where}")


def check_x(op: str, group: MoeGroup, x, num_tokens: Optional[int], hidden: Optional[int]):
    """Dispatch's ``x``: an array ``[num_tokens, hidden]`` of bfloat16 (or its raw uint16 bits), float16 or
    float32, or a tuple ``(x_fp8, scales)``: ``x_fp8`` ``[num_tokens, hidden]`` float8_e4m3fn (or raw uint8 bits)
    with ``hidden % FP8_BLOCK == 0``, ``scales`` ``[num_tokens, hidden // FP8_BLOCK]`` float32 (any strides).
    ``num_tokens`` / ``hidden`` None: any. Returns ``(x, scales or None, kind)`` (``kind`` a
    :mod:`~cupy_symbuf.common.dtypes` kind). Raises ``TypeError`` / ``ValueError``."""
    if isinstance(x, tuple):
        if len(x) != 2:
            raise ValueError(f"{op}: argument 'x' as a tuple must be (x_fp8, scales), got a tuple of {len(x)}")
        x8, scales = x
        x8 = check_array(op, "x[0]", x8, group.backend, dims=(("num_tokens", num_tokens), ("hidden", hidden)))
        if _dt.float_kind(x8.dtype, raw_uint8=_dt.FLOAT8_E4M3) != _dt.FLOAT8_E4M3:
            raise TypeError(f"{op}: argument 'x[0]' (x_fp8) must be float8_e4m3fn (or its raw uint8 bits), got "
                            f"dtype {x8.dtype}")
        n, h = x8.shape
        if h % FP8_BLOCK:
            raise ValueError(f"{op}: argument 'x[0]' (x_fp8) must have hidden divisible by {FP8_BLOCK} (one float32 "
                             f"scale per 1x{FP8_BLOCK} block), got hidden={h}")
        scales = check_array(op, "x[1]", scales, group.backend,
                             dims=(("num_tokens", n), (f"hidden // {FP8_BLOCK}", h // FP8_BLOCK)))
        if scales.dtype != np.float32:
            raise TypeError(f"{op}: argument 'x[1]' (scales) must be float32, got dtype {scales.dtype}")
        return x8, scales, _dt.FLOAT8_E4M3
    x = check_array(op, "x", x, group.backend, dims=(("num_tokens", num_tokens), ("hidden", hidden)))
    kind = _dt.float_kind(x.dtype, raw_uint16=_dt.BFLOAT16)
    if kind not in (_dt.BFLOAT16, _dt.FLOAT16, _dt.FLOAT32):
        raise TypeError(f"{op}: argument 'x' must be bfloat16 (or its raw uint16 bits), float16 or float32, or a "
                        f"tuple (x_fp8, scales); got dtype {x.dtype}")
    return x, None, kind


def check_weights(op: str, group: MoeGroup, topk_weights, num_rows: int, num_topk: int, rows_label: str):
    """``topk_weights`` (None passes) ``[num_rows, num_topk]`` float32, any strides; ``rows_label`` names the
    rows in a shape message. Raises ``TypeError`` / ``ValueError``."""
    if topk_weights is None:
        return None
    return check_array(op, "topk_weights", topk_weights, group.backend,
                       dims=((rows_label, num_rows), ("num_topk (of topk_idx)", num_topk)), dtypes=(np.float32,))


def check_handle(op: str, handle, handle_type: type, comm, made_by: str):
    """``handle`` itself when it is a ``handle_type`` made by ``made_by`` (e.g. ``"dispatch"``) on ``comm``
    (``handle.belongs_to(comm)``). Raises ``TypeError`` (another type) or ``ValueError`` (another communicator's)."""
    if not isinstance(handle, handle_type):
        raise TypeError(f"{op}: argument 'handle' must be a {handle_type.__name__} returned by {made_by}, got "
                        f"{type_name(handle)}")
    if not handle.belongs_to(comm):
        raise ValueError(f"{op}: argument 'handle' must come from this communicator's {made_by} (a handle is valid "
                         f"only on the communicator whose dispatch returned it), got one from another communicator")
    return handle


def check_cached(op: str, handle, topk_idx, topk_weights, num_experts) -> None:
    """The routing arguments of a cached dispatch (one given ``handle``, already checked): ``topk_idx`` and
    ``topk_weights`` None (the routing is the handle's), ``num_experts`` None or the handle's. Raises
    ``ValueError``."""
    if topk_idx is not None or topk_weights is not None:
        raise ValueError(f"{op}: arguments 'topk_idx' and 'topk_weights' must be None with handle (a cached "
                         f"dispatch: the routing is the handle's)")
    if num_experts is not None and num_experts != handle.num_experts:
        raise ValueError(f"{op}: argument 'num_experts' must be None or the handle's ({handle.num_experts}) with "
                         f"handle, got {num_experts!r}")


def check_device_experts(op: str, num_experts: int, max_experts: int) -> None:
    """``ValueError`` when ``num_experts > max_experts``, the GPU layout kernel's bound (one shared-memory
    counter per expert)."""
    if num_experts > max_experts:
        raise ValueError(f"{op}: argument 'num_experts' must be <= {max_experts} on the GPU path (the layout kernel "
                         f"keeps one counter per expert in shared memory), got {num_experts}")


def check_counts(op: str, name: str, counts) -> None:
    """``ValueError`` (:func:`count_value_error`) at the first negative entry of ``counts`` (a NumPy array of
    counts, already checked: 1-D int32 or int64; e.g. ``num_tokens_per_expert``)."""
    if counts.size and int(counts.min()) < 0:
        i = int(np.argmax(counts < 0))
        raise ValueError(count_value_error(op, name, int(counts[i]), i))


def count_value_error(op: str, name: str, value: int, i: int, where: str = "") -> str:
    """The message for a negative count ``value`` at ``[i]`` of the argument ``name`` (``where``: how it was
    found)."""
    return f"{op}: argument '{name}' must hold counts >= 0, got {value} at [{i}]{where}"


def combine_kind(op: str, x, dtype) -> str:
    """The dtype kind a combine reads ``x`` (an already checked array) as: ``dtype`` None: ``x``'s own (bfloat16,
    float16 or float32); ``"bfloat16"`` (``x`` bfloat16 or its raw uint16 bits), float16 or float32 (equal to
    ``x.dtype``). Raises ``TypeError`` naming ``x`` or ``dtype``."""
    if dtype is None:
        kind = _dt.float_kind(x.dtype)
        if kind == _dt.FLOAT8_E4M3 or kind is None:
            extra = " (for raw bfloat16 bits pass dtype='bfloat16')" if x.dtype == np.uint16 else ""
            raise TypeError(f"{op}: argument 'x' must be bfloat16, float16 or float32{extra}, got dtype {x.dtype}")
        return kind
    want = _dt.float_kind(dtype)
    if want not in (_dt.BFLOAT16, _dt.FLOAT16, _dt.FLOAT32):
        raise TypeError(f"{op}: argument 'dtype' must be 'bfloat16', float16 or float32, got {dtype!r}")
    if want == _dt.BFLOAT16:
        if x.dtype != np.uint16 and not _dt.is_bfloat16(x.dtype):
            raise TypeError(f"{op}: argument 'x' must be bfloat16 or raw uint16 bits with dtype='bfloat16', got "
                            f"dtype {x.dtype}")
    elif np.dtype(x.dtype) != np.dtype(want):
        raise TypeError(f"{op}: argument 'dtype' must match x.dtype {x.dtype}, got {dtype!r}")
    return want


def row_bytes(x, scales, num_topk: int, with_weights: bool) -> int:
    """Bytes of one dispatched row: ``hidden * itemsize`` of ``x``, + 4 per scale, + 8 per top-k id (``num_topk``
    0: none travel), + 4 per top-k weight (``with_weights``)."""
    rb = x.shape[1] * x.dtype.itemsize
    if scales is not None:
        rb += scales.shape[1] * 4
    if num_topk:
        rb += num_topk * 8
    if with_weights:
        rb += num_topk * 4
    return int(rb)
