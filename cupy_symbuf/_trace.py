"""Channel telemetry (``Config(trace=True)``, host engine): a bounded record of every ring chunk a rank publishes
or consumes, every direct copy, and every idle spell, for :mod:`cupy_symbuf.diagnostics`.

One record per event, in a preallocated NumPy structured array (``TRACE_DTYPE``, ``capacity`` records; when full,
later events are counted in ``dropped`` and not kept). Off (the default), the engine holds ``None`` and pays one
``is not None`` test per chunk.

Fields: ``t0`` / ``t1`` (seconds, ``time.monotonic``: the event's start and end), ``call`` (this rank's row exchange
number), ``op`` (``_protocol.OPS`` code), ``kind`` (``SEND`` a chunk written into a peer's ring, ``RECV`` a chunk
copied out of our ring, ``PULL`` a direct-mode copy out of a peer's memory, ``SELF`` the rank's own rows, ``IDLE``
a spell with nothing to move), ``channel``, ``peer`` (-1 for SELF / IDLE), ``bytes``, ``head`` / ``tail`` (the ring
counters the event saw; for IDLE the number of send streams blocked on ring space and receive streams waiting for
data when it began).
"""
from __future__ import annotations

import time

import numpy as np

__all__ = ["TRACE_DTYPE", "Recorder", "SEND", "RECV", "PULL", "SELF", "IDLE", "KIND_NAMES"]

SEND, RECV, PULL, SELF, IDLE = range(5)
KIND_NAMES = {SEND: "send", RECV: "recv", PULL: "pull", SELF: "self", IDLE: "idle"}

TRACE_DTYPE = np.dtype([("t0", "f8"), ("t1", "f8"), ("call", "i8"), ("op", "i1"), ("kind", "i1"),
                        ("channel", "i2"), ("peer", "i2"), ("bytes", "i8"), ("head", "i8"), ("tail", "i8")])


class Recorder:
    """The bounded event buffer of one rank (see the module docstring)."""

    __slots__ = ("records", "n", "dropped", "call", "op")

    def __init__(self, capacity: int = 1 << 18):
        self.records = np.zeros(capacity, TRACE_DTYPE)
        self.n = 0
        self.dropped = 0
        self.call = 0
        self.op = 0

    def begin(self, op_code: int) -> None:
        """A new row exchange starts."""
        self.call += 1
        self.op = op_code

    def add(self, kind: int, t0: float, channel: int, peer: int, nbytes: int, head: int, tail: int) -> None:
        """One event that began at ``t0`` and ends now."""
        i = self.n
        if i >= len(self.records):
            self.dropped += 1
            return
        self.records[i] = (t0, time.monotonic(), self.call, self.op, kind, channel, peer, nbytes, head, tail)
        self.n = i + 1

    def snapshot(self) -> np.ndarray:
        """A copy of the events kept so far (``TRACE_DTYPE``)."""
        return self.records[: self.n].copy()

    def clear(self) -> None:
        self.n = self.dropped = 0
