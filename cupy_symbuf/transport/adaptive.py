"""Adaptive channel assignment (``Config(adaptive=True)``): load counters per (channel, peer) kept across calls, and
the *home map* re-balanced from them every ``Config.adaptive_interval`` eager calls.

Why: every peer's run is cut evenly across the channels, so under skewed MoE routing (a few hot experts and
ranks) every channel block is loaded alike, but inside a block the hot peer's warp group works while the other
groups idle. Two remedies, both off the wire (the chunks, counters and call headers are the agreed plan's, so the
rows land exactly where they do without them and the ranks need not exchange anything to use them):

* **Work sharing** (GPU kernel build ``SYMBUF_ADAPTIVE=1``, ``cuda_src/ring_exchange.cu``): the chunks of each
  (channel, peer) ring run are claimed from a per-peer atomic counter by any warp of the block, so warps whose
  own run is done (and the self group's, once this rank's own rows are copied) help the hot peer. Copy warp 0 of
  each group keeps to its own run until it is exhausted, so every run always progresses (no deadlock).
* **The home map** (:func:`home_map`): which run each shareable warp starts on, so that more warps start on the
  hot peers without waiting for their own run to be exhausted: workers in proportion to each peer's bytes over the
  last interval. Every rank computes it by the same rule from its own counters; a run's load is the same at
  its two ends (bytes ``s`` sends ``d`` = bytes ``d`` receives from ``s``), so sender and receiver weigh it alike.
  A CUDA graph captured earlier keeps the map of its capture (the map is a launch parameter).

The host twin (``transport/host.py``) has one worker per rank, which already moves whichever run can move (its progress
loop skips a run that cannot), so its work sharing is inherent; it takes the same map as its visiting order:
runs with more workers are served first in every pass.

Design: the seed article's section 4 ("adaptive channel assignment"); work stealing from a shared chunk counter as
in persistent-kernel schedulers (e.g. CUTLASS's stream-K tile scheduler), applied to ring chunks.
"""
from __future__ import annotations

import numpy as np

from ..wire import protocol as P
from ..wire.plan import kernel_geometry

__all__ = ["home_map", "pack_home", "workers_per_peer", "ChannelLoad"]

SEND, RECV = 0, 1


def _group_warps(world_size: int, rank: int):
    """``(ring_warps, self_first, self_warps, first_warp(p))`` of the ring kernel's block for this rank."""
    geo = kernel_geometry(world_size)
    ring, self_w = geo.ring_warps, geo.self_warps
    self_first = rank * ring

    def first(p: int) -> int:
        return p * ring if p < rank else self_first + self_w + (p - rank - 1) * ring
    return ring, self_first, self_w, first


def home_map(loads, world_size: int, rank: int) -> np.ndarray:
    """The home of every warp of one ring-kernel block (sender or receiver) of ``rank``: uint8 ``[32]``, the peer
    whose run that warp takes chunks of first, or ``protocol.HOME_OWN`` (its own group's run; the self
    group's warp ``i``: the ``(i % (world_size - 1))``-th peer after ``rank``).

    ``loads``: int ``[world_size]``, bytes of each peer's run in this role over the last interval (the entry
    of ``rank`` is ignored). The block's shareable warps (every ring group's copy warps but the first, which keeps
    to its own run, and the self group's warps) are given to the peers in proportion to their load (largest
    remainder), a warp staying in its own group where that group is given warps. All loads zero, one rank, or
    groups of a single warp (``world_size > 15``): every warp ``HOME_OWN``. Deterministic: the same loads give the
    same map on every rank and in both engines. ``ValueError`` for a wrong ``loads`` shape or a negative load."""
    W = int(world_size)
    out = np.full(32, P.HOME_OWN, np.uint8)
    loads = np.asarray(loads, dtype=np.int64)
    if loads.shape != (W,):
        raise ValueError(f"home_map: argument 'loads' must have shape ({W},), got {loads.shape}")
    if (loads < 0).any():
        raise ValueError(f"home_map: argument 'loads' must be >= 0, got {loads.tolist()}")
    if W == 1:
        return out
    ring, self_first, self_w, first = _group_warps(W, rank)
    if ring <= 1:
        return out
    peers = [p for p in range(W) if p != rank]
    load = np.array([loads[p] for p in peers], np.float64)
    total = load.sum()
    if total <= 0:
        return out
    own = {p: list(range(first(p) + 2, first(p) + ring)) for p in peers}  # shareable copy warps of each group
    pool = sum(len(v) for v in own.values()) + self_w
    ideal = pool * load / total
    alloc = np.floor(ideal).astype(np.int64)
    for i in np.argsort(-(ideal - alloc), kind="stable")[: pool - int(alloc.sum())]:
        alloc[i] += 1
    cap = dict(zip(peers, alloc.tolist()))
    spare = []
    for p in peers:  # warps stay home where their group gets warps
        for w in own[p]:
            if cap[p] > 0:
                cap[p] -= 1  # HOME_OWN: its own run first
            else:
                spare.append(w)
    spare += list(range(self_first, self_first + self_w))
    order = sorted(peers, key=lambda p: (-loads[p], p))
    for w in spare:
        target = next((p for p in order if cap[p] > 0), None)
        if target is None:
            break
        cap[target] -= 1
        out[w] = target
    return out


