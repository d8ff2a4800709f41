"""Differentiable MoE ``dispatch`` / ``combine`` for PyTorch tensors (optional; ``import torch`` happens here only).

The backward of a dispatch is a combine and the backward of a combine is a cached dispatch (the same handle), as
in DeepEP's training use (``deep_ep.Buffer``: ``dispatch`` in the forward pass, ``combine`` of the gradients in the
backward pass, and the other way round):

* ``recv_x = dispatch(x)`` copies token ``t`` to every rank holding one of its experts, so
  ``grad_x[t] = sum of grad_recv_x over those copies`` = ``combine(grad_recv_x)``.
* ``recv_topk_weights`` carries the gate weights of the slots whose expert is local (``0`` elsewhere, constant),
  so ``grad_topk_weights[t, k]`` = the gradient of that slot on the rank holding its expert, gathered by the same
  combine (masked slots contribute nothing).
* ``y = combine(z)`` sums the ranks' rows for each token, so ``grad_z`` = the gradient of each row's token, sent
  back along the same routes = ``dispatch(grad_y, handle=handle)``.

Tensors travel without copies where the backend allows: the host backend takes CPU tensors (NumPy views;
bfloat16 through ``ml_dtypes``), the cuda backend CUDA tensors (DLPack; bfloat16 as raw bits), on the current
PyTorch stream. The backward passes are collectives: every rank must run ``backward`` through the same graph
(the usual data-parallel / expert-parallel training loop does), in the same order.
"""
from __future__ import annotations

import numpy as np

__all__ = ["dispatch", "combine"]


def _torch():
    try:
        import torch
    except ImportError as exc:  # pragma: no cover (the module is optional)
        raise ImportError("cupy_symbuf.autograd needs PyTorch (pip install torch)") from exc
    return torch


def _to_xp(comm, t, name: str):
    """A backend array over tensor ``t`` (no copy when ``t`` is contiguous); bfloat16 as the backend holds it
    (host: ``ml_dtypes.bfloat16``; cuda: raw ``uint16`` bits). Returns ``(array, is_bf16_bits)``."""
    torch = _torch()
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"cupy_symbuf.autograd: argument {name!r} must be a torch.Tensor, got {type(t).__name__}")
    t = t.detach()
    want = "cpu" if comm.backend == "host" else "cuda"
    if t.device.type != want:
        raise TypeError(f"cupy_symbuf.autograd: argument {name!r} is on {t.device}, but the communicator's backend "
                        f"{comm.backend!r} takes {want} tensors")
    t = t.contiguous()
    bf16 = t.dtype == torch.bfloat16
    if comm.backend == "host":
        if bf16:
            import ml_dtypes
            return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16), False
        return t.numpy(), False
    import cupy
    if bf16:
        return cupy.from_dlpack(t.view(torch.int16)).view(cupy.uint16), True
    return cupy.from_dlpack(t), False


def _to_torch(a, bf16_bits: bool = False):
    """A tensor over backend array ``a`` (no copy)."""
    torch = _torch()
    if isinstance(a, np.ndarray):
        if a.dtype.name == "bfloat16":
            return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)
        if not a.flags.writeable:
            a = a.copy()
        return torch.from_numpy(np.ascontiguousarray(a))
    if bf16_bits:
        return torch.from_dlpack(a.view("int16")).view(torch.bfloat16)
    return torch.from_dlpack(a)


def _stream_scope(comm):
    """Run the collective on PyTorch's current CUDA stream (cuda backend), else nothing."""
    import contextlib
    if comm.backend != "cuda":
        return contextlib.nullcontext()
    import cupy
    torch = _torch()
    return cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)


def _zeros_like_xp(comm, shape, dtype):
    return comm.xp.zeros(shape, dtype=dtype)


_FUNCTIONS = None


class _rejecting:
    """Context for argument conversions before a collective: an error there is a rejection told to the peers
    (they raise :class:`~cupy_symbuf.SymBufferRejectedError` instead of waiting), then it propagates."""

    def __init__(self, comm, op: str, notify: bool):
        self.comm, self.op, self.notify = comm, op, notify

    def __enter__(self):
        self.comm.engine.check_open()
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            self.comm.engine.reject(self.op, notify=self.notify)
        return False


