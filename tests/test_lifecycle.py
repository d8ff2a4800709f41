"""Lifecycle: construction agreement, bounds and memory checks, bounded construction and close, abort(),
ResourceWarning on leaks, atexit, re-creation, fork. Runs on 1 rank and under mpiexec; multi-rank cases skip on 1."""
import gc
import os
import time
import warnings

import numpy as np
import pytest

import cupy_symbuf as cs
from cupy_symbuf.transport import agree as _agree
from cupy_symbuf.transport import lifecycle as _lifecycle
from cupy_symbuf.transport import symbuffer
from cupy_symbuf.wire.channel_layout import ChannelLayout
from _util import RankChecks, to_backend, to_numpy


def _need2(comm):
    if comm.size < 2:
        pytest.skip("needs two ranks")


def _check_alltoall(c, width=3):
    W, R = c.world_size, c.rank
    x = (R * 1000 + np.arange(W)[:, None] * 10 + np.arange(width)[None, :]).astype(np.float32)
    y = to_numpy(c.alltoall(to_backend(x, c.backend)))
    expected = (np.arange(W)[:, None] * 1000 + R * 10 + np.arange(width)[None, :]).astype(np.float32)
    np.testing.assert_array_equal(y, expected)


def _all_ranks(comm, ok: bool) -> None:
    """Keep ranks in step: every rank learns whether every rank's part passed."""
    assert all(comm.allgather(ok)), "another rank's part failed"


# ---- construction agreement ----------------------------------------------------------------------------------

def test_mismatched_config_same_total_size_raises_on_every_rank(backend, comm):
    _need2(comm)
    a, b = cs.Config(chunk_bytes=1024, num_slots=4), cs.Config(chunk_bytes=2048, num_slots=2)
    la, lb = (ChannelLayout.from_config(cfg.resolved(backend, world_size=comm.size), comm.size) for cfg in (a, b))
    assert la.total_bytes == lb.total_bytes  # the hazard: the buffers alone cannot tell them apart
    others = "rank 1 has 2048" if comm.size == 2 else "ranks " + ",".join(map(str, range(1, comm.size))) + \
        " have 2048"
    with pytest.raises(ValueError) as info:
        cs.Communicator(comm, a if comm.rank == 0 else b, backend=backend)
    assert str(info.value).startswith(f"Communicator: ranks disagree on config.chunk_bytes: rank 0 has 1024, "
                                      f"{others}")
    with cs.Communicator(comm, a, backend=backend) as c:  # a correct construction afterwards works
        assert c.config.chunk_bytes == 1024 and c.config.num_slots == 4
        _check_alltoall(c)


@pytest.fixture
def fresh_defines():
    """The compile-time defines are read once per process: re-read them for the test, and after it."""
    from cupy_symbuf.transport import kernels as _kernels
    caches = [f for f in (getattr(_kernels, n, None) for n in ("_tuning_defines", "_debug_defines"))
              if hasattr(f, "cache_clear")]
    for f in caches:
        f.cache_clear()
    yield
    for f in caches:
        f.cache_clear()


def test_mismatched_defines_and_debug_switch(backend, comm, monkeypatch, fresh_defines):
    _need2(comm)
    from cupy_symbuf.transport import kernels as _kernels
    monkeypatch.setenv("CUPY_SYMBUF_NVRTC_DEFINES", f"-DSYMBUF_UNROLL={2 + (comm.rank > 0) * 2}")
    with pytest.raises(ValueError, match=r"ranks disagree on defines: rank 0 has '-DSYMBUF_UNROLL=2', "
                                         r"ranks? [\d,]+ ha(s|ve) '-DSYMBUF_UNROLL=4'"):
        cs.Communicator(comm, backend=backend)
    monkeypatch.delenv("CUPY_SYMBUF_NVRTC_DEFINES")
    _kernels._tuning_defines.cache_clear()
    monkeypatch.setenv("CUPY_SYMBUF_DEBUG", "1" if comm.rank == 0 else "")
    if hasattr(_kernels, "_debug_defines"):
        _kernels._debug_defines.cache_clear()
    with pytest.raises(ValueError, match=r"ranks disagree on debug: rank 0 has '-DSYMBUF_DEBUG=1'"):
        cs.Communicator(comm, backend=backend)


