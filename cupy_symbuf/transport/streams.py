"""Streams and the async form of the collectives: ``stream=`` and ``async_op=`` of every :class:`Communicator`
collective.

Three pieces, used by ``communicator.py`` (every collective) and ``deepep.py`` (the DeepEP shim):

- :func:`resolve_stream`: the ``stream`` argument as a CuPy stream (a ``cupy.cuda.Stream``/``ExternalStream`` as
  is; a ``torch.cuda.Stream`` or anything with an integer ``.cuda_stream`` or ``.ptr`` wrapped in
  ``cupy.cuda.ExternalStream``), ``None`` for the current stream.
- :class:`CollectiveEvent`: the handle an ``async_op=True`` call returns, after DeepEP's ``EventOverlap``
  (``deep_ep/utils/event.py``: ``current_stream_wait()``, context manager) and ``torch.distributed``'s ``Work``
  (``wait()``, ``is_completed()`` here ``query()``, ``synchronize()``).
- :func:`run_collective`: what a collective method does when either keyword is used: check both keywords (a
  rejection is told to the peers, like any argument check), run the collective with the stream current
  (``with stream:``, so its outputs come from that stream's memory pool and its kernels queue there), and wrap the
  result in a :class:`CollectiveEvent` when asked.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from ..common import backend as _compat

__all__ = ["CollectiveEvent", "resolve_stream", "check_flag", "run_collective", "reject_call"]


def _what(x) -> str:
    return f"{type(x).__module__}.{type(x).__qualname__}"


def resolve_stream(op: str, stream, backend: str, *, name: str = "stream"):
    """The ``stream`` argument of ``op`` as a CuPy stream, or None (= the current CuPy stream).

    Accepted on the cuda backend: None; a ``cupy.cuda.Stream`` or ``cupy.cuda.ExternalStream`` (returned as is);
    any object with an integer ``cuda_stream`` attribute (``torch.cuda.Stream``) or ``ptr`` attribute (a raw
    ``cudaStream_t``), wrapped in ``cupy.cuda.ExternalStream`` on its ``device_index``/``device_id`` (or the
    current device). On the host backend only None is accepted (its collectives complete before returning; there
    is no stream to run on).

    Raises
    ------
    TypeError
        Naming ``op`` and the argument: a stream on the host backend; an object that is neither a stream nor has an
        integer ``cuda_stream``/``ptr``; a stream of another GPU than the current device.
    """
    if stream is None:
        return None
    if backend != "cuda":
        raise TypeError(f"{op}: argument '{name}' must be None on the host backend (its collectives complete "
                        f"before returning; there are no streams), got {_what(stream)}")
    cp = _compat.cupy
    base = cp.cuda.stream._BaseStream
    if isinstance(stream, base):
        s, dev = stream, getattr(stream, "device_id", -1)
    else:
        ptr = getattr(stream, "cuda_stream", None)
        if ptr is None:
            ptr = getattr(stream, "ptr", None)
        if isinstance(ptr, (bool, np.bool_)) or not isinstance(ptr, (int, np.integer)) or int(ptr) < 0:
            raise TypeError(f"{op}: argument '{name}' must be None, a cupy.cuda.Stream, a torch.cuda.Stream or an "
                            f"object with an integer 'cuda_stream' or 'ptr' (a cudaStream_t), got {_what(stream)}"
                            + (" (for a raw handle use cupy.cuda.ExternalStream(ptr))"
                               if isinstance(stream, (int, np.integer)) else ""))
        dev = getattr(stream, "device_index", None)
        if dev is None:
            dev = getattr(getattr(stream, "device", None), "index", None)
        if dev is None:
            dev = getattr(stream, "device_id", -1)
        dev = -1 if dev is None else int(dev)
        s = None
    here = cp.cuda.Device().id
    if dev is not None and int(dev) >= 0 and int(dev) != here:
        raise TypeError(f"{op}: argument '{name}' is a stream of GPU {dev} but this communicator uses GPU {here}")
    if s is None:
        s = cp.cuda.ExternalStream(int(ptr), here)
    return s


def check_flag(op: str, name: str, value) -> bool:
    """``value`` as a bool; ``TypeError`` naming ``op`` and the argument for anything but ``bool``/``numpy.bool_``."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{op}: argument '{name}' must be a bool, got {_what(value)}")
    return bool(value)


def reject_call(comm, op: str, notify: Optional[bool]) -> None:
    """Tell the peers this rank rejected ``op`` before its first step (``notify``: its first step is a count
    exchange; None: ``op`` does not communicate, nothing to tell). The caller re-raises its own error."""
    if notify is not None:
        comm.engine.reject(op, notify)  # nothing to tell once the communicator is closed or broken


