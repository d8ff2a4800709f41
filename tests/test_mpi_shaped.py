"""``Communicator.Alltoall`` / ``Communicator.Alltoallv`` against ``MPI.COMM_WORLD.Alltoall`` / ``Alltoallv`` on the
same buffers: random data, poisoned receive buffers (the elements outside every block must keep the poison), blocks
with gaps and in permuted order, every buffer-spec form, several dtypes, 1-D, 2-D and Fortran-ordered buffers, zero
counts. Bad specs raise the documented error on the rank that passed them (the peers
:class:`~cupy_symbuf.SymBufferRejectedError`) and the communicator keeps giving right data.

On the cuda backend our buffers are CuPy copies of the same data and the results are compared through host copies
(MPI here is not CUDA-aware, so MPI runs on the NumPy originals).
"""
import numpy as np
import pytest
from mpi4py import MPI
from mpi4py.util import dtlib

import cupy_symbuf as cs
from _util import RankChecks, all_ranks, rng_for, to_backend, to_numpy

CFG = cs.Config(chunk_bytes=1024, num_slots=2, timeout_s=30)
POISON = 0x5A
DTYPES = [np.float64, np.complex128, np.int32, np.float32, np.uint8]


@pytest.fixture
def c(backend, comm):
    c = cs.Communicator(comm, CFG, backend=backend)
    yield c
    try:
        c.close()
    except cs.SymBufferError:
        pass


def _same(got, want):
    """Assert ``got`` equals ``want`` bit for bit on every rank together (a rank that fails alone would leave the
    others waiting in the next MPI call)."""
    all_ranks(lambda: np.testing.assert_array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8)))


def _random(rng, n, dtype):
    """``n`` random elements of ``dtype`` (random bytes for integers; finite values for floats)."""
    dtype = np.dtype(dtype)
    if dtype.kind in "fc":
        x = rng.standard_normal(n * (2 if dtype.kind == "c" else 1)).astype(
            np.float64 if dtype.itemsize in (8, 16) else np.float32)
        return x.view(dtype) if dtype.kind == "c" else x.astype(dtype)
    return rng.integers(0, 256, n * dtype.itemsize, dtype=np.uint8).view(dtype)


def _poisoned(n, dtype):
    return np.full(n * np.dtype(dtype).itemsize, POISON, np.uint8).view(dtype)


def _count_matrix(comm, seed, hi=6, zero_frac=0.3):
    """``C[s, r]``: elements rank s sends rank r, the same on every rank; about ``zero_frac`` of them 0."""
    W = comm.size
    rng = np.random.default_rng([seed, W])
    m = rng.integers(0, hi, (W, W))
    m[rng.random((W, W)) < zero_frac] = 0
    return m.astype(np.int64)


def _layout(rng, counts, gaps: bool, permute: bool):
    """Displacements of ``counts`` (in elements): blocks in a random order, random gaps between (and before) them.
    Returns (displs, size of the buffer)."""
    W = len(counts)
    order = rng.permutation(W) if permute else np.arange(W)
    displs = np.zeros(W, np.int64)
    off = int(rng.integers(0, 4)) if gaps else 0
    for j in order:
        displs[j] = off
        off += int(counts[j]) + (int(rng.integers(0, 4)) if gaps else 0)
    return displs, off + (int(rng.integers(0, 3)) if gaps else 0)


