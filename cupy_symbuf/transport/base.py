"""The transport interface: what the engine (and through ``Engine.transport`` the layers above) calls on the row
mover of one communicator.

:class:`Transport` is what both engines implement: :class:`~cupy_symbuf.transport.host.HostTransport` (NumPy over
an MPI shared-memory window, progress driven by the calling thread) and
:class:`~cupy_symbuf.transport.cuda.CudaTransport` (one kernel launch per step on the current CuPy stream).
:class:`DeviceTransport` adds what only the GPU engine offers: device-count calls whose counts never reach the
host, the symmetric table, the device load counters, the error record of queued kernels. Each class declares what
it implements with :func:`implements`, which checks the methods and their parameters when the class is defined.

Attributes every transport has (set by its constructor): ``rank``, ``world_size``, ``layout``
(:class:`~cupy_symbuf.wire.channel_layout.ChannelLayout`), ``timeout_s`` (seconds), ``heap`` (the communicator's
:class:`~cupy_symbuf.transport.symmetric.SymmetricHeap`, set after construction), ``trace`` (the channel
telemetry recorder, or None).
"""
from __future__ import annotations

import inspect
from typing import Optional, Protocol, runtime_checkable

import numpy as np

__all__ = ["Transport", "DeviceTransport", "implements"]


@runtime_checkable
class Transport(Protocol):
    """One communicator's row mover over its symmetric buffer (both backends)."""

    def exchange_rows(self, plan, send_parts, send_index, recv_parts, op: str, direct=None, *, tag: int = 0,
                      **kwargs) -> list:
        """Run one call of ``plan`` (:class:`~cupy_symbuf.wire.plan.ExchangePlan`): every (channel, peer) run
        sends its call header and chunks of the rows of ``send_parts`` (gathered through ``send_index`` when
        given) and receives the peer's into ``recv_parts``. ``direct``: this rank's send mode (see
        :meth:`~cupy_symbuf.transport.engine.Engine.direct_source`). ``tag``: folded into the signature the
        headers carry and the receivers check (:func:`~cupy_symbuf.wire.protocol.call_signature`; the id of the
        dispatch whose handle the call uses, 0: none), so peers with different tags fail the call. Returns the
        ranks that rejected the call (empty: none; the GPU's queued calls report them from :meth:`synchronize`).
        Engine-specific keywords: ``relaxed`` (host), ``counts`` / ``push`` (GPU)."""
        ...

    def notify(self, send_meta: np.ndarray, epoch: int, op: str = "notify", *, op_code: int = 0, status: int = 0,
               sig: int = 0, wait: bool = True) -> Optional[np.ndarray]:
        """Count exchange: ``send_meta`` int64 ``[world_size, M]`` (row ``p`` to rank ``p``); returns int64
        ``[world_size, 3 + M]`` whose row ``s`` is rank ``s``'s ``[op, status, signature, values...]`` (None when
        ``wait`` is False on the GPU: a rejection told to the peers)."""
        ...

    def set_abort(self, reason: int, peer: int = -1, channel: int = -1, detail: int = 0) -> None:
        """Write this rank's abort (``wire.protocol.ERR_*`` ``reason``) into every rank's abort line: every wait of
        every rank leaves with :class:`~cupy_symbuf.SymBufferAbortedError` naming this rank."""
        ...

    def check_abort(self, op: str) -> None:
        """Raise :class:`~cupy_symbuf.SymBufferAbortedError` when this rank's abort line is set."""
        ...

    def peers_waiting(self) -> list:
        """The peers that have begun a call this rank never joined (sorted; one look at this rank's buffer, no
        waiting): their first words of that call (count exchange slot or channel-0 call header, on the GPU also a
        small-protocol header) are in this rank's buffer. Meaningful once this rank makes no more calls (its
        exit-time close): a peer still finishing a call this rank completed is never named."""
        ...

    def set_home(self, load) -> None:
        """Adaptive channels: take the home map of ``load`` (:class:`~cupy_symbuf.transport.adaptive.ChannelLoad`)."""
        ...

    def synchronize(self, op: str = "synchronize") -> None:
        """Wait for what this rank still owes or has queued (GPU: its launches; host: the peers' copies out of the
        sendbufs of earlier ``sync="relaxed"`` calls) and raise an error recorded meanwhile."""
        ...

    def close(self):
        """Release the transport's own resources (not the symmetric buffer); return an error recorded but never
        raised (a queued GPU call's), or None."""
        ...


