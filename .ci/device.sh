#!/usr/bin/env bash
# The GPU machine's stages: tests, benches, profiles and the old-against-new comparison, run from the source tree
# with Open MPI's mpirun (as root on the device machine) and CuPy.
#
# Usage: bash .ci/device.sh STAGE...        (no stage: gpu)
#
# Tests (pytest's summary per stage; tests/test_faults.py runs in its own stage):
#   suite1          the whole suite at 1 rank
#   suiteN          the whole suite at N ranks on GPU 0 under MPS (suite2, suite4, suite8)
#   filesN          the same, each test file of TESTS in its own pytest (N > 1: mpirun), bounded by FILE_LIMIT (60 s),
#                   one summary line per file: a hang or failure costs that file only (the whole-suite stages lose
#                   every summary when one test hangs the ranks). SUITE_BACKENDS=cuda: the GPU suite alone.
#   partsN          the same, the files dealt by size into PARTS (4) pytest runs, each bounded by PART_LIMIT (200 s):
#                   fewer launches than filesN; at 1 rank the parts run concurrently on GPU 0
#   multi, cvd      the whole suite with one rank per GPU (2+ GPUs); cvd: CUDA_VISIBLE_DEVICES set per rank, every
#                   rank sees ordinal 0. Skipped on one GPU.
#   faults          tests/test_faults.py on the GPU path (single-process pytest that launches mpirun per case)
#   ll              tests/test_low_latency.py and tests/test_deepep.py at 1, 2 and 4 ranks (MPS)
#   small           the small-message alltoall's tests: SMALL_TESTS (default tests/test_small_protocol.py,
#                   test_alltoall.py, test_agreement.py; cuda only) at 1 rank and at SMALL_RANKS (default 2 4; MPS)
#   small-wrap      tests/test_small_protocol.py and test_alltoall.py (cuda only) built with the flag-wrap test hook
#                   (CUPY_SYMBUF_NVRTC_DEFINES=-DSYMBUF_SMALL_FLAG_MOD=7: the small protocol's flag repeats every 14
#                   calls, cuda_src/protocol.cuh "The flag's wrap") at 1 rank and at SMALL_RANKS (default 2 4; MPS)
#   small-profile   tests/device/small_profile.py (the small kernel's phase stamps, 64 KiB and 1 MiB per rank, loop
#                   and graph replay) at SMALL_PROFILE_RANKS (default 2 4; MPS), built batched (default), with the
#                   fenced end-of-call count (-DSYMBUF_SMALL_FINISH=0) and as the first kernel (a word at a time and
#                   the fenced count); then bench --sizes 64K,1M (loop, ITERS 200) for the three builds and the rings
#                   (--small-bytes 0) at 2 ranks. Prints each run's summary; the tables are in the logs
#   small-bench     --control with the small-message alltoall on and off (--small-bytes 0), one after the other, at
#                   SMALL_BENCH_RANKS (default 2; MPS), ITERS (30) calls a row
#   deepep          DeepEP's own tests/test_intranode.py and tests/test_low_latency.py, unmodified, over the shim
#                   (tests/external/run_deepep.py; needs .external/DeepEP carried: tests/external/README.md) at
#                   DEEPEP_RANKS (default 2 4; MPS); DEEPEP_TESTS (default "intranode low_latency"), DEEPEP_ARGS
#                   (their options, e.g. --num-tokens 1024). Prints each run's DeepEP pass lines and skips, and on a
#                   failure the first traceback.
#   adaptive        tests/test_adaptive.py at 4 and 8 ranks (MPS), an adaptive soak at 4
#   hier            tests/test_hierarchical.py at 4 ranks (2 x 2 virtual nodes, MPS)
#   staged          tests/test_staged.py at 1 and 2 ranks, then the core suites at 2 ranks with every cuda
#                   Communicator forced staged (CUPY_SYMBUF_TRANSPORT=staged)
#   trace           tests/device/channel_trace.py at 4 ranks: the skewed trace run, static and work-sharing
#                   builds (diagnostics PNGs and report, the cost of tracing)
#   timeline        tests/device/call_timeline.py at 2 ranks: the small calls' kernels and ring events on the GPU
#                   clock (stamps before every launch, the trace build), loop times by num_sms (8, 24, 48, 96)
#   soak            examples/soak.py --backend cuda, 10,000 iterations at SOAK_RANKS (default 2 4)
#   examples        every example at 2 ranks (mpirun; torch_moe_layer.py runs in the torchrun stage)
#   torchrun        torchrun jobs, no MPI, 2 ranks on GPU 0 (MPS), gloo groups: examples/torch_moe_layer.py and
#                   examples/alltoall.py on the cuda backend, then tests/test_torch_bootstrap.py (host backend)
#   sanitize        compute-sanitizer over a small soak (tests/faults/sanitize.sh; MPS off)
#   info            python -m cupy_symbuf info --backend cuda at 2 ranks (topology, transport, communicator)
#   sass            ptxas of the ring kernel: registers, spills, shared memory of the default, work-sharing and
#                   bulk-copy builds at 512 and 1024 threads
# Benches (python -m cupy_symbuf.bench; the rows on stdout):
#   bench           alltoall, plain / out= / symmetric, at BENCH_RANKS (default 2 4 8; MPS)
#   control         the control-path table (--control) at CONTROL_RANKS (default 2 4 8)
#   latency         the latency table (--control --repeat LATENCY_REPEAT, default 3: every row's median, its target,
#                   HBM floor shares, launch skew) at LATENCY_RANKS (default 2 4 8), LATENCY_ITERS (30) calls a row;
#                   at 2 ranks also --profile (cProfile of the host-time rows, in the log)
#   moe             --op dispatch --moe-tokens 4096,128 (normal and low-latency rows) at MOE_RANKS (default 2 4 8)
#   alltoallv       --op alltoallv, patterns uniform / zipf / hot, at 2 ranks
#   fp8             --op dispatch --wire fp8 at 2 ranks
#   bench-adaptive  --op adaptive (static against work sharing, skewed routing) at 4 and 8 ranks
#   bench-hier      --op hier --node-size 2 at 4 ranks
#   bench-staged    alltoall with --transport ipc, then staged, at 2 ranks
#   tune            bench --tune at 2 and 4 ranks into a copy of the packaged table ($LOGDIR/tuning.json)
#   profile         tests/device/stage_profile.py: the fp8 wire dispatch's stages (2 ranks), the hierarchical
#                   path's (4 ranks)
#   ep8             tests/device/ep8_memory.py at 8 ranks: the symmetric memory formula against what was built
# Old against new:
#   compare [OLD_TREE]   OLD_TREE (default .devout/old: an unpacked copy of an older commit, carried to the device)
#                   and this tree side by side at 2 ranks under MPS, COMPARE_RUNS (3) runs each, interleaved (old
#                   then new in odd runs, new then old in even ones): --control, the alltoall bench (64K, 1M, 16M,
#                   128M; plain and symmetric), --op alltoallv, --op dispatch --moe-tokens 4096,128. Then
#                   tests/device/bench_compare.py prints every row's median per tree, the ratio and a '*' where it
#                   is off by more than 5% (also in $OUT/compare_summary.txt). COMPARE_BENCHES picks the benches
#                   (default "control alltoall alltoallv dispatch"). Here (not on the device) OLD_TREE may also be
#                   a git ref: it is unpacked with git archive.
# Groups: gpu = suite1 suite2 suite4 (one device call); gpu-all = suite1 multi cvd suite2 suite4 suite8 (make test-gpu).
#
# Every stage prints "== [name] rc=N S s" and the last lines of its log (pytest's summary, a bench's rows); on a
# failure also the failed tests. Logs: $LOGDIR/<name>.log (default $OUT/logs when the device tool sets $OUT, else
# /tmp/cupy_symbuf_device); with $OUT set they are packed into $OUT/device_logs.tgz at the end (the device returns
# few files). Each command is bounded by `timeout`, and the whole call by DEVICE_BUDGET_S (default 540 s; 0: no
# bound): a stage that would not fit in what is left is cut to it, or skipped below 15 s, and says so.
# Knobs: TESTS (default tests), SUITE_BACKENDS (the suites' backends, e.g. cuda; default: host and cuda), FAULTS_K (the faults stage's -k, default "not soak"), SUITE_ARGS (default --ignore=tests/test_faults.py), TEST_TIMEOUT (per test, 120),
# CUPY_SYMBUF_TIMEOUT_S (30), BENCH_SIZES, ITERS, TAIL (lines of a log shown), COMPARE_EXTRA (bench options added
# to every compare run, e.g. a smoke test on a machine without GPUs: MPIRUN=mpiexec GPU0= COMPARE_BENCHES=alltoall
# COMPARE_EXTRA="--backend host --sizes 64K --iters 5" bash .ci/device.sh compare 8f863c7).
# NVLink multicast stays off (the device machine's rule).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 CUPY_SYMBUF_ABORT_ON_FAILURE=0
export CUPY_SYMBUF_TIMEOUT_S=${CUPY_SYMBUF_TIMEOUT_S:-30}
if [ -n "${OUT:-}" ]; then LOGDIR=${LOGDIR:-$OUT/logs}; else LOGDIR=${LOGDIR:-/tmp/cupy_symbuf_device}; fi
mkdir -p "$LOGDIR"
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c "^GPU")
MPIRUN=${MPIRUN:-"mpirun --oversubscribe --bind-to none -x PYTHONPATH -x PYTHONUNBUFFERED -x NCCL_NVLS_ENABLE \
-x TORCH_SYMM_MEM_DISABLE_MULTICAST -x NVSHMEM_DISABLE_NVLS -x CUPY_SYMBUF_ABORT_ON_FAILURE -x CUPY_SYMBUF_TIMEOUT_S"}
GPU0=${GPU0-"-x CUDA_VISIBLE_DEVICES=0"}              # ranks under MPS share GPU 0
CUDA_ONLY="-x CUPY_SYMBUF_TEST_BACKENDS=cuda"
PYTEST="python3 -m pytest -q --color=no -p no:cacheprovider -rs --timeout=${TEST_TIMEOUT:-120} -o faulthandler_timeout=$((${TEST_TIMEOUT:-120} + 15))"
TESTS=${TESTS:-tests}
SUITE_ARGS=${SUITE_ARGS:---ignore=tests/test_faults.py}
BENCH="python3 -m cupy_symbuf.bench"
BUDGET=${DEVICE_BUDGET_S:-540}
T_START=$SECONDS
FAILED=""
SKIPPED=""

