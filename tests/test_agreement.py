"""Ranks agree, or every rank fails loudly: a call rejected on one rank only, counts / dtype / operation
that differ between ranks. Every case checks real values against NumPy: a call either returns the reference rows
or raises, never wrong data; after a rejection the communicator keeps working.

In-process (every rank runs pytest); the whole-job fault cases (dead peers, hangs, MPI.Abort) are in
test_faults.py.
"""
import time

import numpy as np
import pytest

import cupy_symbuf as cs
from _util import random_rows, reference_alltoallv, rng_for, to_backend, to_numpy

CFG = dict(chunk_bytes=1024, num_slots=4, timeout_s=20)


def _blocking(backend):
    """Rejections by a peer are raised by the call itself on the host path and with Config.blocking on the GPU."""
    return backend == "cuda"


@pytest.fixture
def comm2(backend, comm):
    if comm.size < 2:
        pytest.skip("needs two ranks")
    c = cs.Communicator(comm, cs.Config(blocking=_blocking(backend), **CFG), backend=backend)
    yield c
    try:
        c.close()
    except cs.SymBufferError:
        pass


def _prepared_alltoall(c, comm, backend, seed):
    """A valid alltoall on fresh random data, its reference computed now (collectively): returns the call, which
    itself does no MPI communication (so ranks that fail at different points cannot deadlock in MPI)."""
    rng = rng_for(comm, seed)
    x = random_rows(rng, comm.size, (37,), np.float32)
    everything = comm.allgather(x)
    want = np.stack([everything[j][comm.rank] for j in range(comm.size)])

    def run():
        y = c.alltoall(to_backend(x, backend))
        np.testing.assert_array_equal(to_numpy(y).view(np.uint8), want.view(np.uint8))
    return run


def _close(c):
    """close() of a communicator the test failed on purpose: its error (a peer's abort, a failed close) is expected.
    Called from ``finally``: a check that failed on one rank only must not make that rank skip the collective
    close the others make."""
    try:
        c.close()
    except cs.SymBufferError:
        pass


def _valid_alltoall(c, comm, backend, seed):
    _prepared_alltoall(c, comm, backend, seed)()


def _valid_alltoallv(c, comm, backend, seed, **kw):
    rng = rng_for(comm, seed)
    counts = rng.integers(0, 30, comm.size)
    send = random_rows(rng, int(counts.sum()), (9,), np.int16)
    want, want_counts = reference_alltoallv(comm, send, counts)
    if kw.pop("with_recv_counts", False):
        kw["recv_counts"] = want_counts
    got, got_counts = c.alltoallv(to_backend(send, backend), counts, **kw)
    np.testing.assert_array_equal(got_counts, want_counts)
    np.testing.assert_array_equal(to_numpy(got).view(np.uint8), want.view(np.uint8))


REJECT_CASES = ["alltoall-shape", "alltoallv-sum", "alltoallv-recv_counts", "alltoallv-self", "alltoallv-wrap",
                "alltoallv-capacity", "alltoallv-device-counts"]


