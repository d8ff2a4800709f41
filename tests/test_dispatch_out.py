"""MoE dispatch into caller-owned outputs (``dispatch(out=...)``), and on the GPU the direct mode that
comes with a symmetric ``out`` (MODE_PUSH: the peers write their rows straight into it). Every output is compared
with a NumPy reference built from every rank's inputs (``allgather``); ``out`` is poisoned before each call and
the calls are repeated with fresh data.

    python -m pytest tests/test_dispatch_out.py
    mpiexec -n 2 python -m pytest tests/test_dispatch_out.py
"""
from __future__ import annotations

import numpy as np
import pytest

MPI = pytest.importorskip("mpi4py.MPI")

from test_moe import RANK, W, WORLD, all_ranks, moe_comm, rng_for, to_dev, to_np  # noqa: E402,F401
from test_moe_device import _inputs, _ranks_of, _reference  # noqa: E402
from cupy_symbuf import Communicator, Config, SymBufferRejectedError  # noqa: E402
from conftest import _gpu_for_rank  # noqa: E402

POISON = -7.25


def _out(c, sym: bool, rows: int, hidden: int, dtype=np.float32):
    if sym:
        return c.empty((rows, hidden), dtype)
    return c.xp.empty((rows, hidden), dtype)


def _same_memory(a, b) -> bool:
    """``a`` starts where ``b`` does (also with no rows)."""
    if isinstance(a, np.ndarray):
        return a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
    return a.data.ptr == b.data.ptr


def _pushes(c) -> int:
    return getattr(c._transport, "push_calls", 0)


@pytest.mark.parametrize("sym", [False, True], ids=["plain", "symmetric"])
def test_out_eager_repeated(moe_comm, sym):
    """Eager dispatch into ``out`` three times with new data and routing: recv_x is out's first rows, exact; the
    top-k outputs and the combine exact too. A symmetric out on the GPU goes direct (the peers push)."""
    c = moe_comm
    n_exp, topk, hidden, tokens = 4 * W, 3, 64, 40
    cap = (tokens + 2) * W
    out = _out(c, sym, cap, hidden)
    before = _pushes(c)
    for i, routing in enumerate(["random", "masked", "one_rank"]):
        idx, x, w = _inputs(("out", sym, i, c.backend), tokens + i, hidden, n_exp, topk, routing)
        out[...] = POISON
        rx_, ri_, rw_, counts_, h = c.dispatch(to_dev(c, x), to_dev(c, idx), to_dev(c, w), n_exp, out=out)
        rx, ri, rw, per_expert = _reference(idx, x, w, n_exp)
        comb, _ = c.combine(rx_, h)
        ranks = _ranks_of(idx, n_exp)

        def check():
            assert rx_.shape == rx.shape and _same_memory(rx_, out), "recv_x must be a view of out's first rows"
            np.testing.assert_array_equal(to_np(rx_), rx)
            np.testing.assert_array_equal(to_np(ri_), ri)
            np.testing.assert_array_equal(to_np(rw_), rw)
            assert list(counts_) == per_expert.tolist()
            assert (to_np(out)[rx.shape[0]:] == POISON).all(), "rows past the count must be left alone"
            np.testing.assert_array_equal(to_np(comb), x * ranks[:, None])
        all_ranks(check)
    pushed = _pushes(c) - before
    want = 3 if sym and c.backend == "cuda" and W > 1 else 0
    all_ranks(lambda: pushed == want or pytest.fail(f"dispatches in direct (push) mode: {pushed}, want {want}"))
    if sym:
        c.free(out)


