"""The argument checks of low-latency mode: a :class:`~cupy_symbuf.moe.low_latency.LowLatencyBuffer`'s
parameters and the arrays of its calls. Each raises ``TypeError`` / ``ValueError`` naming the call, the
argument and the rule, before anything moves (the buffer tells the peers of a call's failed check; see its module
docstring)."""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from ..common import dtypes as _dt
from ..common.checks import as_array, check_int
from .low_latency_cuda import SMEM_DYNAMIC_MAX
from .low_latency_regions import ITEMSIZE, KINDS, kind_of

__all__ = ["check_params", "check_x", "check_topk", "check_weights"]


def check_params(op: str, W: int, num_max_dispatch_tokens_per_rank, hidden, num_experts, max_topk, dtype,
                 num_blocks) -> tuple:
    """A LowLatencyBuffer's parameters on ``W`` ranks (see its docstring); returns ``(N, H, E, K, kind, smem,
    num_blocks)``: the ints, the element kind, the dispatch kernel's dynamic shared memory (bytes)."""
    N = check_int(op, "num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank, minimum=1,
                  maximum=4096)
    H = check_int(op, "hidden", hidden, minimum=1)
    E = check_int(op, "num_experts", num_experts, minimum=1)
    K = check_int(op, "max_topk", max_topk, minimum=1, maximum=32)
    kind = kind_of(dtype)
    if kind not in KINDS:
        raise TypeError(f"{op}: dtype must be bfloat16, float16 or float32, got {dtype!r}")
    if E % W:
        raise ValueError(f"{op}: num_experts ({E}) must be a multiple of world_size ({W})")
    if W > 32:
        raise ValueError(f"{op}: world_size must be <= 32, got {W}")
    if (H * ITEMSIZE[kind]) % 16:
        raise ValueError(f"{op}: hidden * itemsize ({H} * {ITEMSIZE[kind]}) must be a multiple of 16 bytes")
    smem = 4 * (E * ((N + 31) // 32) + E)
    if smem > SMEM_DYNAMIC_MAX:
        raise ValueError(f"{op}: num_experts * ceil(N / 32) too large for the receive masks ({smem} bytes "
                         f"of shared memory > {SMEM_DYNAMIC_MAX}): lower num_max_dispatch_tokens_per_rank "
                         f"or num_experts")
    if num_blocks is not None:
        num_blocks = check_int(op, "num_blocks", num_blocks, minimum=1, maximum=1024)
    return N, H, E, K, kind, smem, num_blocks


def check_x(op: str, name: str, x, shape, backend: str, buffer_kind: str) -> Any:
    """``x`` (argument ``name``): an array of ``backend`` of the buffer's element kind and of ``shape`` (None: any
    extent); returns it as that array."""
    a = as_array(op, name, x, backend)
    kind = kind_of(a.dtype)
    if kind != buffer_kind:
        raw = "; raw uint16 bits accepted" if buffer_kind == _dt.BFLOAT16 else ""
        how = f"create the buffer with LowLatencyBuffer(..., dtype={kind!r}) or pass {buffer_kind} rows" \
            if kind in KINDS else \
            f"pass {buffer_kind} rows (LowLatencyBuffer(..., dtype=...) takes bfloat16, float16 or float32)"
        raise TypeError(f"{op}: {name} must have this buffer's dtype ({buffer_kind}{raw}), got {a.dtype}: the "
                        f"buffer's dtype is fixed when it is made; {how}")
    if a.ndim != len(shape) or any(want is not None and got != want for got, want in zip(a.shape, shape)):
        spec = tuple("n" if w is None else w for w in shape)
        raise ValueError(f"{op}: {name} must have shape {spec}, got {tuple(a.shape)}")
    return a


def check_topk(op: str, topk_idx, n: Optional[int], backend: str, max_topk: int, num_experts: int) -> Any:
    """``topk_idx``: int64 / int32 ``[n, 1..max_topk]`` (host: entries -1 or in ``[0, num_experts)``); returns it as
    int64."""
    t = as_array(op, "topk_idx", topk_idx, backend)
    if t.ndim != 2 or (n is not None and t.shape[0] != n):
        raise ValueError(f"{op}: topk_idx must be 2-D [num_tokens, num_topk] with num_tokens = {n}, got shape "
                         f"{tuple(t.shape)}")
    if not 1 <= t.shape[1] <= max_topk:
        raise ValueError(f"{op}: topk_idx.shape[1] (num_topk) must be in [1, max_topk={max_topk}], got "
                         f"{t.shape[1]}")
    if t.dtype not in (np.int64, np.int32):
        raise TypeError(f"{op}: topk_idx must be int64 (or int32), got {t.dtype}")
    t = t.astype(np.int64, copy=False)
    if backend == "host" and t.size and (int(t.min()) < -1 or int(t.max()) >= num_experts):
        raise ValueError(f"{op}: topk_idx entries must be -1 or expert ids in [0, {num_experts}), got "
                         f"min {int(t.min())}, max {int(t.max())}")
    return t


def check_weights(op: str, topk_weights, n: int, K: int, backend: str) -> Any:
    """``topk_weights``: float32 ``[n, K]``; returns it as an array of ``backend``."""
    w = as_array(op, "topk_weights", topk_weights, backend)
    if w.dtype != np.float32:
        raise TypeError(f"{op}: topk_weights must be float32, got {w.dtype}")
    if tuple(w.shape) != (n, K):
        raise ValueError(f"{op}: topk_weights must have shape ({n}, {K}) like topk_idx, got "
                         f"{tuple(w.shape)}")
    return w
