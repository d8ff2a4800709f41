"""DeepSeek-V3-shaped all-to-all: ``mpiexec -n 4 python examples/alltoall.py``, or
``torchrun --standalone --nproc-per-node 4 examples/alltoall.py`` (a gloo group; no MPI needed).

Every rank holds ``--tokens`` tokens of ``--hidden`` values (bf16 on GPU, float32 on the host path), routes each
token to one destination rank with uneven random probabilities, and exchanges them with
``Communicator.alltoallv``. The result is checked against a NumPy reference: every rank regenerates, from the
shared seed, exactly the rows each source sent it. Prints sizes, time and GB/s.

``--launcher``: ``mpi`` (``MPI.COMM_WORLD``), ``torch`` (``torch.distributed`` default group over gloo, as
started by torchrun), ``auto`` (default): torch when torchrun's ``RANK`` / ``WORLD_SIZE`` are set and no MPI
launcher's, else mpi.
"""
import argparse
import os
import sys
import time

import numpy as np

import cupy_symbuf as cs
from cupy_symbuf.utils import select_device

_MPI_ENV = ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK")


class Group:
    """The few collectives the example needs besides cupy_symbuf's: over MPI.COMM_WORLD or torch's default group
    (``comm``: what ``cs.Communicator`` takes)."""

    def __init__(self, launcher: str):
        if launcher == "auto":
            torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
            launcher = "torch" if torchrun and not any(k in os.environ for k in _MPI_ENV) else "mpi"
        self.kind = launcher
        if launcher == "torch":
            import torch.distributed as dist
            dist.init_process_group("gloo")
            self.dist, self.comm = dist, dist.group.WORLD
        else:
            from mpi4py import MPI
            self.comm = MPI.COMM_WORLD

    def barrier(self) -> None:
        if self.kind == "torch":
            self.dist.barrier()
        else:
            self.comm.Barrier()

    def allgather(self, obj) -> list:
        if self.kind == "torch":
            out = [None] * self.dist.get_world_size()
            self.dist.all_gather_object(out, obj)
            return out
        return self.comm.allgather(obj)


def rows_for(seed: int, src: int, dst: int, n: int, hidden: int, itemsize: int) -> np.ndarray:
    """The rows rank ``src`` sends to rank ``dst``: random bits, reproducible by the receiver."""
    rng = np.random.default_rng([seed, src, dst])
    return rng.integers(0, 1 << (8 * itemsize), size=(n, hidden), dtype=np.uint16 if itemsize == 2 else np.uint32)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--backend", default="auto", choices=("auto", "cuda", "host"))
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--launcher", default="auto", choices=("auto", "mpi", "torch"))
    args = ap.parse_args()

    group = Group(args.launcher)
    comm = group.comm
    if args.backend != "host":
        select_device(comm)  # one GPU per local rank (shared round-robin if fewer GPUs)
    with cs.Communicator(comm, backend=args.backend) as c:
        W, me, xp = c.world_size, c.rank, c.xp
        # bf16 travels as raw 16-bit words on the GPU (the kernels move bytes); float32 on the host.
        itemsize = 2 if c.backend == "cuda" else 4
        dtype_name = "bf16" if c.backend == "cuda" else "float32"
        # Uneven random routing: each rank draws its own skewed destination distribution.
        rng = np.random.default_rng([args.seed, me])
        probs = rng.dirichlet(np.full(W, 0.7))
        dest = rng.choice(W, size=args.tokens, p=probs)
        send_counts = np.bincount(dest, minlength=W)
        send = np.concatenate([rows_for(args.seed, me, d, int(send_counts[d]), args.hidden, itemsize)
                               for d in range(W)])
        x = xp.asarray(send)
        recv, recv_counts = c.alltoallv(x, send_counts)
        # Reference: regenerate what each source sent us.
        expected = np.concatenate([rows_for(args.seed, s, me, int(recv_counts[s]), args.hidden, itemsize)
                                   for s in range(W)])
        got = recv.get() if hasattr(recv, "get") else recv
        ok = got.shape == expected.shape and np.array_equal(got, expected)
        # Timing: the same exchange, cached counts excluded (full alltoallv incl. the notify step).
        times = []
        for _ in range(args.iters):
            c.synchronize()
            group.barrier()
            t0 = time.perf_counter()
            c.alltoallv(x, send_counts)
            c.synchronize()  # GPU calls return once queued; this waits (and raises a recorded timeout)
            times.append(time.perf_counter() - t0)
        t = float(np.median(times))
        row_bytes = args.hidden * itemsize
        sent = int(send_counts.sum()) * row_bytes
        off_rank = int(send_counts.sum() - send_counts[me]) * row_bytes
        received = int(recv_counts.sum()) * row_bytes
        stats = group.allgather((me, ok, sent, off_rank, received, t))
        all_ok = all(s[1] for s in stats)
        if me == 0:
            print(f"alltoallv {c.backend} ({group.kind}): world_size={W} tokens/rank={args.tokens} hidden={args.hidden} "
                  f"dtype={dtype_name} channels={c.layout.num_channels}")
            for r, ok_r, s, o, rcv, tr in stats:
                print(f"  rank {r}: sent {s / 2**20:8.2f} MiB ({o / 2**20:8.2f} MiB to other ranks), "
                      f"received {rcv / 2**20:8.2f} MiB, {tr * 1e6:9.1f} us, "
                      f"{s / tr / 1e9:7.1f} GB/s sent, {o / tr / 1e9:7.1f} GB/s off-rank, "
                      f"{'OK' if ok_r else 'MISMATCH'}")
            tmax = max(s[5] for s in stats)
            tot_off = sum(s[3] for s in stats)
            print(f"  slowest rank {tmax * 1e6:.1f} us; aggregate off-rank {tot_off / tmax / 1e9:.1f} GB/s; "
                  f"check vs NumPy reference: {'PASSED' if all_ok else 'FAILED'}")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
