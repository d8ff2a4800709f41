"""The internal interface every collective uses (``communicator.py`` for alltoall(v), ``moe/normal.py`` for dispatch and
combine): agreed plans, the count exchange, row exchanges, and the rules that keep ranks in step.

A collective runs inside :meth:`Engine.call`. Until its first communication step it may reject its arguments;
a rejection (any exception) is then told to the peers under the same call (a rejected count exchange, or rejected
call headers in every ring), so every rank raises and no ring falls out of step: the rejecting rank its own
error, the peers :class:`~cupy_symbuf.SymBufferRejectedError`. Any exception inside a transport step marks the
communicator broken (its ring counters may be out of step).
"""
from __future__ import annotations

import contextlib
import sys
from typing import Optional

import numpy as np

from ..common import backend as _compat
from ..common.address import address_of
from ..wire import protocol as P
from ..wire.plan import PlanCache, check_bytes, kernel_geometry, part_width
from ..common.errors import SymBufferError, SymBufferMismatchError, SymBufferRejectedError, mismatch_error
from .status import rejection_text

__all__ = ["Engine", "row_signature"]

#: keep_allocations_for_graph outside a capture (a null context can be entered any number of times)
_NOTHING = contextlib.nullcontext()


def row_signature(a) -> str:
    """What the rows of ``a`` must agree on across ranks: dtype and row shape (everything after axis 0). The dtype
    by its byte-order string and its name or fields: ``dtype.str`` alone is ``'<V1'`` for every ml_dtypes fp8 type
    and ``'|V8'`` for any 8-byte structured dtype."""
    dt = np.dtype(a.dtype)
    return f"{dt.str}:{dt}{tuple(a.shape[1:])}"


class _CallState:
    """``started``: a communication step ran; ``pending``: the peers are still inside the call (a step that is not
    the call's last one completed, e.g. the count exchange before the row exchange)."""

    __slots__ = ("started", "pending")

    def __init__(self):
        self.started = False
        self.pending = False


class _Call:
    """:meth:`Engine.call`'s context (one collective call): enters the guard and the call state, and on an exception
    tells the peers as the call's progress requires."""

    __slots__ = ("eng", "op", "notify", "state", "outer", "took")

    def __init__(self, eng: "Engine", op: str, notify: bool):
        self.eng, self.op, self.notify = eng, op, notify

    def __enter__(self) -> _CallState:
        eng = self.eng
        eng.check_open()
        self.took = eng.guard.enter(self.op, eng)
        state = self.state = _CallState()
        self.outer, eng._state = eng._state, state
        return state

    def __exit__(self, exc_type, exc, tb) -> bool:
        eng = self.eng
        try:
            # KeyboardInterrupt too: a rank must never fall a call behind silently
            if exc is not None and not (eng._failure() or isinstance(exc, SymBufferRejectedError) or
                                        getattr(exc, "symbuf_agreed", False)):
                # (else already failed, or an error every rank raises alike at the same step: still in step)
                eng._state = None
                state = self.state
                if not state.started:
                    eng._tell_rejected_of(exc, self.op, self.notify)  # the peers raise SymBufferRejectedError
                elif state.pending:  # between steps, the peers are inside the call: fatal, and they are told
                    eng.fail(exc)
                # after the last step (e.g. the combine reduction running out of memory): a local error, in step
        finally:
            eng._state = self.outer
            if self.took:
                eng.guard.leave()
        return False  # the exception (if any) propagates unchanged


