#!/usr/bin/env bash
# Issues 12 and 14 on one H200 (one device call), 2 ranks under MPS: the bench's energy (NVML), CUDA-aware MPI
# (mpi-cuda) and vs_peer columns; the dispatch bench with the low-latency rows; topology discovery on the cuda backend.
# Usage: bash .ci/device_issue12.sh [stage...]   stages: energy ll topo trace examples (default: the first four)
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
STAGES=${*:-energy ll topo trace}
nvidia-cuda-mps-control -d 2>/dev/null && echo "MPS started"
R="$MPIRUN -n ${RANKS:-2} -x CUDA_VISIBLE_DEVICES=0"
for stage in $STAGES; do
  case $stage in
    energy)
      timeout 120 $R python3 -m cupy_symbuf.bench --sizes 16M,128M --iters 20 --warmup 3 --references torch,mpi \
        --json $LOG/a2a_energy.json > $LOG/energy.log 2>&1
      echo "== [alltoall energy / mpi-cuda] rc=$?"; grep -vE "^$|it/s" $LOG/energy.log | tail -22 ;;
    ll)
      timeout 150 $R python3 -m cupy_symbuf.bench --op dispatch --moe-tokens 4096,128 --iters 200 --warmup 5 \
        --json $LOG/moe_ll.json > $LOG/ll.log 2>&1
      echo "== [dispatch + low-latency] rc=$?"; grep -vE "^$|it/s" $LOG/ll.log | tail -30 ;;
    topo)
      timeout 60 $R python3 -m cupy_symbuf info --backend cuda --no-communicator > $LOG/topo.log 2>&1
      echo "== [info --backend cuda] rc=$?"; tail -20 $LOG/topo.log ;;
    trace)  # GPU channel telemetry with a skewed routing -> diagnostics PNGs and report; the cost of tracing
      timeout 150 $MPIRUN -n ${TRACE_RANKS:-4} -x CUDA_VISIBLE_DEVICES=0 -x OUT=$LOG python3 .ci/gpu_trace.py > $LOG/trace.log 2>&1
      echo "== [trace ${TRACE_RANKS:-4} ranks] rc=$?"; tail -30 $LOG/trace.log; ls $LOG/diag ;;
    examples)
      for ex in examples/*.py; do
        a=""; [ "$(basename $ex)" = soak.py ] && a="--iters ${SOAK_ITERS:-2000}"
        timeout 120 $R python3 $ex $a > $LOG/ex_$(basename $ex .py).log 2>&1
        echo "== [$ex] rc=$?"; tail -${EX_TAIL:-4} $LOG/ex_$(basename $ex .py).log
      done ;;
  esac
done
echo quit | nvidia-cuda-mps-control 2>/dev/null