@pytest.mark.parametrize("case", REJECT_CASES)
def test_call_rejected_on_one_rank_only(comm2, comm, backend, case):
    """Rank 0 passes bad arguments, the others valid ones: rank 0 raises its own error, every other rank raises
    SymBufferRejectedError naming rank 0 (nothing is delivered from rank 0), and the next calls of every rank
    return the NumPy reference (the rings stayed in step). ``alltoallv-capacity`` / ``alltoallv-device-counts``:
    rank 0 passes recv_counts with recv_capacity / with send_counts on the device (GPU), which exclude each other,
    and the others the same recv_counts alone: rank 0's call is rejected as a call with recv_counts, never taken
    for a call-form disagreement (which would break the communicator on every rank)."""
    if case == "alltoallv-device-counts" and backend != "cuda":
        pytest.skip("send_counts on the device: GPU only")
    c = comm2
    W, me = comm.size, comm.rank
    rng = rng_for(comm, 11)
    counts = rng.integers(1, 20, W)
    send = to_backend(random_rows(rng, int(counts.sum()), (5,), np.float32), backend)
    recv_counts = np.array(comm.alltoall([int(v) for v in counts]), np.int64)
    bad = me == 0
    if case == "alltoall-shape":
        x = to_backend(random_rows(rng, W + (1 if bad else 0), (5,), np.float32), backend)
        call = lambda: c.alltoall(x)  # noqa: E731
        own = r"must have shape\[0\] == world_size"
    elif case == "alltoallv-sum":
        sc = counts + (1 if bad else 0)
        call = lambda: c.alltoallv(send, sc)  # noqa: E731
        own = "must sum to the number of rows"
    elif case == "alltoallv-recv_counts":
        rc = recv_counts.copy()
        if bad:
            rc[0] = -1
        call = lambda: c.alltoallv(send, counts, recv_counts=rc)  # noqa: E731
        own = "must be >= 0"
    elif case == "alltoallv-self":
        rc = recv_counts.copy()
        if bad:
            rc[0] += 1
        call = lambda: c.alltoallv(send, counts, recv_counts=rc)  # noqa: E731
        own = r"recv_counts\[0\] .* must equal send_counts\[0\]"
    elif case == "alltoallv-capacity":
        kw = dict(recv_capacity=int(recv_counts.sum()) + 4) if bad else {}
        call = lambda: c.alltoallv(send, counts, recv_counts=recv_counts, **kw)  # noqa: E731
        own = "recv_counts and recv_capacity exclude each other"
    elif case == "alltoallv-device-counts":
        sc = to_backend(counts.astype(np.int64), backend) if bad else counts
        call = lambda: c.alltoallv(send, sc, recv_counts=recv_counts)  # noqa: E731
        own = "send_counts on the device .* not with recv_counts"
    else:  # counts whose int64 sum wraps to the row count
        sc = counts.copy()
        if bad:
            huge = np.iinfo(np.int64).max
            sc = np.zeros(W, np.int64)
            sc[0] = int(counts.sum()) + 2
            if W >= 2:
                sc[1] = huge
            if W >= 3:
                sc[2] = huge
            assert W < 3 or int(sc.sum()) == int(counts.sum())  # wraps around in int64
        call = lambda: c.alltoallv(send, sc)  # noqa: E731
        own = "sum|more than the transport can address"
    if bad:
        with pytest.raises(ValueError, match=own) as info:
            call()
        assert not isinstance(info.value, cs.SymBufferRejectedError)
    else:
        with pytest.raises(cs.SymBufferRejectedError, match="rank 0 rejected") as info:
            call()
        assert info.value.rejecting_rank == 0 and info.value.rank == me
    for seed in range(3):  # still usable, and in step: fresh random data every time
        _valid_alltoall(c, comm, backend, 100 + seed)
        _valid_alltoallv(c, comm, backend, 200 + seed, with_recv_counts=seed == 1)


def _mixed_alltoallv(c, comm, backend, seed, **kw):
    """alltoallv whose runs differ in length per (sender, receiver) pair: some fit one ring slot of ``CFG`` (on the
    host: channel 0 alone), others span several slots (every channel), the mix changing with the seed; checked
    against NumPy, ``out=`` poisoned first when given recv_counts."""
    rng = rng_for(comm, seed)
    W = comm.size
    counts = np.array([(3 if (comm.rank + j + seed) % 2 else 23) + int(rng.integers(0, 3)) for j in range(W)])
    send = random_rows(rng, int(counts.sum()), (16,), np.float32)  # 64-byte rows: 23 rows > 1024 bytes
    want, want_counts = reference_alltoallv(comm, send, counts)
    if kw.pop("with_recv_counts", False):
        out = to_backend(np.full(want.shape, np.nan, np.float32), backend)
        got = c.alltoallv(to_backend(send, backend), counts, recv_counts=want_counts, out=out)[0]
        assert got is out
    else:
        got, got_counts = c.alltoallv(to_backend(send, backend), counts)
        np.testing.assert_array_equal(got_counts, want_counts)
    np.testing.assert_array_equal(to_numpy(got).view(np.uint8), want.view(np.uint8))


