"""Symmetric arrays (Communicator.empty / zeros / array / free) and direct mode (the receivers copy straight out of
the sender's symmetric array), against NumPy references; the whole alltoall suite also runs with symmetric
sendbufs (tests/test_alltoall.py, SymmetricSend)."""
import dataclasses

import numpy as np
import pytest

import cupy_symbuf as cs
from cupy_symbuf.transport import host as _host
from _util import all_ranks, random_rows, reference_alltoallv, rng_for, to_backend, to_numpy


@pytest.fixture
def pulls(monkeypatch):
    """Counts the direct-mode copies this rank's host engine makes (HostTransport._pull)."""
    calls = {"n": 0}
    real = _host.HostTransport._pull

    def spy(self, *a, **k):
        calls["n"] += 1
        return real(self, *a, **k)
    monkeypatch.setattr(_host.HostTransport, "_pull", spy)
    return calls


def _close_failed(c):
    """Close a communicator a test made fail (its close may raise the failure again: already checked)."""
    try:
        c.close()
    except cs.SymBufferError:
        pass


def _a2a_reference(comm, x):
    everything = comm.allgather(x)
    return np.stack([everything[j][comm.rank] for j in range(comm.size)])


def test_empty_zeros_array(backend, comm):
    c = cs.Communicator(comm, backend=backend)
    try:
        a = c.empty((3, 5), np.int16)
        z = c.zeros(7, np.float64)
        src = random_rows(rng_for(comm, 1), 4, (6,), np.float32)
        b = c.array(to_backend(src, backend))
        xp = c.xp
        assert isinstance(a, xp.ndarray) and a.shape == (3, 5) and a.dtype == np.int16
        assert z.shape == (7,) and to_numpy(z).tolist() == [0.0] * 7
        np.testing.assert_array_equal(to_numpy(b), src)
        assert all(c.is_symmetric(v) for v in (a, z, b, b[1:3]))
        assert not c.is_symmetric(xp.zeros(4)) and not c.is_symmetric(b[:, 1:])  # plain; not contiguous
        text = c.describe()
        assert "symmetric arrays: 3" in text and "shape (3, 5) dtype int16" in text
        c.free(a)
        assert not c.is_symmetric(a) and "symmetric arrays: 2" in c.describe()
    finally:
        c.close()


def test_allocation_mismatch_raises_on_every_rank(backend, comm):
    if comm.size < 2:
        pytest.skip("needs two ranks")
    c = cs.Communicator(comm, backend=backend)
    try:
        with pytest.raises(ValueError, match="same shape and dtype"):
            c.empty((4, 2 + (comm.rank == 1)), np.float32)
        with pytest.raises((ValueError, TypeError)) as info:
            c.empty((-1,) if comm.rank == 0 else (3,), np.float32)
        if comm.rank != 0:
            assert "rank 0 rejected" in str(info.value)
        with pytest.raises(ValueError, match="same shape and dtype"):
            c.empty(8, np.float32 if comm.rank else np.int32)
        # nothing was allocated and the communicator is usable
        assert "symmetric arrays: none" in c.describe()
        x = random_rows(rng_for(comm, 2), comm.size, (3,), np.int32)
        np.testing.assert_array_equal(to_numpy(c.alltoall(to_backend(x, backend))), _a2a_reference(comm, x))
        keep = c.empty(4, np.uint8)
        other = c.empty(4, np.uint8)
        with pytest.raises(ValueError, match="same allocation"):
            c.free(keep if comm.rank == 0 else other)
        with pytest.raises(ValueError, match="not a live symmetric array"):
            c.free(c.xp.zeros(3))
    finally:
        c.close()


def test_direct_mode_alltoall_matches_numpy(comm, pulls):
    """Host: a symmetric sendbuf goes direct (every peer copies out of it; no ring payload), any offset inside the
    allocation, results exact against NumPy, out= poisoned first; repeated with fresh data."""
    c = cs.Communicator(comm, backend="host")
    try:
        W = comm.size
        rng = rng_for(comm, 3)
        big = c.empty((W + 3, 37), np.float32)     # the sendbuf starts 2 rows in: a nonzero offset
        out = c.empty((W, 37), np.float32)
        for trial in range(4):
            x = random_rows(rng, W, (37,), np.float32)
            view = big[2: 2 + W]
            view[...] = x
            out[...] = np.nan
            y = c.alltoall(view, out=out)
            assert y is out
            np.testing.assert_array_equal(y.view(np.uint32), _a2a_reference(comm, x).view(np.uint32))
        # one copy per peer and call, only with peers (a direct run's one header: channel 0 alone)
        assert pulls["n"] == 4 * (W - 1)
        plain = random_rows(rng, W, (37,), np.float32)
        before = pulls["n"]
        np.testing.assert_array_equal(c.alltoall(plain), _a2a_reference(comm, plain))
        assert pulls["n"] == before  # a plain sendbuf goes through the rings
    finally:
        c.close()


def test_direct_alltoallv_uneven_and_capacity(comm, pulls):
    c = cs.Communicator(comm, cs.Config(chunk_bytes=1024, num_slots=2), backend="host")
    try:
        rng = rng_for(comm, 4)
        buf = c.empty(64 * comm.size * 9, np.uint8)
        for trial in range(3):
            counts = rng.integers(0, 64, comm.size)
            counts[(comm.rank + trial) % comm.size] = 0
            send = random_rows(rng, int(counts.sum()), (9,), np.uint8)
            x = buf[: send.nbytes].reshape(send.shape)
            x[...] = send
            expected, expected_counts = reference_alltoallv(comm, send, counts)
            got, got_counts = c.alltoallv(x, counts)
            np.testing.assert_array_equal(got_counts, expected_counts)
            np.testing.assert_array_equal(got, expected)
            out = np.full((64 * comm.size, 9), 0xEE, np.uint8)
            got2, n = c.alltoallv(x, counts, recv_capacity=64 * comm.size, out=out)
            np.testing.assert_array_equal(got2[: int(n.sum())], expected)
            assert (got2[int(n.sum()):] == 0xEE).all()  # nothing written past the rows received
        assert pulls["n"] > 0 or comm.size == 1
    finally:
        c.close()


