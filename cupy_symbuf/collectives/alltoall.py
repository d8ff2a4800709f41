"""``alltoall`` and ``alltoallv`` as functions over the engine (:class:`~cupy_symbuf.transport.engine.Engine`), the
way :mod:`cupy_symbuf.moe` runs dispatch and combine; :class:`~cupy_symbuf.Communicator` delegates to them and
carries their documentation (``Communicator.alltoall`` / ``Communicator.alltoallv``).

The alltoallv paths:

* **count exchange** (no ``recv_counts``): the counts go through the symmetric buffer first, then the rows;
* **known counts** (``recv_counts``): the rows only, the counts checked in every peer's call header;
* **capacity** (``recv_capacity``, or device ``send_counts`` on the GPU): an output of ``recv_capacity`` rows;
  on the GPU the counts are checked and exchanged on the device and never read on the host (graph-capturable);
* **quantised wire** (``wire_dtype``): the rows packed by :mod:`cupy_symbuf.collectives.wire_dtype`, moved by one
  of the paths above, and dequantised on arrival;
* **displaced blocks** (:func:`alltoallv_displaced`): MPI_Alltoallv's layout, each rank's block at its own element
  displacement in flat buffers (gaps and any order allowed), moved by the known-counts path.

Every function checks its arguments on the calling rank before the first communication step; a rejection is told
to the peers (:meth:`Engine.call` / :meth:`Engine.reject`).
"""
from __future__ import annotations

import math

import numpy as np

from ..common import backend as _compat
from ..common.address import address_of
from ..common import dtypes as _dt
from ..common.checks import as_array, check_counts, check_out
from ..common.errors import SymBufferMismatchError
from ..transport.engine import check_sync, row_signature
from ..transport.outputs import OutputPool
from ..wire import protocol as P
from ..wire.plan import part_width
from . import quant
from . import wire_dtype as _wire

__all__ = ["alltoall", "alltoallv", "alltoallv_displaced", "counts_first", "packed_base"]

#: world_size -> int64 ones ``[world_size]`` (read only): alltoall's counts, one row to and from every rank
_ONES: dict = {}


def _ones(world_size: int) -> np.ndarray:
    ones = _ONES[world_size] = np.ones(world_size, dtype=np.int64)
    ones.flags.writeable = False
    return ones


#: the largest output (bytes) a host repeat record keeps in its pool; larger ones are allocated per call (a pool
#: keeps up to two outputs alive until the communicator's next call of another shape, or its close)
POOL_BYTES = 16 << 20


class _HostRecord:
    """The host engine's record of an op's last call shape (``Engine.repeat[op]``): what a call must match to run the
    prepared exchange (``HostTransport.prepare_exchange``) with no other check: ``sendbuf`` a NumPy array of this shape,
    dtype object and strides (C-contiguous), ``sync="strong"``, the counts (alltoallv) of these exact bytes, shape and
    dtype object, ``out=`` None or a writeable NumPy array of the output's shape, dtype and C strides apart from
    ``sendbuf``, and a communicator with no symmetric arrays (then a plain sendbuf goes by the rings or by cross-memory
    attach by its size alone, as when the record was made) and no telemetry. Everything else the full path checked
    depends only on these. ``pool``: the outputs of calls without ``out=``
    (:class:`~cupy_symbuf.transport.outputs.OutputPool`: the caller gets a view of one, handed out again only once
    nothing outside the pool refers to it; the first is the output of the full path's call that made the record,
    :func:`_full_output`), at most two, of at most :data:`POOL_BYTES` each (``pooled``; larger outputs are allocated per
    call)."""

    __slots__ = ("shape", "dtype", "strides", "out_shape", "out_strides", "nbytes", "out_nbytes", "counts", "prep",
                 "pool", "pooled")

    def __init__(self, x, recv, prep, counts, pool):
        self.shape, self.dtype, self.strides = x.shape, x.dtype, x.strides
        self.out_shape, self.out_strides = recv.shape, recv.strides
        self.nbytes, self.out_nbytes = x.nbytes, recv.nbytes
        self.counts, self.prep = counts, prep
        self.pool = _output_pool(recv.shape, x.dtype) if pool is None else pool
        self.pooled = recv.nbytes <= POOL_BYTES


def _output_pool(shape: tuple, dtype) -> OutputPool:
    """A host record's pool of outputs of ``shape`` and ``dtype`` (NumPy; the pool keeps views of the arrays made
    here, which the caller's views refer to as their ``base``: see transport/outputs.py)."""
    return OutputPool(lambda: (np.empty(shape, dtype=dtype),), host=True)