@pytest.mark.parametrize("case", ["alltoall-shape", "alltoallv-recv_counts"])
def test_call_rejected_with_runs_on_one_and_several_channels(comm2, comm, backend, case):
    """A rejection while the peers' runs to the rejecting rank and to each other span one channel or several (the
    host cuts a run that fits one ring slot onto channel 0 alone; the rejecting rank knows neither, and drains what
    channel 0's header of each peer announces): rank 0 raises its own error, every other rank
    SymBufferRejectedError naming rank 0, and the next calls of every shape mix return the NumPy reference."""
    c = comm2
    W, me = comm.size, comm.rank
    bad = me == 0
    rng = rng_for(comm, 31)
    if case == "alltoall-shape":
        x = to_backend(random_rows(rng, W + (1 if bad else 0), (600,), np.float32), backend)  # 2400 B per peer
        call = lambda: c.alltoall(x)  # noqa: E731
        own = r"must have shape\[0\] == world_size"
    else:
        counts = np.array([3 if j % 2 else 23 for j in range(W)])
        send = to_backend(random_rows(rng, int(counts.sum()), (16,), np.float32), backend)
        rc = np.array(comm.alltoall([int(v) for v in counts]), np.int64)
        if bad:
            rc[0] = -1
        call = lambda: c.alltoallv(send, counts, recv_counts=rc)  # noqa: E731
        own = "must be >= 0"
    if bad:
        with pytest.raises(ValueError, match=own):
            call()
    else:
        with pytest.raises(cs.SymBufferRejectedError, match="rank 0 rejected") as info:
            call()
        assert info.value.rejecting_rank == 0
    for seed in range(4):  # in step: fresh random data, the per-pair mix of one and several channels changing
        _mixed_alltoallv(c, comm, backend, 300 + seed, with_recv_counts=seed % 2 == 1)
        _valid_alltoall(c, comm, backend, 400 + seed)


def test_call_rejected_on_every_rank_stays_usable(comm2, comm, backend):
    c = comm2
    x = to_backend(np.ones((comm.size + 1, 3), np.float32), backend)
    with pytest.raises(ValueError, match="world_size"):
        c.alltoall(x)
    _valid_alltoall(c, comm, backend, 5)


def _every_rank_fails(comm, first, second):
    """Run ``first`` then ``second`` on this rank: each either returns correct data (the call checks it) or raises
    a SymBufferError; returns the error this rank saw (first one). No rank may return wrong data."""
    seen = None
    for fn in (first, second):
        try:
            fn()
        except cs.SymBufferError as exc:
            seen = seen or exc
            if isinstance(exc, (cs.SymBufferMismatchError, cs.SymBufferAbortedError)):
                break
    return seen


@pytest.mark.parametrize("delta", [1, -1], ids=["one-more", "one-fewer"])
def test_recv_counts_differ_from_what_the_peer_sends(backend, comm, delta):
    """Rank 0 expects one row more (or fewer) than rank 1 sends: rank 0 raises SymBufferMismatchError naming the
    peer and both counts before taking a byte, and every rank raises (this call or its next one)."""
    if comm.size < 2:
        pytest.skip("needs two ranks")
    c = cs.Communicator(comm, cs.Config(blocking=True, **CFG), backend=backend)
    try:
        W, me = comm.size, comm.rank
        rng = rng_for(comm, 21)
        counts = rng.integers(1, 20, W)
        send = random_rows(rng, int(counts.sum()), (6,), np.uint8)
        want, want_counts = reference_alltoallv(comm, send, counts)
        rc = want_counts.copy()
        if me == 0:
            rc[1] += delta

        def first():
            got, _ = c.alltoallv(to_backend(send, backend), counts, recv_counts=rc)
            np.testing.assert_array_equal(to_numpy(got), want)  # only a rank whose counts were right may get here

        err = _every_rank_fails(comm, first, _prepared_alltoall(c, comm, backend, 22))
        third = _prepared_alltoall(c, comm, backend, 23)  # an allgather: made before this rank's checks
        assert err is not None, f"rank {me} saw no error"
        if me == 0:
            assert isinstance(err, cs.SymBufferMismatchError) and err.peer == 1 and "row count" in err.field, err
            assert f"expects {want_counts[1] + delta} rows" in str(err) and f"sends {want_counts[1]} rows" in str(err)
        with pytest.raises(cs.SymBufferError, match="unusable|aborted"):
            third()
    finally:  # every rank closes (collective), whatever failed on this rank above
        _close(c)


