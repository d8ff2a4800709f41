#!/usr/bin/env bash
# The 128-token graph rows (normal-mode dispatch / combine in worst-case mode, low-latency dispatch / combine) for
# the kernel builds old and new, interleaved (old new nospread new old: the same warm machine), 2 ranks on GPU 0
# under MPS, then the medians per build and row (tests/device/graph_rows.py prints the rows). Under 150 s (each
# build's first run compiles its kernels: ~30 s; a later run ~15 s).
#
#   bash tests/device/graph_rows.sh            timing (old: SYMBUF_LL_FENCE=0 SYMBUF_LL_SELF=0, the low-latency
#                                              kernels before those changes; new: the defaults)
#   bash tests/device/graph_rows.sh test       then the GPU correctness tests at 2 ranks (cuda only), ~3-5 min more
#
# Builds, in the order GR_SEQ (default "old new nospread new old"): old and new as above, nospread =
# new again (the row-vector build it compared was removed, docs/perf-notes.md), fold0 = new with -DSYMBUF_HEADER_FOLD=0
# (the ring's call header released at once instead of with the first chunk: the receiver checks it while the sender
# copies; one release more a group; e.g. GR_SEQ="old new fold0 new old"). Knobs: GR_OLD / GR_NEW / GR_FOLD0 (the
# builds' CUPY_SYMBUF_NVRTC_DEFINES), GR_SEQ, ROWS_ITERS (replays a row, 200), ROWS_BIG_ITERS (the 4096-token rows'
# calls, 20; 0: off).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export NCCL_NVLS_ENABLE=0 CUPY_SYMBUF_ABORT_ON_FAILURE=0 CUPY_SYMBUF_TIMEOUT_S=${CUPY_SYMBUF_TIMEOUT_S:-30}
LOG=${OUT:-/tmp}/graph_rows
mkdir -p "$LOG"
OLD=${GR_OLD:-"-DSYMBUF_LL_FENCE=0 -DSYMBUF_LL_SELF=0"}
NEW=${GR_NEW:-""}
FOLD0=${GR_FOLD0:-"-DSYMBUF_HEADER_FOLD=0"}  # the third build: the call header released at once, not with chunk 0
MPIRUN=${GR_MPIRUN:-"mpirun --oversubscribe --bind-to none -x PYTHONPATH -x PYTHONUNBUFFERED -x NCCL_NVLS_ENABLE
 -x CUPY_SYMBUF_ABORT_ON_FAILURE -x CUPY_SYMBUF_TIMEOUT_S -x CUPY_SYMBUF_NVRTC_DEFINES -x ROWS_ITERS -x ROWS_BIG_ITERS
 -x CUDA_VISIBLE_DEVICES=0"}
export ROWS_ITERS=${ROWS_ITERS:-200} ROWS_BIG_ITERS=${ROWS_BIG_ITERS:-20}
T0=$SECONDS
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader 2>/dev/null | head -1
MPS=0
nvidia-cuda-mps-control -d 2>/dev/null && MPS=1 && echo "MPS started"
done_msg() {
  [ $MPS = 1 ] && echo quit | nvidia-cuda-mps-control 2>/dev/null
  echo "== graph_rows done in $((SECONDS - T0)) s"
}
trap done_msg EXIT
rm -f "$LOG"/rows_*.log "$LOG"/test_*.log

rc_all=0
declare -A n_run=()
for b in ${GR_SEQ:-old new nospread new old}; do
  case $b in
    old) defs=$OLD ;; new) defs=$NEW ;; nospread) defs="$NEW" ;; fold0) defs="$NEW $FOLD0" ;;
    *) echo "unknown build $b"; continue ;;
  esac
  r=$((${n_run[$b]:-0} + 1)); n_run[$b]=$r
  t=$SECONDS
  CUPY_SYMBUF_NVRTC_DEFINES="$defs" timeout -k 5 60 $MPIRUN -n 2 python3 tests/device/graph_rows.py \
    > "$LOG/rows_${b}_$r.log" 2>&1
  rc=$?
  echo "== [$b $r] rc=$rc $((SECONDS - t)) s  ($defs)"
  [ $rc -ne 0 ] && { rc_all=$rc; tail -15 "$LOG/rows_${b}_$r.log"; }
done
grep -h "^# \|^#   " "$LOG"/rows_*_1.log
python3 - "$LOG" <<'EOF'
import glob, re, statistics, sys
rows = {}
for path in sorted(glob.glob(f"{sys.argv[1]}/rows_*_*.log")):
    build = path.rsplit("/", 1)[1].split("_")[1]
    for line in open(path):
        m = re.match(r"row: (.*?)\s+([-0-9.]+)$", line.strip())
        if m:
            rows.setdefault(m.group(1), {}).setdefault(build, []).append(float(m.group(2)))
nan = float("nan")
builds = ("old", "new", "nospread", "fold0")
print(f"{'row (2 ranks, us; median of the runs)':<46}" + "".join(f"{b:>9}" for b in builds) + f"{'new/old':>8}  runs")
for name, per in rows.items():
    m = {b: statistics.median(per[b]) if per.get(b) else nan for b in builds}
    print(f"{name:<46}" + "".join(f"{m[b]:9.2f}" for b in builds) +
          f"{m['new'] / m['old'] if m['old'] else nan:8.3f}  {per}")
EOF

if [ "${1:-}" = test ]; then
  PYTEST="python3 -m pytest -q --color=no -p no:cacheprovider -x --timeout=120"
  for f in "tests/test_moe_device.py" "tests/test_low_latency.py tests/test_low_latency_agreement.py" \
      "tests/test_moe.py"; do
    t=$SECONDS
    CUPY_SYMBUF_NVRTC_DEFINES="$NEW" timeout -k 5 240 $MPIRUN -n 2 -x CUPY_SYMBUF_TEST_BACKENDS=cuda $PYTEST $f \
      > "$LOG/test_$(basename ${f%% *} .py).log" 2>&1
    rc=$?
    echo "== [test $f] rc=$rc $((SECONDS - t)) s: $(tail -1 "$LOG/test_$(basename ${f%% *} .py).log")"
    [ $rc -ne 0 ] && { rc_all=$rc; grep -aE "^FAILED|^ERROR|^E  " "$LOG/test_$(basename ${f%% *} .py).log" | head -15; }
  done
fi
exit $rc_all
