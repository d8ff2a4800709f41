"""alltoall out of symmetric arrays (direct mode), checked against NumPy.

    mpiexec -n 4 python examples/symmetric_alltoall.py [--mib 16] [--backend auto|cuda|host]

Every rank fills a symmetric array (``Communicator.empty``) with random bytes; on the host each receiver copies its
block straight out of the sender's array (one copy per byte). The result is checked against an allgather
reference, and the time per call is printed next to ``MPI.Alltoall`` of the same arrays (host copies on a GPU).
"""
import argparse
import time

import numpy as np
from mpi4py import MPI

import cupy_symbuf as cs


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=float, default=16, help="input MiB per rank (default 16)")
    ap.add_argument("--backend", default="auto", choices=("auto", "cuda", "host"),
                    help="auto (default): the GPU when one is visible, else the host")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    if args.backend != "host":
        from cupy_symbuf.utils import select_device
        select_device(comm)
    W, me = comm.size, comm.rank
    per_peer = max(16, int(args.mib * 2**20) // W)
    with cs.Communicator(comm, backend=args.backend) as c:
        data = np.random.default_rng(me).integers(0, 256, (W, per_peer), dtype=np.uint8)
        x = c.array(c.xp.asarray(data))            # symmetric input (collective)
        out = c.empty(x.shape, x.dtype)            # symmetric output
        y = c.alltoall(x, out=out)
        got = y.get() if hasattr(y, "get") else y
        want = np.stack([np.random.default_rng(j).integers(0, 256, (W, per_peer), dtype=np.uint8)[me]
                         for j in range(W)])
        ok = comm.allreduce(bool(np.array_equal(got, want)), op=MPI.LAND)
        comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(args.iters):
            c.alltoall(x, out=out)
        c.synchronize()
        ours = comm.allreduce((time.perf_counter() - t0) / args.iters, op=MPI.MAX)
        ref = np.empty_like(data)
        comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(args.iters):
            comm.Alltoall(data, ref)
        mpi = comm.allreduce((time.perf_counter() - t0) / args.iters, op=MPI.MAX)
        if me == 0:
            print(f"symmetric alltoall, {W} ranks, {W * per_peer / 2**20:.1f} MiB per rank, backend {c.backend}: "
                  f"{'correct' if ok else 'WRONG DATA'}; {ours * 1e6:.0f} us per call, MPI.Alltoall "
                  f"{mpi * 1e6:.0f} us ({ours / mpi:.2f}x)")
        if not ok:
            raise SystemExit(1)


if __name__ == "__main__":
    main()
