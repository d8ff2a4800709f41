"""EP8 symmetric memory, checked by building it (``.ci/device.sh ep8``): run under MPS with 8 ranks on one GPU,
``mpirun -n 8 python3 tests/device/ep8_memory.py``. Each rank builds the default Communicator (the normal-mode ring buffer)
and a LowLatencyBuffer for 128 tokens x 7168 bf16, 256 experts, top-8, and rank 0 prints the formula
(``ChannelLayout.total_bytes``, ``LowLatencyBuffer.symmetric_bytes``) beside what the GPU's free memory lost
(all 8 ranks share the GPU, so the loss / 8 is per rank; it includes CUDA's allocation granularity and each
process's context-independent pools)."""
from mpi4py import MPI

import cupy as cp

import cupy_symbuf as cs
from cupy_symbuf.utils import select_device

comm = MPI.COMM_WORLD
select_device(comm)
cp.cuda.runtime.deviceSynchronize()
comm.Barrier()
free0 = cp.cuda.runtime.memGetInfo()[0]
comm.Barrier()
c = cs.Communicator(comm, backend="cuda")
comm.Barrier()
free1 = cp.cuda.runtime.memGetInfo()[0]
comm.Barrier()
ll = cs.LowLatencyBuffer(c, 128, 7168, 256)
comm.Barrier()
free2 = cp.cuda.runtime.memGetInfo()[0]
W = comm.size
ring = c.layout.total_bytes
llb = cs.LowLatencyBuffer.symmetric_bytes(128, 7168, W)
if comm.rank == 0:
    mib = 2 ** 20
    print(f"EP{W}, {W} ranks on one GPU: ring buffer formula {ring / mib:.1f} MiB, built {(free0 - free1) / W / mib:.1f} "
          f"MiB per rank; low-latency buffer formula {llb / mib:.1f} MiB, built {(free1 - free2) / W / mib:.1f} MiB "
          f"per rank; total formula {(ring + llb) / mib:.1f} MiB (target <= 256)")
    print(c.describe().splitlines()[0])
ll.close()
c.close()
