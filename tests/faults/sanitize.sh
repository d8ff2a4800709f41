#!/usr/bin/env bash
# compute-sanitizer over the GPU path (`make sanitize`, `.ci/device.sh sanitize`; run on the GPU machine from the source tree, with
# Open MPI's mpirun): memcheck, racecheck, synccheck and initcheck over a small soak run (alltoall, alltoallv with
# and without recv_counts, get_dispatch_layout / dispatch / combine / cached dispatch, checked bitwise every
# iteration) at 1 rank and at 2 ranks, CuPy's memory pool off (CUPY_SYMBUF_SOAK_NO_POOL=1) so that an out-of-bounds
# write is visible; then the misuse of recv_counts (recv_counts[rank] != send_counts[rank]) under memcheck, which
# must be a clean ValueError. Logs: ${OUT:-/tmp}/sanitize_<tool>_n<ranks>.log; prints each run's SUMMARY lines.
# Knobs: TOOLS="memcheck racecheck synccheck initcheck", RANKS="1 2", SAN_ITERS=20, SAN_ROWS=64, STAGE_LIMIT=600,
#        LEAKS=1 (0: memcheck without --leak-check, out-of-bounds and misaligned accesses only),
#        MISUSE=1 (0 skips it). 2 ranks go one per GPU when there are 2 GPUs, else both on GPU 0 (no MPS: the tool
#        may refuse it; the spinning kernels are then time-sliced, so the timeout is generous).
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export CUPY_SYMBUF_SOAK_NO_POOL=1 CUPY_SYMBUF_TIMEOUT_S=${CUPY_SYMBUF_TIMEOUT_S:-180}
LOG=${OUT:-/tmp}
TOOLS=${TOOLS:-memcheck racecheck synccheck initcheck}
RANKS=${RANKS:-1 2}
SAN=${COMPUTE_SANITIZER:-compute-sanitizer}
MPIRUN="mpirun --oversubscribe --bind-to none -x PYTHONPATH -x PYTHONUNBUFFERED -x CUPY_SYMBUF_SOAK_NO_POOL -x CUPY_SYMBUF_TIMEOUT_S -x NCCL_NVLS_ENABLE"
SOAK="python3 examples/soak.py --backend cuda --iters ${SAN_ITERS:-20} --max-rows ${SAN_ROWS:-64} --check-every 1"
command -v "$SAN" >/dev/null || { echo "sanitize: $SAN not found (CUDA toolkit's compute-sanitizer)"; exit 2; }
fail=0
run() {  # log name, expected app exit status, command...
  local name=$1 want=$2; shift 2
  local log="$LOG/sanitize_$name.log" t0=$SECONDS
  echo "== [$name] $*"
  timeout "${STAGE_LIMIT:-600}" "$@" > "$log" 2>&1
  local rc=$?
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|soak:|CAUGHT|WRONG DATA" "$log" | sort | uniq -c | sed 's/^/   /'
  # every tool run must report 0 errors; the app must exit as expected
  local bad
  bad=$(grep -E "ERROR SUMMARY: [1-9]|RACECHECK SUMMARY: .*\([1-9][0-9]* error" "$log" | head -1)
  echo "== [$name] rc=$rc (want $want) in $((SECONDS - t0)) s${bad:+  <- $bad}"
  if [ "$rc" -ne "$want" ] || [ -n "$bad" ] || ! grep -qE "ERROR SUMMARY|RACECHECK SUMMARY" "$log"; then
    fail=1; tail -30 "$log"
  fi
}
for tool in $TOOLS; do
  extra=""
  [ "$tool" = memcheck ] && [ "${LEAKS:-1}" = 1 ] && extra="--leak-check full"  # LEAKS=0: accesses only
  [ "$tool" = racecheck ] && extra="--racecheck-report all"
  for n in $RANKS; do
    if [ "$n" -eq 1 ]; then
      run "${tool}_n1" 0 $SAN --tool "$tool" $extra $SOAK
    else
      run "${tool}_n$n" 0 $MPIRUN -n "$n" $SAN --tool "$tool" $extra $SOAK
    fi
  done
done
if [ "${MISUSE:-1}" = 1 ]; then   # recv_counts misuse: must be a ValueError on every rank, no write out of bounds
  export CUPY_SYMBUF_FAULT_BACKEND=cuda CUPY_SYMBUF_ABORT_ON_FAILURE=0
  run misuse_memcheck_n1 0 $SAN --tool memcheck python3 tests/faults/fault_cases.py recv_self_off
  run misuse_memcheck_n2 0 $MPIRUN -x CUPY_SYMBUF_FAULT_BACKEND -x CUPY_SYMBUF_ABORT_ON_FAILURE -n 2 \
      $SAN --tool memcheck python3 tests/faults/fault_cases.py recv_self_off
fi
echo "sanitize: $([ $fail -eq 0 ] && echo clean || echo FAILED) (logs in $LOG/sanitize_*.log)"
exit $fail
