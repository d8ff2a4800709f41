#!/usr/bin/env bash
# Issue 9 on one H200 (one device call): GPU suite (1 rank; 2 and 4 ranks under MPS), the fault cases on the GPU
# path, host time per call and 1 MiB loop time before (tree in .old, commit 0d2c106) and after, then soak and
# sanitizers. Usage: bash .ci/device_issue9.sh [stage...]  stages: suite faults perf soak sanitize
# perf needs the old tree: git worktree add .old 0d2c106 (listed in .git/info/exclude; device run: carry [".old"])
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
STAGES=${*:-suite faults perf soak}
mps_on() { nvidia-cuda-mps-control -d 2>/dev/null && echo "MPS started"; }
mps_off() { echo quit | nvidia-cuda-mps-control 2>/dev/null; sleep 1; }
for stage in $STAGES; do
  case $stage in
    suite)
      STAGE_LIMIT=200 MPS_RANKS="2 4" TEST_TIMEOUT=60 PYTEST_ARGS="--ignore=tests/test_faults.py -x" bash .ci/gpu_suite.sh mps single ;;
    faults)  # single-process pytest launching mpirun per case (ranks share GPU 0, MPS on)
      mps_on
      CUPY_SYMBUF_FAULT_BACKEND=cuda MPIEXEC="$FAULT_MPIEXEC" \
        timeout ${FAULTS_LIMIT:-240} python3 -m pytest -q --color=no -p no:cacheprovider --timeout=100 tests/test_faults.py -k "not soak" > $LOG/faults.log 2>&1
      echo "== [faults] rc=$?"; grep -E "passed|failed|FAILED|XPASS|xfail" $LOG/faults.log | tail -15
      mps_off ;;
    perf)  # 64 KiB (host issue time, --profile) and 1 MiB loop; before (.old) and after, 2 ranks under MPS
      mps_on
      for v in old new nofold; do  # nofold: this tree with -DSYMBUF_HEADER_FOLD=0
        tree=.; [ $v = old ] && tree=.old; defs=""; [ $v = nofold ] && defs="-DSYMBUF_HEADER_FOLD=0"
        (cd $tree && PYTHONPATH=$PWD CUPY_SYMBUF_NVRTC_DEFINES="$defs" timeout 120 $MPIRUN -x PYTHONPATH -x CUPY_SYMBUF_NVRTC_DEFINES -n 2 -x CUDA_VISIBLE_DEVICES=0 python3 -m cupy_symbuf.bench \
           --sizes 64K,1M,128M --no-reference --iters 200 --warmup 20 --profile --breakdown > $LOG/perf_$v.log 2>&1)
        echo "== [perf $v] rc=$?"; grep -E "^ *[0-9.]+ [KMG]iB|issue one call" $LOG/perf_$v.log | head -12
      done
      mps_off ;;
    soak)
      mps_on
      timeout ${SOAK_LIMIT:-240} $MPIRUN -n 2 -x CUDA_VISIBLE_DEVICES=0 python3 examples/soak.py --backend cuda --iters ${SOAK_ITERS:-10000} --check-every ${SOAK_CHECK:-10} > $LOG/soak.log 2>&1
      echo "== [soak] rc=$?"; grep -E "soak:|WRONG|mismatch|Error" $LOG/soak.log | tail -6
      mps_off ;;
    sanitize)
      STAGE_LIMIT=${SAN_LIMIT:-150} SAN_ITERS=${SAN_ITERS:-6} bash tests/faults/sanitize.sh; echo "== [sanitize] rc=$?" ;;
  esac
done
