"""Channel telemetry on the GPU (``.ci/device.sh trace``): N ranks under MPS with Config(trace=True) run a
deliberately skewed alltoallv (every rank sends rank 0 ten times the rows) and a MoE dispatch / combine whose routing
favours rank 0's experts, each checked against NumPy; every rank saves its trace, rank 0 runs the diagnostics CLI
(PNGs + report into $TRACE_DIR/diag, default /tmp/symbuf_trace) and prints the report. Then the cost of tracing: alltoall loop time with trace off and
on, same sizes, same process.

    mpirun -n 4 -x CUDA_VISIBLE_DEVICES=0 python3 tests/device/channel_trace.py

With CUPY_SYMBUF_TRACE_ADAPTIVE=1 the communicators use the work-sharing ring kernel (Config(adaptive=True)).
"""
import os
import time

import cupy as cp
import numpy as np
from mpi4py import MPI

import cupy_symbuf as cs
from cupy_symbuf import diagnostics
from cupy_symbuf.utils import select_device

world = MPI.COMM_WORLD
W, me = world.Get_size(), world.Get_rank()
select_device(world)
out_dir = os.environ.get("TRACE_DIR", "/tmp/symbuf_trace")
os.makedirs(out_dir, exist_ok=True)
rng = np.random.default_rng([me, 11])
bad = 0
ADAPTIVE = os.environ.get("CUPY_SYMBUF_TRACE_ADAPTIVE", "0") == "1"  # the work-sharing build traced
with cs.Communicator(world, cs.Config(trace=True, adaptive=ADAPTIVE, adaptive_interval=2)) as c:
    for it in range(6):
        counts = rng.integers(2000, 4000, W)
        counts[0] *= 10                                   # rank 0 is hot
        x = rng.integers(0, 2**31, (int(counts.sum()), 256), dtype=np.int64).astype(np.int32)
        got, rc = c.alltoallv(cp.asarray(x), counts)
        allx = world.allgather((x, counts))
        want = np.concatenate([a[np.concatenate([[0], np.cumsum(n)])[me]:np.concatenate([[0], np.cumsum(n)])[me + 1]]
                               for a, n in allx])
        bad += int(not np.array_equal(got.get(), want))
    E, K, H, T = 8 * W, 4, 2048, 1024
    p = np.ones(E)
    p[: E // W] = 8.0                                     # rank 0's experts are 8x as popular
    idx = np.stack([rng.choice(E, K, replace=False, p=p / p.sum()) for _ in range(T)]).astype(np.int64)
    xt = rng.integers(-64, 64, (T, H)).astype(np.float32)  # integers: the combine's float32 sums are exact
    for it in range(3):
        rx, _, _, _, h = c.dispatch(cp.asarray(xt), cp.asarray(idx), None, E)
        y, _ = c.combine(rx, h)
        reached = np.zeros((T, W), bool)
        np.put_along_axis(reached, idx // (E // W), True, axis=1)
        bad += int(not np.array_equal(y.get(), xt * reached.sum(1, keepdims=True)))
    c.synchronize()
    rec = c.trace()
    path = c.save_trace(os.path.join(out_dir, "trace_rank{rank}.npz"))
    transport = c.engine.transport if hasattr(c, "engine") else c._transport
    print(f"rank {me}: {len(rec)} events ({transport.trace.dropped} dropped), kinds "
          f"{np.bincount(rec['kind'], minlength=4).tolist()}, wrong results {bad}", flush=True)
world.Barrier()
if me == 0:
    diagnostics.main([os.path.join(out_dir, "trace_rank*.npz"), "--out", os.path.join(out_dir, "diag")])
    print(open(os.path.join(out_dir, "diag", "report.txt")).read(), flush=True)
# the cost of tracing: the same alltoall loop with trace off and on
for size in (1 << 20, 16 << 20):
    res = {}
    for trace in (False, True, False, True):
        with cs.Communicator(world, cs.Config(trace=trace)) as c:
            x = cp.asarray(rng.integers(0, 255, (W, size // W), dtype=np.uint8))
            for _ in range(5):
                c.alltoall(x)
            c.synchronize()
            world.Barrier()
            t0 = time.perf_counter()
            for _ in range(50):
                c.alltoall(x)
            c.synchronize()
            dt = world.allreduce((time.perf_counter() - t0) / 50, op=MPI.MAX)
            res.setdefault(trace, []).append(dt * 1e6)
    if me == 0:
        print(f"alltoall {size >> 20} MiB per rank, loop us: trace off {min(res[False]):.1f}, on {min(res[True]):.1f}"
              f" (best of 2 each)", flush=True)
if world.allreduce(bad) and me == 0:
    raise SystemExit("wrong results")
