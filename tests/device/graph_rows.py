"""The four 128-token graph rows of ``bench --control`` alone, for an A/B of kernel builds in one device call
(``tests/device/graph_rows.sh`` runs this once per build, builds interleaved, and prints the medians):

* ``dispatch`` / ``combine`` at 128 tokens replayed from CUDA graphs, worst-case mode (``num_worst_tokens`` =
  128 x world size): the graph of dispatch is the layout kernel, the count exchange, the ring exchange and the
  receive fix-up; that of combine the ring exchange and the reduction. Loop timing (CUDA events around ROWS_ITERS
  replays back to back after one barrier, us per replay, max over ranks), the launch skew of the dispatch graph as
  ``bench --control`` measures it, and the graph-replayed dispatch / combine checked against the eager ones. Then
  the same dispatch graph into a symmetric ``out`` (MODE_PUSH: x's rows written by the peers straight into it, one
  copy; not a row of ``bench --control``: what a single-copy path would give).
* the low-latency dispatch / combine (``bench_low_latency``: 10 calls captured a graph, replayed), with the
  kernels' phase ends (``profile``: us from the earliest block start of any rank).
* a regression guard for the ring kernel's large rows: a cached ``dispatch`` and a ``combine`` at 4096 tokens, loop
  timing (ROWS_BIG_ITERS calls; 0: skipped).

Inputs as ``bench --control``: 7168 hidden float16 (low-latency: bfloat16), top-8 of 256 experts, random routing.
The eager ``combine(dispatch(x))`` at 128 and 4096 tokens is checked against NumPy first (x times the number of ranks
each token went to; the weights' sum is the weights) and the graph replays against the eager calls; the
low-latency rows are timed only (their correctness: ``tests/test_low_latency*.py``, ``graph_rows.sh test``).
Prints one ``row: <name> <us>`` line per row (rank 0) and the build's defines (``CUPY_SYMBUF_NVRTC_DEFINES``) and
ring-kernel registers first.

    mpirun -n 2 python3 tests/device/graph_rows.py            (ranks on one GPU under MPS)
"""
import os

import cupy as cp
import numpy as np
from mpi4py import MPI

from cupy_symbuf import Communicator
from cupy_symbuf.bench.control import EXPERTS, HIDDEN, TOPK, _capture, _routing, _Skew
from cupy_symbuf.bench.driver import _Timer
from cupy_symbuf.bench.low_latency import bench_low_latency
from cupy_symbuf.utils import select_device

ITERS = int(os.environ.get("ROWS_ITERS", "200"))
BIG_ITERS = int(os.environ.get("ROWS_BIG_ITERS", "20"))
TOKENS = 128

world = MPI.COMM_WORLD
me = world.Get_rank()
select_device(world)
timer = _Timer("cuda")


def say(text: str) -> None:
    if me == 0:
        print(text, flush=True)


def row(name: str, us: float) -> None:
    say(f"row: {name:<44} {us:9.2f}")


def check_combined(what: str, x, idx, w, combined, wsum) -> None:
    """NumPy reference of combine(dispatch(x)): every rank returns its copy of row t unchanged, so the float32 sum
    rounded once is x[t] times the number of ranks t went to (exact in float16 here), and the weights' sum is w (each
    slot's weight kept on the one rank holding its expert, zero elsewhere). Collective: every rank's verdict."""
    ranks = idx.get() // (EXPERTS // world.Get_size())
    hits = np.stack([(ranks == r).any(axis=1) for r in range(world.Get_size())], axis=1).sum(axis=1)
    want = (x.get().astype(np.float32) * hits[:, None]).astype(np.float16)
    ok = np.array_equal(combined.get().view(np.uint16), want.view(np.uint16)) and np.array_equal(wsum.get(), w.get())
    if not world.allreduce(bool(ok), op=MPI.LAND):
        raise SystemExit(f"graph_rows: combine(dispatch(x)) differs from the NumPy reference ({what})")


