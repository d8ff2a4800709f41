"""cProfile for the benchmarks' ``--profile``: ``n`` calls of a function profiled (:func:`profile_calls`) and the
functions with the most own time, per call (:func:`top_functions`). Used by the driver (alltoall), ``--control``
and ``--op latency``; each prints the rows in its own table."""
from __future__ import annotations

import cProfile
import pstats
from typing import Callable, List, Optional, Tuple

__all__ = ["profile_calls", "top_functions"]


def profile_calls(fn: Callable[[], object], n: int, done: Optional[Callable[[], object]] = None) -> pstats.Stats:
    """cProfile's statistics of ``n`` calls of ``fn``; ``done`` (e.g. ``Communicator.synchronize``) is called once
    after the last, inside the profile."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        fn()
    if done is not None:
        done()
    prof.disable()
    return pstats.Stats(prof)


def top_functions(stats: pstats.Stats, n: int, most: int) -> List[Tuple[float, float, float, str]]:
    """The ``most`` functions with the most own time in ``stats`` of ``n`` calls, most first: ``(self_us,
    total_us, calls, where)`` per call (``where``: ``"file.py:line(name)"``)."""
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:most]
    return [(tottime * 1e6 / n, cumtime * 1e6 / n, ncalls / n, f"{path.split('/')[-1]}:{line}({name})")
            for (path, line, name), (_, ncalls, tottime, cumtime, _) in rows]
