#!/usr/bin/env bash
# Issue 11 on one H200 (one device call): the direct-mode and alltoall tests on 1 rank, the whole suite at 2 ranks
# under MPS, the direct-mode tests at 4 ranks, then the alltoall bench (plain / out= / symmetric, share of the copy
# rate measured in the same run) at 2, 4 and 8 ranks under MPS.
# Usage: bash .ci/device_issue11.sh [stage...]   stages: quick suite2 quickN (N ranks) bench sms tune ce exp control moe sass bulk
# (default: quick suite2 quick4 bench)
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
STAGES=${*:-quick suite2 quick4 bench}
mps_on() { nvidia-cuda-mps-control -d 2>/dev/null && echo "MPS started"; }
mps_off() { echo quit | nvidia-cuda-mps-control 2>/dev/null; sleep 1; }
QUICK=${QUICK:-"tests/test_symmetric.py tests/test_alltoall.py tests/test_kernels_compile.py"}
PYTEST="python3 -m pytest -q --color=no -p no:cacheprovider --timeout=${TEST_TIMEOUT:-90}"
show() { grep -E "passed|failed|^E |FAILED|Error|rror:" "$1" | head -${2:-20}; }
for stage in $STAGES; do
  t0=$SECONDS
  case $stage in
    quick)
      timeout ${QUICK_LIMIT:-120} $PYTEST -x $QUICK > $LOG/quick1.log 2>&1
      echo "== [quick 1 rank] rc=$? $((SECONDS - t0)) s"; show $LOG/quick1.log ;;
    suite2)
      mps_on
      timeout ${SUITE_LIMIT:-240} $MPIRUN -n 2 -x CUDA_VISIBLE_DEVICES=0 $PYTEST ${SUITE_ARGS:-tests} > $LOG/suite2.log 2>&1
      echo "== [suite 2 ranks MPS] rc=$? $((SECONDS - t0)) s"; show $LOG/suite2.log 30
      mps_off ;;
    quick[0-9])  # quickN: the quick tests at N ranks under MPS
      n=${stage#quick}
      mps_on
      timeout ${QUICK_LIMIT:-120} $MPIRUN -n $n -x CUDA_VISIBLE_DEVICES=0 -x CUPY_SYMBUF_NVRTC_DEFINES="${DEFINES:-}" $PYTEST -x $QUICK > $LOG/$stage.log 2>&1
      echo "== [quick $n ranks MPS] rc=$? $((SECONDS - t0)) s"; show $LOG/$stage.log
      mps_off ;;
    tune)  # bench --tune at 2 and 4 ranks under MPS, merged into a copy of the packaged table under $LOG
      cp cupy_symbuf/tuning.json $LOG/tuning.json
      mps_on
      for n in ${TUNE_RANKS:-2 4}; do
        timeout ${BENCH_LIMIT:-90} $MPIRUN -n $n -x CUDA_VISIBLE_DEVICES=0 python3 -m cupy_symbuf.bench --tune \
          --tune-rounds 1 --sizes ${TUNE_SIZES:-1M,16M,128M} --iters 10 --warmup 2 --tune-out $LOG/tuning.json > $LOG/tune_$n.log 2>&1
        echo "== [tune $n ranks] rc=$?"; grep -vE "^$" $LOG/tune_$n.log | tail -14
      done
      mps_off ;;
    control)
      mps_on
      timeout ${BENCH_LIMIT:-90} $MPIRUN -n 2 -x CUDA_VISIBLE_DEVICES=0 python3 -m cupy_symbuf.bench --control --iters 30 \
        --warmup 5 > $LOG/control_2.log 2>&1
      echo "== [control 2 ranks] rc=$?"; grep -vE "^$" $LOG/control_2.log | tail -20
      mps_off ;;
    ce)  # the copy-engine alltoall (Config.mode="copy_engine") at 2, 4 and 8 ranks
      mps_on
      for n in ${BENCH_RANKS:-2 4 8}; do
        timeout ${BENCH_LIMIT:-90} $MPIRUN -n $n -x CUDA_VISIBLE_DEVICES=0 python3 -m cupy_symbuf.bench --no-reference \
          --mode copy_engine --sends sym --sizes ${BENCH_SIZES:-16M,128M} --iters ${ITERS:-20} --warmup 3 > $LOG/ce_$n.log 2>&1
        echo "== [copy engines $n ranks] rc=$?"; grep -E "MiB|KiB|GiB|registers|num_channels" $LOG/ce_$n.log
      done
      mps_off ;;
    exp)  # the copy-engine rate beside ours (crossover), 16-deep unrolled copies, EP8 memory built at 8 ranks
      mps_on
      B="python3 -m cupy_symbuf.bench --no-reference --timing loop --iters ${ITERS:-20} --warmup 3"
      timeout 90 $MPIRUN -n 2 -x CUDA_VISIBLE_DEVICES=0 $B --num-sms 64 --chunk-bytes 128K --sends out,sym,ce \
        --sizes 1M,4M,16M,64M,128M,512M > $LOG/exp_ce2.log 2>&1
      echo "== [ce, 2 ranks, 64 SMs] rc=$?"; grep -E "MiB|KiB|GiB|regist" $LOG/exp_ce2.log
      timeout 90 $MPIRUN -n 2 -x CUDA_VISIBLE_DEVICES=0 -x CUPY_SYMBUF_NVRTC_DEFINES=-DSYMBUF_UNROLL=16 $B --num-sms 64 \
        --chunk-bytes 128K --sends out,sym --sizes 16M,128M > $LOG/exp_u16_2.log 2>&1
      echo "== [unroll 16, 2 ranks, 64 SMs] rc=$?"; grep -E "MiB|KiB|GiB|regist" $LOG/exp_u16_2.log
      timeout 90 $MPIRUN -n 8 -x CUDA_VISIBLE_DEVICES=0 $B --sends out,sym,ce --sizes 16M,128M > $LOG/exp_ce8.log 2>&1
      echo "== [ce, 8 ranks] rc=$?"; grep -E "MiB|KiB|GiB|regist" $LOG/exp_ce8.log
      timeout 90 $MPIRUN -n 8 -x CUDA_VISIBLE_DEVICES=0 -x CUPY_SYMBUF_NVRTC_DEFINES=-DSYMBUF_UNROLL=16 $B --sends out,sym \
        --sizes 16M,128M > $LOG/exp_u16_8.log 2>&1
      echo "== [unroll 16, 8 ranks] rc=$?"; grep -E "MiB|KiB|GiB|regist" $LOG/exp_u16_8.log
      timeout 60 $MPIRUN -n 8 -x CUDA_VISIBLE_DEVICES=0 python3 .ci/ep8_memory.py > $LOG/ep8.log 2>&1
      echo "== [EP8 memory, 8 ranks] rc=$?"; tail -4 $LOG/ep8.log
      mps_off ;;
    sms)  # symmetric vs plain at 2 ranks with more SMs (channels)
      mps_on
      for sms in ${SMS:-48 64}; do
        timeout ${BENCH_LIMIT:-90} $MPIRUN -n 2 -x CUDA_VISIBLE_DEVICES=0 python3 -m cupy_symbuf.bench --no-reference \
          --sizes ${BENCH_SIZES:-16M,128M} --iters ${ITERS:-20} --warmup 3 --num-sms $sms --timing loop > $LOG/sms_$sms.log 2>&1
        echo "== [bench 2 ranks --num-sms $sms] rc=$?"; grep -vE "^$" $LOG/sms_$sms.log | grep -v sizes | tail -12
      done
      mps_off ;;
    sass)  # registers, spills and SASS of the ring kernel, default and bulk (cp.async.bulk) builds, via ptxas
      for v in default bulk; do
        d=""; [ $v = bulk ] && d="-DSYMBUF_BULK=1"
        python3 -c "import sys; from cupy_symbuf import _kernels; sys.stdout.write(_kernels.compile_ptx('ring_exchange.cu', 'compute_90', defines=tuple('$d -DSYMBUF_MAX_THREADS=512'.split())))" > $LOG/ring_$v.ptx
        ptxas -arch=sm_90 -v $LOG/ring_$v.ptx -o $LOG/ring_$v.cubin 2>&1 | grep -A2 symbuf_ring_exchange | head -4
        cuobjdump -sass $LOG/ring_$v.cubin > $LOG/ring_$v.sass 2>&1
        echo "== [sass $v] UBLKCP $(grep -c UBLKCP $LOG/ring_$v.sass) SYNCS $(grep -c SYNCS $LOG/ring_$v.sass) LDG.E.128 $(grep -c 'LDG.E.*128' $LOG/ring_$v.sass) STG.E.128 $(grep -c 'STG.E.*128' $LOG/ring_$v.sass)"
      done ;;
    bulk)  # alltoall (plain / out= / symmetric) and dispatch with and without bulk copies, same call, BENCH_RANKS
      mps_on
      for n in ${BENCH_RANKS:-2 4 8}; do
        for d in "" "-DSYMBUF_BULK=1"; do
          timeout ${BENCH_LIMIT:-90} $MPIRUN -n $n -x CUDA_VISIBLE_DEVICES=0 -x CUPY_SYMBUF_NVRTC_DEFINES="$d" python3 -m cupy_symbuf.bench \
            --no-reference --timing loop --sizes ${BENCH_SIZES:-16M,128M} --iters ${ITERS:-20} --warmup 3 ${BULK_ARGS:-} > $LOG/bulk_$n${d:+_on}.log 2>&1
          echo "== [alltoall $n ranks ${d:-register copy}] rc=$?"; grep -E "MiB|KiB|GiB|regist" $LOG/bulk_$n${d:+_on}.log
        done
      done
      mps_off ;;
    moe)  # bench --op dispatch (plain, cached, into a symmetric out: direct mode) at BENCH_RANKS ranks
      mps_on
      for n in ${BENCH_RANKS:-2 4 8}; do
        timeout ${BENCH_LIMIT:-120} $MPIRUN -n $n -x CUDA_VISIBLE_DEVICES=0 -x CUPY_SYMBUF_NVRTC_DEFINES="${DEFINES:-}" python3 -m cupy_symbuf.bench --op dispatch \
          --moe-tokens ${MOE_TOKENS:-4096,128} --dtype float16 --iters ${ITERS:-50} --warmup 5 ${MOE_ARGS:-} > $LOG/moe_$n.log 2>&1
        echo "== [dispatch bench $n ranks MPS] rc=$?"; grep -vE "^$" $LOG/moe_$n.log | tail -${MOE_TAIL:-16}
      done
      mps_off ;;
    bench)
      mps_on
      for n in ${BENCH_RANKS:-2 4 8}; do
        t1=$SECONDS
        timeout ${BENCH_LIMIT:-90} $MPIRUN -n $n -x CUDA_VISIBLE_DEVICES=0 python3 -m cupy_symbuf.bench \
          --sizes ${BENCH_SIZES:-16M,128M} --iters ${ITERS:-20} --warmup 3 ${BENCH_ARGS:-} > $LOG/bench_$n.log 2>&1
        echo "== [bench $n ranks MPS] rc=$? $((SECONDS - t1)) s"; grep -vE "^$" $LOG/bench_$n.log | tail -16
      done
      mps_off ;;
  esac
done
