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
    from cupy_symbuf.bench import alltoallv as bv
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


def test_host_latency_bench_rows():
    """--op latency: every host row against MPI, with the issue's targets where they apply (its data checked
    before timing inside the bench)."""
    from cupy_symbuf.bench import host_latency as hl
    rows = _bench_rows(["--backend", "host", "--op", "latency", "--sizes", "64K,8K", "--iters", "3", "--warmup", "1"])
    if rows is not None:
        names = {"alltoall", "alltoall out=", "alltoallv recv_counts", "alltoallv count exchange"}
        assert {(r["row"], r["size_per_rank"]) for r in rows} == {(n, s) for n in names for s in (64 << 10, 8 << 10)}
        assert all(r["ours_us"] > 0 and r["mpi_us"] > 0 and r["ratio"] == r["ours_us"] / r["mpi_us"] for r in rows)
        assert all(r["target"] == hl.TARGETS.get((r["row"], r["size_per_rank"])) for r in rows)
        assert sum(r["target"] is not None for r in rows) == 3  # the 64 KiB rows of the three operations


def test_moe_dispatch_bench_rows():
    """--op dispatch: the routing is top-k distinct experts; every row (dispatch, cached, combine per token count)
    is reported with p50 <= p99 and both bandwidth conventions, DeepEP's (all received bytes) >= the off-rank one."""
    from cupy_symbuf.bench import moe as bm
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
    """--op hier: the hierarchical, flat and MPI rows per size, and the MoE rows (hierarchical dispatch / combine,
    flat, MPI Alltoallv of the same bytes), each checked against the reference first."""
    world = MPI.COMM_WORLD
    W = world.Get_size()
    k = 2 if W % 2 == 0 else 1
    rows = _bench_rows(["--backend", "host", "--op", "hier", "--node-size", str(k), "--sizes", "16K", "--iters", "3",
                        "--warmup", "1", "--moe-tokens", "32", "--hidden", "64", "--num-experts", str(4 * W),
                        "--topk", "4"])
    if rows is not None:
        assert {r["engine"] for r in rows if r["op"] == "hier"} == {"hierarchical", "ours-out", "mpi"}
        assert {r["engine"] for r in rows if r["op"] == "hier-moe"} == {
            "hier-dispatch", "flat-dispatch", "mpi-alltoallv-dispatch", "hier-dispatch-cached",
            "flat-dispatch-cached", "hier-combine", "flat-combine", "mpi-alltoallv-combine"}
        assert all(r["loop_us"] > 0 and r["node_size"] == k for r in rows)


# ---- energy (NVML), the CUDA-aware MPI row, the low-latency rows ------------------------------------------------

def test_bench_new_flags_parse():
    p = bench._parser()
    a = p.parse_args([])
    assert a.energy is True and a.references == "torch" and a.ll_tokens is None and a.ll_iters is None
    a = p.parse_args(["--no-energy", "--references", "torch,mpi", "--ll-tokens", "8,16", "--ll-iters", "50"])
    assert a.energy is False and a.references == "torch,mpi" and a.ll_tokens == "8,16" and a.ll_iters == 50
    assert p.parse_args(["--energy"]).energy is True
    from cupy_symbuf.bench import low_latency as _bench_ll
    assert _bench_ll.ll_tokens(p.parse_args([])) == [128]                      # --moe-tokens 4096,128
    assert _bench_ll.ll_tokens(p.parse_args(["--moe-tokens", "64,8"])) == []
    assert _bench_ll.ll_tokens(p.parse_args(["--ll-tokens", "8,16"])) == [8, 16]
    assert _bench_ll.ll_tokens(p.parse_args(["--ll-tokens", ""])) == []
    import pytest
    with pytest.raises(SystemExit):  # an unknown reference fails on every rank before anything collective
        bench.main(["--backend", "host", "--references", "torch,bogus"])