def _full_output(eng, shape: tuple, x, sendbuf, relaxed: bool):
    """``(output, pool)``: the full path's output (no ``out=``) of ``shape`` and ``x``'s dtype, and the
    :class:`OutputPool` it is a view from when the call may leave a record (:func:`_remember`: host, the sendbuf
    passed as is, ``sync="strong"``, more than one rank, at most :data:`POOL_BYTES`; the record keeps the pool, so
    its first repeat call hands out this output again once the caller dropped it), else None."""
    if eng.backend == "host" and x is sendbuf and not relaxed and eng.world_size > 1 and \
            0 < math.prod(shape) * x.dtype.itemsize <= POOL_BYTES:
        pool = _output_pool(shape, x.dtype)
        recv, = pool.take()
        return recv, pool
    return eng.xp.empty(shape, dtype=x.dtype), None


def _run_record(eng, rec: _HostRecord, op: str, x, out, first_step: bool = True):
    """Run ``rec``'s prepared exchange of ``x`` (already matched to its shape, dtype and strides) into ``out`` or a
    pooled output; the output, or None when the call does not match the record after all (the full path then
    runs and checks everything). ``first_step``: the exchange is the call's first step (a failure to allocate the
    output is then a rejection told to the peers; after a count exchange it ends the call as any error between
    steps does, in :meth:`Engine.call`)."""
    if eng.heap.in_use or eng.transport.trace is not None:
        return None
    eng.check_open()
    if out is None:
        try:
            if rec.pooled:
                recv, out_addr = rec.pool.take_one()  # (a view of a pooled output)
            else:
                recv = np.empty(rec.out_shape, dtype=rec.dtype).view()
                out_addr = address_of(recv)
        except BaseException:
            if first_step:
                eng.reject(op, notify=False)
            raise
        x_addr = address_of(x)
    else:
        if type(out) is not np.ndarray or out.shape != rec.out_shape or out.dtype is not rec.dtype or \
                out.strides != rec.out_strides or not out.flags.writeable:
            return None
        recv, out_addr, x_addr = out, address_of(out), address_of(x)
        if out_addr < x_addr + rec.nbytes and x_addr < out_addr + rec.out_nbytes:
            return None  # (overlap: the full path's error)
    eng.run_prepared(rec.prep, op, x_addr, recv, out_addr)
    return recv


#: ``Engine.repeat``'s key of the record of alltoallv with the count exchange (alltoall's and alltoallv's with
#: recv_counts: the op's name). It holds the counts sent and received: a repeat call exchanges the counts, then
#: runs the prepared exchange when they are the record's.
_NOTIFIED = "alltoallv count exchange"


def _remember(eng, op: str, sendbuf, x, recv, plan, direct, relaxed: bool, pool, counts=None):
    """After a call of the full path that succeeded: make ``op``'s record (:class:`_HostRecord`) of its shape when the
    host engine can prepare it (a plain C-contiguous NumPy sendbuf of at least one byte, passed as is, moved by
    the rings or by cross-memory attach, ``sync="strong"``), else drop the op's record. ``recv``: the call's
    output; ``pool``: the pool it is a view from (:func:`_full_output`), or None. Returns the output to hand the
    caller: ``recv`` (a view of a pooled array, so what the caller changes in the array object it got, its shape,
    dtype, flags or a ``resize``, or in its ``base``, never reaches the pool's array: :func:`_output_pool`), or the
    array the pool's array is a view of when no record keeps the pool (:func:`_unpooled`)."""
    repeat = eng.repeat
    if eng.backend != "host":
        return recv
    prep = None
    if (x is sendbuf and type(x) is np.ndarray and not relaxed and x.nbytes and x.flags.c_contiguous and
            recv.flags.c_contiguous and (direct is None or direct[0] == P.MODE_CMA)):
        prep = eng.prepare_exchange(plan)
    if prep is None:
        repeat.pop(op, None)
        return _unpooled(recv, pool)
    repeat[op] = _HostRecord(x, recv, prep, counts, pool)
    return recv


def _unpooled(recv, pool):
    """The full path's output to hand the caller when no record keeps ``pool`` (:func:`_full_output`): the array
    the pool's array is a view of (the caller's alone, as a new array), or ``recv`` when it came from no pool."""
    return recv if pool is None else recv.base


def _checked_out(eng, op: str, out, shape: tuple, x):
    """The caller's ``out=`` for rows of ``x``'s dtype, ``shape``: not a freed symmetric array, then
    :func:`~cupy_symbuf.common.checks.check_out` (``ValueError`` / ``TypeError`` naming ``out``)."""
    eng.check_live(op, "out", out)
    return check_out(op, out, eng.backend, shape, x.dtype, inputs=(x,))


