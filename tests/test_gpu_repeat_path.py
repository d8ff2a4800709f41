"""The fast path of repeated GPU calls, run here without a GPU (``tests/_gpu_stub.py``: CuPy arrays over made-up
addresses, launches recorded instead of made): a cached dispatch, a combine and a small ``alltoall`` of the call
shape run last go straight to a ring launch with a descriptor of their own, their outputs from a pool.

* Its launches equal, word for word, those of the same call on the full path (the fast record removed first), for
  calls of fresh random shapes, dtypes, strides, handles and streams; only the call's own allocations (pooled on the
  fast path, new on the full one) and the launch number differ, and those are checked against the returned arrays.
* A call that differs from the record in anything (shape, dtype, strides, the weights, the handle, ``dtype=``,
  ``out=``, ``expert_alignment``, ``sync``, a capturing stream, the GPU) takes the full path: the same checks and
  errors, told to the peers.
* An output is handed out again only once nothing holds it (the array, a view, its memory pointer) and on the
  stream it was made on; an allocation that fails on the fast path is a rejection told to the peers; a peer's
  rejection raises from the fast path as from the full one (``Config.blocking``).

Values are checked on a GPU by tests/test_moe_device.py and tests/test_alltoall.py (the lead's device runs).
"""
from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

import _gpu_stub as S  # noqa: E402  (tests/ is on sys.path under pytest)
from cupy_symbuf.collectives import alltoall as _a2a  # noqa: E402
from cupy_symbuf.common.errors import SymBufferRejectedError  # noqa: E402
from cupy_symbuf.moe import normal  # noqa: E402
from cupy_symbuf.moe import normal_cuda  # noqa: E402
from cupy_symbuf.wire import protocol as P  # noqa: E402

_RECV_WORDS = [P.DESC_RECV_PARTS + 4 * i for i in range(P.MAX_PARTS)]
_OUTS = ("back", "out", "w_back", "w_out")


@pytest.fixture
def stub():
    with S.stubbed() as (launches, stream):
        eng = S.engine(launches)
        fast = []
        full = eng.launch_repeat
        small = eng.run_small_repeat

        def launch_repeat(*a, **k):  # counted: which calls took the fast path
            fast.append("ring")
            return full(*a, **k)

        def run_small_repeat(*a, **k):
            fast.append("small")
            return small(*a, **k)
        eng.launch_repeat, eng.run_small_repeat = launch_repeat, run_small_repeat
        yield eng, launches, stream, fast


def _canon(log):
    """The launches without the call's own allocations and launch number (checked apart: :func:`_allocs`)."""
    out = []
    for kind, args, grid, block, stream_ptr in log:
        if kind == "ring":
            args = tuple(0 if i in _RECV_WORDS or i == P.DESC_SEQ else v for i, v in enumerate(args))
        elif kind == "symbuf_small_alltoall":
            args = {k: v for k, v in args.items() if k not in ("recv", "seq")}
        else:
            args = {k: (bool(v) if k in _OUTS else v) for k, v in args.items()}
        out.append((kind, args, grid, block, stream_ptr))
    return out


def _allocs(log) -> list:
    """The call's own allocations its launches name: the ring's receive parts, the reduction's rows and outputs."""
    got = []
    for kind, args, *_ in log:
        if kind == "ring":
            got += [args[w] for w in _RECV_WORDS if args[w]]
        elif kind == "symbuf_small_alltoall":
            got.append(args["recv"])
        else:
            got += [args[k] for k in _OUTS if args[k]]
    return got


def _drop_fast(eng, handles) -> list:
    kept = [(h, {k: h.__dict__.pop(k) for k in (normal_cuda.REPEAT_DISPATCH, normal_cuda.REPEAT_COMBINE)
                 if k in h.__dict__}) for h in handles]
    kept.append(eng.call_memo.pop(_a2a._REPEAT, None))
    return kept


def _restore(eng, kept) -> None:
    for h, d in kept[:-1]:
        h.__dict__.update(d)
    if kept[-1] is not None:
        eng.call_memo[_a2a._REPEAT] = kept[-1]


def _bf16():
    return cupy.dtype(cupy.bfloat16) if hasattr(cupy, "bfloat16") else np.dtype(np.float16)


