"""The one memory map of the symmetric buffer, shared by the host path and the GPU kernels.

Every rank's buffer has the same map. It is carved in order, channel first, then peer rank, then region
(the layout of DeepEP's intranode buffer and of the design article in ``shared/seed``)::

    for channel c in [0, num_channels):            # channel_bytes = world_size * region_bytes
      for peer p in [0, world_size):               # region_bytes = 4 * LINE + num_slots * chunk_bytes
        +0    tail       (recv side) uint64 chunks peer p has published into this rank's ring (c, p).
                         Written by p's sender block (remote, st.release.sys); read by our receiver (ld.acquire.sys).
        +128  head       (send side) uint64 chunks of OUR ring on peer p, i.e. p's ring (c, rank), that p consumed.
                         Written by p's receiver block (remote, st.release.sys); read by our sender (ld.acquire.sys).
        +256  send state our sender's state towards p: [tail at the end of the last call, calls made] (local).
        +384  recv state our receiver's state from p: [head at the end of the last call, calls made] (local).
        +512  ring       num_slots * chunk_bytes payload bytes, written by p, read by us. Each call starts with one
                         call-header slot (cupy_symbuf.wire.protocol), then its payload chunks.
    notify:                                         # count exchange (notify step), double-buffered by call parity
      for parity in (0, 1): for source rank s: slot of notify_slot_bytes =
                         [epoch, op, status, signature | values int64 * max_notify_ints]
    small:               (GPU, Config.small_bytes > 0 and world_size > 1) the small-message protocol's words
                         (cupy_symbuf.wire.protocol SMALL_*): SMALL_CTRL_BYTES of local control words, then for
                         half h in (0, 1) (call sequence number & 1), for source rank s: slot of small_slot_bytes =
                         [header line | one 8-byte word (4 payload bytes + the call's flag) per 4 bytes, up to
                         small_peer_bytes], written by s (remote, 8-byte st.volatile), polled by us.
    abort:               one line: [flag, aborting rank, reason, peer, channel, detail], written by whoever aborts
                         into every rank's buffer (cupy_symbuf.wire.protocol).

All counters only grow (64-bit); the ring slot of counter ``n`` is ``n % num_slots``. Each counter sits alone on
its own 128-byte line and every region is 128-byte aligned. All offsets are Python ints (64-bit in the kernels).
"""
from __future__ import annotations

from dataclasses import dataclass

from . import protocol as P
from .protocol import LINE_BYTES

__all__ = ["LINE_BYTES", "ChannelLayout", "channel_row_range", "chunk_rows", "is_byte_run", "check_row_fits",
           "run_units"]

TAIL_OFFSET = P.TAIL_OFFSET
HEAD_OFFSET = P.HEAD_OFFSET
SEND_TAIL_OFFSET = P.SEND_STATE_OFFSET
RECV_HEAD_OFFSET = P.RECV_STATE_OFFSET
RING_OFFSET = P.RING_OFFSET


def _align(value: int, alignment: int = LINE_BYTES) -> int:
    return (value + alignment - 1) // alignment * alignment


