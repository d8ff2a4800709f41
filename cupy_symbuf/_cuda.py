"""GPU transport: launches the ring kernels of ``cuda_src/alltoall.cu`` on the current CuPy stream."""
from __future__ import annotations

import ctypes
import math

import numpy as np

from . import _compat, _kernels
from .errors import SymBufferTimeoutError
from ._plan import ring_kernel_defines, warp_groups  # noqa: F401 (re-exported)
from .layout import ChannelLayout, check_row_fits, is_byte_stream

__all__ = ["CudaTransport", "warp_groups"]

_ROLES = {0: "send", 1: "recv", 2: "notify"}
_STATUS_INTS = 8


class _Pinned:
    """Host-mapped pinned int64 array, written by kernels and read by the host without a copy (UVA)."""

    def __init__(self, count: int):
        rt = _compat.cupy.cuda.runtime
        self.nbytes = 8 * count
        self.ptr = rt.hostAlloc(self.nbytes, rt.hostAllocMapped)
        self.array = np.ctypeslib.as_array((ctypes.c_int64 * count).from_address(self.ptr))
        self.array[:] = 0

    def free(self) -> None:
        if self.ptr:
            _compat.cupy.cuda.runtime.freeHost(self.ptr)
            self.ptr = 0


# Words of the alltoallv launch descriptor; must match the DESC_* enum of cuda_src/layout.cuh (a CPU test checks).
DESC_RANK, DESC_WORLD_SIZE, DESC_NUM_CHANNELS, DESC_REGION_BYTES, DESC_CHANNEL_BYTES, DESC_NUM_SLOTS, \
    DESC_CHUNK_BYTES, DESC_TIMEOUT_NS = range(8)
DESC_ROW_BYTES, DESC_ROW_ALIGN, DESC_SEND_INDEX, DESC_RECV_INDEX, DESC_NUM_SEND_PARTS, DESC_NUM_RECV_PARTS, \
    DESC_RING_WARPS, DESC_SELF_WARPS = range(8, 16)
DESC_SEND_PARTS = 16
DESC_RECV_PARTS = 32
DESC_PEERS = 48
MAX_PARTS = 4
MAX_PEERS = 32
DESC_SEQ = DESC_PEERS + 4 * MAX_PEERS
DESC_WORDS = DESC_SEQ + 1


def part_geometry(a) -> tuple:
    """``(base address, row stride, row width)`` in bytes of an array whose rows (everything after axis 0) are
    contiguous."""
    width = a.dtype.itemsize * math.prod(a.shape[1:])
    stride = a.strides[0] if a.shape[0] > 1 else width
    return int(a.data.ptr), int(stride), int(width)


class _Plan:
    """A launch descriptor for one shape of row exchange (everything but the buffer addresses, which are written
    per call), or ``desc is None`` when nothing moves."""

    __slots__ = ("desc", "addr", "copy_send", "send_words", "recv_words")

    def __init__(self, desc, copy_send: bool, num_send: int, num_recv: int):
        self.desc = desc
        self.addr = 0 if desc is None else desc.ctypes.data
        self.copy_send = copy_send
        self.send_words = [DESC_SEND_PARTS + 4 * i for i in range(num_send)]
        self.recv_words = [DESC_RECV_PARTS + 4 * i for i in range(num_recv)]


_MAX_PLANS = 64
_OPS_KEPT = 256