with Communicator(world, backend="cuda") as c:
    W = c.world_size
    k = c.engine.transport.ring_kernel
    say(f"# defines: {os.environ.get('CUPY_SYMBUF_NVRTC_DEFINES', '') or '(none)'}; world {W}; ring kernel "
        f"{k.num_regs} registers, {k.local_size_bytes} B local; num_sms {c.config.num_sms}, chunk_bytes "
        f"{c.config.chunk_bytes}, num_slots {c.config.num_slots}")
    rng = np.random.default_rng([me, 10])
    idx = cp.asarray(_routing(rng, TOKENS, EXPERTS, TOPK))
    x = cp.asarray(rng.standard_normal((TOKENS, HIDDEN)).astype(np.float16))
    w = cp.asarray(rng.uniform(0.1, 1, (TOKENS, TOPK)).astype(np.float32))
    eager = c.dispatch(x, idx, w, EXPERTS)
    e_comb, e_wsum = c.combine(eager[0], eager[4], eager[2])
    c.synchronize()
    check_combined(f"{TOKENS} tokens, eager", x, idx, w, e_comb, e_wsum)
    worst = TOKENS * W
    stream = cp.cuda.Stream(non_blocking=True)

    def dispatch_graph(what: str, **kw):
        """A worst-case dispatch captured in a graph after an eager warm-up, replayed once and checked against the
        eager dispatch (recv_x and recv_w rows): ``(graph, outputs)``."""
        with stream:
            c.dispatch(x, idx, w, EXPERTS, num_worst_tokens=worst, **kw)
            stream.synchronize()
        graph, out = _capture(stream, lambda: c.dispatch(x, idx, w, EXPERTS, num_worst_tokens=worst, **kw))
        graph.launch(stream)  # (bench --control's order: the dispatch replayed once, then the combine captured)
        stream.synchronize()
        c.synchronize()
        n_real = int(out[4].num_recv_tokens_device)
        ok = n_real == eager[0].shape[0] and bool((out[0][:n_real] == eager[0]).all()) and \
            bool((out[2][:n_real] == eager[2]).all())
        if not world.allreduce(ok, op=MPI.LAND):
            raise SystemExit(f"graph_rows: the graph-replayed dispatch {what}differs from the eager one")
        return graph, out

    g_disp, out_g = dispatch_graph("")
    with stream:
        g_comb, comb_g = _capture(stream, lambda: c.combine(out_g[0], out_g[4], out_g[2]))
        g_comb.launch(stream)
        stream.synchronize()
    c.synchronize()
    ok = bool((comb_g[0] == e_comb).all()) and bool((comb_g[1] == e_wsum).all())
    if not world.allreduce(ok, op=MPI.LAND):
        raise SystemExit("graph_rows: the graph-replayed combine differs from the eager one")
    with stream:
        td = timer.time_loop(lambda: g_disp.launch(stream), ITERS, 10, world, c.synchronize) * 1e6
        tc = timer.time_loop(lambda: g_comb.launch(stream), ITERS, 10, world, c.synchronize) * 1e6
    row(f"dispatch, {TOKENS} tokens, graph replay", td)
    row(f"combine, {TOKENS} tokens, graph replay", tc)
    row("  dispatch graph: launch skew", _Skew(cp)(world, stream, lambda: g_disp.launch(stream)))
    c.synchronize()
    del g_disp, g_comb, out_g, comb_g
    # the same worst-case dispatch into a symmetric out (MODE_PUSH: the peers write x's rows straight into it, one
    # copy instead of two through the ring slots; top-k ids and weights still through the rings)
    try:
        g_push, out_p = dispatch_graph("into a symmetric out ", out=c.empty((worst, HIDDEN), np.float16))
        with stream:
            row(f"dispatch, {TOKENS} tokens, symmetric out, graph replay",
                timer.time_loop(lambda: g_push.launch(stream), ITERS, 10, world, c.synchronize) * 1e6)
        say(f"#   push calls on rank 0: {c.engine.transport.push_calls}")
        c.synchronize()
        del g_push, out_p
    except (ValueError, NotImplementedError, RuntimeError) as exc:  # the same on every rank: a report line
        say(f"# dispatch into a symmetric out skipped: {type(exc).__name__}: {exc}")
    del eager

    ll = bench_low_latency(c, num_tokens=TOKENS, hidden=HIDDEN, num_experts=EXPERTS, topk=TOPK, iters=50, warmup=5,
                           graph=True, host_issue=0, profile=True)
    row(f"low-latency dispatch, {TOKENS} tokens, graph replay", ll["dispatch_graph_us"])
    row(f"low-latency combine, {TOKENS} tokens, graph replay", ll["combine_graph_us"])
    say(f"#   low-latency dispatch phases (sent, flags seen, layout built, end): {ll.get('dispatch_phases_us')}, "
        f"start skew {ll.get('dispatch_start_skew_us')}")
    say(f"#   low-latency combine phases (weights seen, partials sent, partials seen, end): "
        f"{ll.get('combine_phases_us')}, start skew {ll.get('combine_start_skew_us')}")

    if BIG_ITERS:
        n = 4096
        rng = np.random.default_rng([me, 11])
        idx = cp.asarray(_routing(rng, n, EXPERTS, TOPK))
        x = cp.asarray(rng.standard_normal((n, HIDDEN)).astype(np.float16))
        w = cp.asarray(rng.uniform(0.1, 1, (n, TOPK)).astype(np.float32))
        out = c.dispatch(x, idx, w, EXPERTS)
        h = out[4]
        again = c.dispatch(x, handle=h)
        check_combined(f"{n} tokens", x, idx, w, *c.combine(out[0], h, out[2]))
        c.synchronize()
        if not world.allreduce(bool((again[0] == out[0]).all()), op=MPI.LAND):
            raise SystemExit("graph_rows: the cached dispatch at 4096 tokens differs from the first")
        row(f"dispatch with cached handle, {n} tokens, loop",
            timer.time_loop(lambda: c.dispatch(x, handle=h), BIG_ITERS, 3, world, c.synchronize) * 1e6)
        row(f"combine, {n} tokens, loop",
            timer.time_loop(lambda: c.combine(out[0], h, out[2]), BIG_ITERS, 3, world, c.synchronize) * 1e6)
