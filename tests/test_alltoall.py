"""alltoall / alltoallv against a NumPy reference (allgather + slicing), on every available backend."""
import numpy as np
import pytest
from mpi4py import MPI

import cupy_symbuf as cs
from _util import SymmetricSend, random_rows, reference_alltoallv, rng_for, to_backend, to_numpy

# (small_bytes=0: on the GPU every alltoall goes through these rings, not by the small-message protocol, which the
# `default` fixture's communicator uses for its alltoalls up to 1 MiB and tests/test_small_protocol.py tests)
SMALL_RING = cs.Config(chunk_bytes=1024, num_slots=2, timeout_s=60, small_bytes=0)


# Every test on these fixtures runs three times: with plain sendbufs through the rings (two copies per off-rank
# byte); with sendbufs copied into a symmetric array first (host: direct mode, the receivers copy straight out of
# it); and (host) with plain sendbufs of any size read by cross-memory attach (MODE_CMA).
SEND_KINDS = ["plain", "symmetric", "cma"]


def _make(backend, comm, config, kind, monkeypatch):
    if kind == "cma":
        if backend != "host":
            pytest.skip("cross-memory attach is the host engine's")
        monkeypatch.setattr(cs.wire.protocol, "CMA_MIN_BYTES", 0)  # every plain contiguous sendbuf goes MODE_CMA
    elif kind == "plain":
        monkeypatch.setattr(cs.wire.protocol, "CMA_MIN_BYTES", 1 << 62)  # the rings, whatever the size
    c = cs.Communicator(comm, config, backend=backend)
    if kind == "cma" and c._transport.cma_pids is None and comm.size > 1:
        c.close()
        pytest.skip("cross-memory attach (process_vm_readv) is not allowed between these ranks")
    return c if kind != "symmetric" else SymmetricSend(c, comm)


@pytest.fixture(params=SEND_KINDS)
def small(backend, comm, request, monkeypatch):
    """A communicator with tiny rings (2 x 1 KiB per channel and peer), so most messages pass through the rings."""
    c = _make(backend, comm, SMALL_RING, request.param, monkeypatch)
    yield c
    c.close()


@pytest.fixture(params=SEND_KINDS)
def default(backend, comm, request, monkeypatch):
    c = _make(backend, comm, None, request.param, monkeypatch)
    yield c
    c.close()


def _check_alltoallv(c, comm, send, counts, backend, **kw):
    expected, expected_counts = reference_alltoallv(comm, send, counts)
    got, got_counts = c.alltoallv(to_backend(send, backend), counts, **kw)
    assert type(got).__module__.split(".")[0] == ("cupy" if backend == "cuda" else "numpy")
    np.testing.assert_array_equal(got_counts, expected_counts)
    assert got.dtype == send.dtype and got.shape == expected.shape
    np.testing.assert_array_equal(to_numpy(got).view(np.uint8), expected.view(np.uint8))
    return got


@pytest.mark.parametrize("dtype, row_shape", [(np.float32, (33,)), (np.int8, ()), (np.uint16, (7,)),
                                              (np.float64, (2, 3)), (np.uint8, (14,))])
def test_alltoall_dtypes(small, comm, backend, dtype, row_shape):
    rng = rng_for(comm, 1)
    x = random_rows(rng, comm.size, row_shape, dtype)
    everything = comm.allgather(x)
    y = small.alltoall(to_backend(x, backend))
    expected = np.stack([everything[j][comm.rank] for j in range(comm.size)])
    np.testing.assert_array_equal(to_numpy(y).view(np.uint8), expected.view(np.uint8))


def test_alltoallv_uneven_random(small, comm, backend):
    rng = rng_for(comm, 2)
    for trial in range(3):
        counts = rng.integers(0, 40, comm.size)
        send = random_rows(rng, int(counts.sum()), (5,), np.float32)
        _check_alltoallv(small, comm, send, counts, backend)


def test_rank_sends_nothing(small, comm, backend):
    """Rank 0 sends 0 rows to everyone (so rank 3 receives 0 from rank 0 and must not hang)."""
    rng = rng_for(comm, 3)
    counts = np.zeros(comm.size, np.int64) if comm.rank == 0 else rng.integers(1, 9, comm.size)
    send = random_rows(rng, int(counts.sum()), (3,), np.int32)
    _check_alltoallv(small, comm, send, counts, backend)


