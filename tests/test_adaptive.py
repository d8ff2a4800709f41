"""Adaptive channel assignment (``Config(adaptive=True)``): skewed traffic (one hot rank, Zipf routing)
gives bitwise the results of a NumPy reference with work sharing and re-balanced home maps, at any re-balance
interval and with ranks that differ in the option; the load counters of ``channel_stats`` add up to the bytes the
calls moved (independent count from the send counts); the home map gives the hot peer the warps and never moves a
group's dedicated warp; bad arguments raise naming the argument."""
import numpy as np
import pytest

import cupy_symbuf as cs
from cupy_symbuf.wire import protocol as P
from cupy_symbuf.wire.plan import kernel_geometry
from cupy_symbuf.transport.adaptive import home_map, pack_home, workers_per_peer
from _util import random_rows, reference_alltoallv, rng_for, to_backend, to_numpy


def _first_warp(W, rank, p):
    geo = kernel_geometry(W)
    return p * geo.ring_warps if p < rank else rank * geo.ring_warps + geo.self_warps + (p - rank - 1) * geo.ring_warps


@pytest.mark.parametrize("W", [2, 3, 4, 5, 8, 15])
def test_home_map_gives_the_hot_peer_the_warps(W):
    geo = kernel_geometry(W)
    for rank in range(W):
        loads = np.full(W, 1000, np.int64)
        hot = (rank + 1 + W // 2) % W if W > 2 else 1 - rank
        loads[hot] = 10 ** 7
        loads[rank] = 12345  # ignored
        home = home_map(loads, W, rank)
        assert home.dtype == np.uint8 and home.shape == (32,)
        workers = workers_per_peer(home, W, rank)
        assert workers[rank] == 0
        total = (W - 1) * (geo.ring_warps - 1) + geo.self_warps
        assert sum(workers) == total
        for p in range(W):
            if p != rank:
                # the dedicated warp (copy warp 0 of each group) always stays home
                assert home[_first_warp(W, rank, p) + 1] == P.HOME_OWN
                assert workers[p] >= 1
        assert workers[hot] == max(workers)
        if W > 2:
            assert workers[hot] >= total - (W - 2) * 1 - 1  # every shareable warp but rounding goes to the hot peer
        assert (home_map(loads, W, rank) == home).all()  # deterministic


def test_home_map_edge_cases():
    assert (home_map([0, 0, 0, 0], 4, 1) == P.HOME_OWN).all()  # nothing moved: static
    assert (home_map([5], 1, 0) == P.HOME_OWN).all()
    assert (home_map(np.arange(16) * 7, 16, 3) == P.HOME_OWN).all()  # one warp per group: no sharing
    with pytest.raises(ValueError, match="'loads'.*shape"):
        home_map([1, 2], 3, 0)
    with pytest.raises(ValueError, match="'loads'.*>= 0"):
        home_map([1, -2, 3], 3, 0)
    a = np.arange(32, dtype=np.uint8)
    b = (np.arange(32, dtype=np.uint8) * 7) % 251
    words = pack_home(a, b)
    assert words.dtype == np.int64 and words.shape == (P.HOME_WORDS,)
    for w in range(32):  # the kernel's decoding: byte w % 8 of word w // 8
        assert (int(words[w // 8]) >> (8 * (w % 8))) & 0xFF == a[w]
        assert (int(words[4 + w // 8]) >> (8 * (w % 8))) & 0xFF == b[w]


def test_config_fields_are_checked():
    assert cs.Config().adaptive is False and cs.Config().adaptive_interval == 100
    with pytest.raises(TypeError, match="adaptive must be True or False"):
        cs.Config(adaptive=1)
    for bad in (0, -3, 1.5, "100", True):
        with pytest.raises(ValueError, match="adaptive_interval must be an int >= 1"):
            cs.Config(adaptive_interval=bad)
    assert cs.Config(adaptive_interval=np.int64(7)).adaptive_interval == 7
    with pytest.raises(ValueError, match="adaptive=True needs num_slots <= 32"):
        cs.Config(adaptive=True, num_slots=64).resolved("cuda", world_size=4)
    cs.Config(adaptive=True, num_slots=64).resolved("host", world_size=4)  # the host engine has no window


def _skewed_counts(rng, W, me, kind, scale):
    if kind == "hot_rank":
        counts = rng.integers(1, 8, W)
        counts[0] = scale  # every rank sends most of its rows to rank 0
    elif kind == "zipf":
        ranks = (np.arange(W) + me) % W  # each rank's own hot peer order, heavy tail
        counts = np.floor(scale / (1 + ranks) ** 1.5).astype(np.int64) + rng.integers(0, 3, W)
    else:
        counts = np.full(W, scale // max(1, W))
    return counts.astype(np.int64)


@pytest.mark.parametrize("kind", ["hot_rank", "zipf", "uniform"])
def test_skewed_alltoallv_matches_numpy_and_counts_add_up(comm, backend, kind):
    W, me = comm.Get_size(), comm.Get_rank()
    rng = rng_for(comm, 1301)
    row = (24,)
    scale = 3000 if backend == "host" else 60000
    sent = np.zeros(W, np.int64)
    with cs.Communicator(comm, cs.Config(adaptive=True, adaptive_interval=3), backend=backend) as c:
        for it in range(10):
            counts = _skewed_counts(rng, W, me, kind, scale)
            x = random_rows(rng, int(counts.sum()), row, np.float32)
            want, want_counts = reference_alltoallv(comm, x, counts)
            got, got_counts = c.alltoallv(to_backend(x, backend), counts)
            np.testing.assert_array_equal(to_numpy(got_counts), want_counts)
            np.testing.assert_array_equal(to_numpy(got).view(np.uint8), want.view(np.uint8))
            sent += counts
        # the last collective step before this rank's own counters are checked (a check failing on one rank
        # leaves the block by an exception: every rank's close still meets, the peers' raising its abort)
        everyone = comm.allgather(sent)
        st = c.channel_stats()
        assert st["adaptive"] and st["interval"] == 3 and st["calls"] == 10
        row_bytes = 4 * 24
        send_bytes = np.asarray(st["send"]["bytes"])
        assert send_bytes.shape == (c.layout.num_channels, W)
        want_peer = sent * row_bytes
        want_peer[me] = 0  # own rows take no ring
        np.testing.assert_array_equal(send_bytes.sum(axis=0), want_peer)
        np.testing.assert_array_equal(np.asarray(st["send"]["bytes_per_peer"]), want_peer)
        got_from = np.array([everyone[s][me] for s in range(W)]) * row_bytes
        got_from[me] = 0
        np.testing.assert_array_equal(np.asarray(st["recv"]["bytes"]).sum(axis=0), got_from)
        chunks = np.asarray(st["send"]["chunks"])
        # (the host carries a run of at most HOST_CHUNK_LEAST_BYTES in its header's slot: no chunk for it)
        inline = 10 * cs.wire.protocol.HOST_CHUNK_LEAST_BYTES if backend == "host" else 0
        assert (chunks >= -(-(send_bytes - inline) // c.layout.chunk_bytes)).all()
        assert (chunks[send_bytes == 0] == 0).all()
        if W > 2:
            assert st["rebalances"] == 3
            if kind == "hot_rank" and me != 0:  # the map now sends the shareable warps to rank 0's run
                assert st["remaps"] >= 1
                assert st["send"]["workers"][0] == max(st["send"]["workers"])
        if backend == "cuda" and W > 2 and kind == "hot_rank":
            assert st["work_sharing"]
            if me != 0:  # other groups' and the self group's warps copied chunks of the hot run
                assert np.asarray(st["send"]["stolen"])[:, 0].sum() > 0
        st2 = c.channel_stats(reset=True)
        assert st2["send"]["bytes"] == st["send"]["bytes"]
        st3 = c.channel_stats()
        assert not np.asarray(st3["send"]["bytes"]).any() and not any(st3["send"]["bytes_per_peer"])
        assert st3["calls"] == st3["rebalances"] == st3["remaps"] == 0


def test_direct_host_sends_count_on_channel_zero(comm, backend):
    """A host alltoallv out of a symmetric array goes direct: its rows travel on channel 0 alone, and the send
    counters say so (every byte on channel 0, no chunks) while the results match the reference; the receive
    counters add up to what the peers sent."""
    if backend != "host":
        pytest.skip("the host engine's direct mode")
    from mpi4py import MPI
    W, me = comm.Get_size(), comm.Get_rank()
    rng = rng_for(comm, 1304)
    with cs.Communicator(comm, cs.Config(adaptive=True, num_sms=8), backend=backend) as c:
        sent = np.zeros(W, np.int64)
        for it in range(3):
            counts = rng.integers(0, 9000, W)  # up to ~2.7 slots of 96-byte rows: several channels in ring mode
            x = random_rows(rng, int(counts.sum()), (24,), np.float32)
            want, _ = reference_alltoallv(comm, x, counts)
            sym = c.empty((comm.allreduce(len(x), op=MPI.MAX), 24), x.dtype)  # same shape on every rank
            sym[: len(x)] = x
            got, _ = c.alltoallv(sym[: len(x)], counts)
            np.testing.assert_array_equal(to_numpy(got).view(np.uint8), want.view(np.uint8))
            c.free(sym)
            sent += counts
        everyone = comm.allgather(sent)  # the last collective step before this rank's own counters are checked
        st = c.channel_stats()
        want_peer = sent * 96
        want_peer[me] = 0
        send_bytes = np.asarray(st["send"]["bytes"])
        np.testing.assert_array_equal(send_bytes[0], want_peer)
        assert not send_bytes[1:].any() and not np.asarray(st["send"]["chunks"]).any()
        got_from = np.array([everyone[s][me] for s in range(W)]) * 96
        got_from[me] = 0
        np.testing.assert_array_equal(np.asarray(st["recv"]["bytes"]).sum(axis=0), got_from)

def test_ranks_may_differ_in_the_option_and_the_interval(comm, backend):
    """Local policy: the wire is the same, so a mix of adaptive and static ranks, re-balancing at different calls,
    still gives the reference's bytes; dispatch / combine too."""
    from test_moe import CASES, run_case
    W, me = comm.Get_size(), comm.Get_rank()
    rng = rng_for(comm, 1302)
    cfg = cs.Config(adaptive=me % 2 == 0, adaptive_interval=1 + me)
    with cs.Communicator(comm, cfg, backend=backend) as c:
        for it in range(6):
            counts = _skewed_counts(rng, W, me, "hot_rank", 500)
            x = random_rows(rng, int(counts.sum()), (3, 5), np.int16)
            want, _ = reference_alltoallv(comm, x, counts)
            got, _ = c.alltoallv(to_backend(x, backend), counts)
            np.testing.assert_array_equal(to_numpy(got), want)
        for case in CASES:
            if case.experts() % W:
                continue  # test_moe's cases assume a world size dividing their expert counts (1, 2, 4, 8 ranks)
            if case.name in ("zipf_bf16_top8", "one_rank_fp16_h7", "masked_fp32_top8", "align128_zipf_fp32",
                             "fp8_h384_strided_scales"):
                for k in range(3):
                    run_case(c, case, key=("adaptive", k))
        st = c.channel_stats()
        assert st["adaptive"] == (me % 2 == 0)
        assert st["calls"] >= 6 and (st["rebalances"] > 0) == (me % 2 == 0)


def test_static_communicator_counts_too(comm, backend):
    W, me = comm.Get_size(), comm.Get_rank()
    rng = rng_for(comm, 1303)
    with cs.Communicator(comm, backend=backend) as c:
        x = random_rows(rng, 7 * W, (4,), np.float64)
        counts = np.full(W, 7)
        c.alltoallv(to_backend(x, backend), counts)
        c.alltoall(to_backend(x[:W], backend))
        st = c.channel_stats()
        assert not st["adaptive"] and st["rebalances"] == 0 and not st["work_sharing"]
        assert st["send"]["bytes"] is None and st["send"]["chunks"] is None  # per channel: adaptive only
        want = np.full(W, 7 * 32 + 32)
        want[me] = 0
        np.testing.assert_array_equal(st["send"]["bytes_per_peer"], want)
        np.testing.assert_array_equal(st["recv"]["bytes_per_peer"], want)
        assert all(h == P.HOME_OWN for h in st["send"]["home"])


@pytest.fixture(scope="module", params=__import__("conftest").available_backends())
def adaptive_comm(request):
    """One work-sharing communicator per backend, re-balancing every 2 calls, for every MoE case."""
    from mpi4py import MPI
    if request.param == "cuda":
        from cupy_symbuf.utils import select_device
        select_device(MPI.COMM_WORLD)
    c = cs.Communicator(MPI.COMM_WORLD, cs.Config(adaptive=True, adaptive_interval=2), backend=request.param)
    yield c
    c.close()


def _moe_cases():
    from test_moe import CASES
    return CASES


@pytest.mark.parametrize("case", _moe_cases(), ids=lambda c: c.name)
def test_every_moe_case_with_work_sharing(adaptive_comm, case):
    """test_moe's cases (every routing, dtype, layout, alignment and hidden size) bitwise against its NumPy
    reference on a communicator whose map is re-balanced between the calls."""
    from test_moe import run_case
    if case.cuda_only and adaptive_comm.backend != "cuda":
        pytest.skip("GPU-sized case")
    if case.experts() % adaptive_comm.world_size:
        pytest.skip("the case's experts do not divide among these ranks")
    for k in range(2):
        run_case(adaptive_comm, case, key=("work-sharing", k))


@pytest.mark.parametrize("W", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("host", [True, False])
def test_plan_load_is_the_plans_own_cuts(W, host):
    """The vectorised per-(channel, peer) load equals the plan's channel_range / share_chunks one by one (random
    counts from empty to many chunks, byte and row runs, both engines' chunk rules), and a rank's own rows count
    nothing."""
    from cupy_symbuf.wire.plan import ExchangePlan
    from cupy_symbuf.transport.adaptive import ChannelLoad
    from cupy_symbuf.wire.channel_layout import ChannelLayout
    rng = np.random.default_rng([W, host])
    cfg = cs.Config(num_sms=8 if host else 24).resolved("host" if host else "cuda", world_size=W)
    L = ChannelLayout.from_config(cfg, W)
    for trial in range(25):
        counts = rng.integers(0, int(rng.choice([3, 100, 5000, 200000])), W)
        width = int(rng.choice([1, 2, 7, 64, 256, 14336]))
        idx = bool(rng.integers(0, 2))
        me = int(rng.integers(0, W))
        plan = ExchangePlan(op="alltoallv", sig_text="t", part_widths=[width, 8] if idx else [width], has_index=idx,
                            send_counts=counts, recv_counts=counts[::-1].copy(), layout=L, rank=me, host=host)
        load = ChannelLoad.plan_load(plan, L.num_channels, W, me)
        for role, units in ((0, plan.send_units), (1, plan.recv_units)):
            for p in range(W):
                for ch in range(L.num_channels):
                    lo, hi = plan.channel_range(int(units[p]), ch)
                    # (share_chunks: num_chunks of the share, 0 for a host run in its header's slot)
                    want = (0, 0) if p == me else ((hi - lo) * plan.unit_bytes, plan.share_chunks(int(units[p]), ch))
                    assert host or p == me or want[1] == plan.num_chunks(lo, hi)
                    assert tuple(load[role, ch, p, :2]) == want, (role, p, ch)


def _edge_units(rng, plan, C: int) -> np.ndarray:
    """Run lengths in units around every boundary of the cuts: 0, 1, one ring slot, the host engine's inline and
    least-chunk sizes, the 512-byte grain, whole channels of slots, and random ones up to many slots."""
    slot = plan.chunk_bytes // plan.unit_bytes
    marks = [0, 1, 2, slot, C * slot, plan.num_copy * slot,
             (P.HOST_CHUNK_LEAST_BYTES + plan.unit_bytes - 1) // plan.unit_bytes,
             (plan.chunk_bytes - 8 * P.HDR_WORDS) // plan.unit_bytes,
             (P.CHUNK_GRAIN_BYTES + plan.unit_bytes - 1) // plan.unit_bytes]
    near = [m + d for m in marks for d in (-2, -1, 0, 1, 2, 15, 16, 17) if m + d >= 0]
    return np.array(near + rng.integers(0, 40 * slot + 2, 8).tolist(), np.int64)


@pytest.mark.parametrize("host", [True, False])
def test_vectorised_cuts_are_the_plans_per_channel_cuts(host):
    """``_cuts`` (NumPy over every (peer, channel)) equals the plan's ``channel_range`` / ``share_chunks`` called
    one (peer, channel) at a time, over many random plans: run lengths at 0, 1 and around the slot, inline and
    chunk sizes, byte and row runs, direct or not (``single``), several layouts; on the host the short, direct
    runs on channel 0 alone and the inline ones with 0 chunks."""
    from cupy_symbuf.wire.plan import ExchangePlan
    from cupy_symbuf.transport.adaptive import _cuts
    from cupy_symbuf.wire.channel_layout import ChannelLayout
    rng = np.random.default_rng([7, host])
    seen = {"one channel": 0, "inline": 0, "several channels": 0}
    for trial in range(120):
        W = int(rng.choice([2, 3, 4, 8]))
        cfg = cs.Config(num_sms=int(rng.choice([2, 8, 24] if not host else [2, 8])),
                        chunk_bytes=int(rng.choice([1024, 4096, 32768, 32896, 65536, 262144]))
                        ).resolved("host" if host else "cuda", world_size=W)
        L = ChannelLayout.from_config(cfg, W)
        C = L.num_channels
        byte_run = bool(rng.integers(0, 2))
        width = int(rng.choice([1, 2, 7, 64, 256] if byte_run else [1, 8, 24, 1000]))
        width = min(width, L.chunk_bytes - 8)
        direct = byte_run and bool(rng.integers(0, 2))
        plan = ExchangePlan(op="alltoallv", sig_text="t", part_widths=[width] if byte_run else [width, 8],
                            has_index=not byte_run, send_counts=np.ones(W, np.int64), recv_counts=np.ones(W, np.int64),
                            layout=L, rank=0, direct=direct, host=host)
        units = _edge_units(rng, plan, C)
        for single in (False, True):
            n, chunks = _cuts(plan, units, C, single)
            want_n = [[hi - lo for lo, hi in (plan.channel_range(int(u), k, single) for k in range(C))] for u in units]
            want_chunks = [[plan.share_chunks(int(u), k, single) for k in range(C)] for u in units]
            assert n.dtype == chunks.dtype == np.int64 and n.shape == chunks.shape == (len(units), C)
            assert n.tolist() == want_n, (trial, single, plan)
            assert chunks.tolist() == want_chunks, (trial, single, plan)
            assert (n.sum(axis=1) == units).all()  # every unit on some channel, once
            for u, row, ch in zip(units.tolist(), n, chunks):
                if host and u and (single or u * plan.unit_bytes <= plan.chunk_bytes):
                    assert row[0] == u and not row[1:].any()  # channel 0 alone
                    seen["one channel"] += 1
                    if not single and not ch[0]:
                        seen["inline"] += 1
                elif u * plan.unit_bytes > plan.chunk_bytes and C > 1 and u >= C * plan.align:
                    assert (row > 0).sum() > 1
                    seen["several channels"] += 1
    # the boundaries were all reached
    assert all(seen.values()) if host else seen["several channels"], seen


@pytest.mark.parametrize("W", [2, 3, 4, 8])
@pytest.mark.parametrize("host", [True, False])
def test_plan_load_of_a_direct_run(W, host):
    """The load counters of a direct run: on the host every byte this rank sends is on channel 0 (the run travels
    there alone) and no chunk is counted; on the GPU the bytes stay spread over the channels as the kernel cuts
    them; what this rank receives is the rings' cut either way (it does not know its peers' modes). Independent
    count: the bytes per peer from the send counts."""
    from cupy_symbuf.wire.plan import ExchangePlan
    from cupy_symbuf.transport.adaptive import ChannelLoad
    from cupy_symbuf.wire.channel_layout import ChannelLayout
    rng = np.random.default_rng([W, host, 3])
    cfg = cs.Config(num_sms=8 if host else 24).resolved("host" if host else "cuda", world_size=W)
    L = ChannelLayout.from_config(cfg, W)
    C = L.num_channels
    for trial in range(10):
        counts = rng.integers(0, int(rng.choice([3, 5000, 200000])), W)
        width = int(rng.choice([1, 4, 64, 256]))
        me = int(rng.integers(0, W))
        plan = ExchangePlan(op="alltoallv", sig_text="t", part_widths=[width], has_index=False, send_counts=counts,
                            recv_counts=counts[::-1].copy(), layout=L, rank=me, direct=True, host=host)
        load = ChannelLoad.plan_load(plan, C, W, me)
        sent = counts * width
        sent[me] = 0
        assert load[0, :, :, P.LOAD_BYTES].sum(axis=0).tolist() == sent.tolist()
        assert not load[0, :, :, P.LOAD_CHUNKS].any()
        big = [p for p in range(W) if sent[p] >= 16 * C]
        if host:
            assert load[0, 0, :, P.LOAD_BYTES].tolist() == sent.tolist()
            assert not load[0, 1:].any()
        else:  # every channel carries its share of a run of at least 16 bytes per channel
            assert all((load[0, :, p, P.LOAD_BYTES] > 0).all() for p in big)
        for p in range(W):
            want = [0] * C if p == me else [
                (hi - lo) * plan.unit_bytes for lo, hi in (plan.channel_range(int(plan.recv_units[p]), k)
                                                           for k in range(C))]
            assert load[1, :, p, P.LOAD_BYTES].tolist() == want
