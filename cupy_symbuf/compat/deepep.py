"""DeepEP-compatible shim: DeepEP's intranode ``Buffer`` call shapes over :class:`cupy_symbuf.Communicator`.

Code written for DeepEP's normal (intranode) mode runs with a changed import, over the same ``torch.distributed``
process group (a ``torchrun`` job) or an mpi4py communicator (an ``mpiexec`` job)::

    # import deep_ep; buffer = deep_ep.Buffer(group, num_nvl_bytes)
    from cupy_symbuf.deepep import Buffer, EventOverlap
    buffer = Buffer(group, num_nvl_bytes)      # or Buffer(MPI.COMM_WORLD, num_nvl_bytes)
    num_tokens_per_rank, _, num_tokens_per_expert, is_token_in_rank, _ = buffer.get_dispatch_layout(
        topk_idx, num_experts)
    recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event = buffer.dispatch(
        x, num_tokens_per_rank=num_tokens_per_rank, is_token_in_rank=is_token_in_rank,
        num_tokens_per_expert=num_tokens_per_expert, topk_idx=topk_idx, topk_weights=topk_weights)
    combined_x, _, event = buffer.combine(expert_out, handle)

The call shapes are those of ``deep_ep.Buffer`` (``deep_ep/buffer.py``, in newer releases
``deep_ep/buffers/legacy.py``, https://github.com/deepseek-ai/DeepEP); the semantics are those of
:mod:`cupy_symbuf.moe` (DeepEP normal mode), whose results the shim returns unchanged.

Tensors: PyTorch tensors in give PyTorch tensors out (zero-copy through DLPack; ``torch.bfloat16`` and the
``torch.float8_*`` dtypes travel as their raw bits and come back in their dtype), NumPy in gives NumPy out
(host backend), CuPy in gives CuPy out (cuda backend). PyTorch is imported only when a tensor arrives.

Streams (cuda backend), as DeepEP: every call runs on a stream the ``Buffer`` owns (:meth:`Buffer.get_comm_stream`).
That stream first waits for ``previous_event`` if given, else for the current stream (``torch.cuda.current_stream()``
when the inputs are PyTorch tensors, else the current CuPy stream). Without ``async_finish`` the current stream then
waits for the call; with it, the returned :class:`EventOverlap` carries the call's completion event and the caller
waits on it (``event.current_stream_wait()`` or ``with event:``). Results are allocated from the comm stream's CuPy
memory pool whatever ``allocate_on_comm_stream`` says (DeepEP allocates them on the current stream unless it is
set): when a result is dropped its memory is reused only by later calls on the comm stream, which are ordered
after the current stream (or after their ``previous_event``: capture it after the last use of anything dropped).
On the host backend every call completes before it returns and the events are complete.

Low-latency mode (``low_latency_dispatch`` / ``low_latency_combine``, intranode): over
:class:`cupy_symbuf.LowLatencyBuffer`, whose results it returns unchanged (see its docstring for the row order and
arithmetic). One ``LowLatencyBuffer`` per ``(num_max_dispatch_tokens_per_rank, hidden, num_experts, dtype)``, made
at the first low-latency dispatch with those values (collectively: its parameters are compared across ranks), or
by the constructor (``Buffer(..., low_latency_mode=True, num_max_dispatch_tokens_per_rank=..., hidden=...,
num_experts=...)``). Every rank's dispatch must use the same values. The Buffer dispatches on one current
LowLatencyBuffer; a dispatch of other values first agrees on the switch with every rank through the current one's
call protocol (:meth:`cupy_symbuf.LowLatencyBuffer.announce`: one extra rejected-call step, and on the GPU a wait for
the comm stream; a dispatch of the current values costs nothing extra), and only then makes or takes the other
buffer. So a rank asking for other values than its peers raises ``ValueError`` naming them at once, the peers
:class:`~cupy_symbuf.SymBufferRejectedError` (GPU: from ``synchronize()``) or that ``ValueError``, no buffer is made
on one rank only, and the Buffer stays usable. (The switch is a call of the current LowLatencyBuffer: a receive
hook outstanding there must run first, else ``RuntimeError``.) All low-latency calls of a Buffer run on its comm
stream, in call order (the mode's sequence numbers need that).

As DeepEP: ``dispatch`` routes by the caller's ``is_token_in_rank`` and counts by its ``num_tokens_per_expert``
(``topk_idx`` / ``topk_weights`` optional, travelling as data); the handle is DeepEP's 6-sequence
(:class:`IntranodeHandle`: ``rank_prefix_matrix``, ... with DeepEP's contents, over the native
:class:`cupy_symbuf.moe.DispatchHandle`); with ``num_worst_tokens`` the per-expert list is empty; the low-latency
handle indexes as DeepEP's (:class:`LowLatencyHandleView`); ``use_ue8m0`` scales are packed int32 ``[...,
hidden // 512]``, scales a column-major view; ``get_next_low_latency_combine_buffer`` + ``zero_copy``;
``EventOverlap.current_stream_wait`` asserts without an event; ``deepep.topk_idx_t`` is ``torch.int64``.

``return_recv_hook=True`` splits a low-latency call as DeepEP does: the call launches only the send phase (the
current stream waits for it) and the returned hook launches the receive phase (on the comm stream, ordered after the
then current stream, which then waits for it); the results hold their values once the hook ran; one hook per
LowLatencyBuffer may be outstanding (:class:`cupy_symbuf.LowLatencyBuffer`, "Receive hooks"); not with
``async_finish`` (``ValueError``, as DeepEP asserts).

Not supported (documented per method): internode (RDMA), ``combine``'s ``bias``, LogFMT (``use_logfmt``: the
wire is plain ``x`` dtype), a handle tuple rebuilt by hand (the shim needs
the one ``dispatch`` returned).
"""
from __future__ import annotations

import sys
from collections.abc import Sequence
import operator
import zlib
from typing import Any, Optional

import numpy as np

from ..common import backend as _compat
from ..transport.streams import CollectiveEvent, check_flag, reject_call
from ..communicator import Communicator
from ..transport.bootstrap import is_group
from ..moe.low_latency import LowLatencyBuffer, LowLatencyHandle
from ..moe.normal_handle import DispatchHandle

__all__ = ["Buffer", "EventOverlap", "Config", "IntranodeHandle", "LowLatencyHandleView"]


def __getattr__(name: str):
    """``topk_idx_t``: DeepEP's dtype of ``topk_idx`` (``torch.int64``); PyTorch is imported on first use (so it
    is not in ``__all__``: ``deepep.topk_idx_t`` works, a star import does not import PyTorch)."""
    if name == "topk_idx_t":
        import torch
        return torch.int64
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ------------------------------------------------------------------------------------------------ tensors


def _is_torch(a) -> bool:
    return type(a).__module__.split(".")[0] == "torch"


def _torch_in_use() -> bool:
    """PyTorch is imported and has initialized CUDA: its current stream is the caller's current stream."""
    torch = sys.modules.get("torch")
    try:
        return torch is not None and bool(torch.cuda.is_initialized())
    except Exception:  # pragma: no cover - a partial torch
        return False


class _NoSync:
    """DLPack export of ``a`` without the stream synchronization the protocol does by default (``stream=-1``):
    the shim orders its streams itself (``previous_event``)."""

    def __init__(self, a):
        self._a = a

    def __dlpack__(self, stream=None, **kwargs):
        try:
            return self._a.__dlpack__(stream=-1, **kwargs)
        except TypeError:
            if not kwargs:
                raise
            return self._a.__dlpack__(stream=-1)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


