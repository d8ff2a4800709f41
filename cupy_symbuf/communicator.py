"""``Communicator``: all-to-all collectives over the channel ring buffers of one :class:`SymBuffer`."""
from __future__ import annotations

import operator as _operator
import os as _os
import sys as _sys
import warnings as _warnings
from os import getpid as _getpid
from typing import Optional

import numpy as np

from .common import backend as _compat
from .collectives.alltoall import alltoall as _alltoall, alltoallv as _alltoallv, counts_first as _counts_first
from .collectives import mpi_shaped as _mpi_shaped
from .moe import normal as _moe
from .transport.streams import run_collective as _run_collective
from .common.checks import as_array
from .common.config import Config
from .common.errors import SymBufferClosedError, SymBufferError, SymBufferLeakWarning
from .wire.channel_layout import ChannelLayout
from .transport.bootstrap import as_bootstrap
from .transport.symbuffer import SymBuffer, gpu_identity, resolve_backend
from .transport.guard import CallGuard, collective as _collective, guarded as _guarded

__all__ = ["Communicator"]

from .transport.agree import LOCAL_POLICY_FIELDS as _LOCAL_POLICY  # noqa: E402
from .common.log import logger as _logger  # noqa: E402


def planned_transport(requested: str, backend: str, places) -> str:
    """The transport (``"ipc"`` / ``"staged"``) the cuda buffer of these ranks will be built with, computed before it
    exists, as :class:`~cupy_symbuf.SymBuffer` computes it (:func:`~cupy_symbuf.symbuffer.choose_transport` over
    the ranks' topology records ``places``, one per rank): the tuning table's key depends on it. ``"ipc"`` on the
    host backend, and where the choice raises (the buffer's construction then raises the same on every rank).
    An IPC handle that fails to open later can still make the buffer staged (logged by the Communicator)."""
    if backend != "cuda":
        return "ipc"
    from .transport.symbuffer import choose_transport
    from .transport.topology import Topology
    try:
        topo = None if requested == "staged" or len(places) <= 1 else Topology("cuda", list(places))
        return choose_transport(requested, topo)[0]
    except Exception:  # noqa: BLE001 - SymBuffer raises it below, agreed on every rank
        return "ipc"


# ---- the entry of every collective method (transport/guard.py): one thread at a time, and a call whose arguments
# Python cannot bind (a mistyped keyword) told to the peers before the TypeError is raised
_GUARD = _operator.attrgetter("_guard")
_TOLD = "SymBufferRejectedError naming this rank"


def _told_by_engine(op: str, notify_of):
    """The rejection of a collective that runs on the engine: ``notify_of(arguments)`` says whether its first step
    is a count exchange (None: the call does not communicate)."""
    def reject(c, arguments, exc):
        notify = notify_of(arguments)
        if notify is None:
            return ""
        if c.closed or c._broken:
            return None
        c.engine.reject(op, notify)
        return _TOLD if c.world_size > 1 else ""
    return reject


def _alltoallv_notify(a) -> bool:
    """Whether an alltoallv call starts with the count exchange (``collectives/alltoall.py`` ``counts_first``)."""
    return _counts_first(a.get("recv_counts"))


def _told_by_heap(what: str):
    """The rejection of a symmetric allocation: its agreement step carries this rank's error (the peers raise
    ``ValueError`` naming this rank; nothing is allocated)."""
    def reject(c, arguments, exc):
        try:
            c._heap.empty((), np.uint8, what, err=exc)
        except BaseException as e:  # the heap raises exc itself after telling the peers
            if e is not exc:
                raise
        return "ValueError naming this rank; nothing was allocated" if c.world_size > 1 else ""
    return reject


def _told_free(c, arguments, exc):
    try:
        c._heap.free(None)  # the peers see this rank free no allocation: ValueError on every rank
    except ValueError:
        pass
    return "ValueError; nothing was freed" if c.world_size > 1 else ""


#: this file's folder: frames inside the package are skipped when finding where a communicator was created
_PKG_DIR = _os.path.dirname(__file__) + _os.sep
#: the leak warning is shown once per process
_LEAK_WARNED = []


def _creation_site() -> str:
    """``file:line`` of the first caller outside this package (where the user made the communicator)."""
    f = _sys._getframe(2)
    while f is not None and f.f_code.co_filename.startswith(_PKG_DIR):
        f = f.f_back
    return "?" if f is None else f"{f.f_code.co_filename}:{f.f_lineno}"


def live_communicators() -> dict:
    """This process's communicators still allocated (open; dropped unclosed ones included, which stay allocated
    until exit): ``{"count": n, "bytes": symmetric bytes on this rank (rings and symmetric arrays), "dropped":
    how many of them were dropped without close(), "dropped_at": their creation sites}``. Local."""
    from .transport import lifecycle as _lifecycle
    out = {"count": 0, "bytes": 0, "dropped": 0, "dropped_at": []}
    for obj in _lifecycle.open_objects():
        if isinstance(obj, Communicator):
            out["count"] += 1
            out["bytes"] += obj._symmetric_bytes()
            if obj._dropped:
                out["dropped"] += 1
                out["dropped_at"].append(obj._created_at)
    return out


def _check_reset(op: str, reset) -> bool:
    """``reset`` of :meth:`Communicator.stats` / :meth:`Communicator.channel_stats` as a bool (``TypeError``
    naming it unless it is one: ``reset="no"`` must not zero the counters)."""
    if not isinstance(reset, (bool, np.bool_)):
        raise TypeError(f"{op}: reset must be a bool (True / False), got {type(reset).__name__} {reset!r}")
    return bool(reset)


