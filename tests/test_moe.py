"""MoE dispatch / combine (DeepEP normal-mode intranode semantics) against an independent NumPy reference.

One suite for every world size and backend::

    python -m pytest tests/test_moe.py
    mpiexec -n 2 python -m pytest tests/test_moe.py
    mpiexec -n 4 python -m pytest tests/test_moe.py

Each test runs on ``mpi4py.MPI.COMM_WORLD`` for every backend available here (``host`` always, ``cuda`` when CuPy
imports and sees a GPU). Inputs are fresh random data, seeded per (test, rank), never zero. Every rank gathers all
ranks' inputs with ``allgather`` and computes with plain loops what it must receive and combine; outputs are
compared bitwise (the combine reference adds in float32 in the same fixed rank order the API documents). Checks are
collective (:func:`all_ranks`): a failure on one rank fails the test on every rank, so no rank is left waiting in a
collective.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Optional

import numpy as np
import pytest

MPI = pytest.importorskip("mpi4py.MPI")
ml_dtypes = pytest.importorskip("ml_dtypes")

from conftest import _gpu_for_rank, available_backends  # noqa: E402  (tests/ is on sys.path under pytest)
from _util import all_ranks  # noqa: E402,F401  (test_moe_device imports it from here too)
from cupy_symbuf import Communicator  # noqa: E402
from cupy_symbuf.moe import DispatchHandle  # noqa: E402

WORLD = MPI.COMM_WORLD
RANK = WORLD.Get_rank()
W = WORLD.Get_size()

BF16 = np.dtype(ml_dtypes.bfloat16)
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


@pytest.fixture(scope="module", params=available_backends())
def moe_comm(request):
    """One Communicator per backend for the whole module (construction allocates the symmetric buffer)."""
    if request.param == "cuda":
        import cupy
        cupy.cuda.Device(_gpu_for_rank()).use()
    c = Communicator(WORLD, backend=request.param)
    yield c
    c.close()


# ------------------------------------------------------------------------------------------------ helpers


def rng_for(*key) -> np.random.Generator:
    return np.random.default_rng([zlib.crc32(repr(key).encode()), RANK])


def to_dev(comm, a):
    """NumPy array -> the backend's array module (CuPy may lack a dtype: then its raw unsigned bits)."""
    if comm.backend == "host":
        return a
    import cupy
    try:
        d = cupy.asarray(a)
        if d.dtype == a.dtype:
            return d
    except Exception:
        pass
    return cupy.asarray(np.ascontiguousarray(a).view(UINT[a.dtype.itemsize]))


def to_np(a):
    if a is None or isinstance(a, np.ndarray):
        return a
    return a.get()


def bits(a) -> np.ndarray:
    a = np.ascontiguousarray(to_np(a))
    return a.view(UINT[a.dtype.itemsize])


def assert_bitwise(name, got, want):
    got = to_np(got)
    assert got is not None, f"{name}: got None"
    assert tuple(got.shape) == tuple(want.shape), f"{name}: shape {got.shape} != {want.shape}"
    assert got.dtype.itemsize == want.dtype.itemsize, f"{name}: dtype {got.dtype} vs {want.dtype}"
    g, w = bits(got), bits(want)
    if not np.array_equal(g, w):
        bad = np.argwhere(g != w)
        raise AssertionError(f"{name}: {len(bad)} elements differ, first at {bad[0].tolist()}: "
                             f"got {got[tuple(bad[0])]!r} want {want[tuple(bad[0])]!r}")


def make_values(rng, shape, dtype: str) -> np.ndarray:
    """Random nonzero values (|v| in [0.25, 4]) of a test dtype name: fp32, fp16, bf16, bf16raw (uint16 bits),
    fp8 (float8_e4m3fn)."""
    f = rng.uniform(0.25, 4.0, size=shape).astype(np.float32) * rng.choice(np.float32([-1, 1]), size=shape)
    if dtype == "fp32":
        return f
    if dtype == "fp16":
        return f.astype(np.float16)
    if dtype == "bf16":
        return f.astype(BF16)
    if dtype == "bf16raw":
        return f.astype(BF16).view(np.uint16)
    if dtype == "fp8":
        return f.astype(FP8)
    raise ValueError(dtype)