class _Tensors:
    """Conversions of one call: PyTorch tensors to NumPy/CuPy arrays (zero-copy) and the results back."""

    def __init__(self, torch_mode: bool):
        self.torch = sys.modules["torch"] if torch_mode else None
        self.bf16 = False        # x was torch.bfloat16 (travels as uint16 bits)
        self.fp8 = None          # x was this torch fp8 dtype (travels as uint8 bits)

    def native(self, a, *, is_x: bool = False):
        if a is None or not _is_torch(a):
            return a
        torch = self.torch or sys.modules["torch"]
        t = a.detach()
        raw = None
        if t.dtype == torch.bfloat16:
            t, raw = t.view(torch.int16), np.uint16
            if is_x:
                self.bf16 = True
        elif "float8" in str(t.dtype):
            if is_x:
                self.fp8 = t.dtype
            t, raw = t.view(torch.uint8), np.uint8
        if t.device.type == "cuda":
            arr = _compat.cupy.from_dlpack(_NoSync(t))
        else:
            arr = t.numpy()
        return arr.view(raw) if raw is not None else arr

    def out(self, a, *, is_x: bool = False):
        if self.torch is None or a is None or _is_torch(a):
            return a
        torch = self.torch
        bf16 = is_x and self.bf16 and a.dtype == np.uint16
        if bf16:  # int16 bits: every torch version converts int16 (uint16 only from torch 2.3)
            a = a.view(np.int16)
        t = torch.from_numpy(a) if isinstance(a, np.ndarray) else torch.from_dlpack(_NoSync(a))
        if bf16:
            t = t.view(torch.bfloat16)
        elif is_x and self.fp8 is not None and t.dtype == torch.uint8:
            t = t.view(self.fp8)
        return t

    def out_x(self, x):
        if isinstance(x, tuple):  # fp8: (recv_x_fp8, recv_scales)
            return self.out(x[0], is_x=True), self.out(x[1])
        return self.out(x, is_x=True)


# ------------------------------------------------------------------------------------------------ events / config


class EventOverlap:
    """DeepEP's ``EventOverlap`` (``deep_ep/utils/event.py``) over a :class:`cupy_symbuf.CollectiveEvent`.

    Attributes
    ----------
    event : CollectiveEvent or None
        The call's completion event; None when the call was not ``async_finish`` (the current stream already
        waited) or on the host backend.
    extra_tensors : tuple or None
        References kept alive with the event (DeepEP's stand-in for ``record_stream``).

    As DeepEP, :meth:`current_stream_wait` on an event-less object (a call made without ``async_finish``) raises
    ``AssertionError``. On the host backend the event of an ``async_finish`` call (and of :meth:`Buffer.capture`)
    is an already completed one.
    """

    def __init__(self, event: Optional[CollectiveEvent] = None, extra_tensors: Optional[tuple] = None, *,
                 torch_stream: bool = False) -> None:
        self.event = event
        self.extra_tensors = extra_tensors
        self._torch_stream = torch_stream
        self._release = False

    def _current(self):
        if self._torch_stream:
            return sys.modules["torch"].cuda.current_stream()
        return None  # the current CuPy stream

    def current_stream_wait(self, release_handle: bool = False) -> None:
        """The current stream (``torch.cuda.current_stream()`` for calls on PyTorch tensors, else the current CuPy
        stream) waits for the event on the device; the host does not block. ``release_handle``: drop the event
        (and ``extra_tensors``) afterwards."""
        if self.event is None:
            raise AssertionError("EventOverlap.current_stream_wait: no event to wait for (the call was made without "
                                 "async_finish=True; as DeepEP, this is an error)")
        self.event.wait(self._current())
        if release_handle:
            self.event = None
            self.extra_tensors = None

    def __call__(self, release_handle: bool = False) -> "EventOverlap":
        """``with event(release_handle=True):`` (DeepEP's form)."""
        self._release = release_handle
        return self

    def __enter__(self) -> "EventOverlap":
        """Work queued on the current stream inside the block overlaps with the call; leaving the block the current
        stream waits for it."""
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        release, self._release = self._release, False
        if self.event is not None:
            self.current_stream_wait(release_handle=release)


class _CompletedEvent:
    """The event of a host-backend call: complete when the call returns (waiting is a no-op)."""

    event = None

    def wait(self, stream=None) -> None:
        return None

    def query(self) -> bool:
        return True


class Config:
    """DeepEP's performance config (``deep_ep.Config``): accepted and kept, not used.

    Tuning of this implementation is :class:`cupy_symbuf.Config` (``Buffer(..., symbuf_config=...)``).
    """

    def __init__(self, num_sms: int = 20, num_max_nvl_chunked_send_tokens: int = 6,
                 num_max_nvl_chunked_recv_tokens: int = 256, num_max_rdma_chunked_send_tokens: int = 6,
                 num_max_rdma_chunked_recv_tokens: int = 256) -> None:
        self.num_sms = num_sms
        self.num_max_nvl_chunked_send_tokens = num_max_nvl_chunked_send_tokens
        self.num_max_nvl_chunked_recv_tokens = num_max_nvl_chunked_recv_tokens
        self.num_max_rdma_chunked_send_tokens = num_max_rdma_chunked_send_tokens
        self.num_max_rdma_chunked_recv_tokens = num_max_rdma_chunked_recv_tokens

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """0: the shim sizes its symmetric buffer from :class:`cupy_symbuf.Config`, not from ``num_nvl_bytes``."""
        return 0

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """0: no RDMA buffer (intranode only)."""
        return 0

    def __repr__(self) -> str:
        return f"deepep.Config(num_sms={self.num_sms}) (accepted, not used)"


def _event_of(op: str, previous_event):
    """The CUDA event (a ``cupy.cuda.Event``) to wait for, or None; ``TypeError`` for anything else."""
    if previous_event is None:
        return None
    if isinstance(previous_event, EventOverlap):
        previous_event = previous_event.event
        if previous_event is None or isinstance(previous_event, _CompletedEvent):
            return None
    if isinstance(previous_event, CollectiveEvent):
        return previous_event.event
    cp = _compat.cupy
    if cp is not None and isinstance(previous_event, cp.cuda.Event):
        return previous_event
    raise TypeError(f"{op}: argument 'previous_event' must be None, an EventOverlap (Buffer.capture() or a "
                    f"previous call's event), a CollectiveEvent or a cupy.cuda.Event, got "
                    f"{type(previous_event).__module__}.{type(previous_event).__qualname__}")


def _native_handle(op: str, handle) -> DispatchHandle:
    """The :class:`~cupy_symbuf.moe.DispatchHandle` behind a handle :meth:`Buffer.dispatch` returned."""
    if isinstance(handle, IntranodeHandle):
        return handle.native
    if isinstance(handle, DispatchHandle):
        return handle
    raise TypeError(f"Buffer.{op}: argument 'handle' must be the handle a Buffer.dispatch returned, got "
                    f"{type(handle).__module__}.{type(handle).__qualname__} (a tuple rebuilt by hand does not carry "
                    f"the layout this implementation needs)")


