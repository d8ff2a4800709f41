"""The host engine's repeat path: a call of ``alltoall`` / ``alltoallv(recv_counts=...)`` whose shape matches the last
call of that op runs a prepared exchange (``HostTransport.run_prepared``). Every case checks the rows against NumPy on
fresh random data (outputs poisoned first) and against the full path; a changed shape, dtype or counts takes the full
path; a pooled output is never handed out while the caller holds it; the agreement guarantees hold on the repeat
path (a peer with other counts or dtype: every rank raises; a rejection on one rank: SymBufferRejectedError on the
others, communicator usable)."""
import numpy as np
import pytest

import cupy_symbuf as cs
from _util import RankChecks, all_ranks, random_rows, reference_alltoallv, rng_for
from test_agreement import _every_rank_fails

CFG = dict(chunk_bytes=1 << 16, num_slots=4, timeout_s=20)

# plain: the rings (inline runs, or chunks); cma: every contiguous sendbuf read by cross-memory attach
KINDS = ["plain", "cma", "default"]


def _comm(comm, kind, monkeypatch, **cfg):
    if kind == "cma":
        monkeypatch.setattr(cs.wire.protocol, "CMA_MIN_BYTES", 0)
    elif kind == "plain":
        monkeypatch.setattr(cs.wire.protocol, "CMA_MIN_BYTES", 1 << 62)
    c = cs.Communicator(comm, cs.Config(**dict(CFG, **cfg)), backend="host")
    if kind == "cma" and c._transport.cma_pids is None and comm.size > 1:
        c.close()
        pytest.skip("cross-memory attach (process_vm_readv) is not allowed between these ranks")
    return c


def _counting(c):
    """Count the prepared exchanges the communicator runs (``calls[0]``)."""
    tr = c.engine.transport
    calls = [0]
    if not hasattr(tr, "run_prepared"):
        return calls
    inner = tr.run_prepared

    def run_prepared(*args):
        calls[0] += 1
        return inner(*args)
    tr.run_prepared = run_prepared
    return calls


def _alltoall_case(comm, seed, per_peer_rows, row_shape, dtype):
    rng = rng_for(comm, seed)
    x = random_rows(rng, comm.size * per_peer_rows, row_shape, dtype).reshape(
        (comm.size, per_peer_rows) + tuple(row_shape)) if per_peer_rows > 1 else \
        random_rows(rng, comm.size, row_shape, dtype)
    everything = comm.allgather(x)
    want = np.stack([everything[j][comm.rank] for j in range(comm.size)])
    return x, want


def _repeats(kind, peer_bytes: int) -> bool:
    """Whether calls of ``peer_bytes`` per peer take the repeat path (every send run one ring slot of ``CFG``, or
    read by cross-memory attach)."""
    return kind == "cma" or peer_bytes <= cs.wire.protocol.HOST_CHUNK_LEAST_BYTES


def _poisoned(shape, dtype):
    out = np.empty(shape, dtype)
    out.view(np.uint8)[...] = 0xA5
    return out


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("row_shape, dtype", [((8192,), np.uint8), ((300,), np.float32), ((5, 3), np.int16),
                                              ((40000,), np.uint8)])