def test_fast_launches_equal_the_full_path(stub):
    """Fresh random call shapes, each called until it runs fast, then a fast call and the same call on the full path
    (its fast record removed): the same launches but for the call's own allocations, which are the returned
    arrays' and never overlap each other."""
    eng, launches, stream, fast = stub
    rng = np.random.default_rng(2026)
    other = S.FakeStream(ptr=0x7000)
    for trial in range(24):
        W = eng.world_size
        hidden = int(rng.choice([64, 96, 256, 7168]))
        topk = int(rng.integers(1, 9))
        h = S.handle(eng, num_tokens=int(rng.integers(2, 64)), hidden=hidden, num_topk=topk,
                     num_experts=8 * W, dispatch_id=int(rng.integers(1, 1 << 30)))
        dt = [np.float32, np.float16, _bf16(), np.uint16][trial % 4]  # (uint16: raw bfloat16 bits, dtype= given)
        kw = {"dtype": "bfloat16"} if dt == np.uint16 else {}
        pad = int(rng.integers(0, 3)) * 8  # rows strided (elements contiguous): sent in place at their stride
        x = cupy.empty((h.num_recv_tokens, hidden + pad), dt)[:, :hidden]
        w = cupy.empty((h.num_recv_tokens, topk), np.float32) if trial % 2 else None
        xs = cupy.empty((h.num_tokens, hidden + pad), dt)[:, :hidden]
        a = cupy.empty((W, int(rng.integers(1, 4096))), [np.uint8, np.float32, np.int64][trial % 3])
        align = int(rng.integers(1, 4))
        st = other if trial % 4 == 3 else stream
        launches.use_stream(st)
        calls = [("combine", lambda: normal.combine(eng, x, h, w, **kw)),
                 ("dispatch", lambda: normal.dispatch(eng, xs, handle=h, expert_alignment=align)),
                 ("alltoall", lambda: _a2a.alltoall(eng, a))]
        for name, fn in calls:
            fn(), fn()  # the first call makes the record, the second its fast path
            before = len(fast)
            launches.clear()
            got = fn()
            assert len(fast) > before, f"{name}: a repeated call of one shape must take the fast path"
            log_fast = list(launches.log)
            kept = _drop_fast(eng, [h])
            launches.clear()
            want = fn()
            log_full = list(launches.log)
            _restore(eng, kept)
            assert _canon(log_fast) == _canon(log_full), f"{name} (trial {trial}): the fast path's launches differ"
            if name == "combine":
                assert log_fast[1][1]["out"] == got[0].data.ptr
                assert (log_fast[1][1]["w_out"] == got[1].data.ptr) if w is not None else got[1] is None
                assert [log_fast[0][1][i] for i in _RECV_WORDS if log_fast[0][1][i]] == \
                    [v for v in (log_fast[1][1]["back"], log_fast[1][1]["w_back"]) if v]
                assert got[0].shape == want[0].shape and got[0].dtype == want[0].dtype
            elif name == "dispatch":
                assert _allocs(log_fast) == [got[0].data.ptr]
                assert got[0].shape == want[0].shape and got[0].dtype == want[0].dtype and got[3] == want[3]
                assert got[4] is h and got[1] is got[2] is None
            else:
                assert _allocs(log_fast) == [got.data.ptr] and got.shape == a.shape and got.dtype == a.dtype
        launches.use_stream(stream)


def test_handles_keep_their_own_fast_path(stub):
    """Two handles of one shape, called in turn: each call carries its handle's dispatch id in the signature and its
    tables, as the full path writes them."""
    eng, launches, stream, fast = stub
    hs = [S.handle(eng, num_tokens=16, hidden=64, num_topk=2, dispatch_id=d) for d in (5, 6)]
    x = cupy.empty((hs[0].num_recv_tokens, 64), np.float32)
    xs = cupy.empty((16, 64), np.float32)
    for rep in range(3):
        for h in hs:
            launches.clear()
            normal.combine(eng, x, h)
            normal.dispatch(eng, xs, handle=h)
            c_ring, red, d_ring = [e[1] for e in launches.log]
            plan = eng.device_plan("combine", "float32|hidden=64|weights=False", [x], False)
            assert c_ring[P.DESC_SIG] == P.call_signature(plan.sig, h.dispatch_id)
            assert c_ring[P.DESC_COUNTS] == h.routing.rev_table_ptr and d_ring[P.DESC_COUNTS] == h.routing.table_ptr
            assert d_ring[P.DESC_SEND_INDEX] == h.send_token_idx.data.ptr and red["table"] == h.routing.table_ptr
    assert len(fast) == 2 * 2 * 2, "from the second round on, both calls of both handles run fast"