#: the key of :class:`_Repeat` in the engine's per-call-shape memo (:attr:`Engine.call_memo`)
_REPEAT = "alltoall: the last small call's shape"


class _Repeat:
    """The fast path of a GPU ``alltoall`` by the small-message protocol: the shape the engine ran last with
    ``sync="strong"`` from a C-contiguous plain CuPy sendbuf (``Config.mode`` "auto" or "ring", in which nothing but
    the sendbuf's shape and dtype decides the call: a direct source is never asked for), whose checks passed then
    (the dtype object, the shape and the GPU current then), and what a call of exactly that shape does: the prepared
    launch (:meth:`Engine.small_prepare`: plan, bytes per peer, grid) and the pool its outputs come from when the
    caller gives no ``out=`` (:class:`~cupy_symbuf.transport.outputs.OutputPool`). A call that differs in anything
    (an ``out=`` other than a plain C-contiguous CuPy array of the shape and dtype, apart from the sendbuf) runs the
    full path. The headers carry the plan's signature as before; every receiver checks it."""

    __slots__ = ("dtype", "shape", "device", "small", "outs")


def _repeat(eng, x, plan) -> _Repeat:
    """The :class:`_Repeat` of a small call of ``x`` (C-contiguous, plain CuPy) that ran the full path with
    ``plan``."""
    r = _Repeat()
    r.dtype, r.shape, r.device = x.dtype, x.shape, x.data.device_id
    r.small = eng.small_prepare(plan, x.nbytes)
    xp, shape, dtype = eng.xp, x.shape, x.dtype
    r.outs = OutputPool(lambda: (xp.empty(shape, dtype=dtype),))
    return r


def _out_fits(out, x, rep: _Repeat) -> bool:
    """Whether the caller's ``out=`` passes :func:`~cupy_symbuf.common.checks.check_out` for ``x`` (C-contiguous, of
    ``rep``'s shape and dtype) by what the fast path compares: a plain CuPy array of that dtype object and shape,
    C-contiguous, on ``rep``'s GPU, whose bytes do not overlap ``x``'s (else the full checks say what is wrong)."""
    if type(out) is not type(x) or out.dtype is not rep.dtype or out.shape != rep.shape or not out._c_contiguous or \
            out.data.device_id != rep.device:
        return False
    lo, n, xlo = out.data.ptr, out.nbytes, x.data.ptr
    return not n or lo + n <= xlo or xlo + n <= lo


def alltoall(eng, sendbuf, out=None, sync: str = "strong"):
    """See :meth:`Communicator.alltoall` (``eng``: its engine; ``stream`` / ``async_op`` are the Communicator's)."""
    op = "alltoall"
    rep = eng.call_memo.get(_REPEAT)
    if rep is not None and sync == "strong":  # (only GPU calls make one)
        cp = eng.xp
        if type(sendbuf) is cp.ndarray and sendbuf.dtype is rep.dtype and sendbuf.shape == rep.shape and \
                sendbuf._c_contiguous and sendbuf.data.device_id == rep.device == cp.cuda.runtime.getDevice() and \
                (out is None or _out_fits(out, sendbuf, rep)):
            # the call shape run last: the output from a pool or the caller's, one launch (the same checks: none of
            # them can fail for this shape but the freed-symmetric-array ones, which are made)
            eng.check_open()
            try:
                eng.check_live(op, "sendbuf", sendbuf)
                stream = cp.cuda.get_current_stream()
                if out is None:
                    recv, = rep.outs.take(stream.ptr)
                else:
                    eng.check_live(op, "out", out)
                    recv = out
            except BaseException:  # KeyboardInterrupt too: never fall a call behind the peers silently
                eng.reject(op, notify=False)
                raise
            eng.run_small_repeat(rep.small, sendbuf.data.ptr, recv.data.ptr, stream)
            return recv
    rec = eng.repeat.get(op)  # (only host calls make one)
    if rec is not None and type(sendbuf) is np.ndarray and sendbuf.shape == rec.shape and \
            sendbuf.dtype is rec.dtype and sendbuf.strides == rec.strides and sync == "strong":
        got = _run_record(eng, rec, op, sendbuf, out)
        if got is not None:
            return got
    eng.check_open()
    try:  # argument checks; a rejection is told to the peers (the lean form of Engine.call)
        x = as_array(op, "sendbuf", sendbuf, eng.backend)
        W = eng.world_size
        if x.shape[0] != W:
            raise ValueError(f"{op}: argument 'sendbuf' must have shape[0] == world_size ({W}), "
                             f"got shape {tuple(x.shape)}")
        relaxed = False if sync == "strong" else check_sync(op, sync)  # (the default without a call)
        direct = eng.direct_source(op, [x], None)
        ones = _ONES.get(W)
        plan = eng.rows_plan(op, x, _ones(W) if ones is None else ones, direct is not None)
        pool = None
        if out is None:
            recv, pool = _full_output(eng, x.shape, x, sendbuf, relaxed)
        else:  # (_checked_out, inline: the no-allocation form of the hot path)
            eng.check_live(op, "out", out)
            recv = check_out(op, out, eng.backend, x.shape, x.dtype, inputs=(x,))
    except BaseException:  # KeyboardInterrupt too: never fall a call behind the peers silently
        eng.reject(op, notify=False)
        raise
    if x is not sendbuf:  # a copy (a strided sendbuf) or an import: a captured launch reads it at every replay
        eng.keep_for_graph(x)
    if x.nbytes <= eng.small_total:  # the small-message protocol (GPU): the size decides, alike on every rank
        eng.run_small(plan, x, recv)
        if not relaxed and direct is None and x is sendbuf and x._c_contiguous and \
                eng.config.mode in ("auto", "ring"):  # the next call of this shape: the fast path above
            rep = eng.call_memo.get(_REPEAT)
            if rep is None or rep.dtype is not x.dtype or rep.shape != x.shape or rep.device != x.data.device_id:
                eng.call_memo[_REPEAT] = _repeat(eng, x, plan)
    else:
        eng.run(plan, [x], None, [recv], direct, relaxed)
        if eng.backend == "host":
            recv = _remember(eng, op, sendbuf, x, recv, plan, direct, relaxed, pool)
    return recv


