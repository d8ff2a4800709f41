"""The DeepEP shim (cupy_symbuf.compat.deepep): DeepEP's call shapes, the native API's exact results, a NumPy reference.

Runs on 1 rank and under ``mpiexec -n 2/4``, on every backend available here. PyTorch tests skip without torch.
"""
from __future__ import annotations

import inspect
import zlib

import numpy as np
import pytest

from _util import all_ranks  # noqa: E402  (tests/ is on sys.path under pytest)
from mpi4py import MPI

from conftest import _gpu_for_rank, available_backends
from cupy_symbuf import LowLatencyBuffer, LowLatencyHandle, SymBufferRejectedError, moe
from cupy_symbuf.compat.deepep import Buffer, Config, EventOverlap, IntranodeHandle, LowLatencyHandleView

WORLD = MPI.COMM_WORLD
RANK = WORLD.Get_rank()
W = WORLD.Get_size()


@pytest.fixture(scope="module", params=available_backends())
def buf(request):
    if request.param == "cuda":
        import cupy
        cupy.cuda.Device(_gpu_for_rank()).use()
    b = Buffer(WORLD, int(1e9), 0, backend=request.param)
    yield b
    b.destroy()


def np_(a):
    if a is None or isinstance(a, np.ndarray):
        return a
    if type(a).__module__.startswith("torch"):
        return a.cpu().numpy()
    return a.get()


def dev(b, a):
    if a is None or b.communicator.backend == "host":
        return a
    import cupy
    return cupy.asarray(a)


def inputs(key, num_tokens=20, hidden=8, topk=3, weights=True):
    rng = np.random.default_rng([zlib.crc32(repr(key).encode()), RANK])
    num_experts = 4 * W
    idx = np.stack([rng.choice(num_experts, size=topk, replace=False) for _ in range(num_tokens)]).astype(np.int64)
    idx[rng.random(idx.shape) < 0.2] = -1
    x = rng.integers(-8, 9, size=(num_tokens, hidden)).astype(np.float32)
    w = rng.uniform(0.1, 1.0, size=idx.shape).astype(np.float32) if weights else None
    return x, idx, w, num_experts


