"""The benchmark entry point runs (tiny sizes, host path) and checks its data before timing; no timing asserted."""
import json
import os
import tempfile

import numpy as np

from mpi4py import MPI

from cupy_symbuf import bench


def test_parse_size():
    assert bench.parse_size("16M") == 16 << 20 and bench.parse_size("1G") == 1 << 30
    assert bench.parse_size("4KiB") == 4096 and bench.parse_size("1000") == 1000


def _bench_rows(argv):
    """Run ``bench.main(argv + ["--json", file])`` on every rank; rank 0 gets the rows written, the others None.
    One file made by rank 0 (pytest's tmp_path would make every rank clean one shared base folder: a race)."""
    world = MPI.COMM_WORLD
    path = world.bcast(tempfile.mkstemp(suffix=".json")[1] if world.Get_rank() == 0 else None)
    assert bench.main(list(argv) + ["--json", path]) == 0
    world.Barrier()
    if world.Get_rank() != 0:
        return None
    with open(path) as f:
        rows = json.load(f)
    os.remove(path)
    return rows


def _has_torch() -> bool:
    try:
        import torch.distributed as dist
        return dist.is_available()
    except ImportError:
        return False


def test_bench_runs_and_reports():
    rows = _bench_rows(["--backend", "host", "--sizes", "64K", "--iters", "2", "--warmup", "1", "--relaxed"])
    if rows is not None:
        # torch.distributed (gloo) beside MPI when it could start (torch present and its process group up)
        refs = ("mpi",) + (("torch",) if _has_torch() and bench._TORCH["ready"] is True else ())
        assert {(r["engine"], r["timing"]) for r in rows} == \
            {(e, t) for e in ("ours", "ours-out", "ours-sym", "ours-sym-relaxed") + refs
             for t in ("call", "loop")} | {("copy", "loop")}
        # the copy row is the reference of copy_share (100% by construction); every share is a positive fraction
        assert all(abs(r["copy_share"] - 1) < 1e-9 for r in rows if r["engine"] == "copy")
        assert all(r["copy_share"] > 0 and r["copy_GBps"] > 0 for r in rows)
        assert all(r["time_us"] > 0 and r["size_per_rank"] == 64 * 1024 // MPI.COMM_WORLD.Get_size()
                   * MPI.COMM_WORLD.Get_size() for r in rows)


def test_bench_plots():
    """--plot writes the two PNGs from the run's rows (rank 0)."""
    import pytest
    pytest.importorskip("matplotlib")
    world = MPI.COMM_WORLD
    folder = world.bcast(tempfile.mkdtemp() if world.Get_rank() == 0 else None)
    assert bench.main(["--backend", "host", "--sizes", "8K,64K", "--iters", "2", "--warmup", "1", "--sends", "out",
                       "--plot", folder]) == 0
    world.Barrier()
    if world.Get_rank() == 0:
        for name in ("bandwidth.png", "latency.png"):
            assert os.path.getsize(os.path.join(folder, name)) > 1000


def test_alltoallv_patterns_and_percentiles():
    from cupy_symbuf import _bench_alltoallv as bv
    W = 4
    for me in range(W):
        for pattern in bv.PATTERNS:
            c = bv.pattern_counts(pattern, me, W, 1000)
            assert c.sum() == 1000 and (c >= 0).all()
        assert bv.pattern_counts("hot", me, W, 1000)[0] >= 500                     # half to rank 0
        z = bv.pattern_counts("zipf", me, W, 1000)
        assert z[me] == z.max() and z[(me + 1) % W] > z[(me + 2) % W]            # its own favourites
    world = MPI.COMM_WORLD
    rows = _bench_rows(["--backend", "host", "--op", "alltoallv", "--sizes", "16K", "--iters", "5", "--warmup", "1"])
    if rows is not None:
        assert {(r["pattern"], r["engine"]) for r in rows} == {(p, e) for p in bv.PATTERNS for e in ("ours", "mpi")}
        assert all(0 < r["p50_us"] <= r["p99_us"] and r["loop_us"] > 0 for r in rows)
        hot = [r for r in rows if r["pattern"] == "hot"]
        assert all(r["max_recv_rows_over_mean"] >= (world.Get_size() / 2 if world.Get_size() > 1 else 1) - 0.01
                   for r in hot)


def test_moe_dispatch_bench_rows():
    """--op dispatch: the routing is top-k distinct experts; every row (dispatch, cached, combine per token count)
    is reported with p50 <= p99 and both bandwidth conventions, DeepEP's (all received bytes) >= the off-rank one."""
    from cupy_symbuf import _bench_moe as bm
    idx = bm.routing(np.random.default_rng(0), 50, 16, 4)
    assert idx.shape == (50, 4) and all(len(set(r)) == 4 for r in idx.tolist()) and idx.min() >= 0 and idx.max() < 16
    world = MPI.COMM_WORLD
    W = world.Get_size()
    rows = _bench_rows(["--backend", "host", "--op", "dispatch", "--moe-tokens", "64,8", "--hidden", "256",
                        "--num-experts", str(4 * W), "--topk", "3", "--iters", "5", "--warmup", "1", "--wire", "fp8"])
    if rows is not None:
        ops = ("dispatch", "dispatch-cached", "combine", "dispatch-sym", "dispatch-cached-sym", "dispatch-fp8",
               "dispatch-cached-fp8")
        assert {(r["tokens"], r["op"]) for r in rows} == {(t, o) for t in (64, 8) for o in ops}
        assert all(5e-3 < r["rel_l2_error"] < 5e-2 for r in rows if r["op"].endswith("fp8"))
        assert all(0 < r["p50_us"] <= r["p99_us"] and r["loop_us"] > 0 for r in rows)
        assert all(r["deepep_GBps"] >= r["nvl_GBps"] >= 0 for r in rows)
        assert all(r["nvl_GBps"] > 0 for r in rows) or W == 1


def test_delta_bench_rows():
    """--op delta: plain and delta rows per size; the delta row sends fewer bytes (1 + 4/128 per element against 4,
    refreshes included) and its copy stays close to the rows."""
    world = MPI.COMM_WORLD
    got = _bench_rows(["--backend", "host", "--op", "delta", "--sizes", "64K", "--iters", "5", "--warmup", "1"])
    if got is not None:
        rows = {r["engine"]: r for r in got}
        assert set(rows) == {"plain", "delta"} and all(r["loop_us"] > 0 for r in rows.values())
        if world.Get_size() > 1:
            assert 2.5 < rows["plain"]["sent_bytes_per_step"] / rows["delta"]["sent_bytes_per_step"] < 4.0
        assert 0 <= rows["delta"]["max_rel_err"] < 1e-3


def test_hierarchical_bench_rows():
    """--op hier: the hierarchical, flat and MPI rows per size, each checked against the reference first."""
    world = MPI.COMM_WORLD
    W = world.Get_size()
    k = 2 if W % 2 == 0 else 1
    rows = _bench_rows(["--backend", "host", "--op", "hier", "--node-size", str(k), "--sizes", "16K", "--iters", "3",
                        "--warmup", "1"])
    if rows is not None:
        assert {r["engine"] for r in rows} == {"hierarchical", "ours-out", "mpi"}
        assert all(r["loop_us"] > 0 and r["node_size"] == k for r in rows)