def test_mixed_plain_and_symmetric_senders(comm, pulls):
    """The mode is the sender's (in its call header): rank 0 sends from a symmetric array, the others from plain
    arrays, and every rank still receives exactly what NumPy says."""
    c = cs.Communicator(comm, backend="host")
    try:
        W = comm.size
        x = random_rows(rng_for(comm, 5), W, (129,), np.uint8)
        sym = c.array(x)
        y = c.alltoall(sym if comm.rank == 0 else x.copy())
        np.testing.assert_array_equal(y, _a2a_reference(comm, x))
        # the ranks other than 0 pulled from rank 0 only (once: its run's one header)
        assert pulls["n"] == (0 if comm.rank == 0 else 1)
    finally:
        c.close()


def test_sender_may_overwrite_its_symmetric_sendbuf_after_return(comm):
    """A direct-mode call returns only once every peer has copied its rows out: overwriting the sendbuf at once,
    then running more calls, never changes what the peers received (a result that changed would be a race)."""
    c = cs.Communicator(comm, backend="host")
    try:
        W = comm.size
        rng = rng_for(comm, 6)
        x = c.empty((W, 4096), np.uint8)  # 4 KiB per peer
        for trial in range(10):
            data = random_rows(rng, W, (4096,), np.uint8)
            x[...] = data
            y = c.alltoall(x)
            x[...] = 0xAB                    # at once: peers must have finished reading
            ref = _a2a_reference(comm, data)
            all_ranks(lambda: np.testing.assert_array_equal(y, ref))
    finally:
        c.close()


def test_config_mode_ring_and_direct(comm, pulls):
    W = comm.size
    x = random_rows(rng_for(comm, 7), W, (8,), np.int32)
    with cs.Communicator(comm, cs.Config(mode="ring"), backend="host") as c:
        y = c.alltoall(c.array(x))
        np.testing.assert_array_equal(y, _a2a_reference(comm, x))
        assert pulls["n"] == 0
    with cs.Communicator(comm, cs.Config(mode="direct"), backend="host") as c:
        np.testing.assert_array_equal(c.alltoall(c.array(x)), _a2a_reference(comm, x))
        # a plain sendbuf on rank 0 only, without cross-memory attach: rank 0 raises ValueError naming the mode, the
        # peers are told (with it, a plain contiguous sendbuf goes MODE_CMA: test_cma_plain_sendbufs)
        c._transport.cma_pids = None
        if W > 1:
            sym = c.array(x)
            with pytest.raises(ValueError) as info:
                c.alltoall(x.copy() if comm.rank == 0 else sym)
            if comm.rank == 0:
                assert "Config.mode='direct'" in str(info.value)
            else:
                assert isinstance(info.value, cs.SymBufferRejectedError)
        # still usable
        np.testing.assert_array_equal(c.alltoall(c.array(x)), _a2a_reference(comm, x))
    with pytest.raises(ValueError, match="mode must be one of"):
        cs.Config(mode="fast")


def test_symmetric_arrays_freed_with_the_communicator(comm):
    """Symmetric arrays are sub-allocated from a few segments (each an MPI window and a communicator of its own):
    three small arrays take one; close() frees every segment no rank holds an array of."""
    import gc
    from cupy_symbuf.transport import lifecycle as _lifecycle
    gc.collect()
    before = _lifecycle.live_mpi_objects()
    c = cs.Communicator(comm, backend="host")
    for i in range(3):
        c.zeros((comm.size, 10 + i), np.float32)
    during = _lifecycle.live_mpi_objects()
    c.free(c.empty(5))
    after_free = _lifecycle.live_mpi_objects()
    c.close()
    closed = _lifecycle.live_mpi_objects()
    # the counts are this rank's: checked after the last collective step, so a rank they fail on does not skip
    # the free() or close() its peers make
    assert during["win"] == before["win"] + 2 and during["comm"] == before["comm"] + 2, (before, during)  # the
    assert after_free == during, (during, after_free)  # rings + one segment
    assert closed == before, (before, closed)
    with pytest.raises(cs.SymBufferClosedError):
        c.empty(3)


def test_symmetric_alltoall_on_every_backend(backend, comm):
    """Symmetric input and output on each backend (on the GPU they travel through the rings for now)."""
    c = cs.Communicator(comm, backend=backend)
    try:
        W = comm.size
        rng = rng_for(comm, 8)
        x = c.empty((W, 1000), np.float32)
        out = c.empty((W, 1000), np.float32)
        for _ in range(3):
            data = random_rows(rng, W, (1000,), np.float32)
            x[...] = to_backend(data, backend)
            out[...] = np.nan
            y = c.alltoall(x, out=out)
            c.synchronize()
            np.testing.assert_array_equal(to_numpy(y).view(np.uint32), _a2a_reference(comm, data).view(np.uint32))
    finally:
        c.close()