def test_local_policy_fields_may_differ(backend, comm):
    cfg = cs.Config(timeout_s=5.0 + comm.rank, blocking=comm.rank % 2 == 1, abort_on_failure=comm.rank == 0)
    with cs.Communicator(comm, cfg, backend=backend) as c:
        assert c.config.timeout_s == 5.0 + comm.rank and c.config.abort_on_failure == (comm.rank == 0)
        _check_alltoall(c)


def test_fingerprint_covers_the_wire_and_names_field():
    cfg = cs.Config(num_sms=4, chunk_bytes=1024, num_slots=4).resolved("host", world_size=2)
    fp = _agree.fingerprint(cfg, ChannelLayout.from_config(cfg, 2), "host")
    for key in ("config.num_sms", "config.chunk_bytes", "config.num_slots", "config.max_notify_ints",
                "layout.total_bytes", "layout.num_channels", "backend", "kernel.ring_warps", "kernel.self_warps",
                "kernel.max_threads", "defines", "debug", "package_version", "protocol_version"):
        assert key in fp, key
    assert not any(k.endswith(f) for k in fp for f in _agree.LOCAL_POLICY_FIELDS)
    assert fp["kernel.ring_warps"] == 11 and fp["kernel.self_warps"] == 5  # 2 ranks: 11 + 5 warps
    other = dict(fp, **{"kernel.ring_warps": 8})
    with pytest.raises(ValueError, match=r"^X: ranks disagree on kernel\.ring_warps: ranks 0,2 have 11, rank 1 "
                                         r"has 8"):
        _agree.check_agreement([fp, other, fp], "X")
    _agree.check_agreement([fp, dict(fp)], "X")  # equal: no error


# ---- bounds and memory --------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, rule", [
    ({"num_slots": 10 ** 6}, r"num_slots must be <= 4096"),
    ({"num_sms": 2048}, r"num_sms must be <= 1024"),
    ({"chunk_bytes": 128 << 20}, r"chunk_bytes must be <= 67108864 \(64 MiB"),
    ({"max_notify_ints": 1 << 21}, r"max_notify_ints must be <= 1048576"),
    ({"timeout_s": 2e9}, r"<= 1e9"),
])
def test_config_upper_bounds(kwargs, rule):
    with pytest.raises(ValueError, match=rule):
        cs.Config(**kwargs)


def test_config_abort_on_failure_field(monkeypatch):
    for text, want in (("0", False), ("false", False), ("1", True), ("", True)):
        monkeypatch.setenv("CUPY_SYMBUF_ABORT_ON_FAILURE", text)
        assert cs.Config().abort_on_failure is want
    with pytest.raises(TypeError, match="abort_on_failure"):
        cs.Config(abort_on_failure=1)
    with pytest.raises(ValueError, match=r"num_sms must be <= 2 \* the GPU's SM count \(264\)"):
        cs.Config(num_sms=300).resolved("cuda", gpu_sm_count=132)


def test_buffer_larger_than_free_memory_raises_on_every_rank(comm, monkeypatch):
    # only rank 0 "has" 1000 bytes: every rank raises, alike, naming needed and available bytes
    if comm.rank == 0:
        monkeypatch.setattr(symbuffer, "_host_available_bytes", lambda: (1000, "test probe"))
    with pytest.raises(ValueError, match=r"^Communicator|^SymBuffer") as info:
        cs.Communicator(comm, backend="host")
    msg = str(info.value)
    assert msg.startswith("SymBuffer: rank 0: the symmetric buffers need ") and "only 1000 bytes" in msg
    needed = int(msg.split(" need ")[1].split()[0])
    layout = ChannelLayout.from_config(cs.Config().resolved("host", world_size=comm.size), comm.size)
    assert needed == comm.size * layout.total_bytes
    monkeypatch.undo()
    with cs.Communicator(comm, backend="host") as c:  # and then it works
        _check_alltoall(c)


def test_memory_probe_reports_real_numbers():
    available, what = symbuffer._host_available_bytes()
    assert available is None or available > 0
    assert symbuffer._memory_verdict(0, 4, "host") is None
    assert symbuffer._memory_verdict(1 << 62, 1, "host") is None or "need" in symbuffer._memory_verdict(1 << 62, 1,
                                                                                                       "host")


# ---- bounded construction and close ------------------------------------------------------------------------