def test_repeat_alltoall_equals_full_path_and_numpy(comm, monkeypatch, kind, row_shape, dtype):
    """Repeated alltoalls of one shape on fresh data (with and without out=, out= poisoned): the repeat path runs
    from the second call on, and its rows equal NumPy's and the full path's (the record dropped before the call)."""
    c = _comm(comm, kind, monkeypatch)
    calls = _counting(c)
    for it in range(5):
        x, want = _alltoall_case(comm, 100 + it, 1, row_shape, dtype)
        got = c.alltoall(x)
        out = _poisoned(x.shape, x.dtype)
        returned = c.alltoall(x, out=out)
        c.engine.repeat.clear()  # the full path (makes the record again)
        full = c.alltoall(x)
        all_ranks(lambda: (returned is out or pytest.fail("alltoall(out=) did not return out"),
                           np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8)),
                           np.testing.assert_array_equal(out.view(np.uint8), want.view(np.uint8)),
                           np.testing.assert_array_equal(full.view(np.uint8), want.view(np.uint8))))
    c.close()  # before this rank's own count is checked: a count failing on one rank must not skip the close
    if comm.size > 1:  # every call but the full path's (the first, and the one after each clear)
        assert calls[0] == (2 * 5 - 1 if _repeats(kind, x[0].nbytes) else 0), calls


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [3, 600, 5000])
def test_repeat_alltoallv_recv_counts_equals_full_path_and_numpy(comm, monkeypatch, kind, rows):
    """alltoallv with recv_counts, counts fixed, data fresh each call, out= poisoned and without out=: the repeat
    path's rows equal NumPy's and the full path's; the returned counts are a fresh copy."""
    c = _comm(comm, kind, monkeypatch)
    calls = _counting(c)
    W, me = comm.size, comm.rank
    counts = np.array([rows + 7 * ((me + j) % 3) for j in range(W)], np.int64)
    rc = np.array(comm.alltoall([int(v) for v in counts]), np.int64)
    for it in range(4):
        rng = rng_for(comm, 300 + it)
        send = random_rows(rng, int(counts.sum()), (16,), np.uint8)
        want, want_counts = reference_alltoallv(comm, send, counts)
        out = _poisoned(want.shape, want.dtype)
        got, got_counts = c.alltoallv(send, counts, recv_counts=rc, out=out)
        got2, got_counts2 = c.alltoallv(send, counts, recv_counts=rc)
        got_counts2[0] = -5  # the caller's copy: the next call still returns the counts
        c.engine.repeat.clear()
        full, _ = c.alltoallv(send, counts, recv_counts=rc)
        all_ranks(lambda: (np.testing.assert_array_equal(out, want), np.testing.assert_array_equal(got2, want),
                           np.testing.assert_array_equal(full, want),
                           np.testing.assert_array_equal(got_counts, want_counts),
                           got is out or pytest.fail("alltoallv(out=) did not return out")))
    c.close()  # before this rank's own count is checked: a count failing on one rank must not skip the close
    if W > 1:
        assert calls[0] == (4 * 2 - 1 if _repeats(kind, int(counts.max()) * 16) else 0), calls


def test_changed_shape_dtype_or_counts_take_the_full_path(comm, monkeypatch):
    """After a repeat call, a call with another shape, dtype, strides, counts (same bytes, other values or dtype),
    or a list of counts takes the full path, with the right rows."""
    c = _comm(comm, "default", monkeypatch)
    calls = _counting(c)
    W, me = comm.size, comm.rank
    x, want = _alltoall_case(comm, 1, 1, (64,), np.float32)
    c.alltoall(x)
    c.alltoall(x)
    base = calls[0]
    variants = [_alltoall_case(comm, 2, 1, (65,), np.float32), _alltoall_case(comm, 3, 1, (64,), np.float64),
                _alltoall_case(comm, 4, 1, (64,), np.int32)]
    xs, ws = _alltoall_case(comm, 5, 1, (128,), np.float32)
    variants.append((xs[:, ::2], np.ascontiguousarray(ws[:, ::2])))  # strided: not C-contiguous
    for v, w in variants:
        c.alltoall(x)  # the record of x's shape again
        base = calls[0]
        got = c.alltoall(v)
        all_ranks(lambda: (np.testing.assert_array_equal(got.view(np.uint8), w.view(np.uint8)),
                           calls[0] == base or pytest.fail("a changed call took the repeat path")))
    # alltoallv: the counts change value (same sum on this rank), dtype or type
    counts = np.array([4 + (me + j) % 2 for j in range(W)], np.int64)
    send = random_rows(rng_for(comm, 9), int(counts.sum()), (8,), np.uint8)
    want, rc = reference_alltoallv(comm, send, counts)
    c.alltoallv(send, counts, recv_counts=rc)
    c.alltoallv(send, counts, recv_counts=rc)
    for sc, r in [(counts.astype(np.int32), rc), (counts, rc.astype(np.int32)), (list(counts), rc), (counts, list(rc))]:
        base = calls[0]
        got, got_rc = c.alltoallv(send, sc, recv_counts=r)
        all_ranks(lambda: (np.testing.assert_array_equal(got, want), np.testing.assert_array_equal(got_rc, rc),
                           calls[0] == base or pytest.fail("a changed call took the repeat path")))
    if W > 1:  # other values: the rows to rank 0 move one place (the same total on every rank)
        counts2 = counts.copy()
        counts2[0], counts2[-1] = counts2[0] + 1, counts2[-1] - 1
        want2, rc2 = reference_alltoallv(comm, send, counts2)
        c.alltoallv(send, counts, recv_counts=rc)
        base = calls[0]
        got, _ = c.alltoallv(send, counts2, recv_counts=rc2)
        all_ranks(lambda: (np.testing.assert_array_equal(got, want2),
                           calls[0] == base or pytest.fail("a changed call took the repeat path")))
        c.alltoallv(send, counts2, recv_counts=rc2)
        repeated = calls[0] - base  # its shape is the record now
        counts2[1] += 0  # in place, same values: still the repeat path
        rc2[0] = rc2[0]
        got, _ = c.alltoallv(send, counts2, recv_counts=rc2)
        all_ranks(lambda: (repeated == 1 or pytest.fail(f"{repeated} repeat calls, not 1"),
                           calls[0] == base + 2 or pytest.fail(f"{calls[0] - base} repeat calls, not 2"),
                           np.testing.assert_array_equal(got, want2)))
    c.close()