def test_review_findings(comm):
    """Found in review: a bad argument of array() on one rank is an error on every rank at once (not a timeout);
    zero-size arrays are symmetric and can be freed; subarray and void dtypes; blocks start on their own page;
    a leftover view of a freed array is never taken for a new allocation's array."""
    c = cs.Communicator(comm, cs.Config(timeout_s=20), backend="host")
    try:
        import time
        t0 = time.monotonic()
        err = None
        try:
            c.array(object() if comm.rank == 0 else np.zeros(3))
        except (TypeError, ValueError) as exc:
            err = exc
        took = time.monotonic() - t0

        def check():  # on every rank before the next (collective) allocations
            assert err is not None, "array() returned"
            assert took < 10, f"{took:.1f} s (timeout_s 20)"
            if comm.rank != 0:
                assert "rank 0 rejected" in str(err), err
        all_ranks(check)
        z = c.empty((0, 5), np.float32)
        assert c.is_symmetric(z) is False or z.nbytes == 0
        c.free(z)                                         # found by identity, though it has no bytes
        with pytest.raises(TypeError, match="subarray"):
            c.empty(4, np.dtype((np.float32, (2,))))
        v = c.zeros(4, "V8")
        assert v.dtype == np.dtype("V8") and bytes(v.tobytes()) == bytes(32)
        a = c.zeros((3,), np.float32)
        blocks = [c._heap.allocations[-1].segment.buffer.host_view(r).__array_interface__["data"][0]
                  for r in range(comm.size)]
        assert all((b - blocks[0]) % 4096 == 0 for b in blocks)  # each rank's block on its own pages
        stale = a[1:]
        c.free(a)
        b = c.zeros((3,), np.float32)
        assert c.is_symmetric(b) and not c.is_symmetric(stale)
        assert "symmetric arrays: 2" in c.describe()
    finally:
        c.close()


def test_cma_plain_sendbufs(comm, monkeypatch):
    """Plain sendbufs of CMA_MIN_BYTES per peer and more go by cross-memory attach when every rank can read every
    other (probed at construction, the same verdict on every rank); exact against NumPy, the sendbuf overwritten at
    once after return; Config.mode='ring' turns it off."""
    from cupy_symbuf.wire import protocol as P
    c = cs.Communicator(comm, cs.Config(num_sms=4), backend="host")
    try:
        verdicts = comm.allgather(c._transport.cma_pids is not None)
        assert len(set(verdicts)) == 1
        if comm.size == 1 or not verdicts[0]:
            pytest.skip("one rank, or process_vm_readv not allowed here")
        reads = {"n": 0}
        real = cs.transport.cma.Reader.read

        def spy(self, pid, addr, dst, n):
            reads["n"] += 1
            return real(self, pid, addr, dst, n)
        monkeypatch.setattr(cs.transport.cma.Reader, "read", spy)
        W = comm.size
        rng = rng_for(comm, 9)
        per_peer = P.CMA_MIN_BYTES + 48
        for trial in range(3):
            x = random_rows(rng, W, (per_peer,), np.uint8)
            keep = x.copy()
            y = c.alltoall(x)
            x[...] = 0x5A  # peers have finished reading
            ref = _a2a_reference(comm, keep)
            all_ranks(lambda: np.testing.assert_array_equal(y, ref))
        assert c.layout.num_channels > 1  # one read per peer and call, however many channels carry the headers
        assert reads["n"] == 3 * (W - 1)
        counts = rng.integers(0, 3000, W)
        send = random_rows(rng, int(counts.sum()), (257,), np.uint8)
        expected, expected_counts = reference_alltoallv(comm, send, counts)
        got, got_counts = c.alltoallv(send, counts)
        np.testing.assert_array_equal(got_counts, expected_counts)
        np.testing.assert_array_equal(got, expected)
    finally:
        c.close()
    with cs.Communicator(comm, cs.Config(mode="ring"), backend="host") as c:
        before = reads["n"]
        x = random_rows(rng_for(comm, 10), comm.size, (P.CMA_MIN_BYTES,), np.uint8)
        np.testing.assert_array_equal(c.alltoall(x), _a2a_reference(comm, x))
        assert reads["n"] == before


