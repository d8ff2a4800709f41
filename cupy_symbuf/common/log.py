"""Logging: the ``cupy_symbuf`` logger (standard :mod:`logging`), each line prefixed with the MPI rank.

``CUPY_SYMBUF_LOG_LEVEL`` (``DEBUG``, ``INFO``, ``WARNING`` (default), ``ERROR``) sets its level and, when set, gives it
a stderr handler of its own (``cupy_symbuf[rank R] LEVEL: message``); without it the logger only propagates to
whatever the application configured. Nothing is logged per call on the hot path: construction, allocations,
the cross-memory-attach probe, plan builds.
"""
from __future__ import annotations

import logging
import os
import sys

__all__ = ["logger"]

logger = logging.getLogger("cupy_symbuf")


class _RankFilter(logging.Filter):
    """Puts ``record.rank`` (``MPI.COMM_WORLD`` rank, else torch.distributed's default group rank, or ``-`` before
    either is up) on every record; imports neither mpi4py nor torch."""

    def filter(self, record: logging.LogRecord) -> bool:
        rank = "-"
        try:
            MPI = sys.modules.get("mpi4py.MPI")
            dist = sys.modules.get("torch.distributed")
            if MPI is not None and MPI.Is_initialized() and not MPI.Is_finalized():
                rank = str(MPI.COMM_WORLD.Get_rank())
            elif dist is not None and dist.is_available() and dist.is_initialized():
                rank = str(dist.get_rank())
        except Exception:  # pragma: no cover - logging must never fail the caller
            pass
        record.rank = rank
        return True


def _configure() -> None:
    logger.addFilter(_RankFilter())
    level = os.environ.get("CUPY_SYMBUF_LOG_LEVEL", "").strip().upper()
    if not level:
        return
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise ValueError(f"environment variable CUPY_SYMBUF_LOG_LEVEL must be DEBUG, INFO, WARNING, ERROR or "
                         f"CRITICAL, got {level!r}")
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("cupy_symbuf[rank %(rank)s] %(levelname)s: %(message)s"))
    handler.addFilter(_RankFilter())
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False


_configure()
