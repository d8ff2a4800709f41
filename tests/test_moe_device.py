"""MoE control on the device: worst-case mode (``num_worst_tokens``), device-count handles, uneven
token counts, two live handles with a lagging rank, CUDA graphs of two batch sizes replayed alternately, the
layout kernel's deferred range check. Every output is compared with a NumPy reference built from every rank's
inputs (``allgather``); outputs sit on dirty memory (GPU: the pool hands back blocks filled with garbage).

    python -m pytest tests/test_moe_device.py
    mpiexec -n 2 python -m pytest tests/test_moe_device.py
"""
from __future__ import annotations

import time

import numpy as np
import pytest

MPI = pytest.importorskip("mpi4py.MPI")

from test_moe import (RANK, W, WORLD, all_ranks, assert_bitwise, from_f32, local_idx, make_routing,  # noqa: E402,F401
                      make_values, moe_comm, ref_routes, rng_for, to_dev, to_f32, to_np)
from cupy_symbuf import SymBufferRejectedError  # noqa: E402

UNEVEN = (0, 1, 7, 33)   # tokens on rank r: UNEVEN[r % 4]


def _dirty_pool(comm, nbytes: int) -> None:
    """GPU: fill blocks of the memory pool with garbage and free them, so the next outputs sit on dirty memory."""
    if comm.backend != "cuda":
        return
    import cupy
    junk = [cupy.full(nbytes // 8 + 1, -7, dtype=np.int64) for _ in range(4)]
    del junk


def _inputs(key, tokens: int, hidden: int, num_experts: int, topk: int, routing: str = "random"):
    rng = rng_for(*key)
    idx = make_routing(routing, rng, tokens, num_experts, topk)
    # integer-valued float32 (exact sums in any order), never zero
    x = rng.integers(1, 64, size=(tokens, hidden)).astype(np.float32) * rng.choice(np.float32([-1, 1]),
                                                                                  size=(tokens, hidden))
    w = rng.uniform(0.05, 1.0, size=(tokens, topk)).astype(np.float32)
    return idx, x, w


def _reference(idx, x, w, num_experts):
    """What this rank receives: rows (x, local idx, weights) in source-rank then token order, and per local
    expert counts."""
    every = WORLD.allgather((idx, x, w))
    routes = ref_routes([e[0] for e in every], num_experts)[RANK]
    hidden, topk = x.shape[1], idx.shape[1]
    rx = np.array([every[s][1][t] for s, t in routes], np.float32).reshape(-1, hidden)
    ri = np.array([local_idx(every[s][0][t], num_experts, RANK) for s, t in routes], np.int64).reshape(-1, topk)
    rw = np.array([np.where(local_idx(every[s][0][t], num_experts, RANK) >= 0, every[s][2][t], 0)
                   for s, t in routes], np.float32).reshape(-1, topk)
    epr = num_experts // W
    per_expert = np.array([(ri == j).sum() for j in range(epr)], np.int64)
    return rx, ri, rw, per_expert


def _ranks_of(idx, num_experts):
    epr = num_experts // W
    return np.array([len({int(e) // epr for e in row if e >= 0}) for row in idx], np.float32)


def _check_worst(comm, out, idx, x, w, num_experts, worst, align=1):
    (recv_x, recv_idx, recv_w, counts, h) = out
    rx, ri, rw, per_expert = _reference(idx, x, w, num_experts)
    n = rx.shape[0]

    def check():
        assert recv_x.shape == (worst, x.shape[1]) and recv_idx.shape == (worst, idx.shape[1])
        assert int(to_np(h.num_recv_tokens_device)) == n
        assert np.array_equal(to_np(recv_x)[:n], rx)
        assert np.array_equal(to_np(recv_idx)[:n], ri)
        assert np.array_equal(to_np(recv_w)[:n], rw)
        assert (to_np(recv_idx)[n:] == -1).all(), "rows past the count must hold -1 in recv_topk_idx"
        assert (to_np(recv_w)[n:] == 0).all(), "rows past the count must hold 0 in the weights"
        want = (per_expert + align - 1) // align * align
        assert np.array_equal(np.asarray(to_np(counts), np.int64), want)
    all_ranks(check)
    return rx


@pytest.mark.parametrize("routing", ["random", "one_rank", "masked"])
def test_worst_case_dispatch_combine_uneven(moe_comm, routing):
    """0, 1, 7 and 33 tokens on different ranks; rows past the count are -1 / 0 on dirty memory; combine of the
    worst-case handle equals the reference; a cached dispatch with it moves the same rows."""
    c = moe_comm
    n_exp, topk, hidden = 8 * W, 4, 96
    tokens = UNEVEN[RANK % 4]
    worst = max(UNEVEN[r % 4] for r in range(W)) * W + 3
    idx, x, w = _inputs(("worst", routing, c.backend), tokens, hidden, n_exp, topk, routing)
    for rep in range(2):
        _dirty_pool(c, worst * hidden * 4)
        out = c.dispatch(to_dev(c, x), to_dev(c, idx), to_dev(c, w), n_exp, num_worst_tokens=worst,
                         expert_alignment=1 + rep * 3)
        _check_worst(c, out, idx, x, w, n_exp, worst, align=1 + rep * 3)
    recv_x, _, recv_w, _, h = out
    assert h.num_recv_tokens == worst
    combined, cw = c.combine(recv_x, h, recv_w)
    ranks = _ranks_of(idx, n_exp)
    # combined weights: the sum over the ranks a token reached of the weights of the slots living there
    epr = n_exp // W
    want_w = np.zeros_like(w)
    for t in range(tokens):
        for k in range(topk):
            if idx[t, k] >= 0:
                want_w[t, k] = w[t, k]
    all_ranks(lambda: (np.testing.assert_array_equal(to_np(combined), x * ranks[:, None]),
                       np.testing.assert_array_equal(to_np(cw), want_w)))
    cached = c.dispatch(to_dev(c, x), handle=h)
    rx = _reference(idx, x, w, n_exp)[0]
    all_ranks(lambda: np.testing.assert_array_equal(to_np(cached[0])[:rx.shape[0]], rx))
    # worst-case mode: the per-expert counts are an array of xp on a cached call too (host and GPU alike)
    cached4 = c.dispatch(to_dev(c, x), handle=h, expert_alignment=4)  # out's alignment (rep 1)
    all_ranks(lambda: (isinstance(cached4[3], c.xp.ndarray) and
                       np.array_equal(to_np(cached4[3]), to_np(out[3]))) or pytest.fail(repr(cached4[3])))
    del epr


def test_worst_case_routing_changes_between_calls(moe_comm):
    """Same shapes, new routing every call (a rank sending nothing to some peer included): each call exact."""
    c = moe_comm
    n_exp, topk, hidden, tokens = 4 * W, 2, 32, 24
    worst = tokens * W
    for i, routing in enumerate(["random", "recv_nothing" if W > 1 else "random", "one_rank", "masked"]):
        idx, x, w = _inputs(("change", i, c.backend), tokens, hidden, n_exp, topk, routing)
        _dirty_pool(c, worst * hidden * 4)
        out = c.dispatch(to_dev(c, x), to_dev(c, idx), to_dev(c, w), n_exp, num_worst_tokens=worst)
        _check_worst(c, out, idx, x, w, n_exp, worst)


def test_two_live_handles_with_lagging_rank(moe_comm):
    """dispatch A, dispatch B, combine A, combine B with rank 0 late; eager and worst-case handles mixed."""
    c = moe_comm
    n_exp, topk, hidden = 4 * W, 3, 48
    tokens = UNEVEN[(RANK + 1) % 4]
    idx_a, x_a, w_a = _inputs(("liveA", c.backend), tokens, hidden, n_exp, topk)
    idx_b, x_b, w_b = _inputs(("liveB", c.backend), tokens + 2, hidden, n_exp, topk, "masked")
    out_a = c.dispatch(to_dev(c, x_a), to_dev(c, idx_a), to_dev(c, w_a), n_exp)
    out_b = c.dispatch(to_dev(c, x_b), to_dev(c, idx_b), to_dev(c, w_b), n_exp,
                       num_worst_tokens=(max(UNEVEN) + 2) * W)
    if RANK == 0:
        time.sleep(0.2)
    comb_a, _ = c.combine(out_a[0], out_a[4])
    comb_b, _ = c.combine(out_b[0], out_b[4])
    ra, rb = _ranks_of(idx_a, n_exp), _ranks_of(idx_b, n_exp)
    all_ranks(lambda: (np.testing.assert_array_equal(to_np(comb_a), x_a * ra[:, None]),
                       np.testing.assert_array_equal(to_np(comb_b), x_b * rb[:, None])))


def test_bad_topk_in_worst_case_rejected_everywhere(moe_comm):
    """A topk_idx value out of range on rank 0 in worst-case mode: on the host rank 0 raises ValueError at once;
    on the GPU (nothing read on the host) the layout kernel rejects it in the count exchange and every rank's
    synchronize raises SymBufferRejectedError; nothing moves; the communicator stays usable."""
    c = moe_comm
    n_exp, topk, hidden, tokens = 4 * W, 2, 16, 8
    idx, x, w = _inputs(("badworst", c.backend), tokens, hidden, n_exp, topk)
    if RANK == 0:
        idx[3, 1] = n_exp + 5
    err = None
    try:
        out = c.dispatch(to_dev(c, x), to_dev(c, idx), to_dev(c, w), n_exp, num_worst_tokens=tokens * W)
        c.synchronize()
    except ValueError as e:
        err = e
    errs = WORLD.allgather(None if err is None else type(err).__name__)
    all_ranks(lambda: (not any(e is None for e in errs)) or pytest.fail(f"not raised everywhere: {errs}"))
    must_be_rejected = c.backend == "cuda" or RANK != 0   # (all_ranks is collective: every rank calls it)
    all_ranks(lambda: isinstance(err, SymBufferRejectedError) or not must_be_rejected or pytest.fail(repr(err)))
    if c.backend == "cuda":  # the outputs of the skipped call: no rows, -1 / 0 everywhere
        all_ranks(lambda: ((to_np(out[1]) == -1).all() and int(to_np(out[4].num_recv_tokens_device)) == 0)
                  or pytest.fail("skipped call left rows"))
    idx2, x2, w2 = _inputs(("badworst-after", c.backend), tokens, hidden, n_exp, topk)
    out = c.dispatch(to_dev(c, x2), to_dev(c, idx2), to_dev(c, w2), n_exp, num_worst_tokens=tokens * W)
    _check_worst(c, out, idx2, x2, w2, n_exp, tokens * W)


def test_layout_bad_value_gpu_deferred(moe_comm):
    """GPU get_dispatch_layout reads nothing on the host: a value out of range is left out of the counts and
    raised by synchronize() as ValueError; afterwards the communicator works."""
    c = moe_comm
    if c.backend != "cuda":
        pytest.skip("GPU behaviour (the host path raises at once, tested in test_moe)")
    idx = make_routing("random", rng_for("layoutbad"), 16, 4 * W, 2)
    idx[2, 0] = -3
    c.get_dispatch_layout(to_dev(c, idx), 4 * W)
    with pytest.raises(ValueError, match=r"get_dispatch_layout .*topk_idx"):
        c.synchronize()
    c.synchronize()  # raised once


def test_cuda_graphs_two_batch_sizes(moe_comm):
    """Two CUDA graphs (16 and 48 tokens) of worst-case dispatch + combine on one communicator, replayed
    alternately with new data and new routing copied into their inputs; every replay exact."""
    c = moe_comm
    if c.backend != "cuda":
        pytest.skip("CUDA graphs need the GPU")
    import cupy
    n_exp, topk, hidden = 4 * W, 4, 64
    stream = cupy.cuda.Stream(non_blocking=True)
    graphs = {}
    for tokens in (16, 48):
        idx, x, w = _inputs(("graph-warm", tokens), tokens, hidden, n_exp, topk)
        d_idx, d_x, d_w = cupy.asarray(idx), cupy.asarray(x), cupy.asarray(w)
        worst = tokens * W
        with stream:
            c.dispatch(d_x, d_idx, d_w, n_exp, num_worst_tokens=worst)  # warm the pool and the plans
            stream.synchronize()
            c.synchronize()
            stream.begin_capture()
            out = c.dispatch(d_x, d_idx, d_w, n_exp, num_worst_tokens=worst)
            comb = c.combine(out[0], out[4], out[2])
            graph = stream.end_capture()
        graphs[tokens] = (graph, d_idx, d_x, d_w, out, comb, worst)
    for rep in range(3):
        for tokens in (48, 16):
            graph, d_idx, d_x, d_w, out, comb, worst = graphs[tokens]
            routing = ["random", "masked", "one_rank"][rep]
            idx, x, w = _inputs(("graph", tokens, rep), tokens, hidden, n_exp, topk, routing)
            d_idx.set(idx)
            d_x.set(x)
            d_w.set(w)
            out[1].fill(-5)  # dirty outputs: the replay must rewrite every row
            out[2].fill(7)
            stream.synchronize()
            graph.launch(stream)
            stream.synchronize()
            c.synchronize()
            _check_worst(c, out, idx, x, w, n_exp, worst)
            ranks = _ranks_of(idx, n_exp)
            all_ranks(lambda: np.testing.assert_array_equal(to_np(comb[0]), x * ranks[:, None]))


def _take_free_blocks(value: int) -> list:
    """GPU: every free block of the memory pool's arena of the current stream, taken (largest sizes first) and
    filled with ``value`` (int64); the returned arrays hold them until dropped. A kernel that later writes into
    memory freed before this call lands in one of them."""
    import cupy
    pool = cupy.get_default_memory_pool()
    taken = []
    for nbytes in (1 << 24, 1 << 20, 1 << 16, 1 << 12, 512):
        for _ in range(100000):
            before = pool.free_bytes()
            taken.append(cupy.full(nbytes // 8, value, dtype=np.int64))
            if pool.free_bytes() >= before:  # a new allocation: no free block of this size is left here
                break
    return taken


@pytest.mark.parametrize("route", ["topk", "mask"])
def test_cuda_graph_replays_after_the_call_temporaries_are_freed(moe_comm, route):
    """A worst-case dispatch (routed by topk_idx, or by the caller's rank mask, DeepEP's routing) and its combine
    captured in a CUDA graph; then every reference the caller does not need dropped (the handle, the call's own
    temporaries: the mask path's counts and reject-word arrays, CuPy's scan and reduction workspaces, the routing
    block) and every free block of the pool taken and filled with a sentinel. Each replay with new rows and routing
    copied into the inputs matches the NumPy reference, and the sentinel blocks stay untouched (a replay reading
    or writing a temporary freed after the capture would meet them)."""
    c = moe_comm
    if c.backend != "cuda":
        pytest.skip("CUDA graphs need the GPU")
    import gc
    import cupy
    n_exp, topk, hidden, tokens = 4 * W, 2, 32, 24
    epr, worst = n_exp // W, tokens * W
    stream = cupy.cuda.Stream(non_blocking=True)

    def routing(rep):
        idx, x, w = _inputs(("graph-keep", route, rep), tokens, hidden, n_exp, topk)
        if route == "mask":  # not topk_idx's layout: the mask decides, the per-expert counts are the caller's
            rng = rng_for("graph-keep-mask", rep)
            mask = rng.random((tokens, W)) < 0.5
            per_expert = rng.integers(0, 5, size=n_exp)
        else:
            mask = np.zeros((tokens, W), bool)
            for t, k in zip(*np.nonzero(idx >= 0)):
                mask[t, idx[t, k] // epr] = True
            per_expert = np.bincount(idx[idx >= 0], minlength=n_exp)
        return idx, x, w, mask, per_expert.astype(np.int32)

    idx, x, w, mask, per_expert = routing(0)
    d_idx, d_x, d_w = cupy.asarray(idx), cupy.asarray(x), cupy.asarray(w)
    d_mask, d_per_expert = cupy.asarray(mask), cupy.asarray(per_expert)
    d_per_rank = cupy.asarray(mask.sum(axis=0).astype(np.int32))
    kw = dict(is_token_in_rank=d_mask, num_tokens_per_rank=d_per_rank, num_tokens_per_expert=d_per_expert) \
        if route == "mask" else dict(num_experts=n_exp)
    with stream:
        c.dispatch(d_x, d_idx, d_w, num_worst_tokens=worst, **kw)  # warm the pool and the plans
        stream.synchronize()
        c.synchronize()
        stream.begin_capture()
        out = c.dispatch(d_x, d_idx, d_w, num_worst_tokens=worst, **kw)
        comb = c.combine(out[0], out[4])
        graph = stream.end_capture()
    recv_x, recv_idx, recv_w, counts = out[:4]
    combined = comb[0]
    del out, comb, kw
    gc.collect()
    with stream:
        sentinel = _take_free_blocks(-0x5A5A5A5A5A5A5A5B)
    for rep in range(1, 4):
        idx, x, w, mask, per_expert = routing(rep)
        every = WORLD.allgather((x, idx, w, mask, per_expert))
        mine = [(xs[m[:, RANK]], ids[m[:, RANK]], ws[m[:, RANK]]) for xs, ids, ws, m, _ in every]
        want_x = np.concatenate([r[0] for r in mine])
        local = np.concatenate([np.where((r[1] >= RANK * epr) & (r[1] < (RANK + 1) * epr), r[1] - RANK * epr, -1)
                                for r in mine])
        want_w = np.concatenate([np.where(r[1] // epr == RANK, r[2], 0) for r in mine]).astype(np.float32)
        want_counts = np.sum([pe[RANK * epr:(RANK + 1) * epr] for *_, pe in every], axis=0)
        n = want_x.shape[0]
        with stream:
            d_idx.set(idx)
            d_x.set(x)
            d_w.set(w)
            d_mask.set(mask)
            d_per_rank.set(mask.sum(axis=0).astype(np.int32))
            d_per_expert.set(per_expert)
            recv_idx.fill(-5)  # dirty outputs: the replay must rewrite every row
            recv_w.fill(7)
        graph.launch(stream)
        stream.synchronize()
        c.synchronize()

        def check():
            np.testing.assert_array_equal(to_np(recv_x)[:n], want_x)
            np.testing.assert_array_equal(to_np(recv_idx)[:n], local)
            np.testing.assert_array_equal(to_np(recv_w)[:n], want_w)
            assert (to_np(recv_idx)[n:] == -1).all(), "rows past the count must hold -1 in recv_topk_idx"
            np.testing.assert_array_equal(np.asarray(to_np(counts), np.int64), want_counts)
            np.testing.assert_array_equal(to_np(combined), x * mask.sum(axis=1)[:, None])
            hit = [i for i, a in enumerate(sentinel) if bool((a != -0x5A5A5A5A5A5A5A5B).any())]
            assert not hit, f"a replay wrote into {len(hit)} of {len(sentinel)} blocks freed after the capture"
        all_ranks(check)


# ------------------------------------------------------------------------------------------------ alltoallv capacity


def _a2av_inputs(key, hidden=5, dtype=np.float32):
    rng = rng_for(*key)
    counts = rng.integers(0, 9, size=W).astype(np.int64)
    if W > 1:
        counts[(RANK + 1) % W] = 0  # a rank sending nothing to some peer
    x = (rng.integers(1, 1000, size=(int(counts.sum()), hidden)) * rng.choice([-1, 1], size=(1, hidden)))
    return counts, x.astype(dtype)


def _a2av_reference(counts, x):
    every = WORLD.allgather((counts, x))
    parts, got = [], []
    for c_j, x_j in every:
        off = np.concatenate([[0], np.cumsum(c_j)])
        parts.append(x_j[off[RANK]:off[RANK + 1]])
        got.append(int(c_j[RANK]))
    return np.concatenate(parts), np.array(got, np.int64)


@pytest.mark.parametrize("device_counts", [False, True])
def test_alltoallv_capacity(moe_comm, device_counts):
    """Capacity mode: output of recv_capacity rows, real rows exact, counts returned in the backend's module."""
    c = moe_comm
    if device_counts and c.backend != "cuda":
        pytest.skip("device-side send_counts need the GPU")
    cap = 8 * W + 3
    for rep in range(3):
        counts, x = _a2av_inputs(("a2av-cap", rep, device_counts, c.backend))
        _dirty_pool(c, cap * 5 * 4)
        sc = to_dev(c, counts) if device_counts else counts
        recv, got = c.alltoallv(to_dev(c, x), sc, recv_capacity=cap)
        want, want_counts = _a2av_reference(counts, x)
        all_ranks(lambda: (recv.shape[0] == cap or pytest.fail(f"shape {recv.shape}"),
                           np.testing.assert_array_equal(to_np(got), want_counts),
                           np.testing.assert_array_equal(to_np(recv)[:want.shape[0]], want)))


def test_alltoallv_capacity_bad_device_counts(moe_comm):
    """Device-side counts that do not sum to the rows of sendbuf (one rank): every rank's synchronize raises
    SymBufferRejectedError, nothing moves, and the communicator works afterwards."""
    c = moe_comm
    if c.backend != "cuda":
        pytest.skip("device-side send_counts need the GPU")
    counts, x = _a2av_inputs(("a2av-bad", c.backend))
    bad = counts.copy()
    if RANK == 0:
        bad[0] += 1
    err = None
    try:
        c.alltoallv(to_dev(c, x), to_dev(c, bad), recv_capacity=8 * W)
        c.synchronize()
    except SymBufferRejectedError as e:
        err = e
    errs = WORLD.allgather(err is not None)
    all_ranks(lambda: all(errs) or pytest.fail(f"rejected on {errs}"))
    recv, got = c.alltoallv(to_dev(c, x), to_dev(c, counts), recv_capacity=8 * W)
    want, want_counts = _a2av_reference(counts, x)
    all_ranks(lambda: np.testing.assert_array_equal(to_np(recv)[:want.shape[0]], want))


def test_alltoallv_capacity_graph_replays(moe_comm):
    """alltoallv in capacity mode captured once, replayed with new counts and rows copied into its inputs."""
    c = moe_comm
    if c.backend != "cuda":
        pytest.skip("CUDA graphs need the GPU")
    import cupy
    hidden, rows_max = 6, 8 * W
    cap = rows_max * W  # any routing of rows_max rows per rank fits
    d_x = cupy.zeros((rows_max, hidden), np.float32)
    d_counts = cupy.zeros(W, np.int64)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        d_counts.set(np.full(W, 1, np.int64))
        # rows_max rows sent in all: pad the counts' last destination with the rest
        c.alltoallv(d_x, d_counts + cupy.asarray(np.eye(W, dtype=np.int64)[W - 1] * (rows_max - W)),
                    recv_capacity=cap)
        stream.synchronize()
    for rep in range(3):
        rng = rng_for("a2av-graph", rep)
        counts = rng.multinomial(rows_max, np.ones(W) / W).astype(np.int64)  # new counts, same row total
        x = (rng.integers(1, 1000, size=(rows_max, hidden)) + 1000 * rep).astype(np.float32)
        if rep == 0:
            with stream:
                stream.begin_capture()
                out = c.alltoallv(d_x, d_counts, recv_capacity=cap)
                graph = stream.end_capture()
        d_counts.set(counts)
        d_x.set(x)
        stream.synchronize()
        graph.launch(stream)
        stream.synchronize()
        c.synchronize()
        want, want_counts = _a2av_reference(counts, x)
        all_ranks(lambda: (np.testing.assert_array_equal(to_np(out[1]), want_counts),
                           np.testing.assert_array_equal(to_np(out[0])[:want.shape[0]], want)))


def test_eager_count_exchange_refused_in_graph_capture(moe_comm):
    """An eager dispatch (host reads its counts) inside a CUDA graph capture raises at once, naming the
    worst-case form; the communicator stays usable."""
    c = moe_comm
    if c.backend != "cuda":
        pytest.skip("CUDA graphs need the GPU")
    import cupy
    n_exp = 4 * W
    idx, x, w = _inputs(("capture-eager",), 8, 16, n_exp, 2)
    d_idx, d_x, d_w = cupy.asarray(idx), cupy.asarray(x), cupy.asarray(w)
    stream = cupy.cuda.Stream(non_blocking=True)
    err = None
    with stream:
        stream.begin_capture()
        try:
            c.dispatch(d_x, d_idx, d_w, n_exp)
        except RuntimeError as e:
            err = e
        stream.end_capture()
    all_ranks(lambda: (err is not None and "num_worst_tokens" in str(err)) or pytest.fail(repr(err)))
    out = c.dispatch(d_x, d_idx, d_w, n_exp, num_worst_tokens=8 * W)
    _check_worst(c, out, idx, x, w, n_exp, 8 * W)


def test_worst_case_overflow_fails_the_call_on_every_rank(moe_comm):
    """More rows than num_worst_tokens on rank 0 (every token to its expert 0): rank 0 raises
    SymBufferMismatchError (field "capacity") and the peers fail in the same dispatch (SymBufferAbortedError), not
    in their next call: the check comes before any row moves, as the GPU's count exchange does."""
    from cupy_symbuf import Communicator, Config, SymBufferAbortedError, SymBufferMismatchError
    if W == 1:
        pytest.skip("needs 2 ranks")
    c = Communicator(WORLD, Config(timeout_s=5.0, abort_on_failure=False), backend=moe_comm.backend)
    n_exp, tokens = 2 * W, 4
    idx = np.zeros((tokens, 1), np.int64)  # rank 0 receives tokens * W rows
    x = np.ones((tokens, 8), np.float32)
    err = None
    try:
        try:
            c.dispatch(to_dev(c, x), to_dev(c, idx), None, n_exp, num_worst_tokens=tokens * W - 1)
            if c.backend == "cuda":
                c.synchronize()
        except (SymBufferMismatchError, SymBufferAbortedError) as e:
            err = e
        want = SymBufferMismatchError if RANK == 0 else SymBufferAbortedError

        def check():
            assert isinstance(err, want), f"rank {RANK}: {err!r}"
            assert RANK != 0 or "num_worst_tokens" in str(err), str(err)
        all_ranks(check)
    finally:
        WORLD.Barrier()
        c.close()


def test_gpu_capacity_error_text():
    """The GPU's capacity overflow (symbuf_notify's FIELD_CAPACITY record: no peer, no call header) reads like the
    host path's error: field "capacity", the rows and the capacity, no "rank -1" / "call header"."""
    from cupy_symbuf.wire import protocol as P
    from cupy_symbuf.common.errors import mismatch_error
    err = mismatch_error("dispatch", 3, -1, -1, P.FIELD_CAPACITY, 11, 12)
    assert err.field == "capacity" and (err.expected, err.got) == (11, 12)
    assert "receives 12 rows, more than the output capacity 11" in str(err)
    assert "rank -1" not in str(err) and "call header" not in str(err)


def test_alltoallv_capacity_bad_capacity_is_a_rejection(moe_comm):
    """A recv_capacity that is not an int, negative, or too large to allocate on rank 0: rank 0 raises
    TypeError / ValueError / MemoryError, the peers SymBufferRejectedError (GPU: from synchronize()), and the
    communicator stays usable (the output is allocated before the count exchange)."""
    c = moe_comm
    counts, x = _a2av_inputs(("a2av-badcap", c.backend), hidden=1000)
    oom = (MemoryError,)
    if c.backend == "cuda":
        import cupy
        oom = (MemoryError, cupy.cuda.memory.OutOfMemoryError)
    for bad, want in (("8", TypeError), (-1, ValueError), (10 ** 13, oom)):
        err = None
        try:
            c.alltoallv(to_dev(c, x), counts, recv_capacity=bad if RANK == 0 else 8 * W)
            # GPU: capacity mode reads nothing on the host; the peers learn of the rejection from synchronize()
            c.synchronize()
        except BaseException as e:  # noqa: BLE001 - checked below
            err = e
        if RANK == 0:
            all_ranks(lambda: isinstance(err, want) or pytest.fail(f"{bad!r}: {err!r}"))
        else:
            all_ranks(lambda: isinstance(err, SymBufferRejectedError) or pytest.fail(f"{bad!r}: {err!r}"))
    recv, got = c.alltoallv(to_dev(c, x), counts, recv_capacity=8 * W)
    want_x, want_counts = _a2av_reference(counts, x)
    all_ranks(lambda: (np.testing.assert_array_equal(to_np(got), want_counts),
                       np.testing.assert_array_equal(to_np(recv)[:want_x.shape[0]], want_x)))


# ------------------------------------------------------------------------------------------------ out=


def test_out_argument_no_allocation(moe_comm):
    """out= on alltoall, alltoallv (recv_counts / recv_capacity) and combine: the result IS the caller's array,
    exact against NumPy, reused across calls with new data."""
    c = moe_comm
    xp = c.xp
    out = xp.full((W, 3, 5), -1, np.float32)
    for rep in range(3):
        x = rng_for("out-a2a", rep).integers(1, 100, size=(W, 3, 5)).astype(np.float32) + RANK * 1000
        got = c.alltoall(to_dev(c, x), out=out)
        every = WORLD.allgather(x)
        want = np.stack([every[j][RANK] for j in range(W)])
        all_ranks(lambda: (got is out or pytest.fail("not the out array"),
                           np.testing.assert_array_equal(to_np(got), want)))
    counts, x = _a2av_inputs(("out-a2av", c.backend))
    want, want_counts = _a2av_reference(counts, x)
    o = xp.zeros((int(want_counts.sum()), 5), np.float32)
    recv, _ = c.alltoallv(to_dev(c, x), counts, recv_counts=want_counts, out=o)
    cap = xp.zeros((8 * W + 1, 5), np.float32)
    recv2, _ = c.alltoallv(to_dev(c, x), counts, recv_capacity=8 * W + 1, out=cap)
    all_ranks(lambda: (recv is o and recv2 is cap) or pytest.fail("not the out arrays"))
    all_ranks(lambda: (np.testing.assert_array_equal(to_np(recv), want),
                       np.testing.assert_array_equal(to_np(recv2)[:want.shape[0]], want)))
    n_exp = 4 * W
    idx, xm, w = _inputs(("out-combine", c.backend), 6, 32, n_exp, 2)
    d = c.dispatch(to_dev(c, xm), to_dev(c, idx), to_dev(c, w), n_exp)
    o = xp.full((6, 32), 7, np.float32)
    comb, _ = c.combine(d[0], d[4], out=o)
    ranks = _ranks_of(idx, n_exp)
    all_ranks(lambda: (comb is o or pytest.fail("not the out array"),
                       np.testing.assert_array_equal(to_np(comb), xm * ranks[:, None])))


def test_bad_out_rejected_then_usable(moe_comm):
    """A wrong out= on rank 0 (shape, dtype, overlapping the input; alltoallv without a known size): rank 0 raises
    naming 'out', the peers SymBufferRejectedError (GPU, no count exchange: from synchronize()); usable after."""
    c = moe_comm
    xp = c.xp
    x = to_dev(c, np.arange(W * 4, dtype=np.float32).reshape(W, 4) + RANK)
    cases = [(xp.zeros((W, 5), np.float32), ValueError), (xp.zeros((W, 4), np.float64), TypeError), (x, ValueError)]
    for bad, want in cases:
        err = None
        try:
            c.alltoall(x, out=bad if RANK == 0 else None)
            c.synchronize()
        except (ValueError, TypeError) as e:
            err = e
        ok = isinstance(err, want) and "'out'" in str(err) if RANK == 0 else isinstance(err, SymBufferRejectedError)
        all_ranks(lambda: ok or pytest.fail(repr(err)))
    err = None
    try:
        c.alltoallv(x, np.ones(W, np.int64), out=xp.zeros((W, 4), np.float32))
    except ValueError as e:
        err = e
    all_ranks(lambda: (err is not None and "recv_counts or recv_capacity" in str(err)) or pytest.fail(repr(err)))
    got = c.alltoall(x)
    every = WORLD.allgather(to_np(x))
    all_ranks(lambda: np.testing.assert_array_equal(to_np(got), np.stack([every[j][RANK] for j in range(W)])))


def test_combine_and_cached_dispatch_repeats_alternating_call_shapes(moe_comm):
    """Repeated combines and cached dispatches alternating the handle (two dispatches of other routing, hidden and
    top-k), the dtype (fp32 / fp16 / bf16), the row strides of x (a column slice of a wider buffer), weights or
    none, out= or none and (GPU) the stream: every result bitwise equal to a NumPy reference of fresh random data,
    outputs on poisoned memory (the pool's blocks filled with garbage; out= prefilled), and every earlier result
    still intact at the end (a later call never writes into an array an earlier one returned). On the GPU a
    repeated call of one shape runs from the record its first call kept (x and the weights reduced in one
    launch): a record serving a call of another shape would show here as wrong values."""
    comm = moe_comm
    xp = comm.xp
    cuda = comm.backend == "cuda"
    n_exp = 4 * W
    handles = []
    for j, (tokens, hidden, topk) in enumerate(((UNEVEN[RANK % 4] + 5, 48, 3), (40, 64, 2))):
        rng = rng_for("repeat-shapes-dispatch", j, comm.backend)
        idx = make_routing("random", rng, tokens, n_exp, topk)
        x0 = rng.standard_normal((tokens, hidden)).astype(np.float32)
        h = comm.dispatch(to_dev(comm, x0), to_dev(comm, idx), None, n_exp)[4]
        handles.append((h, idx, hidden, topk, ref_routes(WORLD.allgather(idx), n_exp)))
    streams = [None]
    if cuda:
        import cupy
        streams.append(cupy.cuda.Stream(non_blocking=True))
    kept = []  # (device array, expected host array, name): checked again at the end
    for i in range(18):
        h, idx, hidden, topk, routes = handles[i % 2]
        dt = ("fp32", "fp16", "bf16")[(i // 2) % 3]
        with_w, strided, use_out = i % 3 != 1, i % 4 == 3, i % 5 == 2
        stream = streams[(i // 3) % len(streams)]
        rng = rng_for("repeat-shapes-call", i, comm.backend)
        n = h.num_recv_tokens
        cx = make_values(rng, (n, hidden), dt)
        cw = rng.uniform(0.05, 1.0, size=(n, topk)).astype(np.float32) if with_w else None
        xs = make_values(rng, (idx.shape[0], hidden), dt)  # for the cached dispatch
        xs_dev = to_dev(comm, xs)
        if strided:  # rows 8 elements apart (built on the host: no device arithmetic in any dtype)
            wide = make_values(rng, (n, hidden + 8), dt)
            wide[:, :hidden] = cx
            cx_dev = to_dev(comm, wide)[:, :hidden]
        else:
            cx_dev = to_dev(comm, cx)
        kw = {"dtype": "bfloat16"} if dt == "bf16" and cx_dev.dtype == np.uint16 else {}
        out = None
        if use_out:  # garbage bits in the caller's out
            out = to_dev(comm, np.full((idx.shape[0], hidden * cx.dtype.itemsize), 0x7B, np.uint8).view(cx.dtype))
        _dirty_pool(comm, 4 * (n + idx.shape[0]) * (hidden + topk) * 4)
        ctx = stream if stream is not None else _Null()
        if stream is not None:  # the inputs were made on the default stream, which the side stream does not wait for
            cupy.cuda.Device().synchronize()
        with ctx:
            combined, combined_w = comm.combine(cx_dev, h, to_dev(comm, cw) if with_w else None, out=out, **kw)
            recv_x = comm.dispatch(xs_dev, handle=h)[0]
            if stream is not None:
                stream.synchronize()
        every = WORLD.allgather((cx, cw, xs))
        acc = np.zeros((idx.shape[0], hidden), np.float32)
        acc_w = np.zeros((idx.shape[0], topk), np.float32)
        for r in range(W):
            for row, (s, t) in enumerate(routes[r]):
                if s == RANK:
                    acc[t] += to_f32(every[r][0][row], dt)
                    if with_w:
                        acc_w[t] += every[r][1][row]
        want = from_f32(acc, dt)
        want_recv = np.array([every[s][2][t] for s, t in routes[RANK]], xs.dtype).reshape(-1, hidden)

        def check():
            assert_bitwise(f"call {i}: combined_x", combined, want)
            assert out is None or combined is out, f"call {i}: combined_x is not the out array"
            if with_w:
                assert_bitwise(f"call {i}: combined_topk_weights", combined_w, acc_w)
            else:
                assert combined_w is None
            assert_bitwise(f"call {i}: cached dispatch recv_x", recv_x, want_recv)
        all_ranks(check)
        kept += [(combined, want, f"call {i}: combined_x"), (recv_x, want_recv, f"call {i}: recv_x")]
        if with_w:
            kept.append((combined_w, acc_w, f"call {i}: combined_topk_weights"))
    comm.synchronize()

    def intact():
        for got, want, name in kept:
            assert_bitwise(name + " (at the end)", got, want)
    all_ranks(intact)


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_eager_dispatch_repeats_alternating_call_shapes(moe_comm):
    """Repeated eager dispatches (no handle) alternating topk_idx's dtype (int64 / int32) and layout (C order, a
    column slice, Fortran order), x's dtype and strides (a column slice, every other element), weights or none
    (strided too), num_experts, expert_alignment and num_worst_tokens, each shape met several times: every
    result equal to a NumPy reference of fresh random data, outputs on poisoned memory, every earlier result intact
    at the end. On the GPU a repeated call of one shape runs from the record its first call kept (checks,
    signature, receive parts, prepared launches): a record serving another shape would show as wrong values."""
    comm = moe_comm
    cuda = comm.backend == "cuda"
    kept = []
    for i in range(16):
        tokens = UNEVEN[(RANK + i) % 4] + 5
        n_exp = (4 * W, 8 * W)[i % 2]
        topk = (3, 2)[(i // 4) % 2]
        hidden = 48
        idx_kind = ("i64", "i32", "cols", "F")[(i // 2) % 4]
        x_kind = ("c", "cols", "every other", "f16")[i % 4]
        w_kind = ("w", None, "w strided")[i % 3]
        align = (1, 3)[(i // 3) % 2]
        worst = (max(UNEVEN) + 5) * W if i % 5 == 4 else 0  # bounds what any rank receives
        idx, x, w = _inputs(("eager-repeat", i % 8, comm.backend), tokens, hidden, n_exp, topk)
        if x_kind == "f16":
            x = x.astype(np.float16)
        x_dev = to_dev(comm, x)
        if x_kind == "cols":
            wide = np.zeros((tokens, hidden + 8), x.dtype)
            wide[:, :hidden] = x
            x_dev = to_dev(comm, wide)[:, :hidden]
        elif x_kind == "every other":
            wide = np.zeros((tokens, 2 * hidden), x.dtype)
            wide[:, ::2] = x
            x_dev = to_dev(comm, wide)[:, ::2]
        idx_dev = to_dev(comm, idx.astype(np.int32) if idx_kind == "i32" else idx)
        if idx_kind == "cols":
            wide = np.full((tokens, topk + 2), -1, np.int64)
            wide[:, :topk] = idx
            idx_dev = to_dev(comm, wide)[:, :topk]
        elif idx_kind == "F":
            idx_dev = to_dev(comm, np.asfortranarray(idx)) if not cuda else to_dev(comm, idx.T.copy()).T
        w_dev = None
        if w_kind == "w":
            w_dev = to_dev(comm, w)
        elif w_kind == "w strided":
            wide = np.zeros((tokens, 2 * topk), np.float32)
            wide[:, ::2] = w
            w_dev = to_dev(comm, wide)[:, ::2]
        _dirty_pool(comm, 4 * tokens * W * (hidden + 2 * topk) * 4)
        out = comm.dispatch(x_dev, idx_dev, w_dev, n_exp, expert_alignment=align, num_worst_tokens=worst)
        rx, ri, rw, per_expert = _reference(idx, x.astype(np.float32), w, n_exp)
        n = rx.shape[0]
        want_counts = (per_expert + align - 1) // align * align

        def check(out=out, rx=rx, ri=ri, rw=rw, n=n, want_counts=want_counts, i=i, worst=worst, w_dev=w_dev):
            recv_x, recv_idx, recv_w, counts, h = out
            assert recv_x.dtype == x.dtype and recv_x.shape[0] == (worst or n), f"call {i}"
            assert np.array_equal(to_np(recv_x)[:n].astype(np.float32), rx), f"call {i}: recv_x"
            assert np.array_equal(to_np(recv_idx)[:n], ri), f"call {i}: recv_topk_idx"
            if w_dev is None:
                assert recv_w is None
            else:
                assert np.array_equal(to_np(recv_w)[:n], rw), f"call {i}: recv_topk_weights"
            if worst:
                assert (to_np(recv_idx)[n:] == -1).all() and int(to_np(h.num_recv_tokens_device)) == n
            got = np.asarray(counts if isinstance(counts, list) else to_np(counts), np.int64)
            assert np.array_equal(got, want_counts), f"call {i}: counts"
            assert (h.num_experts, h.expert_alignment, h.num_topk) == (n_exp, align, topk)
        all_ranks(check)
        kept.append((out, rx, ri, n, i))
    comm.synchronize()

    def intact():
        for (recv_x, recv_idx, *_), rx, ri, n, i in kept:
            assert np.array_equal(to_np(recv_x)[:n].astype(np.float32), rx), f"call {i}: recv_x (at the end)"
            assert np.array_equal(to_np(recv_idx)[:n], ri), f"call {i}: recv_topk_idx (at the end)"
    all_ranks(intact)


@pytest.mark.parametrize("tokens, n_exp, topk", [(9, 4 * W, 2), (1100, min(8192, 1020 * W), 3), (3000, 16 * W, 8)],
                         ids=["small", "max-experts", "tiles"])
def test_eager_dispatch_repeats_with_a_rejected_call_between(moe_comm, tokens, n_exp, topk):
    """Eager dispatches of one call shape (on the GPU the layout and the count exchange are one kernel, and the
    repeats run from the shape's record): each against the NumPy reference on fresh data, outputs on dirty memory;
    the third call carries a topk_idx value out of range on rank 0 only: rank 0 raises ValueError naming it, the
    others SymBufferRejectedError, nothing moves, and the next calls are right again. ``max-experts``: the most
    experts the default Config.max_notify_ints allows (at 8 ranks near MAX_EXPERTS, 8192: the layout's per-expert
    counters next to the fused kernel's static shared memory); ``tiles``: more tokens than one block's threads."""
    c = moe_comm
    hidden = 32
    for i in range(5):
        idx, x, w = _inputs(("eager-reject", tokens, n_exp, i, c.backend), tokens, hidden, n_exp, topk)
        bad = i == 2 and RANK == 0
        if bad:
            idx[tokens // 2, topk - 1] = n_exp + 3
        _dirty_pool(c, 4 * tokens * W * (hidden + 2 * topk) * 4)
        if i == 2:
            err = None
            try:
                c.dispatch(to_dev(c, x), to_dev(c, idx), to_dev(c, w), n_exp)
            except (ValueError, SymBufferRejectedError) as e:
                err = e
            if W == 1 and not bad:
                continue  # (one rank and a good call: nothing to reject)

            def rejected(err=err, bad=bad):
                if bad:
                    assert isinstance(err, ValueError) and not isinstance(err, SymBufferRejectedError), repr(err)
                    assert f"got {n_exp + 3} at [{tokens // 2}, {topk - 1}]" in str(err), str(err)
                else:
                    assert isinstance(err, SymBufferRejectedError) and "rank 0 rejected" in str(err), repr(err)
            all_ranks(rejected)
            continue
        recv_x, recv_idx, recv_w, counts, h = c.dispatch(to_dev(c, x), to_dev(c, idx), to_dev(c, w), n_exp)
        rx, ri, rw, per_expert = _reference(idx, x, w, n_exp)

        def check(i=i):
            assert np.array_equal(to_np(recv_x), rx), f"call {i}: recv_x"
            assert np.array_equal(to_np(recv_idx), ri), f"call {i}: recv_topk_idx"
            assert np.array_equal(to_np(recv_w), rw), f"call {i}: recv_topk_weights"
            assert list(counts) == per_expert.tolist(), f"call {i}: counts"
            assert h.num_recv_tokens == rx.shape[0]
            assert np.array_equal(to_np(h.is_token_in_rank).astype(bool),
                                  np.array([[any(e >= 0 and e // (n_exp // W) == r for e in row) for r in range(W)]
                                            for row in idx], bool).reshape(tokens, W))
        all_ranks(check)


def test_repeat_calls_of_one_shape(moe_comm):
    """Combines and cached dispatches of one call shape repeated 12 times (on the GPU from the handle's fast path:
    outputs from its pool, a launch descriptor of its own), fresh random values written into the same input arrays
    every call, every other result kept and the rest dropped, the last calls on a side stream (GPU): every result
    bitwise equal to a NumPy reference, and every kept one intact at the end (a pooled output is never handed out
    again while the caller holds it, and a dropped one only in stream order)."""
    comm = moe_comm
    cuda = comm.backend == "cuda"
    n_exp, hidden, topk = 4 * W, 64, 3
    tokens = UNEVEN[RANK % 4] + 5
    rng = rng_for("repeat-one-shape-dispatch", 0, comm.backend)
    idx = make_routing("random", rng, tokens, n_exp, topk)
    h = comm.dispatch(to_dev(comm, rng.standard_normal((tokens, hidden)).astype(np.float32)), to_dev(comm, idx),
                      None, n_exp)[4]
    routes = ref_routes(WORLD.allgather(idx), n_exp)
    n = h.num_recv_tokens
    cx_dev, cw_dev = to_dev(comm, np.zeros((n, hidden), np.float32)), to_dev(comm, np.zeros((n, topk), np.float32))
    xs_dev = to_dev(comm, np.zeros((tokens, hidden), np.float32))
    side = None
    if cuda:
        import cupy
        side = cupy.cuda.Stream(non_blocking=True)
    kept = []
    for i in range(12):
        rng = rng_for("repeat-one-shape-call", i, comm.backend)
        cx, xs = make_values(rng, (n, hidden), "fp32"), make_values(rng, (tokens, hidden), "fp32")
        cw = rng.uniform(0.05, 1.0, size=(n, topk)).astype(np.float32)
        on_side = side is not None and i >= 8
        if cuda:
            cupy.cuda.Device().synchronize()  # the previous calls (any stream) done with the inputs
        cx_dev[...], cw_dev[...], xs_dev[...] = to_dev(comm, cx), to_dev(comm, cw), to_dev(comm, xs)
        if cuda:
            cupy.cuda.Device().synchronize()  # the new values in place before a side-stream call reads them
        with (side if on_side else _Null()):
            combined, combined_w = comm.combine(cx_dev, h, cw_dev)
            recv_x = comm.dispatch(xs_dev, handle=h)[0]
            if on_side:
                side.synchronize()
        every = WORLD.allgather((cx, cw, xs))
        acc = np.zeros((tokens, hidden), np.float32)
        acc_w = np.zeros((tokens, topk), np.float32)
        for r in range(W):
            for row, (s, t) in enumerate(routes[r]):
                if s == RANK:
                    acc[t] += every[r][0][row]
                    acc_w[t] += every[r][1][row]
        want_recv = np.array([every[s][2][t] for s, t in routes[RANK]], np.float32).reshape(-1, hidden)

        def check():
            assert_bitwise(f"call {i}: combined_x", combined, acc)
            assert_bitwise(f"call {i}: combined_topk_weights", combined_w, acc_w)
            assert_bitwise(f"call {i}: cached dispatch recv_x", recv_x, want_recv)
        all_ranks(check)
        if i % 2:
            kept += [(combined, acc, f"call {i}: combined_x"), (combined_w, acc_w, f"call {i}: combined_topk_weights"),
                     (recv_x, want_recv, f"call {i}: recv_x")]
        combined = combined_w = recv_x = None  # (the dropped results: their outputs may be handed out again)
    comm.synchronize()

    def intact():
        for got, want, name in kept:
            assert_bitwise(name + " (at the end)", got, want)
    all_ranks(intact)