def test_host_energy_and_mpi_cuda_skip_with_reason(capsys):
    """Host backend: energy and mpi-cuda each print why they are skipped; every row has the fields, null."""
    rows = _bench_rows(["--backend", "host", "--sizes", "16K", "--iters", "2", "--warmup", "1", "--sends", "out",
                        "--references", "mpi"])
    printed = capsys.readouterr().out
    if rows is not None:
        assert "# energy: skipped: host backend" in printed
        assert "# mpi-cuda: skipped: host backend" in printed
        assert {r["engine"] for r in rows} == {"ours-out", "mpi", "copy"}
        for r in rows:
            assert "energy_J_per_GB" in r and r["energy_J_per_GB"] is None and r["idle_W"] is None
            assert r["energy_skipped"].startswith("host backend")
            assert r["skipped"]["mpi-cuda"].startswith("host backend")
            assert r["peer"] == "mpi" and r["vs_peer"] > 0
        assert all(abs(r["vs_peer"] - 1) < 1e-12 for r in rows if r["engine"] == "mpi")
    rows = _bench_rows(["--backend", "host", "--op", "dispatch", "--moe-tokens", "8", "--hidden", "128",
                        "--num-experts", str(2 * MPI.COMM_WORLD.Get_size()), "--topk", "2", "--iters", "3",
                        "--warmup", "1", "--ll-tokens", ""])
    if rows is not None:
        assert rows and all(r["energy_J_per_GB"] is None and r["energy_skipped"] for r in rows)


class _FakeNVML:
    """A stand-in for pynvml: an energy counter (mJ) that advances only when the measured function runs, a fixed
    power reading."""

    class NVMLError(Exception):
        pass

    def __init__(self, power_mw=60_000, fail_init=False):
        self.counter_mj = 1_000_000
        self.power_mw = power_mw
        self.fail_init = fail_init
        self.fail_reads = False
        self.shutdowns = 0

    def nvmlInit(self):
        if self.fail_init:
            raise self.NVMLError("Driver Not Loaded")

    def nvmlShutdown(self):
        self.shutdowns += 1

    def nvmlDeviceGetHandleByPciBusId(self, bus):
        return ("handle", bus)

    def nvmlDeviceGetTotalEnergyConsumption(self, handle):
        if self.fail_reads:
            raise self.NVMLError("GPU is lost")
        return self.counter_mj

    def nvmlDeviceGetPowerUsage(self, handle):
        return self.power_mw


def _open_fake(monkeypatch, fake, reader=None):
    import sys
    from cupy_symbuf.bench import energy as _bench_energy
    world = MPI.COMM_WORLD
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    meter, why = _bench_energy.EnergyMeter.open(
        world, world.Get_rank() == 0 if reader is None else reader, "0000:19:00.0", "ab" * 16, num_gpus=1,
        ranks_per_gpu=world.Get_size(), device_sync=lambda: None)
    return meter, why


def test_energy_arithmetic_with_a_fake_nvml(monkeypatch):
    """J/GB from the energy counter's advance: 500 mJ per call of 2e8 bytes (all ranks' input) -> 2.5 J/GB, whatever
    the number of calls; idle power from the power readings (60 W, rank 0 reads: one GPU shared by the ranks)."""
    import pytest
    from cupy_symbuf.bench import energy as _bench_energy
    f = _bench_energy.energy_figures(12_000.0, 2.0, 100, 1e8, idle_w=1.0)    # 12 J over 100 x 0.1 GB = 10 GB
    assert f["energy_J_per_GB"] == pytest.approx(1.2) and f["energy_avg_W"] == pytest.approx(6.0)
    assert f["energy_above_idle_J_per_GB"] == pytest.approx((12 - 1.0 * 2.0) / 10)
    assert f["energy_calls"] == 100 and f["energy_bytes"] == 1e10
    world = MPI.COMM_WORLD
    fake = _FakeNVML()
    meter, why = _open_fake(monkeypatch, fake)
    assert why is None and meter is not None
    assert ("shared by" in meter.scope) == (world.Get_size() > 1) and "whole GPU" in meter.scope
    meter.min_s, meter.idle_s, meter.idle_period_s = 0.05, 0.02, 0.005
    assert meter.measure_idle() == pytest.approx(60.0)                       # one reader: 60 W
    assert meter.idle_energy_w == 0.0                                        # the counter did not move while idle

    def call():
        fake.counter_mj += 500
        import time
        time.sleep(0.002)
    got = meter.measure(call, None, 2e8, est_s=0.002)
    assert got["energy_calls"] >= 1 and got["energy_s"] >= 0.05
    assert got["energy_J_per_GB"] == pytest.approx(2.5, rel=1e-12)
    calls, s = got["energy_calls"], got["energy_s"]
    assert got["energy_J"] == pytest.approx(0.5 * calls)
    assert got["energy_above_idle_J_per_GB"] == pytest.approx((0.5 * calls - 60.0 * s) / (calls * 0.2))
    assert got["idle_W"] == pytest.approx(60.0) and got["energy_scope"] == meter.scope
    # a timer carrying the meter: the bench row's fields
    timer = bench._Timer("host")
    timer.energy = meter
    row = _bench_energy.row_fields(timer, call, None, 2e8, 0.002, _bench_energy.A2A_BYTES)
    assert row["energy_J_per_GB"] == pytest.approx(2.5, rel=1e-12)
    assert row["energy_bytes_kind"] == _bench_energy.A2A_BYTES
    assert set(row) == set(_bench_energy.EMPTY)
    # a reading failing later: no crash, the meter is off, the row says why (every rank alike)
    fake.fail_reads = True
    assert meter.measure(call, None, 2e8, est_s=0.002) is None and meter.failed
    fake.fail_reads = False
    row = _bench_energy.row_fields(timer, call, None, 2e8, 0.002, _bench_energy.A2A_BYTES)
    assert row["energy_J_per_GB"] is None and row["energy_skipped"] == meter.failed
    meter.close()
    assert fake.shutdowns == (1 if world.Get_rank() == 0 else 0)
    timer = bench._Timer("host")
    assert _bench_energy.row_fields(timer, call, None, 1, None, "x")["energy_J_per_GB"] is None


