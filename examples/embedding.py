"""A sharded embedding lookup over ``Communicator.alltoallv``, checked bitwise against a single-table NumPy lookup,
with the share of the step spent communicating, ours and the peer baseline.

Run::

    mpiexec -n 4 python examples/embedding.py                  # host: 100 000 x 64 float32 table, 8192 ids/rank
    mpiexec -n 3 python examples/embedding.py --rows 1001      # uneven row blocks
    mpiexec -n 2 python examples/embedding.py --zipf 1.2       # skewed ids: the owner of the hot rows is hot
    mpirun -n 8 python examples/embedding.py --backend cuda    # GPU: 1 Mi x 128 float32 table, 65 536 ids/rank

The table, ``[rows, dim]`` of ``--dtype`` (float32 or float16), is reproducible from ``--seed`` on every rank
(``table(seed, rows, dim, dtype)``); rank ``r`` keeps the contiguous row block ``[bounds[r], bounds[r + 1])`` with
``bounds[r] = r * rows // world_size`` (blocks differ by at most one row). Every rank draws its own batch of
``--batch`` int64 ids in ``[0, rows)`` (uniform, or Zipf-skewed towards low ids with ``--zipf A``).

One step (what is timed):

1. route: ``owner = searchsorted(bounds[:-1], ids, "right") - 1``; the ids are grouped by owner
   (``order = argsort(owner)``) and ``send_counts = bincount(owner)`` (ids per destination rank, read on the host);
2. ``alltoallv(ids[order], send_counts)``: the ids reach their owners, ``recv_counts`` (ids from each source) come
   back from the count exchange;
3. gather: each owner takes ``shard[recv_ids - bounds[rank]]``, ``[sum(recv_counts), dim]``;
4. ``alltoallv(rows, recv_counts, recv_counts=send_counts)``: the rows go back to the requesters (the counts are
   known, so no count exchange);
5. un-route: ``out[order] = back``: the rows in batch order, ``[batch, dim]``.

Check: ``out`` must equal ``table[ids]`` bit for bit (NumPy, on the host) on every rank; exit status 1 otherwise.

Communication share: per rank, the time in steps 2 and 4 over the time of the whole step (means over ``--iters``
timed steps after ``--warmup``; each step starts after a barrier and the engines take turns step by step; on GPUs a
device synchronize closes every section, so a section is the time the device needed). The time in a collective
includes waiting for slower peers. The peer baseline does the same step on the same arrays: on the host
``MPI.Comm.Alltoall`` of the counts plus two ``MPI.Comm.Alltoallv`` (mpi4py buffer specs with counts and
displacements, one row as an MPI contiguous datatype); on GPUs NCCL grouped send/recv through CuPy (counts by
``MPI.Alltoall`` on the host), skipped with the reason
printed where it cannot run (ranks sharing a GPU, no NCCL in CuPy).
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np
from mpi4py import MPI

import cupy_symbuf as cs
from cupy_symbuf.utils import select_device

WORLD = MPI.COMM_WORLD
HOST_DEFAULTS = dict(rows=100_000, dim=64, batch=8192)
GPU_DEFAULTS = dict(rows=1 << 20, dim=128, batch=65536)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=("auto", "host", "cuda"), default="auto")
    p.add_argument("--rows", type=int, help="rows of the whole table (host 100000, GPU 1048576)")
    p.add_argument("--dim", type=int, help="embedding dimension, values per row (host 64, GPU 128)")
    p.add_argument("--batch", type=int, help="ids looked up per rank per step (host 8192, GPU 65536)")
    p.add_argument("--dtype", choices=("float32", "float16"), default="float32", help="table dtype")
    p.add_argument("--zipf", type=float, default=0.0,
                   help="0: uniform ids; A > 1: ids drawn Zipf(A)-skewed towards row 0 (rank 0 owns the hot rows)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=10, help="timed steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-baseline", action="store_true", help="skip the MPI / NCCL baseline")
    p.add_argument("--corrupt", action="store_true",
                   help="(testing) change one looked-up value on the last rank after the exchange: the check must "
                        "then fail and the exit status be 1")
    args = p.parse_args(argv)
    return args


def resolve_sizes(args, backend: str, world_size: int) -> None:
    defaults = GPU_DEFAULTS if backend == "cuda" else HOST_DEFAULTS
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.rows < world_size:
        raise SystemExit(f"embedding.py: argument --rows ({args.rows}) must be >= the number of ranks ({world_size})")
    for name in ("dim", "batch"):
        if getattr(args, name) < 1:
            raise SystemExit(f"embedding.py: argument --{name} must be >= 1, got {getattr(args, name)}")
    if args.iters < 1 or args.warmup < 0:
        raise SystemExit(f"embedding.py: arguments --iters (>= 1) and --warmup (>= 0) got {args.iters}, "
                         f"{args.warmup}")
    if args.zipf != 0.0 and args.zipf <= 1.0:
        raise SystemExit(f"embedding.py: argument --zipf must be 0 (uniform) or > 1, got {args.zipf}")


def table(seed: int, rows: int, dim: int, dtype) -> np.ndarray:
    """The whole table, ``[rows, dim]`` of ``dtype``, identical on every rank (standard normal values)."""
    rng = np.random.default_rng([seed, 0])
    return rng.standard_normal((rows, dim), dtype=np.float32).astype(dtype, copy=False)


def batch_ids(seed: int, rank: int, rows: int, batch: int, zipf: float) -> np.ndarray:
    """Rank ``rank``'s ids, int64 ``[batch]`` in ``[0, rows)``."""
    rng = np.random.default_rng([seed, 1, rank])
    if zipf:
        return ((rng.zipf(zipf, batch) - 1) % rows).astype(np.int64)
    return rng.integers(0, rows, size=batch, dtype=np.int64)


