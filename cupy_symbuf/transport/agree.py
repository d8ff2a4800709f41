"""Agreement between ranks at construction and ``close()``: the exchanges that must never hang, and the wire
fingerprint every rank compares before anything is allocated.

:func:`exchange_all` (an allgather of one picklable object per rank), :func:`barrier` and
:func:`discard_leftovers` run on a :class:`~cupy_symbuf.transport.bootstrap.Bootstrap` (an mpi4py communicator is
taken as its :class:`~cupy_symbuf.transport.bootstrap.MpiBootstrap`): bounded by ``timeout_s``, a peer that never
arrives gives a :class:`CollectiveTimeoutError` naming it.

:func:`fingerprint` lists everything that shapes the wire (resolved ``Config``, layout, backend, kernel variant and
warp split, compile-time defines, package and protocol version); :func:`check_agreement` compares every rank's
fingerprint and raises ``ValueError`` naming the field, the values and the ranks, alike on every rank.
"""
from __future__ import annotations

import os
from typing import Any

from .bootstrap import TAG, CollectiveTimeoutError, as_bootstrap  # noqa: F401 (TAG: the exchanges' tag)

__all__ = ["CollectiveTimeoutError", "exchange_all", "barrier", "discard_leftovers", "fingerprint", "check_agreement",
           "raise_if_any_failed", "LOCAL_POLICY_FIELDS"]

#: Config fields that are local policy: ranks may differ on them without changing the wire.
LOCAL_POLICY_FIELDS = ("timeout_s", "blocking", "abort_on_failure", "mode", "trace", "adaptive", "adaptive_interval")


def exchange_all(group, obj: Any, timeout_s: float, what: str, *, role: str = "construction",
                 on_slow=None) -> list:
    """Every rank's ``obj`` (a list indexed by rank), like an allgather but bounded by ``timeout_s``: the
    :meth:`~cupy_symbuf.transport.bootstrap.Bootstrap.allgather` of ``group`` (a Bootstrap or an mpi4py
    communicator). Raises :class:`CollectiveTimeoutError` naming the ranks that never arrived, and
    :class:`~cupy_symbuf.SymBufferError` when a peer's message of this exchange belongs to another step (``what``
    differs: ranks calling different steps; a message of an earlier exchange that timed out is never taken for
    this one, see :class:`~cupy_symbuf.transport.bootstrap.Bootstrap`).
    ``on_slow``: ``(seconds, fn)``: ``fn(missing_ranks)`` is called once when the wait takes longer than that."""
    return as_bootstrap(group).allgather(obj, timeout_s, what, role=role, on_slow=on_slow)


def barrier(group, timeout_s: float, what: str, *, role: str = "close", on_slow=None) -> None:
    """A barrier of ``group`` (a Bootstrap or an mpi4py communicator) bounded by ``timeout_s``
    (:class:`CollectiveTimeoutError` names the missing ranks)."""
    as_bootstrap(group).barrier(timeout_s, what, role=role, on_slow=on_slow)


def discard_leftovers(group) -> int:
    """Receive and drop every message of ours already queued on ``group`` (leftovers of exchanges that timed out);
    returns how many. Call it on every rank, after a barrier, before freeing a communicator that saw a timeout:
    MPI may hand a freed communicator's unreceived messages to a later one."""
    return as_bootstrap(group).discard_leftovers()


def raise_if_any_failed(verdicts: list, where: str, exc_type=ValueError) -> None:
    """``verdicts[r]`` is ``None`` or rank ``r``'s error text (a local check failed there): raise on every rank, alike,
    naming the first failing rank."""
    for r, v in enumerate(verdicts):
        if v is not None:
            raise exc_type(f"{where}: rank {r}: {v}")


# ---- construction fingerprint ------------------------------------------------------------------------------

def fingerprint(config, layout, backend: str) -> dict:
    """Everything that shapes the wire, as ``{field: value}`` (plain, comparable values), in a fixed order."""
    import dataclasses

    from ..common.version import __version__
    from . import kernels as _kernels
    from ..wire import plan as _plan
    from ..wire import protocol as _protocol
    fp: dict = {}
    for f in dataclasses.fields(config):
        if f.name not in LOCAL_POLICY_FIELDS:
            fp[f"config.{f.name}"] = getattr(config, f.name)
    fp["config.copy_engine"] = getattr(config, "mode", "auto") == "copy_engine"  # a CE call needs every rank in it
    for name in ("world_size", "num_channels", "num_slots", "chunk_bytes", "max_notify_ints", "total_bytes"):
        fp[f"layout.{name}"] = getattr(layout, name)
    fp["backend"] = backend
    try:
        geo = _plan.kernel_geometry(layout.world_size)
        for name in ("max_threads", "ring_warps", "self_warps", "num_copy", "threads"):
            fp[f"kernel.{name}"] = getattr(geo, name)
    except ValueError as exc:  # world too large for the GPU kernel: the same on every rank of this size
        fp["kernel"] = f"n/a ({exc})"
    fp["defines"] = " ".join(_kernels._tuning_defines())  # as this process compiles (read once)
    if hasattr(_kernels, "_debug_defines"):
        fp["debug"] = " ".join(_kernels._debug_defines())
    else:  # pragma: no cover
        fp["debug"] = os.environ.get("CUPY_SYMBUF_DEBUG", "")
    if backend == "cuda" and hasattr(_kernels, "build_id"):
        fp["kernel.build_id"] = _kernels.build_id("ring_exchange.cu", _plan.ring_kernel_defines(layout.world_size))
    fp["package_version"] = __version__
    fp["protocol_version"] = _protocol.PROTOCOL_VERSION
    return fp


def check_agreement(fingerprints: list, where: str) -> None:
    """Raise ``ValueError`` (the same text on every rank) naming the first field where ranks differ, the values and
    the ranks holding each."""
    base = fingerprints[0]
    keys = list(base)
    for fp in fingerprints[1:]:
        keys += [k for k in fp if k not in keys]
    for key in keys:
        values = [fp.get(key, "<missing>") for fp in fingerprints]
        if any(v != values[0] for v in values):
            groups: dict = {}
            for r, v in enumerate(values):
                groups.setdefault(repr(v), []).append(r)
            parts = []
            for v, ranks in groups.items():
                who = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ",".join(map(str, ranks))
                parts.append(f"{who} {'has' if len(ranks) == 1 else 'have'} {v}")
            raise ValueError(f"{where}: ranks disagree on {key}: " + ", ".join(parts) +
                             " (every field that shapes the wire must be the same on every rank)")
