# Sourced by the .ci/device_issue9*.sh scripts (GPU machine, Open MPI as root): the environment, the launcher
# and the fault-case launcher they share. NVLink multicast stays off (the device tool's rule).
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 CUPY_SYMBUF_ABORT_ON_FAILURE=0
export CUPY_SYMBUF_TIMEOUT_S=${CUPY_SYMBUF_TIMEOUT_S:-30}
LOG=${OUT:-/tmp}
MPIRUN="mpirun --oversubscribe --bind-to none -x PYTHONPATH -x PYTHONUNBUFFERED -x NCCL_NVLS_ENABLE -x CUPY_SYMBUF_ABORT_ON_FAILURE -x CUPY_SYMBUF_TIMEOUT_S"
FAULT_MPIEXEC="mpirun --oversubscribe --bind-to none -x PYTHONPATH -x CUPY_SYMBUF_ABORT_ON_FAILURE -x CUPY_SYMBUF_FAULT_BACKEND"
# run NAME SECONDS command...: one stage of a device call, its log in $OUT/NAME.log, its rc and last ${TAIL:-4} lines
# (pytest's summary, a bench's rows) on stdout (device_next.sh, device_issue15.sh)
run() {
  local name=$1 t=$2; shift 2
  timeout $t "$@" > $OUT/$name.log 2>&1
  echo "== [$name] rc=$?"; grep -avE "^$|it/s" $OUT/$name.log | tail -${TAIL:-4}
}