@pytest.fixture
def scratch_comm(comm):
    """A duplicate of ``comm`` (two ranks at least) for a test that leaves unreceived messages on it (a failed
    construction, a barrier cut at its deadline); after the test every rank discards them, then it is freed (MPI
    may hand a freed communicator's unreceived messages to a later one)."""
    _need2(comm)
    sub = comm.Dup()
    yield sub
    comm.Barrier()
    time.sleep(0.05)
    _agree.discard_leftovers(sub)
    comm.Barrier()
    sub.Free()


def test_peer_that_never_constructs_times_out_naming_it(comm, scratch_comm):
    sub = scratch_comm
    checks = RankChecks()  # rank 0's checks may fail there only: every rank still makes every step below
    if comm.rank == 0:
        with checks.local("rank 0's construction times out, bounded"):
            t0 = time.monotonic()
            with pytest.raises(cs.SymBufferTimeoutError) as info:
                cs.Communicator(sub, cs.Config(timeout_s=0.5), backend="host")
            took = time.monotonic() - t0
            err = info.value
            assert err.role == "construction" and err.missing == list(range(1, comm.size)), repr(err)
            assert "never arrived" in str(err) and f"rank 0: rank{'s' if comm.size > 2 else ''} 1" in str(err), err
            assert took < 5.0, f"the construction raised {took:.1f} s in (timeout_s 0.5)"
    comm.Barrier()
    if comm.rank != 0:  # a late arrival does not go on alone: rank 0 withdrew
        with checks.local("a late arrival raises rank 0's withdrawal"):
            with pytest.raises(cs.SymBufferTimeoutError, match=r"rank 0 gave up waiting") as info:
                cs.Communicator(sub, cs.Config(timeout_s=2.0), backend="host")
            assert info.value.withdrawn and 0 in info.value.missing, repr(info.value)
    checks.gather()


def test_bounded_barrier_never_splits_when_a_confirm_comes_after_the_deadline(comm, monkeypatch, scratch_comm):
    """Rank 0 arrives 1 s into the others' 2 s timeout and is slow between the two rounds: its "confirm" comes
    after their deadline. Every rank must leave the same way (here: all pass). A second round cut at the first
    deadline let the others withdraw while rank 0, holding their confirms, went on alone (into MPI_Win_free in
    close(): the hang of a close racing a peer's timeout)."""
    from cupy_symbuf.transport.bootstrap import MpiBootstrap
    sub = scratch_comm
    if comm.rank == 0:
        real = MpiBootstrap._gather

        def slow_between_rounds(c, kind, *args, **kw):
            got = real(c, kind, *args, **kw)
            if kind == "here":
                time.sleep(1.5)
            return got
        monkeypatch.setattr(MpiBootstrap, "_gather", slow_between_rounds)
    comm.Barrier()
    if comm.rank == 0:
        time.sleep(1.0)
    try:
        _agree.barrier(sub, 2.0, "split test")
        outcome = "passed"
    except cs.SymBufferTimeoutError as exc:
        outcome = f"raised {exc}"
    monkeypatch.undo()
    outcomes = comm.allgather(outcome)
    assert len(set(o.split(" ")[0] for o in outcomes)) == 1, f"ranks left the barrier differently: {outcomes}"


def test_bounded_barrier_withdraws_when_everyone_is_heard_only_after_the_deadline(comm, monkeypatch, scratch_comm):
    """A rank that hears from every peer only after its own deadline (it was descheduled) withdraws instead of
    confirming; the peers, which heard from it, then raise too: nobody goes on alone."""
    from cupy_symbuf.transport.bootstrap import MpiBootstrap
    sub = scratch_comm
    if comm.rank == 0:
        real = MpiBootstrap._gather

        def stalled(c, kind, *args, **kw):
            got = real(c, kind, *args, **kw)
            if kind == "here":
                time.sleep(1.2)  # descheduled past this rank's 1 s deadline before it could confirm
            return got
        monkeypatch.setattr(MpiBootstrap, "_gather", stalled)
    comm.Barrier()
    try:
        _agree.barrier(sub, 1.0 if comm.rank == 0 else 5.0, "late test")
        outcome = "passed"
    except cs.SymBufferTimeoutError as exc:
        outcome = "raised " + ("late" if "only after its timeout" in str(exc) else "withdrawn" if exc.withdrawn else
                               str(exc))
    monkeypatch.undo()
    outcomes = comm.allgather(outcome)
    assert outcomes[0] == "raised late" and all(o == "raised withdrawn" for o in outcomes[1:]), outcomes