def test_a_call_that_differs_takes_the_full_path(stub):
    """After a fast record exists, a call differing in one thing runs the full path (no fast launch); calls that
    the full checks refuse raise their errors and the peers are told (a rejected call's ring launch)."""
    eng, launches, stream, fast = stub
    h = S.handle(eng, num_tokens=8, hidden=32, num_topk=2)
    h2 = S.handle(eng, num_tokens=8, hidden=32, num_topk=2, dispatch_id=9)
    n = h.num_recv_tokens
    x = cupy.empty((n, 32), np.float32)
    w = cupy.empty((n, 2), np.float32)
    xs = cupy.empty((8, 32), np.float32)
    a = cupy.empty((2, 64), np.float32)
    other_gpu = cupy.ndarray(x.shape, x.dtype, memptr=cupy.cuda.MemoryPointer(
        cupy.cuda.UnownedMemory(1 << 41, x.nbytes, None, 1), 0))
    base = [lambda: normal.combine(eng, x, h, w), lambda: normal.dispatch(eng, xs, handle=h),
            lambda: _a2a.alltoall(eng, a)]

    def prime():
        for fn in base:
            fn(), fn()
    ok = {  # accepted by the full checks: run full, and once repeated the new shape runs fast
        "combine, other x strides": lambda: normal.combine(eng, cupy.empty((n, 40), np.float32)[:, :32], h, w),
        "combine, x float16": lambda: normal.combine(eng, cupy.empty((n, 32), np.float16), h, w),
        "combine, no weights": lambda: normal.combine(eng, x, h),
        "combine, other handle": lambda: normal.combine(eng, x, h2, w),
        "combine, out=": lambda: normal.combine(eng, x, h, w, out=cupy.empty((8, 32), np.float32)),
        "combine, dtype=": lambda: normal.combine(eng, x, h, w, dtype="float32"),
        "combine, sync relaxed": lambda: normal.combine(eng, x, h, w, sync="relaxed"),
        "dispatch, other alignment": lambda: normal.dispatch(eng, xs, handle=h, expert_alignment=4),
        "dispatch, x float16": lambda: normal.dispatch(eng, cupy.empty((8, 32), np.float16), handle=h),
        "dispatch, other handle": lambda: normal.dispatch(eng, xs, handle=h2),
        "dispatch, num_experts given": lambda: normal.dispatch(eng, xs, handle=h, num_experts=h.num_experts),
        "alltoall, other shape": lambda: _a2a.alltoall(eng, cupy.empty((2, 65), np.float32)),
        "alltoall, other dtype": lambda: _a2a.alltoall(eng, cupy.empty((2, 64), np.int32)),
        "alltoall, out=": lambda: _a2a.alltoall(eng, a, out=cupy.empty((2, 64), np.float32)),
    }
    never_fast = {"combine, out=", "combine, sync relaxed", "dispatch, num_experts given"}
    at_once = {"alltoall, out="}  # (the caller's output of the record's shape and dtype: fast from the first call)
    for name, fn in ok.items():
        prime()
        before = len(fast)
        fn()
        assert (len(fast) == before) != (name in at_once), f"{name}: the first call's path"
        fn()
        assert (len(fast) == before) == (name in never_fast), f"{name}: the repeated call's path"
    bad = {
        "combine, one row more": (lambda: normal.combine(eng, cupy.empty((n + 1, 32), np.float32), h, w), ValueError,
                                  r"combine: argument 'x' .*num_recv_tokens"),
        "combine, x on GPU 1": (lambda: normal.combine(eng, other_gpu, h, w), TypeError,
                                r"combine: argument 'x' lives on GPU 1"),
        "combine, weights of 3": (lambda: normal.combine(eng, x, h, cupy.empty((n, 3), np.float32)), ValueError,
                                  r"combine: argument 'topk_weights'"),
        "combine, another communicator's handle": (lambda: normal.combine(S.engine(launches), x, h, w), ValueError,
                                                    r"combine: argument 'handle' must come from this communicator"),
        "dispatch, another communicator's handle": (lambda: normal.dispatch(S.engine(launches), xs, handle=h),
                                                     ValueError, r"dispatch: argument 'handle' must come from this"),
        "dispatch, bool alignment": (lambda: normal.dispatch(eng, xs, handle=h, expert_alignment=True), TypeError,
                                     r"dispatch: argument 'expert_alignment'"),
        "dispatch, one row more": (lambda: normal.dispatch(eng, cupy.empty((9, 32), np.float32), handle=h),
                                   ValueError, r"dispatch: argument 'x' .*num_tokens"),
        "alltoall, 3 blocks": (lambda: _a2a.alltoall(eng, cupy.empty((3, 64), np.float32)), ValueError,
                               r"alltoall: argument 'sendbuf' must have shape\[0\] == world_size"),
        "alltoall, sync": (lambda: _a2a.alltoall(eng, a, sync="weak"), ValueError, r"alltoall: argument 'sync'"),
        "alltoall, out= overlapping": (lambda: _a2a.alltoall(eng, a, out=_over(a.data.ptr + 4, a.shape, a.dtype)),
                                       ValueError, r"alltoall: argument 'out' overlaps an input"),
        "alltoall, out= strided": (lambda: _a2a.alltoall(eng, a, out=cupy.empty((2, 128), np.float32)[:, ::2]),
                                   ValueError, r"alltoall: argument 'out' must be C-contiguous"),
        "alltoall, out= of int32": (lambda: _a2a.alltoall(eng, a, out=cupy.empty((2, 64), np.int32)), TypeError,
                                    r"alltoall: argument 'out' must have dtype float32"),
        "alltoall, out= of another shape": (lambda: _a2a.alltoall(eng, a, out=cupy.empty((2, 65), np.float32)),
                                            ValueError, r"alltoall: argument 'out' must have shape"),
    }
    for name, (fn, exc, pattern) in bad.items():
        prime()
        before = len(fast)
        launches.clear()
        with pytest.raises(exc, match=pattern):
            fn()
        assert len(fast) == before, f"{name}: must take the full path"
        told = [e for e in launches.log if e[0] == "ring"]
        assert len(told) == 1 and told[0][1][P.DESC_FLAGS] & P.FLAG_REJECT, f"{name}: the peers must be told"
    prime()  # still usable, fast again
    before = len(fast)
    for fn in base:
        fn()
    assert len(fast) == before + 3


