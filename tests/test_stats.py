"""Communicator.stats(): per-operation calls and payload bytes to and from each rank, against the counts the test
itself sends (host path; the GPU path shares the engine code)."""
import numpy as np

import cupy_symbuf as cs
from _util import random_rows, rng_for


def test_stats_count_bytes_per_peer(comm):
    W, me = comm.size, comm.rank
    with cs.Communicator(comm, backend="host") as c:
        assert c.stats() == {}
        rng = rng_for(comm, 1)
        x = random_rows(rng, W, (10,), np.float32)          # 40 bytes to each rank
        for _ in range(3):
            c.alltoall(x)
        sent_v = np.zeros(W, np.int64)
        recv_v = np.zeros(W, np.int64)
        for trial in range(300):                              # many plans: the counters fold on the way
            counts = rng.integers(0, 5, W)
            everyone = comm.allgather(counts)
            y, rc = c.alltoallv(random_rows(rng, int(counts.sum()), (3,), np.int16), counts)
            sent_v += counts * 6
            recv_v += np.array([everyone[j][me] for j in range(W)]) * 6
        s = c.stats()
        assert s["alltoall"] == {"calls": 3, "bytes_sent": [120] * W, "bytes_received": [120] * W,
                                 "calls_device_counts": 0}
        assert s["alltoallv"]["calls"] == 300
        assert s["alltoallv"]["bytes_sent"] == sent_v.tolist() and s["alltoallv"]["bytes_received"] == recv_v.tolist()
        assert c.stats(reset=True) == s and c.stats() == {}


def test_reset_must_be_a_bool(comm):
    """From a new-user attack: ``stats(reset="no")`` zeroed the counters (any truthy value did); now a TypeError
    naming reset, and the counters are intact; True / False and NumPy bools still work."""
    import pytest
    W = comm.size
    with cs.Communicator(comm, backend="host") as c:
        x = random_rows(rng_for(comm, 2), W, (4,), np.float32)
        c.alltoall(x)
        before = c.channel_stats()
        for method in (c.stats, c.channel_stats):
            for bad in ("no", 1, None, [True]):
                with pytest.raises(TypeError, match="reset must be a bool"):
                    method(reset=bad)
        assert c.stats()["alltoall"]["calls"] == 1 and c.channel_stats() == before
        assert before["send"]["bytes_per_peer"] == [16 if p != comm.rank else 0 for p in range(W)] or W == 1
        assert c.stats(reset=np.bool_(False))["alltoall"]["calls"] == 1
        assert c.stats(reset=True)["alltoall"]["calls"] == 1 and c.stats() == {}