def test_energy_skips_when_nvml_is_missing_or_fails(monkeypatch):
    """No pynvml, or nvmlInit failing on the reading rank: the same reason on every rank, no meter, no crash."""
    world = MPI.COMM_WORLD
    meter, why = _open_fake(monkeypatch, None)                    # sys.modules[name] = None: ImportError
    assert meter is None and "pynvml is not installed" in why
    meter, why = _open_fake(monkeypatch, _FakeNVML(fail_init=True))
    assert meter is None and "nvmlInit failed" in why and "Driver Not Loaded" in why
    assert world.allgather(why) == [why] * world.Get_size()


def test_mpi_cuda_support_query(monkeypatch):
    """The CUDA-support question is answered without touching a device array (forced by the environment)."""
    from cupy_symbuf.bench import mpi_cuda as mc
    monkeypatch.setenv("CUPY_SYMBUF_MPI_CUDA", "0")
    assert mc.cuda_support() == (False, "CUPY_SYMBUF_MPI_CUDA=0")
    monkeypatch.setenv("CUPY_SYMBUF_MPI_CUDA", "1")
    assert mc.cuda_support()[0] is True
    monkeypatch.delenv("CUPY_SYMBUF_MPI_CUDA")
    ok, how = mc.cuda_support()
    assert ok in (True, False, None) and how


def test_low_latency_rows_on_the_host():
    """--op dispatch times ll-dispatch / ll-combine (checked against NumPy first) with p50 <= p99 and the iteration
    count asked for; the energy fields are there, null on the host."""
    W = MPI.COMM_WORLD.Get_size()
    rows = _bench_rows(["--backend", "host", "--op", "dispatch", "--moe-tokens", "16", "--hidden", "256",
                        "--num-experts", str(4 * W), "--topk", "3", "--iters", "3", "--warmup", "1",
                        "--ll-tokens", "16,8", "--ll-iters", "12"])
    if rows is not None:
        ll = [r for r in rows if r["op"].startswith("ll-")]
        assert {(r["tokens"], r["op"]) for r in ll} == {(t, o) for t in (16, 8) for o in ("ll-dispatch", "ll-combine")}
        assert all(0 < r["p50_us"] <= r["p99_us"] and r["loop_us"] > 0 and r["iters"] == 12 for r in ll)
        assert all(r["deepep_GBps"] >= r["nvl_GBps"] >= 0 for r in ll)
        assert all(r["nvl_GBps"] > 0 for r in ll) or W == 1
        assert all("energy_J_per_GB" in r and r["energy_J_per_GB"] is None for r in ll)


def test_low_latency_references():
    """The NumPy references the low-latency rows are checked against, on a hand example: 2 ranks, 1 expert each,
    top-2; combine of identity experts = the token times the sum of its weights (rounded as documented)."""
    from cupy_symbuf.bench import low_latency as _bench_ll
    x0 = np.array([[1, 2], [3, 4]], np.float16)
    x1 = np.array([[5, 6]], np.float16)
    i0 = np.array([[0, 1], [1, -1]], np.int64)
    i1 = np.array([[0, 1]], np.int64)
    rows, cnt = _bench_ll.reference_dispatch([x0, x1], [i0, i1], 1, 1)          # rank 1 holds expert 1
    assert cnt.tolist() == [3] and rows[0].tolist() == [[1, 2], [3, 4], [5, 6]]
    w = np.array([[0.25, 0.5], [1.0, 0.0]], np.float32)
    y = _bench_ll.reference_combine(x0, i0, w, 2, 1)
    assert y.dtype == np.float16 and y.tolist() == [[0.75, 1.5], [3.0, 4.0]]


