"""Low-latency MoE dispatch / combine (DeepEP low_latency_dispatch / low_latency_combine) against
an independent NumPy reference, on every backend here, under ``mpiexec -n 1/2/4``.

Every rank generates every rank's inputs from seeds (so each computes locally what it must receive), outputs are
poisoned before each call and compared bitwise (recv_x rows below recv_count, recv_count, src_info, layout_range,
combined_x with the documented arithmetic), and against float64 within the documented bounds. Checks are
collective (:func:`all_ranks`).
"""
from __future__ import annotations

import re
import zlib

import numpy as np
import pytest

from _util import RankChecks, all_ranks  # noqa: E402  (tests/ is on sys.path under pytest)

MPI = pytest.importorskip("mpi4py.MPI")
ml_dtypes = pytest.importorskip("ml_dtypes")

from conftest import _gpu_for_rank, available_backends  # noqa: E402
from cupy_symbuf import (Communicator, Config, LowLatencyBuffer, SymBufferAbortedError,  # noqa: E402
                         SymBufferError, SymBufferMismatchError, SymBufferRejectedError, SymBufferTimeoutError, quant)
from cupy_symbuf.common import dtypes as dt  # noqa: E402
from cupy_symbuf.bench.low_latency import bench_low_latency  # noqa: E402
from cupy_symbuf.moe.low_latency import LL_COMBINE_FIELDS, LL_DISPATCH_FIELDS  # noqa: E402

WORLD = MPI.COMM_WORLD
RANK = WORLD.Get_rank()
W = WORLD.Get_size()
BF16 = np.dtype(ml_dtypes.bfloat16)


@pytest.fixture(scope="module", params=available_backends())
def comm(request):
    if request.param == "cuda":
        import cupy
        cupy.cuda.Device(_gpu_for_rank()).use()
    c = Communicator(WORLD, backend=request.param)
    yield c
    c.close()


def dev(c, a):
    if c.backend == "host":
        return a
    import cupy
    return cupy.asarray(a)


def host(a):
    return a.get() if hasattr(a, "get") else np.asarray(a)


KIND_BITS = {"bfloat16": np.uint16, "float16": np.float16, "float32": np.float32}


def to_f32(bits, kind):
    return dt.to_float32(np, bits, kind)


def from_f32(f, kind):
    return dt.from_float32(np, np.asarray(f, np.float32), kind, KIND_BITS[kind])


