#!/usr/bin/env bash
# Issues 12 and 14 on one H200 (one device call), 2 ranks under MPS: the bench's energy (NVML), CUDA-aware MPI
# (mpi-cuda) and vs_peer columns; the dispatch bench with the low-latency rows; topology discovery on the cuda backend.
# Usage: bash .ci/device_issue12.sh [stage...]   stages: energy ll topo trace json adv mpi examples (default: the first four)
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
      timeout 150 $MPIRUN -n ${TRACE_RANKS:-4} -x CUDA_VISIBLE_DEVICES=0 python3 .ci/gpu_trace.py > $LOG/trace.log 2>&1
      echo "== [trace ${TRACE_RANKS:-4} ranks] rc=$?"; tail -40 $LOG/trace.log; ls /tmp/symbuf_trace/diag
      cp /tmp/symbuf_trace/diag/channels.png $LOG/gpu-trace-channels.png 2>/dev/null ;;
    json)  # the bench's table, JSON and plots in one call
      timeout 120 $R python3 -m cupy_symbuf.bench --sizes 4K,64K,1M,16M,128M --iters 20 --warmup 3 \
        --json $LOG/bench.json --plot $LOG/plots > $LOG/bench_json.log 2>&1
      echo "== [bench --json --plot] rc=$?"; grep -vE "^$|it/s" $LOG/bench_json.log | tail -30; ls -la $LOG/plots ;;
    adv)  # issue 13 on the GPU: fp8 wire dispatch, delta exchange, relaxed sync, skewed alltoallv
      timeout 120 $R python3 -m cupy_symbuf.bench --op dispatch --moe-tokens 4096,128 --wire fp8 --iters 50 --warmup 5 \
        --no-energy > $LOG/adv_fp8.log 2>&1; echo "== [dispatch --wire fp8] rc=$?"; grep -vE "^$|it/s" $LOG/adv_fp8.log | tail -16
      timeout 90 $R python3 -m cupy_symbuf.bench --op delta --sizes 1M,16M --iters 20 --warmup 3 > $LOG/adv_delta.log 2>&1
      echo "== [delta] rc=$?"; grep -vE "^$|it/s" $LOG/adv_delta.log | tail -8
      timeout 90 $R python3 -m cupy_symbuf.bench --sizes 16M,128M --sends sym --relaxed --iters 20 --warmup 3 --no-energy \
        --no-reference > $LOG/adv_relaxed.log 2>&1; echo "== [relaxed] rc=$?"; grep -E "MiB" $LOG/adv_relaxed.log
      timeout 90 $R python3 -m cupy_symbuf.bench --op alltoallv --patterns uniform,zipf,hot --sizes 16M --iters 50 \
        --warmup 3 > $LOG/adv_a2av.log 2>&1; echo "== [alltoallv patterns] rc=$?"; grep -vE "^$|it/s" $LOG/adv_a2av.log | tail -12 ;;
    mpi)  # CUDA-aware MPI forced (the library's query says no): does Open MPI move device arrays anyway?
      timeout 60 $R -x CUPY_SYMBUF_MPI_CUDA=1 python3 -m cupy_symbuf.bench --sizes 1M,16M --references mpi --iters 10 \
        --warmup 2 --no-energy > $LOG/mpi_forced.log 2>&1; echo "== [mpi-cuda forced] rc=$?"; grep -vE "^$|it/s" $LOG/mpi_forced.log | tail -12 ;;
    examples)
      for ex in examples/*.py; do
        a=""; [ "$(basename $ex)" = soak.py ] && a="--iters ${SOAK_ITERS:-2000}"
        timeout 120 $R python3 $ex $a > $LOG/ex_$(basename $ex .py).log 2>&1
        echo "== [$ex] rc=$?"; tail -${EX_TAIL:-4} $LOG/ex_$(basename $ex .py).log
      done ;;
  esac
done
echo quit | nvidia-cuda-mps-control 2>/dev/null