def alltoallv(eng, sendbuf, send_counts, recv_counts=None, recv_capacity=None, out=None, wire_dtype=None,
              sync: str = "strong", *, sig_what: str = ""):
    """See :meth:`Communicator.alltoallv` (``eng``: its engine; ``stream`` / ``async_op`` are the Communicator's).
    Returns ``(recvbuf, recv_counts)``. ``sig_what``: what the count exchange says when the ranks' row signatures
    differ (the quantised wire says it in the caller's terms, not the packed rows')."""
    op = "alltoallv"
    if wire_dtype is not None:
        return _alltoallv_wire(eng, op, sendbuf, send_counts, recv_counts, recv_capacity, out, wire_dtype, sync)
    device_counts = eng.backend == "cuda" and _compat.is_cupy_array(send_counts)
    if recv_counts is not None and (recv_capacity is not None or device_counts):
        # rejected in recv_counts' form (counts_first): the peers that pass the same recv_counts wait for call
        # headers, so they see a rejection, not a call-form disagreement that would break the communicator
        eng.check_open()
        if recv_capacity is not None:
            err = ValueError(f"{op}: recv_counts and recv_capacity exclude each other (capacity mode exchanges the "
                             f"counts on the device)")
        else:
            err = ValueError(f"{op}: send_counts on the device go with recv_capacity (the counts are exchanged on "
                             f"the device), not with recv_counts (pass send_counts as a NumPy array or list with "
                             f"them)")
        eng.reject(op, notify=False, exc=err)
        raise err
    if recv_capacity is not None or device_counts:
        with eng.call(op, notify=True):
            return _alltoallv_capacity(eng, op, sendbuf, send_counts, recv_capacity, out, check_sync(op, sync))
    if recv_counts is not None:  # known counts: one step, so the lean form of Engine.call (as alltoall)
        rec = eng.repeat.get(op)
        if rec is not None and type(sendbuf) is np.ndarray and sendbuf.shape == rec.shape and \
                sendbuf.dtype is rec.dtype and sendbuf.strides == rec.strides and sync == "strong" and \
                recv_capacity is None and type(send_counts) is np.ndarray and type(recv_counts) is np.ndarray:
            sd, sb, rd, rb, rc = rec.counts
            if send_counts.dtype is sd and recv_counts.dtype is rd and send_counts.ndim == 1 and \
                    recv_counts.ndim == 1 and send_counts.tobytes() == sb and recv_counts.tobytes() == rb:
                got = _run_record(eng, rec, op, sendbuf, out)
                if got is not None:
                    return got, rc.copy()
        eng.check_open()
        try:
            relaxed = False if sync == "strong" else check_sync(op, sync)
            x = as_array(op, "sendbuf", sendbuf, eng.backend)
            send_counts_arg, recv_counts_arg = send_counts, recv_counts
            send_counts, recv_counts, sig, shape, plans = _known_counts(eng, op, x, send_counts, recv_counts)
            direct = eng.direct_source(op, [x], None)
            mode = direct is not None
            plan = plans[mode]
            if plan is None:  # (remembered with the counts: a repeated call builds no plan key)
                plan = plans[mode] = eng.plans.get(op, sig, [part_width(x)], False, send_counts, recv_counts, mode)
            pool = None
            if out is None:
                recv, pool = _full_output(eng, shape, x, sendbuf, relaxed)
            else:
                eng.check_live(op, "out", out)
                recv = check_out(op, out, eng.backend, shape, x.dtype, inputs=(x,))
        except BaseException:  # KeyboardInterrupt too: never fall a call behind the peers silently
            eng.reject(op, notify=False)
            raise
        eng.run(plan, [x], None, [recv], direct, relaxed)
        key = (_counts_key(send_counts_arg), _counts_key(recv_counts_arg)) if eng.backend == "host" else (None,)
        if key[0] is None or key[-1] is None:
            eng.repeat.pop(op, None)
            recv = _unpooled(recv, pool)
        else:
            recv = _remember(eng, op, sendbuf, x, recv, plan, direct, relaxed, pool, key[0] + key[1] + (recv_counts,))
        return recv, recv_counts.copy()
    with eng.call(op, notify=True):
        relaxed = False if sync == "strong" else check_sync(op, sync)
        if out is not None:
            raise ValueError(f"{op}: argument 'out' needs recv_counts or recv_capacity (the output's size must be "
                             f"known before the count exchange)")
        W = eng.world_size
        rec = eng.repeat.get(_NOTIFIED)
        if rec is not None and type(sendbuf) is np.ndarray and sendbuf.shape == rec.shape and \
                sendbuf.dtype is rec.dtype and sendbuf.strides == rec.strides and not relaxed and \
                type(send_counts) is np.ndarray and send_counts.ndim == 1 and send_counts.dtype is rec.counts[0] and \
                send_counts.tobytes() == rec.counts[1] and not eng.heap.in_use:
            x, direct = sendbuf, False  # (checked as the record's call was; the mode is found again if needed)
            send_counts, sig = rec.counts[2], rec.counts[3]
        else:
            rec = None
            x = as_array(op, "sendbuf", sendbuf, eng.backend)
            counts_arg = send_counts
            send_counts, sig = _send_counts(eng, op, x, send_counts)
            direct = eng.direct_source(op, [x], None)
        # what the peers send (each checked its own counts); their sum is checked exactly here too. The
        # signature message is made only when the ranks differ.
        what = sig_what or (lambda: f"every rank must send rows of the same dtype and row shape, with the same "
                                    f"wire_dtype; this rank has {sig} (no wire_dtype)")
        got = eng.notify(op, send_counts[:, None], sig, sig_what=what)[:, 0]
        got_bytes = got.tobytes()
        if rec is not None:
            if got_bytes == rec.counts[4]:  # the counts of the record's call: its prepared exchange
                recv = _run_record(eng, rec, op, x, None, first_step=False)
                if recv is not None:
                    return recv, rec.counts[5].copy()
            counts_arg = None  # (no new record from this call)
            direct = eng.direct_source(op, [x], None)
        recv_counts = _checked(eng, ("recv", got_bytes),
                               lambda: check_counts(op, "recv_counts (from the count exchange)", got.copy(), W))
        shape = (int(recv_counts.sum()),) + tuple(x.shape[1:])
        recv, pool = _full_output(eng, shape, x, sendbuf, relaxed)
        plan = eng.plans.get(op, sig, [part_width(x)], False, send_counts, recv_counts, direct is not None)
        eng.run(plan, [x], None, [recv], direct, relaxed)
        key = _counts_key(counts_arg) if eng.backend == "host" else None
        if key is None:
            eng.repeat.pop(_NOTIFIED, None)
            recv = _unpooled(recv, pool)
        else:
            recv = _remember(eng, _NOTIFIED, sendbuf, x, recv, plan, direct, relaxed, pool,
                             key + (send_counts, sig, got_bytes, recv_counts))
    return recv, recv_counts.copy()


