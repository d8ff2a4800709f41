"""Where the tokens of a normal-mode dispatch go, computed with the array module ``xp`` (NumPy or CuPy).

Experts are placed contiguously: with ``num_local_experts = num_experts // world_size``, expert ``e`` lives on rank
``e // num_local_experts``. Used by the flat dispatch on the host (:mod:`cupy_symbuf.moe.normal`; the GPU computes
the same in one kernel, :mod:`cupy_symbuf.moe.gpu`) and by the hierarchical one
(:mod:`cupy_symbuf.scaleout.hierarchical`).
"""
from __future__ import annotations

from typing import List

import numpy as np

__all__ = ["token_layout", "align_counts"]


def token_layout(xp, idx, num_experts: int, world_size: int):
    """The layout of ``idx`` (int64 ``[num_tokens, num_topk]``, already checked: -1 or in ``[0, num_experts)``):
    ``(num_tokens_per_rank int32 [world_size], num_tokens_per_expert int32 [num_experts], is_token_in_rank bool
    [num_tokens, world_size])``, arrays of ``xp`` (see :func:`cupy_symbuf.moe.get_dispatch_layout`)."""
    num_tokens, _ = idx.shape
    epr = num_experts // world_size
    valid = idx >= 0
    dest = xp.where(valid, idx // epr, world_size)           # invalid -> spare column world_size
    hit = xp.zeros((num_tokens, world_size + 1), dtype=bool)
    if idx.size:
        hit[xp.arange(num_tokens)[:, None], dest] = True
    is_token_in_rank = xp.ascontiguousarray(hit[:, :world_size])
    num_tokens_per_rank = is_token_in_rank.sum(axis=0).astype(np.int32)
    if idx.size:
        num_tokens_per_expert = xp.bincount((idx + 1).ravel(), minlength=num_experts + 1)[1:].astype(np.int32)
    else:
        num_tokens_per_expert = xp.zeros(num_experts, dtype=np.int32)
    return num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank


def align_counts(raw, alignment: int) -> List[int]:
    """Each of the per-expert counts ``raw`` (ints) rounded up to a multiple of ``alignment`` (>= 1), as a list."""
    if alignment == 1:
        return list(raw)
    return ((np.asarray(raw, np.int64) + (alignment - 1)) // alignment * alignment).tolist()