def ref(x, idx, w, num_experts):
    """recv_x, recv_topk_idx (local ids), recv_topk_weights of this rank; combine of recv_x sent straight back."""
    everything = WORLD.allgather((x, idx, w))
    epr = num_experts // W
    rx, ri, rw = [], [], []
    for xs, ids, ws in everything:
        for t in range(xs.shape[0]):
            mine = [int(e) >= 0 and int(e) // epr == RANK for e in ids[t]]
            if any(mine):
                rx.append(xs[t])
                ri.append([int(e) - RANK * epr if m else -1 for e, m in zip(ids[t], mine)])
                if ws is not None:
                    rw.append([v if m else 0.0 for v, m in zip(ws[t], mine)])
    k = idx.shape[1]
    recv_x = np.stack(rx) if rx else np.zeros((0, x.shape[1]), x.dtype)
    recv_i = np.array(ri, np.int64).reshape(-1, k)
    recv_w = np.array(rw, np.float32).reshape(-1, k) if w is not None else None
    n_ranks = np.array([len({int(e) // epr for e in row if e >= 0}) for row in idx], dtype=np.float32)
    return recv_x, recv_i, recv_w, x * n_ranks[:, None]


def layout_and_dispatch(b, x, idx, w, n_exp, **kw):
    lay = b.get_dispatch_layout(dev(b, idx), n_exp)
    out = b.dispatch(dev(b, x), num_tokens_per_rank=lay[0], is_token_in_rank=lay[3], num_tokens_per_expert=lay[2],
                     topk_idx=dev(b, idx), topk_weights=dev(b, w), **kw)
    return lay, out


# ------------------------------------------------------------------------------------------------ shapes, results


def test_tuples_and_native_results(buf):
    x, idx, w, n_exp = inputs(("native", buf.communicator.backend))
    want_x, want_i, want_w, want_comb = ref(x, idx, w, n_exp)
    c = buf.communicator
    lay, out = layout_and_dispatch(buf, x, idx, w, n_exp, expert_alignment=4)
    nat_lay = c.get_dispatch_layout(dev(buf, idx), n_exp)
    nat = c.dispatch(dev(buf, x), dev(buf, idx), dev(buf, w), n_exp, expert_alignment=4)
    comb = buf.combine(out[0], out[4], topk_weights=out[2])
    nat_comb = c.combine(nat[0], nat[4], nat[2])
    cached = buf.dispatch(dev(buf, x), handle=out[4])

    def check():
        assert len(lay) == 5 and lay[1] is None and isinstance(lay[4], EventOverlap)
        for a, b in zip((lay[0], lay[2], lay[3]), nat_lay):
            assert a.dtype == b.dtype
            np.testing.assert_array_equal(np_(a), np_(b))
        assert len(out) == 6 and isinstance(out[5], EventOverlap)
        assert isinstance(out[4], IntranodeHandle) and isinstance(out[4].native, moe.DispatchHandle)
        for a, b in zip(out[:3], nat[:3]):
            np.testing.assert_array_equal(np_(a), np_(b))
        assert out[3] == nat[3] and isinstance(out[3], list)
        np.testing.assert_array_equal(np_(out[0]), want_x)
        np.testing.assert_array_equal(np_(out[1]), want_i)
        np.testing.assert_array_equal(np_(out[2]), want_w)
        assert len(comb) == 3 and isinstance(comb[2], EventOverlap)
        np.testing.assert_array_equal(np_(comb[0]), np_(nat_comb[0]))
        np.testing.assert_array_equal(np_(comb[1]), np_(nat_comb[1]))
        np.testing.assert_array_equal(np_(comb[0]), want_comb)
        assert len(cached) == 6 and cached[1:5] == (None, None, None, None)
        np.testing.assert_array_equal(np_(cached[0]), want_x)
        assert type(out[0]) is type(dev(buf, x))

    all_ranks(check)


def test_fp8_tuple_and_no_weights(buf):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x, idx, _, n_exp = inputs(("fp8", buf.communicator.backend), hidden=256, weights=False)
    fp8 = x.astype(ml_dtypes.float8_e4m3fn)
    if buf.communicator.backend == "cuda":
        fp8 = fp8.view(np.uint8)
    scales = np.ones((x.shape[0], 2), np.float32) * (RANK + 1)
    lay = buf.get_dispatch_layout(dev(buf, idx), n_exp)
    out = buf.dispatch((dev(buf, fp8), dev(buf, scales)), num_tokens_per_rank=lay[0], is_token_in_rank=lay[3],
                       num_tokens_per_expert=lay[2])
    want_x = ref(fp8.view(np.uint8), idx, None, n_exp)[0]

    def check():
        assert isinstance(out[0], tuple) and len(out[0]) == 2 and out[1] is None and out[2] is None
        np.testing.assert_array_equal(np_(out[0][0]).view(np.uint8), want_x)

    all_ranks(check)


def test_fp8_with_topk_and_weights(buf):
    """The largest row DeepEP's tests send: fp8 x, its scales, top-k indices and weights, routed by the mask
    (DeepEP's "FP8, with top-k" case): every part arrives right."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x, idx, w, n_exp = inputs(("fp8topk", buf.communicator.backend), hidden=256)
    fp8 = x.astype(ml_dtypes.float8_e4m3fn)
    if buf.communicator.backend == "cuda":
        fp8 = fp8.view(np.uint8)
    scales = (np.arange(x.shape[0] * 2, dtype=np.float32).reshape(-1, 2) + 1000 * RANK)
    lay = buf.get_dispatch_layout(dev(buf, idx), n_exp)
    out = buf.dispatch((dev(buf, fp8), dev(buf, scales)), num_tokens_per_rank=lay[0], is_token_in_rank=lay[3],
                       num_tokens_per_expert=lay[2], topk_idx=dev(buf, idx), topk_weights=dev(buf, w))
    want_x, want_i, want_w, _ = ref(fp8.view(np.uint8), idx, w, n_exp)
    want_s = ref(scales, idx, None, n_exp)[0]

    def check():
        np.testing.assert_array_equal(np_(out[0][0]).view(np.uint8), want_x)
        np.testing.assert_array_equal(np_(out[0][1]), want_s)
        np.testing.assert_array_equal(np_(out[1]), want_i)
        np.testing.assert_array_equal(np_(out[2]), want_w)

    all_ranks(check)


# ------------------------------------------------------------------------------------------------ events


def test_previous_event_and_async_finish(buf):
    x, idx, w, n_exp = inputs(("async", buf.communicator.backend))
    want_x, _, _, want_comb = ref(x, idx, w, n_exp)
    prev = Buffer.capture()
    lay = buf.get_dispatch_layout(dev(buf, idx), n_exp, previous_event=prev, async_finish=True,
                                  allocate_on_comm_stream=True)
    lay[4].current_stream_wait()
    out = buf.dispatch(dev(buf, x), num_tokens_per_rank=lay[0], is_token_in_rank=lay[3],
                       num_tokens_per_expert=lay[2], topk_idx=dev(buf, idx), topk_weights=dev(buf, w),
                       previous_event=lay[4], async_finish=True)
    with out[5]:  # the current stream waits at the end of the block
        pass
    comb = buf.combine(out[0], out[4], async_finish=True, previous_event=out[5])
    comb[2].current_stream_wait(release_handle=True)

    def check():
        if buf.communicator.backend == "cuda":
            assert out[5].event is not None
            import cupy
            cupy.cuda.get_current_stream().synchronize()
        else:
            assert out[5].event is not None  # a completed event (DeepEP's current_stream_wait needs one)
        assert comb[2].event is None  # released
        np.testing.assert_array_equal(np_(out[0]), want_x)
        np.testing.assert_array_equal(np_(comb[0]), want_comb)
        s = buf.get_comm_stream()  # a torch stream when PyTorch is loaded (.cuda_stream), else CuPy's (.ptr)
        assert s is None or (getattr(s, "ptr", None) or s.cuda_stream) != 0

    all_ranks(check)


def test_bad_stream_arguments_then_usable(buf):
    x, idx, w, n_exp = inputs(("bad", buf.communicator.backend))
    want_x = ref(x, idx, w, n_exp)[0]

    def check():
        with pytest.raises(ValueError, match="allocate_on_comm_stream"):
            buf.get_dispatch_layout(dev(buf, idx), n_exp, allocate_on_comm_stream=True)
        lay = buf.get_dispatch_layout(dev(buf, idx), n_exp)
        with pytest.raises(TypeError, match="'previous_event'"):
            buf.dispatch(dev(buf, x), num_tokens_per_rank=lay[0], is_token_in_rank=lay[3],
                         num_tokens_per_expert=lay[2], topk_idx=dev(buf, idx), previous_event="not an event")
        with pytest.raises(TypeError, match="'async_finish'"):
            buf.dispatch(dev(buf, x), num_tokens_per_rank=lay[0], is_token_in_rank=lay[3],
                         num_tokens_per_expert=lay[2], topk_idx=dev(buf, idx), async_finish="yes")
        with pytest.raises(ValueError, match="'num_tokens_per_rank' is required"):
            buf.dispatch(dev(buf, x), topk_idx=dev(buf, idx))
        with pytest.raises(ValueError, match="'is_token_in_rank' is required"):
            buf.dispatch(dev(buf, x), num_tokens_per_rank=lay[0], num_tokens_per_expert=lay[2])
        with pytest.raises(ValueError, match="both or neither"):
            buf.dispatch(dev(buf, x), num_tokens_per_rank=lay[0], is_token_in_rank=lay[3],
                         num_tokens_per_expert=lay[2], topk_idx=dev(buf, idx))
        out = buf.dispatch(dev(buf, x), num_tokens_per_rank=lay[0], is_token_in_rank=lay[3],
                           num_tokens_per_expert=lay[2], topk_idx=dev(buf, idx), topk_weights=dev(buf, w))
        with pytest.raises(NotImplementedError, match="bias"):
            buf.combine(out[0], out[4], bias=out[0])
        np.testing.assert_array_equal(np_(out[0]), want_x)
        buf.combine(out[0], out[4], config=Buffer.get_combine_config(W))

    all_ranks(check)


@pytest.mark.skipif(W == 1, reason="needs peers")
def test_shim_rejection_on_one_rank_is_told_to_peers(buf):
    x, idx, w, n_exp = inputs(("reject1", buf.communicator.backend))
    lay = buf.get_dispatch_layout(dev(buf, idx), n_exp)
    kw = dict(num_tokens_per_rank=lay[0], is_token_in_rank=lay[3], num_tokens_per_expert=lay[2])

    def check():
        if RANK == 0:
            with pytest.raises(TypeError, match="'previous_event'"):
                buf.dispatch(dev(buf, x), previous_event=3, **kw)
        else:
            with pytest.raises(SymBufferRejectedError):
                buf.dispatch(dev(buf, x), **kw)
        np.testing.assert_array_equal(np_(buf.dispatch(dev(buf, x), **kw)[0]), ref(x, idx, w, n_exp)[0])

    all_ranks(check)


def test_num_worst_tokens(buf):
    x, idx, w, n_exp = inputs(("worst", buf.communicator.backend))
    lay, out = layout_and_dispatch(buf, x, idx, w, n_exp, num_worst_tokens=0)  # zero: not passed on
    all_ranks(lambda: np.testing.assert_array_equal(np_(out[0]), ref(x, idx, w, n_exp)[0]))
    if "num_worst_tokens" not in inspect.signature(moe.dispatch).parameters:
        pytest.xfail("the native dispatch has no num_worst_tokens yet")
    worst = x.shape[0] * W
    _, out = layout_and_dispatch(buf, x, idx, w, n_exp, num_worst_tokens=worst)
    all_ranks(lambda: np.testing.assert_array_equal(np_(out[0])[:ref(x, idx, w, n_exp)[0].shape[0]],
                                                    ref(x, idx, w, n_exp)[0]))


def test_construction_errors(buf):
    def check():
        with pytest.raises(TypeError, match="mpi4py"):
            Buffer(object())
        with pytest.raises(ValueError, match="group"):
            Buffer()
        assert Config().get_nvl_buffer_size_hint(7168 * 2, W) == 0
        assert isinstance(Buffer.get_dispatch_config(W), Config)
        with pytest.raises(ValueError):
            Buffer.set_num_sms(3)
        assert buf.rank == RANK and buf.group_size == W and buf.group is WORLD

    all_ranks(check)


# ------------------------------------------------------------------------------------------------ PyTorch


def test_torch_tensors_in_torch_out(buf):
    torch = pytest.importorskip("torch")
    device = "cuda" if buf.communicator.backend == "cuda" else "cpu"
    if device == "cuda":
        torch.cuda.set_device(_gpu_for_rank())
    x, idx, w, n_exp = inputs(("torch", device))
    want_x, want_i, want_w, want_comb = ref(x, idx, w, n_exp)
    tx = torch.from_numpy(x).to(device).to(torch.bfloat16)
    tidx, tw = torch.from_numpy(idx).to(device), torch.from_numpy(w).to(device)
    lay = buf.get_dispatch_layout(tidx, n_exp)
    out = buf.dispatch(tx, num_tokens_per_rank=lay[0], is_token_in_rank=lay[3], num_tokens_per_expert=lay[2],
                       topk_idx=tidx, topk_weights=tw, async_finish=True)
    out[5].current_stream_wait()
    comb = buf.combine(out[0], out[4])

    def check():
        for t in (lay[0], lay[2], lay[3], out[0], out[1], out[2], comb[0]):
            assert isinstance(t, torch.Tensor) and t.device.type == device
        assert lay[0].dtype == torch.int32 and lay[3].dtype == torch.bool
        assert out[0].dtype == torch.bfloat16 and comb[0].dtype == torch.bfloat16
        np.testing.assert_array_equal(out[0].float().cpu().numpy(), want_x)
        np.testing.assert_array_equal(out[1].cpu().numpy(), want_i)
        np.testing.assert_array_equal(out[2].cpu().numpy(), want_w)
        np.testing.assert_array_equal(comb[0].float().cpu().numpy(), want_comb)

    all_ranks(check)


# ------------------------------------------------------------------------------------------------ low-latency mode


def ll_inputs(key, n, hidden, num_experts, topk):
    rng = np.random.default_rng([zlib.crc32(repr(key).encode()), RANK])
    idx = np.argsort(rng.random((n, num_experts)), axis=1)[:, :topk].astype(np.int64)
    idx[rng.random(idx.shape) < 0.2] = -1
    xf = rng.standard_normal((n, hidden)).astype(np.float32)
    x = (xf.view(np.uint32) >> 16).astype(np.uint16)  # bf16 bits (truncated: any bits will do)
    w = rng.random((n, topk)).astype(np.float32)
    return x, idx, w


LL_N, LL_H, LL_K = 16, 256, 4


@pytest.mark.parametrize("use_fp8", [False, True], ids=["bf16", "fp8"])
def test_low_latency_matches_native(buf, use_fp8):
    """Buffer.low_latency_dispatch / low_latency_combine give the native LowLatencyBuffer's results bit for bit,
    in DeepEP's tuple shapes."""
    E = 4 * W
    L = E // W
    x, idx, w = ll_inputs(("ll", use_fp8), LL_N - RANK % 2, LL_H, E, LL_K)
    native = LowLatencyBuffer(buf.communicator, LL_N, LL_H, E, max_topk=32)
    try:
        out = buf.low_latency_dispatch(dev(buf, x), dev(buf, idx), LL_N, E, use_fp8=use_fp8)
        nat = native.dispatch(dev(buf, x), dev(buf, idx), use_fp8=use_fp8)
        got_cnt, nat_cnt = np_(out[1]).copy(), np_(nat[1]).copy()
        if use_fp8:
            got_x = [np_(a).view(np.uint8 if i == 0 else np.float32).copy() for i, a in enumerate(out[0])]
            nat_x = [np_(a).view(np.uint8 if i == 0 else np.float32).copy() for i, a in enumerate(nat[0])]
        else:
            got_x, nat_x = [np_(out[0]).view(np.uint16).copy()], [np_(nat[0]).view(np.uint16).copy()]
        h, nh = out[2], nat[2]
        got_src, nat_src = np_(h[0]).copy(), np_(nh.src_info).copy()
        got_lr, nat_lr = np_(h[1]).copy(), np_(nh.layout_range).copy()
        rng = np.random.default_rng([7, RANK])
        y = (rng.standard_normal((L, W * LL_N, LL_H)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        comb = buf.low_latency_combine(dev(buf, y), dev(buf, idx), dev(buf, w), h)
        nat_comb = np_(native.combine(dev(buf, y), dev(buf, idx), dev(buf, w), nh)).copy()
        if buf.communicator.backend == "cuda":
            import cupy
            cupy.cuda.runtime.deviceSynchronize()
    finally:
        native.close()

    def check():
        assert len(out) == 5 and isinstance(out[3], EventOverlap) and out[4] is None
        assert isinstance(h, LowLatencyHandleView) and isinstance(h.native, LowLatencyHandle)
        assert len(h) == 5 and tuple(h)[2:] == (LL_N, LL_H, E)
        assert isinstance(out[0], tuple) == use_fp8
        np.testing.assert_array_equal(got_cnt, nat_cnt)
        for el in range(L):
            c = int(nat_cnt[el])
            for a, b in zip(got_x, nat_x):
                np.testing.assert_array_equal(a[el, :c], b[el, :c])
            np.testing.assert_array_equal(got_src[el, :c], nat_src[el, :c])
        np.testing.assert_array_equal(got_lr, nat_lr)
        assert len(comb) == 3 and isinstance(comb[1], EventOverlap) and comb[2] is None
        assert tuple(comb[0].shape) == (x.shape[0], LL_H)
        np.testing.assert_array_equal(np_(comb[0]).view(np.uint16), nat_comb.view(np.uint16))
        assert type(out[1]) is type(dev(buf, idx))

    all_ranks(check)


def test_low_latency_options(buf):
    """Stats accumulate, out= is filled, hooks and async events come back, size hint and clean."""
    E = 4 * W
    L = E // W
    x, idx, w = ll_inputs("llopt", LL_N, LL_H, E, LL_K)
    stats = dev(buf, np.zeros(L, np.int32))
    r1 = buf.low_latency_dispatch(dev(buf, x), dev(buf, idx), LL_N, E, use_fp8=False,
                                  cumulative_local_expert_recv_stats=stats, return_recv_hook=True)
    r1[4]()
    c1 = np_(r1[1]).copy()
    r2 = buf.low_latency_dispatch(dev(buf, x), dev(buf, idx), LL_N, E, use_fp8=False,
                                  cumulative_local_expert_recv_stats=stats, async_finish=True)
    r2[3].current_stream_wait()
    y = np_(r2[0]).copy()
    out = dev(buf, np.zeros((LL_N, LL_H), np.uint16))
    comb = buf.low_latency_combine(dev(buf, y), dev(buf, idx), dev(buf, w), r2[2], out=out, return_recv_hook=True)
    comb[2]()
    plain = np_(buf.low_latency_combine(dev(buf, y), dev(buf, idx), dev(buf, w), r2[2])[0]).copy()
    if buf.communicator.backend == "cuda":
        import cupy
        cupy.cuda.runtime.deviceSynchronize()
    hint = Buffer.get_low_latency_rdma_size_hint(LL_N, LL_H, W, E)
    ll = r2[2].native.owner

    def check():
        assert callable(r1[4]) and callable(comb[2])
        np.testing.assert_array_equal(np_(stats), 2 * c1)
        assert comb[0] is out
        np.testing.assert_array_equal(np_(out), plain)
        assert buf.communicator.backend == "host" or r2[3].event is not None
        assert hint == ll.nbytes and hint > 0
        assert buf.clean_low_latency_buffer(LL_N, LL_H, E) is None
        with pytest.raises(TypeError, match="handle"):
            buf.low_latency_combine(dev(buf, y), dev(buf, idx), dev(buf, w), object())

    all_ranks(check)


@pytest.mark.parametrize("use_fp8", [False, True], ids=["bf16", "fp8"])
def test_low_latency_return_recv_hook(buf, use_fp8):
    """return_recv_hook=True (DeepEP's split): the call returns before the receive (its stats untouched), the hook
    runs it; the results (data, DeepEP's column-major ue8m0 scales, counts, out=) equal the unsplit calls' bits; a
    hook runs once, the next call before it is a RuntimeError, async_finish with it a ValueError."""
    E = 4 * W
    L = E // W
    x, idx, w = ll_inputs(("llhook", use_fp8), LL_N - RANK % 2, LL_H * 2, E, LL_K)
    X, I, Wt = dev(buf, x), dev(buf, idx), dev(buf, w)
    opts = dict(use_fp8=use_fp8, round_scale=use_fp8, use_ue8m0=use_fp8)

    def dispatched(r):
        data = [np_(a).view(np.uint8).copy() if i == 0 else np_(a).copy() for i, a in enumerate(r[0])] \
            if use_fp8 else [np_(r[0]).view(np.uint16).copy()]
        return data, np_(r[1]).copy()

    plain = buf.low_latency_dispatch(X, I, LL_N, E * 1, **opts)
    want_x, want_cnt = dispatched(plain)
    rng = np.random.default_rng([9, RANK])
    y = (rng.standard_normal((L, W * LL_N, LL_H * 2)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    want_comb = np_(buf.low_latency_combine(dev(buf, y), I, Wt, plain[2])[0]).copy()
    stats = dev(buf, np.zeros(L, np.int32))
    r = buf.low_latency_dispatch(X, I, LL_N, E, cumulative_local_expert_recv_stats=stats, return_recv_hook=True,
                                 **opts)
    if buf.communicator.backend == "cuda":
        import cupy
        cupy.cuda.runtime.deviceSynchronize()
    stats_before = np_(stats).copy()
    with pytest.raises(RuntimeError, match="has not run"):
        buf.low_latency_dispatch(X, I, LL_N, E, **opts)
    r[4]()
    with pytest.raises(RuntimeError, match="already ran"):
        r[4]()
    got_x, got_cnt = dispatched(r)
    out = dev(buf, np.zeros((x.shape[0], LL_H * 2), np.uint16))
    comb = buf.low_latency_combine(dev(buf, y), I, Wt, r[2], out=out, return_recv_hook=True)
    comb[2]()
    with pytest.raises(ValueError, match="async_finish and return_recv_hook"):
        buf.low_latency_combine(dev(buf, y), I, Wt, r[2], async_finish=True, return_recv_hook=True)
    got_comb = np_(comb[0]).copy()
    stats_after = np_(stats).copy()

    def check():
        assert callable(r[4]) and r[3].event is None and callable(comb[2]) and comb[0] is out
        assert not stats_before.any(), "the stats are added by the receive (the hook)"
        np.testing.assert_array_equal(stats_after, want_cnt)
        np.testing.assert_array_equal(got_cnt, want_cnt)
        for el in range(L):
            c = int(want_cnt[el])
            for a, b in zip(got_x, want_x):
                np.testing.assert_array_equal(a[el, :c], b[el, :c])
        np.testing.assert_array_equal(got_comb.view(np.uint16), want_comb.view(np.uint16))

    all_ranks(check)


def test_low_latency_buffer_at_construction():
    """Buffer(low_latency_mode=True, N, hidden, num_experts) creates the LowLatencyBuffer collectively up front."""
    backend = available_backends()[0]
    E = 4 * W
    with Buffer(WORLD, 0, 0, low_latency_mode=True, backend=backend, num_max_dispatch_tokens_per_rank=LL_N,
                hidden=LL_H, num_experts=E) as b:
        before = dict(b._ll)
        x, idx, _ = ll_inputs("llctor", LL_N, LL_H, E, LL_K)
        r = b.low_latency_dispatch(dev(b, x), dev(b, idx), LL_N, E, use_fp8=False)
        if b.communicator.backend == "cuda":
            import cupy
            cupy.cuda.runtime.deviceSynchronize()
        after = dict(b._ll)
        all_ranks(lambda: (len(before) == 1 and after == before and r[2].native.owner in before.values()) or
                  pytest.fail(f"{before} {after}"))


def test_low_latency_torch(buf):
    torch = pytest.importorskip("torch")
    device = "cuda" if buf.communicator.backend == "cuda" else "cpu"
    if device == "cuda":
        torch.cuda.set_device(_gpu_for_rank())
    E = 4 * W
    x, idx, w = ll_inputs("lltorch", LL_N, LL_H, E, LL_K)
    tx = torch.from_numpy(x.view(np.int16)).to(device).view(torch.bfloat16)
    tidx, tw = torch.from_numpy(idx).to(device), torch.from_numpy(w).to(device)
    recv, cnt, h, ev, hook = buf.low_latency_dispatch(tx, tidx, LL_N, E, use_fp8=False)
    (q, sc), cnt8, _, _, _ = buf.low_latency_dispatch(tx, tidx, LL_N, E)  # DeepEP's default: fp8
    comb, _, _ = buf.low_latency_combine(recv, tidx, tw, h)

    def check():
        assert isinstance(recv, torch.Tensor) and recv.dtype == torch.bfloat16 and recv.device.type == device
        assert cnt.dtype == torch.int32 and q.dtype == torch.float8_e4m3fn and sc.dtype == torch.float32
        assert comb.dtype == torch.bfloat16 and tuple(comb.shape) == (LL_N, LL_H)

    all_ranks(check)


# ------------------------------------------------------------------------------------------------ DeepEP's semantics


def deepep_handle_ref(in_rank_all, num_channels):
    """DeepEP's intranode handle matrices from every rank's is_token_in_rank (a NumPy reading of its
    notify_dispatch / dispatch kernels): rank_prefix_matrix, this rank's channel_prefix_matrix,
    recv_channel_prefix_matrix, recv_src_idx, send_head."""
    C = num_channels
    counts = np.array([m.sum(axis=0) for m in in_rank_all], np.int64)          # [src, dst]
    rpm = np.cumsum(counts, axis=0).astype(np.int32)

    def chan_ranges(T):
        per = -(-T // C)
        return [(min(per * c, T), min(per * c + per, T)) for c in range(C)]

    def cpm_of(m):
        T = m.shape[0]
        return np.array([[m[:e, r].sum() for (_, e) in chan_ranges(T)] for r in range(W)], np.int32)

    mine = in_rank_all[RANK]
    cpm = cpm_of(mine)
    rcpm = np.array([[0 if c == 0 else cpm_of(in_rank_all[s])[RANK][c - 1] for c in range(C)] for s in range(W)],
                    np.int32)
    src = np.concatenate([np.nonzero(in_rank_all[s][:, RANK])[0] for s in range(W)]).astype(np.int32)
    T = mine.shape[0]
    head = np.full((T, W), -1, np.int32)
    for (b, e) in chan_ranges(T):
        for r in range(W):
            k = 0
            for t in range(b, e):
                if mine[t, r]:
                    head[t, r] = k
                    k += 1
    return rpm, cpm, rcpm, src, head


def test_dispatch_routes_by_the_callers_mask(buf):
    """DeepEP routes by is_token_in_rank (with or without top-k) and counts by num_tokens_per_expert: a mask that
    differs from topk_idx's layout is followed; the handle is DeepEP's 6-tuple with DeepEP's contents."""
    x, idx, w, n_exp = inputs(("mask", buf.communicator.backend), num_tokens=23)
    lay = buf.get_dispatch_layout(dev(buf, idx), n_exp)
    rng = np.random.default_rng([11, RANK])
    mask = rng.random((x.shape[0], W)) < 0.5                                 # not topk_idx's layout
    per_rank = mask.sum(axis=0).astype(np.int32)
    per_expert = rng.integers(0, 5, size=n_exp).astype(np.int32)
    everything = WORLD.allgather((x, mask, per_expert, idx, w))
    want_x = np.concatenate([xs[m[:, RANK]] for xs, m, _, _, _ in everything])
    epr = n_exp // W
    want_counts = [int(sum(pe[RANK * epr + j] for _, _, pe, _, _ in everything)) for j in range(epr)]
    want_i = np.concatenate([np.where((ids >= RANK * epr) & (ids < (RANK + 1) * epr), ids - RANK * epr, -1)[m[:, RANK]]
                             for _, m, _, ids, _ in everything])
    want_w = np.concatenate([np.where((ids >= RANK * epr) & (ids < (RANK + 1) * epr), ws, 0)[m[:, RANK]]
                             for _, m, _, ids, ws in everything])
    cfg = Config(16)
    plain = buf.dispatch(dev(buf, x), num_tokens_per_rank=dev(buf, per_rank), is_token_in_rank=dev(buf, mask),
                         num_tokens_per_expert=dev(buf, per_expert), config=cfg)
    topk = buf.dispatch(dev(buf, x), num_tokens_per_rank=dev(buf, per_rank), is_token_in_rank=dev(buf, mask),
                        num_tokens_per_expert=dev(buf, per_expert), topk_idx=dev(buf, idx),
                        topk_weights=dev(buf, w), config=cfg)
    worst = buf.dispatch(dev(buf, x), num_tokens_per_rank=dev(buf, per_rank), is_token_in_rank=dev(buf, mask),
                         num_tokens_per_expert=dev(buf, per_expert), topk_idx=dev(buf, idx),
                         topk_weights=dev(buf, w), num_worst_tokens=x.shape[0] * W)
    comb = buf.combine(plain[0], plain[4])
    cached = buf.dispatch(dev(buf, x * 2), handle=plain[4])
    rpm, cpm, rcpm, src, head = deepep_handle_ref([m for _, m, _, _, _ in everything], 8)

    def check():
        np.testing.assert_array_equal(np_(plain[0]), want_x)
        assert plain[1] is None and plain[2] is None and plain[3] == want_counts
        assert isinstance(plain[3], list) and all(type(c) is int for c in plain[3])
        np.testing.assert_array_equal(np_(topk[0]), want_x)
        np.testing.assert_array_equal(np_(topk[1]), want_i)
        np.testing.assert_array_equal(np_(topk[2]), want_w)
        h = plain[4]
        assert isinstance(h, IntranodeHandle) and len(h) == 6 and len(tuple(h)) == 6
        for got, want in zip((h[0], h[1], h[2], h[3], h[5]), (rpm, cpm, rcpm, src, head)):
            assert np_(got).dtype == np.int32
            np.testing.assert_array_equal(np_(got), want)
        assert h[4] is not None and np.array_equal(np_(h[4]), mask)
        n = want_x.shape[0]
        assert worst[3] == [] and np_(worst[0]).shape[0] == x.shape[0] * W
        np.testing.assert_array_equal(np_(worst[0])[:n], want_x)
        np.testing.assert_array_equal(np_(worst[1])[:n], want_i)
        np.testing.assert_array_equal(np_(worst[2])[:n], want_w)
        assert (np_(worst[1])[n:] == -1).all()
        np.testing.assert_array_equal(np_(comb[0]), x * mask.sum(axis=1)[:, None])
        np.testing.assert_array_equal(np_(cached[0]), want_x * 2)

    all_ranks(check)


def test_dispatch_mask_disagreeing_with_per_rank_is_rejected(buf):
    x, idx, w, n_exp = inputs(("maskbad", buf.communicator.backend))
    lay = buf.get_dispatch_layout(dev(buf, idx), n_exp)
    per_rank = np_(lay[0]).copy()
    if RANK == 0:
        per_rank[0] += 1

    def check():
        err = ValueError if RANK == 0 else SymBufferRejectedError
        _rejected_then_right(buf, pytest.raises(err), (x, idx, w, n_exp), lay, num_tokens_per_rank=dev(buf, per_rank))

    all_ranks(check)


def _rejected_then_right(buf, ctx, case, lay, **bad):
    """A mask dispatch of ``case`` (``inputs()``' result) with the layout ``lay`` but the arguments ``bad`` raises
    what ``ctx`` expects (GPU: by synchronize()); the right dispatch right after returns the reference rows."""
    x, idx, w, n_exp = case
    right = dict(num_tokens_per_rank=lay[0], is_token_in_rank=lay[3], num_tokens_per_expert=lay[2])
    with ctx:
        buf.dispatch(dev(buf, x), **{**right, **bad})
        if buf.communicator.backend == "cuda":
            buf.communicator.synchronize()
    out = buf.dispatch(dev(buf, x), **right)
    np.testing.assert_array_equal(np_(out[0]), ref(x, idx, w, n_exp)[0])


@pytest.mark.skipif(W == 1, reason="every length is a multiple of world_size 1")
def test_dispatch_mask_short_per_expert_names_its_length(buf):
    """A num_tokens_per_expert one entry short on rank 0 (its length, num_experts, no longer a multiple of
    world_size): rank 0's ValueError names that argument, its length and what the length must be (not num_experts,
    which the caller did not pass), the peers raise SymBufferRejectedError, and a right dispatch right after returns
    the reference rows."""
    x, idx, w, n_exp = inputs(("maskshort", buf.communicator.backend))
    lay = buf.get_dispatch_layout(dev(buf, idx), n_exp)
    per_expert = np_(lay[2])[: n_exp - 1].copy() if RANK == 0 else np_(lay[2])

    def check():
        if RANK == 0:
            ctx = pytest.raises(ValueError, match=rf"argument 'num_tokens_per_expert' must have one entry per expert "
                                                  rf"\(num_experts, a multiple of world_size \({W}\)\), got "
                                                  rf"{n_exp - 1} entries")
        else:
            ctx = pytest.raises(SymBufferRejectedError)
        _rejected_then_right(buf, ctx, (x, idx, w, n_exp), lay, num_tokens_per_expert=dev(buf, per_expert))

    all_ranks(check)


@pytest.mark.parametrize("worst", [False, True], ids=["eager", "worst"])
def test_dispatch_mask_negative_per_expert_is_rejected(buf, worst):
    """A negative num_tokens_per_expert entry on rank 0 (its mask and num_tokens_per_rank right): rank 0 raises
    ValueError naming the argument and the rule (host: before anything moves; GPU: found on the device, carried by
    the count exchange's reject word), the peers SymBufferRejectedError; in GPU worst-case mode (nothing read on
    the host) every rank's synchronize() raises SymBufferRejectedError. A right dispatch right after returns the
    reference rows and counts on every rank."""
    x, idx, w, n_exp = inputs(("maskneg", worst, buf.communicator.backend))
    lay = buf.get_dispatch_layout(dev(buf, idx), n_exp)
    per_expert = np_(lay[2]).copy()
    if RANK == 0:
        per_expert[n_exp - 1] = -3
    want_x = ref(x, idx, w, n_exp)[0]
    epr = n_exp // W
    want_counts = np.sum([pe[RANK * epr:(RANK + 1) * epr] for pe in WORLD.allgather(np_(lay[2]))], axis=0).tolist()
    kw = dict(topk_idx=dev(buf, idx), topk_weights=dev(buf, w), num_worst_tokens=x.shape[0] * W) if worst else {}
    cuda = buf.communicator.backend == "cuda"

    def check():
        if RANK == 0 and not (cuda and worst):
            ctx = pytest.raises(ValueError, match=r"argument 'num_tokens_per_expert' must hold counts >= 0, got -3 "
                                                  rf"at \[{n_exp - 1}\]")
        else:
            ctx = pytest.raises(SymBufferRejectedError)
        with ctx:
            buf.dispatch(dev(buf, x), num_tokens_per_rank=lay[0], is_token_in_rank=lay[3],
                         num_tokens_per_expert=dev(buf, per_expert), **kw)
            if cuda:
                buf.communicator.synchronize()
        out = buf.dispatch(dev(buf, x), num_tokens_per_rank=lay[0], is_token_in_rank=lay[3],
                           num_tokens_per_expert=lay[2], **kw)
        n = want_x.shape[0]
        np.testing.assert_array_equal(np_(out[0])[:n], want_x)
        if worst:
            assert np_(out[0]).shape[0] == x.shape[0] * W and out[3] == []
        else:
            assert np_(out[0]).shape[0] == n and out[3] == want_counts

    all_ranks(check)


def test_event_overlap_asserts_without_event(buf):
    x, idx, w, n_exp = inputs(("ev", buf.communicator.backend))
    lay = buf.get_dispatch_layout(dev(buf, idx), n_exp)

    def check():
        with pytest.raises(AssertionError, match="async_finish"):
            lay[4].current_stream_wait()
        with lay[4]:  # leaving the block without an event does nothing (as DeepEP)
            pass
        Buffer.capture().current_stream_wait()

    all_ranks(check)


def test_topk_idx_t():
    torch = pytest.importorskip("torch")
    import cupy_symbuf.deepep as face
    assert face.topk_idx_t is torch.int64


def test_low_latency_ue8m0_zero_copy_and_handle(buf):
    """use_ue8m0: DeepEP's packed int32 [..., hidden // 512] scales (exponent bytes), column-major; the handle
    indexes as DeepEP's; the zero-copy combine reads get_next_low_latency_combine_buffer's array."""
    E = 4 * W
    L = E // W
    H = 512
    x, idx, w = ll_inputs(("ue8m0",), LL_N, H, E, LL_K)
    f = buf.low_latency_dispatch(dev(buf, x), dev(buf, idx), LL_N, E, use_fp8=True, round_scale=True)
    f_strides = f[0][1].strides  # (the device array's own: a host copy is C-ordered)
    f_scales = np_(f[0][1]).copy()
    p = buf.low_latency_dispatch(dev(buf, x), dev(buf, idx), LL_N, E, use_fp8=True, round_scale=True,
                                 use_ue8m0=True)
    packed = p[0][1]
    h = p[2]
    b = buf.low_latency_dispatch(dev(buf, x), dev(buf, idx), LL_N, E, use_fp8=False)
    y = np_(b[0]).copy()
    zc = buf.get_next_low_latency_combine_buffer(b[2])
    zc[...] = dev(buf, y)
    junk = dev(buf, np.zeros_like(y))
    got = np_(buf.low_latency_combine(junk, dev(buf, idx), dev(buf, w), b[2], zero_copy=True)[0]).copy()
    want = np_(buf.low_latency_combine(dev(buf, y), dev(buf, idx), dev(buf, w), b[2])[0]).copy()
    if buf.communicator.backend == "cuda":
        import cupy
        cupy.cuda.runtime.deviceSynchronize()
    all_x = WORLD.allgather((x, idx))

    def check():
        assert packed.dtype == np.int32 and tuple(packed.shape) == (L, W * LL_N, H // 512)
        st = packed.strides
        assert st[1] == 4 and st[2] == 4 * W * LL_N                            # column-major last two axes
        assert f_strides[1] == 4 and f_strides[2] == 4 * W * LL_N
        cnt = np_(p[1])
        ref_bytes = (f_scales.view(np.uint32) >> 23).astype(np.uint8)     # NumPy pack of the float32 scales
        ref_packed = np.ascontiguousarray(ref_bytes).view(np.int32)
        for e in range(L):
            np.testing.assert_array_equal(np_(packed)[e, :cnt[e]], ref_packed[e, :cnt[e]])
        assert len(h) == 5 and h[2:] == (LL_N, H, E)
        src, lr = np_(h[0]), np_(h[1])
        assert src.dtype == np.int32 and lr.dtype == np.int64
        for e in range(L):
            ge = RANK * L + e
            want_src = np.concatenate([np.nonzero((ids == ge).any(axis=1))[0] for _, ids in all_x])
            np.testing.assert_array_equal(src[e, :cnt[e]], want_src)
            begin = 0
            for s, (_, ids) in enumerate(all_x):
                n = int((ids == ge).any(axis=1).sum())
                assert int(lr[e, s]) >> 32 == begin and int(lr[e, s]) & 0xFFFFFFFF == n
                begin += n
        np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))

    all_ranks(check)