class CudaTransport:
    """Runs row streams (alltoallv) and the notify step over a cuda :class:`~cupy_symbuf.SymBuffer`."""

    def __init__(self, buf, layout: ChannelLayout, timeout_s: float):
        self.buf = buf
        self.layout = layout
        self.timeout_s = timeout_s
        self.rank = buf.rank
        self.world_size = buf.world_size
        self.timeout_ns = np.uint64(int(timeout_s * 1e9))
        self._status = _Pinned(_STATUS_INTS)
        self._meta = _Pinned(self.world_size * layout.max_notify_ints)
        self._meta_in = _Pinned(self.world_size * layout.max_notify_ints)
        # The launch descriptor's static words; each row-exchange shape gets a copy completed by _plan. It is the
        # kernel's first parameter, passed by value (the driver copies it at launch, so it may be rewritten for the
        # next call while this one is still queued on the stream).
        self._desc = np.zeros(DESC_WORDS, np.int64)
        d = self._desc
        d[DESC_RANK], d[DESC_WORLD_SIZE], d[DESC_NUM_CHANNELS] = self.rank, self.world_size, layout.num_channels
        d[DESC_REGION_BYTES], d[DESC_CHANNEL_BYTES] = layout.region_bytes, layout.channel_bytes
        d[DESC_NUM_SLOTS], d[DESC_CHUNK_BYTES], d[DESC_TIMEOUT_NS] = layout.num_slots, layout.chunk_bytes, \
            int(self.timeout_ns)
        #: (start, stop) CUDA events recorded around each alltoallv launch when set (``bench --breakdown``)
        self.kernel_events = None
        self._layout_args = tuple(np.int64(v) for v in layout.kernel_args())
        # Compile (or fetch from cache) now so the first collective is not charged for NVRTC.
        self._k_alltoallv = _kernels.get_function("alltoall.cu", "symbuf_alltoallv",
                                                  ring_kernel_defines(self.world_size))
        self._k_notify = _kernels.get_function("alltoall.cu", "symbuf_notify")
        self.ring_warps, self.self_warps = warp_groups(self.world_size,
                                                       int(self._k_alltoallv.max_threads_per_block))
        self.threads = 32 * ((self.world_size - 1) * self.ring_warps + self.self_warps)
        d[DESC_RING_WARPS], d[DESC_SELF_WARPS] = self.ring_warps, self.self_warps
        # The ring kernel is launched through the driver API (cuLaunchKernel) with a parameter block built once:
        # the descriptor array, the device array of peer bases and the error record. A few us per call instead of
        # CuPy's argument marshalling, and the only way to pass a struct by value.
        from cupy_backends.cuda.api import driver
        fn = int(self._k_alltoallv.kernel.ptr)
        self._ptr_args = (ctypes.c_uint64 * 2)(buf.peer_ptrs_device.data.ptr, self._status.ptr)
        base = ctypes.addressof(self._ptr_args)
        self._arg_ptrs = (ctypes.c_void_p * 3)(self._desc.ctypes.data, base, base + 8)
        params = ctypes.addressof(self._arg_ptrs)
        grid, threads = 2 * layout.num_channels, self.threads
        self._launch = lambda stream_ptr: driver.launchKernel(fn, grid, 1, 1, threads, 1, 1, 0, stream_ptr,
                                                              params, 0)
        self._plans = {}  # row-exchange shape -> _Plan
        #: False: calls return once the kernel is queued (stream order, like NCCL) and a timeout is raised by the
        #: next call or by ``synchronize()``; True: every call waits for its kernel and raises its own timeout.
        self.blocking = False
        self._seq = 0                  # launches so far; a failing wait writes its launch's number into the record
        self._ops = [""] * _OPS_KEPT   # op name of launch seq, at seq % _OPS_KEPT
        self._last_stream = None       # stream of the last launch (collectives are ordered across streams)
        self._reported = False

    def close(self):
        """Wait for queued kernels, free the host records; return the timeout error recorded but not yet raised
        (or None)."""
        _compat.cupy.cuda.runtime.deviceSynchronize()  # queued kernels still write the error record
        err = None
        if not self._reported:
            try:
                self.check("close")
            except SymBufferTimeoutError as exc:
                err = exc
        self._status.free()
        self._meta.free()
        self._meta_in.free()
        return err

    def _next_launch(self, op: str, stream) -> int:
        """Number this launch (for the error record) and order it after the previous launch when that one went
        to another stream: every kernel starts from the ring counters the previous one left."""
        last = self._last_stream
        if last is not None and last.ptr != stream.ptr:
            ev = _compat.cupy.cuda.Event(disable_timing=True)
            ev.record(last)
            stream.wait_event(ev)
        self._last_stream = stream
        self._seq += 1
        self._ops[self._seq % _OPS_KEPT] = op
        return self._seq

    def synchronize(self, op: str = "synchronize") -> None:
        """Wait for the last launch (and the current stream), then raise a recorded timeout."""
        if self._last_stream is not None:
            self._last_stream.synchronize()
        self.check(op, _compat.cupy.cuda.get_current_stream())

    def check(self, op: str, stream=None) -> None:
        """Raise the :class:`SymBufferTimeoutError` a kernel recorded, if any; with ``stream``, wait for it first.

        Without ``stream`` this reads the host-mapped error record without waiting: a failure shows as soon as a
        wait has recorded it. The record stays set (a failed communicator refuses further calls; queued kernels
        that still wait see it on the device and give up at once). The error names the operation whose kernel
        failed, and ``op`` (the call that found it) when that was a later one.
        """
        if stream is not None:
            stream.synchronize()
        st = self._status.array
        if st[0]:
            if stream is None:  # order our reads of the fields after the flag (and let the failing kernels end)
                _compat.cupy.cuda.runtime.deviceSynchronize()
            info = st.copy()
            seq = int(info[7])
            failed = self._ops[seq % _OPS_KEPT] if 0 <= self._seq - seq < _OPS_KEPT else ""
            # after our own launch (stream given, same launch) the failure is this call's; else an earlier call's
            where = op if stream is not None and seq == self._seq and failed == op else \
                f"{failed or 'an earlier collective'} (queued earlier; found by {op})"
            self._reported = True
            raise SymBufferTimeoutError(rank=int(info[2]), peer=int(info[3]), channel=int(info[4]),
                                        role=_ROLES.get(int(info[1]), str(info[1])), head=int(info[5]),
                                        tail=int(info[6]), timeout_s=self.timeout_s, op=where)

    def exchange_rows(self, send_parts, send_index, send_counts, recv_parts, recv_counts, op: str) -> None:
        """Send rows to every peer and receive rows from every peer, in one kernel launch on the current stream.

        ``send_parts``: CuPy arrays ``[n, ...]`` whose rows (all axes after the first) are contiguous, any row
        stride; a sent row is the concatenation of the parts' rows ``send_index[r]`` (``send_index``: int64 CuPy
        array ``[sum(send_counts)]``, or None for rows ``0, 1, ...``), grouped by destination (``send_counts`` int64
        ``[W]``). ``recv_parts``: C-contiguous CuPy arrays ``[sum(recv_counts), ...]`` with the same row widths in
        bytes, filled in order.
        Returns once the kernel is queued (``self.blocking``: once it ended); raises a timeout an earlier kernel
        recorded.
        """
        cp = _compat.cupy
        self.check(op)  # a failure of an earlier, unawaited call surfaces here, before anything else
        # The plan (descriptor) depends on shapes, strides and counts, never on addresses: repeated calls of one
        # shape (every training step) only write the buffer addresses into it.
        key = (tuple((a.shape, a.strides, a.dtype.itemsize) for a in send_parts),
               tuple((a.shape, a.strides, a.dtype.itemsize) for a in recv_parts), send_index is None,
               send_counts.tobytes(), recv_counts.tobytes())
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plan(op, send_parts, send_index, send_counts, recv_parts, recv_counts)
            if len(self._plans) >= _MAX_PLANS:
                self._plans.clear()
            self._plans[key] = plan
        d = plan.desc
        if d is None:
            return  # nothing moves; ring counters unchanged on every rank alike
        if plan.copy_send:  # a byte stream is one span per peer: rows that are not contiguous are copied first
            send_parts = [cp.ascontiguousarray(send_parts[0])]
        for w, a in zip(plan.send_words, send_parts):
            d[w] = a.data.ptr
        for w, a in zip(plan.recv_words, recv_parts):
            d[w] = a.data.ptr
        if send_index is not None:
            send_index = cp.ascontiguousarray(send_index, dtype=cp.int64)  # read as int64[rows] by the kernel
            d[DESC_SEND_INDEX] = send_index.data.ptr
        stream = cp.cuda.get_current_stream()
        d[DESC_SEQ] = self._next_launch(op, stream)
        self._arg_ptrs[0] = plan.addr  # the driver copies the descriptor at launch: it may change after
        if self.kernel_events is not None:  # bench --breakdown: time the kernel alone
            self.kernel_events[0].record(stream)
        self._launch(stream.ptr)
        if self.kernel_events is not None:
            self.kernel_events[1].record(stream)
        if self.blocking:
            self.check(op, stream)

    def _plan(self, op: str, send_parts, send_index, send_counts, recv_parts, recv_counts) -> _Plan:
        """Check one shape of row exchange and build its descriptor (addresses are filled per call)."""
        W = self.world_size
        byte_stream = is_byte_stream(len(send_parts), send_index is not None)
        sgeo = [part_geometry(a) for a in send_parts]
        rgeo = [part_geometry(a) for a in recv_parts]
        row_bytes = sum(g[2] for g in sgeo)
        # Checked on every rank, before the nothing-to-move return: ranks with nothing to move raise alike.
        check_row_fits(op, row_bytes, self.layout.chunk_bytes, byte_stream)
        if row_bytes == 0 or (not send_counts.any() and not recv_counts.any()):
            return _Plan(None, False, 0, 0)
        copy_send = byte_stream and sgeo[0][1] != sgeo[0][2]
        if [g[2] for g in sgeo] != [g[2] for g in rgeo] or len(sgeo) > MAX_PARTS or \
                (byte_stream and rgeo[0][1] != rgeo[0][2]):
            raise AssertionError(f"{op}: internal: send and receive parts differ ({sgeo} vs {rgeo})")
        d = self._desc.copy()  # the static words (rank, layout, warps) and room for this shape
        scounts, rcounts = send_counts, recv_counts
        if byte_stream:  # 1-byte rows; channel boundaries 16-byte aligned
            sgeo = [(0, 1, 1)]
            rgeo = [(0, 1, 1)]
            scounts, rcounts = send_counts * row_bytes, recv_counts * row_bytes
            d[DESC_ROW_BYTES], d[DESC_ROW_ALIGN] = 1, 16
        else:
            d[DESC_ROW_BYTES], d[DESC_ROW_ALIGN] = row_bytes, 1
        d[DESC_SEND_INDEX] = d[DESC_RECV_INDEX] = 0
        for base, geo in ((DESC_SEND_PARTS, sgeo), (DESC_RECV_PARTS, rgeo)):
            off = 0
            for i, (_, stride, width) in enumerate(geo):
                d[base + 4 * i: base + 4 * i + 4] = (0, stride, width, off)  # base address: per call
                off += width
        d[DESC_NUM_SEND_PARTS], d[DESC_NUM_RECV_PARTS] = len(sgeo), len(rgeo)
        peers = d[DESC_PEERS: DESC_PEERS + 4 * W].reshape(4, W)
        peers[1], peers[3] = scounts, rcounts
        peers[0, 0] = peers[2, 0] = 0
        np.cumsum(scounts[:-1], out=peers[0, 1:])
        np.cumsum(rcounts[:-1], out=peers[2, 1:])
        return _Plan(d, copy_send, len(sgeo), len(rgeo))

    def notify(self, send_meta: np.ndarray, epoch: int, op: str = "notify") -> np.ndarray:
        cp = _compat.cupy
        self.check(op)  # a failure of an earlier, unawaited call surfaces first
        stream = cp.cuda.get_current_stream()
        W, M = send_meta.shape
        self._meta_in.array[: W * M] = send_meta.reshape(-1)  # read by the kernel from pinned memory
        threads = max(32, min(1024, (W + 31) // 32 * 32))
        args = (np.uint64(self._meta_in.ptr), np.uint64(self._meta.ptr), np.int32(M), np.int64(epoch),
                self.buf.peer_ptrs_device,
                np.int32(self.rank), np.int32(W), *self._layout_args, self.timeout_ns, np.uint64(self._status.ptr),
                np.uint64(self._next_launch(op, stream)))
        self._k_notify((1,), (threads,), args)
        self.check(op, stream)  # the host needs the counts: always waits
        return self._meta.array[: W * M].reshape(W, M).copy()