def test_exception_leaving_with_releases_peers_at_once(comm):
    """An exception leaving ``with Communicator`` on rank 1 sets the abort word: a peer in a collective raises
    SymBufferAbortedError naming rank 1 well within 1 s (not after timeout_s), and every rank's close() is clean."""
    _need2(comm)
    comm.Barrier()
    t_raise = t_left = None
    checks = RankChecks()  # a peer's checks may fail there only: every rank still reaches the allgather below
    try:
        with cs.Communicator(comm, cs.Config(timeout_s=20), backend="host") as c:
            _check_alltoall(c)
            comm.Barrier()
            if comm.rank == 1:
                time.sleep(0.3)
                t_raise = time.time()
                raise KeyError("left on purpose")
            with checks.local("a peer's call raises rank 1's abort"):
                with pytest.raises(cs.SymBufferAbortedError, match=r"aborted by rank 1: an exception left its "
                                                                   r"'with Communicator' block") as info:
                    c.alltoall(np.zeros((comm.size, 4), np.float32))
                assert info.value.aborting_rank == 1, repr(info.value)
            t_left = time.time()
    except KeyError:
        assert comm.rank == 1
    checks.gather()
    times = comm.allgather((t_raise, t_left))
    raised = times[1][0]
    for r, (_, left) in enumerate(times):
        if r != 1:
            assert left - raised < 1.0, f"rank {r} left {left - raised:.2f} s after rank 1's exception"


def test_exception_leaving_with_is_seen_by_peers_in_close(comm):
    """Rank 1 raises inside ``with`` while the others already wait in close(): their close() frees everything and
    raises SymBufferAbortedError naming rank 1 (``abort_on_failure`` off here; on, the job would end with it)."""
    _need2(comm)
    comm.Barrier()
    before = _lifecycle.live_mpi_objects()
    outcome = None
    try:
        with cs.Communicator(comm, cs.Config(timeout_s=20), backend="host") as c:
            _check_alltoall(c)
            if comm.rank == 1:
                time.sleep(0.5)
                raise KeyError("left on purpose")
    except KeyError:
        outcome = "raised KeyError"
    except cs.SymBufferAbortedError as exc:
        outcome = exc
    checks = RankChecks()  # what close() did on this rank, checked on every rank after the last step
    with checks.local("close()"):
        if comm.rank == 1:
            assert outcome == "raised KeyError", outcome
        else:
            assert outcome is not None, "close() returned although rank 1 left by an exception"
            assert outcome.aborting_rank == 1 and "'with Communicator'" in str(outcome), repr(outcome)
    with checks.local("freed"):
        assert c._closed and _lifecycle.live_mpi_objects() == before
    comm.Barrier()
    checks.gather()


def test_close_with_a_peer_that_never_closes_is_bounded(comm):
    _need2(comm)
    c = cs.Communicator(comm, cs.Config(timeout_s=0.5), backend="host")
    _check_alltoall(c)
    checks = RankChecks()  # each rank's checks may fail there only: every rank still makes both Barriers
    if comm.rank == 0:
        with checks.local("rank 0's close() times out, bounded"):
            t0 = time.monotonic()
            with pytest.raises(cs.SymBufferTimeoutError) as info:
                c.close()
            took = time.monotonic() - t0
            assert info.value.role == "close" and info.value.missing == list(range(1, comm.size)), repr(info.value)
            assert took < 5.0, f"close() raised {took:.1f} s in (timeout_s 0.5)"
        with checks.local("a second close()"):
            c.close()  # idempotent: closed (its buffer left allocated) after the timeout
    comm.Barrier()
    if comm.rank != 0:
        with checks.local("a late close() raises rank 0's withdrawal"):
            with pytest.raises(cs.SymBufferTimeoutError, match=r"gave up waiting"):
                c.close()
    with checks.local("closed"):
        assert c._closed
    comm.Barrier()
    checks.gather()


def test_closing_a_failed_communicator_ends_the_job_by_default(comm, monkeypatch):
    calls = []
    monkeypatch.setattr(_lifecycle, "_mpi_abort", lambda code: calls.append(code))
    monkeypatch.setattr(_lifecycle, "GRACE_S", 0.0)
    c = cs.Communicator(comm, cs.Config(abort_on_failure=True), backend="host")
    buf = c.buffer
    c._broken = "test failure"
    c.close()
    assert calls == [1]
    assert c._closed
    buf.close()  # what the abort would have ended: free it here to keep the test clean


