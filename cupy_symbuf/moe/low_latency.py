"""Low-latency MoE dispatch / combine for decode (1 to a few hundred tokens per rank), with DeepEP's
``Buffer.low_latency_dispatch`` / ``Buffer.low_latency_combine`` semantics (``deep_ep/buffer.py``), intranode.

::

    ll = cupy_symbuf.LowLatencyBuffer(comm, num_max_dispatch_tokens_per_rank=128, hidden=7168, num_experts=256)
    recv_x, recv_count, handle = ll.dispatch(x, topk_idx)            # or use_fp8=True: recv_x = (x_fp8, scales)
    y = run_experts(recv_x, recv_count)                               # [num_local_experts, W * N, hidden]
    out = ll.combine(y, topk_idx, topk_weights, handle)               # [num_tokens, hidden], weights APPLIED

``combine`` here **applies the top-k weights** (``out[t] = sum_j w[t, j] * y[expert topk_idx[t, j], row of t]``),
as DeepEP's low-latency combine does. The normal-mode :meth:`Communicator.combine` does not: it sums the rows it is
given, which the caller has weighted already.

Design (decided and measured: ``docs/perf-notes.md``, "low-latency mode")
-----------------------------------------------------------------------
* Its own :class:`~cupy_symbuf.SymBuffer`, allocated collectively, sized for the worst case
  (``num_max_dispatch_tokens_per_rank`` tokens to every rank), double-buffered: halves chosen by the parity of a
  per-call sequence number kept in device memory (host memory on the host path) and advanced by the kernel, so
  CUDA-graph replays keep alternating; every flag is compared against that sequence, never reset by the host.
  A call waits for every peer's flag of that same call, so when call ``i + 2`` starts on a rank every peer has
  finished call ``i``: the half is free again.
* **One copy per (token, destination rank)** over the interconnect, not one per (token, expert): dispatch stores
  token ``t`` of source ``s`` once into row ``t`` of ``s``'s staging area in every rank that holds one of its
  experts (with ``s``'s ``topk_idx`` as int32 metadata); the receiver then places the rows per local expert with
  local copies. ``recv_x[e]`` holds expert ``e``'s rows ordered by (source rank, token index): deterministic, so
  the host twin gives the same bits. ``combine`` sends each token's weights to every rank first (``K`` floats a
  token), each rank sums the weighted outputs of **its** experts for a token into one partial row (float32
  accumulation, rounded once to ``x``'s dtype) and sends that row back once; the source sums the partials of the
  ranks in ascending rank order (float32 from 0) and rounds once. So combine rounds twice (the per-rank partial,
  then the sum), DeepEP once; the error is within one extra rounding of the partial (relative ``2**-9`` for
  bf16) and is the same on both backends.
* One kernel each (``cuda_src/low_latency.cu``: ``symbuf_ll_dispatch``, ``symbuf_ll_combine``), no host
  synchronisation, no host read of counts, fixed sizes: graph-capturable. Every wait is a bounded SpinBudget
  wait (``cuda_src/protocol.cuh``) that polls the **communicator's** abort word: a timeout raises
  :class:`~cupy_symbuf.SymBufferTimeoutError` (rank, peer; ``head`` = the value awaited, ``tail`` = the one seen,
  channel -1: for combine's weights flag a sequence number, for dispatch's and the partials' flags a count of the
  peer's blocks, which add 1 each to every destination's line when their stores are done, so no block waits for
  another before publishing), a peer's other dtype / top-k / fp8 options (the per-call signature in every flag
  line) :class:`~cupy_symbuf.SymBufferMismatchError` (a peer making the other call kind, a combine against this
  rank's dispatch, publishes in the other kind's flag lines: that wait ends at ``timeout_s``), and
  :meth:`Communicator.abort` stops the waits. The kernels write
  the communicator's one error record and are numbered by its launch ledger (``transport/status.py``), so a
  failure is decoded and named exactly as a ring kernel's.
* Host cost per call (GPU): the first call of each shape (shapes, dtypes, fp8 options) is validated in full and
  builds the kernel's argument structs (one per output set); later calls with CuPy arrays of that shape,
  C-contiguous on this GPU, check only those attributes, write the input addresses and the launch number into the
  block and call ``cuLaunchKernel`` (no allocation; the outputs and their views are the preallocated ones). Other
  inputs (PyTorch tensors, non-contiguous or int32 ``topk_idx``) take the validating path every call.
* fp8: the one quantiser of ``cuda_src/quant.cuh`` / :mod:`cupy_symbuf.quant` (per 128 elements, float32 scale
  amax / 448, optionally rounded up to a power of two).

Outputs are taken from two preallocated sets (like DeepEP's double buffer): what ``dispatch`` / ``combine`` return
stays valid until the call after the next one of the same kind; copy it to keep it longer. A handle is usable by
``combine`` until two more dispatches have been made.

Receive hooks (DeepEP's ``return_recv_hook``): ``dispatch(..., return_recv_hook=True)`` returns ``(recv_x,
recv_count, handle, hook)`` and ``combine(..., return_recv_hook=True)`` ``(combined_x, hook)``; the call launches
only the send phase (the kernel's ``phase`` argument: dispatch stores the payload and meta, then the flag-line counts
that announce them; combine sends the weights, waits for every source's weights (the partial sums are made on the
expert side, so its send waits for the peers' sends, which publish their weights first), sends its partial rows and
their counts), and ``hook()`` (:class:`LowLatencyRecvHook`) launches the receive phase on the stream the call was
made on (the same bounded waits, error record and rejection decision, then the unpacking / the sum). The results
hold their values only after the hook ran (on the GPU: after its kernel, in stream order). Work queued between the
call and the hook overlaps the transfer (DeepEP's two-micro-batch overlap). Rules: **one call's receive may be
outstanding per buffer**: the buffer's next call of either kind before the hook ran raises ``RuntimeError`` (nothing
moves, nothing is told to the peers, the hook stays callable), and so does a second call of one hook (DeepEP does not
check either; its double buffer lets two calls be in flight, ours keeps one because the sequence of each kind is
counted by the receive launches and the combine reads the dispatch's receive outputs). On the host backend the
receive runs inside ``hook()``, and a split call counts (output-set parity, handle age) when its receive completes;
on the GPU it counts at the send, like any launch. A peer's rejection of a split call and a failure found by its
receive are raised by the hook on every other rank: on the host backend from ``hook()``; on the GPU from
:meth:`synchronize` after it (or from ``hook()`` with ``Config(blocking=True)``). Both phases are capturable in
CUDA graphs, together or in separate graphs replayed in call order. ``x`` / ``topk_idx`` / ``topk_weights`` must keep
their values until the hook ran (combine's receive reads ``topk_idx``; the hook keeps references to them).

Rules: every rank makes the same calls in the same order with the same ``hidden``, dtype, top-k and fp8 options
(checked in the flag lines); ``num_tokens`` may differ (0 too). Arguments are validated before anything moves.
A combine answers one dispatch: every rank passes the handle of the same dispatch, and the ``topk_idx`` that
dispatch was given (equal values; a copy or an int32 one is fine). Both are checked without a host read: the
handle carries its dispatch's id (:attr:`LowLatencyHandle.dispatch_id`; the kernels read the one each dispatch
stores with its outputs, so CUDA-graph replays compare the ids the replayed dispatches wrote), which every rank's
weights flag line carries and every rank compares; and before publishing its line a rank compares its ``topk_idx``
with the top-k indices its dispatch sent (host path: a copy kept in the handle, a ``ValueError`` of that rank; GPU:
the dispatch's metadata in the symmetric buffer, read by the combine kernel's first block, ``n x num_topk`` int32
compares, no host read). Either difference is a rejection of the call on every rank (below; never wrong rows): the
peers' :class:`~cupy_symbuf.SymBufferRejectedError` names the handles' dispatch ids, or the rank whose
``topk_idx`` differs (on the GPU that rank's error is one too, naming itself). Calls follow the communicator's
call protocol:

* A call rejected on one rank (its arguments fail the checks, or any exception, ``KeyboardInterrupt`` too, before
  anything moved) is told to the peers: the rejecting rank still takes part in the call with flag lines marked
  rejected and no payload, then raises its own error; no rank consumes anything of that call, and the buffer stays
  usable on every rank. The peers raise :class:`~cupy_symbuf.SymBufferRejectedError` naming the rejecting rank: on
  the host path from the call itself; on the GPU (queued, like any collective) from :meth:`synchronize` (or at
  once with ``Config(blocking=True)``), the call's outputs then being empty (dispatch: zero ``recv_count``,
  ``layout_range`` and token counts; combine: zero rows). A GPU caller that goes on to ``combine`` before
  synchronising holds the handle of a dispatch that delivered nothing: that dispatch stored its id negated, so a
  combine with its handle is rejected on every rank (``SymBufferRejectedError``, "which a rank rejected"), whatever
  handle the rejecting rank combines with; if the rejecting rank makes another kind of call instead, the ranks fall
  out of step and the call times out. Synchronise after a dispatch before trusting its handle. On the
  GPU a rejected call counts as a call on every rank, the rejecting one too (for "valid until the call after the
  next one" and a handle's two dispatches); on the host path it counts on none.
* Any exception inside a call once it started moving data (``KeyboardInterrupt`` too) makes this buffer and its
  communicator unusable and sets the communicator's abort word: the peers' waits leave within microseconds (GPU)
  or a millisecond (host) with :class:`~cupy_symbuf.SymBufferAbortedError` naming this rank.

On the GPU, ``topk_idx`` entries outside ``[-1, num_experts)`` are ignored like -1 (a check would need a host
read); the host path raises ``ValueError`` for them. Experts are placed contiguously (expert ``e`` on rank
``e // num_local_experts``), as in :mod:`cupy_symbuf.moe`.

This module is the public face and the call protocol (checks made, handles, hooks, call counters, rejections told,
failures); its parts: ``low_latency_checks`` (the argument checks), ``low_latency_regions`` (the buffer map),
``low_latency_host`` (the host backend's wire) and ``low_latency_cuda`` (the kernels' argument structs and
launches). The benchmark is :func:`cupy_symbuf.bench.low_latency.bench_low_latency`.
"""
from __future__ import annotations

