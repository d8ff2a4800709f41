"""A rank that leaves a communicator (an exception out of its ``with`` block, ``abort()``, ``close()``, the end of
its program) while its peers wait for it in a step of the communicator: the peers learn it at once, naming that
rank, every rank's close() is prompt and the next communicator works. Runs on 1 rank and under mpiexec (the
multi-rank cases skip on 1), over every backend of the machine; the program-end cases start their own jobs
(``tests/leaving_cases.py``; ``CUPY_SYMBUF_FAULT_BACKEND=cuda`` and ``MPIEXEC`` as for the fault tests) and skip
under mpiexec."""
import os
import re
import sys
import time

import numpy as np
import pytest

import cupy_symbuf as cs
from _jobs import KIND, UNDER_MPIEXEC, clean_env, mpi_command, run_job
from _util import RankChecks, to_backend, to_numpy

TIMEOUT_S = 20.0
BOUND_S = TIMEOUT_S / 4


def _alltoall_matches_numpy(c, comm, seed):
    """One alltoall of fresh random rows, checked against NumPy (every rank's input gathered by MPI)."""
    W, R = c.world_size, c.rank
    x = np.random.default_rng(seed * 1000 + R).standard_normal((W, 5)).astype(np.float32)
    y = to_numpy(c.alltoall(to_backend(x, c.backend)))
    everyone = np.stack(comm.allgather(x))  # [source, destination, 5]
    np.testing.assert_array_equal(y, everyone[:, R])


@pytest.mark.parametrize("step", ["empty", "zeros", "free"])
@pytest.mark.parametrize("how", ["raise", "abort", "close"])
def test_a_rank_leaving_during_its_peers_allocation_step(backend, comm, step, how):
    """Rank 1 leaves (``raise``: an exception out of its ``with`` block; ``abort``: ``abort()`` then that
    exception; ``close``: ``close()`` then that exception) while every other rank is in a symmetric allocation
    step (``empty`` / ``zeros`` / ``free``). The others' step raises at once naming rank 1
    (``SymBufferAbortedError`` when rank 1 set the abort word, else the bootstrap's "left this communicator"),
    every rank's close() returns well within ``timeout_s`` without an error of its own, and a new communicator's
    alltoall matches NumPy. (Was: the step raised "not calling the same step", close() waited ``timeout_s`` and the
    next construction failed on every rank.)"""
    if comm.size < 2:
        pytest.skip("needs two ranks")
    comm.Barrier()
    took_step = took_close = None
    err = left_by = None
    try:
        with cs.Communicator(comm, cs.Config(timeout_s=TIMEOUT_S), backend=backend) as c:
            _alltoall_matches_numpy(c, comm, 1)
            a = c.zeros((16,), np.int32)
            comm.Barrier()
            if comm.rank == 1:
                time.sleep(0.3)  # the others are in the step by now
                if how == "abort":
                    c.abort("left on purpose")
                elif how == "close":
                    c.close()
                t_close = time.monotonic()
                raise KeyError("left on purpose")
            t0 = time.monotonic()
            try:
                if step == "free":
                    c.free(a)
                else:
                    getattr(c, step)((4, 4), np.float32)
            except cs.SymBufferError as exc:
                err = exc
            took_step = time.monotonic() - t0
            t_close = time.monotonic()
            if err is not None:
                raise err
    except (KeyError, cs.SymBufferError) as exc:
        left_by = exc
    took_close = time.monotonic() - t_close
    # what each rank saw may differ by rank (a timing, the error it raised): every check is kept until every rank
    # has made every step below, then the ranks fail together, each named
    checks = RankChecks()
    with checks.local("how the block was left"):
        if comm.rank == 1:
            assert isinstance(left_by, KeyError), repr(left_by)
        else:
            assert left_by is err, repr(left_by)
            notes = getattr(left_by, "__notes__", [])
            assert not notes, f"close() failed too: {notes}"
    if comm.rank != 1:
        with checks.local(f"the peers' Communicator.{step} raises"):
            assert err is not None, f"Communicator.{step} returned although rank 1 left"
            if how == "close":  # no abort word: the bootstrap names the closing rank
                assert getattr(err, "closing", False) and err.missing == [1], repr(err)
                assert "rank 1 left this communicator" in str(err), err
            else:
                assert isinstance(err, cs.SymBufferAbortedError) and err.aborting_rank == 1, repr(err)
                assert "aborted by rank 1" in str(err), err
            assert took_step < BOUND_S, f"the step took {took_step:.1f} s (timeout_s {TIMEOUT_S:g})"
        with checks.local("closed"):
            with pytest.raises(cs.SymBufferClosedError):
                c.zeros((4,), np.float32)
    with checks.local("close() prompt"):
        assert c.closed
        assert took_close < BOUND_S, f"close() took {took_close:.1f} s (timeout_s {TIMEOUT_S:g})"
    t1 = time.monotonic()
    with cs.Communicator(comm, cs.Config(timeout_s=TIMEOUT_S), backend=backend) as c2:
        took_construct = time.monotonic() - t1
        _alltoall_matches_numpy(c2, comm, 2)
        b = c2.zeros((8,), np.float32)  # the next communicator's own allocation steps are in step too
        c2.free(b)
    with checks.local("the next construction prompt"):
        assert took_construct < BOUND_S, f"the next construction took {took_construct:.1f} s"
    comm.Barrier()
    checks.gather()