def test_pooled_output_not_handed_out_while_held(comm, monkeypatch):
    """Outputs of calls without out= come from a pool: one the caller still holds (itself, or a view of it) is
    never written by a later call; one the caller dropped is handed out again."""
    c = _comm(comm, "default", monkeypatch)
    xs, wants = zip(*[_alltoall_case(comm, 40 + i, 1, (1000,), np.float32) for i in range(6)])
    y0 = c.alltoall(xs[0])
    y1 = c.alltoall(xs[1])
    y2 = c.alltoall(xs[2])
    view = y1[1:]
    del y1
    y3 = c.alltoall(xs[3])
    all_ranks(lambda: (np.testing.assert_array_equal(y0, wants[0]), np.testing.assert_array_equal(view, wants[1][1:]),
                       np.testing.assert_array_equal(y2, wants[2]), np.testing.assert_array_equal(y3, wants[3]),
                       not any(np.shares_memory(a, b) for a, b in [(y0, y2), (y0, y3), (view, y2), (view, y3),
                                                                    (y2, y3)]) or pytest.fail("a held output shared")))
    if comm.size > 1:
        del view, y0, y2, y3
        first = c.alltoall(xs[4])
        addr = first.__array_interface__["data"][0]
        del first
        again = c.alltoall(xs[5])  # the dropped output's memory, handed out again
        all_ranks(lambda: (again.__array_interface__["data"][0] == addr or
                           pytest.fail("the dropped output's memory was not handed out again"),
                           np.testing.assert_array_equal(again, wants[5])))
    c.close()


def _holders():
    """Ways a caller keeps a repeat call's output ``y`` (dropped itself) and reads it again: ``(hold, read)``."""
    import ctypes
    return {"a view of a view": (lambda y: y.reshape(-1)[1:].view(), lambda h: h),
            "a memoryview": (lambda y: memoryview(y), np.asarray),
            "np.frombuffer": (lambda y: np.frombuffer(y, np.float32), lambda h: h),
            "a ctypes array over its buffer": (lambda y: (ctypes.c_char * y.nbytes).from_buffer(y),
                                               lambda h: np.frombuffer(h, np.float32)),
            "a DLPack consumer": (lambda y: np.from_dlpack(y), lambda h: h)}


