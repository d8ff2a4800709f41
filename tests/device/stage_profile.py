"""Where the time goes on the GPU: the fp8 wire dispatch's stages (2 ranks) or the hierarchical path's (4 ranks as
2 x 2 virtual nodes), by wrapping the stages with a device sync and a wall clock (``.ci/device.sh profile``).

    mpirun -n 2 python3 tests/device/stage_profile.py fp8 | mpirun -n 4 python3 tests/device/stage_profile.py hier

The hierarchical stages are private methods of ``HierarchicalCommunicator``; a name that no longer exists is
reported and left out, so the script keeps running while that class changes."""
import sys
import time
from collections import defaultdict

import numpy as np
from mpi4py import MPI

import cupy as cp
import cupy_symbuf as cs
from cupy_symbuf import quant
from cupy_symbuf.scaleout import hierarchical

world = MPI.COMM_WORLD
me, W = world.Get_rank(), world.Get_size()
acc = defaultdict(float)
cnt = defaultdict(int)


def wrap(obj, name, label=None):
    label = label or name
    f = getattr(obj, name, None)
    if f is None:
        if me == 0:
            print(f"# {label}: no such attribute here, not timed")
        return

    def g(*a, **k):
        cp.cuda.get_current_stream().synchronize()
        t = time.perf_counter()
        r = f(*a, **k)
        cp.cuda.get_current_stream().synchronize()
        acc[label] += time.perf_counter() - t
        cnt[label] += 1
        return r
    setattr(obj, name, g)


def report(title, n):
    rows = world.gather(dict(acc), root=0)
    if me == 0:
        print(f"# {title}: mean us per call over {n} calls (max over ranks)")
        for k in sorted(rows[0], key=lambda k: -rows[0][k]):
            print(f"  {k:>32} {max(r.get(k, 0) for r in rows) / n * 1e6:10.1f}  x{cnt[k] // n}")
    acc.clear()
    cnt.clear()


def timed(fn, n):
    for _ in range(3):
        fn()
    cp.cuda.Device().synchronize()
    world.Barrier()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    cp.cuda.Device().synchronize()
    return world.allreduce(time.perf_counter() - t, op=MPI.MAX) / n * 1e6


what = sys.argv[1]
if what == "fp8":
    c = cs.Communicator(world, backend="cuda")
    T, H, E, K = 4096, 7168, 256, 8
    rng = np.random.default_rng(me)
    x = cp.asarray(rng.standard_normal((T, H)).astype(np.float16))
    idx = cp.asarray(np.argsort(rng.random((T, E)), axis=1)[:, :K].astype(np.int64))
    w = cp.asarray(rng.random((T, K)).astype(np.float32))
    _, _, _, _, h = c.dispatch(x, idx, w, E)
    n = 20
    print_t = {"plain cached": timed(lambda: c.dispatch(x, handle=h), n),
               "fp8 cached": timed(lambda: c.dispatch(x, handle=h, wire_dtype="fp8"), n)}
    xf = x.astype(np.float32)
    q, s = quant.quantize_fp8(xf)
    (rq, rs), *_ = c.dispatch((q, s), handle=h)
    print_t["to_float32"] = timed(lambda: x.astype(np.float32), n)
    print_t["quantize_fp8 f32"] = timed(lambda: quant.quantize_fp8(xf), n)
    print_t["dispatch (q, s) cached"] = timed(lambda: c.dispatch((q, s), handle=h), n)
    print_t["dequantize_fp8"] = timed(lambda: quant.dequantize_fp8(rq, rs), n)
    df = quant.dequantize_fp8(rq, rs)
    print_t["from_float32"] = timed(lambda: df.astype(np.float16), n)
    if me == 0:
        print(f"# fp8 wire, {T} tokens x {H} fp16, top-{K} of {E}, {W} ranks: us per call (max over ranks)")
        for k, v in print_t.items():
            print(f"  {k:>26} {v:10.1f}")
    c.close()
elif what == "hier":
    c = cs.Communicator(world, backend="cuda")
    hc = cs.HierarchicalCommunicator(world, node_size=2, backend="cuda")
    for name in ("_rail_bytes", "_to_host", "_to_device", "_to_host_staged", "_to_device_staged", "_agree",
                 "_rail_exchange", "_result_order"):
        wrap(hc, name)
    nc = hc.node_comm
    for name in ("alltoallv", "dispatch", "combine"):
        wrap(nc, name, "node_comm." + name)
    wrap(hierarchical._agree, "exchange_all", "_agree.exchange_all")
    per = 16 << 20
    xb = cp.asarray(np.random.default_rng(me).integers(0, 255, per, dtype=np.uint8)).reshape(W, -1)
    n = 10
    for _ in range(2):
        hc.alltoall(xb)
    acc.clear(); cnt.clear()
    for _ in range(n):
        hc.alltoall(xb)
    report("hier alltoall 16 MiB per rank", n)
    host = np.empty(per, np.uint8)
    pinned = cp.cuda.alloc_pinned_memory(per)
    pin = np.frombuffer(pinned, np.uint8, per)
    t = {"asnumpy 16 MiB (pageable)": timed(lambda: cp.asnumpy(xb), n),
         "D2H 16 MiB pinned": timed(lambda: xb.reshape(-1).get(out=pin), n),
         "asarray 16 MiB (pageable)": timed(lambda: cp.asarray(host), n),
         "np.concatenate 16 MiB": timed(lambda: np.concatenate([host[: per // 2], host[per // 2:]]), n)}
    sc = np.full(W, per // W, np.int64); so = np.arange(W, dtype=np.int64) * (per // W)
    recv = np.empty(per, np.uint8)
    t["MPI Alltoallv world 16 MiB"] = timed(lambda: world.Alltoallv([host, (sc, so), MPI.BYTE],
                                                                      [recv, (sc, so), MPI.BYTE]), n)
    rail = hc._rail
    R = rail.Get_size()
    sc2 = np.full(R, per // R, np.int64); so2 = np.arange(R, dtype=np.int64) * (per // R)
    t["MPI Alltoallv rail 16 MiB"] = timed(lambda: rail.Alltoallv([host, (sc2, so2), MPI.BYTE],
                                                                    [recv, (sc2, so2), MPI.BYTE]), n)
    t["MPI Alltoallv rail pinned 16 MiB"] = timed(lambda: rail.Alltoallv([pin, (sc2, so2), MPI.BYTE],
                                                                           [recv, (sc2, so2), MPI.BYTE]), n)
    t["node alltoall 16 MiB"] = timed(lambda: nc.alltoall(xb[:2]), n)
    if me == 0:
        print(f"# pieces, us per call, {W} ranks, MPI {MPI.Get_library_version().splitlines()[0]}")
        for k, v in t.items():
            print(f"  {k:>34} {v:10.1f}")
    T, H, E, K = 1024, 7168, 256, 8
    rng = np.random.default_rng(me)
    x = cp.asarray(rng.standard_normal((T, H)).astype(np.float16))
    idx = cp.asarray(np.argsort(rng.random((T, E)), axis=1)[:, :K].astype(np.int64))
    wt = cp.asarray(rng.random((T, K)).astype(np.float32))
    for _ in range(2):
        r = hc.dispatch(x, idx, wt, E)
    acc.clear(); cnt.clear()
    for _ in range(n):
        r = hc.dispatch(x, idx, wt, E)
    report(f"hier dispatch {T} tokens", n)
    for _ in range(n):
        hc.combine(r[0], r[4], r[2])
    report(f"hier combine {T} tokens", n)
    hc.close()
    c.close()
