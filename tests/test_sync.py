"""Selective synchronisation (sync="strong" | "relaxed"): a relaxed call returns without waiting for the peers'
copies out of its sendbuf, the next collective (or synchronize) waits for them first, and results stay exact
against NumPy with a lagging rank, back to back; bad values are rejected on every rank."""
import time

import numpy as np
import pytest

import cupy_symbuf as cs
from cupy_symbuf.transport import host as _host
from _util import random_rows, reference_alltoallv, rng_for, to_backend, to_numpy


def _a2a_reference(comm, x):
    everything = comm.allgather(x)
    return np.stack([everything[j][comm.rank] for j in range(comm.size)])


def test_relaxed_returns_before_the_peers_copied(comm, monkeypatch):
    """Host, direct mode: the peers of rank 0 are slow to copy its rows (0.5 s in each copy). A strong call returns
    with nothing pending; a relaxed one returns with the peers' heads still pending on rank 0, the next collective
    (here synchronize) settles them, and every rank received exactly what NumPy says."""
    if comm.size < 2:
        pytest.skip("needs two ranks")
    real = _host.HostTransport._pull
    if comm.rank != 0:
        def slow(self, *a, **k):
            time.sleep(0.5)
            return real(self, *a, **k)
        monkeypatch.setattr(_host.HostTransport, "_pull", slow)
    W = comm.size
    with cs.Communicator(comm, backend="host") as c:
        rng = rng_for(comm, 21)
        x = random_rows(rng, W, (256,), np.float32)
        sym = c.array(x)
        y = c.alltoall(sym)
        assert not c._transport._pending                      # strong: every peer had copied
        np.testing.assert_array_equal(y, _a2a_reference(comm, x))
        y = c.alltoall(sym, sync="relaxed")
        if comm.rank == 0:
            assert c._transport._pending                      # returned while the peers still copy
        c.synchronize()
        assert not c._transport._pending
        sym[...] = -1.0  # allowed now: synchronize waited for the peers' (slow) copies; theirs must be untouched
        np.testing.assert_array_equal(y, _a2a_reference(comm, x))


@pytest.mark.parametrize("op", ["alltoall", "alltoallv"])
def test_relaxed_back_to_back_with_a_lagging_rank(backend, comm, op):
    """30 relaxed calls back to back, the last rank lagging a random 0-20 ms before each; two symmetric sendbufs
    used in turn (each rewritten only after the next call returned, as the contract says); exact every time."""
    W, me = comm.size, comm.rank
    rng = rng_for(comm, 22)
    lag = np.random.default_rng(5)
    with cs.Communicator(comm, backend=backend) as c:
        bufs = [c.empty(W * 64 * 16, np.uint8) for _ in range(2)]
        for i in range(30):
            if op == "alltoall":
                data = random_rows(rng, W, (64 * 16,), np.uint8)
                send = bufs[i % 2].reshape(W, 64 * 16)
                send[...] = to_backend(data, backend)
            else:
                counts = rng.integers(0, 64, W)
                data = random_rows(rng, int(counts.sum()), (16,), np.uint8)
                send = bufs[i % 2][: data.nbytes].reshape(data.shape)
                send[...] = to_backend(data, backend)
            wait = lag.uniform(0, 0.02)
            if me == W - 1:
                time.sleep(wait)
            if op == "alltoall":
                got = to_numpy(c.alltoall(send, sync="relaxed"))
                np.testing.assert_array_equal(got, _a2a_reference(comm, data))
            else:
                got, got_counts = c.alltoallv(send, counts, sync="relaxed")
                want, want_counts = reference_alltoallv(comm, data, counts)
                np.testing.assert_array_equal(np.asarray(got_counts), want_counts)
                np.testing.assert_array_equal(to_numpy(got), want)
        c.synchronize()


def test_sync_argument_is_checked(backend, comm):
    W = comm.size
    x = random_rows(rng_for(comm, 23), W, (8,), np.int32)
    with cs.Communicator(comm, backend=backend) as c:
        xb = to_backend(x, backend)
        with pytest.raises(ValueError, match="'sync' must be one of"):
            c.alltoall(xb, sync="weak")
        with pytest.raises(ValueError, match="'sync' must be one of"):
            c.alltoallv(xb, np.ones(W, np.int64), sync=None)
        if W > 1:  # rank 0 alone: it raises naming the argument, the peers are told
            with pytest.raises(ValueError) as info:
                c.alltoall(xb, sync="weak" if comm.rank == 0 else "relaxed")
                c.synchronize()
            assert ("'sync'" in str(info.value)) == (comm.rank == 0)
        np.testing.assert_array_equal(to_numpy(c.alltoall(xb, sync="relaxed")), _a2a_reference(comm, x))
        rng = np.random.default_rng(comm.rank)
        idx = to_backend(np.stack([rng.choice(2 * W, 2, replace=False) for _ in range(4)]).astype(np.int64),
                         backend)
        tok = to_backend(rng.standard_normal((4, 8)).astype(np.float32), backend)
        recv, _, _, _, handle = c.dispatch(tok, idx, None, 2 * W)
        with pytest.raises(ValueError, match="'sync' must be one of"):
            c.combine(recv, handle, sync="later")
        y, _ = c.combine(recv, handle, sync="relaxed")
        assert y.shape == (4, 8)
