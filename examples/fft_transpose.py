"""A distributed 2-D FFT with an all-to-all transpose (``Communicator.alltoall``), checked against
``numpy.fft.fft2``, with the communication share and (``--scaling``) the strong-scaling efficiency.

Run::

    mpiexec -n 4 python examples/fft_transpose.py                   # host: 512 x 512 complex128
    mpiexec -n 3 python examples/fft_transpose.py --n 500 --scaling # uneven row blocks; efficiency vs one rank
    mpirun -n 8 python examples/fft_transpose.py --backend cuda --scaling   # GPU: 8192 x 8192 complex64

The input ``A`` (``[N, N]`` of ``--dtype``, complex128 or complex64) is reproducible from ``--seed`` on every rank
(``full_input``). Rows are split in blocks of ``nb = ceil(N / world_size)``: rank ``r`` owns rows
``[r * nb, min((r + 1) * nb, N))`` (the last ranks may own fewer, even none), held as ``[nb, N]`` with zero rows as
padding. The column index space is padded the same way to ``world_size * nb``, so every block exchanged is
``[nb, nb]`` and ``alltoall`` (equal blocks) does the transpose.

One forward FFT (what is timed):

1. row FFTs: ``xp.fft.fft(a, axis=1)`` of the local ``[nb, N]`` rows;
2. pack: the ``[nb, world_size * nb]`` (column-padded) rows viewed as ``[nb, world_size, nb]`` and transposed to
   ``send[j] = rows[:, j * nb:(j + 1) * nb]``, ``[world_size, nb, nb]`` contiguous: block ``j`` goes to rank ``j``;
3. ``recv = alltoall(send)``: ``recv[s][i, c]`` is ``A'[s * nb + i, rank * nb + c]`` (``A'`` = row-transformed);
4. unpack: ``t = recv.transpose(2, 0, 1).reshape(nb, world_size * nb)[:, :N]``: ``t[c, g] = A'[g, rank * nb + c]``,
   this rank's columns as rows;
5. column FFTs: ``xp.fft.fft(t, axis=1)``.

The result is in transposed layout (as FFTW-MPI's ``TRANSPOSED_OUT``): rank ``r``'s row ``c`` is column
``r * nb + c`` of ``fft2(A)``. Check: every rank compares its rows with ``numpy.fft.fft2(A)[:, cols].T`` computed
in complex128 on the host: ``max |y - ref| <= 8 * eps * log2(N * N) * rms(ref)`` with ``eps`` the machine epsilon
of the dtype's real part (an FFT's rounding error grows like ``eps * log2(size)`` relative to the transform's
magnitude, whose rms is ``rms(ref)``; factor 8 covers the two libraries' different orders), and the relative L2
error must be below ``eps * log2(N * N)``. A wrong or misplaced block gives errors of order ``rms(ref)``. Exit
status 1 on a failed check.

Timing: means over ``--iters`` runs after ``--warmup``, each after a barrier, with a device synchronize around the
alltoall on GPUs. Communication share = time in ``alltoall`` (incl. waiting for slower peers) / time of the whole
FFT, per rank. ``--scaling``: rank 0 alone (the other ranks wait without spinning) times the same ``N x N``
transform on one rank with the same algorithm minus the exchange (row FFTs, a local transpose copy, column FFTs);
strong-scaling efficiency = ``T_1 / (world_size * T_W)`` with ``T_W`` the slowest rank's mean time. On a host
with fewer cores than ranks the ranks share cores and the efficiency says so.
"""
from __future__ import annotations

import argparse
import math
import sys
import time

import numpy as np
from mpi4py import MPI

import cupy_symbuf as cs
from cupy_symbuf.utils import select_device

WORLD = MPI.COMM_WORLD
HOST_DEFAULTS = dict(n=512, dtype="complex128")
GPU_DEFAULTS = dict(n=8192, dtype="complex64")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=("auto", "host", "cuda"), default="auto")
    p.add_argument("--n", type=int, help="N: the array is N x N (host 512, GPU 8192)")
    p.add_argument("--dtype", choices=("complex128", "complex64"), help="host complex128, GPU complex64")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5, help="timed transforms")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scaling", action="store_true",
                   help="also time the same N on rank 0 alone and print the strong-scaling efficiency")
    p.add_argument("--corrupt", action="store_true",
                   help="(testing) change one received value on rank 0: the check must then fail and the "
                        "exit status be 1")
    return p.parse_args(argv)


def resolve(args, backend: str) -> None:
    defaults = GPU_DEFAULTS if backend == "cuda" else HOST_DEFAULTS
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.n < 1:
        raise SystemExit(f"fft_transpose.py: argument --n must be >= 1, got {args.n}")
    if args.iters < 1 or args.warmup < 0:
        raise SystemExit(f"fft_transpose.py: arguments --iters (>= 1) and --warmup (>= 0) got {args.iters}, "
                         f"{args.warmup}")


def full_input(seed: int, n: int, dtype) -> np.ndarray:
    """``A``, ``[n, n]`` of complex ``dtype`` (real and imaginary parts standard normal), identical on every rank."""
    rng = np.random.default_rng([seed, 0])
    re = rng.standard_normal((n, n))
    im = rng.standard_normal((n, n))
    return (re + 1j * im).astype(dtype)


