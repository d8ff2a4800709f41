#!/bin/bash
# Low-latency mode on one H200 (issue 10 item 5): tests at 1 rank, 2 ranks under MPS, then bench_low_latency.
source "$(dirname "${BASH_SOURCE[0]}")/device_env.sh"
export CUPY_SYMBUF_TEST_BACKENDS=cuda CUPY_SYMBUF_TIMEOUT_S=10
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
nvidia-cuda-mps-control -d && echo "MPS started"
PYT="python3 -m pytest -q -x --timeout=90 -p no:cacheprovider tests/test_low_latency.py"
echo "== 1 rank"; timeout 110 $PYT 2>&1 | tail -25
echo "== 2 ranks (MPS)"; timeout 130 $MPIRUN -x CUPY_SYMBUF_TEST_BACKENDS -n 2 $PYT 2>&1 | tail -25
echo "== 4 ranks (MPS)"; timeout 150 $MPIRUN -x CUPY_SYMBUF_TEST_BACKENDS -n 4 $PYT 2>&1 | tail -8
echo "== bench 2 ranks (MPS)"
timeout 90 $MPIRUN -n 2 python3 -c "
from mpi4py import MPI
import cupy_symbuf as cs
from cupy_symbuf.utils import select_device
select_device(MPI.COMM_WORLD)
with cs.Communicator(MPI.COMM_WORLD) as c:
    for fp8 in (False, True):
        r = cs.bench_low_latency(c, 128, 7168, 256, 8, iters=50, use_fp8=fp8)
        if c.rank == 0: print('fp8' if fp8 else 'bf16', {k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items()}, flush=True)
" 2>&1 | tail -20
echo quit | nvidia-cuda-mps-control
