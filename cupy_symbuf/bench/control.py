"""``python -m cupy_symbuf.bench --control [--repeat 3]``: the control-path and latency table. Every row the
latency targets name, each with its target, the same method for all: loop timing (calls back to back after one
barrier, CUDA events around them, seconds per call, max over ranks), host time per issue where the row says so
(``time.perf_counter`` around one call issued with nothing queued, median of 200, max over ranks; on the GPU also
"back to back": 200 calls with no synchronisation inside, where a queue that backs up adds its waits), ratios of two
rows.

Rows (GPU; the host backend prints the rows it can time):

* ``get_dispatch_layout`` at ``--tokens`` (default 4096): loop, its kernel alone (graph replay), host time.
* ``dispatch`` without / with a cached handle and ``combine`` at ``--tokens``, and the ratios without / with handle
  and combine / cached dispatch.
* 128-token decode batch: eager ``dispatch`` without handle, host time of a cached ``dispatch`` and of a
  ``combine``, ``dispatch`` / ``combine`` replayed from CUDA graphs (worst-case mode, ``num_worst_tokens``).
* the low-latency mode at 128 tokens bf16: eager, host time, graph replay.
* ``alltoall`` 64 KiB: host time to issue one call eagerly and per graph replay; ``alltoall`` 1 MiB per rank, loop.
* ``copy rate``: every rank copying 64 MiB between two of its own arrays at once (all ranks' bytes / time), and for
  the byte-heavy rows (graph-replayed dispatch / combine, low-latency graph rows, alltoall 1 MiB) the **HBM floor
  share** = (all ranks' bytes moved / that copy rate) / the row's time: 100% = one copy per byte at the rate the
  ranks share. Bytes moved: every row a rank sends, its own included (dispatch: ``x`` + top-k ids + weights;
  combine: ``x`` + weights; alltoall: every rank's input); low-latency rows: the bytes a rank stores into its
  peers' buffers (its own excluded, as ``bench_low_latency`` counts them).
* ``launch skew``: for each graph row, the ranks' latest minus earliest GPU start (``%globaltimer`` stamped by a
  one-thread kernel queued right before the replay, after a barrier; median of 20), where the ranks share a GPU's
  clock (one GPU under MPS; on several GPUs the row is printed with that caveat).

Targets: the host-time rows hold at every world size; kernel rows hold at 2 ranks, and at 4 and 8 ranks on one GPU
(the ranks' bytes share one HBM) the byte-heavy rows must reach an HBM floor share of at least 70% instead.
``--repeat N``: the whole table N times in this process, each row's median printed (with the runs' min-max).
Inputs: ``--tokens`` x 7168 hidden float16, top-8 of 256 experts, random routing (distinct experts per token);
the graph-replayed dispatch is checked once against the eager result.
"""
from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI

from ..common import backend as _compat
from .profiling import profile_calls, top_functions

HIDDEN, EXPERTS, TOPK = 7168, 256, 8
DECODE = 128
#: The HBM floor share the byte-heavy rows must reach at 4 and 8 ranks on one GPU.
FLOOR_TARGET = 0.70
COPY_BYTES = 64 << 20

_STAMP_SRC = r"""
extern "C" __global__ void symbuf_bench_stamp(long long* out) {
  long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  *out = t;
}
"""


def _routing(rng, n: int, num_experts: int, topk: int) -> np.ndarray:
    return np.argsort(rng.random((n, num_experts)), axis=1)[:, :topk].astype(np.int64)


def _host_issue_us(fn, comm, sync, n: int = 200) -> float:
    """Host microseconds to issue one call alone: ``n`` times ``sync()`` (the device idle, nothing queued), then
    ``time.perf_counter`` around one ``fn()``; the median per rank, max over ranks. What a caller whose host is the
    bottleneck (the device waiting for its launches) pays per call."""
    comm.Barrier()
    dts = []
    for _ in range(n):
        sync()
        t0 = time.perf_counter()
        fn()
        dts.append(time.perf_counter() - t0)
    sync()
    return comm.allreduce(float(np.median(dts)), op=MPI.MAX) * 1e6


