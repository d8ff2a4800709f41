"""Ranks agree on which dispatch a handle comes from (flat Communicator, every backend here).

Every eager dispatch numbers itself with the count exchange it ran (``DispatchHandle.dispatch_id``, the same on every
rank), and combine / a cached dispatch carry that number in the signature of their call headers. A rank that passes
the handle of another dispatch (same per-rank counts, tokens in another order: nothing else would tell) makes the
call fail with a :class:`~cupy_symbuf.SymBufferError` on every rank (the receivers of its header a
:class:`~cupy_symbuf.SymBufferMismatchError` naming the handles, the rest :class:`~cupy_symbuf.SymBufferAbortedError`);
no rank returns rows. Handles of the same dispatch on every rank still work (values against NumPy, into poisoned
outputs), also twice, also in worst-case mode; on the GPU a CUDA graph of a worst-case dispatch + combine replays
with the id it was captured with.

    python -m pytest tests/test_handle_agreement.py
    mpiexec -n 2 python -m pytest tests/test_handle_agreement.py
"""
from __future__ import annotations

import numpy as np
import pytest

import cupy_symbuf as cs
from _util import all_ranks, to_backend, to_numpy

CFG = dict(chunk_bytes=1024, num_slots=4, timeout_s=20)
HIDDEN = 24
POISON = np.float32(np.nan)


def _comm(backend, comm, blocking=True):
    # blocking: the GPU raises a kernel's mismatch from the call itself (else from the next synchronize); a CUDA
    # graph capture needs it off (a blocking call waits for its kernel)
    return cs.Communicator(comm, cs.Config(blocking=blocking and backend == "cuda", **CFG), backend=backend)


def _close(c):
    try:
        c.close()
    except cs.SymBufferError:
        pass


def _inputs(comm, seed: int, num_tokens: int = 12):
    """Tokens holding small integers (every sum exact), top-2 routing over 2 experts per rank, never all -1; and a
    permutation of the tokens (same per-rank counts, other order: a second dispatch only its id tells apart)."""
    rng = np.random.default_rng([seed, comm.rank, comm.size])
    E = 2 * comm.size
    idx = rng.integers(-1, E, (num_tokens, 2))
    idx[:, 0] = rng.integers(0, E, num_tokens)
    x = rng.integers(1, 50, (num_tokens, HIDDEN)).astype(np.float32)
    perm = rng.permutation(num_tokens)
    return x, idx, E, perm