@pytest.mark.parametrize("holder", list(_holders()))
def test_pooled_output_held_by_any_consumer_is_not_overwritten(comm, monkeypatch, holder):
    """A repeat call's output that the caller dropped but still reaches through something made from it (a view of
    a view, a memoryview, ``np.frombuffer``, a ctypes array, a DLPack consumer) keeps its rows through the calls
    after it, whose outputs are NumPy's rows in other memory; once that is dropped too the memory is handed out
    again."""
    hold, read = _holders()[holder]
    c = _comm(comm, "default", monkeypatch)
    try:
        calls = _counting(c)
        xs, wants = zip(*[_alltoall_case(comm, 140 + i, 1, (1000,), np.float32) for i in range(6)])
        c.alltoall(xs[0])  # the full path; the calls below repeat it
        y = c.alltoall(xs[1])
        addr = y.__array_interface__["data"][0]
        held = hold(y)
        del y
        live = []
        for x in xs[2:5]:  # the pool's other output, handed out again while the held one is not
            live.append(c.alltoall(x))
            live[-1] = live[-1].copy() if len(live) < 3 else live[-1]
        got = read(held)
        all_ranks(lambda: [np.testing.assert_array_equal(got.reshape(-1), wants[1].reshape(-1)[-got.size:])] +
                  [np.testing.assert_array_equal(z, w) for z, w in zip(live, wants[2:5])] +
                  [not np.shares_memory(got, live[-1]) or pytest.fail("the held output was written")])
        if comm.size > 1:
            repeats = calls[0]
            del held, got, live
            again = c.alltoall(xs[5]).__array_interface__["data"][0]  # dropped: handed out again
            all_ranks(lambda: (repeats == 4 or pytest.fail(f"{repeats} repeat calls, not 4"),
                               again == addr or pytest.fail("the dropped output's memory was not handed out again")))
    finally:
        c.close()


def test_host_pool_counts_the_base_of_its_arrays():
    """An :class:`OutputPool` of NumPy arrays that are views of a larger array (``host=True``): a caller's view of a
    set's array holds that larger array (NumPy makes a view of a view a view of the owner), so the pool counts the
    base too and never hands out a set while such a view lives; dropped, the set is handed out again."""
    from cupy_symbuf.transport.outputs import OutputPool
    pool = OutputPool(lambda: (np.empty(64, np.uint8)[16:],), host=True)
    v, = pool.take()
    assert v.base is not None and v.base.base is None  # (the caller's view refers to the owner, not the set's array)
    w, = pool.take()
    assert not np.shares_memory(v, w)
    addr = v.ctypes.data
    del v, w
    u, addr_u = pool.take_one()
    assert u.ctypes.data == addr == addr_u and len(pool) == 2


@pytest.mark.parametrize("op", ["alltoall", "alltoallv", "alltoallv count exchange"])
def test_changes_to_a_dropped_output_never_reach_the_next_one(comm, monkeypatch, op):
    """A caller may change the array object it got (shape, dtype, the writeable flag; resize), or the array it is a
    view of (``y.base``: shape, dtype, the writeable flag), and drop it: the next call's output of that shape still has
    the call's shape, dtype and a writeable buffer, and NumPy's rows (the pool hands out views of its arrays, which
    are views of owners it never hands out; a resize of one is NumPy's own error, never a write into freed
    memory)."""
    c = _comm(comm, "default", monkeypatch)
    W = comm.size
    counts = np.full(W, 3, np.int64)

    def call(x):
        if op == "alltoall":
            return c.alltoall(x)
        if op == "alltoallv":
            return c.alltoallv(x, counts, recv_counts=counts)[0]
        return c.alltoallv(x, counts)[0]

    rng = rng_for(comm, 77)
    try:
        _change_and_drop(comm, op, call, rng, counts)
    finally:
        c.close()


def _change_and_drop(comm, op, call, rng, counts):
    """The body of test_changes_to_a_dropped_output_never_reach_the_next_one (``call`` runs ``op``)."""
    W = comm.size
    for change in ["shape", "dtype", "readonly", "resize", "base shape", "base dtype", "base readonly", "none"]:
        for _ in range(3):  # the full path's output, then the repeat path's
            x = random_rows(rng, 3 * W, (8,), np.float32)
            want, _ = reference_alltoallv(comm, x, counts)
            y = call(x.reshape(W, 3, 8) if op == "alltoall" else x)
            np.testing.assert_array_equal(y.reshape(want.shape), want)
            shape, dtype = y.shape, y.dtype
            what = change
            if change.startswith("base "):  # the array the output is a view of (itself where it is no view)
                y = y if y.base is None else y.base
                what = change[5:]
            if what == "shape":
                y.shape = (-1,)
            elif what == "dtype":
                y.dtype = np.uint8
            elif what == "readonly":
                y.flags.writeable = False
            elif what == "resize":  # a pooled output is a view (NumPy refuses); an unpooled one is the caller's
                try:
                    y.resize((6 * W, 8), refcheck=False)
                except ValueError:
                    pass
            del y
            x = random_rows(rng, 3 * W, (8,), np.float32)
            want, _ = reference_alltoallv(comm, x, counts)
            z = call(x.reshape(W, 3, 8) if op == "alltoall" else x)
            assert z.shape == shape and z.dtype == dtype and z.flags.writeable, (change, z.shape, z.dtype)
            np.testing.assert_array_equal(z.reshape(want.shape), want)
            del z