# run NAME LIMIT_S command...: one command of a stage, bounded by LIMIT_S (cut to the call's budget), its output in
# $LOGDIR/NAME.log; prints its rc, wall time and last ${TAIL:-4} lines, and the failed tests when it failed
# (grep -a: a NUL in a log must not hide its tail).
run() {
  local name=$1 limit=$2; shift 2
  if [ "$BUDGET" -gt 0 ]; then
    local left=$((BUDGET - (SECONDS - T_START) - 10))
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -lt 15 ]; then
      echo "== [$name] skipped: $((left + 10)) s of the call's ${BUDGET} s left"; SKIPPED="$SKIPPED $name"; return 0
    fi
  fi
  local t0=$SECONDS
  timeout -k 10 "$limit" "$@" > "$LOGDIR/$name.log" 2>&1
  local rc=$?
  echo "== [$name] rc=$rc $((SECONDS - t0)) s$([ $rc -eq 124 ] && echo " (timed out at $limit s)")"
  if [ "${TAIL:-4}" -gt 0 ]; then grep -avE "^\s*$|it/s" "$LOGDIR/$name.log" | tail -"${TAIL:-4}"; fi
  if [ $rc -ne 0 ]; then
    FAILED="$FAILED $name"
    grep -aE "^FAILED|^ERROR|^E  |Error:|rror: " "$LOGDIR/$name.log" | head -15
  fi
  return $rc
}