def _over(ptr: int, shape, dtype):
    """A CuPy array over the made-up address ``ptr`` (never dereferenced)."""
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return cupy.ndarray(shape, dtype, memptr=cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(ptr, n, None, 0), 0))


def test_alltoall_out_on_the_fast_path(stub):
    """A small alltoall with the caller's ``out=`` (a plain C-contiguous array of the shape and dtype, apart from the
    sendbuf) runs fast and writes into ``out``: the launch equal to the full path's word for word; out= just
    touching the sendbuf's end is apart (fast), one byte over is not (the full check's error, told)."""
    eng, launches, stream, fast = stub
    a = cupy.empty((2, 300), np.float32)
    outs = [cupy.empty((2, 300), np.float32) for _ in range(3)]
    for o in outs:
        _a2a.alltoall(eng, a, out=o)
    for o in outs + [_over(a.data.ptr + a.nbytes, a.shape, a.dtype), _over(a.data.ptr - a.nbytes, a.shape, a.dtype)]:
        before = len(fast)
        launches.clear()
        got = _a2a.alltoall(eng, a, out=o)
        assert got is o and len(fast) == before + 1
        log_fast = list(launches.log)
        kept = _drop_fast(eng, [])
        launches.clear()
        _a2a.alltoall(eng, a, out=o)
        _restore(eng, kept)
        assert [(k, {f: v for f, v in g.items() if f != "seq"}) for k, g, *_ in log_fast] == \
            [(k, {f: v for f, v in g.items() if f != "seq"}) for k, g, *_ in launches.log]
    before = len(fast)
    with pytest.raises(ValueError, match="overlaps an input"):
        _a2a.alltoall(eng, a, out=_over(a.data.ptr + a.nbytes - 1, a.shape, a.dtype))
    assert len(fast) == before


def test_capturing_stream_takes_the_full_path(stub):
    """A fast record made outside a CUDA graph capture is not used inside one: the full path keeps what replays read
    and allocates outputs of their own (never pooled ones, which later calls would hand out again)."""
    eng, launches, stream, fast = stub
    h = S.handle(eng, num_tokens=16, hidden=64, num_topk=2)
    x = cupy.empty((h.num_recv_tokens, 64), np.float32)
    xs = cupy.empty((16, 64), np.float32)
    for fn in (lambda: normal.combine(eng, x, h), lambda: normal.dispatch(eng, xs, handle=h)):
        fn(), fn()
        before = len(fast)
        stream.capturing = True
        try:
            eng.graph_keep.clear()
            fn()
            assert len(fast) == before and eng.graph_keep, "a capture must take the full path"
        finally:
            stream.capturing = False
        fn()
        assert len(fast) == before + 1


