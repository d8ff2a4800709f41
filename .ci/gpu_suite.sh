#!/usr/bin/env bash
# GPU test suite, run from the source tree on a GPU machine with Open MPI (the device machine):
#   1 rank; one rank per GPU; one rank per GPU with CUDA_VISIBLE_DEVICES set per rank (every rank sees ordinal 0);
#   2, 4 and 8 ranks on GPU 0 under MPS. Logs go to ${OUT:-/tmp}/gpu_*.log.
# Usage: bash .ci/gpu_suite.sh [stage...]   stages: single multi cvd mps examples bench sweep (default: the four tests)
#        node = the whole one-node session in one call (issue 4: 8 or 4 GPUs, one rank per GPU):
#               single multi cvd examples bench; the bench times NCCL in the same run.
#        x2 = multi cvd examples bench (one call on nvidia-h200-x2); h200 = mps single (one call on nvidia-h200).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export CUPY_SYMBUF_TIMEOUT_S=${CUPY_SYMBUF_TIMEOUT_S:-20}
LOG=${OUT:-/tmp}
NGPU=$(nvidia-smi -L | grep -c GPU)
MPIRUN="mpirun --oversubscribe --bind-to none -x PYTHONPATH -x PYTHONUNBUFFERED -x NCCL_NVLS_ENABLE -x TORCH_SYMM_MEM_DISABLE_MULTICAST -x NVSHMEM_DISABLE_NVLS -x CUPY_SYMBUF_TIMEOUT_S"
PYTEST="python3 -m pytest -q --color=no -p no:cacheprovider --timeout=${TEST_TIMEOUT:-120} ${PYTEST_ARGS:-}"
TESTS=${TESTS:-tests}
STAGES=${*:-single multi cvd mps}
STAGES=${STAGES/node/single multi cvd examples bench}
STAGES=${STAGES/x2/multi cvd examples bench}   # one call on nvidia-h200-x2
STAGES=${STAGES/h200/mps single}               # one call on nvidia-h200
fail=0
run() {  # name, command...
  local name=$1; shift
  echo "== [$name] $*"
  local t0=$SECONDS
  timeout ${STAGE_LIMIT:-300} "$@" > "$LOG/gpu_$name.log" 2>&1
  local rc=$?
  grep -E "passed|failed|error|PASSED|FAILED|Error" "$LOG/gpu_$name.log" | tail -4
  echo "== [$name] rc=$rc in $((SECONDS - t0)) s"
  [ $rc -eq 0 ] || { fail=1; tail -40 "$LOG/gpu_$name.log"; }
}
for stage in $STAGES; do
  case $stage in
    single) run single $PYTEST $TESTS ;;
    multi) [ "$NGPU" -ge 2 ] && run multi$NGPU $MPIRUN -n $NGPU $PYTEST $TESTS ;;
    cvd)   [ "$NGPU" -ge 2 ] && run cvd$NGPU $MPIRUN -n $NGPU bash -c 'export CUDA_VISIBLE_DEVICES=$OMPI_COMM_WORLD_LOCAL_RANK; exec '"$PYTEST $TESTS" ;;
    mps)
      nvidia-cuda-mps-control -d && echo "MPS started"
      for n in ${MPS_RANKS:-2 4 8}; do
        run mps$n $MPIRUN -n $n -x CUDA_VISIBLE_DEVICES=0 $PYTEST $TESTS
      done
      echo quit | nvidia-cuda-mps-control ;;
    examples)
      run example_alltoall $MPIRUN -n $NGPU python3 examples/alltoall.py
      [ -f examples/moe_layer.py ] && run example_moe $MPIRUN -n $NGPU python3 examples/moe_layer.py ;;
    bench) run bench $MPIRUN -n $NGPU python3 -m cupy_symbuf.bench --breakdown --profile --sizes ${BENCH_SIZES:-1M,16M,128M,1G} ;;
    sweep)  # Config and compile-time sweep, entries "NVRTC_DEFINES|bench args" (each size checked against NumPy
            # before it is timed); NCCL once, in the bench stage
      IFS=';' read -ra CFGS <<< "${SWEEP:-|--num-sms 32;|--num-sms 48;-DSYMBUF_MAX_THREADS=512|--num-sms 24;-DSYMBUF_MAX_THREADS=512|--num-sms 32;-DSYMBUF_MAX_THREADS=512|--num-sms 48}"
      for cfg in "${CFGS[@]}"; do
        name="sweep${cfg//[ |=-]/}"
        CUPY_SYMBUF_NVRTC_DEFINES="${cfg%%|*}" run "$name" $MPIRUN -x CUPY_SYMBUF_NVRTC_DEFINES -n $NGPU python3 -m cupy_symbuf.bench --no-reference --breakdown --sizes 16M,128M,1G ${cfg#*|}
        echo "   [$cfg]"; grep -E "ours|registers" "$LOG/gpu_$name.log"
      done ;;
  esac
done
exit $fail