MPS=0
mps_on() {
  [ $MPS = 1 ] && return 0
  nvidia-cuda-mps-control -d 2>/dev/null && echo "MPS started"
  MPS=1
}
mps_off() {
  [ $MPS = 1 ] || return 0
  echo quit | nvidia-cuda-mps-control 2>/dev/null; sleep 1
  MPS=0
}

finish() {
  mps_off
  echo "== done in $((SECONDS - T_START)) s; failed:${FAILED:- none}; skipped:${SKIPPED:- none}"
  if [ -n "${OUT:-}" ]; then
    tar czf "$OUT/device_logs.tgz" -C "$LOGDIR" . 2>/dev/null && rm -rf "$LOGDIR" && echo "logs: device_logs.tgz"
  fi
}
trap finish EXIT

# small_build_defines BUILD: the small kernel's defines of a small-profile build: batched (the default), finish0 (the
# end-of-call count with two fences), serial (the previous kernel: a word at a time and the fenced count), rings
small_build_defines() {
  case $1 in
    finish0) echo "-DSYMBUF_SMALL_FINISH=0" ;;
    serial) echo "-DSYMBUF_SMALL_PIPELINE=0 -DSYMBUF_SMALL_FINISH=0" ;;
  esac
}

# in_tree DIR command...: the command with DIR as working directory and PYTHONPATH (a tree's package and cuda_src)
IN_TREE=(bash -c 'cd "$1" && shift && PYTHONPATH=$PWD exec "$@"' in_tree)