@pytest.mark.parametrize("odd_form", ["recv_counts", "count_exchange"])
def test_ranks_disagree_on_passing_recv_counts(backend, comm, odd_form):
    """The last rank passes recv_counts to alltoallv and the others do not (``recv_counts``), or the other way round
    (``count_exchange``): the ranks without them wait in the count exchange, the others for call headers. Each wait
    also watches for the other form's first message, so every rank raises at once (well within timeout_s, after a
    count exchange and a call of each form went right): SymBufferMismatchError naming the field (call form), both
    forms, recv_counts and a peer in the other form. On the GPU only the count exchange watches (symbuf_notify):
    a rank waiting for call headers raises SymBufferAbortedError naming the detecting rank and the field. No rank
    returns rows; the communicator is then unusable on every rank."""
    if comm.size < 2:
        pytest.skip("needs two ranks")
    timeout_s = 10.0  # "at once": within half of it, room for a loaded machine
    c = cs.Communicator(comm, cs.Config(blocking=True, **dict(CFG, timeout_s=timeout_s)), backend=backend)
    try:
        W, me, odd = comm.size, comm.rank, comm.size - 1
        _valid_alltoallv(c, comm, backend, 71)
        _valid_alltoallv(c, comm, backend, 72, with_recv_counts=True)
        rng = rng_for(comm, 73)
        counts = rng.integers(1, 20, W)
        send = random_rows(rng, int(counts.sum()), (5,), np.float32)
        want, want_counts = reference_alltoallv(comm, send, counts)
        with_rc = (me == odd) == (odd_form == "recv_counts")
        comm.Barrier()
        t0 = time.monotonic()
        with pytest.raises((cs.SymBufferMismatchError, cs.SymBufferAbortedError)) as info:
            if with_rc:
                c.alltoallv(to_backend(send, backend), counts, recv_counts=want_counts)
            else:
                c.alltoallv(to_backend(send, backend), counts)
        took = time.monotonic() - t0
        err = info.value
        assert took < timeout_s / 2, f"rank {me} raised {took:.2f} s after the call (timeout_s {timeout_s:g}): {err}"
        other = [odd] if me != odd else [r for r in range(W) if r != odd]  # the ranks in the other form
        if isinstance(err, cs.SymBufferMismatchError):
            assert err.field.startswith("call form") and err.peer in other, err
            assert "recv_counts" in str(err) and f"rank {err.peer} called alltoallv with" in str(err), err
        else:  # GPU: a rank waiting for call headers (or, by a race, one whose count exchange saw the abort word first)
            assert backend == "cuda" and err.aborting_rank != me, err
            assert "call form" in str(err) and "recv_counts" in str(err), err
        with pytest.raises(cs.SymBufferError, match="unusable"):
            c.alltoallv(to_backend(send, backend), counts, recv_counts=want_counts)
    finally:  # every rank closes (collective), whatever failed on this rank above
        _close(c)


