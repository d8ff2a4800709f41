"""Low-precision transfer (wire_dtype): alltoallv rows and dispatch tokens quantised per 128-element block on the
send side, dequantised on receive. Exact against a NumPy reference of the same quantise / dequantise on the
sender's rows (every rank regenerates every peer's rows from its seed), within the documented error bounds of the
true values, and the ranks' choices are checked."""
import numpy as np
import pytest

import cupy_symbuf as cs
from cupy_symbuf.common import dtypes as dt
from cupy_symbuf.collectives import quant
from _util import to_backend, to_numpy

ml_dtypes = pytest.importorskip("ml_dtypes")


def _dtype(name):
    return ml_dtypes.bfloat16 if name == "bfloat16" else np.dtype(name)


def _send(src: int, W: int, dtype, rows_per_dst=(3, 0, 5, 2)):
    rng = np.random.default_rng([src, 9])
    counts = np.array([rows_per_dst[(src + d) % len(rows_per_dst)] for d in range(W)], np.int64)
    x = (rng.standard_normal((int(counts.sum()), 2, 128)) * rng.uniform(0.01, 100)).astype(np.float32)
    x[0, 0, :5] = 0.0
    return x.astype(dtype), counts


def _roundtrip(x, wire):
    """What a receiver gets for rows x (NumPy): dequantise(quantise(float32(x))) in x's dtype."""
    f = x.astype(np.float32).reshape(x.shape[0], int(np.prod(x.shape[1:])))
    if wire == "fp8":
        q, s = quant.quantize_fp8(f)
        back = quant.dequantize_fp8(q, s)
    else:
        q, s = quant.quantize_int8(f)
        back = quant.dequantize_int8(q, s)
    return back.astype(x.dtype).reshape(x.shape), s