@pytest.mark.parametrize("sym", [False, True], ids=["plain", "symmetric"])
def test_out_cached_and_worst_case(moe_comm, sym):
    """A cached dispatch (handle) and a worst-case dispatch (num_worst_tokens) into out, exact; the worst-case
    rows past the count keep recv_topk_idx -1 / weights 0, and (host) recv_x rows past it are 0."""
    c = moe_comm
    n_exp, topk, hidden, tokens = 2 * W, 2, 48, 17 + RANK
    worst = 20 * W
    out = _out(c, sym, worst, hidden)
    idx, x, w = _inputs(("cached-out", sym, c.backend), tokens, hidden, n_exp, topk)
    rx, ri, rw, _ = _reference(idx, x, w, n_exp)
    first = c.dispatch(to_dev(c, x), to_dev(c, idx), to_dev(c, w), n_exp)
    for k in range(2):
        x2 = (x * (k + 2)).astype(np.float32)
        out[...] = POISON
        got = c.dispatch(to_dev(c, x2), handle=first[4], out=out)[0]
        all_ranks(lambda: (_same_memory(got, out) or pytest.fail("not a view of out"),
                           np.testing.assert_array_equal(to_np(got), rx * (k + 2))))
    out[...] = POISON
    gx, gi, gw, _, hw = c.dispatch(to_dev(c, x), to_dev(c, idx), to_dev(c, w), n_exp, num_worst_tokens=worst,
                                   out=out)
    n = rx.shape[0]

    def check():
        assert gx.shape == (worst, hidden) and _same_memory(gx, out)
        np.testing.assert_array_equal(to_np(gx)[:n], rx)
        np.testing.assert_array_equal(to_np(gi)[:n], ri)
        np.testing.assert_array_equal(to_np(gw)[:n], rw)
        assert (to_np(gi)[n:] == -1).all() and (to_np(gw)[n:] == 0).all()
        if c.backend == "host":
            assert (to_np(gx)[n:] == 0).all()
    all_ranks(check)
    out[...] = POISON
    got = c.dispatch(to_dev(c, x), handle=hw, out=out)[0]  # cached worst-case handle
    all_ranks(lambda: np.testing.assert_array_equal(to_np(got)[:n], rx))
    if sym:
        c.free(out)