@pytest.mark.parametrize("kind", ["plain", "cma"])
@pytest.mark.parametrize("what", ["counts", "dtype"])
def test_peer_differs_while_this_rank_repeats(comm, monkeypatch, kind, what):
    """Rank 0 repeats a call shape (the repeat path), rank 1 sends one row more to rank 0 (``counts``) or the same
    bytes as another dtype (``dtype``): every rank raises (this call or its next), rank 0 a SymBufferMismatchError
    naming rank 1 (or, ``dtype`` with more ranks, the abort of rank 1, which found it first), and no rank returns
    wrong rows."""
    if comm.size < 2:
        pytest.skip("needs two ranks")
    c = _comm(comm, kind, monkeypatch, blocking=True)
    calls = _counting(c)
    W, me = comm.size, comm.rank
    counts = np.full(W, 6, np.int64)
    send = random_rows(rng_for(comm, 61), int(counts.sum()), (4,), np.float32)
    want, rc = reference_alltoallv(comm, send, counts)
    for _ in range(2):
        got, _ = c.alltoallv(send, counts, recv_counts=rc)
        all_ranks(lambda: np.testing.assert_array_equal(got, want))
    before = calls[0]
    send2, counts2 = send, counts
    if me == 1 and what == "counts":
        counts2 = counts.copy()
        counts2[0] += 1  # one row more to rank 0; the rows to every other rank as before
        send2 = np.insert(send, int(counts[0]), random_rows(rng_for(comm, 62), 1, (4,), np.float32), axis=0)
    elif me == 1:
        send2 = send.view(np.int32)

    def first():
        got, _ = c.alltoallv(send2, counts2, recv_counts=rc)
        np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))

    x, wa = _alltoall_case(comm, 63, 1, (5,), np.float32)

    def second():
        np.testing.assert_array_equal(c.alltoall(x), wa)

    err = _every_rank_fails(comm, first, second)
    repeated = calls[0] - before
    try:  # every rank closes (collective) before its own checks
        c.close()
    except cs.SymBufferError:
        pass
    assert err is not None, f"rank {me} saw no error"
    if me == 0:
        assert repeated == 1, repeated  # rank 0's call was a repeat call
        if isinstance(err, cs.SymBufferAbortedError):  # (more ranks: rank 1 found its dtype differs first)
            assert W > 2 and what == "dtype" and err.aborting_rank == 1, err
        else:
            assert isinstance(err, cs.SymBufferMismatchError) and err.peer == 1, err
            assert ("row count" if what == "counts" else "signature") in err.field, err