def test_abort_is_local_and_peers_raise_naming_the_rank(backend, comm):
    c = cs.Communicator(comm, cs.Config(timeout_s=10.0), backend=backend)
    checks = RankChecks()  # each rank's checks may fail there only: every rank still makes every step
    try:
        _check_alltoall(c)
        comm.Barrier()
        if comm.rank == 0:
            c.abort("test abort")
            with checks.local("rank 0 after its abort"):
                assert "aborted by this rank (rank 0): test abort" in c.describe(), c.describe()
                with pytest.raises(cs.SymBufferError,
                                   match=r"unusable .*aborted by this rank \(rank 0\): test abort"):
                    c.alltoall(to_backend(np.ones((comm.size, 2), np.float32), backend))
        comm.Barrier()
        if comm.rank != 0:
            with checks.local("a peer's call raises rank 0's abort"):
                t0 = time.monotonic()
                with pytest.raises(cs.SymBufferError) as info:
                    c.alltoall(to_backend(np.ones((comm.size, 2), np.float32), backend))
                    if backend == "cuda":
                        c.synchronize()
                took = time.monotonic() - t0
                assert isinstance(info.value, cs.SymBufferAbortedError), repr(info.value)
                assert info.value.aborting_rank == 0 and "rank 0" in str(info.value), repr(info.value)
                assert took < 5.0, f"the peer raised {took:.1f} s in: it must leave well before timeout_s (10 s)"
    finally:
        comm.Barrier()
        c.close()
    checks.gather()


def test_abort_cause_names_another_rank_and_departing_never_raises():
    """The cause handed to ``abort_job`` is another rank or None (no rank known, or the reporting rank itself);
    departing calls the bootstrap's ``depart`` once, skips a freed one (None) and swallows its failure."""
    assert [_lifecycle.peer_cause(a, 1) for a in (None, -1, 0, 1, 2)] == [None, None, 0, None, 2]
    # an uncaught error's cause (the excepthook's): the rank it names, when another
    assert [_lifecycle._cause_of(cs.SymBufferAbortedError("x", rank=1, aborting_rank=a)) for a in (-1, 1, 2)] == \
        [None, None, 2]
    assert _lifecycle._cause_of(RuntimeError("x")) is None
    calls = []

    class Boot:
        def depart(self, reason):
            calls.append(reason)

    class Gone:
        def depart(self, reason):
            raise RuntimeError("the store is gone")

    _lifecycle.depart(Boot(), "ending")
    _lifecycle.depart(None, "freed")
    _lifecycle.depart(Gone(), "failing")
    assert calls == ["ending"]


@pytest.mark.parametrize("completed_first", [False, True], ids=["completed_rank_closes_last",
                                                               "completed_rank_closes_first"])