# ---- argument checks: counts >= 1, references an op does not time -------------------------------------------

import pytest  # noqa: E402


@pytest.mark.parametrize("argv, flag, lo", [
    (["--iters", "0"], "--iters", 1), (["--iters", "-2"], "--iters", 1), (["--iters", "x"], "--iters", 1),
    (["--moe-tokens", "0"], "--moe-tokens", 1), (["--moe-tokens", "4096,-128"], "--moe-tokens", 1),
    (["--moe-tokens", "4096,"], "--moe-tokens", 1), (["--warmup", "-1"], "--warmup", 0),
    (["--tokens", "0"], "--tokens", 1), (["--ll-iters", "0"], "--ll-iters", 1), (["--hidden", "0"], "--hidden", 1),
    (["--num-experts", "-8"], "--num-experts", 1), (["--topk", "0"], "--topk", 1),
    (["--tune-rounds", "0"], "--tune-rounds", 1), (["--node-size", "0"], "--node-size", 1),
])
def test_counts_must_be_positive(argv, flag, lo, capsys):
    """Zero or negative counts are refused by argparse (exit 2, "must be an int >= 1" naming the flag); the old
    parser took them (int) and the runs then timed nothing or failed deep inside."""
    with pytest.raises(SystemExit) as e:
        bench._parser().parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}:" in err and f"int >= {lo}" in err, err


def test_counts_accepted_values():
    a = bench._parser().parse_args(["--iters", "1", "--warmup", "0", "--moe-tokens", " 64, 8", "--tokens", "3"])
    assert (a.iters, a.warmup, a.moe_tokens, a.tokens) == (1, 0, "64,8", 3)
    assert bench._parser().parse_args([]).moe_tokens == "4096,128"


@pytest.mark.parametrize("argv", [["--op", "dispatch"], ["--op", "delta"], ["--op", "hier"], ["--control"]])
def test_mpi_reference_refused_where_it_times_nothing(argv, capsys):
    """``--references mpi`` with an op the mpi reference does not cover is an argparse error (exit 2, before anything
    collective), like an unknown reference; it used to add nothing without a word."""
    with pytest.raises(SystemExit) as e:
        bench.main(["--backend", "host", "--references", "mpi"] + argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--references mpi" in err and "covers --op alltoall and alltoallv only" in err, err


@pytest.mark.parametrize("argv, text", [
    (["--op", "adaptive", "--patterns", "bogus"], "'bogus' is not a pattern of --op adaptive"),
    (["--op", "adaptive", "--patterns", "uniform,zipf"], "'zipf' is not a pattern of --op adaptive"),
    (["--op", "adaptive", "--patterns", "zipfnan"], "'zipfnan' is not a pattern"),
    (["--op", "adaptive", "--patterns", "zipf-1"], "'zipf-1' is not a pattern"),
    (["--op", "adaptive", "--wire", "fp8"], "--wire applies to --op dispatch only (got --op adaptive)"),
    (["--wire", "fp8"], "--wire applies to --op dispatch only (got --op alltoall)"),
    (["--tune", "--op", "dispatch", "--wire", "fp8"], "--op, --wire would be ignored"),
    (["--tune", "--mode", "ring"], "--mode would be ignored"),
    (["--tune-out", "/tmp/t.json"], "--tune-out is --tune's output file"),
])
def test_bad_arguments_found_before_anything_collective(argv, text, capsys):
    """From a new-user attack: a bad --patterns of --op adaptive gave a traceback on every rank after part of the run
    (or, for 'zipf', after the first pattern's timing); now an argparse error (exit 2) before anything runs."""
    with pytest.raises(SystemExit) as e:
        bench.main(["--backend", "host"] + argv)
    assert e.value.code == 2
    assert text in capsys.readouterr().err


def test_node_size_must_divide_the_world(comm, capsys):
    W = comm.Get_size()
    with pytest.raises(SystemExit) as e:
        bench.main(["--backend", "host", "--op", "hier", "--node-size", str(W + 1)])
    assert e.value.code == 2
    assert "must divide the world size" in capsys.readouterr().err
