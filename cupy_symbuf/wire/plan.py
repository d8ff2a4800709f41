"""The agreed exchange plan: everything fixed for one shape of row exchange, computed once in Python and consumed
by both engines (the host engine interprets it; the GPU path turns it into the kernel's launch descriptor).

What depends only on what every rank shares (world size, kernel variant, layout) is here too
(:func:`kernel_geometry`), so the host twin cuts runs into exactly the chunks the GPU's copy warps own.
"""
from __future__ import annotations

import functools

__all__ = ["warp_groups", "ring_kernel_defines", "kernel_geometry", "KernelGeometry"]


def warp_groups(world_size: int, max_threads: int = 1024) -> tuple:
    """``(ring_warps, self_warps)``: warps of each peer's group in one channel block, and of the rank's own group.

    A block is ``(world_size - 1) * ring_warps + self_warps`` warps of at most ``max_threads`` threads (the kernel's
    ``__launch_bounds__``, ``SYMBUF_MAX_THREADS``). A ring group is one publisher warp and ``ring_warps - 1`` copy
    warps copying through that peer's ring; the self group copies the rank's rows to itself straight (half of
    them in the sender block, half in the receiver block), about a third of a ring group's bytes and all local, so
    ring groups are made as large as possible while the self group keeps ``ceil((ring_warps - 1) / 2)`` warps (at
    least 1); warps left over go to the self group (for 2 ranks in 512 threads: 11 ring warps and 5 self warps
    instead of 8 and 8; for some sizes the self group ends up the larger, e.g. 6 ranks: 5 and 7). Every rank
    computes the same split (same ``world_size``, same kernel variant), so sender and receiver cut runs alike.

    Named barriers (ids 1..15) sync a group of several warps, so groups of more than one warp need
    ``world_size <= 15``; larger worlds get one warp per group (``__syncwarp``), up to ``max_threads // 32`` ranks.
    Raises ``ValueError`` when ``world_size`` exceeds ``max_threads // 32``.
    """
    max_warps = max_threads // 32
    if world_size > max_warps:
        raise ValueError(f"world_size must be <= {max_warps} for the GPU path (one warp per peer in a "
                         f"{max_threads}-thread block), got {world_size}")
    if world_size == 1:
        return 0, max_warps
    if world_size > 15:
        return 1, 1
    ring = 1
    while (world_size - 1) * (ring + 1) + max(1, -(-ring // 2)) <= max_warps:
        ring += 1
    return ring, max_warps - (world_size - 1) * ring


def ring_kernel_defines(world_size: int) -> tuple:
    """Compile-time variant of the ring kernel for ``world_size`` ranks: 512-thread blocks (128 registers per
    thread, no spills; measured faster for 2 ranks on H200, docs/perf-notes.md) while that still leaves every peer
    group 4 warps (``world_size <= 4``), else 1024-thread blocks (64 registers) so that groups keep several warps."""
    return ("-DSYMBUF_MAX_THREADS=512",) if world_size <= 4 else ("-DSYMBUF_MAX_THREADS=1024",)


class KernelGeometry(tuple):
    """``(max_threads, ring_warps, self_warps, num_copy, threads)`` of the ring kernel for one world size."""

    __slots__ = ()

    max_threads = property(lambda s: s[0])
    ring_warps = property(lambda s: s[1])
    self_warps = property(lambda s: s[2])
    #: copy workers of one (channel, peer) ring run: the ring group's warps less the publisher (1 for a
    #: group of a single warp, which copies and publishes itself). The host engine cuts chunks the same way.
    num_copy = property(lambda s: s[3])
    threads = property(lambda s: s[4])


@functools.lru_cache(maxsize=None)
def kernel_geometry(world_size: int) -> KernelGeometry:
    """The ring kernel's geometry for ``world_size`` ranks, from its compile-time variant alone (no GPU needed):
    both engines and the construction fingerprint use it."""
    defines = ring_kernel_defines(world_size)
    max_threads = int(defines[0].split("=")[1])
    ring, self_w = warp_groups(world_size, max_threads)
    num_copy = 1 if ring <= 1 else ring - 1
    threads = 32 * ((world_size - 1) * ring + self_w)
    return KernelGeometry((max_threads, ring, self_w, num_copy, threads))


# ---- the exchange plan ---------------------------------------------------------------------------------------

import math  # noqa: E402

import numpy as np  # noqa: E402

from . import protocol as P  # noqa: E402
from .channel_layout import channel_row_range, check_row_fits, chunk_rows, is_byte_run, run_units  # noqa: E402

#: Largest number of units one run may carry: offsets stay far from int64 overflow in both engines.
MAX_UNITS = 1 << 60


class ExchangePlan:
    """Everything fixed for one shape of row exchange: the wire format, the per-peer run sizes and the call
    header's fields; built once per shape (:class:`PlanCache`) and consumed by both engines.

    A *row* is the concatenation of the parts' rows (``part_widths`` bytes each, ``row_bytes`` in all); the rows
    one rank sends to one peer form that peer's *row run*, measured in *units*: bytes for a byte run (one part
    sent in row order; channel cuts on 16-byte boundaries), else whole packed rows (``layout.is_byte_run``).
    Channel ``c`` carries units ``channel_range(units, c)`` of every run, in ring chunks of
    ``rows_per_chunk(lo, hi)`` units, after the call header (``wire/protocol.py``). The GPU kernel derives the same cuts
    from the descriptor this plan fills (``transport/cuda.py``); the host engine calls the methods below.

    Attributes
    ----------
    op, op_code, sig : str, int, int
        Operation, its code and the row signature the call header carries (``protocol.signature`` of the wire
        format, part widths and the caller's dtype / row-shape text).
    reject : bool
        This rank rejected the call: it sends only rejected headers and drains what its peers send.
    byte_run, row_bytes, unit_bytes, align, part_widths
    send_units, recv_units, send_first, recv_first : numpy.ndarray int64 ``[world_size]`` (read-only)
        Units to / from each peer and the first unit of each peer's run.
    num_channels, num_copy, chunk_bytes : int
        From the layout and :func:`kernel_geometry` (the copy workers of one ring run on the GPU).
    direct : bool
        This rank sends in direct mode (host engine, a byte run out of a symmetric array): its headers carry
        ``MODE_DIRECT`` and no payload chunks, and each receiver copies its share straight out of this rank's
        symmetric array (``protocol.HDR_MODE``). The mode is the sender's and travels in its call header, so
        the receiver knows it before it takes a byte; ranks may differ (a plain ``sendbuf`` on one rank, a
        symmetric one on another).
    """

    __slots__ = ("op", "op_code", "sig", "reject", "byte_run", "row_bytes", "unit_bytes", "align",
                 "part_widths", "send_units", "recv_units", "send_first", "recv_first", "num_channels",
                 "num_copy", "chunk_bytes", "world_size", "rank", "engine_data", "device_counts", "direct", "least_bytes",
                 "load", "host")

    def __init__(self, *, op: str, sig_text: str, part_widths, has_index: bool, send_counts, recv_counts,
                 layout, rank: int, reject: bool = False, direct: bool = False, host: bool = False):
        self.op = op
        self.direct = bool(direct) and not reject
        self.op_code = P.op_code(op)
        self.reject = bool(reject)
        self.world_size = W = layout.world_size
        self.rank = rank
        self.num_channels = layout.num_channels
        self.chunk_bytes = layout.chunk_bytes
        # the host engine cuts as the GPU (as many chunks as copy warps, for pipelining) but into chunks of at least
        # 32 KiB; both ends of a run use the same engine (the backend is agreed at construction)
        self.num_copy = kernel_geometry(W).num_copy
        self.least_bytes = P.CHUNK_LEAST_BYTES if not host else P.HOST_CHUNK_LEAST_BYTES
        self.host = bool(host)
        self.engine_data = None  # the engine's own cache for this plan (the GPU's launch descriptor)
        self.load = None  # its per-call load counters (adaptive.ChannelLoad.plan_load), made on first use
        self.device_counts = False  # units from a device counts table (PlanCache.device), not the fields below
        zeros = np.zeros(W, np.int64)
        if self.reject:
            self.sig, self.byte_run, self.row_bytes, self.unit_bytes, self.align = 0, True, 1, 1, 1
            self.part_widths = ()
            self.send_units = self.recv_units = self.send_first = self.recv_first = zeros
            zeros.flags.writeable = False
            return
        widths = tuple(int(w) for w in part_widths)
        if len(widths) > MAX_PARTS:
            raise AssertionError(f"{op}: internal: at most {MAX_PARTS} parts")
        self.part_widths = widths
        self.byte_run = is_byte_run(len(widths), has_index)
        if self.direct and not self.byte_run:
            raise AssertionError(f"{op}: internal: direct mode needs a byte run (one part, rows in order)")
        self.row_bytes = sum(widths)
        check_row_fits(op, self.row_bytes, layout.chunk_bytes, self.byte_run)
        self.unit_bytes, self.align = run_units(self.byte_run, self.row_bytes)
        self.sig = P.signature(op, "bytes" if self.byte_run else "rows", widths, sig_text)
        scale = self.row_bytes if self.byte_run else 1
        for name, counts in (("send_counts", send_counts), ("recv_counts", recv_counts)):
            check_bytes(op, name, counts, self.row_bytes)
        self.send_units = _frozen(np.asarray(send_counts, np.int64) * scale)
        self.recv_units = _frozen(np.asarray(recv_counts, np.int64) * scale)
        self.send_first = _frozen(_exclusive_cumsum(self.send_units))
        self.recv_first = _frozen(_exclusive_cumsum(self.recv_units))

    # ---- cuts (the kernel computes the same from its descriptor) ----------------------------------------
    def run_channels(self, units: int, single: bool = False) -> int:
        """Channels that carry a ``units``-unit run of this plan, each behind its own call header: every channel of
        the layout on the GPU; on the host (``protocol.host_run_channels``) channel 0 alone when ``single`` (the
        sender's run goes direct or is rejected: see :meth:`header`) or the run fits one ring slot. Sender and
        receiver compute it from the same agreed units; the receiver learns a direct or rejected run from channel
        0's header (``HDR_NCHANNELS``)."""
        if not self.host:
            return self.num_channels
        return P.host_run_channels(int(units) * self.unit_bytes, single, self.num_channels, self.chunk_bytes)

    def channel_range(self, units: int, channel: int, single: bool = False) -> tuple:
        """Units ``[lo, hi)`` of a ``units``-unit run that ``channel`` carries (empty on a channel past
        :meth:`run_channels`)."""
        units = int(units)
        k = self.run_channels(units, single) if self.host else self.num_channels
        if channel >= k:
            return units, units
        return channel_row_range(units, channel, k, self.align)

    def run_inline(self, units: int, single: bool = False) -> bool:
        """Host engine: a ring run of ``units`` rides in its call header's slot, no payload chunks follow
        (``protocol.host_run_inline``; never direct, rejected or on the GPU)."""
        return self.host and not single and P.host_run_inline(int(units) * self.unit_bytes, self.chunk_bytes)

    def share_chunks(self, units: int, channel: int, single: bool = False) -> int:
        """Payload chunks after the call header on ``channel`` for a ``units``-unit run (0 for a run in the
        header's slot, :meth:`run_inline`)."""
        if self.run_inline(units, single):
            return 0
        return self.num_chunks(*self.channel_range(units, channel, single))

    def rows_per_chunk(self, lo: int, hi: int) -> int:
        """Units per ring chunk of a channel's share ``[lo, hi)`` (``layout.chunk_rows`` with the GPU's copy
        workers, so both engines cut the same chunks)."""
        return chunk_rows(hi - lo, self.unit_bytes, self.chunk_bytes, self.num_copy, self.least_bytes)

    def num_chunks(self, lo: int, hi: int) -> int:
        """Payload chunks of a channel's share in ring mode (the call header not counted)."""
        if hi <= lo:
            return 0
        per = self.rows_per_chunk(lo, hi)
        return -(-(hi - lo) // per)

    def header(self, seq: int, peer: int, channel: int) -> np.ndarray:
        """The call header this rank sends to ``peer`` on ``channel`` (int64 ``[HDR_WORDS]``)."""
        h = np.zeros(P.HDR_WORDS, np.int64)
        h[P.HDR_MAGIC] = P.HDR_MAGIC_VALUE
        h[P.HDR_SEQ], h[P.HDR_OP], h[P.HDR_SIG] = seq, self.op_code, self.sig
        h[P.HDR_RANK], h[P.HDR_CHANNEL] = self.rank, channel
        if self.reject:
            h[P.HDR_STATUS] = P.HDR_REJECTED
            h[P.HDR_NCHANNELS] = self.run_channels(0, True)
            return h
        units = int(self.send_units[peer])
        h[P.HDR_UNITS], h[P.HDR_STATUS] = units, P.HDR_OK
        h[P.HDR_NCHUNKS] = 0 if self.direct else self.share_chunks(units, channel)
        h[P.HDR_MODE] = P.MODE_DIRECT if self.direct else P.MODE_RING
        h[P.HDR_NCHANNELS] = self.run_channels(units, self.direct)
        return h

    def __repr__(self) -> str:
        return (f"ExchangePlan(op={self.op!r}, reject={self.reject}, byte_run={self.byte_run}, "
                f"row_bytes={self.row_bytes}, direct={self.direct}, send_units={self.send_units.tolist()}, "
                f"recv_units={self.recv_units.tolist()})")


MAX_PARTS = P.MAX_PARTS


def check_bytes(op: str, name: str, counts, row_bytes: int) -> None:
    """``ValueError`` when ``counts`` rows of ``row_bytes`` bytes (exact sum, Python ints: never wraps) are more
    than the transport can address (``MAX_UNITS`` bytes)."""
    total = sum(int(c) for c in counts)
    if total * row_bytes >= MAX_UNITS:
        raise ValueError(f"{op}: argument '{name}' asks for {total} rows of {row_bytes} bytes, more than the "
                         f"transport can address (2**60 bytes)")


def _frozen(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


def _exclusive_cumsum(a: np.ndarray) -> np.ndarray:
    out = np.zeros_like(a)
    np.cumsum(a[:-1], out=out[1:])
    return out


class PlanCache:
    """Plans by call shape (operation, signature text, part widths, gather or not, counts): a repeated call (every
    training step) finds its plan, and with it the engine's launch descriptor, without rebuilding either."""

    def __init__(self, layout, rank: int, max_plans: int = 64, host: bool = False):
        self.layout, self.rank, self.max_plans, self.host = layout, rank, max_plans, host
        self._plans = {}
        self._rejects = {}

    def device(self, op: str, sig_text: str, part_widths, has_index: bool, row_run: bool = True) -> ExchangePlan:
        """The plan of a device-count call (GPU): the per-peer units come from a counts table in device memory
        (``protocol.CT_*``, written by the count exchange kernel), so one plan serves every count; its
        ``send_units`` / ``recv_units`` are zeros and unused."""
        key = (op, sig_text, tuple(part_widths), has_index, row_run, "device")
        plan = self._plans.get(key)
        if plan is None:
            W = self.layout.world_size
            # row_run: a row run even without an index (has_index=True; the kernel then reads rows in order),
            # the table counts rows; else the wire format the parts imply (a byte run: the table counts bytes)
            plan = ExchangePlan(op=op, sig_text=sig_text, part_widths=part_widths, has_index=has_index or row_run,
                                send_counts=np.zeros(W, np.int64), recv_counts=np.zeros(W, np.int64),
                                layout=self.layout, rank=self.rank, host=self.host)
            plan.device_counts = True
            if len(self._plans) >= self.max_plans:
                self._plans.clear()
            self._plans[key] = plan
        return plan

    def get(self, op: str, sig_text: str, part_widths, has_index: bool, send_counts: np.ndarray,
            recv_counts: np.ndarray, direct: bool = False) -> ExchangePlan:
        key = (op, sig_text, tuple(part_widths), has_index, send_counts.tobytes(), recv_counts.tobytes(), direct)
        plan = self._plans.get(key)
        if plan is None:
            plan = ExchangePlan(op=op, sig_text=sig_text, part_widths=part_widths, has_index=has_index,
                                send_counts=send_counts, recv_counts=recv_counts, layout=self.layout, rank=self.rank,
                                direct=direct, host=self.host)
            if len(self._plans) >= self.max_plans:
                self._plans.clear()
            self._plans[key] = plan
        return plan

    def reject(self, op: str) -> ExchangePlan:
        """The plan of a call this rank rejected: headers with ``HDR_REJECTED``, nothing else."""
        plan = self._rejects.get(op)
        if plan is None:
            W = self.layout.world_size
            plan = ExchangePlan(op=op, sig_text="", part_widths=(), has_index=False, send_counts=np.zeros(W),
                                recv_counts=np.zeros(W), layout=self.layout, rank=self.rank, reject=True,
                                host=self.host)
            self._rejects[op] = plan
        return plan


def part_width(a) -> int:
    """Bytes of one row of ``a`` (all axes after the first)."""
    return int(a.dtype.itemsize * math.prod(a.shape[1:]))
