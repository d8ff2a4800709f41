"""Jobs of tests/test_guards.py, one case per run::

    mpiexec -n 2 python tests/faults/guard_cases.py <case> --marker <unique-tag>

* ``typo``: rank 0 calls ``alltoall(x, foo=1)``; rank 1 the valid call. Rank 0 prints ``TYPO TypeError ...``, rank 1
  ``PEER REJECTED rank 0 after S s``; then both make a valid call (checked) and close: ``DONE rank R``.
* ``leak``: every rank makes three communicators at three lines and drops them unclosed, with Python's default
  warning filters: the SymBufferLeakWarning is printed once per process, naming where the first was made;
  ``LIVE``/``DESCRIBE`` lines report ``cupy_symbuf.info()["live_communicators"]`` and ``describe()``; exit closes
  the three (collective, every rank in the same order).
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from mpi4py import MPI  # noqa: E402

import cupy_symbuf as cs  # noqa: E402

WORLD = MPI.COMM_WORLD
R, W = WORLD.Get_rank(), WORLD.Get_size()


def say(*parts) -> None:
    sys.stdout.write(" ".join(str(p) for p in parts) + "\n")
    sys.stdout.flush()


def blocks(rank: int) -> np.ndarray:
    return np.arange(W * 3, dtype=np.float64).reshape(W, 3) + 100 * rank


def typo() -> None:
    c = cs.Communicator(WORLD, backend="host")
    x = blocks(R)
    WORLD.Barrier()
    t0 = time.monotonic()
    try:
        if R == 0:
            c.alltoall(x, foo=1)
        else:
            c.alltoall(x)
        say("NO ERROR rank", R)
    except TypeError as exc:
        say("TYPO TypeError", exc)
    except cs.SymBufferRejectedError as exc:
        say(f"PEER REJECTED rank {exc.rejecting_rank} after {time.monotonic() - t0:.3f} s: {exc}")
    got = c.alltoall(x)
    want = np.stack([blocks(j)[R] for j in range(W)])
    if not np.array_equal(got, want):
        say("WRONG DATA rank", R)
        sys.exit(3)
    c.close()
    say("DONE rank", R)


def make(config):
    return cs.Communicator(WORLD, config, backend="host")


def leak() -> None:
    cfg = cs.Config(num_sms=2, chunk_bytes=4096, num_slots=2)
    a = make(cfg)  # the first one dropped: its creation site is the one the warning names
    b = make(cfg)
    c = cs.Communicator(WORLD, cfg, backend="host")
    keep = c.describe  # nothing keeps the communicators themselves
    del a, b, c, keep
    gc.collect()
    live = cs.info()["live_communicators"]
    say(f"LIVE rank {R} count={live['count']} dropped={live['dropped']} bytes_positive={live['bytes'] > 0} "
        f"at={live['dropped_at']}")
    with cs.Communicator(WORLD, cfg, backend="host") as d:
        text = d.describe()
        n = text.split("(")[-1] if "dropped without close()" in text else text
        say(f"DESCRIBE rank {R} {live['dropped']} dropped without close()" if "3 dropped without close()" in text
            else f"DESCRIBE rank {R} missing: {n}")
    say(f"EXITING rank {R}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("case", choices=("typo", "leak"))
    ap.add_argument("--marker", default="")
    args = ap.parse_args()
    {"typo": typo, "leak": leak}[args.case]()