def counts_first(recv_counts) -> bool:
    """Whether an alltoallv call starts with the count exchange (the form of the call, which every rank must share):
    exactly when it has no ``recv_counts`` (with ``recv_capacity``, or with ``send_counts`` on the device, too). A
    call whose arguments are rejected is rejected in this form: recv_counts with recv_capacity, or with send_counts
    on the device, as a call with recv_counts, so that the peers that pass the same recv_counts see a rejection."""
    return recv_counts is None


def _checked(eng, key, check):
    """``check()`` (an argument check that returns a NumPy array), remembered under ``key`` in the engine's
    per-call-shape memo (:attr:`Engine.call_memo`): a repeated call with the same values skips it. The result is
    made read only (callers hand out copies); a check that raises is never remembered."""
    memo = eng.call_memo
    got = memo.get(key)
    if got is None:
        got = check()
        if isinstance(got, np.ndarray):
            got.flags.writeable = False
        elif isinstance(got, tuple):
            for a in got:
                if isinstance(a, np.ndarray):
                    a.flags.writeable = False
        if len(memo) >= 256:
            memo.clear()
        memo[key] = got
    return got


def _counts_key(counts):
    """The exact value of ``counts`` as a hashable key when it is a 1-D NumPy integer array (its dtype object,
    which compares with its byte order and width, and bytes: the same bytes as ``'<i8'`` and ``'>i8'`` are other
    values), else None: lists and other sequences are checked in full every call (their items' types matter).
    (The dtype object, not ``dtype.str``: that string is made anew on every access.)"""
    if type(counts) is np.ndarray and counts.ndim == 1 and counts.dtype.kind in "iu":
        return counts.dtype, counts.tobytes()
    return None


