"""``python -m cupy_symbuf.bench --backend host --op latency [--sizes 64K,1M] [--iters 300] [--profile]``: the
small-message host rows, every one beside MPI's time for the same traffic, the ratio and its target.

Rows per per-rank size (NumPy arrays, host backend):

* ``alltoall``: ``Communicator.alltoall(x)`` (a fresh output per call) against ``MPI.Comm.Alltoall`` into a
  preallocated array; ``alltoall out=`` (the output reused) beside it;
* ``alltoallv recv_counts``: ``alltoallv(x, counts, recv_counts=..., out=...)`` (a cached layout: no count
  exchange) against ``MPI.Comm.Alltoallv``;
* ``alltoallv count exchange``: ``alltoallv(x, counts)`` (the counts exchanged first, a fresh output) against
  ``MPI.Comm.Alltoall`` of the counts followed by ``MPI.Comm.Alltoallv`` (what an MPI program does without
  known counts).

alltoallv rows: uniform counts of ``ROW_BYTES``-byte rows (every rank sends ``size / world_size`` bytes to every
rank). Every call of ours is checked once against the NumPy reference before timing. Timing: each call alone
after a barrier (``time.perf_counter`` around it), ours and MPI's interleaved call by call (so that load from
other processes on a shared machine falls on both alike), ``--iters`` calls each after ``--warmup``; a row's time
is the median over calls of each rank, then the maximum over ranks. ``--profile``: rank 0 prints cProfile's top
functions of 200 calls of each of our rows (us per call, profiler overhead included).
"""
from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI

from .profiling import profile_calls, top_functions
from .units import fmt_bytes as _fmt

__all__ = ["run", "TARGETS", "ROW_BYTES"]

ROW_BYTES = 64
#: (row, per-rank bytes) -> the target ratio ours / MPI
TARGETS = {("alltoall", 64 << 10): 2.0, ("alltoall", 1 << 20): 1.3,
           ("alltoallv recv_counts", 64 << 10): 2.0, ("alltoallv recv_counts", 1 << 20): 1.3,
           ("alltoallv count exchange", 64 << 10): 2.0}


