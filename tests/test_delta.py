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
