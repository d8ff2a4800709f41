"""Worker of tests/test_torch_bootstrap.py, started by torchrun (2 ranks, gloo, host backend): one case per run,
named by argv[1]. Prints ``CASE <name> OK`` on every rank that passed its checks."""
import atexit
import os
import sys
import time

import numpy as np
import torch.distributed as dist

import cupy_symbuf as cs
from cupy_symbuf.transport.bootstrap import CollectiveTimeoutError, TorchBootstrap, as_bootstrap


def correct() -> None:
    """alltoall / alltoallv against NumPy, a dispatch / combine against a NumPy sum, a second communicator on a
    sub-group, a hierarchical communicator (one rank per node: the rail step is torch's all_to_all_single)."""
    W, me = dist.get_world_size(), dist.get_rank()
    assert "mpi4py" not in sys.modules, "a torchrun job must not import mpi4py"
    with cs.Communicator(None, backend="host") as c:
        assert c.world_size == W and c.rank == me and c.buffer.comm is None
        rng = np.random.default_rng([7, me])
        x = rng.standard_normal((W, 5, 24)).astype(np.float32)
        got = np.asarray(c.alltoall(x))
        everyone = [np.random.default_rng([7, s]).standard_normal((W, 5, 24)).astype(np.float32) for s in range(W)]
        np.testing.assert_array_equal(got, np.stack([everyone[s][me] for s in range(W)]))
        counts = [np.random.default_rng([8, s]).integers(0, 9, W) for s in range(W)]
        rows = [np.random.default_rng([9, s]).standard_normal((int(counts[s].sum()), 40)).astype(np.float32)
                for s in range(W)]
        recv, recv_counts = c.alltoallv(rows[me], counts[me])
        offs = [np.concatenate([[0], np.cumsum(counts[s])]) for s in range(W)]
        want = np.concatenate([rows[s][offs[s][me]:offs[s][me + 1]] for s in range(W)])
        np.testing.assert_array_equal(np.asarray(recv_counts), [counts[s][me] for s in range(W)])
        np.testing.assert_array_equal(np.asarray(recv), want)
        # dispatch / combine: each token to the ranks of its top-k experts; combine of the received rows sums
        # one copy per rank reached
        E, k, n = 4 * W, 2, 33
        idx = np.stack([np.random.default_rng([10, me, t]).choice(E, k, replace=False) for t in range(n)])
        tok = rng.standard_normal((n, 16)).astype(np.float32)
        from cupy_symbuf.deepep import Buffer
        buf = Buffer(dist.group.WORLD, backend="host")
        try:
            ntpr, _, ntpe, in_rank, _ = buf.get_dispatch_layout(idx, E)
            rx, _, _, _, handle, _ = buf.dispatch(tok, topk_idx=idx, topk_weights=np.ones((n, k), np.float32),
                                                  num_tokens_per_rank=ntpr, is_token_in_rank=in_rank,
                                                  num_tokens_per_expert=ntpe)
            y = np.asarray(buf.combine(np.asarray(rx), handle)[0])
            reached = np.stack([np.isin(np.arange(W), idx[t] // (E // W)).sum() for t in range(n)])
            np.testing.assert_allclose(y, tok * reached[:, None], rtol=1e-6)
        finally:
            buf.destroy()
    sub = dist.new_group([0, 1]) if W >= 2 else None
    with cs.Communicator(sub, backend="host") as c2:
        assert c2.world_size == min(W, 2)
    with cs.HierarchicalCommunicator(None, node_size=1, backend="host") as h:
        x = np.arange(W * 3 * 8, dtype=np.float32).reshape(W, 3, 8) + 1000 * me
        got = np.asarray(h.alltoall(x))
        want = np.stack([np.arange(W * 3 * 8, dtype=np.float32).reshape(W, 3, 8)[me] + 1000 * s
                         for s in range(W)])
        np.testing.assert_array_equal(got, want)
    boot = as_bootstrap(None)
    assert isinstance(boot, TorchBootstrap)
    assert boot.allgather(me * 10, 30.0, "test allgather") == [r * 10 for r in range(W)]
    assert boot.bcast("x" if me == 1 else None, 30.0, "test bcast", root=1) == "x"


def never() -> None:
    """Rank 1 never constructs: rank 0's construction raises CollectiveTimeoutError naming it."""
    if dist.get_rank() == 1:
        time.sleep(6)
        return
    try:
        cs.Communicator(None, cs.Config(timeout_s=1.5, abort_on_failure=False), backend="host")
    except CollectiveTimeoutError as exc:
        assert exc.missing == [1] and exc.rank == 0 and exc.timeout_s == 1.5, exc
        assert "rank 1 never arrived" in str(exc) and "Communicator construction" in exc.what, exc
        print(f"rank 0 raised: {exc}", flush=True)
    else:
        raise AssertionError("construction without rank 1 returned")


def withdrawn() -> None:
    """Rank 0 times out of an exchange rank 1 joins late: rank 1 raises 'withdrawn' (not a hang, not a success)."""
    boot = as_bootstrap(None)
    if boot.rank == 0:
        try:
            boot.allgather(0, 0.5, "test late step")
        except CollectiveTimeoutError as exc:
            assert exc.missing == [1], exc
        else:
            raise AssertionError("returned without rank 1")
    else:
        time.sleep(1.5)
        try:
            boot.allgather(1, 10.0, "test late step")
        except CollectiveTimeoutError as exc:
            assert exc.withdrawn and exc.missing == [0], exc
        else:
            raise AssertionError("went on alone")


def abort() -> None:
    """Rank 1 aborts the communicator; closing a failed communicator ends the job (os._exit, non-zero)."""
    c = cs.Communicator(None, backend="host")
    if c.rank == 1:
        c.abort()
    c.close()
    print("CLOSE RETURNED", flush=True)


def _raise_in_rank_1(use_with: bool) -> None:
    """One alltoall (checked against NumPy), then rank 1 raises RuntimeError (``timeout_s`` 30: a close() that
    waited for the peers would show); rank 0 calls alltoall again and is released by the abort word."""
    me, W = dist.get_rank(), dist.get_world_size()
    rng = np.random.default_rng([11, me])
    x = rng.standard_normal((W, 3, 8)).astype(np.float32)
    everyone = [np.random.default_rng([11, s]).standard_normal((W, 3, 8)).astype(np.float32) for s in range(W)]

    def body(c):
        np.testing.assert_array_equal(np.asarray(c.alltoall(x)), np.stack([everyone[s][me] for s in range(W)]))
        if me == 1:
            print(f"FAULT t={time.time():.3f} rank 1", flush=True)
            raise RuntimeError(f"injected failure on rank 1 {'inside' if use_with else 'outside'} 'with'")
        c.alltoall(x)
        raise AssertionError("alltoall returned although rank 1 left")

    config = cs.Config(timeout_s=30.0)
    if use_with:
        with cs.Communicator(None, config, backend="host") as c:
            body(c)
    else:
        body(cs.Communicator(None, config, backend="host"))


def raise_with() -> None:
    """Rank 1 raises inside ``with``: its close() must not wait for the peers ending the job; its traceback is
    printed (then ``EXITING`` from an exit handler registered before the communicator's)."""
    atexit.register(lambda: print(f"EXITING t={time.time():.3f} rank {dist.get_rank()}", flush=True))
    _raise_in_rank_1(True)


def raise_nowith() -> None:
    """Rank 1 raises with its communicator open (no ``with``); this worker's entry point runs under torch's
    ``record`` (the error file torchrun reads for its summary)."""
    from torch.distributed.elastic.multiprocessing.errors import record
    record(_raise_in_rank_1)(False)


def _right_alltoall(c, seed: int) -> None:
    me, W = dist.get_rank(), dist.get_world_size()
    everyone = [np.random.default_rng([seed, s]).standard_normal((W, 5)).astype(np.float32) for s in range(W)]
    np.testing.assert_array_equal(np.asarray(c.alltoall(everyone[me])), np.stack([everyone[s][me] for s in range(W)]))


def alloc_leave() -> None:
    """Rank 1 raises inside ``with`` while rank 0 is in ``Communicator.empty``: rank 0's step raises the abort
    naming rank 1 at once, both closes are prompt, and a new communicator's alltoall matches NumPy (every wait
    well under ``timeout_s`` 30)."""
    me = dist.get_rank()
    config = cs.Config(timeout_s=30.0, abort_on_failure=False)
    t0 = None
    try:
        with cs.Communicator(None, config, backend="host") as c:
            _right_alltoall(c, 21)
            dist.barrier()
            if me == 1:
                time.sleep(0.3)
                t0 = time.monotonic()
                raise KeyError("left on purpose")
            t0 = time.monotonic()
            c.empty((4, 4), np.float32)
            raise AssertionError("Communicator.empty returned although rank 1 left")
    except KeyError:
        assert me == 1
    except cs.SymBufferAbortedError as exc:
        assert me != 1 and exc.aborting_rank == 1, repr(exc)
        assert not getattr(exc, "__notes__", None), exc.__notes__  # close() did not fail
    took = time.monotonic() - t0
    assert took < 7.5, f"rank {me}: the step and close() took {took:.1f} s"
    t1 = time.monotonic()
    with cs.Communicator(None, config, backend="host") as c2:
        _right_alltoall(c2, 22)
    assert time.monotonic() - t1 < 7.5


def exit_leave() -> None:
    """Rank 1's program ends (``sys.exit(0)``) with a communicator open outside ``with`` while rank 0 enters an
    alltoall: rank 0 raises the abort naming rank 1 within a few seconds, then closes at once."""
    me = dist.get_rank()
    c = cs.Communicator(None, cs.Config(timeout_s=30.0, abort_on_failure=False), backend="host")
    _right_alltoall(c, 23)
    dist.barrier()
    if me == 1:
        print("LEAVING rank 1", flush=True)
        _KEEP.append(c)
        sys.exit(0)
    time.sleep(0.3)
    t0 = time.monotonic()
    try:
        c.alltoall(np.zeros((dist.get_world_size(), 2), np.float32))
        raise AssertionError("alltoall returned although rank 1 left")
    except cs.SymBufferAbortedError as exc:
        assert exc.aborting_rank == 1 and "its program ended" in str(exc), repr(exc)
    assert time.monotonic() - t0 < 7.5, f"rank {me}: the alltoall took {time.monotonic() - t0:.1f} s"
    t1 = time.monotonic()
    c.close()
    assert time.monotonic() - t1 < 7.5


_KEEP = []


def retry() -> None:
    """Rank 1 comes 1.5 s late to a construction rank 0 gives up after 0.5 s: both raise CollectiveTimeoutError
    (rank 1 "withdrawn"); then a construction on the same group works at once, its alltoall matching NumPy."""
    me = dist.get_rank()
    if me == 1:
        time.sleep(1.5)
    try:
        cs.Communicator(None, cs.Config(timeout_s=0.5, abort_on_failure=False), backend="host").close()
        raise AssertionError("constructed without the late rank")
    except CollectiveTimeoutError as exc:
        assert exc.withdrawn == (me == 1), repr(exc)
    dist.barrier()
    t0 = time.monotonic()
    with cs.Communicator(None, cs.Config(timeout_s=30.0, abort_on_failure=False), backend="host") as c:
        _right_alltoall(c, 29)
    assert time.monotonic() - t0 < 7.5, f"rank {me}: the retry took {time.monotonic() - t0:.1f} s"


if __name__ == "__main__":
    case = sys.argv[1]
    dist.init_process_group("gloo")
    globals()[case]()
    print(f"CASE {case} OK rank {dist.get_rank()}", flush=True)
    dist.destroy_process_group()