def test_outputs_handed_out_again_only_when_free(stub):
    """An output comes back from the pool only when nothing holds it or its memory any more, and on its own stream;
    two outputs alive at once never share memory."""
    eng, launches, stream, fast = stub
    a = cupy.empty((2, 256), np.float32)
    _a2a.alltoall(eng, a), _a2a.alltoall(eng, a)
    first = _a2a.alltoall(eng, a)
    ptr = first.data.ptr
    second = _a2a.alltoall(eng, a)  # `first` held: another one
    assert second.data.ptr != ptr
    del first, second
    holders = {"the array": lambda y: y, "a view": lambda y: y[1:], "its memory pointer": lambda y: y.data,
               "its allocation": lambda y: y.data.mem, "an array over its pointer":
               lambda y: cupy.ndarray(y.shape, y.dtype, memptr=y.data)}
    for name, hold in holders.items():
        y = _a2a.alltoall(eng, a)
        held = hold(y)
        del y
        live = [_a2a.alltoall(eng, a) for _ in range(3)]
        spans = sorted([(held_ptr, 2 * 256 * 4) for held_ptr in [_ptr(held)] + [z.data.ptr for z in live]])
        assert all(p + n <= q for (p, n), (q, _) in zip(spans, spans[1:])), f"{name}: memory handed out twice"
        del held, live
    y = _a2a.alltoall(eng, a)
    p = y.data.ptr
    del y
    assert _a2a.alltoall(eng, a).data.ptr == p, "a free output is handed out again"
    launches.use_stream(S.FakeStream(ptr=0x9000))
    try:
        assert _a2a.alltoall(eng, a).data.ptr != p, "not on another stream"
    finally:
        launches.use_stream(stream)


def test_changes_to_a_dropped_output_never_reach_the_next_one(stub):
    """The pool hands out views of its arrays: a caller that reshapes the array it got in place and drops it gets
    the call's shape from the next call over the same memory (the pool's array itself was never reshaped)."""
    eng, launches, stream, fast = stub
    a = cupy.empty((2, 256), np.float32)
    _a2a.alltoall(eng, a), _a2a.alltoall(eng, a)
    y = _a2a.alltoall(eng, a)
    p = y.data.ptr
    y.shape = (512,)
    del y
    z = _a2a.alltoall(eng, a)
    assert z.data.ptr == p and z.shape == (2, 256) and z.dtype == np.float32


