"""DeltaExchange: quantised differences with error feedback over 1,000 steps of slowly changing rows, against the
documented bound (every element within amax / 254 of its block's change, exact on refresh steps), computed from
the senders' own data (each rank regenerates every peer's rows from the peer's seed)."""
import numpy as np
import pytest

import cupy_symbuf as cs
from _util import to_backend, to_numpy


def _rows(src: int, dst: int, steps: int, rows: int, hidden: int) -> np.ndarray:
    """float32 [steps, rows, hidden]: the rows rank src sends to rank dst at each step (a random walk, a few large
    jumps)."""
    rng = np.random.default_rng([src, dst, 5])
    walk = rng.standard_normal((steps, rows, hidden)).astype(np.float32) * np.float32(0.01)
    walk[0] = rng.standard_normal((rows, hidden)) * 3
    walk[steps // 3] += 5  # a jump: the next steps carry a large residual
    return np.cumsum(walk, axis=0, dtype=np.float32)


def test_delta_exchange_stays_within_the_bound(backend, comm):
    W, me = comm.size, comm.rank
    steps, rows, hidden, block, refresh = 1000, 3, 256, 128, 250
    send = np.stack([_rows(me, d, steps, rows, hidden) for d in range(W)], axis=1)     # [steps, W, rows, hidden]
    recv_ref = np.stack([_rows(s, me, steps, rows, hidden) for s in range(W)], axis=1)
    with cs.Communicator(comm, backend=backend) as c:
        dx = cs.DeltaExchange(c, rows, hidden, block=block, refresh=refresh)
        prev = np.zeros((W, rows, hidden), np.float32)
        worst = 0.0
        inexact = 0
        for t in range(steps):
            got = to_numpy(dx.step(to_backend(send[t], backend)))
            want = recv_ref[t]
            if t % refresh == 0:
                np.testing.assert_array_equal(got, want)  # refresh: exact
            else:
                change = np.abs(want - prev).reshape(W, rows * hidden // block, block).max(axis=2)
                bound = np.repeat(change / 254, block, axis=1).reshape(W, rows, hidden)
                err = np.abs(got - want)
                assert (err <= bound * (1 + 2 ** -20) + np.abs(want) * 2 ** -22 + 1e-30).all(), \
                    f"step {t}: error {err.max()} over the bound"
                worst = max(worst, float((err / np.maximum(bound, 1e-30)).max()))
                inexact += int((err > 0).sum())
            prev = got
        assert inexact > 0 and worst > 0.1  # the deltas really are quantised (a test that could not fail otherwise)
        if W > 1:
            assert 3.5 < dx.wire_ratio < 4.0  # 1 + 4/128 bytes per element against 4, refreshes included
        assert dx.steps == steps


def test_delta_exchange_rejects_bad_arguments(backend, comm):
    with cs.Communicator(comm, backend=backend) as c:
        with pytest.raises(ValueError, match="multiple of block"):
            cs.DeltaExchange(c, 2, 100)
        with pytest.raises(ValueError, match="same"):
            cs.DeltaExchange(c, 2 + (comm.rank == 0 and comm.size > 1), 128) if comm.size > 1 else \
                (_ for _ in ()).throw(ValueError("same"))
        dx = cs.DeltaExchange(c, 2, 128, refresh=3)
        x = c.xp.ones((comm.size, 2, 128), np.float32)
        dx.step(x)
        if comm.size > 1:  # a wrong shape on rank 0: it raises, the peers are told; no copy changed anywhere
            with pytest.raises(ValueError) as info:
                dx.step(x[:, :1] if comm.rank == 0 else x * 2)
                c.synchronize()
            if comm.rank != 0:
                assert isinstance(info.value, cs.SymBufferRejectedError)
            assert dx.steps == 1
        got = to_numpy(dx.step(x * 3))
        np.testing.assert_allclose(got, 3.0, rtol=1e-2)


def test_delta_exchange_recovers_from_a_transient_inf(backend, comm):
    """From a new-user attack: one inf in a delta step made that block's scale inf, and both copies of the block stayed
    NaN for every later step until the next refresh (up to refresh - 1 steps of NaN although x was finite again).
    Now the inf step returns NaN in exactly the blocks that held it, both copies restart them from zero, and the next
    steps are within the documented bound again (previous copy 0 for those blocks), against NumPy."""
    W, me = comm.size, comm.rank
    rows, hidden, block = 2, 256, 128
    send = np.stack([_rows(me, d, 6, rows, hidden) for d in range(W)], axis=1)       # [steps, W, rows, hidden]
    recv_ref = np.stack([_rows(s, me, 6, rows, hidden) for s in range(W)], axis=1)
    hot = (me + 1) % W  # rank me puts an inf into block 1 of row 0 of what it sends to rank hot, at step 2
    send[2, hot, 0, 200] = np.inf
    recv_ref[2, (me - 1) % W, 0, 200] = np.inf
    with cs.Communicator(comm, backend=backend) as c:
        dx = cs.DeltaExchange(c, rows, hidden, block=block, refresh=100)
        prev = None
        for t in range(6):
            with np.errstate(invalid="ignore", over="ignore"):
                got = to_numpy(dx.step(to_backend(send[t], backend)))
            want = recv_ref[t]
            if t == 0:
                np.testing.assert_array_equal(got, want)
            elif t == 2:  # the block with the inf arrives as NaN, every other element is within the bound
                nan_blocks = np.isnan(got).reshape(W, rows, hidden // block, block).all(axis=3)
                expect = np.zeros_like(nan_blocks)
                expect[(me - 1) % W, 0, 1] = True
                np.testing.assert_array_equal(nan_blocks, expect)
                assert not np.isnan(got[~np.repeat(expect, block, axis=2)]).any()
            else:
                assert not np.isnan(got).any(), f"step {t}: NaN left from the inf of step 2"
                change = np.abs(want - prev).reshape(W, rows * hidden // block, block).max(axis=2)
                bound = np.repeat(change / 254, block, axis=1).reshape(W, rows, hidden)
                err = np.abs(got - want)
                assert (err <= bound * (1 + 2 ** -20) + np.abs(want) * 2 ** -22 + 1e-30).all(), \
                    f"step {t}: error {err.max()} over the bound"
            prev = np.where(np.isnan(got), np.float32(0), got)  # the restarted blocks: both copies hold zeros


def test_delta_exchange_rejects_what_is_not_an_array_on_every_rank(backend, comm):
    """From a new-user attack: x that NumPy cannot turn into an array (a ragged list) raised on that rank before the
    peers were told; the peers' step then paired with that rank's next step (a silent step shift), then timed out.
    Now it is a rejection like a wrong shape: that rank's ValueError names 'x', the peers raise
    SymBufferRejectedError, no copy changes, and the next step is exact (refresh) against NumPy."""
    W, me = comm.size, comm.rank
    with cs.Communicator(comm, backend=backend) as c:
        dx = cs.DeltaExchange(c, 2, 128, refresh=2)
        x = np.stack([_rows(me, d, 1, 2, 128)[0] for d in range(W)])
        want = np.stack([_rows(s, me, 1, 2, 128)[0] for s in range(W)])
        np.testing.assert_array_equal(to_numpy(dx.step(to_backend(x, backend))), want)
        with pytest.raises(ValueError) as info:
            dx.step([[1.0, 2.0], [3.0]] if me == 0 else to_backend(x * 2, backend))
        if me == 0:
            assert "argument 'x'" in str(info.value) and "not convertible to an array" in str(info.value)
        else:
            assert isinstance(info.value, cs.SymBufferRejectedError)
        assert dx.steps == 1
        got = to_numpy(dx.step(to_backend(x * 3, backend)))  # step 1: a delta step, in step on every rank
        np.testing.assert_allclose(got, want * 3, rtol=0, atol=float(np.abs(want * 2).max()) / 254 * 1.001)
        np.testing.assert_array_equal(to_numpy(dx.step(to_backend(x * 5, backend))), want * 5)  # step 2: refresh
