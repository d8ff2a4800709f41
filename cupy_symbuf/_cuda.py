"""GPU transport: launches the ring kernels of ``cuda_src/alltoall.cu`` on the current CuPy stream."""
from __future__ import annotations

import ctypes

import numpy as np

from . import _compat, _kernels
from .errors import SymBufferTimeoutError
from .layout import ChannelLayout

__all__ = ["CudaTransport", "threads_per_block"]

_ROLES = {0: "send", 1: "recv", 2: "notify"}
_STATUS_INTS = 8


def threads_per_block(world_size: int) -> int:
    """Threads of one channel block: ``world_size`` warp groups of ``max(1, 32 // world_size)`` warps (1024
    threads for world sizes that divide 32).

    Named barriers (ids 1..15) sync a group of several warps, so groups of more than one warp need
    ``world_size <= 15``; larger worlds get one warp per peer (``__syncwarp``), up to 32 peers.
    """
    if world_size > 32:
        raise ValueError(f"world_size must be <= 32 for the GPU path (one warp per peer in a 1024-thread block), "
                         f"got {world_size}")
    warps_per_peer = max(1, 32 // world_size) if world_size <= 15 else 1
    return world_size * warps_per_peer * 32


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


class CudaTransport:
    """Runs alltoallv byte streams and the notify step over a cuda :class:`~cupy_symbuf.SymBuffer`."""

    def __init__(self, buf, layout: ChannelLayout, timeout_s: float):
        self.buf = buf
        self.layout = layout
        self.timeout_s = timeout_s
        self.rank = buf.rank
        self.world_size = buf.world_size
        self.threads = threads_per_block(self.world_size)
        self.timeout_ns = np.uint64(int(timeout_s * 1e9))
        self._status = _Pinned(_STATUS_INTS)
        self._meta = _Pinned(self.world_size * layout.max_notify_ints)
        # send_off, send_len, recv_off, recv_len: read by the kernel straight from pinned host memory (no copy)
        self._offsets = _Pinned(4 * self.world_size)
        self._layout_args = tuple(np.int64(v) for v in layout.kernel_args())
        # Compile (or fetch from cache) now so the first collective is not charged for NVRTC.
        self._k_alltoallv = _kernels.get_function("alltoall.cu", "symbuf_alltoallv")
        self._k_notify = _kernels.get_function("alltoall.cu", "symbuf_notify")

    def close(self) -> None:
        self._status.free()
        self._meta.free()
        self._offsets.free()

    def _check(self, op: str, stream) -> None:
        stream.synchronize()
        st = self._status.array
        if st[0]:
            info = st.copy()
            st[:] = 0
            err = SymBufferTimeoutError(rank=int(info[2]), peer=int(info[3]), channel=int(info[4]),
                                        role=_ROLES.get(int(info[1]), str(info[1])), head=int(info[5]),
                                        tail=int(info[6]), timeout_s=self.timeout_s, op=op)
            raise err

    def alltoallv(self, src, send_off, send_len, dst, recv_off, recv_len, op: str = "alltoallv") -> None:
        """``src``/``dst``: CuPy arrays (any dtype, contiguous); offsets/lengths in bytes, host int64 ``[W]``.

        Launches on the current stream and waits for it (the error record must be read before returning).
        """
        cp = _compat.cupy
        stream = cp.cuda.get_current_stream()
        W = self.world_size
        offs = self._offsets.array
        offs[0:W], offs[W:2 * W], offs[2 * W:3 * W], offs[3 * W:4 * W] = send_off, send_len, recv_off, recv_len
        base = self._offsets.ptr
        args = (np.uint64(src.data.ptr if src.size else 0), np.uint64(dst.data.ptr if dst.size else 0),
                np.uint64(base), np.uint64(base + 8 * W), np.uint64(base + 16 * W), np.uint64(base + 24 * W),
                self.buf.peer_ptrs_device, np.int32(self.rank), np.int32(W), np.int32(self.layout.num_channels),
                *self._layout_args, self.timeout_ns, np.uint64(self._status.ptr))
        self._k_alltoallv((2 * self.layout.num_channels,), (self.threads,), args)
        self._check(op, stream)

    def notify(self, send_meta: np.ndarray, epoch: int, op: str = "notify") -> np.ndarray:
        cp = _compat.cupy
        stream = cp.cuda.get_current_stream()
        W, M = send_meta.shape
        dev_meta = cp.asarray(np.ascontiguousarray(send_meta, dtype=np.int64))
        threads = max(32, min(1024, (W + 31) // 32 * 32))
        args = (dev_meta, np.uint64(self._meta.ptr), np.int32(M), np.int64(epoch), self.buf.peer_ptrs_device,
                np.int32(self.rank), np.int32(W), *self._layout_args, self.timeout_ns, np.uint64(self._status.ptr))
        self._k_notify((1,), (threads,), args)
        self._check(op, stream)
        return self._meta.array[: W * M].reshape(W, M).copy()
