"""Exceptions raised by cupy_symbuf."""
from __future__ import annotations

__all__ = ["SymBufferError", "SymBufferTimeoutError", "SymBufferClosedError"]


class SymBufferError(RuntimeError):
    """Base class of cupy_symbuf runtime errors (not argument errors, which are ValueError/TypeError)."""


class SymBufferClosedError(SymBufferError):
    """A SymBuffer or Communicator was used after ``close()``."""


class SymBufferTimeoutError(SymBufferError):
    """A spin-wait on a channel ring (or the notify step) exceeded ``Config.timeout_s``.

    Attributes ``rank``, ``peer``, ``channel``, ``role`` ("send", "recv" or "notify"), ``head`` and ``tail``
    (ring counters in chunks; for notify, ``head`` is the epoch awaited and ``tail`` the epoch seen) say which
    wait expired. The ring counters of this communicator (and of its peers) are then inconsistent: it refuses
    further calls; close it on every rank and build a new Communicator.
    """

    def __init__(self, *, rank: int, peer: int, channel: int, role: str, head: int, tail: int,
                 timeout_s: float, op: str = ""):
        self.rank, self.peer, self.channel, self.role = rank, peer, channel, role
        self.head, self.tail, self.timeout_s, self.op = head, tail, timeout_s, op
        what = {"send": "sender waiting for ring space (tail - head == capacity)",
                "recv": "receiver waiting for data (tail == head)",
                "notify": "notify waiting for the peer's count (head = epoch awaited, tail = epoch seen)"}
        what = what.get(role, role)
        super().__init__(
            f"{op + ': ' if op else ''}timeout after {timeout_s:g} s on rank {rank}, peer {peer}, channel {channel}: "
            f"{what}; head={head} tail={tail}. A peer rank probably failed or is not calling the same collective (or "
            f"recv_counts given to alltoallv differ from what the peers send).")