def _send_counts(eng, op, x, send_counts):
    """``(send_counts int64 [W] read only, row signature)`` of an alltoallv's ``sendbuf`` ``x``: the counts
    checked (shape, >= 0, summing to ``x.shape[0]``, addressable), remembered per exact value, shape and dtype
    object (its ``id`` too: the key holds it alive, and an equal dtype object whose signature text could differ,
    e.g. other metadata, is checked afresh)."""
    W = eng.world_size

    def check():
        counts = check_counts(op, "send_counts", send_counts, W, total=int(x.shape[0]))
        eng.check_size(op, "send_counts", counts, x)  # before the count exchange: a rejection
        return counts, row_signature(x)

    key = _counts_key(send_counts)
    if key is None:
        return check()
    return _checked(eng, ("send", x.shape, x.dtype, id(x.dtype), key), check)


def _known_counts(eng, op, x, send_counts, recv_counts):
    """alltoallv with ``recv_counts``: ``(send_counts, recv_counts, row signature, output shape, plans)``, the
    counts int64 ``[W]`` read only, checked as :func:`_send_counts` and ``recv_counts`` (shape, >= 0, addressable,
    ``recv_counts[rank] == send_counts[rank]``), remembered per exact values, dtype and row shape. ``plans``: the
    exchange plans of these counts through the rings and in a direct mode (``[ring, direct]``, None until the
    caller makes one; they depend on nothing else the key leaves out), remembered with them."""
    W = eng.world_size

    def check():
        sc, sig = _send_counts(eng, op, x, send_counts)
        rc = check_counts(op, "recv_counts", recv_counts, W)
        rank = eng.rank
        if rc[rank] != sc[rank]:
            raise ValueError(f"{op}: recv_counts[{rank}] ({rc[rank]}) must equal send_counts[{rank}] "
                             f"({sc[rank]}): the rows this rank sends to itself")
        return sc, rc, sig, (int(rc.sum()),) + tuple(x.shape[1:]), [None, None]

    skey, rkey = _counts_key(send_counts), _counts_key(recv_counts)
    if skey is None or rkey is None:
        return check()
    return _checked(eng, ("known", x.shape, x.dtype, id(x.dtype), skey, rkey), check)