def test_rank_that_completed_its_call_closes_at_once_after_a_peer_aborted(comm, completed_first):
    """Every rank's alltoall completes; then rank 1 aborts and rank 0's next call raises its abort, while the ranks
    from 2 on make no further call (their last call completed: right rows). Every rank then closes, with no other
    step in between, and constructs a new communicator: each close and the construction take well under
    ``timeout_s`` on every rank (a rank waiting out ``timeout_s`` there because a peer failed is the defect), the
    completed ranks' close raises the abort naming rank 1 after freeing, and the new communicator's alltoall is
    right. ``completed_first``: the completed ranks reach close() before (or 0.5 s after) the aborting ones."""
    if comm.size < 3:
        pytest.skip("needs a third rank that completed its call")
    timeout_s = 20.0
    before = _lifecycle.live_mpi_objects()
    c = cs.Communicator(comm, cs.Config(timeout_s=timeout_s), backend="host")
    completed = comm.rank >= 2
    took_close, err = None, None
    # what each rank sees here may differ by rank (a timing, the error its close() raised): every check is kept
    # until every rank has made every step, then the ranks fail together, each named
    checks = RankChecks()
    try:
        _check_alltoall(c)
        # every rank's call has returned before rank 1 aborts (a rank still inside it would raise the abort, as
        # it must); from here on no rank waits for a peer outside cupy_symbuf
        comm.Barrier()
        if comm.rank == 1:
            c.abort("left on purpose")
        elif comm.rank == 0:
            with checks.local("rank 0's next call raises rank 1's abort"):
                with pytest.raises(cs.SymBufferAbortedError) as info:
                    _check_alltoall(c)
                assert info.value.aborting_rank == 1, info.value
        if completed != completed_first:
            time.sleep(0.5)
    finally:  # every rank closes, whatever failed above
        t0 = time.monotonic()
        try:
            c.close()
        except cs.SymBufferError as exc:
            err = exc
        took_close = time.monotonic() - t0
    with checks.local("close()"):
        assert c._closed
        if completed:  # its last call returned rows: close() tells it of the abort (after freeing)
            assert isinstance(err, cs.SymBufferAbortedError) and err.aborting_rank == 1, repr(err)
        else:  # the abort was raised (rank 0) or made (rank 1) here already
            assert err is None or isinstance(err, cs.SymBufferAbortedError), repr(err)
    t1 = time.monotonic()
    with cs.Communicator(comm, cs.Config(timeout_s=timeout_s), backend="host") as c2:
        took_construct = time.monotonic() - t1
        _check_alltoall(c2)
    # a rank that waits out timeout_s takes 20 s; half of it leaves room for a loaded machine
    bound = timeout_s / 2
    with checks.local("well under timeout_s"):
        assert took_close < bound and took_construct < bound, (
            f"close() took {took_close:.1f} s, the next construction {took_construct:.1f} s "
            f"(timeout_s {timeout_s:g})")
    with checks.local("freed"):
        assert _lifecycle.live_mpi_objects() == before
    checks.gather()


# ---- leaks, re-creation, fork ------------------------------------------------------------------------------

def test_unclosed_communicator_warns_once_and_is_kept_for_exit(comm, monkeypatch):
    """A communicator dropped open warns (once per process) and is kept in the registry for exit to close. What
    the garbage collector did is local to each rank: every check is kept until every rank has made every
    collective step (constructions, closes), and every rank closes exactly the communicators this test made,
    newest first, whether or not its collector dropped them."""
    from cupy_symbuf import communicator as _communicator
    monkeypatch.setattr(_communicator, "_LEAK_WARNED", [])  # once per process: as if none was dropped yet
    open_before = [o for o in _lifecycle.open_objects() if isinstance(o, cs.Communicator)]  # e.g. dropped earlier

    def made_here():  # the communicators this test made, still registered (dropped or open), newest first
        return [o for o in _lifecycle.open_objects()
                if isinstance(o, cs.Communicator) and not any(o is b for b in open_before)]

    def dropped():
        return [o for o in _lifecycle.open_objects() if isinstance(o, cs.Communicator) and o._dropped]

    checks = RankChecks()
    c = cs.Communicator(comm, backend="host")
    with checks.local("the first drop warns"):
        with pytest.warns(cs.SymBufferLeakWarning,
                          match=r"created at \S*test_lifecycle.py:\d+ was dropped without close"):
            del c
            gc.collect()
    # kept (strongly) in the registry: exit would close it collectively; here the test closes it
    with checks.local("one dropped communicator kept"):
        assert len(dropped()) == 1 and cs.info()["live_communicators"]["dropped"] == 1, \
            cs.info()["live_communicators"]
    with warnings.catch_warnings(record=True) as seen:  # shown once per process
        warnings.simplefilter("always")
        d = cs.Communicator(comm, backend="host")
        del d
        gc.collect()
    with checks.local("the second drop is silent"):
        assert not [w for w in seen if issubclass(w.category, (ResourceWarning, cs.SymBufferLeakWarning))], \
            [str(w.message) for w in seen]
    with checks.local("two dropped communicators kept"):
        assert len(dropped()) == 2 and all(o._dropped for o in made_here()), cs.info()["live_communicators"]
    mine = made_here()
    with checks.local("this test's two communicators registered"):
        assert len(mine) == 2, mine
    while mine:  # newest first, as exit does (collective: every rank closes the same ones)
        mine.pop(0).close()
    with checks.local("none dropped left"):
        assert cs.info()["live_communicators"]["dropped"] == 0, cs.info()["live_communicators"]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        c = cs.Communicator(comm, backend="host")
        c.close()
        del c
        gc.collect()
    with checks.local("a closed communicator is silent"):
        assert not [w for w in seen if issubclass(w.category, (ResourceWarning, cs.SymBufferLeakWarning))], \
            [str(w.message) for w in seen]
    checks.gather()