def to_host(a) -> np.ndarray:
    return a if isinstance(a, np.ndarray) else a.get()


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.backend != "host":
        select_device(WORLD)  # one GPU per local rank (round-robin when fewer GPUs); -1 and nothing without GPUs
    with cs.Communicator(WORLD, backend=args.backend) as c:
        W, me, xp = c.world_size, c.rank, c.xp
        resolve(args, c.backend)
        N, dtype = args.n, np.dtype(args.dtype)
        nb = -(-N // W)                                      # rows (and columns) per block
        own = lambda r: max(0, min(nb, N - r * nb))          # noqa: E731  rows rank r owns
        lo = me * nb
        full = full_input(args.seed, N, dtype)
        a_np = np.zeros((nb, N), dtype=dtype)
        a_np[:own(me)] = full[lo:lo + own(me)]
        a = xp.asarray(a_np)                                 # [nb, N], rows past own(me) are zero

        def forward(corrupt=False):
            """One distributed FFT; returns (y [nb, N] in transposed layout, seconds in alltoall, seconds total)."""
            c.synchronize()
            WORLD.Barrier()
            t0 = time.perf_counter()
            if W * nb == N:
                rows = xp.fft.fft(a, axis=1)                                           # [nb, N]
            else:                                                                      # pad the columns
                rows = xp.zeros((nb, W * nb), dtype=dtype)
                rows[:, :N] = xp.fft.fft(a, axis=1)
            send = xp.ascontiguousarray(rows.reshape(nb, W, nb).transpose(1, 0, 2))    # [W, nb, nb]
            c.synchronize()
            ta = time.perf_counter()
            recv = c.alltoall(send)
            c.synchronize()
            tb = time.perf_counter()
            if corrupt:
                recv[0, 0, 0] += 1
            t = recv.transpose(2, 0, 1).reshape(nb, W * nb)[:, :N]                     # [nb, N]
            y = xp.fft.fft(t, axis=1)
            c.synchronize()
            t1 = time.perf_counter()
            return y, tb - ta, t1 - t0

        y, _, _ = forward(corrupt=args.corrupt and me == 0)
        comm_s = total_s = 0.0
        for it in range(args.warmup + args.iters):
            _, t_comm, t_all = forward()
            if it >= args.warmup:
                comm_s += t_comm / args.iters
                total_s += t_all / args.iters

        # ---- strong scaling: the same N on rank 0 alone
        t_one = None
        if args.scaling:
            if me == 0:
                whole = xp.asarray(full)

                def serial():
                    r = xp.fft.fft(whole, axis=1)
                    t = xp.ascontiguousarray(r.T)
                    return xp.fft.fft(t, axis=1)
                times = []
                for it in range(args.warmup + args.iters):
                    c.synchronize()
                    t0 = time.perf_counter()
                    serial()
                    c.synchronize()
                    if it >= args.warmup:
                        times.append(time.perf_counter() - t0)
                t_one = sum(times) / len(times)
                del whole
            req = WORLD.Ibarrier()                           # the others wait here without taking a core
            while not req.Test():
                time.sleep(1e-3)

        # ---- check against numpy.fft.fft2 (complex128 on the host)
        mine = own(me)
        fft2 = np.fft.fft2(full.astype(np.complex128))                         # [N, N] complex128
        ref = fft2[:, lo:lo + mine].T                                          # [mine, N]: this rank's columns
        got = to_host(y)[:mine].astype(np.complex128)
        eps = float(np.finfo(dtype).eps)
        log_size = math.log2(max(N * N, 2))
        rms = float(np.sqrt(np.mean(np.abs(fft2) ** 2)))
        del fft2
        tol = 8 * eps * log_size * rms
        err = float(np.abs(got - ref).max(initial=0.0))
        rel = float(np.linalg.norm(got - ref) / max(float(np.linalg.norm(ref)), 1e-300)) if mine else 0.0
        ok = err <= tol and rel <= eps * log_size
        stats = dict(rank=me, rows=mine, ok=bool(ok), err=err, tol=tol, rel=rel, comm=comm_s, total=total_s)
        allstats = WORLD.gather(stats, root=0)
        all_ok = WORLD.allreduce(bool(ok), op=MPI.LAND)
        if me == 0:
            print(f"distributed 2-D FFT: backend={c.backend} ranks={W} N={N} {dtype} "
                  f"({W * nb * nb * dtype.itemsize / 2**20:.2f} MiB per rank through alltoall, blocks {nb} x {nb}), "
                  f"channels={c.layout.num_channels}")
            print(f"  per rank, mean of {args.iters} transforms after {args.warmup} warm-up:")
            print("    rank | rows | fft2 us   | alltoall us | comm share | max |y - ref| / tol | rel L2 error | check")
            for s in allstats:
                print(f"    {s['rank']:4d} | {s['rows']:4d} | {s['total'] * 1e6:9.1f} | {s['comm'] * 1e6:11.1f} | "
                      f"{s['comm'] / s['total']:9.1%}  | {s['err'] / s['tol'] if s['tol'] else 0.0:18.3g} | "
                      f"{s['rel']:12.3g} | {'correct' if s['ok'] else 'WRONG DATA'}")
            slow = max(s["total"] for s in allstats)
            share = sum(s["comm"] for s in allstats) / sum(s["total"] for s in allstats)
            print(f"  communication share of the transform {share:.1%} (all ranks), slowest rank {slow * 1e6:.1f} us")
            if t_one is not None:
                print(f"  strong scaling: 1 rank {t_one * 1e6:.1f} us (same N, rank 0 alone), {W} ranks "
                      f"{slow * 1e6:.1f} us: speedup {t_one / slow:.2f}x, efficiency {t_one / (W * slow):.1%}")
            print(f"check vs numpy.fft.fft2 (tolerance 8 * eps * log2(N^2) * rms, eps {eps:.3g}): "
                  f"{'correct' if all_ok else 'WRONG DATA'}")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