def _host_stream_us(fn, comm, n: int = 200) -> float:
    """Host microseconds per call of ``n`` calls issued back to back (no synchronisation inside), max over ranks:
    the issue time plus whatever the device's queue makes the launches wait once it backs up (the kernels slower
    than the issue), so at least the row's device time per call when that is longer."""
    comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    dt = (time.perf_counter() - t0) / n
    return comm.allreduce(dt, op=MPI.MAX) * 1e6


def _profile(c, comm, what: str, fn, n: int = 50) -> None:
    """Rank 0 prints the top functions by own time of ``n`` calls (us per call, profiler overhead included)."""
    c.synchronize()
    comm.Barrier()
    stats = profile_calls(fn, n, done=c.synchronize)
    if comm.Get_rank() == 0:
        calls = sum(v[1] for v in stats.stats.values()) / n
        print(f"# profile of {n} calls of {what} (rank 0; {calls:.0f} Python-level calls per call; "
              f"self_us / total_us / calls per call)")
        for self_us, total_us, per_call, where in top_functions(stats, n, 22):
            print(f"#  {self_us:8.1f} {total_us:8.1f} {per_call:5.1f}  {where}")


def _capture(stream, fn):
    with stream:
        stream.begin_capture()
        out = fn()
        graph = stream.end_capture()
    return graph, out


def _copy_rate(comm, xp, timer, iters: int, warmup: int) -> float:
    """All ranks' bytes per second of every rank copying ``COPY_BYTES`` between two of its own arrays at once
    (loop timing, max over ranks): the rate the ranks share (one GPU under MPS: its HBM)."""
    src = xp.ones(COPY_BYTES, dtype=np.uint8)
    dst = xp.empty_like(src)
    per = timer.time_loop(lambda: xp.copyto(dst, src), iters, warmup, comm)
    return comm.Get_size() * COPY_BYTES / per


class _Skew:
    """Launch skew of a graph replay: each rank's GPU start time (``%globaltimer``, one thread stamping it right
    before the replay on the same stream), latest minus earliest over ranks, median of ``trials``."""

    def __init__(self, cp):
        self.cp = cp
        self.kernel = cp.RawKernel(_STAMP_SRC, "symbuf_bench_stamp")
        self.word = cp.zeros(1, np.int64)

    def __call__(self, comm, stream, launch, trials: int = 20) -> float:
        skews = []
        for _ in range(trials):
            stream.synchronize()
            comm.Barrier()
            with stream:
                self.kernel((1,), (1,), (self.word,))
                launch()
            stream.synchronize()
            t = comm.allgather(int(self.word.get()[0]))
            skews.append((max(t) - min(t)) * 1e-3)
        return float(np.median(skews))


class _Table:
    """The rows of one pass: ``(name, value, unit, target text, check)``; ``check(value)`` is True / False for a
    row with a target at this world size, None for a row that only reports."""

    def __init__(self, gpu: bool):
        self.rows = []
        self.gpu = gpu

    def add(self, name: str, value: float, unit: str, target: str, check=None) -> float:
        if not self.gpu and check is not None:  # the targets are the GPU path's: the host backend reports
            target, check = f"report (GPU: {target})", None
        self.rows.append((name, float(value), unit, target, check))
        return value