def test_recv_counts_with_recv_capacity_on_one_rank_against_the_count_exchange(comm):
    """The last rank passes recv_counts and recv_capacity (they exclude each other), the others neither (a count
    exchange): that rank's rejection goes in recv_counts' form while the peers wait in the count exchange, so every
    rank raises at once; the rejecting rank raises its own ValueError (the call-form mismatch as its context), the
    others the call-form SymBufferMismatchError naming it (host path: on the GPU the rejection is queued)."""
    if comm.size < 2:
        pytest.skip("needs two ranks")
    timeout_s = 10.0  # "at once": within half of it, room for a loaded machine
    c = cs.Communicator(comm, cs.Config(**dict(CFG, timeout_s=timeout_s)), backend="host")
    try:
        W, me, odd = comm.size, comm.rank, comm.size - 1
        _valid_alltoallv(c, comm, "host", 81)
        rng = rng_for(comm, 82)
        counts = rng.integers(1, 20, W)
        send = random_rows(rng, int(counts.sum()), (5,), np.float32)
        _, want_counts = reference_alltoallv(comm, send, counts)
        comm.Barrier()
        t0 = time.monotonic()
        if me == odd:
            with pytest.raises(ValueError, match="exclude each other") as info:
                c.alltoallv(send, counts, recv_counts=want_counts, recv_capacity=int(want_counts.sum()))
            assert isinstance(info.value.__context__, cs.SymBufferMismatchError), repr(info.value.__context__)
        else:
            with pytest.raises(cs.SymBufferMismatchError) as info:
                c.alltoallv(send, counts)
            assert info.value.field.startswith("call form") and info.value.peer == odd, info.value
        took = time.monotonic() - t0
        assert took < timeout_s / 2, f"rank {me} raised {took:.2f} s after the call (timeout_s {timeout_s:g})"
    finally:  # every rank closes (collective), whatever failed on this rank above
        _close(c)


@pytest.mark.parametrize("what", ["dtype", "row_shape", "operation"])
def test_peer_disagrees_on_dtype_shape_or_operation(backend, comm, what):
    """One rank passes another dtype (same bytes), another row shape (same bytes), or calls another collective:
    every rank raises a SymBufferError (the receivers a SymBufferMismatchError naming the field), none returns
    rows."""
    if comm.size < 2:
        pytest.skip("needs two ranks")
    c = cs.Communicator(comm, cs.Config(blocking=True, **CFG), backend=backend)
    try:
        me, W = comm.rank, comm.size
        rng = rng_for(comm, 31)
        x = random_rows(rng, W, (4, 6), np.float32)
        if me == 1:
            if what == "dtype":
                x = x.view(np.int32)
            elif what == "row_shape":
                x = x.reshape(W, 6, 4)
        everything = comm.allgather(x)

        def first():
            if me == 1 and what == "operation":
                got, _ = c.alltoallv(to_backend(x, backend), np.ones(W, np.int64), recv_counts=np.ones(W, np.int64))
            else:
                got = c.alltoall(to_backend(x, backend))
            want = np.stack([everything[j][me] for j in range(W)])
            np.testing.assert_array_equal(to_numpy(got).view(np.uint8), want.view(np.uint8))

        err = _every_rank_fails(comm, first, _prepared_alltoall(c, comm, backend, 32))
        assert err is not None, f"rank {me} saw no error"
        if isinstance(err, cs.SymBufferMismatchError) and err.peer == 1:
            field = {"dtype": "signature", "row_shape": "signature", "operation": "operation"}[what]
            assert field in err.field, err
            if what == "operation":
                assert "called alltoall" in str(err) and "called alltoallv" in str(err)
    finally:  # every rank closes (collective), whatever failed on this rank above
        _close(c)


def test_notify_agreement_dtype_differs_stays_usable(comm2, comm, backend):
    """Without recv_counts the count exchange carries each rank's row signature: every rank raises ValueError
    before any payload moves, and the communicator stays usable."""
    c = comm2
    me, W = comm.rank, comm.size
    dt = np.float32 if me else np.int32
    x = to_backend(np.ones((W, 3), dt), backend)
    with pytest.raises(ValueError, match="same dtype and row shape"):
        c.alltoallv(x, np.ones(W, np.int64))
    _valid_alltoallv(c, comm, backend, 41)