def to_f32(a: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bf16raw":
        return a.view(BF16).astype(np.float32)
    return a.astype(np.float32)


def from_f32(f: np.ndarray, dtype: str) -> np.ndarray:
    return {"fp32": lambda: f.copy(), "fp16": lambda: f.astype(np.float16), "bf16": lambda: f.astype(BF16),
            "bf16raw": lambda: f.astype(BF16).view(np.uint16)}[dtype]()


def make_routing(kind: str, rng, num_tokens: int, num_experts: int, num_topk: int) -> np.ndarray:
    """int64 ``[num_tokens, num_topk]`` expert ids (distinct per row, ``-1`` padding shuffled into place)."""
    epr = num_experts // W

    def pick(allowed, logits=None):
        allowed = np.asarray(allowed, dtype=np.int64)
        out = -np.ones((num_tokens, num_topk), dtype=np.int64)
        k = min(num_topk, len(allowed))
        if k and num_tokens:
            score = rng.random((num_tokens, len(allowed)))
            if logits is not None:                      # Gumbel top-k = sampling without replacement by weight
                score = -(logits[None, :] + rng.gumbel(size=score.shape))
            out[:, :k] = allowed[np.argsort(score, axis=1)[:, :k]]
        perm = np.argsort(rng.random((num_tokens, num_topk)), axis=1)
        return np.take_along_axis(out, perm, axis=1)

    if kind == "random":
        return pick(np.arange(num_experts))
    if kind == "zipf":                                   # same popular experts on every rank
        popular = np.random.default_rng(1234).permutation(num_experts)
        logits = np.empty(num_experts)
        logits[popular] = -1.2 * np.log1p(np.arange(num_experts))
        return pick(np.arange(num_experts), logits)
    if kind == "one_rank":                               # every token to rank 0's experts
        return pick(np.arange(epr))
    if kind == "recv_nothing":                           # nobody routes to the last rank's experts
        return pick(np.arange(num_experts - epr))
    if kind == "masked":
        idx = pick(np.arange(num_experts))
        for t in range(num_tokens):
            if t % 4 == 0:                               # fully masked row
                idx[t] = -1
            elif t % 4 == 1 and num_topk >= 3 and epr >= 2:  # one -1 and two experts of one rank
                r = int(rng.integers(W))
                pair = r * epr + rng.choice(epr, size=2, replace=False)
                others = np.setdiff1d(np.arange(num_experts), pair)
                rest = rng.choice(others, size=min(num_topk - 3, len(others)), replace=False)
                row = np.full(num_topk, -1, dtype=np.int64)
                row[:2] = pair
                row[3:3 + len(rest)] = rest
                idx[t] = row[rng.permutation(num_topk)]
        return idx
    raise ValueError(kind)


# ------------------------------------------------------------------------------------------------ reference


def ref_layout(idx: np.ndarray, num_experts: int):
    epr = num_experts // W
    in_rank = np.zeros((idx.shape[0], W), dtype=bool)
    per_expert = np.zeros(num_experts, dtype=np.int64)
    for t in range(idx.shape[0]):
        for e in idx[t]:
            if e >= 0:
                in_rank[t, e // epr] = True
                per_expert[e] += 1
    return in_rank.sum(axis=0), per_expert, in_rank


def ref_routes(all_idx, num_experts: int):
    """routes[r] = [(src_rank, token), ...] in the order rank r receives them (source rank, then token)."""
    epr = num_experts // W
    routes = [[] for _ in range(W)]
    for s in range(W):
        for t in range(all_idx[s].shape[0]):
            for r in sorted({int(e) // epr for e in all_idx[s][t] if e >= 0}):
                routes[r].append((s, t))
    return routes


def local_idx(row, num_experts: int, rank: int) -> np.ndarray:
    epr = num_experts // W
    return np.array([int(e) - rank * epr if e >= 0 and int(e) // epr == rank else -1 for e in row], dtype=np.int64)


# ------------------------------------------------------------------------------------------------ cases


@dataclass(frozen=True)
class Case:
    name: str
    routing: str = "random"
    num_tokens: int = 64
    hidden: int = 64
    num_experts: int = 32            # 0: world_size
    num_topk: int = 4
    dtype: str = "fp32"              # fp32, fp16, bf16, bf16raw, fp8 (dispatch; combine then uses bf16)
    align: int = 1
    x_layout: str = "contig"         # contig, strided (big[:, ::2]), offset (C-contiguous, misaligned by 1 item)
    scales_layout: str = "contig"    # contig, colmajor, strided
    weights: bool = True
    idx_dtype: str = "int64"
    cuda_only: bool = False

    def experts(self) -> int:
        return self.num_experts or W


CASES = [
    Case("random_fp32"),
    Case("random_bf16_top8", num_tokens=96, hidden=256, num_experts=64, num_topk=8, dtype="bf16"),
    Case("zipf_bf16_top8", routing="zipf", num_tokens=256, hidden=128, num_experts=64, num_topk=8, dtype="bf16"),
    Case("one_rank_fp16_h7", routing="one_rank", hidden=7, num_experts=16, dtype="fp16"),
    Case("zero_tokens_bf16_h7", routing="zero_tokens", hidden=7, dtype="bf16"),
    Case("recv_nothing_fp32", routing="recv_nothing"),
    Case("experts_eq_world_top1", num_experts=0, num_topk=1),
    Case("experts_eq_world_top2_bf16", num_experts=0, num_topk=2, hidden=16, dtype="bf16"),
    Case("top1_fp16", num_topk=1, dtype="fp16", num_tokens=128),
    Case("align128_bf16", num_tokens=96, dtype="bf16", align=128),
    Case("align128_zipf_fp32", routing="zipf", num_experts=64, num_topk=8, align=128),
    Case("hidden2880_bf16", num_tokens=32, hidden=2880, num_experts=64, num_topk=8, dtype="bf16"),
    Case("hidden7168_bf16", num_tokens=12, hidden=7168, num_experts=64, num_topk=8, dtype="bf16"),
    Case("hidden7_bf16raw", hidden=7, dtype="bf16raw"),
    Case("masked_bf16_h7", routing="masked", hidden=7, num_experts=16, num_topk=4, dtype="bf16"),
    Case("masked_fp32_top8", routing="masked", num_experts=64, num_topk=8),
    Case("strided_x_fp16", hidden=96, dtype="fp16", x_layout="strided"),
    Case("strided_x_bf16_h7", hidden=7, dtype="bf16", x_layout="strided", routing="masked", num_experts=16),
    Case("offset_x_bf16", hidden=64, dtype="bf16", x_layout="offset", num_topk=2),
    Case("offset_x_fp32_weights_h6", hidden=6, dtype="fp32", x_layout="offset"),
    Case("fp8_h256", hidden=256, dtype="fp8"),
    Case("fp8_h7168_colmajor_scales", num_tokens=12, hidden=7168, num_experts=64, num_topk=8, dtype="fp8",
         scales_layout="colmajor"),
    Case("fp8_h384_strided_scales", hidden=384, dtype="fp8", scales_layout="strided", routing="zipf"),
    Case("no_weights_bf16", dtype="bf16", weights=False),
    Case("int32_topk_idx", idx_dtype="int32", routing="masked", num_experts=16),
    Case("deepseek_like_bf16", num_tokens=1024, hidden=7168, num_experts=256, num_topk=8, dtype="bf16",
         cuda_only=True),
]


def laid_out(comm, rng, a: np.ndarray, case: Case, dtype: Optional[str] = None):
    """``a`` on the backend in the case's memory layout: ``strided`` = ``big[:, ::2]``; ``offset`` = C-contiguous
    but starting one item into an allocation (so its address is not aligned to wider words)."""
    dtype = dtype or case.dtype
    n, h = a.shape
    if case.x_layout == "strided":
        big = make_values(rng, (n, 2 * h), dtype)
        big[:, ::2] = a
        return to_dev(comm, big)[:, ::2]
    if case.x_layout == "offset":
        flat = make_values(rng, (n * h + 1,), dtype)
        flat[1:] = a.reshape(-1)
        return to_dev(comm, flat)[1:].reshape(n, h)
    return to_dev(comm, a)


def run_case(comm, case: Case, *, key=(), handle_out: Optional[list] = None):
    """Dispatch and combine one case and compare everything with the reference, on every rank."""
    xp = comm.xp
    rng = rng_for(case.name, comm.backend, *key)
    n_exp = case.experts()
    num_tokens = 0 if (case.routing == "zero_tokens" and RANK == W - 1) else case.num_tokens
    routing = "random" if case.routing == "zero_tokens" else case.routing
    if routing == "recv_nothing" and W == 1:
        idx = -np.ones((num_tokens, case.num_topk), dtype=np.int64)
    else:
        idx = make_routing(routing, rng, num_tokens, n_exp, case.num_topk)
    weights = rng.uniform(0.05, 1.0, size=idx.shape).astype(np.float32) if case.weights else None
    fp8 = case.dtype == "fp8"
    x_np = make_values(rng, (num_tokens, case.hidden), case.dtype)
    scales_np = rng.uniform(0.5, 2.0, size=(num_tokens, case.hidden // 128)).astype(np.float32) if fp8 else None

    # device inputs, in the requested memory layouts
    x_dev = laid_out(comm, rng, x_np, case)
    if fp8:
        if case.scales_layout == "colmajor":
            s_dev = xp.asfortranarray(to_dev(comm, scales_np))
        elif case.scales_layout == "strided":
            big_s = np.repeat(scales_np, 2, axis=1) * np.float32(3)
            big_s[:, ::2] = scales_np
            s_dev = to_dev(comm, big_s)[:, ::2]
        else:
            s_dev = to_dev(comm, scales_np)
        x_arg = (x_dev, s_dev)
    else:
        x_arg = x_dev
    idx_dev = to_dev(comm, idx.astype(case.idx_dtype))
    w_dev = to_dev(comm, weights) if weights is not None else None

    recv_x, recv_idx, recv_w, per_expert, handle = comm.dispatch(
        x_arg, idx_dev, w_dev, n_exp, expert_alignment=case.align)

    all_idx = WORLD.allgather(idx)
    all_x = WORLD.allgather(x_np)
    all_w = WORLD.allgather(weights)
    all_s = WORLD.allgather(scales_np)
    routes = ref_routes(all_idx, n_exp)
    mine = routes[RANK]
    n_recv = len(mine)
    epr = n_exp // W

    def check_dispatch():
        want_x = np.stack([all_x[s][t] for s, t in mine]) if mine else np.empty((0, case.hidden), x_np.dtype)
        got_x = recv_x
        if fp8:
            assert isinstance(recv_x, tuple) and len(recv_x) == 2, "fp8 dispatch must return (x, scales)"
            got_x, got_s = recv_x
            want_s = (np.stack([all_s[s][t] for s, t in mine]) if mine
                      else np.empty((0, case.hidden // 128), np.float32))
            assert_bitwise("recv_scales", got_s, want_s)
        assert_bitwise("recv_x", got_x, want_x)
        want_idx = (np.stack([local_idx(all_idx[s][t], n_exp, RANK) for s, t in mine]) if mine
                    else np.empty((0, case.num_topk), np.int64))
        assert to_np(recv_idx).dtype == np.int64, f"recv_topk_idx dtype {recv_idx.dtype}"
        assert_bitwise("recv_topk_idx", recv_idx, want_idx)
        if weights is None:
            assert recv_w is None, "recv_topk_weights must be None without topk_weights"
        else:
            want_w = (np.stack([all_w[s][t] for s, t in mine]) if mine
                      else np.empty((0, case.num_topk), np.float32))
            want_w = np.where(want_idx >= 0, want_w, np.float32(0)).astype(np.float32)
            assert to_np(recv_w).dtype == np.float32
            assert_bitwise("recv_topk_weights", recv_w, want_w)
        counts = np.zeros(epr, dtype=np.int64)
        for li in want_idx.ravel():
            if li >= 0:
                counts[li] += 1
        want_counts = [int(-(-c // case.align) * case.align) for c in counts]
        assert isinstance(per_expert, list) and all(type(c) is int for c in per_expert), \
            f"num_recv_tokens_per_expert must be a list of int, got {per_expert!r}"
        assert per_expert == want_counts, f"num_recv_tokens_per_expert {per_expert} != {want_counts}"
        assert isinstance(handle, DispatchHandle)
        assert handle.num_recv_tokens == n_recv
        assert [int(c) for c in handle.recv_counts] == [sum(1 for s, _ in mine if s == j) for j in range(W)]

    all_ranks(check_dispatch)

    # combine: fresh per-row expert outputs and weights on every rank
    c_dtype = "bf16" if fp8 else case.dtype
    cx = make_values(rng, (n_recv, case.hidden), c_dtype)
    cw = rng.uniform(0.05, 1.0, size=(n_recv, case.num_topk)).astype(np.float32) if case.weights else None
    cx_dev = laid_out(comm, rng, cx, case, c_dtype)
    cw_dev = to_dev(comm, cw) if cw is not None else None
    kw = {"dtype": "bfloat16"} if c_dtype == "bf16raw" else {}
    combined, combined_w = comm.combine(cx_dev, handle, cw_dev, **kw)

    all_cx = WORLD.allgather(cx)
    all_cw = WORLD.allgather(cw)

    def check_combine():
        acc = np.zeros((num_tokens, case.hidden), dtype=np.float32)
        acc_w = np.zeros((num_tokens, case.num_topk), dtype=np.float32)
        for r in range(W):                          # documented order: source ranks ascending, from 0.0
            for i, (s, t) in enumerate(routes[r]):
                if s == RANK:
                    acc[t] += to_f32(all_cx[r][i], c_dtype)
                    if cw is not None:
                        acc_w[t] += all_cw[r][i]
        assert_bitwise("combined_x", combined, from_f32(acc, c_dtype))
        assert combined.dtype == cx_dev.dtype, f"combined_x dtype {combined.dtype} != x dtype {cx_dev.dtype}"
        went_nowhere = (idx < 0).all(axis=1)
        assert not to_np(combined)[went_nowhere].view(UINT[to_np(combined).dtype.itemsize]).any(), \
            "tokens sent nowhere must combine to zeros"
        if cw is None:
            assert combined_w is None
        else:
            assert_bitwise("combined_topk_weights", combined_w, acc_w)

    all_ranks(check_combine)
    if handle_out is not None:
        handle_out.append((handle, x_np, idx))
    return handle


# ------------------------------------------------------------------------------------------------ tests


@pytest.mark.parametrize("routing", ["random", "zipf", "one_rank", "recv_nothing", "masked"])
@pytest.mark.parametrize("num_topk", [1, 4, 8])
def test_layout(moe_comm, routing, num_topk):
    comm = moe_comm
    n_exp = 8 * W
    rng = rng_for("layout", routing, num_topk)
    idx = make_routing(routing, rng, 100, n_exp, num_topk)
    per_rank, per_expert, in_rank = comm.get_dispatch_layout(to_dev(comm, idx), n_exp)
    want_rank, want_expert, want_in = ref_layout(idx, n_exp)

    def check():
        for name, got, dt in (("num_tokens_per_rank", per_rank, np.int32),
                              ("num_tokens_per_expert", per_expert, np.int32),
                              ("is_token_in_rank", in_rank, np.bool_)):
            assert isinstance(got, comm.xp.ndarray), f"{name} must be a {comm.xp.__name__} array"
            assert to_np(got).dtype == dt, f"{name} dtype {got.dtype} != {np.dtype(dt)}"
        assert_bitwise("num_tokens_per_rank", per_rank, want_rank.astype(np.int32))
        assert_bitwise("num_tokens_per_expert", per_expert, want_expert.astype(np.int32))
        assert_bitwise("is_token_in_rank", in_rank, want_in)

    all_ranks(check)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_dispatch_combine(moe_comm, case):
    comm = moe_comm
    if case.cuda_only and comm.backend != "cuda":
        pytest.skip("GPU-sized case")
    run_case(comm, case)


def test_repeated_runs_bitwise(moe_comm):
    """Many back-to-back dispatch/combine pairs on alternating data sets, each bitwise equal to the reference:
    nothing stale survives in the rings (the tail must never overtake the payload)."""
    comm = moe_comm
    cases = [Case("repeat_a", routing="zipf", num_tokens=128, hidden=7, num_experts=64, num_topk=8, dtype="bf16"),
             Case("repeat_b", routing="masked", num_tokens=96, hidden=200, num_experts=16, dtype="fp32")]
    reps = 12 if comm.backend == "host" else 40
    for i in range(reps):
        run_case(comm, cases[i % 2], key=(i % 4,))


def test_cached_dispatch(moe_comm, monkeypatch):
    """dispatch(x, handle=h) with the same routing: no count exchange, same rows, topk outputs None."""
    comm = moe_comm
    case = Case("cached", routing="masked", num_tokens=80, hidden=256, num_experts=16, num_topk=4, dtype="bf16",
                align=4)
    got = []
    handle = run_case(comm, case, handle_out=got)
    _, _, idx = got[0]
    rng = rng_for("cached-2", comm.backend)
    x2 = make_values(rng, (idx.shape[0], 256), "fp16")          # another dtype is fine with a cached layout
    x8 = make_values(rng, (idx.shape[0], 256), "fp8")
    s8 = rng.uniform(0.5, 2, size=(idx.shape[0], 2)).astype(np.float32)

    calls = {"notify": 0, "recv_counts_none": 0}
    real_notify, real_a2a = comm._engine.notify, comm.alltoallv

    def notify(*a, **k):
        calls["notify"] += 1
        return real_notify(*a, **k)

    def a2a(sendbuf, send_counts, *, recv_counts=None):
        calls["recv_counts_none"] += recv_counts is None
        return real_a2a(sendbuf, send_counts, recv_counts=recv_counts)

    monkeypatch.setattr(comm._engine, "notify", notify)
    monkeypatch.setattr(comm, "alltoallv", a2a)
    out2 = comm.dispatch(to_dev(comm, x2), handle=handle, expert_alignment=8)
    out8 = comm.dispatch((to_dev(comm, x8), xp_fortran(comm, s8)), handle=handle)
    monkeypatch.undo()

    all_x2, all_x8, all_s8 = WORLD.allgather(x2), WORLD.allgather(x8), WORLD.allgather(s8)
    all_idx = WORLD.allgather(idx)
    mine = ref_routes(all_idx, 16)[RANK]

    def check():
        assert calls["notify"] == 0, "a cached dispatch must skip the count exchange"
        assert calls["recv_counts_none"] == 0, "a cached dispatch must pass the cached recv_counts"
        recv_x, r_idx, r_w, per_expert, h2 = out2
        assert r_idx is None and r_w is None
        assert h2 is handle
        assert per_expert == handle.num_recv_tokens_per_expert(8)
        assert all(c % 8 == 0 for c in per_expert)
        want = np.stack([all_x2[s][t] for s, t in mine]) if mine else np.empty((0, 256), np.float16)
        assert_bitwise("cached recv_x", recv_x, want)
        (r8, rs8), r_idx8, r_w8, _, _ = out8
        assert r_idx8 is None and r_w8 is None
        want8 = np.stack([all_x8[s][t] for s, t in mine]) if mine else np.empty((0, 256), FP8)
        wants = np.stack([all_s8[s][t] for s, t in mine]) if mine else np.empty((0, 2), np.float32)
        assert_bitwise("cached recv_x fp8", r8, want8)
        assert_bitwise("cached recv_scales", rs8, wants)

    all_ranks(check)


def xp_fortran(comm, a):
    return comm.xp.asfortranarray(to_dev(comm, a))


def ranks_reached(idx: np.ndarray, num_experts: int) -> np.ndarray:
    """float32 ``[num_tokens]``: how many distinct ranks each token's valid top-k experts live on (NumPy reference
    for combining a dispatched token: with contiguous placement it comes back once from each of those ranks)."""
    per_rank = num_experts // W
    return np.array([len({int(e) // per_rank for e in row if e >= 0}) for row in idx], dtype=np.float32)


def dispatch_integers(comm, seed: str, kind: str, tokens: int, hidden: int, topk: int, high: int):
    """Dispatch fp32 tokens holding small integers (sums stay exact) over ``4 * W`` experts with routing ``kind``.
    Returns ``(idx, x, recv_x, handle, reached)``; ``reached`` is :func:`ranks_reached` of the routing."""
    rng = rng_for(seed, comm.backend)
    n_exp = 4 * W
    idx = make_routing(kind, rng, tokens, n_exp, topk)
    x = rng.integers(1, high, size=(tokens, hidden)).astype(np.float32)
    recv_x, _, _, _, h = comm.dispatch(to_dev(comm, x), to_dev(comm, idx), None, n_exp)
    return idx, x, recv_x, h, ranks_reached(idx, n_exp)


def test_moe_roundtrip_identity(moe_comm):
    """combine(recv_x) with fp32 tokens = x times the number of ranks each token reached (small integers: exact)."""
    comm = moe_comm
    idx, x, recv_x, h, reached = dispatch_integers(comm, "identity", "masked", 64, 32, 4, 100)
    combined, cw = comm.combine(recv_x, h)

    def check():
        assert cw is None
        np.testing.assert_array_equal(to_np(combined), x * reached[:, None])
        np.testing.assert_array_equal(to_np(h.is_token_in_rank).sum(axis=1), reached)

    all_ranks(check)


def test_combine_row_strided_x_on_some_ranks(moe_comm):
    """combine of x whose rows are strided (a column slice of a wider buffer) on even ranks and contiguous on odd
    ranks: every rank must cut the row runs the same way whatever its own strides (a review found the GPU path
    choosing its wire format from local strides). Integers in fp32: exact."""
    comm = moe_comm
    idx, x, recv_x, h, reached = dispatch_integers(comm, "strided-combine", "random", 48, 24, 3, 50)
    wide = comm.xp.zeros((recv_x.shape[0], 40), dtype=np.float32)
    wide[:, :24] = recv_x
    y = wide[:, :24] if RANK % 2 == 0 else recv_x    # even ranks: row stride 160 B, row width 96 B
    combined, _ = comm.combine(y, h)
    all_ranks(lambda: np.testing.assert_array_equal(to_np(combined), x * reached[:, None]))


def test_combine_out_overlapping_weights_rejected(moe_comm):
    """combine(out=) whose memory overlaps topk_weights on rank 0 (the reduction reads the weights while it writes
    out): rank 0 raises ValueError naming the overlap, the others SymBufferRejectedError naming rank 0 (GPU: from the
    call or from synchronize()); then a combine with separate arrays equals the NumPy reference (integers in fp32:
    exact)."""
    from cupy_symbuf import SymBufferRejectedError
    comm = moe_comm
    idx, x, recv_x, h, reached = dispatch_integers(comm, "out-over-weights", "random", 16, 8, 2, 50)
    n_recv, k = h.num_recv_tokens, idx.shape[1]
    xp = comm.xp
    buf = xp.zeros(max(16 * 8, n_recv * k) + 8, np.float32)
    out = buf[:16 * 8].reshape(16, 8)
    w = buf[:n_recv * k].reshape(n_recv, k) if RANK == 0 else xp.zeros((n_recv, k), np.float32)
    if RANK == 0:
        with pytest.raises(ValueError, match="'out' overlaps an input"):
            comm.combine(recv_x, h, w, out=out)
    elif W > 1:
        with pytest.raises(SymBufferRejectedError, match="rank 0"):  # GPU: the queued call reports it from synchronize
            comm.combine(recv_x, h, w, out=out)
            comm.synchronize()
    if RANK == 0 or W > 1:
        w = xp.ones((n_recv, k), np.float32)
        combined, cw = comm.combine(recv_x, h, w, out=xp.full((16, 8), np.nan, np.float32))
        all_ranks(lambda: np.testing.assert_array_equal(to_np(combined), x * reached[:, None]))


@pytest.mark.parametrize("backend", available_backends())
def test_row_larger_than_slot_rejected_on_every_rank(backend):
    """Ring slots hold whole packed rows: a dispatch row larger than Config.chunk_bytes raises ValueError on every
    rank alike (also a rank with no tokens), and the communicator keeps working."""
    from cupy_symbuf import Config
    if backend == "cuda":
        import cupy
        cupy.cuda.Device(_gpu_for_rank()).use()
    with Communicator(WORLD, Config(chunk_bytes=1024, num_slots=4, timeout_s=60), backend=backend) as comm:
        rng = rng_for("row-too-big", backend)
        n_exp = 2 * W
        num_tokens = 0 if RANK == W - 1 else 8          # the last rank has nothing to send
        idx = make_routing("random", rng, num_tokens, n_exp, 2)
        big = rng.uniform(-1, 1, size=(num_tokens, 300)).astype(np.float32)   # 1200 B + 16 B of top-k > 1024
        with pytest.raises(ValueError, match=r"dispatch: one row is 1216 bytes .*Config\.chunk_bytes=1024"):
            comm.dispatch(to_dev(comm, big), to_dev(comm, idx), None, n_exp)
        x = rng.integers(1, 50, size=(num_tokens, 40)).astype(np.float32)  # 160 + 16 B rows fit
        recv_x, _, _, _, h = comm.dispatch(to_dev(comm, x), to_dev(comm, idx), None, n_exp)
        combined, _ = comm.combine(recv_x, h)
        reached = ranks_reached(idx, n_exp)
        all_ranks(lambda: np.testing.assert_array_equal(to_np(combined), x * reached[:, None]))


def test_dlpack_inputs(moe_comm):
    """dispatch/combine take DLPack objects (PyTorch tensors) through the one validation helper; results equal the
    array path's."""
    from _util import DLPackOnly
    comm = moe_comm
    rng = rng_for("dlpack", comm.backend)
    n_exp = 4 * W
    idx = make_routing("random", rng, 32, n_exp, 3)
    x = rng.integers(1, 50, size=(32, 16)).astype(np.float32)
    w = rng.uniform(0.1, 1, size=idx.shape).astype(np.float32)
    ref = comm.dispatch(to_dev(comm, x), to_dev(comm, idx), to_dev(comm, w), n_exp)
    got = comm.dispatch(DLPackOnly(to_dev(comm, x)), DLPackOnly(to_dev(comm, idx)), DLPackOnly(to_dev(comm, w)),
                        n_exp)
    comb_ref, _ = comm.combine(ref[0], ref[4])
    comb, _ = comm.combine(DLPackOnly(got[0]), got[4])

    def check():
        for a, b in zip(got[:3], ref[:3]):
            np.testing.assert_array_equal(to_np(a), to_np(b))
        assert got[3] == ref[3]
        np.testing.assert_array_equal(to_np(comb), to_np(comb_ref))

    all_ranks(check)


# ------------------------------------------------------------------------------------------------ bad input

GOOD = Case("after_error", routing="masked", num_tokens=24, hidden=32, num_experts=8, num_topk=3, dtype="bf16")


def _base(comm, hidden=32, dtype="fp32"):
    rng = rng_for("bad-base", comm.backend)
    n_exp = 4 * W
    idx = make_routing("random", rng, 16, n_exp, 2)
    x = make_values(rng, (16, hidden), dtype)
    w = rng.uniform(0.1, 1, size=idx.shape).astype(np.float32)
    return n_exp, idx, x, w


def _wrong_module(comm, a):
    """The same data in the wrong array module for this backend (a list where no other module exists)."""
    if comm.backend == "cuda":
        return to_np(a)
    try:
        import cupy
        if cupy.cuda.is_available():
            return cupy.asarray(a)
    except Exception:
        pass
    return a.tolist()


def _dispatched(comm, dtype="fp32"):
    n_exp, idx, x, w = _base(comm, dtype=dtype)
    d = comm.dispatch(to_dev(comm, x), to_dev(comm, idx), to_dev(comm, w), n_exp)
    return d


def _bad_cases():
    D = lambda comm, x, idx, w, n, **kw: comm.dispatch(x, idx, w, n, **kw)  # noqa: E731

    def disp(mutate):
        def run(comm):
            n_exp, idx, x, w = _base(comm)
            args = dict(x=to_dev(comm, x), idx=to_dev(comm, idx), w=to_dev(comm, w), n=n_exp)
            args.update(mutate(comm, args, n_exp, idx, x, w))
            kw = args.pop("kw", {})
            D(comm, args["x"], args["idx"], args["w"], args["n"], **kw)
        return run

    def set_idx(val, pos):
        def m(comm, args, n_exp, idx, x, w):
            i = idx.copy()
            i[pos] = val if val != "E" else n_exp
            return {"idx": to_dev(comm, i)}
        return m

    def comb(mutate):
        def run(comm):
            recv_x, _, recv_w, _, h = _dispatched(comm)
            args = dict(x=recv_x, h=h, w=recv_w, kw={})
            args.update(mutate(comm, args))
            comm.combine(args["x"], args["h"], args["w"], **args["kw"])
        return run

    def fp8(hidden, scales_cols, scales_dtype=np.float32):
        def run(comm):
            n_exp, idx, _, w = _base(comm)
            rng = rng_for("fp8bad", comm.backend)
            x8 = make_values(rng, (16, hidden), "fp8")
            s = rng.uniform(0.5, 2, size=(16, scales_cols)).astype(scales_dtype)
            comm.dispatch((to_dev(comm, x8), to_dev(comm, s)), to_dev(comm, idx), to_dev(comm, w), n_exp)
        return run

    def cached(**kw):
        def run(comm):
            recv_x, _, _, _, h = _dispatched(comm)
            n_exp, idx, x, w = _base(comm)
            xs = {"rows": x[:-1]}.get(kw.get("x"), x)
            comm.dispatch(to_dev(comm, xs), to_dev(comm, idx) if kw.get("idx") else None,
                          None, kw.get("n"), handle=h)
        return run

    def other_type_handle(comm):
        recv_x, _, _, _, h = _dispatched(comm)
        comm.combine(recv_x, (h.send_counts, h.recv_counts))

    def layout_not_multiple(comm):
        _, idx, _, _ = _base(comm)
        comm.get_dispatch_layout(to_dev(comm, idx), 4 * W + 1)

    def hidden_differs(comm):
        n_exp, idx, _, w = _base(comm)
        x = make_values(rng_for("hd"), (16, 8 + RANK), "fp32")
        comm.dispatch(to_dev(comm, x), to_dev(comm, idx), to_dev(comm, w), n_exp)

    V, T = ValueError, TypeError
    return {
        "expert_index_too_big": (disp(lambda c, a, n, i, x, w: set_idx("E", (3, 1))(c, a, n, i, x, w)), V,
                                 r"dispatch: argument 'topk_idx' .*num_experts"),
        "expert_index_below_minus_one": (disp(lambda *a: set_idx(-2, (5, 0))(*a)), V, r"dispatch: argument 'topk_idx'"),
        "num_experts_zero": (disp(lambda *a: {"n": 0}), V, r"dispatch: argument 'num_experts'"),
        "num_experts_not_multiple": (disp(lambda c, a, n, *r: {"n": n + 1}), V,
                                     r"dispatch: argument 'num_experts' must be a multiple of world_size"),
        "layout_num_experts_not_multiple": (layout_not_multiple, V, r"get_dispatch_layout: argument 'num_experts'"),
        "num_experts_missing": (disp(lambda *a: {"n": None}), V, r"dispatch: argument 'num_experts'"),
        "topk_idx_missing": (disp(lambda *a: {"idx": None}), V, r"dispatch: argument 'topk_idx'"),
        "topk_idx_rows_vs_x": (disp(lambda c, a, n, i, x, w: {"idx": to_dev(c, i[:-1]), "w": to_dev(c, w[:-1])}),
                               V, r"dispatch: argument 'topk_idx' .*num_tokens"),
        "topk_idx_1d": (disp(lambda c, a, n, i, x, w: {"idx": to_dev(c, i[:, 0].copy())}), V,
                        r"dispatch: argument 'topk_idx'"),
        "topk_idx_float": (disp(lambda c, a, n, i, x, w: {"idx": to_dev(c, i.astype(np.float32))}), T,
                           r"dispatch: argument 'topk_idx' must be int64"),
        "topk_weights_cols": (disp(lambda c, a, n, i, x, w: {"w": to_dev(c, np.ones((16, 3), np.float32))}), V,
                              r"dispatch: argument 'topk_weights' .*num_topk"),
        "topk_weights_rows": (disp(lambda c, a, n, i, x, w: {"w": to_dev(c, np.ones((17, 2), np.float32))}), V,
                              r"dispatch: argument 'topk_weights' .*num_tokens"),
        "topk_weights_float64": (disp(lambda c, a, n, i, x, w: {"w": to_dev(c, w.astype(np.float64))}), T,
                                 r"dispatch: argument 'topk_weights' must be float32"),
        "x_float64": (disp(lambda c, a, n, i, x, w: {"x": to_dev(c, x.astype(np.float64))}), T,
                      r"dispatch: argument 'x' must"),
        "x_3d": (disp(lambda c, a, n, i, x, w: {"x": to_dev(c, x.reshape(16, 4, 8))}), V,
                 r"dispatch: argument 'x' must be 2-D"),
        "x_wrong_module": (disp(lambda c, a, n, i, x, w: {"x": _wrong_module(c, a["x"])}), T,
                           r"dispatch: argument 'x' (must be a (NumPy|CuPy) array|is a CuPy array)"),
        "topk_idx_wrong_module": (disp(lambda c, a, n, i, x, w: {"idx": _wrong_module(c, a["idx"])}), T,
                                  r"dispatch: argument 'topk_idx' (must be a (NumPy|CuPy) array|is a CuPy array)"),
        "expert_alignment_zero": (disp(lambda *a: {"kw": {"expert_alignment": 0}}), V,
                                  r"dispatch: argument 'expert_alignment' must be in \[1, 1073741824\]"),
        # a new-user attack: 2**70 passed the check and failed with a bare OverflowError after the rows moved
        "expert_alignment_huge": (disp(lambda *a: {"kw": {"expert_alignment": 2 ** 70}}), V,
                                  r"dispatch: argument 'expert_alignment' must be in \[1, 1073741824\]"),
        "fp8_hidden_not_multiple_of_128": (fp8(96, 0), V, r"divisible by 128"),
        "fp8_scales_shape": (fp8(256, 3), V, r"dispatch: argument 'x\[1\]' must have shape"),
        "fp8_scales_dtype": (fp8(256, 2, np.float16), T, r"dispatch: argument 'x\[1\]' \(scales\) must be float32"),
        "cached_with_topk_idx": (cached(idx=True), V,
                                 r"dispatch: arguments 'topk_idx' and 'topk_weights' must be None with handle"),
        "cached_other_num_experts": (cached(n=1000 * W), V, r"dispatch: argument 'num_experts'"),
        "cached_rows": (cached(x="rows"), V, r"dispatch: argument 'x' must have shape"),
        "combine_not_a_handle": (other_type_handle, T, r"combine: argument 'handle' must be a DispatchHandle"),
        "combine_hidden": (comb(lambda c, a: {"x": c.xp.concatenate([a["x"], a["x"][:, :1]], axis=1)}), V,
                           r"combine: argument 'x' .*hidden"),
        "combine_rows": (comb(lambda c, a: {"x": c.xp.ones((a["x"].shape[0] + 1, a["x"].shape[1]), a["x"].dtype)}), V,
                         r"combine: argument 'x' .*num_recv_tokens"),
        "combine_weights_shape": (comb(lambda c, a: {"w": a["w"][:, :1]}), V, r"combine: argument 'topk_weights'"),
        "combine_uint16_without_dtype": (comb(lambda c, a: {"x": c.xp.zeros(a["x"].shape, np.uint16)}), T,
                                         r"combine: argument 'x' must be .*dtype='bfloat16'"),
        "combine_dtype_mismatch": (comb(lambda c, a: {"kw": {"dtype": np.float16}}), T, r"combine: argument 'dtype'"),
        "combine_x_wrong_module": (comb(lambda c, a: {"x": _wrong_module(c, a["x"])}), T,
                                   r"combine: argument 'x' (must be a (NumPy|CuPy) array|is a CuPy array)"),
        "hidden_differs_across_ranks": (hidden_differs, V, r"dispatch: ranks disagree on the dispatched row size"),
    }


BAD = _bad_cases()


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_input_then_usable(moe_comm, name):
    """Bad input on every rank: a clear error naming the operation and argument, then a correct call succeeds."""
    comm = moe_comm
    call, exc, pattern = BAD[name]
    if name in ("num_experts_not_multiple", "layout_num_experts_not_multiple", "hidden_differs_across_ranks") \
            and W == 1:
        pytest.skip("needs world_size > 1")

    def check():
        with pytest.raises(exc, match=pattern):
            call(comm)

    all_ranks(check)
    run_case(comm, GOOD, key=(name,))


def test_handle_from_other_communicator(moe_comm):
    comm = moe_comm
    other = Communicator(WORLD, backend=comm.backend)
    try:
        n_exp, idx, x, w = _base(comm)
        _, _, _, _, h_other = other.dispatch(to_dev(comm, x), to_dev(comm, idx), to_dev(comm, w), n_exp)
        recv_x, _, _, _, h = comm.dispatch(to_dev(comm, x), to_dev(comm, idx), to_dev(comm, w), n_exp)

        def check():
            with pytest.raises(ValueError, match=r"combine: argument 'handle' must come from this communicator"):
                comm.combine(recv_x, h_other)
            with pytest.raises(ValueError, match=r"dispatch: argument 'handle' must come from this communicator"):
                comm.dispatch(to_dev(comm, x), handle=h_other)
            assert h.belongs_to(comm) and not h.belongs_to(other)

        all_ranks(check)
    finally:
        other.close()
    run_case(comm, GOOD, key=("other-comm",))


def test_handle_is_immutable(moe_comm):
    comm = moe_comm
    recv_x, _, _, _, h = _dispatched(comm)

    def check():
        with pytest.raises(Exception):
            h.num_tokens = 3
        with pytest.raises(ValueError):
            h.send_counts[0] = 7

    all_ranks(check)