import operator
from typing import Any, Optional

import numpy as np

from ..transport import agree as _agree
from ..common import backend as _compat
from ..wire import protocol as P
from ..common import dtypes as _dt
from ..collectives import quant as _quant
from ..common.checks import check_int
from ..common.errors import SymBufferError, SymBufferRejectedError
from ..transport.symbuffer import SymBuffer
from ..transport.guard import collective, guarded
from ..transport.streams import check_flag as _check_flag
from .low_latency_checks import check_params, check_topk, check_weights, check_x
from .low_latency_cuda import LL_COMBINE_FIELDS, LL_DISPATCH_FIELDS, LL_SOURCE, GpuLaunches
from .low_latency_host import HostWire
from .low_latency_regions import BOTH, ITEMSIZE, KINDS, OPS, RECV, REJECTED, SEND, kind_of, regions

__all__ = ["LowLatencyBuffer", "LowLatencyHandle", "LowLatencyRecvHook", "LL_DISPATCH_FIELDS", "LL_COMBINE_FIELDS",
           "LL_SOURCE"]

#: a LowLatencyBuffer's calls take its communicator's guard: one thread at a time for both
_GUARD = operator.attrgetter("comm.engine.guard")


def _reject_unbound(which: int):
    """The ``reject`` of :func:`~cupy_symbuf.transport.guard.collective` for dispatch (0) / combine (1): a call
    Python cannot bind on this rank (a mistyped keyword) is a rejection told to the peers, as any other exception
    before the first step (:meth:`LowLatencyBuffer._tell_rejected`)."""
    def reject(buf, arguments, exc):
        if buf.world_size == 1:
            return ""
        if buf._closed or buf._broken or buf._engine.broken or buf._pending is not None:
            return None
        buf._tell_rejected(which)
        return "SymBufferRejectedError"
    return reject


