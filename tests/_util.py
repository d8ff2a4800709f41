"""Helpers for tests: move arrays between NumPy and the backend, poison outputs, build references."""
import contextlib

import numpy as np


def to_backend(x: np.ndarray, backend: str):
    if backend == "cuda":
        import cupy
        return cupy.asarray(x)
    return x


def to_numpy(x):
    if hasattr(x, "get"):
        return x.get()
    return np.asarray(x)


def rng_for(comm, test_seed: int):
    """Fresh random generator per (test, rank)."""
    return np.random.default_rng([test_seed, comm.Get_rank(), comm.Get_size()])


def random_rows(rng, nrows: int, row_shape, dtype) -> np.ndarray:
    """Random data (never zeros) of any dtype: random bytes, so every bit pattern is exercised."""
    dtype = np.dtype(dtype)
    nbytes = nrows * int(np.prod(row_shape, dtype=np.int64)) * dtype.itemsize
    raw = rng.integers(1, 256, size=nbytes, dtype=np.uint8)
    return raw.view(dtype).reshape((nrows,) + tuple(row_shape))


def reference_alltoallv(comm, send: np.ndarray, counts: np.ndarray):
    """What this rank must receive: rows that each rank j sends to us, in source-rank order (NumPy only)."""
    everything = comm.allgather((send, np.asarray(counts)))
    me = comm.Get_rank()
    parts, recv_counts = [], []
    for s_j, c_j in everything:
        off = np.concatenate([[0], np.cumsum(c_j)])
        parts.append(s_j[off[me]: off[me + 1]])
        recv_counts.append(int(c_j[me]))
    return np.concatenate(parts, axis=0), np.array(recv_counts, dtype=np.int64)


class DLPackOnly:
    """An object that offers nothing but the DLPack protocol of an array, the way a PyTorch tensor arrives."""

    def __init__(self, a):
        self._a = a

    def __dlpack__(self, *args, **kwargs):
        return self._a.__dlpack__(*args, **kwargs)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


def all_ranks(check) -> None:
    """Run the local assertions ``check()`` on every rank of ``MPI.COMM_WORLD``; fail on every rank if any rank
    failed (so no rank is left waiting in the next collective). ``pytest.fail`` inside ``check`` raises a
    BaseException: it is caught too, so it cannot skip the allgather."""
    import pytest
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    err = None
    try:
        check()
    except (Exception, pytest.fail.Exception) as e:  # noqa: BLE001 - reported on every rank
        err = f"rank {world.Get_rank()}: {type(e).__name__}: {e}"
    errs = [e for e in world.allgather(err) if e]
    if errs:
        pytest.fail("\n".join(errs), pytrace=False)


class RankChecks:
    """Rank-local checks of a test that makes collective steps after them (a timing bound, a local count, a warning
    the garbage collector raises, an error that depends on which rank was slow). A check that fails is kept, not
    raised, so this rank still makes every later collective step with the others; :meth:`gather` (a collective
    step itself, on every rank of ``MPI.COMM_WORLD`` after the test's last step) then fails the test on every rank,
    naming each rank and what failed there::

        checks = RankChecks()
        with checks.local("close() bounded"):
            assert took < bound, took
        comm.Barrier()  # made on every rank, whatever failed above
        checks.gather()

    A ``local`` block must hold no collective step: a failure skips the rest of the block."""

    def __init__(self):
        self.failures = []

    @contextlib.contextmanager
    def local(self, what: str):
        import pytest
        try:
            yield
        except (Exception, pytest.fail.Exception) as e:  # noqa: BLE001 - reported on every rank by gather()
            self.failures.append(f"{what}: {type(e).__name__}: {e}")

    def gather(self) -> None:
        import pytest
        failures = self.failures
        all_ranks(lambda: not failures or pytest.fail("; ".join(failures), pytrace=False))


class SymmetricSend:
    """A :class:`~cupy_symbuf.Communicator` whose ``alltoall`` / ``alltoallv`` first copy a valid ``sendbuf`` into a
    symmetric array (one staging allocation of the largest sendbuf over the ranks, grown collectively), so the
    whole alltoall suite runs in direct mode too (both backends: the receivers copy straight out of it).
    Anything that is not a NumPy / CuPy array passes through unchanged, so the bad-input tests see what they sent.
    ``direct_sends`` counts the calls made with a symmetric sendbuf."""

    def __init__(self, c, comm):
        self._c, self._comm, self._buf = c, comm, None
        self._stream = None  # (cuda) the stream of the last staging copy
        self.direct_sends = 0

    def __getattr__(self, name):
        return getattr(self._c, name)

    def _sym(self, x):
        from mpi4py import MPI
        import cupy_symbuf as cs
        ok = (isinstance(x, np.ndarray) or cs.common.backend.is_cupy_array(x)) and x.ndim >= 1 and not x.dtype.hasobject \
            and (type(x).__module__.startswith("cupy") == (self._c.backend == "cuda"))
        n = self._comm.allreduce(int(x.nbytes) if ok else 0, op=MPI.MAX)
        if self._buf is None or self._buf.nbytes < n:
            if self._buf is not None:
                self._c.free(self._buf)
            self._buf = self._c.empty(max(n, 16), np.uint8)
        if not ok:
            return x
        if self._c.backend == "cuda":
            # one staging array for every call: a copy into it on another stream than the last call's would race
            # with that call's kernels (and the peers' reads of it in direct mode), which stream order covers only
            # on one stream; so wait for the calls queued so far before staging on a new stream
            import cupy
            stream = cupy.cuda.get_current_stream().ptr
            if self._stream is not None and stream != self._stream:
                self._c.synchronize()
            self._stream = stream
        view = self._buf[: x.nbytes].view(x.dtype).reshape(x.shape)
        view[...] = x
        assert self._c.is_symmetric(view) or x.nbytes == 0
        self.direct_sends += 1
        return view

    def alltoall(self, sendbuf, *args, **kwargs):
        return self._c.alltoall(self._sym(sendbuf), *args, **kwargs)

    def alltoallv(self, sendbuf, *args, **kwargs):
        return self._c.alltoallv(self._sym(sendbuf), *args, **kwargs)