# compare OLD_TREE: see the header
compare() {
  local old=$1 runs=${COMPARE_RUNS:-3} r b v order
  if [ ! -d "$old" ]; then
    if git rev-parse -q --verify "$old^{commit}" >/dev/null 2>&1; then
      local dir=/tmp/cupy_symbuf_old_$(git rev-parse --short "$old")
      rm -rf "$dir" && mkdir -p "$dir" && git archive "$old" | tar -x -C "$dir" && old=$dir
    else
      echo "== [compare] no old tree: $old is neither a directory nor a git ref (carry an unpacked copy)"
      FAILED="$FAILED compare"; return 1
    fi
  fi
  old=$(cd "$old" && pwd)
  [ -d "$old/cupy_symbuf" ] || { echo "== [compare] $old has no cupy_symbuf/"; FAILED="$FAILED compare"; return 1; }
  echo "== [compare] old: $old ($(cat "$old/.commit" 2>/dev/null || echo "no .commit file")), new: $PWD ($(git rev-parse --short HEAD 2>/dev/null || echo "no git"))"
  rm -f "$LOGDIR"/cmp_*.log
  declare -A args=(
    [control]="--control"
    [alltoall]="--sizes 64K,1M,16M,128M --sends plain,sym --no-energy"
    [alltoallv]="--op alltoallv --no-energy"
    [dispatch]="--op dispatch --moe-tokens 4096,128 --no-energy")
  declare -A limit=([control]=75 [alltoall]=60 [alltoallv]=60 [dispatch]=90)
  mps_on
  for r in $(seq 1 "$runs"); do
    order="old new"; [ $((r % 2)) -eq 0 ] && order="new old"
    for b in ${COMPARE_BENCHES:-control alltoall alltoallv dispatch}; do
      [ -n "${args[$b]:-}" ] || { echo "== [compare] unknown bench $b (control alltoall alltoallv dispatch)"; continue; }
      for v in $order; do
        local tree=$PWD; [ $v = old ] && tree=$old
        TAIL=0 run "cmp_${b}_${v}_$r" "${limit[$b]}" "${IN_TREE[@]}" "$tree" \
          $MPIRUN -n 2 $GPU0 $BENCH ${args[$b]} ${COMPARE_EXTRA:-}
      done
    done
  done
  python3 tests/device/bench_compare.py "$LOGDIR" --brief --out "$LOGDIR/compare_summary.txt"
  [ -n "${OUT:-}" ] && cp "$LOGDIR/compare_summary.txt" "$OUT/compare_summary.txt"
  return 0
}