@pytest.mark.parametrize("kind", ["plain", "cma"])
@pytest.mark.parametrize("op", ["alltoall", "alltoallv"])
def test_rejection_on_one_rank_while_the_peers_repeat(comm, monkeypatch, kind, op):
    """Rank 0 passes a bad call, the others repeat their call shape: rank 0 raises ValueError, the others
    SymBufferRejectedError naming rank 0 (from the repeat path), and the next calls (repeat path again) return the
    NumPy reference."""
    if comm.size < 2:
        pytest.skip("needs two ranks")
    c = _comm(comm, kind, monkeypatch)
    calls = _counting(c)
    W, me = comm.size, comm.rank
    counts = np.full(W, 9, np.int64)

    def valid(seed):
        send = random_rows(rng_for(comm, seed), int(counts.sum()), (8,), np.uint16)
        want, rc = reference_alltoallv(comm, send, counts)
        if op == "alltoall":
            x = send[:W]
            everything = comm.allgather(x)
            got = c.alltoall(x)
            all_ranks(lambda: np.testing.assert_array_equal(got, np.stack([everything[j][me] for j in range(W)])))
        else:
            got, _ = c.alltoallv(send, counts, recv_counts=rc, out=_poisoned(want.shape, want.dtype))
            all_ranks(lambda: np.testing.assert_array_equal(got, want))
        return send, rc

    send, rc = valid(70)
    valid(71)
    before = calls[0]
    checks = RankChecks()  # what this rank raised: checked on every rank before the next (collective) calls
    if me == 0:
        with checks.local("rank 0's own rejection"):
            with pytest.raises(ValueError) as info:
                if op == "alltoall":
                    c.alltoall(send[:W + 1])
                else:
                    bad = rc.copy()
                    bad[1] = -1
                    c.alltoallv(send, counts, recv_counts=bad)
            assert not isinstance(info.value, cs.SymBufferRejectedError), repr(info.value)
    else:
        with checks.local("the peers' SymBufferRejectedError, from the repeat path"):
            with pytest.raises(cs.SymBufferRejectedError, match="rank 0 rejected") as info:
                if op == "alltoall":
                    c.alltoall(send[:W])
                else:
                    c.alltoallv(send, counts, recv_counts=rc)
            assert info.value.rejecting_rank == 0, repr(info.value)
            assert calls[0] == before + 1, calls[0] - before  # raised by the repeat path
    checks.gather()
    for seed in range(3):
        valid(72 + seed)
    c.close()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [3, 600, 5000])
def test_repeat_alltoallv_count_exchange(comm, monkeypatch, kind, rows):
    """alltoallv without recv_counts, counts fixed and data fresh each call: after the count exchange a repeat call
    runs the prepared exchange when the counts received are the record's, with NumPy's rows and counts; when a peer
    sends other counts (legal here) the call goes on by the full path, with the right rows."""
    c = _comm(comm, kind, monkeypatch)
    calls = _counting(c)
    W, me = comm.size, comm.rank
    counts = np.array([rows + 7 * ((me + j) % 3) for j in range(W)], np.int64)
    for it in range(4):
        send = random_rows(rng_for(comm, 400 + it), int(counts.sum()), (16,), np.uint8)
        want, want_counts = reference_alltoallv(comm, send, counts)
        got, got_counts = c.alltoallv(send, counts)
        got_counts[0] = -5  # the caller's copy
        c.engine.repeat.clear()
        full, full_counts = c.alltoallv(send, counts)
        all_ranks(lambda: (np.testing.assert_array_equal(got, want), np.testing.assert_array_equal(full, want),
                           np.testing.assert_array_equal(full_counts, want_counts)))
    repeats = _repeats(kind, int(counts.max()) * 16)
    if W > 1:
        n = calls[0]
        all_ranks(lambda: n == (3 if repeats else 0) or pytest.fail(f"{n} repeat calls"))
        # the last rank sends one row more to rank 0; rank 0 passes the counts of its record
        send = random_rows(rng_for(comm, 499), int(counts.sum()), (16,), np.uint8)
        sc = counts
        if me == W - 1:
            sc = counts.copy()
            sc[0] += 1
            send = np.insert(send, int(counts[0]), random_rows(rng_for(comm, 498), 1, (16,), np.uint8), axis=0)
        want, want_counts = reference_alltoallv(comm, send, sc)
        before = calls[0]
        got, got_counts = c.alltoallv(send, sc)
        all_ranks(lambda: (np.testing.assert_array_equal(got, want),
                           np.testing.assert_array_equal(got_counts, want_counts),
                           me != 0 or calls[0] == before or pytest.fail("rank 0's call took the repeat path")))
    c.close()