def test_zero_to_one_peer(small, comm, backend):
    """Rank 0 sends 0 rows to the last rank only; the receiver's count comes from the sender."""
    rng = rng_for(comm, 4)
    counts = rng.integers(1, 9, comm.size)
    if comm.rank == 0:
        counts[-1] = 0
    send = random_rows(rng, int(counts.sum()), (2,), np.float32)
    got = _check_alltoallv(small, comm, send, counts, backend)
    assert got.shape[0] == sum(int(c[comm.rank]) for c in comm.allgather(counts))


def test_all_rows_to_one_rank(small, comm, backend):
    rng = rng_for(comm, 5)
    counts = np.zeros(comm.size, np.int64)
    counts[comm.size - 1] = 37
    send = random_rows(rng, 37, (11,), np.uint8)
    _check_alltoallv(small, comm, send, counts, backend)


def test_everything_empty(small, comm, backend):
    counts = np.zeros(comm.size, np.int64)
    send = np.zeros((0, 4), np.float32)
    got = _check_alltoallv(small, comm, send, counts, backend)
    assert got.shape == (0, 4)


def test_zero_width_rows(small, comm, backend):
    """alltoall of rows with no elements (``[world_size, 0]``, as mpi4py's Alltoall of count 0 makes): an empty
    result of the same shape on every rank, and the next call is right."""
    W = comm.size
    for shape in ((W, 0), (W, 0, 3)):
        got = small.alltoall(to_backend(np.empty(shape, np.float64), backend))
        assert to_numpy(got).shape == shape
    send = random_rows(rng_for(comm, 71), W, (2, 5), np.float32)
    got = to_numpy(small.alltoall(to_backend(send, backend)))
    want = np.stack([theirs[comm.rank] for theirs in comm.allgather(send)])  # row j of rank j's send: ours
    np.testing.assert_array_equal(got, want)


def test_one_rank_communicator(backend, comm):
    with cs.Communicator(MPI.COMM_SELF, SMALL_RING, backend=backend) as c:
        rng = rng_for(comm, 6)
        x = random_rows(rng, 1, (100,), np.float32)
        np.testing.assert_array_equal(to_numpy(c.alltoall(to_backend(x, backend))), x)
        y, rc = c.alltoallv(to_backend(x, backend), [1])
        np.testing.assert_array_equal(to_numpy(y), x)
        assert rc.tolist() == [1]


def test_messages_many_times_larger_than_ring(small, comm, backend):
    """Each (channel, peer) ring holds 2 KiB; ~200 KiB per peer must pass through it."""
    rng = rng_for(comm, 7)
    counts = rng.integers(150, 250, comm.size)
    send = random_rows(rng, int(counts.sum()), (256,), np.float32)  # 1 KiB rows
    ring = small.layout.ring_bytes
    assert send.nbytes // comm.size > 50 * ring
    _check_alltoallv(small, comm, send, counts, backend)


@pytest.mark.parametrize("row_bytes", [1, 14])
def test_odd_row_sizes(small, comm, backend, row_bytes):
    rng = rng_for(comm, 8 + row_bytes)
    counts = rng.integers(0, 300, comm.size)
    send = random_rows(rng, int(counts.sum()), (row_bytes,), np.uint8)
    _check_alltoallv(small, comm, send, counts, backend)


