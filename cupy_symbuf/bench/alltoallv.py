"""``python -m cupy_symbuf.bench --op alltoallv [--patterns uniform,zipf,hot]``: alltoallv with skewed traffic, p50 /
p99 latency and the reference in the same run.

Patterns (rows of ``ROW_BYTES`` bytes; every rank sends about ``size`` bytes in all):

* ``uniform``: the same number of rows to every rank;
* ``zipf``: rank ``me`` sends to rank ``(me + k) % W`` a share proportional to ``1 / (k + 1) ** 1.2``: every rank has
  its own favourite destinations (MoE routing with popular experts);
* ``hot``: half of every rank's bytes go to rank 0, the rest evenly: rank 0 receives about ``W / 2`` times its share
  (one hot expert's rank).

Every call is first checked exactly (each row carries its source, destination and index). Timings, max over ranks:
``p50`` / ``p99`` of ``--iters`` calls each after a barrier (the cross-rank maximum of each call, then the
percentile over calls: DeepEP / nccl-tests report per-call maxima), and ``loop`` (calls back to back). Reference:
``MPI.Comm.Alltoallv`` of the same NumPy arrays on the host; on GPUs, with ``--references mpi``, ``mpi-cuda``:
CUDA-aware ``MPI.Comm.Alltoallv`` of the same CuPy arrays (``cupy_symbuf.bench.mpi_cuda``; skipped with the reason
where MPI has no CUDA support).
"""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

from .units import fmt_bytes as _fmt

__all__ = ["run", "pattern_counts", "ROW_BYTES"]

ROW_BYTES = 64
PATTERNS = ("uniform", "zipf", "hot")


def pattern_counts(pattern: str, me: int, W: int, rows: int) -> np.ndarray:
    """Rows rank ``me`` sends to each rank (int64 ``[W]``, summing to ``rows``)."""
    if pattern == "uniform":
        w = np.ones(W)
    elif pattern == "zipf":
        w = np.zeros(W)
        for k in range(W):
            w[(me + k) % W] = 1.0 / (k + 1) ** 1.2
    elif pattern == "hot":
        w = np.full(W, 0.5 / max(1, W - 1)) if W > 1 else np.ones(1)
        w[0] = 0.5 if W > 1 else 1.0
    else:
        raise ValueError(f"--patterns: unknown pattern {pattern!r}; known: {', '.join(PATTERNS)}")
    counts = np.floor(w / w.sum() * rows).astype(np.int64)
    counts[int(np.argmax(w))] += rows - int(counts.sum())
    return counts


def _rows(src: int, counts: np.ndarray) -> np.ndarray:
    """uint8 ``[sum(counts), ROW_BYTES]``: row ``i`` to rank ``d`` holds bytes of (src, d, i) (exact check)."""
    out = np.empty((int(counts.sum()), ROW_BYTES), np.uint8)
    pos = 0
    col = np.arange(ROW_BYTES, dtype=np.int64)
    for d, n in enumerate(counts):
        i = np.arange(n, dtype=np.int64)[:, None]
        out[pos: pos + n] = ((src * 131 + d * 31 + i * 7 + col) % 251).astype(np.uint8)
        pos += n
    return out


def _percentiles(timer, fn, iters, warmup, comm, sync):
    samples = timer.samples(fn, iters, warmup, comm, sync)
    return float(np.percentile(samples, 50)), float(np.percentile(samples, 99))


