#!/usr/bin/env bash
# Issue 9, third device call: the GPU fault cases of a call rejected on every/one rank, soak 10,000 at MPS 2 and 4
# ranks, memcheck (accesses) and racecheck at 2 ranks with the hazards summarised, the item-3 misuse under memcheck.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
nvidia-cuda-mps-control -d && echo "MPS started"
CUPY_SYMBUF_FAULT_BACKEND=cuda MPIEXEC="$FAULT_MPIEXEC" \
  timeout 120 python3 -m pytest -q --color=no -p no:cacheprovider --timeout=60 tests/test_faults.py -k "recv_self_off or reject" > $LOG/faults.log 2>&1
echo "== [faults reject] rc=$?"; grep -E "passed|failed|FAILED" $LOG/faults.log | tail -6
for n in 2 4; do
  timeout 90 $MPIRUN -n $n -x CUDA_VISIBLE_DEVICES=0 python3 examples/soak.py --backend cuda --iters 10000 --check-every 10 > $LOG/soak_n$n.log 2>&1
  echo "== [soak n=$n] rc=$?"; grep -E "soak:|WRONG" $LOG/soak_n$n.log | tail -3
done
echo quit | nvidia-cuda-mps-control; sleep 1
LEAKS=0 TOOLS=memcheck RANKS="1 2" SAN_ITERS=4 STAGE_LIMIT=60 MISUSE=1 bash tests/faults/sanitize.sh 2>&1 | grep -E "^== |SUMMARY|sanitize:"
TOOLS=racecheck RANKS=2 SAN_ITERS=2 STAGE_LIMIT=60 MISUSE=0 bash tests/faults/sanitize.sh > /dev/null 2>&1
echo "== racecheck n=2 hazards by kind and place:"
grep -E "^========= +(Error|Warning): Race|^========= +(Read|Write) Thread|^========= +at .*" $LOG/sanitize_racecheck_n2.log | sed -E 's/\(.*\)//; s/0x[0-9a-f]+/ADDR/g' | sort | uniq -c | sort -rn | head -20
grep -E "RACECHECK SUMMARY" $LOG/sanitize_racecheck_n2.log | head -2