@pytest.mark.parametrize("flat", [True, False])
def test_changes_to_a_dropped_outputs_base_never_reach_the_next_one(stub, flat):
    """A caller that reshapes the array its output is a view of (``y.base.shape = ...``; CuPy allows no other change
    in place) and drops the output gets the call's shape from the next call over the same memory, on every fast
    path (alltoall, cached dispatch, combine with weights: two outputs). Failed before (a new user's attack): the
    next output came back with the changed shape."""
    eng, launches, stream, fast = stub
    h = S.handle(eng, num_tokens=8, hidden=32, num_topk=2)
    x = cupy.empty((h.num_recv_tokens, 32), np.float32)
    w = cupy.empty((h.num_recv_tokens, 2), np.float32)
    xs = cupy.empty((8, 32), np.float32)
    a = cupy.empty((2, 256), np.float32)
    for fn in (lambda: (_a2a.alltoall(eng, a),), lambda: normal.dispatch(eng, xs, handle=h)[:1],
               lambda: normal.combine(eng, x, h, w)):
        fn(), fn()
        ys = fn()
        want = [(y.data.ptr, y.shape, y.dtype) for y in ys]
        for y in ys:
            y.base.shape = (y.size,) if flat else (y.size // 2, 2)
        del ys, y
        got = fn()
        assert [(z.data.ptr, z.shape, z.dtype) for z in got] == want


def _ptr(held) -> int:
    """Where the output ``held`` (or its view, memory pointer or allocation) starts."""
    if isinstance(held, cupy.ndarray):
        return (held if held.base is None else held.base).data.ptr
    return held.ptr  # a memory pointer, or the allocation


def test_failed_allocation_on_the_fast_path_is_told(stub, monkeypatch):
    """The fast path's output allocation failing (every pooled output held) is a rejection told to the peers, and
    the communicator stays usable."""
    eng, launches, stream, fast = stub
    h = S.handle(eng, num_tokens=8, hidden=32, num_topk=2)
    x = cupy.empty((h.num_recv_tokens, 32), np.float32)
    xs = cupy.empty((8, 32), np.float32)
    a = cupy.empty((2, 64), np.float32)
    for fn in (lambda: normal.combine(eng, x, h), lambda: normal.dispatch(eng, xs, handle=h),
               lambda: _a2a.alltoall(eng, a)):
        fn(), fn()
        held = [fn(), fn()]  # both pooled outputs in use: the next call allocates

        def oom(*args, **kwargs):
            raise cupy.cuda.memory.OutOfMemoryError(1 << 30, 0)
        with monkeypatch.context() as m:
            m.setattr(cupy, "empty", oom)
            m.setattr(cupy.cuda, "alloc", oom)
            launches.clear()
            before = len(fast)
            with pytest.raises(cupy.cuda.memory.OutOfMemoryError):
                fn()
            assert len(fast) == before
            told = [e for e in launches.log if e[0] == "ring"]
            assert len(told) == 1 and told[0][1][P.DESC_FLAGS] & P.FLAG_REJECT, "the peers must be told"
        del held
        fn()


def test_blocking_rejection_raised_from_the_fast_path(stub):
    """``Config.blocking``: a peer's rejection recorded by the kernel raises SymBufferRejectedError from a fast call
    as from the full path's, and the next call runs."""
    eng, launches, stream, fast = stub
    tr = eng.transport
    h = S.handle(eng, num_tokens=8, hidden=32, num_topk=2)
    xs = cupy.empty((8, 32), np.float32)
    a = cupy.empty((2, 64), np.float32)
    for fn in (lambda: normal.dispatch(eng, xs, handle=h), lambda: _a2a.alltoall(eng, a)):
        fn(), fn()
        tr.blocking = True
        try:
            before = len(fast)
            tr.status.words[P.STATUS_REJECTED_BY] = 2  # rank 1 (+1)
            tr.status.words[P.STATUS_REJECTED_SEQ] = tr.status.ledger.seq + 1
            with pytest.raises(SymBufferRejectedError, match="rank 1 rejected this call"):
                fn()
            assert len(fast) == before + 1
            fn()
        finally:
            tr.blocking = False


def test_combine_received_rows_per_stream(stub):
    """A combine's received rows (written by its ring kernel, read by its reduction, never handed out) are one
    allocation per stream, the same on every fast call on that stream and apart from every output."""
    eng, launches, stream, fast = stub
    other = S.FakeStream(ptr=0x6000)
    h = S.handle(eng, num_tokens=16, hidden=64, num_topk=2)
    x = cupy.empty((h.num_recv_tokens, 64), np.float16)
    w = cupy.empty((h.num_recv_tokens, 2), np.float32)
    backs, outs = {}, []
    for st in (stream, stream, other, other, stream, other):
        launches.use_stream(st)
        normal.combine(eng, x, h, w)
        launches.clear()
        outs.append(normal.combine(eng, x, h, w))
        red = launches.log[1][1]
        backs.setdefault(st.ptr, set()).add((red["back"], red["w_back"]))
    launches.use_stream(stream)
    assert all(len(v) == 1 for v in backs.values()) and len(backs) == 2, backs
    spans = [(b, h.send_rows * 64 * 2) for v in backs.values() for b, _ in v] + \
        [(bw, h.send_rows * 2 * 4) for v in backs.values() for _, bw in v] + \
        [(o.data.ptr, o.nbytes) for pair in outs for o in pair]
    spans = sorted(set(spans))
    assert all(p + n <= q for (p, n), (q, _) in zip(spans, spans[1:])), "received rows overlap an output"


def test_combine_result_tuple_held_keeps_its_arrays(stub):
    """A caller that keeps a combine's result tuple with weights as it is (``res = combine(...)``, not unpacked)
    holds both outputs: the next call of the shape returns other memory."""
    eng, launches, stream, fast = stub
    h = S.handle(eng, num_tokens=16, hidden=64, num_topk=2, dispatch_id=7)
    x = cupy.empty((h.num_recv_tokens, 64), np.float32)
    w = cupy.empty((h.num_recv_tokens, 2), np.float32)
    normal.combine(eng, x, h, w), normal.combine(eng, x, h, w)  # the record, then its fast path
    before = len(fast)
    res = normal.combine(eng, x, h, w)
    again = normal.combine(eng, x, h, w)
    assert len(fast) == before + 2, "both calls take the fast path"
    assert res[0].data.ptr != again[0].data.ptr and res[1].data.ptr != again[1].data.ptr, \
        "a held result tuple's arrays handed out again"
