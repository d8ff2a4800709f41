#!/usr/bin/env bash
# Issue 15 on nvidia-h200-x2 (2 H200 over NVLink, one rank per GPU): written in the fifth session, when that kind
# was withheld; nothing here has run. Ask `status` first; run the calls in order (each under ~550 s; the logs go
# into one tarball in $OUT, the summary lines to stdout). NCCL (CuPy's binding) and the copy limit are timed in the
# same runs as ours. NVLink multicast stays off (device_env.sh).
# Usage: bash .ci/device_issue15.sh 1   the GPU suite, one rank per GPU, then with CUDA_VISIBLE_DEVICES per rank
#        bash .ci/device_issue15.sh 2   info (the NVLink link), every example, the alltoall bench against NCCL
#                                       (1M / 16M / 128M / 1G, plain / out= / symmetric / copy-engine pull)
#        bash .ci/device_issue15.sh 3   MoE dispatch / combine at 16 SMs (4096 tokens) and 128 tokens, the control
#                                       table (low-latency mode in CUDA graphs), fp8 wire, the hierarchical path
#                                       with 2 virtual nodes of 1 GPU (NCCL between them), bench --tune
set -uo pipefail
REAL_OUT=${OUT:-/tmp}
export OUT=/tmp/devlogs15
mkdir -p $OUT
cd "$(dirname "$0")/.."
source .ci/device_env.sh
nvidia-smi -L
PT="python3 -m pytest -q -p no:cacheprovider"
CVD='export CUDA_VISIBLE_DEVICES=$OMPI_COMM_WORLD_LOCAL_RANK; exec'
B="python3 -m cupy_symbuf.bench"
case ${1:-1} in
  1)
    TAIL=6 run suite_multi 270 $MPIRUN -n 2 $PT --timeout=120 tests
    TAIL=6 run suite_cvd 270 $MPIRUN -n 2 bash -c "$CVD $PT --timeout=120 tests" ;;
  2)
    TAIL=30 run info 40 $MPIRUN -n 2 python3 -m cupy_symbuf info --backend cuda
    for ex in alltoall embedding fft_transpose moe_layer symmetric_alltoall; do
      run example_$ex 60 $MPIRUN -n 2 python3 examples/$ex.py
    done
    run example_soak 60 $MPIRUN -n 2 python3 examples/soak.py --backend cuda --iters 2000 --check-every 5
    TAIL=40 run bench_alltoall 200 $MPIRUN -n 2 $B --sizes 1M,16M,128M,1G --sends plain,out,sym,ce --iters 20 \
      --warmup 5 --breakdown --json $OUT/alltoall.json ;;
  3)
    TAIL=24 run bench_moe16 120 $MPIRUN -n 2 $B --op dispatch --moe-tokens 4096,128 --num-sms 16 --iters 50 --warmup 5
    TAIL=24 run bench_moe_fp8 90 $MPIRUN -n 2 $B --op dispatch --moe-tokens 4096,128 --wire fp8 --iters 50 --warmup 5 \
      --no-energy
    TAIL=40 run control 90 $MPIRUN -n 2 $B --control --tokens 4096
    TAIL=24 run hier_nccl 90 $MPIRUN -n 2 $B --op hier --node-size 1 --sizes 1M,16M,128M --moe-tokens 128,4096 \
      --iters 20 --warmup 3
    TAIL=20 run tune 150 $MPIRUN -n 2 -x CUPY_SYMBUF_TUNING=$OUT/tuning_x2.json $B --tune --tune-rounds 1 \
      --sizes 1M,16M,128M --iters 10 --warmup 2 ;;
esac
tar czf $REAL_OUT/logs15_call${1:-1}.tgz -C $OUT . 2>/dev/null && echo "logs: logs15_call${1:-1}.tgz"
