"""Where the small-message alltoall kernel's time goes (``cuda_src/small_exchange.cu``): its build with phase stamps
(``-DSYMBUF_SMALL_PROFILE=1``, added here to ``CUPY_SYMBUF_NVRTC_DEFINES``; every other ``-D`` given there, e.g.
``-DSYMBUF_SMALL_PIPELINE=0``, picks the variant profiled) runs ``alltoall`` at 64 KiB and 1 MiB per rank, CALLS
calls back to back (loop) and CALLS replays of a CUDA graph, each after a warm-up and checked once against NumPy.

    mpirun -n 2 python3 tests/device/small_profile.py        (and -n 4; all ranks on one GPU under MPS)

Per size and mode, over every rank's calls (median / p90 of the calls; us): the host's wall time per call; the
kernel from its first block's start to its last block's end; start to start of consecutive kernels of a rank and the
idle gap between them; the spread of the blocks' start times; the ranks' launch skew (latest minus earliest kernel
start of the same call; ``%globaltimer`` is one clock per GPU, so ranks sharing it compare); the one-way latency
(the peer's sending block past its state line, to our block having the peer's header), where each block has one
item. Then per phase (``wire/protocol.py`` SMALL_PROF_*), from the kernel's start: the first block to reach it
(median), the last (median, p90), and the last block's phase from its own start in ``clock64`` cycles at the
calibrated rate (for when ``%globaltimer`` is coarse: its step is printed). The profiling build adds a shared-memory
stamp per phase and a record write at each block's end (~1 us): its wall times run a little over the plain build's.
"""
import os
import time

os.environ["CUPY_SYMBUF_NVRTC_DEFINES"] = (os.environ.get("CUPY_SYMBUF_NVRTC_DEFINES", "") +
                                           " -DSYMBUF_SMALL_PROFILE=1").strip()

import cupy as cp  # noqa: E402
import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

import cupy_symbuf as cs  # noqa: E402
from cupy_symbuf.transport import kernels  # noqa: E402
from cupy_symbuf.transport.cuda import SMALL_SOURCE  # noqa: E402
from cupy_symbuf.utils import select_device  # noqa: E402
from cupy_symbuf.wire import protocol as P  # noqa: E402

CALLS = int(os.environ.get("SMALL_PROFILE_CALLS", "50"))
assert CALLS <= P.SMALL_PROF_CALLS
PHASES = [("state line (send)", P.SMALL_PROF_SEQ), ("self rows copied", P.SMALL_PROF_COPY),
          ("sends issued", P.SMALL_PROF_SENT), ("state lines (recv)", P.SMALL_PROF_RSEQ),
          ("header checked", P.SMALL_PROF_HEADER), ("first words in", P.SMALL_PROF_FIRST),
          ("all words in", P.SMALL_PROF_RECEIVED), ("end", P.SMALL_PROF_END)]

world = MPI.COMM_WORLD
W, me = world.Get_size(), world.Get_rank()
select_device(world)


def records(prof, grid: int) -> np.ndarray:
    """[CALLS, grid, SMALL_PROF_RECORD] of the last run (the counters zeroed before it)."""
    host = prof.get()
    counters = host[:P.SMALL_PROF_BLOCKS]
    assert (counters[:grid] == CALLS).all(), f"rank {me}: block launch counts {counters[:grid]}, expected {CALLS}"
    recs = host[P.SMALL_PROF_BLOCKS:].reshape(P.SMALL_PROF_CALLS, P.SMALL_PROF_BLOCKS, P.SMALL_PROF_RECORD)
    return recs[:CALLS, :grid].astype(np.int64)


def run(prof, launch, grid: int):
    """CALLS launches after zeroing the stamps; (records, wall us per call max over ranks)."""
    cp.cuda.Device().synchronize()
    prof.fill(0)
    cp.cuda.Device().synchronize()
    world.Barrier()
    t0 = time.perf_counter()
    for _ in range(CALLS):
        launch()
    cp.cuda.Device().synchronize()
    wall = world.allreduce(time.perf_counter() - t0, op=MPI.MAX) / CALLS * 1e6
    return records(prof, grid), wall


def q(v, p=50):
    v = np.asarray(v, dtype=np.float64)
    return float(np.percentile(v, p)) / 1e3 if v.size else float("nan")


SUMMARY = []