def workers_per_peer(home: np.ndarray, world_size: int, rank: int) -> list:
    """Warps of one block that start on each peer's run under ``home`` (:func:`home_map`): ``[world_size]``
    ints, the dedicated warp included (0 for ``rank``; self-group warps at ``HOME_OWN`` count for the peers in turn
    after ``rank``, as the kernel starts them)."""
    W = int(world_size)
    counts = [0] * W
    if W == 1:
        return counts
    ring, self_first, self_w, first = _group_warps(W, rank)
    if ring <= 1:  # one warp per group: no sharing
        return [0 if p == rank else 1 for p in range(W)]
    for p in range(W):
        if p == rank:
            continue
        for w in range(first(p) + 1, first(p) + ring):
            h = int(home[w])
            counts[p if h == P.HOME_OWN or w == first(p) + 1 else h] += 1
    for i, w in enumerate(range(self_first, self_first + self_w)):
        h = int(home[w])  # the kernel's self_start: without a home, the peers in turn after this rank
        counts[(rank + 1 + i % (W - 1)) % W if h == P.HOME_OWN else h] += 1
    return counts


def pack_home(send_home: np.ndarray, recv_home: np.ndarray) -> np.ndarray:
    """The descriptor words ``DESC_HOME``: int64 ``[HOME_WORDS]``, the sender block's 32 bytes then the receiver
    block's (little-endian: warp ``w``'s byte is bits ``8 * (w % 8)`` of word ``w // 8``)."""
    raw = np.concatenate([np.asarray(send_home, np.uint8), np.asarray(recv_home, np.uint8)])
    return raw.view("<i8").astype(np.int64)


