#!/usr/bin/env bash
# The next GPU session's first device calls (written in the fourth session, which had no device): the GPU code of
# issues 13 and 14 that has never run on a GPU. One call each (under 10 minutes); every log goes into one tarball
# in $OUT (the device returns only a few files), the summary lines to stdout.
# Usage: bash .ci/device_next.sh 1    call 1: correctness (adaptive 4 + 8 ranks, staged 2 ranks, hierarchical
#                                            2 x 2 on one GPU under MPS, repeats of the adaptive tests)
#        bash .ci/device_next.sh 2    call 2: the GPU suite at 2 ranks with adaptive-free defaults (regression of the
#                                            merged tree), the staged transport forced over the suite
#        bash .ci/device_next.sh 3    call 3: numbers (bench --op adaptive at 2/4/8 ranks, uniform alltoall with and
#                                            without work sharing, fp8 dispatch, staged vs ipc bench, hierarchical
#                                            GPU bench)
# Read: every stage prints "== [what] rc=N" and then pytest's summary or the bench rows.
set -uo pipefail
REAL_OUT=${OUT:-/tmp}
export OUT=/tmp/devlogs
mkdir -p $OUT
cd "$(dirname "$0")/.."
source .ci/device_env.sh
nvidia-cuda-mps-control -d 2>/dev/null && echo "MPS started"
T() { local t=$1; shift; timeout $t "$@"; }
case ${1:-1} in
  1)
    bash .ci/device_issue13.sh sass tests
    T 150 $MPIRUN -n 4 -x CUDA_VISIBLE_DEVICES=0 -x CUPY_SYMBUF_TEST_BACKENDS=cuda python3 -m pytest -q -x \
      -p no:cacheprovider --timeout=120 tests/test_hierarchical.py > $OUT/hier4.log 2>&1
    echo "== [test_hierarchical.py, 4 ranks on cuda (2 x 2 virtual nodes)] rc=$?"; tail -4 $OUT/hier4.log
    T 120 $MPIRUN -n 2 -x CUDA_VISIBLE_DEVICES=0 -x CUPY_SYMBUF_TEST_BACKENDS=cuda python3 -m pytest -q -x \
      -p no:cacheprovider --timeout=100 tests/test_wire.py tests/test_delta.py > $OUT/wire2.log 2>&1
    echo "== [test_wire.py + test_delta.py, 2 ranks on cuda: the fused fp8 kernels] rc=$?"; tail -3 $OUT/wire2.log
    bash .ci/device_staged.sh fake staged2 ;;
  2)
    T 420 $MPIRUN -n 2 -x CUDA_VISIBLE_DEVICES=0 -x CUPY_SYMBUF_TEST_BACKENDS=cuda python3 -m pytest -q \
      -p no:cacheprovider --timeout=200 tests > $OUT/suite2.log 2>&1
    echo "== [GPU suite, 2 ranks] rc=$?"; grep -E "passed|failed|FAILED|Error" $OUT/suite2.log | tail -12
    bash .ci/device_staged.sh suite2
    T 150 $MPIRUN -n 4 -x CUDA_VISIBLE_DEVICES=0 python3 examples/soak.py --backend cuda --iters 3000 --check-every 5 \
      --adaptive > $OUT/soak_adaptive.log 2>&1
    echo "== [soak --adaptive, 4 ranks, 3000 iterations] rc=$?"; tail -2 $OUT/soak_adaptive.log ;;
  3)
    bash .ci/device_issue13.sh bench
    T 120 $MPIRUN -n 2 -x CUDA_VISIBLE_DEVICES=0 python3 -m cupy_symbuf.bench --op dispatch --moe-tokens 4096,128 \
      --wire fp8 --iters 50 --warmup 5 --no-energy > $OUT/fp8.log 2>&1
    echo "== [dispatch --wire fp8 (fused quantiser)] rc=$?"; grep -vE "^$|it/s" $OUT/fp8.log | tail -16
    bash .ci/device_staged.sh bench
    T 120 $MPIRUN -n 4 -x CUDA_VISIBLE_DEVICES=0 python3 -m cupy_symbuf.bench --op hier --node-size 2 --backend cuda \
      --sizes 1M,16M --moe-tokens 128,1024 --iters 20 --warmup 3 > $OUT/hier_bench.log 2>&1
    echo "== [bench --op hier, cuda, 2 x 2] rc=$?"; grep -vE "^$|it/s" $OUT/hier_bench.log | tail -16 ;;
esac
echo quit | nvidia-cuda-mps-control 2>/dev/null
tar czf $REAL_OUT/logs_call${1:-1}.tgz -C $OUT . 2>/dev/null && echo "logs: logs_call${1:-1}.tgz"
