"""GPU transport: launches the ring kernel of ``cuda_src/ring_exchange.cu`` on the current CuPy stream.

The kernel interprets a launch descriptor (``protocol.DESC_*`` words) made once per
:class:`~cupy_symbuf.wire.plan.ExchangePlan` and part strides; a call only writes its buffer addresses into it.
"""
from __future__ import annotations

import ctypes
import math
import struct
import time

import numpy as np

from ..common import backend as _compat
from . import kernels as _kernels
from .base import DeviceTransport, implements
from ..wire import kernel_args as _kernel_args
from ..wire import protocol as P
from ..wire.plan import kernel_geometry, ring_kernel_defines, warp_groups  # noqa: F401 (re-exported)
from ..wire.protocol import (DESC_ABORT_OFFSET, DESC_CHANNEL_BYTES, DESC_CHUNK_BYTES, DESC_COUNTS, DESC_FLAGS, DESC_NUM_CHANNELS,
                        DESC_NUM_RECV_PARTS, DESC_NUM_SEND_PARTS, DESC_NUM_SLOTS, DESC_OP, DESC_PEERS, DESC_RANK,
                        DESC_RECV_INDEX, DESC_RECV_PARTS, DESC_REGION_BYTES, DESC_RING_WARPS, DESC_ROW_ALIGN,
                        DESC_ROW_BYTES, DESC_SELF_WARPS, DESC_SEND_INDEX, DESC_SEND_PARTS, DESC_SEQ, DESC_SIG,
                        DESC_TIMEOUT_NS, DESC_WORDS, DESC_WORLD_SIZE, MAX_PARTS, MAX_PEERS, DESC_DIRECT_ALLOC,
                        DESC_DIRECT_OFFSET, DESC_SYM_TABLE)
from ..common.errors import (SymBufferAbortedError, SymBufferMismatchError, SymBufferRejectedError, SymBufferTimeoutError,
                     aborted_error)
from ..wire.channel_layout import ChannelLayout
from .status import DeviceStatus, Pinned

__all__ = ["CudaTransport", "warp_groups", "RING_SOURCE", "RING_KERNEL", "NOTIFY_KERNEL"]

#: The data mover and the count exchange (``cuda_src/ring_exchange.cu``).
RING_SOURCE = "ring_exchange.cu"
RING_KERNEL = "symbuf_ring_exchange"
NOTIFY_KERNEL = "symbuf_notify"
MOE_NOTIFY_KERNEL = "symbuf_moe_layout_notify"  # an eager MoE dispatch's layout and count exchange
CE_KERNEL = "symbuf_ce_finish"
#: The small-message alltoall (``cuda_src/small_exchange.cu``).
SMALL_SOURCE = "small_exchange.cu"
SMALL_KERNEL = "symbuf_small_alltoall"

#: SmallArgs' first fields (send, recv, bytes, op, sig: one pack instead of five field writes)
_SMALL_HEAD = struct.Struct("@QQqqq")
assert [_kernel_args.field_offsets("SmallArgs")[f] for f in ("send", "recv", "bytes", "op", "sig")] == \
    [0, 8, 16, 24, 32]

# re-exported for tests and tools that read descriptor words
DESC = {n: getattr(P, n) for n in dir(P) if n.startswith("DESC_")}
assert MAX_PARTS == 4 and MAX_PEERS == 32


_INT64 = np.dtype(np.int64)

#: cudaMemcpyDefault: the direction from the addresses (UVA), for copies whose end may be device memory (ipc) or
#: registered host memory (the staged transport)
_MEMCPY_DEFAULT = 4


def part_geometry(a) -> tuple:
    """``(base address, row stride, row width)`` in bytes of an array whose rows (everything after axis 0) are
    contiguous."""
    width = a.dtype.itemsize * math.prod(a.shape[1:])
    stride = a.strides[0] if a.shape[0] > 1 else width
    return int(a.data.ptr), int(stride), int(width)


#: Bulk-copy stages of a ring-kernel block take at most this much dynamic shared memory (bytes).
BULK_SMEM_MAX = 192 * 1024


def bulk_shared_bytes(function, defines) -> int:
    """Dynamic shared memory for the ring kernel's bulk copies (``-DSYMBUF_BULK=1`` among its defines or
    ``CUPY_SYMBUF_NVRTC_DEFINES``, on a GPU of compute capability 9.0 or newer): what the device lets a block opt
    into beside the kernel's static shared memory, capped at BULK_SMEM_MAX; the kernel's attribute is raised to
    it. 0 otherwise (the register copy)."""
    cp = _compat.cupy
    every = tuple(defines) + _kernels._tuning_defines()
    if "-DSYMBUF_BULK=1" not in every:
        return 0
    dev = cp.cuda.Device()
    if int(dev.compute_capability) < 90:
        return 0
    from cupy_backends.cuda.api import driver
    optin = int(cp.cuda.runtime.deviceGetAttribute(97, dev.id))  # cudaDevAttrMaxSharedMemoryPerBlockOptin
    static = int(getattr(function, "shared_size_bytes", 16 * 1024))
    smem = min(BULK_SMEM_MAX, optin - static - 1024) // 1024 * 1024
    if smem <= 0:
        return 0
    driver.funcSetAttribute(int(function.kernel.ptr), 8, smem)  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    return smem


class _Launch:
    """The launch descriptor of one plan and part strides (everything but the buffer addresses, written per
    call); ``desc is None`` when nothing moves and there is no peer to tell (one rank)."""

    __slots__ = ("desc", "addr", "copy_send", "send_words", "recv_words")

    def __init__(self, desc, copy_send: bool, num_send: int, num_recv: int):
        self.desc = desc
        self.addr = 0 if desc is None else desc.ctypes.data
        self.copy_send = copy_send
        self.send_words = [DESC_SEND_PARTS + 4 * i for i in range(num_send)]
        self.recv_words = [DESC_RECV_PARTS + 4 * i for i in range(num_recv)]


class RepeatLaunch:
    """A prepared ring launch (:class:`_Launch`) with a descriptor of its own for one caller's repeated calls of one
    shape (:meth:`CudaTransport.repeat_prepare`): the words that are the same on every such call (send index, counts
    table, no direct source, flags, the signature with the call's tag) are written once, so a call writes its parts'
    addresses and its launch number only (:meth:`CudaTransport.fire_repeat`). ``words``: the descriptor as a
    memoryview of int64 (an item write costs less than a NumPy one); ``ptr_words``: the words of the addresses a call
    passes, send parts then receive parts."""

    __slots__ = ("op", "plan", "desc", "addr", "words", "ptr_words")