def run(c, comm, timer, args, sizes) -> list:
    W, me, xp = c.world_size, c.rank, c.xp
    patterns = (args.patterns or "uniform,zipf,hot").split(",")
    refs = set(r for r in str(getattr(args, "references", "")).split(",") if r)
    mpi_cuda = ""  # the mpi-cuda row: "" not asked for (or host), None runs, else why it is skipped
    if c.backend == "cuda" and not args.no_reference and "mpi" in refs:
        from . import mpi_cuda as _mpi_cuda
        mpi_cuda = _mpi_cuda.skip_reason(c, comm)
    results = []
    if me == 0:
        print(f"{'size/rank':>10} {'pattern':>8} {'engine':>8} {'p50_us':>10} {'p99_us':>10} {'loop_us':>10} "
              f"{'max_recv':>9} {'busbw_GB/s':>11}")
        if c.backend == "cuda" and mpi_cuda == "":
            print("# alltoallv reference on GPUs: --references mpi (CUDA-aware MPI Alltoallv; NCCL grouped "
                  "send/recv with counts: not built)")
        elif c.backend == "cuda" and mpi_cuda:
            print(f"# mpi-cuda: skipped: {mpi_cuda}")
    for size in sizes:
        rows = max(W, size // ROW_BYTES)
        for pattern in patterns:
            counts = pattern_counts(pattern, me, W, rows)
            everyone = comm.allgather(counts)
            recv_counts = np.array([everyone[j][me] for j in range(W)], np.int64)
            send_host = _rows(me, counts)
            x = xp.asarray(send_host)
            got, got_counts = c.alltoallv(x, counts)
            got = got.get() if hasattr(got, "get") else np.asarray(got)
            want = np.concatenate([_rows(j, everyone[j])[int(everyone[j][:me].sum()):][: everyone[j][me]]
                                   for j in range(W)])
            ok = np.array_equal(got_counts, recv_counts) and np.array_equal(got, want)
            if not comm.allreduce(bool(ok), op=MPI.LAND):
                raise RuntimeError(f"bench: alltoallv {pattern} of {_fmt(size)} per rank gave wrong data; not timing")
            out = xp.empty((int(recv_counts.sum()), ROW_BYTES), np.uint8)
            engines = {"ours": lambda: c.alltoallv(x, counts, recv_counts=recv_counts, out=out)}
            if c.backend == "host" and not args.no_reference:
                sdisp = np.concatenate([[0], np.cumsum(counts)[:-1]]) * ROW_BYTES
                rdisp = np.concatenate([[0], np.cumsum(recv_counts)[:-1]]) * ROW_BYTES
                ybuf = np.empty(int(recv_counts.sum()) * ROW_BYTES, np.uint8)
                sflat = send_host.reshape(-1)
                sspec = [sflat, (counts * ROW_BYTES, sdisp), MPI.BYTE]
                rspec = [ybuf, (recv_counts * ROW_BYTES, rdisp), MPI.BYTE]
                engines["mpi"] = lambda: comm.Alltoallv(sspec, rspec)
            if mpi_cuda is None:
                from . import mpi_cuda as _mpi_cuda
                engines["mpi-cuda"] = _mpi_cuda.alltoallv_fn(comm, x, counts, recv_counts, ROW_BYTES, want)
            max_recv = comm.allreduce(int(recv_counts.sum()), op=MPI.MAX)
            off_rank = comm.allreduce(int(counts.sum() - counts[me]), op=MPI.MAX)  # the busiest sender's bytes
            for engine, fn in engines.items():
                p50, p99 = _percentiles(timer, fn, args.iters, args.warmup, comm, c.synchronize)
                loop = timer.time_loop(fn, args.iters, args.warmup, comm, c.synchronize)
                busbw = off_rank * ROW_BYTES / loop / 1e9
                results.append({"op": "alltoallv", "pattern": pattern, "engine": engine, "size_per_rank": size,
                                "p50_us": p50 * 1e6, "p99_us": p99 * 1e6, "loop_us": loop * 1e6,
                                "max_recv_rows_over_mean": max_recv / rows, "busbw_GBps": busbw, "world_size": W,
                                "backend": c.backend})
                if me == 0:
                    print(f"{_fmt(size):>10} {pattern:>8} {engine:>8} {p50 * 1e6:10.1f} {p99 * 1e6:10.1f} "
                          f"{loop * 1e6:10.1f} {max_recv / rows:8.2f}x {busbw:11.2f}")
    return results
