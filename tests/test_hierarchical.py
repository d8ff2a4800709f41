"""HierarchicalCommunicator: alltoall / alltoallv across (virtual) nodes, our channels inside a node and MPI between
them, against a flat NumPy reference; every node split of the world tried (1 rank per node, the whole world as one
node, and everything between), uneven counts with zeros, several dtypes and row shapes; bad arguments fail on
every rank."""
import numpy as np
import pytest

import cupy_symbuf as cs
from cupy_symbuf.hierarchical import HierarchicalCommunicator, node_size_from_env
from _util import random_rows, reference_alltoallv, rng_for


def _splits(W):
    return [k for k in range(1, W + 1) if W % k == 0]


@pytest.mark.parametrize("dtype,row", [(np.float32, (3,)), (np.uint8, (7,)), (np.int64, ()), (np.float16, (2, 5))])
def test_alltoallv_over_virtual_nodes_matches_numpy(comm, dtype, row):
    W = comm.size
    rng = rng_for(comm, 31)
    for k in _splits(W):
        with HierarchicalCommunicator(comm, node_size=k) as h:
            assert (h.node, h.local_rank, h.num_nodes) == (comm.rank // k, comm.rank % k, W // k)
            assert h.node_comm.world_size == k
            for trial in range(3):
                counts = rng.integers(0, 6, W)
                counts[(comm.rank + trial) % W] = 0
                send = random_rows(rng, int(counts.sum()), row, dtype)
                want, want_counts = reference_alltoallv(comm, send, counts)
                got, got_counts = h.alltoallv(send, counts)
                np.testing.assert_array_equal(got_counts, want_counts)
                assert got.dtype == send.dtype and got.shape == want.shape
                np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
            x = random_rows(rng, W, (4,), np.float32)
            everything = comm.allgather(x)
            np.testing.assert_array_equal(h.alltoall(x), np.stack([everything[j][comm.rank] for j in range(W)]))


def test_node_size_is_checked_everywhere(comm, monkeypatch):
    W = comm.size
    if W > 1:
        with pytest.raises(ValueError, match="dividing the world size|rejected"):
            HierarchicalCommunicator(comm, node_size=W + 1 if comm.rank == 0 else W)
    with pytest.raises(ValueError, match="backend must be 'host'"):
        HierarchicalCommunicator(comm, node_size=1, backend="cuda")
    monkeypatch.setenv("CUPY_SYMBUF_NODE_SIZE", "x")
    with pytest.raises(ValueError, match="CUPY_SYMBUF_NODE_SIZE"):
        node_size_from_env()
    monkeypatch.setenv("CUPY_SYMBUF_NODE_SIZE", "1")
    with HierarchicalCommunicator(comm) as h:  # from the environment: one rank per virtual node
        assert h.node_size == 1 and h.num_nodes == W
    monkeypatch.delenv("CUPY_SYMBUF_NODE_SIZE")
    with HierarchicalCommunicator(comm) as h:  # the real node: this machine, every rank
        assert h.node_size == W and h.num_nodes == 1


def test_bad_counts_fail_on_every_rank_and_it_stays_usable(comm):
    W = comm.size
    with HierarchicalCommunicator(comm, node_size=1) as h:
        x = np.arange(W * 2, dtype=np.float32).reshape(W, 2)
        bad = np.ones(W, np.int64)
        bad[0] += comm.rank == 0  # rank 0's counts do not sum to its rows
        with pytest.raises(ValueError) as info:
            h.alltoallv(x, bad)
        msg = str(info.value)
        assert ("summing" in msg and "rejected its" not in msg) if comm.rank == 0 else "rank 0 rejected" in msg
        if W > 1:  # ranks disagreeing on the row shape
            with pytest.raises(ValueError, match="same dtype and row shape"):
                h.alltoallv(x if comm.rank else x.reshape(W, 2, 1), np.ones(W, np.int64))
        with pytest.raises((TypeError, ValueError)):  # send_counts None: named, on every rank
            h.alltoallv(x, None if comm.rank == 0 else np.ones(W, np.int64))
        if W > 1:  # a bad alltoall shape on the last rank only: every rank raises, all stay in step
            with pytest.raises(ValueError):
                h.alltoall(np.zeros((W + 1, 2), np.float32) if comm.rank == W - 1 else x)
        got, n = h.alltoallv(x, np.ones(W, np.int64))
        assert n.tolist() == [1] * W and got.shape == (W, 2)
        np.testing.assert_array_equal(h.alltoall(x), np.stack([comm.allgather(x)[j][comm.rank] for j in range(W)]))
    with pytest.raises(cs.SymBufferClosedError):
        h.alltoall(x)
    with cs.Communicator(comm, backend="host") as c:  # nothing left over in MPI from the rejected calls
        assert c.world_size == W