class LowLatencyHandle:
    """What :meth:`LowLatencyBuffer.combine` needs from its :meth:`~LowLatencyBuffer.dispatch` (DeepEP's
    ``(recv_src_info, recv_layout_range, num_max_dispatch_tokens_per_rank, hidden, num_experts)``).

    ``src_info``: int32 ``[num_local_experts, W * N]``, source token index of each received row (rows below
    ``recv_count[e]``); ``layout_range``: int64 ``[num_local_experts, W]``, ``(begin << 32) | count`` of the rows
    from each source rank; ``recv_tokens_per_rank``: int32 ``[W]``, tokens each rank dispatched; ``inv``: int32
    ``[W, N, num_topk]``, flattened ``recv_x`` row of each (source, token, slot) naming a local expert, else -1.
    Device arrays on the GPU (no host read). ``dispatch_id``: int, the number of the dispatch that made it in the
    buffer's call sequence, the same on every rank (host path: the dispatch's flag-line sequence number; GPU: the
    dispatch calls made before it + 1, which the device's sequence equals as long as no CUDA graph was replayed: the
    kernels compare the device's own value, which each dispatch stores with its outputs). Read-only by convention (a
    plain ``__slots__`` object: one is made per dispatch, so it is cheap to build).

    Indexable as DeepEP's tuple: ``handle[0]`` = ``src_info``, ``handle[1]`` = ``layout_range``, ``handle[2]`` =
    ``num_max_dispatch_tokens_per_rank``, ``handle[3]`` = ``hidden``, ``handle[4]`` = ``num_experts`` (``len`` 5;
    unpacking works)."""

    __slots__ = ("owner", "call", "num_tokens", "num_topk", "hidden", "use_fp8", "src_info", "layout_range",
                 "recv_tokens_per_rank", "inv", "num_max_dispatch_tokens_per_rank", "num_experts", "dispatch_id",
                 "_sent")

    def __init__(self, owner, call: int, num_tokens: int, num_topk: int, hidden: int, use_fp8: bool, src_info,
                 layout_range, recv_tokens_per_rank, inv, num_max_dispatch_tokens_per_rank: int = 0,
                 num_experts: int = 0, *, dispatch_id: int = 0, sent=None) -> None:
        self.owner = owner
        self.call = call
        self.num_tokens = num_tokens
        self.num_topk = num_topk
        self.hidden = hidden
        self.use_fp8 = use_fp8
        self.src_info = src_info
        self.layout_range = layout_range
        self.recv_tokens_per_rank = recv_tokens_per_rank
        self.inv = inv
        self.num_max_dispatch_tokens_per_rank = num_max_dispatch_tokens_per_rank
        self.num_experts = num_experts
        self.dispatch_id = dispatch_id
        #: host path: the int32 [num_tokens, num_topk] top-k indices the dispatch sent (combine's must equal them;
        #: the GPU compares the dispatch's metadata in the symmetric buffer instead); None on the GPU
        self._sent = sent

    def _fields(self) -> tuple:
        return (self.src_info, self.layout_range, self.num_max_dispatch_tokens_per_rank, self.hidden,
                self.num_experts)

    def __getitem__(self, i):
        return self._fields()[i]

    def __len__(self) -> int:
        return 5

    def __iter__(self):
        return iter(self._fields())

    def __repr__(self) -> str:
        return (f"LowLatencyHandle(call={self.call}, dispatch_id={self.dispatch_id}, num_tokens={self.num_tokens}, "
                f"num_topk={self.num_topk}, "
                f"hidden={self.hidden}, use_fp8={self.use_fp8}, num_max_dispatch_tokens_per_rank="
                f"{self.num_max_dispatch_tokens_per_rank}, num_experts={self.num_experts})")


class LowLatencyRecvHook:
    """The receive phase of a :meth:`LowLatencyBuffer.dispatch` / :meth:`~LowLatencyBuffer.combine` made with
    ``return_recv_hook=True`` (DeepEP's ``hook``): calling it (no arguments, returns None) runs the receive, after
    which the call's results hold their values.

    GPU: the receive kernel is queued on the stream the call was made on (the call's send kernel is before it
    there), with no host synchronisation; its failures and a peer's rejection of the call are raised as a queued
    call's (from :meth:`LowLatencyBuffer.synchronize`, or from the hook itself with ``Config(blocking=True)``).
    Host backend: the receive runs in the call to the hook, which raises what it finds.

    Raises ``RuntimeError`` when called a second time; the errors of the call it completes (see
    :meth:`LowLatencyBuffer.dispatch`). ``done`` says whether it ran. A plain ``__slots__`` object (one per call)."""

    __slots__ = ("owner", "op", "which", "call", "done", "_ent", "_p", "_stream", "_state", "_keep")

    def __init__(self, owner, op: str, which: int, call: int, ent=None, p: int = 0, stream=None, state=None,
                 keep=()) -> None:
        self.owner = owner
        self.op = op
        self.which = which
        self.call = call
        self.done = False
        self._ent, self._p, self._stream, self._state, self._keep = ent, p, stream, state, keep

    def __call__(self) -> None:
        self.owner._receive(self)

    def __repr__(self) -> str:
        return f"LowLatencyRecvHook({self.op}, call={self.call}, done={self.done})"


