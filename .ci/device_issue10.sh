#!/usr/bin/env bash
# Issue 10 on one H200 (one device call): the MoE / control tests (1 rank; 2 ranks under MPS), then the
# control-path table (python -m cupy_symbuf.bench --control) at 2, 4 and 8 ranks under MPS; then optionally the
# whole GPU suite. Usage: bash .ci/device_issue10.sh [stage...]   stages: quick control suite (default: quick control)
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
STAGES=${*:-quick control}
mps_on() { nvidia-cuda-mps-control -d 2>/dev/null && echo "MPS started"; }
mps_off() { echo quit | nvidia-cuda-mps-control 2>/dev/null; sleep 1; }
QUICK=${QUICK:-"tests/test_kernels_compile.py tests/test_moe_device.py tests/test_moe.py tests/test_alltoall.py tests/test_streams.py tests/test_deepep.py"}
PYTEST="python3 -m pytest -q --color=no -p no:cacheprovider --timeout=90 -x"
for stage in $STAGES; do
  case $stage in
    quick)
      timeout ${QUICK_LIMIT:-180} $PYTEST $QUICK > $LOG/quick1.log 2>&1
      echo "== [quick 1 rank] rc=$?"; grep -E "passed|failed|^E |FAILED|Error" $LOG/quick1.log | head -20
      mps_on
      timeout ${QUICK_LIMIT:-180} $MPIRUN -n 2 -x CUDA_VISIBLE_DEVICES=0 $PYTEST $QUICK > $LOG/quick2.log 2>&1
      echo "== [quick 2 ranks MPS] rc=$?"; grep -E "passed|failed|^E |FAILED|Error" $LOG/quick2.log | head -20
      mps_off ;;
    control)
      mps_on
      for n in ${CONTROL_RANKS:-2 4 8}; do
        timeout ${CONTROL_LIMIT:-150} $MPIRUN -n $n -x CUDA_VISIBLE_DEVICES=0 python3 -m cupy_symbuf.bench --control --profile \
          --iters ${ITERS:-50} --warmup 5 > $LOG/control_$n.log 2>&1
        echo "== [control $n ranks] rc=$?"; grep -vE "^$" $LOG/control_$n.log | tail -22
      done
      mps_off ;;
    suite)
      STAGE_LIMIT=${SUITE_LIMIT:-200} MPS_RANKS="2 4" TEST_TIMEOUT=60 PYTEST_ARGS="--ignore=tests/test_faults.py -x" bash .ci/gpu_suite.sh mps single ;;
  esac
done