def inputs(case, it, r, N, H, E, K, kind):
    """Rank r's (x bits, topk_idx, topk_weights) for this case and iteration."""
    rng = np.random.default_rng([zlib.crc32(f"{case}/{it}".encode()), r])
    n = {"one_token": 1, "full": N, "uneven": (0 if r == W - 1 else int(rng.integers(1, N + 1)))}.get(case, N // 2 + r)
    n = min(n, N)
    idx = np.argsort(rng.random((n, E)), axis=1)[:, :K].astype(np.int64)
    if case == "one_expert":
        idx[:] = -1
        idx[:, 0] = 3 % E
    if case in ("minus_one", "uneven"):
        idx[rng.random((n, K)) < 0.3] = -1
    xf = (rng.standard_normal((n, H)) * rng.choice([1e-3, 1.0, 50.0], size=(n, 1))).astype(np.float32)
    return from_f32(xf, kind), idx, rng.random((n, K)).astype(np.float32)


def expert_outputs(it, r, L, WN, H, kind):
    rng = np.random.default_rng([zlib.crc32(f"y/{it}".encode()), r])
    return from_f32(rng.standard_normal((L, WN, H)).astype(np.float32), kind)


def reference_rows(all_idx, me, L):
    """rows[el] = [(s, t), ...] in (source, token) order: the documented recv_x row order."""
    rows = [[] for _ in range(L)]
    for el in range(L):
        e = me * L + el
        for s, idx in enumerate(all_idx):
            for t in range(idx.shape[0]):
                if e in idx[t]:
                    rows[el].append((s, t))
    return rows


def poison(ll):
    for s in ll._sets:
        for k, a in s.items():
            a[...] = 0x5A if a.dtype == np.uint8 else (np.nan if a.dtype.kind == "f" else -7)
    for o in ll._combine_out:
        o[...] = 0x5A


def still_poisoned(c, arrays) -> bool:
    """Every element of ``arrays`` still holds :func:`poison`'s value (after the current stream's work): bytes
    0x5A (uint8 arrays: pass x-typed outputs as their bytes), NaN (floats), -7 (integers)."""
    if c.backend == "cuda":
        import cupy
        cupy.cuda.get_current_stream().synchronize()
    for a in arrays:
        a = host(a)
        if a.dtype == np.uint8:
            ok = (a == 0x5A).all()
        elif a.dtype.kind == "f":
            ok = np.isnan(a).all()
        else:
            ok = (a == -7).all()
        if not ok:
            return False
    return True


def run_case(c, ll, case, it, kind="bfloat16", use_fp8=False, ue8m0=False, K=4, recv_hook=False):
    """One dispatch + combine of ``case`` checked against the NumPy reference (collective). ``recv_hook``: both
    calls split (``return_recv_hook=True``): their outputs are checked to be untouched by the send phase (still
    poisoned), then the hooks run the receives. Returns host copies ``(recv_count, combined_x)``."""
    N, H, E, L = ll.N, ll.H, ll.num_experts, ll.L
    data = [inputs(case, it, r, N, H, E, K, kind) for r in range(W)]
    xb, idx, w = data[RANK]
    if use_fp8:
        for s in ll._sets:  # the fp8 outputs (made on the first fp8 call) exist before they are poisoned
            ll._fp8_set(s)
    poison(ll)
    xin = xb.view(BF16) if (kind == "bfloat16" and c.backend == "host" and it % 2) else xb
    y = expert_outputs(it, RANK, L, W * N, H, kind)
    rows = reference_rows([d[1] for d in data], RANK, L)
    if recv_hook:
        recv, cnt, h, hook = ll.dispatch(dev(c, xin), dev(c, idx), use_fp8=use_fp8, round_scale=ue8m0,
                                         return_recv_hook=True)
        sent_only = still_poisoned(c, [cnt, h.src_info, h.layout_range] +
                                   ([recv[0].view(np.uint8), recv[1]] if use_fp8 else [recv.view(np.uint8)]))
        hook()
        assert hook.done
        out, hook = ll.combine(dev(c, y), dev(c, idx), dev(c, w), h, return_recv_hook=True)
        sent_only = still_poisoned(c, [out.view(np.uint8)]) and sent_only
        hook()
        all_ranks(lambda: None if sent_only else pytest.fail("a send phase wrote the call's outputs"))
    else:
        recv, cnt, h = ll.dispatch(dev(c, xin), dev(c, idx), use_fp8=use_fp8, round_scale=ue8m0)
        out = ll.combine(dev(c, y), dev(c, idx), dev(c, w), h)
    if c.backend == "cuda":
        ll.synchronize()

    def check():
        assert host(cnt).tolist() == [len(r) for r in rows], "recv_count"
        src = host(h.src_info)
        lr = host(h.layout_range)
        for el in range(L):
            begin = 0
            for s in range(W):
                cnt_s = sum(1 for (ss, _) in rows[el] if ss == s)
                assert int(lr[el, s]) == (begin << 32) | cnt_s, f"layout_range[{el}, {s}]"
                begin += cnt_s
            assert src[el, :len(rows[el])].tolist() == [t for (_, t) in rows[el]], f"src_info[{el}]"
        if use_fp8:
            q, sc = (host(a) for a in recv)
            q = q.view(np.uint8)
            for el in range(L):
                for p, (s, t) in enumerate(rows[el]):
                    rq, rs = quant.quantize_fp8(to_f32(data[s][0][t:t + 1], kind), ue8m0)
                    assert np.array_equal(q[el, p], rq[0]), f"fp8 bytes of expert {el} row {p}"
                    assert np.array_equal(sc[el, p].view(np.uint32), rs[0].view(np.uint32)), "fp8 scales"
                    xf = to_f32(data[s][0][t], kind)
                    err = np.abs(quant.dequantize_fp8(q[el, p], sc[el, p]).astype(np.float64) - xf)
                    assert (err <= quant.error_bound(xf, sc[el, p])).all(), "fp8 error bound"
                    if ue8m0:
                        m, _ = np.frexp(sc[el, p])
                        assert (m == 0.5).all(), "ue8m0 scales are powers of two"
        else:
            rx = host(recv).view(KIND_BITS[kind])
            for el in range(L):
                for p, (s, t) in enumerate(rows[el]):
                    assert np.array_equal(rx[el, p].view(np.uint8), data[s][0][t].view(np.uint8)), \
                        f"recv_x[{el}][{p}] != x of rank {s} token {t}"
        # combine: every rank d's outputs y_d, partial per rank rounded once, summed in rank order
        ys = [expert_outputs(it, d, L, W * N, H, kind) for d in range(W)]
        all_rows = [reference_rows([dd[1] for dd in data], d, L) for d in range(W)]
        n = idx.shape[0]
        ref = np.zeros((n, H), np.float32)
        exact = np.zeros((n, H), np.float64)
        for t in range(n):
            for d in range(W):
                acc = np.zeros(H, np.float32)
                hit = False
                for j in range(K):
                    e = int(idx[t, j])
                    if e < 0 or e // L != d:
                        continue
                    p = all_rows[d][e - d * L].index((RANK, t))
                    yf = to_f32(ys[d][e - d * L, p], kind)
                    acc = acc + np.float32(w[t, j]) * yf
                    exact[t] += np.float64(w[t, j]) * yf
                    hit = True
                if hit:
                    ref[t] = ref[t] + to_f32(from_f32(acc, kind), kind)
        got = host(out).view(KIND_BITS[kind])
        assert got.shape == (n, H)
        assert np.array_equal(got.view(np.uint8), from_f32(ref, kind).view(np.uint8)), "combined_x (bitwise)"
        tol = {"bfloat16": 2 ** -7, "float16": 2 ** -9, "float32": 1e-5}[kind]
        mag = np.abs(exact).max() if exact.size else 0
        assert np.allclose(to_f32(got, kind), exact, rtol=tol, atol=tol * (mag + 1e-30)), "weights applied"
    all_rows_ok = all_ranks
    all_rows_ok(check)
    return host(cnt).copy(), host(out).copy()


CASES = ["one_token", "full", "one_expert", "minus_one", "uneven"]


@pytest.fixture(scope="module")
def ll(comm):
    b = LowLatencyBuffer(comm, 32, 256, 4 * W, max_topk=8)
    yield b
    b.close()


@pytest.mark.parametrize("case", CASES)
def test_dispatch_combine(comm, ll, case):
    run_case(comm, ll, case, 0)


def test_128_tokens_top8(comm):
    with LowLatencyBuffer(comm, 128, 1024, 8 * W, max_topk=8) as b:
        run_case(comm, b, "full", 1, K=8)
        run_case(comm, b, "full", 2, K=8, use_fp8=True)


@pytest.mark.parametrize("ue8m0", [False, True], ids=["scale", "ue8m0"])
def test_fp8(comm, ll, ue8m0):
    for case in ("full", "uneven"):
        run_case(comm, ll, case, 3, use_fp8=True, ue8m0=ue8m0)


def test_repeated_calls_double_buffer(comm, ll):
    for it in range(6):
        run_case(comm, ll, CASES[it % len(CASES)], 10 + it, use_fp8=bool(it % 3 == 2))


def test_handle_survives_one_more_dispatch(comm, ll):
    N, H, E, L = ll.N, ll.H, ll.num_experts, ll.L
    xa, ia, wa = inputs("full", 40, RANK, N, H, E, 4, "bfloat16")
    xb, ib, _ = inputs("minus_one", 41, RANK, N, H, E, 4, "bfloat16")
    ra, _, ha = ll.dispatch(dev(comm, xa), dev(comm, ia))
    ll.dispatch(dev(comm, xb), dev(comm, ib))
    y = expert_outputs(40, RANK, L, W * N, H, "bfloat16")
    out1 = host(ll.combine(dev(comm, y), dev(comm, ia), dev(comm, wa), ha)).copy()
    ra, _, ha = ll.dispatch(dev(comm, xa), dev(comm, ia))
    out2 = host(ll.combine(dev(comm, y), dev(comm, ia), dev(comm, wa), ha))
    all_ranks(lambda: np.testing.assert_array_equal(out1.view(np.uint16), out2.view(np.uint16)))
    ll.dispatch(dev(comm, xb), dev(comm, ib))
    ll.dispatch(dev(comm, xb), dev(comm, ib))
    with pytest.raises(ValueError, match=rf"handle is stale: it is from dispatch #{ha.dispatch_id} "
                                         rf"\(LowLatencyHandle.dispatch_id\), and 2 more dispatches have been made "
                                         rf"since"):
        ll.combine(dev(comm, y), dev(comm, ia), dev(comm, wa), ha)


@pytest.mark.parametrize("kind", ["float16", "float32"])
def test_other_dtypes(comm, kind):
    with LowLatencyBuffer(comm, 16, 512, 2 * W, dtype=kind, max_topk=2) as b:
        run_case(comm, b, "minus_one", 50, kind=kind, K=2)
        run_case(comm, b, "full", 51, kind=kind, K=2, use_fp8=True)


def test_validation(comm, ll):
    N, H, E = ll.N, ll.H, ll.num_experts
    x, i, w = inputs("full", 60, RANK, N, H, E, 4, "bfloat16")
    X, I, Wt = dev(comm, x), dev(comm, i), dev(comm, w)
    with pytest.raises(ValueError, match="x must have shape"):
        ll.dispatch(X[:, :8], I)
    with pytest.raises(TypeError, match="dtype"):
        ll.dispatch(dev(comm, x.astype(np.float32)), I)
    with pytest.raises(ValueError, match="num_tokens"):
        ll.dispatch(X, I[:1])
    with pytest.raises(ValueError, match="max_topk"):
        ll.dispatch(X, dev(comm, np.zeros((x.shape[0], 9), np.int64)))
    big = np.zeros((N + 1, H), np.uint16)
    with pytest.raises(ValueError, match="num_max_dispatch_tokens_per_rank"):
        ll.dispatch(dev(comm, big), dev(comm, np.zeros((N + 1, 4), np.int64)))
    with pytest.raises(ValueError, match="use_fp8"):
        ll.dispatch(X, I, use_ue8m0=True)
    if comm.backend == "host":
        bad = i.copy()
        bad[0, 0] = E
        with pytest.raises(ValueError, match="topk_idx entries"):
            ll.dispatch(X, bad)
    with pytest.raises(ValueError, match="num_experts"):
        LowLatencyBuffer(comm, 8, 256, 4 * W + 1) if W > 1 else (_ for _ in ()).throw(ValueError("num_experts"))
    with pytest.raises(ValueError, match="multiple of 16"):
        LowLatencyBuffer(comm, 8, 3, 4 * W)
    with pytest.raises(TypeError, match="dtype"):
        LowLatencyBuffer(comm, 8, 256, 4 * W, dtype="int8")
    recv, _, h = ll.dispatch(X, I)
    with pytest.raises(ValueError, match="topk_weights"):
        ll.combine(recv, I, Wt[:, :2], h)
    with pytest.raises(TypeError, match="float32"):
        ll.combine(recv, I, dev(comm, w.astype(np.float64)), h)
    with pytest.raises(ValueError, match="x must have shape"):
        ll.combine(recv[:1], I, Wt, h)
    with pytest.raises(TypeError, match="LowLatencyHandle"):
        ll.combine(recv, I, Wt, object())
    ll.combine(recv, I, Wt, h)  # still usable
    if comm.backend == "cuda":
        ll.synchronize()


def test_wrong_dtype_says_how_to_pass_dtype(comm, ll):
    """Rows of another dtype than the buffer's (float32 into a bfloat16 buffer, DeepEP's default): the TypeError
    names both dtypes and how to make a buffer of the rows' dtype (``dtype=``), for dispatch's x and combine's."""
    N, H, E = ll.N, ll.H, ll.num_experts
    x, i, w = inputs("full", 61, RANK, N, H, E, 4, "bfloat16")
    X, I, Wt = dev(comm, x), dev(comm, i), dev(comm, w)
    with pytest.raises(TypeError) as ei:
        ll.dispatch(dev(comm, x.astype(np.float32)), I)
    msg = str(ei.value)
    assert "LowLatencyBuffer(..., dtype='float32')" in msg and "pass bfloat16 rows" in msg, msg
    assert "x must have this buffer's dtype (bfloat16" in msg and "got float32" in msg, msg
    with pytest.raises(TypeError, match=r"dtype=\.\.\..*bfloat16, float16 or float32") as ei:
        ll.dispatch(dev(comm, x.astype(np.int32)), I)
    recv, _, h = ll.dispatch(X, I)
    with pytest.raises(TypeError, match=r"low_latency_combine: x .*dtype='float32'"):
        ll.combine(recv.astype(np.float32), I, Wt, h)
    ll.combine(recv, I, Wt, h)  # still usable
    if comm.backend == "cuda":
        ll.synchronize()


def test_parameters_agree_across_ranks(comm):
    if W == 1:
        pytest.skip("needs 2 ranks")
    with pytest.raises(ValueError, match="hidden"):
        LowLatencyBuffer(comm, 8, 256 if RANK else 512, 4 * W)


@pytest.fixture
def fresh_pair(comm):
    """``make(timeout_s)``: a Communicator of its own (``comm``'s backend, ``abort_on_failure=False``) and a
    LowLatencyBuffer ``(8 tokens, hidden 256, 4 experts per rank)`` on it, for a test that leaves them unusable;
    after the test a barrier, then both closed."""
    made = []

    def make(timeout_s: float):
        c = Communicator(WORLD, Config(timeout_s=timeout_s, abort_on_failure=False), backend=comm.backend)
        made.append(c)
        b = LowLatencyBuffer(c, 8, 256, 4 * W)
        made.insert(0, b)
        return c, b
    yield make
    WORLD.Barrier()
    for obj in made:
        obj.close()


def test_signature_mismatch_raises_everywhere(fresh_pair):
    if W == 1:
        pytest.skip("needs 2 ranks")
    c, b = fresh_pair(5.0)
    x, i, _ = inputs("full", 70, RANK, 8, 256, 4 * W, 4, "bfloat16")
    with pytest.raises((SymBufferMismatchError, SymBufferAbortedError)):
        b.dispatch(dev(c, x), dev(c, i), use_fp8=(RANK == 0))
        if c.backend == "cuda":
            b.synchronize()
    with pytest.raises(Exception, match="unusable"):
        b.dispatch(dev(c, x), dev(c, i))


def test_peer_that_never_calls_times_out(fresh_pair):
    if W == 1:
        pytest.skip("needs 2 ranks")
    c, b = fresh_pair(1.0)
    x, i, _ = inputs("full", 80, RANK, 8, 256, 4 * W, 4, "bfloat16")
    if RANK == 0:
        with pytest.raises(SymBufferTimeoutError) as ei:
            b.dispatch(dev(c, x), dev(c, i))
            if c.backend == "cuda":
                b.synchronize()
        msg = str(ei.value)
        assert ei.value.rank == 0 and ei.value.peer >= 1 and "low_latency_dispatch" in msg
        # the hint fits the call (not the ring collectives' alltoallv recv_counts)
        assert "waiting for the peer's flag line of this call" in msg and "alltoallv" not in msg, msg
        assert "is not making the same calls of this LowLatencyBuffer" in msg, msg


# ---- the shared call protocol: rejections and aborts --------------------------------------------------------------

def _close_all(b, c):
    WORLD.Barrier()
    for obj in (b, c):
        try:
            obj.close()
        except SymBufferError:
            pass


def _assert_in_step(ll) -> None:
    """Every rank is at the same place in the call sequence (``LowLatencyBuffer._call_state``: the host's call
    counters and the calls the flag-line protocol completed), rejected calls included. Collective; every rank sees
    the same gathered states, so all fail alike."""
    states = WORLD.allgather(ll._call_state())
    assert all(st == states[0] for st in states), \
        f"ranks out of step (dispatch calls, combine calls, dispatch launches, combine launches): {states}"


def _reject_dispatch(c, ll, bad: int, it: int, how: str = "too_many") -> None:
    """Rank ``bad`` rejects a dispatch (``how``: one token more than N, a KeyboardInterrupt during its checks, or a
    keyword Python cannot bind, ``use_fp9=``);
    it raises its own error, every other rank SymBufferRejectedError naming it (GPU: from synchronize, the
    call's counts then zero). Collective: each rank's checks are gathered at the end (a check failing on one rank
    fails every rank there, so none is left waiting in the caller's next collective step)."""
    N, H, E = ll.N, ll.H, ll.num_experts
    x, i, _ = inputs("full", it, RANK, N, H, E, 4, "bfloat16")
    checks = RankChecks()
    if RANK == bad:
        with checks.local(f"rank {bad}'s own rejection"):
            if how == "too_many":
                x, i = np.zeros((N + 1, H), np.uint16), np.zeros((N + 1, 4), np.int64)
                with pytest.raises(ValueError, match="num_max_dispatch_tokens_per_rank") as ei:
                    ll.dispatch(dev(c, x), dev(c, i))
                assert not isinstance(ei.value, SymBufferRejectedError), repr(ei.value)
            elif how == "typo":
                with pytest.raises(TypeError, match="use_fp9.*the peers were told"):
                    ll.dispatch(dev(c, x), dev(c, i), use_fp9=True)
            else:
                def interrupted(*a, **k):
                    raise KeyboardInterrupt("simulated Ctrl-C during the argument checks")
                ll._check_topk = interrupted
                try:
                    with pytest.raises(KeyboardInterrupt):  # (one token fewer: a new shape, never the GPU hot path)
                        ll.dispatch(dev(c, x[:-1]), dev(c, i[:-1]))
                finally:
                    del ll._check_topk
    else:
        with checks.local(f"the peers' SymBufferRejectedError naming rank {bad}"):
            with pytest.raises(SymBufferRejectedError, match=f"low_latency_dispatch.*rank {bad} rejected") as ei:
                ll.dispatch(dev(c, x), dev(c, i))
                if c.backend == "cuda":
                    ll.synchronize()
            assert ei.value.rejecting_rank == bad and ei.value.rank == RANK, repr(ei.value)
            if c.backend == "cuda":  # the call took an output set (returned, or raised with Config(blocking=True))
                cnt = ll._sets[(ll._dispatch_calls - 1) & 1]["recv_count"]
                assert not host(cnt).any(), "a rejected dispatch leaves zero counts"
    checks.gather()


def _reject_combine(c, ll, bad: int, it: int) -> None:
    """After a valid dispatch, rank ``bad`` passes float64 weights to combine (TypeError); the others raise
    SymBufferRejectedError naming it (GPU: from synchronize, the call's rows then zero). Collective, each rank's
    checks gathered at the end (as :func:`_reject_dispatch`)."""
    N, H, E, L = ll.N, ll.H, ll.num_experts, ll.L
    x, i, w = inputs("full", it, RANK, N, H, E, 4, "bfloat16")
    _, _, h = ll.dispatch(dev(c, x), dev(c, i))
    y = dev(c, expert_outputs(it, RANK, L, W * N, H, "bfloat16"))
    checks = RankChecks()
    if RANK == bad:
        with checks.local(f"rank {bad}'s own rejection"):
            with pytest.raises(TypeError, match="float32"):
                ll.combine(y, dev(c, i), dev(c, w.astype(np.float64)), h)
    else:
        with checks.local(f"the peers' SymBufferRejectedError naming rank {bad}"):
            with pytest.raises(SymBufferRejectedError, match=f"low_latency_combine.*rank {bad} rejected") as ei:
                ll.combine(y, dev(c, i), dev(c, w), h)
                if c.backend == "cuda":
                    ll.synchronize()
            assert ei.value.rejecting_rank == bad, repr(ei.value)
            if c.backend == "cuda":
                out = ll._combine_out[(ll._combine_calls - 1) & 1][: x.shape[0]]
                assert not host(out).any(), "a rejected combine leaves zero rows"
    checks.gather()


@pytest.mark.parametrize("blocking", [False, True], ids=["queued", "blocking"])
@pytest.mark.parametrize("how", ["too_many", "interrupt", "typo"])
def test_call_rejected_on_one_rank_is_told_to_the_peers(comm, how, blocking):
    """A dispatch rejected on one rank only (one token too many, or Ctrl-C during its checks): every rank raises
    (the peers SymBufferRejectedError naming it), no rank returns rows of another call, and the next three calls
    are right on every rank (outputs poisoned first, compared with the NumPy reference)."""
    if W == 1:
        pytest.skip("needs 2 ranks")
    if blocking and comm.backend != "cuda":
        pytest.skip("Config(blocking=True) changes only the GPU path")
    c = Communicator(WORLD, Config(timeout_s=10.0, abort_on_failure=False, blocking=blocking), backend=comm.backend)
    b = LowLatencyBuffer(c, 16, 256, 4 * W, max_topk=8)
    try:
        run_case(c, b, "full", 100)
        _reject_dispatch(c, b, W - 1, 101, how)
        _assert_in_step(b)
        for k, case in enumerate(("full", "uneven", "minus_one")):
            run_case(c, b, case, 102 + k)
        _assert_in_step(b)
    finally:
        _close_all(b, c)


@pytest.mark.parametrize("blocking", [False, True], ids=["queued", "blocking"])
def test_rejections_on_each_rank_in_turn(comm, blocking):
    """Every rank in turn rejects a dispatch, then a combine; the valid calls between them stay right, and after
    every rejection all ranks are at the same call (counters and flag-line sequence)."""
    if W == 1:
        pytest.skip("needs 2 ranks")
    if blocking and comm.backend != "cuda":
        pytest.skip("Config(blocking=True) changes only the GPU path")
    c = Communicator(WORLD, Config(timeout_s=10.0, abort_on_failure=False, blocking=blocking), backend=comm.backend)
    b = LowLatencyBuffer(c, 16, 256, 4 * W, max_topk=8)
    try:
        for bad in range(W):
            _reject_dispatch(c, b, bad, 110 + 4 * bad)
            _assert_in_step(b)
            run_case(c, b, "uneven", 111 + 4 * bad)
            _reject_combine(c, b, bad, 112 + 4 * bad)
            _assert_in_step(b)
            run_case(c, b, "full", 113 + 4 * bad, use_fp8=bool(bad % 2))
            _assert_in_step(b)
    finally:
        _close_all(b, c)


@pytest.mark.parametrize("kind,exc_type", [("dispatch", KeyboardInterrupt), ("dispatch", RuntimeError),
                                           ("combine", KeyboardInterrupt)])
def test_exception_inside_a_call_aborts_the_peers(comm, kind, exc_type):
    """An exception (Ctrl-C too) on rank 0 inside a low-latency call, where it starts moving data, 0.3 s after the
    peers entered theirs: they leave with SymBufferAbortedError naming rank 0 within 1 s of it (timeout_s is 30),
    and every rank's buffer and communicator are unusable."""
    if W == 1:
        pytest.skip("needs 2 ranks")
    import time
    c = Communicator(WORLD, Config(timeout_s=30.0, abort_on_failure=False), backend=comm.backend)
    b = LowLatencyBuffer(c, 16, 256, 4 * W, max_topk=8)
    try:
        run_case(c, b, "full", 120)
        N, H, E, L = b.N, b.H, b.num_experts, b.L
        x, i, w = inputs("full", 121, RANK, N, H, E, 4, "bfloat16")
        y = dev(c, expert_outputs(121, RANK, L, W * N, H, "bfloat16"))
        h = b.dispatch(dev(c, x), dev(c, i))[2] if kind == "combine" else None
        if c.backend == "cuda":
            b.synchronize()

        def call():
            if kind == "dispatch":
                b.dispatch(dev(c, x), dev(c, i))
            else:
                b.combine(y, dev(c, i), dev(c, w), h)
            if c.backend == "cuda":
                b.synchronize()

        t_fault = 0.0
        checks = RankChecks()  # what each rank's call raised: gathered once every rank made the allreduce
        WORLD.Barrier()
        if RANK == 0:
            def injected(*a, **k):
                raise exc_type("injected inside a low-latency call")
            if c.backend == "cuda":  # the GPU launches (GpuLaunches) / the host wire (HostWire) of the buffer
                setattr(b._gpu, f"issue_{kind}", injected)
            else:
                setattr(b._host, f"{kind}_send", injected)
            time.sleep(0.3)
            t_fault = time.time()
            with checks.local("rank 0's own exception"):
                with pytest.raises(exc_type):
                    call()
        else:
            with checks.local("the peers' SymBufferAbortedError"):
                with pytest.raises(SymBufferAbortedError) as ei:
                    call()
            t_left = time.time()
        t_fault = WORLD.allreduce(t_fault, op=MPI.MAX)  # made by every rank, whatever it raised
        checks.gather()
        if RANK != 0:
            assert ei.value.aborting_rank == 0 and "rank 0" in str(ei.value), ei.value
            assert t_left - t_fault < 1.0, f"the peer left {t_left - t_fault:.2f} s after the fault"
        with pytest.raises(SymBufferError, match="unusable"):
            b.dispatch(dev(c, x), dev(c, i))
    finally:
        _close_all(b, c)


def test_one_status_path(comm):
    """GPU: the low-latency kernels write the communicator's error record and are numbered by its launch ledger
    (transport/status.py), the ring kernels' own."""
    if comm.backend != "cuda":
        pytest.skip("GPU error record")
    with LowLatencyBuffer(comm, 8, 256, 4 * W, max_topk=4) as b:
        st = comm.engine.transport.status
        assert b._gpu.status is st
        before = st.ledger.seq
        run_case(comm, b, "full", 130)
        assert st.ledger.seq == before + 2 and st.ledger.op(before + 1) == "low_latency_dispatch"


def test_quantiser_matches_ml_dtypes():
    rng = np.random.default_rng(5)
    v = np.concatenate([rng.standard_normal(50000).astype(np.float32) * s for s in (1e-5, 1e-2, 1, 40, 600)])
    v = np.concatenate([v, np.float32([0, -0.0, 448, 449, 464, 465, 1e9, -1e9, 2 ** -6, 2 ** -10, 2 ** -9 * 2.5])])
    ref = np.clip(v, -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    assert np.array_equal(quant.float32_to_fp8_e4m3(v), ref)
    codes = np.arange(256, dtype=np.uint8)
    assert np.array_equal(quant.fp8_e4m3_to_float32(codes), codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32),
                          equal_nan=True)
    x = (rng.standard_normal((7, 512)) * rng.choice([1e-6, 1, 300], size=(7, 1))).astype(np.float32)
    for ue8m0 in (False, True):
        q, s = quant.quantize_fp8(x, ue8m0)
        assert (s >= np.maximum(np.abs(x).reshape(7, 4, 128).max(-1), 1e-4) / 448).all()
        assert (np.abs(quant.dequantize_fp8(q, s) - x) <= quant.error_bound(x, s)).all()


def test_kernel_argument_sizes():
    pytest.importorskip("cupy")
    from cupy_symbuf.transport import kernels as _kernels
    try:
        ptx = _kernels.compile_ptx("low_latency.cu", "compute_90")
    except Exception as exc:  # pragma: no cover
        pytest.skip(f"NVRTC not available: {exc}")
    for name, fields in (("symbuf_ll_dispatch", LL_DISPATCH_FIELDS), ("symbuf_ll_combine", LL_COMBINE_FIELDS)):
        assert re.search(r"\.entry %s\(\s*\.param \.align 8 \.b8 \w+\[%d\]\s*\)" % (name, 8 * len(fields)), ptx), name
    assert "st.release.sys.global.u64" in ptx and "ld.acquire.sys.global.u64" in ptx and "%globaltimer" in ptx
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx


def test_bench_runs(comm):
    r = bench_low_latency(comm, num_tokens=8, hidden=256, num_experts=4 * W, topk=2, iters=10, warmup=1)
    all_ranks(lambda: assert_keys(r))


def assert_keys(r):
    assert r["dispatch_us"] > 0 and r["combine_us"] > 0, r


def test_hot_path_cache(comm, ll):
    """GPU: repeated calls of one shape take the cached hot path (same results); other inputs (non-contiguous x,
    int32 topk_idx) still go through validation and give the same bits; a bad call after caching still raises."""
    if comm.backend != "cuda":
        pytest.skip("GPU hot path")
    import cupy
    N, H, E = ll.N, ll.H, ll.num_experts
    x, i, w = inputs("full", 90, RANK, N, H, E, 4, "bfloat16")
    X, I, Wt = dev(comm, x), dev(comm, i), dev(comm, w)
    results = []
    for variant in ("plain", "plain", "strided", "int32"):
        xv, iv = X, I
        if variant == "strided":
            big = cupy.zeros((X.shape[0], 2 * H), X.dtype)
            big[:, :H] = X
            xv = big[:, :H]
        elif variant == "int32":
            iv = I.astype(cupy.int32)
        recv, cnt, h = ll.dispatch(xv, iv)
        out = ll.combine(recv, iv, Wt, h)
        ll.synchronize()
        results.append((host(cnt).copy(), host(out).copy()))
    assert ll._gpu.fastkeys[0] and ll._gpu.fastkeys[1]
    with pytest.raises(TypeError, match="dtype"):
        ll.dispatch(X.astype(cupy.float32), I)
    with pytest.raises(ValueError, match="topk_weights"):
        ll.combine(recv, I, Wt[:, :2], h)

    def check():
        for cnt, out in results[1:]:
            np.testing.assert_array_equal(cnt, results[0][0])
            np.testing.assert_array_equal(out.view(np.uint16), results[0][1].view(np.uint16))

    all_ranks(check)


# ---- receive hooks (return_recv_hook=True: the send phase in the call, the receive in the hook) -------------------


@pytest.mark.parametrize("case", ["full", "uneven", "minus_one"])
def test_recv_hook_split_equals_the_plain_call(comm, ll, case):
    """dispatch / combine with return_recv_hook=True: the send phase leaves every output untouched (poisoned), the
    hooks' receives fill them; the results equal the NumPy reference (in run_case) and the unsplit call's bits."""
    plain = run_case(comm, ll, case, 200)
    split = run_case(comm, ll, case, 200, recv_hook=True)
    all_ranks(lambda: [np.testing.assert_array_equal(a, b) for a, b in zip(plain, split)])
    run_case(comm, ll, case, 201, use_fp8=True, recv_hook=True)


def test_recv_hook_mixed_with_plain_calls(comm, ll):
    """Split and unsplit calls in turn (both output sets and both halves of each kind), every one right, the ranks
    in step after them."""
    for it in range(6):
        run_case(comm, ll, CASES[it % len(CASES)], 210 + it, use_fp8=it == 3, recv_hook=it % 3 != 0)
    _assert_in_step(ll)


def test_recv_hook_misuse(comm, ll):
    """Calling a hook twice, or the buffer's next call (either kind) before the outstanding hook ran, is a
    RuntimeError that moves nothing (the hook stays callable, the buffer usable); a non-bool return_recv_hook is a
    TypeError."""
    N, H, E, L = ll.N, ll.H, ll.num_experts, ll.L
    x, i, w = inputs("full", 220, RANK, N, H, E, 4, "bfloat16")
    X, I, Wt = dev(comm, x), dev(comm, i), dev(comm, w)
    y = dev(comm, expert_outputs(220, RANK, L, W * N, H, "bfloat16"))
    _, _, h, hook = ll.dispatch(X, I, return_recv_hook=True)
    assert not hook.done
    with pytest.raises(RuntimeError, match="low_latency_dispatch: the receive hook of low_latency_dispatch call "
                                           r"\d+ .*has not run"):
        ll.dispatch(X, I)
    with pytest.raises(RuntimeError, match="low_latency_combine: .*has not run"):
        ll.combine(y, I, Wt, h)
    with pytest.raises(RuntimeError, match="has not run"):
        ll.dispatch(X, I, return_recv_hook=True)
    hook()
    with pytest.raises(RuntimeError, match="already ran"):
        hook()
    _, chook = ll.combine(y, I, Wt, h, return_recv_hook=True)
    with pytest.raises(RuntimeError, match="the receive hook of low_latency_combine call .*has not run"):
        ll.dispatch(X, I)
    chook()
    with pytest.raises(RuntimeError, match="already ran"):
        chook()
    with pytest.raises(TypeError, match="return_recv_hook.*bool"):  # rejected on every rank alike
        ll.dispatch(X, I, return_recv_hook="yes")
    if comm.backend == "cuda":
        ll.synchronize()
    _assert_in_step(ll)
    run_case(comm, ll, "uneven", 221, recv_hook=True)
    _assert_in_step(ll)


@pytest.mark.parametrize("blocking", [False, True], ids=["queued", "blocking"])
def test_recv_hook_raises_a_peers_rejection(comm, blocking):
    """Every rank in turn rejects a dispatch, then a combine, while the others make the call with
    return_recv_hook=True: the call returns, and their hook (GPU queued: synchronize after it) raises
    SymBufferRejectedError naming the rejecting rank, the outputs then empty; the ranks stay in step and the next
    split calls are right."""
    if W == 1:
        pytest.skip("needs 2 ranks")
    if blocking and comm.backend != "cuda":
        pytest.skip("Config(blocking=True) changes only the GPU path")
    c = Communicator(WORLD, Config(timeout_s=10.0, abort_on_failure=False, blocking=blocking), backend=comm.backend)
    b = LowLatencyBuffer(c, 16, 256, 4 * W, max_topk=8)
    N, H, E, L = b.N, b.H, b.num_experts, b.L
    try:
        for bad in range(W):
            x, i, w = inputs("full", 230 + bad, RANK, N, H, E, 4, "bfloat16")
            X, I, Wt = dev(c, x), dev(c, i), dev(c, w)
            poison(b)
            if RANK == bad:
                with pytest.raises(ValueError, match="num_max_dispatch_tokens_per_rank"):
                    b.dispatch(dev(c, np.zeros((N + 1, H), np.uint16)), dev(c, np.zeros((N + 1, 4), np.int64)),
                               return_recv_hook=True)
            else:
                _, cnt, _, hook = b.dispatch(X, I, return_recv_hook=True)
                with pytest.raises(SymBufferRejectedError, match=f"low_latency_dispatch.*rank {bad} rejected") as ei:
                    hook()
                    if c.backend == "cuda":
                        b.synchronize()
                assert ei.value.rejecting_rank == bad and hook.done
                if c.backend == "cuda":
                    assert not host(cnt).any(), "a rejected dispatch leaves zero counts"
            _assert_in_step(b)
            run_case(c, b, "uneven", 240 + bad, recv_hook=True)
            _, _, h = b.dispatch(X, I)
            y = dev(c, expert_outputs(250 + bad, RANK, L, W * N, H, "bfloat16"))
            for o in b._combine_out:  # (the handle's arrays stay)
                o[...] = 0x5A
            if RANK == bad:
                with pytest.raises(TypeError, match="float32"):
                    b.combine(y, I, dev(c, w.astype(np.float64)), h, return_recv_hook=True)
            else:
                out, hook = b.combine(y, I, Wt, h, return_recv_hook=True)
                with pytest.raises(SymBufferRejectedError, match=f"low_latency_combine.*rank {bad} rejected"):
                    hook()
                    if c.backend == "cuda":
                        b.synchronize()
                if c.backend == "cuda":
                    assert not host(out).any(), "a rejected combine leaves zero rows"
            _assert_in_step(b)
            run_case(c, b, "full", 260 + bad, recv_hook=True, use_fp8=bool(bad % 2))
            _assert_in_step(b)
    finally:
        _close_all(b, c)


def test_recv_hook_phases_captured_in_graphs(comm):
    """GPU: the send phase and the hook's receive captured in separate CUDA graphs (dispatch send, its receive,
    combine send, its receive), replayed in that order three times with the outputs poisoned before each: every
    replay gives the bits of the eager unsplit calls."""
    if comm.backend != "cuda":
        pytest.skip("CUDA graphs")
    import cupy
    with LowLatencyBuffer(comm, 16, 256, 4 * W, max_topk=4) as b:
        N, H, E, L = b.N, b.H, b.num_experts, b.L
        x, i, w = inputs("uneven", 270, RANK, N, H, E, 4, "bfloat16")
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            X, I, Wt = dev(comm, x), dev(comm, i), dev(comm, w)
            y = dev(comm, expert_outputs(270, RANK, L, W * N, H, "bfloat16"))
            recv, cnt, h = b.dispatch(X, I)
            out = b.combine(y, I, Wt, h)
            b.synchronize()
            want = host(cnt).copy(), host(out).copy(), host(recv).copy()
            graphs = []
            stream.begin_capture()
            recv, cnt, h, dhook = b.dispatch(X, I, return_recv_hook=True)
            graphs.append(stream.end_capture())
            stream.begin_capture()
            dhook()
            graphs.append(stream.end_capture())
            stream.begin_capture()
            out, chook = b.combine(y, I, Wt, h, return_recv_hook=True)
            graphs.append(stream.end_capture())
            stream.begin_capture()
            chook()
            graphs.append(stream.end_capture())
            got = []
            for _ in range(3):
                poison(b)
                for g in graphs:
                    g.launch(stream)
                stream.synchronize()
                b.synchronize()
                got.append((host(cnt).copy(), host(out).copy(), host(recv).copy()))

    def check():
        for c_, o_, r_ in got:
            np.testing.assert_array_equal(c_, want[0])
            np.testing.assert_array_equal(o_.view(np.uint16), want[1].view(np.uint16))
            for el in range(L):
                np.testing.assert_array_equal(r_[el, :want[0][el]].view(np.uint16),
                                              want[2][el, :want[0][el]].view(np.uint16))

    all_ranks(check)