@dataclass(frozen=True)
class ChannelLayout:
    """Offsets (bytes from the start of a rank's symmetric buffer) of every channel region.

    Parameters
    ----------
    world_size : int
        Ranks sharing the buffer (>= 1).
    num_channels : int
        Channels (>= 1); ``Config.num_sms // 2``.
    num_slots, chunk_bytes : int
        Ring capacity per (channel, peer) in slots, and bytes per slot (multiple of 128).
    max_notify_ints : int
        int64 values per (source rank) notify slot.
    small_bytes : int
        Largest ``alltoall`` (bytes of one rank's sendbuf) that goes by the small-message protocol
        (``Config.small_bytes``; 0: none, and no small region).
    """

    world_size: int
    num_channels: int
    num_slots: int
    chunk_bytes: int
    max_notify_ints: int = 1024
    small_bytes: int = 0

    def __post_init__(self) -> None:
        for name in ("world_size", "num_channels", "num_slots", "chunk_bytes", "max_notify_ints"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ChannelLayout: {name} must be a positive int, got {value!r}")
        if not isinstance(self.small_bytes, int) or not 0 <= self.small_bytes < 1 << 31:  # (a header word's 32 bits)
            raise ValueError(f"ChannelLayout: small_bytes must be an int in [0, 2**31), got {self.small_bytes!r}")
        if self.chunk_bytes % LINE_BYTES:
            raise ValueError(f"ChannelLayout: chunk_bytes must be a multiple of {LINE_BYTES}, got {self.chunk_bytes}")

    @classmethod
    def from_config(cls, config, world_size: int) -> "ChannelLayout":
        """Layout for a resolved :class:`~cupy_symbuf.Config` and ``world_size`` ranks."""
        return cls(world_size=world_size, num_channels=config.num_channels, num_slots=config.num_slots,
                   chunk_bytes=config.chunk_bytes, max_notify_ints=config.max_notify_ints,
                   small_bytes=getattr(config, "small_bytes", None) or 0)

    # ---- sizes -------------------------------------------------------------------------------------------
    @property
    def ring_bytes(self) -> int:
        """Payload bytes of one (channel, peer) ring: ``num_slots * chunk_bytes``."""
        return self.num_slots * self.chunk_bytes

    @property
    def region_bytes(self) -> int:
        """Bytes of one (channel, peer) region: four 128-byte counter lines plus the ring."""
        return RING_OFFSET + self.ring_bytes

    @property
    def channel_bytes(self) -> int:
        """Bytes of one channel: ``world_size * region_bytes``."""
        return self.world_size * self.region_bytes

    @property
    def notify_offset(self) -> int:
        """Start of the notify (count exchange) region, after all channels."""
        return self.num_channels * self.channel_bytes

    @property
    def notify_slot_bytes(self) -> int:
        """One source rank's notify slot: header words (epoch, op, status, signature) + ``max_notify_ints``
        values, 128-byte aligned."""
        return _align(8 * (P.NOTIFY_HDR_WORDS + self.max_notify_ints))

    @property
    def notify_bytes(self) -> int:
        """Two parities x ``world_size`` slots."""
        return 2 * self.world_size * self.notify_slot_bytes

    @property
    def small_peer_bytes(self) -> int:
        """Largest payload per peer of a small-protocol ``alltoall``: ``small_bytes // world_size`` (0: the
        protocol is off, also for one rank)."""
        return self.small_bytes // self.world_size if self.world_size > 1 else 0

    @property
    def small_slot_bytes(self) -> int:
        """One source's slot in one half of the small region: the header line, then one 8-byte word per 4
        payload bytes, 128-byte aligned."""
        return _align(8 * P.SMALL_DATA_WORD + 8 * (-(-self.small_peer_bytes // 4)))

    @property
    def small_offset(self) -> int:
        """Start of the small region, after the notify region (its size is 0 when the protocol is off)."""
        return self.notify_offset + self.notify_bytes

    @property
    def small_region_bytes(self) -> int:
        """Control words + 2 halves x ``world_size`` source slots; 0 when ``small_peer_bytes`` is 0."""
        if not self.small_peer_bytes:
            return 0
        return P.SMALL_CTRL_BYTES + 2 * self.world_size * self.small_slot_bytes

    def small_slot_offset(self, half: int, source: int) -> int:
        """The slot rank ``source`` writes into for calls whose sequence number has parity ``half``."""
        if not self.small_peer_bytes or half not in (0, 1) or not 0 <= source < self.world_size:
            raise IndexError(f"ChannelLayout: small slot (half={half}, source={source}) out of range (small region "
                             f"{'off' if not self.small_peer_bytes else 'on'})")
        return self.small_offset + P.SMALL_CTRL_BYTES + (half * self.world_size + source) * self.small_slot_bytes

    @property
    def abort_offset(self) -> int:
        """The abort line, after the notify and small regions (``protocol.ABORT_*`` words)."""
        return self.small_offset + self.small_region_bytes

    @property
    def total_bytes(self) -> int:
        """Bytes every rank allocates for its symmetric buffer."""
        return self.abort_offset + LINE_BYTES

    # ---- offsets -----------------------------------------------------------------------------------------
    def region_offset(self, channel: int, peer: int) -> int:
        """Start of the (channel, peer) region."""
        self._check(channel, peer)
        return channel * self.channel_bytes + peer * self.region_bytes

    def tail_offset(self, channel: int, peer: int) -> int:
        """``tail`` line: chunks ``peer`` published into this rank's ring (channel, peer)."""
        return self.region_offset(channel, peer) + TAIL_OFFSET

    def head_offset(self, channel: int, peer: int) -> int:
        """``head`` line: chunks of this rank's data that ``peer`` consumed from its ring (channel, this rank)."""
        return self.region_offset(channel, peer) + HEAD_OFFSET

    def send_tail_offset(self, channel: int, peer: int) -> int:
        """Local running send tail towards ``peer``."""
        return self.region_offset(channel, peer) + SEND_TAIL_OFFSET

    def recv_head_offset(self, channel: int, peer: int) -> int:
        """Local running receive head from ``peer``."""
        return self.region_offset(channel, peer) + RECV_HEAD_OFFSET

    def ring_offset(self, channel: int, peer: int) -> int:
        """Ring payload written by ``peer`` into this rank's buffer for ``channel``."""
        return self.region_offset(channel, peer) + RING_OFFSET

    def slot_offset(self, channel: int, peer: int, counter: int) -> int:
        """Payload offset of ring counter ``counter`` (slot = counter % num_slots)."""
        return self.ring_offset(channel, peer) + (counter % self.num_slots) * self.chunk_bytes

    def notify_slot_offset(self, parity: int, source: int) -> int:
        """Notify slot that rank ``source`` writes into, for calls of the given parity (epoch % 2)."""
        if parity not in (0, 1) or not 0 <= source < self.world_size:
            raise IndexError(f"ChannelLayout: notify slot (parity={parity}, source={source}) out of range")
        return self.notify_offset + (parity * self.world_size + source) * self.notify_slot_bytes

    def _check(self, channel: int, peer: int) -> None:
        if not 0 <= channel < self.num_channels:
            raise IndexError(f"ChannelLayout: channel {channel} not in [0, {self.num_channels})")
        if not 0 <= peer < self.world_size:
            raise IndexError(f"ChannelLayout: peer {peer} not in [0, {self.world_size})")

    # ---- kernels -----------------------------------------------------------------------------------------
    def kernel_args(self) -> tuple:
        """Scalars handed to every kernel, in the order of ``struct Layout`` in ``cuda_src/layout.cuh``."""
        return (self.region_bytes, self.channel_bytes, self.num_slots, self.chunk_bytes,
                self.notify_offset, self.notify_slot_bytes)

    def describe(self) -> str:
        """Human-readable map of the buffer with sizes."""
        kib = 1024.0
        lines = [
            f"SymBuffer layout: world_size={self.world_size} num_channels={self.num_channels} "
            f"total={self.total_bytes} B ({self.total_bytes / kib / kib:.2f} MiB)",
            f"  channel c at c * {self.channel_bytes} B; inside it peer p at p * {self.region_bytes} B:",
            f"    +{TAIL_OFFSET:<6d} tail       uint64, 128 B line (written by peer's sender)",
            f"    +{HEAD_OFFSET:<6d} head       uint64, 128 B line (written by peer's receiver)",
            f"    +{SEND_TAIL_OFFSET:<6d} send state [tail, calls] uint64, 128 B line (local sender state)",
            f"    +{RECV_HEAD_OFFSET:<6d} recv state [head, calls] uint64, 128 B line (local receiver state)",
            f"    +{RING_OFFSET:<6d} ring       {self.num_slots} slots x {self.chunk_bytes} B = {self.ring_bytes} B "
            f"(each call: one call-header slot, then its payload chunks)",
            f"  notify at {self.notify_offset}: 2 parities x {self.world_size} slots x {self.notify_slot_bytes} B "
            f"= {self.notify_bytes} B (epoch, op, status, signature + {self.max_notify_ints} int64)",
        ]
        if self.small_region_bytes:
            lines.append(
                f"  small at {self.small_offset}: {P.SMALL_CTRL_BYTES} B control + 2 halves x {self.world_size} "
                f"slots x {self.small_slot_bytes} B = {self.small_region_bytes} B (alltoall up to "
                f"{self.small_peer_bytes} B per peer: header line + one 8-byte word per 4 payload bytes, flag in data)")
        else:
            lines.append("  small: none (small-message protocol off)")
        lines.append(f"  abort line at {self.abort_offset}: {LINE_BYTES} B (flag, aborting rank, reason, peer, "
                     f"channel)")
        return "\n".join(lines)


def channel_row_range(rows: int, channel: int, num_channels: int, align: int = 1) -> tuple:
    """Rows ``[lo, hi)`` of a ``rows``-row run carried by ``channel``: an even split whose inner boundaries are
    multiples of ``align`` rows.

    Sender and receiver compute the same split from the same row count, so no offsets travel.
    The same formula is in ``cuda_src/layout.cuh`` (``channel_range``).
    """
    lo = (rows * channel // num_channels) // align * align
    hi = rows if channel == num_channels - 1 else (rows * (channel + 1) // num_channels) // align * align
    return lo, hi


def chunk_rows(rows: int, unit_bytes: int, chunk_bytes: int, num_copy: int = 1,
               least_bytes: int = P.CHUNK_LEAST_BYTES) -> int:
    """Units (rows, or bytes of a byte run) per ring chunk of a ``rows``-unit run on one channel.

    ``num_copy`` workers copy chunks in parallel (GPU: the copy warps of a peer group; host: 1). The run is cut
    into ``num_copy`` chunks per round in as few rounds as whole slots allow: a short run is spread over every
    worker instead of one worker copying one slot, and a long one ends on a full round. A chunk is at least
    ``least_bytes`` of units (GPU: 4 KiB, one unrolled warp pass; host: ``HOST_CHUNK_LEAST_BYTES``), a multiple of 512 bytes of units (one vector pass of a warp; keeps byte
    runs 16-byte aligned), and at most one slot (``chunk_bytes // unit_bytes`` units). Sender and receiver derive
    it from the same row count, so they cut the run alike. Same formula in ``cuda_src/ring_prims.cuh``. An empty
    run (``rows <= 0``) has no chunks; the slot size is returned.
    """
    max_rows = chunk_bytes // unit_bytes
    if rows <= 0:
        return max_rows
    grain = min(max_rows, -(-P.CHUNK_GRAIN_BYTES // unit_bytes))
    least = min(max_rows, -(-least_bytes // unit_bytes))
    rounds = -(-rows // (num_copy * max_rows))
    per = -(-rows // (num_copy * rounds))
    return min(max_rows, max(least, -(-per // grain) * grain))


# ---- wire format of a row exchange (both backends, and cuda_src/ring_exchange.cu) ---------------------------------

def is_byte_run(num_parts: int, has_index: bool) -> bool:
    """Wire format of a row exchange: a byte run (1-byte rows, channel cuts on 16-byte boundaries) for one part
    sent in row order, else packed rows (cuts on row boundaries, whole rows per chunk). Decided only from what
    every rank of a collective shares (number of parts, gather or not), never from a rank's own strides: sender
    and receiver must cut every run the same way."""
    return num_parts == 1 and not has_index


def check_row_fits(op: str, row_bytes: int, chunk_bytes: int, byte_run: bool) -> None:
    """Packed rows travel whole in one ring slot: ``ValueError`` when a row is larger than ``Config.chunk_bytes``."""
    if not byte_run and row_bytes > chunk_bytes:
        raise ValueError(f"{op}: one row is {row_bytes} bytes (all its parts), more than Config.chunk_bytes="
                         f"{chunk_bytes}: ring slots hold whole rows; build the Communicator with "
                         f"Config(chunk_bytes=...) of at least {(row_bytes + 127) // 128 * 128}")


def run_units(byte_run: bool, row_bytes: int) -> tuple:
    """``(unit_bytes, align)`` of a run: the unit its channels and chunks are cut in (a byte, or one packed
    row) and the alignment of the channel cuts in units (16 bytes, or 1 row); ``chunk_rows(rows, unit_bytes,
    chunk_bytes, ...)`` then cuts a channel's share into ring chunks. The kernel gets the same values in its
    descriptor (``DESC_ROW_BYTES``, ``DESC_ROW_ALIGN``)."""
    return (1, P.BYTE_RUN_ALIGN) if byte_run else (row_bytes, 1)