class Communicator:
    """All-to-all collectives (``alltoall``, ``alltoallv``, MoE ``dispatch``/``combine``) over a SymBuffer.

    Parameters
    ----------
    comm : mpi4py.MPI.Comm, torch.distributed.ProcessGroup or None
        Ranks of one node. Construction is collective over ``comm``; so is every method. An mpi4py
        intra-communicator (a job started by ``mpiexec``), a ``torch.distributed`` process group of any backend
        (a job started by ``torchrun``; the host backend's memory is then POSIX shared memory), or None: torch's
        default group when ``torch.distributed.is_initialized()``, else ``MPI.COMM_WORLD``. Every exchange of
        construction and ``close()`` goes through it (bounded; see
        :func:`~cupy_symbuf.transport.bootstrap.as_bootstrap`); the collectives never use it.
    config : Config, optional
        Transport tuning; unset fields (``num_sms``, ``chunk_bytes``) get per-backend defaults (``self.config``
        holds the resolved values).
    backend : {"auto", "cuda", "host"}
        ``"cuda"``: CuPy arrays and GPU kernels on the current CuPy device and stream. ``"host"``: NumPy arrays over
        an MPI shared-memory window. ``"auto"``: cuda when CuPy imports and a GPU is visible.

    Attributes
    ----------
    rank, world_size, backend, config, layout (:class:`~cupy_symbuf.layout.ChannelLayout`), buffer (SymBuffer),
    xp (``numpy`` or ``cupy``), topology (:class:`~cupy_symbuf.Topology`), transport (``"ipc"`` / ``"staged"`` /
    ``"shared_memory"``: where the buffer lives, ``Config.transport``), transport_reason, planned_transport (the
    transport computed before the buffer existed, which keyed the tuning table), tuning_source.

    Notes
    -----
    Every call checks its arguments on the calling rank before any communication; a rejected call raises
    ``ValueError``/``TypeError`` naming the operation and argument and leaves the communicator usable (all ranks
    must then skip that call alike). A :class:`~cupy_symbuf.SymBufferTimeoutError` instead leaves the ring counters
    inconsistent, and the communicator refuses further calls.

    On the GPU path a collective is queued on the current CuPy stream and returns without waiting for it (like
    NCCL; ``Config.blocking=True`` waits): read the result in stream order, and call :meth:`synchronize` (or any
    later collective) to have a recorded timeout raised. Collectives of one communicator run in call order even
    when issued on different streams (a call on a new stream waits for the previous call's stream). Inputs must
    stay alive, unmodified, until stream order reaches the collective (as with NCCL; with PyTorch tensors from
    another stream, ``tensor.record_stream``).

    Lifecycle. Construction is bounded by ``config.timeout_s``: a peer that never constructs gives every waiting rank
    a :class:`~cupy_symbuf.SymBufferTimeoutError` (role "construction") naming the missing ranks. Before allocating,
    the ranks compare a fingerprint of everything that shapes the wire (the resolved Config except the local policy
    fields ``timeout_s``, ``blocking`` and ``abort_on_failure``; the layout; backend; kernel variant and warp split;
    compile-time defines and ``CUPY_SYMBUF_DEBUG``; package and protocol version): a difference raises
    ``ValueError`` on every rank naming the field, the values and the ranks. The buffer must fit in free memory
    (host: ``/dev/shm`` and RAM for every rank of the node; GPU: free device memory for the ranks sharing it).
    :meth:`close` is bounded the same way. A failed communicator (timeout, mismatch, :meth:`abort`) ends the job
    with ``MPI.COMM_WORLD.Abort(1)`` (without MPI: ``os._exit(1)``, which ends a torchrun job) when it is closed or
    reaches interpreter exit, unless
    ``Config.abort_on_failure`` is off. Dropped unclosed, a communicator warns
    (:class:`~cupy_symbuf.SymBufferLeakWarning`, shown by default, once per process, naming where it was created)
    and stays allocated (freeing is collective, so the garbage collector cannot do it); ``atexit`` closes the ones
    still open, dropped ones included, newest first. :meth:`describe` and ``cupy_symbuf.info()`` count this
    process's live communicators and their bytes. After ``os.fork()`` the child neither uses, closes nor frees the
    parent's communicators.

    Threads. One thread at a time per communicator: a call from a second thread while one is inside any of its
    calls (collectives, symmetric arrays, :meth:`synchronize`, :meth:`close`, a ``LowLatencyBuffer`` or
    ``DeltaExchange`` over it) raises ``RuntimeError`` at once naming the operation and the thread inside; nothing
    is sent and the call inside goes on. Any thread may call (cuda: each call makes the communicator's GPU current
    in the calling thread, and the thread's own current device again after it, so a new thread needs no
    ``cupy.cuda.Device(...).use()``). Several communicators may be used from several threads at once; on the
    GPU give each thread a stream of its own (``with cupy.cuda.Stream(non_blocking=True):``), as with NCCL:
    kernels of two communicators queued on one stream in a different order on two ranks wait for each other
    until ``timeout_s``. :meth:`abort` may be called from any thread. A call Python cannot bind (a mistyped keyword) is a rejection
    like any bad argument: ``TypeError`` here, :class:`~cupy_symbuf.SymBufferRejectedError` on the peers.
    """

    def __init__(self, comm=None, config: Optional[Config] = None, *, backend: str = "auto"):
        import os

        from .transport import agree as _agree
        from .transport import lifecycle as _lifecycle
        self._guard = CallGuard()  # one thread at a time inside this communicator's calls
        self._created_at = _creation_site()  # named by the warning when it is dropped unclosed
        self._dropped = False
        self._closed = True  # until construction completes (close() and __del__ of a half-built object do nothing)
        self._broken: Optional[str] = None
        if config is None:
            config = Config()
        if not isinstance(config, Config):
            raise TypeError(f"Communicator: config must be a cupy_symbuf.Config, got {type(config).__name__}")
        try:
            boot = as_bootstrap(comm)  # every exchange of construction goes through it
        except TypeError:
            raise TypeError(f"Communicator: comm must be an mpi4py intra-communicator, a torch.distributed "
                            f"ProcessGroup or None, got {comm!r}") from None
        timeout = config.timeout_s
        what = "Communicator construction"
        try:
            # 1. Every rank is here (bounded), with its backend and GPU; a local failure is told to all.
            err, gpu, sm_count, gpu_name, place = None, None, 132, "", None
            try:
                backend = resolve_backend(backend)
                if backend == "cuda":
                    ident = gpu_identity(_compat.cupy.cuda.Device().id)
                    gpu = ident["uuid"] + "/" + ident["pci_bus_id"]
                    sm_count = ident["sm_count"] or sm_count
                    gpu_name = ident.get("name", "")
                from .transport.topology import local_record
                place = local_record(backend, nvml=False)  # for self.topology: host, GPU, peer access (no NVML)
            except Exception as exc:
                err = f"{type(exc).__name__}: {exc}"
            step = boot.allgather((backend, gpu, err, place), timeout, what)
            _agree.raise_if_any_failed([s[2] for s in step], "Communicator")
            _agree.check_agreement([{"backend": s[0]} for s in step], "Communicator")
            ranks_per_gpu = [s[1] for s in step].count(gpu) if backend == "cuda" else 1
            self._places = [dict(s[3], shm=0) for s in step]  # one node: SymBuffer checks it below
            # 2. Everything that shapes the wire, compared before anything is allocated.
            world_size = boot.size
            err, fp = None, None
            self.tuning_source = None
            try:
                self.planned_transport = planned_transport(config.transport, backend, self._places)
                config = self._tuned(config, backend, world_size, gpu_name, ranks_per_gpu,
                                     self.planned_transport)
                self.config = config.resolved(backend, ranks_per_gpu=ranks_per_gpu, gpu_sm_count=sm_count,
                                              world_size=world_size)
                self.layout = ChannelLayout.from_config(self.config, world_size)
                fp = _agree.fingerprint(self.config, self.layout, backend)
            except Exception as exc:
                err = f"{type(exc).__name__}: {exc}" if not isinstance(exc, ValueError) else str(exc)
            step = boot.allgather((fp, err), timeout, what + " (fingerprint)")
            _agree.raise_if_any_failed([e for _, e in step], "Communicator")
            _agree.check_agreement([f for f, _ in step], "Communicator")
            self.world_size = world_size
            # 3. The buffer (its size checked against free memory on every rank first).
            self.buffer = SymBuffer(boot, self.layout.total_bytes, backend=backend, timeout_s=timeout,
                                    transport=self.config.transport, _managed=True)
        except SymBufferError as exc:  # a construction timeout: the excepthook applies this config's policy
            exc.abort_on_failure = config.abort_on_failure
            raise
        self.rank = self.buffer.rank
        self.backend = self.buffer.backend
        if self.backend == "cuda":  # every call makes it current in the calling thread (any thread may call)
            self._guard.device = self.buffer.device_id
        self.xp = _compat.array_module(self.backend)
        self._epoch = 0
        try:
            if self.backend == "cuda":
                from .transport.cuda import CudaTransport
                self._transport = CudaTransport(self.buffer, self.layout, self.config.timeout_s)
                self._transport.blocking = self.config.blocking
                self._transport.copy_engine = self.config.mode == "copy_engine"
            else:
                from .transport.host import HostTransport
                self._transport = HostTransport(self.buffer, self.layout, self.config.timeout_s)
            from .transport.symmetric import SymmetricHeap
            self._heap = SymmetricHeap(self.buffer, self._transport, self.config.timeout_s, self._check_open,
                                       on_broken=self._mark_broken)
            self._transport.heap = self._heap
            if self.config.adaptive and self.backend == "cuda" and self.world_size > 1:
                self._transport.enable_adaptive()  # the work-sharing build of the ring kernel, its load counters
            if self.config.trace:
                if self.backend == "cuda":  # the kernels record (a telemetry build of the ring kernel)
                    self._transport.enable_trace()
                else:
                    from .transport.trace import Recorder
                    self._transport.trace = Recorder()
            if self.backend == "host":  # can every rank read every other's memory (plain sendbufs go direct)?
                if not self._transport.probe_cma(self.buffer.bootstrap, self.config.timeout_s) and self.world_size > 1:
                    _logger.info("cross-memory attach (process_vm_readv) is not available between these ranks: "
                                 "plain sendbufs go through the rings")
        except BaseException:
            self.buffer.close()
            raise
        self._pid = os.getpid()
        self._closed = False
        self._token = _lifecycle.register(self, state=self._lifecycle_state, abort=self._abort_uncaught,
                                          depart=self._depart, leave=self._left_at_exit,
                                          exit_close=self._close_at_exit)
        if self.backend == "cuda":
            _logger.info("Communicator: %s transport (%s)", self.transport, self.transport_reason)
            if self.tuning_source and self.transport != self.planned_transport and self.rank == 0:
                _logger.warning("Communicator: the layout came from the tuning table's %s entry (%s), but the buffer "
                                "fell back to the %s transport; pass num_sms / chunk_bytes / num_slots to choose "
                                "another", self.planned_transport, self.tuning_source, self.transport)
        _logger.debug("Communicator: backend=%s world_size=%d %s%s", self.backend, self.world_size, self.config,
                      f" (layout from the tuning table {self.tuning_source})" if self.tuning_source else "")

    def _tuned(self, config: Config, backend: str, world_size: int, gpu_name: str, ranks_per_gpu: int,
               transport: str = "ipc") -> Config:
        """``config`` with the layout (``num_sms``, ``chunk_bytes``, ``num_slots``) of the tuning table entry of this
        device kind, ranks per GPU, world size and transport (:mod:`cupy_symbuf.tuning`), when there is one and the
        caller set none of the three."""
        import dataclasses

        from .transport import tuning
        if any(getattr(config, f) is not None for f in tuning.FIELDS):
            return config  # a layout field set by the caller: the table's values were measured together, none apply
        tuned, source = tuning.lookup(tuning.table_key(backend, world_size, gpu_name, ranks_per_gpu, transport))
        if not tuned:
            return config
        try:
            out = dataclasses.replace(config, **tuned)
        except ValueError as exc:
            raise ValueError(f"{exc} (from the tuning table {source}; fix or remove that entry)") from None
        self.tuning_source = f"{source}: {tuned}"
        return out

    # ---- lifecycle -----------------------------------------------------------------------------------------
    @_guarded("Communicator.close", guard=_GUARD)
    def close(self) -> None:
        """Free the symmetric buffer (collective, bounded by ``config.timeout_s``; idempotent).

        Waits for all work queued on the device first (``cudaDeviceSynchronize``, every stream); raises the
        :class:`~cupy_symbuf.SymBufferTimeoutError` a queued collective recorded if no earlier call raised it (after
        freeing everything).

        A failed communicator (a timeout, a mismatch, :meth:`abort`; or one whose queued collective recorded a
        timeout) with ``Config.abort_on_failure`` (the default) prints the error and calls
        ``MPI.COMM_WORLD.Abort(1)`` (without MPI: ``os._exit(1)``): the job ends instead of hanging on peers that may never close. Otherwise the
        close is bounded: a peer that does not close within ``timeout_s`` (it died, exited or never closes) gives
        :class:`~cupy_symbuf.SymBufferTimeoutError` (role "close") naming the missing ranks, and this rank's buffer
        stays allocated (a peer may still write into it). In a process forked from the creator, close() only
        forgets the communicator.

        A peer that left the communicator by aborting it (an exception left its ``with`` block or ended its script,
        :meth:`abort`) before or while this rank closes: close() frees everything, then raises that
        :class:`~cupy_symbuf.SymBufferAbortedError` naming the rank (with ``Config.abort_on_failure``, the job ends
        with that message instead). Not while an exception leaves this rank's own ``with`` block (that exception is
        the one reported).

        Ending the job from here, this rank first departs from the communicator's bootstrap
        (``Bootstrap.depart``): while an exception leaves a peer's ``with`` block, that peer's close() stops waiting
        for this rank at once and raises :class:`~cupy_symbuf.transport.bootstrap.CollectiveTimeoutError`
        (``departed``), which ``__exit__`` adds as a note to the exception leaving the block; the job is not ended
        there a second time, so that exception and its traceback are printed.
        """
        import os

        from .transport import lifecycle as _lifecycle
        if getattr(self, "_closed", True):
            return
        self._closed = True
        _lifecycle.unregister(self._token)
        if os.getpid() != self._pid:
            self.buffer.close()  # forgets it there: the parent's memory is not freed by a child
            return
        was_broken = self._broken
        leaving = getattr(self, "_leaving_by", None) is not None  # an exception leaves this rank's 'with' block
        err = None
        try:
            err = self._transport.close()  # GPU: waits for queued kernels; a recorded, unreported error or None
        except Exception as exc:
            err = exc
        # what captured CUDA graphs read and wrote (the transport has waited for queued kernels): released now, not
        # when the garbage collector finds this object
        eng = self.__dict__.get("_engine_obj")
        if eng is not None:
            eng.graph_keep.clear()
        if err is not None and not self._broken:
            self._broken = f"{type(err).__name__}: {err}"
        if err is None and not self._broken and not leaving:
            err = self._peer_abort()  # a peer aborted before this rank closed
            if err is not None:
                self._broken = str(err)
        if self._broken and self.config.abort_on_failure:
            self._end_job(f"closing a failed Communicator: {self._broken}", self._abort_cause())
            return  # reached only where the abort is replaced (tests)
        seen = []

        def on_arrival():  # every rank is in close(): a peer that aborted before entering it has set the word
            if err is None and not self._broken and not leaving:
                seen.append(self._peer_abort())

        watch = getattr(self, "_exit_watch", None)  # at interpreter exit (see _close_at_exit)
        try:
            # the symmetric arrays, then the buffer: collective, bounded, in the same order on every rank; peers wait
            # for it
            self._heap.close(interrupt=watch)
            self.buffer.close(on_arrival=on_arrival, interrupt=watch)
        except SymBufferError as exc:
            if not self._broken:
                self._broken = str(exc)
            # peers ending the job told this close() (they departed): while an exception leaves this rank's 'with'
            # block, raise, so that exception is printed; the peers end the job
            departed = getattr(exc, "departed", None) is not None
            if self.config.abort_on_failure and not (leaving and departed):
                # the buffer is still mapped (a failed close leaves it allocated): its abort word can be read
                cause = self._abort_cause()
                self._end_job(f"Communicator.close: {exc}",
                              exc.missing[0] if cause is None and departed and exc.missing else cause)
                return
            raise
        if seen and seen[0] is not None:  # freed; the peer's abort is this close's error
            err = seen[0]
            self._broken = str(err)
            if self.config.abort_on_failure:
                self._end_job(str(err), err.aborting_rank)  # (the buffer is freed: its abort word is gone)
                return
        if err is not None and not was_broken:
            raise err  # a queued collective failed and nothing raised it yet (its results are not valid)
        rejected = getattr(self._transport, "pending_rejection", None)
        if rejected is not None and not was_broken:  # a peer rejected a queued call; no synchronize() said so
            raise rejected

    def _close_at_exit(self, watch) -> None:
        """:meth:`close` at interpreter exit (``lifecycle``; ``sys.exit(0)`` inside ``with``): ``watch`` (no
        arguments, never raises; ``lifecycle.exit_watch``) is polled by its bounded waits while the buffer is still
        mapped, and tells every open communicator of this rank whose peers wait for it that it has left
        (:meth:`_left_at_exit`)."""
        self._exit_watch = watch
        try:
            self.close()
        finally:
            self._exit_watch = None

    def _left_at_exit(self) -> bool:
        """This rank's program ended with this communicator open (``sys.exit`` or the end of its script, which
        ``sys.excepthook`` never sees): it makes no further call. When a peer has begun a call (or a symmetric
        allocation step) of this communicator that this rank never joined (:meth:`_peers_waiting`), that peer
        waits for it in vain: set the abort word (``ERR_EXITED``), so its collective leaves at once naming this
        rank. A peer that is only behind (finishing a call this rank completed, or computing) is left alone and
        reaches close() later, which completes as usual (close() takes this reason for no failure). Returns True
        once there is nothing more to look for (the word set, the communicator failed, or closed and unmapped).
        Never raises."""
        from .wire import protocol as _protocol
        if getattr(self, "_closed", True) and getattr(self, "_exit_watch", None) is None:
            return True  # closed (and its buffer unmapped), or never made
        if self._broken or getattr(self, "_pid", None) != _getpid():
            return True
        try:
            if not self._peers_waiting():
                return False
            self._transport.set_abort(_protocol.ERR_EXITED)
        except Exception:  # noqa: BLE001 - the process is ending; the peers' waits stay bounded by timeout_s
            pass
        return True

    def _peers_waiting(self) -> list:
        """The peers waiting for this rank in a call or step it never joined: the transport's look at this rank's
        buffer (``peers_waiting``: a count exchange slot, a call header of a new call) and the bootstrap's at the
        peers' step messages (``peers_in_other_steps``). Only while the buffer is mapped."""
        out = set(self._transport.peers_waiting())  # (every transport has it: transport.base.Transport)
        look = getattr(self.buffer.bootstrap, "peers_in_other_steps", None)
        if look is not None:
            out.update(look())
        return sorted(out)

    def _end_job(self, message: str, cause) -> None:
        """``abort_on_failure`` in :meth:`close`: depart from the bootstrap (peers waiting for this rank in their
        close() stop waiting), then end the job; ``cause``: the peer whose abort caused the failure (it exits
        first, see ``lifecycle.abort_job``), or None."""
        from .transport import lifecycle as _lifecycle
        self._depart(message)
        _lifecycle.abort_job(message, self.rank, cause=_lifecycle.peer_cause(cause, self.rank))

    def _depart(self, reason: str) -> None:
        """This rank takes part in no further exchange of this communicator (``lifecycle.depart``; never raises)."""
        from .transport import lifecycle as _lifecycle
        _lifecycle.depart(self.buffer.bootstrap, reason)

    def _abort_cause(self):
        """The rank that set this communicator's abort word when that is another rank, else None (one look; only
        while the buffer is mapped)."""
        from .common.errors import SymBufferAbortedError
        from .transport import lifecycle as _lifecycle
        check = getattr(self._transport, "check_abort", None)
        try:
            if check is not None:
                check("Communicator.close")
        except SymBufferAbortedError as exc:
            return _lifecycle.peer_cause(exc.aborting_rank, self.rank)
        except Exception:  # noqa: BLE001 - reading our own memory; never mask the failure being reported
            return None
        return None

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran (or construction failed); a closed communicator raises
        :class:`~cupy_symbuf.SymBufferClosedError` from every collective."""
        return getattr(self, "_closed", True)

    def _peer_abort(self):
        """The :class:`~cupy_symbuf.SymBufferAbortedError` of this communicator's abort word when a rank set it on
        leaving the communicator (an exception left its ``with`` block or ended its script, :meth:`abort`), else
        None (one look, no waiting). A peer's own failure (timeout, mismatch) is that peer's to report: a rank that
        took no part in the failed call closes cleanly."""
        from .common.errors import SymBufferAbortedError
        from .wire import protocol as _protocol
        check = getattr(self._transport, "check_abort", None)
        try:
            if check is not None:
                check("Communicator.close")
        except SymBufferAbortedError as exc:
            left = {_protocol.ERR_NAMES[k] for k in (_protocol.ERR_LEFT_WITH, _protocol.ERR_UNCAUGHT,
                                                     _protocol.ERR_USER)}
            return exc if exc.reason in left else None
        except Exception:  # pragma: no cover - reading our own memory; never mask close()
            return None
        return None

    def abort(self, reason: str = "") -> None:
        """Abort this communicator on every rank, like ``ncclCommAbort`` (local: returns at once, no communication).

        Writes the abort line into every rank's symmetric buffer, so the peers' waits (kernels and host loops)
        leave with :class:`~cupy_symbuf.SymBufferAbortedError` naming this rank; marks this communicator broken
        ("aborted by this rank"). Every rank must still :meth:`close` it (with ``Config.abort_on_failure``, the
        default, closing a failed communicator ends the job with ``MPI.COMM_WORLD.Abort``). A no-op once closed.
        """
        from .wire import protocol as _protocol
        if getattr(self, "_closed", True):
            return
        self._transport.set_abort(_protocol.ERR_USER)
        msg = f"aborted by this rank (rank {self.rank})" + (f": {reason}" if reason else "")
        self._broken = msg if not self._broken else f"{self._broken}; then {msg}"

    def __del__(self):
        if getattr(self, "_closed", True) or getattr(self, "_pid", None) != _getpid():
            return
        # Dropped while open. Its memory is shared (the peers map it; a captured CUDA graph may still replay
        # against it) and freeing it is collective, which a garbage collector running at a different moment on
        # each rank cannot do: nothing is freed here. It is kept (strongly) in its place in the lifecycle
        # registry, so exit closes it collectively with the others in the same order on every rank.
        try:
            from .transport import lifecycle as _lifecycle
            self._dropped = True
            _lifecycle.keep_dropped(self._token, self, state=self._lifecycle_state, abort=self._abort_uncaught,
                                    depart=self._depart, leave=self._left_at_exit,
                                    exit_close=self._close_at_exit)
            if not _LEAK_WARNED:
                _LEAK_WARNED.append(True)
                _warnings.warn(
                    f"an open {self!r} created at {self._created_at} was dropped without close(): its symmetric "
                    f"buffer ({self._symmetric_bytes()} B on this rank) and MPI communicator stay allocated until "
                    f"the program exits, which closes it (freeing is collective, so the garbage collector cannot "
                    f"do it). Call close() on every rank or use 'with Communicator(...)'. Shown once per process; "
                    f"cupy_symbuf.info()['live_communicators'] counts the ones still allocated",
                    SymBufferLeakWarning, stacklevel=2)
        except Exception:  # pragma: no cover - interpreter shutting down
            pass

    def _symmetric_bytes(self) -> int:
        """Bytes of symmetric memory this communicator holds on this rank (rings and symmetric arrays)."""
        try:
            return int(self.buffer.nbytes) + int(self._heap.total_bytes)
        except Exception:  # noqa: BLE001 - a half-built or closing communicator
            return 0

    @_guarded("Communicator.synchronize", guard=_GUARD)
    def synchronize(self) -> None:
        """Wait for this rank's queued collectives (and the current CuPy stream) and raise a timeout they recorded.

        On the GPU path collectives return once queued (``Config.blocking=False``, the default); this is where
        their :class:`~cupy_symbuf.SymBufferTimeoutError` surfaces if no later call raised it first. The results
        of the collective that timed out and of every one queued after it are not valid. Local (no communication);
        on the host path, whose calls complete before returning, it waits only for the peers' copies out of the
        sendbufs of earlier ``sync="relaxed"`` calls.

        Raises
        ------
        SymBufferTimeoutError
            A queued kernel's wait expired (rank, peer, channel, head and tail named); the communicator is then
            unusable.
        SymBufferRejectedError
            A peer rejected a queued call (or, device-count calls, the ranks' row formats differed): nothing moved,
            the communicator stays usable.
        ValueError
            A queued GPU ``get_dispatch_layout`` found ``topk_idx`` values outside ``[-1, num_experts)`` (they were
            left out of its counts); the communicator stays usable.
        """
        self._check_open()
        # GPU: the queued launches; host: the peers' copies out of the sendbufs of earlier sync="relaxed" calls
        self._run(self._transport.synchronize, "synchronize")
        if self.backend == "cuda":
            self._transport.check_layout_error("synchronize")  # a local argument error: the communicator stays usable

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """Close on every way out. An exception leaving the block first sets the abort word
        (``ERR_LEFT_WITH``): peers in a collective leave at once with
        :class:`~cupy_symbuf.SymBufferAbortedError` naming this rank, and peers in :meth:`close` raise it (with
        ``abort_on_failure``: end the job with it); then this rank closes (bounded) and its exception propagates.
        ``sys.exit(0)`` closes as at interpreter exit: peers found waiting for this rank in a call it never joined
        are told it left (``ERR_EXITED``, see ``lifecycle``)."""
        if exc is None or exc_type is GeneratorExit or (exc_type is SystemExit and exc.code in (None, 0)):
            # a normal way out (sys.exit(0), a generator closed): the peers are not aborted; but sys.exit ends the
            # program: peers found waiting for this rank in a call it never joined are told then
            if exc_type is SystemExit and not getattr(self, "_closed", True):
                from .transport import lifecycle as _lifecycle
                self._close_at_exit(_lifecycle.exit_watch())
            else:
                self.close()
            return
        if not getattr(self, "_closed", True) and getattr(self, "_pid", None) == _getpid():
            self._leaving_by = f"{exc_type.__name__}: {exc}"
            set_abort = getattr(self._transport, "set_abort", None)
            if set_abort is not None and not self._broken:
                from .transport import lifecycle as _lifecycle
                from .wire import protocol as _protocol
                try:
                    set_abort(_protocol.ERR_LEFT_WITH)
                except Exception:  # pragma: no cover - never mask the exception that is leaving
                    pass
                if self.config.abort_on_failure:
                    _lifecycle.say(self.rank, f"{self._leaving_by} left 'with Communicator': the peers are told "
                                              f"(abort word), closing")
                    if getattr(self.buffer, "comm", None) is not None:
                        # under MPI a peer's MPI_Abort may end this process before Python prints the traceback
                        # (a torch bootstrap's peers depart instead, and Python prints it once close() returns)
                        import traceback
                        _lifecycle.say(self.rank, *"".join(traceback.format_exception(exc_type, exc, tb)).rstrip()
                                       .splitlines())
        try:
            self.close()
        except Exception as close_exc:  # the exception that left the block stays the one reported
            note = (f"cupy_symbuf: leaving 'with Communicator', close() failed too: {type(close_exc).__name__}: "
                    f"{close_exc}")
            if hasattr(exc, "add_note"):
                exc.add_note(note)
            else:  # pragma: no cover - Python < 3.11
                import sys
                sys.stderr.write(note + "\n")

    def _check_open(self) -> None:
        if self._closed:
            raise SymBufferClosedError("Communicator is closed")
        if self._broken:
            raise SymBufferError(f"Communicator is unusable after an earlier failure: {self._broken}")
        if _getpid() != self._pid:
            raise SymBufferError(f"Communicator was created by process {self._pid}; after os.fork() only that "
                                 f"process may use it (create a new one in the child)")

    def describe(self) -> str:
        """The buffer map (:meth:`ChannelLayout.describe`), the resolved config and the lifecycle state."""
        state = "closed" if self._closed else (f"broken ({self._broken})" if self._broken else "open")
        live = live_communicators()
        tuned = f"\n  defaults from the tuning table {self.tuning_source}" if self.tuning_source else ""
        if self.backend == "host" and self.world_size > 1:
            cma = getattr(self._transport, "cma_pids", None) is not None
            tuned += ("\n  cross-memory attach between the ranks: " +
                      ("on (plain sendbufs of >= 256 KiB per peer are read in place)" if cma else
                       "off (plain sendbufs go through the rings)"))
        if self.backend == "cuda":
            tuned += f"\n  transport: {self.transport} ({self.transport_reason})"
        return (f"{self.layout.describe()}\n{self._heap.describe()}\n  backend={self.backend} config={self.config}"
                f"{tuned}\n"
                f"  state={state} (created by pid {getattr(self, '_pid', '?')} at {self._created_at}; fields compared "
                f"across ranks at construction: all but {', '.join(_LOCAL_POLICY)})\n"
                f"  this process: {live['count']} live communicator(s), {live['bytes']} B of symmetric memory"
                + (f" ({live['dropped']} dropped without close(), created at {', '.join(live['dropped_at'])})"
                   if live["dropped"] else ""))

    def trace(self, clear: bool = False):
        """The channel telemetry recorded so far (``Config(trace=True)``): a NumPy structured array of
        ``cupy_symbuf.transport.trace.TRACE_DTYPE`` (fields ``t0``, ``t1`` seconds of ``time.monotonic``, on the GPU of
        ``%globaltimer`` (waits for the device first); ``call``, ``op``,
        ``kind`` (send / recv / pull / self / idle), ``channel``, ``peer``, ``bytes``, ``head``, ``tail``), one
        record per event, in order. Local. ``clear=True`` empties the buffer after the copy. ``ValueError`` when
        the communicator was built without ``trace=True``."""
        rec = getattr(self._transport, "trace", None)
        if rec is None:
            raise ValueError("Communicator.trace: build the Communicator with Config(trace=True) to record")
        out = rec.snapshot()
        if clear:
            rec.clear()
        return out

    def save_trace(self, path: str) -> str:
        """Write :meth:`trace` with this rank, the world size, the config and the events dropped (buffer full) to
        ``path`` (``.npz``; ``{rank}`` in it is replaced by the rank, e.g. ``trace_rank{rank}.npz``); returns the
        path. Local; every rank writes its own file for ``python -m cupy_symbuf.diagnostics``."""
        path = path.replace("{rank}", str(self.rank))
        np.savez(path, records=self.trace(), rank=self.rank, world_size=self.world_size, config=str(self.config),
                 dropped=self._transport.trace.dropped)
        return path

    def stats(self, reset: bool = False) -> dict:
        """Always-on counters of this rank's row exchanges, per operation (local, no communication).

        Returns ``{op: {"calls": int, "bytes_sent": [world_size] ints, "bytes_received": [world_size] ints,
        "calls_device_counts": int}}`` for every operation that ran (``alltoall``, ``alltoallv``, ``dispatch``,
        ``combine``): bytes of payload to and from each rank (entry ``rank``: the rows a rank keeps, copied
        locally), over the calls whose rows this rank moved (calls this rank rejected are not counted; the rows
        of a peer that rejected a call are counted as planned). ``calls_device_counts``: GPU calls whose counts stay on the
        device (worst-case / capacity modes, cached dispatch and combine): counted, their bytes are not. The cost is
        one dict update per call. ``reset=True`` zeroes the counters after reading them; ``reset`` must be a bool
        (``TypeError`` otherwise: a string such as ``"no"`` would read as true)."""
        return self._engine.stats(_check_reset("stats", reset))

    def channel_stats(self, reset: bool = False) -> dict:
        """Load counters per (channel, peer) of this rank's rings, kept across calls, and the adaptive home
        map (``Config(adaptive=True)``, :mod:`cupy_symbuf.adaptive`). Local, no communication.

        Returns a dict: ``adaptive`` (bool), ``interval`` (eager calls between re-balances), ``work_sharing`` (the
        GPU's work-sharing kernel runs), ``calls`` (row exchanges counted), ``rebalances`` (home maps computed) and
        ``remaps`` (of which changed the map), and per role ``"send"`` / ``"recv"`` a dict of
        ``bytes`` and ``chunks`` (``[num_channels][world_size]`` ints: payload bytes of each peer's channel share
        and its ring chunks; entry ``rank`` is 0: a rank's own rows take no ring; None without ``adaptive``),
        ``stolen`` (``[num_channels][world_size]``: chunks copied by warps of another peer's group; nonzero with
        GPU work sharing only; None without ``adaptive``), ``bytes_per_peer`` (``[world_size]``, always),
        ``imbalance`` (the busiest peer's bytes over the mean of the ring peers'; 1.0 when balanced or idle),
        ``home`` (32 ints: each warp's home peer, 255 = its own group's) and ``workers`` (``[world_size]``: warps
        that start on each peer's rows).

        The host-side counts are of the calls as planned, like :meth:`stats`: a call a peer rejected counts the rows
        to and from that peer, and on the receive side ``chunks`` counts ring chunks even from a peer that sent
        directly (the sender's mode arrives in its call header, after the plan), while the host engine's direct send
        counts its bytes on channel 0, where it travels, and no chunks; the GPU kernel's counts are of
        what moved. Sources: the host engine, and the GPU without ``adaptive``, count the calls whose counts the
        host knows (GPU device-count calls, e.g. ``num_worst_tokens`` or a cached handle, are not counted there),
        the per-channel cuts only with ``adaptive`` (about 50 us per new call shape on the host); the GPU's
        work-sharing kernel counts every call itself (this method then waits for the queued kernels; refused with
        ``RuntimeError`` during a CUDA graph capture). ``reset=True`` zeroes every counter after reading them (the
        home map stays); ``reset`` must be a bool (``TypeError`` otherwise)."""
        return self._engine.channel_stats(_check_reset("channel_stats", reset))

    # ---- symmetric arrays -----------------------------------------------------------------------------------
    @_collective("Communicator.empty", guard=_GUARD, reject=_told_by_heap("empty"))
    def empty(self, shape, dtype=np.float32):
        """A new array that lives in symmetric memory (collective: every rank passes the same ``shape`` and
        ``dtype``, in the same order of allocations).

        Returns a plain ``numpy.ndarray`` (host) or ``cupy.ndarray`` (cuda) over this rank's copy of a new
        symmetric allocation, placed at the same offset of the same segment of the communicator's symmetric heap
        on every rank (a few segments, each an MPI shared-memory window / ``cudaMalloc`` mapped into every peer,
        grown collectively; design of ``torch.distributed._symmetric_memory.empty`` and NCCL window
        registration): thousands of live arrays are fine. Use it (or a C-contiguous slice of it) as ``sendbuf``
        of :meth:`alltoall` / :meth:`alltoallv` and each receiver copies the rows straight out of it: one copy per
        byte instead of two through the rings (``Config.mode``). Each array starts on a 256-byte boundary and is
        zeroed when allocated. Freed by :meth:`free` or :meth:`close`; an array (or view) kept past that reads the
        bytes it had and is never another allocation's array (its memory stays mapped, and is not reused, while
        any rank holds such an array), but the collectives refuse it.

        Parameters
        ----------
        shape : int or tuple of int (>= 0)
        dtype : numpy dtype (default float32; ml_dtypes types such as bfloat16 work)

        Raises
        ------
        TypeError, ValueError
            A bad ``shape`` / ``dtype`` on any rank, or ranks asking for different shapes or dtypes: raised on
            every rank, nothing allocated, the communicator usable.
        SymBufferAbortedError
            A peer aborted the communicator (an exception left its ``with`` block, :meth:`abort`, its program
            ended) before or while this rank waited: raised at once, naming it; the communicator is unusable.
        SymBufferTimeoutError
            A peer did not take part within ``config.timeout_s``, or closed the communicator meanwhile
            (``CollectiveTimeoutError`` with ``closing``, at once, naming it); the communicator is unusable.
        """
        return self._heap.empty(shape, dtype)

    @_collective("Communicator.zeros", guard=_GUARD, reject=_told_by_heap("zeros"))
    def zeros(self, shape, dtype=np.float32):
        """:meth:`empty`, zero-filled (collective). Every block is zeroed when it is allocated, so this is
        :meth:`empty` with that promise."""
        return self._heap.empty(shape, dtype, "zeros")

    @_collective("Communicator.array", guard=_GUARD, reject=_told_by_heap("array"))
    def array(self, a):
        """A symmetric copy of ``a`` (collective: every rank passes an array of the same shape and dtype); the
        backend's array type, C-contiguous. See :meth:`empty`. An argument this rank cannot convert raises here
        and, through the allocation's agreement step, ``ValueError`` on the peers (nothing allocated)."""
        err, src = None, None
        try:
            src = as_array("Communicator.array", "a", a, self.backend) if not isinstance(a, (list, tuple)) \
                else self.xp.asarray(a)
        except (TypeError, ValueError) as exc:
            err = exc
        out = self._heap.empty(getattr(src, "shape", ()), getattr(src, "dtype", np.uint8), "array", err=err)
        out[...] = src
        return out

    @_collective("Communicator.free", guard=_GUARD, reject=_told_free)
    def free(self, a) -> None:
        """Free the symmetric allocation ``a`` belongs to (collective: every rank frees the same allocation; on
        the GPU after the device is idle). ``ValueError`` on every rank when ``a`` is not one of this
        communicator's symmetric arrays or the ranks name different ones."""
        self._heap.free(a)

    def is_symmetric(self, a) -> bool:
        """Whether ``a`` is C-contiguous and lies inside one of this communicator's live symmetric arrays (local)."""
        return self._heap.find(a) is not None if hasattr(a, "flags") else False

    @property
    def transport(self) -> str:
        """Where the symmetric buffer (rings, symmetric arrays, low-latency buffers) lives, the same on every rank:
        ``"ipc"`` (cuda: each GPU's own memory, mapped into the peers through CUDA IPC), ``"staged"`` (cuda: pinned
        host memory mapped into every GPU, chosen by ``Config.transport``: every byte crosses PCIe twice) or
        ``"shared_memory"`` (host backend). :attr:`transport_reason` says why."""
        return self.buffer.transport

    @property
    def transport_reason(self) -> str:
        """Why :attr:`transport` was chosen (one line: requested, every pair peer-accessible, the pairs without
        peer access, or the CUDA IPC handle that did not open)."""
        return self.buffer.transport_reason

    @property
    def topology(self):
        """The ranks' :class:`~cupy_symbuf.Topology` (hosts, GPUs by UUID / PCI bus id, the link of every pair:
        same GPU, NVLink count and speed through NVML, PCIe, none; host backend: shared memory).

        Local, no communication (any rank may read it alone, also after :meth:`close`): every rank's host name, GPU
        and peer access came with construction's first exchange; the first read adds the NVLink links through this
        process's NVML (:func:`cupy_symbuf.topology.with_local_nvml`), so construction never pays for NVML.
        """
        topo = self.__dict__.get("_topology_obj")
        if topo is None:
            from .transport.topology import Topology, with_local_nvml
            places = with_local_nvml(self._places, self.rank) if self.backend == "cuda" else self._places
            topo = self.__dict__["_topology_obj"] = Topology(self.backend, places, rank=self.rank)
        return topo

    # ---- transport ------------------------------------------------------------------------------------------
    @property
    def engine(self):
        """The seam between this communicator and the layers above ``transport/`` (collectives, MoE, low-latency
        mode, scale-out, the benchmark): its :class:`~cupy_symbuf.transport.engine.Engine`, made on first use.
        Public within the package (no stability promise to users): ``engine.call`` / ``reject`` / ``check_open``
        keep the ranks in step, ``engine.transport`` is the
        :class:`~cupy_symbuf.transport.base.Transport` its steps run on, ``engine.heap`` the symmetric arrays."""
        eng = self.__dict__.get("_engine_obj")
        if eng is None:
            from .transport.engine import Engine
            eng = Engine(self._transport, self.layout, self.config, rank=self.rank, world_size=self.world_size,
                         backend=self.backend, heap=self._heap, check_open=self._check_open,
                         failure=self._failure, on_broken=self._set_broken, guard=self._guard)
            self.__dict__["_engine_obj"] = eng
        return eng

    _engine = engine  # the facade's own shorthand (layers above use ``engine``)

    def _failure(self):
        return self._broken

    def _set_broken(self, msg: str) -> None:
        self._broken = msg

    def _mark_broken(self, msg: str) -> None:
        """Unusable from now on, after ``msg`` (kept: an earlier failure stays the one named)."""
        if not self._broken:
            self._broken = msg

    def _lifecycle_state(self) -> tuple:
        """For :mod:`~cupy_symbuf.transport.lifecycle`: ``(pid that made it, open, why it failed or None, abort on
        failure)``."""
        return self._pid, not self._closed, self._broken, self.config.abort_on_failure

    def _abort_uncaught(self, exc_type) -> None:
        """For :mod:`~cupy_symbuf.transport.lifecycle`: this rank's program ends with an uncaught ``exc_type``:
        set the abort word (the peers leave their waits naming this rank) and mark this communicator broken."""
        from .wire import protocol as _protocol
        if self._broken:
            return
        self._transport.set_abort(_protocol.ERR_UNCAUGHT)
        self._broken = f"aborted by this rank (rank {self.rank}): uncaught {exc_type.__name__}"

    def _run(self, fn, *args, **kwargs):
        return self._engine._run(fn, *args, **kwargs)

    # ---- collectives ----------------------------------------------------------------------------------------
    @_collective("alltoall", guard=_GUARD, reject=_told_by_engine("alltoall", lambda a: False))
    def alltoall(self, sendbuf, *, out=None, stream=None, async_op=False, sync="strong"):
        """All-to-all of equal blocks: ``recvbuf[j]`` is what rank ``j`` sent to this rank (``sendbuf[rank]`` there).

        Parameters
        ----------
        sendbuf : numpy.ndarray (host) or cupy.ndarray (cuda), shape ``[world_size, ...]``, any dtype
            ``sendbuf[j]`` goes to rank ``j``. Non-contiguous input is copied. On cuda the transfer runs on the
            current CuPy stream after the work already queued on it.
        out : array, optional (keyword-only)
            Where to receive, so that a call allocates nothing: the backend's array of ``sendbuf``'s shape and
            dtype, C-contiguous, sharing no memory with ``sendbuf`` (``ValueError`` / ``TypeError`` naming
            ``out`` otherwise, a rejection told to the peers). Returned as ``recvbuf``. With a CUDA graph: capture
            with ``out`` and replay with new data in ``sendbuf``.
        stream, async_op : keyword-only
            See Streams below (every collective takes them).
        sync : {"strong", "relaxed"}, keyword-only
            Selective synchronisation. ``"strong"`` (default): returns with every peer done with this call's
            buffers. ``"relaxed"``: may return while peers still copy this rank's rows straight out of ``sendbuf``
            (direct modes); do not modify ``sendbuf`` until the next collective on this communicator returns (it
            waits for those copies first) or :meth:`synchronize`. Saves the wait for the slowest peer's copy; the
            same as strong through the rings and on the GPU path (see ``transport.engine.check_sync``).

        Returns
        -------
        recvbuf : same array type, shape and dtype as ``sendbuf``
            (with ``async_op=True``: a :class:`~cupy_symbuf.CollectiveEvent` whose ``result`` it is).

        Every rank must pass the same dtype and shape: every receiver checks it in the call header of each peer
        before it takes a byte (a difference raises :class:`~cupy_symbuf.SymBufferMismatchError` on every rank
        involved and the communicator is unusable).

        On the GPU a call of at most ``Config.small_bytes`` (default 1 MiB) of ``sendbuf`` goes by the
        small-message protocol: one kernel, each 4 bytes stored with the call's flag into the receiver's buffer,
        no ring round trips; the same agreement checks (its header words), rejections and bounded waits.

        Raises
        ------
        TypeError
            Wrong array type for the backend, or an array on another GPU.
        ValueError
            ``sendbuf.shape[0] != world_size``. The peers are told: they raise
            :class:`~cupy_symbuf.SymBufferRejectedError` (a ValueError), on the GPU path from this call with
            ``Config.blocking`` or else from :meth:`synchronize`; the communicator stays usable.
        SymBufferMismatchError
            A peer called another collective or passed another dtype / row shape.
        SymBufferTimeoutError, SymBufferAbortedError
            A peer did not take part within ``config.timeout_s``, or a rank aborted (on the GPU path raised by a
            later call or by :meth:`synchronize` unless ``Config.blocking``).

        Streams (every collective: ``alltoall``, ``alltoallv``, ``get_dispatch_layout``, ``dispatch``, ``combine``)
            ``stream=None`` (default): the current CuPy stream. A ``cupy.cuda.Stream``, a ``torch.cuda.Stream`` or
            any object with an integer ``cuda_stream``/``ptr`` (wrapped in ``cupy.cuda.ExternalStream``): the
            collective runs with it current (``with stream:``), so its kernels queue there after the work already
            queued on it, and its outputs come from that stream's CuPy memory pool (use them in that stream's
            order, or after :meth:`CollectiveEvent.wait`). Inputs made on another stream need an event wait first,
            as with NCCL. On the host backend ``stream`` must be None. A bad ``stream`` (or ``async_op`` not a
            bool) raises ``TypeError`` naming the argument; the peers raise
            :class:`~cupy_symbuf.SymBufferRejectedError` and the communicator stays usable.
            ``async_op=True``: return a :class:`~cupy_symbuf.CollectiveEvent` (after DeepEP's ``EventOverlap`` and
            ``torch.distributed.Work``) with the normal return value as ``.result``; ``.wait(stream=None)`` makes a
            stream wait for the collective without blocking the host, ``.synchronize()`` blocks and raises what the
            transport recorded. Errors found while issuing the call still raise from the call. On the host backend
            the event is complete at once.
        """
        if stream is not None or async_op is not False:
            return _run_collective(self, "alltoall", False, self.alltoall, (sendbuf,), {"out": out, "sync": sync},
                                   stream=stream, async_op=async_op)
        return _alltoall(self._engine, sendbuf, out, sync)

    @_collective("alltoallv", guard=_GUARD, reject=_told_by_engine("alltoallv", _alltoallv_notify))
    def alltoallv(self, sendbuf, send_counts, *, recv_counts=None, recv_capacity=None, out=None, stream=None,
                  async_op=False, wire_dtype=None, sync="strong"):
        """All-to-all of variable row counts.

        Parameters
        ----------
        sendbuf : numpy.ndarray (host) or cupy.ndarray (cuda), shape ``[num_rows, ...]``, any dtype
            Rows grouped by destination rank: the first ``send_counts[0]`` rows go to rank 0, and so on.
        send_counts : sequence of int, shape ``[world_size]``
            Rows for each destination; >= 0, summing to ``num_rows``.
        recv_counts : sequence of int, shape ``[world_size]``, optional
            Rows from each source, when the caller already knows them (a cached layout): skips the count exchange.
            Must equal what the peers send (checked in every peer's call header before any byte is taken), and
            ``recv_counts[rank] == send_counts[rank]``. Every rank must make the same choice (given or None).

        recv_capacity : int >= 0, optional (keyword-only)
            **Capacity mode** (DeepEP's ``num_worst_tokens`` idea for alltoallv): the output has exactly
            ``recv_capacity`` rows and the counts never reach the host, so the call can be captured in a CUDA
            graph. ``send_counts`` may then be a CuPy int array on the device (GPU; checked there: a negative count
            or a wrong sum rejects the call on every rank, reported by :meth:`synchronize`). Rows past the real
            count are left as the memory held. Receiving more than ``recv_capacity`` rows is fatal
            (:class:`~cupy_symbuf.SymBufferMismatchError` on that rank, the peers abort). Not with
            ``recv_counts``. Every rank must make the same choice.
        out : array, optional (keyword-only)
            Where to receive (no allocation): the backend's array, C-contiguous, exactly the shape and dtype of
            ``recvbuf`` below, sharing no memory with ``sendbuf``. Only with ``recv_counts`` or ``recv_capacity``
            (the size must be known before the count exchange). Returned as ``recvbuf``.
        stream, async_op : keyword-only
            The stream to run on and the async form: see :meth:`alltoall` (Streams).
        wire_dtype : {None, "fp8", "int8"}, keyword-only
            Low-precision transfer of float rows (float32, float16 or bfloat16; the row's element count a
            multiple of 128): each row is quantised per block of 128 elements (``"fp8"``: float8_e4m3fn codes,
            :func:`cupy_symbuf.quant.quantize_fp8`; ``"int8"``: int8 codes, ``scale = amax / 127``,
            :func:`cupy_symbuf.quant.quantize_int8`) with one float32 scale, the codes and scales travel (1 + 4/128
            bytes per element), and ``recvbuf`` comes back dequantised in ``sendbuf``'s dtype. Errors per element:
            ``quant.error_bound`` (fp8, relative ~2**-4) / ``quant.int8_error_bound`` (half a step), plus, for
            float16 / bfloat16 rows, half an ulp of that dtype (the dequantised value is rounded back into it). Not with
            ``out``. Every rank must pass the same ``wire_dtype`` and dtype (the packed rows' format and the
            source dtype are in the row signature every peer checks): with a count exchange a difference raises
            ``ValueError`` on every rank and the communicator stays usable; with ``recv_counts`` it is a call-header
            mismatch, fatal on every rank (:class:`~cupy_symbuf.SymBufferMismatchError`). An inf in a
            128-element block makes that block's scale inf: the whole block arrives as NaN. A NaN arrives as NaN
            in its own element with ``"fp8"`` (the block's amax ignores NaN) and makes the whole block NaN with
            ``"int8"``.
        sync : {"strong", "relaxed"}, keyword-only
            As in :meth:`alltoall`.

        Returns
        -------
        recvbuf : same array type and dtype, shape ``[sum(recv_counts), ...]`` (capacity mode:
            ``[recv_capacity, ...]``), rows grouped by source rank.
        recv_counts : numpy.ndarray int64 ``[world_size]`` (capacity mode: an int64 array of the backend's module,
            on the GPU in device memory, valid in stream order).
            With ``async_op=True`` a :class:`~cupy_symbuf.CollectiveEvent` whose ``result`` is this pair.

        Notes
        -----
        Without ``recv_counts`` the counts are exchanged first through the symmetric buffer (the notify step);
        every rank takes part even when it sends or receives nothing, and ranks whose dtype or row shape differ
        all raise ``ValueError`` before any payload moves (the communicator stays usable). Then every
        (channel, peer) ring carries its share of the bytes behind a call header; messages larger than the rings
        pass through them in chunks.

        Raises
        ------
        TypeError, ValueError
            Bad array type/device, counts of the wrong shape, negative, not summing to ``num_rows`` or too large
            to address, ``recv_counts[rank] != send_counts[rank]``. A call rejected on one rank is rejected on
            every rank (the peers raise :class:`~cupy_symbuf.SymBufferRejectedError`; with ``recv_counts`` on the
            GPU path from :meth:`synchronize` unless ``Config.blocking``); the communicator stays usable.
        SymBufferMismatchError
            ``recv_counts`` differ from what a peer sends, or a peer called another collective or passed another
            dtype / row shape: every rank involved raises, the communicator is unusable.
        SymBufferTimeoutError, SymBufferAbortedError
            A peer did not take part within ``config.timeout_s``, or a rank aborted.
        """
        if stream is not None or async_op is not False:
            return _run_collective(self, "alltoallv", _counts_first(recv_counts), self.alltoallv,
                                   (sendbuf, send_counts),
                                   {"recv_counts": recv_counts, "recv_capacity": recv_capacity, "out": out,
                                    "wire_dtype": wire_dtype, "sync": sync}, stream=stream, async_op=async_op)
        return _alltoallv(self._engine, sendbuf, send_counts, recv_counts, recv_capacity, out, wire_dtype, sync)

    # ---- mpi4py-shaped entry points (buffer specs as mpi4py's; see cupy_symbuf.collectives.mpi_shaped) --------
    @_collective("Alltoall", guard=_GUARD, reject=_told_by_engine("alltoall", lambda a: False))
    def Alltoall(self, sendbuf, recvbuf) -> None:
        """``MPI.Comm.Alltoall`` as mpi4py takes it: rank ``j``'s block of ``sendbuf`` goes to rank ``j``; the block
        from rank ``i`` is written to block ``i`` of ``recvbuf``. Returns None (the result is in ``recvbuf``).

        Parameters (buffer-spec rules from mpi4py, ``message_simple``)
        ----------
        sendbuf, recvbuf : array or ``[buf, datatype]`` / ``[buf, count]`` / ``[buf, (count, displ)]`` /
            ``[buf, count, datatype]`` / ``[buf, (count, displ), datatype]`` / ``[buf, count, displ, datatype]``
            ``buf``: numpy.ndarray (host) or cupy.ndarray (cuda), any shape, C- or Fortran-contiguous, viewed flat
            in memory order; ``recvbuf``'s writeable and sharing no memory with ``sendbuf``. ``count``: elements to
            (from) every rank, the block of rank ``j`` at element ``displ + j * count``; left out: the elements
            after ``displ`` divided by ``world_size`` (must divide evenly). ``displ``: elements, default 0.
            ``datatype``: a predefined ``MPI.Datatype`` (``MPI.DOUBLE``, ..., or a ``Dup()`` of one), an mpi4py
            typecode (``'d'``, ``'i'``, ``'Zd'``, ...) or a NumPy dtype; it must describe ``buf``'s dtype; left
            out: inferred from the array as mpi4py does. Both specs must give the same datatype and count.
            Elements of ``recvbuf`` outside the blocks keep their values.

        Every rank must pass the same count and datatype (checked in every peer's call header before a byte is
        taken: a difference is :class:`~cupy_symbuf.SymBufferMismatchError`, every rank raises and the communicator
        is unusable). Moves through :meth:`alltoall` in place (no copy). On cuda the transfer runs on the current
        CuPy stream; errors found on the device are raised by :meth:`synchronize` unless ``Config.blocking``.

        Raises
        ------
        TypeError
            A buffer of the wrong array type or device, a derived or null ``MPI.Datatype``, a datatype that does not
            describe the array's dtype, different send and receive datatypes, a count that is not an int.
        ValueError
            A spec of the wrong length, a negative count or displacement, blocks outside the buffer, a count that
            cannot be inferred, send and receive counts that differ, a non-contiguous or read-only buffer,
            ``recvbuf`` sharing memory with ``sendbuf``. Checked before any communication: the peers raise
            :class:`~cupy_symbuf.SymBufferRejectedError` and the communicator stays usable.
        SymBufferMismatchError, SymBufferTimeoutError, SymBufferAbortedError
            As :meth:`alltoall`.
        """
        _mpi_shaped.Alltoall(self._engine, sendbuf, recvbuf)

    @_collective("Alltoallv", guard=_GUARD, reject=_told_by_engine("alltoallv", lambda a: False))
    def Alltoallv(self, sendbuf, recvbuf) -> None:
        """``MPI.Comm.Alltoallv`` as mpi4py takes it: ``counts[j]`` elements at ``displs[j]`` of ``sendbuf`` go to
        rank ``j``; what rank ``i`` sends is written to ``counts[i]`` elements at ``displs[i]`` of ``recvbuf``.
        Returns None (the result is in ``recvbuf``). An mpi4py program ports by replacing ``comm.Alltoallv`` with
        ``c.Alltoallv`` (``c = Communicator(comm)``).

        Parameters (buffer-spec rules from mpi4py, ``message_vector``)
        ----------
        sendbuf, recvbuf : array or ``[buf, datatype]`` / ``[buf, counts]`` / ``[buf, (counts, displs)]`` /
            ``[buf, counts, datatype]`` / ``[buf, (counts, displs), datatype]`` / ``[buf, counts, displs, datatype]``
            ``buf``: numpy.ndarray (host) or cupy.ndarray (cuda), any shape, C- or Fortran-contiguous, viewed flat in
            memory order (``[n]`` elements); ``recvbuf``'s writeable and sharing no memory with ``sendbuf``.
            ``counts``: ``world_size`` ints >= 0 (elements per rank), or one int for every rank, or left out (the
            ``n`` elements split as mpi4py does: rank ``j`` gets ``n // W + (j < n % W)``). ``displs``:
            ``world_size`` ints (element offsets), or one int ``d`` (rank ``j`` at ``j * d``), or None / left out
            (packed: the running sum of the counts); ``(counts, displs)`` as one item must be a tuple. Blocks may
            leave gaps and come in any order; each block of a positive count must lie inside the buffer, and the
            receive blocks must not overlap. ``datatype``: a predefined ``MPI.Datatype`` (``MPI.DOUBLE``, ..., or a
            ``Dup()`` of one), an mpi4py typecode (``'d'``, ``'i'``, ``'Zd'``, ...) or a NumPy dtype; it must
            describe ``buf``'s dtype; left out: inferred from the array as mpi4py does. Elements of ``recvbuf``
            outside every block keep their values.

        The receive counts a rank declares must equal what its peers send (checked in every peer's call header
        before a byte is taken: a difference is :class:`~cupy_symbuf.SymBufferMismatchError` naming both counts,
        every rank raises, this call or its next, and the communicator is unusable; never wrong data). Blocks
        packed back to back in rank order move in place; otherwise the send blocks are gathered into one temporary
        and the receive blocks scattered from one (one extra copy each way). On cuda the transfer runs on the
        current CuPy stream; errors found on the device are raised by :meth:`synchronize` unless
        ``Config.blocking``.

        Raises
        ------
        TypeError
            A buffer of the wrong array type or device, a derived or null ``MPI.Datatype``, a datatype that does not
            describe the array's dtype, different send and receive datatypes, counts or displacements that are not
            ints.
        ValueError
            A spec of the wrong length, counts / displacements without one entry per rank, a negative count, a
            block outside its buffer, overlapping receive blocks, the counts of this rank's block to itself
            differing between the specs, a non-contiguous or read-only buffer, ``recvbuf`` sharing memory with
            ``sendbuf``. Checked before any communication: the peers raise
            :class:`~cupy_symbuf.SymBufferRejectedError` and the communicator stays usable.
        SymBufferMismatchError, SymBufferTimeoutError, SymBufferAbortedError
            As :meth:`alltoallv`.
        """
        _mpi_shaped.Alltoallv(self._engine, sendbuf, recvbuf)

    # ---- MoE (DeepEP normal-mode semantics; see cupy_symbuf.moe) --------------------------------------------
    # ``stream``/``async_op`` (keyword-only) as in alltoall's docstring (Streams); other keywords pass to cupy_symbuf.moe.
    @_collective("get_dispatch_layout", guard=_GUARD, reject=_told_by_engine("get_dispatch_layout", lambda a: None),
                 forwards=_moe.get_dispatch_layout)
    def get_dispatch_layout(self, topk_idx, num_experts, *, stream=None, async_op=False, **kwargs):
        # docstring: cupy_symbuf.moe.get_dispatch_layout (assigned below)
        if stream is None and async_op is False:
            return _moe.get_dispatch_layout(self._engine, topk_idx, num_experts, **kwargs)
        return _run_collective(self, "get_dispatch_layout", None, _moe.get_dispatch_layout,
                               (self._engine, topk_idx, num_experts), kwargs, stream=stream, async_op=async_op)

    @_collective("dispatch", guard=_GUARD, reject=_told_by_engine("dispatch", lambda a: a.get("handle") is None),
                 forwards=_moe.dispatch)
    def dispatch(self, x, topk_idx=None, topk_weights=None, num_experts=None, *, handle=None, expert_alignment=1,
                 stream=None, async_op=False, **kwargs):
        # docstring: cupy_symbuf.moe.dispatch (assigned below)
        kwargs.update(handle=handle, expert_alignment=expert_alignment)
        if stream is None and async_op is False:
            return _moe.dispatch(self._engine, x, topk_idx, topk_weights, num_experts, **kwargs)
        return _run_collective(self, "dispatch", handle is None, _moe.dispatch,
                               (self._engine, x, topk_idx, topk_weights, num_experts), kwargs, stream=stream,
                               async_op=async_op)

    @_collective("combine", guard=_GUARD, reject=_told_by_engine("combine", lambda a: False), forwards=_moe.combine)
    def combine(self, x, handle, topk_weights=None, *, dtype=None, stream=None, async_op=False, **kwargs):
        # docstring: cupy_symbuf.moe.combine (assigned below)
        kwargs.update(dtype=dtype)
        if stream is None and async_op is False:
            return _moe.combine(self._engine, x, handle, topk_weights, **kwargs)
        return _run_collective(self, "combine", False, _moe.combine, (self._engine, x, handle, topk_weights), kwargs,
                               stream=stream, async_op=async_op)

    def __repr__(self) -> str:
        return (f"Communicator(backend={self.backend!r}, rank={getattr(self, 'rank', '?')}, "
                f"world_size={self.world_size}, num_channels={self.layout.num_channels})")


# The MoE methods carry the full DeepEP-semantics docstrings of cupy_symbuf.moe (one text, two entry points;
# there the communicator is the first argument ``comm``).
# Every one of them also takes ``stream=`` and ``async_op=`` (keyword-only), documented once in alltoall's docstring.
_STREAMS_DOC = """
    stream, async_op : keyword-only (Communicator methods)
        The stream to run on (None: the current CuPy stream; a ``cupy.cuda.Stream``, ``torch.cuda.Stream`` or an
        object with ``cuda_stream``/``ptr``; None only on the host backend) and the async form (True: a
        :class:`~cupy_symbuf.CollectiveEvent` whose ``result`` is the return value): see
        :meth:`Communicator.alltoall` (Streams). A bad value raises ``TypeError`` naming the argument.
    """
Communicator.get_dispatch_layout.__doc__ = (_moe.get_dispatch_layout.__doc__ or "") + _STREAMS_DOC
Communicator.dispatch.__doc__ = (_moe.dispatch.__doc__ or "") + _STREAMS_DOC
Communicator.combine.__doc__ = (_moe.combine.__doc__ or "") + _STREAMS_DOC
