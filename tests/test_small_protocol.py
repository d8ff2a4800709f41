"""The small-message protocol of the GPU alltoall (flag in data, ``cuda_src/small_exchange.cu``): sizes straddling
its threshold, dtypes, poisoned outputs, many queued calls mixed with ring calls, CUDA graph replays, a rank
rejecting a small call (alone, or followed at once by ring calls on the others), ranks disagreeing on the size,
the flag's wrap (with the test build ``CUPY_SYMBUF_NVRTC_DEFINES=-DSYMBUF_SMALL_FLAG_MOD=7``, whose flag repeats
every 14 calls; ``.ci/device.sh small-wrap``). Every result is compared with a NumPy reference on fresh random data;
a call either returns the reference rows or raises, never wrong data.

The protocol is GPU-only: the device tests skip on the host backend (whose alltoall is unchanged). The buffer-map
and Config tests at the end run anywhere.
"""
import numpy as np
import pytest

import cupy_symbuf as cs
from cupy_symbuf.wire import protocol as P
from cupy_symbuf.wire.channel_layout import ChannelLayout
from _util import RankChecks, all_ranks, random_rows, rng_for, to_backend, to_numpy

#: Payload bytes per peer the tests' communicators send by the small protocol (Config.small_bytes = W * this).
PEER = 4096


def _comm(backend, comm, *, blocking=True, small=PEER, **kw):
    if backend != "cuda":
        pytest.skip("the small-message protocol is the GPU path's")
    kw.setdefault("timeout_s", 20)
    c = cs.Communicator(comm, cs.Config(blocking=blocking, small_bytes=small * comm.size, **kw), backend=backend)
    assert c.layout.small_peer_bytes == (small if comm.size > 1 else 0)
    return c


def _close(c):
    try:
        c.close()
    except cs.SymBufferError:
        pass


def _small_calls(c) -> int:
    return c._transport.small_calls


def _reference(comm, x: np.ndarray) -> np.ndarray:
    everything = comm.allgather(x)
    return np.stack([everything[j][comm.rank] for j in range(comm.size)])


def _poisoned(shape, dtype):
    import cupy
    out = cupy.empty(shape, dtype)
    out.view(cupy.uint8)[...] = 0xA5  # no valid row is all 0xA5 bytes (random_rows draws 1..255 per byte)
    return out


def _expect(y, want):
    np.testing.assert_array_equal(to_numpy(y).view(np.uint8), want.view(np.uint8))