def test_repeats_are_bitwise_identical(default, comm, backend):
    """100 runs on the same input: any difference between runs is a race."""
    rng = rng_for(comm, 9)
    counts = rng.integers(0, 64, comm.size)
    send = random_rows(rng, int(counts.sum()), (7168 // 2,), np.uint16)  # bf16-sized rows as raw bits
    expected, _ = reference_alltoallv(comm, send, counts)
    dev = to_backend(send, backend)
    recv_counts = None
    for i in range(100):
        got, recv_counts = default.alltoallv(dev, counts, recv_counts=recv_counts if i % 2 else None)
        if i % 10 == 0 or i == 99:
            assert np.array_equal(to_numpy(got), expected), f"run {i} differs"


def test_repeat_calls_recheck_counts_changed_in_place(small, comm, backend):
    """A repeated alltoallv remembers the checks of the count values it saw: the same arrays changed in place
    (other valid counts, then invalid ones) are checked and moved afresh, and the returned recv_counts belong to
    the caller (writing into them changes no later call)."""
    rng = rng_for(comm, 21)
    W = comm.size
    counts = rng.integers(0, 9, W).astype(np.int64)
    send = random_rows(rng, 64, (5,), np.float32)
    for step in range(4):
        n = int(counts.sum())
        expected, expected_counts = reference_alltoallv(comm, send[:n], counts)
        recv_counts = expected_counts.copy()
        for kw in ({}, {"recv_counts": recv_counts}):
            got, got_counts = small.alltoallv(to_backend(send[:n], backend), counts, **kw)
            np.testing.assert_array_equal(got_counts, expected_counts)
            np.testing.assert_array_equal(to_numpy(got), expected)
            got_counts[:] = -7  # the caller's array: must not leak into the next call's checks or result
        out = to_backend(np.full_like(expected, np.nan), backend)
        got, got_counts = small.alltoallv(to_backend(send[:n], backend), counts, recv_counts=recv_counts, out=out)
        assert got is out
        np.testing.assert_array_equal(to_numpy(out), expected)
        np.testing.assert_array_equal(got_counts, expected_counts)
        counts[:] = rng.integers(0, 9, W)  # in place: same object, other values
    # in place to values that fail the checks: rejected on this rank like a fresh call, the peers told
    bad = counts.copy()
    bad[0] = -1
    if comm.rank == 0:
        counts[:] = bad
    n = int(counts.sum()) if comm.rank else 0
    with pytest.raises(ValueError, match="send_counts' must be >= 0" if comm.rank == 0 else "rank 0 rejected"):
        small.alltoallv(to_backend(send[:max(n, 0)], backend), counts)
    counts[:] = np.abs(bad)
    _check_alltoallv(small, comm, send[:int(counts.sum())], counts, backend)


def test_non_contiguous_input(small, comm, backend):
    rng = rng_for(comm, 10)
    counts = rng.integers(0, 20, comm.size)
    big = random_rows(rng, int(counts.sum()), (24,), np.float32)
    view = to_backend(big, backend)[:, ::3]
    expected, _ = reference_alltoallv(comm, np.ascontiguousarray(big[:, ::3]), counts)
    got, _ = small.alltoallv(view, counts)
    np.testing.assert_array_equal(to_numpy(got), expected)


def test_bf16_rows(small, comm, backend):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = rng_for(comm, 11)
    counts = rng.integers(0, 6, comm.size)
    x = rng.standard_normal((int(counts.sum()), 7168)).astype(ml_dtypes.bfloat16)
    if backend == "cuda":
        x = x.view(np.uint16)  # CuPy moves bf16 as raw 16-bit words
    _check_alltoallv(small, comm, x, counts, backend)


def test_bad_inputs_leave_communicator_usable(small, comm, backend):
    rng = rng_for(comm, 12)
    W = comm.size
    good = random_rows(rng, W, (4,), np.float32)
    with pytest.raises(ValueError, match=r"alltoall: argument 'sendbuf' must have shape\[0\] == world_size"):
        small.alltoall(to_backend(good[:0] if W > 0 else good, backend))
    with pytest.raises(ValueError, match="alltoallv: argument 'send_counts' must sum"):
        small.alltoallv(to_backend(good, backend), np.full(W, 2))
    with pytest.raises(ValueError, match="alltoallv: argument 'send_counts' must be >= 0"):
        small.alltoallv(to_backend(good, backend), np.array([-1] + [1] * (W - 1) + [0])[:W] if W > 1 else [-1])
    with pytest.raises(ValueError, match=r"alltoallv: argument 'send_counts' must have shape"):
        small.alltoallv(to_backend(good, backend), np.ones(W + 1, np.int64))
    with pytest.raises(TypeError, match="alltoallv: argument 'send_counts' must hold integers"):
        small.alltoallv(to_backend(good, backend), np.ones(W) * 1.5)
    wrong = good if backend == "cuda" else _other_module(good)
    if wrong is not None:
        with pytest.raises(TypeError, match="alltoall: argument 'sendbuf'"):
            small.alltoall(wrong)
    with pytest.raises(TypeError, match="alltoall: argument 'sendbuf'"):
        small.alltoall([[1.0]] * W)
    # still works
    counts = np.ones(W, np.int64)
    _check_alltoallv(small, comm, good, counts, backend)


def _other_module(x):
    try:
        import cupy
        if cupy.cuda.is_available():
            return cupy.asarray(x)
    except Exception:
        pass
    return None


@pytest.mark.parametrize("raised_by", ["call", "synchronize", "next_call"])
def test_timeout_names_rank_peer_channel(backend, comm, raised_by):
    """A peer that never joins: the waiting rank gets a timeout naming rank, peer, channel, head and tail.
    ``call``: Config(blocking=True) (and always on the host) raises from the call itself. GPU default (calls return
    once queued): the call returns at once, and the error comes from synchronize() or from the next call, which
    names the earlier collective that failed."""
    if comm.size < 2:
        pytest.skip("needs two ranks")
    if backend == "host" and raised_by != "call":
        pytest.skip("host calls complete before returning")
    import time
    c = cs.Communicator(comm, cs.Config(chunk_bytes=1024, num_slots=2, timeout_s=1.0,
                                        blocking=raised_by == "call"), backend=backend)
    failure = None
    try:
        if comm.rank == 0:
            # 256 KiB to rank 1 through rings of 2 x 1 KiB per channel: far more than every channel can hold.
            rows = 64 * c.layout.num_channels
            assert rows * 4096 > 4 * c.layout.num_channels * c.layout.ring_bytes
            x = to_backend(np.ones((rows, 1024), np.float32), backend)
            counts = np.zeros(comm.size, np.int64)
            counts[1] = rows
            none = np.zeros(comm.size, np.int64)
            try:
                if raised_by == "call":
                    with pytest.raises(cs.SymBufferTimeoutError) as info:
                        c.alltoallv(x, counts, recv_counts=none)
                else:
                    t0 = time.monotonic()
                    c.alltoallv(x, counts, recv_counts=none)  # queued: returns without waiting for the peer
                    assert time.monotonic() - t0 < 0.5
                    with pytest.raises(cs.SymBufferTimeoutError) as info:
                        if raised_by == "synchronize":
                            c.synchronize()
                        else:
                            time.sleep(3.0)  # the queued kernel records its timeout after 1 s
                            c.alltoall(to_backend(np.ones((comm.size, 1), np.float32), backend))
                err = info.value
                # the sender waits for ring space, or a receiver for a call header (whichever expires first; the
                # other ranks never call)
                assert err.rank == 0 and err.peer != 0 and err.role in ("send", "recv")  # no peer ever calls
                if err.role == "send":  # the waiting chunk's counter is a full ring or more ahead of what was freed
                    assert err.tail - err.head >= c.config.num_slots
                else:  # no header ever came: tail == head
                    assert err.tail == err.head
                assert f"rank 0, peer {err.peer}, channel" in str(err) and "head=" in str(err) and "tail=" in str(err)
                assert err.op.startswith("alltoallv")  # the collective that failed, also when a later one found it
                if raised_by != "call":
                    assert f"found by {'synchronize' if raised_by == 'synchronize' else 'alltoall'}" in err.op
                with pytest.raises(cs.SymBufferError, match="unusable"):
                    c.alltoall(to_backend(np.ones((comm.size, 1), np.float32), backend))
            except BaseException as exc:  # keep the other ranks in step: report after the barrier
                failure = exc
    finally:
        comm.Barrier()
        c.close()
    if failure is not None:
        raise failure


def test_collectives_keep_call_order_across_streams(default, comm, backend):
    """Calls issued on different CUDA streams, back to back without waiting, still run in call order (each kernel
    starts from the ring counters the previous one left): results equal the NumPy reference, 20 rounds."""
    if backend != "cuda":
        pytest.skip("CUDA streams only")
    import cupy
    rng = rng_for(comm, 91)
    streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(3)]
    sends, outs = [], []
    for i in range(20):
        counts = rng.integers(0, 300, comm.size)
        send = random_rows(rng, int(counts.sum()), (37,), np.float32)
        expected, recv_counts = reference_alltoallv(comm, send, counts)
        x = cupy.asarray(send)
        cupy.cuda.get_current_stream().synchronize()
        with streams[i % 3]:  # recv_counts given: no count exchange, nothing waits between the calls
            got, _ = default.alltoallv(x, counts, recv_counts=recv_counts)
        sends.append(x)
        outs.append((got, expected, streams[i % 3]))
    default.synchronize()
    for got, expected, stream in outs:
        stream.synchronize()
        np.testing.assert_array_equal(cupy.asnumpy(got), expected)


def test_send_buffer_filled_on_non_default_stream(default, comm, backend):
    """A kernel on a non-default stream fills the send buffer right before the collective on that stream:
    the collective must run after it (stream order), 100 times, with identical results."""
    if backend != "cuda":
        pytest.skip("CUDA streams only")
    import cupy
    W = comm.size
    counts = np.full(W, 512, np.int64)
    stream = cupy.cuda.Stream(non_blocking=True)
    fill = cupy.ElementwiseKernel("int64 seed", "float32 y",
                                  "y = (float)((i * 2654435761ll + seed) % 1000003)", "symbuf_test_fill")
    first = None
    with stream:
        x = cupy.empty((int(counts.sum()), 1024), cupy.float32)
        for run in range(100):
            x.fill(-1.0)  # poison, then refill: a collective that ran early would send -1s
            fill(np.int64(comm.rank * 7 + 1), x)
            got, _ = default.alltoallv(x, counts, recv_counts=counts)
            host = got.get()
            if first is None:
                first = host
                for s in range(W):  # reference: what rank s's fill kernel wrote into its block for us
                    idx = (np.arange(comm.rank * 512 * 1024, (comm.rank + 1) * 512 * 1024, dtype=np.int64))
                    ref = ((idx * 2654435761 + (s * 7 + 1)) % 1000003).astype(np.float32).reshape(512, 1024)
                    np.testing.assert_array_equal(host[s * 512:(s + 1) * 512], ref)
            else:
                assert np.array_equal(host, first), f"run {run} differs"


def test_mismatched_rows_across_ranks_raise_everywhere(small, comm, backend):
    """A rank whose rows differ in dtype or shape: every rank raises in the notify step, before payload moves,
    and the communicator still works afterwards."""
    if comm.size < 2:
        pytest.skip("needs two ranks")
    rng = rng_for(comm, 13)
    counts = np.ones(comm.size, np.int64)
    width = 5 if comm.rank == 0 else 4
    x = random_rows(rng, comm.size, (width,), np.float32)
    with pytest.raises(ValueError, match="same dtype and row shape"):
        small.alltoallv(to_backend(x, backend), counts)
    y = random_rows(rng, comm.size, (4,), np.float64 if comm.rank == 1 else np.int64)
    with pytest.raises(ValueError, match="same dtype and row shape"):
        small.alltoallv(to_backend(y, backend), counts)
    good = random_rows(rng, comm.size, (4,), np.float32)
    _check_alltoallv(small, comm, good, counts, backend)


def test_argument_edge_cases(small, comm, backend):
    W = comm.size
    # object arrays: rejected on the host for their dtype, on cuda for not being on the GPU
    with pytest.raises(TypeError, match="object references" if backend == "host" else "must be a CuPy array"):
        small.alltoall(np.array([object()] * W, dtype=object))
    with pytest.raises(ValueError, match="at least 1 dimension"):
        small.alltoall(to_backend(np.array(5.0), backend))
    with pytest.raises(ValueError, match="fit in int64"):
        small.alltoallv(to_backend(np.zeros((W, 1), np.float32), backend), np.full(W, 2 ** 63, np.uint64))
    # still usable
    _check_alltoallv(small, comm, random_rows(rng_for(comm, 14), W, (3,), np.float32), np.ones(W, np.int64), backend)


def test_dlpack_inputs(small, comm, backend):
    """alltoall/alltoallv take any DLPack object (PyTorch tensors) zero-copy, with results equal to the array's."""
    from _util import DLPackOnly
    rng = rng_for(comm, 21)
    x = random_rows(rng, comm.size * 3, (5,), np.float32)
    counts = np.full(comm.size, 3, np.int64)
    expected, _ = reference_alltoallv(comm, x, counts)
    got, _ = small.alltoallv(DLPackOnly(to_backend(x, backend)), counts)
    np.testing.assert_array_equal(to_numpy(got), expected)
    y = random_rows(rng, comm.size, (4,), np.int32)
    np.testing.assert_array_equal(to_numpy(small.alltoall(DLPackOnly(to_backend(y, backend)))),
                                  reference_alltoallv(comm, y, np.ones(comm.size, np.int64))[0])
    try:
        import torch
    except Exception:
        return
    t = torch.from_numpy(x) if backend == "host" else torch.from_dlpack(to_backend(x, backend))
    got, _ = small.alltoallv(t, counts)
    np.testing.assert_array_equal(to_numpy(got), expected)


@pytest.mark.parametrize("known", [False, True])
def test_repeat_calls_recheck_counts_of_other_byte_order(small, comm, backend, known):
    """The remembered count checks tell the byte order apart: after valid little-endian counts, a big-endian view
    of the same bytes (other values: 2**56 for a 1) is checked afresh and rejected, the peers told."""
    rng = rng_for(comm, 23)
    W = comm.size
    counts = np.ones(W, dtype="<i8")
    send = random_rows(rng, W, (3,), np.float32)
    expected, expected_counts = reference_alltoallv(comm, send, counts)
    kw = {"recv_counts": expected_counts.astype("<i8")} if known else {}
    got, _ = small.alltoallv(to_backend(send, backend), counts, **kw)
    np.testing.assert_array_equal(to_numpy(got), expected)
    swapped = counts.view(">i8") if comm.rank == 0 else counts
    with pytest.raises(ValueError, match="send_counts' must sum to" if comm.rank == 0 else "rank 0 rejected"):
        small.alltoallv(to_backend(send, backend), swapped, **kw)
        small.synchronize()  # (GPU: a queued call's rejection by a peer is raised here; host: by the call)
    if known:  # the same for the receive counts the caller gives
        bad = {"recv_counts": kw["recv_counts"].view(">i8")} if comm.rank == 0 else kw
        with pytest.raises(ValueError, match="recv_counts" if comm.rank == 0 else "rank 0 rejected"):
            small.alltoallv(to_backend(send, backend), counts, **bad)
            small.synchronize()
    got, _ = small.alltoallv(to_backend(send, backend), counts, **kw)
    np.testing.assert_array_equal(to_numpy(got), expected)


def test_host_runs_of_one_slot_take_channel_0_alone(comm):
    """Host cut (``protocol.host_run_channels``, ``host_run_inline``): a run that fits one ring slot moves behind one
    call header, on channel 0 (a short one inside the header's slot); a longer one on every channel; a rank's
    sender state counters show it (channel 1's does not move for a short run), and all arrive exactly as NumPy
    says, into poisoned outputs."""
    if comm.size < 2:
        pytest.skip("needs peers")
    c = cs.Communicator(comm, SMALL_RING, backend="host")
    try:
        t, L, me, W = c._transport, c.layout, comm.rank, comm.size
        assert L.num_channels == 2
        rng = rng_for(comm, 41)

        def counters():
            return np.array([[int(t._u64(me, L.send_tail_offset(ch, p))[0]) for p in range(W) if p != me]
                             for ch in range(L.num_channels)])
        # (per-peer bytes, channels, slots on channel 0: a run of at most HOST_CHUNK_LEAST_BYTES that fits the
        # header's slot rides in it, a longer one follows in chunks)
        for per_peer, channels, slots in ((512, 1, 1), (L.chunk_bytes - 8, 1, 2), (L.chunk_bytes + 8, 2, None),
                                          (0, 1, 1)):
            x = random_rows(rng, W, (per_peer // 4,), np.float32)
            before = counters()
            out = np.full_like(x, np.nan)
            np.testing.assert_array_equal(c.alltoall(x, out=out).view(np.uint32),
                                          _a2a_ref(comm, x).view(np.uint32))
            moved = counters() - before
            assert (moved[:channels] > 0).all() and (moved[channels:] == 0).all(), (per_peer, moved)
            assert slots is None or (moved[0] == slots).all(), (per_peer, moved)
    finally:
        c.close()


def _a2a_ref(comm, x):
    everything = comm.allgather(x)
    return np.stack([everything[j][comm.rank] for j in range(comm.size)])