class _HandleTuple(Sequence):
    """DeepEP's handle tuple over a native handle (``.native``): ``LENGTH`` elements, each made by ``_make(j)`` on
    first access and kept (a slice: a tuple of them)."""

    LENGTH = 0

    def __init__(self, native, conv) -> None:
        self.native = native
        self._conv = conv
        self._cache = {}

    def __len__(self) -> int:
        return self.LENGTH

    def __getitem__(self, i):
        if isinstance(i, slice):
            return tuple(self[j] for j in range(self.LENGTH)[i])
        j = range(self.LENGTH)[i]
        if j not in self._cache:
            self._cache[j] = self._make(j)
        return self._cache[j]

    def _make(self, j: int):
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.native!r})"


class IntranodeHandle(_HandleTuple):
    """DeepEP's intranode dispatch handle: a 6-sequence ``(rank_prefix_matrix, channel_prefix_matrix,
    recv_channel_prefix_matrix, recv_src_idx, is_token_in_rank, send_head)`` with DeepEP's contents, over a
    :class:`~cupy_symbuf.moe.DispatchHandle` (``.native``, what :meth:`Buffer.combine` and a cached
    :meth:`Buffer.dispatch` use). The elements are computed on first access (none of DeepEP's kernels needs
    them here), on the current stream (``torch.cuda.current_stream()`` for PyTorch tensors: access them after the
    dispatch's event when it was ``async_finish``), as tensors of the dispatch's kind (CUDA tensors on the GPU):

    * ``rank_prefix_matrix`` int32 ``[num_ranks, num_ranks]``: ``[i][j]`` = tokens ranks ``0..i`` sent to rank
      ``j`` (rows of ``recv_x`` from rank ``i`` end at ``[i][rank]``).
    * ``channel_prefix_matrix`` int32 ``[num_ranks, num_channels]``: ``[r][c]`` = tokens this rank sent to rank
      ``r`` from DeepEP's channels ``0..c`` (channel ``c`` = tokens ``[c * ceil(T / C), (c + 1) * ceil(T / C))``,
      ``C = config.num_sms // 2`` of the dispatch's config).
    * ``recv_channel_prefix_matrix`` int32 ``[num_ranks, num_channels]``: ``[s][c]`` = rows from rank ``s`` of its
      channels ``0..c-1`` (the start of channel ``c`` within ``s``'s rows).
    * ``recv_src_idx`` int32 ``[num_recv_tokens]``: source token index of each received row.
    * ``is_token_in_rank``: the caller's tensor.
    * ``send_head`` int32 ``[num_tokens, num_ranks]``: the token's index among the tokens of its channel sent to
      that rank, ``-1`` where not sent.

    In worst-case mode on the GPU the count matrix never reaches the host: ``rank_prefix_matrix`` and
    ``recv_channel_prefix_matrix`` raise ``ValueError`` there.
    """

    LENGTH = 6

    def __init__(self, native: DispatchHandle, conv, is_token_in_rank, num_channels: int) -> None:
        super().__init__(native, conv)
        self._in_rank_given = is_token_in_rank
        self.num_channels = max(1, int(num_channels))

    def _make(self, j: int):
        torch = self._conv.torch
        if self.native.backend == "cuda" and torch is not None:
            # the caller's current stream (the dispatch's results are ordered on it), not CuPy's
            with _compat.cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
                return self._compute(j)
        return self._compute(j)

    def _compute(self, j: int):
        h = self.native
        if j == 4:
            return self._in_rank_given
        xp = np if h.backend == "host" else _compat.cupy
        W, C, T = h.world_size, self.num_channels, h.num_tokens
        if j in (0, 2) and h.count_matrix is None:
            raise ValueError("IntranodeHandle: rank_prefix_matrix / recv_channel_prefix_matrix need the count matrix, "
                             "which a worst-case (num_worst_tokens) GPU dispatch keeps on the device")
        if j == 0:
            v = xp.asarray(np.cumsum(h.count_matrix, axis=0).astype(np.int32))
        elif j == 3:
            v = h.recv_src_idx.astype(np.int32)
        elif j == 2:
            src = np.asarray(h.recv_src_idx.get() if xp is not np else h.recv_src_idx)
            offs = np.concatenate([[0], np.cumsum(h.count_matrix[:, h.rank])])
            out = np.zeros((W, C), np.int32)
            for s_ in range(W):
                n_s = int(h.src_num_tokens[s_])
                per = -(-n_s // C)
                starts = np.minimum(per * np.arange(C), n_s)
                out[s_] = np.searchsorted(src[offs[s_]:offs[s_ + 1]], starts, side="left")
            v = xp.asarray(out)
        else:
            in_rank = h.is_token_in_rank
            per = -(-T // C)
            incl = xp.cumsum(in_rank, axis=0, dtype=np.int64)
            if j == 1:
                ends = xp.minimum(per * (xp.arange(C) + 1), T)
                padded = xp.concatenate([xp.zeros((1, W), np.int64), incl])
                v = xp.ascontiguousarray(padded[ends].T).astype(np.int32)
            else:  # send_head
                excl = incl - in_rank
                chan_start = (xp.arange(T) // max(per, 1)) * per
                v = xp.where(in_rank, excl - excl[chan_start] if T else excl, -1).astype(np.int32)
        return self._conv.out(v)

    def __repr__(self) -> str:
        return f"IntranodeHandle({self.native!r}, num_channels={self.num_channels})"


def _column_major_scales(xp, scales, ue8m0: bool):
    """Storage for DeepEP's low-latency scales of float32 ``scales`` ``[L, R, hidden // 128]``: ``[L, S, R]``
    (``S = hidden // 128``, float32; with ``ue8m0`` ``hidden // 512``, int32), not yet filled
    (:func:`_fill_column_major_scales`); its ``transpose(0, 2, 1)`` is the view DeepEP hands out (column-major last
    two axes, strides ``(R * S, 1, R)`` in elements)."""
    L, R, S = scales.shape
    return xp.empty((L, S // 4, R), np.int32) if ue8m0 else xp.empty((L, S, R), scales.dtype)


def _fill_column_major_scales(xp, scales, ue8m0: bool, cm) -> None:
    """Fill ``cm`` (:func:`_column_major_scales`) from ``scales``; with ``ue8m0`` packed to int32 (byte ``k`` of word
    ``j`` = the biased exponent of the scale of block ``4 j + k``: the scales are powers of two)."""
    if ue8m0:
        exp = (scales.view(np.uint32) >> 23).astype(np.uint8)
        scales = xp.ascontiguousarray(exp).view(np.int32)
    cm[...] = scales.transpose(0, 2, 1)


class LowLatencyHandleView(_HandleTuple):
    """DeepEP's low-latency handle ``(src_info, layout_range, num_max_dispatch_tokens_per_rank, hidden,
    num_experts)`` over a :class:`cupy_symbuf.LowLatencyHandle` (``.native``), the arrays as tensors of the
    dispatch's kind (zero-copy views, made on first access): ``src_info`` int32 ``[num_local_experts, num_ranks *
    N]`` (source token index of each received row), ``layout_range`` int64 ``[num_local_experts, num_ranks]``
    (``(begin << 32) | count`` of the rows from each source rank)."""

    LENGTH = 5

    def _make(self, j: int):
        v = self.native[j]
        return self._conv.out(v) if j < 2 else v


#: ``max_topk`` of the LowLatencyBuffers the shim makes (the largest top-k a call may use)
_LL_MAX_TOPK = 32
#: A LowLatencyBuffer's key, ``(num_max_dispatch_tokens_per_rank, hidden, num_experts, dtype)``, field names
_LL_KEY_FIELDS = ("num_max_dispatch_tokens_per_rank", "hidden", "num_experts", "dtype")
_LL_KEY_DTYPES = ("bfloat16", "float16", "float32")


def _ll_token(key: tuple) -> int:
    """The token that announces a switch to the LowLatencyBuffer of ``key`` (:meth:`LowLatencyBuffer.announce`):
    the key itself, packed (bit 62 set; N below 2**13, hidden below 2**24, num_experts below 2**20, dtype one of
    ``_LL_KEY_DTYPES``), else a CRC-32 of its text plus 1 (below 2**33)."""
    try:
        n, h, e = (operator.index(v) for v in key[:3])
    except TypeError:
        return 1 + zlib.crc32(repr(key).encode())
    dtype = key[3]
    if dtype in _LL_KEY_DTYPES and 0 < n < 1 << 13 and 0 < h < 1 << 24 and 0 < e < 1 << 20:
        return 1 << 62 | n << 46 | h << 22 | e << 2 | _LL_KEY_DTYPES.index(dtype)
    return 1 + zlib.crc32(repr((n, h, e, dtype)).encode())


def _ll_key_of(token: int) -> Optional[tuple]:
    """The key :func:`_ll_token` packed into ``token``, or None."""
    if not token >> 62 & 1 or token & 3 == 3:
        return None
    return (token >> 46 & (1 << 13) - 1, token >> 22 & (1 << 24) - 1, token >> 2 & (1 << 20) - 1,
            _LL_KEY_DTYPES[token & 3])


def _ll_key_text(key: tuple) -> str:
    return "(" + ", ".join(f"{f}={v}" for f, v in zip(_LL_KEY_FIELDS, key)) + ")"


def _ll_key_diff(mine: tuple, theirs: Optional[tuple]) -> str:
    """``mine`` against ``theirs`` (None: not known here), field by field."""
    if theirs is None:
        return f"another {', '.join(_LL_KEY_FIELDS)}"
    return ", ".join(f"{f} {a} here, {b} there" for f, a, b in zip(_LL_KEY_FIELDS, mine, theirs) if a != b)


# ------------------------------------------------------------------------------------------------ Buffer


class Buffer:
    """DeepEP's ``Buffer`` (intranode normal mode) over a :class:`cupy_symbuf.Communicator`.

    Parameters
    ----------
    group : torch.distributed.ProcessGroup or mpi4py.MPI.Comm
        The ranks of one node (as DeepEP's). Construction is collective.
    num_nvl_bytes, num_rdma_bytes : int
        Accepted and kept as attributes, not used: the symmetric buffer is sized by ``symbuf_config``
        (:class:`cupy_symbuf.Config`); only intranode communication exists here.
    low_latency_mode : bool
        Kept. The low-latency methods work either way; with it and all three of
        ``num_max_dispatch_tokens_per_rank``, ``hidden``, ``num_experts`` (keyword-only, not DeepEP's) the
        low-latency buffer (bfloat16) is created here, collectively, instead of at the first low-latency call.
    num_qps_per_rank, allow_nvlink_for_low_latency_mode, allow_mnnvl, enable_shrink : accepted, not used.
    explicitly_destroy : bool
        Kept; :meth:`destroy` works either way (the communicator is also closed at exit).
    comm : mpi4py.MPI.Comm, optional
        Used when ``group`` is None (as DeepEP's own ``comm`` argument).
    num_max_dispatch_tokens_per_rank, hidden, num_experts : int, optional (keyword-only)
        See ``low_latency_mode``.
    symbuf_config : cupy_symbuf.Config, optional (keyword-only)
        Transport tuning of the underlying communicator.
    backend : {"auto", "cuda", "host"} (keyword-only)
        As :class:`cupy_symbuf.Communicator`.

    Attributes
    ----------
    rank, group_size, group, num_nvl_bytes, num_rdma_bytes, low_latency_mode, explicitly_destroy, communicator
    (the :class:`~cupy_symbuf.Communicator`; its native API gives the same results).

    Raises
    ------
    ValueError
        Neither ``group`` nor ``comm``.
    TypeError
        ``group`` neither a ``torch.distributed`` process group nor an ``mpi4py.MPI.Comm``. Construction errors of
        :class:`~cupy_symbuf.Communicator` propagate.
    """

    #: DeepEP's SM count of the high-throughput kernels: kept for :meth:`get_dispatch_config`, not used.
    num_sms: int = 20

    def __init__(self, group=None, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 explicitly_destroy: bool = False, enable_shrink: bool = False, comm=None, *,
                 symbuf_config=None, backend: str = "auto", num_max_dispatch_tokens_per_rank: Optional[int] = None,
                 hidden: Optional[int] = None, num_experts: Optional[int] = None) -> None:
        mpi_comm = group if group is not None else comm
        if mpi_comm is None:
            raise ValueError("Buffer: either 'group' or 'comm' must be provided (a torch.distributed process group "
                             "or an mpi4py.MPI.Comm)")
        if not is_group(mpi_comm):
            raise TypeError(f"Buffer: argument 'group' must be a torch.distributed process group or an "
                            f"mpi4py.MPI.Comm, got {type(mpi_comm).__module__}.{type(mpi_comm).__qualname__}")
        self.communicator = Communicator(mpi_comm, symbuf_config, backend=backend)
        self.group = mpi_comm
        self.rank = self.communicator.rank
        self.group_size = self.communicator.world_size
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.num_qps_per_rank = num_qps_per_rank
        self.explicitly_destroy = explicitly_destroy
        self._comm_stream = None
        self._ll = {}  # (N, hidden, num_experts, dtype) -> LowLatencyBuffer
        self._ll_current = None  # the key of the LowLatencyBuffer of the last low-latency dispatch (every rank's)
        if self.communicator.backend == "cuda":
            self._comm_stream = _compat.cupy.cuda.Stream(non_blocking=True)
        shape = (num_max_dispatch_tokens_per_rank, hidden, num_experts)
        if low_latency_mode and all(v is not None for v in shape):
            try:
                self._ll_buffer("Buffer", *shape, "bfloat16")
            except BaseException:
                self.communicator.close()
                raise

    # ---- lifecycle ------------------------------------------------------------------------------------------
    def destroy(self) -> None:
        """Close the low-latency buffers and the communicator (collective; :meth:`cupy_symbuf.Communicator.close`)."""
        lls, self._ll, self._ll_current = list(self._ll.values()), {}, None
        try:
            for ll in lls:
                ll.close()
        finally:
            self.communicator.close()

    close = destroy

    def __enter__(self) -> "Buffer":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        lls, self._ll, self._ll_current = list(self._ll.values()), {}, None
        try:
            for ll in lls:
                ll.close()
        finally:
            self.communicator.__exit__(exc_type, exc, tb)

    # ---- static helpers -------------------------------------------------------------------------------------
    @staticmethod
    def is_sm90_compiled() -> bool:
        """True: the kernels are compiled at run time by NVRTC (for ``sm_90`` and the device in use)."""
        return True

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """DeepEP's SM count (must be even); kept, not used (tune with ``cupy_symbuf.Config(num_sms=...)``).

        Raises ``ValueError`` for an odd count, as DeepEP asserts."""
        if new_num_sms % 2:
            raise ValueError(f"Buffer.set_num_sms: the SM count must be even, got {new_num_sms}")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """A :class:`Config` (accepted by :meth:`dispatch`, not used)."""
        return Config(Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """A :class:`Config` (accepted by :meth:`combine`, not used)."""
        return Config(Buffer.num_sms)

    @staticmethod
    def capture() -> EventOverlap:
        """An :class:`EventOverlap` on the current stream (``torch.cuda.current_stream()`` when PyTorch has
        initialized CUDA, else the current CuPy stream), for ``previous_event``. Without CuPy and a GPU: an
        event-less EventOverlap (host calls complete before returning)."""
        if not _compat.cuda_available():
            return EventOverlap(_CompletedEvent())
        torch_mode = _torch_in_use()
        stream = sys.modules["torch"].cuda.current_stream() if torch_mode else None
        return EventOverlap(CollectiveEvent.record(stream), torch_stream=torch_mode)

    def get_comm_stream(self):
        """The stream every call of this Buffer runs on: a ``torch.cuda.ExternalStream`` when PyTorch has
        initialized CUDA, else a ``cupy.cuda.Stream``; None on the host backend."""
        if self._comm_stream is None:
            return None
        if _torch_in_use():
            return sys.modules["torch"].cuda.ExternalStream(self._comm_stream.ptr)
        return self._comm_stream

    # ---- the call machinery ---------------------------------------------------------------------------------
    def _launch(self, op: str, notify, torch_mode: bool, previous_event, async_finish, allocate_on_comm_stream,
                call):
        """Check the stream arguments (a rejection is told to the peers), order the comm stream after
        ``previous_event`` or the current stream, run ``call(stream)`` (the native method with ``stream`` and
        ``async_op``), and either make the current stream wait or return the event. Returns
        ``(result, EventOverlap)``."""
        comm = self.communicator
        comm.engine.check_open()
        try:
            async_finish = check_flag(op, "async_finish", async_finish)
            allocate_on_comm_stream = check_flag(op, "allocate_on_comm_stream", allocate_on_comm_stream)
            if allocate_on_comm_stream and (previous_event is None or not async_finish):
                raise ValueError(f"{op}: allocate_on_comm_stream=True needs previous_event and async_finish=True "
                                 f"(as DeepEP)")
            prev = _event_of(op, previous_event)
        except BaseException:
            reject_call(comm, op, notify)
            raise
        if self._comm_stream is None:  # host: complete on return
            return call(None), EventOverlap(_CompletedEvent() if async_finish else None)
        cp = _compat.cupy
        torch = sys.modules.get("torch") if torch_mode else None
        compute = cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream) if torch is not None \
            else cp.cuda.get_current_stream()
        s = self._comm_stream
        s.wait_event(prev if prev is not None else compute.record())
        ev = call(s)
        if async_finish:
            return ev.result, EventOverlap(ev, torch_stream=torch is not None)
        ev.wait(compute)
        return ev.result, EventOverlap(None)

    def _native_call(self, method, *args, **kwargs):
        def call(stream):
            if stream is None:
                return method(*args, **kwargs)
            return method(*args, stream=stream, async_op=True, **kwargs)
        return call

    # ---- normal mode ----------------------------------------------------------------------------------------
    def get_dispatch_layout(self, topk_idx, num_experts: int, previous_event: Optional[EventOverlap] = None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """DeepEP's ``Buffer.get_dispatch_layout``: where each token goes (local, no communication).

        Parameters
        ----------
        topk_idx : ``[num_tokens, num_topk]`` int64 (int32 accepted) tensor/array; ``-1`` = no expert.
        num_experts : int, a positive multiple of the group size.
        previous_event, async_finish, allocate_on_comm_stream
            DeepEP's stream arguments (see the module docstring). ``allocate_on_comm_stream=True`` needs
            ``previous_event`` and ``async_finish`` (``ValueError``).

        Returns
        -------
        num_tokens_per_rank : ``[num_ranks]`` int32
        num_tokens_per_rdma_rank : None (intranode)
        num_tokens_per_expert : ``[num_experts]`` int32
        is_token_in_rank : ``[num_tokens, num_ranks]`` bool
        event : EventOverlap (with an event only when ``async_finish``)

        Tensors are of ``topk_idx``'s kind (PyTorch, NumPy or CuPy). Values as
        :meth:`cupy_symbuf.Communicator.get_dispatch_layout` (its errors propagate: ``TypeError``/``ValueError``);
        ``TypeError`` for a ``previous_event`` that is not an event.
        """
        op = "get_dispatch_layout"
        conv = _Tensors(_is_torch(topk_idx))
        idx = conv.native(topk_idx)
        res, event = self._launch(op, None, conv.torch is not None, previous_event, async_finish,
                                  allocate_on_comm_stream,
                                  self._native_call(self.communicator.get_dispatch_layout, idx, num_experts))
        per_rank, per_expert, in_rank = (conv.out(a) for a in res)
        return per_rank, None, per_expert, in_rank, event

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config: Optional[Config] = None,
                 previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False):
        """DeepEP's ``Buffer.dispatch`` (intranode): send each token to every rank holding one of its experts.
        Collective.

        Parameters
        ----------
        x : ``[num_tokens, hidden]`` bfloat16 (also float16/float32 here), or ``(x_fp8, scales)`` with ``x_fp8``
            float8_e4m3fn ``[num_tokens, hidden]`` and ``scales`` float32 ``[num_tokens, hidden // 128]``.
        handle : the handle of an earlier :meth:`dispatch` (:class:`IntranodeHandle`), optional
            Cached mode (only ``x`` travels; ``topk_idx``/``topk_weights`` must be None).
        num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert
            :meth:`get_dispatch_layout`'s results (or the caller's own), required without ``handle`` as in DeepEP,
            and used as DeepEP uses them: token ``t`` goes to rank ``r`` where ``is_token_in_rank[t, r]``;
            ``num_tokens_per_expert`` (length ``num_experts``, entries ``>= 0``) gives the receive counts per local
            expert; ``num_tokens_per_rank`` must equal ``is_token_in_rank``'s column sums (both checked; see
            :func:`cupy_symbuf.moe.dispatch`).
        num_tokens_per_rdma_rank : ignored (intranode).
        topk_idx, topk_weights : ``[num_tokens, num_topk]`` int64 / float32, optional, both or neither (as DeepEP):
            they travel with the tokens.
        expert_alignment : int >= 1
            Round each ``num_recv_tokens_per_expert_list`` entry up to a multiple of it.
        num_worst_tokens : int
            DeepEP's worst-case mode (needs ``topk_idx``): every ``recv_*`` has this many rows, the real ones first.
        config : :class:`Config` or None; only ``config.num_sms // 2`` (DeepEP's channel count, default
            :meth:`get_dispatch_config`'s) is used, for the handle's channel matrices.
        previous_event, async_finish, allocate_on_comm_stream : see :meth:`get_dispatch_layout`.

        Returns
        -------
        recv_x : received tokens, ``x``'s dtype (a tuple for fp8), ordered by source rank then token.
        recv_topk_idx : ``[num_recv_tokens, num_topk]`` int64, local expert ids or ``-1``; None when cached or
            without ``topk_idx``.
        recv_topk_weights : ``[num_recv_tokens, num_topk]`` float32 (0 where ``recv_topk_idx`` is ``-1``); None
            when cached or without ``topk_weights``.
        num_recv_tokens_per_expert_list : list of int ``[num_local_experts]``; ``[]`` with ``num_worst_tokens``;
            None when cached.
        handle : :class:`IntranodeHandle` (DeepEP's tuple) for :meth:`combine` and cached dispatches; None when
            cached (as DeepEP).
        event : EventOverlap

        Values as :meth:`cupy_symbuf.Communicator.dispatch`, whose errors propagate. ``ValueError``:
        ``num_tokens_per_expert`` or ``topk_idx`` missing without ``handle`` (told to the peers, who raise
        :class:`~cupy_symbuf.SymBufferRejectedError`).
        """
        op = "dispatch"
        notify = handle is None
        first = x[0] if isinstance(x, tuple) else x
        conv = _Tensors(_is_torch(first))
        try:
            xn = (conv.native(x[0], is_x=True), conv.native(x[1])) if isinstance(x, tuple) else \
                conv.native(x, is_x=True)
            kwargs = {}
            if num_worst_tokens:
                kwargs["num_worst_tokens"] = num_worst_tokens
            if handle is None:
                for name, v in (("num_tokens_per_rank", num_tokens_per_rank), ("is_token_in_rank", is_token_in_rank),
                                ("num_tokens_per_expert", num_tokens_per_expert)):
                    if v is None:
                        raise ValueError(f"Buffer.{op}: argument '{name}' is required without handle "
                                         f"(get_dispatch_layout's result, as DeepEP)")
                call = self._native_call(self.communicator.dispatch, xn, conv.native(topk_idx),
                                         conv.native(topk_weights), expert_alignment=expert_alignment,
                                         is_token_in_rank=conv.native(is_token_in_rank),
                                         num_tokens_per_rank=conv.native(num_tokens_per_rank),
                                         num_tokens_per_expert=conv.native(num_tokens_per_expert), **kwargs)
            else:
                if topk_idx is not None or topk_weights is not None:
                    raise ValueError(f"Buffer.{op}: a cached dispatch (with handle) takes no topk_idx / topk_weights "
                                     f"(as DeepEP)")
                call = self._native_call(self.communicator.dispatch, xn, handle=_native_handle(op, handle),
                                         expert_alignment=expert_alignment, **kwargs)
        except BaseException:
            reject_call(self.communicator, op, notify)
            raise
        res, event = self._launch(op, notify, conv.torch is not None, previous_event, async_finish,
                                  allocate_on_comm_stream, call)
        recv_x, recv_idx, recv_w, counts, new_handle = res
        if handle is not None:
            return conv.out_x(recv_x), None, None, None, None, event
        counts = [] if num_worst_tokens else [int(c) for c in counts]
        channels = (config if config is not None else self.get_dispatch_config(self.group_size)).num_sms // 2
        return conv.out_x(recv_x), conv.out(recv_idx), conv.out(recv_w), counts, \
            IntranodeHandle(new_handle, conv, is_token_in_rank, channels), event

    def combine(self, x, handle, topk_weights=None, bias=None, config: Optional[Config] = None,
                previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False):
        """DeepEP's ``Buffer.combine`` (intranode): return each dispatched row to its source rank and sum there
        (**without** weights, float32 accumulation, ranks in ascending order). Collective.

        Parameters
        ----------
        x : ``[num_recv_tokens, hidden]`` bfloat16 (also float16/float32), one row per row of the dispatch's
            ``recv_x``.
        handle : DispatchHandle from :meth:`dispatch`.
        topk_weights : ``[num_recv_tokens, num_topk]`` float32, optional (reduced the same way).
        bias : must be None (``NotImplementedError`` otherwise: add it to ``combined_x`` yourself).
        config : accepted, not used.
        previous_event, async_finish, allocate_on_comm_stream : see :meth:`get_dispatch_layout`.

        Returns
        -------
        combined_x : ``[num_tokens, hidden]``, ``x``'s dtype.
        combined_topk_weights : ``[num_tokens, num_topk]`` float32, or None.
        event : EventOverlap

        Values and errors as :meth:`cupy_symbuf.Communicator.combine`.
        """
        op = "combine"
        conv = _Tensors(_is_torch(x))
        try:
            if bias is not None:
                raise NotImplementedError(f"Buffer.{op}: 'bias' is not supported yet (add it to combined_x)")
            xn = conv.native(x, is_x=True)
            dtype = "bfloat16" if conv.bf16 else None
            call = self._native_call(self.communicator.combine, xn, _native_handle(op, handle),
                                     conv.native(topk_weights), dtype=dtype)
        except BaseException:
            reject_call(self.communicator, op, False)
            raise
        res, event = self._launch(op, False, conv.torch is not None, previous_event, async_finish,
                                  allocate_on_comm_stream, call)
        combined, combined_w = res
        return conv.out(combined, is_x=True), conv.out(combined_w), event

    # ---- low-latency mode ------------------------------------------------------------------------------------
    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        """DeepEP's buffer size hint of the low-latency mode: here the bytes of the symmetric buffer the shim's
        :class:`~cupy_symbuf.LowLatencyBuffer` (bfloat16, top-k up to 32) allocates on every rank (the Buffer
        allocates it itself: pass the value as ``num_rdma_bytes`` or not at all). ``num_experts`` does not change
        it (the per-expert outputs are separate device arrays)."""
        return LowLatencyBuffer.symmetric_bytes(num_max_dispatch_tokens_per_rank, hidden, num_ranks,
                                                max_topk=_LL_MAX_TOPK)

    def _ll_buffer(self, op: str, num_max_dispatch_tokens_per_rank, hidden, num_experts, dtype) -> LowLatencyBuffer:
        """The LowLatencyBuffer a dispatch of these values uses: the current one when they are its values (nothing
        else is done); else, once every rank agreed on the switch through the current one
        (:meth:`LowLatencyBuffer.announce`), the one of these values, made (collectively) on first use.

        Raises ``ValueError`` naming the values when the ranks disagree (the peers that dispatched on the current
        buffer raise :class:`~cupy_symbuf.SymBufferRejectedError`); the current buffer stays the current one."""
        key = (num_max_dispatch_tokens_per_rank, hidden, num_experts, str(dtype))
        ll = self._ll.get(key)
        if self._ll_current is not None and key == self._ll_current:
            return ll
        if self._ll_current is not None:  # a switch: every rank must announce the same one
            cur = self._ll[self._ll_current]
            token = _ll_token(key)
            if self._comm_stream is None:
                tokens = cur.announce(token)
            else:
                with self._comm_stream:  # in call order with the buffer's other calls
                    tokens = cur.announce(token)
            for r, t in enumerate(tokens):
                if t == token:
                    continue
                if t is None:
                    theirs = self._ll_current
                    what = f"rank {r} dispatched with the current values {_ll_key_text(theirs)}"
                elif t == 0:
                    theirs = None
                    what = f"rank {r}'s dispatch failed its own checks"
                else:
                    theirs = _ll_key_of(t)
                    what = f"rank {r} asked for {_ll_key_text(theirs) if theirs else 'other values'}"
                raise ValueError(
                    f"{op}: the ranks disagree on the low-latency buffer of this dispatch: this rank asked for "
                    f"{_ll_key_text(key)}, {what} ({_ll_key_diff(key, theirs)}): every rank must pass the same "
                    f"num_max_dispatch_tokens_per_rank, num_experts, hidden and x dtype; nothing was dispatched "
                    f"and the Buffer stays usable")
        if ll is None:
            ll = LowLatencyBuffer(self.communicator, num_max_dispatch_tokens_per_rank, hidden, num_experts,
                                  dtype=dtype, max_topk=_LL_MAX_TOPK)
            self._ll[key] = ll
        self._ll_current = key
        return ll

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """DeepEP's low-latency buffer reset: nothing to do here (the mode's flags are compared against sequence
        numbers and block counts that only grow, never reset), so a no-op; kept for call compatibility."""
        return None

    @staticmethod
    def _ll_flags(op: str, async_finish, return_recv_hook) -> tuple:
        """``(async_finish, return_recv_hook)`` checked (bools; not both, as DeepEP asserts)."""
        async_finish = check_flag(op, "async_finish", async_finish)
        return_recv_hook = check_flag(op, "return_recv_hook", return_recv_hook)
        if async_finish and return_recv_hook:
            raise ValueError(f"{op}: async_finish and return_recv_hook cannot both be set (as DeepEP: with the hook, "
                             f"hook() orders the receive on the current stream)")
        return async_finish, return_recv_hook

    def _ll_reject(self, kind: str, ll: Optional[LowLatencyBuffer] = None) -> None:
        """The shim's own check of a low-latency ``kind`` call failed on this rank: tell the peers through ``ll``
        (default: the current LowLatencyBuffer, where the peers' call goes), in order on the comm stream, so that
        they raise ``SymBufferRejectedError`` instead of pairing their call with this rank's next one. Without a
        current buffer (this Buffer's first low-latency dispatch) there is nothing to tell through: the peers'
        construction of one then waits ``timeout_s``."""
        if ll is None:
            ll = self._ll.get(self._ll_current) if self._ll_current is not None else None
        if ll is None:
            return
        if self._comm_stream is None:
            ll.reject_call(kind)
        else:
            with self._comm_stream:
                ll.reject_call(kind)

    def _ll_run(self, op: str, torch_mode: bool, async_finish, return_recv_hook, call):
        """Run ``call(split)`` (a LowLatencyBuffer call, ``split``: with ``return_recv_hook``; it returns ``(result,
        native hook or None, finish)``, ``finish()`` completing ``result`` once the receive is done) on the comm
        stream after the current stream; returns ``(result, EventOverlap, hook)`` with DeepEP's stream behaviour:

        * without ``return_recv_hook`` the current stream waits for the call unless ``async_finish`` (the event is
          returned);
        * with it (not with ``async_finish``: ``ValueError``, as DeepEP asserts) only the send phase is launched and
          the current stream waits for it (DeepEP launches it on the current stream); ``hook()`` orders the comm
          stream after the then current stream, launches the receive phase there (and ``finish``), and makes the
          current stream wait for it. The hook runs once (a second call raises ``RuntimeError``), and must run
          before this Buffer's next low-latency call of that LowLatencyBuffer.

        The flags come checked by :meth:`_ll_flags`."""
        if self._comm_stream is None:  # host: the send in the call, the receive in the hook
            res, native_hook, finish = call(return_recv_hook)
            if not return_recv_hook:
                finish()
                return res, EventOverlap(_CompletedEvent() if async_finish else None), None

            def host_hook():
                native_hook()
                finish()
            return res, EventOverlap(None), host_hook
        cp = _compat.cupy
        torch = sys.modules.get("torch") if torch_mode else None

        def current():
            return cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream) if torch is not None \
                else cp.cuda.get_current_stream()
        compute = current()
        s = self._comm_stream
        s.wait_event(compute.record())
        with s:
            res, native_hook, finish = call(return_recv_hook)
            if not return_recv_hook:
                finish()
        ev = CollectiveEvent(res, event=s.record(), stream=s, communicator=self.communicator)
        if return_recv_hook:
            ev.wait(compute)  # the send phase, then the caller's work (DeepEP: both on the current stream)

            def hook():
                cur = current()
                s.wait_event(cur.record())
                with s:
                    native_hook()
                    finish()
                cur.wait_event(s.record())
            return res, EventOverlap(None), hook
        if async_finish:
            return res, EventOverlap(ev, torch_stream=torch is not None), None
        ev.wait(compute)
        return res, EventOverlap(None), None

    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             cumulative_local_expert_recv_stats=None, dispatch_wait_recv_cost_stats=None,
                             use_fp8: bool = True, round_scale: bool = False, use_ue8m0: bool = False,
                             async_finish: bool = False, return_recv_hook: bool = False) -> Any:
        """DeepEP's ``Buffer.low_latency_dispatch`` over :meth:`cupy_symbuf.LowLatencyBuffer.dispatch` (its
        results, unchanged). Collective; the first call of each ``(num_max_dispatch_tokens_per_rank, hidden,
        num_experts, dtype)`` creates the LowLatencyBuffer on every rank (see the module docstring).

        Parameters
        ----------
        x : ``[num_tokens, hidden]`` bfloat16 (float16/float32 too), ``num_tokens <=
            num_max_dispatch_tokens_per_rank`` (may differ across ranks).
        topk_idx : ``[num_tokens, num_topk]`` int64, ``-1`` = none; ``num_topk <= 32``.
        num_max_dispatch_tokens_per_rank, num_experts : int, the same on every rank.
        cumulative_local_expert_recv_stats : ``[num_local_experts]`` int32, optional: ``recv_count`` is added to it
            (in stream order).
        dispatch_wait_recv_cost_stats : accepted, not written (no wait timing here).
        use_fp8 : bool (default True, as DeepEP): float8_e4m3fn data and float32 scales per 128 elements.
        round_scale : scales rounded up to powers of two (float32 ``[..., hidden // 128]``).
        use_ue8m0 : with ``round_scale`` (as DeepEP), the scales packed as DeepEP does: int32 ``[...,
            hidden // 512]``, byte ``k`` (little-endian) of word ``j`` the biased float32 exponent of the scale of
            block ``4 j + k`` (``hidden % 512 == 0``; ``ValueError`` otherwise).
        async_finish, return_recv_hook : see :meth:`_ll_run`: with ``return_recv_hook`` the call launches the
            send phase only and ``hook()`` the receive (the results hold their values after it; call it before this
            LowLatencyBuffer's next low-latency call, once); not both (``ValueError``, as DeepEP).

        Returns
        -------
        recv_x : ``[num_local_experts, num_ranks * num_max_dispatch_tokens_per_rank, hidden]``, ``x``'s dtype, or
            with ``use_fp8`` ``(float8_e4m3fn data, scales)``, the scales float32 ``[..., hidden // 128]`` (int32
            ``[..., hidden // 512]`` with ``use_ue8m0``), a view whose last two axes are column-major (as DeepEP; a
            copy per call); rows below ``recv_count[e]`` valid, ordered by (source rank, token).
        recv_count : ``[num_local_experts]`` int32.
        handle : :class:`LowLatencyHandleView` (DeepEP's ``(src_info, layout_range, N, hidden, num_experts)``), for
            :meth:`low_latency_combine` within the next two dispatches of that shape.
        event : EventOverlap; hook : callable or None.

        The outputs are the LowLatencyBuffer's double buffer: valid until the dispatch after the next one.
        Errors: those of :meth:`LowLatencyBuffer.dispatch` (its argument errors are told to the peers, which
        raise ``SymBufferRejectedError``); ``ValueError`` naming the values when this rank's
        ``(num_max_dispatch_tokens_per_rank, hidden, num_experts, dtype)`` differ from a peer's (told to the peers
        through the current LowLatencyBuffer, see the module docstring); the shim's own checks before it (``x`` not
        2-D, the flags) are told through the current LowLatencyBuffer too (on the first low-latency dispatch of a
        Buffer there is none: the peers then wait ``timeout_s``).
        """
        op = "Buffer.low_latency_dispatch"
        try:  # the shim's own checks: a failure is told to the peers through the current LowLatencyBuffer
            conv = _Tensors(_is_torch(x))
            xn = conv.native(x, is_x=True)
            idx = conv.native(topk_idx)
            if getattr(xn, "ndim", 0) != 2:
                raise ValueError(f"{op}: x must be [num_tokens, hidden], got shape "
                                 f"{tuple(getattr(xn, 'shape', ()))}")
            dtype = "bfloat16" if conv.bf16 or xn.dtype == np.uint16 else xn.dtype
            if use_ue8m0 and use_fp8 and int(xn.shape[1]) % 512:
                raise ValueError(f"{op}: use_ue8m0 packs four scales per int32: hidden must be a multiple of 512, "
                                 f"got {int(xn.shape[1])}")
            async_finish, return_recv_hook = self._ll_flags(op, async_finish, return_recv_hook)
        except BaseException:
            self._ll_reject("dispatch")
            raise
        ll = self._ll_buffer(op, num_max_dispatch_tokens_per_rank, int(xn.shape[1]), num_experts, dtype)
        stats = conv.native(cumulative_local_expert_recv_stats)

        def call(split):
            r = ll.dispatch(xn, idx, use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0,
                            return_recv_hook=split)
            recv, count, h = r[:3]
            cm = None
            if isinstance(recv, tuple):  # DeepEP's scales: column-major in the last two axes, packed with ue8m0
                cm = _column_major_scales(ll.xp, recv[1], bool(use_ue8m0))

            def finish():
                if stats is not None:
                    stats[...] += count.astype(stats.dtype, copy=False)
                if cm is not None:
                    _fill_column_major_scales(ll.xp, recv[1], bool(use_ue8m0), cm)
            out = (recv[0], cm.transpose(0, 2, 1)) if cm is not None else recv
            return (out, count, h), (r[3] if split else None), finish

        (recv_x, recv_count, handle), event, hook = self._ll_run(op, conv.torch is not None, async_finish,
                                                                 return_recv_hook, call)
        if isinstance(recv_x, tuple):
            q, scales = recv_x
            if conv.torch is not None:
                q = conv.out(q.view(np.uint8)).view(conv.torch.float8_e4m3fn)
                recv_x = (q, conv.out(scales))
        else:
            recv_x = conv.out(recv_x, is_x=True)
        return recv_x, conv.out(recv_count), LowLatencyHandleView(handle, conv), event, hook

    def get_next_low_latency_combine_buffer(self, handle):
        """DeepEP's zero-copy combine buffer: the ``[num_local_experts, num_ranks *
        num_max_dispatch_tokens_per_rank, hidden]`` tensor (the dispatch's dtype and kind) the next
        :meth:`low_latency_combine` with ``zero_copy=True`` reads instead of its ``x``
        (:meth:`cupy_symbuf.LowLatencyBuffer.next_combine_buffer`). Fill it, then combine."""
        native = self._ll_handle("Buffer.get_next_low_latency_combine_buffer", handle)
        conv = handle._conv if isinstance(handle, LowLatencyHandleView) else _Tensors(False)
        arr = native.owner.next_combine_buffer()
        if native.owner.kind == "bfloat16":
            conv.bf16 = True
        return conv.out(arr, is_x=True)

    def _ll_handle(self, op: str, handle) -> LowLatencyHandle:
        if isinstance(handle, LowLatencyHandleView):
            handle = handle.native
        if not isinstance(handle, LowLatencyHandle) or not isinstance(handle.owner, LowLatencyBuffer) \
                or handle.owner not in self._ll.values():
            raise TypeError(f"{op}: handle must be the handle of this Buffer's low_latency_dispatch, got "
                            f"{type(handle).__name__}")
        return handle

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, use_logfmt: bool = False,
                            zero_copy: bool = False, async_finish: bool = False, return_recv_hook: bool = False,
                            out=None, combine_wait_recv_cost_stats=None) -> Any:
        """DeepEP's ``Buffer.low_latency_combine`` over :meth:`cupy_symbuf.LowLatencyBuffer.combine` (its result,
        unchanged; **weights applied**, as DeepEP). Collective.

        Parameters
        ----------
        x : ``[num_local_experts, num_ranks * num_max_dispatch_tokens_per_rank, hidden]``, the dispatch's dtype:
            the experts' outputs in ``recv_x``'s row order.
        topk_idx, topk_weights : the dispatched tokens' ``[num_tokens, num_topk]`` int64 / float32.
        handle : :class:`cupy_symbuf.LowLatencyHandle` from :meth:`low_latency_dispatch`.
        use_logfmt : accepted, not used (the wire is ``x``'s dtype).
        zero_copy : read :meth:`get_next_low_latency_combine_buffer`'s tensor instead of ``x`` (``x`` is then only
            used for its kind).
        async_finish, return_recv_hook : as :meth:`low_latency_dispatch`.
        out : optional ``[num_tokens, hidden]`` tensor/array of ``x``'s kind: the result is copied into it and it
            is returned.
        combine_wait_recv_cost_stats : accepted, not written.

        Returns
        -------
        combined_x : ``[num_tokens, hidden]``, ``x``'s dtype (``out`` when given; else valid until the combine
            after the next one). event : EventOverlap; hook : callable or None.
        """
        op = "Buffer.low_latency_combine"
        ll = None
        try:  # the shim's own checks: a failure is told to the peers (through the handle's LowLatencyBuffer)
            handle = self._ll_handle(op, handle)
            ll = handle.owner
            conv = _Tensors(_is_torch(x))
            xn = conv.native(x, is_x=True)
            if check_flag(op, "zero_copy", zero_copy):  # x was written into the combine buffer
                xn = ll.next_combine_buffer()
            idx, w = conv.native(topk_idx), conv.native(topk_weights)
            outn = conv.native(out, is_x=True) if out is not None else None
            async_finish, return_recv_hook = self._ll_flags(op, async_finish, return_recv_hook)
        except BaseException:
            self._ll_reject("combine", ll)
            raise

        def call(split):
            r = ll.combine(xn, idx, w, handle, return_recv_hook=split)
            res = r[0] if split else r

            def finish():
                if outn is not None:
                    outn[...] = res
            return (outn if outn is not None else res), (r[1] if split else None), finish

        combined, event, hook = self._ll_run(op, conv.torch is not None, async_finish, return_recv_hook, call)
        if out is not None:
            return out, event, hook
        return conv.out(combined, is_x=True), event, hook

    def __repr__(self) -> str:
        return f"deepep.Buffer({self.communicator!r})"