def test_call_headers_checked_repeatedly(comm2, comm, backend):
    """Many calls of mixed shapes in a row: every header's sequence number and counts match (a race or a stale
    header would raise or give wrong rows)."""
    c = comm2
    for i in range(20):
        if i % 3 == 0:
            _valid_alltoall(c, comm, backend, 300 + i)
        else:
            _valid_alltoallv(c, comm, backend, 300 + i, with_recv_counts=i % 3 == 2)


def test_debug_switch_reports_ring_invariant(comm, monkeypatch):
    """CUPY_SYMBUF_DEBUG (here: the host engine's switch, read once at import) checks the ring invariants on
    every head/tail read: a head counter corrupted past the tail (as a stray write inside the symmetric buffer
    would do, which memcheck cannot see) is reported as an error naming the invariant, on rank 0, and every other
    rank raises too (the abort word)."""
    if comm.size < 2:
        pytest.skip("needs two ranks")
    from cupy_symbuf.transport import host as _host
    monkeypatch.setattr(_host, "DEBUG", True)
    c = cs.Communicator(comm, cs.Config(**CFG), backend="host")
    try:
        x = np.arange(comm.size * 8, dtype=np.float32).reshape(comm.size, 8)
        c.alltoall(x)  # fine with the checks on
        comm.Barrier()
        if comm.rank == 0:  # our head line for (channel 0, peer 1): what rank 1 consumed; now far past our tail
            head = c.layout.head_offset(0, 1)
            c.buffer.host_view(0)[head: head + 8].view(np.uint64)[0] = 10 ** 6
        comm.Barrier()
        with pytest.raises(cs.SymBufferError) as info:
            c.alltoall(x)
        if comm.rank == 0:
            assert isinstance(info.value, cs.SymBufferMismatchError)
            assert "CUPY_SYMBUF_DEBUG" in str(info.value) and "ring counters" in str(info.value)
        else:
            assert isinstance(info.value, (cs.SymBufferAbortedError, cs.SymBufferMismatchError)), info.value
    finally:  # every rank closes (collective), whatever failed on this rank above
        _close(c)


