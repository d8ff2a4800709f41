"""Tunable parameters of the channel transport (:class:`Config`).

Every field is validated at construction and the error names the rule, in the manner of DeepEP's
``Config`` (``deep_ep/utils.py``) that asserts its invariants up front.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import os
from dataclasses import dataclass
from typing import Optional

__all__ = ["Config", "DEFAULT_GPU_NUM_SMS", "DEFAULT_HOST_NUM_SMS", "MAX_NUM_SMS", "MAX_CHUNK_BYTES", "MAX_NUM_SLOTS",
           "MAX_NOTIFY_INTS", "MAX_TIMEOUT_S", "TRANSPORTS", "DEFAULT_SMALL_BYTES", "MAX_SMALL_BYTES"]

#: Default SMs for the GPU path when one rank owns a GPU. More SMs keep more bytes in flight over NVLink
#: (measured on H200: 8 sender blocks with 4 loads in flight per thread already reach ~355 GB/s of SM stores),
#: but every SM taken by communication is one fewer for the overlapping compute kernels; DeepEP uses 20-24.
DEFAULT_GPU_NUM_SMS = 24
#: The host path has no SMs; ``num_sms // 2`` is just the number of channels the bytes are striped over.
DEFAULT_HOST_NUM_SMS = 4

#: Upper bounds of the fields (every field is bounded; the buffer size is checked against free memory as well).
#: ``num_sms``: a thread block per SM at most (no GPU has more than 1024 SMs; on the GPU path also at most twice
#: the device's SM count, checked when the Communicator resolves the config).
MAX_NUM_SMS = 1024
#: ``chunk_bytes``: one ring slot; 64 MiB is far beyond the point where larger slots stop helping.
MAX_CHUNK_BYTES = 64 << 20
#: ``num_slots``: ring depth per (channel, peer).
MAX_NUM_SLOTS = 4096
#: ``max_notify_ints``: int64 values per peer in one count exchange (8 MiB per notify slot).
MAX_NOTIFY_INTS = 1 << 20
#: ``mode``: how rows travel (see Config).
MODES = ("auto", "ring", "direct", "copy_engine")
#: ``transport``: where the GPU path's symmetric buffer lives (see Config).
TRANSPORTS = ("auto", "ipc", "staged")
#: ``timeout_s``: about 31 years; larger values overflow the kernels' nanosecond deadline arithmetic.
MAX_TIMEOUT_S = 1e9


def _env_float(name: str, default: float) -> float:
    value = os.environ.get(name)
    if not value:
        return default
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"environment variable {name} must be a number of seconds, got {value!r}") from None


def _env_transport() -> str:
    value = os.environ.get("CUPY_SYMBUF_TRANSPORT", "").strip().lower()
    if not value:
        return "auto"
    if value not in TRANSPORTS:
        raise ValueError(f"environment variable CUPY_SYMBUF_TRANSPORT must be one of {TRANSPORTS}, got {value!r}")
    return value


#: ``small_bytes`` default on the GPU: alltoalls of up to 1 MiB per rank go by the small-message protocol (the
#: region costs about 4 MiB per rank whatever the world size).
DEFAULT_SMALL_BYTES = 1 << 20
#: ``small_bytes``: the protocol's words carry 4 payload bytes each, so its region is about 4x this per rank.
MAX_SMALL_BYTES = 64 << 20


def _env_small_bytes():
    """``CUPY_SYMBUF_SMALL_BYTES`` (an int; 0 turns the small-message protocol off), else None (the default)."""
    value = os.environ.get("CUPY_SYMBUF_SMALL_BYTES", "").strip()
    if not value:
        return None
    try:
        return int(value, 0)
    except ValueError:
        raise ValueError(f"environment variable CUPY_SYMBUF_SMALL_BYTES must be an int (bytes per rank; 0: off), "
                         f"got {value!r}") from None


def env_abort_default() -> bool:
    """``CUPY_SYMBUF_ABORT_ON_FAILURE``: unset, empty or anything but "0"/"false"/"no"/"off" means on (the default
    of ``Config.abort_on_failure``, and the policy of failures that belong to no communicator)."""
    value = os.environ.get("CUPY_SYMBUF_ABORT_ON_FAILURE", "").strip().lower()
    return value not in ("0", "false", "no", "off")


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


@dataclass(frozen=True)
class Config:
    """Channel-transport configuration (immutable; validated on construction).

    Parameters
    ----------
    num_sms : int or None
        Thread blocks (SMs) the GPU kernels take; must be even and >= 2. Block ``2c`` sends for channel ``c`` and
        block ``2c + 1`` receives for it, so ``num_channels = num_sms // 2``. ``None`` picks a default when the
        :class:`~cupy_symbuf.Communicator` is built: ``DEFAULT_GPU_NUM_SMS`` for a GPU owned by one rank, shared
        evenly (and at least 2) when several ranks share one GPU (MPS), and ``DEFAULT_HOST_NUM_SMS`` on the host.
        Trade-off: more SMs move more bytes in parallel but leave fewer SMs for compute.
    chunk_bytes : int or None
        Bytes in one ring slot: the largest chunk the sender publishes with one ``tail`` update (a short row run,
        the rows to one peer, is cut into smaller chunks so that every copy warp gets one,
        ``layout.chunk_rows``); a multiple of 128.
        ``None``: 64 KiB on the GPU (one warp copies one chunk), 256 KiB on the host.
    num_slots : int or None
        Ring capacity in slots per (channel, peer); >= 2. Capacity in bytes is ``num_slots * chunk_bytes``.
        ``None``: on the GPU ``2 * (32 // world_size)`` (at least 4), so senders can fill one set of slots while the
        receivers drain another (ring memory then stays about ``num_channels * 64 * chunk_bytes`` per rank whatever
        the world size; for 2 ranks 32 slots, 3.2x the 10 copy warps of a peer group, and 32 and 64 slots measured
        the same, docs/perf-notes.md v6); 16 on the host.
        Messages larger than the ring pass through it, so this bounds memory, not message size.
    timeout_s : float
        Bound on every spin-wait (GPU kernels and host path), in seconds; > 0. On expiry a
        :class:`~cupy_symbuf.SymBufferTimeoutError` names rank, peer, channel, head and tail.
        Default from the environment variable ``CUPY_SYMBUF_TIMEOUT_S``, else 30 s.
    max_notify_ints : int
        Largest number of int64 values one rank sends to each peer in a count exchange (notify); >= 1.
        MoE dispatch needs ``1 + num_experts // world_size``.
    blocking : bool
        GPU path only. ``False`` (default): a collective returns once its kernel is queued on the current CuPy
        stream, like NCCL; the result is ready in stream order, and a timeout the kernel records is raised by the
        next call on the communicator or by :meth:`Communicator.synchronize`. ``True``: every call waits for its
        kernel and raises its own timeout (simpler to debug, costs a host synchronisation per call). Steps whose
        results the host needs (the count exchange of ``alltoallv`` without ``recv_counts``, MoE ``dispatch``
        without a handle) always wait. The host path always completes within the call.
    abort_on_failure : bool
        "The job always ends": when a failed communicator (a timeout, a mismatch between ranks, :meth:`abort`) is
        closed, or is still open at interpreter exit, or a ``SymBufferError`` reaches the top level uncaught, the
        rank prints the error and calls ``MPI.COMM_WORLD.Abort(1)`` instead of hanging in a window free or
        ``MPI_Finalize``. ``False``: close() of a failed communicator does a bounded close and frees what it can
        (if peers never come it leaves the buffer allocated and raises), for callers who recover themselves.
        Default from the environment variable ``CUPY_SYMBUF_ABORT_ON_FAILURE`` ("0"/"false" turn it off), else on.
    mode : {"auto", "ring", "direct", "copy_engine"}
        How this rank sends rows. ``"auto"`` (default): the receivers of an ``alltoall`` / ``alltoallv`` copy its
        rows straight out of its ``sendbuf``, one copy per byte, when that is a symmetric array
        (:meth:`Communicator.empty`; both backends: on the GPU each receiver's kernel reads the sender's block
        through its CUDA IPC mapping) or, host backend only, for a C-contiguous plain array, when every rank can
        read every other's memory by cross-memory attach (Linux ``process_vm_readv``, as MPICH and Open MPI do;
        probed at construction; ``CUPY_SYMBUF_CMA=0`` turns it off); else through the rings (two copies per
        off-rank byte). ``"ring"``: always the rings. ``"direct"``: an ``alltoall`` / ``alltoallv`` that cannot
        go direct raises ``ValueError`` instead. ``"copy_engine"`` (GPU; must be the same on every rank): as
        ``"auto"``, and an ``alltoall`` of at least ``protocol.CE_MIN_BYTES`` (16 MiB) per peer is pulled by the
        copy engines (one ``cudaMemcpyAsync`` per peer, no SMs for the off-rank rows), which needs every rank's
        ``sendbuf`` to be the same symmetric allocation at the same offset (the usual loop over one
        ``Communicator.empty`` array): a plain ``sendbuf`` of that size raises ``ValueError`` (the peers are
        told), and a symmetric one at another offset fails the kernel's check: a fatal error on every rank,
        never wrong data. The copies are queued before the kernel's check is known, so on a call that a peer
        rejected (or that failed) the output holds arbitrary bytes for that peer's rows; the call raises. The host backend treats it as ``"auto"``. Design: NCCL 2.28's copy-engine all-to-all
        on symmetric windows.
        MoE ``dispatch`` / ``combine`` gather their rows through an index and always use the rings. The mode is the
        sender's and travels in each call header, so ranks may differ (local policy).
    trace : bool
        Channel telemetry: record every ring chunk published or consumed, every direct copy and (host) every idle
        spell (timestamps, channel, peer, bytes, head / tail) into a bounded buffer of 2**18 events; read it with
        :meth:`Communicator.trace`, save it with :meth:`Communicator.save_trace` and turn the files of all ranks
        into pictures and a report with ``python -m cupy_symbuf.diagnostics``. On the GPU the ring kernel's copy
        warps write the records (a telemetry build of the kernel, ``SYMBUF_TRACE=1``; ``%globaltimer`` times,
        the wait for ring space or data included; no idle records). Off (default): no recording, and the GPU runs
        a kernel build without it. Local policy.
    adaptive : bool
        Adaptive channel assignment under skewed routing (:mod:`cupy_symbuf.adaptive`). On the GPU the ring
        kernel's work-sharing build (``SYMBUF_ADAPTIVE=1``): the chunks of every (channel, peer) ring run are
        claimed from a shared per-peer counter by any warp of the block, so warps whose own run is done (and the
        self group's, once this rank's own rows are copied) help the hot peer; and every ``adaptive_interval``
        eager calls the *home map* (which run each shareable warp starts on) is re-balanced from the load
        counters (:meth:`Communicator.channel_stats`). The host engine serves runs in the map's order. The wire
        is unchanged (same chunks, counters and headers), so results are bitwise the same; local policy. Needs
        ``num_slots <= 32`` on the GPU (``protocol.ADAPT_WINDOW``; the default for 2 or more ranks is). Off
        (default): the static split.
    adaptive_interval : int
        Eager calls between two re-balances of the home map; 1 to 2**31 (default 100). A call captured in a CUDA graph
        keeps the map of its capture and is not counted.
    transport : {"auto", "ipc", "staged"}
        GPU path: where the symmetric buffer lives. ``"ipc"``: each rank's buffer in its own GPU's memory
        (``cudaMalloc``), mapped into every peer through CUDA IPC; every pair of the ranks' GPUs must be the same
        GPU or peer-accessible (NVLink / PCIe P2P), else construction raises ``RuntimeError``. ``"staged"``: the
        whole buffer in host memory (an MPI shared-memory window, as on the host backend, pinned and mapped into
        every GPU with ``cudaHostRegister``); the same kernels run unchanged, but every byte crosses PCIe twice
        (the sender's GPU writes it to host memory, the receiver's GPU reads it back), so it is much slower than
        NVLink and for GPUs without peer access only. ``"auto"`` (default): ``"staged"`` when some pair of the
        ranks' GPUs has no peer access (``cudaDeviceCanAccessPeer``, the communicator's
        :class:`~cupy_symbuf.Topology`) or opening a peer's CUDA IPC handle fails, else ``"ipc"``. The choice is
        the same on every rank and reported: ``Communicator.transport``, a log line (staged chosen by ``auto``: a
        warning), :meth:`Communicator.describe` and ``python -m cupy_symbuf info``. Default from the environment
        variable ``CUPY_SYMBUF_TRANSPORT``, else ``"auto"``. Must be the same on every rank (it is compared at
        construction). The host backend ignores it (its buffer is always shared memory). Design: NCCL's SHM
        transport for GPUs without P2P (``NCCL_P2P_DISABLE``), a host-memory staging buffer.
    small_bytes : int or None
        GPU path: an ``alltoall`` whose ``sendbuf`` holds at most this many bytes (at most ``small_bytes //
        world_size`` per peer) goes by the small-message protocol (NCCL's LL idea): each 4 bytes travel with the
        call's flag in one 8-byte store into the receiver's buffer, and the receiver polls the words themselves, so
        the call needs no ring header, tail or head round trip and no second copy out of a ring slot (twice the
        bytes on the wire, a fraction of the latency). The choice follows the call's size, which every rank agrees
        on. ``0``: off (every call through the rings). ``None``: ``CUPY_SYMBUF_SMALL_BYTES`` if set, else
        ``DEFAULT_SMALL_BYTES`` (1 MiB) on the GPU; the host backend has no small protocol (0), and the staged
        transport does not use it (its control words' atomics on host memory have not run on a GPU). The region takes
        about ``4 * small_bytes`` per rank. Must be the same on every rank (it shapes the buffer). A symmetric
        ``sendbuf`` of that size takes it too (the choice may not depend on one rank's buffer; ``mode`` applies
        above it); telemetry (``trace``) records its calls; the device load counters of ``adaptive`` count ring
        traffic only.

    Bounds: ``num_sms <= 1024`` (and ``<= 2 *`` the GPU's SM count on cuda), ``chunk_bytes <= 64 MiB``,
    ``num_slots <= 4096``, ``max_notify_ints <= 2**20``, ``timeout_s <= 1e9``, ``adaptive_interval <= 2**31``,
    ``small_bytes <= 64 MiB``; the resulting buffer must also fit
    in free memory (checked before allocating).

    Agreement: every rank of a Communicator must have the same resolved values of ``num_sms``, ``chunk_bytes``,
    ``num_slots``, ``max_notify_ints``, ``small_bytes`` and ``transport`` (they shape the wire); construction raises ``ValueError`` on
    every rank naming the field otherwise. ``timeout_s``, ``blocking``, ``abort_on_failure``, ``mode``, ``trace``,
    ``adaptive`` and ``adaptive_interval`` are local policy and may differ between ranks.
    """

    num_sms: Optional[int] = None
    chunk_bytes: Optional[int] = None
    num_slots: Optional[int] = None
    timeout_s: float = dataclasses.field(default_factory=lambda: _env_float("CUPY_SYMBUF_TIMEOUT_S", 30.0))
    max_notify_ints: int = 1024
    blocking: bool = False
    abort_on_failure: bool = dataclasses.field(default_factory=env_abort_default)
    mode: str = "auto"
    trace: bool = False
    adaptive: bool = False
    adaptive_interval: int = 100
    transport: str = dataclasses.field(default_factory=_env_transport)
    small_bytes: Optional[int] = dataclasses.field(default_factory=_env_small_bytes)

    def __post_init__(self) -> None:
        # accept NumPy integers too
        for name in ("num_sms", "chunk_bytes", "num_slots", "max_notify_ints", "small_bytes"):
            value = getattr(self, name)
            if _is_int(value):
                object.__setattr__(self, name, int(value))
        if self.num_sms is not None:
            if not _is_int(self.num_sms):
                raise TypeError(f"Config: num_sms must be an int, got {type(self.num_sms).__name__}")
            if self.num_sms < 2 or self.num_sms % 2:
                raise ValueError(
                    f"Config: num_sms must be even and >= 2 (one sender and one receiver block per channel), "
                    f"got {self.num_sms}")
            if self.num_sms > MAX_NUM_SMS:
                raise ValueError(f"Config: num_sms must be <= {MAX_NUM_SMS} (one thread block per SM), got "
                                 f"{self.num_sms}")
        if self.chunk_bytes is not None:
            if not isinstance(self.chunk_bytes, int) or self.chunk_bytes <= 0 or self.chunk_bytes % 128:
                raise ValueError(
                    f"Config: chunk_bytes must be a positive multiple of 128 (ring slots are 128-byte aligned), "
                    f"got {self.chunk_bytes}")
            if self.chunk_bytes > MAX_CHUNK_BYTES:
                raise ValueError(f"Config: chunk_bytes must be <= {MAX_CHUNK_BYTES} (64 MiB per ring slot), got "
                                 f"{self.chunk_bytes}")
        if self.num_slots is not None and (not isinstance(self.num_slots, int) or self.num_slots < 2):
            raise ValueError(f"Config: num_slots must be an int >= 2 (so the sender can fill one slot while the "
                             f"receiver drains another), got {self.num_slots}")
        if self.num_slots is not None and self.num_slots > MAX_NUM_SLOTS:
            raise ValueError(f"Config: num_slots must be <= {MAX_NUM_SLOTS} (ring depth per channel and peer), got "
                             f"{self.num_slots}")
        if (isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, numbers.Real)
                or not math.isfinite(self.timeout_s) or not 0 < self.timeout_s <= MAX_TIMEOUT_S):
            raise ValueError(f"Config: timeout_s must be a finite positive number of seconds (<= 1e9), got "
                             f"{self.timeout_s!r}")
        if not isinstance(self.blocking, bool):
            raise TypeError(f"Config: blocking must be True or False, got {self.blocking!r}")
        if not isinstance(self.max_notify_ints, int) or self.max_notify_ints < 1:
            raise ValueError(f"Config: max_notify_ints must be an int >= 1, got {self.max_notify_ints!r}")
        if self.max_notify_ints > MAX_NOTIFY_INTS:
            raise ValueError(f"Config: max_notify_ints must be <= {MAX_NOTIFY_INTS} (2**20 int64 per peer in a "
                             f"count exchange), got {self.max_notify_ints}")
        if not isinstance(self.abort_on_failure, bool):
            raise TypeError(f"Config: abort_on_failure must be True or False, got {self.abort_on_failure!r}")
        if not isinstance(self.trace, bool):
            raise TypeError(f"Config: trace must be True or False, got {self.trace!r}")
        if not isinstance(self.adaptive, bool):
            raise TypeError(f"Config: adaptive must be True or False, got {self.adaptive!r}")
        if _is_int(self.adaptive_interval):
            object.__setattr__(self, "adaptive_interval", int(self.adaptive_interval))
        if not _is_int(self.adaptive_interval) or not 1 <= self.adaptive_interval <= 2 ** 31:
            raise ValueError(f"Config: adaptive_interval must be an int >= 1 and <= 2**31 (eager calls between "
                             f"re-balances), got {self.adaptive_interval!r}")
        if self.small_bytes is not None and (not isinstance(self.small_bytes, int) or
                                             not 0 <= self.small_bytes <= MAX_SMALL_BYTES):
            raise ValueError(f"Config: small_bytes must be None or an int in [0, {MAX_SMALL_BYTES}] (bytes per rank of "
                             f"an alltoall that goes by the small-message protocol; 0: off), got {self.small_bytes!r}")
        if self.mode not in MODES:
            raise ValueError(f"Config: mode must be one of {MODES}, got {self.mode!r}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"Config: transport must be one of {TRANSPORTS}, got {self.transport!r}")

    @property
    def num_channels(self) -> int:
        """``num_sms // 2`` (raises ``ValueError`` while ``num_sms`` is unresolved)."""
        if self.num_sms is None:
            raise ValueError("Config: num_sms is not resolved yet (None); a Communicator resolves it")
        return self.num_sms // 2

    def resolved(self, backend: str, *, ranks_per_gpu: int = 1, gpu_sm_count: int = 132,
                 world_size: int = 1) -> "Config":
        """Return a copy with ``num_sms``, ``chunk_bytes``, ``num_slots`` and ``small_bytes`` filled in for
        ``backend`` ("cuda" or "host") and ``world_size`` ranks."""
        num_sms = self.num_sms
        chunk = self.chunk_bytes
        slots = self.num_slots
        if slots is None:
            slots = max(4, 2 * (32 // world_size)) if backend == "cuda" and world_size <= 15 else \
                (4 if backend == "cuda" else 16)
        if backend == "cuda":
            if num_sms is None:
                share = max(2, (gpu_sm_count // max(1, ranks_per_gpu)) // 2 * 2)
                num_sms = min(DEFAULT_GPU_NUM_SMS, share)
            if chunk is None:
                chunk = 64 * 1024
            from ..wire.protocol import ADAPT_WINDOW
            if self.adaptive and world_size > 1 and slots > ADAPT_WINDOW:
                raise ValueError(f"Config: adaptive=True needs num_slots <= {ADAPT_WINDOW} on the cuda backend (the "
                                 f"work-sharing kernel's window of done marks), got {slots}")
            if gpu_sm_count and num_sms > 2 * gpu_sm_count:
                raise ValueError(f"Config: num_sms must be <= 2 * the GPU's SM count ({2 * gpu_sm_count}) on the "
                                 f"cuda backend, got {num_sms}")
        else:
            if num_sms is None:
                num_sms = DEFAULT_HOST_NUM_SMS
            if chunk is None:
                chunk = 256 * 1024
        small = 0 if backend != "cuda" else (DEFAULT_SMALL_BYTES if self.small_bytes is None else self.small_bytes)
        return dataclasses.replace(self, num_sms=num_sms, chunk_bytes=chunk, num_slots=slots, small_bytes=small)