@pytest.mark.parametrize("kind", ["plain", "cma"])
def test_header_the_repeat_path_does_not_expect_gets_the_full_check(comm, monkeypatch, kind):
    """Rank 0's repeat calls send call headers that say the run continues on a second channel (a sender that cuts
    its runs otherwise): rank 1, on its repeat path, hands the header to the full check and raises
    SymBufferMismatchError naming rank 0 and the ring field before it takes a byte; rank 0 raises
    SymBufferAbortedError naming rank 1 (this call or its next); no rank returns wrong rows."""
    if comm.size != 2:
        pytest.skip("two ranks")
    c = _comm(comm, kind, monkeypatch)
    from cupy_symbuf.wire import protocol as P
    x, want = _alltoall_case(comm, 91, 1, (4096,), np.uint8)
    for _ in range(2):
        got = c.alltoall(x)
        all_ranks(lambda: np.testing.assert_array_equal(got, want))
    rec = c.engine.repeat["alltoall"]
    if comm.rank == 0:
        for s in rec.prep.sends:
            s[5][P.HDR_NCHANNELS] = 2
    calls = _counting(c)

    def first():
        np.testing.assert_array_equal(c.alltoall(x), want)

    err = _every_rank_fails(comm, first, first)
    try:  # every rank closes (collective) before its own checks
        c.close()
    except cs.SymBufferError:
        pass
    assert calls[0] >= 1
    if comm.rank == 1:
        assert isinstance(err, cs.SymBufferMismatchError), err
        assert err.peer == 0 and err.channel == 0 and err.field == P.FIELD_NAMES[P.FIELD_RING], err
    else:
        assert isinstance(err, cs.SymBufferAbortedError) and err.aborting_rank == 1, err


def test_symmetric_sendbuf_of_the_record_shape_takes_the_full_path(comm, monkeypatch):
    """A record made from plain sendbufs: a symmetric array of the same shape takes the full path (direct mode,
    the right rows), and a view of a freed symmetric array is refused on every rank (ValueError naming it), as
    without a record."""
    c = _comm(comm, "default", monkeypatch)
    calls = _counting(c)
    x, want = _alltoall_case(comm, 95, 1, (512,), np.float32)
    c.alltoall(x)
    c.alltoall(x)
    base = calls[0]
    sym = c.empty(x.shape, x.dtype)
    sym[...] = x
    got = c.alltoall(sym)
    all_ranks(lambda: (np.testing.assert_array_equal(got, want),
                       calls[0] == base or pytest.fail("a symmetric sendbuf took the repeat path")))
    c.alltoall(x)
    c.free(sym)
    with pytest.raises(ValueError, match="freed"):
        c.alltoall(sym)
    got = c.alltoall(x)  # usable
    all_ranks(lambda: np.testing.assert_array_equal(got, want))
    c.close()


def test_outputs_past_the_pool_size_are_not_kept(comm, monkeypatch):
    """An output larger than the pool's bound is allocated per call (the record keeps none alive); the repeat path
    still runs, with NumPy's rows."""
    from cupy_symbuf.collectives import alltoall as _a2a
    monkeypatch.setattr(_a2a, "POOL_BYTES", 1000)
    c = _comm(comm, "default", monkeypatch)
    calls = _counting(c)
    for it in range(3):
        x, want = _alltoall_case(comm, 80 + it, 1, (512,), np.float32)
        got = c.alltoall(x)
        all_ranks(lambda: np.testing.assert_array_equal(got, want))
    pooled = len(c.engine.repeat["alltoall"].pool) if comm.size > 1 else 0
    c.close()  # before this rank's own counts are checked
    if comm.size > 1:  # (one rank: no repeat path, nothing to exchange)
        assert pooled == 0
        assert calls[0] == 2


@pytest.mark.parametrize("per_peer", [5000, 300000])
def test_peer_sends_ring_chunks_while_this_rank_repeats(comm, monkeypatch, per_peer):
    """Every rank but 0 turns to the rings for its sends (the cross-memory attach threshold raised there: in its
    header's slot, or in chunks over every channel) while rank 0 repeats a call shape read by cross-memory attach:
    rank 0's repeat path takes each peer's run as its header says (the chunks drained behind their headers), and
    every rank gets NumPy's rows, call after call."""
    if comm.size < 2:
        pytest.skip("needs two ranks")
    c = _comm(comm, "cma", monkeypatch)
    calls = _counting(c)
    W, me = comm.size, comm.rank
    for it in range(4):
        x, want = _alltoall_case(comm, 120 + it, 1, (per_peer,), np.uint8)
        if it >= 2 and me != 0:
            monkeypatch.setattr(cs.wire.protocol, "CMA_MIN_BYTES", 1 << 62)
            c.engine.repeat.clear()  # (a record holds the mode its shape had: the full path finds the new one)
        got = c.alltoall(x)
        all_ranks(lambda: np.testing.assert_array_equal(got, want))
    c.close()  # before this rank's own count is checked
    if me == 0:
        assert calls[0] == 3