def test_a_step_abandoned_by_an_abort_leaves_nothing_for_the_next_one(backend, comm):
    """Rank 1 aborts while the others are in an allocation step, and only later (after the others have closed
    their side: they wait in close()) closes: the abandoned step's messages never meet a later step, and the
    next communicator's allocation and alltoall are right."""
    if comm.size < 2:
        pytest.skip("needs two ranks")
    comm.Barrier()
    c = cs.Communicator(comm, cs.Config(timeout_s=TIMEOUT_S), backend=backend)
    _alltoall_matches_numpy(c, comm, 3)
    comm.Barrier()
    checks = RankChecks()  # each rank's checks may fail there only: every rank still makes every step below
    if comm.rank == 1:
        time.sleep(0.3)
        c.abort("left on purpose")
        time.sleep(0.5)  # the others raise and enter close() first
    else:
        with checks.local("the peers' step raises rank 1's abort at once"):
            t0 = time.monotonic()
            with pytest.raises(cs.SymBufferAbortedError) as info:
                c.empty((3,), np.float64)
            took = time.monotonic() - t0
            assert info.value.aborting_rank == 1, repr(info.value)
            assert took < BOUND_S, f"the step took {took:.1f} s (timeout_s {TIMEOUT_S:g})"
    t1 = time.monotonic()
    c.close()
    took = time.monotonic() - t1
    with checks.local("close() prompt"):
        assert took < BOUND_S, f"close() took {took:.1f} s (timeout_s {TIMEOUT_S:g})"
    with cs.Communicator(comm, cs.Config(timeout_s=TIMEOUT_S), backend=backend) as c2:
        a = c2.empty((3,), np.float64)
        a[:] = c2.rank
        _alltoall_matches_numpy(c2, comm, 4)
    comm.Barrier()
    checks.gather()


# ---- a program that ends with a communicator open (its own jobs) -------------------------------------------

def _job(case: str, n: int, handled: bool):
    if UNDER_MPIEXEC:
        pytest.skip("starts its own MPI job (run from a pytest process that is not an MPI rank)")
    if KIND == "none":
        pytest.skip("no MPI launcher")
    env = clean_env(CUPY_SYMBUF_TIMEOUT_S=str(TIMEOUT_S), CUPY_SYMBUF_ABORT_ON_FAILURE="0" if handled else "1")
    t0 = time.monotonic()
    rc, out, killed = run_job(mpi_command(n, [sys.executable, os.path.join("tests", "leaving_cases.py"), case]),
                              env, 3 * TIMEOUT_S)
    took = time.monotonic() - t0
    assert not killed, f"the job was still running after {3 * TIMEOUT_S:g} s:\n{out}"
    assert "WRONG DATA" not in out and "NO ERROR" not in out, out
    return rc, out, took


@pytest.mark.parametrize("case, n, handled", [("sys_exit", 2, True), ("end", 2, True), ("sys_exit", 4, True),
                                              ("sys_exit", 2, False), ("sys_exit_with", 2, True),
                                              ("sys_exit_counts", 2, True), ("sys_exit_counts", 4, True),
                                              ("two_comms", 2, True), ("two_comms", 4, True),
                                              ("two_comms_alloc", 2, True), ("two_comms_alloc", 4, True)],
                         ids=["sys_exit-2-handled", "end-2-handled", "sys_exit-4-handled", "sys_exit-2-default",
                              "sys_exit_with-2-handled", "sys_exit_counts-2-handled", "sys_exit_counts-4-handled",
                              "two_comms-2-handled", "two_comms-4-handled", "two_comms_alloc-2-handled",
                              "two_comms_alloc-4-handled"])
