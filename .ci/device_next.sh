#!/usr/bin/env bash
# Device calls written in the fourth session (no device) for the GPU code it built. Calls 1 and 2 ran in the fifth
# session (docs/benchmarks.md); call 3 and .ci/device_profile.py did not (the loans paused). The code covered:
# (issue 13's work-sharing ring kernel, issue 14's staged transport and hierarchical GPU form,
# the fused fp8 kernels). One H200, ranks under MPS. Each call keeps its stage timeouts under ~540 s in all, so
# that the device's 600 s limit never cuts it before the logs are packed: every log goes into one tarball in $OUT
# (the device returns only a few files), the summary lines to stdout ("== [what] rc=N", then pytest's summary or
# the bench rows). Run 1 first: a hang or a wrong result there decides what 2 and 3 are worth.
# Usage: bash .ci/device_next.sh 1    correctness of the new GPU code (about 7-8 minutes)
#        bash .ci/device_next.sh 2    numbers: bench --op adaptive, alltoall with / without work sharing, fp8 wire
#                                     dispatch, hierarchical and staged benches (about 7-8 minutes)
#        bash .ci/device_next.sh 3    the whole GPU suite at 2 ranks (regression of the merged tree, the fifth
#                                     session's DeltaExchange / wire fixes included), test_hierarchical at 4 ranks,
#                                     then bench --tune --transport staged (the staged entry of the tuning table)
#        bash .ci/device_next.sh 4    the core suites with the staged transport forced, then .ci/device_profile.py
#                                     (where the fp8 wire's and the hierarchical path's time goes)
set -uo pipefail
REAL_OUT=${OUT:-/tmp}
export OUT=/tmp/devlogs
mkdir -p $OUT
cd "$(dirname "$0")/.."
source .ci/device_env.sh
nvidia-cuda-mps-control -d 2>/dev/null && echo "MPS started"
df -h /dev/shm | tail -1  # the staged transport's window lives there (about 48 MiB per rank)
G="-x CUDA_VISIBLE_DEVICES=0 -x CUPY_SYMBUF_TEST_BACKENDS=cuda"
PT="python3 -m pytest -q -p no:cacheprovider"
case ${1:-1} in
  1)
    bash .ci/device_issue13.sh sass
    run adaptive4 110 $MPIRUN -n 4 $G $PT -x --timeout=100 tests/test_adaptive.py
    run adaptive8 100 $MPIRUN -n 8 $G $PT -x --timeout=100 tests/test_adaptive.py
    run adaptive4_repeat 50 $MPIRUN -n 4 $G $PT -x --timeout=50 tests/test_adaptive.py -k "skewed or differ"
    run hier4 80 $MPIRUN -n 4 $G $PT -x --timeout=80 tests/test_hierarchical.py
    run wire2 50 $MPIRUN -n 2 $G $PT -x --timeout=40 tests/test_wire.py tests/test_delta.py
    run staged1 30 env CUDA_VISIBLE_DEVICES=0 CUPY_SYMBUF_TEST_BACKENDS=cuda $PT -x --timeout=30 tests/test_staged.py
    run staged2 60 $MPIRUN -n 2 $G $PT -x --timeout=50 tests/test_staged.py
    run soak_adaptive 45 $MPIRUN -n 4 -x CUDA_VISIBLE_DEVICES=0 python3 examples/soak.py --backend cuda \
      --iters 2000 --check-every 5 --adaptive ;;
  2)
    TAIL=22 run bench_adaptive4 110 $MPIRUN -n 4 -x CUDA_VISIBLE_DEVICES=0 python3 -m cupy_symbuf.bench \
      --op adaptive --moe-tokens 4096 --iters 100 --warmup 5
    TAIL=22 run bench_adaptive8 110 $MPIRUN -n 8 -x CUDA_VISIBLE_DEVICES=0 python3 -m cupy_symbuf.bench \
      --op adaptive --moe-tokens 4096 --iters 100 --warmup 5
    for a in "" --adaptive; do
      TAIL=8 run a2a4$a 50 $MPIRUN -n 4 -x CUDA_VISIBLE_DEVICES=0 python3 -m cupy_symbuf.bench --sizes 1M,16M,128M \
        --iters 20 --warmup 3 --no-reference --no-energy $a
    done
    TAIL=16 run fp8 70 $MPIRUN -n 2 -x CUDA_VISIBLE_DEVICES=0 python3 -m cupy_symbuf.bench --op dispatch \
      --moe-tokens 4096,128 --wire fp8 --iters 50 --warmup 5 --no-energy
    TAIL=16 run hier_bench 60 $MPIRUN -n 4 -x CUDA_VISIBLE_DEVICES=0 python3 -m cupy_symbuf.bench --op hier \
      --node-size 2 --sizes 1M,16M --moe-tokens 128,1024 --iters 20 --warmup 3
    for t in ipc staged; do
      TAIL=8 run a2a_$t 40 $MPIRUN -n 2 -x CUDA_VISIBLE_DEVICES=0 python3 -m cupy_symbuf.bench --sizes 1M,16M \
        --iters 20 --warmup 3 --no-reference --no-energy --transport $t
    done ;;
  3)
    TAIL=12 run suite2 330 $MPIRUN -n 2 $G $PT --timeout=200 tests
    # the fifth session's host-only fixes of the hierarchical path (unusable after a failed agreement), at 2 x 2
    run hier4 80 $MPIRUN -n 4 $G $PT -x --timeout=80 tests/test_hierarchical.py
    # the staged transport's own layout (issue 14, a layout per link class): the entry lands in the tarball
    TAIL=14 run tune_staged 150 $MPIRUN -n 2 -x CUDA_VISIBLE_DEVICES=0 -x CUPY_SYMBUF_TUNING=$OUT/tuning_staged.json \
      python3 -m cupy_symbuf.bench --tune --transport staged --tune-rounds 1 --sizes 1M,16M --iters 10 --warmup 2 ;;
  4)
    TAIL=12 run suite2_staged 200 $MPIRUN -n 2 $G -x CUPY_SYMBUF_TRANSPORT=staged $PT --timeout=100 \
      tests/test_alltoall.py tests/test_symmetric.py tests/test_moe.py tests/test_low_latency.py
    TAIL=12 run profile_fp8 90 $MPIRUN -n 2 -x CUDA_VISIBLE_DEVICES=0 python3 .ci/device_profile.py fp8
    TAIL=40 run profile_hier 200 $MPIRUN -n 4 -x CUDA_VISIBLE_DEVICES=0 python3 .ci/device_profile.py hier ;;
esac
echo quit | nvidia-cuda-mps-control 2>/dev/null
tar czf $REAL_OUT/logs_call${1:-1}.tgz -C $OUT . 2>/dev/null && echo "logs: logs_call${1:-1}.tgz"