class Engine:
    """The transport of one communicator behind the collectives: the seam every layer above ``transport/`` uses
    (``Communicator.engine``).

    Attributes ``rank``, ``world_size``, ``backend``, ``xp``, ``config``, ``layout``, ``plans``
    (:class:`~cupy_symbuf.wire.plan.PlanCache`), ``transport`` (the
    :class:`~cupy_symbuf.transport.base.Transport` the steps run on) and ``heap`` (the communicator's
    :class:`~cupy_symbuf.transport.symmetric.SymmetricHeap`).

    The engine reaches its communicator's lifecycle only through the callbacks it is given: ``check_open()``
    raises unless the communicator may be used, ``failure()`` returns why it is broken (None while it is not) and
    ``on_broken(msg)`` marks it broken.

    ``guard``: the communicator's :class:`~cupy_symbuf.transport.guard.CallGuard` (one thread at a time inside
    its calls; :meth:`call` enters it too, so every user of the engine shares it).
    """

    def __init__(self, transport, layout, config, *, rank: int, world_size: int, backend: str, heap,
                 check_open, failure, on_broken, guard=None):
        from .guard import CallGuard
        self.guard = CallGuard() if guard is None else guard
        self.transport = transport
        self.heap = heap
        self._check_open, self._failure, self._on_broken = check_open, failure, on_broken
        self.layout, self.config = layout, config
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.xp = _compat.array_module(backend)
        self.plans = PlanCache(layout, rank, host=backend == "host")
        self._epoch = 0
        self._state: Optional[_CallState] = None
        self._rows_plans = {}
        #: the collectives' memo of argument checks per exact call shape and values (read-only results; see
        #: ``collectives/alltoall.py``), so a repeated call re-checks nothing it already passed
        self.call_memo = {}
        self._notify_sigs = {}  # (op, signature text, values per rank) -> (op code, signature) of a count exchange
        #: host engine: op -> the prepared repeat call of that op's last call shape (``collectives/alltoall.py``)
        self.repeat = {}
        #: temporaries of calls captured into CUDA graphs (keep_for_graph), released with the communicator
        self.graph_keep = []
        # always-on counters (stats()): calls per plan since the last fold (a dict update per call), folded into
        # per-operation byte totals per peer when it grows or stats() is asked for
        self._calls: dict = {}
        self._totals: dict = {}
        # load counters per (role, channel, peer) and the adaptive home map (Config(adaptive=True); adaptive.py)
        from .adaptive import ChannelLoad
        self.load = ChannelLoad(world_size, rank, layout.num_channels, adaptive=config.adaptive,
                                interval=config.adaptive_interval)
        #: the GPU's work-sharing kernel counts the loads itself (device counters, device-count calls included)
        self._device_load = backend == "cuda" and config.adaptive and world_size > 1
        #: the largest ``alltoall`` (bytes of one rank's sendbuf) that goes by the small-message protocol
        #: (:meth:`run_small`), or -1: off (the host backend, one rank, ``Config.small_bytes=0``). Decided from the
        #: call's size alone, which every rank agrees on, and from the layout, which they agreed on at construction.
        peer_bytes = getattr(transport, "small_peer_bytes", 0)
        self.small_total = peer_bytes * world_size if peer_bytes else -1

    def __repr__(self) -> str:
        return f"the communicator of rank {self.rank} (world_size {self.world_size}, backend {self.backend!r})"

    # ---- lifecycle hooks ------------------------------------------------------------------------------------
    def check_open(self) -> None:
        """Raise unless the communicator may be used (closed, broken, or made by another process)."""
        self._check_open()

    @property
    def broken(self):
        """Why the communicator is unusable (a message), or None."""
        return self._failure()

    def find_symmetric(self, a):
        """``(SymmetricSegment, byte offset in it)`` when ``a`` is C-contiguous and lies wholly inside one of the
        communicator's live symmetric arrays, else None."""
        return self.heap.find(a)

    def check_live(self, op: str, name: str, a) -> None:
        """``ValueError`` naming ``name`` when ``a`` is a view of a symmetric array the communicator has freed."""
        self.heap.check_live(op, name, a)

    def _run(self, fn, *args, last: bool = True, **kwargs):
        """Run one transport step (``last``: the call's last one); an exception of any type inside it marks the
        communicator broken and tells the peers (:meth:`_step_failed`)."""
        state = self._state
        if state is not None:
            state.started = True
        try:
            out = fn(*args, **kwargs)
        except BaseException as exc:
            self._step_failed(exc)
            raise
        if state is not None:
            state.pending = not last
        return out

    def _step_failed(self, exc: BaseException) -> None:
        """What an exception out of a transport step does (:meth:`_run` and the hot paths that inline it, which call
        this only once the step raised, so their way through costs nothing more): a peer's rejection of a queued
        call (:class:`~cupy_symbuf.SymBufferRejectedError`, from ``synchronize`` or a blocking launch: the rings are
        in step, the communicator usable) nothing; anything else marks the communicator broken and tells the peers
        (:meth:`fail`). The caller re-raises ``exc``."""
        if not isinstance(exc, SymBufferRejectedError):
            self.fail(exc)

    def mark_broken(self, why: str) -> None:
        """Mark the communicator unusable (once) with the message ``why``, telling no peer: for an owner above
        (the hierarchical communicator) whose own failure leaves this communicator's ranks out of step."""
        if not self._failure():
            self._on_broken(why)

    def fail(self, exc: BaseException) -> None:
        """Mark the communicator broken after ``exc`` (once), and unless the transport already told every rank
        (its timeouts, mismatches and aborts set the abort word), set the abort word so that the peers' waits
        leave at once with an error naming this rank instead of waiting out ``timeout_s``."""
        if self._failure():
            return
        self._on_broken(f"{type(exc).__name__}: {exc}")
        if not isinstance(exc, SymBufferError):
            try:
                self.transport.set_abort(P.ERR_LOCAL)
            except Exception:  # pragma: no cover - the original error matters more
                pass

    def fatal(self, exc: BaseException) -> BaseException:
        """An error this rank found between a call's steps that its peers cannot see (e.g. more rows than the
        output capacity): mark the communicator broken and set the abort word so the peers leave at once;
        returns ``exc`` to raise."""
        if not self._failure():
            self._on_broken(f"{type(exc).__name__}: {exc}")
            try:
                self.transport.set_abort(P.ERR_LOCAL)
            except Exception:  # pragma: no cover - the original error matters more
                pass
        return exc

    # ---- one collective call -----------------------------------------------------------------------------------
    def call(self, op: str, *, notify: bool) -> "_Call":
        """Context of one collective ``op`` (``notify``: its first step is a count exchange); entering it returns
        the call's state. An exception raised before the first step is a rejection: the peers are told (they raise
        :class:`~cupy_symbuf.SymBufferRejectedError`), then it propagates unchanged. Another thread inside one of
        the communicator's calls: ``RuntimeError`` (:class:`~cupy_symbuf.transport.guard.CallGuard`), nothing told.
        (A class, not a generator context: about a microsecond less per call.)"""
        return _Call(self, op, notify)

    def reject(self, op: str, notify: bool, exc: Optional[BaseException] = None) -> None:
        """A collective whose arguments this rank rejected before its first step (the caller re-raises its own
        error after this): the peers are told, unless the communicator is already closed or broken (or belongs to
        another process). ``exc``: that error, when it is not the one being handled (see :meth:`_tell_rejected_of`)."""
        try:
            self._check_open()
        except SymBufferError:
            return
        self._tell_rejected_of(exc if exc is not None else sys.exc_info()[1], op, notify)

    def _tell_rejected_of(self, exc: Optional[BaseException], op: str, notify: bool) -> None:
        """:meth:`_tell_rejected` for a call rejected with ``exc`` (the error being handled; None: none). Where the
        peers wait in the other call form (a count exchange, or call headers: ``recv_counts`` passed on some ranks
        only), telling them finds the call-form mismatch, which every rank raises: this rank raises its own error
        first, the mismatch as its ``__context__`` (the communicator is unusable either way)."""
        try:
            self._tell_rejected(op, notify)
        except SymBufferMismatchError as told:
            if exc is None:
                raise
            exc.__context__ = told

    def _tell_rejected(self, op: str, notify: bool) -> None:
        """Take part in the call just far enough to tell every peer this rank rejected it."""
        if self.world_size == 1:
            return
        if notify:
            self._epoch += 1
            self._run(self.transport.notify, np.zeros((self.world_size, 1), np.int64), self._epoch, op,
                      op_code=P.op_code(op), status=P.HDR_REJECTED, sig=0, wait=self.backend != "cuda")
        else:
            self._run(self.transport.exchange_rows, self.plans.reject(op), [], None, [], op)

    # ---- steps ----------------------------------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        """Count exchanges this communicator has run so far (:meth:`notify`, :meth:`notify_device`, rejected ones
        included): every rank takes part in each, so the number is the same on every rank after each one (a
        captured one counts once, at its capture). A dispatch names itself by it (``DispatchHandle.dispatch_id``)."""
        return self._epoch

    def notify(self, op: str, send_meta: np.ndarray, sig_text: str = "", *, sig_what: str = "") -> np.ndarray:
        """Count exchange through the symmetric buffer (every rank calls it, also with nothing to send).

        ``send_meta`` int64 ``[world_size, M]`` (``1 <= M <= config.max_notify_ints``): row ``p`` goes to rank
        ``p``. Returns int64 ``[world_size, M]``: row ``s`` is what rank ``s`` put in its row ``self.rank``.
        Every rank sees every rank's operation, status and signature, so all raise alike: a rank that rejected
        the call -> :class:`~cupy_symbuf.SymBufferRejectedError` (communicator usable); another operation ->
        :class:`~cupy_symbuf.SymBufferMismatchError` (broken); another ``sig_text`` (dtype / row shape) ->
        ``ValueError`` (usable: nothing moved).
        """
        send_meta = np.ascontiguousarray(send_meta, dtype=np.int64)
        W = self.world_size
        if send_meta.ndim != 2 or send_meta.shape[0] != W:
            raise AssertionError(f"{op}: internal: send_meta must be [world_size={W}, M], got {send_meta.shape}")
        if not 1 <= send_meta.shape[1] <= self.config.max_notify_ints:
            raise ValueError(f"{op}: {send_meta.shape[1]} values per rank exceed Config.max_notify_ints="
                             f"{self.config.max_notify_ints} (or are 0)")
        # the number of values per rank is signed too: a peer reading more words than this rank wrote would read a
        # stale slot (e.g. dispatch with another num_experts)
        code, sig = self._notify_signature(op, sig_text, send_meta.shape[1])
        if self.backend == "cuda":
            self._check_not_capturing(op)
        self._epoch += 1
        out = self._run(self.transport.notify, send_meta, self._epoch, op, op_code=code, status=P.HDR_OK, sig=sig,
                        last=False)
        return self._check_notify(op, out, code, sig, sig_text, sig_what)

    def _notify_signature(self, op: str, sig_text: str, num_values: int) -> tuple:
        """``(op code, signature)`` of a count exchange, remembered per (op, signature text, values per rank)."""
        key = (op, sig_text, num_values)
        cs = self._notify_sigs.get(key)
        if cs is None:
            cs = P.op_code(op), P.signature(op, sig_text, num_values)
            if len(self._notify_sigs) >= 256:
                self._notify_sigs.clear()
            self._notify_sigs[key] = cs
        return cs

    def notify_device(self, op: str, meta, num_values: int, sig_text: str, *, table, sums, local_reject=None,
                      scale: int = 1, capacity: int = -1, worst: bool = False, sig_what: str = "",
                      self_error=None, capturing=None, layout=None):
        """The count exchange of a device-count call (GPU; array arguments may be device addresses as ints): the
        values ``meta`` (device int64 ``[W, num_values]``,
        made by a kernel: the host never sees them) go to the peers; the kernel writes the counts tables
        ``table`` (device int64 ``[2 * CT_WORDS]``: this call's and the reverse call's) and ``sums`` (device int64
        ``[num_values]``: each value summed over the sources). ``worst``: nothing is read on the host (the call
        can be captured in a CUDA graph); the kernel checks status, op and signature itself and a rejection or
        a signature difference is reported by ``synchronize``; rows received beyond ``capacity`` are fatal.
        Otherwise the host waits once, checks as :meth:`notify` and returns ``(recv_values, sent_values)``, int64
        ``[W, num_values]`` each. ``self_error()``: the exception this rank raises when ``local_reject`` (a device
        word) made it reject the call (the peers raise :class:`~cupy_symbuf.SymBufferRejectedError`).
        ``capturing``: :meth:`capture_state`'s answer when the caller has it (None: asked). ``layout`` (not with
        ``worst``): an eager MoE dispatch whose layout kernel writes ``meta`` and ``local_reject`` in the same launch
        (:meth:`CudaTransport.notify_layout_device`'s tuple: the layout's arguments)."""
        code, sig = self._notify_signature(op, sig_text, num_values)
        if not worst:
            self._check_not_capturing(op, capturing)
        self._epoch += 1
        tr = self.transport
        if layout is not None:  # (eager: echo, no device checks, scale 1)
            self._run(tr.notify_layout_device, layout, num_values, op, op_code=code, sig=sig, meta=address_of(meta),
                      bad=address_of(local_reject), sums=address_of(sums), table=address_of(table), capacity=capacity,
                      last=False)
        else:
            self._run(tr.notify_device, address_of(meta), num_values, op, op_code=code, status=P.HDR_OK, sig=sig,
                      local_reject=address_of(local_reject), echo=not worst, sums=address_of(sums),
                      table=address_of(table), scale=scale, capacity=capacity, device_checks=worst, last=False)
        if worst:
            return None
        out = self._run(tr.notify_result, op, num_values, last=False)
        if self_error is not None and out[self.rank, 1] == P.HDR_REJECTED:
            err = self_error()
            err.symbuf_agreed = True  # the peers raise SymBufferRejectedError from the same count exchange
            raise err
        recv = self._check_notify(op, out, code, sig, sig_text, sig_what)
        return recv, tr.sent_meta(num_values)

    def capture_state(self) -> tuple:
        """``(current CuPy stream, whether it is being captured into a CUDA graph)`` (GPU: one
        ``cudaStreamIsCapturing``), ``(None, False)`` on the host: a call asks once and hands both down
        (:meth:`keep_for_graph`, :meth:`keep_allocations_for_graph`, the launches)."""
        if self.backend != "cuda":
            return None, False
        stream = _compat.cupy.cuda.get_current_stream()
        return stream, stream.is_capturing()

    def keep_for_graph(self, *objs, capturing=None) -> None:
        """While the current stream is being captured into a CUDA graph, keep ``objs`` (temporaries a captured kernel
        reads or writes: int64 copies, contiguous copies, rows returned for the reduction) alive until
        :meth:`Communicator.close`, so that replays never touch memory the pool gave to someone else. Outside a
        capture: nothing (one ``cudaStreamIsCapturing``, none when the caller passes ``capturing``:
        :meth:`capture_state`)."""
        if capturing is None:
            capturing = self.capture_state()[1]
        if capturing:
            self.graph_keep.extend(o for o in objs if o is not None)

    def keep_allocations_for_graph(self, capturing=None):
        """A context: while the current stream is being captured into a CUDA graph, every device allocation this
        thread makes inside it is kept until :meth:`Communicator.close`, as :meth:`keep_for_graph` keeps named
        objects: the call's temporaries, and the workspaces CuPy's reductions and scans allocate and free inside
        one array operation (CUB's temporary storage), which no reference reaches. A replay then never reads or
        writes memory the pool gave to someone else. Outside a capture: nothing (one ``cudaStreamIsCapturing``,
        none when the caller passes ``capturing``: :meth:`capture_state`)."""
        if capturing is None:
            capturing = self.capture_state()[1]
        if not capturing:
            return _NOTHING
        cuda = _compat.cupy.cuda
        allocate, keep = cuda.get_allocator(), self.graph_keep

        def allocate_and_keep(nbytes):
            mem = allocate(nbytes)
            keep.append(mem)
            return mem
        return cuda.using_allocator(allocate_and_keep)

    def _check_not_capturing(self, op: str, capturing=None) -> None:
        """An eager count exchange reads the counts on the host: it cannot run inside a CUDA graph capture. Every
        rank capturing the same program raises alike before any step (nothing queued, the communicator usable).
        ``capturing``: :meth:`capture_state`'s answer when the caller has it (None: asked). ``layout`` (not with
        ``worst``): an eager MoE dispatch whose layout kernel writes ``meta`` and ``local_reject`` in the same launch
        (:meth:`CudaTransport.notify_layout_device`'s tuple: the layout's arguments)."""
        if capturing is None:
            capturing = self.capture_state()[1]
        if capturing:
            err = RuntimeError(f"{op}: this call reads its receive counts on the host and cannot be captured in a CUDA "
                               f"graph; capture the worst-case form instead (dispatch(..., num_worst_tokens=N), "
                               f"alltoallv(..., recv_capacity=N)) or a cached dispatch / combine with a handle")
            err.symbuf_agreed = True
            raise err

    def push_targets(self, outs) -> Optional[tuple]:
        """MODE_PUSH (GPU MoE dispatch into symmetric outputs, ``dispatch(out=...)``): which of the C-contiguous
        receive arrays ``outs`` (one per row part, at their full capacity: never cut to this call's rows, which
        only this rank knows) the peers can write into themselves: ``(ids, rows, sig)`` with ``ids`` the symmetric
        segment id of each part (-1: through the ring), ``rows`` the rows the pushed parts hold (a peer's run
        past them is a fatal capacity error in the kernel) and ``sig`` the text every rank's row signature gets
        (segment, byte offset and row bytes of each pushed part: the ranks must lay their outputs out alike, and
        a difference is a signature mismatch on every rank, never a write elsewhere); or None: rings only (host
        backend, ``Config.mode="ring"``, one rank, or no part is a registered symmetric array)."""
        if self.backend != "cuda" or self.config.mode == "ring" or self.world_size == 1:
            return None
        ids, where, rows = [], [], []
        for i, a in enumerate(outs):
            sym = self.heap.find(a)
            if sym is not None and sym[0].registered:
                ids.append(sym[0].id)
                rows.append(int(a.shape[0]))
                where.append(f"{i}:{sym[0].id}:{sym[1]}:{a.nbytes // max(1, a.shape[0])}")
            else:
                ids.append(-1)
        if not where:
            return None
        return ids, min(rows), "|push=" + ";".join(where)

    def exchange_rows_device(self, op: str, send_parts, send_index, recv_parts, sig_text: str, table, *,
                             row_run: bool = True, direct=None, push=None, tag: int = 0, plan=None,
                             stream=None) -> None:
        """Row exchange of a device-count call (GPU): like :meth:`exchange_rows`, the units to and from each peer
        read by the kernel from the counts table at device address ``table`` (:meth:`notify_device`): rows
        (``row_run``) or bytes (one part without index: a byte run, the table scaled by the row bytes).
        ``direct``: :meth:`direct_source` (a byte run only). ``push``: ``(ids, rows)`` of :meth:`push_targets`
        (its ``sig`` already in ``sig_text``): the peers write those receive parts straight into ``recv_parts``.
        ``tag``: as in :meth:`exchange_rows` (a launch captured in a CUDA graph keeps it: every replay carries the
        tag of its capture). ``plan``: :meth:`device_plan` of these arguments, when the caller kept it (a repeated call
        of one shape); ``stream``: the current stream, when the caller has it (:meth:`capture_state`)."""
        if plan is None:
            plan = self.device_plan(op, sig_text, send_parts, send_index is not None, row_run)
        rejected = self._run(self.transport.exchange_rows, plan, send_parts, send_index, recv_parts, op,
                             direct if not row_run else None, counts=int(table), push=push, tag=tag, stream=stream)
        self._count(plan)
        if rejected:
            self._raise_rejected(op, rejected)

    def prepare_rows_device(self, op: str, sig_text: str, send_parts, recv_parts, has_index: bool) -> tuple:
        """``(plan, launch)`` of :meth:`exchange_rows_device` (rows) for these arguments and their row strides, for a
        caller that keeps it for repeated calls of one shape (:meth:`launch_rows_device`)."""
        plan = self.device_plan(op, sig_text, send_parts, has_index)
        return plan, self.transport.prepare(plan, send_parts, recv_parts)

    def launch_rows_device(self, op: str, prepared: tuple, send_ptrs, recv_ptrs, index_ptr, table: int, *, tag: int,
                           stream) -> None:
        """:meth:`exchange_rows_device` of a call whose :meth:`prepare_rows_device` the caller kept: parts of the
        same dtypes, row widths and row strides, given by address (``index_ptr``: the int64 C-contiguous send
        index's, None without one); ``stream``: the current stream. The same descriptor, step and checks."""
        plan, launch = prepared
        rejected = self._run(self.transport.launch_prepared, op, plan, launch, send_ptrs, recv_ptrs, index_ptr,
                             table, tag, stream)
        self._count(plan)
        if rejected:
            self._raise_rejected(op, rejected)

    def repeat_prepare(self, op: str, prepared: tuple, index_ptr, table: int, *, tag: int):
        """The fast form of :meth:`launch_rows_device` for a caller's repeated calls of one shape (GPU): a launch of
        :meth:`prepare_rows_device`'s ``prepared`` with a descriptor of its own in which the send index
        (``index_ptr``, None: none), the counts table and the tag stay written
        (:class:`~cupy_symbuf.transport.cuda.RepeatLaunch`); None where the calls must go through
        :meth:`launch_rows_device` (one rank). Run it with :meth:`launch_repeat`."""
        plan, launch = prepared
        return self.transport.repeat_prepare(op, plan, launch, index_ptr, int(table), tag)

    def launch_repeat(self, rep, ptrs, stream) -> None:
        """:meth:`launch_rows_device` of a call whose :meth:`repeat_prepare` the caller kept: ``ptrs`` the addresses
        of its send parts then its receive parts, ``stream`` the current stream. The same descriptor, ledger entry
        and checks; an exception inside the launch marks the communicator broken (as :meth:`_run`), a peer's
        rejection (``Config.blocking``) raises :class:`~cupy_symbuf.SymBufferRejectedError`. It enters no call
        state: the caller has made every check that could reject the call (a call of its record's shape can fail
        none), and tells the peers itself when something before this launch fails (:meth:`reject`)."""
        try:
            rejected = self.transport.fire_repeat(rep, ptrs, stream)
        except BaseException as exc:
            self._step_failed(exc)
            raise
        self._count(rep.plan)
        if rejected:
            self._raise_rejected(rep.op, rejected)

    def small_prepare(self, plan, nbytes: int) -> tuple:
        """What :meth:`run_small` of ``plan`` for a sendbuf of ``nbytes`` bytes hands the transport besides the
        addresses (GPU; kept by a caller for repeated calls of one shape, run by :meth:`run_small_repeat`)."""
        return self.transport.small_prepare(plan, nbytes)

    def run_small_repeat(self, prepared: tuple, send_ptr: int, recv_ptr: int, stream) -> None:
        """:meth:`run_small` of a C-contiguous sendbuf at ``send_ptr`` into ``recv_ptr`` with its
        :meth:`small_prepare`, on ``stream`` (the current stream); no call state, as :meth:`launch_repeat`."""
        try:
            rejected = self.transport.fire_small(prepared, send_ptr, recv_ptr, stream)
        except BaseException as exc:
            self._step_failed(exc)
            raise
        plan = prepared[0]
        self._count(plan)
        if rejected:
            self._raise_rejected(plan.op, rejected)

    def device_plan(self, op: str, sig_text: str, send_parts, has_index: bool, row_run: bool = True):
        """The plan :meth:`exchange_rows_device` runs for these arguments (cached by the plan cache; a caller may keep
        it for repeated calls of the same shape and signature)."""
        return self.plans.device(op, sig_text, [part_width(a) for a in send_parts], has_index, row_run)

    def _check_notify(self, op, out, code, sig, sig_text, sig_what):
        if out[:, :3].tolist() == [[code, P.HDR_OK, sig]] * len(out):  # every rank's header as this rank's
            return out[:, P.NOTIFY_HDR_WORDS - 1:]
        ops, status, sigs = out[:, 0], out[:, 1], out[:, 2]
        if (status == P.HDR_REJECTED).any():
            who = int(np.flatnonzero(status == P.HDR_REJECTED)[0])
            raise SymBufferRejectedError(
                f"{op}: {rejection_text(who)}; nothing was exchanged and the communicator stays usable",
                rank=self.rank, rejecting_rank=who, op=op)
        if (ops != code).any():
            who = int(np.flatnonzero(ops != code)[0])
            err = mismatch_error(op, self.rank, who, -1, P.FIELD_OP, code, int(ops[who]))
            self._on_broken(str(err))
            raise err
        if (sigs != sig).any():
            who = int(np.flatnonzero(sigs != sig)[0])
            what = (sig_what() if callable(sig_what) else sig_what) or f"every rank must send rows of the same dtype and row shape; this rank has {sig_text}"
            err = ValueError(f"{op}: {what}, but rank {who} does not (no data was sent)")
            err.symbuf_agreed = True  # every rank raises it from the same count exchange: the call ends in step
            raise err
        return out[:, P.NOTIFY_HDR_WORDS - 1:]

    @staticmethod
    def check_size(op: str, name: str, counts, x) -> None:
        """The size check of a plan, made on this rank's own counts before a count exchange (so that a failure is
        a rejection told to the peers, not a rank falling out of the call after it)."""
        check_bytes(op, name, counts, part_width(x))

    def rows_plan(self, op: str, x, counts: np.ndarray, direct: bool = False):
        """The plan of an equal-blocks call (``alltoall``: one row of ``x`` to and from every rank), cached by
        shape, dtype and mode: the per-call path does no planning at all."""
        key = (op, x.shape, x.dtype, direct)
        plan = self._rows_plans.get(key)
        if plan is None:
            plan = self.plans.get(op, row_signature(x), [part_width(x)], False, counts, counts, direct)
            if len(self._rows_plans) >= 64:
                self._rows_plans.clear()
            self._rows_plans[key] = plan
        return plan

    def direct_source(self, op: str, send_parts, send_index):
        """How this rank's peers can copy this call's rows straight out of its sendbuf, or None (the rings).

        One send part in row order (a byte run), ``Config.mode`` other than ``"ring"``:
        ``(MODE_DIRECT, SymmetricSegment, byte offset in it)`` when the part lies in a symmetric array
        (``Communicator.empty``; GPU: in a segment with a row of the symmetric table, ``SYM_TABLE_ROWS`` segments);
        else, host engine only,
        ``(MODE_CMA, pid, address)`` for a C-contiguous plain array of at least ``CMA_MIN_BYTES`` per peer (any
        size with ``Config.mode="direct"``) when every rank can read every other's memory by cross-memory attach
        (probed at construction). Either way one copy per byte, and the call returns (GPU: its kernel ends) once
        every peer has copied. ``Config.mode="direct"`` makes a call that cannot go direct a ``ValueError`` (a
        rejection; the peers are told) instead of a fallback to the rings."""
        for a in send_parts:
            self.heap.check_live(op, "sendbuf", a)
        mode = self.config.mode
        if mode == "ring":
            return None
        found = None
        if send_index is None and len(send_parts) == 1:
            x = send_parts[0]
            sym = self.heap.find(x)
            if sym is not None and (self.backend == "host" or sym[0].registered):
                found = (P.MODE_DIRECT,) + sym
            elif self.backend == "host" and self.transport.cma_pids is not None and x.flags.c_contiguous and \
                    (mode == "direct" or x.nbytes >= P.CMA_MIN_BYTES * self.world_size):
                found = (P.MODE_CMA, self.transport.cma_pids[self.rank], address_of(x))
        # copy_engine: the peers pull an alltoall of CE_MIN_BYTES per peer from where this rank's rows would lie
        # in their symmetric array, so a plain sendbuf of that size is refused (told to them) instead
        must = mode == "direct" or (mode == "copy_engine" and op == "alltoall" and self.backend == "cuda" and
                                    self.world_size > 1 and
                                    sum(a.nbytes for a in send_parts) // self.world_size >= P.CE_MIN_BYTES)
        if found is None and must and sum(a.nbytes for a in send_parts) > 0:
            why = ("its rows are gathered through an index" if send_index is not None or len(send_parts) != 1
                   else "sendbuf is not a C-contiguous symmetric array of this communicator (Communicator.empty)" +
                   (", and cross-memory attach is not available between these ranks" if self.backend == "host" else
                    f" in a segment with a row of the GPU's symmetric table (SYM_TABLE_ROWS = {P.SYM_TABLE_ROWS} "
                    f"segments; {len(self.heap.segments)} live, holding {len(self.heap.allocations)} arrays); the "
                    f"GPU path reads plain arrays only through the rings"))
            raise ValueError(f"{op}: Config.mode={mode!r} but this call cannot move its rows directly: {why}")
        return found

    def run(self, plan, send_parts, send_index, recv_parts, direct=None, relaxed: bool = False) -> None:
        """Run ``plan`` on the transport (the hot path of a validated call); raises
        :class:`~cupy_symbuf.SymBufferRejectedError` when a peer rejected the call (see :meth:`exchange_rows`).
        ``direct``: :meth:`direct_source` (``plan.direct`` must say the same); ``relaxed``: see
        :func:`check_sync`."""
        if direct is None:  # (the rings: no mode to pass, nothing a relaxed call defers)
            rejected = self._run(self.transport.exchange_rows, plan, send_parts, send_index, recv_parts, plan.op)
        else:
            rejected = self._run(self.transport.exchange_rows, plan, send_parts, send_index, recv_parts, plan.op,
                                 direct, **self._relaxed(relaxed, direct))
        self._count(plan)
        if rejected:
            self._raise_rejected(plan.op, rejected)

    def prepare_exchange(self, plan):
        """Host engine: ``plan``'s exchange made ready for :meth:`run_prepared` (the transport's
        ``prepare_exchange``), or None when the transport does not run it that way (see
        ``HostTransport.prepare_exchange``; a device transport has none)."""
        prepare = getattr(self.transport, "prepare_exchange", None)
        return prepare(plan) if prepare is not None else None

    def run_prepared(self, prep, op: str, x_addr: int, out, out_addr: int) -> None:
        """Run a prepared call (:meth:`prepare_exchange`) of a C-contiguous send part at ``x_addr`` into the
        C-contiguous ``out`` at ``out_addr`` (the plan's shapes: the caller's contract), as :meth:`run` runs its plan:
        the same headers, checks, counters and errors."""
        state = self._state
        if state is not None:
            state.started = True
        try:  # (_run, inline)
            rejected = self.transport.run_prepared(prep, op, x_addr, out, out_addr)
        except BaseException as exc:
            self._step_failed(exc)
            raise
        if state is not None:
            state.pending = False
        n = self._calls.get(prep.plan)  # (_count, inline for a plan counted before)
        if n is None:
            self._count(prep.plan)
        else:
            self._calls[prep.plan] = n + 1
            load = self.load
            load.calls_total += 1
            if load.adaptive:
                self._adapt()
        if rejected:
            self._raise_rejected(op, rejected)

    def run_small(self, plan, x, recv) -> None:
        """Run the ``alltoall`` ``plan`` of ``x`` (``[world_size, ...]``, at most :attr:`small_total` bytes) into
        ``recv`` (C-contiguous, its shape and dtype) by the small-message protocol (GPU,
        ``transport.exchange_small``): one launch, no ring. Raises
        :class:`~cupy_symbuf.SymBufferRejectedError` when a peer rejected the call (``Config.blocking``; a queued
        call reports it from ``synchronize``)."""
        rejected = self._run(self.transport.exchange_small, plan, x, recv)
        self._count(plan)
        if rejected:
            self._raise_rejected(plan.op, rejected)

    # ---- counters ---------------------------------------------------------------------------------------------
    def _count(self, plan) -> None:
        n = self._calls.get(plan)
        self._calls[plan] = 1 if n is None else n + 1
        if n is None and len(self._calls) > 256:
            self._fold()
        self.load.calls_total += 1
        if self.load.adaptive:
            self._adapt()

    def _adapt(self) -> None:
        """Config(adaptive=True), after every ring exchange: every ``adaptive_interval`` eager calls, re-balance
        the home map from the loads since the last re-balance and hand it to the transport (the GPU's from its
        device counters, read asynchronously: the map follows the loads of about one interval before). A call
        being captured into a CUDA graph is not counted (the graph keeps the map of its capture)."""
        if self.backend == "cuda" and _compat.cupy.cuda.get_current_stream().is_capturing():
            return
        if not self.load.due():
            return
        if self._device_load:
            totals = self.transport.load_snapshot()
            if totals is None:  # the first snapshot is still on its way: try again next interval
                self.load.calls = 0
                return
        else:
            self._fold()
            totals = self.load.totals
        if self.load.rebalance(totals):
            self.transport.set_home(self.load)

    def channel_stats(self, reset: bool = False) -> dict:
        """See :meth:`Communicator.channel_stats`."""
        if self.backend == "cuda" and _compat.cupy.cuda.get_current_stream().is_capturing():
            raise RuntimeError("channel_stats: not while a CUDA graph is being captured (it waits for the queued "
                               "kernels); call it outside the capture")
        self._fold()
        if self._device_load:
            totals = self.transport.load_totals()
        else:
            totals = self.load.totals
        out = self.load.stats(totals, work_sharing=self._device_load and kernel_geometry(self.world_size).ring_warps > 1,
                              detailed=self.load.adaptive)
        if reset:
            if self._device_load:
                self.transport.load_reset()
            self.load.reset()
        return out

    def _fold(self) -> None:
        W = self.world_size
        detailed = self.load.adaptive and not self._device_load  # the GPU's work-sharing kernel counts itself
        for plan, n in self._calls.items():
            self.load.add_plan(plan, n, detailed=detailed)
        for plan, n in self._calls.items():
            t = self._totals.get(plan.op)
            if t is None:
                t = self._totals[plan.op] = {"calls": 0, "bytes_sent": np.zeros(W, np.int64),
                                             "bytes_received": np.zeros(W, np.int64), "calls_device_counts": 0}
            t["calls"] += n
            if plan.device_counts:
                t["calls_device_counts"] += n  # the units are in a device table the host never reads
            elif not plan.reject:
                unit = 1 if plan.byte_run else plan.row_bytes
                t["bytes_sent"] += n * unit * plan.send_units
                t["bytes_received"] += n * unit * plan.recv_units
        self._calls.clear()

    def stats(self, reset: bool = False) -> dict:
        """See :meth:`Communicator.stats`."""
        self._fold()
        out = {op: {"calls": t["calls"], "bytes_sent": t["bytes_sent"].tolist(),
                    "bytes_received": t["bytes_received"].tolist(), "calls_device_counts": t["calls_device_counts"]}
               for op, t in sorted(self._totals.items())}
        if reset:
            self._totals.clear()
        return out

    def _raise_rejected(self, op: str, rejected) -> None:
        who = int(rejected[0])
        raise SymBufferRejectedError(
            f"{op}: {rejection_text(who)}; the rows from rank {who} were not delivered (on the host path the other "
            f"ranks' rows may already be in this rank's output); the communicator stays usable",
            rank=self.rank, rejecting_rank=who, op=op)

    def _relaxed(self, relaxed: bool, direct) -> dict:
        """The transport keyword of ``sync="relaxed"``: only the host engine defers anything (its direct-mode
        senders' wait for the peers' heads); on the GPU a relaxed call runs as a strong one (a stronger guarantee
        than asked)."""
        return {"relaxed": True} if relaxed and direct is not None and self.backend == "host" else {}

    def exchange_rows(self, op: str, send_parts, send_index, send_counts: np.ndarray, recv_parts,
                      recv_counts: np.ndarray, sig_text: str, direct=None, relaxed: bool = False, *,
                      tag: int = 0) -> None:
        """Row exchange (both backends): a sent row is the concatenation of row ``send_index[r]`` (or ``r``) of
        every array of ``send_parts`` (``[n, ...]``, rows contiguous, any row stride), rows grouped by destination;
        received rows are split into the C-contiguous ``recv_parts`` in order. Counts int64 ``[W]``. ``sig_text``:
        what the peers' rows must agree on (dtype and row shape), checked by every receiver in the call header.
        ``tag``: a number every rank must pass alike, folded into that check without a new plan (the id of the
        dispatch whose handle a combine or cached dispatch uses; 0: none): a peer with another tag is a
        :class:`~cupy_symbuf.SymBufferMismatchError` on the signature, found by every receiver of its headers.
        Raises :class:`~cupy_symbuf.SymBufferRejectedError` when a peer rejected the call (the host path, or
        ``Config.blocking``; queued GPU calls report it from :meth:`Communicator.synchronize`). ``direct``:
        :meth:`direct_source` of the send parts (this rank then sends in direct mode).
        """
        for a in list(send_parts) + list(recv_parts):
            if not (a.flags.c_contiguous or (a.ndim == 2 and (a.shape[1] <= 1 or a.strides[1] == a.dtype.itemsize))):
                raise AssertionError(f"{op}: internal: part of shape {a.shape} strides {a.strides} has no "
                                     f"contiguous rows")
        plan = self.plans.get(op, sig_text, [part_width(a) for a in send_parts], send_index is not None,
                              send_counts, recv_counts, direct is not None)
        rejected = self._run(self.transport.exchange_rows, plan, send_parts, send_index, recv_parts, op,
                             *(() if direct is None else (direct,)), tag=tag, **self._relaxed(relaxed, direct))
        self._count(plan)
        if rejected:
            self._raise_rejected(op, rejected)

    def counts_meta(self, counts, num_rows: int, meta, bad) -> None:
        """Capacity mode's count check on the device (GPU; arrays or device addresses): queue the check of
        ``counts`` (int64 ``[W]``, rows to each rank) against ``num_rows`` on the current stream, writing them as
        the count exchange's values ``meta`` (int64 ``[W]``) and ``bad`` (int64 ``[2]``: 1 when a count is
        negative or the sum differs, then the first negative count's rank or -1), the ``local_reject`` word of
        :meth:`notify_device`. Local, no communication step: a rejection after it is still told to the peers."""
        self.transport.counts_meta(address_of(counts), num_rows, address_of(meta), address_of(bad))


SYNC_MODES = ("strong", "relaxed")


def check_sync(op: str, sync) -> bool:
    """Validate a collective's ``sync`` argument; True for ``"relaxed"``.

    ``"strong"`` (default): the call returns with every peer done with this call's buffers: the caller may
    overwrite ``sendbuf`` at once. ``"relaxed"``: the call returns once this rank has received every row and sent
    every header, possibly while peers still copy rows straight out of its ``sendbuf`` (direct / cross-memory
    attach modes; the rings hold their own copy); the caller must not modify ``sendbuf`` until its next collective
    on this communicator returns (which first waits for those copies) or :meth:`Communicator.synchronize`. Saves
    the trailing wait for the slowest peer's copy (NCCL / MPI ``Isend``-style buffer ownership). On the GPU path
    and through the rings a relaxed call behaves as a strong one. ``ValueError`` for another value."""
    if sync not in SYNC_MODES:
        raise ValueError(f"{op}: argument 'sync' must be one of {SYNC_MODES}, got {sync!r}")
    return sync == "relaxed"