@pytest.mark.parametrize("dtype", [np.uint8, np.float32, np.float16, np.int64, np.complex64])
def test_sizes_straddling_the_threshold(backend, comm, dtype):
    """One element per peer, threshold - 1 element, the threshold, threshold + 1 element (bytes per peer; uint8:
    threshold - 1, threshold, threshold + 1 bytes): the first three by the small protocol, the last through the
    rings; outputs poisoned first; every result the reference."""
    c = _comm(backend, comm)
    try:
        W, item = comm.size, np.dtype(dtype).itemsize
        rng = rng_for(comm, 1)
        for per_peer, small in ((item, True), (PEER - item, True), (PEER, True), (PEER + item, False)):
            x = random_rows(rng, W, (per_peer // item,), dtype)
            want = _reference(comm, x)
            out = _poisoned(x.shape, dtype)
            before = _small_calls(c)
            y = c.alltoall(to_backend(x, backend), out=out)
            assert y is out
            all_ranks(lambda: _expect(y, want))
            assert _small_calls(c) - before == (1 if small and W > 1 else 0), (per_peer, small)
    finally:
        _close(c)


@pytest.mark.parametrize("dtype, row_shape", [(np.float32, (33,)), (np.int8, ()), (np.uint16, (7,)),
                                              (np.float64, (2, 3)), (np.uint8, (14,)), (np.int32, (0,))])
def test_dtypes_and_row_shapes(backend, comm, dtype, row_shape):
    """Row shapes of any byte count (odd ones end in a partial 4-byte word), an empty row, several dtypes."""
    c = _comm(backend, comm)
    try:
        x = random_rows(rng_for(comm, 2), comm.size, row_shape, dtype)
        want = _reference(comm, x)
        before = _small_calls(c)
        y = c.alltoall(to_backend(x, backend))
        all_ranks(lambda: _expect(y, want))
        assert _small_calls(c) - before == (1 if comm.size > 1 else 0)
    finally:
        _close(c)


def test_unaligned_and_strided_sendbuf(backend, comm):
    """A sendbuf at an odd address (the byte path of the pack) and one with a row stride (copied first)."""
    import cupy
    c = _comm(backend, comm)
    try:
        W = comm.size
        rng = rng_for(comm, 3)
        x = random_rows(rng, W, (1001,), np.uint8)
        want = _reference(comm, x)
        base = cupy.zeros(W * 1001 + 1, cupy.uint8)
        odd = base[1:].reshape(W, 1001)
        odd[...] = cupy.asarray(x)
        y = c.alltoall(odd)
        all_ranks(lambda: _expect(y, want))
        wide = cupy.zeros((W, 2000), cupy.uint8)
        wide[:, :1001] = cupy.asarray(x)
        y2 = c.alltoall(wide[:, :1001])
        all_ranks(lambda: _expect(y2, want))
    finally:
        _close(c)


@pytest.mark.parametrize("per_peer", [512 << 10, (512 << 10) - 3, 200 << 10], ids=["512KiB", "512KiB-3", "200KiB"])
def test_large_items_odd_sizes_and_addresses(backend, comm, per_peer):
    """Runs of up to 512 KiB per peer on 24 blocks (num_sms=24, the H100 default; the tuning table's 64 on an H200
    would cut items of 8 words a thread), so an item has more words than a thread's batch (SYMBUF_SMALL_BATCH, 16:
    ~21 words a thread at 2 ranks, ~43 at 4: full batches, then a part); a run ending in a partial word; sendbuf
    and output at odd addresses (the byte paths of the pack and the unpack). Three calls back to back with fresh
    data (both halves), outputs poisoned first, each the reference."""
    import cupy
    c = _comm(backend, comm, small=512 << 10, num_sms=24)
    try:
        W = comm.size
        rng = rng_for(comm, 13)
        for odd in (False, True, False):
            x = random_rows(rng, W, (per_peer,), np.uint8)
            want = _reference(comm, x)
            sendbuf = cupy.zeros(W * per_peer + 1, cupy.uint8)[int(odd):int(odd) + W * per_peer].reshape(W, per_peer)
            sendbuf[...] = cupy.asarray(x)
            out = _poisoned(W * per_peer + 1, np.uint8)[int(odd):int(odd) + W * per_peer].reshape(W, per_peer)
            before = _small_calls(c)
            y = c.alltoall(sendbuf, out=out)
            all_ranks(lambda: _expect(y, want))
            assert _small_calls(c) - before == (1 if W > 1 else 0)
    finally:
        _close(c)


@pytest.mark.parametrize("blocking", [False, True], ids=["queued", "blocking"])
def test_many_calls_alternating_small_and_large(backend, comm, blocking):
    """60 alltoalls alternating small (by the protocol) and large (through the rings), every fifth call an
    alltoallv with recv_counts (the rings, another operation), queued back to back (queued: no host wait between
    them, so a rank may run ahead of its peers by whole calls) into poisoned outputs, then all checked: a stale flag
    or a half reused too early shows up as a wrong row, a sequence number out of step as a mismatch."""
    c = _comm(backend, comm, blocking=blocking)
    try:
        W = comm.size
        rng = rng_for(comm, 4)
        calls, small_expected = [], 0
        for i in range(60):
            if i % 5 == 4:
                counts = rng.integers(0, 9, W)
                send = random_rows(rng, int(counts.sum()), (6,), np.int16)
                everything = comm.allgather((send, counts))
                parts, rc = [], []
                for s_j, c_j in everything:
                    off = np.concatenate([[0], np.cumsum(c_j)])
                    parts.append(s_j[off[comm.rank]: off[comm.rank + 1]])
                    rc.append(int(c_j[comm.rank]))
                rc = np.array(rc, np.int64)
                got, _ = c.alltoallv(to_backend(send, backend), counts, recv_counts=rc)
                calls.append((got, np.concatenate(parts, axis=0)))
                continue
            small = i % 2 == 0
            dtype = (np.uint8, np.float32)[i % 3 == 0]
            item = np.dtype(dtype).itemsize
            lo, hi = (1, PEER // item) if small else (PEER // item + 1, 3 * PEER // item)
            n = int(comm.bcast(int(rng.integers(lo, hi + 1))))  # rank 0's: the size is part of the agreed call
            x = random_rows(rng, W, (n,), dtype)
            want = _reference(comm, x)
            out = _poisoned(x.shape, dtype)
            calls.append((c.alltoall(to_backend(x, backend), out=out), want))
            small_expected += 1 if small and W > 1 else 0
        c.synchronize()

        def check():
            for k, (y, want) in enumerate(calls):
                assert y.shape == want.shape, k
                np.testing.assert_array_equal(to_numpy(y).view(np.uint8), want.view(np.uint8), err_msg=f"call {k}")
        all_ranks(check)
        assert _small_calls(c) == small_expected
    finally:
        _close(c)


def test_cuda_graph_replays(backend, comm):
    """A small alltoall, a large one and a second small one captured in one CUDA graph, replayed 4 times on fresh
    data into poisoned outputs, with eager small calls between the replays: each replay advances the sequence
    numbers on the device (the graph holds no host-side count)."""
    c = _comm(backend, comm, blocking=False)
    try:
        import cupy
        W = comm.size
        shapes = [(W, 300), (W, 3 * PEER // 4), (W, 7)]  # float32: 1200 B, 3 * PEER B, 28 B per peer
        bufs = [cupy.zeros(s, cupy.float32) for s in shapes]
        outs = [cupy.zeros(s, cupy.float32) for s in shapes]
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            for b, o in zip(bufs, outs):
                c.alltoall(b, out=o)  # warm the plans
            stream.synchronize()
            c.synchronize()
            before = _small_calls(c)
            stream.begin_capture()
            for b, o in zip(bufs, outs):
                c.alltoall(b, out=o)
            graph = stream.end_capture()
            assert _small_calls(c) - before == (2 if W > 1 else 0)
            for rep in range(4):
                rng = rng_for(comm, 50 + rep)
                xs = [random_rows(rng, W, s[1:], np.float32) for s in shapes]
                wants = [_reference(comm, x) for x in xs]
                for b, o, x in zip(bufs, outs, xs):
                    b.set(x)
                    o.view(cupy.uint8)[...] = 0xA5
                cupy.cuda.Device().synchronize()  # the inputs and the poison in place before the replay
                graph.launch(stream)
                stream.synchronize()
                c.synchronize()
                all_ranks(lambda: [_expect(o, w) for o, w in zip(outs, wants)])
                e = random_rows(rng, W, (11,), np.uint8)
                want_e = _reference(comm, e)
                ye = c.alltoall(cupy.asarray(e))
                stream.synchronize()
                all_ranks(lambda: _expect(ye, want_e))
    finally:
        _close(c)


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "queued"])
@pytest.mark.parametrize("who", ["one", "two"])
def test_rank_rejects_a_small_call(backend, comm, blocking, who):
    """Rank 0 (and rank 1: 'two', from 3 ranks) passes a sendbuf of the wrong shape; the others a valid small one.
    The rejecting ranks raise their own ValueError, the others SymBufferRejectedError naming a rejecting rank (from
    the call with blocking, else from synchronize), quickly; the next small and large calls of every rank are right
    (the sequence numbers and ring counters stayed in step)."""
    if comm.size < 2 or (who == "two" and comm.size < 3):
        pytest.skip("needs more ranks")
    c = _comm(backend, comm, blocking=blocking)
    try:
        W, me = comm.size, comm.rank
        bad = me == 0 or (who == "two" and me == 1)
        rng = rng_for(comm, 6)
        x = random_rows(rng, W + 1 if bad else W, (25,), np.float32)
        import time
        checks = RankChecks()  # what this rank raised, and when: checked on every rank before the next calls
        t0 = time.monotonic()
        if bad:
            with checks.local("its own rejection"):
                with pytest.raises(ValueError, match="world_size") as info:
                    c.alltoall(to_backend(x, backend))
                assert not isinstance(info.value, cs.SymBufferRejectedError), repr(info.value)
            c.synchronize()
        else:
            with checks.local("the peers' rejection"):
                with pytest.raises(cs.SymBufferRejectedError, match="rejected") as info:
                    c.alltoall(to_backend(x, backend))
                    c.synchronize()
                assert info.value.rejecting_rank in ((0,) if who == "one" else (0, 1)) and info.value.rank == me, \
                    repr(info.value)
        took = time.monotonic() - t0
        with checks.local("prompt"):
            assert took < 10, f"{took:.1f} s: the rejection must not wait for a timeout (timeout_s 20)"
        checks.gather()
        for seed, per_peer in ((7, 100), (8, 2 * PEER), (9, PEER)):
            y = random_rows(rng_for(comm, seed), W, (per_peer // 4,), np.float32)
            want = _reference(comm, y)
            got = c.alltoall(to_backend(y, backend))
            all_ranks(lambda: _expect(got, want))
        c.synchronize()
    finally:
        _close(c)


def test_every_rank_rejects_then_small_calls(backend, comm):
    c = _comm(backend, comm)
    try:
        with pytest.raises(ValueError, match="world_size"):
            c.alltoall(to_backend(np.ones((comm.size + 1, 3), np.float32), backend))
        x = random_rows(rng_for(comm, 10), comm.size, (5,), np.float32)
        want = _reference(comm, x)
        y = c.alltoall(to_backend(x, backend))
        all_ranks(lambda: _expect(y, want))
    finally:
        _close(c)


@pytest.mark.parametrize("case", ["both-small", "straddle", "dtype"])
def test_ranks_disagree_on_the_call(backend, comm, case):
    """Rank 1's call differs: another size that still goes by the small protocol ('both-small'), one byte per
    peer past the threshold so its call goes through the rings while the others' goes small ('straddle'), or
    another dtype of the same bytes ('dtype'). Every rank raises a SymBufferError (this call or its next), none
    returns rows that are not the reference's, and none waits for a timeout."""
    if comm.size < 2:
        pytest.skip("needs two ranks")
    import time
    c = _comm(backend, comm, blocking=True, timeout_s=60)
    try:
        W, me = comm.size, comm.rank
        n = {"both-small": PEER // 2, "straddle": PEER, "dtype": PEER // 2}[case]
        if me == 1:
            n = {"both-small": PEER // 4, "straddle": PEER + 1, "dtype": PEER // 2}[case]
        x = random_rows(rng_for(comm, 11), W, (n,), np.uint8)
        if me == 1 and case == "dtype":
            x = x.view(np.int16)
        everything = comm.allgather(x)
        follow = random_rows(rng_for(comm, 12), W, (16,), np.uint8)
        want_follow = _reference(comm, follow)

        def first():
            y = c.alltoall(to_backend(x, backend))
            want = np.stack([everything[j][me] for j in range(W)])
            np.testing.assert_array_equal(to_numpy(y).view(np.uint8), want.view(np.uint8))

        def second():
            _expect(c.alltoall(to_backend(follow, backend)), want_follow)

        t0 = time.monotonic()
        seen = None
        try:  # the second call only when the first returned the reference rows (checked)
            first()
            second()
        except cs.SymBufferError as exc:
            seen = exc
        assert seen is not None, f"rank {me} saw no error"
        assert time.monotonic() - t0 < 30, f"rank {me}: {time.monotonic() - t0:.1f} s (a timeout, not a mismatch)"
        if isinstance(seen, cs.SymBufferMismatchError) and case == "dtype":
            assert "signature" in seen.field, seen
        if isinstance(seen, cs.SymBufferMismatchError) and case == "straddle":
            assert "mode" in seen.field or "signature" in seen.field, seen
    finally:
        _close(c)


def test_small_bytes_zero_turns_it_off(backend, comm):
    c = _comm(backend, comm, small=0)
    try:
        x = random_rows(rng_for(comm, 13), comm.size, (8,), np.float32)
        want = _reference(comm, x)
        y = c.alltoall(to_backend(x, backend))
        all_ranks(lambda: _expect(y, want))
        assert _small_calls(c) == 0 and c.layout.small_region_bytes == 0
    finally:
        _close(c)


def _flag_mod() -> int:
    from cupy_symbuf.transport import kernels
    return kernels.small_flag_mod()


def _own_words(c, offset: int, count: int) -> np.ndarray:
    """``count`` uint64 words of this rank's own buffer from byte ``offset`` (a debug read; the caller made sure no
    kernel writes them meanwhile)."""
    buf = c._transport.buf
    return to_numpy(buf.peer_view(buf.rank, np.uint64, (count,), offset_bytes=offset))


def _recv_seq(c, peer: int) -> int:
    """Calls made on (channel 0, peer) by our receiver's state line (STATE_SEQ): the next call's seq is this + 1."""
    return int(_own_words(c, c.layout.recv_head_offset(0, peer) + 8 * P.STATE_SEQ, 1)[0])


def test_flag_wrap_leaves_no_stale_word(backend, comm):
    """The flag's wrap (cuda_src/protocol.cuh), with the test build whose flag repeats every 2 * M calls
    (CUPY_SYMBUF_NVRTC_DEFINES=-DSYMBUF_SMALL_FLAG_MOD=7; skipped otherwise). Twice: a small call of PEER bytes per
    peer at seq q0 (every word of its half), then only shorter calls (decreasing sizes; in the first round the calls
    whose kernel zeroes, small_zero_next, go through the rings, so the ring kernel zeroes; in the second they are
    small), then at q0 + 2 M, the flag of q0 again, a PEER call. Every call into a poisoned output, checked against
    NumPy. Before the last call, a debug read of the half: its words past what the shorter calls wrote are zero.
    Without the zeroing they still hold call q0's words with the flag call q0 + 2 M waits for: a receiver would take
    any of them whose new store had not landed yet (the lateness cannot be forced, so the words are checked)."""
    if comm.size < 2:
        pytest.skip("needs two ranks")
    mod = _flag_mod()
    if backend == "cuda" and mod > 64:
        pytest.skip("needs the flag-wrap build: CUPY_SYMBUF_NVRTC_DEFINES=-DSYMBUF_SMALL_FLAG_MOD=7")
    c = _comm(backend, comm, blocking=True)
    try:
        W, me = comm.size, comm.rank
        peers = [s for s in range(W) if s != me]
        span = 2 * mod
        rng = rng_for(comm, 20)
        seq = _recv_seq(c, peers[0])
        assert all(_recv_seq(c, s) == seq for s in peers)

        def call(per_peer: int, small: bool) -> None:
            nonlocal seq
            x = random_rows(rng, W, (per_peer,), np.uint8)
            want = _reference(comm, x)
            out = _poisoned(x.shape, np.uint8)
            before = _small_calls(c)
            y = c.alltoall(to_backend(x, backend), out=out)
            all_ranks(lambda: _expect(y, want))
            assert _small_calls(c) - before == (1 if small else 0), (seq + 1, per_peer)
            seq += 1

        for round_, zero_by in enumerate(("ring", "small")):
            q0 = seq + 1
            call(PEER, True)
            near = 0  # bytes per peer the later small calls of the half wrote
            for k, q in enumerate(range(q0 + 1, q0 + span)):
                if zero_by == "ring" and P.small_zero_next(q, mod):
                    call(PEER + 4 * (k + 1), False)
                    continue
                size = max(4, ((PEER // 2) >> (k // 2)) - k)  # decreasing, odd sizes too
                call(size, True)
                if q % 2 == q0 % 2:
                    near = max(near, size)
            assert seq == q0 + span - 1 and P.small_flag(q0 + span, mod) == P.small_flag(q0, mod)
            c.synchronize()
            flag = P.small_flag(q0 + span, mod)

            def check():
                for s in peers:
                    w = _own_words(c, c.layout.small_slot_offset(q0 & 1, s), P.SMALL_DATA_WORD + PEER // 4)
                    far = w[P.SMALL_DATA_WORD + -(-near // 4):]
                    assert not ((far >> np.uint64(32)) == flag).any(), (round_, s, "a stale word with the flag")
                    assert not far.any(), (round_, s, "the far words are not zero")
            all_ranks(check)
            comm.Barrier()  # no peer stores call q0 + span before every rank has read
            call(PEER, True)
        c.synchronize()
    finally:
        _close(c)


def test_rejection_then_a_ring_call_at_once(backend, comm):
    """50 times: one rank (in turn) rejects a small alltoall (a sendbuf of the wrong shape: its ring kernel sends
    rejection headers), while the others queue a valid small one and at once a large one (through the rings), with
    no wait between. The rejecting rank's receivers may find a peer's ring header of the large call in the ring
    before they looked at its small header of this one (cuda_src/ring_prims.cuh, wait_ring_or_small): that is no
    mismatch. Expected: ValueError on the rejecting rank, SymBufferRejectedError naming it on the others (from
    synchronize: queued calls), the large call right on every rank, and a small call after it too."""
    if comm.size < 2:
        pytest.skip("needs two ranks")
    import time
    c = _comm(backend, comm, blocking=False)
    try:
        W, me = comm.size, comm.rank
        rng = rng_for(comm, 21)
        for rep in range(50):
            who = rep % W
            bad = me == who
            x = random_rows(rng, W + 1 if bad else W, (25,), np.float32)
            big = random_rows(rng, W, (PEER // 4 + 1 + rep,), np.float32)  # past the threshold: the rings
            want = _reference(comm, big)
            tail = random_rows(rng, W, (3 + rep,), np.float32)
            want_tail = _reference(comm, tail)
            checks = RankChecks()  # what this rank raised, and when: every rank makes every call, then checks
            t0 = time.monotonic()
            if bad:
                time.sleep(0.001 * (rep % 4))  # the peers' small kernels wait, their ring calls queued behind
                with checks.local(f"repetition {rep}: its own rejection"):
                    with pytest.raises(ValueError, match="world_size") as info:
                        c.alltoall(to_backend(x, backend))
                    assert not isinstance(info.value, cs.SymBufferRejectedError), repr(info.value)
                y = c.alltoall(to_backend(big, backend))
                c.synchronize()
            else:
                c.alltoall(to_backend(x, backend))
                y = c.alltoall(to_backend(big, backend))
                with checks.local(f"repetition {rep}: the peers' rejection"):
                    with pytest.raises(cs.SymBufferRejectedError, match="rejected") as info:
                        c.synchronize()
                    assert info.value.rejecting_rank == who and info.value.rank == me, repr(info.value)
            checks.gather()
            all_ranks(lambda: _expect(y, want))
            z = c.alltoall(to_backend(tail, backend))
            c.synchronize()
            all_ranks(lambda: _expect(z, want_tail))
            took = time.monotonic() - t0
            all_ranks(lambda: took < 10 or pytest.fail(f"repetition {rep}: {took:.1f} s: a timeout, not a rejection "
                                                       f"(timeout_s 20)"))
    finally:
        _close(c)


# ---- buffer map and Config (no GPU needed) ------------------------------------------------------------------------

@pytest.mark.parametrize("world_size", [1, 2, 3, 8, 32])
@pytest.mark.parametrize("small_bytes", [0, 1 << 20, 4097])
def test_layout_accounts_for_the_small_region(world_size, small_bytes):
    L = ChannelLayout(world_size, 3, 4, 1024, max_notify_ints=5, small_bytes=small_bytes)
    off = ChannelLayout(world_size, 3, 4, 1024, max_notify_ints=5)
    peer = small_bytes // world_size if world_size > 1 else 0
    assert L.small_peer_bytes == peer
    assert L.small_offset == off.abort_offset  # after the notify region
    if not peer:
        assert L.small_region_bytes == 0 and L.total_bytes == off.total_bytes
        assert "small: none" in L.describe()
        with pytest.raises(IndexError):
            L.small_slot_offset(0, 0)
        return
    words = -(-peer // 4)
    assert L.small_slot_bytes % 128 == 0 and L.small_slot_bytes >= 8 * (P.SMALL_DATA_WORD + words)
    assert L.small_region_bytes == P.SMALL_CTRL_BYTES + 2 * world_size * L.small_slot_bytes
    assert L.abort_offset == L.small_offset + L.small_region_bytes
    assert L.total_bytes == off.total_bytes + L.small_region_bytes
    slots = sorted(L.small_slot_offset(h, s) for h in (0, 1) for s in range(world_size))
    assert slots[0] == L.small_offset + P.SMALL_CTRL_BYTES
    assert all(b - a == L.small_slot_bytes for a, b in zip(slots, slots[1:]))  # disjoint, in order
    assert slots[-1] + L.small_slot_bytes == L.abort_offset
    text = L.describe()
    assert f"small at {L.small_offset}" in text and f"{L.small_region_bytes} B" in text


def test_small_flag_never_zero_and_differs_from_two_calls_before():
    for seq in [1, 2, 3, P.SMALL_FLAG_MOD - 1, P.SMALL_FLAG_MOD, P.SMALL_FLAG_MOD + 1, P.SMALL_FLAG_MOD + 2,
                2 * P.SMALL_FLAG_MOD, (1 << 63) + 5]:
        f = P.small_flag(seq)
        assert 0 < f < 1 << 32
        if seq > 2:
            assert f != P.small_flag(seq - 2)


def _stale_matches(mod: int, calls: int, zeroes) -> list:
    """The flag's wrap, modelled (cuda_src/protocol.cuh, "The flag's wrap"): ``(c_old, c)`` for every call c of
    ``1..calls`` that could take a word the peer stored at an earlier call c_old of its half with c's flag, left
    alone by the calls between (shorter ones). A store of call c_old may land as late as the start of the receiver's
    kernel c_old + 2 (its kernel c_old + 1 received the peer's message of call c_old + 1); a zeroing by kernel x
    (``zeroes(x)``: of the half of call x + 1, before its sends) removes every store that landed before it."""
    bad = []
    for c in range(1, calls + 1):
        for c_old in range(c - 2, 0, -2):
            if P.small_flag(c_old, mod) != P.small_flag(c, mod):
                continue
            # a zeroing kernel x of this half (x + 1 = c mod 2) after the store surely landed, before call c
            if not any(zeroes(x) for x in range(c_old + 2, c) if (x + 1 - c) % 2 == 0):
                bad.append((c_old, c))
    return bad


@pytest.mark.parametrize("mod", [3, 5, 7, 9, 15])
def test_flag_wrap_rule_leaves_no_stale_flag(mod):
    """The kernel of call x zeroes the half of call x + 1 when small_zero_next(x) (the first two calls of each half
    in every epoch of 2 * mod calls): over 40 epochs no call can take a stale word with its flag, even a store that
    landed late (a call this rank rejected while the peer went small: its payload words are never read). Without
    the zeroing, or with only the first of the two (a late store of the epoch's last call survives), calls can:
    the model catches the defect the rule fixes. Four zeroings per epoch and per half pair."""
    calls = 40 * 2 * mod
    assert _stale_matches(mod, calls, lambda x: P.small_zero_next(x, mod)) == []
    assert _stale_matches(mod, calls, lambda x: False)  # no zeroing: the wrap's stale words
    first_only = lambda x: P.small_epoch(x + 1, mod) != P.small_epoch(x - 1, mod)  # noqa: E731
    assert _stale_matches(mod, calls, first_only)
    span = 2 * mod
    assert [x for x in range(1, 4 * span - 1) if P.small_zero_next(x, mod)] == \
        [k * span + d for k in (1, 2, 3) for d in (-1, 0, 1, 2)]  # epoch 0: the zeroed buffer, nothing to do
    for x in (1, 2, 3):
        assert not P.small_zero_next(x)  # the first calls of a communicator zero nothing
    big = P.SMALL_FLAG_MOD
    assert [x for x in range(2 * big - 3, 2 * big + 4) if P.small_zero_next(x)] == \
        [2 * big - 1, 2 * big, 2 * big + 1, 2 * big + 2]
    for seq in (1, 2, 2 * big - 1, 2 * big, 2 * big + 1):
        assert P.small_flag(seq + 2 * big) == P.small_flag(seq) and P.small_flag(seq + 2) != P.small_flag(seq)


def test_flag_wrap_hook_is_a_build_define(monkeypatch):
    """CUPY_SYMBUF_NVRTC_DEFINES="-DSYMBUF_SMALL_FLAG_MOD=7" (the test hook) sets the modulus the kernels are built
    with: it is part of the construction fingerprint's defines and of the kernels' build id, so ranks cannot
    differ on it (they fail at construction instead)."""
    from cupy_symbuf.transport import agree, kernels
    from cupy_symbuf.wire.channel_layout import ChannelLayout as CL
    layout = CL(2, 1, 4, 1024)
    try:
        monkeypatch.delenv("CUPY_SYMBUF_NVRTC_DEFINES", raising=False)
        kernels._tuning_defines.cache_clear()
        assert kernels.small_flag_mod() == P.SMALL_FLAG_MOD
        plain = agree.fingerprint(cs.Config(), layout, "host")
        plain_id = kernels.build_id("small_exchange.cu")
        monkeypatch.setenv("CUPY_SYMBUF_NVRTC_DEFINES", "-DSYMBUF_SMALL_FLAG_MOD=7")
        kernels._tuning_defines.cache_clear()
        assert kernels.small_flag_mod() == 7
        hooked = agree.fingerprint(cs.Config(), layout, "host")
        assert "SYMBUF_SMALL_FLAG_MOD=7" in hooked["defines"]
        with pytest.raises(ValueError, match="defines"):
            agree.check_agreement([plain, hooked], "test")
        assert kernels.build_id("small_exchange.cu") != plain_id
    finally:
        monkeypatch.delenv("CUPY_SYMBUF_NVRTC_DEFINES", raising=False)
        kernels._tuning_defines.cache_clear()


def test_config_small_bytes(monkeypatch):
    assert cs.Config().resolved("cuda", world_size=2).small_bytes == 1 << 20
    assert cs.Config(small_bytes=0).resolved("cuda", world_size=2).small_bytes == 0
    assert cs.Config(small_bytes=12345).resolved("host", world_size=2).small_bytes == 0  # no host protocol
    for bad in (-1, (64 << 20) + 1, 1.5, "1"):
        with pytest.raises(ValueError, match="small_bytes"):
            cs.Config(small_bytes=bad)
    monkeypatch.setenv("CUPY_SYMBUF_SMALL_BYTES", "0")
    assert cs.Config().resolved("cuda", world_size=2).small_bytes == 0
    monkeypatch.setenv("CUPY_SYMBUF_SMALL_BYTES", "65536")
    assert cs.Config().resolved("cuda", world_size=4).small_bytes == 65536
    monkeypatch.setenv("CUPY_SYMBUF_SMALL_BYTES", "lots")
    with pytest.raises(ValueError, match="CUPY_SYMBUF_SMALL_BYTES"):
        cs.Config()


def test_mode_mismatch_message_names_the_small_protocol():
    """The error a small receiver raises when a peer sent the same call through the rings (another size)."""
    from cupy_symbuf.common.errors import mismatch_error
    err = mismatch_error("alltoall", 0, 1, 0, P.FIELD_MODE, P.MODE_SMALL, P.MODE_RING)
    assert isinstance(err, cs.SymBufferMismatchError) and err.peer == 1 and "mode" in err.field
    assert "small-message protocol" in str(err) and "another size" in str(err)
    other = mismatch_error("alltoall", 0, 1, 0, P.FIELD_MODE, P.MODE_RING, 7)
    assert "none of ring" in str(other)


# ---- the GPU path's host code without a GPU (tests/_gpu_stub.py: launches recorded, addresses made up) -------------

def _stub():
    pytest.importorskip("cupy")
    import _gpu_stub as S
    return S


@pytest.mark.parametrize("world_size", [2, 4])
def test_host_picks_the_protocol_by_size_and_fills_its_launch(world_size):
    """At or under small_bytes // world_size per peer one symbuf_small_alltoall launch whose arguments say this call
    (bytes per peer, op, the plan's signature, the send and receive arrays, items per peer, at most the rank's
    num_sms blocks of SMALL_THREADS); one byte more per peer: the ring kernel. Decided from the size alone."""
    S = _stub()
    cp = S.cupy
    from cupy_symbuf.collectives.alltoall import alltoall
    with S.stubbed() as (launches, stream):
        eng = S.engine(launches, world_size=world_size)
        tr = eng.transport
        T = eng.layout.small_peer_bytes
        assert T == (1 << 20) // world_size and eng.small_total == T * world_size
        blocks = 2 * eng.layout.num_channels
        for per_peer, small in ((1, True), (4095, True), (T, True), (T + 1, False)):
            x = cp.empty((world_size, per_peer), np.uint8)
            launches.clear()
            y = alltoall(eng, x)
            assert [e[0] for e in launches.log] == ["symbuf_small_alltoall" if small else "ring"], per_peer
            if not small:
                continue
            _, args, grid, block, _ = launches.log[0]
            plan = eng.rows_plan("alltoall", x, np.ones(world_size, np.int64))
            per = max(1, min(-(-(-(-per_peer // 4)) // P.SMALL_WORDS_PER_ITEM), blocks // world_size))
            assert (args["bytes"], args["op"], args["sig"]) == (per_peer, P.OPS["alltoall"], plan.sig)
            assert (args["send"], args["recv"]) == (x.data.ptr, y.data.ptr)
            assert args["items_per_peer"] == per and grid == min(world_size * per, blocks)
            assert block == P.SMALL_THREADS and grid <= blocks
            assert (args["small_offset"], args["slot_bytes"]) == (eng.layout.small_offset, eng.layout.small_slot_bytes)
        assert tr.small_calls == 3


def test_host_small_protocol_off_and_the_rejection_form():
    """small_bytes=0: every alltoall through the rings. A rejected alltoall is the ring kernel's FLAG_REJECT launch
    whatever the size, with the small region in its descriptor (its receivers watch the peers' small headers)."""
    S = _stub()
    cp = S.cupy
    from cupy_symbuf.collectives.alltoall import alltoall
    with S.stubbed() as (launches, stream):
        off = S.engine(launches, small_bytes=0)
        assert off.small_total == -1 and off.transport._l_small is None
        alltoall(off, cp.empty((2, 8), np.float32))
        assert [e[0] for e in launches.log] == ["ring"]
        assert launches.log[0][1][P.DESC_SMALL_OFFSET] == 0
        eng = S.engine(launches)
        launches.clear()
        with pytest.raises(ValueError, match="world_size"):
            alltoall(eng, cp.empty((3, 8), np.float32))
        assert [e[0] for e in launches.log] == ["ring"]
        words = launches.log[0][1]
        assert words[P.DESC_FLAGS] & P.FLAG_REJECT and words[P.DESC_OP] == P.OPS["alltoall"]
        assert (words[P.DESC_SMALL_OFFSET], words[P.DESC_SMALL_SLOT_BYTES]) == \
            (eng.layout.small_offset, eng.layout.small_slot_bytes)


@pytest.mark.parametrize("small_bytes", [None, 0], ids=["small", "ring"])
def test_host_strided_sendbuf_copied_and_kept_while_capturing(small_bytes):
    """A sendbuf with a row stride goes as a contiguous copy; while the stream is being captured the copy is kept
    for the replays (the engine's graph_keep, released by close()), by either protocol: else the pool could hand
    its memory to another array after the capture and every replay would write the copy over that array."""
    S = _stub()
    cp = S.cupy
    from cupy_symbuf.collectives.alltoall import alltoall
    with S.stubbed() as (launches, stream):
        eng = S.engine(launches, **({} if small_bytes is None else {"small_bytes": small_bytes}))
        kind = "symbuf_small_alltoall" if small_bytes is None else "ring"

        def sent():
            k, args = launches.log[-1][:2]
            assert k == kind
            return args["send"] if k != "ring" else args[P.DESC_SEND_PARTS]

        wide = cp.empty((2, 64), np.uint8)
        x = wide[:, :32]
        alltoall(eng, x)
        assert sent() != x.data.ptr and not eng.graph_keep  # outside a capture nothing is kept
        stream.capturing = True
        try:
            alltoall(eng, x)
            assert sent() in [a.data.ptr for a in eng.graph_keep if hasattr(a, "data")]
        finally:
            stream.capturing = False


def test_host_small_protocol_off_on_the_staged_transport():
    """The staged transport (the symmetric buffer in registered host memory; chosen alike on every rank) runs every
    alltoall through the rings: the small kernel's control-word atomics on host memory have not run on a GPU."""
    S = _stub()
    with S.stubbed() as (launches, stream):
        eng = S.engine(launches)
        assert eng.transport.small_peer_bytes > 0
        eng.transport.staged = True  # (what CudaTransport.__init__ reads from a staged SymBuffer)
        eng.transport._init_small(0)
        assert eng.transport.small_peer_bytes == 0