@implements(DeviceTransport)
class CudaTransport:
    """Runs row exchanges (one ring-kernel launch per call) and the notify step over a cuda
    :class:`~cupy_symbuf.SymBuffer` (a :class:`~cupy_symbuf.transport.base.DeviceTransport`)."""

    def __init__(self, buf, layout: ChannelLayout, timeout_s: float):
        self.buf = buf
        #: the symmetric buffer lives in registered host memory (chosen alike on every rank at construction)
        self.staged = getattr(buf, "transport", "ipc") == "staged"
        self.layout = layout
        self.timeout_s = timeout_s
        self.rank = buf.rank
        self.world_size = buf.world_size
        self.timeout_ns = np.uint64(int(timeout_s * 1e9))
        #: the error record and launch ledger of every kernel of this communicator (the low-latency kernels too)
        self.status = DeviceStatus(self.rank, timeout_s, self.read_abort_line)
        #: [count, first flat index] of topk_idx values out of range seen by a queued get_dispatch_layout kernel
        #: (host-mapped; written only when it holds none), raised by synchronize (or at once with blocking)
        self.layout_error = Pinned(2)
        self.layout_error_what = ""
        width = P.NOTIFY_HDR_WORDS - 1 + layout.max_notify_ints
        self._meta = Pinned(self.world_size * width)
        self._meta_in = Pinned(self.world_size * layout.max_notify_ints)
        #: the count exchange kernel stores its launch ticket here last (host-mapped): the host spins on it
        self._notify_done = Pinned(1)
        #: the count exchange's epoch, kept on the device and advanced by the kernel (CUDA-graph replays count)
        self._epoch = _compat.cupy.zeros(1, np.int64)
        # The descriptor's static words; each plan gets a copy completed by _describe. It is the kernel's first
        # parameter, passed by value (the driver copies it at launch, so it may be rewritten for the next call
        # while this one is still queued on the stream).
        self._desc = np.zeros(DESC_WORDS, np.int64)
        d = self._desc
        d[DESC_RANK], d[DESC_WORLD_SIZE], d[DESC_NUM_CHANNELS] = self.rank, self.world_size, layout.num_channels
        d[DESC_REGION_BYTES], d[DESC_CHANNEL_BYTES] = layout.region_bytes, layout.channel_bytes
        d[DESC_NUM_SLOTS], d[DESC_CHUNK_BYTES], d[DESC_TIMEOUT_NS] = layout.num_slots, layout.chunk_bytes, \
            int(self.timeout_ns)
        d[DESC_ABORT_OFFSET] = layout.abort_offset
        d[P.DESC_PEER_BASES], d[P.DESC_STATUS] = int(buf.peer_ptrs_device.data.ptr), self.status.ptr
        #: the symmetric table (wire/protocol.py SYM_TABLE_*): where every rank's block of each live symmetric segment
        #: is mapped in this process; the ring kernel's receivers look up a direct-mode sender's block in it
        self.sym_table = _compat.cupy.zeros(P.SYM_TABLE_ROWS * P.SYM_TABLE_STRIDE, np.int64)
        self._sym_rows = [None] * P.SYM_TABLE_ROWS  # segment id per row
        d[DESC_SYM_TABLE], d[DESC_DIRECT_ALLOC], d[DESC_DIRECT_OFFSET] = int(self.sym_table.data.ptr), -1, 0
        d[P.DESC_PUSH_ALLOC: P.DESC_PUSH_ALLOC + MAX_PARTS] = -1
        #: calls this rank sent in direct mode, and dispatches whose outputs its peers pushed into (tests, stats)
        self.direct_calls = 0
        self.push_calls = 0
        #: (start, stop) CUDA events recorded around each ring-kernel launch when set (``bench --breakdown``)
        self.kernel_events = None
        # Compile (or fetch from cache) now so the first collective is not charged for NVRTC.
        geo = kernel_geometry(self.world_size)
        self._k_ring = _kernels.get_function(RING_SOURCE, RING_KERNEL, ring_kernel_defines(self.world_size))
        self._k_notify = _kernels.get_function(RING_SOURCE, NOTIFY_KERNEL)
        # the count exchange through its argument struct (NotifyArgs, _kernels.Launcher): the static fields once
        self._l_notify = _kernels.Launcher(self._k_notify, "NotifyArgs")
        a = self._l_notify.args
        a.recv_meta, a.epoch_word, a.peer_bases = self._meta.ptr, int(self._epoch.data.ptr), \
            int(buf.peer_ptrs_device.data.ptr)
        a.rank, a.world_size, a.abort_offset, a.timeout_ns = self.rank, self.world_size, layout.abort_offset, \
            int(self.timeout_ns)
        (a.region_bytes, a.channel_bytes, a.num_slots, a.chunk_bytes, a.notify_offset,
         a.notify_slot_bytes) = layout.kernel_args()
        a.status = self.status.ptr
        self._ticket = 0  # of the last count exchange whose result the host waits for (notify_result)
        #: Config.mode == "copy_engine": alltoalls of symmetric arrays of at least CE_MIN_BYTES per peer are pulled
        #: by the copy engines (FLAG_CE; every rank's sendbuf the same allocation and offset, checked by the kernel)
        self.copy_engine = False
        #: calls moved by the copy engines (tests, stats)
        self.ce_calls = 0
        self._l_ce = _kernels.Launcher(_kernels.get_function(RING_SOURCE, CE_KERNEL), "CeFinishArgs")
        a = self._l_ce.args
        a.peer_bases, a.rank, a.world_size, a.num_channels = int(buf.peer_ptrs_device.data.ptr), self.rank, \
            self.world_size, layout.num_channels
        a.region_bytes, a.channel_bytes, a.abort_offset, a.timeout_ns, a.status = layout.region_bytes, \
            layout.channel_bytes, layout.abort_offset, int(self.timeout_ns), self.status.ptr
        self._init_small(int(buf.peer_ptrs_device.data.ptr))
        if int(self._k_ring.max_threads_per_block) < geo.max_threads:
            raise RuntimeError(f"{RING_KERNEL}: compiled for {self._k_ring.max_threads_per_block} threads per "
                               f"block, fewer than its variant's {geo.max_threads} (register limit?)")
        self.ring_warps, self.self_warps, self.threads = geo.ring_warps, geo.self_warps, geo.threads
        d[DESC_RING_WARPS], d[DESC_SELF_WARPS] = self.ring_warps, self.self_warps
        # The ring kernel is launched through the driver API (cuLaunchKernel) with its one parameter, the
        # descriptor (RingArgs: DESC_WORDS words, the plan's own block, set per call). A few us per call instead of
        # CuPy's argument marshalling.
        assert 8 * DESC_WORDS == _kernel_args.struct_size("RingArgs")
        self._arg_ptrs = (ctypes.c_void_p * 1)(self._desc.ctypes.data)
        self._bind_ring(ring_kernel_defines(self.world_size))
        #: Config(trace=True): the kernels' channel telemetry (_trace.DeviceRecorder, see enable_trace), else None
        self.trace = None
        #: Config(adaptive=True): the work-sharing build's device load counters (enable_adaptive), else None
        self.load = None
        self._home = None
        #: False: calls return once the kernel is queued (stream order, like NCCL) and a timeout is raised by the
        #: next call or by ``synchronize()``; True: every call waits for its kernel and raises its own timeout.
        self.blocking = False
        self._launch_stream = None     # stream of the last launch (collectives are ordered across streams)
        #: copies made for calls captured into CUDA graphs (their replays read them), released by close()
        self.graph_keep = []
        #: set by close(): a peer's rejection of a queued call never reported (Communicator.close raises it)
        self.pending_rejection = None

    def _init_small(self, peer_bases: int) -> None:
        """The small-message protocol (``Config.small_bytes``, at construction): :attr:`small_peer_bytes` (an
        ``alltoall`` of at most this many bytes per peer goes by it, :meth:`exchange_small`; 0: off), the static
        fields of its kernel's argument (this communicator's own launcher), and the descriptor words with which a
        rejected alltoall's ring kernel watches the peers' small headers. ``peer_bases``: device address of every
        rank's buffer base."""
        layout = self.layout
        #: an alltoall of at most this many bytes per peer goes by the small-message protocol; 0: off. Off on the
        #: staged transport (the same choice on every rank): its control words' atomics on registered host memory
        #: have not been run on a GPU there
        self.small_peer_bytes = 0 if self.staged else layout.small_peer_bytes
        #: calls that went by the small-message protocol (tests, stats)
        self.small_calls = 0
        self._l_small = None
        on = bool(self.small_peer_bytes)
        self._desc[P.DESC_SMALL_OFFSET] = layout.small_offset if on else 0
        self._desc[P.DESC_SMALL_SLOT_BYTES] = layout.small_slot_bytes if on else 0
        if not on:
            return
        self._l_small = _kernels.new_launcher(SMALL_SOURCE, SMALL_KERNEL)
        a = self._l_small.args
        a.peer_bases, a.rank, a.world_size, a.num_channels = peer_bases, self.rank, self.world_size, \
            layout.num_channels
        a.region_bytes, a.channel_bytes, a.num_slots, a.chunk_bytes = layout.region_bytes, layout.channel_bytes, \
            layout.num_slots, layout.chunk_bytes
        a.small_offset, a.slot_bytes, a.abort_offset = layout.small_offset, layout.small_slot_bytes, layout.abort_offset
        a.timeout_ns, a.status = int(self.timeout_ns), self.status.ptr

    def _bind_ring(self, defines) -> None:
        """Compile (or fetch) the ring kernel variant ``defines`` and make it the one every call launches."""
        from cupy_backends.cuda.api import driver
        self._k_ring = _kernels.get_function(RING_SOURCE, RING_KERNEL, tuple(defines))
        if int(self._k_ring.max_threads_per_block) < self.threads:
            raise RuntimeError(f"{RING_KERNEL} {' '.join(defines)}: compiled for {self._k_ring.max_threads_per_block} "
                               f"threads per block, fewer than the {self.threads} it is launched with")
        fn = int(self._k_ring.kernel.ptr)
        params = ctypes.addressof(self._arg_ptrs)
        grid, threads = 2 * self.layout.num_channels, self.threads
        #: SYMBUF_BULK (sm_90+): dynamic shared memory of each ring-kernel block, the copy warps' bulk-copy stages
        # (not on the staged transport: cp.async.bulk may not read or write host memory, and every ring slot is
        # host memory there; the kernel then takes its register copy)
        self.bulk_smem = 0 if self.staged else bulk_shared_bytes(self._k_ring, defines)
        smem = self.bulk_smem
        self._launch = lambda stream_ptr: driver.launchKernel(fn, grid, 1, 1, threads, 1, 1, smem, stream_ptr,
                                                              params, 0)

    @property
    def ring_kernel(self):
        """The ring kernel this transport launches (a ``cupy.RawKernel`` function: ``num_regs``,
        ``local_size_bytes``, ... for reports)."""
        return self._k_ring

    def _variant(self) -> tuple:
        """The ring kernel's build for this world size and the local options (telemetry, work sharing)."""
        return ring_kernel_defines(self.world_size) + (("-DSYMBUF_TRACE=1",) if self.trace is not None else ()) + \
            (("-DSYMBUF_ADAPTIVE=1",) if self.load is not None else ())

    def enable_adaptive(self) -> None:
        """``Config(adaptive=True)`` (at construction, before any call): the ring kernel's work-sharing build
        (``SYMBUF_ADAPTIVE=1``, same wire) and its load counters (device int64 ``[2, num_channels, world_size,
        LOAD_WORDS]``, ``DESC_LOAD``). Local policy."""
        cp = _compat.cupy
        C, W = self.layout.num_channels, self.world_size
        self.load = cp.zeros((2, C, W, P.LOAD_WORDS), np.int64)
        self._load_host = Pinned(self.load.size)  # the asynchronous snapshot (load_snapshot)
        self._load_event = None
        self._desc[P.DESC_LOAD] = int(self.load.data.ptr)
        self._home = np.full(P.HOME_WORDS, -1, np.int64)  # every byte HOME_OWN
        self._desc[P.DESC_HOME: P.DESC_HOME + P.HOME_WORDS] = self._home
        self._bind_ring(self._variant())
        self.load_snapshot()  # the first snapshot (zeros) in flight: every due interval has one to re-balance from

    def set_home(self, load) -> None:
        """The home map of ``load`` (:class:`~cupy_symbuf.adaptive.ChannelLoad`) for the next launches (written
        into each call's descriptor; a captured graph keeps the words of its capture)."""
        if self.load is not None:
            self._home = np.asarray(load.words, np.int64).copy()

    def load_snapshot(self):
        """The load counters as of the previous call of this method (int64 ``[2, C, W, LOAD_WORDS]``), without
        waiting: queues a copy of the device counters into pinned memory on the current stream and returns the one
        queued last time once its event completed (None before that)."""
        cp = _compat.cupy
        got = None
        ev = self._load_event
        if ev is not None:
            if not ev.done:
                return None  # the last copy is still queued: no new one
            got = self._load_host.array.reshape(self.load.shape).copy()
        stream = cp.cuda.get_current_stream()
        cp.cuda.runtime.memcpyAsync(self._load_host.ptr, int(self.load.data.ptr), self.load.nbytes,
                                    cp.cuda.runtime.memcpyDeviceToHost, stream.ptr)
        self._load_event = cp.cuda.Event(disable_timing=True)
        self._load_event.record(stream)
        return got

    def load_totals(self) -> np.ndarray:
        """The device load counters now (waits for every queued kernel)."""
        _compat.cupy.cuda.runtime.deviceSynchronize()
        return _compat.cupy.asnumpy(self.load)

    def load_reset(self) -> None:
        """Zero the device load counters (after every queued kernel); a snapshot still pending is dropped (it holds
        the counters from before the reset)."""
        _compat.cupy.cuda.runtime.deviceSynchronize()
        self.load.fill(0)
        _compat.cupy.cuda.runtime.deviceSynchronize()
        self._load_event = None

    def enable_trace(self, capacity: int = 1 << 18):
        """``Config(trace=True)`` (at construction, before any call): the ring kernel's telemetry build
        (``SYMBUF_TRACE=1``: same protocol, a record per chunk / direct slice / own-rows share) and its device buffer
        of ``capacity`` records; returns the :class:`~cupy_symbuf.transport.trace.DeviceRecorder`. Local policy: the build
        differs from the peers' only by the records it writes."""
        from .trace import DeviceRecorder
        self.trace = DeviceRecorder(capacity)
        self._desc[P.DESC_TRACE], self._desc[P.DESC_TRACE_CAP] = self.trace.ptr, self.trace.capacity
        if self._l_small is not None:  # the small-message kernel records its items too (a runtime check, no build)
            self._l_small.args.trace, self._l_small.args.trace_cap = self.trace.ptr, self.trace.capacity
        self._bind_ring(self._variant())
        return self.trace

    def close(self):
        """Wait for queued kernels, free the host records; return the error recorded but not yet raised (or
        None)."""
        _compat.cupy.cuda.runtime.deviceSynchronize()  # queued kernels still write the error record
        err = None
        if not self.status.reported:
            try:
                self.check("close")
            except (SymBufferTimeoutError, SymBufferMismatchError, SymBufferAbortedError) as exc:
                err = exc
        rejected = self.take_rejected()  # a peer's rejection of a queued call that no synchronize() reported
        if rejected is not None:
            who, seq = rejected
            failed = self.status.op_name(seq)
            self.pending_rejection = SymBufferRejectedError(
                f"close: rank {who} rejected a queued collective ({failed}) and no synchronize() "
                f"reported it: that call's rows from rank {who} were not delivered", rank=self.rank,
                rejecting_rank=who, op=failed)
        self.status.free()
        self.graph_keep = []
        self._notify_done.free()
        self.layout_error.free()
        self._meta.free()
        self._meta_in.free()
        if self.load is not None:
            self._load_host.free()
        return err

    def _next_launch(self, op: str, stream, plan=None) -> int:
        """Number this launch (the ledger, for the error record) and order it after the previous launch when that
        one went to another stream: every kernel starts from the ring counters the previous one left."""
        last = self._launch_stream
        if last is not None and last.ptr != stream.ptr and not stream.is_capturing():
            ev = _compat.cupy.cuda.Event(disable_timing=True)
            ev.record(last)
            stream.wait_event(ev)
        self._launch_stream = stream
        return self.status.ledger.next(op, plan)

    # ---- errors (decoded by self.status: transport/status.py) ------------------------------------------------
    def synchronize(self, op: str = "synchronize") -> None:
        """Wait for the last launch (and the current stream), then raise a recorded error, or the rejection of a
        queued call by a peer (:class:`SymBufferRejectedError`, once)."""
        if self._launch_stream is not None:
            self._launch_stream.synchronize()
        self.check(op, _compat.cupy.cuda.get_current_stream())
        rejected = self.take_rejected()
        if rejected is not None:
            raise self.status.rejected_error(op, *rejected)

    def check_layout_error(self, op: str) -> None:
        """Raise ``ValueError`` (once) when a get_dispatch_layout kernel found topk_idx values out of range (read
        after the stream was synchronised)."""
        le = self.layout_error.array
        if le[0]:
            count, flat = int(le[0]), int(le[1])
            le[0] = le[1] = 0
            raise ValueError(f"get_dispatch_layout (queued earlier; found by {op}): {count} topk_idx value(s) "
                             f"outside [-1, num_experts), the first at flat index {flat} (topk_idx shape and "
                             f"num_experts: {self.layout_error_what}); "
                             f"those slots were left out of the returned counts")

    def take_rejected(self):
        """``(rejecting rank, launch seq)`` recorded by a kernel that received a rejected call header, or None;
        clears it (:meth:`DeviceStatus.take_rejected`)."""
        return self.status.take_rejected()

    def check(self, op: str, stream=None) -> None:
        """Raise the error a kernel recorded, if any; with ``stream``, wait for it first
        (:meth:`DeviceStatus.check`: the record stays set, so a failed communicator refuses further calls and
        queued kernels that still wait see it on the device and give up at once)."""
        self.status.check(op, stream)

    # ---- abort word -----------------------------------------------------------------------------------------
    def read_abort_line(self) -> np.ndarray:
        """This rank's abort line (int64 ``[16]``), copied from device memory (waits for nothing else)."""
        out = np.zeros(P.HDR_WORDS, np.int64)
        cp = _compat.cupy
        with cp.cuda.Device(self.buf.device_id):  # (the side stream's device, whatever the calling thread has)
            side = self._side_stream()
            cp.cuda.runtime.memcpyAsync(
                out.ctypes.data, self.buf.peer_ptrs[self.rank] + self.layout.abort_offset, out.nbytes,
                _MEMCPY_DEFAULT, side.ptr)  # by address: device memory (ipc) or mapped host memory (staged)
            side.synchronize()
        return out

    def _side_stream(self):
        """A stream of this transport's own that waits for no other (``non_blocking``): the abort line is read
        and written on it, so a collective kernel still spinning on the legacy default stream (CuPy's default)
        cannot hold the copies that would end its wait."""
        s = self.__dict__.get("_side")
        if s is None:  # (made and used with this communicator's device current: see the callers)
            s = self._side = _compat.cupy.cuda.Stream(non_blocking=True)
        return s

    def check_abort(self, op: str) -> None:
        """Raise :class:`SymBufferAbortedError` when this rank's abort word is set (one small device read)."""
        line = self.read_abort_line()
        if line[P.ABORT_FLAG]:
            raise aborted_error(op, self.rank, line)

    def set_abort(self, reason: int, peer: int = -1, channel: int = -1, detail: int = 0) -> None:
        """Write this rank's abort into every rank's abort line (fields, then the flag); every waiting kernel of
        every rank leaves with an error naming this rank."""
        rt = _compat.cupy.cuda.runtime
        fields = np.zeros(P.ABORT_DETAIL + 1, np.int64)
        fields[P.ABORT_RANK], fields[P.ABORT_REASON] = self.rank, reason
        fields[P.ABORT_PEER], fields[P.ABORT_CHANNEL], fields[P.ABORT_DETAIL] = peer, channel, detail
        flag = np.ones(1, np.int64)
        off = self.layout.abort_offset
        with _compat.cupy.cuda.Device(self.buf.device_id):  # (abort() may come from a thread with another device)
            side = self._side_stream()
            for base in self.buf.peer_ptrs:  # every rank's fields land before any flag (the stream is synchronised)
                rt.memcpyAsync(base + off + 8, fields[1:].ctypes.data, fields.nbytes - 8, _MEMCPY_DEFAULT, side.ptr)
            side.synchronize()
            for base in self.buf.peer_ptrs:
                rt.memcpyAsync(base + off, flag.ctypes.data, 8, _MEMCPY_DEFAULT, side.ptr)
            side.synchronize()

    def peers_waiting(self) -> list:
        """The peers that have begun a call this rank never joined (sorted), from the words they write into this
        rank's buffer first in every call (read with small copies on the side stream; waits for no kernel): a count
        exchange (the peer's notify slot of the epoch after this rank's last one, the device epoch), a ring call
        (its channel-0 ``tail`` past what this rank's receiver consumed), or a small-protocol call (its small header
        in the half of this rank's next call sequence number, with that call's flag: the ring kernel's test of a
        rejecting receiver). Not read: the low-latency buffers' flags (a peer waiting in a low-latency dispatch or
        combine is not named). Read at exit, after every queued kernel of this rank finished (``close``; none is named
        while the last launch's stream still has work): each call it made consumed what its peers sent in it, so a
        peer merely behind is not named."""
        cp = _compat.cupy
        rt = cp.cuda.runtime
        L, me, W = self.layout, self.rank, self.world_size
        peers = [p for p in range(W) if p != me]
        last = self._launch_stream
        if not peers or (last is not None and not last.done):
            return []  # a kernel of this rank is still queued: its call may still be under way (none named)
        base = self.buf.peer_ptrs[me]
        # per peer: channel-0 tail, receiver state (counter, seq), notify epochs of both parities; then our epoch.
        # Only the next call's parity ((epoch + 1) & 1) is tested, but the epoch is a device word (advanced by the
        # notify kernel, graph replays included: the host has no copy of it), read in this same batch of copies:
        # both parities cost one more 8-byte copy per peer, one parity a second round of copies and synchronize.
        first = np.zeros(5 * len(peers) + 1, np.int64)
        srcs = []
        for p in peers:
            srcs += [base + L.tail_offset(0, p), base + L.recv_head_offset(0, p) + 8 * P.STATE_COUNTER,
                     base + L.recv_head_offset(0, p) + 8 * P.STATE_SEQ,
                     base + L.notify_slot_offset(0, p) + 8 * P.NOTIFY_EPOCH,
                     base + L.notify_slot_offset(1, p) + 8 * P.NOTIFY_EPOCH]
        srcs.append(int(self._epoch.data.ptr))
        small = bool(self.small_peer_bytes)
        with cp.cuda.Device(self.buf.device_id):
            side = self._side_stream()
            for i, src in enumerate(srcs):
                rt.memcpyAsync(first.ctypes.data + 8 * i, src, 8, _MEMCPY_DEFAULT, side.ptr)
            side.synchronize()
            epoch = int(first[-1])
            out, unsure = [], []
            for i, p in enumerate(peers):
                tail, consumed, seq, e0, e1 = (int(v) for v in first[5 * i: 5 * i + 5])
                if tail > consumed or (e1 if (epoch + 1) & 1 else e0) >= epoch + 1:
                    out.append(p)
                elif small:
                    unsure.append((p, seq + 1))
            if unsure:
                hdr = np.zeros(len(unsure), np.int64)
                for i, (p, nxt) in enumerate(unsure):
                    rt.memcpyAsync(hdr.ctypes.data + 8 * i,
                                   base + L.small_slot_offset(nxt & 1, p) + 8 * P.SMALL_H_OP, 8, _MEMCPY_DEFAULT,
                                   side.ptr)
                side.synchronize()
                mod = _kernels.small_flag_mod()
                out += [p for (p, nxt), word in zip(unsure, hdr.tolist())
                        if (word >> 32) & 0xFFFFFFFF == P.small_flag(nxt, mod)]
        return sorted(out)

    # ---- symmetric table ------------------------------------------------------------------------------------
    def sym_register(self, seg) -> bool:
        """Enter symmetric segment ``seg`` (``SymmetricSegment``: ``id``, ``buffer``) in the symmetric table (one
        row per segment; every symmetric array of the segment is found there by the segment's id and the array's
        offset in it); False when the table is full (``SYM_TABLE_ROWS`` live segments; the same on every rank, as
        allocation is collective): then sendbufs in it go through the rings. Synchronous (a row is written before
        any kernel can name it)."""
        try:
            row = self._sym_rows.index(None)
        except ValueError:
            return False
        words = np.zeros(P.SYM_TABLE_STRIDE, np.int64)
        words[0], words[1] = seg.id + 1, seg.buffer.nbytes
        words[2: 2 + self.world_size] = seg.buffer.peer_ptrs
        s = row * P.SYM_TABLE_STRIDE
        self.sym_table[s: s + P.SYM_TABLE_STRIDE].set(words)
        _compat.cupy.cuda.runtime.deviceSynchronize()
        self._sym_rows[row] = seg.id
        return True

    def sym_unregister(self, seg) -> None:
        """Clear ``seg``'s row (after the device was synchronised: no queued kernel reads it)."""
        if seg.id in self._sym_rows:
            row = self._sym_rows.index(seg.id)
            s = row * P.SYM_TABLE_STRIDE
            self.sym_table[s: s + P.SYM_TABLE_STRIDE].set(np.zeros(P.SYM_TABLE_STRIDE, np.int64))
            _compat.cupy.cuda.runtime.deviceSynchronize()  # before the row can be given to a new segment
            self._sym_rows[row] = None
        seg.registered = False

    # ---- row exchange ---------------------------------------------------------------------------------------
    def exchange_rows(self, plan, send_parts, send_index, recv_parts, op: str, direct=None, counts: int = 0,
                      push=None, *, tag: int = 0, stream=None) -> list:
        """Run one call of ``plan`` (:class:`~cupy_symbuf.wire.plan.ExchangePlan`) in one kernel launch on the current
        stream: every (channel, peer) run sends its call header and its chunks and receives the peer's.

        ``send_parts``: CuPy arrays ``[n, ...]`` whose rows (all axes after the first) are contiguous, any row
        stride; ``send_index``: int64 CuPy array ``[sum(send_counts)]`` or None; ``recv_parts``: C-contiguous.
        ``direct``: ``(MODE_DIRECT, SymmetricSegment, byte offset in it)`` (``Engine.direct_source``): the send
        part lies in a registered symmetric segment; every peer's kernel copies its share straight out of it
        (MODE_DIRECT headers, no payload chunks) and this rank's kernel ends once every peer has.
        ``push``: ``(segment id or -1 per receive part, rows of the receive parts)`` (``Engine.push_targets``):
        MODE_PUSH, the peers write those parts of their rows straight into ``recv_parts`` (symmetric outputs).
        ``tag``: folded into the signature of this call's headers (``protocol.call_signature``; every peer must
        pass the same; a captured launch keeps the tag it was captured with). ``stream``: the current CuPy stream
        when the caller has it already (None: asked here).
        Returns once the kernel is queued, with ``[]``; with ``self.blocking`` once it ended, with the ranks that
        rejected the call. Raises an error an earlier kernel recorded, before anything else.
        """
        cp = _compat.cupy
        self.check(op)  # a failure of an earlier, unawaited call surfaces here, before anything else
        launch = self.prepare(plan, send_parts, recv_parts)
        d = launch.desc
        if d is None:
            return []  # one rank, nothing to move
        copies = None
        if launch.copy_send:  # a byte run is one span per peer: rows that are not contiguous are copied first
            send_parts = copies = [cp.ascontiguousarray(send_parts[0])]
        for w, a in zip(launch.send_words, send_parts):
            d[w] = a.data.ptr
        for w, a in zip(launch.recv_words, recv_parts):
            d[w] = a.data.ptr
        if send_index is not None:
            index = send_index  # read as int64[rows] by the kernel; a handle's send_idx already is
            if index.dtype != _INT64 or not index._c_contiguous:
                index = cp.ascontiguousarray(send_index, dtype=cp.int64)
            if index is not send_index:
                copies = (copies or []) + [index]
            d[DESC_SEND_INDEX] = index.data.ptr
        d[DESC_COUNTS] = counts  # a device counts table (device-count plans), else 0
        ce = False
        if direct is not None and not launch.copy_send:
            d[DESC_DIRECT_ALLOC], d[DESC_DIRECT_OFFSET] = direct[1].id, direct[2]
            self.direct_calls += 1
            ce = self.copy_engine and plan.op == "alltoall" and counts == 0 and self.world_size > 1 and \
                int(plan.send_units[0]) >= P.CE_MIN_BYTES
        else:
            d[DESC_DIRECT_ALLOC] = -1
        flags = (P.FLAG_REJECT if plan.reject else 0) | (P.FLAG_CE if ce else 0)
        if push is not None and not plan.reject:
            ids, rows = push
            d[P.DESC_PUSH_ALLOC: P.DESC_PUSH_ALLOC + len(ids)] = ids
            d[P.DESC_PUSH_ROWS] = rows
            flags |= P.FLAG_PUSH
            self.push_calls += 1
        if stream is None:
            stream = cp.cuda.get_current_stream()
        if copies is not None and stream.is_capturing():  # a captured kernel reads them at every replay
            self.graph_keep.extend(copies)
        return self._fire(op, plan, launch, flags, tag, stream, (direct, recv_parts[0]) if ce else None)

    def prepare(self, plan, send_parts, recv_parts) -> _Launch:
        """The launch of ``plan`` for these parts' row strides (its descriptor, addresses written per call), made
        once and kept with the plan: :meth:`exchange_rows` uses it, and a caller that keeps it for repeated calls of
        one shape hands it to :meth:`launch_prepared`."""
        if len(send_parts) == 1:  # (the usual case without a generator)
            a = send_parts[0]
            strides = (a.strides[0] if a.shape[0] > 1 else -1,)
        else:
            strides = tuple(a.strides[0] if a.shape[0] > 1 else -1 for a in send_parts)
        launches = plan.engine_data
        if launches is None:
            launches = plan.engine_data = {}
        launch = launches.get(strides)
        if launch is None:
            launch = launches[strides] = self._describe(plan, send_parts, recv_parts)
        return launch

    def launch_prepared(self, op: str, plan, launch: _Launch, send_ptrs, recv_ptrs, index_ptr: int, counts: int,
                        tag: int, stream) -> list:
        """:meth:`exchange_rows` of a row-run call whose :meth:`prepare` the caller kept (a repeated call of one
        shape: parts of the strides it was prepared for, rows contiguous within a row, no direct source, no push):
        the parts by address (``send_ptrs``, ``recv_ptrs``; ``index_ptr``: the int64 C-contiguous send index's, or
        None for a plan without one), ``counts`` the device counts table, ``stream`` the current stream. The same
        descriptor words, checks and launch as :meth:`exchange_rows` of the same arrays."""
        self.check(op)  # a failure of an earlier, unawaited call surfaces here, before anything else
        d = launch.desc
        if d is None:
            return []  # one rank, nothing to move
        if launch.copy_send:  # (a byte run of strided rows is copied per call: exchange_rows only)
            raise AssertionError(f"{op}: internal: launch_prepared of a byte run whose rows are copied")
        for w, p in zip(launch.send_words, send_ptrs):
            d[w] = p
        for w, p in zip(launch.recv_words, recv_ptrs):
            d[w] = p
        if index_ptr is not None:
            d[DESC_SEND_INDEX] = index_ptr
        d[DESC_COUNTS] = counts
        d[DESC_DIRECT_ALLOC] = -1
        return self._fire(op, plan, launch, P.FLAG_REJECT if plan.reject else 0, tag, stream, None)

    def repeat_prepare(self, op: str, plan, launch: _Launch, index_ptr, counts: int, tag: int):
        """The :class:`RepeatLaunch` of :meth:`launch_prepared` with these arguments that stay the same from call to
        call (``index_ptr``: None for a plan without a send index; ``counts``: the device counts table; ``tag``), or
        None where a call must go through :meth:`launch_prepared` (one rank: nothing to move; a byte run whose rows
        are copied)."""
        if launch.desc is None or launch.copy_send:
            return None
        r = RepeatLaunch()
        r.op, r.plan = op, plan
        d = r.desc = launch.desc.copy()  # the plan's words for these strides; never shared with another caller
        if index_ptr is not None:
            d[DESC_SEND_INDEX] = index_ptr
        d[DESC_COUNTS], d[DESC_DIRECT_ALLOC] = counts, -1
        d[DESC_FLAGS] = P.FLAG_REJECT if plan.reject else 0
        d[DESC_SIG] = P.call_signature(plan.sig, tag)
        r.addr = d.ctypes.data
        r.words = memoryview(d).cast("B").cast("q")
        r.ptr_words = tuple(launch.send_words) + tuple(launch.recv_words)
        return r

    def fire_repeat(self, r: RepeatLaunch, ptrs, stream) -> list:
        """One call of :meth:`launch_prepared` from its :class:`RepeatLaunch`: ``ptrs`` the addresses of the send
        parts then the receive parts (as ``r.ptr_words``), ``stream`` the current stream. The same descriptor words,
        checks, ledger entry and launch."""
        if self.status.words[P.STATUS_FLAG]:  # (check() reads the same word first)
            self.check(r.op)  # a failure of an earlier, unawaited call surfaces here, before anything else
        w = r.words
        for i, p in zip(r.ptr_words, ptrs):
            w[i] = p
        if self._home is not None:  # adaptive: the current home map (plans keep no copy of their own)
            r.desc[P.DESC_HOME: P.DESC_HOME + P.HOME_WORDS] = self._home
        w[DESC_SEQ] = self.status.ledger.next(r.op, r.plan) if self._launch_stream is stream else \
            self._next_launch(r.op, stream, r.plan)
        self._arg_ptrs[0] = r.addr  # the driver copies the descriptor at launch: it may change after
        if self.kernel_events is not None:  # bench --breakdown: time the kernel alone
            self.kernel_events[0].record(stream)
        self._launch(stream.ptr)
        if self.kernel_events is None and not self.blocking:
            return ()
        return self._launched(r.op, stream)

    def _launched(self, op: str, stream) -> list:
        """After a ring launch: the kernel's end event (``bench --breakdown``), and with ``blocking`` the wait for it:
        the ranks that rejected the call (else ``[]``)."""
        if self.kernel_events is not None:
            self.kernel_events[1].record(stream)
        if self.blocking:
            self.check(op, stream)
            rejected = self.take_rejected()
            return [] if rejected is None else [rejected[0]]
        return []

    def _fire(self, op: str, plan, launch: _Launch, flags: int, tag: int, stream, ce) -> list:
        """The words every ring launch writes last (flags, signature with ``tag``, home map, launch number), the
        launch on ``stream``, and with ``ce`` (``(direct, recv)``) the copy-engine pull after it; the ranks that
        rejected the call when it waited (``blocking``), else ``[]``."""
        d = launch.desc
        d[DESC_FLAGS] = flags
        d[DESC_SIG] = P.call_signature(plan.sig, tag)
        if self._home is not None:  # adaptive: the current home map (plans keep no copy of their own)
            d[P.DESC_HOME: P.DESC_HOME + P.HOME_WORDS] = self._home
        d[DESC_SEQ] = self._next_launch(op, stream, plan)
        self._arg_ptrs[0] = launch.addr  # the driver copies the descriptor at launch: it may change after
        if self.kernel_events is not None:  # bench --breakdown: time the kernel alone
            self.kernel_events[0].record(stream)
        self._launch(stream.ptr)
        if ce is not None:
            self._copy_engine_pull(plan, ce[0], ce[1], stream, int(d[DESC_SEQ]))
        return self._launched(op, stream)

    def exchange_small(self, plan, x, recv) -> list:
        """One ``alltoall`` of ``plan`` by the small-message protocol (``cuda_src/small_exchange.cu``): ``x`` and
        ``recv`` are CuPy arrays of the same shape ``[world_size, ...]`` and dtype, ``recv`` C-contiguous, at most
        :attr:`small_peer_bytes` per peer (the caller checked it: every rank decides from the same agreed size).
        One launch on the current stream, nothing read on the host (graph-capturable). Returns ``[]`` once queued;
        with ``self.blocking`` once it ended, with the rank that rejected the call (its rows in ``recv`` are not
        delivered). Raises an error an earlier kernel recorded, before anything else."""
        cp = _compat.cupy
        self.check(plan.op)
        stream = cp.cuda.get_current_stream()
        if not x._c_contiguous:  # the kernel reads one byte run per peer
            x = cp.ascontiguousarray(x)
            if stream.is_capturing():  # a captured kernel reads it at every replay
                self.graph_keep.append(x)
        return self.fire_small(self.small_prepare(plan, x.nbytes), x.data.ptr, recv.data.ptr, stream)

    def small_prepare(self, plan, nbytes: int) -> tuple:
        """What a small-message ``alltoall`` of ``plan`` with a sendbuf of ``nbytes`` bytes hands its kernel besides the
        addresses and the launch number (a caller may keep it for repeated calls of one shape; :meth:`fire_small`)."""
        W = self.world_size
        n = nbytes // W
        # items of SMALL_WORDS_PER_ITEM words per peer, on at most the rank's SM share of blocks (the ring kernel's
        # grid): a block takes several items when there are more
        blocks = 2 * self.layout.num_channels
        words = -(-n // 4)
        per = max(1, min(-(-words // P.SMALL_WORDS_PER_ITEM), blocks // W))
        return plan, n, per, min(W * per, blocks)

    def fire_small(self, prepared: tuple, send_ptr: int, recv_ptr: int, stream) -> list:
        """:meth:`exchange_small` of a C-contiguous sendbuf at ``send_ptr`` into ``recv_ptr`` on ``stream`` (the
        current stream) with its :meth:`small_prepare`."""
        plan, n, per, grid = prepared
        op = plan.op
        if self.status.words[P.STATUS_FLAG]:  # (check() reads the same word first)
            self.check(op)
        a = self._l_small.args
        _SMALL_HEAD.pack_into(a, 0, send_ptr, recv_ptr, n, plan.op_code, plan.sig)  # (send, recv, bytes, op, sig)
        a.items_per_peer = per
        a.seq = self.status.ledger.next(op, plan) if self._launch_stream is stream else \
            self._next_launch(op, stream, plan)
        if self.kernel_events is not None:  # bench --breakdown: time the kernel alone
            self.kernel_events[0].record(stream)
        self._l_small(grid, P.SMALL_THREADS, stream=stream)
        self.small_calls += 1
        if self.kernel_events is None and not self.blocking:
            return ()
        return self._launched(op, stream)

    def _copy_engine_pull(self, plan, direct, recv, stream, seq: int) -> None:
        """FLAG_CE, after the ring kernel (which checked that every peer's run lies where this assumes and copied
        nothing, this rank's own rows included). The copies are queued before that check's outcome is known: on a
        call a peer rejected (or that failed) they still read the peer's block, so ``recv`` then holds arbitrary
        bytes for that peer, and the call raises (:class:`SymBufferRejectedError` / the failure). One
        ``cudaMemcpyAsync`` per rank, from its block of the same symmetric segment at this rank's own offset plus
        this rank's rows, into ``recv``, then ``symbuf_ce_finish`` (heads back, the peers' heads awaited)."""
        rt = _compat.cupy.cuda.runtime
        seg, off = direct[1], direct[2]
        src_off = off + int(plan.send_first[self.rank])
        dst = int(recv.data.ptr)
        for j in range(self.world_size):  # this rank's own rows too (the kernel left them to the copy engine)
            rt.memcpyAsync(dst + int(plan.recv_first[j]), seg.buffer.peer_ptrs[j] + src_off,
                           int(plan.recv_units[j]), _MEMCPY_DEFAULT, stream.ptr)
        self._l_ce.args.seq = seq
        self._l_ce(1, 256, stream=stream)
        self.ce_calls += 1

    def _describe(self, plan, send_parts, recv_parts) -> _Launch:
        """The descriptor of ``plan`` for these parts' strides (addresses are filled per call)."""
        W = self.world_size
        d = self._desc.copy()  # the static words (rank, layout, warps) and room for this plan
        d[DESC_OP], d[DESC_SIG], d[DESC_FLAGS] = plan.op_code, plan.sig, P.FLAG_REJECT if plan.reject else 0
        d[DESC_SEND_INDEX] = d[DESC_RECV_INDEX] = 0
        if plan.reject:
            d[DESC_ROW_BYTES], d[DESC_ROW_ALIGN] = 1, 1
            d[DESC_NUM_SEND_PARTS] = d[DESC_NUM_RECV_PARTS] = 0
            return _Launch(d, False, 0, 0)
        sgeo = [part_geometry(a) for a in send_parts]
        rgeo = [part_geometry(a) for a in recv_parts]
        if W == 1 and not plan.send_units.any() and not plan.device_counts:
            return _Launch(None, False, 0, 0)
        if [g[2] for g in sgeo] != list(plan.part_widths) or [g[2] for g in rgeo] != list(plan.part_widths) or \
                (plan.byte_run and rgeo[0][2] and rgeo[0][1] != rgeo[0][2]):  # (zero-width rows: no bytes)
            raise AssertionError(f"{plan.op}: internal: parts differ from the plan ({sgeo} vs {rgeo} vs {plan})")
        copy_send = plan.byte_run and bool(sgeo[0][2]) and sgeo[0][1] != sgeo[0][2]
        if plan.byte_run:  # 1-byte rows; channel boundaries 16-byte aligned
            sgeo = rgeo = [(0, 1, 1)]
        d[DESC_ROW_BYTES], d[DESC_ROW_ALIGN] = plan.unit_bytes, plan.align
        for base, geo in ((DESC_SEND_PARTS, sgeo), (DESC_RECV_PARTS, rgeo)):
            off = 0
            for i, (_, stride, width) in enumerate(geo):
                d[base + 4 * i: base + 4 * i + 4] = (0, stride, width, off)  # base address: per call
                off += width
        d[DESC_NUM_SEND_PARTS], d[DESC_NUM_RECV_PARTS] = len(sgeo), len(rgeo)
        peers = d[DESC_PEERS: DESC_PEERS + 4 * W].reshape(4, W)
        peers[0], peers[1], peers[2], peers[3] = plan.send_first, plan.send_units, plan.recv_first, plan.recv_units
        return _Launch(d, copy_send, len(send_parts), len(recv_parts))

    # ---- notify ---------------------------------------------------------------------------------------------
    def notify(self, send_meta: np.ndarray, epoch: int, op: str = "notify", *, op_code: int = 0, status: int = 0,
               sig: int = 0, wait: bool = True) -> np.ndarray:
        """Count exchange (``cuda_src/ring_exchange.cu`` ``symbuf_notify``): ``send_meta`` int64 ``[W, M]``;
        returns int64 ``[W, 3 + M]`` whose row ``s`` is rank ``s``'s ``[op, status, signature, values...]``.
        Waits (the host needs the counts) unless ``wait`` is False (a rejection told to the peers), then returns
        None. ``epoch`` is the host engine's; the kernel keeps its own in device memory."""
        W, M = send_meta.shape
        self.check(op)  # a failure of an earlier, unawaited call surfaces first
        self._meta_in.array[: W * M] = send_meta.reshape(-1)  # read by the kernel from pinned memory
        self.notify_device(self._meta_in.ptr, M, op, op_code=op_code, status=status, sig=sig)
        if not wait:
            return None
        return self.notify_result(op, M)

    def notify_result(self, op: str, M: int) -> np.ndarray:
        """Wait for the last count exchange and return its host-mapped result, int64 ``[W, 3 + M]``.

        The one host wait of an eager call (DeepEP's ``notify_dispatch`` idea): the host spins on the kernel's
        host-mapped done word (its launch ticket, stored last with a system-scope release) instead of
        synchronising the stream; after ``timeout_s`` (a kernel queued before it never ends) or when the error
        record is set, the stream is synchronised and the recorded error raised."""
        done, st, want = self._notify_done.array, self.status.words, self._ticket
        deadline = None
        spins = 0
        while done[0] != want and not st[P.STATUS_FLAG]:
            spins += 1
            if spins & 1023 == 0:
                if deadline is None:
                    deadline = time.monotonic() + self.timeout_s
                elif time.monotonic() > deadline:
                    break
        if done[0] != want or st[P.STATUS_FLAG]:
            self.check(op, _compat.cupy.cuda.get_current_stream())
        W = self.world_size
        width = P.NOTIFY_HDR_WORDS - 1 + M
        return self._meta.array[: W * width].reshape(W, width).copy()

    def sent_meta(self, M: int) -> np.ndarray:
        """int64 ``[W, M]``: what the last count exchange with ``echo`` sent (read after :meth:`notify_result`)."""
        return self._meta_in.array[: self.world_size * M].reshape(self.world_size, M).copy()

    def notify_device(self, send_meta_ptr: int, M: int, op: str, *, op_code: int, status: int, sig: int,
                      local_reject: int = 0, echo: bool = False, sums: int = 0, table: int = 0, scale: int = 1,
                      capacity: int = -1, device_checks: bool = False) -> None:
        """Queue the count exchange kernel on the current stream and return at once (graph-capturable: nothing
        is read on the host). ``send_meta_ptr``: device (or host-mapped) int64 ``[W, M]``; ``local_reject``,
        ``sums``, ``table``: device addresses or 0 (see the kernel's comment); ``echo``: copy the sent values
        into host-mapped memory (:meth:`sent_meta`)."""
        W = self.world_size
        stream = _compat.cupy.cuda.get_current_stream()
        threads = max(32, min(1024, (max(W, M) + 31) // 32 * 32))
        a = self._l_notify.args
        a.send_meta, a.num_values, a.op, a.call_status, a.sig = send_meta_ptr, M, op_code, status, sig
        a.seq = self._next_launch(op, stream)
        a.local_reject, a.send_echo, a.sums, a.table = local_reject, self._meta_in.ptr if echo else 0, sums, table
        a.scale, a.capacity, a.device_checks = scale, capacity, 1 if device_checks else 0
        # the done word only for calls whose result the host waits for: a captured (device-checked) call replayed
        # later must never overwrite the ticket an eager call's host is spinning on
        self._ticket += 1
        a.done, a.ticket = (0, 0) if device_checks else (self._notify_done.ptr, self._ticket)
        self._l_notify(1, threads, stream=stream)

    #: the launcher of ``symbuf_moe_layout_notify`` (an eager dispatch's layout and count exchange), made on first use
    _l_moe_notify = None

    def notify_layout_device(self, layout: tuple, M: int, op: str, *, op_code: int, sig: int, meta: int,
                             bad: int, sums: int, table: int, capacity: int = -1) -> None:
        """:meth:`notify_device` of an eager MoE dispatch (``echo``, host checks, the done word) with the layout
        kernel in the same launch (``symbuf_moe_layout_notify``): ``layout`` = ``(idx, num_tokens, num_topk,
        num_experts, in_rank, pos, send_idx, threads, shared_mem)`` (addresses as ints; ``threads`` at least
        the layout's and the count exchange's); the layout writes the values at ``meta`` (device int64
        ``[W, M]``) and its bad-value count at ``bad`` (the call's local rejection), which the count exchange then
        reads, as the two launches on one stream would; ``capacity``: as :meth:`notify_device`'s. Queued on the
        current stream; nothing read on the host."""
        fn = self._l_moe_notify
        if fn is None:  # the count exchange's static fields (symbuf_notify's), once
            fn = self._l_moe_notify = _kernels.new_launcher(RING_SOURCE, MOE_NOTIFY_KERNEL)
            src, a = self._l_notify.args, fn.args
            for f in ("recv_meta", "epoch_word", "peer_bases", "rank", "world_size", "abort_offset", "timeout_ns",
                      "region_bytes", "channel_bytes", "num_slots", "chunk_bytes", "notify_offset",
                      "notify_slot_bytes", "status"):
                setattr(a, f, getattr(src, f))
            a.call_status, a.scale, a.device_checks = P.HDR_OK, 1, 0
            a.send_echo, a.done = self._meta_in.ptr, self._notify_done.ptr
        stream = _compat.cupy.cuda.get_current_stream()
        a = fn.args
        a.send_meta, a.num_values, a.op, a.sig, a.local_reject, a.sums, a.table = meta, M, op_code, sig, bad, sums, \
            table
        a.capacity = capacity
        (a.idx, a.num_tokens, a.num_topk, a.num_experts, a.in_rank, a.pos, a.send_idx, threads, smem) = layout
        a.seq = self._next_launch(op, stream)
        self._ticket += 1
        a.ticket = self._ticket
        fn(1, threads, shared_mem=smem, stream=stream)

    #: the launcher of ``symbuf_counts_meta`` (capacity mode), made on first use
    _l_counts_meta = None

    def counts_meta(self, counts_ptr: int, num_rows: int, meta_ptr: int, bad_ptr: int) -> None:
        """Queue ``symbuf_counts_meta`` (``cuda_src/ring_exchange.cu``) on the current stream: the device int64 counts
        ``[W]`` at ``counts_ptr`` copied to ``meta_ptr``, and ``bad_ptr`` ``[2]`` set to (1 when a count is
        negative or they do not sum to ``num_rows``, else 0; the first negative count's rank or -1)."""
        fn = self._l_counts_meta
        if fn is None:
            fn = self._l_counts_meta = _kernels.new_launcher(RING_SOURCE, "symbuf_counts_meta")
        fn.fill(counts=counts_ptr, world_size=self.world_size, rows=num_rows, meta=meta_ptr, bad=bad_ptr)
        fn(1, 32)
