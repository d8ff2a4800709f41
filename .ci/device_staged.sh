#!/usr/bin/env bash
# Issue 14 on the GPU machine: the staged transport (Config.transport="staged": the symmetric buffer in pinned host
# memory, cudaHostRegister'ed and mapped into every GPU). Written without a GPU; this is its first device run.
#
# Usage: bash .ci/device_staged.sh [stage...]
#   stages: fake staged1 staged2 suite2 info bench   (default: all of them, in that order; about 6-8 minutes)
# Ranks: with 2 or more GPUs the 2 ranks get one GPU each (utils.select_device), no MPS: the real case, each GPU
# writes host memory the other reads. With one GPU both ranks share GPU 0 under MPS (like .ci/device_issue11.sh).
#
# How to read the output (every stage prints "== [stage] rc=N seconds" and then the pytest summary lines or rows;
# the full logs are in $OUT, named after the stage):
#   fake     tests/test_staged.py at 1 rank: the host tests (decision over fake topologies, the SymBuffer
#            construction with a fake CUDA runtime) and the GPU tests at 1 rank. Expect "N passed", 0 failed.
#   staged1  the same file at 1 rank with the real GPU only (CUPY_SYMBUF_TEST_BACKENDS=cuda).
#   staged2  tests/test_staged.py under mpirun -n 2: a staged cuda Communicator's alltoall (1 B, 1000 B, 3 MiB per
#            peer), alltoallv, symmetric sendbuf (direct mode from host memory), MoE dispatch / combine against
#            NumPy; the real IPC fallback (rank 1's ipcOpenMemHandle made to fail: both ranks must come up
#            "staged" with "CUDA IPC failed" in the reason); "auto transport on this machine: (...)" printed by
#            rank 0 says what auto picks here (H200s with NVLink, or MPS on one GPU: expect "ipc").
#            Expect 0 failed, 0 skipped among the gpu tests (test_gpu_*). A hang ends at the 90 s pytest timeout:
#            then look for SymBufferTimeoutError (a flag or a tail not seen over PCIe: a memory-ordering problem).
#   suite2   the existing GPU tests with every cuda Communicator forced staged (CUPY_SYMBUF_TRANSPORT=staged) at
#            2 ranks: alltoall, symmetric arrays, MoE (incl. device control, graphs), low-latency, lifecycle,
#            streams. Any failure here that does not fail with the env unset is a staged-transport bug. Known
#            suspects to look at first: the low-latency kernel's red.add / atomicOr on host-mapped memory (GPU
#            atomics on mapped host memory are atomic only for that GPU), cp.async.bulk builds (off by default),
#            cudaMemcpy with memcpyDeviceToHost / HostToDevice kinds on the abort line (a host-mapped address),
#            tests that assume the rings are GPU memory (memGetInfo deltas, IPC-specific asserts).
#   info     python -m cupy_symbuf info --backend cuda at 2 ranks, --transport staged and auto: the
#            "transport: requested ..., from the topology: ..." line and "communicator: ... transport=staged
#            (requested ...)" / "transport=ipc (...)".
#   bench    alltoall bench at 2 ranks, ipc then staged (--no-reference, loop timing): the price of staging.
#            Expect staged busbw bounded by PCIe (tens of GB/s at most) against hundreds over NVLink; record both
#            tables in docs/perf-notes.md.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
STAGES=${*:-fake staged1 staged2 suite2 info bench}
PYTEST="python3 -m pytest -q --color=no -p no:cacheprovider --timeout=${TEST_TIMEOUT:-90} -rs"
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c "^GPU")
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
echo "GPUs: $NGPU"
nvidia-smi topo -m 2>/dev/null | head -6
if [ "${NGPU:-0}" -ge 2 ]; then
  RUN2="$MPIRUN -n 2 -x CUPY_SYMBUF_TRANSPORT -x CUPY_SYMBUF_TEST_BACKENDS"
  mps_on() { :; }; mps_off() { :; }
else
  RUN2="$MPIRUN -n 2 -x CUDA_VISIBLE_DEVICES=0 -x CUPY_SYMBUF_TRANSPORT -x CUPY_SYMBUF_TEST_BACKENDS"
  mps_on() { nvidia-cuda-mps-control -d 2>/dev/null && echo "MPS started"; }
  mps_off() { echo quit | nvidia-cuda-mps-control 2>/dev/null; sleep 1; }
fi
export CUPY_SYMBUF_TRANSPORT=auto CUPY_SYMBUF_TEST_BACKENDS=host,cuda
show() { grep -E "passed|failed|^E |FAILED|SKIPPED|Error|rror:|auto transport" "$1" | head -${2:-25}; }
SUITE=${SUITE:-"tests/test_alltoall.py tests/test_symmetric.py tests/test_moe.py tests/test_moe_device.py tests/test_low_latency.py tests/test_lifecycle.py tests/test_streams.py tests/test_dispatch_out.py"}
for stage in $STAGES; do
  t0=$SECONDS
  case $stage in
    fake)
      timeout 120 $PYTEST tests/test_staged.py > $LOG/staged_fake.log 2>&1
      echo "== [fake + gpu, 1 rank] rc=$? $((SECONDS - t0)) s"; show $LOG/staged_fake.log ;;
    staged1)
      CUPY_SYMBUF_TEST_BACKENDS=cuda timeout 120 $PYTEST tests/test_staged.py -k gpu > $LOG/staged1.log 2>&1
      echo "== [gpu tests, 1 rank] rc=$? $((SECONDS - t0)) s"; show $LOG/staged1.log ;;
    staged2)
      mps_on
      timeout 240 $RUN2 $PYTEST tests/test_staged.py > $LOG/staged2.log 2>&1
      echo "== [tests/test_staged.py, 2 ranks] rc=$? $((SECONDS - t0)) s"; show $LOG/staged2.log 40
      mps_off ;;
    suite2)
      mps_on
      CUPY_SYMBUF_TRANSPORT=staged CUPY_SYMBUF_TEST_BACKENDS=cuda timeout ${SUITE_LIMIT:-300} $RUN2 $PYTEST $SUITE \
        > $LOG/staged_suite2.log 2>&1
      echo "== [GPU suite forced staged, 2 ranks] rc=$? $((SECONDS - t0)) s"; show $LOG/staged_suite2.log 40
      mps_off ;;
    info)
      mps_on
      for t in staged auto; do
        timeout 120 $RUN2 python3 -m cupy_symbuf info --backend cuda --transport $t > $LOG/info_$t.log 2>&1
        echo "== [info --transport $t, 2 ranks] rc=$?"; grep -E "^transport|^communicator|  transport:" $LOG/info_$t.log
      done
      mps_off ;;
    bench)
      mps_on
      for t in ipc staged; do
        timeout 150 $RUN2 python3 -m cupy_symbuf.bench --backend cuda --transport $t --no-reference --no-energy \
          --timing loop --sends out,sym --sizes ${BENCH_SIZES:-1M,16M,128M} --iters ${ITERS:-20} --warmup 3 \
          > $LOG/bench_$t.log 2>&1
        echo "== [bench --transport $t, 2 ranks] rc=$?"; grep -E "transport=|MiB|KiB|GiB|rror" $LOG/bench_$t.log | head -12
      done
      mps_off ;;
    *) echo "unknown stage $stage" ;;
  esac
done
