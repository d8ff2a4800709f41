"""A bounded exchange that timed out (or was left) leaves messages queued on its communicator: a peer that arrived
late, a "confirm" or "withdrawn" never read. They must never be taken for a later exchange on the same
communicator: a construction retried after a timeout works at once, while ranks calling different steps still raise
the step mismatch on every rank. Every test runs on a duplicate of ``MPI.COMM_WORLD`` (the leftovers of its
timed-out steps are dropped before it is freed). Rank-local checks are kept (``RankChecks``) so that every rank
makes every collective step whatever failed on it."""
import time

import numpy as np
import pytest

import cupy_symbuf as cs
from cupy_symbuf.transport import agree as _agree
from cupy_symbuf.transport.bootstrap import MpiBootstrap
from _util import RankChecks, random_rows, rng_for
from test_lifecycle import scratch_comm  # noqa: F401 (a fixture: the duplicate, its leftovers dropped, freed)

SHORT_S = 0.4  # the timed-out step's timeout_s on the ranks that come on time
LATE_S = 1.2  # how late the late ranks come (well past SHORT_S)
RETRY_S = 20.0  # the retry's timeout_s: a retry that waits for stale messages would take this long
AT_ONCE_S = 5.0  # a retry that works at once takes well under this (4 ranks on 2 loaded cores)


@pytest.fixture
def sub(scratch_comm):
    """A duplicate of ``comm`` (two ranks at least) for a test that leaves messages of timed-out steps on it."""
    return scratch_comm


def _late_ranks(which: str, size: int) -> list:
    return {"first_peer": [1], "last": [size - 1], "all_but_0": list(range(1, size))}[which]


def _outcome(step) -> str:
    """How ``step()`` ended on this rank: "passed", "withdrawn" / "timeout" (a SymBufferTimeoutError), "mismatch"
    (the step mismatch) or another error's text."""
    try:
        step()
        return "passed"
    except cs.SymBufferTimeoutError as exc:
        return "withdrawn" if getattr(exc, "withdrawn", False) else "timeout"
    except cs.SymBufferError as exc:
        return "mismatch" if "the ranks are not calling the same step" in str(exc) else f"{type(exc).__name__}: {exc}"


def _time_out(comm, late: list, late_timeout_s: float, step) -> list:
    """``step(timeout_s)`` on every rank, the ``late`` ranks ``LATE_S`` after the others; every rank's outcome
    (each must raise a timeout: the ranks on time never hear from the late ones, which find them gone)."""
    comm.Barrier()
    if comm.rank in late:
        time.sleep(LATE_S)
    mine = _outcome(lambda: step(late_timeout_s if comm.rank in late else SHORT_S))
    return comm.allgather(mine)


def _rows(comm, seed: int):
    """This rank's fresh random rows (row j goes to rank j) and what it must receive (every rank's rows gathered
    over ``comm``, the NumPy reference)."""
    x = random_rows(rng_for(comm, seed), comm.size, (3, 5), np.float32)
    everyone = comm.allgather(x)
    return x, np.stack([everyone[j][comm.rank] for j in range(comm.size)])


def _alltoall_right(c, x, expected) -> None:
    np.testing.assert_array_equal(np.asarray(c.alltoall(x)).view(np.uint32), expected.view(np.uint32))


@pytest.mark.parametrize("late_timeout_s", [SHORT_S, 5.0], ids=["late_short", "late_long"])
@pytest.mark.parametrize("which", ["first_peer", "last", "all_but_0"])
def test_construction_retried_after_a_timeout_works_at_once(comm, sub, which, late_timeout_s):
    """The late ranks come ``LATE_S`` after the others gave up (``SHORT_S``): every rank raises a timeout (the late
    ones "withdrawn" at once). Left queued: the late ranks' "here" / "confirm" / "withdrawn" on the others, the
    others' "withdrawn" on the late ones and on each other. Then every rank builds a Communicator on the same
    comm: the first try constructs at once and its alltoall is right (was: it met those messages and failed, and
    so did the next try)."""
    late = _late_ranks(which, comm.size)
    outcomes = _time_out(comm, late, late_timeout_s,
                         lambda t: cs.Communicator(sub, cs.Config(timeout_s=t), backend="host").close())
    assert all(o in ("timeout", "withdrawn") for o in outcomes), outcomes
    assert all(outcomes[r] == "withdrawn" for r in late if r != 0), outcomes
    x1, want1 = _rows(comm, 11)
    x2, want2 = _rows(comm, 12)
    checks = RankChecks()
    with checks.local("the first retry"):  # collective steps of the library only: they fail on every rank alike
        t0 = time.monotonic()
        with cs.Communicator(sub, cs.Config(timeout_s=RETRY_S), backend="host") as c:
            _alltoall_right(c, x1, want1)
        assert time.monotonic() - t0 < AT_ONCE_S, f"the retry took {time.monotonic() - t0:.1f} s"
    with checks.local("the next construction"):
        with cs.Communicator(sub, cs.Config(timeout_s=RETRY_S), backend="host") as c:
            _alltoall_right(c, x2, want2)
    dropped = sum(comm.allgather(MpiBootstrap(sub).stale_dropped))
    checks.gather()
    assert dropped > 0  # the leftovers were met, and dropped