def _shaped(flat, shape_kind):
    """The flat buffer (NumPy or CuPy) as a 1-D, 2-D (C order) or 2-D Fortran-ordered array with the same memory."""
    n = flat.shape[0]
    if shape_kind == "1d" or n % 2:
        return flat
    rows = 2
    if shape_kind == "2d":
        return flat.reshape(rows, n // rows)
    return flat.reshape(n // rows, rows).T  # "2d-F": Fortran-contiguous view of the same memory


def _vspec(form, buf, counts, displs, datatype):
    """The Alltoallv spec ``form`` (mpi4py's buffer-spec forms) for these parts."""
    c, d = list(map(int, counts)), list(map(int, displs))
    return {
        "[buf, counts]": lambda: [buf, c],
        "[buf, (counts, displs)]": lambda: [buf, (c, d)],
        "[buf, counts, datatype]": lambda: [buf, c, datatype],
        "[buf, (counts, displs), datatype]": lambda: [buf, (c, d), datatype],
        "[buf, counts, displs, datatype]": lambda: [buf, c, d, datatype],
        "[buf, counts, None, datatype]": lambda: [buf, c, None, datatype],
        "(buf, ndarray counts, ndarray displs, datatype)": lambda: (buf, np.asarray(c), np.asarray(d), datatype),
    }[form]()


PACKED_FORMS = {"[buf, counts]", "[buf, counts, datatype]", "[buf, counts, None, datatype]"}
VFORMS = ["[buf, counts]", "[buf, (counts, displs)]", "[buf, counts, datatype]", "[buf, (counts, displs), datatype]",
          "[buf, counts, displs, datatype]", "[buf, counts, None, datatype]",
          "(buf, ndarray counts, ndarray displs, datatype)"]


NAMED = {np.dtype(np.float64): MPI.DOUBLE, np.dtype(np.complex128): MPI.C_DOUBLE_COMPLEX, np.dtype(np.int32): MPI.INT,
         np.dtype(np.float32): MPI.FLOAT, np.dtype(np.uint8): MPI.UINT8_T}


def _ours_datatype(kind, dtype):
    """The datatype we are given: the predefined MPI.Datatype, the Dup() of it that mpi4py.util.dtlib makes,
    mpi4py's typecode string, or the NumPy dtype."""
    dtype = np.dtype(dtype)
    if kind == "typecode":
        return {8: "Zf", 16: "Zd"}[dtype.itemsize] if dtype.kind == "c" else NAMED[dtype].typechar
    return {"MPI": NAMED[dtype], "dtlib": dtlib.from_numpy_dtype(dtype), "numpy": dtype}[kind]


def _compare_alltoallv(c, comm, backend, seed, dtype, form="[buf, counts, displs, datatype]", shape_kind="1d",
                       gaps=True, permute=True, dt_kind="MPI", counts_seed=None):
    """One Alltoallv by MPI and by us on the same data and layout; asserts our receive buffer equals MPI's."""
    W, me = comm.size, comm.rank
    rng = rng_for(comm, seed)
    m = _count_matrix(comm, seed if counts_seed is None else counts_seed)
    sc, rc = m[me], m[:, me]
    packed = form in PACKED_FORMS
    sd, ns = _layout(rng, sc, gaps and not packed, permute and not packed)
    rd, nr = _layout(rng, rc, gaps and not packed, permute and not packed)
    if packed:  # mpi4py packs the blocks in rank order: the buffers may still be larger
        ns, nr = ns + 2, nr + 3
    send = _random(rng, ns, dtype)
    want = _poisoned(nr, dtype)
    mpi_t = NAMED[np.dtype(dtype)]
    comm.Alltoallv(_vspec(form, _shaped(send, shape_kind), sc, sd, mpi_t),
                   _vspec(form, _shaped(want, shape_kind), rc, rd, mpi_t))
    got = _poisoned(nr, dtype)
    got_b = _shaped(to_backend(got, backend), shape_kind)
    out = c.Alltoallv(_vspec(form, _shaped(to_backend(send, backend), shape_kind), sc, sd,
                             _ours_datatype(dt_kind, dtype)),
                      _vspec(form, got_b, rc, rd, _ours_datatype(dt_kind, dtype)))
    assert out is None
    host = to_numpy(got_b)
    flat = (host.T if shape_kind == "2d-F" and host.ndim == 2 else host).reshape(-1)
    _same(flat, want)
    return want


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape_kind", ["1d", "2d", "2d-F"])
def test_alltoallv_equals_mpi_with_gaps(c, comm, backend, dtype, shape_kind):
    for seed in range(3):
        _compare_alltoallv(c, comm, backend, 10 + seed, dtype, shape_kind=shape_kind)


@pytest.mark.parametrize("form", VFORMS)
@pytest.mark.parametrize("dt_kind", ["MPI", "dtlib", "typecode", "numpy"])
def test_alltoallv_every_spec_form(c, comm, backend, form, dt_kind):
    _compare_alltoallv(c, comm, backend, 30, np.complex128, form=form, dt_kind=dt_kind)
    _compare_alltoallv(c, comm, backend, 31, np.int32, form=form, dt_kind=dt_kind, shape_kind="2d")


@pytest.mark.parametrize("layout", ["packed", "gaps", "permuted", "gaps+permuted"])
def test_alltoallv_layouts_and_zero_counts(c, comm, backend, layout):
    gaps, permute = "gaps" in layout, "permuted" in layout
    for seed in range(2):
        _compare_alltoallv(c, comm, backend, 40 + seed, np.float64, gaps=gaps, permute=permute)
    # every count 0: the receive buffer keeps its poison everywhere
    W = comm.size
    z = np.zeros(W, np.int64)
    got = to_backend(_poisoned(5, np.float64), backend)
    c.Alltoallv([to_backend(np.ones(3), backend), z, z, MPI.DOUBLE], [got, z, np.arange(W), MPI.DOUBLE])
    _same(to_numpy(got), _poisoned(5, np.float64))
    # only rank 0 sends, everything to the last rank
    m = np.zeros((W, W), np.int64)
    m[0, W - 1] = 7
    sc, rc = m[comm.rank], m[:, comm.rank]
    send = _random(rng_for(comm, 43), 9, np.float64)
    sd = np.full(W, 2, np.int64)
    rd = np.full(W, 1, np.int64)
    want, got = _poisoned(10, np.float64), _poisoned(10, np.float64)
    comm.Alltoallv([send, sc, sd, MPI.DOUBLE], [want, rc, rd, MPI.DOUBLE])
    got_b = to_backend(got, backend)
    c.Alltoallv([to_backend(send, backend), sc, sd, MPI.DOUBLE], [got_b, rc, rd, MPI.DOUBLE])
    _same(to_numpy(got_b), want)


def test_alltoallv_default_split_and_strided(c, comm, backend):
    """mpi4py's inferred forms: a bare buffer (n elements split n // W + (j < n % W), packed), ``[buf, datatype]``,
    one int count for every rank, one int displacement (strided blocks)."""
    W = comm.size
    rng = rng_for(comm, 50)
    for n in (4 * W, 0):
        send = _random(rng, n, np.float32)
        for make in (lambda b: b, lambda b: [b, MPI.FLOAT], lambda b: [b, "f"]):
            want, got = _poisoned(n, np.float32), _poisoned(n, np.float32)
            comm.Alltoallv(make(send), make(want))
            got_b = to_backend(got, backend)
            c.Alltoallv(make(to_backend(send, backend)), make(got_b))
            _same(to_numpy(got_b), want)
    # one count for every rank, strided displacements (a gap of 2 after each block)
    send = _random(rng, 5 * W, np.int32)
    want, got = _poisoned(5 * W + 1, np.int32), _poisoned(5 * W + 1, np.int32)
    comm.Alltoallv([send, (3, 5), MPI.INT], [want, (3, 5), MPI.INT])
    got_b = to_backend(got, backend)
    c.Alltoallv([to_backend(send, backend), (3, 5), MPI.INT], [got_b, (3, 5), MPI.INT])
    _same(to_numpy(got_b), want)


# ---- Alltoall ------------------------------------------------------------------------------------------------------

def _aspec(form, buf, count, displ, datatype):
    return {
        "bare": lambda: buf,
        "[buf, datatype]": lambda: [buf, datatype],
        "[buf, count]": lambda: [buf, count],
        "[buf, (count, displ)]": lambda: [buf, (count, displ)],
        "[buf, [count, displ]]": lambda: [buf, [count, displ]],
        "[buf, count, datatype]": lambda: [buf, count, datatype],
        "[buf, (count, displ), datatype]": lambda: [buf, (count, displ), datatype],
        "[buf, count, displ, datatype]": lambda: [buf, count, displ, datatype],
    }[form]()


AFORMS = ["bare", "[buf, datatype]", "[buf, count]", "[buf, (count, displ)]", "[buf, [count, displ]]",
          "[buf, count, datatype]", "[buf, (count, displ), datatype]", "[buf, count, displ, datatype]"]


@pytest.mark.parametrize("form", AFORMS)
@pytest.mark.parametrize("dtype", [np.float64, np.complex128, np.int32], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape_kind", ["1d", "2d"])
def test_alltoall_equals_mpi(c, comm, backend, form, dtype, shape_kind):
    W = comm.size
    rng = rng_for(comm, 60)
    mpi_t = NAMED[np.dtype(dtype)]
    for count in (3, 0):
        inferred = form in ("bare", "[buf, datatype]")
        displ = 0 if inferred or form in ("[buf, count]", "[buf, count, datatype]") else 2
        extra = 0 if inferred else 1  # elements after the blocks (left alone)
        n = displ + W * count + extra
        send = _random(rng, n, dtype)
        want, got = _poisoned(n, dtype), _poisoned(n, dtype)
        comm.Alltoall(_aspec(form, _shaped(send, shape_kind), count, displ, mpi_t),
                      _aspec(form, _shaped(want, shape_kind), count, displ, mpi_t))
        got_b = _shaped(to_backend(got, backend), shape_kind)
        assert c.Alltoall(_aspec(form, _shaped(to_backend(send, backend), shape_kind), count, displ, mpi_t),
                          _aspec(form, got_b, count, displ, mpi_t)) is None
        _same(to_numpy(got_b).reshape(-1), want)


# ---- bad specs -----------------------------------------------------------------------------------------------------

def _bad_cases(comm, backend):
    """(name, sendspec, recvspec, exception type, message pattern) of specs one rank can reject alone."""
    W, me = comm.size, comm.rank
    cnt = np.ones(W, np.int64)
    dsp = np.arange(W, dtype=np.int64)
    s = to_backend(np.arange(W, dtype=np.float64), backend)
    r = to_backend(np.zeros(W), backend)
    r32 = to_backend(np.zeros(W, np.float32), backend)
    wide = to_backend(np.zeros((W, 2)), backend)
    return [
        ("derived datatype", [s, cnt, dsp, MPI.DOUBLE.Create_contiguous(2)], [r, cnt, dsp, MPI.DOUBLE], TypeError,
         r"Alltoallv: argument 'sendbuf' has a derived MPI datatype \(COMBINER_CONTIGUOUS\)"),
        ("resized datatype", [s, cnt, dsp, MPI.DOUBLE], [r, cnt, dsp, MPI.DOUBLE.Create_resized(0, 16)], TypeError,
         r"argument 'recvbuf' has a derived MPI datatype \(COMBINER_RESIZED\)"),
        ("counts wrong length", [s, list(cnt) + [1], dsp, MPI.DOUBLE], [r, cnt, dsp, MPI.DOUBLE], ValueError,
         r"argument 'sendbuf' counts must have one entry per rank \(world_size = %d\)" % W),
        ("displs wrong length", [s, cnt, dsp, MPI.DOUBLE], [r, cnt, dsp[:-1], MPI.DOUBLE], ValueError,
         r"argument 'recvbuf' displs must have one entry per rank"),
        ("displ out of range", [s, cnt, dsp + 1, MPI.DOUBLE], [r, cnt, dsp, MPI.DOUBLE], ValueError,
         r"argument 'sendbuf': the block of rank %d \(1 elements at displacement %d\) must lie inside the buffer's "
         r"%d elements" % (W - 1, W, W)),
        ("negative displ", [s, cnt, dsp, MPI.DOUBLE], [r, cnt, dsp - 1, MPI.DOUBLE], ValueError,
         r"argument 'recvbuf': the block of rank 0 .* must lie inside"),
        ("negative count", [s, -cnt, dsp, MPI.DOUBLE], [r, cnt, dsp, MPI.DOUBLE], ValueError,
         r"argument 'sendbuf' counts must be >= 0"),
        ("float counts", [s, cnt * 1.0, dsp, MPI.DOUBLE], [r, cnt, dsp, MPI.DOUBLE], TypeError,
         r"argument 'sendbuf' counts must hold ints"),
        ("buffer vs datatype", [s, cnt, dsp, MPI.FLOAT], [r, cnt, dsp, MPI.DOUBLE], TypeError,
         r"argument 'sendbuf' has datatype MPI_FLOAT \(float32\), which does not describe the array's elements "
         r"\(float64\)"),
        ("typecode vs buffer", [s, cnt, dsp, "i"], [r, cnt, dsp, "d"], TypeError,
         r"argument 'sendbuf' has datatype 'i' \(int32\), which does not describe"),
        ("send vs recv datatype", [s, cnt, dsp, MPI.DOUBLE], [r32, cnt, dsp, MPI.FLOAT], TypeError,
         r"argument 'recvbuf' has datatype float32 but 'sendbuf' float64"),
        ("five items", [s, cnt, dsp, MPI.DOUBLE, 0], [r, cnt, dsp, MPI.DOUBLE], ValueError,
         r"argument 'sendbuf' must be an array or a list/tuple of 2 to 4 items"),
        ("not a spec", {"buf": s}, [r, cnt, dsp, MPI.DOUBLE], TypeError,
         r"argument 'sendbuf' must be an array or a list/tuple"),
        ("overlapping recv blocks", [s, cnt, dsp, MPI.DOUBLE], [wide, cnt, dsp // 2, MPI.DOUBLE], ValueError,
         r"argument 'recvbuf': the blocks of ranks 0 \(\[0, 1\)\) and 1 \(\[0, 1\)\) overlap"),
        ("self counts differ", [s, cnt, dsp, MPI.DOUBLE], [wide, cnt * 2, dsp * 2, MPI.DOUBLE], ValueError,
         r"argument 'recvbuf' expects 2 elements from this rank \(%d\) but 'sendbuf' sends it 1" % me),
        ("aliased buffers", [s, cnt, dsp, MPI.DOUBLE], [s, cnt, dsp, MPI.DOUBLE], ValueError,
         r"argument 'recvbuf' shares memory with 'sendbuf'"),
        ("non-contiguous", [wide[:, ::-1], cnt, dsp, MPI.DOUBLE], [r, cnt, dsp, MPI.DOUBLE], ValueError,
         r"argument 'sendbuf' must be a contiguous array"),
    ]


CASE_NAMES = [case[0] for case in _bad_cases(MPI.COMM_WORLD, "host")
              if MPI.COMM_WORLD.size > 1 or case[0] != "overlapping recv blocks"]  # (one block cannot overlap)


@pytest.mark.parametrize("who", ["every rank", "rank 0"])
@pytest.mark.parametrize("case", CASE_NAMES)
def test_bad_alltoallv_specs_raise_and_stay_usable(c, comm, backend, case, who):
    name, sspec, rspec, exc, pattern = next(x for x in _bad_cases(comm, backend) if x[0] == case)
    me = comm.rank
    if who == "every rank" or me == 0:
        with pytest.raises(exc, match=pattern) as info:
            c.Alltoallv(sspec, rspec)
        assert not isinstance(info.value, cs.SymBufferRejectedError)
    else:
        good = np.ones(comm.size)
        with pytest.raises(cs.SymBufferRejectedError, match="rank 0 rejected"):
            c.Alltoallv(to_backend(good, backend), to_backend(np.zeros(comm.size), backend))
            c.synchronize()  # (GPU: a queued call's rejection by a peer is raised here; host: by the call)
    # still usable, and in step
    _compare_alltoallv(c, comm, backend, 70, np.complex128)
    _compare_alltoallv(c, comm, backend, 71, np.int32, form="[buf, counts]")


def _bad_alltoall_cases(comm, backend):
    W = comm.size
    s = to_backend(np.arange(2 * W, dtype=np.float64), backend)
    r = to_backend(np.zeros(2 * W), backend)
    return [
        ("derived datatype", [s, MPI.DOUBLE.Create_contiguous(2)], r, TypeError,
         r"Alltoall: argument 'sendbuf' has a derived MPI datatype"),
        ("count not inferable", [s, (None, 1)], r, ValueError,
         r"argument 'sendbuf': cannot infer the count: the buffer's %d elements after displ 1 are not a multiple "
         r"of world_size" % (2 * W - 1)),
        ("count too large", [s, 3], r, ValueError, r"argument 'sendbuf': world_size x count = %d x 3" % W),
        ("displ out of range", [s, (1, 2 * W + 1)], r, ValueError, r"argument 'sendbuf' displ must be in"),
        ("counts differ", [s, 2], [r, 1], ValueError, r"argument 'recvbuf' expects 1 elements from this rank"),
        ("buffer vs datatype", [s, MPI.INT], r, TypeError, r"does not describe the array's elements"),
        ("count not an int", [s, 1.5], r, TypeError, r"argument 'sendbuf' count must be an int"),
    ]


A_CASE_NAMES = [case[0] for case in _bad_alltoall_cases(MPI.COMM_WORLD, "host")
                if MPI.COMM_WORLD.size > 1 or case[0] != "count not inferable"]  # (any n divides by 1)


@pytest.mark.parametrize("case", A_CASE_NAMES)
def test_bad_alltoall_specs_raise_and_stay_usable(c, comm, backend, case):
    name, sspec, rspec, exc, pattern = next(x for x in _bad_alltoall_cases(comm, backend) if x[0] == case)
    if comm.rank == 0:
        with pytest.raises(exc, match=pattern) as info:
            c.Alltoall(sspec, rspec)
        assert not isinstance(info.value, cs.SymBufferRejectedError)
    else:
        with pytest.raises(cs.SymBufferRejectedError, match="rank 0 rejected"):
            c.Alltoall(to_backend(np.ones(comm.size), backend), to_backend(np.zeros(comm.size), backend))
            c.synchronize()  # (GPU: a queued call's rejection by a peer is raised here; host: by the call)
    test_alltoall_equals_mpi(c, comm, backend, "[buf, count, displ, datatype]", np.float64, "1d")


def test_declared_recv_counts_differ_from_what_the_peer_sends(backend, comm):
    """Rank 0 declares one element more from rank 1 than rank 1 sends: rank 0 raises SymBufferMismatchError
    before taking a byte, every rank raises (this call or the next), none gets wrong data."""
    if comm.size < 2:
        pytest.skip("needs two ranks")
    c = cs.Communicator(comm, cs.Config(blocking=True, chunk_bytes=1024, num_slots=2, timeout_s=20), backend=backend)
    W, me = comm.size, comm.rank
    m = _count_matrix(comm, 80, zero_frac=0.0) + 1
    sc, rc = m[me], m[:, me].copy()
    if me == 0:
        rc[1] += 1
    send = _random(rng_for(comm, 81), int(sc.sum()), np.float64)
    sends = comm.allgather(send)
    want = np.concatenate([sends[s][int(m[s, :me].sum()):][:m[s, me]] for s in range(W)])
    seen = []
    checks = RankChecks()  # this rank's rows: checked on every rank after every rank's calls and close
    try:
        for i in range(2):
            got = to_backend(_poisoned(int(rc.sum()), np.float64), backend)
            try:
                c.Alltoallv([to_backend(send, backend), sc, MPI.DOUBLE], [got, rc, MPI.DOUBLE])
            except cs.SymBufferError as exc:
                seen.append(exc)
                break
            with checks.local(f"call {i} returned rows"):  # only a rank whose declared counts were right
                np.testing.assert_array_equal(to_numpy(got), want)
        errors = comm.allgather(type(seen[0]).__name__ if seen else None)
    finally:  # every rank closes (collective), whatever failed on this rank above
        try:
            c.close()
        except cs.SymBufferError:
            pass
    checks.gather()
    assert all(errors), errors
    if me == 0:
        assert isinstance(seen[0], cs.SymBufferMismatchError), seen[0]


def test_no_mpi_shaped_call_on_a_closed_communicator(backend, comm):
    c = cs.Communicator(comm, CFG, backend=backend)
    c.close()
    x = to_backend(np.zeros(comm.size), backend)
    with pytest.raises(cs.SymBufferClosedError):
        c.Alltoall(x, to_backend(np.zeros(comm.size), backend))
    with pytest.raises(cs.SymBufferClosedError):
        c.Alltoallv(x, to_backend(np.zeros(comm.size), backend))


def test_all_ranks_agree_after_the_suite(comm):
    all_ranks(lambda: None)
