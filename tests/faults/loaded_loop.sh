#!/usr/bin/env bash
# The fault suite (tests/test_faults.py) LOOPS times in a row under CPU load (one busy-looping process per core, so
# that ranks are descheduled at awkward moments, as on a shared CI runner): a race in a bounded wait or in close()
# shows up as a killed job or a failed case. `make fault-loop` (LOOPS=3); prints one line per loop (time, pytest
# counts) and a total; exits nonzero if any loop failed.
# Knobs: LOOPS=3, PY (default .venv/bin/python), BURNERS (default: the number of cores), PYTEST_ARGS (e.g. -k raise).
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
LOOPS=${LOOPS:-3}
BURNERS=${BURNERS:-$(nproc)}
export PYTHONPATH=$PWD
burners=()
stop() { for p in "${burners[@]}"; do kill "$p" 2>/dev/null; done; }
trap stop EXIT
trap "exit 143" TERM INT
for _ in $(seq 1 "$BURNERS"); do "$PY" -c 'while 1: pass' & burners+=($!); done
fail=0
t_all=$SECONDS
for i in $(seq 1 "$LOOPS"); do
  t0=$SECONDS
  out=$(timeout 3000 "$PY" -m pytest -q --color=no -p no:cacheprovider --timeout=300 tests/test_faults.py \
        ${PYTEST_ARGS:-} 2>&1)
  rc=$?
  counts=$(echo "$out" | grep -aE "[0-9]+ (passed|failed|error)" | tail -1)
  echo "fault-loop $i/$LOOPS: exit $rc, $((SECONDS - t0)) s: $counts"
  if [ $rc != 0 ]; then fail=$((fail + 1)); echo "$out" | grep -aE "^(FAILED|ERROR)|^E " | head -40; fi
done
echo "fault-loop: $((LOOPS - fail)) of $LOOPS loops passed under $BURNERS CPU burners ($((SECONDS - t_all)) s)"
[ $fail = 0 ]
