#!/usr/bin/env bash
# Issue 9, final device call at the final code: the GPU suite (1 rank; 2 and 4 ranks under MPS), the reject fault
# cases on the GPU path, a soak of 10,000 iterations at 2 ranks, and host issue time / 1 MiB loop.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
STAGE_LIMIT=100 MPS_RANKS="2 4" TEST_TIMEOUT=60 PYTEST_ARGS="--ignore=tests/test_faults.py" bash .ci/gpu_suite.sh single mps 2>&1 | grep -E "^== |passed|failed"
nvidia-cuda-mps-control -d && echo "MPS started"
CUPY_SYMBUF_FAULT_BACKEND=cuda MPIEXEC="$FAULT_MPIEXEC" \
  timeout 60 python3 -m pytest -q --color=no -p no:cacheprovider --timeout=50 tests/test_faults.py -k "recv_self_off or reject or abort or dtype" > $LOG/faults.log 2>&1
echo "== [faults] rc=$?"; grep -E "passed|failed|FAILED" $LOG/faults.log | tail -6
timeout 60 $MPIRUN -n 2 -x CUDA_VISIBLE_DEVICES=0 python3 examples/soak.py --backend cuda --iters 10000 --check-every 10 > $LOG/soak.log 2>&1
echo "== [soak n=2] rc=$?"; grep -E "soak:|WRONG" $LOG/soak.log | tail -2
timeout 40 $MPIRUN -n 2 -x CUDA_VISIBLE_DEVICES=0 python3 -m cupy_symbuf.bench --sizes 64K,1M --no-reference --iters 200 --warmup 20 --profile > $LOG/perf.log 2>&1
echo "== [perf] rc=$?"; grep -E "^ *[0-9.]+ [KMG]iB|issue one call" $LOG/perf.log | head -6
echo quit | nvidia-cuda-mps-control