@pytest.mark.parametrize("wire", ["fp8", "int8"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_alltoallv_wire_dtype_matches_numpy(backend, comm, wire, dtype):
    if backend == "cuda" and dtype == "bfloat16":
        pytest.skip("CuPy has no bfloat16 dtype")
    W, me = comm.size, comm.rank
    dty = _dtype(dtype)
    x, counts = _send(me, W, dty)
    with cs.Communicator(comm, backend=backend) as c:
        for capacity in (None, 20 * W):
            got, got_counts = c.alltoallv(to_backend(x, backend), counts, wire_dtype=wire,
                                          recv_capacity=capacity)
            got, got_counts = to_numpy(got), to_numpy(got_counts)
            want, want_exact, want_counts = [], [], []
            for s in range(W):
                xs, cs_ = _send(s, W, dty)
                lo = int(cs_[:me].sum())
                rows = xs[lo: lo + cs_[me]]
                want.append(_roundtrip(rows, wire)[0])
                want_exact.append(rows)
                want_counts.append(cs_[me])
            want = np.concatenate(want)
            np.testing.assert_array_equal(got_counts, want_counts)
            n = int(np.sum(want_counts))
            assert got.dtype == dty and got.shape[1:] == x.shape[1:]
            np.testing.assert_array_equal(got[:n].view(np.uint8), want.view(np.uint8))  # bit for bit
            # and within the bound of the true values (float32 rows: the quantiser's own bound)
            exact = np.concatenate(want_exact).astype(np.float32).reshape(n, 256)
            _, s = _roundtrip(np.concatenate(want_exact), wire)
            bound = quant.error_bound(exact, s) if wire == "fp8" else quant.int8_error_bound(s)
            if dtype == "float32":
                assert (np.abs(got[:n].astype(np.float32).reshape(n, 256) - exact) <= bound).all()


def test_wire_dtype_must_agree_and_bad_input_is_rejected(backend, comm):
    W, me = comm.size, comm.rank
    x, counts = _send(me, W, np.float32)
    with cs.Communicator(comm, backend=backend) as c:
        xb = to_backend(x, backend)
        with pytest.raises(ValueError, match="wire_dtype must be"):
            c.alltoallv(xb, counts, wire_dtype="fp4")
        with pytest.raises(ValueError, match=r"wire_dtype must be None, 'fp8' or 'int8', got \['fp8'\]"):
            c.alltoallv(xb, counts, wire_dtype=["fp8"])  # was a bare "unhashable type: 'list'"
        with pytest.raises(ValueError, match="multiple of 128"):
            c.alltoallv(xb[:, :, :100], counts, wire_dtype="fp8")
        if W > 1:  # fp8 on rank 0, int8 elsewhere: the packed rows differ in dtype, every rank raises
            with pytest.raises(ValueError):
                c.alltoallv(xb, counts, wire_dtype="fp8" if me == 0 else "int8")
            # float32 rows on rank 0, float16 elsewhere: the source dtype travels in the packed row shape
            with pytest.raises(ValueError):
                c.alltoallv(xb if me == 0 else xb.astype(np.float16), counts, wire_dtype="fp8")
            # fp8 on rank 0 only: each rank's error says it in the caller's terms (not the packed uint8 rows)
            want = (r"sends float32 rows of shape \(.*\) as wire_dtype='fp8', but rank 1 does not" if me == 0 else
                    r"this rank has .*float32.* \(no wire_dtype\), but rank 0 does not")
            with pytest.raises(ValueError, match=want):
                c.alltoallv(xb, counts, **({"wire_dtype": "fp8"} if me == 0 else {}))
        got, _ = c.alltoallv(xb, counts, wire_dtype="int8")  # still usable
        assert got.shape[1:] == x.shape[1:]


def test_dispatch_wire_fp8(backend, comm):
    """dispatch(wire_dtype='fp8') delivers exactly what a plain dispatch of the sender-side roundtrip delivers,
    within the fp8 bound of the true tokens; its relative L2 error on Gaussian data is ~2-3e-2."""
    W = comm.size
    rng = np.random.default_rng([comm.rank, 3])
    T, H, E, K = 40, 256, 4 * W, 3
    x = rng.standard_normal((T, H)).astype(np.float32)
    idx = np.stack([rng.choice(E, K, replace=False) for _ in range(T)]).astype(np.int64)
    with cs.Communicator(comm, backend=backend) as c:
        xb, ib = to_backend(x, backend), to_backend(idx, backend)
        recv, recv_idx, _, _, handle = c.dispatch(xb, ib, None, E, wire_dtype="fp8")
        plain = to_numpy(c.dispatch(xb, ib, None, E)[0])
        ref = to_numpy(c.dispatch(to_backend(_roundtrip(x, "fp8")[0], backend), ib, None, E)[0])
        recv = to_numpy(recv)
        np.testing.assert_array_equal(recv, ref)
        _, s = quant.quantize_fp8(plain)
        assert (np.abs(recv - plain) <= quant.error_bound(plain, s)).all()
        rel = np.linalg.norm(recv - plain) / np.linalg.norm(plain)
        assert 5e-3 < rel < 5e-2, rel
        cached = to_numpy(c.dispatch(xb, handle=handle, wire_dtype="fp8")[0])  # cached dispatch too
        np.testing.assert_array_equal(cached, ref)
        with pytest.raises(ValueError, match="wire_dtype"):
            c.dispatch(xb, ib, None, E, wire_dtype="int8")


def test_int8_quantiser_spec():
    """quantize_int8 per 128-element block: scale = amax / 127 (0 for an all-zero block), codes use the full
    range (the block's largest element is +-127), every element within half a step, zero blocks exact."""
    rng = np.random.default_rng(11)
    x = (rng.standard_normal((6, 384)) * np.array([1e-3, 1, 50, 1e4, 1, 1])[:, None]).astype(np.float32)
    x[5, 128:256] = 0.0
    q, s = quant.quantize_int8(x)
    assert q.dtype == np.int8 and s.shape == (6, 3) and s.dtype == np.float32
    blocks = x.reshape(6, 3, 128)
    np.testing.assert_array_equal(s, (np.abs(blocks).max(axis=2) / np.float32(127)).astype(np.float32))
    qb = q.reshape(6, 3, 128).astype(np.int32)
    live = s > 0
    assert (np.abs(qb).max(axis=2)[live] == 127).all() and (qb[~live] == 0).all()
    back = quant.dequantize_int8(q, s)
    assert (np.abs(back - x) <= quant.int8_error_bound(s)).all()
    assert (back[5, 128:256] == 0).all()


@pytest.mark.skipif(not cs.common.backend.cuda_available(), reason="needs CuPy and a visible GPU")
@pytest.mark.parametrize("ue8m0", [False, True])
def test_fused_gpu_quantiser_is_the_numpy_one_bit_for_bit(ue8m0):
    """The fused kernels (cuda_src/quant.cu) against quant.py's NumPy arithmetic on random blocks of every scale,
    an all-zero block, +-inf, NaN, subnormals and values past 448 times the scale; views starting inside an
    allocation (misaligned for the 16-byte loads) too; and the dequantiser likewise."""
    import cupy
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((37, 384)) * np.exp(rng.uniform(-20, 20, (37, 1)))).astype(np.float32)
    x[0] = 0.0
    x[1, :7] = [np.inf, -np.inf, np.nan, 1e-42, -1e-40, 3e38, -2.5]
    x[2, 128:256] = 1e-45
    want_q, want_s = quant.quantize_fp8(x, ue8m0)
    got_q, got_s = quant.quantize_fp8(cupy.asarray(x), ue8m0)
    np.testing.assert_array_equal(cupy.asnumpy(got_s).view(np.uint32), want_s.view(np.uint32))
    np.testing.assert_array_equal(cupy.asnumpy(got_q), want_q)
    big = cupy.asarray(np.concatenate([[0.0], x.reshape(-1)]).astype(np.float32))
    view = big[1:].reshape(x.shape)  # C-contiguous, 4 bytes into its allocation
    q2, s2 = quant.quantize_fp8(view, ue8m0)
    np.testing.assert_array_equal(cupy.asnumpy(q2), want_q)
    want = quant.dequantize_fp8(want_q, want_s)
    got = quant.dequantize_fp8(cupy.asarray(want_q), cupy.asarray(want_s))
    g = cupy.asnumpy(got)
    assert (np.isnan(g) == np.isnan(want)).all()  # NaN bits may differ (the GPU's canonical NaN)
    ok = ~np.isnan(want)
    np.testing.assert_array_equal(g[ok].view(np.uint32), want[ok].view(np.uint32))


@pytest.mark.parametrize("wire", ["fp8", "int8"])
def test_wire_non_finite_values_arrive_as_documented(backend, comm, wire):
    """The documented non-finite behaviour (the docs had said a NaN makes its whole block NaN with fp8 too): an inf
    makes its 128-element block NaN; a NaN is NaN in its own element only with fp8 and makes its block NaN with
    int8; every other block within the quantiser's bound of the NumPy reference."""
    W, me = comm.size, comm.rank
    rng = np.random.default_rng([me, 77])
    x = rng.standard_normal((2 * W, 384)).astype(np.float32)
    x[0::2, 5] = np.nan      # block 0 of even rows: one NaN
    x[1::2, 130] = np.inf    # block 1 of odd rows: one inf
    with cs.Communicator(comm, backend=backend) as c:
        with np.errstate(invalid="ignore", over="ignore"):
            got, _ = c.alltoallv(to_backend(x, backend), np.full(W, 2), wire_dtype=wire)
    got = to_numpy(got)
    want = np.concatenate([a[2 * me: 2 * me + 2] for a in comm.allgather(x)])
    nan = np.isnan(got)
    assert nan[1::2, 128:256].all() and not nan[1::2, :128].any() and not nan[1::2, 256:].any()  # inf
    if wire == "fp8":
        assert nan[0::2, 5].all() and nan[0::2].sum() == W  # the NaN element only
    else:
        assert nan[0::2, :128].all() and not nan[0::2, 128:].any()  # the whole block
    ok = ~nan
    with np.errstate(invalid="ignore", over="ignore"):
        quantise = quant.quantize_fp8 if wire == "fp8" else quant.quantize_int8
        _, scales = quantise(np.where(np.isfinite(want), want, 0))
    bound = quant.error_bound(want, scales) if wire == "fp8" else quant.int8_error_bound(scales)
    assert (np.abs(got - want)[ok] <= bound[ok]).all()


def _special_rows(seed):
    """float32 rows of 3 blocks: every scale, an all-zero block, +-inf, NaN, subnormals, values past 448 x scale."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((29, 384)) * np.exp(rng.uniform(-12, 12, (29, 1)))).astype(np.float32)
    x[0] = 0.0
    x[1, :7] = [np.inf, -np.inf, np.nan, 1e-42, -1e-40, 3e38, -2.5]
    x[2, 128:256] = 1e-45
    return x


def _in_kind(x32, kind):
    """x32 in float kind ``kind`` as the caller holds it on the GPU (bfloat16: raw uint16 bits)."""
    if kind == "float16":
        with np.errstate(over="ignore"):
            return x32.astype(np.float16)
    if kind == "bfloat16":
        return dt.float32_to_bf16_bits(np, x32)
    return x32


@pytest.mark.parametrize("kind", ["float32", "float16", "bfloat16"])
def test_quantize_from_kind_is_the_float32_composition(kind):
    """quantize_fp8_from / dequantize_fp8_to (NumPy) are quantize_fp8 of the widened rows and the narrowing of
    dequantize_fp8, for every float kind (bfloat16 as raw bits and as the ml_dtypes dtype)."""
    x = _in_kind(_special_rows(7), kind)
    for a in ([x, x.view(ml_dtypes.bfloat16)] if kind == "bfloat16" else [x]):
        f = dt.to_float32(np, a, kind)
        for ue8m0 in (False, True):
            q, s = quant.quantize_fp8_from(a, kind, ue8m0)
            wq, ws = quant.quantize_fp8(f, ue8m0)
            np.testing.assert_array_equal(q, wq)
            np.testing.assert_array_equal(s.view(np.uint32), ws.view(np.uint32))
            with np.errstate(over="ignore", invalid="ignore"):
                got = quant.dequantize_fp8_to(q, s, kind, a.dtype)
                want = dt.from_float32(np, quant.dequantize_fp8(wq, ws), kind, a.dtype)
            assert got.dtype == a.dtype and got.shape == a.shape
            np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


@pytest.mark.skipif(not cs.common.backend.cuda_available(), reason="needs CuPy and a visible GPU")
@pytest.mark.parametrize("kind", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("ue8m0", [False, True])
def test_fused_gpu_quantiser_reads_and_writes_the_callers_type(kind, ue8m0):
    """The kernels for float16 / bfloat16 rows (symbuf_quant_fp8_f16 / _bf16 and the dequantisers writing the
    caller's type) against the NumPy composition, bit for bit (a NaN: NaN, its payload the GPU's), also on a view
    misaligned for their 8-byte loads."""
    import cupy
    host = _in_kind(_special_rows(8), kind)
    f = dt.to_float32(np, host, kind)
    want_q, want_s = quant.quantize_fp8(f, ue8m0)
    big = cupy.asarray(np.concatenate([host.reshape(-1)[:1], host.reshape(-1)]))
    for dev in (cupy.asarray(host), big[1:].reshape(host.shape)):
        got_q, got_s = quant.quantize_fp8_from(dev, kind, ue8m0)
        np.testing.assert_array_equal(cupy.asnumpy(got_s).view(np.uint32), want_s.view(np.uint32))
        np.testing.assert_array_equal(cupy.asnumpy(got_q), want_q)
    with np.errstate(over="ignore", invalid="ignore"):
        want = dt.from_float32(np, quant.dequantize_fp8(want_q, want_s), kind, host.dtype)
    got = cupy.asnumpy(quant.dequantize_fp8_to(cupy.asarray(want_q), cupy.asarray(want_s), kind, host.dtype))
    assert got.dtype == host.dtype and got.shape == host.shape
    # NaN stays NaN; its payload is the GPU's canonical one (its float32 product), as in the float32 kernel's test
    nan = np.isnan(dt.to_float32(np, want, kind))
    assert (np.isnan(dt.to_float32(np, got, kind)) == nan).all() and nan.any()
    bits = {"float32": np.uint32, "float16": np.uint16, "bfloat16": np.uint16}[kind]
    np.testing.assert_array_equal(got[~nan].view(bits), want[~nan].view(bits))


def test_kind_and_dtype_must_agree():
    """From a new-user attack: float32 rows with kind='bfloat16' were read as shifted 32-bit words (garbage scales,
    no error), float64 rows passed as float16, and out_dtype=float32 with kind='bfloat16' returned half the
    columns. Now a TypeError naming the argument and the kind, a ValueError for an unknown kind; the right pairs
    (bfloat16 as the ml_dtypes dtype or uint16 bits) still match the NumPy composition."""
    x32 = np.random.default_rng(4).standard_normal((2, 256)).astype(np.float32)
    for a, kind in ((x32, "bfloat16"), (x32.astype(np.float64), "float16"), (x32.astype(np.float16), "float32"),
                    (dt.float32_to_bf16_bits(np, x32), "float16")):
        with pytest.raises(TypeError, match=rf"quantize_fp8_from: x must hold {kind} values"):
            quant.quantize_fp8_from(a, kind)
    for bad in ("float8_e4m3", "FLOAT32", None):
        with pytest.raises(ValueError, match="quantize_fp8_from: kind must be one of"):
            quant.quantize_fp8_from(x32, bad)
    q, s_ = quant.quantize_fp8(x32)
    for out_dtype, kind in ((np.float32, "bfloat16"), (np.int8, "bfloat16"), (np.float16, "float32")):
        with pytest.raises(TypeError, match=rf"dequantize_fp8_to: out_dtype must hold {kind} values"):
            quant.dequantize_fp8_to(q, s_, kind, out_dtype)
    bits = dt.float32_to_bf16_bits(np, x32)
    for a in (bits, bits.view(ml_dtypes.bfloat16)):
        got_q, got_s = quant.quantize_fp8_from(a, "bfloat16")
        want_q, want_s = quant.quantize_fp8(dt.to_float32(np, bits, "bfloat16"))
        np.testing.assert_array_equal(got_q, want_q)
        np.testing.assert_array_equal(got_s, want_s)
        back = quant.dequantize_fp8_to(got_q, got_s, "bfloat16", a.dtype)
        assert back.dtype == a.dtype and back.shape == a.shape


def test_all_nan_block_takes_the_floor_scale_as_on_the_gpu():
    """From a new-user attack: an all-NaN block got scale NaN on the host (np.maximum passes NaN; the GPU's fmaxf
    takes the floor, 1e-4 / 448, or 2**-22 with ue8m0); now the host's scales are the GPU's."""
    x = np.random.default_rng(5).standard_normal((1, 256)).astype(np.float32)
    x[0, :128] = np.nan
    for ue8m0, want in ((False, np.float32(quant.AMAX_FLOOR) / quant.FP8_MAX), (True, np.float32(2.0 ** -22))):
        with np.errstate(invalid="ignore"):
            _, s = quant.quantize_fp8(x, ue8m0)
        assert s[0, 0] == want and np.isfinite(s).all(), (ue8m0, s)
        assert s[0, 1] == quant.block_scales(x[:, 128:], ue8m0)[0, 0]


def test_dispatch_wire_dtype_must_be_a_str(backend, comm):
    """From a new-user attack: dispatch took wire_dtype=np.array(["fp8"]) (an elementwise comparison) where
    alltoallv refuses it; now the same ValueError, and the communicator stays usable."""
    W = comm.size
    x = np.random.default_rng([comm.rank, 6]).standard_normal((4, 128)).astype(np.float32)
    idx = np.zeros((4, 1), np.int64)
    with cs.Communicator(comm, backend=backend) as c:
        with pytest.raises(ValueError, match="wire_dtype must be None or 'fp8'"):
            c.dispatch(to_backend(x, backend), to_backend(idx, backend), None, W, wire_dtype=np.array(["fp8"]))
        got = to_numpy(c.dispatch(to_backend(x, backend), to_backend(idx, backend), None, W)[0])
        everyone = np.concatenate(comm.allgather(x))  # every token to expert 0, on rank 0
        want = everyone if comm.rank == 0 else np.zeros((0, 128), np.float32)
        np.testing.assert_array_equal(got, want)