def _moe_inputs(comm, seed, num_tokens=10, hidden=32):
    rng = rng_for(comm, seed)
    E = 2 * comm.size
    x = rng.standard_normal((num_tokens, hidden)).astype(np.float32)
    idx = rng.integers(-1, E, (num_tokens, 2))
    epr = E // comm.size
    reached = np.array([len({int(e) // epr for e in row if e >= 0}) for row in idx], np.float32)
    return x, idx, E, reached


def _moe_roundtrip(c, comm, backend, seed):
    """dispatch then combine of the received rows: each token comes back summed once per rank it reached (top-2,
    so at most 2 equal float32 addends: exact)."""
    x, idx, E, reached = _moe_inputs(comm, seed)
    recv_x, _, _, _, h = c.dispatch(to_backend(x, backend), to_backend(idx, backend), None, E)
    out, _ = c.combine(recv_x, h)
    np.testing.assert_array_equal(to_numpy(out), x * reached[:, None])
    return h


@pytest.mark.parametrize("case", ["dispatch", "cached_dispatch", "combine"])
def test_moe_call_rejected_on_one_rank_only(comm2, comm, backend, case):
    """MoE calls rejected by rank 0 only: dispatch (its count exchange carries the rejection), a cached dispatch
    and combine (their call headers carry it). Rank 0 raises its own error, the others SymBufferRejectedError; then
    dispatch and combine return the NumPy reference everywhere."""
    c = comm2
    h = _moe_roundtrip(c, comm, backend, 51)
    x, idx, E, _ = _moe_inputs(comm, 51)
    bad = comm.rank == 0
    if case == "dispatch":
        if bad:
            idx = idx.copy()
            idx[0, 0] = E  # out of range
        call = lambda: c.dispatch(to_backend(x, backend), to_backend(idx, backend), None, E)  # noqa: E731
        own = "argument 'topk_idx' must hold -1"
    elif case == "cached_dispatch":
        xs = x[:-1] if bad else x  # one token short of the handle's
        call = lambda: c.dispatch(to_backend(xs, backend), handle=h)  # noqa: E731
        own = "num_tokens"
    else:
        rows = h.num_recv_tokens
        y = np.ones((rows, 32 + (1 if bad else 0)), np.float32)  # wrong hidden on rank 0
        call = lambda: c.combine(to_backend(y, backend), h)  # noqa: E731
        own = "hidden"
    if bad:
        with pytest.raises((ValueError, TypeError), match=own) as info:
            call()
        assert not isinstance(info.value, cs.SymBufferRejectedError)
    else:
        with pytest.raises(cs.SymBufferRejectedError, match="rank 0 rejected"):
            call()
    for seed in (52, 53):
        _moe_roundtrip(c, comm, backend, seed)
        _valid_alltoall(c, comm, backend, seed)


def test_ranks_call_different_collectives_with_count_exchange(backend, comm):
    """alltoallv (count exchange) on rank 0, dispatch (count exchange) on the others: every rank sees every rank's
    operation in the count exchange and raises SymBufferMismatchError naming both operations."""
    if comm.size < 2:
        pytest.skip("needs two ranks")
    c = cs.Communicator(comm, cs.Config(blocking=True, **CFG), backend=backend)
    try:
        x, idx, E, _ = _moe_inputs(comm, 61)
        with pytest.raises(cs.SymBufferMismatchError) as info:
            if comm.rank == 0:
                c.alltoallv(to_backend(np.ones((comm.size, 2), np.float32), backend), np.ones(comm.size, np.int64))
            else:
                c.dispatch(to_backend(x, backend), to_backend(idx, backend), None, E)
        assert "alltoallv" in str(info.value) and "dispatch" in str(info.value)
    finally:  # every rank closes (collective), whatever failed on this rank above
        _close(c)


def test_interrupt_during_argument_checks_is_told_to_peers(comm2, comm, backend, monkeypatch):
    """A KeyboardInterrupt (any BaseException) on rank 0 while it checks its arguments: the peers still learn of
    the rejection (SymBufferRejectedError), and the next calls are correct on every rank (review finding: the
    rank fell a call behind and every rank got the wrong call's rows)."""
    c = comm2
    import cupy_symbuf.collectives.alltoall as a2a
    real = a2a.as_array

    def interrupted(*a, **k):
        raise KeyboardInterrupt("simulated Ctrl-C during the argument checks")

    x = to_backend(np.ones((comm.size, 3), np.int64), backend)
    if comm.rank == 0:
        monkeypatch.setattr(a2a, "as_array", interrupted)
        with pytest.raises(KeyboardInterrupt):
            c.alltoall(x)
        monkeypatch.setattr(a2a, "as_array", real)
    else:
        with pytest.raises(cs.SymBufferRejectedError, match="rank 0 rejected"):
            c.alltoall(x)
    for seed in (71, 72):
        _valid_alltoall(c, comm, backend, seed)


def test_exception_inside_the_transport_aborts_the_peers(comm, monkeypatch):
    """An exception on rank 0 in the middle of moving rows (host engine): the peers leave at once with
    SymBufferAbortedError naming rank 0 (not after timeout_s), and every rank's communicator is unusable."""
    if comm.size < 2:
        pytest.skip("needs two ranks")
    import time
    from cupy_symbuf.transport import host as _host
    c = cs.Communicator(comm, cs.Config(chunk_bytes=1024, num_slots=2, timeout_s=30), backend="host")
    try:
        x = np.ones((comm.size * 64, 256), np.float32)  # 64 KiB per peer through 2 x 1 KiB rings
        counts = np.full(comm.size, 64)
        c.alltoallv(x, counts, recv_counts=counts)
        if comm.rank == 0:
            calls = {"n": 0}
            real = _host._Side.fill

            def fill(self, *a):
                calls["n"] += 1
                if calls["n"] == 3:
                    raise KeyboardInterrupt("simulated Ctrl-C inside the transport")
                return real(self, *a)
            monkeypatch.setattr(_host._Side, "fill", fill)
        comm.Barrier()
        t0 = time.monotonic()
        with pytest.raises(BaseException) as info:
            c.alltoallv(x, counts, recv_counts=counts)
        took = time.monotonic() - t0
        if comm.rank == 0:
            assert isinstance(info.value, KeyboardInterrupt)
        else:
            assert isinstance(info.value, cs.SymBufferAbortedError) and info.value.aborting_rank == 0, info.value
            assert took < 10, f"the peer waited {took:.1f} s"
        with pytest.raises(cs.SymBufferError, match="unusable"):
            c.alltoall(np.ones((comm.size, 1), np.float32))
    finally:  # every rank closes (collective), whatever failed on this rank above
        _close(c)


def test_fp8_and_structured_dtypes_are_told_apart(backend, comm):
    """Dtypes whose ``dtype.str`` is the same ('<V1' for every fp8 type of ml_dtypes, '|V8' for 8-byte structured
    dtypes): a rank with another one is a SymBufferMismatchError, never reinterpreted bytes."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    if comm.size < 2:
        pytest.skip("needs two ranks")
    if backend == "cuda":
        pytest.skip("CuPy has no fp8 / structured dtypes")
    for a, b in ((ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e4m3b11fnuz),
                 (np.dtype([("a", "<i4"), ("b", "<f4")]), np.dtype([("b", "<f4"), ("a", "<i4")]))):
        assert np.dtype(a).str == np.dtype(b).str
        c = cs.Communicator(comm, cs.Config(blocking=True, **CFG), backend=backend)
        try:
            x = np.zeros((comm.size, 4), a if comm.rank else b)
            with pytest.raises(cs.SymBufferError):
                c.alltoall(x)
                c.alltoall(np.zeros((comm.size, 4), np.float32))  # a rank whose rows went through: its next call
        finally:  # every rank closes (collective), whatever failed on this rank above
            _close(c)


def test_dispatch_num_experts_differs(comm2, comm, backend):
    """num_experts differs between ranks (ids valid for both): every rank raises ValueError from the count
    exchange (it is part of the row signature), nothing is delivered, the communicator stays usable."""
    c = comm2
    x, idx, E, _ = _moe_inputs(comm, 81)
    idx = np.where(idx >= 0, idx % comm.size, -1)  # valid for num_experts = W and 2 W
    n_exp = E if comm.rank else comm.size
    with pytest.raises(ValueError, match="num_experts"):
        c.dispatch(to_backend(x, backend), to_backend(idx, backend), None, n_exp)
    _moe_roundtrip(c, comm, backend, 82)


def test_local_error_after_the_last_step_is_not_fatal(comm, monkeypatch):
    """A MemoryError on rank 0 in combine's reduction, after the row exchange (the peers' calls are complete):
    rank 0 raises it, nothing is aborted, and every rank's next calls are correct (second review: such errors
    had been made fatal on every rank)."""
    if comm.size < 2:
        pytest.skip("needs two ranks")
    from cupy_symbuf import moe
    c = cs.Communicator(comm, cs.Config(**CFG), backend="host")
    x, idx, E, _ = _moe_inputs(comm, 91)
    recv_x, _, _, _, h = c.dispatch(x, idx, None, E)
    if comm.rank == 0:
        def oom(*a, **k):
            raise MemoryError("simulated: no memory for combine's output")
        monkeypatch.setattr(moe._dt, "from_float32", oom)
        with pytest.raises(MemoryError):
            c.combine(recv_x, h)
        monkeypatch.undo()
    else:
        c.combine(recv_x, h)
    comm.Barrier()
    _moe_roundtrip(c, comm, "host", 92)
    _valid_alltoall(c, comm, "host", 93)
    c.close()