def _reached(idx, E, W):
    epr = E // W
    return np.array([len({int(e) // epr for e in row if e >= 0}) for row in idx], np.float32)


def _expected_recv(comm, x, idx, E):
    """The rows this rank receives: by source rank, then source token, each token once per rank it reaches."""
    every = comm.allgather((x, idx))
    epr = E // comm.size
    rows = [xs[t] for xs, ids in every for t in range(len(ids))
            if any(e >= 0 and int(e) // epr == comm.rank for e in ids[t])]
    return np.array(rows, np.float32).reshape(-1, HIDDEN)


def _every_rank_raises(comm, call):
    """Run ``call`` on this rank; it must raise a SymBufferError (never return rows). Checked on every rank;
    returns the exception."""
    err = None
    try:
        call()
    except cs.SymBufferError as exc:
        err = exc
    seen = comm.allgather(None if err is None else f"{type(err).__name__}: {err}")
    all_ranks(lambda: all(seen) or pytest.fail(f"a rank returned without an error: {seen}"))
    return err


def _check_mismatch_text(comm, err, op):
    """Every receiver of the stale header raises SymBufferMismatchError on the signature naming the handles; a rank
    that saw the abort word first raises SymBufferAbortedError."""
    names = comm.allgather((type(err).__name__, getattr(err, "field", None), str(err)))

    def check():
        assert isinstance(err, (cs.SymBufferMismatchError, cs.SymBufferAbortedError)), repr(err)
        assert any(n == "SymBufferMismatchError" for n, _, _ in names), names
        for n, field, text in names:
            if n == "SymBufferMismatchError":
                assert "signature" in field, names
                assert op in text and "handle" in text and "dispatch #" in text, text
    all_ranks(check)


@pytest.mark.parametrize("worst", [False, True], ids=["eager", "worst_case"])
def test_combine_with_handle_of_another_dispatch_on_one_rank(backend, comm, worst):
    """Rank 0 combines with the handle of the first of two dispatches (same counts, tokens reordered), the others
    with the second's: every rank raises, no rank returns a combine."""
    if comm.size < 2:
        pytest.skip("needs two ranks")
    c = _comm(backend, comm)
    try:
        x, idx, E, perm = _inputs(comm, 1)
        kw = {"num_worst_tokens": len(x) * comm.size} if worst else {}
        recv_a, _, _, _, h_a = c.dispatch(to_backend(x, backend), to_backend(idx, backend), None, E, **kw)
        recv_b, _, _, _, h_b = c.dispatch(to_backend(x[perm], backend), to_backend(idx[perm], backend), None, E,
                                          **kw)
        all_ranks(lambda: h_a.num_recv_tokens == h_b.num_recv_tokens or pytest.fail("counts differ"))
        h = h_a if comm.rank == 0 else h_b
        err = _every_rank_raises(comm, lambda: c.combine(recv_b, h))
        _check_mismatch_text(comm, err, "combine")
        # the communicator is unusable afterwards (no silent recovery into wrong rows)
        with pytest.raises(cs.SymBufferError):
            c.combine(recv_b, h_b)
    finally:
        _close(c)


@pytest.mark.parametrize("worst", [False, True], ids=["eager", "worst_case"])
def test_cached_dispatch_with_handle_of_another_dispatch_on_one_rank(backend, comm, worst):
    """Rank 0 passes the earlier handle to a cached dispatch, the others the later one: every rank raises (the
    other ranks, which passed the right handle, would otherwise receive rank 0's rows in the wrong slots)."""
    if comm.size < 2:
        pytest.skip("needs two ranks")
    c = _comm(backend, comm)
    try:
        x, idx, E, perm = _inputs(comm, 2)
        kw = {"num_worst_tokens": len(x) * comm.size} if worst else {}
        _, _, _, _, h_a = c.dispatch(to_backend(x, backend), to_backend(idx, backend), None, E, **kw)
        _, _, _, _, h_b = c.dispatch(to_backend(x[perm], backend), to_backend(idx[perm], backend), None, E, **kw)
        h = h_a if comm.rank == 0 else h_b
        y = to_backend(x[perm] * 3, backend)
        err = _every_rank_raises(comm, lambda: c.dispatch(y, handle=h))
        _check_mismatch_text(comm, err, "dispatch")
    finally:
        _close(c)


def test_eager_dispatch_on_one_rank_cached_on_the_others(backend, comm):
    """The last rank dispatches eagerly (no handle: a count exchange first) while the others pass the handle of the
    dispatch before (a cached dispatch: call headers at once): every rank raises, none returns rows, well within
    timeout_s; a SymBufferMismatchError names the call form and the rule in dispatch's terms (a handle on every rank
    or on none), a SymBufferAbortedError the call form (GPU: the ranks waiting for call headers)."""
    if comm.size < 2:
        pytest.skip("needs two ranks")
    c = _comm(backend, comm)
    try:
        x, idx, E, _ = _inputs(comm, 4)
        _, _, _, _, h = c.dispatch(to_backend(x, backend), to_backend(idx, backend), None, E)
        y = to_backend(x * 3, backend)
        eager = comm.rank == comm.size - 1
        err = _every_rank_raises(comm, lambda: c.dispatch(y, to_backend(idx, backend), None, E) if eager else
                                 c.dispatch(y, handle=h))
        names = comm.allgather((type(err).__name__, getattr(err, "field", None), str(err)))

        def check():
            assert any(n == "SymBufferMismatchError" for n, _, _ in names), names
            for n, field, text in names:
                assert "call form" in (field or text), names
                if n == "SymBufferMismatchError":
                    assert "every rank must pass a handle to dispatch" in text and "dispatch with a handle" in text \
                        and "dispatch (eager" in text, text
        all_ranks(check)
    finally:
        _close(c)


def test_right_handles_still_work(backend, comm):
    """The same two dispatches with the right handle on every rank: combine (twice with one handle, into poisoned
    outputs), cached dispatch (into a poisoned out) and combine of the other handle all equal NumPy."""
    c = _comm(backend, comm)
    try:
        x, idx, E, perm = _inputs(comm, 3)
        W = comm.size
        recv_a, _, _, _, h_a = c.dispatch(to_backend(x, backend), to_backend(idx, backend), None, E)
        recv_b, _, _, _, h_b = c.dispatch(to_backend(x[perm], backend), to_backend(idx[perm], backend), None, E)
        want_a, want_b = _expected_recv(comm, x, idx, E), _expected_recv(comm, x[perm], idx[perm], E)
        reach = _reached(idx, E, W)
        xp = c.xp
        outs = []
        for h, rx in ((h_a, recv_a), (h_a, recv_a), (h_b, recv_b)):  # h_a twice: one dispatch, two combines
            out = xp.full((len(x), HIDDEN), POISON, np.float32)
            outs.append(c.combine(rx, h, out=out)[0])
        y = x[perm] * 3
        cached_out = xp.full((h_b.num_recv_tokens + 2, HIDDEN), POISON, np.float32)
        cached = c.dispatch(to_backend(y, backend), handle=h_b, out=cached_out)[0]
        want_cached = _expected_recv(comm, y, idx[perm], E)

        def check():
            np.testing.assert_array_equal(to_numpy(recv_a), want_a)
            np.testing.assert_array_equal(to_numpy(recv_b), want_b)
            np.testing.assert_array_equal(to_numpy(outs[0]), x * reach[:, None])
            np.testing.assert_array_equal(to_numpy(outs[1]), x * reach[:, None])
            np.testing.assert_array_equal(to_numpy(outs[2]), (x * reach[:, None])[perm])
            np.testing.assert_array_equal(to_numpy(cached), want_cached)
        all_ranks(check)
    finally:
        _close(c)


def test_dispatch_ids_agree_and_advance(backend, comm):
    """Every eager dispatch gets an id identical on every rank and larger than the one before; a cached dispatch
    returns the handle it was given (same id); a dispatch rejected on one rank still advances every rank's count,
    so the next ids agree."""
    c = _comm(backend, comm)
    try:
        x, idx, E, _ = _inputs(comm, 4)
        ids = []
        for _ in range(3):
            h = c.dispatch(to_backend(x, backend), to_backend(idx, backend), None, E)[4]
            ids.append(h.dispatch_id)
        assert c.dispatch(to_backend(x, backend), handle=h)[4].dispatch_id == ids[-1]
        if comm.size > 1:
            bad = idx.copy()
            if comm.rank == 0:
                bad[0, 0] = E  # out of range: rank 0 rejects, the others raise SymBufferRejectedError
            with pytest.raises((ValueError, cs.SymBufferRejectedError)):
                c.dispatch(to_backend(x, backend), to_backend(bad, backend), None, E)
        ids.append(c.dispatch(to_backend(x, backend), to_backend(idx, backend), None, E)[4].dispatch_id)
        every = comm.allgather(ids)
        all_ranks(lambda: (all(e == every[0] for e in every) and ids == sorted(set(ids)) and ids[0] > 0)
                  or pytest.fail(f"ids per rank: {every}"))
    finally:
        _close(c)


def test_cuda_graph_replays_with_its_captured_handle(backend, comm):
    """GPU: a worst-case dispatch + combine captured in a CUDA graph replays with the id it was captured with
    (exact values each replay); an eager combine of the captured handle on every rank works between replays; an
    eager combine that uses the captured handle on rank 0 and another dispatch's handle elsewhere fails everywhere."""
    if backend != "cuda":
        pytest.skip("CUDA graphs need the GPU")
    import cupy
    c = _comm(backend, comm, blocking=False)
    try:
        W = comm.size
        x, idx, E, perm = _inputs(comm, 5, num_tokens=16)
        worst = len(x) * W
        d_x, d_idx = cupy.asarray(x), cupy.asarray(idx)
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            c.dispatch(d_x, d_idx, None, E, num_worst_tokens=worst)  # warm the pool and the plans
            stream.synchronize()
            c.synchronize()
            stream.begin_capture()
            out = c.dispatch(d_x, d_idx, None, E, num_worst_tokens=worst)
            comb = c.combine(out[0], out[4])
            graph = stream.end_capture()
        h_g = out[4]
        for rep in range(2):
            xr, ir, _, _ = _inputs(comm, 50 + rep, num_tokens=16)
            d_x.set(xr)
            d_idx.set(ir)
            comb[0].fill(np.nan)
            cupy.cuda.Device().synchronize()  # the inputs and the poisoned output are in place before the replay
            graph.launch(stream)
            stream.synchronize()
            c.synchronize()
            reach = _reached(ir, E, W)
            all_ranks(lambda: np.testing.assert_array_equal(to_numpy(comb[0]), xr * reach[:, None]))
            eager, _ = c.combine(out[0], h_g)
            all_ranks(lambda: np.testing.assert_array_equal(to_numpy(eager), xr * reach[:, None]))
        if W > 1:
            other = c.dispatch(d_x, d_idx, None, E, num_worst_tokens=worst)
            h = h_g if comm.rank == 0 else other[4]
            err = _every_rank_raises(comm, lambda: (c.combine(out[0], h), c.synchronize()))
            _check_mismatch_text(comm, err, "combine")
    finally:
        _close(c)
