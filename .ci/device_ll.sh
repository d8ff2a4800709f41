#!/bin/bash
# Low-latency mode on one H200 (issue 10 item 5): tests at 1 rank, 2 and 4 ranks under MPS, then bench_low_latency
# (loop, graph, host issue time per call, kernel phases) at 2 ranks under MPS. With LL_BEFORE=<dir> (a checkout of
# an earlier cupy_symbuf + cuda_src) the same benchmark runs on that tree first, for before/after numbers.
source "$(dirname "${BASH_SOURCE[0]}")/device_env.sh"
export CUPY_SYMBUF_TEST_BACKENDS=cuda CUPY_SYMBUF_TIMEOUT_S=10
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
nvidia-cuda-mps-control -d && echo "MPS started"
cat > /tmp/ll_bench.py <<'PY'
import inspect, sys, time
import numpy as np
from mpi4py import MPI
import cupy as cp
import cupy_symbuf as cs
from cupy_symbuf.utils import select_device
select_device(MPI.COMM_WORLD)
tag = sys.argv[1]
blocks = [None] + [int(b) for b in sys.argv[2:]]
params = inspect.signature(cs.bench_low_latency).parameters

def host_issue(c, n_iss=1000):  # host time per call to issue (old trees have no bench key for it)
    ll = cs.LowLatencyBuffer(c, 128, 7168, 256, max_topk=8)
    s = cp.cuda.Stream(non_blocking=True)
    rng = np.random.default_rng(c.rank)
    with s:
        x = cp.asarray(rng.integers(0, 2 ** 15, (128, 7168)).astype(np.uint16))
        ti = cp.asarray(np.argsort(rng.random((128, 256)), axis=1)[:, :8].astype(np.int64))
        tw = cp.asarray(rng.random((128, 8)).astype(np.float32))
        y = ll.dispatch(x, ti)[0].copy()
        res = {}
        for name in ("dispatch", "combine"):
            h = ll.dispatch(x, ti)[2]
            ll.combine(y, ti, tw, h)
            tot = 0.0
            for _ in range(n_iss // 200):
                s.synchronize(); MPI.COMM_WORLD.Barrier()
                t0 = time.perf_counter()
                for _ in range(200):
                    ll.dispatch(x, ti) if name == "dispatch" else ll.combine(y, ti, tw, h)
                tot += time.perf_counter() - t0
            s.synchronize(); ll.synchronize()
            res[name] = MPI.COMM_WORLD.allreduce(tot * 1e6 / (n_iss // 200 * 200), op=MPI.MAX)
    ll.close()
    return res

with cs.Communicator(MPI.COMM_WORLD) as c:
    hi = host_issue(c)
    if c.rank == 0:
        print(f"[{tag}] host issue us/call (1000 calls, no sync, max over ranks): dispatch {hi['dispatch']:.2f} "
              f"combine {hi['combine']:.2f}", flush=True)
    for nb in blocks:
        for fp8 in (False, True):
            kw = {}
            if "profile" in params:
                kw["profile"] = not fp8
            if nb is not None:
                if "num_blocks" not in params:
                    continue
                kw["num_blocks"] = nb
            r = cs.bench_low_latency(c, 128, 7168, 256, 8, iters=50, use_fp8=fp8, **kw)
            if c.rank == 0:
                print(f"[{tag}] {'fp8' if fp8 else 'bf16'} blocks={nb or 'default'}",
                      {k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items()}, flush=True)
PY
PYT="python3 -m pytest -q -x --timeout=60 -p no:cacheprovider tests/test_low_latency.py tests/test_deepep.py"
echo "== 2 ranks (MPS)"; timeout 85 $MPIRUN -x CUPY_SYMBUF_TEST_BACKENDS -n 2 $PYT 2>&1 | tail -12
echo "== bench 2 ranks (MPS), this tree"
timeout 70 $MPIRUN -n 2 python3 /tmp/ll_bench.py after ${LL_BLOCKS:-} 2>&1 | grep -v "^\s*$" | tail -12
echo "== 1 rank"; timeout 60 $PYT 2>&1 | tail -12
if [ -n "${LL_BEFORE:-}" ]; then
  echo "== bench 2 ranks (MPS), before ($LL_BEFORE)"
  PYTHONPATH=$PWD/$LL_BEFORE timeout 45 $MPIRUN -n 2 python3 /tmp/ll_bench.py before 2>&1 | tail -6
fi
echo "== 4 ranks (MPS)"; timeout 70 $MPIRUN -x CUPY_SYMBUF_TEST_BACKENDS -n 4 ${PYT/tests\/test_deepep.py/} 2>&1 | tail -6
echo quit | nvidia-cuda-mps-control
