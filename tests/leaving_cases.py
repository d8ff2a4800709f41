"""Jobs for tests/test_leaving.py: a rank's program ends (``sys.exit`` or the end of its script) with a
communicator open outside any ``with`` block. Run as ``mpiexec -n N python tests/leaving_cases.py CASE``.

``sys_exit`` / ``end``: after a right alltoall, rank 1 leaves by ``sys.exit(0)`` / by the end of its script
(``sys_exit_with``: ``sys.exit(0)`` inside ``with``, every rank's communicator in a ``with`` block); the other ranks enter an alltoall 0.3 s later and must raise ``SymBufferAbortedError`` naming rank 1 (each prints
``RAISED rank=R after=SECONDS aborting=A cls=NAME``), then close it (``CLOSED rank=R took=SECONDS``; with
``CUPY_SYMBUF_ABORT_ON_FAILURE=1`` the error is left uncaught instead, and the job ends).

``sys_exit_counts``: as ``sys_exit``, the others' next call an ``alltoallv`` that starts with a count exchange.
``two_comms``: as ``sys_exit`` with two communicators open on every rank; the others' alltoall is on the OLDER one
(rank 1's exit-time close of the newer one finds them waiting in the older); handled, they leave both open for
their own exit-time closes (exit status 0). ``two_comms_alloc``: the same with a symmetric allocation
(``Communicator.zeros``, a bootstrap step) on the older one instead of the alltoall.

``late``: every rank makes a right alltoall and ends with the communicator open; rank 1 ends 2.5 s after the others
(rank 1 in no call the others never joined): every rank's exit-time close must still be clean (exit status 0). Each
rank prints ``DONE rank=R`` before it ends.

``done_first`` (3 ranks or more): after a right alltoall, an ``alltoallv`` in which rank 1 sends and receives nothing
while ranks 0 and 2 exchange more rows than a ring holds, rank 2 slowed down in it (its first copy out of rank 0's
ring sleeps 2.5 s, as a rank descheduled on a loaded host would be): rank 1's part of the call is done at once and
its program ends with the communicator open; ranks 0 and 2 must still finish their call with the right rows and
every exit-time close be clean (exit status 0). Ring slots only (``CUPY_SYMBUF_CMA=0``).

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
    if case.startswith("two_comms"):
        right_alltoall(make_comm(), 4)  # the newer one, closed first at exit
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
        if case == "sys_exit_counts":
            c.alltoallv(dev(np.zeros((W, 4), np.float32)), [1] * W)
        elif case == "two_comms_alloc":
            c.zeros((4,), np.float32)
        else:
            c.alltoall(dev(np.zeros((W, 4), np.float32)))
        if BACKEND == "cuda":
            c.synchronize()  # (a queued GPU call reports its abort here, unless Config.blocking)
    except cs.SymBufferAbortedError as exc:
        say(f"RAISED rank={R} after={time.time() - t0:.3f} aborting={exc.aborting_rank} "
            f"cls={type(exc).__name__} msg={exc}")
        if not HANDLED:
            raise
        if case.startswith("two_comms"):
            return  # both closed at exit, newest first, as on rank 1
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


def done_first() -> None:
    c = make_comm()
    right_alltoall(c, 3)
    rows = 1 << 16  # rows of 1 KiB (256 float32): 64 MiB each way between ranks 0 and 2
    big = {0: 2, 2: 0}
    counts = [0] * W
    if R in big:
        counts[big[R]] = rows
    x = np.random.default_rng(40 + R).standard_normal((sum(counts), 256)).astype(np.float32)
    if R == 2:  # slowed down once, in the middle of the call (its first copy out of rank 0's ring)
        from cupy_symbuf.transport import host as _host
        drain = _host._Side.drain
        slept = []

        def slow_drain(self, slot, p, u, n):
            if p == 0 and not slept:
                slept.append(True)
                time.sleep(2.5)
            return drain(self, slot, p, u, n)
        _host._Side.drain = slow_drain
    y = host(c.alltoallv(dev(x), counts)[0])  # (recvbuf, recv_counts)
    want = np.random.default_rng(40 + big[R]).standard_normal((rows, 256)).astype(np.float32) if R in big else \
        np.zeros((0, 256), np.float32)
    if not np.array_equal(y, want):
        say(f"WRONG DATA rank={R}")
        os._exit(3)
    say(f"DONE rank={R}")


if __name__ == "__main__":
    case = sys.argv[1]
    if case == "done_first":
        os.environ["CUPY_SYMBUF_CMA"] = "0"
        done_first()
    elif case == "late":
        late()
    else:
        leaver(case)
