"""Channel telemetry (``Config(trace=True)``; host engine: :class:`Recorder`, GPU kernels: :class:`DeviceRecorder`): a bounded record of every ring chunk a rank publishes
or consumes, every direct copy, and every idle spell, for :mod:`cupy_symbuf.diagnostics`.

One record per event, in a preallocated NumPy structured array (``TRACE_DTYPE``, ``capacity`` records; when full,
later events are counted in ``dropped`` and not kept). Off (the default), the engine holds ``None`` and pays one
``is not None`` test per chunk.

Fields: ``t0`` / ``t1`` (seconds, ``time.monotonic``: the event's start and end), ``call`` (this rank's row exchange
number), ``op`` (``protocol.OPS`` code), ``kind`` (``SEND`` a chunk written into a peer's ring, ``RECV`` a chunk
copied out of our ring, ``PULL`` a direct-mode copy out of a peer's memory, ``SELF`` the rank's own rows, ``IDLE``
a spell with nothing to move), ``channel``, ``peer`` (-1 for SELF / IDLE), ``bytes``, ``head`` / ``tail`` (the ring
counters the event saw; for IDLE the number of send runs blocked on ring space and receive runs waiting for
data when it began).
"""
from __future__ import annotations

import time

import numpy as np

from ..wire import protocol as P

__all__ = ["TRACE_DTYPE", "Recorder", "DeviceRecorder", "SEND", "RECV", "PULL", "SELF", "IDLE", "KIND_NAMES"]

SEND, RECV, PULL, SELF, IDLE = P.TRACE_SEND, P.TRACE_RECV, P.TRACE_PULL, P.TRACE_SELF, P.TRACE_IDLE
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


class DeviceRecorder:
    """The GPU form of :class:`Recorder`: the ring kernel (built with ``SYMBUF_TRACE=1``) appends one record per ring
    chunk sent (``SEND``, also a chunk pushed into a peer's outputs) or received (``RECV``), per direct-mode slice
    copied out of a peer's block (``PULL``) and per warp's share of a rank's own rows (``SELF``) into a device buffer
    (``protocol.DESC_TRACE``: an atomic counter, then ``TRACE_WORDS`` int64 words per record); no ``IDLE`` records.
    Times are ``%globaltimer`` nanoseconds, one clock for every rank on a GPU, given in seconds; ``t0`` is taken
    before the event's wait for ring space / data, so ``t1 - t0`` includes it. ``call`` is the kernel's launch
    number. Records are in the order the kernels claimed their slots (sorted by ``t1`` on reading)."""

    __slots__ = ("buffer", "capacity")

    def __init__(self, capacity: int = 1 << 18):
        from ..common import backend as _compat
        self.capacity = int(capacity)
        self.buffer = _compat.cupy.zeros(P.TRACE_HDR_WORDS + P.TRACE_WORDS * self.capacity, np.int64)

    @property
    def ptr(self) -> int:
        return int(self.buffer.data.ptr)

    def _count(self) -> int:
        return int(self.buffer[0].get())

    @property
    def dropped(self) -> int:
        return max(0, self._count() - self.capacity)

    def snapshot(self) -> np.ndarray:
        """A copy of the events kept so far (``TRACE_DTYPE``); waits for the device."""
        from ..common import backend as _compat
        _compat.cupy.cuda.Device().synchronize()
        n = min(self._count(), self.capacity)
        raw = self.buffer[P.TRACE_HDR_WORDS: P.TRACE_HDR_WORDS + n * P.TRACE_WORDS].get().reshape(n, P.TRACE_WORDS)
        out = np.zeros(n, TRACE_DTYPE)
        out["t0"], out["t1"] = raw[:, 0] * 1e-9, raw[:, 1] * 1e-9
        out["call"] = raw[:, 2]
        packed = raw[:, 3]
        out["op"], out["kind"] = packed & 0xFF, (packed >> 8) & 0xFF
        out["channel"], out["peer"] = (packed >> 16) & 0xFFFF, ((packed >> 32) & 0xFFFF) - 1
        out["bytes"], out["head"], out["tail"] = raw[:, 4], raw[:, 5], raw[:, 6]
        return out[np.argsort(out["t1"], kind="stable")]

    def clear(self) -> None:
        from ..common import backend as _compat
        _compat.cupy.cuda.Device().synchronize()
        self.buffer[0] = 0