class LowLatencyBuffer:
    """Low-latency MoE dispatch / combine over its own symmetric buffer (see the module docstring).

    Parameters
    ----------
    comm : Communicator
        The communicator whose ranks take part (collective over them; its abort word and error policy are shared).
    num_max_dispatch_tokens_per_rank : int
        ``N``: the most tokens any rank dispatches in one call (1 to 4096; DeepEP's name).
    hidden : int
        Elements per token; ``hidden * itemsize`` a multiple of 16 (fp8 dispatch also needs ``hidden % 128 == 0``).
    num_experts : int
        Global experts, a multiple of ``world_size``; ``num_local_experts = num_experts // world_size``.
    dtype : "bfloat16" (default), "float16" or "float32"
        Element type of ``x`` (bf16: ``ml_dtypes.bfloat16``, CuPy's bfloat16 or raw ``uint16`` bits).
    max_topk : int
        Largest ``topk_idx.shape[1]`` of a call (1 to 32; sizes the metadata areas).
    num_blocks : int, optional
        Thread blocks per kernel (GPU); default the GPU's SM count divided by the ranks sharing it.

    Memory: the symmetric buffer holds ``2 x (W x N x row)`` for dispatch and for combine (row = ``hidden x
    itemsize`` rounded to 16 bytes) plus metadata; the two output sets hold ``2 x num_local_experts x W x N x row``
    (DeepEP's ``recv_x`` shape), fp8 outputs allocated on the first fp8 call.

    Raises ``TypeError``/``ValueError`` for bad parameters (on every rank alike: the parameters are compared across
    ranks, a difference names the field and the ranks).
    """

    def __init__(self, comm, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int, *,
                 dtype="bfloat16", max_topk: int = 16, num_blocks: Optional[int] = None):
        op = "LowLatencyBuffer"
        self._closed = True
        engine = getattr(comm, "engine", None)  # the communicator's seam (transport/engine.py Engine)
        if engine is None or not callable(getattr(engine, "check_open", None)):
            raise TypeError(f"{op}: comm must be a cupy_symbuf.Communicator, got {type(comm).__name__}")
        engine.check_open()
        W = comm.world_size
        err = None
        try:
            N, H, E, K, kind, smem, num_blocks = check_params(op, W, num_max_dispatch_tokens_per_rank, hidden,
                                                              num_experts, max_topk, dtype, num_blocks)
        except (TypeError, ValueError) as exc:
            err = exc
        boot = comm.buffer.bootstrap  # the communicator's (MPI or torch.distributed)
        timeout = comm.config.timeout_s
        verdicts = _agree.exchange_all(boot, None if err is None else f"{type(err).__name__}: {err}", timeout,
                                       f"{op} construction")
        if err is not None:
            raise err
        _agree.raise_if_any_failed(verdicts, op)
        fp = {"num_max_dispatch_tokens_per_rank": N, "hidden": H, "num_experts": E, "dtype": kind, "max_topk": K,
              "num_blocks": num_blocks}
        _agree.check_agreement(_agree.exchange_all(boot, fp, timeout, f"{op} construction (parameters)"), op)
        self.comm = comm
        #: the communicator's engine: its lifecycle (check_open, broken, mark_broken) and its transport (abort word,
        #: error record and launch ledger)
        self._engine = engine
        self.rank, self.world_size, self.backend = comm.rank, W, comm.backend
        self.xp = comm.xp
        self.num_max_dispatch_tokens_per_rank = self.N = N
        self.hidden = self.H = H
        self.num_experts = E
        self.num_local_experts = self.L = E // W
        self.max_topk = K
        self.kind = kind
        self.itemsize = ITEMSIZE[kind]
        self.timeout_s = timeout
        # ---- the low-latency regions of the symmetric buffer (bytes; every area 128-aligned) ----
        for k, v in regions(W, N, H, self.itemsize, K).items():
            setattr(self, k, v)
        transport = getattr(comm, "transport", None)  # where the communicator's rings live (cuda: ipc / staged)
        self.buffer = SymBuffer(boot, self.nbytes, backend=self.backend, timeout_s=timeout,
                                transport=transport if transport in ("ipc", "staged") else "auto")
        self._dispatch_calls = 0
        self._combine_calls = 0
        #: the LowLatencyRecvHook of a call made with return_recv_hook=True whose receive has not run, else None
        self._pending = None
        self._broken = None
        #: the backend's part: the GPU launches (GpuLaunches) or the host wire (HostWire); the other is None
        self._gpu = self._host = None
        self._sets = [dict(), dict()]
        self._combine_out = [None, None]
        self._combine_in = [None, None]
        try:
            xp = self.xp
            for s in self._sets:
                s["recv_x"] = xp.zeros((self.L, W * N, H * self.itemsize), np.uint8)
                s["recv_count"] = xp.zeros(self.L, np.int32)
                s["src_info"] = xp.zeros((self.L, W * N), np.int32)
                s["layout_range"] = xp.zeros((self.L, W), np.int64)
                s["inv"] = xp.zeros((W, N, K), np.int32)
                s["recv_ntok"] = xp.zeros(W, np.int32)
            for i in range(2):
                self._combine_out[i] = xp.zeros((N, H * self.itemsize), np.uint8)
            if self.backend == "cuda":
                self._gpu = GpuLaunches(self, num_blocks, smem, self._failed)
                self.grid = self._gpu.grid
            else:
                self._host = HostWire(self)
        except BaseException:
            self.buffer.close()
            raise
        self._closed = False

    @staticmethod
    def symmetric_bytes(num_max_dispatch_tokens_per_rank: int, hidden: int, world_size: int, *,
                        dtype="bfloat16", max_topk: int = 16) -> int:
        """Bytes of the symmetric buffer a ``LowLatencyBuffer`` of these parameters allocates on every rank
        (outputs not included: ``2 x num_local_experts x W x N x row`` more, on the device)."""
        kind = kind_of(dtype)
        if kind not in KINDS:
            raise TypeError(f"LowLatencyBuffer.symmetric_bytes: dtype must be bfloat16, float16 or float32, got "
                            f"{dtype!r}")
        return regions(int(world_size), int(num_max_dispatch_tokens_per_rank), int(hidden), ITEMSIZE[kind],
                       int(max_topk))["nbytes"]

    # ---- lifecycle ---------------------------------------------------------------------------------------------
    @guarded("LowLatencyBuffer.close", guard=_GUARD)
    def close(self) -> None:
        """Free the symmetric buffer (collective, bounded by the communicator's ``timeout_s``). Idempotent. One
        thread at a time with the communicator's calls (``RuntimeError`` while another thread is inside one)."""
        if self._closed:
            return
        self._closed = True
        if self.backend == "cuda":
            _compat.cupy.cuda.runtime.deviceSynchronize()
        self.buffer.close()

    def __enter__(self) -> "LowLatencyBuffer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_usable(self) -> None:
        if self._closed:
            raise SymBufferError("LowLatencyBuffer is closed")
        if self._broken:
            raise SymBufferError(f"LowLatencyBuffer is unusable after an earlier failure: {self._broken}")
        self._engine.check_open()

    def _failed(self, exc: BaseException) -> None:
        """``exc`` (any exception, KeyboardInterrupt too) ended a call after it started moving data: this buffer
        and the communicator are unusable, and unless the transport raised it (its timeouts, mismatches and
        aborts told every rank already) the abort word is set, so the peers' waits leave at once with
        :class:`~cupy_symbuf.SymBufferAbortedError` naming this rank instead of waiting out ``timeout_s``."""
        if self._broken:
            return
        self._broken = f"{type(exc).__name__}: {exc}"
        if not isinstance(exc, SymBufferError):
            try:
                self._engine.transport.set_abort(P.ERR_LOCAL)
            except Exception:  # pragma: no cover - the original error matters more
                pass
        self._engine.mark_broken(f"low-latency mode: {self._broken}")

    def _tell_rejected(self, which: int, why: int = P.REJECT_ARGS) -> None:
        """This rank rejected its call of kind ``which`` (0 dispatch, 1 combine) before anything moved (any
        exception, KeyboardInterrupt too): take part in the call just far enough that every peer learns it (they
        raise :class:`~cupy_symbuf.SymBufferRejectedError` naming this rank and the reason ``why``, ``REJECT_*``,
        which the GPU's rejected combine launch does not carry) and every rank stays at the same call. The caller
        re-raises its own error. Nothing to tell on one rank or on a closed / failed buffer; a failure while
        telling is raised instead (the buffer is then unusable)."""
        if self._closed or self._broken or self._engine.broken or self.world_size == 1 or self._pending is not None:
            return
        try:
            if self.backend == "cuda":
                self._gpu.issue_rejected(which, why=why)
            else:
                self._host.rejected(which, why=why)
        except BaseException as exc:
            self._failed(exc)
            raise
        if self.backend == "cuda":
            # the peers' launches of this call took an output set and counted the call (queued: returned; blocking:
            # raised SymBufferRejectedError after counting it): count it here too, so every rank's call counters
            # (output set parity, handle staleness) stay equal. (Host path: no rank counts a rejected call.)
            if which == 0:
                self._dispatch_calls += 1
            else:
                self._combine_calls += 1

    def synchronize(self) -> None:
        """Wait for this rank's queued low-latency kernels (the current stream) and raise what they recorded.

        Raises
        ------
        SymBufferRejectedError
            A peer rejected a queued call (named with its rank; once): that call delivered nothing (dispatch:
            zero ``recv_count``; combine: zero rows) and the buffer stays usable.
        SymBufferTimeoutError, SymBufferMismatchError, SymBufferAbortedError
            A kernel failed (the buffer and the communicator are unusable).
        """
        self._check_usable()
        if self.backend == "cuda":
            self._gpu.check_record("synchronize", _compat.cupy.cuda.get_current_stream())
            rejected = self._gpu.status.take_rejected()
            if rejected is not None:
                raise self._gpu.status.rejected_error("synchronize", *rejected)

    @guarded("LowLatencyBuffer.reject_call", guard=_GUARD)
    def reject_call(self, kind: str) -> None:
        """Take part in the peers' next ``kind`` call of this buffer as a call this rank rejected, for a check made
        outside this buffer (a wrapper's own, as :class:`cupy_symbuf.deepep.Buffer`'s): the peers learn of it as of
        this buffer's own argument errors (see the module docstring: they raise
        :class:`~cupy_symbuf.SymBufferRejectedError` naming this rank, nothing is delivered, every rank stays at
        the same call). The caller raises its own error afterwards.

        Parameters
        ----------
        kind : ``"dispatch"`` or ``"combine"``

        Raises
        ------
        ValueError
            ``kind`` is neither (nothing moves).
        SymBufferTimeoutError, SymBufferMismatchError, SymBufferAbortedError
            Telling failed (the buffer is then unusable).

        Nothing is told on one rank, on a closed or failed buffer, or while a receive hook of this buffer is
        outstanding (the next call raises ``RuntimeError`` there anyway)."""
        which = {"dispatch": 0, "combine": 1}.get(kind)
        if which is None:
            raise ValueError(f"LowLatencyBuffer.reject_call: kind must be 'dispatch' or 'combine', got {kind!r}")
        self._tell_rejected(which)

    @guarded("LowLatencyBuffer.announce", guard=_GUARD)
    def announce(self, token: int) -> list:
        """Take part in this buffer's next dispatch without dispatching, telling every rank ``token``: the step
        through which the ranks agree on what follows before anything collective outside this buffer starts
        (:class:`cupy_symbuf.deepep.Buffer` announces a switch to another LowLatencyBuffer here, so a rank that
        asks for another one than its peers is an error on every rank at once, not a wait of ``timeout_s``).

        Collective with the peers' next dispatch or ``announce`` of this buffer: this rank's flag lines of that call
        are marked rejected (reason ``REJECT_SWITCH``) and carry ``token``, and every rank's lines are awaited. A
        peer that made an ordinary dispatch there has it rejected: nothing is delivered and it raises
        :class:`~cupy_symbuf.SymBufferRejectedError` naming this rank (host path: from the call; GPU: from
        :meth:`synchronize`, or the call with ``Config(blocking=True)``). It counts as a rejected dispatch (see
        "Rules": on the GPU a handle then lasts one dispatch less).

        Parameters
        ----------
        token : int in ``[1, 2**63)``
            Validate it alike on every rank: a bad one raises before anything moves and is not told.

        Returns
        -------
        list, indexed by rank: that rank's token; ``None`` for a rank that made an ordinary dispatch; 0 for a rank
        that rejected its own dispatch (its arguments failed its checks).

        GPU: waits for the current stream (one host synchronisation) to read the lines. On one rank: ``[token]``,
        nothing launched.

        Raises
        ------
        TypeError, ValueError
            ``token`` not an int in range.
        RuntimeError
            The receive hook of this buffer's previous call has not run (nothing moves).
        SymBufferTimeoutError, SymBufferMismatchError, SymBufferAbortedError
            The step failed (the buffer and its communicator are unusable).
        """
        op = "LowLatencyBuffer.announce"
        token = check_int(op, "token", token, minimum=1, maximum=2 ** 63 - 1)
        self._check_usable()
        self._check_no_pending(op)
        if self.world_size == 1:
            return [token]
        if self.backend == "cuda":
            self._gpu.check_record(op)  # a failure of an earlier, unawaited call surfaces here, before anything else
        try:
            if self.backend != "cuda":
                lines = self._host.rejected(0, token, P.REJECT_SWITCH)
            else:
                stream = self._gpu.issue_rejected(0, token, P.REJECT_SWITCH)
                self._dispatch_calls += 1  # (as any rejected launch: every rank counts it)
                self._gpu.check_record(op, stream)
                lines = self._gpu.dispatch_lines()
        except BaseException as exc:
            self._failed(exc)
            raise
        return [None if n != REJECTED else tag for n, tag in lines]

    # ---- receive hooks -------------------------------------------------------------------------------------------
    def _check_no_pending(self, op: str) -> None:
        """A call made with ``return_recv_hook=True`` whose hook has not run blocks the buffer's next call (of
        either kind): raised before anything moves, and not told to the peers (they make the same calls, so the same
        mistake); the hook stays callable."""
        h = self._pending
        if h is not None:
            raise RuntimeError(f"{op}: the receive hook of {h.op} call {h.call} (return_recv_hook=True) has not run: "
                               f"call it before the next low-latency call of this buffer (one call's receive may be "
                               f"outstanding per buffer)")

    @guarded("LowLatencyBuffer.receive", guard=_GUARD)
    def _receive(self, hook: LowLatencyRecvHook) -> None:
        """Run ``hook``'s receive phase (:class:`LowLatencyRecvHook`)."""
        op = hook.op
        if hook.done:
            raise RuntimeError(f"{op}: this receive hook (call {hook.call}) already ran: a hook runs its call's "
                               f"receive once")
        self._check_usable()
        if self._pending is not hook:  # pragma: no cover - a hook is the buffer's pending one until it runs
            raise RuntimeError(f"{op}: this receive hook does not belong to the buffer's outstanding call")
        hook.done = True
        self._pending = None
        which = hook.which
        try:
            if self.backend == "cuda":
                self._gpu.check_record(op)  # a failure of the send phase (or earlier) surfaces before the launch
                ent, p = hook._ent, hook._p
                self._gpu.issue(ent, p, ent.args[p], op, phase=RECV, stream=hook._stream)
            elif which == 0:
                self._host.dispatch_recv(op, *hook._state)
            else:
                self._host.combine_recv(op, *hook._state)
        except SymBufferRejectedError:  # a peer rejected the call: nothing consumed, every rank past it, usable
            raise
        except BaseException as exc:
            self._failed(exc)
            raise
        finally:
            hook._keep = hook._state = None
        if self.backend != "cuda":  # (the GPU counted the call at its send launch)
            if which == 0:
                self._dispatch_calls += 1
            else:
                self._combine_calls += 1

    def _call_state(self) -> tuple:
        """This rank's place in the call sequence: ``(dispatch calls, combine calls, dispatch launches, combine
        launches)``, ints. The first two are the host's call counters (output set parity, handle staleness), the
        last two the calls the flag-line protocol has completed (host: the ctrl lines' sequence words; GPU: the
        blocks counted in LL_CTRL_EXIT / grid, after waiting for the current stream). Between calls every rank of
        a buffer in step has the same four numbers, rejected calls included (the tests compare them across
        ranks)."""
        done = (self._gpu or self._host).calls_done()
        return self._dispatch_calls, self._combine_calls, done[0], done[1]

    # ---- validation ----------------------------------------------------------------------------------------------
    def _check_x(self, op: str, name: str, x, shape) -> Any:
        return check_x(op, name, x, shape, self.backend, self.kind)

    def _check_topk(self, op: str, topk_idx, n: Optional[int]) -> Any:
        return check_topk(op, topk_idx, n, self.backend, self.max_topk, self.num_experts)

    def _sig(self, op: str, K: int, use_fp8: bool, ue8m0: bool) -> int:
        return P.signature(op, self.kind, self.H, K, int(use_fp8), int(ue8m0))

    def _fp8_set(self, s: dict) -> None:
        if "recv_q" not in s:
            s["recv_q"] = self.xp.zeros((self.L, self.world_size * self.N, self.H), np.uint8)
            s["recv_scales"] = self.xp.zeros((self.L, self.world_size * self.N, self.H // _quant.QUANT_BLOCK),
                                             np.float32)

    # ---- dispatch --------------------------------------------------------------------------------------------------
    @collective("LowLatencyBuffer.dispatch", guard=_GUARD, reject=_reject_unbound(0))
    def dispatch(self, x, topk_idx, *, use_fp8: bool = False, round_scale: bool = False, use_ue8m0: bool = False,
                 return_recv_hook: bool = False):
        """DeepEP ``low_latency_dispatch``: send each token to the ranks of its experts, grouped per local expert.

        Parameters
        ----------
        x : array ``[num_tokens, hidden]`` of the buffer's dtype, ``num_tokens <= num_max_dispatch_tokens_per_rank``
            (0 allowed; may differ across ranks).
        topk_idx : int64 (or int32) array ``[num_tokens, num_topk]``; -1 = no expert in that slot.
        use_fp8 : bool
            Quantise to float8_e4m3fn per 128 elements on the way (:mod:`cupy_symbuf.quant`); ``hidden % 128 == 0``.
        round_scale, use_ue8m0 : bool
            Either one: fp8 scales rounded up to powers of two (still returned as float32).
        return_recv_hook : bool
            Launch only the send phase and return a :class:`LowLatencyRecvHook` as a 4th result (DeepEP's
            ``return_recv_hook``): the results hold their values only once ``hook()`` ran the receive (see the
            module docstring, "Receive hooks").

        Returns
        -------
        recv_x : ``[num_local_experts, W * N, hidden]`` of ``x``'s dtype; with ``use_fp8`` the tuple ``(x_fp8,
            scales)``: e4m3 bytes (``ml_dtypes.float8_e4m3fn`` on NumPy when installed, else ``uint8``) and float32
            ``[num_local_experts, W * N, hidden // 128]``. Expert ``e``'s rows ``0 .. recv_count[e] - 1`` hold its
            tokens ordered by (source rank, source token index); rows past the count are not defined.
        recv_count : int32 ``[num_local_experts]``.
        handle : :class:`LowLatencyHandle` for :meth:`combine` (``src_info``, ``layout_range``).
        hook : :class:`LowLatencyRecvHook`, only with ``return_recv_hook``.

        Queued on the current stream on the GPU (no host synchronisation). The outputs stay valid until the
        dispatch after the next one.

        Raises
        ------
        TypeError, ValueError
            Bad arguments (naming the argument and the rule); the peers are told (see the module docstring).
        SymBufferRejectedError
            A peer rejected this call (host path; on the GPU from :meth:`synchronize`): nothing was delivered, the
            buffer stays usable.
        SymBufferTimeoutError, SymBufferMismatchError, SymBufferAbortedError
            The call failed (the buffer and its communicator are unusable).
        RuntimeError
            The receive hook of this buffer's previous call has not run (nothing is told to the peers).
        """
        g = self._gpu
        if (g is not None and type(x) is g.fast and type(topk_idx) is g.fast and self._pending is None
                and (return_recv_hook is False or return_recv_hook is True)):
            # hot path: a call shape seen before (validated then), CuPy arrays, contiguous, on this GPU
            ent = g.fastkeys[0].get((x.shape, x.dtype, topk_idx.shape, topk_idx.dtype, use_fp8, round_scale,
                                     use_ue8m0))
            if (ent is not None and not self._closed and not self._broken and not g.st[P.STATUS_FLAG]
                    and x._c_contiguous and topk_idx._c_contiguous and x.data.device_id == g.dev
                    and topk_idx.data.device_id == g.dev):
                self._engine.check_open()
                call = self._dispatch_calls
                p = call & 1
                try:
                    stream = g.issue_dispatch(ent, p, x.data.ptr, topk_idx.data.ptr,
                                              SEND if return_recv_hook else BOTH)
                except SymBufferRejectedError:  # Config(blocking=True): a peer rejected it (zero counts in set p)
                    self._dispatch_calls = call + 1
                    raise
                except BaseException as exc:
                    self._failed(exc)
                    raise
                self._dispatch_calls = call + 1
                h = g.hsets[p]
                handle = LowLatencyHandle(self, call, ent.n, ent.K, self.H, ent.use_fp8, h[1], h[2], h[3], h[4],
                                          self.N, self.num_experts, dispatch_id=call + 1)
                if return_recv_hook:
                    hook = self._pending = LowLatencyRecvHook(self, OPS[0], 0, call, ent, p, stream,
                                                              keep=(x, topk_idx))
                    return ent.outs[p], h[0], handle, hook
                return ent.outs[p], h[0], handle
        op = OPS[0]
        self._check_usable()
        self._check_no_pending(op)
        if self.backend == "cuda":
            self._gpu.check_record(op)  # a failure of an earlier, unawaited call surfaces here, before anything else
        x_in, topk_in = x, topk_idx
        call = self._dispatch_calls
        s = self._sets[call & 1]
        ent = None
        try:  # until the call's first step, any exception is a rejection that the peers are told
            x = self._check_x(op, "x", x, (None, self.H))
            n = int(x.shape[0])
            if n > self.N:
                raise ValueError(f"{op}: x has {n} tokens, more than num_max_dispatch_tokens_per_rank ({self.N})")
            topk = self._check_topk(op, topk_idx, n)
            K = int(topk.shape[1])
            ue8m0 = bool(round_scale or use_ue8m0)
            use_fp8 = bool(use_fp8)
            if ue8m0 and not use_fp8:
                raise ValueError(f"{op}: round_scale / use_ue8m0 need use_fp8=True")
            if use_fp8 and self.H % _quant.QUANT_BLOCK:
                raise ValueError(f"{op}: use_fp8 needs hidden % {_quant.QUANT_BLOCK} == 0, got hidden = {self.H}")
            sig = self._sig(op, K, use_fp8, ue8m0)
            return_recv_hook = _check_flag(op, "return_recv_hook", return_recv_hook)
            if use_fp8:
                self._fp8_set(s)
            if self.backend == "cuda":
                if use_fp8:
                    self._fp8_set(self._sets[1 - (call & 1)])  # both sets before the blocks are built
                ent = self._gpu.entry(0, (n, K, use_fp8, ue8m0, x.dtype), x_stride=self.H * self.itemsize, n=n, k=K,
                                  use_fp8=int(use_fp8), ue8m0=int(ue8m0), sig=sig)
                if not ent.outs:
                    ent.n, ent.K, ent.use_fp8 = n, K, use_fp8
                    ent.outs = [self._dispatch_out(self._sets[q], use_fp8, x.dtype) for q in (0, 1)]
        except BaseException:
            self._tell_rejected(0)
            raise
        hook = None
        dispatch_id, sent = call + 1, None
        try:
            if self.backend == "cuda":
                stream = self._gpu.issue_dispatch(ent, call & 1, x.data.ptr, topk.data.ptr,
                                                  SEND if return_recv_hook else BOTH)
                if self._gpu.same(x_in, x) and self._gpu.same(topk_in, topk):
                    self._gpu.fastkeys[0][(x_in.shape, x_in.dtype, topk_in.shape, topk_in.dtype, use_fp8, round_scale,
                                       use_ue8m0)] = ent
                if return_recv_hook:
                    hook = LowLatencyRecvHook(self, op, 0, call, ent, call & 1, stream, keep=(x, topk))
            else:
                state, sent = self._host.dispatch_send(op, x, topk, n, K, use_fp8, ue8m0, sig)
                dispatch_id = state[0]
                if return_recv_hook:
                    hook = LowLatencyRecvHook(self, op, 0, call, state=state + (use_fp8, sig, s))
                else:
                    self._host.dispatch_recv(op, *state, use_fp8, sig, s)
        except SymBufferRejectedError:  # a peer rejected the call: nothing moved, every rank is past it, usable
            if self.backend == "cuda":  # (Config(blocking=True)) the kernel left zero counts in output set call & 1
                self._dispatch_calls = call + 1
            raise
        except BaseException as exc:
            self._failed(exc)
            raise
        if self.backend == "cuda" or hook is None:  # (host: a split call counts when its receive completes)
            self._dispatch_calls += 1
        handle = LowLatencyHandle(self, call, n, K, self.H, use_fp8, s["src_info"], s["layout_range"],
                                  s["recv_ntok"], s["inv"], self.N, self.num_experts, dispatch_id=dispatch_id,
                                  sent=sent)
        if hook is not None:
            self._pending = hook
            return self._dispatch_out(s, use_fp8, x.dtype), s["recv_count"], handle, hook
        return self._dispatch_out(s, use_fp8, x.dtype), s["recv_count"], handle

    def _dispatch_out(self, s: dict, use_fp8: bool, dtype):
        if use_fp8:
            q = s["recv_q"]
            if self.backend == "host" and _dt.float8_e4m3fn_dtype() is not None:
                q = q.view(_dt.float8_e4m3fn_dtype())
            return q, s["recv_scales"]
        return s["recv_x"].view(dtype).reshape(self.L, self.world_size * self.N, self.H)

    low_latency_dispatch = dispatch

    def next_combine_buffer(self):
        """The ``[num_local_experts, W * N, hidden]`` array (the buffer's dtype; bfloat16 as raw ``uint16`` bits)
        that the next :meth:`combine` of this buffer reads when passed as its ``x``: fill it with the experts'
        outputs in ``recv_x``'s row order and pass it (DeepEP's ``get_next_low_latency_combine_buffer`` with
        ``zero_copy=True``: no copy into the buffer). One array per parity of the combine count (DeepEP's double
        buffer), allocated on first use (``2 x`` the size of one ``recv_x`` in all)."""
        self._check_usable()
        p = self._combine_calls & 1
        if self._combine_in[p] is None:
            raw = self.xp.zeros((self.L, self.world_size * self.N, self.H * self.itemsize), np.uint8)
            dtype = {_dt.BFLOAT16: np.uint16, _dt.FLOAT16: np.float16}.get(self.kind, np.float32)
            self._combine_in[p] = raw.view(dtype).reshape(self.L, self.world_size * self.N, self.H)
        return self._combine_in[p]

    # ---- combine ---------------------------------------------------------------------------------------------------
    @collective("LowLatencyBuffer.combine", guard=_GUARD, reject=_reject_unbound(1))
    def combine(self, x, topk_idx, topk_weights, handle: LowLatencyHandle, *, return_recv_hook: bool = False):
        """DeepEP ``low_latency_combine``: bring the expert outputs back to their tokens **and apply the weights**.

        ``out[t] = sum_j topk_weights[t, j] * x[e_j, row of (this rank, t) in e_j]`` over the slots ``j`` with
        ``topk_idx[t, j] >= 0`` (the normal-mode :meth:`Communicator.combine` does not weight: it sums what it is
        given). Arithmetic, the same on both backends: each expert rank ``d`` makes ``partial_d = sum over j in
        ascending order of its experts of w * x`` (float32, multiply then add, from 0), rounded once to the dtype
        and sent back once per token; ``out[t] = sum over d ascending of float(partial_d)`` (float32 from 0),
        rounded once. A token with no expert gives 0.

        Parameters
        ----------
        x : ``[num_local_experts, W * N, hidden]`` of the buffer's dtype: the experts' outputs in ``recv_x``'s
            row order (rows past ``recv_count`` are not read).
        topk_idx : the ``[num_tokens, num_topk]`` passed to the dispatch that made ``handle`` (equal values: a copy,
            or int32, is fine; compared with what that dispatch sent, see the module docstring's "Rules").
        topk_weights : float32 ``[num_tokens, num_topk]``.
        handle : from this buffer's :meth:`dispatch`, at most two dispatches old; every rank's from the same
            dispatch (equal ``handle.dispatch_id``; compared across ranks in the flag lines).
        return_recv_hook : bool
            Launch only the send phase and return ``(combined_x, hook)``: ``combined_x`` holds its values once
            ``hook()`` ran the receive (see the module docstring, "Receive hooks"). ``x``, ``topk_idx`` and
            ``topk_weights`` must keep their values until then.

        Returns
        -------
        combined_x : ``[num_tokens, hidden]`` of ``x``'s dtype; valid until the combine after the next one. With
            ``return_recv_hook`` the pair ``(combined_x, hook)`` (:class:`LowLatencyRecvHook`).

        Raises
        ------
        TypeError, ValueError
            Bad arguments (a stale or foreign ``handle`` too; host path: a ``topk_idx`` other than the dispatch's);
            the peers are told (see the module docstring).
        SymBufferRejectedError
            As :meth:`dispatch`; also when the ranks' handles come from different dispatches (on every rank, naming
            the dispatch ids) or a rank's ``topk_idx`` differs from its dispatch's (GPU: on that rank too, naming
            itself): nothing was delivered (GPU: zero rows), the buffer stays usable.
        SymBufferTimeoutError, SymBufferMismatchError, SymBufferAbortedError, RuntimeError
            As :meth:`dispatch`.
        """
        g = self._gpu
        if (g is not None and type(x) is g.fast and type(topk_idx) is g.fast and type(topk_weights) is g.fast
                and self._pending is None and (return_recv_hook is False or return_recv_hook is True)
                and type(handle) is LowLatencyHandle and handle.owner is self
                and handle.call + 2 >= self._dispatch_calls):
            ent = g.fastkeys[1].get((x.shape, x.dtype, topk_idx.shape, topk_idx.dtype, topk_weights.shape,
                                     topk_weights.dtype))
            if (ent is not None and not self._closed and not self._broken and not g.st[P.STATUS_FLAG]
                    and ent.n == handle.num_tokens and ent.K == handle.num_topk and x._c_contiguous
                    and topk_idx._c_contiguous and topk_weights._c_contiguous and x.data.device_id == g.dev
                    and topk_idx.data.device_id == g.dev and topk_weights.data.device_id == g.dev):
                self._engine.check_open()
                call = self._combine_calls
                p = call & 1
                try:
                    stream = g.issue_combine(ent, p, x.data.ptr, topk_idx.data.ptr, topk_weights.data.ptr,
                                             g.hptrs[handle.call & 1], SEND if return_recv_hook else BOTH)
                except SymBufferRejectedError:  # Config(blocking=True): a peer rejected it (zero rows in set p)
                    self._combine_calls = call + 1
                    raise
                except BaseException as exc:
                    self._failed(exc)
                    raise
                self._combine_calls = call + 1
                if return_recv_hook:
                    hook = self._pending = LowLatencyRecvHook(self, OPS[1], 1, call, ent, p, stream,
                                                              keep=(x, topk_idx, topk_weights, handle))
                    return ent.outs[p], hook
                return ent.outs[p]
        op = OPS[1]
        self._check_usable()
        self._check_no_pending(op)
        if self.backend == "cuda":
            self._gpu.check_record(op)  # a failure of an earlier, unawaited call surfaces here, before anything else
        call = self._combine_calls
        out = self._combine_out[call & 1]
        ent = None
        why = P.REJECT_ARGS  # what the peers are told of a rejection
        try:  # until the call's first step, any exception is a rejection that the peers are told
            if not isinstance(handle, LowLatencyHandle):
                raise TypeError(f"{op}: handle must be a LowLatencyHandle from dispatch, got {type(handle).__name__}")
            if handle.owner is not self:
                raise ValueError(f"{op}: handle belongs to another LowLatencyBuffer")
            if handle.call + 2 < self._dispatch_calls:
                raise ValueError(f"{op}: handle is stale: it is from dispatch #{handle.dispatch_id} "
                                 f"(LowLatencyHandle.dispatch_id), and {self._dispatch_calls - handle.call - 1} more "
                                 f"dispatches have been made since (a handle lasts until two more dispatches)")
            x_in, topk_in, w_in = x, topk_idx, topk_weights
            x = self._check_x(op, "x", x, (self.L, self.world_size * self.N, self.H))
            n, K = handle.num_tokens, handle.num_topk
            topk = self._check_topk(op, topk_idx, n)
            if topk.shape[1] != K:
                raise ValueError(f"{op}: topk_idx must have num_topk = {K} (as in dispatch), got {topk.shape[1]}")
            if handle._sent is not None and not np.array_equal(topk, handle._sent):  # host (GPU: in the kernel)
                why = P.REJECT_TOPK
                t, j = (int(v[0]) for v in np.nonzero(topk != handle._sent))
                raise ValueError(f"{op}: topk_idx differs from the one the dispatch of this handle "
                                 f"(#{handle.dispatch_id}) sent (first at token {t}, slot {j}: {int(topk[t, j])} "
                                 f"here, {int(handle._sent[t, j])} sent): combine takes that dispatch's topk_idx "
                                 f"(equal values; a copy is fine)")
            w = check_weights(op, topk_weights, n, K, self.backend)
            sig = self._sig(op, K, False, False)
            return_recv_hook = _check_flag(op, "return_recv_hook", return_recv_hook)
            if self.backend == "cuda":
                ent = self._gpu.entry(1, (n, K, x.dtype), n=n, k=K, sig=sig)
                if not ent.outs:
                    ent.n, ent.K = n, K
                    ent.outs = [o[:n].view(x.dtype) for o in self._combine_out]
        except BaseException:
            self._tell_rejected(1, why)
            raise
        hook = None
        try:
            if self.backend == "cuda":
                stream = self._gpu.issue_combine(ent, call & 1, x.data.ptr, topk.data.ptr, w.data.ptr,
                                                 self._gpu.hptrs[handle.call & 1], SEND if return_recv_hook else BOTH)
                if self._gpu.same(x_in, x) and self._gpu.same(topk_in, topk) and self._gpu.same(w_in, w):
                    self._gpu.fastkeys[1][(x_in.shape, x_in.dtype, topk_in.shape, topk_in.dtype, w_in.shape,
                                       w_in.dtype)] = ent
                if return_recv_hook:
                    hook = LowLatencyRecvHook(self, op, 1, call, ent, call & 1, stream, keep=(x, topk, w, handle))
            else:
                state = self._host.combine_send(op, x, topk, w, n, K, handle, sig)
                if return_recv_hook:
                    hook = LowLatencyRecvHook(self, op, 1, call, state=state + (topk, n, x.dtype, out))
                else:
                    self._host.combine_recv(op, *state, topk, n, x.dtype, out)
        except SymBufferRejectedError:  # a peer rejected the call: nothing moved, every rank is past it, usable
            if self.backend == "cuda":  # (Config(blocking=True)) the kernel left zero rows in output set call & 1
                self._combine_calls = call + 1
            raise
        except BaseException as exc:
            self._failed(exc)
            raise
        if self.backend == "cuda" or hook is None:  # (host: a split call counts when its receive completes)
            self._combine_calls += 1
        if hook is not None:
            self._pending = hook
            return out[:n].view(x.dtype), hook
        return out[:n].view(x.dtype)

    low_latency_combine = combine

    def set_profile(self, ptr: int) -> None:
        """GPU diagnostics: make every later launch of this buffer's kernels stamp ``%globaltimer`` at its phase
        ends into the device array at address ``ptr`` (uint64 ``[grid][LL_PROF_STAMPS]``, one row per block; the
        phases are listed in ``cuda_src/low_latency.cu``); ``ptr = 0`` turns the stamps off. Used by
        :func:`cupy_symbuf.bench.low_latency.bench_low_latency` with ``profile=True``. Not collective; the array
        must outlive the launches.

        Raises
        ------
        RuntimeError
            On the host backend (no kernels).
        """
        if self._gpu is None:
            raise RuntimeError("LowLatencyBuffer.set_profile: the host backend has no kernels to profile")
        self._gpu.set_profile(ptr)

    def __repr__(self) -> str:
        return (f"LowLatencyBuffer(backend={self.backend!r}, rank={self.rank}/{self.world_size}, N={self.N}, "
                f"hidden={self.H}, num_experts={self.num_experts}, dtype={self.kind}, nbytes={self.nbytes})")
