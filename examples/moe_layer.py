"""A small mixture-of-experts feed-forward layer over ``Communicator.dispatch`` / ``combine``, checked against a
single-process NumPy computation of the same layer, with dispatch/combine timings.

Run::

    mpiexec -n 4 python examples/moe_layer.py                 # host backend: 256 tokens, hidden 256, 32 experts, top-4
    mpirun -n 2 python examples/moe_layer.py --backend cuda   # GPU: DeepSeek-V3-like 4096 tokens/rank, hidden 7168,
                                                              # 256 experts, top-8, bf16

The layer, per token ``x`` (``[hidden]``):

- router: ``p = softmax(x @ W_router)`` over ``num_experts``; the ``topk`` largest, renormalised to sum 1, are the
  gate weights ``g_k`` of experts ``e_k``;
- expert ``e``: ``f_e(x) = silu(x @ W1_e) @ W2_e`` (``W1_e`` ``[hidden, inter]``, ``W2_e`` ``[inter, hidden]``;
  two matmuls with a SiLU between);
- output ``y = sum_k g_k f_{e_k}(x)``.

Weights are seeded identically on every rank (``--seed``); tokens are seeded per rank. Expert ``e`` lives on rank
``e // (num_experts // world_size)`` (DeepEP's contiguous placement).

Forward: router (on the backend's device) -> ``dispatch`` -> each rank runs its local experts on the received rows
(picked through ``recv_topk_idx``), weights them by ``recv_topk_weights`` and sums per received token (float32) ->
rounds to the token dtype -> ``combine`` (float32 sum over ranks, one rounding).

Check: every rank recomputes the whole layer for its own tokens in NumPy float32 from the same (rounded) input
tokens and weights, and compares elementwise with a tolerance derived from the roundings the distributed path
makes (see ``tolerance`` below). The router is checked too: the NumPy top-k must equal the device's except where the
k-th and (k+1)-th logits are closer than float32 matmul noise (such near-ties are counted and reported, and the
expert check uses the device's routing).

Timing: median over ``--iters`` runs after ``--warmup``, with a barrier and (GPU) a device synchronize around each
call. Bandwidth, per rank, in two labelled conventions, counting token payload bytes only (``hidden * itemsize`` per
row; the top-k indices and weights that ride along are not counted):

- "NVLink bytes": rows received from OTHER ranks (dispatch) / the same rows sent back to them (combine): what
  crosses the interconnect;
- "DeepEP convention": all rows received, including a rank's own tokens to itself (``recv_x.numel() * itemsize``
  in DeepEP's ``tests/test_intranode.py``), so it is higher than what crosses NVLink.

Communication share of the layer: the whole forward (router -> ``dispatch`` -> local experts -> ``combine``) is run
``--iters`` times after ``--warmup``, each after a barrier, with a (GPU: device) synchronize closing every section;
share = time in ``dispatch`` + ``combine`` (including waiting for slower peers) / time of the layer, per rank (means
over the runs), and over all ranks together.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from cupy_symbuf import Communicator  # noqa: E402
from cupy_symbuf import dtypes as dt  # noqa: E402

WORLD = MPI.COMM_WORLD
RANK, W = WORLD.Get_rank(), WORLD.Get_size()

HOST_DEFAULTS = dict(tokens=256, hidden=256, experts=32, topk=4, inter=64, dtype="fp32")
GPU_DEFAULTS = dict(tokens=4096, hidden=7168, experts=256, topk=8, inter=64, dtype="bf16")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backend", choices=["auto", "host", "cuda"], default="auto")
    p.add_argument("--tokens", type=int, help="tokens per rank (host 256, GPU 4096)")
    p.add_argument("--hidden", type=int, help="hidden size (host 256, GPU 7168)")
    p.add_argument("--experts", type=int, help="global number of experts, a multiple of world_size (host 32, GPU 256)")
    p.add_argument("--topk", type=int, help="experts per token (host 4, GPU 8)")
    p.add_argument("--inter", type=int, help="expert intermediate size (64; kept small so all experts fit the "
                                             "NumPy reference)")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="token dtype (host fp32, GPU bf16)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def silu(xp, a):
    return a / (1.0 + xp.exp(-a))


def expert_weights(seed: int, e: int, hidden: int, inter: int):
    """float32 ``W1 [hidden, inter]``, ``W2 [inter, hidden]`` of expert ``e``, identical on every rank."""
    rng = np.random.default_rng([seed, 1, e])
    w1 = rng.standard_normal((hidden, inter), dtype=np.float32) / np.float32(np.sqrt(hidden))
    w2 = rng.standard_normal((inter, hidden), dtype=np.float32) / np.float32(np.sqrt(inter))
    return w1, w2


def router_weights(seed: int, hidden: int, num_experts: int):
    rng = np.random.default_rng([seed, 2])
    return rng.standard_normal((hidden, num_experts), dtype=np.float32) / np.float32(np.sqrt(hidden))


def route(xp, x32, w_router, topk: int):
    """Softmax router, top-k renormalised. Returns int64 ``[T, topk]``, float32 ``[T, topk]``, float32 logits."""
    logits = x32 @ w_router
    z = logits - logits.max(axis=1, keepdims=True)
    p = xp.exp(z)
    p /= p.sum(axis=1, keepdims=True)
    idx = xp.argsort(-p, axis=1)[:, :topk].astype(np.int64)
    g = xp.take_along_axis(p, idx, axis=1)
    g = (g / g.sum(axis=1, keepdims=True)).astype(np.float32)
    return idx, g, logits


def token_dtype(xp, name: str):
    """(dtype to hold tokens in, float kind) for ``xp``; bf16 on a CuPy without bfloat16 is raw uint16 bits."""
    if name == "fp32":
        return np.dtype(np.float32), dt.FLOAT32
    if name == "fp16":
        return np.dtype(np.float16), dt.FLOAT16
    bf = dt.bfloat16_dtype()
    if bf is not None:
        try:
            xp.zeros(1, dtype=bf)
            return bf, dt.BFLOAT16
        except Exception:
            pass
    return np.dtype(np.uint16), dt.BFLOAT16


def to_host(a):
    return a if isinstance(a, np.ndarray) else a.get()


def main() -> int:
    args = parse_args()
    backend = args.backend
    if backend == "auto":
        try:
            import cupy
            backend = "cuda" if cupy.cuda.is_available() else "host"
        except Exception:
            backend = "host"
    defaults = GPU_DEFAULTS if backend == "cuda" else HOST_DEFAULTS
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if backend == "cuda":
        import cupy
        local = WORLD.Split_type(MPI.COMM_TYPE_SHARED)
        cupy.cuda.Device(local.Get_rank() % cupy.cuda.runtime.getDeviceCount()).use()
        local.Free()

    T, H, E, K, I = args.tokens, args.hidden, args.experts, args.topk, args.inter
    if E % W:
        raise SystemExit(f"--experts ({E}) must be a multiple of the number of ranks ({W})")
    epr = E // W
    comm = Communicator(WORLD, backend=backend)
    xp = comm.xp
    tdt, kind = token_dtype(xp, args.dtype)
    cdt = {"dtype": "bfloat16"} if tdt == np.uint16 else {}
    itemsize = tdt.itemsize

    def sync():  # GPU collectives return once queued; this waits for them (and raises a recorded timeout)
        comm.synchronize()

    # ---- inputs and weights (weights identical on all ranks; tokens per rank)
    x_np32 = np.random.default_rng([args.seed, 3, RANK]).standard_normal((T, H), dtype=np.float32)
    x = dt.from_float32(xp, xp.asarray(x_np32), kind, tdt)          # the layer's input, rounded to tdt
    x32 = dt.to_float32(xp, x, kind)                                 # what the reference starts from
    w_router = router_weights(args.seed, H, E)
    local_w = [tuple(xp.asarray(w) for w in expert_weights(args.seed, e, H, I))
               for e in range(RANK * epr, (RANK + 1) * epr)]

    # ---- forward pieces
    def experts(recv_x, recv_idx, recv_w):
        rx = dt.to_float32(xp, recv_x, kind)
        out = xp.zeros(rx.shape, dtype=np.float32)
        for j, (w1, w2) in enumerate(local_w):
            rows, slots = xp.nonzero(recv_idx == j)      # a token names expert j at most once: rows are unique
            if rows.size == 0:
                continue
            y = silu(xp, rx[rows] @ w1) @ w2
            out[rows] += recv_w[rows, slots][:, None] * y
        return dt.from_float32(xp, out, kind, tdt)

    topk_idx, topk_w, logits = route(xp, x32, xp.asarray(w_router), K)
    recv_x, recv_idx, recv_w, per_expert, handle = comm.dispatch(x, topk_idx, topk_w, E)
    expert_out = experts(recv_x, recv_idx, recv_w)
    y, _ = comm.combine(expert_out, handle, **cdt)
    sync()

    # ---- timing
    def timed(fn):
        times = []
        for it in range(args.warmup + args.iters):
            sync()
            WORLD.Barrier()
            t0 = time.perf_counter()
            fn()
            sync()
            t1 = time.perf_counter()
            if it >= args.warmup:
                times.append(t1 - t0)
        return float(np.median(times))

    t_dispatch = timed(lambda: comm.dispatch(x, topk_idx, topk_w, E))
    t_cached = timed(lambda: comm.dispatch(x, handle=handle))
    t_combine = timed(lambda: comm.combine(expert_out, handle, **cdt))

    # ---- communication share of the whole layer (router, dispatch, experts, combine), sections timed apart
    def layer():
        sync()
        WORLD.Barrier()
        t0 = time.perf_counter()
        idx, w, _ = route(xp, x32, w_router_dev, K)
        sync()
        ta = time.perf_counter()
        rx, ridx, rw, _, h = comm.dispatch(x, idx, w, E)
        sync()
        tb = time.perf_counter()
        eo = experts(rx, ridx, rw)
        sync()
        tc = time.perf_counter()
        comm.combine(eo, h, **cdt)
        sync()
        t1 = time.perf_counter()
        return (tb - ta) + (t1 - tc), t1 - t0

    w_router_dev = xp.asarray(w_router)
    t_comm = t_layer = 0.0
    for it in range(args.warmup + args.iters):
        tc_, tl_ = layer()
        if it >= args.warmup:
            t_comm += tc_ / args.iters
            t_layer += tl_ / args.iters

    # ---- NumPy reference for this rank's tokens
    ok, report = check(args, x32, logits, topk_idx, topk_w, y, kind, tdt, w_router)

    # ---- report
    recv_counts = np.asarray(handle.recv_counts)
    send_counts = np.asarray(handle.send_counts)
    recv_all = int(recv_counts.sum())
    recv_other = recv_all - int(recv_counts[RANK])
    row = H * itemsize
    stats = dict(rank=RANK, send=send_counts.tolist(), recv=recv_counts.tolist(), per_expert_total=sum(per_expert),
                 t_d=t_dispatch, t_cd=t_cached, t_c=t_combine, t_comm=t_comm, t_layer=t_layer,
                 d_nvl=recv_other * row / t_dispatch / 1e9, d_deepep=recv_all * row / t_dispatch / 1e9,
                 c_nvl=recv_other * row / t_combine / 1e9, c_deepep=recv_all * row / t_combine / 1e9,
                 ok=ok, report=report)
    allstats = WORLD.gather(stats, root=0)
    all_ok = WORLD.allreduce(ok, op=MPI.LAND)
    if RANK == 0:
        print(f"MoE layer: backend={backend} ranks={W} tokens/rank={T} hidden={H} experts={E} "
              f"(local {epr}) top-{K} inter={I} dtype={args.dtype} ({tdt}) channels={comm.layout.num_channels}")
        print("tokens routed (row: source rank; columns: tokens sent to each destination rank):")
        for s in allstats:
            print(f"  rank {s['rank']}: send {s['send']}  recv total {sum(s['recv'])} "
                  f"(from other ranks {sum(s['recv']) - s['recv'][s['rank']]}), "
                  f"token-expert pairs received {s['per_expert_total']}")
        print(f"timings, median of {args.iters} after {args.warmup} warm-up; GB/s per rank, token payload only "
              f"({row} B/row):")
        print("  rank | dispatch us | cached dispatch us | combine us | dispatch GB/s NVLink / DeepEP-conv | "
              "combine GB/s NVLink / DeepEP-conv")
        for s in allstats:
            print(f"  {s['rank']:4d} | {s['t_d'] * 1e6:11.1f} | {s['t_cd'] * 1e6:18.1f} | {s['t_c'] * 1e6:10.1f} | "
                  f"{s['d_nvl']:14.2f} / {s['d_deepep']:6.2f}       | {s['c_nvl']:13.2f} / {s['c_deepep']:6.2f}")
        print('  "NVLink" = bytes received from OTHER ranks (dispatch) and sent back to them (combine); "DeepEP-conv" = '
              "all received rows incl. a rank's own tokens, for both (DeepEP's convention)")
        print(f"communication share of the layer (router + dispatch + experts + combine), mean of {args.iters} after "
              f"{args.warmup} warm-up:")
        for s in allstats:
            print(f"  rank {s['rank']}: layer {s['t_layer'] * 1e6:9.1f} us, dispatch + combine "
                  f"{s['t_comm'] * 1e6:9.1f} us = {s['t_comm'] / s['t_layer']:.1%}")
        share = sum(s["t_comm"] for s in allstats) / sum(s["t_layer"] for s in allstats)
        print(f"  communication share of the layer {share:.1%} (all ranks), slowest rank's layer "
              f"{max(s['t_layer'] for s in allstats) * 1e6:.1f} us")
        for s in allstats:
            print(f"  check rank {s['rank']}: {s['report']}")
        print("RESULT:", "PASS" if all_ok else "FAIL")
    comm.close()
    return 0 if all_ok else 1


def check(args, x32_dev, logits_dev, topk_idx_dev, topk_w_dev, y_dev, kind, tdt, w_router):
    """Recompute the layer for this rank's tokens in NumPy and compare. Returns (ok, one-line report)."""
    T, H, E, K, I = args.tokens, args.hidden, args.experts, args.topk, args.inter
    epr = E // W
    x32 = to_host(x32_dev)
    dev_idx = to_host(topk_idx_dev)
    dev_w = to_host(topk_w_dev)
    y = dt.to_float32(np, to_host(y_dev), kind)

    # router: NumPy top-k must match except at near-ties (k-th vs (k+1)-th logit closer than matmul noise)
    idx_np, g_np, logits_np = route(np, x32, w_router, K)
    srt = -np.sort(-logits_np, axis=1)
    gap = srt[:, K - 1] - srt[:, K] if K < E else np.full(T, np.inf)
    noise = 1e-4 * (np.abs(x32) @ np.abs(w_router)).max(axis=1)          # f32 matmul error bound, generous
    same = (np.sort(idx_np, axis=1) == np.sort(dev_idx, axis=1)).all(axis=1)
    router_bad = int((~same & (gap > noise)).sum())
    near_ties = int((~same).sum()) - router_bad
    w_err = float(np.abs(np.sort(g_np, axis=1) - np.sort(dev_w, axis=1))[same].max(initial=0.0))

    # experts + combine in float32, per destination rank, with the device's routing
    ref = np.zeros((T, H), dtype=np.float32)
    abs_partials = np.zeros((T, H), dtype=np.float32)   # sum_r |p_r|
    abs_terms = np.zeros((T, H), dtype=np.float32)      # sum_k |g_k f_k(x)|
    for r in range(W):
        p_r = np.zeros((T, H), dtype=np.float32)
        for e in range(r * epr, (r + 1) * epr):
            tok, slot = np.nonzero(dev_idx == e)
            if tok.size == 0:
                continue
            w1, w2 = expert_weights(args.seed, e, H, I)
            term = dev_w[tok, slot][:, None] * (silu(np, x32[tok] @ w1) @ w2)
            p_r[tok] += term
            abs_terms[tok] += np.abs(term)
        ref += p_r
        abs_partials += np.abs(p_r)
    # Tolerance. The distributed path rounds each rank's partial sum p_r to the token dtype (relative error
    # <= u/2 with u the dtype's machine epsilon: 2^-7 for bf16, 2^-10 for fp16; nothing for fp32), sums the rounded
    # partials in float32 and rounds the sum once more (<= u/2 * |y|); so |y - ref| <= u/2 * (sum_r |p_r| + |y|),
    # and we allow u (factor 2 slack). On top, both sides compute the expert matmuls in float32 in different
    # orders (device BLAS vs NumPy): their difference is a few 2^-24 relative to the magnitudes of the summed
    # terms (about sqrt(hidden) * 2^-24 ~ 5e-6 for hidden 7168 in the worst case seen), so 1e-5 * sum_k |g_k f_k|
    # is allowed, plus an absolute floor of 1e-6 * max|ref| for elements that cancel to ~0.
    u = {dt.BFLOAT16: 2.0 ** -7, dt.FLOAT16: 2.0 ** -10, dt.FLOAT32: 0.0}[kind]
    tol = u * (abs_partials + np.abs(ref)) + 1e-5 * abs_terms + 1e-6 * float(np.abs(ref).max(initial=0.0))
    err = np.abs(y - ref)
    ratio = float((err / tol).max(initial=0.0))
    rel = float(np.linalg.norm(y - ref) / max(np.linalg.norm(ref), 1e-30))
    ok = ratio <= 1.0 and router_bad == 0 and w_err < 1e-4
    report = (f"max |y - ref| / tol = {ratio:.3f} (<= 1 passes), max |y - ref| = {float(err.max(initial=0)):.3g}, "
              f"relative L2 error = {rel:.3g}; router: {router_bad} top-k mismatches beyond near-ties, "
              f"{near_ties} near-ties, gate weight max diff {w_err:.2g}")
    return bool(ok), report


if __name__ == "__main__":
    sys.exit(main())
