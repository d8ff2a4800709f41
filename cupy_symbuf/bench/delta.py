"""``python -m cupy_symbuf.bench --op delta [--sizes 1M,16M]``: :class:`~cupy_symbuf.DeltaExchange` against the
plain float32 ``alltoall`` of the same rows in the same run.

Each size is the float32 bytes a rank sends per step (``hidden`` 1024, ``rows`` per peer from the size); the rows
change slowly between steps (a random walk of 1% of their scale). Rows: ``plain`` (``alltoall`` of the float32
rows), ``delta`` (one step: quantise the change, the all-to-all of codes and scales, dequantise; refreshes every
100 steps included in the timed loop), loop timing (max over ranks), the bytes sent to other ranks per step and the
largest error of the receiver's copy relative to the rows' scale after the timed steps.
"""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

from .units import fmt_bytes as _fmt

from ..collectives.delta import DeltaExchange

__all__ = ["run"]

HIDDEN = 1024


def run(c, comm, timer, args, sizes) -> list:
    W, me, xp = c.world_size, c.rank, c.xp
    results = []
    if me == 0:
        print(f"{'size/rank':>10} {'engine':>8} {'loop_us':>10} {'sent_B/step':>12} {'ratio':>6} {'max_rel_err':>11}")
    for size in sizes:
        rows = max(1, size // (4 * HIDDEN * W))
        rng = np.random.default_rng([me, size])
        x = xp.asarray(rng.standard_normal((W, rows, HIDDEN)).astype(np.float32))
        step = xp.asarray((rng.standard_normal((W, rows, HIDDEN)) * 0.01).astype(np.float32))
        state = {"x": x}

        def moved():
            state["x"] = state["x"] + step
            return state["x"]
        dx = DeltaExchange(c, rows, HIDDEN)
        plain_t = timer.time_loop(lambda: c.alltoall(moved()), args.iters, args.warmup, comm, c.synchronize)
        delta_t = timer.time_loop(lambda: dx.step(moved()), args.iters, args.warmup, comm, c.synchronize)
        got = dx.step(moved())
        exact = c.alltoall(state["x"])
        err = float(xp.abs(got - exact).max() / xp.abs(exact).max())
        err = comm.allreduce(err, op=MPI.MAX)
        off = (W - 1) * rows * HIDDEN * 4
        for engine, t, sent in (("plain", plain_t, off), ("delta", delta_t, off / dx.wire_ratio if W > 1 else 0)):
            results.append({"op": "delta", "engine": engine, "size_per_rank": W * rows * HIDDEN * 4, "loop_us": t * 1e6,
                            "sent_bytes_per_step": sent, "max_rel_err": err if engine == "delta" else 0.0,
                            "world_size": W, "backend": c.backend})
            if me == 0:
                ratio = off / sent if sent else float("nan")
                print(f"{_fmt(W * rows * HIDDEN * 4):>10} {engine:>8} {t * 1e6:10.1f} {sent:12.0f} {ratio:6.2f} "
                      f"{(err if engine == 'delta' else 0.0):11.2e}")
    return results