def test_out_fp8_tuple(moe_comm):
    """An fp8 tuple x (codes, scales) into a symmetric (out_x, out_scales): raw bits exact."""
    import ml_dtypes
    c = moe_comm
    n_exp, topk, hidden, tokens = 2 * W, 2, 256, 12
    idx, _, w = _inputs(("fp8-out", c.backend), tokens, 8, n_exp, topk)
    rng = rng_for("fp8-out-bits", c.backend)
    codes = rng.integers(1, 127, size=(tokens, hidden), dtype=np.uint8)   # finite e4m3 values
    scales = rng.uniform(0.5, 2.0, size=(tokens, hidden // 128)).astype(np.float32)
    fp8 = np.dtype(ml_dtypes.float8_e4m3fn)
    cap = tokens * W
    ox, osc = c.empty((cap, hidden), np.uint8), c.empty((cap, hidden // 128), np.float32)
    ox[...] = 0xFF
    osc[...] = POISON
    x8 = to_dev(c, codes.view(fp8)) if c.backend == "host" else to_dev(c, codes)
    (gx, gs), gi, _, _, _ = c.dispatch((x8, to_dev(c, scales)), to_dev(c, idx), to_dev(c, w), n_exp, out=(ox, osc))
    rx, _, _, _ = _reference(idx, codes.astype(np.float32), w, n_exp)
    rs, _, _, _ = _reference(idx, scales, w, n_exp)

    def check():
        assert _same_memory(gx, ox) and _same_memory(gs, osc)
        np.testing.assert_array_equal(to_np(gx).view(np.uint8).astype(np.float32), rx)
        np.testing.assert_array_equal(to_np(gs), rs)
    all_ranks(check)
    c.free(osc)
    c.free(ox)


def _bad(c, name, x, idx, w, n_exp, hidden):
    xp = c.xp
    if name == "dtype":
        return dict(out=xp.empty((100, hidden), np.float64)), TypeError, "argument 'out' must have dtype"
    if name == "hidden":
        return dict(out=xp.empty((100, hidden + 1), np.float32)), ValueError, "hidden"
    if name == "strided":
        return dict(out=xp.empty((100, 2 * hidden), np.float32)[:, ::2]), ValueError, "C-contiguous"
    if name == "tuple":
        return dict(out=(xp.empty((100, hidden), np.float32),)), TypeError, "an array"
    if name == "wire":
        return dict(out=xp.empty((100, hidden), np.float32), wire_dtype="fp8"), ValueError, "wire_dtype"
    if name == "overlap":  # written while x is still read
        return dict(out="x"), ValueError, "share memory with x"
    if name == "rawbits":  # raw bfloat16 bits in, float16 out: refused (only x's dtype or the raw uint)
        return dict(out=xp.empty((100, hidden), np.float16), raw_x=True), TypeError, "raw bits"
    if name == "freed":
        sym = c.empty((100, hidden), np.float32)
        c.free(sym)
        return dict(out=sym), ValueError, "freed"
    raise AssertionError(name)


@pytest.mark.parametrize("name", ["dtype", "hidden", "strided", "tuple", "wire", "overlap", "rawbits", "freed",
                                  "readonly"])
def test_bad_out_raises_everywhere_then_usable(moe_comm, name):
    c = moe_comm
    n_exp, topk, hidden, tokens = 2 * W, 2, 128, 9
    idx, x, w = _inputs(("bad-out", name, c.backend), tokens, hidden, n_exp, topk)
    if name == "readonly":
        if c.backend != "host":
            pytest.skip("CuPy arrays are always writeable")
        ro = np.empty((100, hidden), np.float32)
        ro.setflags(write=False)
        kwargs, exc, match = dict(out=ro), ValueError, "writeable"
    else:
        kwargs, exc, match = _bad(c, name, x, idx, w, n_exp, hidden)
    xd = to_dev(c, x)
    if kwargs.pop("raw_x", False):
        xd = to_dev(c, x.astype(np.float16)).view(np.uint16)
    if kwargs.get("out") == "x" if isinstance(kwargs.get("out"), str) else False:
        kwargs["out"] = xd
    with pytest.raises(exc, match=match):
        c.dispatch(xd, to_dev(c, idx), to_dev(c, w), n_exp, **kwargs)
    got = c.dispatch(to_dev(c, x), to_dev(c, idx), to_dev(c, w), n_exp)[0]
    rx = _reference(idx, x, w, n_exp)[0]
    all_ranks(lambda: np.testing.assert_array_equal(to_np(got), rx))


def test_cached_out_too_small_is_a_rejection(moe_comm):
    """Rank 0's out holds fewer rows than its handle receives: ValueError there, SymBufferRejectedError on the
    peers, nothing written; then the same call with room works."""
    c = moe_comm
    n_exp, topk, hidden, tokens = 2 * W, 2, 32, 10
    idx, x, w = _inputs(("small-out", c.backend), tokens, hidden, n_exp, topk, "random")
    first = c.dispatch(to_dev(c, x), to_dev(c, idx), to_dev(c, w), n_exp)
    n = first[0].shape[0]
    rows = max(0, n - 1) if RANK == 0 else n
    small = c.xp.full((rows, hidden), POISON, np.float32)
    n0 = WORLD.bcast(n if RANK == 0 else None)
    if RANK == 0 and n > 0:
        with pytest.raises(ValueError, match="fewer than"):
            c.dispatch(to_dev(c, x), handle=first[4], out=small)
    elif W > 1 and n0 > 0:
        with pytest.raises(SymBufferRejectedError):  # GPU: a queued call reports it from synchronize
            c.dispatch(to_dev(c, x), handle=first[4], out=small)
            c.synchronize()
    else:
        c.dispatch(to_dev(c, x), handle=first[4], out=small)
    if RANK == 0 and n > 0:
        all_ranks(lambda: (to_np(small) == POISON).all() or pytest.fail("out was written"))
    else:
        all_ranks(lambda: None)
    ok = c.xp.empty((n, hidden), np.float32)
    got = c.dispatch(to_dev(c, x), handle=first[4], out=ok)[0]
    all_ranks(lambda: np.testing.assert_array_equal(to_np(got), to_np(first[0])))


def _gpu_comm(**cfg):
    import cupy
    cupy.cuda.Device(_gpu_for_rank()).use()
    return Communicator(WORLD, backend="cuda", config=Config(**cfg) if cfg else None)


def test_push_layout_mismatch_raises_everywhere():
    """GPU: rank 0's symmetric out starts one row later than the others': the ranks disagree on where the rows
    go, a ValueError on every rank from the count exchange, nothing moved; then an agreed call works. With
    Config.mode='ring' a symmetric out goes through the rings (no pushes)."""
    from conftest import available_backends
    if "cuda" not in available_backends() or W < 2:
        pytest.skip("needs the cuda backend and two ranks")
    c = _gpu_comm()
    try:
        n_exp, topk, hidden, tokens = 2 * W, 2, 32, 8
        idx, x, w = _inputs(("push-mismatch",), tokens, hidden, n_exp, topk)
        out = c.empty((tokens * W + 1, hidden), np.float32)
        view = out[1:] if RANK == 0 else out[:-1]
        with pytest.raises(ValueError, match="disagree"):
            c.dispatch(to_dev(c, x), to_dev(c, idx), to_dev(c, w), n_exp, out=view)
        got = c.dispatch(to_dev(c, x), to_dev(c, idx), to_dev(c, w), n_exp, out=out[1:])[0]
        rx = _reference(idx, x, w, n_exp)[0]
        all_ranks(lambda: np.testing.assert_array_equal(to_np(got), rx))
    finally:
        c.close()
    r = _gpu_comm(mode="ring")
    try:
        out = r.empty((tokens * W, hidden), np.float32)
        got = r.dispatch(to_dev(r, x), to_dev(r, idx), to_dev(r, w), n_exp, out=out)[0]
        all_ranks(lambda: (np.testing.assert_array_equal(to_np(got), rx),
                           _pushes(r) == 0 or pytest.fail("Config.mode='ring' pushed")))
    finally:
        r.close()