def _alltoallv_wire(eng, op, sendbuf, send_counts, recv_counts, recv_capacity, out, wire_dtype, sync):
    """alltoallv(wire_dtype=...): quantise the rows, exchange the packed rows, dequantise (see alltoallv)."""
    eng.check_open()
    notify = counts_first(recv_counts)
    try:
        if not isinstance(wire_dtype, str) or wire_dtype not in _wire.WIRE_DTYPES:  # (a list is unhashable)
            raise ValueError(f"{op}: wire_dtype must be None, 'fp8' or 'int8', got {wire_dtype!r}")
        if out is not None:
            raise ValueError(f"{op}: out= is not supported with wire_dtype (the rows arrive packed)")
        x = as_array(op, "sendbuf", sendbuf, eng.backend)
        kind = _dt.float_kind(x.dtype)
        if kind not in (_dt.BFLOAT16, _dt.FLOAT16, _dt.FLOAT32) or x.ndim < 2:
            raise TypeError(f"{op}: wire_dtype={wire_dtype!r} needs float32 / float16 / bfloat16 rows (at least "
                            f"2-D; bfloat16 as the ml_dtypes dtype on the host: CuPy has none, so on the GPU "
                            f"pass float16 or float32), got dtype {x.dtype} shape {tuple(x.shape)}")
        n, row_shape = int(x.shape[0]), tuple(x.shape[1:])
        per_row = int(np.prod(row_shape))
        if per_row % quant.QUANT_BLOCK:
            raise ValueError(f"{op}: wire_dtype={wire_dtype!r} needs rows of a multiple of {quant.QUANT_BLOCK} "
                             f"elements, got {per_row} (row shape {row_shape})")
        packed = _wire.pack_rows(eng.xp.ascontiguousarray(x).reshape(n, per_row), kind, wire_dtype)
    except BaseException:
        eng.reject(op, notify=notify)
        raise
    # a rank that differs in wire_dtype / dtype / row shape: say it in the caller's terms, not the packed rows'
    what = (f"every rank must send rows of the same dtype and row shape, with the same wire_dtype; this rank sends "
            f"{x.dtype} rows of shape {row_shape} as wire_dtype={wire_dtype!r}")
    recv, got = alltoallv(eng, packed, send_counts, recv_counts, recv_capacity, sync=sync, sig_what=what)
    back = _wire.unpack_rows(recv, per_row, kind, x.dtype, wire_dtype)
    return back.reshape((int(recv.shape[0]),) + row_shape), got


def _alltoallv_capacity(eng, op, sendbuf, send_counts, recv_capacity, out=None, relaxed=False):
    """alltoallv in capacity mode (see :meth:`Communicator.alltoallv`; no recv_counts): GPU: counts checked and
    exchanged on the device, the ring kernel reads its units from the counts table, nothing read on the host; host:
    the same result from the host protocol, padded to the capacity."""
    if recv_capacity is None:
        raise ValueError(f"{op}: send_counts on the device needs recv_capacity= (the output rows; the host never "
                         f"reads the counts)")
    if isinstance(recv_capacity, bool) or not isinstance(recv_capacity, (int, np.integer)):
        raise TypeError(f"{op}: recv_capacity must be an int >= 0, got {type(recv_capacity).__name__}")
    if recv_capacity < 0:
        raise ValueError(f"{op}: recv_capacity must be an int >= 0, got {recv_capacity!r}")
    cap = int(recv_capacity)
    x = as_array(op, "sendbuf", sendbuf, eng.backend)
    W = eng.world_size
    sig = row_signature(x)
    out_shape = (cap,) + tuple(x.shape[1:])
    if eng.backend == "host":
        send_counts = check_counts(op, "send_counts", send_counts, W, total=int(x.shape[0]))
        eng.check_size(op, "send_counts", send_counts, x)
        direct = eng.direct_source(op, [x], None)
        # the output before the count exchange: a capacity too large to allocate is a rejection told to the
        # peers (communicator usable), not a failure between the steps
        recv = np.empty(out_shape, dtype=x.dtype) if out is None else _checked_out(eng, op, out, out_shape, x)
        got = check_counts(op, "recv_counts (from the count exchange)",
                           eng.notify(op, send_counts[:, None], sig)[:, 0].copy(), W)
        n = int(got.sum())
        if n > cap:  # between the steps: fatal, the peers are told (Engine.call sets the abort word)
            raise eng.fatal(SymBufferMismatchError(
                f"{op}: rank {eng.rank} receives {n} rows, more than recv_capacity={cap}", rank=eng.rank,
                op=op, field="capacity", expected=cap, got=n))
        eng.exchange_rows(op, [x], None, send_counts, [recv[:n]], got, sig, direct, relaxed)
        return recv, got
    cp = eng.xp
    counts = send_counts if _compat.is_cupy_array(send_counts) else cp.asarray(np.asarray(send_counts))
    if counts.ndim != 1 or counts.shape[0] != W or counts.dtype.kind not in "iu":
        raise ValueError(f"{op}: send_counts must be integers of shape [world_size={W}], got dtype "
                         f"{counts.dtype} shape {tuple(counts.shape)}")
    counts = cp.ascontiguousarray(counts, dtype=np.int64)
    CT = P.CT_WORDS
    block = cp.empty(2 * CT + 1 + 2 + W, np.int64)  # tables, row sum, bad, meta
    bad, meta = block[2 * CT + 1:2 * CT + 3], block[2 * CT + 3:]
    eng.counts_meta(counts, int(x.shape[0]), meta, bad)
    rb = part_width(x)
    direct = eng.direct_source(op, [x], None)
    recv = cp.empty(out_shape, dtype=x.dtype) if out is None else \
        _checked_out(eng, op, out, out_shape, x)  # before the notify
    scale = rb or 1  # rows of 0 bytes: the table counts rows (nothing moves), so the counts still come back
    eng.keep_for_graph(counts, block)  # an int64 copy of the counts and the tables, read by every replay
    eng.notify_device(op, meta.reshape(W, 1), 1, sig, table=block[:2 * CT], sums=block[2 * CT:2 * CT + 1],
                      local_reject=bad, scale=scale, capacity=cap, worst=True)
    if rb:
        eng.exchange_rows_device(op, [x], None, [recv], sig, block.data.ptr, row_run=False, direct=direct)
    got = block[P.CT_PEERS + 3 * W:P.CT_PEERS + 4 * W] // scale
    return recv, got


