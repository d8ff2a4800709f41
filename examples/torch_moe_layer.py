"""A small PyTorch mixture-of-experts layer written against DeepEP's API (``cupy_symbuf.deepep.Buffer``), launched
with ``torchrun``, checked against a single-process computation of the same layer.

Run::

    torchrun --standalone --nproc-per-node 2 examples/torch_moe_layer.py                   # CPU: host backend
    torchrun --standalone --nproc-per-node 2 examples/torch_moe_layer.py --backend cuda    # GPU (every rank on
                                                                      # GPU local_rank % device_count; MPS if shared)

The layer (``MoE`` below), per token ``x`` (``[hidden]`` float32):

- router: ``p = softmax(x @ W_router)`` over ``num_experts``; the ``topk`` largest, renormalised to sum 1, are the
  gate weights ``g_k`` of experts ``e_k``;
- expert ``e``: ``Linear(hidden, inter) -> SiLU -> Linear(inter, hidden)``;
- output ``y = sum_k g_k f_{e_k}(x)``.

Expert ``e`` lives on rank ``e // (num_experts // world_size)`` (DeepEP's placement); every rank builds the same
weights from ``--seed`` and its own tokens from ``--seed + rank``. Forward, as in DeepEP's intranode examples:
``get_dispatch_layout(topk_idx)`` -> ``dispatch(x, topk_idx=..., topk_weights=...)`` -> each rank applies its
local experts to the received rows (``recv_topk_idx`` holds local expert ids, ``-1`` elsewhere) weighted by
``recv_topk_weights`` and sums per row -> ``combine`` (sums every rank's partial for each token).

Check: every rank computes the whole layer for its own tokens with every expert locally (the same modules, no
communication) and compares (``torch.allclose``, rtol 1e-5, atol 1e-5: only the order of the float32 sums
differs). Prints one line per rank and, from rank 0, ``torch_moe_layer: PASSED`` (exit 0) or ``FAILED`` (exit 1).

The process group is gloo by default (``--dist-backend``); cupy_symbuf's construction goes through its store, and
its own buffers carry the tokens (POSIX shared memory on the host backend, GPU memory on the cuda backend).
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

from cupy_symbuf.deepep import Buffer


class MoE(nn.Module):
    """Router + ``num_experts`` two-layer experts; :meth:`forward` runs the distributed layer over ``buffer``
    (only this rank's experts), :meth:`reference` the whole layer on this rank."""

    def __init__(self, hidden: int, inter: int, num_experts: int, topk: int):
        super().__init__()
        self.topk = topk
        self.num_experts = num_experts
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(hidden, inter), nn.SiLU(), nn.Linear(inter, hidden))
                                     for _ in range(num_experts))

    def route(self, x: torch.Tensor):
        probs = torch.softmax(self.router(x), dim=-1)
        w, idx = torch.topk(probs, self.topk, dim=-1)
        return idx.to(torch.int64), (w / w.sum(dim=-1, keepdim=True)).to(torch.float32)

    def forward(self, x: torch.Tensor, buffer: Buffer) -> torch.Tensor:
        idx, w = self.route(x)
        num_tokens_per_rank, _, num_tokens_per_expert, is_token_in_rank, _ = buffer.get_dispatch_layout(
            idx, self.num_experts)
        recv_x, recv_idx, recv_w, _, handle, _ = buffer.dispatch(
            x, topk_idx=idx, topk_weights=w, num_tokens_per_rank=num_tokens_per_rank,
            is_token_in_rank=is_token_in_rank, num_tokens_per_expert=num_tokens_per_expert)
        local = self.num_experts // buffer.group_size
        first = buffer.rank * local
        out = torch.zeros_like(recv_x)
        for j in range(recv_idx.shape[1]):
            for e in range(local):
                rows = recv_idx[:, j] == e
                if bool(rows.any()):
                    out[rows] += recv_w[rows, j:j + 1] * self.experts[first + e](recv_x[rows])
        y, _, _ = buffer.combine(out, handle)
        return y

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        idx, w = self.route(x)
        y = torch.zeros_like(x)
        for j in range(self.topk):
            for e in range(self.num_experts):
                rows = idx[:, j] == e
                if bool(rows.any()):
                    y[rows] += w[rows, j:j + 1] * self.experts[e](x[rows])
        return y


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="auto", choices=("auto", "cuda", "host"))
    ap.add_argument("--dist-backend", default="gloo", help="torch.distributed backend of the group (gloo, nccl)")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--inter", type=int, default=64)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()
    if "RANK" not in os.environ:
        ap.error("start it with torchrun (torchrun --standalone --nproc-per-node N examples/torch_moe_layer.py)")

    use_cuda = args.backend == "cuda" or (args.backend == "auto" and torch.cuda.is_available())
    device = torch.device("cpu")
    if use_cuda:
        ordinal = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
        torch.cuda.set_device(ordinal)
        import cupy
        cupy.cuda.Device(ordinal).use()
        device = torch.device("cuda", ordinal)
    dist.init_process_group(args.dist_backend, device_id=device if args.dist_backend == "nccl" else None)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.experts % world:
        ap.error(f"--experts ({args.experts}) must be a multiple of the world size ({world})")

    torch.manual_seed(args.seed)
    layer = MoE(args.hidden, args.inter, args.experts, args.topk).to(device)
    gen = torch.Generator().manual_seed(args.seed + 1 + rank)
    x = torch.randn(args.tokens, args.hidden, generator=gen).to(device)

    buffer = Buffer(dist.group.WORLD, backend="cuda" if use_cuda else "host")
    try:
        with torch.no_grad():
            y = layer(x, buffer)
            if use_cuda:
                torch.cuda.synchronize()
            want = layer.reference(x)
        err = float((y - want).abs().max())
        ok = bool(torch.allclose(y, want, rtol=1e-5, atol=1e-5)) and bool(torch.isfinite(y).all())
        print(f"rank {rank}: {buffer.communicator.backend} backend, {args.tokens} tokens x {args.hidden}, "
              f"{args.experts} experts top-{args.topk}: max |y - reference| = {err:.3g} {'OK' if ok else 'MISMATCH'}",
              flush=True)
        flag = torch.tensor([0 if ok else 1], dtype=torch.int32, device=device if args.dist_backend == "nccl"
                            else "cpu")
        dist.all_reduce(flag)  # SUM of failures over the ranks
        all_ok = int(flag.item()) == 0
    finally:
        buffer.destroy()
    if rank == 0:
        print(f"torch_moe_layer: {'PASSED' if all_ok else 'FAILED'} (world_size={world}, "
              f"{buffer.communicator.backend} backend, torch.distributed {args.dist_backend})", flush=True)
    dist.destroy_process_group()
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
