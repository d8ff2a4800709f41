"""HierarchicalCommunicator: alltoall / alltoallv across (virtual) nodes, our channels inside a node and MPI between
them, against a flat NumPy reference; every node split of the world tried (1 rank per node, the whole world as one
node, and everything between), uneven counts with zeros, several dtypes and row shapes; bad arguments fail on
every rank."""
import numpy as np
import pytest

import cupy_symbuf as cs
from cupy_symbuf.scaleout.hierarchical import HierarchicalCommunicator, node_size_from_env
from _util import random_rows, reference_alltoallv, rng_for


def _splits(W):
    return [k for k in range(1, W + 1) if W % k == 0]


@pytest.mark.parametrize("dtype,row", [(np.float32, (3,)), (np.uint8, (7,)), (np.int64, ()), (np.float16, (2, 5))])
def test_alltoallv_over_virtual_nodes_matches_numpy(comm, dtype, row):
    W = comm.size
    rng = rng_for(comm, 31)
    for k in _splits(W):
        with HierarchicalCommunicator(comm, node_size=k) as h:
            assert (h.node, h.local_rank, h.num_nodes) == (comm.rank // k, comm.rank % k, W // k)
            assert h.node_comm.world_size == k
            for trial in range(3):
                counts = rng.integers(0, 6, W)
                counts[(comm.rank + trial) % W] = 0
                send = random_rows(rng, int(counts.sum()), row, dtype)
                want, want_counts = reference_alltoallv(comm, send, counts)
                got, got_counts = h.alltoallv(send, counts)
                np.testing.assert_array_equal(got_counts, want_counts)
                assert got.dtype == send.dtype and got.shape == want.shape
                np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
            x = random_rows(rng, W, (4,), np.float32)
            everything = comm.allgather(x)
            np.testing.assert_array_equal(h.alltoall(x), np.stack([everything[j][comm.rank] for j in range(W)]))


def test_node_size_is_checked_everywhere(comm, monkeypatch):
    W = comm.size
    if W > 1:
        with pytest.raises(ValueError, match="dividing the world size|rejected"):
            HierarchicalCommunicator(comm, node_size=W + 1 if comm.rank == 0 else W)
    with pytest.raises(ValueError, match=r"HierarchicalCommunicator: backend must be one of \('host', 'cuda', "
                                         r"'auto'\), got 'tpu'"):
        HierarchicalCommunicator(comm, node_size=1, backend="tpu")
    if not cs.common.backend.cuda_available():  # the GPU form is accepted, and refused only for want of a GPU
        with pytest.raises(RuntimeError, match="backend='cuda' needs CuPy and a visible GPU"):
            HierarchicalCommunicator(comm, node_size=1, backend="cuda")
    with HierarchicalCommunicator(comm, node_size=1, backend="auto") as h:
        assert h.backend == ("cuda" if cs.common.backend.cuda_available() else "host") == h.node_comm.backend
    with pytest.raises(ValueError, match=r"inter_node must be one of \('auto', 'mpi', 'nccl'\), got 'rdma'"):
        HierarchicalCommunicator(comm, node_size=1, inter_node="rdma")
    if W > 1:  # ranks asking for different engines: every rank raises, before any is made
        with pytest.raises(ValueError, match="ranks disagree on inter_node"):
            HierarchicalCommunicator(comm, node_size=1, inter_node="mpi" if comm.rank == 0 else "auto")
    with pytest.raises(ValueError, match="inter_node='nccl' cannot run: rank 0: the host backend"):
        HierarchicalCommunicator(comm, node_size=1, backend="host", inter_node="nccl")
    with HierarchicalCommunicator(comm, node_size=1, backend="host", inter_node="auto") as h:
        assert h.inter_node == "mpi"
    monkeypatch.setenv("CUPY_SYMBUF_NODE_SIZE", "x")
    with pytest.raises(ValueError, match="CUPY_SYMBUF_NODE_SIZE"):
        node_size_from_env()
    monkeypatch.setenv("CUPY_SYMBUF_NODE_SIZE", "1")
    with HierarchicalCommunicator(comm) as h:  # from the environment: one rank per virtual node
        assert h.node_size == 1 and h.num_nodes == W
    monkeypatch.delenv("CUPY_SYMBUF_NODE_SIZE")
    with HierarchicalCommunicator(comm) as h:  # the real node: this machine, every rank
        assert h.node_size == W and h.num_nodes == 1


def test_bad_counts_fail_on_every_rank_and_it_stays_usable(comm):
    W = comm.size
    with HierarchicalCommunicator(comm, node_size=1) as h:
        x = np.arange(W * 2, dtype=np.float32).reshape(W, 2)
        bad = np.ones(W, np.int64)
        bad[0] += comm.rank == 0  # rank 0's counts do not sum to its rows
        with pytest.raises(ValueError) as info:
            h.alltoallv(x, bad)
        msg = str(info.value)
        assert ("must sum to the number of rows" in msg and "rejected its" not in msg) if comm.rank == 0 else \
            "rank 0 rejected" in msg and isinstance(info.value, cs.SymBufferRejectedError)
        if W > 1:  # ranks disagreeing on the row shape
            with pytest.raises(ValueError, match="same dtype and row shape"):
                h.alltoallv(x if comm.rank else x.reshape(W, 2, 1), np.ones(W, np.int64))
        with pytest.raises((TypeError, ValueError)):  # send_counts None: named, on every rank
            h.alltoallv(x, None if comm.rank == 0 else np.ones(W, np.int64))
        if W > 1:  # a bad alltoall shape on the last rank only: every rank raises, all stay in step
            with pytest.raises(ValueError):
                h.alltoall(np.zeros((W + 1, 2), np.float32) if comm.rank == W - 1 else x)
        got, n = h.alltoallv(x, np.ones(W, np.int64))
        assert n.tolist() == [1] * W and got.shape == (W, 2)
        np.testing.assert_array_equal(h.alltoall(x), np.stack([comm.allgather(x)[j][comm.rank] for j in range(W)]))
    with pytest.raises(cs.SymBufferClosedError):
        h.alltoall(x)
    with cs.Communicator(comm, backend="host") as c:  # nothing left over in MPI from the rejected calls
        assert c.world_size == W


def test_alltoallv_checks_like_the_flat_one(comm):
    """From a new-user attack: ml_dtypes' 1-byte types share dtype.str '<V1' (an fp8 e4m3fn row was taken as
    e4m3fnuz on the other ranks: wrong data); a count too large for int64 on one rank made that rank leave before
    the agreement (every later call out of step until the timeout); non-integer counts were truncated; a list
    sendbuf was accepted. All now fail on every rank before anything moves, and the communicator stays usable."""
    import ml_dtypes
    W, me = comm.size, comm.rank
    with HierarchicalCommunicator(comm, node_size=2 if W % 2 == 0 else 1) as h:
        x = np.ones((W, 4), np.float32)
        if W > 1:
            fp8 = x.astype(ml_dtypes.float8_e4m3fn if me == 0 else ml_dtypes.float8_e4m3fnuz)
            with pytest.raises(ValueError, match="same dtype and row shape"):
                h.alltoallv(fp8, np.ones(W, np.int64))
        for bad in ([2 ** 63] + [0] * (W - 1), [1.5] + [1.0] * (W - 1)):
            with pytest.raises((TypeError, ValueError)) as info:
                h.alltoallv(x, bad if me == 0 else np.ones(W, np.int64))
            if me != 0:
                assert isinstance(info.value, cs.SymBufferRejectedError) and "rank 0 rejected" in str(info.value)
            else:
                assert "send_counts" in str(info.value)
        with pytest.raises((TypeError, ValueError)):
            h.alltoallv(x.tolist() if me == 0 else x, np.ones(W, np.int64))
        with pytest.raises((TypeError, ValueError)) as info:
            h.alltoall(np.zeros((W + 1, 4), np.float32) if me == 0 else x)
        assert "HierarchicalCommunicator.alltoall" in str(info.value)
        y = h.alltoall(x * (me + 1))  # still in step
        np.testing.assert_array_equal(y[:, 0], np.arange(1, W + 1, dtype=np.float32))


# ---- MoE dispatch / combine over (virtual) nodes (DeepEP's internode design) ------------------------------------
#
# Every check is against an independent NumPy reference built from every rank's inputs (allgather) with plain
# loops, and against a flat Communicator's dispatch / combine on the same world. dispatch: bitwise. combine: bitwise
# against a reference that adds in the documented order (inside each node in float32, local ranks ascending, the
# partial rounded to x's dtype; then nodes ascending in float32, rounded once); against the flat combine (ranks
# ascending, rounded once) within (num_nodes + 1) * unit roundoff of x's dtype * sum |terms| (float32: 2**-24,
# float16: 2**-11, bfloat16: 2**-8): the same terms summed in another order, and each node's partial rounded once.

import ml_dtypes  # noqa: E402
from mpi4py import MPI  # noqa: E402

from _util import all_ranks  # noqa: E402
from cupy_symbuf.common import backend as _compat  # noqa: E402
from cupy_symbuf.scaleout.hierarchical import HierarchicalDispatchHandle  # noqa: E402

WORLD = MPI.COMM_WORLD
W, RANK = WORLD.Get_size(), WORLD.Get_rank()
BF16 = np.dtype(ml_dtypes.bfloat16)
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
EPS = {"fp32": 2.0 ** -24, "fp16": 2.0 ** -11, "bf16": 2.0 ** -8, "bf16raw": 2.0 ** -8}


@pytest.fixture(scope="module")
def flat():
    c = cs.Communicator(WORLD, backend="host")
    yield c
    c.close()


@pytest.fixture(scope="module")
def hiers():
    """One HierarchicalCommunicator per node split of the world, made on first use, closed at the end."""
    made = {}

    def get(k):
        if k not in made:
            made[k] = HierarchicalCommunicator(WORLD, node_size=k)
        return made[k]
    yield get
    for k in sorted(made):
        made[k].close()


def values(rng, shape, dtype):
    """Random nonzero values, |v| in [0.25, 4], of a test dtype name (bf16raw: bfloat16 as uint16 bits)."""
    f = rng.uniform(0.25, 4.0, size=shape).astype(np.float32) * rng.choice(np.float32([-1, 1]), size=shape)
    return {"fp32": lambda: f, "fp16": lambda: f.astype(np.float16), "bf16": lambda: f.astype(BF16),
            "bf16raw": lambda: f.astype(BF16).view(np.uint16), "fp8": lambda: f.astype(FP8)}[dtype]()


def f32(a, dtype):
    return a.view(BF16).astype(np.float32) if dtype == "bf16raw" else a.astype(np.float32)


def from32(f, dtype):
    return {"fp32": lambda: f.astype(np.float32), "fp16": lambda: f.astype(np.float16),
            "bf16": lambda: f.astype(BF16), "bf16raw": lambda: f.astype(BF16).view(np.uint16)}[dtype]()


def bits(a):
    a = np.ascontiguousarray(_np(a))
    return a.view(UINT[a.dtype.itemsize])


def _np(a):
    return a if a is None or isinstance(a, np.ndarray) else a.get()


def same_bits(name, got, want):
    got = _np(got)
    assert got is not None, f"{name}: got None"
    assert got.shape == want.shape, f"{name}: shape {got.shape} != {want.shape}"
    assert got.dtype.itemsize == want.dtype.itemsize, f"{name}: dtype {got.dtype} vs {want.dtype}"
    if not np.array_equal(bits(got), bits(want)):
        bad = np.argwhere(bits(got) != bits(want))
        raise AssertionError(f"{name}: {len(bad)} elements differ, first at {bad[0].tolist()}: got "
                             f"{got[tuple(bad[0])]!r}, want {want[tuple(bad[0])]!r}")


def routing(rng, tokens, num_experts, topk, kind="random"):
    """int64 [tokens, topk]: distinct experts per row, about a fifth of the slots -1 (no expert), every eighth
    token sent nowhere; kind "skip_last": nobody routes to the last rank's experts."""
    allowed = np.arange(num_experts - (num_experts // W if kind == "skip_last" and W > 1 else 0))
    idx = -np.ones((tokens, topk), np.int64)
    for t in range(tokens):
        pick = rng.permutation(allowed)[:topk]
        idx[t, :len(pick)] = pick
    idx[rng.random(idx.shape) < 0.2] = -1
    idx[::8] = -1
    return idx


from test_moe import ref_routes  # noqa: E402  (routes[r]: the (source rank, token) rows rank r receives, in order)


def check_dispatch(got, all_x, all_s, all_idx, all_w, num_experts, align, dtype, hidden):
    """The dispatch results of this rank against the loops' reference."""
    recv_x, recv_idx, recv_w, counts, handle = got
    epr = num_experts // W
    mine = ref_routes(all_idx, num_experts)[RANK]
    K = all_idx[0].shape[1]
    empty = (0, hidden)
    want_x = np.stack([all_x[s][t] for s, t in mine]) if mine else np.empty(empty, all_x[0].dtype)
    if all_s[0] is not None:
        assert isinstance(recv_x, tuple) and len(recv_x) == 2
        want_s = np.stack([all_s[s][t] for s, t in mine]) if mine else np.empty((0, hidden // 128), np.float32)
        same_bits("recv_scales", recv_x[1], want_s)
        recv_x = recv_x[0]
    same_bits("recv_x", recv_x, want_x)
    want_idx = np.array([[int(e) - RANK * epr if e >= 0 and int(e) // epr == RANK else -1 for e in all_idx[s][t]]
                         for s, t in mine], np.int64).reshape(-1, K)
    if recv_idx is not None:
        assert _np(recv_idx).dtype == np.int64
        same_bits("recv_topk_idx", recv_idx, want_idx)
    if recv_idx is not None and all_w[0] is not None:
        want_w = np.array([all_w[s][t] for s, t in mine], np.float32).reshape(-1, K)
        same_bits("recv_topk_weights", recv_w, np.where(want_idx >= 0, want_w, np.float32(0)).astype(np.float32))
    else:
        assert recv_w is None
    raw = np.zeros(epr, np.int64)
    for v in want_idx.ravel():
        if v >= 0:
            raw[v] += 1
    want_counts = [int(-(-c // align) * align) for c in raw]
    assert isinstance(counts, list) and all(type(c) is int for c in counts), counts
    assert counts == want_counts, f"num_recv_tokens_per_expert {counts} != {want_counts}"
    assert isinstance(handle, HierarchicalDispatchHandle)
    assert handle.num_recv_tokens == len(mine)
    assert handle.recv_counts.tolist() == [sum(1 for s, _ in mine if s == j) for j in range(W)]


def ref_combine(all_cx, all_cw, routes, k, dtype, tokens, hidden, topk):
    """What combine returns on this rank, summed in the documented order (nodes of k ranks); also sum |terms|."""
    acc = np.zeros((tokens, hidden), np.float32)
    acc_w = np.zeros((tokens, topk), np.float32)
    mag = np.zeros((tokens, hidden), np.float32)
    for n in range(W // k):
        part = np.zeros((tokens, hidden), np.float32)
        part_w = np.zeros((tokens, topk), np.float32)
        hit = np.zeros(tokens, bool)
        for r in range(n * k, (n + 1) * k):
            for i, (s, t) in enumerate(routes[r]):
                if s == RANK:
                    part[t] += f32(all_cx[r][i], dtype)
                    mag[t] += np.abs(f32(all_cx[r][i], dtype))
                    if all_cw[r] is not None:
                        part_w[t] += all_cw[r][i]
                    hit[t] = True
        acc[hit] += f32(from32(part, dtype), dtype)[hit]
        acc_w[hit] += part_w[hit]
    return from32(acc, dtype), acc_w, mag


CASES = {  # name: (dtype, num_experts per rank, topk, hidden, weights, align, routing)
    "fp32_top4_weights": ("fp32", 4, 4, 16, True, 1, "random"),
    "bf16_top8_align4": ("bf16", 8, 8, 32, True, 4, "random"),
    "fp16_top2_no_weights_skip_last": ("fp16", 2, 2, 8, False, 1, "skip_last"),
    "bf16raw_top3": ("bf16raw", 4, 3, 7, True, 1, "random"),
    "fp8_top4": ("fp8", 4, 4, 256, True, 1, "random"),
    # one token a rank (decode): a rail carries a single row, whose unpacked parts were misaligned views on the GPU
    "bf16raw_top3_one_token": ("bf16raw", 4, 3, 7, True, 1, "random", 1),
}


def poison(a):
    """Overwrite ``a`` (NumPy or CuPy, any strides) with garbage: all-ones bytes, or -7.25 where its rows are
    strided."""
    if a.flags.c_contiguous:
        a.view(np.uint8)[...] = 0xFF
    else:
        a[...] = 0xFF if np.dtype(a.dtype).kind in "iu" else -7.25


def _round(h, fl, case, seed, k, dev=lambda a: a):
    """One dispatch + combine + cached dispatch of fresh random data on h (k ranks a node) and on the flat fl;
    everything checked against the reference and the flat results; inputs and outputs poisoned in between.
    ``dev``: NumPy -> the backend's arrays (the GPU tests: CuPy)."""
    dtype, epr, K, H, with_w, align, kind = case[:7]
    rng = np.random.default_rng([seed, RANK, W, k])
    E = epr * W
    T = 0 if RANK == W - 1 and seed % 2 else int(rng.integers(12, 40))  # the last rank empty every other round
    if len(case) > 7:
        T = case[7]
    idx = routing(rng, T, E, K, kind)
    x = values(rng, (T, H), dtype)
    scales = rng.uniform(0.5, 2, (T, H // 128)).astype(np.float32) if dtype == "fp8" else None
    w = rng.uniform(0.05, 1.0, (T, K)).astype(np.float32) if with_w else None
    if scales is None and seed % 2:  # a row-strided x (every other column of a wider array)
        big = values(rng, (T, 2 * H), dtype)
        big[:, ::2] = x
        arg = dev(big)[:, ::2]
    else:
        arg = (dev(x.copy()), dev(scales.copy())) if scales is not None else dev(x.copy())
    idx_in = dev(idx.astype(np.int32 if seed % 3 == 0 else np.int64))
    w_in = None if w is None else dev(w.copy())
    got = h.dispatch(arg, idx_in, w_in, E, expert_alignment=align)
    want = fl.dispatch(arg, idx_in, w_in, E, expert_alignment=align)
    # poison the inputs: the results must not alias them
    for a in (arg if isinstance(arg, tuple) else (arg,)) + ((w_in,) if w_in is not None else ()):
        poison(a)
    idx_in[...] = -1
    all_x, all_s, all_idx, all_w = (WORLD.allgather(a) for a in (x, scales, idx, w))
    all_ranks(lambda: check_dispatch(got, all_x, all_s, all_idx, all_w, E, align, dtype, H))

    def same_as_flat():
        gx, fx = (got[0][0], want[0][0]) if scales is not None else (got[0], want[0])
        same_bits("recv_x vs flat", gx, _np(fx))
        same_bits("recv_topk_idx vs flat", got[1], want[1])
        if w is not None:
            same_bits("recv_topk_weights vs flat", got[2], want[2])
        assert got[3] == want[3]
    all_ranks(same_as_flat)

    hh = got[4]
    cdt = "bf16" if dtype == "fp8" else dtype
    n_recv = hh.num_recv_tokens
    cx = values(rng, (n_recv, H), cdt)
    cw = rng.uniform(0.05, 1.0, (n_recv, K)).astype(np.float32) if with_w else None
    kw = {"dtype": "bfloat16"} if cdt == "bf16raw" else {}
    # poison the dispatch's outputs: combine must not read them
    for a in (got[0] if isinstance(got[0], tuple) else (got[0],)) + tuple(a for a in got[1:3] if a is not None):
        poison(a)
    cx_in, cw_in = dev(cx.copy()), None if cw is None else dev(cw.copy())
    if seed % 2 == 0:  # a strided combine input
        big = values(rng, (n_recv, 2 * H), cdt)
        big[:, 1::2] = cx
        cx_in = dev(big)[:, 1::2]
    comb, comb_w = h.combine(cx_in, hh, cw_in, **kw)
    fcomb, fcomb_w = fl.combine(dev(cx), want[4], None if cw is None else dev(cw), **kw)
    comb, comb_w, fcomb, fcomb_w = _np(comb), _np(comb_w), _np(fcomb), _np(fcomb_w)
    cx_in[...] = 0
    all_cx, all_cw = WORLD.allgather(cx), WORLD.allgather(cw)
    routes = ref_routes(all_idx, E)

    def check_combine():
        rx, rw, mag = ref_combine(all_cx, all_cw, routes, k, cdt, T, H, K)
        same_bits("combined_x", comb, rx)
        assert comb.dtype == cx.dtype
        assert not bits(comb)[(idx < 0).all(axis=1)].any(), "tokens sent nowhere must combine to zeros"
        bound = (W // k + 1) * EPS[cdt] * mag
        diff = np.abs(f32(comb, cdt) - f32(fcomb, cdt))
        assert (diff <= bound).all(), f"combined_x differs from the flat combine by {diff.max()} > bound"
        if k in (1, W):  # one node, or one rank a node: the flat combine's order exactly
            same_bits("combined_x vs flat", comb, fcomb)
        if cw is None:
            assert comb_w is None
        else:
            same_bits("combined_topk_weights", comb_w, rw)
            np.testing.assert_allclose(comb_w, fcomb_w, rtol=1e-5, atol=1e-6)
    all_ranks(check_combine)

    # a cached dispatch of fresh data on the same routes
    x2 = values(rng, (T, H), dtype)
    s2 = rng.uniform(0.5, 2, (T, H // 128)).astype(np.float32) if dtype == "fp8" else None
    got2 = h.dispatch((dev(x2), dev(s2)) if s2 is not None else dev(x2), handle=hh, expert_alignment=align)
    all_x2, all_s2 = WORLD.allgather(x2), WORLD.allgather(s2)

    def check_cached():
        assert got2[1] is None and got2[2] is None and got2[4] is hh
        mine = routes[RANK]
        want_x = np.stack([all_x2[s][t] for s, t in mine]) if mine else np.empty((0, H), x2.dtype)
        same_bits("cached recv_x", got2[0][0] if s2 is not None else got2[0], want_x)
        if s2 is not None:
            same_bits("cached recv_scales", got2[0][1],
                      np.stack([all_s2[s][t] for s, t in mine]) if mine else np.empty((0, H // 128), np.float32))
        assert got2[3] == got[3]
    all_ranks(check_cached)


@pytest.mark.parametrize("k", _splits(W))
@pytest.mark.parametrize("name", sorted(CASES))
def test_dispatch_combine_match_flat_and_numpy(hiers, flat, name, k):
    """Every node split (4 ranks: 4 x 1, 2 x 2, 1 x 4); random routing with -1 slots and tokens sent nowhere; an
    empty last rank every other round; three rounds of fresh data on the same communicators (repeated calls)."""
    h = hiers(k)
    for seed in range(3):
        _round(h, flat, CASES[name], seed * 7 + len(name), k)


# ---- bad arguments and mismatches: on one rank, every rank fails alike; the communicator stays usable -----------

BADRANK = W - 1  # the rank that passes the bad argument (rank 0 itself at world size 1)
OPD, OPC = "HierarchicalCommunicator.dispatch", "HierarchicalCommunicator.combine"


def _base(seed=5):
    rng = np.random.default_rng([seed, RANK])
    E = 4 * W
    return E, routing(rng, 16, E, 2), values(rng, (16, 8), "fp32"), rng.uniform(0.1, 1, (16, 2)).astype(np.float32)


def _bad_cases():
    def disp(mutate):
        def run(h, other):
            E, idx, x, w = _base()
            a = dict(x=x, idx=idx, w=w, n=E, kw={})
            if RANK == BADRANK:
                a.update(mutate(dict(a)))
            h.dispatch(a["x"], a["idx"], a["w"], a["n"], **a["kw"])
        return run

    def each(mutate):  # every rank passes its own (valid) arguments: they disagree
        def run(h, other):
            E, idx, x, w = _base()
            a = dict(x=x, idx=idx, w=w, n=E)
            a.update(mutate(dict(a)))
            h.dispatch(a["x"], a["idx"], a["w"], a["n"])
        return run

    def cached(mutate):
        def run(h, other):
            E, idx, x, w = _base()
            hd = h.dispatch(x, idx, w, E)[4]
            a = dict(x=x, idx=None, w=None, n=None, kw={"handle": hd})
            if RANK == BADRANK:
                a.update(mutate(dict(a), h, other, hd))
            h.dispatch(a["x"], a["idx"], a["w"], a["n"], **a["kw"])
        return run

    def comb(mutate, everyone=False):
        def run(h, other):
            E, idx, x, w = _base()
            rx, _, rw, _, hd = h.dispatch(x, idx, w, E)
            a = dict(x=rx, h=hd, w=rw, kw={})
            if everyone or RANK == BADRANK:
                a.update(mutate(dict(a), h, other, x, idx, w, E))
            h.combine(a["x"], a["h"], a["w"], **a["kw"])
        return run

    def idx_at(v):
        def m(a):
            i = a["idx"].copy()
            i[3, 1] = v if v != "E" else a["n"]
            return {"idx": i}
        return m

    def other_handle(a, h, other, x, idx, w, E):
        return {"h": other.dispatch(x, idx, w, E)[4]}

    def flat_handle(a, h, other, x, idx, w, E):
        return {"h": other.node_comm.dispatch(x, idx if other.world_size == 1 else -np.ones_like(idx), None,
                                              4 * other.node_size)[4]}

    def cached_other(h, other):  # every rank dispatches on the other communicator; the bad rank uses its handle
        E, idx, x, w = _base()
        ho = other.dispatch(x, idx, w, E)[4]
        hd = h.dispatch(x, idx, w, E)[4]
        h.dispatch(x, handle=ho if RANK == BADRANK else hd)

    def second_dispatch(a, h, other, x, idx, w, E):  # every rank dispatches again; the bad rank keeps the first
        hd2 = h.dispatch(x, idx, w, E)[4]
        return {} if RANK == BADRANK else {"h": hd2}

    V, T = ValueError, TypeError
    rej, mis = "rejected", "mismatch"
    return {
        # name: (call, exception on the bad rank, pattern, kind)
        "expert_index_too_big": (disp(idx_at("E")), V, rf"{OPD}: argument 'topk_idx' must hold -1 .*num_experts", rej),
        "expert_index_below_minus_one": (disp(idx_at(-2)), V, rf"{OPD}: argument 'topk_idx' must hold -1", rej),
        "num_experts_not_multiple": (disp(lambda a: {"n": a["n"] + 1}), V,
                                     rf"{OPD}: argument 'num_experts' must be a multiple of world_size", rej),
        "num_experts_missing": (disp(lambda a: {"n": None}), V, rf"{OPD}: argument 'num_experts' is required", rej),
        "num_experts_float": (disp(lambda a: {"n": float(a["n"])}), T,
                              rf"{OPD}: argument 'num_experts' must be an int", rej),
        "topk_idx_missing": (disp(lambda a: {"idx": None}), V, rf"{OPD}: argument 'topk_idx' is required", rej),
        "topk_idx_float": (disp(lambda a: {"idx": a["idx"].astype(np.float32)}), T,
                           rf"{OPD}: argument 'topk_idx' must be int64",
                           rej),
        "topk_idx_rows": (disp(lambda a: {"idx": a["idx"][:-1]}), V,
                          rf"{OPD}: argument 'topk_idx' must have shape", rej),
        "topk_weights_float64": (disp(lambda a: {"w": a["w"].astype(np.float64)}), T,
                                 rf"{OPD}: argument 'topk_weights' must be float32", rej),
        "topk_weights_cols": (disp(lambda a: {"w": a["w"][:, :1].copy()}), V,
                              rf"{OPD}: argument 'topk_weights' must have shape",
                              rej),
        "x_float64": (disp(lambda a: {"x": a["x"].astype(np.float64)}), T,
                      rf"{OPD}: argument 'x' must be bfloat16", rej),
        "x_list": (disp(lambda a: {"x": a["x"].tolist()}), T, rf"{OPD}: argument 'x' must be a NumPy array", rej),
        "x_3d": (disp(lambda a: {"x": a["x"].reshape(16, 2, 4)}), V, rf"{OPD}: argument 'x' must be 2-D", rej),
        "fp8_hidden_96": (disp(lambda a: {"x": (values(np.random.default_rng(1), (16, 96), "fp8"),
                                                np.ones((16, 0), np.float32))}), V,
                          rf"{OPD}: argument 'x\[0\]' \(x_fp8\) must have hidden divisible by 128", rej),
        "row_larger_than_chunk": (disp(lambda a: {"x": np.ones((16, 1 << 18), np.float32)}), V,
                                  rf"{OPD}: one row is .* bytes .*Config.chunk_bytes", rej),
        "expert_alignment_zero": (disp(lambda a: {"kw": {"expert_alignment": 0}}), V,
                                  rf"{OPD}: argument 'expert_alignment' must be in \[1, 1073741824\]", rej),
        "handle_not_a_handle": (disp(lambda a: {"idx": None, "w": None, "n": None, "kw": {"handle": (1, 2)}}), T,
                                rf"{OPD}: argument 'handle' must be a HierarchicalDispatchHandle", rej),
        "cached_with_topk_idx": (cached(lambda a, h, o, hd: {"idx": _base()[1]}), V,
                                 rf"{OPD}: arguments 'topk_idx' and 'topk_weights' must be None with handle", rej),
        "cached_other_num_experts": (cached(lambda a, h, o, hd: {"n": 1000 * W}), V,
                                     rf"{OPD}: argument 'num_experts' must be None or the handle's", rej),
        "cached_rows": (cached(lambda a, h, o, hd: {"x": a["x"][:-1]}), V,
                        rf"{OPD}: argument 'x' must have shape", rej),
        "cached_handle_of_other_communicator": (cached_other, V,
                                                rf"{OPD}: argument 'handle' must come from this communicator",
                                                rej),
        "combine_not_a_handle": (comb(lambda a, *r: {"h": "handle"}), T,
                                 rf"{OPC}: argument 'handle' must be a HierarchicalDispatchHandle", rej),
        "combine_flat_handle": (comb(flat_handle), T,
                                rf"{OPC}: argument 'handle' must be a HierarchicalDispatchHandle", rej),
        "combine_other_communicator": (comb(other_handle, everyone=True), V,
                                       rf"{OPC}: argument 'handle' must come from this communicator", "every"),
        "combine_rows": (comb(lambda a, *r: {"x": np.ones((a["x"].shape[0] + 1, 8), np.float32)}), V,
                         rf"{OPC}: argument 'x' must have shape .*num_recv_tokens", rej),
        "combine_hidden": (comb(lambda a, *r: {"x": np.ones((a["x"].shape[0], 9), np.float32)}), V,
                           rf"{OPC}: argument 'x' must have shape .*hidden", rej),
        "combine_uint16_without_dtype": (comb(lambda a, *r: {"x": np.ones(a["x"].shape, np.uint16)}), T,
                                         rf"{OPC}: argument 'x' must be .*dtype='bfloat16'", rej),
        "combine_dtype_mismatch": (comb(lambda a, *r: {"kw": {"dtype": np.float16}}), T,
                                   rf"{OPC}: argument 'dtype'", rej),
        "combine_weights_shape": (comb(lambda a, *r: {"w": a["w"][:, :1].copy()}), V,
                                  rf"{OPC}: argument 'topk_weights' must have shape", rej),
        "combine_x_list": (comb(lambda a, *r: {"x": a["x"].tolist()}), T,
                           rf"{OPC}: argument 'x' must be a NumPy array", rej),
        # every rank valid on its own, the ranks disagree: ValueError on every rank, naming the field
        "hidden_differs": (each(lambda a: {"x": values(np.random.default_rng(2), (16, 8 + RANK % 2), "fp32")}), V,
                           rf"{OPD}: ranks disagree on hidden", mis),
        "dtype_differs": (each(lambda a: {"x": a["x"].astype(np.float16) if RANK % 2 else a["x"]}), V,
                          rf"{OPD}: ranks disagree on dtype", mis),
        "weights_on_some_ranks": (each(lambda a: {"w": None if RANK % 2 else a["w"]}), V,
                                  rf"{OPD}: ranks disagree on topk_weights", mis),
        "num_topk_differs": (each(lambda a: {"idx": np.concatenate([a["idx"], -np.ones((16, RANK % 2), np.int64)], 1),
                                             "w": None}), V, rf"{OPD}: ranks disagree on num_topk", mis),
        "num_experts_differs": (each(lambda a: {"n": a["n"] * (1 + RANK % 2)}), V,
                                rf"{OPD}: ranks disagree on num_experts", mis),
        "cached_handles_of_different_dispatches": (
            cached(lambda a, h, o, hd: {}), V, rf"{OPD}: ranks disagree on handle", "cached-mis"),
        "combine_handles_of_different_dispatches": (comb(second_dispatch, everyone=True), V,
                                                    rf"{OPC}: ranks disagree on handle", mis),
        "combine_weights_on_some_ranks": (comb(lambda a, *r: {"w": None if RANK % 2 else a["w"]}, everyone=True), V,
                                          rf"{OPC}: ranks disagree on topk_weights", mis),
    }


BAD = _bad_cases()


@pytest.fixture(scope="module")
def other_hier():
    h = HierarchicalCommunicator(WORLD, node_size=1)
    yield h
    h.close()


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_argument_on_one_rank_fails_everywhere(hiers, flat, other_hier, name):
    """One rank's bad argument: that rank raises its own error naming the operation, the argument and the rule;
    every other rank raises SymBufferRejectedError naming that rank and repeating the error; ranks disagreeing
    raise ValueError naming the field on every rank. Then the communicator works (checked against NumPy)."""
    call, exc, pattern, kind = BAD[name]
    if (kind in ("mismatch", "cached-mis") or name == "num_experts_not_multiple") and W == 1:
        pytest.skip("needs world_size > 1")
    k = 2 if W % 2 == 0 else 1
    h = hiers(k)
    if kind == "cached-mis":  # the bad rank passes the handle of an earlier dispatch
        E, idx, x, w = _base()
        first = h.dispatch(x, idx, w, E)[4]
        second = h.dispatch(x, idx, w, E)[4]
        call = lambda h, o: h.dispatch(x, handle=first if RANK == BADRANK else second)  # noqa: E731

    def check():
        if kind in ("mismatch", "cached-mis", "every") or RANK == BADRANK:
            with pytest.raises(exc, match=pattern):
                call(h, other_hier)
        else:
            with pytest.raises(cs.SymBufferRejectedError,
                               match=rf"rank {BADRANK} rejected its arguments \((TypeError|ValueError): {pattern}"):
                call(h, other_hier)
    all_ranks(check)
    _round(h, flat, CASES["fp32_top4_weights"], 11, k)


@pytest.mark.skipif(W == 1, reason="a rail needs two nodes")
@pytest.mark.parametrize("step", ["dispatch", "combine"])
def test_a_failure_before_the_rail_step_fails_every_rail_peer(hiers, flat, monkeypatch, step):
    """From a review: an error on one rank between the agreement and the rail's MPI Alltoallv (there: a failed copy
    to the host, or a node kernel that failed) left its rail peers in MPI's unbounded wait. The rail peers now agree
    first: the failing rank raises its error, the others SymBufferError naming it, nothing crosses nodes, and the
    communicator works after (checked against NumPy)."""
    h = hiers(1)  # one rank per node: every rank is on one rail with all the others
    E, idx, x, w = _base()
    rx, _, rw, _, hd = h.dispatch(x, idx, w, E)
    real = h._to_host_staged

    def broken(a, name):  # the rail step's packed rows (uint8 [rows, bytes]) into the staging buffer
        if getattr(a, "ndim", 0) == 2 and a.dtype == np.uint8:
            raise RuntimeError("simulated failure before the rail step")
        return real(a, name)
    if RANK == BADRANK:
        monkeypatch.setattr(h, "_to_host_staged", broken)

    def call():
        if step == "dispatch":
            h.dispatch(x, idx, w, E)
        else:
            h.combine(rx, hd, rw)

    def check():
        if RANK == BADRANK:
            with pytest.raises(RuntimeError, match="simulated failure"):
                call()
        else:
            with pytest.raises(cs.SymBufferError, match=rf"node {BADRANK} on this rank's rail failed before the step "
                                                        rf"between nodes \(RuntimeError: simulated failure"):
                call()
    try:
        all_ranks(check)
    finally:
        monkeypatch.setattr(h, "_to_host_staged", real)
    _round(h, flat, CASES["fp32_top4_weights"], 13, 1)


def test_dispatch_after_close_raises():
    E, idx, x, w = _base()
    with HierarchicalCommunicator(WORLD, node_size=1) as h:
        hd = h.dispatch(x, idx, w, E)[4]
    with pytest.raises(cs.SymBufferClosedError):
        h.dispatch(x, idx, w, E)
    with pytest.raises(cs.SymBufferClosedError):
        h.combine(np.zeros((hd.num_recv_tokens, 8), np.float32), hd)


# ---- the GPU form (backend="cuda": the node communicator on the GPU, the step between nodes staged through host
# memory); skipped without CuPy and a GPU -------------------------------------------------------------------------

gpu = pytest.mark.skipif(not _compat.cuda_available(), reason="needs CuPy and a visible GPU")


def _to_cupy(a):
    """NumPy -> CuPy (a dtype CuPy lacks, bfloat16 or fp8: its raw unsigned bits)."""
    import cupy
    if a is None:
        return None
    try:
        d = cupy.asarray(a)
        if d.dtype == a.dtype:
            return d
    except Exception:  # noqa: BLE001 - a dtype CuPy does not have
        pass
    return cupy.asarray(np.ascontiguousarray(a).view(UINT[a.dtype.itemsize]))


@pytest.fixture(scope="module")
def gpu_comms():
    from cupy_symbuf.utils import select_device
    select_device(WORLD)
    made = {}

    def get(k):
        if k not in made:
            made[k] = HierarchicalCommunicator(WORLD, node_size=k, backend="cuda")
        return made[k]
    flat_gpu = cs.Communicator(WORLD, backend="cuda")
    yield get, flat_gpu
    for k in sorted(made):
        made[k].close()
    flat_gpu.close()


@gpu
@pytest.mark.parametrize("k", _splits(W))
@pytest.mark.parametrize("name", ["fp32_top4_weights", "fp16_top2_no_weights_skip_last", "bf16raw_top3",
                                  "bf16raw_top3_one_token", "fp8_top4"])
def test_gpu_dispatch_combine_match_flat_and_numpy(gpu_comms, name, k):
    """The same rounds as the host test with CuPy arrays in and out, against NumPy and the flat GPU communicator."""
    get, flat_gpu = gpu_comms
    h = get(k)
    assert h.backend == "cuda" and h.node_comm.backend == "cuda"
    for seed in range(2):
        _round(h, flat_gpu, CASES[name], seed * 5 + 1, k, dev=_to_cupy)


@gpu
@pytest.mark.parametrize("k", _splits(W))
def test_gpu_alltoallv_matches_numpy(gpu_comms, k):
    get, _ = gpu_comms
    h = get(k)
    rng = rng_for(WORLD, 77)
    for trial in range(2):
        counts = rng.integers(0, 6, W)
        send = random_rows(rng, int(counts.sum()), (3,), np.float32)
        want, want_counts = reference_alltoallv(WORLD, send, counts)
        got, got_counts = h.alltoallv(_to_cupy(send), counts)
        assert type(got).__module__.startswith("cupy")
        np.testing.assert_array_equal(got_counts, want_counts)
        np.testing.assert_array_equal(_np(got).view(np.uint8), want.view(np.uint8))
    with pytest.raises(TypeError, match="HierarchicalCommunicator.alltoallv: argument 'sendbuf' must be a CuPy"):
        h.alltoallv(send, counts)  # NumPy on the cuda backend: refused on every rank alike


class _FakeNccl:
    """CuPy's NCCL binding as the rail step uses it (groupStart, send, recv, groupEnd, NCCL_UINT8, destroy), over
    host memory: the grouped sends / receives run as MPI Isend / Irecv on the rail at groupEnd. Lets the host tests
    check the NCCL branch's offsets and counts (the real one needs GPUs on distinct devices)."""

    NCCL_UINT8 = 7

    def __init__(self, rail):
        self.rail, self.ops, self.destroyed = rail, [], False

    # the module's functions
    def groupStart(self):
        self.ops = []

    def groupEnd(self):
        import ctypes
        reqs, keep = [], []
        for kind, addr, n, peer in self.ops:
            buf = (ctypes.c_uint8 * n).from_address(addr)
            keep.append(buf)
            reqs.append(self.rail.Isend([buf, MPI.BYTE], dest=peer, tag=91) if kind == "send" else
                        self.rail.Irecv([buf, MPI.BYTE], source=peer, tag=91))
        MPI.Request.Waitall(reqs)
        self.ops = []

    # the communicator's methods
    def send(self, addr, n, dtype, peer, stream):
        assert dtype == self.NCCL_UINT8 and stream == 0 and n > 0
        self.ops.append(("send", addr, n, peer))

    def recv(self, addr, n, dtype, peer, stream):
        assert dtype == self.NCCL_UINT8 and stream == 0 and n > 0
        self.ops.append(("recv", addr, n, peer))

    def destroy(self):
        self.destroyed = True


@pytest.mark.parametrize("k", _splits(W))
def test_nccl_rail_branch_moves_the_same_bytes(flat, monkeypatch, k):
    """The inter_node='nccl' branch of the step between nodes (grouped send / recv per rail peer), run on the host
    with a fake NCCL that moves the bytes by MPI: alltoallv, dispatch, cached dispatch and combine equal NumPy and
    the flat communicator, as over MPI; the rail communicator is destroyed at close."""
    import sys
    import types
    h = HierarchicalCommunicator(WORLD, node_size=k)
    assert h.inter_node == "mpi"  # the host backend: MPI
    fake = _FakeNccl(h._rail)
    cuda_pkg = types.SimpleNamespace(nccl=fake)
    monkeypatch.setitem(sys.modules, "cupy.cuda.nccl", fake)
    monkeypatch.setitem(sys.modules, "cupy.cuda", cuda_pkg)
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=cuda_pkg))
    h._nccl, h.inter_node = fake, "nccl"
    try:
        _a2av_round(h, 91 + k)
        for name in ("fp32_top4_weights", "bf16raw_top3_one_token"):
            _round(h, flat, CASES[name], 17, k)
    finally:
        h.close()
    assert fake.destroyed


# ---- failures that leave the ranks out of step (from a new-user attack) -----------------------------------------

def _a2av_round(h, seed):
    """One alltoallv through ``h`` with random counts and rows, checked against NumPy on every rank."""
    rng = rng_for(WORLD, seed)
    counts = rng.integers(0, 5, W)
    send = random_rows(rng, int(counts.sum()), (3,), np.float32)
    want, want_counts = reference_alltoallv(WORLD, send, counts)
    got, got_counts = h.alltoallv(send, counts)
    np.testing.assert_array_equal(got_counts, want_counts)
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


@pytest.mark.skipif(W == 1, reason="needs a peer")
@pytest.mark.parametrize("case", ["late_rank", "different_collectives"])
def test_a_failed_agreement_makes_it_unusable_on_every_rank(case):
    """A rank that came to a call after its peers' bounded agreement had timed out, or ranks calling different
    collectives, left the agreement's messages queued: the next call took them for its own, and some ranks went on
    into the rail's MPI Alltoallv (unbounded) while the others raised: a hang. Now the failing call raises on every
    rank, every later call raises SymBufferError naming the first failure (at once, on every rank), close works,
    and a communicator made after it is in step (checked against NumPy)."""
    import time
    k = 2 if W % 2 == 0 else 1
    h = HierarchicalCommunicator(WORLD, cs.Config(timeout_s=1, abort_on_failure=False), node_size=k)
    x = np.arange(W * 2, dtype=np.float32).reshape(W, 2)
    ones = np.ones(W, np.int64)

    def fail():
        with pytest.raises(cs.SymBufferError):
            if case == "late_rank":
                if RANK == 1:
                    time.sleep(1.5)  # the others' agreement times out first
                h.alltoallv(x, ones)
            elif RANK == 0:
                h.alltoall(x)
            else:
                h.alltoallv(x, ones)
    all_ranks(fail)

    def refused():
        E, idx, xt, w = _base()
        for call in (lambda: h.alltoallv(x, ones), lambda: h.alltoall(x), lambda: h.dispatch(xt, idx, w, E)):
            t0 = time.monotonic()
            with pytest.raises(cs.SymBufferError, match="HierarchicalCommunicator is unusable after an earlier "
                                                        "failure"):
                call()
            assert time.monotonic() - t0 < 0.5  # refused at once, not after a wait
    all_ranks(refused)
    h.close()
    WORLD.Barrier()
    with HierarchicalCommunicator(WORLD, node_size=k) as fresh:
        _a2av_round(fresh, 97)


@pytest.mark.skipif(W % 2 or W < 4, reason="needs two nodes of two ranks")
def test_a_node_communicator_that_fails_to_build_fails_every_rank():
    """A Config that differs between the ranks of one node failed that node's Communicator only: the ranks of the
    other nodes got a HierarchicalCommunicator (inter_node='mpi') whose first call timed out, or waited out
    timeout_s in construction ('auto'). Now every rank raises at construction, the other nodes' ranks naming the
    failing rank, and a communicator made after it works (checked against NumPy)."""
    for inter in ("mpi", "auto"):
        cfg = cs.Config(timeout_s=5, num_slots=8 if RANK == 0 else 16)

        def build():
            with pytest.raises(ValueError) as info:
                HierarchicalCommunicator(WORLD, cfg, node_size=2, inter_node=inter)
            if RANK < 2:
                assert "ranks disagree on config.num_slots" in str(info.value)
            else:
                assert "the node communicator of rank 0 (node 0) could not be built" in str(info.value)
        all_ranks(build)
    with HierarchicalCommunicator(WORLD, node_size=2) as h:
        _a2av_round(h, 98)


def test_alltoall_refuses_a_list_like_the_flat_one():
    """From a new-user attack: HierarchicalCommunicator.alltoall took a Python list (np.ascontiguousarray on the host)
    where its alltoallv and the flat alltoall raise TypeError. Now the list's rank raises TypeError naming sendbuf,
    the others SymBufferRejectedError, and the next alltoall is in step (against NumPy)."""
    x = np.arange(W * 3, dtype=np.float32).reshape(W, 3) + 10 * RANK
    with HierarchicalCommunicator(WORLD, node_size=1) as h:
        def check():
            with pytest.raises((TypeError, ValueError)) as info:
                h.alltoall(x.tolist() if RANK == 0 else x)
            if RANK == 0:
                assert isinstance(info.value, TypeError) and "argument 'sendbuf' must be a NumPy array" in \
                    str(info.value)
            else:
                assert isinstance(info.value, cs.SymBufferRejectedError)
        all_ranks(check)
        everything = WORLD.allgather(x)
        np.testing.assert_array_equal(h.alltoall(x), np.stack([everything[j][RANK] for j in range(W)]))