def displs(counts: np.ndarray) -> np.ndarray:
    """Exclusive prefix sum of ``counts`` (MPI displacements), same dtype."""
    d = np.zeros_like(counts)
    np.cumsum(counts[:-1], out=d[1:])
    return d


def to_host(a) -> np.ndarray:
    return a if isinstance(a, np.ndarray) else a.get()


def nccl_baseline(c, reason_out: list):
    """NCCL grouped send/recv for the two exchanges, or None (reason appended to ``reason_out``) where it cannot
    run. Collective: every rank returns None or every rank a function."""
    import socket
    reason = None
    try:
        from cupy.cuda import nccl
        if not getattr(nccl, "available", True):
            reason = "CuPy was built without NCCL"
    except Exception as exc:  # noqa: BLE001
        reason = f"cupy.cuda.nccl not importable ({type(exc).__name__}: {exc})"
    dev = None
    if reason is None:
        import cupy
        dev = (socket.gethostname(), cupy.cuda.Device().pci_bus_id)
    devs = WORLD.allgather(dev)
    reasons = WORLD.allgather(reason)
    if any(reasons):
        reason_out.append(next(r for r in reasons if r))
        return None
    if len(set(devs)) < len(devs):
        reason_out.append(f"ranks share a GPU ({len(devs)} ranks on {len(set(devs))} devices): NCCL refuses two "
                          f"ranks on one device (ncclInvalidUsage)")
        return None
    try:
        uid = WORLD.bcast(nccl.get_unique_id() if c.rank == 0 else None, root=0)
        nc = nccl.NcclCommunicator(c.world_size, uid, c.rank)
        err = None
    except Exception as exc:  # noqa: BLE001
        nc, err = None, f"NCCL init failed: {type(exc).__name__}: {exc}"
    errs = [e for e in WORLD.allgather(err) if e]
    if errs:
        reason_out.append(errs[0])
        return None
    import cupy

    def exchange(x, send_counts, recv_counts, out):
        """``x`` rows grouped by destination -> ``out`` rows grouped by source (counts: host int64 [W])."""
        row = x.dtype.itemsize * int(np.prod(x.shape[1:], dtype=np.int64))       # bytes per row
        so, ro = displs(send_counts) * row, displs(recv_counts) * row
        stream = cupy.cuda.get_current_stream().ptr
        nccl.groupStart()
        for p in range(c.world_size):
            if send_counts[p]:
                nc.send(x.data.ptr + int(so[p]), int(send_counts[p]) * row, nccl.NCCL_UINT8, p, stream)
            if recv_counts[p]:
                nc.recv(out.data.ptr + int(ro[p]), int(recv_counts[p]) * row, nccl.NCCL_UINT8, p, stream)
        nccl.groupEnd()
        return out

    exchange.nc = nc  # keep the communicator alive with the function
    return exchange


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.backend != "host":
        select_device(WORLD)  # one GPU per local rank (round-robin when fewer GPUs); -1 and nothing without GPUs
    with cs.Communicator(WORLD, backend=args.backend) as c:
        W, me, xp = c.world_size, c.rank, c.xp
        resolve_sizes(args, c.backend, W)
        R, D, B = args.rows, args.dim, args.batch
        dtype = np.dtype(args.dtype)

        # ---- data: the whole table on the host (the reference), this rank's block on the backend
        bounds_np = np.array([r * R // W for r in range(W + 1)], dtype=np.int64)
        full = table(args.seed, R, D, dtype)
        lo, hi = int(bounds_np[me]), int(bounds_np[me + 1])
        shard = xp.asarray(full[lo:hi])                      # [hi - lo, dim]
        ids_np = batch_ids(args.seed, me, R, B, args.zipf)
        ids = xp.asarray(ids_np)                             # int64 [batch]
        starts = xp.asarray(bounds_np[:-1])                  # int64 [W], first row of each rank's block

        def route():
            owner = xp.searchsorted(starts, ids, side="right") - 1      # [batch], owner rank of each id
            order = xp.argsort(owner)                                    # ids grouped by owner
            send_counts = to_host(xp.bincount(owner, minlength=W)).astype(np.int64)
            return order, ids[order], send_counts

        def gather(recv_ids):
            return xp.take(shard, recv_ids - lo, axis=0)                # [sum(recv_counts), dim]

        def unroute(order, back):
            out = xp.empty((B, D), dtype=dtype)
            out[order] = back
            return out

        # ---- the exchanges: ours, and the peer baseline (same arrays)
        def ours_ids(sids, send_counts):
            return c.alltoallv(sids, send_counts)

        def ours_rows(rows, recv_counts, send_counts):
            return c.alltoallv(rows, recv_counts, recv_counts=send_counts)[0]

        baseline, skipped = None, []
        if args.no_baseline:
            skipped.append("--no-baseline")
        elif c.backend == "host":
            rowtype = MPI.BYTE.Create_contiguous(D * dtype.itemsize).Commit()

            def mpi_ids(sids, send_counts):
                recv_counts = np.empty(W, dtype=np.int64)
                WORLD.Alltoall(send_counts, recv_counts)
                recv = np.empty(int(recv_counts.sum()), dtype=np.int64)
                WORLD.Alltoallv([sids, (send_counts, displs(send_counts)), MPI.INT64_T],
                                [recv, (recv_counts, displs(recv_counts)), MPI.INT64_T])
                return recv, recv_counts

            def mpi_rows(rows, recv_counts, send_counts):
                back = np.empty((int(send_counts.sum()), D), dtype=dtype)
                WORLD.Alltoallv([rows, (recv_counts, displs(recv_counts)), rowtype],
                                [back, (send_counts, displs(send_counts)), rowtype])
                return back

            baseline = ("MPI.Alltoallv", mpi_ids, mpi_rows)
        else:
            ex = nccl_baseline(c, skipped)
            if ex is not None:
                def nccl_ids(sids, send_counts):
                    recv_counts = np.empty(W, dtype=np.int64)
                    WORLD.Alltoall(send_counts, recv_counts)
                    recv = xp.empty(int(recv_counts.sum()), dtype=np.int64)
                    return ex(sids, send_counts, recv_counts, recv), recv_counts

                def nccl_rows(rows, recv_counts, send_counts):
                    return ex(rows, recv_counts, send_counts, xp.empty((int(send_counts.sum()), D), dtype=dtype))

                baseline = ("NCCL", nccl_ids, nccl_rows)

        def step(ex_ids, ex_rows, corrupt=False):
            """One lookup; returns (out [batch, dim], seconds in the two exchanges, seconds of the whole step)."""
            c.synchronize()
            WORLD.Barrier()
            t0 = time.perf_counter()
            order, sids, send_counts = route()
            c.synchronize()
            ta = time.perf_counter()
            recv_ids, recv_counts = ex_ids(sids, send_counts)
            c.synchronize()
            tb = time.perf_counter()
            rows = gather(recv_ids)
            c.synchronize()
            tc = time.perf_counter()
            back = ex_rows(rows, recv_counts, send_counts)
            c.synchronize()
            td = time.perf_counter()
            out = unroute(order, back)
            c.synchronize()
            t1 = time.perf_counter()
            if corrupt:
                out[0, 0] += 1
            return out, (tb - ta) + (td - tc), t1 - t0, send_counts, recv_counts

        ref = full[ids_np]                                              # the single-table lookup

        engines = [("cupy_symbuf", ours_ids, ours_rows)] + ([baseline] if baseline is not None else [])
        results = []
        for name, ex_ids, ex_rows in engines:                           # checked run, one per engine
            out, _, _, send_counts, recv_counts = step(ex_ids, ex_rows, corrupt=args.corrupt and me == W - 1)
            got = to_host(out)
            ok = got.shape == ref.shape and np.array_equal(got.view(np.uint8), ref.view(np.uint8))
            results.append(dict(name=name, ok=bool(ok), bad=0 if ok else int((got != ref).any(axis=-1).sum()),
                                comm=0.0, step=0.0, send=send_counts.tolist(), recv=recv_counts.tolist()))
        for it in range(args.warmup + args.iters):                      # timed: the engines take turns
            for res, (_, ex_ids, ex_rows) in zip(results, engines):
                _, t_comm, t_step, _, _ = step(ex_ids, ex_rows)
                if it >= args.warmup:
                    res["comm"] += t_comm / args.iters
                    res["step"] += t_step / args.iters
        if c.backend == "host" and baseline is not None:
            rowtype.Free()

        allres = WORLD.gather(results, root=0)
        all_ok = WORLD.allreduce(all(r["ok"] for r in results), op=MPI.LAND)
        if me == 0:
            print(f"sharded embedding lookup: backend={c.backend} ranks={W} table {R} x {D} {dtype} "
                  f"(rows per rank {int(np.diff(bounds_np).min())}..{int(np.diff(bounds_np).max())}), "
                  f"batch {B} ids/rank ({'zipf %.2f' % args.zipf if args.zipf else 'uniform'}), "
                  f"channels={c.layout.num_channels}")
            print(f"  ids routed (rank: ids sent to each owner rank / ids received from each rank), "
                  f"{D * dtype.itemsize} B per row:")
            for r, res in enumerate(allres):
                print(f"    rank {r}: send {res[0]['send']}  recv {res[0]['recv']}")
            print(f"  per rank, mean of {args.iters} steps after {args.warmup} warm-up (comm = the two exchanges):")
            print("    engine        | rank | step us  | comm us  | comm share | check")
            for k in range(len(results)):
                for r, res in enumerate(allres):
                    e = res[k]
                    print(f"    {e['name']:13s} | {r:4d} | {e['step'] * 1e6:8.1f} | {e['comm'] * 1e6:8.1f} | "
                          f"{e['comm'] / e['step']:9.1%}  | "
                          f"{'correct' if e['ok'] else 'WRONG DATA (%d rows differ)' % e['bad']}")
            for k in range(len(results)):
                comm_t = sum(res[k]["comm"] for res in allres)
                step_t = sum(res[k]["step"] for res in allres)
                slow = max(res[k]["step"] for res in allres)
                print(f"  {allres[0][k]['name']}: communication share of the step {comm_t / step_t:.1%} "
                      f"(all ranks), slowest rank's step {slow * 1e6:.1f} us")
            if baseline is None:
                print(f"  peer baseline skipped: {skipped[0] if skipped else 'not available'}")
            print(f"check vs single-table NumPy lookup (bitwise, {B} ids x {W} ranks, every engine): "
                  f"{'correct' if all_ok else 'WRONG DATA'}")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