def _cuts(plan, units: np.ndarray, C: int, single: bool = False):
    """``(units, chunks)``, int64 ``[W, C]``: each peer run's share on each channel and its payload chunks: the
    plan's ``channel_range`` and ``share_chunks`` (with ``single``: the runs go direct or are rejected) for every
    (peer, channel) at once. The host engine's rules included: a run on channel 0 alone where ``run_channels``
    says 1 (nothing on the others), 0 chunks for a run in its header's slot (``run_inline``). Python ints where
    a product could leave int64."""
    W = units.shape[0]
    if W and int(units.max(initial=0)) >= (1 << 62) // max(C + 1, 1):  # huge runs: exact Python ints
        cuts = [[plan.channel_range(int(u), k, single) for k in range(C)] for u in units]
        n = np.array([[hi - lo for lo, hi in row] for row in cuts], np.int64).reshape(W, C)
        chunks = np.array([[plan.share_chunks(int(u), k, single) for k in range(C)] for u in units],
                          np.int64).reshape(W, C)
        return n, chunks
    c = np.arange(C, dtype=np.int64)
    align = int(plan.align)
    lo = (units[:, None] * c[None, :] // C) // align * align
    hi = (units[:, None] * (c[None, :] + 1) // C) // align * align
    hi[:, C - 1] = units
    n = hi - lo
    if plan.host:  # ExchangePlan.run_channels: channel 0 alone for a direct or rejected run, or one of one slot
        run_bytes = units * plan.unit_bytes
        one = (run_bytes <= plan.chunk_bytes) | single
        n[one] = 0
        n[one, 0] = units[one]
    max_rows = plan.chunk_bytes // plan.unit_bytes  # layout.chunk_rows, vectorised
    grain = min(max_rows, -(-P.CHUNK_GRAIN_BYTES // plan.unit_bytes))
    least = min(max_rows, -(-plan.least_bytes // plan.unit_bytes))
    pos = np.maximum(n, 1)
    rounds = -(-pos // (plan.num_copy * max_rows))
    per = -(-pos // (plan.num_copy * rounds))
    per = np.minimum(max_rows, np.maximum(least, -(-per // grain) * grain))
    chunks = np.where(n > 0, -(-n // per), 0)
    if plan.host and not single:  # ExchangePlan.run_inline: the run rides in its call header's slot (on channel 0)
        chunks[(run_bytes > 0) & (run_bytes <= P.HOST_CHUNK_LEAST_BYTES)
               & (run_bytes + 8 * P.HDR_WORDS <= plan.chunk_bytes)] = 0
    return n, chunks


class ChannelLoad:
    """Load counters of one communicator and its home maps (see the module docstring); kept by its ``Engine``.

    ``totals``: int64 ``[2 (send, recv), num_channels, world_size, LOAD_WORDS]``: bytes of each run's channel
    share, ring chunks, and (GPU work sharing) chunks copied by warps of another group. ``adaptive``: re-balance
    the map every ``interval`` eager calls; off, only the bytes per peer are kept (``peer_bytes``;
    ``Communicator.channel_stats``)."""

    def __init__(self, world_size: int, rank: int, num_channels: int, *, adaptive: bool, interval: int):
        self.world_size, self.rank, self.num_channels = world_size, rank, num_channels
        self.adaptive, self.interval = bool(adaptive), int(interval)
        self.totals = np.zeros((2, num_channels, world_size, P.LOAD_WORDS), np.int64)
        #: bytes per (role, peer) of the host-count calls, kept by every communicator (one NumPy add per plan at
        #: a fold); the per-channel ``totals`` only with ``adaptive`` (their cuts cost ~40-60 us per new plan)
        self.peer_bytes = np.zeros((2, world_size), np.int64)
        self.calls = 0            # eager ring exchanges counted towards the next re-balance
        self.calls_total = 0
        self.rebalances = 0       # maps computed
        self.remaps = 0           # of which changed the map
        self._at_rebalance = self.totals.copy()  # totals at the last re-balance
        self.home = np.full((2, 32), P.HOME_OWN, np.uint8)
        self.words = pack_home(self.home[SEND], self.home[RECV])

    @staticmethod
    def plan_load(plan, num_channels: int, world_size: int, rank: int) -> np.ndarray:
        """The per-call load of a host-count plan: int64 ``[2, C, W, LOAD_WORDS]`` (bytes, chunks; nothing
        stolen), from the plan's own cuts (``layout.channel_row_range`` / ``chunk_rows``, the same the kernel and the
        host engine use), computed with NumPy over every (channel, peer) at once; zeros for a rejected or
        device-count plan (its units are not known on the host). A direct run counts no chunks; on the host it
        travels on channel 0 alone and its bytes count there (what this rank receives counts as the rings' cut:
        its peers' modes are theirs). Cached on the plan."""
        got = getattr(plan, "load", None)
        if got is not None:
            return got
        out = np.zeros((2, num_channels, world_size, P.LOAD_WORDS), np.int64)
        if not plan.reject and not plan.device_counts:
            for role, units in ((SEND, plan.send_units), (RECV, plan.recv_units)):
                # a direct host run travels on channel 0 alone (a receiver counts the rings' cut it expects)
                n, chunks = _cuts(plan, np.asarray(units, np.int64), num_channels, plan.direct and role == SEND)
                n[rank] = chunks[rank] = 0  # a rank's own rows take no ring
                out[role, :, :, P.LOAD_BYTES] = (n * plan.unit_bytes).T
                out[role, :, :, P.LOAD_CHUNKS] = 0 if plan.direct and role == SEND else chunks.T
        out.flags.writeable = False
        plan.load = out
        return out

    def due(self) -> bool:
        """Count one eager call towards the next re-balance; True when it is due (every ``interval`` calls)."""
        if not self.adaptive:
            return False
        self.calls += 1
        return self.calls >= self.interval

    def rebalance(self, totals=None) -> bool:
        """Re-balance from the bytes moved since the last re-balance (``totals``: the counters now, else
        ``self.totals``); returns True when the map changed (the caller hands ``words`` to its transport)."""
        self.calls = 0
        if totals is None:
            totals = self.totals
        # 0 after a reset
        delta = np.maximum(totals[..., P.LOAD_BYTES] - self._at_rebalance[..., P.LOAD_BYTES], 0)
        self._at_rebalance = totals.copy()
        self.rebalances += 1
        if not delta.any():
            return False  # nothing moved (or counters not yet read): keep the map
        per_peer = delta.sum(axis=1)  # [2, W]
        new = np.stack([home_map(per_peer[r], self.world_size, self.rank) for r in (SEND, RECV)])
        if (new == self.home).all():
            return False
        self.home = new
        self.words = pack_home(new[SEND], new[RECV])
        self.remaps += 1
        return True

    def add_plan(self, plan, n: int, *, detailed: bool) -> None:
        """Count ``n`` calls of ``plan``: its bytes per peer, and with ``detailed`` its per-channel load."""
        if plan.reject or plan.device_counts:
            return
        unit = plan.unit_bytes
        self.peer_bytes[SEND] += n * unit * plan.send_units
        self.peer_bytes[RECV] += n * unit * plan.recv_units
        if detailed:
            self.totals += n * self.plan_load(plan, self.num_channels, self.world_size, self.rank)

    def reset(self) -> None:
        """Zero every counter (the map stays)."""
        self.totals[:] = 0
        self._at_rebalance[:] = 0
        self.peer_bytes[:] = 0
        self.calls = self.calls_total = self.rebalances = self.remaps = 0

    def stats(self, totals=None, *, work_sharing: bool = False, detailed: bool = True) -> dict:
        """The dict :meth:`Communicator.channel_stats` returns (see there)."""
        t = self.totals if totals is None else totals
        W = self.world_size
        out = {"adaptive": self.adaptive, "interval": self.interval, "work_sharing": bool(work_sharing),
               "calls": self.calls_total, "rebalances": self.rebalances, "remaps": self.remaps}
        for role, name in ((SEND, "send"), (RECV, "recv")):
            b = t[role, :, :, P.LOAD_BYTES]
            if detailed:
                per_peer = b.sum(axis=0)
            else:
                per_peer = self.peer_bytes[role].copy()
                per_peer[self.rank] = 0  # a rank's own rows take no ring
            ring = [p for p in range(W) if p != self.rank]
            mean = per_peer[ring].mean() if ring else 0.0
            out[name] = {"bytes": b.tolist() if detailed else None,
                         "chunks": t[role, :, :, P.LOAD_CHUNKS].tolist() if detailed else None,
                         "stolen": t[role, :, :, P.LOAD_STOLEN].tolist() if detailed else None,
                         "bytes_per_peer": per_peer.tolist(),
                         "imbalance": float(per_peer[ring].max() / mean) if ring and mean > 0 else 1.0,
                         "home": [int(h) for h in self.home[role]],
                         "workers": workers_per_peer(self.home[role], W, self.rank)}
        return out
