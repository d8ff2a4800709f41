"""The GPU path's host code, run here without a GPU (``tests/_gpu_stub.py``: CuPy arrays over made-up addresses,
launches recorded instead of made): what a combine, a cached dispatch and an eager dispatch hand their kernels.

* A repeated call of one shape runs from the record its first call kept (per handle: kind, signature, plan,
  reduction launcher, allocation layout): its launches must equal, word for word (addresses of the call's new
  allocations aside), those of the same call made with no record, while calls alternate the handle, the dtype, the
  row strides, the weights, ``out=`` and the stream.
* The combine reduces x and the weights in one launch; every call asks ``cudaStreamIsCapturing`` once.
* A call whose arguments differ from its record's in shape or device is checked in full (the same errors, told to
  the peers); records are bounded per handle.
* An eager dispatch (no handle) of a call shape checked before runs from its record in the communicator's memo
  (kind, signature, receive parts, plan): the same launches as the call checked in full; a call differing in any
  one key field (a dtype at the same strides, strides at the same shape, rows, the weights, the integer arguments,
  the GPU) is checked in full; the handle built without the dataclass's ``__init__`` equals the one built with it.

Values are checked on a GPU by tests/test_moe_device.py (``..._repeats_alternating_call_shapes``).
"""
from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

import _gpu_stub as S  # noqa: E402  (tests/ is on sys.path under pytest)
from cupy_symbuf.moe import normal  # noqa: E402
from cupy_symbuf.moe import normal_cuda  # noqa: E402
from cupy_symbuf.wire import protocol as P  # noqa: E402

# descriptor words holding this call's own allocations or its launch number (differ between two equal calls)
_CALL_WORDS = {P.DESC_SEQ} | {P.DESC_SEND_PARTS + 4 * i for i in range(P.MAX_PARTS)} | \
    {P.DESC_RECV_PARTS + 4 * i for i in range(P.MAX_PARTS)}
_REDUCE_ALLOCS = ("back", "out", "w_back", "w_out")


@pytest.fixture
def stub():
    with S.stubbed() as (launches, stream):
        eng = S.engine(launches)
        yield eng, launches, stream


def _canon(log, fresh_out: bool = True, x_ptr: int = -1):
    """The launches without what differs between two equal calls (their new allocations, the launch number;
    ``x_ptr``: the caller's x, whose contiguous copy, where one is made, is new on every call)."""
    out = []
    for kind, args, grid, block, stream_ptr in log:
        if kind == "ring":
            args = tuple(0 if i in _CALL_WORDS else v for i, v in enumerate(args))
        else:
            args = {k: (v if k not in _REDUCE_ALLOCS or (k == "out" and not fresh_out) else bool(v))
                    for k, v in args.items()}
            args["self_rows"] = "x" if args["self_rows"] == x_ptr else bool(args["self_rows"])
        out.append((kind, args, grid, block, stream_ptr))
    return out


def _bf16():
    try:
        return cupy.dtype(cupy.bfloat16) if hasattr(cupy, "bfloat16") else None
    except TypeError:  # pragma: no cover
        return None


def test_combine_reduces_x_and_weights_in_one_launch(stub):
    eng, launches, stream = stub
    h = S.handle(eng, num_tokens=32, hidden=256, num_topk=4)
    x = cupy.empty((h.num_recv_tokens, h.hidden), np.float16)
    w = cupy.empty((h.num_recv_tokens, h.num_topk), np.float32)
    for _ in range(2):  # the first call makes the record, the second runs from it
        launches.clear()
        combined, cw = normal.combine(eng, x, h, w)
        kinds = [e[0] for e in launches.log]
        assert kinds == ["ring", "symbuf_combine_reduce_f16"], kinds
        a = launches.log[1][1]
        assert a["out"] == combined.data.ptr and a["w_out"] == cw.data.ptr
        assert a["self_rows"] == x.data.ptr and a["w_self_rows"] == w.data.ptr
        assert a["table"] == h.routing.table_ptr and a["pos"] == h.routing.pos.data.ptr
        assert (a["num_topk"], a["hidden"], a["num_tokens"], a["world_size"], a["rank"]) == \
            (4, 256, 32, eng.world_size, eng.rank)
        assert a["self_stride"] == 256 and a["w_self_stride"] == 4 and a["vec"] == 1
        assert combined.shape == (32, 256) and combined.dtype == np.float16
        assert cw.shape == (32, 4) and cw.dtype == np.float32
        # the outputs do not overlap (one allocation, two arrays) and neither overlaps the received rows
        spans = sorted([(combined.data.ptr, combined.nbytes), (cw.data.ptr, cw.nbytes),
                        (a["back"], h.send_rows * 256 * 2), (a["w_back"], h.send_rows * 16)])
        assert all(p + n <= q for (p, n), (q, _) in zip(spans, spans[1:])), spans
    launches.clear()
    combined, cw = normal.combine(eng, x, h)
    a = launches.log[1][1]
    assert cw is None and a["w_out"] == 0 and a["w_back"] == 0 and a["num_topk"] == 0


def test_capture_state_asked_once_per_call(stub):
    eng, launches, stream = stub
    h = S.handle(eng, num_tokens=16, hidden=128, num_topk=4)
    x = cupy.empty((h.num_recv_tokens, h.hidden), np.float32)
    w = cupy.empty((h.num_recv_tokens, h.num_topk), np.float32)
    xs = cupy.empty((h.num_tokens, h.hidden), np.float32)
    idx = cupy.empty((h.num_tokens, h.num_topk), np.int64)
    calls = {"combine": lambda: normal.combine(eng, x, h, w),
             "cached dispatch": lambda: normal.dispatch(eng, xs, handle=h),
             "eager dispatch": lambda: normal.dispatch(eng, xs, idx, None, h.num_experts)}
    for name, fn in calls.items():
        for _ in range(2):
            stream.capture_queries = 0
            fn()
            assert stream.capture_queries == 1, f"{name}: cudaStreamIsCapturing {stream.capture_queries} times"


