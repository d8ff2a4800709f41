"""Jobs for tests/test_leaving.py: a rank's program ends (``sys.exit`` or the end of its script) with a
communicator open outside any ``with`` block. Run as ``mpiexec -n N python tests/leaving_cases.py CASE``.

``sys_exit`` / ``end``: after a right alltoall, rank 1 leaves by ``sys.exit(0)`` / by the end of its script
(``sys_exit_with``: ``sys.exit(0)`` inside ``with``, every rank's communicator in a ``with`` block); the other ranks enter an alltoall 0.3 s later and must raise ``SymBufferAbortedError`` naming rank 1 (each prints
``RAISED rank=R after=SECONDS aborting=A cls=NAME``), then close it (``CLOSED rank=R took=SECONDS``; with
``CUPY_SYMBUF_ABORT_ON_FAILURE=1`` the error is left uncaught instead, and the job ends).

``late``: every rank makes a right alltoall and ends with the communicator open; rank 1 ends 2.5 s after the others
(longer than ``lifecycle.EXIT_GRACE_S``): every rank's exit-time close must still be clean (exit status 0). Each
rank prints ``DONE rank=R`` before it ends.

``CUPY_SYMBUF_FAULT_BACKEND=cuda`` runs them on the GPU (as the fault cases).
"""
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from mpi4py import MPI  # noqa: E402

import cupy_symbuf as cs  # noqa: E402

WORLD = MPI.COMM_WORLD
R, W = WORLD.Get_rank(), WORLD.Get_size()
HANDLED = os.environ.get("CUPY_SYMBUF_ABORT_ON_FAILURE", "1") == "0"
BACKEND = os.environ.get("CUPY_SYMBUF_FAULT_BACKEND", "host")
OPEN = []  # the script's communicators, open when it ends


def make_comm():
    if BACKEND == "cuda":
        from cupy_symbuf.utils import select_device
        select_device(WORLD)
    c = cs.Communicator(WORLD, backend=BACKEND)
    OPEN.append(c)
    return c


def dev(a: np.ndarray):
    if BACKEND == "cuda":
        import cupy
        return cupy.asarray(a)
    return a


def host(a) -> np.ndarray:
    return a.get() if hasattr(a, "get") else np.asarray(a)


def say(line: str) -> None:
    print(f"{line}", flush=True)


def right_alltoall(c, seed: int) -> None:
    x = np.random.default_rng(seed * 100 + R).standard_normal((W, 4)).astype(np.float32)
    y = host(c.alltoall(dev(x)))
    want = np.stack(WORLD.allgather(x))[:, R]
    if not np.array_equal(y, want):
        say(f"WRONG DATA rank={R}")
        sys.stdout.flush()
        os._exit(3)


def leaver(case: str) -> None:
    c = make_comm()
    if case == "sys_exit_with":
        with c:
            leaver_body(c, case)
    else:
        leaver_body(c, case)


def leaver_body(c, case: str) -> None:
    right_alltoall(c, 1)
    WORLD.Barrier()
    if R == 1:
        say(f"LEAVING rank={R} t={time.time():.3f}")
        if case.startswith("sys_exit"):
            sys.exit(0)
        return  # the end of the script, the communicator open
    time.sleep(0.3)
    t0 = time.time()
    try:
        c.alltoall(dev(np.zeros((W, 4), np.float32)))
        if BACKEND == "cuda":
            c.synchronize()  # (a queued GPU call reports its abort here, unless Config.blocking)
    except cs.SymBufferAbortedError as exc:
        say(f"RAISED rank={R} after={time.time() - t0:.3f} aborting={exc.aborting_rank} "
            f"cls={type(exc).__name__} msg={exc}")
        if not HANDLED:
            raise
        t1 = time.time()
        c.close()
        say(f"CLOSED rank={R} took={time.time() - t1:.3f}")
        return
    say(f"NO ERROR rank={R}: alltoall returned although rank 1 left")


def late() -> None:
    c = make_comm()
    right_alltoall(c, 2)
    if R == 1:
        time.sleep(2.5)
    say(f"DONE rank={R}")


if __name__ == "__main__":
    case = sys.argv[1]
    if case == "late":
        late()
    else:
        leaver(case)