def _functions():
    """The two ``torch.autograd.Function`` classes, made once (torch is imported only when they are used)."""
    global _FUNCTIONS
    if _FUNCTIONS is not None:
        return _FUNCTIONS
    torch = _torch()

    once = torch.autograd.function.once_differentiable

    class _Dispatch(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, topk_weights, comm, topk_idx, num_experts, kwargs, box):
            with _rejecting(comm, "dispatch", True):
                xa, bits = _to_xp(comm, x, "x")
                ia, _ = _to_xp(comm, topk_idx, "topk_idx")
                wa = None if topk_weights is None else _to_xp(comm, topk_weights, "topk_weights")[0]
            with _stream_scope(comm):
                recv_x, recv_idx, recv_w, counts, handle = comm.dispatch(xa, ia, wa, num_experts, **kwargs)
            box["handle"], box["counts"] = handle, counts
            ctx.comm, ctx.handle, ctx.bits = comm, handle, bits
            ctx.recv_idx = recv_idx
            ctx.has_weights = topk_weights is not None
            ctx.recv_dtype = recv_x.dtype
            idx_t = _to_torch(recv_idx)
            ctx.mark_non_differentiable(idx_t)
            return _to_torch(recv_x, bits), idx_t, (None if recv_w is None else _to_torch(recv_w))

        @staticmethod
        @once
        def backward(ctx, grad_recv_x, grad_recv_idx, grad_recv_w):
            comm, h = ctx.comm, ctx.handle
            xp = comm.xp
            n, hidden = int(ctx.recv_idx.shape[0]), h.hidden
            # every rank calls the combine with the same arguments' shapes (a gradient autograd left out is zeros)
            if grad_recv_x is None:
                gx = _zeros_like_xp(comm, (n, hidden), ctx.recv_dtype)
            else:
                gx, _ = _to_xp(comm, grad_recv_x, "grad_recv_x")
            gw = None
            if ctx.has_weights:
                if grad_recv_w is None:
                    gw = _zeros_like_xp(comm, tuple(ctx.recv_idx.shape), np.float32)
                else:
                    gw = _to_xp(comm, grad_recv_w.float(), "grad_recv_topk_weights")[0]
                    gw = xp.where(ctx.recv_idx >= 0, gw, xp.float32(0))  # masked slots are constants (0)
            with _stream_scope(comm):
                grad_x, grad_w = comm.combine(gx, h, gw, dtype="bfloat16" if ctx.bits else None)
            return (_to_torch(grad_x, ctx.bits), None if grad_w is None else _to_torch(grad_w),
                    None, None, None, None, None)

    class _Combine(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, comm, handle):
            with _rejecting(comm, "combine", False):
                xa, bits = _to_xp(comm, x, "x")
            with _stream_scope(comm):
                y, _ = comm.combine(xa, handle, dtype="bfloat16" if bits else None)
            ctx.comm, ctx.handle, ctx.bits = comm, handle, bits
            ctx.y_shape, ctx.y_dtype = tuple(y.shape), y.dtype
            return _to_torch(y, bits)

        @staticmethod
        @once
        def backward(ctx, grad_y):
            comm = ctx.comm
            g = _zeros_like_xp(comm, ctx.y_shape, ctx.y_dtype) if grad_y is None else _to_xp(comm, grad_y,
                                                                                               "grad_y")[0]
            with _stream_scope(comm):
                recv = comm.dispatch(g, handle=ctx.handle)[0]
            return _to_torch(recv, ctx.bits), None, None

    _FUNCTIONS = (_Dispatch, _Combine)
    return _FUNCTIONS


def dispatch(comm, x, topk_idx, topk_weights=None, num_experts=None, **kwargs):
    """Differentiable :meth:`Communicator.dispatch` (DeepEP normal mode) of PyTorch tensors. Collective.

    Parameters
    ----------
    comm : Communicator
        Host backend: CPU tensors; cuda backend: CUDA tensors (run on PyTorch's current stream).
    x : torch.Tensor ``[num_tokens, hidden]`` float32, float16 or bfloat16
        Differentiable.
    topk_idx : torch.Tensor ``[num_tokens, num_topk]`` int64
        Global expert per slot, ``-1`` = none.
    topk_weights : torch.Tensor ``[num_tokens, num_topk]`` float32, optional
        Differentiable gate weights.
    num_experts : int
        Global number of experts (a multiple of the world size).
    **kwargs
        ``expert_alignment`` (see :meth:`Communicator.dispatch`); not ``handle`` (use a cached dispatch of the
        communicator for non-differentiable repeats) and not ``num_worst_tokens``.

    Returns
    -------
    recv_x : torch.Tensor ``[num_recv_tokens, hidden]``, x's dtype (differentiable)
    recv_topk_idx : torch.Tensor ``[num_recv_tokens, num_topk]`` int64 (local expert, ``-1`` elsewhere)
    recv_topk_weights : torch.Tensor ``[num_recv_tokens, num_topk]`` float32 or None (differentiable)
    num_recv_tokens_per_expert : list of int
    handle : DispatchHandle
        For :func:`combine`.

    The backward pass is ``combine`` of the gradients (see the module docstring). Raises what
    :meth:`Communicator.dispatch` raises, and ``TypeError`` for a tensor on the wrong device or not a tensor.
    """
    with _rejecting(comm, "dispatch", True):
        for k in ("handle", "num_worst_tokens"):
            if k in kwargs:
                raise ValueError(f"cupy_symbuf.autograd.dispatch: {k!r} is not supported (a differentiable "
                                 f"dispatch computes its own layout)")
    box = {}
    recv_x, recv_idx, recv_w = _functions()[0].apply(x, topk_weights, comm, topk_idx, num_experts, kwargs, box)
    return recv_x, recv_idx, recv_w, box["counts"], box["handle"]


def combine(comm, x, handle):
    """Differentiable :meth:`Communicator.combine` of a PyTorch tensor ``x`` ``[num_recv_tokens, hidden]`` (the
    rows of the dispatch that made ``handle``, typically the weighted expert outputs): returns ``combined_x``
    ``[num_tokens, hidden]`` of ``x``'s dtype. Collective. Its backward is a cached dispatch of the gradient
    (``dispatch(grad, handle=handle)``). Raises what :meth:`Communicator.combine` raises."""
    return _functions()[1].apply(x, comm, handle)
