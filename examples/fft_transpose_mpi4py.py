"""A distributed 2-D FFT written as a plain mpi4py program, ported to cupy_symbuf by one line: the global transpose
``comm.Alltoallv(...)`` becomes ``c.Alltoallv(...)`` with the same buffer specs (``c = cupy_symbuf.Communicator(comm)``
made beside it; the original line stays in the file as a comment).

Run::

    mpiexec -n 3 python examples/fft_transpose_mpi4py.py --n 100                  # host (NumPy), uneven slabs
    mpiexec -n 2 python examples/fft_transpose_mpi4py.py --backend cuda --n 4099  # GPU (CuPy)

Slab decomposition of ``A`` (``[N, N]`` complex, random from ``--seed``): rank ``r`` owns ``rows[r] = N // W +
(r < N % W)`` rows starting at ``row0[r]`` (the same split for the columns, so with N not divisible by the world size
``W`` the blocks differ in size and the Alltoallv counts differ per rank). One forward transform:

1. row FFTs of the local ``[rows[me], N]`` slab (``xp.fft.fft(a, axis=1)``);
2. pack: block ``j`` (``[rows[me], cols[j]]``, the columns rank ``j`` owns) goes to rank ``j``; the blocks lie in the
   send buffer in rank order, ``rows[me] * cols[j]`` elements at displacement ``rows[me] * col0[j]``;
3. the global transpose, ``Alltoallv``: the block from rank ``i`` (``rows[i] * cols[me]`` elements) is written at
   displacement ``row0[i] * cols[me]`` of the receive buffer ``[N, cols[me]]``, which is then exactly this rank's
   columns of the row-transformed ``A`` (no unpacking);
4. column FFTs of the ``[N, cols[me]]`` block (``xp.fft.fft(b, axis=0)``): columns ``col0[me]:col0[me] + cols[me]``
   of ``fft2(A)``.

Check: the input slabs are gathered (``Allgatherv``, host memory) and every rank compares its columns with
``numpy.fft.fft2(A)`` in complex128: ``max |y - ref| <= 8 * eps * log2(N * N) * rms(ref)`` (``eps`` of the dtype's
real part; an FFT's rounding error grows like ``eps * log2(size)`` relative to the transform's magnitude). Rank 0
prints ``check vs numpy.fft.fft2 ...: correct`` (or ``WRONG DATA``, exit status 1). ``--corrupt`` changes one received
value on rank 0 (the check must then fail).
"""
import argparse
import math
import sys

import numpy as np
from mpi4py import MPI

import cupy_symbuf

p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
p.add_argument("--backend", choices=("auto", "host", "cuda"), default="auto",
               help="host: NumPy arrays; cuda: CuPy arrays; auto (default): cuda where CuPy sees a GPU, else host")
p.add_argument("--n", type=int, default=257, help="N: the array is N x N (default 257)")
p.add_argument("--dtype", choices=("complex128", "complex64"), default="complex128")
p.add_argument("--seed", type=int, default=0)
p.add_argument("--corrupt", action="store_true", help="(testing) change one received value on rank 0")
args = p.parse_args()
if args.backend == "auto":
    try:
        import cupy
        args.backend = "cuda" if cupy.cuda.runtime.getDeviceCount() > 0 else "host"
    except Exception:  # no CuPy, or no GPU visible
        args.backend = "host"

comm = MPI.COMM_WORLD
W, me = comm.Get_size(), comm.Get_rank()
if args.backend == "cuda":
    import cupy as xp
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    xp.cuda.Device(local.Get_rank() % xp.cuda.runtime.getDeviceCount()).use()  # one GPU per local rank
    local.Free()
else:
    xp = np
N, dtype = args.n, np.dtype(args.dtype)
mpi_type = MPI.C_DOUBLE_COMPLEX if dtype == np.complex128 else MPI.C_FLOAT_COMPLEX

rows = np.array([N // W + (r < N % W) for r in range(W)])     # rows (and columns) each rank owns
row0 = np.cumsum(rows) - rows                                 # where they start
cols, col0 = rows, row0

rng = np.random.default_rng([args.seed, me])
a_host = (rng.standard_normal((rows[me], N)) + 1j * rng.standard_normal((rows[me], N))).astype(dtype)
a = xp.asarray(a_host)                                        # [rows[me], N]: this rank's slab

# 1. row FFTs; 2. pack the block for each rank, in rank order
r = xp.fft.fft(a, axis=1)
sendbuf = xp.concatenate([r[:, col0[j]:col0[j] + cols[j]].reshape(-1) for j in range(W)])
scounts, sdispls = rows[me] * cols, rows[me] * col0
# 3. the global transpose: the block from rank i lands as rows row0[i]: of this rank's [N, cols[me]] columns
recvbuf = xp.empty((N, cols[me]), dtype=dtype)
rcounts, rdispls = rows * cols[me], row0 * cols[me]
c = cupy_symbuf.Communicator(comm, backend=args.backend)      # the port: made once, beside the call
# comm.Alltoallv([sendbuf, (scounts, sdispls), mpi_type], [recvbuf, (rcounts, rdispls), mpi_type])
c.Alltoallv([sendbuf, (scounts, sdispls), mpi_type], [recvbuf, (rcounts, rdispls), mpi_type])
if args.corrupt and me == 0 and recvbuf.size:
    recvbuf[0, 0] += 1
# 4. column FFTs: this rank's columns of fft2(A)
y = xp.fft.fft(recvbuf, axis=0)

# check against numpy.fft.fft2 of the gathered input (complex128, on the host)
full = np.empty((N, N), dtype=dtype)
comm.Allgatherv(a_host, [full, rows * N, row0 * N, mpi_type])
ref_all = np.fft.fft2(full.astype(np.complex128))
ref = ref_all[:, col0[me]:col0[me] + cols[me]]
got = (y.get() if hasattr(y, "get") else y).astype(np.complex128)
eps = float(np.finfo(dtype).eps)
tol = 8 * eps * math.log2(max(N * N, 2)) * float(np.sqrt(np.mean(np.abs(ref_all) ** 2)))
err = float(np.abs(got - ref).max(initial=0.0))
ok = comm.allreduce(err <= tol, op=MPI.LAND)
worst = comm.reduce(err, op=MPI.MAX, root=0)
if me == 0:
    print(f"distributed 2-D FFT (mpi4py program, c.Alltoallv): backend={args.backend} ranks={W} N={N} {dtype}, "
          f"column blocks {cols.tolist()}")
    print(f"check vs numpy.fft.fft2 (max |y - ref| {worst:.3g}, tolerance {tol:.3g}): "
          f"{'correct' if ok else 'WRONG DATA'}")
sys.exit(0 if ok else 1)
