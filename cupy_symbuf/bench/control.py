"""``python -m cupy_symbuf.bench --control``: the control-path table (MoE layout, dispatch / combine
with and without a handle, 128-token decode batches eager and replayed in CUDA graphs, the low-latency mode,
alltoall host issue time and the 1 MiB loop), every row with the same method: loop timing (calls back to back
after one barrier, CUDA events around them, seconds per call, max over ranks), plus host time per issue where the
row says so. Inputs: ``--tokens`` (default 4096) x 7168 hidden float16, top-8 of 256 experts, random routing
(distinct experts per token); checked once against the eager result before timing the graph rows.
"""
from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI

from ..common import backend as _compat

HIDDEN, EXPERTS, TOPK = 7168, 256, 8


def _routing(rng, n: int, num_experts: int, topk: int) -> np.ndarray:
    return np.argsort(rng.random((n, num_experts)), axis=1)[:, :topk].astype(np.int64)


def _host_issue_us(fn, comm, n: int = 200) -> float:
    """Host seconds to issue one call (no synchronisation inside), max over ranks, in us."""
    comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    dt = (time.perf_counter() - t0) / n
    return comm.allreduce(dt, op=MPI.MAX) * 1e6


def _profile(c, comm, what: str, fn, n: int = 50) -> None:
    """Rank 0 prints the top functions by own time of ``n`` calls (us per call, profiler overhead included)."""
    import cProfile
    import pstats
    c.synchronize()
    comm.Barrier()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        fn()
    c.synchronize()
    prof.disable()
    if comm.Get_rank() == 0:
        print(f"# profile of {n} calls of {what} (rank 0; self_us / total_us per call)")
        stats = pstats.Stats(prof)
        for (path, line, name), (_, ncalls, tottime, cumtime, _) in sorted(stats.stats.items(),
                                                                           key=lambda kv: -kv[1][2])[:22]:
            print(f"#  {tottime * 1e6 / n:8.1f} {cumtime * 1e6 / n:8.1f} {ncalls / n:5.1f}  "
                  f"{path.split('/')[-1]}:{line}({name})")


def _capture(stream, fn):
    with stream:
        stream.begin_capture()
        out = fn()
        graph = stream.end_capture()
    return graph, out