def _sendbuf_kinds(rng, W, per_peer):
    """Plain C-contiguous sendbufs of every kind whose address the engine finds differently
    (``common.address.address_of``): writeable of a built-in dtype (through the buffer), read-only and of a dtype the
    buffer protocol cannot describe (bfloat16; through ``__array_interface__``), and a view that starts inside a larger
    array."""
    import ml_dtypes
    f32 = random_rows(rng, W, (per_peer // 4,), np.float32)
    ro = random_rows(rng, W, (per_peer // 4,), np.float32)
    ro.flags.writeable = False
    bf16 = rng.standard_normal((W, per_peer // 2)).astype(ml_dtypes.bfloat16)
    inner = random_rows(rng, W + 1, (per_peer,), np.uint8)[1:]  # starts one row into its base
    return {"float32": f32, "read-only": ro, "bfloat16": bf16, "view inside": inner}


def test_cma_addresses_of_every_sendbuf_kind(comm, monkeypatch):
    """The rows read by cross-memory attach come from the right place for every kind of plain sendbuf (its address
    found through the buffer or through ``__array_interface__``; a view inside a larger array), into a poisoned
    ``out=`` and into a fresh output, repeated: exact against NumPy; each call reads once per peer."""
    from cupy_symbuf.transport import cma
    from cupy_symbuf.wire import protocol as P
    with cs.Communicator(comm, backend="host") as c:
        if comm.size == 1 or not all(comm.allgather(c._transport.cma_pids is not None)):
            pytest.skip("one rank, or process_vm_readv not allowed here")
        reads = {"n": 0}
        real = cma.Reader.read

        def spy(self, *a):
            reads["n"] += 1
            return real(self, *a)
        monkeypatch.setattr(cma.Reader, "read", spy)
        W = comm.size
        for name, x in _sendbuf_kinds(rng_for(comm, 11), W, P.CMA_MIN_BYTES + 64).items():
            ref = _a2a_reference(comm, x)
            out = np.empty_like(x)
            for trial in range(2):
                out.view(np.uint8)[...] = 0xA5  # poison: a row not written shows
                before = reads["n"]
                got = c.alltoall(x, out=out) if trial else c.alltoall(x)
                read = reads["n"] - before

                def check():  # this rank's reads and rows, on every rank before the next call
                    assert read == W - 1, (name, read)
                    np.testing.assert_array_equal(got.view(np.uint8), ref.view(np.uint8))
                all_ranks(check)


def test_address_of_matches_array_interface():
    """``address_of`` gives ``__array_interface__``'s address for every kind of NumPy array it is handed (through
    the buffer or not: non-contiguous and reversed views too), an int as is and 0 for None; ``address_range`` the
    bytes of a C-contiguous array."""
    from cupy_symbuf.common.address import address_of, address_range
    kinds = _sendbuf_kinds(np.random.default_rng(3), 2, 1024)
    kinds["empty"] = np.empty((0, 4), np.float32)
    base = np.arange(60, dtype=np.float64).reshape(6, 10)
    kinds.update({"columns": base[:, 3:], "reversed": base[::-1], "transposed": base.T, "every other": base[::2]})
    for name, a in kinds.items():
        assert address_of(a) == a.__array_interface__["data"][0], name
    assert address_of(None) == 0 and address_of(12345) == 12345
    lo = base.__array_interface__["data"][0]
    assert address_range(base[1:]) == (lo + 80, lo + base.nbytes)


@pytest.mark.parametrize("sendbuf", ["symmetric", "plain"])
def test_direct_run_travels_on_channel_0_alone(comm, monkeypatch, sendbuf):
    """A direct-mode run (symmetric array, or a plain one by cross-memory attach) travels behind one call header,
    on channel 0 alone, however many channels the layout has: the receiver copies the whole run at that header.
    Rank 1 reads rank 0's channel-0 header as saying the run continues on a second channel (a sender that cuts its
    runs otherwise). Rank 1 raises SymBufferMismatchError naming rank 0 and the ring field before it copies a
    byte; rank 0 (waiting for rank 1's head) SymBufferAbortedError naming rank 1; a third rank either returns its
    right rows (rank 1 had sent to it before it found the mismatch) or raises the same abort. Then every rank
    closes at once (well within ``timeout_s``), whether its call failed or completed."""
    import time
    if comm.size < 2:
        pytest.skip("needs two ranks")
    timeout_s = 20
    c = cs.Communicator(comm, cs.Config(num_sms=4, timeout_s=timeout_s), backend="host")
    closed = False
    try:
        from cupy_symbuf.wire import protocol as P
        W = comm.size
        if sendbuf == "plain" and c._transport.cma_pids is None:
            pytest.skip("process_vm_readv not allowed here")
        per_peer = 256 if sendbuf == "symmetric" else P.CMA_MIN_BYTES
        x = random_rows(rng_for(comm, 23), W, (per_peer,), np.uint8)
        src = c.array(x) if sendbuf == "symmetric" else x
        assert c.layout.num_channels > 1
        try:
            first = c.alltoall(src)
        except cs.SymBufferError as exc:
            first = exc
        # The reference, on every rank, before the call that fails (an MPI allgather made by the ranks whose call
        # completed alone waits there, while the others wait for them in close(): timeout_s). It is also a
        # barrier: no rank starts the failing call while a peer is still in this one (that peer would see the
        # abort word after its last direct copy and raise it, as it must).
        ref = _a2a_reference(comm, x)
        assert not isinstance(first, Exception), first
        np.testing.assert_array_equal(first, ref)
        if comm.rank == 1:
            real = _host.HostTransport._check_header

            def two(self, op, plan, r, hdr, sig):
                if r.p == 0 and r.c == 0:
                    hdr[P.HDR_NCHANNELS] = 2  # the words the receiver checks
                real(self, op, plan, r, hdr, sig)
            monkeypatch.setattr(_host.HostTransport, "_check_header", two)
        c.engine.repeat.clear()  # the full path, whose header check the fault goes into (repeat path: test_host_repeat)
        err = got = None
        try:
            got = c.alltoall(src)
        except cs.SymBufferError as exc:
            err = exc
        if comm.rank == 1:
            assert isinstance(err, cs.SymBufferMismatchError), err
            assert err.peer == 0 and err.channel == 0 and err.field == P.FIELD_NAMES[P.FIELD_RING], err
            assert "1 channel(s)" in str(err) and "says 2" in str(err), err
        elif comm.rank == 0 or err is not None:  # (a third rank may have completed before rank 1 found it)
            assert isinstance(err, cs.SymBufferAbortedError) and err.aborting_rank == 1, err
        else:
            np.testing.assert_array_equal(got, ref)
        t0 = time.monotonic()
        closed = True
        _close_failed(c)  # (a peer's abort or a timeout from close() is ignored there: its time is checked)
        took = time.monotonic() - t0
        assert took < timeout_s / 4, f"close() took {took:.1f} s on rank {comm.rank} (timeout_s {timeout_s})"
    finally:
        if not closed:
            _close_failed(c)


def test_reader_never_returns_rows_of_a_sender_that_failed(comm, monkeypatch):
    """Found by a new-user attack: a receiver still copying out of a sender's memory while that sender's call fails
    (and its program may overwrite the sendbuf at once) must raise, not return: after its last direct copy the
    receiver fences and looks at the abort word. Rank 0 alone sends (a symmetric sendbuf: direct mode), fails as
    soon as it would wait for its readers; each reader is slowed after its copy so rank 0's abort lands first."""
    if comm.size < 2:
        pytest.skip("needs two ranks")
    import time
    from cupy_symbuf.transport import host as H
    c = cs.Communicator(comm, cs.Config(timeout_s=20), backend="host")
    try:
        W = comm.size
        n = 4096
        counts = np.zeros(W, np.int64)
        if comm.rank == 0:
            counts[1:] = n
        x = c.empty(n * (W - 1), np.uint8)[: int(counts.sum())]   # the same allocation on every rank
        x[...] = 7
        rc = np.zeros(W, np.int64)
        if comm.rank != 0:
            rc[0] = n
        comm.Barrier()
        if comm.rank == 0:
            def fail(*a, **k):
                raise KeyboardInterrupt("injected while peers still read this rank's rows")
            monkeypatch.setattr(H, "_yield", fail)
        else:
            real = H.HostTransport._pull

            def slow(self, *a, **k):
                real(self, *a, **k)
                time.sleep(0.5)
            monkeypatch.setattr(H.HostTransport, "_pull", slow)
        with pytest.raises(BaseException) as info:
            c.alltoallv(x, counts, recv_counts=rc)
        if comm.rank == 0:
            assert isinstance(info.value, KeyboardInterrupt)
        else:
            assert isinstance(info.value, cs.SymBufferAbortedError) and info.value.aborting_rank == 0, info.value
    finally:
        _close_failed(c)


# ---- GPU direct mode (the ring kernel's receivers copy straight out of the sender's symmetric block) ----------------
def _cuda_comm(comm, config=None):
    from conftest import available_backends
    if "cuda" not in available_backends():
        pytest.skip("needs a GPU")
    from cupy_symbuf.utils import select_device
    select_device(comm)
    config = config or cs.Config()
    if config.small_bytes is None:  # these tests are about the direct modes: the small-message protocol, which takes
        config = dataclasses.replace(config, small_bytes=0)  # every alltoall up to its size whatever the sendbuf, off
    return cs.Communicator(comm, config, backend="cuda")


def _send_counters(c):
    """uint64 [channels, world_size]: this rank's sender state counters (SEND_STATE_OFFSET, STATE_COUNTER) read
    from its buffer after the queued calls ended: a direct-mode call moves each by exactly 1 (its call header), a
    ring call by 1 + its payload chunks."""
    import cupy as cp
    from cupy_symbuf.wire import protocol as P
    c.synchronize()
    L, base = c.layout, c.buffer.peer_ptrs[c.rank]
    out = np.zeros((L.num_channels, c.world_size), np.uint64)
    word = np.zeros(1, np.uint64)
    for ch in range(L.num_channels):
        for p in range(c.world_size):
            cp.cuda.runtime.memcpy(word.ctypes.data, base + L.region_offset(ch, p) + P.SEND_STATE_OFFSET +
                                   8 * P.STATE_COUNTER, 8, 4)  # cudaMemcpyDefault: ipc or staged
            out[ch, p] = word[0]
    return out


def test_gpu_direct_alltoall_matches_numpy(comm):
    """GPU: a symmetric sendbuf goes direct (MODE_DIRECT headers, no ring payload), at a nonzero offset inside its
    allocation, sizes that cut into channels unevenly, out= poisoned first; exact against NumPy; a plain sendbuf
    of the same shape still goes through the rings."""
    import cupy as cp
    c = _cuda_comm(comm)
    try:
        W = comm.size
        rng = rng_for(comm, 11)
        for row in (37, 4096, 1 << 18):  # bytes per peer: odd rows, one 4 KiB row, 256 KiB (every channel)
            big = c.empty((W + 3, row), np.uint8)
            out = c.empty((W, row), np.uint8)
            before = c._transport.direct_calls
            peers = [p for p in range(W) if p != comm.rank]
            for trial in range(3):
                x = random_rows(rng, W, (row,), np.uint8)
                big[2: 2 + W] = cp.asarray(x)
                out[...] = 0xEE
                counters = _send_counters(c)
                y = c.alltoall(big[2: 2 + W], out=out)
                assert y is out
                np.testing.assert_array_equal(cp.asnumpy(y), _a2a_reference(comm, x))
                # the kernel sent headers only (no payload chunk in any ring): the rows went direct
                assert ((_send_counters(c) - counters)[:, peers] == 1).all()
            assert c._transport.direct_calls == before + 3
            plain = random_rows(rng, W, (row,), np.uint8)
            counters = _send_counters(c)
            np.testing.assert_array_equal(cp.asnumpy(c.alltoall(cp.asarray(plain))), _a2a_reference(comm, plain))
            assert c._transport.direct_calls == before + 3  # the plain call went through the rings
            assert W == 1 or ((_send_counters(c) - counters)[:, peers] > 1).any()
            c.free(big)
            c.free(out)
        c.synchronize()
    finally:
        c.close()


def test_gpu_direct_alltoallv_host_and_device_counts(comm):
    """GPU direct mode with uneven counts (zeros included), counts exchanged on the host and on the device
    (recv_capacity): exact against NumPy, nothing written past the rows received."""
    import cupy as cp
    c = _cuda_comm(comm)
    try:
        W = comm.size
        rng = rng_for(comm, 12)
        buf = c.empty(300 * W * 24, np.uint8)
        for trial in range(4):
            counts = rng.integers(0, 300, W)
            counts[(comm.rank + trial) % W] = 0
            send = random_rows(rng, int(counts.sum()), (24,), np.uint8)
            x = buf[: send.nbytes].reshape(send.shape)
            x[...] = cp.asarray(send)
            expected, expected_counts = reference_alltoallv(comm, send, counts)
            got, got_counts = c.alltoallv(x, counts)
            np.testing.assert_array_equal(np.asarray(got_counts), expected_counts)
            np.testing.assert_array_equal(cp.asnumpy(got), expected)
            cap = 300 * W
            out = cp.full((cap, 24), 0xEE, np.uint8)
            got2, n = c.alltoallv(x, cp.asarray(counts), recv_capacity=cap, out=out)
            total = int(cp.asnumpy(n).sum())
            np.testing.assert_array_equal(cp.asnumpy(n), expected_counts)
            np.testing.assert_array_equal(cp.asnumpy(got2[:total]), expected)
            assert bool((got2[total:] == 0xEE).all())
        assert c._transport.direct_calls == 8 or W == 1
    finally:
        c.close()


def test_gpu_direct_sender_overwrites_at_once(comm):
    """GPU: the sender's kernel ends only once every peer has copied its rows out, so a write to the sendbuf queued
    right after the call (same stream) never changes what the peers receive; mixed with ring calls on the same
    rings; repeated (a result that changed between runs would be a race)."""
    import cupy as cp
    c = _cuda_comm(comm)
    try:
        W = comm.size
        rng = rng_for(comm, 13)
        x = c.empty((W, 1 << 20), np.uint8)  # 1 MiB per peer
        for trial in range(6):
            data = random_rows(rng, W, (1 << 20,), np.uint8)
            x[...] = cp.asarray(data)
            y = c.alltoall(x)
            x[...] = 0xAB                      # queued at once after the call
            z = c.alltoall(cp.asarray(data))   # a ring call after a direct one
            ref = _a2a_reference(comm, data)
            all_ranks(lambda: (np.testing.assert_array_equal(cp.asnumpy(y), ref),
                               np.testing.assert_array_equal(cp.asnumpy(z), ref)))
    finally:
        c.close()


def test_gpu_mixed_plain_and_symmetric_senders(comm):
    """The mode is the sender's (its call header): rank 0 sends from a symmetric array, the others from plain
    arrays; every rank receives exactly what NumPy says."""
    import cupy as cp
    c = _cuda_comm(comm)
    try:
        W = comm.size
        x = random_rows(rng_for(comm, 14), W, (4099,), np.uint8)
        sym = c.array(cp.asarray(x))
        y = c.alltoall(sym if comm.rank == 0 else cp.asarray(x))
        np.testing.assert_array_equal(cp.asnumpy(y), _a2a_reference(comm, x))
        assert c._transport.direct_calls == (1 if comm.rank == 0 else 0)
    finally:
        c.close()


def test_gpu_config_mode_ring_and_direct(comm):
    import cupy as cp
    W = comm.size
    x = random_rows(rng_for(comm, 15), W, (8,), np.int32)
    with _cuda_comm(comm, cs.Config(mode="ring")) as c:
        np.testing.assert_array_equal(cp.asnumpy(c.alltoall(c.array(cp.asarray(x)))), _a2a_reference(comm, x))
        assert c._transport.direct_calls == 0
    with _cuda_comm(comm, cs.Config(mode="direct")) as c:
        sym = c.array(cp.asarray(x))
        np.testing.assert_array_equal(cp.asnumpy(c.alltoall(sym)), _a2a_reference(comm, x))
        if W > 1:  # a plain sendbuf on rank 0 only: rank 0 raises naming the mode, the peers are told (their
            # queued calls report the rejection from synchronize)
            with pytest.raises(ValueError) as info:
                c.alltoall(cp.asarray(x) if comm.rank == 0 else sym)
                c.synchronize()
            if comm.rank == 0:
                assert "Config.mode='direct'" in str(info.value)
            else:
                assert isinstance(info.value, cs.SymBufferRejectedError)
        np.testing.assert_array_equal(cp.asnumpy(c.alltoall(sym)), _a2a_reference(comm, x))  # still usable
        # an allocation outside the symmetric table goes through the rings (auto), or is refused (direct)
        alloc = c._heap.find(sym)[0]
        c._transport.sym_unregister(alloc)
        with pytest.raises(ValueError, match="SYM_TABLE_ROWS|first 64 live"):
            c.alltoall(sym)


def test_gpu_direct_header_naming_an_unknown_allocation_fails_everywhere(comm):
    """A direct-mode header whose allocation the receiver cannot find (here: rank 1 forgot its table row) is a
    fatal mismatch naming the transfer mode on the receiving rank, and every rank raises (at the latest from its
    next call): never wrong data."""
    import cupy as cp
    if comm.size < 2:
        pytest.skip("needs two ranks")
    c = _cuda_comm(comm, cs.Config(timeout_s=10))
    try:
        x = random_rows(rng_for(comm, 16), comm.size, (64,), np.uint8)
        sym = c.array(cp.asarray(x))
        if comm.rank == 1:
            c._transport.sym_unregister(c._heap.find(sym)[0])
        # rank 1 fails at once and sets the abort word on every rank; a rank whose kernel had finished already
        # raises from its next call (its peers never complete it), never returning data
        with pytest.raises(cs.SymBufferError) as info:
            c.alltoall(sym if comm.rank == 0 else cp.asarray(x))
            c.synchronize()
            c.alltoall(cp.asarray(x))
            c.synchronize()
        if comm.rank == 1:
            assert "transfer mode" in str(info.value)
    finally:
        _close_failed(c)


# ---- copy engines (Config.mode="copy_engine") -------------------------------------------------------------------
def test_gpu_copy_engine_alltoall_matches_numpy(comm):
    """GPU, mode copy_engine: an alltoall of one symmetric allocation at the same offset on every rank, at least
    CE_MIN_BYTES per peer, is pulled by cudaMemcpyAsync (the kernel only checks headers); just below the crossover
    the direct kernel copies. Exact against NumPy around the crossover, out= poisoned, the sendbuf overwritten right
    after each call (the finish kernel waits for the peers' copies), repeated."""
    import cupy as cp
    from cupy_symbuf.wire import protocol as P
    c = _cuda_comm(comm, cs.Config(mode="copy_engine"))
    try:
        W = comm.size
        rng = rng_for(comm, 17)
        for n, via_ce in ((P.CE_MIN_BYTES - 16, False), (P.CE_MIN_BYTES, True), (P.CE_MIN_BYTES + 48, True)):
            big = c.empty((W + 1, n), np.uint8)
            out = c.empty((W, n), np.uint8)
            x = big[1:]  # offset n in the allocation, the same on every rank
            before = c._transport.ce_calls
            for trial in range(3):
                data = random_rows(rng, W, (n,), np.uint8)
                x[...] = cp.asarray(data)
                out[...] = 0xEE
                y = c.alltoall(x, out=out)
                x[...] = 0xAB  # queued right after the call
                ref = _a2a_reference(comm, data)
                all_ranks(lambda: np.testing.assert_array_equal(cp.asnumpy(y), ref))
            assert c._transport.ce_calls - before == (3 if via_ce and W > 1 else 0)
            c.free(big)
            c.free(out)
        c.synchronize()
        if W > 1:  # a plain sendbuf of that size on rank 0: refused there, the peers told; still usable after
            n = P.CE_MIN_BYTES
            sym = c.empty((W, n), np.uint8)
            data = random_rows(rng, W, (n,), np.uint8)
            sym[...] = cp.asarray(data)
            with pytest.raises(ValueError) as info:
                c.alltoall(cp.asarray(data) if comm.rank == 0 else sym)
                c.synchronize()
            assert ("copy_engine" in str(info.value)) == (comm.rank == 0)
            np.testing.assert_array_equal(cp.asnumpy(c.alltoall(sym)), _a2a_reference(comm, data))
    finally:
        c.close()


def test_gpu_copy_engine_needs_the_same_offset_everywhere(comm):
    """Copy-engine mode assumes every rank's sendbuf lies at the same offset of the same allocation; a rank that
    differs makes the kernel's header check fail: an error on every rank (at the latest from the next call),
    never the wrong rows."""
    import cupy as cp
    from cupy_symbuf.wire import protocol as P
    if comm.size < 2:
        pytest.skip("needs two ranks")
    c = _cuda_comm(comm, cs.Config(mode="copy_engine", timeout_s=10))
    try:
        W, n = comm.size, P.CE_MIN_BYTES
        big = c.empty((W + 1, n), np.uint8)
        x = big[1:] if comm.rank == 0 else big[:W]
        with pytest.raises(cs.SymBufferError) as info:
            c.alltoall(x)
            c.synchronize()
            c.alltoall(x)
            c.synchronize()
        if comm.rank != 0:  # rank 0's rows are not where the others assume
            assert "transfer mode" in str(info.value) or "abort" in str(info.value)
    finally:
        _close_failed(c)


def test_copy_engine_mode_must_agree(backend, comm):
    """Config.mode='copy_engine' changes what the peers' kernels do: it is part of the agreed fingerprint, so a
    communicator where one rank asks for it and another does not fails to build on every rank."""
    if comm.size < 2:
        pytest.skip("needs two ranks")
    with pytest.raises(ValueError, match="copy_engine"):
        cs.Communicator(comm, cs.Config(mode="copy_engine" if comm.rank == 0 else "auto"), backend=backend)
    # on the host it is "auto": exact results
    if backend == "host":
        with cs.Communicator(comm, cs.Config(mode="copy_engine"), backend="host") as c:
            x = random_rows(rng_for(comm, 18), comm.size, (16,), np.float32)
            np.testing.assert_array_equal(c.alltoall(c.array(x)), _a2a_reference(comm, x))


# ---- the symmetric heap: many arrays in few segments; freed memory stays mapped while arrays over it live --------
def test_thousands_of_live_arrays_stay_direct(comm, pulls):
    """2000 live symmetric arrays (1 KiB per rank each) take a handful of segments (MPI windows), not one window
    and communicator each (MPI runs out near a thousand); alltoalls out of arrays in different segments go direct
    and match NumPy; freeing them all releases all but one segment."""
    import gc
    from cupy_symbuf.transport import lifecycle as _lifecycle
    gc.collect()
    before = _lifecycle.live_mpi_objects()
    c = cs.Communicator(comm, backend="host")
    try:
        W, n = comm.size, 2000
        arrays = [c.empty((W, 1024 // W), np.uint8) for _ in range(n)]
        heap = c._heap
        segs = {heap.find(a)[0].id for a in arrays}
        wins = _lifecycle.live_mpi_objects()["win"] - before["win"]

        def check():  # this rank's counts, on every rank before the next (collective) calls
            assert 2 <= len(segs) <= 8 and len(heap.segments) == len(segs), heap.describe()
            assert wins <= 1 + len(segs), (wins, len(segs))
            assert f"symmetric arrays: {n}" in c.describe()
        all_ranks(check)
        rng = rng_for(comm, 19)
        picked = [arrays[0], arrays[n // 2], arrays[-1]]
        assert len({heap.find(a)[0].id for a in picked}) >= 2  # from different segments
        for a in picked:
            data = random_rows(rng, W, (1024 // W,), np.uint8)
            a[...] = data
            before_pulls = pulls["n"]
            got, want = c.alltoall(a), _a2a_reference(comm, data)
            pulled = pulls["n"] - before_pulls

            def check_call():  # this rank's rows and pulls, on every rank before the next call
                np.testing.assert_array_equal(got, want)
                assert pulled == W - 1, pulled  # direct: every peer pulled, once
            all_ranks(check_call)
        for a in arrays:
            c.free(a)
        del arrays, picked, a
        c.free(c.empty(4, np.uint8))  # an agreement step after the views are gone: the ranges are recycled
        # every idle segment but one is unmapped (the other holds the 4-byte array, freed but not yet reported)
        assert len(heap.segments) <= 2 and sum(s.idle for s in heap.segments) <= 1, heap.describe()
    finally:
        c.close()
    gc.collect()
    assert _lifecycle.live_mpi_objects() == before


_LIFETIME_JOB = r'''
import sys
import numpy as np
from mpi4py import MPI
import cupy_symbuf as cs

case, backend = sys.argv[1], sys.argv[2]
comm = MPI.COMM_WORLD
rank, W = comm.rank, comm.size
if backend == "cuda":
    from cupy_symbuf.utils import select_device
    select_device(comm)
c = cs.Communicator(comm, cs.Config(timeout_s=20), backend=backend)
xp = c.xp
host = lambda a: a.get() if hasattr(a, "get") else np.asarray(a)
pattern = (np.arange(4096) * 7 + 3 + rank).astype(np.uint8)


def where(a):
    seg, off = c._heap.find(a)
    return seg.id, off


if case == "free":
    a = c.array(xp.asarray(pattern))
    view = a[100:]
    c.free(a)
    del a
    others = [c.zeros(4096, np.uint8) for _ in range(3)]   # new allocations of the same size
    for o in others:
        o[...] = 0xEE
    c.alltoall(xp.zeros((W, 16), np.uint8))                 # a collective, then read the stale view
    assert (host(view) == pattern[100:]).all(), "the stale view lost its bytes"
    view[...] = 1                                            # a write lands in the old range only
    assert all((host(o) == 0xEE).all() for o in others)
elif case == "close":
    a = c.array(xp.asarray(pattern))
    view = a[5:]
    c.close()
    assert (host(a) == pattern).all() and (host(view) == pattern[5:]).all()
    a[...] = 9
    assert (host(view) == 9).all()
elif case == "peer_view":
    a = c.array(xp.asarray(pattern))
    old_seg, old_off = where(a)
    view = a[:] if rank == 1 else None                       # only rank 1 keeps a view
    c.free(a)
    del a
    placed = []
    for _ in range(3):
        b = c.empty(4096, np.uint8)
        b[...] = 0xBB
        seg, off = where(b)
        assert seg != old_seg or off + 4096 <= old_off or old_off + 4096 <= off, (seg, off, old_seg, old_off)
        placed.append(b)
    if rank == 1:
        assert (host(view) == pattern).all(), "a peer's stale view saw another array's data"
    view = None                                              # dropped: the range may be reused after the next step
    c.free(placed.pop())
    reused = False
    for _ in range(3):
        b = c.empty(4096, np.uint8)
        reused = reused or where(b) == (old_seg, old_off)
        placed.append(b)
    assert reused, "a range no rank holds was never reused"
    assert all(x == reused for x in comm.allgather(reused))
if case != "close":
    c.close()
print(f"LIFETIME-OK {case} rank {rank}", flush=True)
'''


@pytest.mark.parametrize("backend_", ["host", "cuda"])
@pytest.mark.parametrize("case", ["free", "close", "peer_view"])
def test_stale_views_read_their_old_bytes(case, backend_, tmp_path):
    """An array (or view) left over from Communicator.free or close() reads the bytes it had (never a crash, never
    another array's data), and a freed range is not handed out again while any rank holds an array over it; once
    none does, a later allocation may reuse it. In a 2-rank job of its own, so a crash fails only this test."""
    from _jobs import LAUNCHER, UNDER_MPIEXEC, clean_env, mpi_command, run_job
    import sys
    if UNDER_MPIEXEC:
        pytest.skip("launches its own mpiexec job; runs from the single-process pytest pass")
    if not LAUNCHER:
        pytest.skip("no mpiexec found (set MPIEXEC)")
    if backend_ == "cuda":
        from conftest import available_backends
        if "cuda" not in available_backends():
            pytest.skip("needs a GPU")
    script = tmp_path / "lifetime_job.py"
    script.write_text(_LIFETIME_JOB)
    rc, out, killed = run_job(mpi_command(2, [sys.executable, str(script), case, backend_]),
                              clean_env(CUPY_SYMBUF_ABORT_ON_FAILURE="0"), 120)
    assert not killed and rc == 0 and out.count(f"LIFETIME-OK {case}") == 2, f"rc={rc} killed={killed}\n{out}"


def test_gpu_thousands_of_live_arrays_stay_direct(comm):
    """GPU: 2000 live symmetric arrays take a handful of segments, every one with a row of the kernels' symmetric
    table (SYM_TABLE_ROWS rows, one per segment), so alltoalls out of arrays in different segments all go direct
    (headers only in the rings) and match NumPy."""
    import cupy as cp
    c = _cuda_comm(comm)
    try:
        W, n = comm.size, 2000
        arrays = [c.empty((W, 1024 // W), np.uint8) for _ in range(n)]
        heap = c._heap
        assert 2 <= len(heap.segments) <= 8 and all(s.registered for s in heap.segments), heap.describe()
        rng = rng_for(comm, 20)
        picked = [arrays[0], arrays[n // 2], arrays[-1]]
        assert len({heap.find(a)[0].id for a in picked}) >= 2
        before = c._transport.direct_calls
        for a in picked:
            data = random_rows(rng, W, (1024 // W,), np.uint8)
            a[...] = cp.asarray(data)
            np.testing.assert_array_equal(cp.asnumpy(c.alltoall(a)), _a2a_reference(comm, data))
        assert c._transport.direct_calls - before == 3  # every one went direct
        for a in arrays:
            c.free(a)
        c.synchronize()
    finally:
        c.close()