class CollectiveEvent:
    """Completion handle of a collective called with ``async_op=True`` (or a point recorded on a stream).

    Designed after DeepEP's ``EventOverlap`` (``deep_ep/utils/event.py``: ``current_stream_wait()``, use as a
    context manager) and ``torch.distributed``'s ``Work`` (``wait()``, ``is_completed()``, ``synchronize()``).
    On the GPU the collective was queued on :attr:`stream` and a CUDA event recorded behind it; nothing here
    blocks the host except :meth:`synchronize`. On the host backend the collective completed before the call
    returned and the event is complete from the start.

    Until :meth:`wait`, :meth:`current_stream_wait` or :meth:`synchronize` the handle also keeps the call's
    arguments referenced (DeepEP's ``extra_tensors``, standing in for ``record_stream``): their memory is not
    handed back to a pool before the stream that waits is ordered after the collective.

    Attributes
    ----------
    result
        The collective's normal return value (e.g. ``(recv, recv_counts)`` of ``alltoallv``). On the GPU its
        arrays are valid in the order of :attr:`stream`, or of any stream after :meth:`wait`.
    stream : cupy.cuda.Stream or None
        The stream the collective ran on (None on the host backend).
    event : cupy.cuda.Event or None
        Recorded on :attr:`stream` after the collective (None on the host backend).
    """

    def __init__(self, result: Any = None, *, event=None, stream=None, communicator=None, keep=()):
        self._result = result
        self._event = event
        self._stream = stream
        self._comm = communicator
        self._keep = keep
        self._backend = "cuda" if event is not None else "host"

    @classmethod
    def record(cls, stream=None, *, communicator=None) -> "CollectiveEvent":
        """A handle for the work queued so far on ``stream`` (default: the current CuPy stream; any stream form
        :func:`resolve_stream` accepts). Needs CuPy and a GPU."""
        cp = _compat.cupy
        if cp is None:
            raise TypeError("CollectiveEvent.record: needs CuPy and a GPU (the host backend has no streams)")
        s = resolve_stream("CollectiveEvent.record", stream, "cuda") or cp.cuda.get_current_stream()
        ev = cp.cuda.Event(disable_timing=True)
        ev.record(s)
        return cls(None, event=ev, stream=s, communicator=communicator)

    @property
    def result(self):
        """What the collective returns (its outputs; ready in the order of :attr:`stream`)."""
        return self._result

    @property
    def event(self):
        """The ``cupy.cuda.Event`` recorded after the collective (None on the host backend)."""
        return self._event

    @property
    def stream(self):
        """The stream the collective was queued on (None on the host backend)."""
        return self._stream

    def query(self) -> bool:
        """True when the collective has completed on the device (never blocks; always True on the host)."""
        return True if self._event is None else bool(self._event.done)

    is_completed = query  # torch.distributed.Work's name

    def wait(self, stream=None):
        """Make ``stream`` (default: the current CuPy stream) wait for the collective; returns :attr:`result`.

        Queues a wait on the device (``cudaStreamWaitEvent``) and returns at once: the host does not block, and
        an error the collective's kernels record is raised later by :meth:`synchronize` (or by any later
        collective / ``Communicator.synchronize``). ``stream`` takes any form :func:`resolve_stream` accepts
        (``torch.cuda.current_stream()`` for PyTorch code). On the host backend a no-op (``stream`` must be None).

        Raises
        ------
        TypeError
            ``stream`` not a stream (see :func:`resolve_stream`).
        """
        s = resolve_stream("CollectiveEvent.wait", stream, self._backend)
        if self._event is not None:
            if s is None:
                s = _compat.cupy.cuda.get_current_stream()
            s.wait_event(self._event)
        self._keep = ()
        return self._result

    def current_stream_wait(self) -> None:
        """The current CuPy stream waits for the collective (DeepEP's ``EventOverlap.current_stream_wait``)."""
        self.wait(None)

    def synchronize(self):
        """Block the host until the collective completed, then raise any error the transport recorded (through
        ``Communicator.synchronize``: timeouts, mismatches, aborts, a peer's rejection); returns :attr:`result`.

        Raises
        ------
        SymBufferTimeoutError, SymBufferMismatchError, SymBufferAbortedError, SymBufferRejectedError
            As ``Communicator.synchronize``.
        """
        if self._event is not None:
            self._event.synchronize()
        self._keep = ()
        comm = self._comm
        if comm is not None and not comm.closed:
            comm.synchronize()
        return self._result

    def __enter__(self) -> "CollectiveEvent":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """Leaving the ``with`` block, the current CuPy stream waits for the collective (work queued inside the
        block overlaps with it)."""
        self.current_stream_wait()

    def __repr__(self) -> str:
        state = "complete" if self._event is None else ("done" if self._event.done else "queued")
        return f"CollectiveEvent({state}, stream={getattr(self._stream, 'ptr', None)})"


def run_collective(comm, op: str, notify: Optional[bool], fn, args=(), kwargs=None, *, stream=None,
                   async_op=False):
    """Run the collective ``fn(*args, **kwargs)`` of ``comm`` with ``stream`` current; with ``async_op`` return
    a :class:`CollectiveEvent` around its result, else the result.

    ``notify`` says how a rejection of the two keywords is told to the peers (see :func:`reject_call`): a bad
    ``stream``/``async_op`` is a ``TypeError`` on this rank, :class:`~cupy_symbuf.SymBufferRejectedError` on the
    peers, and the communicator stays usable.
    """
    comm.engine.check_open()
    try:
        s = resolve_stream(op, stream, comm.backend)
        async_op = check_flag(op, "async_op", async_op)
    except BaseException:
        reject_call(comm, op, notify)
        raise
    kwargs = kwargs or {}
    if comm.backend != "cuda":
        out = fn(*args, **kwargs)
        return CollectiveEvent(out, communicator=comm) if async_op else out
    cp = _compat.cupy
    if s is None:
        s = cp.cuda.get_current_stream()
    with s:
        out = fn(*args, **kwargs)
    if not async_op:
        return out
    ev = cp.cuda.Event(disable_timing=True)
    ev.record(s)
    return CollectiveEvent(out, event=ev, stream=s, communicator=comm, keep=(args, kwargs))