def test_unclosed_symbuffer_warns(comm):
    b = cs.SymBuffer(comm, 1024, backend="host")
    win, dup = b._win, b.comm
    checks = RankChecks()  # the garbage collector's warning is local: every rank still frees (collectively)
    with checks.local("an unclosed SymBuffer warns"):
        with pytest.warns(ResourceWarning, match=r"unclosed SymBuffer"):
            del b
            gc.collect()
    comm.Barrier()
    win.Unlock_all()
    win.Free()
    dup.Free()
    _lifecycle.count("win", -1)
    _lifecycle.count("comm", -1)
    checks.gather()


def test_create_close_cycles_do_not_leak_mpi_objects(comm):
    before = _lifecycle.live_mpi_objects()
    open_before = [o for o in _lifecycle.open_objects() if isinstance(o, cs.Communicator)]  # e.g. dropped earlier
    cfg = cs.Config(num_sms=2, chunk_bytes=1024, num_slots=2)
    checks = RankChecks()  # the counts are local: every rank makes all 100 cycles, then the ranks fail together
    for i in range(100):
        with cs.Communicator(comm, cfg, backend="host") as c:
            assert c.world_size == comm.size
            if i % 25 == 0:
                _check_alltoall(c)
            if not checks.failures:
                with checks.local(f"cycle {i}: one communicator and one window more while open"):
                    live = _lifecycle.live_mpi_objects()
                    assert live == {"comm": before["comm"] + 1, "win": before["win"] + 1}, (live, before)
    with checks.local("none left"):
        assert _lifecycle.live_mpi_objects() == before
        assert [o for o in _lifecycle.open_objects() if isinstance(o, cs.Communicator)] == open_before
    checks.gather()


def test_sub_communicator_after_closing_the_world_one(backend, comm):
    with cs.Communicator(comm, backend=backend) as c:
        _check_alltoall(c)
    sub = comm.Split(comm.rank % 2, comm.rank)
    try:
        with cs.Communicator(sub, backend=backend) as c:
            assert c.world_size == (comm.size + 1 - comm.rank % 2) // 2
            _check_alltoall(c)
    finally:
        sub.Free()


def test_fork_child_leaves_the_parents_communicator_alone(comm):
    c = cs.Communicator(comm, backend="host")
    checks = RankChecks()  # the child's outcome is local: every rank's parent still makes every step
    try:
        _check_alltoall(c)
        pid = os.fork()
        if pid == 0:  # child: nothing of the parent's may be used, closed or freed
            code = 3
            try:
                try:
                    c.alltoall(np.ones((comm.size, 1), np.float32))
                    code = 1
                except cs.SymBufferError as exc:
                    code = 0 if "os.fork()" in str(exc) else 2
                c.close()  # forgets it here, frees nothing
                del c
                gc.collect()
                _lifecycle._at_exit()
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        with checks.local("the child's outcome (0: refused naming os.fork())"):
            assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
        _check_alltoall(c)  # the parent keeps working
        _check_alltoall(c, width=5)
    finally:
        comm.Barrier()
        c.close()
    checks.gather()


def test_atexit_closes_open_communicators_newest_first(comm, monkeypatch):
    order = []
    a = cs.Communicator(comm, backend="host")
    b = cs.Communicator(comm, backend="host")
    for name, obj in (("a", a), ("b", b)):
        real = obj.close
        monkeypatch.setattr(obj, "close", lambda real=real, name=name: (order.append(name), real()))
    _lifecycle._at_exit()
    assert order == ["b", "a"] and a._closed and b._closed


def test_close_releases_what_captured_graphs_kept(backend, comm):
    """What calls captured into CUDA graphs keep alive (``engine.graph_keep``: their temporaries, read by every
    replay) is released by close(), not when the garbage collector finds the communicator."""
    import weakref
    c = cs.Communicator(comm, backend=backend)
    kept = np.arange(5.0)
    ref = weakref.ref(kept)
    c.engine.graph_keep.append(kept)
    del kept
    gc.collect()
    held_while_open = ref() is not None  # held for replays while the communicator is open
    _check_alltoall(c)
    c.close()  # every rank closes (collective), then checks what the garbage collector left here
    assert held_while_open, "a captured call's temporary was freed while the communicator was open"
    assert ref() is None, "close() kept a captured call's temporary alive"
    del c