def report(title, recs_all, wall):
    """Rank 0 prints the table of every rank's records ([rank] of [CALLS, grid, RECORD]) and keeps a summary line."""
    if me != 0:
        return
    ph = P.SMALL_PROF_PHASES
    gts = [r[:, :, :ph] for r in recs_all]
    starts = np.stack([g[:, :, P.SMALL_PROF_START].min(1) for g in gts])  # [rank, call]
    ends = np.stack([g[:, :, P.SMALL_PROF_END].max(1) for g in gts])
    spread = np.concatenate([g[:, :, P.SMALL_PROF_START].max(1) - g[:, :, P.SMALL_PROF_START].min(1) for g in gts])
    seqs = np.stack([r[:, :, P.SMALL_PROF_SEQ_NO].max(1) for r in recs_all])
    same_call = bool((seqs == seqs[0]).all())
    stamps = np.sort(np.unique(np.concatenate([g[g > 0].ravel() for g in gts])))
    step = int(np.diff(stamps).min()) if stamps.size > 1 else 0
    lines = [f"# {title}: {W} ranks, {CALLS} calls, grid {recs_all[0].shape[1]}, wall {wall:.1f} us/call; "
             f"globaltimer step {step} ns; calls matched by seq: {same_call}",
             f"  kernel {q(ends - starts):.2f} / {q(ends - starts, 90):.2f}   start-to-start "
             f"{q(np.diff(starts, axis=1)):.2f}   idle gap {q(starts[:, 1:] - ends[:, :-1]):.2f}   block start "
             f"spread {q(spread):.2f} / {q(spread, 90):.2f}   rank skew {q(starts.max(0) - starts.min(0)):.2f} / "
             f"{q(starts.max(0) - starts.min(0), 90):.2f}"]
    grid = recs_all[0].shape[1]
    one_item = all(((r[:, :, P.SMALL_PROF_INFO] & 0xFF) == 1).all() for r in recs_all) and grid % W == 0
    if one_item:  # block b: item b = (peer b // per, part b % per) on every rank
        per = grid // W
        lat = []
        for r in range(W):
            for p in range(W):
                if p != r:  # our block of (p, 0) has the header that p's block of (r, 0) sent after its state line
                    lat.append(gts[r][:, p * per, P.SMALL_PROF_HEADER] - gts[p][:, r * per, P.SMALL_PROF_SEQ])
        lines[-1] += f"   one-way (state line -> header) {q(np.concatenate(lat)):.2f}"
    clk = [r[:, :, ph:2 * ph] for r in recs_all]
    dgt = np.concatenate([(g[:, :, P.SMALL_PROF_END] - g[:, :, P.SMALL_PROF_START]).ravel() for g in gts])
    dclk = np.concatenate([(k[:, :, P.SMALL_PROF_END] - k[:, :, P.SMALL_PROF_START]).ravel() for k in clk])
    ns_per_cycle = dgt.sum() / max(dclk.sum(), 1)
    lines.append(f"  {'phase (us from kernel start)':<30}{'first':>7}{'last':>7}{'p90':>7}"
                 f"{'blk clk':>9}  (clk: {1 / ns_per_cycle:.2f} GHz)")
    for name, p in PHASES:
        first, last, inblk = [], [], []
        for g, k, s in zip(gts, clk, starts):
            has = g[:, :, p] > 0
            for c in range(g.shape[0]):
                if has[c].any():
                    d = g[c, has[c], p] - s[c]
                    first.append(d.min())
                    last.append(d.max())
                    inblk.append((k[c, has[c], p] - k[c, has[c], P.SMALL_PROF_START]).max() * ns_per_cycle)
        if last:
            lines.append(f"  {name:<30}{q(first):7.2f}{q(last):7.2f}{q(last, 90):7.2f}{q(inblk):9.2f}")
    print("\n".join(lines), flush=True)
    SUMMARY.append(f"{title.split(' [')[0]:<28} wall {wall:6.2f}  kernel {q(ends - starts):6.2f}  idle gap "
                   f"{q(starts[:, 1:] - ends[:, :-1]):5.2f}  skew {q(starts.max(0) - starts.min(0)):5.2f}")


def main():
    defines = os.environ["CUPY_SYMBUF_NVRTC_DEFINES"]
    bad = 0
    with cs.Communicator(world, backend="cuda") as c:
        transport = c.engine.transport if hasattr(c, "engine") else c._transport
        prof = None
        stream = cp.cuda.Stream(non_blocking=True)
        for per_rank in (64 << 10, 1 << 20):
            rng = np.random.default_rng([me, per_rank])
            xh = rng.integers(0, 255, (W, per_rank // W), dtype=np.uint8)
            x = cp.asarray(xh)
            out = cp.empty_like(x)
            with stream:
                for _ in range(5):
                    c.alltoall(x, out=out)
                stream.synchronize()
                want = np.stack([a[me] for a in world.allgather(xh)])
                bad += int(not np.array_equal(out.get(), want))
                if prof is None:  # the module is compiled by now (first call)
                    mod = kernels.get_module(SMALL_SOURCE, cp.cuda.Device().id, ())
                    size = P.SMALL_PROF_BLOCKS * (1 + P.SMALL_PROF_CALLS * P.SMALL_PROF_RECORD)
                    prof = cp.ndarray((size,), dtype=np.uint64, memptr=mod.get_global("symbuf_small_prof"))
                small = transport.small_calls
                c.alltoall(x, out=out)
                stream.synchronize()
                if transport.small_calls != small + 1:
                    raise SystemExit(f"alltoall {per_rank} B per rank did not go by the small protocol "
                                     f"(small_peer_bytes {transport.small_peer_bytes})")
                prof.fill(0)
                c.alltoall(x, out=out)
                stream.synchronize()
                grid = int((prof[:P.SMALL_PROF_BLOCKS] > 0).sum().get())
                recs, wall = run(prof, lambda: c.alltoall(x, out=out), grid)
                report(f"{per_rank >> 10} KiB per rank, loop [{defines}]", world.gather(recs, root=0), wall)
                stream.begin_capture()
                c.alltoall(x, out=out)
                graph = stream.end_capture()
                for _ in range(5):
                    graph.launch(stream)
                out.fill(0)
                graph.launch(stream)
                stream.synchronize()
                bad += int(not np.array_equal(out.get(), want))
                recs, wall = run(prof, lambda: graph.launch(stream), grid)
                report(f"{per_rank >> 10} KiB per rank, graph replay", world.gather(recs, root=0), wall)
    if me == 0:
        print(f"# summary, {W} ranks [{defines}] (us, medians)\n" + "\n".join(SUMMARY), flush=True)
    if world.allreduce(bad) and me == 0:
        raise SystemExit("wrong results")


if __name__ == "__main__":
    main()