@runtime_checkable
class DeviceTransport(Transport, Protocol):
    """What the GPU engine adds: device-count calls, the symmetric table, device load counters, queued errors.

    Attribute ``status``: the :class:`~cupy_symbuf.transport.status.DeviceStatus` (the one error record and launch
    ledger) that every kernel of the communicator writes and is numbered by, the low-latency kernels too."""

    def notify_device(self, send_meta_ptr: int, M: int, op: str, *, op_code: int, status: int, sig: int,
                      local_reject: int = 0, echo: bool = False, sums: int = 0, table: int = 0, scale: int = 1,
                      capacity: int = -1, device_checks: bool = False) -> None:
        """Queue the count exchange of device values (addresses as ints) and return at once."""
        ...

    def notify_result(self, op: str, M: int) -> np.ndarray:
        """Wait for the last queued count exchange; int64 ``[world_size, 3 + M]``."""
        ...

    def prepare(self, plan, send_parts, recv_parts):
        """The launch of a row exchange of ``plan`` for these parts' row strides, kept for :meth:`launch_prepared`."""
        ...

    def launch_prepared(self, op: str, plan, launch, send_ptrs, recv_ptrs, index_ptr, counts: int, tag: int,
                        stream) -> list:
        """The row exchange of a prepared launch with the parts by address (a repeated call of one shape)."""
        ...

    def exchange_small(self, plan, x, recv) -> list:
        """One ``alltoall`` by the small-message protocol (flag in data; at most ``small_peer_bytes`` per peer,
        attribute ``small_peer_bytes``, 0: off); returns the ranks that rejected it when it waited (``blocking``)."""
        ...

    def repeat_prepare(self, op: str, plan, launch, index_ptr, counts: int, tag: int):
        """A prepared launch with a descriptor of its own holding the words a caller's repeated calls share (index,
        counts table, tag), or None where there is nothing to launch; run by :meth:`fire_repeat`."""
        ...

    def fire_repeat(self, r, ptrs, stream) -> list:
        """:meth:`launch_prepared` of a :meth:`repeat_prepare` launch with the parts' addresses ``ptrs``."""
        ...

    def small_prepare(self, plan, nbytes: int) -> tuple:
        """What :meth:`exchange_small` of ``plan`` for ``nbytes`` of sendbuf hands its kernel besides addresses."""
        ...

    def fire_small(self, prepared: tuple, send_ptr: int, recv_ptr: int, stream) -> list:
        """:meth:`exchange_small` of a C-contiguous sendbuf by address, with its :meth:`small_prepare`."""
        ...

    def sent_meta(self, M: int) -> np.ndarray:
        """int64 ``[world_size, M]``: what the last echoed count exchange sent."""
        ...

    def check(self, op: str, stream=None) -> None:
        """Raise the error a queued kernel recorded, if any (with ``stream``: wait for it first)."""
        ...

    def check_layout_error(self, op: str) -> None:
        """Raise ``ValueError`` (once) for out-of-range ``topk_idx`` values a queued layout kernel found."""
        ...

    def sym_register(self, seg) -> bool:
        """Enter a symmetric segment (``SymmetricSegment``) in the device table; False when the table is full."""
        ...

    def sym_unregister(self, seg) -> None:
        """Remove a symmetric segment from the device table."""
        ...

    def load_snapshot(self):
        """The device load counters as of about one adaptive interval ago (None while the first copy is on its
        way)."""
        ...

    def load_totals(self) -> np.ndarray:
        """The device load counters now (waits for the queued kernels)."""
        ...

    def load_reset(self) -> None:
        """Zero the device load counters."""
        ...


def _members(protocol) -> list:
    """The methods ``protocol`` declares, its bases' included (not ``object``'s or ``Protocol``'s)."""
    names = []
    for klass in protocol.__mro__:
        if klass in (object, Protocol) or klass.__module__ == "typing":
            continue
        names += [n for n, v in vars(klass).items() if callable(v) and not n.startswith("_") and n not in names]
    return names


def _accepts(impl, spec) -> Optional[str]:
    """None when ``impl`` can be called every way ``spec`` can (by name, with its defaults), else why not."""
    try:
        have = inspect.signature(impl).parameters
        want = inspect.signature(spec).parameters
    except (TypeError, ValueError):  # pragma: no cover - a builtin: nothing to compare
        return None
    var_kw = any(p.kind is p.VAR_KEYWORD for p in have.values())
    for name, p in want.items():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        q = have.get(name)
        if q is None:
            if not var_kw:
                return f"has no parameter {name!r}"
            continue
        if p.default is not p.empty and q.default is q.empty:
            return f"parameter {name!r} needs a default"
        if p.kind is p.KEYWORD_ONLY and q.kind is q.POSITIONAL_ONLY:
            return f"parameter {name!r} must be accepted by keyword"
    extra = [n for n, q in have.items() if n not in want and q.default is q.empty and
             q.kind not in (q.VAR_POSITIONAL, q.VAR_KEYWORD)]
    if extra:
        return f"requires parameters the interface does not pass: {extra}"
    return None


def implements(*protocols):
    """Class decorator: declare that the class implements ``protocols`` (:class:`Transport`, ...). Checked when the
    class is defined: every method of each protocol must exist and accept the protocol's parameters (``TypeError``
    naming the class, the method and the rule otherwise). The class keeps the list as ``__implements__``."""
    def check(cls):
        problems = []
        for proto in protocols:
            for name in _members(proto):
                impl = getattr(cls, name, None)
                if not callable(impl):
                    problems.append(f"{name}: missing")
                    continue
                why = _accepts(impl, getattr(proto, name))
                if why:
                    problems.append(f"{name}: {why}")
        if problems:
            raise TypeError(f"{cls.__name__} does not implement {', '.join(p.__name__ for p in protocols)}: "
                            + "; ".join(problems))
        cls.__implements__ = tuple(protocols)
        return cls
    return check