def _pass(c, comm, timer, args, data, skew_meter) -> list:
    """One pass of the table (collective); returns its rows (see :class:`_Table`)."""
    cp = _compat.cupy
    xp = c.xp
    W = c.world_size
    gpu = c.backend == "cuda"
    iters, warm = args.iters, args.warmup
    tab = _Table(gpu)
    loop = lambda fn: timer.time_loop(fn, iters, warm, comm, c.synchronize) * 1e6  # noqa: E731
    at2 = W <= 2  # kernel-time targets hold at 2 ranks; at 4 and 8 on one GPU the floor share instead

    def kernel_target(limit: float):
        if at2:
            return f"<= {limit:g}", (lambda v: v <= limit)
        return f"report (<= {limit:g} at 2 ranks)", None

    def floor_row(name: str, us: float, total_bytes: float):
        if data["rate"] is None or not us:
            return
        share = total_bytes / data["rate"] * 1e6 / us
        if at2:
            tab.add(f"  {name}: HBM floor share", 100 * share, "%", "report", None)
        else:
            tab.add(f"  {name}: HBM floor share", 100 * share, "%", f">= {100 * FLOOR_TARGET:.0f}%",
                    lambda v: v >= 100 * FLOOR_TARGET)

    def skew_row(name: str, stream, launch):
        if skew_meter is not None:
            tab.add(f"  {name}: launch skew" + ("" if data["one_gpu"] else " (clocks of several GPUs)"),
                    skew_meter(comm, stream, launch), "us", "report", None)

    idx, x, w, n = data["idx"], data["x"], data["w"], data["n"]
    # ---- get_dispatch_layout
    t, tg = loop(lambda: c.get_dispatch_layout(idx, EXPERTS)), kernel_target(20)
    tab.add(f"get_dispatch_layout, {n} tokens", t, "us", *tg)
    if gpu:
        stream = cp.cuda.Stream(non_blocking=True)
        with stream:
            c.get_dispatch_layout(idx, EXPERTS)
            stream.synchronize()
        g_lay, _ = _capture(stream, lambda: c.get_dispatch_layout(idx, EXPERTS))
        with stream:
            tab.add("  get_dispatch_layout kernel (graph replay)", loop(lambda: g_lay.launch(stream)), "us", "report")
        tab.add("  get_dispatch_layout host time per call",
                _host_issue_us(lambda: c.get_dispatch_layout(idx, EXPERTS), comm, c.synchronize), "us", "report")
        c.synchronize()

    # ---- dispatch / combine at n tokens
    out = c.dispatch(x, idx, w, EXPERTS)
    recv_x, _, recv_w, _, h = out
    t_new = loop(lambda: c.dispatch(x, idx, w, EXPERTS))
    t_cached = loop(lambda: c.dispatch(x, handle=h))
    tab.add(f"dispatch without handle, {n} tokens", t_new, "us", "report")
    tab.add(f"dispatch with cached handle, {n} tokens", t_cached, "us", "report")
    tab.add(f"  ratio dispatch without / with handle, {n} tokens", t_new / t_cached, "x", "<= 1.25",
            lambda v: v <= 1.25)
    t_comb = loop(lambda: c.combine(recv_x, h, recv_w))
    tab.add(f"combine, {n} tokens", t_comb, "us", "report")
    tab.add(f"  ratio combine / cached dispatch, {n} tokens", t_comb / t_cached, "x", "<= 1.05",
            lambda v: v <= 1.05)
    out = recv_x = recv_w = h = None  # free the n-token buffers

    # ---- decode batch: 128 tokens, eager, cached, and replayed in graphs (worst-case mode)
    s = DECODE
    idx_s, x_s, w_s = data["idx_s"], data["x_s"], data["w_s"]
    t = loop(lambda: c.dispatch(x_s, idx_s, w_s, EXPERTS))
    tab.add(f"dispatch without handle, {s} tokens (eager)", t, "us", *kernel_target(60))
    eager = c.dispatch(x_s, idx_s, w_s, EXPERTS)
    h_s = eager[4]
    c.synchronize()
    cached, comb = lambda: c.dispatch(x_s, handle=h_s), lambda: c.combine(eager[0], h_s, eager[2])  # noqa: E731
    tab.add(f"dispatch with cached handle, {s} tokens, host time per call",
            _host_issue_us(cached, comm, c.synchronize), "us", "<= 15", lambda v: v <= 15)
    tab.add(f"combine, {s} tokens, host time per call",
            _host_issue_us(comb, comm, c.synchronize), "us", "<= 15", lambda v: v <= 15)
    if gpu:
        tab.add(f"  dispatch with cached handle, {s} tokens, host time back to back", _host_stream_us(cached, comm),
                "us", "report")
        c.synchronize()
        tab.add(f"  combine, {s} tokens, host time back to back", _host_stream_us(comb, comm), "us", "report")
        c.synchronize()
    tab.add(f"combine, {s} tokens (eager)", loop(lambda: c.combine(eager[0], h_s, eager[2])), "us", "report")
    # bytes every rank moves in the 128-token calls (its own rows included), summed over ranks
    sent_rows = comm.allreduce(int(np.asarray(h_s.send_counts).sum()), op=MPI.SUM)
    disp_bytes = sent_rows * (HIDDEN * 2 + TOPK * 8 + TOPK * 4)
    comb_bytes = sent_rows * (HIDDEN * 2 + TOPK * 4)
    if gpu:
        worst = s * W
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
            td = tab.add(f"dispatch, {s} tokens, CUDA graph replay", loop(lambda: g_disp.launch(stream)), "us",
                         *kernel_target(15))
            tc = tab.add(f"combine, {s} tokens, CUDA graph replay", loop(lambda: g_comb.launch(stream)), "us",
                         *kernel_target(15))
        floor_row(f"dispatch, {s} tokens, graph", td, disp_bytes)
        floor_row(f"combine, {s} tokens, graph", tc, comb_bytes)
        skew_row(f"dispatch, {s} tokens, graph", stream, lambda: g_disp.launch(stream))
        c.synchronize()
    if getattr(args, "profile", False) and not data.get("profiled"):  # (the first pass only)
        data["profiled"] = True
        _profile(c, comm, f"dispatch without handle, {s} tokens", lambda: c.dispatch(x_s, idx_s, w_s, EXPERTS))
        _profile(c, comm, f"dispatch with cached handle, {s} tokens", lambda: c.dispatch(x_s, handle=h_s))
        _profile(c, comm, f"combine, {s} tokens", lambda: c.combine(eager[0], h_s, eager[2]))
        _profile(c, comm, "alltoall 64 KiB", lambda: c.alltoall(data["a64"]))
    eager = h_s = None

    # ---- low-latency mode
    try:
        from .low_latency import bench_low_latency
        ll = bench_low_latency(c, num_tokens=s, hidden=HIDDEN, num_experts=EXPERTS, topk=TOPK, iters=iters,
                               warmup=warm, graph=gpu)
        ll_bytes = {"dispatch": comm.allreduce(ll["bytes_dispatch"], op=MPI.SUM),
                    "combine": comm.allreduce(ll["bytes_combine"], op=MPI.SUM)}
        for k in ("dispatch_us", "combine_us", "dispatch_host_us", "combine_host_us", "dispatch_graph_us",
                  "combine_graph_us"):
            if ll.get(k) is None:
                continue
            name = f"low-latency {k[:-3].replace('_', ' ')}, {s} tokens bf16"
            if k.endswith("graph_us"):
                v = tab.add(name, ll[k], "us", *kernel_target(15))
                floor_row(name, v, ll_bytes[k.split("_")[0]])
            else:
                tab.add(name, ll[k], "us", "report")
    except Exception as exc:  # noqa: BLE001 - report and go on with the rows that work
        if c.rank == 0:
            print(f"# low-latency rows skipped: {type(exc).__name__}: {exc}")

    # ---- alltoall: host issue time (64 KiB), graph replay host time, 1 MiB loop
    a64 = data["a64"]
    for _ in range(warm):
        c.alltoall(a64)
    c.synchronize()
    a2a = lambda: c.alltoall(a64)  # noqa: E731
    tab.add("alltoall 64 KiB, host time to issue one call", _host_issue_us(a2a, comm, c.synchronize), "us", "<= 9",
            lambda v: v <= 9)
    if gpu:
        tab.add("  alltoall 64 KiB, host time back to back", _host_stream_us(a2a, comm), "us", "report")
    c.synchronize()
    if gpu:
        stream = cp.cuda.Stream(non_blocking=True)
        with stream:
            c.alltoall(a64)
            stream.synchronize()
        g_a2a, _ = _capture(stream, lambda: c.alltoall(a64))
        with stream:
            tab.add("alltoall 64 KiB, host time per graph replay",
                    _host_issue_us(lambda: g_a2a.launch(stream), comm, stream.synchronize), "us", "<= 3",
                    lambda v: v <= 3)
            stream.synchronize()
            tab.add("  alltoall 64 KiB, graph replay", loop(lambda: g_a2a.launch(stream)), "us", "report")
        skew_row("alltoall 64 KiB, graph", stream, lambda: g_a2a.launch(stream))
        c.synchronize()
    a1m = data["a1m"]
    t = tab.add("alltoall 1 MiB per rank, loop", loop(lambda: c.alltoall(a1m)), "us", *kernel_target(10))
    floor_row("alltoall 1 MiB per rank", t, W * a1m.nbytes)
    return tab.rows


