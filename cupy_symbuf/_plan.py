"""The agreed exchange plan: everything fixed for one shape of row exchange, computed once in Python and consumed
by both engines (the host engine interprets it; the GPU path turns it into the kernel's launch descriptor).

What depends only on what every rank shares (world size, kernel variant, layout) is here too
(:func:`kernel_geometry`), so the host twin cuts streams into exactly the chunks the GPU's copy warps own.
"""
from __future__ import annotations

import functools

__all__ = ["warp_groups", "ring_kernel_defines", "kernel_geometry", "KernelGeometry"]


def warp_groups(world_size: int, max_threads: int = 1024) -> tuple:
    """``(ring_warps, self_warps)``: warps of each peer's group in one channel block, and of the rank's own group.

    A block is ``(world_size - 1) * ring_warps + self_warps`` warps of at most ``max_threads`` threads (the kernel's
    ``__launch_bounds__``, ``SYMBUF_MAX_THREADS``). A ring group is one publisher warp and ``ring_warps - 1`` copy
    warps streaming through that peer's ring; the self group copies the rank's rows to itself straight (half of
    them in the sender block, half in the receiver block), about a third of a ring group's bytes and all local, so
    ring groups are made as large as possible while the self group keeps ``ceil((ring_warps - 1) / 2)`` warps (at
    least 1); warps left over go to the self group (for 2 ranks in 512 threads: 11 ring warps and 5 self warps
    instead of 8 and 8; for some sizes the self group ends up the larger, e.g. 6 ranks: 5 and 7). Every rank
    computes the same split (same ``world_size``, same kernel variant), so sender and receiver cut streams alike.

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
    #: copy workers of one (channel, peer) ring stream: the ring group's warps less the publisher (1 for a
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
