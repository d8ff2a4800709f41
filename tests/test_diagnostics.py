"""Channel telemetry (Config(trace=True)) and the diagnostics CLI: a traced run with a deliberately hot rank; the
trace's byte totals agree with stats(), and the report names the hot rank; the PNGs are written."""
import importlib.util
import os
import pathlib
import tempfile

import numpy as np
import pytest
from mpi4py import MPI

import cupy_symbuf as cs
from cupy_symbuf import diagnostics
from cupy_symbuf.transport import trace as _trace
from _util import RankChecks, random_rows, rng_for, to_backend


def test_trace_and_diagnostics_name_the_hot_rank(comm, backend):
    """Both backends: on the GPU the ring kernel's copy warps write the records (SEND / RECV per chunk, SELF)."""
    W, me = comm.size, comm.rank
    with pytest.raises(ValueError, match="trace=True"):
        with cs.Communicator(comm, backend=backend) as c0:
            c0.trace()
    c = cs.Communicator(comm, cs.Config(trace=True, chunk_bytes=16384, num_slots=4), backend=backend)
    checks = RankChecks()  # this rank's trace and rank 0's report: checked on every rank after the last step
    have_matplotlib = importlib.util.find_spec("matplotlib") is not None
    try:
        rng = rng_for(comm, 1)
        for it in range(4):
            counts = rng.integers(20, 40, W)
            counts[0] = 400                      # rank 0 is hot: every rank sends it 10x the rows
            x = random_rows(rng, int(counts.sum()), (700,), np.uint8)   # ring and CMA sizes both occur
            c.alltoallv(to_backend(x, backend), counts)
            c.alltoall(to_backend(random_rows(rng, W, (3000,), np.uint8), backend))
        rec = c.trace()
        st = c.stats()
        with checks.local("this rank's trace agrees with stats()"):
            assert rec.dtype == _trace.TRACE_DTYPE and len(rec) > 0 and (rec["t1"] >= rec["t0"]).all()
            assert set(np.unique(rec["op"]).tolist()) <= {cs.wire.protocol.OPS["alltoall"],
                                                          cs.wire.protocol.OPS["alltoallv"]}
            assert (rec["channel"] >= 0).all() or backend == "host"  # host IDLE records have no channel
            if W > 1:  # every peer's run is seen, in both directions
                assert set(rec[rec["kind"] == _trace.SEND]["peer"].tolist()) == set(range(W)) - {me}
            got_in = np.zeros(W, np.int64)
            for kind in (_trace.RECV, _trace.PULL):
                sel = rec[rec["kind"] == kind]
                np.add.at(got_in, sel["peer"], sel["bytes"])
            want_in = np.array(st["alltoallv"]["bytes_received"]) + np.array(st["alltoall"]["bytes_received"])
            want_in[me] = 0                          # a rank's own rows: SELF records
            np.testing.assert_array_equal(got_in, want_in)
            own = int(rec[rec["kind"] == _trace.SELF]["bytes"].sum())
            assert own == st["alltoallv"]["bytes_sent"][me] + st["alltoall"]["bytes_sent"][me]
        folder = comm.bcast(tempfile.mkdtemp() if me == 0 else None)
        path = c.save_trace(os.path.join(folder, "trace_rank{rank}.npz"))
        with checks.local("the trace's file"):
            assert path.endswith(f"trace_rank{me}.npz"), path
        comm.Barrier()
        if me == 0:
            with checks.local("rank 0's report names the hot rank"):
                out = os.path.join(folder, "diag")
                assert diagnostics.main([os.path.join(folder, "trace_rank*.npz"), "--out", out]) == 0
                text = pathlib.Path(out, "report.txt").read_text()
                if W > 1:
                    assert "hot ranks (received > 1.25x the mean): rank 0 " in text, text
                summary = diagnostics.summarize(diagnostics.load(
                    [os.path.join(folder, f"trace_rank{r}.npz") for r in range(W)]))
                assert int(np.argmax(summary["received"])) == 0
                if have_matplotlib:
                    for name in ("channels.png", "sizes.png", "traffic.png", "busy.png"):
                        assert os.path.getsize(os.path.join(out, name)) > 1000, name
        comm.Barrier()
        with checks.local("trace(clear=True)"):
            assert len(c.trace(clear=True)) == len(rec)   # nothing ran since; then the buffer is empty
            assert len(c.trace()) == 0
    finally:
        c.close()
    checks.gather()
    if not have_matplotlib:
        pytest.skip("matplotlib is not installed: the PNGs were not checked (the rest was)")


def test_diagnostics_inputs(comm):
    """An empty trace gives a report without a traceback; a missing rank's trace and dropped events are named in
    the report; a file that is not a trace is a clear error."""
    if comm.rank != 0:
        return
    folder = tempfile.mkdtemp()
    rec = np.zeros(0, _trace.TRACE_DTYPE)
    np.savez(os.path.join(folder, "t0.npz"), records=rec, rank=0, world_size=2, config="", dropped=5)
    s = diagnostics.summarize(diagnostics.load([os.path.join(folder, "t0.npz")]))
    text = diagnostics.report(s)
    assert "no trace of ranks [1]" in text and "5 events were dropped" in text and "no events traced" in text
    assert diagnostics.main([os.path.join(folder, "t0.npz"), "--out", os.path.join(folder, "d")]) == 0
    np.savez(os.path.join(folder, "junk.npz"), a=np.zeros(3))
    with pytest.raises(ValueError, match="not a trace file"):
        diagnostics.load([os.path.join(folder, "junk.npz")])