@pytest.mark.parametrize("kind", ["exchange_all", "barrier", "close_barrier"])
def test_agreement_step_retried_after_a_timeout_works_at_once(comm, sub, kind):
    """A bounded ``exchange_all`` / ``barrier`` (role "construction", or "close": ``agree.barrier``'s default)
    that timed out, rank 1 late, then the same step and others on every rank (a close barrier, a construction):
    all at once, with every rank's object."""
    def step(t):
        if kind == "close_barrier":
            _agree.barrier(sub, t, "retry test")
        elif kind == "barrier":
            _agree.barrier(sub, t, "retry test", role="construction")
        else:
            _agree.exchange_all(sub, comm.rank, t, "retry test")
    outcomes = _time_out(comm, [1], SHORT_S, step)
    assert "passed" not in outcomes, outcomes
    mine = float(rng_for(comm, 21).random())
    expected = comm.allgather(mine)
    x, want = _rows(comm, 22)
    checks = RankChecks()
    with checks.local("the retried steps"):
        t0 = time.monotonic()
        if kind == "close_barrier":
            _agree.barrier(sub, RETRY_S, "retry test")
        assert _agree.exchange_all(sub, mine, RETRY_S, "retry test") == expected
        assert _agree.exchange_all(sub, -mine, RETRY_S, "another step") == [-v for v in expected]
        _agree.barrier(sub, RETRY_S, "a barrier", role="construction")
        _agree.barrier(sub, RETRY_S, "a close barrier")
        with cs.Communicator(sub, cs.Config(timeout_s=RETRY_S), backend="host") as c:
            _alltoall_right(c, x, want)
        assert time.monotonic() - t0 < AT_ONCE_S, f"the retry took {time.monotonic() - t0:.1f} s"
    checks.gather()


@pytest.mark.parametrize("after_timeout", [False, True], ids=["fresh", "after_timeout"])
def test_ranks_calling_different_steps_raise_on_every_rank(comm, sub, after_timeout):
    """Rank 0 calls one step, the others another: every rank raises the step mismatch (not a timeout), at once,
    also on a communicator that carries a timed-out step's leftovers; the next step called alike works."""
    if after_timeout:
        first = _time_out(comm, [1], SHORT_S, lambda t: _agree.exchange_all(sub, 0, t, "step A"))
        assert "passed" not in first, first
    t0 = time.monotonic()
    mine = _outcome(lambda: _agree.exchange_all(sub, comm.rank, RETRY_S, "step A" if comm.rank == 0 else "step B"))
    took = time.monotonic() - t0
    outcomes = comm.allgather((mine, took))
    assert all(o == "mismatch" for o, _ in outcomes), outcomes
    assert all(t < AT_ONCE_S for _, t in outcomes), outcomes
    checks = RankChecks()
    with checks.local("the next step"):
        assert _agree.exchange_all(sub, comm.rank, RETRY_S, "step A") == list(range(comm.size))
    checks.gather()


def test_a_rank_absent_from_a_timed_out_step_takes_its_next_call_for_it(comm, sub):
    """Rank 1 never calls a step the others timed out in: the ranks' k-th steps on a communicator are the same
    step, so its next call is its late arrival there (it raises "gave up waiting" at once, as any late rank);
    the call after that meets the others' next step."""
    checks = RankChecks()
    if comm.rank != 1:
        with checks.local("the step without rank 1"):
            with pytest.raises(cs.SymBufferTimeoutError):
                _agree.exchange_all(sub, comm.rank, SHORT_S, "absent test")
    comm.Barrier()
    if comm.rank == 1:
        with checks.local("rank 1's next call"):
            t0 = time.monotonic()
            with pytest.raises(cs.SymBufferTimeoutError, match="gave up waiting") as info:
                _agree.exchange_all(sub, comm.rank, RETRY_S, "absent test")
            assert info.value.withdrawn and time.monotonic() - t0 < AT_ONCE_S
    comm.Barrier()
    with checks.local("the step after"):
        assert _agree.exchange_all(sub, comm.rank, RETRY_S, "absent test") == list(range(comm.size))
    checks.gather()