STAGE_NAMES="suite1 files1 files2 files4 parts1 parts2 parts4 multi cvd faults ll small small-wrap small-profile small-bench deepep torchrun adaptive hier staged trace timeline soak examples sanitize info sass bench control latency moe
alltoallv fp8 bench-adaptive bench-hier bench-staged tune profile ep8 compare"
STAGE_NAMES=$(echo $STAGE_NAMES)
STAGES=${*:-gpu}
STAGES=${STAGES//gpu-all/suite1 multi cvd suite2 suite4 suite8}
STAGES=$(echo " $STAGES " | sed 's/ gpu / suite1 suite2 suite4 /g')
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader 2>/dev/null | head -1
echo "GPUs: $NGPU; stages: $STAGES; budget: ${BUDGET} s; logs: $LOGDIR"
set -- $STAGES
while [ $# -gt 0 ]; do
  stage=$1; shift
  case $stage in
    suite1) run suite1 ${SUITE_LIMIT:-240} env \
      ${SUITE_BACKENDS:+CUPY_SYMBUF_TEST_BACKENDS=$SUITE_BACKENDS} $PYTEST $TESTS $SUITE_ARGS ;;
    suite[0-9]*)
      n=${stage#suite}; mps_on
      run "$stage" ${SUITE_LIMIT:-300} $MPIRUN -n "$n" $GPU0 ${SUITE_BACKENDS:+-x CUPY_SYMBUF_TEST_BACKENDS=$SUITE_BACKENDS} \
        $PYTEST $TESTS $SUITE_ARGS ;;
    files[0-9]*)  # each test file in its own pytest (mpirun at N > 1), so a hang or failure costs that file only
      n=${stage#files}; [ "$n" -gt 1 ] && mps_on
      for f in $(for t in $TESTS; do [ -d "$t" ] && ls "$t"/test_*.py || echo "$t"; done | grep -v test_faults.py); do
        if [ "$n" -gt 1 ]; then
          TAIL=${TAIL:-1} run "files${n}_$(basename "$f" .py)" ${FILE_LIMIT:-60} $MPIRUN -n "$n" $GPU0 \
            ${SUITE_BACKENDS:+-x CUPY_SYMBUF_TEST_BACKENDS=$SUITE_BACKENDS} $PYTEST --tb=short "$f"
        else
          TAIL=${TAIL:-1} run "files1_$(basename "$f" .py)" ${FILE_LIMIT:-60} env \
            ${SUITE_BACKENDS:+CUPY_SYMBUF_TEST_BACKENDS=$SUITE_BACKENDS} $PYTEST --tb=short "$f"
        fi
      done ;;
    parts[0-9]*)  # the suite's files dealt into PARTS pytest runs by size (N > 1: mpirun, one after another; 1 rank:
      # concurrently, no spinning peers at 1 rank), each bounded by PART_LIMIT: a hang costs one part only
      n=${stage#parts}; [ "$n" -gt 1 ] && mps_on
      k=${PARTS:-4}; unset part; declare -a part; i=0
      for f in $(for t in $TESTS; do [ -d "$t" ] && ls "$t"/test_*.py || echo "$t"; done | grep -v test_faults.py \
          | xargs wc -l | grep -v " total$" | sort -rn | awk '{print $2}'); do
        part[$((i % k))]="${part[$((i % k))]:-} $f"; i=$((i + 1))
      done
      for j in $(seq 0 $((k - 1))); do
        [ -n "${part[$j]:-}" ] || continue
        if [ "$n" -gt 1 ]; then
          TAIL=${TAIL:-2} run "parts${n}_$j" ${PART_LIMIT:-200} $MPIRUN -n "$n" $GPU0 \
            ${SUITE_BACKENDS:+-x CUPY_SYMBUF_TEST_BACKENDS=$SUITE_BACKENDS} $PYTEST --tb=short ${part[$j]}
        else
          TAIL=${TAIL:-2} run "parts1_$j" ${PART_LIMIT:-200} env \
            ${SUITE_BACKENDS:+CUPY_SYMBUF_TEST_BACKENDS=$SUITE_BACKENDS} $PYTEST --tb=short ${part[$j]} &
        fi
      done
      wait
      if [ "$n" -eq 1 ]; then  # the concurrent parts ran in subshells: their failures from their logs
        for j in $(seq 0 $((k - 1))); do
          [ -f "$LOGDIR/parts1_$j.log" ] || continue
          tail -3 "$LOGDIR/parts1_$j.log" | grep -qaE "[0-9]+ (passed|skipped)" && \
            ! tail -3 "$LOGDIR/parts1_$j.log" | grep -qaE "[0-9]+ (failed|error)" || FAILED="$FAILED parts1_$j"
        done
      fi ;;
    multi|cvd)
      if [ "$NGPU" -lt 2 ]; then echo "== [$stage] skipped: $NGPU GPU"; continue; fi
      mps_off
      if [ $stage = multi ]; then run multi$NGPU ${SUITE_LIMIT:-300} $MPIRUN -n "$NGPU" $PYTEST $TESTS $SUITE_ARGS
      else run cvd$NGPU ${SUITE_LIMIT:-300} $MPIRUN -n "$NGPU" bash -c \
        "export CUDA_VISIBLE_DEVICES=\$OMPI_COMM_WORLD_LOCAL_RANK; exec $PYTEST $TESTS $SUITE_ARGS"; fi ;;
    faults)
      mps_on
      CUPY_SYMBUF_FAULT_BACKEND=cuda MPIEXEC="$MPIRUN -x CUPY_SYMBUF_FAULT_BACKEND" TAIL=8 \
        run faults 240 $PYTEST --timeout=100 tests/test_faults.py -k "${FAULTS_K:-not soak}" ;;
    ll)
      mps_on
      LL="tests/test_low_latency.py tests/test_deepep.py tests/test_low_latency_agreement.py"
      run ll1 90 env CUPY_SYMBUF_TEST_BACKENDS=cuda $PYTEST -x $LL
      run ll2 150 $MPIRUN -n 2 $GPU0 $CUDA_ONLY $PYTEST -x $LL
      run ll4 100 $MPIRUN -n 4 $GPU0 $CUDA_ONLY $PYTEST -x tests/test_low_latency.py ;;
    small)
      SMALL_TESTS=${SMALL_TESTS:-"tests/test_small_protocol.py tests/test_alltoall.py tests/test_agreement.py"}
      run small1 ${SMALL_LIMIT:-120} env CUPY_SYMBUF_TEST_BACKENDS=cuda $PYTEST $SMALL_TESTS
      mps_on
      for n in ${SMALL_RANKS:-2 4}; do
        run small$n ${SMALL_LIMIT:-180} $MPIRUN -n "$n" $GPU0 $CUDA_ONLY $PYTEST $SMALL_TESTS
      done ;;
    small-wrap)  # every rank the same hook: it is in the kernels' build id and the construction fingerprint
      WRAP="CUPY_SYMBUF_NVRTC_DEFINES=-DSYMBUF_SMALL_FLAG_MOD=7"
      WRAP_TESTS="tests/test_small_protocol.py tests/test_alltoall.py"
      run small-wrap1 ${SMALL_LIMIT:-120} env CUPY_SYMBUF_TEST_BACKENDS=cuda $WRAP $PYTEST $WRAP_TESTS
      mps_on
      for n in ${SMALL_RANKS:-2 4}; do
        run small-wrap$n ${SMALL_LIMIT:-180} env $WRAP $MPIRUN -n "$n" $GPU0 $CUDA_ONLY -x CUPY_SYMBUF_NVRTC_DEFINES \
          $PYTEST $WRAP_TESTS
      done ;;
    small-profile)
      mps_on
      for n in ${SMALL_PROFILE_RANKS:-2 4}; do
        for build in batched finish0 serial; do
          DEF=$(small_build_defines $build)
          TAIL=6 run "small-profile$n-$build" 120 env CUPY_SYMBUF_NVRTC_DEFINES="$DEF" $MPIRUN -n "$n" $GPU0 \
            -x CUPY_SYMBUF_NVRTC_DEFINES python3 tests/device/small_profile.py
        done
      done
      for build in batched finish0 serial rings; do
        DEF=$(small_build_defines $build)
        TAIL=6 run "small-ab2-$build" 120 env CUPY_SYMBUF_NVRTC_DEFINES="$DEF" $MPIRUN -n 2 $GPU0 \
          -x CUPY_SYMBUF_NVRTC_DEFINES $BENCH --sizes 64K,1M --timing loop --sends plain,out --iters "${ITERS:-200}" \
          --warmup 20 --no-reference $([ $build = rings ] && echo --small-bytes 0)
      done ;;
    small-bench)
      mps_on
      for n in ${SMALL_BENCH_RANKS:-2}; do
        for sb in on off; do
          TAIL=30 run "small-control$n-$sb" 150 $MPIRUN -n "$n" $GPU0 $BENCH --control --iters "${ITERS:-30}" \
            --warmup 5 $([ $sb = off ] && echo --small-bytes 0)
        done
      done ;;
    deepep)
      if [ ! -f .external/DeepEP/tests/test_intranode.py ]; then
        echo "== [deepep] no .external/DeepEP/tests (fetch DeepEP and carry .external: tests/external/README.md)"
        FAILED="$FAILED deepep"; continue
      fi
      mps_on
      port=29531
      for n in ${DEEPEP_RANKS:-2 4}; do
        for t in ${DEEPEP_TESTS:-intranode low_latency}; do
          port=$((port + 1))
          TAIL=0 run "deepep_${t}$n" "${DEEPEP_LIMIT:-240}" $MPIRUN -n "$n" $GPU0 -x MASTER_ADDR=127.0.0.1 \
            -x MASTER_PORT=$port python3 tests/external/run_deepep.py "$t" ${DEEPEP_ARGS:-}
          log="$LOGDIR/deepep_${t}$n.log"
          grep -aE "^\[adapter\]|passed$|^\[tuning\] Best|bandwidth" "$log" | sort | uniq -c | sed 's/^ */   /' | head -40
          if grep -aq "FAILED" "$log"; then
            echo "   -- first failure:"; grep -a -m1 -A40 "FAILED" "$log" | head -45
          fi
        done
      done ;;
    adaptive)
      mps_on
      run adaptive4 120 $MPIRUN -n 4 $GPU0 $CUDA_ONLY $PYTEST -x tests/test_adaptive.py
      run adaptive8 120 $MPIRUN -n 8 $GPU0 $CUDA_ONLY $PYTEST -x tests/test_adaptive.py
      run soak_adaptive4 60 $MPIRUN -n 4 $GPU0 python3 examples/soak.py --backend cuda --iters 2000 \
        --check-every 5 --adaptive ;;
    hier) mps_on; run hier4 120 $MPIRUN -n 4 $GPU0 $CUDA_ONLY $PYTEST -x tests/test_hierarchical.py ;;
    staged)
      mps_on
      run staged1 60 env CUPY_SYMBUF_TEST_BACKENDS=cuda $PYTEST -x tests/test_staged.py
      run staged2 90 $MPIRUN -n 2 $GPU0 $CUDA_ONLY $PYTEST -x tests/test_staged.py
      TAIL=8 run staged_core2 240 $MPIRUN -n 2 $GPU0 $CUDA_ONLY -x CUPY_SYMBUF_TRANSPORT=staged $PYTEST \
        tests/test_alltoall.py tests/test_symmetric.py tests/test_moe.py tests/test_low_latency.py ;;
    timeline)
      mps_on
      TAIL=200 run timeline2 120 $MPIRUN -n 2 $GPU0 python3 tests/device/call_timeline.py ;;
    trace)
      mps_on
      TAIL=30 run trace4 150 $MPIRUN -n 4 $GPU0 -x TRACE_DIR=$LOGDIR/trace python3 tests/device/channel_trace.py
      TAIL=20 run trace4_adaptive 150 $MPIRUN -n 4 $GPU0 -x TRACE_DIR=$LOGDIR/trace_adaptive \
        -x CUPY_SYMBUF_TRACE_ADAPTIVE=1 python3 tests/device/channel_trace.py ;;
    soak)
      mps_on
      for n in ${SOAK_RANKS:-2 4}; do
        TAIL=2 run soak$n 120 $MPIRUN -n "$n" $GPU0 python3 examples/soak.py --backend cuda \
          --iters "${SOAK_ITERS:-10000}" --check-every 10
      done ;;
    examples)
      mps_on
      for ex in examples/*.py; do
        [ "$(basename "$ex")" = torch_moe_layer.py ] && continue  # a torchrun program: the torchrun stage
        a=""; [ "$(basename "$ex")" = soak.py ] && a="--backend cuda --iters 2000 --check-every 5"
        run "example_$(basename "$ex" .py)" 90 $MPIRUN -n 2 $GPU0 python3 "$ex" $a
      done ;;
    sanitize)
      mps_off
      OUT=$LOGDIR STAGE_LIMIT=${SAN_LIMIT:-150} SAN_ITERS=${SAN_ITERS:-6} TAIL=20 run sanitize 500 \
        bash tests/faults/sanitize.sh ;;
    torchrun)
      mps_on
      TORCHRUN="env CUDA_VISIBLE_DEVICES=0 OMP_NUM_THREADS=1 python3 -m torch.distributed.run --standalone --nproc-per-node 2"
      TAIL=6 run torchrun_moe 120 $TORCHRUN examples/torch_moe_layer.py --backend cuda
      TAIL=6 run torchrun_moe_big 120 $TORCHRUN examples/torch_moe_layer.py --backend cuda --tokens 1024 \
        --hidden 1024 --inter 512 --experts 16 --topk 4
      TAIL=6 run torchrun_alltoall 120 $TORCHRUN examples/alltoall.py --backend cuda --launcher torch
      run torchrun_tests 300 $PYTEST tests/test_torch_bootstrap.py ;;
    info) mps_on; TAIL=40 run info2 60 $MPIRUN -n 2 $GPU0 python3 -m cupy_symbuf info --backend cuda ;;
    sass) TAIL=30 run sass 120 python3 tests/device/ring_sass.py "$LOGDIR" ;;
    bench)
      mps_on
      for n in ${BENCH_RANKS:-2 4 8}; do
        TAIL=16 run bench$n 120 $MPIRUN -n "$n" $GPU0 $BENCH --sizes "${BENCH_SIZES:-1M,16M,128M}" \
          --iters "${ITERS:-20}" --warmup 3
      done ;;
    control)
      mps_on
      for n in ${CONTROL_RANKS:-2 4 8}; do
        TAIL=16 run control$n 120 $MPIRUN -n "$n" $GPU0 $BENCH --control --iters "${ITERS:-50}" --warmup 5
      done ;;
    latency)
      mps_on
      for n in ${LATENCY_RANKS:-2 4 8}; do
        p=""; [ "$n" = 2 ] && p=--profile  # (cProfile of the host-time rows in the log, first pass, 2 ranks)
        TAIL=40 run latency$n ${LATENCY_LIMIT:-150} $MPIRUN -n "$n" $GPU0 $BENCH --control --repeat "${LATENCY_REPEAT:-3}" \
          --iters "${LATENCY_ITERS:-30}" --warmup 5 $p
      done ;;
    moe)
      mps_on
      for n in ${MOE_RANKS:-2 4 8}; do
        TAIL=16 run moe$n 150 $MPIRUN -n "$n" $GPU0 $BENCH --op dispatch --moe-tokens 4096,128 \
          --iters "${ITERS:-50}" --warmup 5
      done ;;
    alltoallv)
      mps_on
      TAIL=12 run alltoallv2 120 $MPIRUN -n 2 $GPU0 $BENCH --op alltoallv --patterns uniform,zipf,hot \
        --sizes "${BENCH_SIZES:-1M,16M,128M}" --iters "${ITERS:-50}" --warmup 3 ;;
    fp8)
      mps_on
      TAIL=16 run fp8_2 90 $MPIRUN -n 2 $GPU0 $BENCH --op dispatch --moe-tokens 4096,128 --wire fp8 \
        --iters "${ITERS:-50}" --warmup 5 --no-energy ;;
    bench-adaptive)
      mps_on
      for n in 4 8; do
        TAIL=22 run bench_adaptive$n 150 $MPIRUN -n $n $GPU0 $BENCH --op adaptive --moe-tokens 4096 \
          --iters "${ITERS:-100}" --warmup 5
      done ;;
    bench-hier)
      mps_on
      TAIL=16 run bench_hier4 90 $MPIRUN -n 4 $GPU0 $BENCH --op hier --node-size 2 --sizes 1M,16M \
        --moe-tokens 128,1024 --iters 20 --warmup 3 ;;
    bench-staged)
      mps_on
      for t in ipc staged; do
        TAIL=8 run bench_$t 90 $MPIRUN -n 2 $GPU0 $BENCH --transport $t --sizes "${BENCH_SIZES:-1M,16M,128M}" \
          --iters 20 --warmup 3 --no-reference --no-energy
      done ;;
    tune)
      mps_on
      cp cupy_symbuf/transport/tuning.json "$LOGDIR/tuning.json"
      for n in ${TUNE_RANKS:-2 4}; do
        TAIL=14 run tune$n 150 $MPIRUN -n "$n" $GPU0 $BENCH --tune --tune-rounds 1 --sizes 1M,16M,128M \
          --iters 10 --warmup 2 --tune-out "$LOGDIR/tuning.json"
      done ;;
    profile)
      mps_on
      TAIL=12 run profile_fp8 90 $MPIRUN -n 2 $GPU0 python3 tests/device/stage_profile.py fp8
      TAIL=40 run profile_hier 200 $MPIRUN -n 4 $GPU0 python3 tests/device/stage_profile.py hier ;;
    ep8) mps_on; TAIL=2 run ep8 90 $MPIRUN -n 8 $GPU0 python3 tests/device/ep8_memory.py ;;
    compare)
      old=.devout/old
      if [ $# -gt 0 ] && ! [[ " $STAGE_NAMES " == *" $1 "* || $1 == suite[0-9]* ]]; then old=$1; shift; fi
      compare "$old" ;;
    *) echo "== [$stage] unknown stage (see the header of .ci/device.sh)"; FAILED="$FAILED $stage" ;;
  esac
done
[ -z "$FAILED" ]