def run(c, comm, timer, args) -> list:
    """Print and return the rows ``(name, us, target)``."""
    cp = _compat.cupy
    xp = c.xp
    me, W = c.rank, c.world_size
    iters, warm = args.iters, args.warmup
    rows = []

    def row(name, seconds_or_us, target, *, us=False):
        v = seconds_or_us if us else seconds_or_us * 1e6
        rows.append((name, v, target))
        if me == 0:
            print(f"{name:<52} {v:10.1f} us   target {target}", flush=True)

    loop = lambda fn: timer.time_loop(fn, iters, warm, comm, c.synchronize)  # noqa: E731
    rng = np.random.default_rng([me, 10])
    n = args.tokens
    idx = xp.asarray(_routing(rng, n, EXPERTS, TOPK))
    x = xp.asarray(rng.standard_normal((n, HIDDEN)).astype(np.float16))
    w = xp.asarray(rng.uniform(0.1, 1, (n, TOPK)).astype(np.float32))
    if me == 0:
        print(f"# control path: {n} tokens x {HIDDEN} float16, top-{TOPK} of {EXPERTS} experts, world_size {W}, "
              f"loop timing over {iters} calls (max over ranks)")

    row(f"get_dispatch_layout, {n} tokens", loop(lambda: c.get_dispatch_layout(idx, EXPERTS)), "<= 20")
    if c.backend == "cuda":
        stream = cp.cuda.Stream(non_blocking=True)
        with stream:
            c.get_dispatch_layout(idx, EXPERTS)
            stream.synchronize()
        g_lay, _ = _capture(stream, lambda: c.get_dispatch_layout(idx, EXPERTS))
        with stream:
            row("  get_dispatch_layout kernel (graph replay)", loop(lambda: g_lay.launch(stream)), "-")
        row("  get_dispatch_layout host time per call", _host_issue_us(lambda: c.get_dispatch_layout(idx, EXPERTS),
                                                                     comm), "-", us=True)
        c.synchronize()
    out = c.dispatch(x, idx, w, EXPERTS)
    recv_x, _, recv_w, _, h = out
    t_new = loop(lambda: c.dispatch(x, idx, w, EXPERTS))
    t_cached = loop(lambda: c.dispatch(x, handle=h))
    row(f"dispatch without handle, {n} tokens", t_new, f"<= 1.3x cached ({1.3 * t_cached * 1e6:.0f})")
    row(f"dispatch with cached handle, {n} tokens", t_cached, "-")
    row("  ratio without / with handle", t_new / t_cached, "<= 1.3", us=True)
    t_comb = loop(lambda: c.combine(recv_x, h, recv_w))
    row(f"combine, {n} tokens", t_comb, f"<= 1.1x cached dispatch ({1.1 * t_cached * 1e6:.0f})")
    out = recv_x = recv_w = h = None  # free the 4096-token buffers

    # decode batch: 128 tokens, eager and replayed in a graph (worst-case mode)
    s = 128
    idx_s, x_s, w_s = idx[:s].copy(), x[:s].copy(), w[:s].copy()
    t = loop(lambda: c.dispatch(x_s, idx_s, w_s, EXPERTS))
    row(f"dispatch without handle, {s} tokens (eager)", t, "<= 40")
    worst = s * W
    eager = c.dispatch(x_s, idx_s, w_s, EXPERTS)
    if c.backend == "cuda":
        stream = cp.cuda.Stream(non_blocking=True)
        with stream:
            c.dispatch(x_s, idx_s, w_s, EXPERTS, num_worst_tokens=worst)
            stream.synchronize()
        g_disp, out_g = _capture(stream, lambda: c.dispatch(x_s, idx_s, w_s, EXPERTS, num_worst_tokens=worst))
        g_disp.launch(stream)
        stream.synchronize()
        c.synchronize()
        n_real = int(out_g[4].num_recv_tokens_device)
        ok = n_real == eager[0].shape[0] and bool((out_g[0][:n_real] == eager[0]).all())
        if not comm.allreduce(ok, op=MPI.LAND):
            raise RuntimeError("bench --control: the graph-replayed dispatch differs from the eager one")
        with stream:
            g_comb, _ = _capture(stream, lambda: c.combine(out_g[0], out_g[4], out_g[2]))
        with stream:
            row(f"dispatch, {s} tokens, CUDA graph replay", loop(lambda: g_disp.launch(stream)), "<= 20")
            row(f"combine, {s} tokens, CUDA graph replay", loop(lambda: g_comb.launch(stream)), "<= 20")
    t = loop(lambda: c.combine(eager[0], eager[4], eager[2]))
    row(f"combine, {s} tokens (eager)", t, "-")
    if getattr(args, "profile", False):
        _profile(c, comm, "dispatch without handle, 128 tokens", lambda: c.dispatch(x_s, idx_s, w_s, EXPERTS))
        _profile(c, comm, "combine, 128 tokens", lambda: c.combine(eager[0], eager[4], eager[2]))
    eager = None

    # low-latency mode
    try:
        from ..moe.low_latency import bench_low_latency
        ll = bench_low_latency(c, num_tokens=128, hidden=HIDDEN, num_experts=EXPERTS, topk=TOPK, iters=iters,
                               warmup=warm, graph=c.backend == "cuda")
        for k in ("dispatch_us", "combine_us", "dispatch_graph_us", "combine_graph_us"):
            if k in ll and ll[k] is not None:
                row(f"low-latency {k[:-3].replace('_', ' ')}, 128 tokens bf16", ll[k], "<= 20", us=True)
    except Exception as exc:  # noqa: BLE001 - report and go on with the rows that work
        if me == 0:
            print(f"# low-latency rows skipped: {type(exc).__name__}: {exc}")

    # alltoall: host issue time (64 KiB), graph replay host time, 1 MiB loop
    a64 = xp.asarray(np.random.default_rng(me).integers(0, 255, (W, (64 << 10) // W), dtype=np.uint8))
    for _ in range(warm):
        c.alltoall(a64)
    c.synchronize()
    row("alltoall 64 KiB, host time to issue one call", _host_issue_us(lambda: c.alltoall(a64), comm), "<= 8",
        us=True)
    c.synchronize()
    if c.backend == "cuda":
        stream = cp.cuda.Stream(non_blocking=True)
        with stream:
            c.alltoall(a64)
            stream.synchronize()
        g_a2a, _ = _capture(stream, lambda: c.alltoall(a64))
        with stream:
            row("alltoall 64 KiB, host time per graph replay", _host_issue_us(lambda: g_a2a.launch(stream), comm),
                "<= 3", us=True)
            stream.synchronize()
    a1m = xp.asarray(np.random.default_rng(me).integers(0, 255, (W, (1 << 20) // W), dtype=np.uint8))
    row("alltoall 1 MiB per rank, loop", loop(lambda: c.alltoall(a1m)), "<= 8 at 2 ranks")
    return rows
