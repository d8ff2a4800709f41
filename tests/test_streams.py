"""``stream=`` and ``async_op=`` on every collective (cupy_symbuf.transport.streams), against NumPy references.

Runs on 1 rank and under ``mpiexec -n 2/4``; on every backend available (host always; cuda where CuPy sees a GPU).
On the GPU the collectives run on a non-default stream whose memory pool was first filled with garbage (poisoned),
so an output the collective failed to write shows.
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest
from mpi4py import MPI

import cupy_symbuf as cs
from _util import all_ranks, reference_alltoallv, to_numpy
from conftest import _gpu_for_rank, available_backends
from cupy_symbuf import CollectiveEvent, SymBufferRejectedError

WORLD = MPI.COMM_WORLD
RANK = WORLD.Get_rank()
W = WORLD.Get_size()


@pytest.fixture(scope="module", params=available_backends())
def sc(request):
    if request.param == "cuda":
        import cupy
        cupy.cuda.Device(_gpu_for_rank()).use()
    c = cs.Communicator(WORLD, backend=request.param)
    yield c
    c.close()


def rng_for(*key):
    return np.random.default_rng([zlib.crc32(repr(key).encode()), RANK])


def dev(c, a):
    if c.backend == "host":
        return a
    import cupy
    return cupy.asarray(a)


def side_stream(c):
    """A non-default stream (None on the host) whose pool holds freed garbage, ordered after the current stream
    (the inputs were made there)."""
    if c.backend == "host":
        return None
    import cupy
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        junk = [cupy.full(n, 0x7FC0DEAD, dtype=np.uint32) for n in (1 << 10, 1 << 14, 1 << 18)]
    s.synchronize()
    del junk
    s.wait_event(cupy.cuda.get_current_stream().record())
    return s


def ref_dispatch(x, idx, num_experts):
    """recv rows of this rank (source rank, then token) and combine reference of recv_x sent straight back."""
    everything = WORLD.allgather((x, idx))
    epr = num_experts // W
    rows = []
    for s, (xs, ids) in enumerate(everything):
        for t in range(xs.shape[0]):
            if any(int(e) >= 0 and int(e) // epr == RANK for e in ids[t]):
                rows.append(xs[t])
    recv = np.stack(rows) if rows else np.zeros((0, x.shape[1]), x.dtype)
    n_ranks = np.array([len({int(e) // epr for e in row if e >= 0}) for row in idx], dtype=np.float32)
    return recv, x * n_ranks[:, None]


def moe_inputs(key, num_tokens=24, hidden=16, num_experts=None, topk=3):
    rng = rng_for(*key)
    num_experts = num_experts or 4 * W
    idx = np.stack([rng.choice(num_experts, size=topk, replace=False) for _ in range(num_tokens)]).astype(np.int64)
    idx[rng.random(idx.shape) < 0.2] = -1
    x = rng.integers(-8, 9, size=(num_tokens, hidden)).astype(np.float32)  # small integers: exact sums
    return x, idx, num_experts


# ------------------------------------------------------------------------------------------------ same data


def test_alltoall_on_stream_and_async(sc):
    rng = rng_for("a2a", sc.backend)
    x = rng.integers(0, 1 << 30, size=(W, 37)).astype(np.int32)
    everything = WORLD.allgather(x)
    want = np.stack([everything[j][RANK] for j in range(W)])
    s = side_stream(sc)
    default = sc.alltoall(dev(sc, x))
    on_stream = sc.alltoall(dev(sc, x), stream=s)
    ev = sc.alltoall(dev(sc, x), stream=s, async_op=True)
    ev_default = sc.alltoall(dev(sc, x), async_op=True)

    def check():
        assert isinstance(ev, CollectiveEvent) and isinstance(ev_default, CollectiveEvent)
        np.testing.assert_array_equal(to_numpy(default), want)
        if s is not None:
            s.synchronize()
        np.testing.assert_array_equal(to_numpy(on_stream), want)
        got = ev.wait()  # the current stream waits; the result is then readable in its order
        np.testing.assert_array_equal(to_numpy(got), want)
        np.testing.assert_array_equal(to_numpy(ev_default.synchronize()), want)
        assert ev.query() and ev_default.query()
        if sc.backend == "host":
            assert ev.stream is None and ev.event is None
        else:
            assert ev.stream.ptr == s.ptr

    all_ranks(check)


def test_alltoallv_on_stream_and_async(sc):
    rng = rng_for("a2av", sc.backend)
    counts = rng.integers(0, 9, W)
    send = rng.standard_normal((int(counts.sum()), 5)).astype(np.float32)
    want, want_counts = reference_alltoallv(WORLD, send, counts)
    s = side_stream(sc)
    got, got_counts = sc.alltoallv(dev(sc, send), counts, stream=s)
    ev = sc.alltoallv(dev(sc, send), counts, recv_counts=want_counts, stream=s, async_op=True)

    def check():
        if s is not None:
            s.synchronize()
        np.testing.assert_array_equal(got_counts, want_counts)
        np.testing.assert_array_equal(to_numpy(got), want)
        r, rc = ev.synchronize()
        assert ev.result[0] is r
        np.testing.assert_array_equal(rc, want_counts)
        np.testing.assert_array_equal(to_numpy(r), want)

    all_ranks(check)


def test_moe_on_stream_and_async(sc):
    x, idx, n_exp = moe_inputs(("moe", sc.backend))
    want_recv, want_comb = ref_dispatch(x, idx, n_exp)
    s = side_stream(sc)
    lay0 = sc.get_dispatch_layout(dev(sc, idx), n_exp)
    lay_ev = sc.get_dispatch_layout(dev(sc, idx), n_exp, stream=s, async_op=True)
    ev = sc.dispatch(dev(sc, x), dev(sc, idx), None, n_exp, stream=s, async_op=True)
    recv_x, recv_idx, _, counts, handle = ev.result
    ev.wait(s)  # a no-op wait on its own stream: allowed
    cev = sc.combine(recv_x, handle, stream=s, async_op=True)
    cached = sc.dispatch(dev(sc, x), handle=handle, stream=s)

    def check():
        lay = lay_ev.synchronize()
        for a, b in zip(lay0, lay):
            np.testing.assert_array_equal(to_numpy(a), to_numpy(b))
        with cev:  # context manager: the current stream waits when the block ends
            pass
        comb, comb_w = cev.result
        if s is not None:
            s.synchronize()
        np.testing.assert_array_equal(to_numpy(recv_x), want_recv)
        assert recv_idx.shape == (want_recv.shape[0], idx.shape[1])
        assert sum(counts) == int((to_numpy(recv_idx) >= 0).sum())
        np.testing.assert_array_equal(to_numpy(comb), want_comb)
        assert comb_w is None
        np.testing.assert_array_equal(to_numpy(cached[0]), want_recv)
        assert cached[4] is handle

    all_ranks(check)


def test_keywords_unused_keep_return_values(sc):
    """Without the new keywords nothing changes: plain return values, never a CollectiveEvent."""
    x = np.arange(W * 3, dtype=np.float32).reshape(W, 3)
    out = sc.alltoall(dev(sc, x), stream=None, async_op=False)
    assert not isinstance(out, CollectiveEvent) and tuple(out.shape) == (W, 3)
    r = sc.alltoallv(dev(sc, x), np.ones(W, np.int64), stream=None, async_op=False)
    assert isinstance(r, tuple) and len(r) == 2


# ------------------------------------------------------------------------------------------------ bad arguments


class _NotAStream:
    ptr = "nope"


@pytest.mark.parametrize("bad", ["abc", 5, 1.5, _NotAStream(), object()], ids=["str", "int", "float", "ptr_str",
                                                                             "object"])
def test_bad_stream_then_usable(sc, bad):
    x = np.arange(W * 2, dtype=np.int64).reshape(W, 2) + 100 * RANK
    idx = np.zeros((4, 1), np.int64)

    def check():
        for call in (lambda: sc.alltoall(dev(sc, x), stream=bad),
                     lambda: sc.alltoallv(dev(sc, x), np.ones(W, np.int64), stream=bad),
                     lambda: sc.get_dispatch_layout(dev(sc, idx), W, stream=bad),
                     lambda: sc.dispatch(dev(sc, x.astype(np.float32)), dev(sc, idx), None, W, stream=bad)):
            with pytest.raises(TypeError, match="'stream'"):
                call()
        y = sc.alltoall(dev(sc, x))
        np.testing.assert_array_equal(to_numpy(y)[:, 0], np.arange(W) * 100 + 2 * RANK)

    all_ranks(check)


def test_bad_async_op_then_usable(sc):
    x = np.ones((W, 2), np.float32)

    def check():
        with pytest.raises(TypeError, match="'async_op'"):
            sc.alltoall(dev(sc, x), async_op="yes")
        with pytest.raises(TypeError, match="'async_op'"):
            sc.alltoallv(dev(sc, x), np.ones(W, np.int64), async_op=1)
        np.testing.assert_array_equal(to_numpy(sc.alltoall(dev(sc, x))), x)

    all_ranks(check)


def test_host_stream_must_be_none():
    c = cs.Communicator(WORLD, backend="host")
    try:
        class FakeTorchStream:
            cuda_stream = 0
            device_index = 0

        def check():
            with pytest.raises(TypeError, match="'stream' must be None on the host backend"):
                c.alltoall(np.zeros((W, 1)), stream=FakeTorchStream())
            ev = c.alltoall(np.zeros((W, 1)), async_op=True)
            with pytest.raises(TypeError, match="'stream' must be None on the host backend"):
                ev.wait(FakeTorchStream())
            assert ev.query() and ev.wait() is ev.result
            with ev:
                pass

        all_ranks(check)
    finally:
        c.close()


@pytest.mark.skipif(W == 1, reason="needs peers")
def test_bad_stream_on_one_rank_is_told_to_peers(sc):
    """Rank 0 passes a bad stream to alltoallv (count exchange first): it raises TypeError, the peers
    SymBufferRejectedError, and the communicator stays usable."""
    send = np.ones((W, 3), np.float32)

    def check():
        if RANK == 0:
            with pytest.raises(TypeError, match="'stream'"):
                sc.alltoallv(dev(sc, send), np.ones(W, np.int64), stream="bad")
        else:
            with pytest.raises(SymBufferRejectedError):
                sc.alltoallv(dev(sc, send), np.ones(W, np.int64))
        r, rc = sc.alltoallv(dev(sc, send), np.ones(W, np.int64))
        np.testing.assert_array_equal(rc, np.ones(W))

    all_ranks(check)


# ------------------------------------------------------------------------------------------------ GPU only

needs_cuda = pytest.mark.skipif("cuda" not in available_backends(), reason="needs CuPy and a GPU")


@needs_cuda
def test_gpu_overlap_matmul_and_dispatch():
    """A matmul on one stream overlaps a dispatch + combine on another; both checked against NumPy."""
    import cupy
    cupy.cuda.Device(_gpu_for_rank()).use()
    c = cs.Communicator(WORLD, backend="cuda")
    try:
        rng = rng_for("overlap")
        a = rng.integers(-3, 4, size=(512, 512)).astype(np.float32)
        b = rng.integers(-3, 4, size=(512, 512)).astype(np.float32)
        x, idx, n_exp = moe_inputs(("overlap-moe",), num_tokens=64, hidden=64)
        want_recv, want_comb = ref_dispatch(x, idx, n_exp)
        da, db, dx, didx = (cupy.asarray(v) for v in (a, b, x, idx))
        cupy.cuda.get_current_stream().synchronize()
        s_compute = cupy.cuda.Stream(non_blocking=True)
        s_comm = cupy.cuda.Stream(non_blocking=True)
        with s_compute:
            prod = da
            for _ in range(2):  # 2 rounds: every partial sum is a multiple of 1/64 below 2**18, exact in float32
                prod = prod @ db
                prod = prod / 64.0
        ev = c.dispatch(dx, didx, None, n_exp, stream=s_comm, async_op=True)
        recv_x, _, _, _, handle = ev.result
        comb = c.combine(recv_x, handle, stream=s_comm, async_op=True)
        comb.wait(s_compute)  # the compute stream now waits for the collectives, without a host block
        with s_compute:
            both = comb.result[0] + 0
        s_compute.synchronize()
        ev.synchronize()
        comb.synchronize()
        ref = a
        for _ in range(2):
            ref = ref @ b / 64.0

        def check():
            np.testing.assert_allclose(prod.get(), ref, rtol=1e-6, atol=0)
            np.testing.assert_array_equal(recv_x.get(), want_recv)
            np.testing.assert_array_equal(both.get(), want_comb)

        all_ranks(check)
    finally:
        c.close()


@needs_cuda
def test_gpu_torch_stream():
    torch = pytest.importorskip("torch")
    import cupy
    cupy.cuda.Device(_gpu_for_rank()).use()
    torch.cuda.set_device(_gpu_for_rank())
    c = cs.Communicator(WORLD, backend="cuda")
    try:
        x = torch.arange(W * 4, dtype=torch.float32, device="cuda").reshape(W, 4) + 1000 * RANK
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        ev = c.alltoall(x, stream=s, async_op=True)
        ev.wait(torch.cuda.current_stream())
        got = torch.from_dlpack(ev.result).cpu().numpy()
        everything = WORLD.allgather(x.cpu().numpy())
        want = np.stack([everything[j][RANK] for j in range(W)])
        all_ranks(lambda: np.testing.assert_array_equal(got, want))
    finally:
        c.close()