def run(c, comm, timer, args) -> list:
    """Print the table (rank 0) and return its rows ``(name, median value, target)``; ``args.repeat`` passes."""
    xp = c.xp
    me, W = c.rank, c.world_size
    repeat = max(1, int(getattr(args, "repeat", 1) or 1))
    rng = np.random.default_rng([me, 10])
    n = args.tokens
    idx = xp.asarray(_routing(rng, n, EXPERTS, TOPK))
    x = xp.asarray(rng.standard_normal((n, HIDDEN)).astype(np.float16))
    w = xp.asarray(rng.uniform(0.1, 1, (n, TOPK)).astype(np.float32))
    s = min(DECODE, n)
    data = {"n": n, "idx": idx, "x": x, "w": w, "idx_s": idx[:s].copy(), "x_s": x[:s].copy(), "w_s": w[:s].copy(),
            "a64": xp.asarray(np.random.default_rng(me).integers(0, 255, (W, (64 << 10) // W), dtype=np.uint8)),
            "a1m": xp.asarray(np.random.default_rng(me).integers(0, 255, (W, (1 << 20) // W), dtype=np.uint8)),
            "rate": None, "one_gpu": True}
    skew = None
    if c.backend == "cuda":
        cp = _compat.cupy
        try:  # the ranks share one clock only on one GPU (several GPUs: reported with that caveat)
            uuid = cp.cuda.Device().pci_bus_id
            data["one_gpu"] = len(set(comm.allgather(uuid))) == 1
        except Exception:  # noqa: BLE001 - a caveat in a row name, never a failure
            data["one_gpu"] = False
        try:
            skew = _Skew(cp)
        except Exception as exc:  # noqa: BLE001 - the skew rows are optional
            if me == 0:
                print(f"# launch skew rows skipped: {type(exc).__name__}: {exc}")
    try:
        data["rate"] = _copy_rate(comm, xp, timer, max(5, args.iters // 2), max(1, args.warmup))
    except Exception as exc:  # noqa: BLE001 - the floor rows are optional
        if me == 0:
            print(f"# copy rate not measured ({type(exc).__name__}: {exc}): no HBM floor rows")
    if me == 0:
        rate = "" if data["rate"] is None else f"; copy rate {data['rate'] / 1e9:.0f} GB/s (all ranks, {COPY_BYTES >> 20} MiB each)"
        print(f"# control path: {n} tokens x {HIDDEN} float16, top-{TOPK} of {EXPERTS} experts, world_size {W}, "
              f"loop timing over {args.iters} calls (max over ranks), {repeat} pass(es), medians{rate}", flush=True)
        small = c.layout.small_peer_bytes if c.backend == "cuda" else 0
        way = {True: "by it", False: "rings"}
        print("# alltoall rows: " + (f"small-message protocol up to {small} B per peer (Config.small_bytes = "
                                     f"{c.layout.small_bytes}): 64 KiB row {way[(64 << 10) // W <= small]}, "
                                     f"1 MiB row {way[(1 << 20) // W <= small]}" if small else
                                     "through the rings (small-message protocol off)"), flush=True)
    passes = []
    for r in range(repeat):
        passes.append(_pass(c, comm, timer, args, data, skew))
        if me == 0 and repeat > 1:
            print(f"# pass {r + 1} of {repeat} done", flush=True)
    out = []
    missed = 0
    for i, (name, _, unit, target, check) in enumerate(passes[0]):
        vals = [p[i][1] for p in passes if i < len(p) and p[i][0] == name]
        v = float(np.median(vals))
        verdict = "" if check is None else ("  ok" if check(v) else "  MISSED")
        missed += check is not None and not check(v)
        spread = f"  [{min(vals):.1f}-{max(vals):.1f} over {len(vals)}]" if len(vals) > 1 else ""
        if me == 0:
            print(f"{name:<60} {v:10.1f} {unit:<2}   target {target}{verdict}{spread}", flush=True)
        out.append((name, v, target))
    if me == 0:
        print(f"# {sum(r[4] is not None for r in passes[0])} rows with a target at world_size {W}, {missed} missed")
    return out