def test_a_program_ending_with_the_communicator_open_releases_its_peers(case, n, handled):
    """Rank 1's program ends (``sys.exit(0)`` / the end of its script) with a communicator open outside any
    ``with`` block (``sys_exit_with``: ``sys.exit(0)`` inside one), while the others enter an alltoall
    (``sys_exit_counts``: an alltoallv that starts with a count exchange; ``two_comms``: an alltoall on the older
    of two open communicators while rank 1 closes the newer; ``two_comms_alloc``: a symmetric allocation there, a
    bootstrap step): they raise ``SymBufferAbortedError`` naming rank 1 within a few seconds (its exit-time
    close finds them waiting in a call it never joined and sets the abort word), not after ``timeout_s``;
    handled, they close at once (``two_comms``: at their exit) and the job ends with status 0; by default the job
    ends nonzero with that error. (Was: ``SystemExit`` never reached ``sys.excepthook``, and the peers waited
    ``timeout_s``.)"""
    rc, out, took = _job(case, n, handled)
    raised = {int(m.group(1)): (float(m.group(2)), int(m.group(3)), m.group(4))
              for m in re.finditer(r"RAISED rank=(\d+) after=([\d.]+) aborting=(-?\d+) cls=(\w+)", out)}
    expected = set(range(n)) - {1} if handled else None
    if handled:
        assert set(raised) == expected, out
        assert rc == 0, f"exit status {rc}:\n{out}"
        closed = {int(m.group(1)): float(m.group(2)) for m in re.finditer(r"CLOSED rank=(\d+) took=([\d.]+)", out)}
        if not case.startswith("two_comms"):
            assert set(closed) == expected and max(closed.values()) < BOUND_S, out
    else:
        assert raised and rc != 0, f"exit status {rc}:\n{out}"
    for r, (after, aborting, cls) in raised.items():
        assert cls == "SymBufferAbortedError" and aborting == 1, out
        assert after < BOUND_S, f"rank {r} raised {after:.1f} s after entering its alltoall:\n{out}"
    assert "its program ended (sys.exit or the end of its script)" in out, out
    assert took < TIMEOUT_S, f"the job took {took:.1f} s (timeout_s {TIMEOUT_S:g}):\n{out}"


@pytest.mark.parametrize("n", [2, 4])
def test_ranks_ending_at_different_times_still_close_cleanly(n):
    """Every rank's program ends with the communicator open, rank 1 2.5 s after the others: rank 1 is in no call
    the early ranks never joined, so they never set the abort word; the exit-time closes are collective, the job
    ends with status 0 and nothing is reported."""
    rc, out, took = _job("late", n, handled=False)
    assert rc == 0, f"exit status {rc}:\n{out}"
    assert sorted(int(r) for r in re.findall(r"DONE rank=(\d+)", out)) == list(range(n)), out
    assert "cupy_symbuf: rank" not in out and "Traceback" not in out, out
    assert took < TIMEOUT_S, out


def test_a_rank_done_with_its_call_ending_first_aborts_no_peer():
    """Three ranks; in an ``alltoallv`` rank 1 sends and receives nothing while ranks 0 and 2 exchange more than a
    ring holds, rank 2 slowed down in it: rank 1's part is done at once and its program ends with the communicator
    open. Its exit-time close waits (longer than a second) for peers that are still (rightly) in a call in which
    they need nothing more from rank 1: they must finish it with the right rows and close cleanly (exit status 0),
    not leave it with ``SymBufferAbortedError`` naming rank 1. (Failed before: the exit-time close set the abort
    word after a fixed second, whatever the peers waited for.)"""
    rc, out, took = _job("done_first", 3, handled=False)
    assert rc == 0, f"exit status {rc}:\n{out}"
    assert sorted(int(r) for r in re.findall(r"DONE rank=(\d+)", out)) == [0, 1, 2], out
    assert "Traceback" not in out, out