def _interleaved(fns: dict, iters: int, warmup: int, comm) -> dict:
    """name -> seconds of one call after a barrier: the median over ``iters`` calls on each rank, the maximum over
    ranks. The functions take turns call by call."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    local = {k: np.empty(iters) for k in fns}
    barrier, clock = comm.Barrier, time.perf_counter
    for i in range(iters):
        for k, fn in fns.items():
            barrier()
            t0 = clock()
            fn()
            local[k][i] = clock() - t0
    return {k: comm.allreduce(float(np.median(v)), op=MPI.MAX) for k, v in local.items()}


def _profile(comm, what: str, fn, n: int = 200) -> None:
    comm.Barrier()
    stats = profile_calls(fn, n)
    comm.Barrier()
    if comm.Get_rank() == 0:
        print(f"# profile of {n} calls of {what} (rank 0; self_us / total_us / calls per call)")
        for self_us, total_us, per_call, where in top_functions(stats, n, 18):
            print(f"#  {self_us:8.1f} {total_us:8.1f} {per_call:5.1f}  {where}")


def _check(comm, what: str, got, want) -> None:
    if not comm.allreduce(bool(np.array_equal(got, want)), op=MPI.LAND):
        raise RuntimeError(f"bench --op latency: {what} gave wrong data; not timing it")


def run(c, comm, timer, args, sizes) -> list:
    """Print and return one dict per row (``row``, ``size_per_rank``, ``ours_us``, ``mpi_us``, ``ratio``,
    ``target``)."""
    if c.backend != "host":
        raise ValueError("bench --op latency: the host rows need --backend host (GPU rows: --control)")
    W, me = c.world_size, c.rank
    iters, warm = args.iters, args.warmup
    out_rows = []
    if me == 0:
        print(f"# host rows: world_size {W}, each call alone after a barrier, ours and MPI interleaved, median of "
              f"{iters} calls per rank, max over ranks")
        print(f"{'row':<34} {'size/rank':>9} {'ours_us':>9} {'mpi_us':>9} {'ratio':>7} {'target':>7}")

    def report(row, size, ours, mpi):
        ratio = ours / mpi
        tgt = TARGETS.get((row, size))
        out_rows.append({"row": row, "size_per_rank": size, "ours_us": ours * 1e6, "mpi_us": mpi * 1e6,
                         "ratio": ratio, "target": tgt, "world_size": W, "backend": "host"})
        if me == 0:
            mark = "" if tgt is None else ("  ok" if ratio <= tgt else "  MISSED")
            print(f"{row:<34} {_fmt(size):>9} {ours * 1e6:9.1f} {mpi * 1e6:9.1f} {ratio:6.2f}x "
                  f"{'-' if tgt is None else f'<= {tgt}':>7}{mark}", flush=True)

    profiles = []
    for size in sizes:
        # alltoall: equal blocks of size / W bytes
        per_peer = max(1, size // W)
        x = np.random.default_rng([me, size, 1]).integers(0, 255, (W, per_peer), dtype=np.uint8)
        want = np.stack([np.random.default_rng([j, size, 1]).integers(0, 255, (W, per_peer), dtype=np.uint8)[me]
                         for j in range(W)])
        _check(comm, f"alltoall of {_fmt(size)}", c.alltoall(x), want)
        y, yo = np.empty_like(x), np.empty_like(x)
        t = _interleaved({"ours": lambda: c.alltoall(x), "out": lambda: c.alltoall(x, out=yo),
                          "mpi": lambda: comm.Alltoall(x, y)}, iters, warm, comm)
        _check(comm, f"alltoall of {_fmt(size)} (out=)", yo, want)
        report("alltoall", size, t["ours"], t["mpi"])
        report("alltoall out=", size, t["out"], t["mpi"])
        profiles.append((f"alltoall {_fmt(size)}", lambda x=x: c.alltoall(x)))

        # alltoallv: uniform counts of ROW_BYTES-byte rows
        rows = max(W, size // ROW_BYTES)
        counts = np.full(W, rows // W, np.int64)
        counts[me] += rows - int(counts.sum())
        everyone = comm.allgather(counts)
        recv_counts = np.array([everyone[j][me] for j in range(W)], np.int64)
        xv = np.random.default_rng([me, size, 2]).integers(0, 255, (int(counts.sum()), ROW_BYTES), dtype=np.uint8)
        parts = [np.random.default_rng([j, size, 2]).integers(0, 255, (int(everyone[j].sum()), ROW_BYTES),
                                                              dtype=np.uint8) for j in range(W)]
        wantv = np.concatenate([parts[j][int(everyone[j][:me].sum()):][: everyone[j][me]] for j in range(W)])
        got, got_counts = c.alltoallv(xv, counts)
        _check(comm, f"alltoallv of {_fmt(size)} (count exchange)", got, wantv)
        _check(comm, f"alltoallv of {_fmt(size)} (counts)", got_counts, recv_counts)
        outv = np.empty_like(wantv)
        sdisp = np.concatenate([[0], np.cumsum(counts)[:-1]]) * ROW_BYTES
        rdisp = np.concatenate([[0], np.cumsum(recv_counts)[:-1]]) * ROW_BYTES
        ybuf = np.empty(int(recv_counts.sum()) * ROW_BYTES, np.uint8)
        sspec = [xv.reshape(-1), (counts * ROW_BYTES, sdisp), MPI.BYTE]
        rspec = [ybuf, (recv_counts * ROW_BYTES, rdisp), MPI.BYTE]
        rc_buf = np.empty(W, np.int64)

        def mpi_with_counts():  # what an MPI program does when it does not know the counts
            comm.Alltoall(counts, rc_buf)
            rd = np.empty(W, np.int64)
            rd[0] = 0
            np.cumsum(rc_buf[:-1], out=rd[1:])
            yb = np.empty(int(rc_buf.sum()) * ROW_BYTES, np.uint8)
            comm.Alltoallv(sspec, [yb, (rc_buf * ROW_BYTES, rd * ROW_BYTES), MPI.BYTE])

        t = _interleaved({"known": lambda: c.alltoallv(xv, counts, recv_counts=recv_counts, out=outv),
                          "mpi": lambda: comm.Alltoallv(sspec, rspec),
                          "exchange": lambda: c.alltoallv(xv, counts),
                          "mpi2": mpi_with_counts}, iters, warm, comm)
        _check(comm, f"alltoallv of {_fmt(size)} (recv_counts, out=)", outv, wantv)
        _check(comm, f"MPI Alltoallv of {_fmt(size)}", ybuf.reshape(-1, ROW_BYTES), wantv)
        report("alltoallv recv_counts", size, t["known"], t["mpi"])
        report("alltoallv count exchange", size, t["exchange"], t["mpi2"])
        profiles.append((f"alltoallv recv_counts {_fmt(size)}",
                         lambda xv=xv, counts=counts, rc=recv_counts, o=outv: c.alltoallv(xv, counts, recv_counts=rc,
                                                                                       out=o)))
        profiles.append((f"alltoallv count exchange {_fmt(size)}", lambda xv=xv, counts=counts: c.alltoallv(xv, counts)))
    if getattr(args, "profile", False):
        for what, fn in profiles:
            _profile(comm, what, fn)
    return out_rows