def test_a_rank_absent_from_a_timed_out_close_step_is_not_told_its_peers_are_closing(comm, sub):
    """Rank 1 never calls a close-role step (``agree.barrier``'s default role) that the others timed out in: their
    messages of it (a "here", then their "withdrawn") do not tell rank 1's other steps that they are closing (was:
    every later step that is not a close raised "rank 0 left this communicator (closing it ...)" on rank 1, and
    "gave up waiting" on the others, for good: no construction on the communicator ever worked again). Those steps
    meet at once; rank 1's next close step takes them as its late arrival there ("gave up waiting" at once), and the
    close step after meets the others'."""
    checks = RankChecks()
    if comm.rank != 1:
        with checks.local("the close step without rank 1"):
            with pytest.raises(cs.SymBufferTimeoutError):
                _agree.barrier(sub, SHORT_S, "absent close test")
    comm.Barrier()
    time.sleep(0.05)
    x, want = _rows(comm, 31)
    with checks.local("the steps after"):
        t0 = time.monotonic()
        assert _agree.exchange_all(sub, comm.rank, RETRY_S, "next step") == list(range(comm.size))
        assert _agree.exchange_all(sub, -comm.rank, RETRY_S, "the step after") == [-r for r in range(comm.size)]
        with cs.Communicator(sub, cs.Config(timeout_s=RETRY_S), backend="host") as c:
            _alltoall_right(c, x, want)
        assert time.monotonic() - t0 < AT_ONCE_S, f"the steps took {time.monotonic() - t0:.1f} s"
    comm.Barrier()
    if comm.rank == 1:
        with checks.local("rank 1's next close step"):
            t0 = time.monotonic()
            with pytest.raises(cs.SymBufferTimeoutError, match="gave up waiting") as info:
                _agree.barrier(sub, RETRY_S, "absent close test")
            assert info.value.withdrawn and time.monotonic() - t0 < AT_ONCE_S
    comm.Barrier()
    with checks.local("the close step after"):
        t0 = time.monotonic()
        _agree.barrier(sub, RETRY_S, "absent close test")
        assert time.monotonic() - t0 < AT_ONCE_S
    checks.gather()


def test_a_rank_whose_peers_dropped_its_messages_meets_their_next_step(comm, sub):
    """Rank 0 made a step alone (it timed out) and the others dropped its messages (``discard_leftovers``): rank 0
    has counted one step more than they. The next step called on every rank still meets at once (the others take
    rank 0's step number from its "here")."""
    checks = RankChecks()
    if comm.rank == 0:
        with checks.local("the lonely step"):
            with pytest.raises(cs.SymBufferTimeoutError):
                _agree.exchange_all(sub, 0, SHORT_S, "lonely step")
    comm.Barrier()
    time.sleep(0.05)
    if comm.rank != 0:
        _agree.discard_leftovers(sub)
    comm.Barrier()
    with checks.local("the next steps"):
        t0 = time.monotonic()
        assert _agree.exchange_all(sub, comm.rank, RETRY_S, "next step") == list(range(comm.size))
        assert _agree.exchange_all(sub, comm.rank, RETRY_S, "the step after") == list(range(comm.size))
        assert time.monotonic() - t0 < AT_ONCE_S
    checks.gather()


def test_exchange_count_lives_per_communicator(comm):
    """The count is the communicator's (every bootstrap over it shares it), starts at 0 on a duplicate, and goes
    with a freed communicator (a handle MPI reuses starts afresh)."""
    checks = RankChecks()
    d = comm.Dup()
    got = [_agree.exchange_all(d, comm.rank, RETRY_S, f"count {i}") for i in range(3)]
    with checks.local("three steps counted on the communicator"):
        assert got == [list(range(comm.size))] * 3
        assert MpiBootstrap(d)._x.next == 3 and MpiBootstrap(d)._x is MpiBootstrap(d)._x
    dd = MpiBootstrap(d).dup()
    with checks.local("a duplicate starts at 0"):
        assert dd._x.next == 0
    dd.free()
    d.Free()
    again = comm.Dup()
    with checks.local("a new communicator starts at 0"):
        assert MpiBootstrap(again)._x.next == 0
    again.Free()
    checks.gather()


@pytest.mark.parametrize("role", ["construction", "close"])
def test_a_look_at_the_inbox_during_a_step_keeps_that_steps_messages(comm, sub, role):
    """``peers_in_other_steps`` run from a wait's ``interrupt`` (as the exit-time close's watch does, through
    another bootstrap over the same communicator) reads the messages of the step in progress: it keeps them for
    it, never drops them as a left step's (the step then completes at once instead of timing out)."""
    def look():
        time.sleep(0.05)  # the late peer's message arrives here: the look, not the wait, reads it
        MpiBootstrap(sub).peers_in_other_steps()
    comm.Barrier()
    if comm.rank == 1:
        time.sleep(0.3)
    checks = RankChecks()
    with checks.local("the looked-at step"):
        t0 = time.monotonic()
        got = MpiBootstrap(sub).allgather(comm.rank, RETRY_S, "looked-at step", role=role, interrupt=look)
        assert got == list(range(comm.size)), got
        assert time.monotonic() - t0 < AT_ONCE_S, f"the step took {time.monotonic() - t0:.1f} s"
    checks.gather()