def packed_base(counts: np.ndarray, displs: np.ndarray):
    """Where the blocks ``[displs[j], displs[j] + counts[j])`` (int64 ``[W]`` each, in elements) start when they lie
    back to back in rank order (the blocks of zero count ignored, whatever their displacement), so that the
    ``sum(counts)`` elements from there are the blocks of rank 0, 1, ... in turn; None when they do not (a gap, an
    overlap or another order). 0 when every count is 0."""
    nz = counts > 0
    if not nz.any():
        return 0
    base = int(displs[np.argmax(nz)])
    starts = base + np.cumsum(counts) - counts  # where each block starts when packed from ``base``
    return base if bool((displs[nz] == starts[nz]).all()) else None


def alltoallv_displaced(eng, send_flat, send_counts, send_displs, recv_flat, recv_counts, recv_displs,
                        sync: str = "strong") -> None:
    """Alltoallv in MPI_Alltoallv's layout: flat element buffers with a block per rank at its own displacement.

    ``send_flat`` / ``recv_flat``: 1-D arrays of the backend (the same dtype; ``recv_flat`` writeable, sharing no
    memory with ``send_flat``). ``send_counts`` / ``send_displs`` / ``recv_counts`` / ``recv_displs``: int64
    ``[world_size]``, in elements. Rank ``j`` receives ``send_flat[send_displs[j]:][:send_counts[j]]``; this rank
    writes what rank ``i`` sends it to ``recv_flat[recv_displs[i]:][:recv_counts[i]]``; receive elements outside
    every block keep their values. The caller has checked the blocks lie inside the buffers, the receive blocks do
    not overlap and ``recv_counts[rank] == send_counts[rank]`` (a rejection told to the peers otherwise:
    :meth:`Engine.reject` with op ``"alltoallv"``, known counts).

    Blocks packed back to back in rank order (:func:`packed_base`) move in place (no copy); otherwise the send
    blocks are gathered into one temporary before the exchange (one copy of the bytes sent) and the receive blocks
    scattered from one after it (one copy of the bytes received). The rows go by the known-counts path of
    :func:`alltoallv` (``recv_counts`` given), so the counts are checked in every peer's call header before a byte
    is taken: a rank whose ``recv_counts[i]`` differ from what rank ``i`` sends raises
    :class:`~cupy_symbuf.SymBufferMismatchError`, every rank raises (this call or its next) and the communicator
    is unusable; never wrong data.
    """
    op = "alltoallv"
    eng.check_open()
    xp = eng.xp
    try:  # the temporaries before the first step: a failure (out of memory) is a rejection told to the peers
        sbase, rbase = packed_base(send_counts, send_displs), packed_base(recv_counts, recv_displs)
        ns, nr = int(send_counts.sum()), int(recv_counts.sum())
        if sbase is not None:
            send = send_flat[sbase:sbase + ns]
        elif ns:
            send = xp.concatenate([send_flat[d:d + c] for c, d in zip(send_counts.tolist(), send_displs.tolist())
                                   if c])
        else:
            send = send_flat[:0]
        recv = recv_flat[rbase:rbase + nr] if rbase is not None else xp.empty(nr, dtype=recv_flat.dtype)
    except BaseException:
        eng.reject(op, notify=False)
        raise
    alltoallv(eng, send, send_counts, recv_counts=recv_counts, out=recv, sync=sync)
    if rbase is None:  # after the last step: a local copy
        off = 0
        for c, d in zip(recv_counts.tolist(), recv_displs.tolist()):
            if c:
                recv_flat[d:d + c] = recv[off:off + c]
                off += c
