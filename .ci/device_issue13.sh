#!/usr/bin/env bash
# Issue 13's adaptive channels on one H200 (one device call), under MPS. Written in the fourth session (no device);
# the fifth session ran its sass stage and the equivalent tests and bench through .ci/device_next.sh 1 and 2.
# Usage: bash .ci/device_issue13.sh [stage...]   stages: sass tests bench trace (default: all four)
#   sass   ptxas of the work-sharing build (registers, spills, shared memory) beside the default build
#   tests  tests/test_adaptive.py (every MoE case of test_moe.py on a work-sharing communicator, skewed alltoallv,
#          the cuda-only checks: work_sharing on, stolen chunks > 0 on the hot stream) with test_moe.py and
#          test_alltoall.py at 4 and 8 ranks, then 3 repeats of test_adaptive.py at 4 ranks (a change is a race)
#   bench  python -m cupy_symbuf.bench --op adaptive at 4 and 8 ranks: uniform, zipf1.0, zipf1.5, hot; p50 / p99,
#          static and adaptive interleaved (target: p99_gain >= 1.3 on the skewed patterns, ~1.0 on uniform)
#   trace  the skewed trace run with adaptive on: busy time per channel and warp group (Config(trace=True))
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
STAGES=${*:-sass tests bench trace}
nvidia-cuda-mps-control -d 2>/dev/null && echo "MPS started"
for stage in $STAGES; do
  case $stage in
    sass)
      python3 - > $LOG/adaptive_sass.log 2>&1 <<'PY'
import subprocess
from cupy_symbuf.transport import kernels as _kernels
for d in [("-DSYMBUF_MAX_THREADS=512",), ("-DSYMBUF_ADAPTIVE=1", "-DSYMBUF_MAX_THREADS=512"),
          ("-DSYMBUF_MAX_THREADS=1024",), ("-DSYMBUF_ADAPTIVE=1", "-DSYMBUF_MAX_THREADS=1024")]:
    open("/tmp/k.ptx", "w").write(_kernels.compile_ptx("ring_exchange.cu", "compute_90", defines=d))
    r = subprocess.run(["ptxas", "-arch=sm_90", "-v", "/tmp/k.ptx", "-o", "/tmp/k.cubin"], capture_output=True, text=True)
    lines = r.stderr.splitlines()
    i = next(i for i, l in enumerate(lines) if "symbuf_ring_exchange" in l)
    print(d, *lines[i + 2: i + 4], sep="\n  ")
PY
      echo "== [sass] rc=$?"; cat $LOG/adaptive_sass.log ;;
    tests)
      for n in 4 8; do
        timeout 240 $MPIRUN -n $n -x CUDA_VISIBLE_DEVICES=0 -x CUPY_SYMBUF_TEST_BACKENDS=cuda python3 -m pytest -q -x \
          -p no:cacheprovider --timeout=200 tests/test_adaptive.py tests/test_moe.py tests/test_alltoall.py \
          > $LOG/adaptive_tests_$n.log 2>&1
        echo "== [tests $n ranks] rc=$?"; tail -4 $LOG/adaptive_tests_$n.log
      done
      for k in 1 2 3; do
        timeout 120 $MPIRUN -n 4 -x CUDA_VISIBLE_DEVICES=0 -x CUPY_SYMBUF_TEST_BACKENDS=cuda python3 -m pytest -q -x \
          -p no:cacheprovider --timeout=100 tests/test_adaptive.py > $LOG/adaptive_rep.log 2>&1
        echo "== [repeat $k] rc=$?"; tail -1 $LOG/adaptive_rep.log
      done ;;
    bench)
      for n in 2 4; do  # uniform alltoall with and without work sharing (2 ranks: only the self warps can help)
        for a in "" --adaptive; do
          timeout 120 $MPIRUN -n $n -x CUDA_VISIBLE_DEVICES=0 python3 -m cupy_symbuf.bench --sizes 1M,16M,128M \
            --iters 20 --warmup 3 --no-reference --no-energy $a > $LOG/a2a_$n$a.log 2>&1
          echo "== [alltoall $n ranks $a] rc=$?"; grep -E "MiB|KiB" $LOG/a2a_$n$a.log | tail -8
        done
      done
      for n in 2 4 8; do
        timeout 240 $MPIRUN -n $n -x CUDA_VISIBLE_DEVICES=0 python3 -m cupy_symbuf.bench --op adaptive \
          --moe-tokens ${MOE_TOKENS:-4096} --iters ${ITERS:-200} --warmup 5 --json $LOG/adaptive_$n.json \
          > $LOG/adaptive_bench_$n.log 2>&1
        echo "== [bench --op adaptive, $n ranks] rc=$?"; grep -vE "^$|it/s" $LOG/adaptive_bench_$n.log | tail -20
      done ;;
    trace)
      timeout 150 $MPIRUN -n 4 -x CUDA_VISIBLE_DEVICES=0 -x CUPY_SYMBUF_TRACE_ADAPTIVE=1 python3 .ci/gpu_trace.py \
        > $LOG/adaptive_trace.log 2>&1
      echo "== [trace adaptive 4 ranks] rc=$?"; tail -30 $LOG/adaptive_trace.log ;;
  esac
done
echo quit | nvidia-cuda-mps-control 2>/dev/null