def test_records_follow_the_call_shape(stub):
    """Calls alternating handle, dtype, strides, weights, out and stream: each call's launches equal those of the
    same call made with no record (the records dropped first)."""
    eng, launches, stream = stub
    other = S.FakeStream(ptr=0x5000)
    hs = [S.handle(eng, num_tokens=24, hidden=128, num_topk=4, dispatch_id=3),
          S.handle(eng, num_tokens=40, hidden=96, num_topk=2, send_rows=50, dispatch_id=7)]
    dtypes = [(np.float32, None), (np.float16, None), (np.uint16, "bfloat16")]
    if _bf16() is not None:
        dtypes.append((_bf16(), None))
    cases = []
    for i in range(2 * len(dtypes) * 3 * 2):
        h = hs[i % 2]
        dt, dtype_arg = dtypes[(i // 2) % len(dtypes)]
        strided = ("rows", "elements", None)[(i // (2 * len(dtypes))) % 3]
        with_w = i % 3 != 2
        use_out = i % 5 == 4
        st = other if i % 4 == 1 else stream
        cases.append((h, dt, dtype_arg, strided, with_w, use_out, st))

    def make(case):
        h, dt, dtype_arg, strided, with_w, use_out, st = case
        n = h.num_recv_tokens

        def rows(m, pad):  # "rows": a column slice (rows strided, elements not); "elements": every other element
            if strided == "rows":
                return cupy.empty((m, h.hidden + pad), dt)[:, :h.hidden]
            if strided == "elements":
                return cupy.empty((m, 2 * h.hidden), dt)[:, ::2]
            return cupy.empty((m, h.hidden), dt)
        w = cupy.empty((n, h.num_topk), np.float32) if with_w else None
        out = cupy.empty((h.num_tokens, h.hidden), dt) if use_out else None
        return rows(n, 8), w, out, rows(h.num_tokens, 4)

    arrays = [make(c) for c in cases]

    def run(case, arrs):
        h, dt, dtype_arg, strided, with_w, use_out, st = case
        x, w, out, xs = arrs
        launches.use_stream(st)
        launches.clear()
        kw = {} if dtype_arg is None else {"dtype": dtype_arg}
        normal.combine(eng, x, h, w, out=out, **kw)
        if dtype_arg is None:
            normal.dispatch(eng, xs, handle=h)
        for kind, a, *_ in launches.log:  # the reduction's two outputs never overlap
            if kind != "ring" and a["w_out"]:
                spans = sorted([(a["out"], h.num_tokens * h.hidden * np.dtype(dt).itemsize),
                                (a["w_out"], h.num_tokens * h.num_topk * 4)])
                assert spans[0][0] + spans[0][1] <= spans[1][0], f"{case}: the outputs overlap"
        got = _canon(launches.log, fresh_out=out is None, x_ptr=x.data.ptr)
        launches.use_stream(stream)
        return got

    for rep in range(3):  # rep 0 makes the records, 1 and 2 run from them
        for case, arrs in zip(cases, arrays):
            warm = run(case, arrs)
            kept = [h.__dict__.pop("_records", None) for h in hs]  # the same call with no record, then put back
            cold = run(case, arrs)
            for h, recs in zip(hs, kept):
                h.__dict__.pop("_records", None)
                if recs is not None:
                    h.__dict__["_records"] = recs
            assert warm == cold, f"{case}: launches from the record differ from a fresh call's"
            assert all(e[4] == case[6].ptr for e in launches.log) or not launches.log
    # strided x: the ring reads the rows in place (no copy) at their stride, the reduction reads its own rows there
    h = hs[0]
    x = cupy.empty((h.num_recv_tokens, h.hidden + 8), np.float32)[:, :h.hidden]
    launches.clear()
    normal.combine(eng, x, h)
    ring, red = launches.log[0][1], launches.log[1][1]
    assert ring[P.DESC_SEND_PARTS] == x.data.ptr and ring[P.DESC_SEND_PARTS + 1] == (h.hidden + 8) * 4
    assert red["self_rows"] == x.data.ptr and red["self_stride"] == h.hidden + 8


def test_handles_and_tags_not_mixed(stub):
    """Two handles of the same shapes: each call carries its own handle's tag (dispatch id) and tables."""
    eng, launches, stream = stub
    h1 = S.handle(eng, num_tokens=16, hidden=64, num_topk=2, dispatch_id=11)
    h2 = S.handle(eng, num_tokens=16, hidden=64, num_topk=2, dispatch_id=12)
    x = cupy.empty((h1.num_recv_tokens, 64), np.float32)
    xs = cupy.empty((16, 64), np.float32)
    for rep in range(2):
        for h in (h1, h2):
            launches.clear()
            normal.combine(eng, x, h)
            normal.dispatch(eng, xs, handle=h)
            (c_ring, red, d_ring) = [e[1] for e in launches.log]
            plan = eng.device_plan("combine", "float32|hidden=64|weights=False", [x], False)
            assert c_ring[P.DESC_SIG] == P.call_signature(plan.sig, h.dispatch_id)
            assert c_ring[P.DESC_COUNTS] == h.routing.rev_table_ptr and d_ring[P.DESC_COUNTS] == h.routing.table_ptr
            assert red["table"] == h.routing.table_ptr and red["pos"] == h.routing.pos.data.ptr
            assert d_ring[P.DESC_SEND_INDEX] == h.send_token_idx.data.ptr


def test_records_bounded(stub):
    eng, launches, stream = stub
    h = S.handle(eng, num_tokens=8, hidden=32, num_topk=2)
    for pad in range(40):
        x = cupy.empty((h.num_recv_tokens, 32 + pad), np.float32)[:, :32]
        normal.combine(eng, x, h)
    assert 0 < len(h.__dict__["_records"]) <= normal_cuda._RECORDS_MAX


def test_shape_or_device_off_the_record_checked_in_full(stub):
    """After a record exists: x with one row too many (same dtype and strides: the record's key), x on another GPU,
    raw bfloat16 bits without dtype= and a dtype= that differs from x's (records exist for the other choice) raise
    the full check's errors, and the peers are told (a rejected call's ring launch)."""
    eng, launches, stream = stub
    h = S.handle(eng, num_tokens=8, hidden=32, num_topk=2)
    x = cupy.empty((h.num_recv_tokens, 32), np.float32)
    raw = cupy.empty((h.num_recv_tokens, 32), np.uint16)
    normal.combine(eng, x, h)
    normal.combine(eng, raw, h, dtype="bfloat16")
    normal.dispatch(eng, cupy.empty((8, 32), np.float32), handle=h)
    bad_rows = cupy.empty((h.num_recv_tokens + 1, 32), np.float32)
    other_gpu = cupy.ndarray(x.shape, x.dtype, memptr=cupy.cuda.MemoryPointer(
        cupy.cuda.UnownedMemory(1 << 41, x.nbytes, None, 1), 0))
    cases = [(lambda: normal.combine(eng, bad_rows, h), ValueError, r"combine: argument 'x' .*num_recv_tokens"),
             (lambda: normal.combine(eng, other_gpu, h), TypeError, r"combine: argument 'x' lives on GPU 1"),
             (lambda: normal.combine(eng, raw, h), TypeError, r"combine: argument 'x' must be bfloat16, float16 or "
              r"float32 \(for raw bfloat16 bits pass dtype='bfloat16'\)"),
             (lambda: normal.combine(eng, x, h, dtype=np.float16), TypeError, r"combine: argument 'dtype' must match"),
             (lambda: normal.dispatch(eng, cupy.empty((9, 32), np.float32), handle=h), ValueError,
              r"dispatch: argument 'x' .*num_tokens"),
             (lambda: normal.dispatch(eng, cupy.ndarray((8, 32), np.float32, memptr=other_gpu.data), handle=h),
              TypeError, r"dispatch: argument 'x' lives on GPU 1")]
    for fn, exc, pattern in cases:
        launches.clear()
        with pytest.raises(exc, match=pattern):
            fn()
        told = [e for e in launches.log if e[0] == "ring"]
        assert len(told) == 1 and told[0][1][P.DESC_FLAGS] & P.FLAG_REJECT, "the peers must be told"
    launches.clear()
    normal.combine(eng, x, h)  # still usable, from the record
    assert [e[0] for e in launches.log] == ["ring", "symbuf_combine_reduce_f32"]


def test_launchers_are_per_communicator():
    """The MoE kernels' argument structs (layout, fix-up, reduction) belong to one communicator: two threads with
    two communicators on one GPU never fill the same struct (one thread's fields launched by the other)."""
    from cupy_symbuf.moe import gpu as _gpu
    with S.stubbed() as (launches, stream):
        e1, e2 = S.engine(launches), S.engine(launches)
        for name in (_gpu.LAYOUT_KERNEL, _gpu.FIXUP_KERNEL):
            assert _gpu._launcher(e1, name) is _gpu._launcher(e1, name)
            assert _gpu._launcher(e1, name).args is not _gpu._launcher(e2, name).args
        k = "symbuf_combine_reduce_bf16"
        assert _gpu.reduce_launcher(e1, k).args is not _gpu.reduce_launcher(e2, k).args


def test_capture_keeps_what_replays_read(stub):
    """While the stream is being captured: a combine keeps the caller's x and weights and the received rows'
    allocation (every replay reads them), a cached dispatch keeps x and recv_x; an eager dispatch is refused before
    its first communication step (every rank alike: nothing told; its local layout kernel may be queued), a
    worst-case one is not."""
    eng, launches, stream = stub
    h = S.handle(eng, num_tokens=16, hidden=64, num_topk=2)
    x = cupy.empty((h.num_recv_tokens, 64), np.float32)
    w = cupy.empty((h.num_recv_tokens, 2), np.float32)
    xs = cupy.empty((16, 64), np.float32)
    idx = cupy.empty((16, 2), np.int64)
    normal.combine(eng, x, h, w)  # a record made outside the capture serves inside it
    stream.capturing = True
    try:
        eng.graph_keep.clear()
        launches.clear()
        normal.combine(eng, x, h, w)
        kept = [id(o) for o in eng.graph_keep]
        assert id(x) in kept and id(w) in kept, "the combine's inputs must be kept for the replays"
        back = launches.log[1][1]["back"]
        assert any(isinstance(o, cupy.cuda.MemoryPointer) and o.ptr == back for o in eng.graph_keep)
        eng.graph_keep.clear()
        recv_x = normal.dispatch(eng, xs, handle=h)[0]
        kept = [id(o) for o in eng.graph_keep]
        assert id(xs) in kept and id(recv_x) in kept
        launches.clear()
        with pytest.raises(RuntimeError, match=r"dispatch: this call reads its receive counts on the host"):
            normal.dispatch(eng, xs, idx, None, h.num_experts)
        assert not [e for e in launches.log if e[0] in ("ring", "symbuf_notify", "symbuf_moe_layout_notify")], \
            "a refused capture must take no communication step (every rank refuses alike)"
        launches.clear()
        normal.dispatch(eng, xs, idx, None, h.num_experts, num_worst_tokens=16 * eng.world_size)
        assert [e[0] for e in launches.log] == ["symbuf_moe_layout", "symbuf_notify", "ring", "symbuf_moe_recv_fixup"]
    finally:
        stream.capturing = False


def _over(ptr: int, shape, dtype, strides=None):
    """A CuPy array over the made-up address ``ptr`` (never dereferenced)."""
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    mem = cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(ptr, 1 << 24, None, 0), 0)
    return cupy.ndarray(shape, dtype, memptr=mem, strides=strides) if n else cupy.ndarray(shape, dtype)


@pytest.mark.parametrize("where", ["right_after_x", "inside_last_row", "before_reversed_x", "under_reversed_x"])
def test_out_overlap_uses_the_bytes_strided_x_spans(stub, where):
    """check_out on the GPU path: an ``out`` that starts right after a row-strided x's last element is accepted (the
    old bound, first row + (rows - 1) * stride + x.nbytes, reached rows - 1 rows too far: a combine with ``out=``
    then failed with a false 'overlaps an input' whenever the pool placed out there, seen on the device); one that
    overlaps x's last row is refused, and so is one overlapping a reversed view below its first element."""
    from cupy_symbuf.common.checks import check_out
    base, n, h, pad = 1 << 40, 6, 16, 8
    row = (h + pad) * 4
    x = _over(base, (n, h), np.float32, strides=(row, 4))
    if where.endswith("reversed_x"):  # rows in reverse: x.data.ptr is its last row, the highest address
        x = _over(base + (n - 1) * row, (n, h), np.float32, strides=(-row, 4))
    end = base + (n - 1) * row + h * 4  # one past x's last element
    at = {"right_after_x": end, "inside_last_row": end - 4, "before_reversed_x": base - 3 * h * 4,
          "under_reversed_x": base + row}[where]
    out = _over(at, (3, h), np.float32)
    if where in ("right_after_x", "before_reversed_x"):
        assert check_out("combine", out, "cuda", (3, h), np.float32, inputs=(x,)) is out
    else:
        with pytest.raises(ValueError, match="'out' overlaps an input"):
            check_out("combine", out, "cuda", (3, h), np.float32, inputs=(x,))


# ------------------------------------------------------------------------------------------ eager dispatch records

_PTR_FIELDS = {"idx", "in_rank", "meta", "bad", "pos", "send_idx", "send_meta", "local_reject", "sums", "table",
               "gidx", "w", "counts_out", "per_rank", "per_expert"}
_RING_PTRS = {P.DESC_SEND_INDEX, P.DESC_COUNTS} | {P.DESC_SEND_PARTS + 4 * i for i in range(P.MAX_PARTS)} | \
    {P.DESC_RECV_PARTS + 4 * i for i in range(P.MAX_PARTS)}


def _canon_eager(log, callers: dict):
    """An eager dispatch's launches with its addresses as ``callers``' names (the caller's arrays), offsets in the
    call's routing block (from the ring's counts table) or in its receive arrays (from the ring's first receive
    part), else "new" (a copy made by the call); the launch number and notify ticket left out."""
    ring = [a for k, a, *_ in log if k == "ring"]
    rt_base = ring[0][P.DESC_COUNTS] if ring else 0
    out_base = ring[0][P.DESC_RECV_PARTS] if ring else 0

    def name(v):
        for n, p in callers.items():
            if v == p:
                return n
        if not v:
            return 0
        if 0 <= v - rt_base < 1 << 20:
            return ("rt", v - rt_base)
        if 0 <= v - out_base < 1 << 20:
            return ("out", v - out_base)
        return "new"
    got = []
    for kind, args, grid, block, stream_ptr in log:
        if kind == "ring":
            args = tuple(name(v) if i in _RING_PTRS else v for i, v in enumerate(args) if i != P.DESC_SEQ)
        else:
            args = {k: (name(v) if k in _PTR_FIELDS else v) for k, v in args.items() if k not in ("seq", "ticket")}
        got.append((kind, args, grid, block, stream_ptr))
    return got


def _eager_keys(eng):
    return [k for k in eng.call_memo if k[0] == "dispatch"]


def test_eager_records_follow_the_call_shape(stub):
    """Eager dispatches alternating x's dtype and strides, topk_idx's strides (copied to C order), weights or none (strided too), num_experts, expert_alignment and num_worst_tokens: a call from its
    record launches, word for word, what the same call checked in full (its record dropped first) launches; one
    record per call shape."""
    eng, launches, stream = stub
    n, hidden, k = 24, 64, 4
    xs = {"f32": cupy.empty((n, hidden), np.float32), "f16": cupy.empty((n, hidden), np.float16),
          "raw bf16": cupy.empty((n, hidden), np.uint16),
          "rows strided": cupy.empty((n, hidden + 8), np.float32)[:, :hidden],
          "elements strided": cupy.empty((n, 2 * hidden), np.float32)[:, ::2]}
    # (int32 topk_idx is cast by a CuPy kernel, which the stub cannot run: tests/test_moe_device.py has it)
    idxs = {"i64": cupy.empty((n, k), np.int64), "F order": cupy.empty((k, n), np.int64).T,
            "rows strided": cupy.empty((n, k + 3), np.int64)[:, :k]}
    ws = {"none": None, "w": cupy.empty((n, k), np.float32), "w strided": cupy.empty((n, 2 * k), np.float32)[:, ::2]}
    cases = []
    for i in range(len(xs) * len(idxs) * len(ws)):
        cases.append((list(xs)[i % len(xs)], list(idxs)[(i // len(xs)) % len(idxs)],
                      list(ws)[(i // (len(xs) * len(idxs))) % len(ws)], (64, 128)[i % 2], (1, 4)[(i // 3) % 2],
                      (0, 0, n * eng.world_size)[i % 3]))

    def run(case):
        xn, idn, wn, n_exp, align, worst = case
        x, idx, w = xs[xn], idxs[idn], ws[wn]
        launches.clear()
        res = normal.dispatch(eng, x, idx, w, n_exp, expert_alignment=align, num_worst_tokens=worst)
        callers = {"x": x.data.ptr, "idx": idx.data.ptr}
        if w is not None:
            callers["w"] = w.data.ptr
        return _canon_eager(launches.log, callers), res

    for rep in range(3):  # rep 0 makes the records, 1 and 2 run from them
        for case in cases:
            warm, res = run(case)
            log = list(launches.log)
            worst = case[5]
            # eager: the layout and the count exchange in one launch; worst case: two
            assert [e[0] for e in log] == (["symbuf_moe_layout", "symbuf_notify"] if worst else
                                           ["symbuf_moe_layout_notify"]) + ["ring", "symbuf_moe_recv_fixup"], case
            with pytest.MonkeyPatch.context() as mp:  # no record at all: checked in full, the arrays handed over
                mp.setattr(normal, "eager_key", lambda *args: None)
                cold, res_cold = run(case)
            assert warm == cold, f"{case}: launches from the record differ from a fresh call's"
            for a, b in zip(res[:3], res_cold[:3]):
                assert (a is None) == (b is None) and (a is None or (a.shape, a.dtype, a.strides) ==
                                                       (b.shape, b.dtype, b.strides)), case
            h = res[4]
            assert (h.num_experts, h.expert_alignment, h.num_worst_tokens, h.num_tokens, h.num_topk, h.hidden) == \
                (case[3], case[4], case[5], n, k, hidden)
            hc = res_cold[4]  # the same fields as the handle of the call checked in full (the per-call arrays aside)
            assert vars(h).keys() == vars(hc).keys(), case
            for f, v in vars(hc).items():
                mine = vars(h)[f]
                assert not isinstance(v, tuple) or len(mine) == len(v), (case, f)
                for a, b in zip(mine, v) if isinstance(v, tuple) else [(mine, v)]:
                    if isinstance(b, np.ndarray):
                        assert np.array_equal(a, b) and not a.flags.writeable, (case, f)
                    elif isinstance(b, (int, str, type(None))) and f != "dispatch_id":
                        assert a == b, (case, f)
            assert h._comm_ref() is hc._comm_ref() is eng and h.dispatch_id == hc.dispatch_id - 1
            # the layout and fix-up fields by name (their order in the packed struct included)
            lay, fix = log[0][1], log[-1][1]
            rt, W, epr = h.routing, eng.world_size, case[3] // eng.world_size
            idx_ptr = idxs[case[1]].data.ptr
            assert (lay["num_tokens"], lay["num_topk"], lay["num_experts"], lay["world_size"]) == (n, k, case[3], W)
            if worst:
                assert (lay["in_rank"], lay["meta"], lay["bad"], lay["pos"], lay["send_idx"]) == \
                    (h.is_token_in_rank.data.ptr, rt.meta_ptr, rt.bad_ptr, rt.pos.data.ptr, rt.send_idx.data.ptr)
                assert lay["per_rank"] == lay["per_expert"] == lay["bad_sticky"] == 0
            else:  # the layout writes the values the count exchange sends, and its bad count rejects the call
                assert (lay["in_rank"], lay["send_meta"], lay["local_reject"], lay["pos"], lay["send_idx"]) == \
                    (h.is_token_in_rank.data.ptr, rt.meta_ptr, rt.bad_ptr, rt.pos.data.ptr, rt.send_idx.data.ptr)
                assert (lay["sums"], lay["table"], lay["num_values"]) == (rt.sums_ptr, rt.table_ptr, 1 + epr)
                assert lay["device_checks"] == 0 and lay["capacity"] == -1 and lay["call_status"] == P.HDR_OK
                assert log[0][3] >= max(32 * W, min(1024, (n + 31) // 32 * 32), 1 + epr) and log[0][2] == 1
            assert (lay["idx"] == idx_ptr) == (case[1] == "i64") and lay["idx"]
            assert (fix["gidx"], fix["w"]) == (res[1].data.ptr, 0 if res[2] is None else res[2].data.ptr)
            assert (fix["rows"], fix["num_topk"], fix["first_expert"], fix["epr"], fix["align"]) == \
                (res[1].shape[0], k, eng.rank * epr, epr, case[4])
            assert fix["table"] == (rt.table_ptr if case[5] else 0) and fix["sums"] == rt.sums_ptr
            assert fix["counts_out"] == (res[3].data.ptr if case[5] else 0)
    assert len(_eager_keys(eng)) == len({c for c in cases}), "one record per call shape"


def test_eager_record_missed_when_the_call_differs(stub):
    """After an eager dispatch made its record: the same call with another dtype, shape, GPU or argument type is
    checked in full, its errors raised and told to the peers (a rejected count exchange), and the record still
    serves the first shape after it."""
    eng, launches, stream = stub
    n, hidden, k = 16, 32, 2
    x = cupy.empty((n, hidden), np.float32)
    idx = cupy.empty((n, k), np.int64)
    w = cupy.empty((n, k), np.float32)
    normal.dispatch(eng, x, idx, w, 64)
    assert len(_eager_keys(eng)) == 1
    other_gpu = cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(1 << 41, 1 << 20, None, 1), 0)
    # each differs from the recorded call in one thing only (same strides where the dtype or the rows differ)
    cases = [
        (lambda: normal.dispatch(eng, cupy.empty((n, hidden), np.int32), idx, w, 64), TypeError,
         r"dispatch: argument 'x' must be bfloat16"),
        (lambda: normal.dispatch(eng, x, cupy.empty((n, k), np.float64), w, 64), TypeError,
         r"dispatch: argument 'topk_idx' must be int64 or int32"),
        (lambda: normal.dispatch(eng, x, idx, cupy.empty((n, k), np.int32), 64), TypeError,
         r"dispatch: argument 'topk_weights' must be float32"),
        (lambda: normal.dispatch(eng, cupy.empty((n + 1, hidden), np.float32), idx, w, 64), ValueError,
         r"dispatch: argument 'topk_idx' .*num_tokens"),
        (lambda: normal.dispatch(eng, x, cupy.empty((n + 1, k), np.int64), w, 64), ValueError,
         r"dispatch: argument 'topk_idx' .*num_tokens"),
        (lambda: normal.dispatch(eng, x, idx, cupy.empty((n + 1, k), np.float32), 64), ValueError,
         r"dispatch: argument 'topk_weights' .*num_tokens"),
        (lambda: normal.dispatch(eng, x, idx, cupy.empty((n, 2 * k), np.float32)[:, :k + 1], 64), ValueError,
         r"dispatch: argument 'topk_weights' .*num_topk"),
        (lambda: normal.dispatch(eng, x, idx, w, 63), ValueError, r"dispatch: argument 'num_experts' must be a multiple"),
        (lambda: normal.dispatch(eng, x, idx, w, True), TypeError, r"dispatch: argument 'num_experts' must be an int"),
        (lambda: normal.dispatch(eng, x, idx, w, 64, expert_alignment=0), ValueError,
         r"dispatch: argument 'expert_alignment' must be in"),
        (lambda: normal.dispatch(eng, x, idx, w, 64, num_worst_tokens=-1), ValueError,
         r"dispatch: argument 'num_worst_tokens' must be >= 0"),
        (lambda: normal.dispatch(eng, cupy.ndarray((n, hidden), np.float32, memptr=other_gpu), idx, w, 64),
         TypeError, r"dispatch: argument 'x' lives on GPU 1"),
        (lambda: normal.dispatch(eng, x, cupy.ndarray((n, k), np.int64, memptr=other_gpu), w, 64), TypeError,
         r"dispatch: argument 'topk_idx' lives on GPU 1"),
        (lambda: normal.dispatch(eng, x, idx, cupy.ndarray((n, k), np.float32, memptr=other_gpu), 64), TypeError,
         r"dispatch: argument 'topk_weights' lives on GPU 1"),
        (lambda: normal.dispatch(eng, np.empty((n, hidden), np.float32), idx, w, 64), TypeError,
         r"dispatch: argument 'x' must be a CuPy array"),
    ]
    for fn, exc, pattern in cases:
        launches.clear()
        with pytest.raises(exc, match=pattern):
            fn()
        told = [e for e in launches.log if e[0] == "symbuf_notify"]
        assert len(told) == 1 and told[0][1]["call_status"] == P.HDR_REJECTED, f"{pattern}: the peers must be told"
        assert not [e for e in launches.log if e[0] == "ring"]
    launches.clear()
    normal.dispatch(eng, x, idx, w, 64)  # still usable, from the record
    assert [e[0] for e in launches.log] == ["symbuf_moe_layout_notify", "ring", "symbuf_moe_recv_fixup"]
    # a bool, a NumPy integer, out= and a handle are never looked up (checked in full every call)
    assert normal_cuda.eager_key(cupy, x, idx, w, np.int64(64), 1, 0) is None
    assert normal_cuda.eager_key(cupy, x, idx, w, 64, True, 0) is None
    assert normal_cuda.eager_key(cupy, (x, w), idx, w, 64, 1, 0) is None


def test_new_handle_equals_the_dataclass():
    from dataclasses import fields
    from cupy_symbuf.moe.normal_handle import DispatchHandle, new_handle
    kw = {f.name: object() for f in fields(DispatchHandle)}
    for drop in (None, "recv_src_idx", "dispatch_id"):  # defaults filled in
        got = dict(kw) if drop is None else {k: v for k, v in kw.items() if k != drop}
        a, b = new_handle(**got), DispatchHandle(**got)
        assert type(a) is DispatchHandle and vars(a) == vars(b)
    with pytest.raises(TypeError, match="new_handle: the fields"):
        new_handle(**{k: v for k, v in kw.items() if k != "rank"})
    with pytest.raises(TypeError, match="new_handle: the fields"):
        new_handle(**kw, extra=1)


def test_handle_from_fixed_fields_equals_the_dataclass():
    """handle_from (a repeated eager dispatch's handle: the fields its record fixes, then the call's) equals the
    dataclass built from all of them; a missing field or a name that is not one is a TypeError."""
    from dataclasses import fields
    from cupy_symbuf.moe.normal_handle import DispatchHandle, handle_fields, handle_from
    kw = {f.name: object() for f in fields(DispatchHandle)}
    names = list(kw)
    for cut in (0, 5, len(names) - 2, len(names)):
        fixed = handle_fields(**{k: kw[k] for k in names[:cut]})
        a = handle_from(fixed, **{k: kw[k] for k in names[cut:]})
        assert type(a) is DispatchHandle and vars(a) == vars(DispatchHandle(**kw))
        assert fixed == handle_fields(**{k: kw[k] for k in names[:cut]})  # (not changed by the handle)
    b = handle_from(handle_fields(**kw), _recv_total=1)  # a private cache beside the fields
    assert vars(b) == dict(vars(DispatchHandle(**kw)), _recv_total=1)
    with pytest.raises(TypeError, match="handle_fields: not fields"):
        handle_fields(extra=1)
    with pytest.raises(TypeError, match="handle_from: fields of DispatchHandle missing: .'rank'."):
        handle_from(handle_fields(**{k: v for k, v in kw.items() if k != "rank"}), _recv_total=1)


def test_eager_record_of_a_neighbouring_shape_not_used(stub):
    """Pairs of valid eager dispatches differing in one thing only (x's dtype at the same strides, x's or topk_idx's
    strides at the same shape, weights or none, num_experts, expert_alignment, num_worst_tokens): the second call,
    made right after the first made its record, launches what it launches checked in full."""
    eng, launches, stream = stub
    n, hidden, k = 16, 64, 4
    x16, raw = cupy.empty((n, hidden), np.float16), cupy.empty((n, hidden), np.uint16)
    x, x_rows = cupy.empty((n, hidden), np.float32), cupy.empty((n, hidden + 4), np.float32)[:, :hidden]
    idx, idx_f = cupy.empty((n, k), np.int64), cupy.empty((k, n), np.int64).T
    w = cupy.empty((n, k), np.float32)
    W = eng.world_size
    pairs = [((x16, idx, w, 64), (raw, idx, w, 64)), ((x, idx, w, 64), (x_rows, idx, w, 64)),
             ((x, idx, w, 64), (x, idx_f, w, 64)), ((x, idx, None, 64), (x, idx, w, 64)),
             ((x, idx, w, 64), (x, idx, None, 64)), ((x, idx, w, 64), (x, idx, w, 128)),
             ((x, idx, w, 64, 1), (x, idx, w, 64, 4)), ((x, idx, w, 64, 1, 0), (x, idx, w, 64, 1, n * W)),
             ((x, idx, w, 64, 1, n * W), (x, idx, w, 64, 1, 2 * n * W))]

    def run(args):
        xa, ia, wa, n_exp, *rest = args
        align, worst = (rest + [1, 0])[:2] if len(rest) < 2 else rest
        launches.clear()
        normal.dispatch(eng, xa, ia, wa, n_exp, expert_alignment=align, num_worst_tokens=worst)
        callers = {"x": xa.data.ptr, "idx": ia.data.ptr}
        if wa is not None:
            callers["w"] = wa.data.ptr
        return _canon_eager(launches.log, callers)

    for first, second in pairs:
        eng.call_memo.clear()
        run(first)
        after = run(second)
        eng.call_memo.clear()
        assert after == run(second), f"{second[3:]}: a record of {first[3:]} was used"


def test_prepared_launch_writes_what_exchange_rows_writes(stub):
    """CudaTransport.launch_prepared (the parts by address, a repeated call's launch) against exchange_rows of the
    same arrays: the same descriptor words, launch number aside, for a combine-like call (two parts, no index, a
    row-strided part), a cached-dispatch-like one (one part, an index) and an eager-like one (three parts, an
    index), with another call's addresses and tag left in the descriptor in between."""
    eng, launches, stream = stub
    table = 1 << 44

    def arrays(m, widths, pad=0):
        return [cupy.empty((m, w + pad), dt)[:, :w] for w, dt in widths]

    def ptrs(parts):
        return [a.data.ptr for a in parts]
    calls = [("combine", "f32|combine-like", [(64, np.float32), (4, np.float32)], 8, 30, 30, None, 7),
             ("dispatch", "f16|cached-like", [(128, np.float16)], 0, 20, 26, 33, 9),
             ("dispatch", "f32|eager-like", [(32, np.float32), (5, np.int64), (5, np.float32)], 0, 20, 24, 40, 0)]
    for op, sig, widths, pad, n_send, n_recv, n_index, tag in calls:
        send, recv = arrays(n_send, widths, pad), arrays(n_recv, widths)
        other_send, other_recv = arrays(n_send, widths, pad), arrays(n_recv, widths)
        index = None if n_index is None else cupy.empty(n_index, np.int64)
        other_index = None if n_index is None else cupy.empty(n_index, np.int64)
        prepared = eng.prepare_rows_device(op, sig, send, recv, index is not None)
        launches.clear()
        eng.exchange_rows_device(op, send, index, recv, sig, table, tag=tag, plan=prepared[0], stream=stream)
        eng.launch_rows_device(op, prepared, ptrs(other_send), ptrs(other_recv),
                               None if index is None else other_index.data.ptr, table + 64, tag=tag + 1,
                               stream=stream)
        eng.launch_rows_device(op, prepared, ptrs(send), ptrs(recv), None if index is None else index.data.ptr,
                               table, tag=tag, stream=stream)
        full, other, got = [e[1] for e in launches.log]
        assert [v for i, v in enumerate(got) if i != P.DESC_SEQ] == \
            [v for i, v in enumerate(full) if i != P.DESC_SEQ], f"{sig}: launch_prepared differs from exchange_rows"
        assert other != full and got[P.DESC_SEQ] == full[P.DESC_SEQ] + 2


def test_layout_memo_follows_the_call_shape(stub):
    """get_dispatch_layout remembers its checks per (topk_idx dtype, shape, strides, num_experts): a repeated call
    launches what the call checked in full launches; a call differing in one of them alone is checked in full (a
    dtype at the same strides, rows or columns at the same strides, num_experts, a bool for it, another GPU). (The
    strides and the plain-int rule are in the key for caution: what the memo keeps, the cast to int64, follows
    from the dtype alone.)"""
    eng, launches, stream = stub
    n, k = 32, 4
    idx, idx_more = cupy.empty((n, k), np.int64), cupy.empty((n + 8, k), np.int64)
    idx_f = cupy.empty((k, n), np.int64).T

    def run(a, n_exp, memo=True):
        launches.clear()
        with pytest.MonkeyPatch.context() as mp:
            if not memo:
                mp.setattr(normal, "layout_key", lambda *args: None)
            per_rank, per_expert, in_rank = normal.get_dispatch_layout(eng, a, n_exp)
        (kind, args, grid, block, _), = launches.log
        assert kind == "symbuf_moe_layout" and (args["per_rank"], args["per_expert"], args["in_rank"]) == \
            (per_rank.data.ptr, per_expert.data.ptr, in_rank.data.ptr)
        assert in_rank.shape == (a.shape[0], eng.world_size) and per_expert.shape == (n_exp,)
        args = {f: v for f, v in args.items() if f not in ("per_rank", "per_expert", "in_rank")}
        args["idx"] = args["idx"] == a.data.ptr
        return args, grid, block

    for first, second in [((idx, 64), (idx, 64)), ((idx, 64), (idx_more, 64)), ((idx, 64), (idx, 128)),
                          ((idx, 64), (idx_f, 64))]:
        eng.call_memo.clear()
        run(*first)
        got = run(*second)
        assert got == run(*second, memo=False), f"{second}: the memo of {first} was used"
        assert got[0]["num_tokens"] == second[0].shape[0] and got[0]["num_experts"] == second[1]
    other_gpu = cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(1 << 41, 1 << 20, None, 1), 0)
    one = cupy.empty((n, 1), np.int64)
    run(one, 64)  # a memo for [n, 1]; its view [n, 0] has the same strides and no column
    for bad, exc, pattern in [(lambda: normal.get_dispatch_layout(eng, one[:, :0], 64), ValueError,
                               r"argument 'topk_idx' must have num_topk >= 1"),
                              (lambda: normal.get_dispatch_layout(eng, cupy.empty((n, k), np.float64), 64), TypeError,
                               r"get_dispatch_layout: argument 'topk_idx' must be int64 or int32"),
                              (lambda: normal.get_dispatch_layout(eng, idx, True), TypeError,
                               r"argument 'num_experts' must be an int"),
                              (lambda: normal.get_dispatch_layout(eng, idx, 63), ValueError,
                               r"argument 'num_experts' must be a multiple"),
                              (lambda: normal.get_dispatch_layout(eng, cupy.ndarray((n, k), np.int64,
                                                                                    memptr=other_gpu), 64),
                               TypeError, r"argument 'topk_idx' lives on GPU 1")]:
        with pytest.raises(exc, match=pattern):
            bad()
    assert run(idx, 64)[0]["idx"], "still from the memo, reading topk_idx itself"


@pytest.mark.parametrize("n,W,M", [(1, 2, 3), (128, 2, 129), (4096, 8, 33), (0, 4, 2)])
def test_routing_parts_where_the_block_says(stub, n, W, M):
    """Routing's addresses (the hot path's) against its arrays (made when asked): the counts tables, the sums, the
    bad-value words and the count exchange's values in the block; pos, send_idx and in_rank after it, disjoint."""
    from cupy_symbuf.moe import gpu as _gpu
    CT = P.CT_WORDS
    rt = _gpu.Routing(n, 2, W, M)
    base = rt.block.data.ptr
    assert rt.block.shape == (2 * CT + M + 2 + W * M,) and rt.table_ptr == base
    assert (rt.rev_table_ptr, rt.sums_ptr, rt.bad_ptr, rt.meta_ptr) == \
        (base + 8 * CT, base + 16 * CT, base + 8 * (2 * CT + M), base + 8 * (2 * CT + M + 2))
    assert rt.table.data.ptr == base and rt.sums.data.ptr == rt.sums_ptr and rt.bad.data.ptr == rt.bad_ptr
    assert rt.pos.shape == (n, W) and rt.pos.data.ptr == rt.pos_ptr and rt.send_idx.data.ptr == rt.send_idx_ptr
    assert rt.send_idx.shape == (max(1, n * W),) and rt.in_rank.shape == (n, W) and rt.in_rank.dtype == bool
    assert rt.send_rows_idx(n * W // 2).data.ptr == rt.send_idx_ptr
    spans = sorted([(base, rt.block.nbytes), (rt.pos_ptr, 8 * n * W), (rt.send_idx_ptr, 8 * max(1, n * W)),
                    (rt.in_rank.data.ptr, n * W)])
    assert all(p + size <= q for (p, size), (q, _) in zip(spans, spans[1:])), spans


def test_eager_record_first_call_copies_each_strided_part_once(stub):
    """The call that makes an eager dispatch's record copies each part whose elements are not contiguous within a
    row once, as a call with no record does (finding which parts a repeated call copies makes no copy: under a
    CUDA graph capture a second copy would be a kernel every replay runs for nothing); a call from the record,
    once too."""
    eng, launches, stream = stub
    n, hidden, k = 16, 32, 4
    x = cupy.empty((n, 2 * hidden), np.float32)[:, ::2]
    idx = cupy.empty((n, k), np.int64)
    w = cupy.empty((n, 2 * k), np.float32)[:, ::2]
    copied = []
    real = cupy.ascontiguousarray

    def counting(a, dtype=None):
        copied.append(a.data.ptr)
        return real(a, dtype)

    def copies(memo: bool):
        copied.clear()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(cupy, "ascontiguousarray", counting)
            if not memo:
                mp.setattr(normal, "eager_key", lambda *args: None)
            normal.dispatch(eng, x, idx, w, 64)
        return sorted(p for p in copied if p in (x.data.ptr, w.data.ptr))

    want = sorted([x.data.ptr, w.data.ptr])
    assert copies(memo=False) == want  # no record: each strided part copied once
    assert copies(memo=True) == want, "the record's first call copies a strided part more than once"
    assert copies(memo=True) == want  # from the record


def test_record_first_calls_copy_each_strided_part_once(stub):
    """The calls that make a combine's and a cached dispatch's records copy each part whose elements are not
    contiguous within a row once (as the calls from the records do), and hand the copies to the launches."""
    eng, launches, stream = stub
    h = S.handle(eng, num_tokens=16, hidden=64, num_topk=4)
    x = cupy.empty((h.num_recv_tokens, 2 * h.hidden), np.float32)[:, ::2]
    w = cupy.empty((h.num_recv_tokens, 2 * h.num_topk), np.float32)[:, ::2]
    xs = cupy.empty((h.num_tokens, 2 * h.hidden), np.float32)[:, ::2]
    copied = []
    real = cupy.ascontiguousarray

    def counting(a, dtype=None):
        got = real(a, dtype)
        if got is not a:
            copied.append((a.data.ptr, got.data.ptr))
        return got

    for call, strided in (("combine", (x, w)), ("cached dispatch", (xs,))):
        for rep in range(2):  # the record's first call, then one from it
            copied.clear()
            launches.clear()
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(cupy, "ascontiguousarray", counting)
                if call == "combine":
                    normal.combine(eng, x, h, w)
                else:
                    normal.dispatch(eng, xs, handle=h)
            assert sorted(src for src, _ in copied) == sorted(a.data.ptr for a in strided), (call, rep, copied)
            ring = launches.log[0][1]
            sent = [ring[P.DESC_SEND_PARTS + 4 * i] for i in range(len(strided))]
            assert sent == [dst for _, dst in copied], (call, rep, "the launch sends another array than the copy")


@pytest.mark.parametrize("n, k, n_exp, weights, world_size", [(24, 4, 64, True, 2), (1500, 8, 256, False, 4),
                                                             (0, 2, 8, True, 2), (7, 1, 1024, True, 8)])
def test_eager_layout_and_count_exchange_in_one_launch(n, k, n_exp, weights, world_size):
    """An eager dispatch launches the layout and the count exchange as one kernel (symbuf_moe_layout_notify) whose
    fields are, field by field, the layout launch's (its values written where the count exchange reads them: meta =
    send_meta, bad = local_reject) and the eager count exchange's (symbuf_notify with the echo and the done word,
    the static fields copied from its launcher), on threads enough for both and with the layout's shared memory;
    the first call (checked in full) and the calls from its record launch the same. (Its dynamic shared memory,
    4 * num_experts bytes as the layout's, fits next to both bodies' static arrays: tests/test_kernels_compile.py.)"""
    from cupy_symbuf.moe import gpu as _gpu
    from cupy_symbuf.wire import kernel_args as _kargs
    with S.stubbed() as (launches, stream):
        eng = S.engine(launches, world_size=world_size, rank=world_size - 1)
        tr = eng.transport
        a = tr._l_notify.args  # static fields set as a constructed transport sets them (distinct values)
        for i, f in enumerate(("recv_meta", "epoch_word", "peer_bases", "abort_offset", "region_bytes",
                               "channel_bytes", "num_slots", "chunk_bytes", "notify_offset", "notify_slot_bytes",
                               "status")):
            setattr(a, f, 1000 + i)
        a.timeout_ns = 77
        x = cupy.empty((n, 32), np.float32)
        idx = cupy.empty((n, k), np.int64)
        w = cupy.empty((n, k), np.float32) if weights else None
        epr = n_exp // world_size
        for rep in range(3):  # the first call checked in full, then from its record
            launches.clear()
            res = normal.dispatch(eng, x, idx, w, n_exp)
            kinds = [e[0] for e in launches.log]
            assert kinds[:2] == ["symbuf_moe_layout_notify", "ring"], kinds
            fused, grid, block = launches.log[0][1], launches.log[0][2], launches.log[0][3]
            rt = res[4].routing
            # the two launches this one replaces, for the same routing
            launches.clear()
            _gpu.layout(eng, idx, n_exp, in_rank=rt.in_rank, meta=rt.meta_ptr, bad=rt.bad_ptr, pos=rt.pos_ptr,
                        send_idx=rt.send_idx_ptr)
            tr.notify_device(rt.meta_ptr, 1 + epr, "dispatch", op_code=fused["op"], status=P.HDR_OK,
                             sig=fused["sig"], local_reject=rt.bad_ptr, echo=True, sums=rt.sums_ptr,
                             table=rt.table_ptr)
            (_, lay, lgrid, lblock, _), (_, note, ngrid, nblock, _) = launches.log
            for f in _kargs.fields("NotifyArgs"):
                if f not in ("seq", "ticket"):
                    assert fused[f] == note[f], f
            assert fused["ticket"] == tr._ticket - 1 and fused["done"] == tr._notify_done.ptr
            assert (fused["send_meta"], fused["local_reject"]) == (lay["meta"], lay["bad"])
            for f in ("idx", "num_tokens", "num_topk", "num_experts", "world_size", "in_rank", "pos", "send_idx"):
                assert fused[f] == lay[f], f
            assert lay["per_rank"] == lay["per_expert"] == lay["bad_sticky"] == 0
            assert fused["recv_meta"] == 1000 and fused["status"] == 1010 and fused["timeout_ns"] == 77
            assert grid == lgrid == ngrid == 1 and block >= max(lblock, nblock) and block <= 1024
            assert fused["capacity"] == -1 and fused["device_checks"] == 0
