#!/usr/bin/env bash
# Branch fp8-direct (fifth session, no device left to run it): the fp8 wire's quantiser reads float16 / bfloat16
# rows and its dequantiser writes them, with no float32 temporary (cuda_src/quant.cu, quant.quantize_fp8_from /
# dequantize_fp8_to). One device call: the bit-for-bit tests, then the dispatch bench beside the plain path.
# Merge the branch only if both pass: the tests, and cached fp8 at 4096 tokens faster than main's 1263 us p50.
# Usage: bash .ci/device_fp8_direct.sh
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
nvidia-cuda-mps-control -d 2>/dev/null && echo "MPS started"
G="-x CUDA_VISIBLE_DEVICES=0 -x CUPY_SYMBUF_TEST_BACKENDS=cuda"
timeout 120 $MPIRUN -n 2 $G python3 -m pytest -q -x -p no:cacheprovider --timeout=100 tests/test_wire.py \
  > $LOG/fp8_direct_tests.log 2>&1
echo "== [tests] rc=$?"; tail -3 $LOG/fp8_direct_tests.log
timeout 150 $MPIRUN -n 2 -x CUDA_VISIBLE_DEVICES=0 python3 -m cupy_symbuf.bench --op dispatch --moe-tokens 4096,128 \
  --wire fp8 --iters 50 --warmup 5 --no-energy > $LOG/fp8_direct_bench.log 2>&1
echo "== [bench --op dispatch --wire fp8] rc=$?"; grep -vE "^$|it/s" $LOG/fp8_direct_bench.log | tail -20
echo quit | nvidia-cuda-mps-control 2>/dev/null
