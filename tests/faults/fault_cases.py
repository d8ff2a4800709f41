"""Fault cases for cupy_symbuf, one per run, launched under mpiexec by ``tests/test_faults.py``::

    CUPY_SYMBUF_TIMEOUT_S=3 mpiexec -n 2 python tests/faults/fault_cases.py <case> --marker <unique-tag>

Two ways to meet a failure, chosen by the environment as a user would:

* default (``CUPY_SYMBUF_ABORT_ON_FAILURE`` unset): a runtime error is not caught; it reaches interpreter exit
  (the library then ends the job: ``MPI.Abort``). The script prints ``RAISING <Class> <message> [...]`` first.
* handled (``CUPY_SYMBUF_ABORT_ON_FAILURE=0``): the script catches it, prints ``CAUGHT <Class> <message> [...]``,
  closes the communicator (catching what ``close()`` raises too) and exits 0; where a peer is known to be hung or
  dead it ends the job itself with ``MPI.COMM_WORLD.Abort(2)``, as a recovering caller would.

Argument errors (``ValueError``, incl. ``SymBufferRejectedError``) are caught in both modes: a rejected call leaves
the communicator usable, and the case goes on with a valid call.

Every array a call returns is compared bitwise with a reference computed locally (no MPI traffic, so a reference
never hangs): a difference prints ``WRONG DATA ...`` and exits 3 at once. A call that should have failed but
returned prints ``NO ERROR ...`` (exit 4 at the end). Lines are tagged ``[on rank R during LABEL]``; ``FAULT t=``
marks when the fault was injected (the harness measures the job's end from there).
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from mpi4py import MPI  # noqa: E402

import cupy_symbuf as cs  # noqa: E402
from cupy_symbuf.common.errors import SymBufferError  # noqa: E402

WORLD = MPI.COMM_WORLD
R, W = WORLD.Get_rank(), WORLD.Get_size()
HANDLED = os.environ.get("CUPY_SYMBUF_ABORT_ON_FAILURE", "") == "0"
BACKEND = os.environ.get("CUPY_SYMBUF_FAULT_BACKEND", "host")
FAULT_RANK = 1
_state = {"no_error": False}


def say(*parts) -> None:
    """One write per line (ranks' lines reach the launcher's output whole, not glued to each other)."""
    sys.stdout.write(" ".join(str(p) for p in parts) + "\n")
    sys.stdout.flush()


def fault(what: str) -> None:
    say(f"FAULT t={time.time():.3f} rank {R}: {what}")


def tag(label: str, exc: BaseException = None) -> str:
    """``[on rank R during LABEL t=TIME isa CLASSES]``: CLASSES are the public cupy_symbuf.common.errors classes (and
    ValueError) the exception is an instance of, so a private subclass still matches what users catch."""
    isa = ""
    if exc is not None:
        names = [n for n in cs.common.errors.__all__ if isinstance(exc, getattr(cs.common.errors, n))]
        names += [b.__name__ for b in (ValueError, TypeError) if isinstance(exc, b)]
        isa = " isa " + ",".join(names or ["-"])
    return f"[on rank {R} during {label} t={time.time():.3f}{isa}]"


def one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def xp():
    if BACKEND == "cuda":
        import cupy
        return cupy
    return np


def dev(a: np.ndarray):
    return xp().asarray(a) if BACKEND == "cuda" else a


def host(a) -> np.ndarray:
    return a.get() if hasattr(a, "get") else np.asarray(a)


def make_comm(config=None):
    if BACKEND == "cuda":
        from cupy_symbuf.utils import select_device
        select_device(WORLD)
    return cs.Communicator(WORLD, config, backend=BACKEND)


def attempt(c, label: str, fn, *, expect_error: bool):
    """Run ``fn()``; returns (exception or None, result). See the module docstring for what is caught."""
    try:
        out = fn()
        if c is not None and BACKEND == "cuda":
            c.synchronize()
    except ValueError as exc:                      # a rejected call (incl. SymBufferRejectedError): recoverable
        say(f"CAUGHT {type(exc).__name__} {one_line(exc)} {tag(label, exc)}")
        return exc, None
    except Exception as exc:
        if HANDLED:
            say(f"CAUGHT {type(exc).__name__} {one_line(exc)} {tag(label, exc)}")
            return exc, None
        say(f"RAISING {type(exc).__name__} {one_line(exc)} {tag(label, exc)}")
        raise
    if expect_error:
        say(f"NO ERROR {tag(label)}: the call returned although ranks disagree")
        _state["no_error"] = True
    return None, out


def check(label: str, got, want: np.ndarray) -> None:
    g = host(got)
    if g.shape != want.shape or g.dtype.itemsize != want.dtype.itemsize or \
            g.tobytes() != np.ascontiguousarray(want).tobytes():
        diff = "shape/dtype" if g.shape != want.shape else int((g.reshape(-1).view(np.uint8) !=
                                                               want.reshape(-1).view(np.uint8)).sum())
        say(f"WRONG DATA {tag(label)}: got {g.dtype}{g.shape} want {want.dtype}{want.shape}; bytes differing: {diff}")
        sys.stdout.flush()
        os._exit(3)


def close(c, label: str = "close") -> None:
    attempt(None, label, c.close, expect_error=False)     # None: no synchronize() after it


def finish(peer_lost: bool = False) -> None:
    """End of a handled case: a peer that is hung or dead cannot finalize, so the caller ends the job."""
    if peer_lost and HANDLED:
        say(f"ENDING JOB with MPI.COMM_WORLD.Abort(2) {tag('finish')}: a peer is hung or dead")
        time.sleep(0.5)  # let the launcher forward this rank's lines before the abort tears the job down
        WORLD.Abort(2)
    if _state["no_error"]:
        sys.exit(4)
    say(f"CASE DONE {tag('finish')}")


# ---- valid calls with local references --------------------------------------------------------------------------

def a2a_send(rank: int, width: int = 8, dtype=np.float32) -> np.ndarray:
    """alltoall input of ``rank``: row j goes to rank j; every value names (source, destination, column)."""
    v = rank * 10000 + np.arange(W)[:, None] * 100 + np.arange(width)[None, :]
    return v.astype(dtype)


def a2a_want(width: int = 8, dtype=np.float32) -> np.ndarray:
    return np.stack([a2a_send(s, width, dtype)[R] for s in range(W)])


def counts_of(src: int, call: int) -> np.ndarray:
    """Rows rank ``src`` sends to each rank in the ``call``-th alltoallv (the same rule on every rank; zeros too)."""
    return np.array([(src * 3 + d * 5 + call) % 4 for d in range(W)], dtype=np.int64)


def av_send(src: int, call: int, width: int = 6) -> np.ndarray:
    cnt = counts_of(src, call)
    rows = []
    for d in range(W):
        for i in range(cnt[d]):
            rows.append(src * 1e6 + d * 1e4 + call * 100 + i + np.arange(width) / 10)
    return np.array(rows, dtype=np.float64).reshape(-1, width)


def av_want(call: int, width: int = 6) -> np.ndarray:
    parts = []
    for s in range(W):
        off = np.concatenate([[0], np.cumsum(counts_of(s, call))])
        parts.append(av_send(s, call, width)[off[R]: off[R + 1]])
    return np.concatenate(parts).reshape(-1, width)


def valid_alltoall(c, label: str = "valid alltoall") -> bool:
    exc, y = attempt(c, label, lambda: c.alltoall(dev(a2a_send(R))), expect_error=False)
    if exc is None:
        check(label, y, a2a_want())
    return exc is None


def valid_alltoallv(c, call: int, label: str = "valid alltoallv", recv_counts: bool = False) -> bool:
    rc = np.array([counts_of(s, call)[R] for s in range(W)]) if recv_counts else None
    exc, out = attempt(c, label, lambda: c.alltoallv(dev(av_send(R, call)), counts_of(R, call), recv_counts=rc),
                       expect_error=False)
    if exc is None:
        y, got_counts = out
        check(label, y, av_want(call))
        check(label + " counts", got_counts, np.array([counts_of(s, call)[R] for s in range(W)], np.int64))
    return exc is None


def after_failure(c, label: str = "call after failure") -> None:
    """A valid call after a failure must raise (communicator broken) or return correct data, never wrong rows."""
    valid_alltoallv(c, 7, label)


# ---- cases ----------------------------------------------------------------------------------------------------

def case_ok():
    fault("none (valid calls only)")
    with make_comm() as c:
        valid_alltoall(c)
        valid_alltoallv(c, 1)
        valid_alltoallv(c, 2, recv_counts=True)
    finish()


def _raise_before(use_with: bool):
    def body(c):
        valid_alltoall(c, "warm-up alltoall")
        if R == FAULT_RANK:
            fault("raises RuntimeError before alltoall")
            raise RuntimeError(f"injected failure on rank {R} before alltoall")
        fault(f"rank {FAULT_RANK} raises before alltoall; this rank calls it")
        attempt(c, "alltoall", lambda: c.alltoall(dev(a2a_send(R))), expect_error=True)
    if use_with:
        try:
            with make_comm() as c:      # __exit__ calls close() on every rank, the raising one included
                body(c)
        except SymBufferError as exc:   # what close() raised in __exit__
            if not HANDLED:
                raise
            say(f"CAUGHT {type(exc).__name__} {one_line(exc)} {tag('close in __exit__', exc)}")
    else:
        c = make_comm()
        body(c)                         # the raising rank never calls close()
        close(c)
    finish(peer_lost=False)


def case_raise_with():
    _raise_before(True)


def case_raise_nowith():
    _raise_before(False)


def case_raise_with_peer_closing():
    """Rank 1 raises inside its ``with`` block 1 s after the others left theirs (they wait in close()): leaving by
    the exception sets the abort word, so their close() raises SymBufferAbortedError naming rank 1 at once (by
    default the job ends with that message) instead of returning as if all were well."""
    try:
        with make_comm() as c:
            valid_alltoall(c, "warm-up alltoall")
            if R == FAULT_RANK:
                time.sleep(1.0)           # the others are in close() by now
                fault("raises RuntimeError inside 'with' while the others are in close()")
                raise RuntimeError(f"injected failure on rank {R} inside 'with'")
            fault(f"rank {FAULT_RANK} raises inside 'with' while this rank is in close()")
    except SymBufferError as exc:         # what close() raised in __exit__
        say(f"{'CAUGHT' if HANDLED else 'RAISING'} {type(exc).__name__} {one_line(exc)} {tag('close', exc)}")
        if not HANDLED:
            raise
    finish()


def case_exit_mid_alltoallv():
    """A rank ``os._exit``s in the middle of a large alltoallv: it enters first and fills its small rings (the
    others enter 1 s later and find part of its rows there), then dies at 0.5 s while waiting for ring space. Run
    with and without the launcher's cleanup: without it the survivors must leave on their own (timeout)."""
    c = make_comm(cs.Config(chunk_bytes=4096, num_slots=4))
    valid_alltoall(c, "warm-up alltoall")
    rows, width = 1024, 1024              # 4 MiB per peer of float32, through 16 KiB rings
    counts = np.full(W, rows, dtype=np.int64)
    x = dev(np.full((W * rows, width), R, dtype=np.float32))
    WORLD.Barrier()
    if R == FAULT_RANK:
        def die():
            fault("os._exit(7) in the middle of alltoallv")
            os._exit(7)
        threading.Timer(0.5, die).start()
    else:
        fault(f"rank {FAULT_RANK} will exit in the middle of alltoallv")
        time.sleep(1.0)
    exc, out = attempt(c, "alltoallv", lambda: c.alltoallv(x, counts), expect_error=(R != FAULT_RANK))
    if exc is None:
        check("alltoallv", out[0], np.repeat(np.arange(W, dtype=np.float32), rows)[:, None] *
              np.ones(width, np.float32))
    if R == FAULT_RANK:
        time.sleep(60)                    # the timer ends this rank
    close(c)
    finish(peer_lost=True)


def case_exit_after_cma_header():
    """Cross-memory attach (host, a plain sendbuf of 1 MiB per peer): rank 1 enters alltoall first, announces its
    rows (MODE_CMA headers) and dies at 1 s while waiting for the peers to read them; the others enter at 2 s and
    find its process gone when they read: they raise at once naming it, instead of waiting out the timeout.
    Where the kernel forbids cross-memory attach the case says CASE SKIPPED and the harness skips it."""
    c = make_comm()
    if BACKEND != "host" or c._transport.cma_pids is None:  # the same verdict on every rank (probed together)
        say(f"CASE SKIPPED: cross-memory attach is not available here {tag('setup')}")
        close(c)
        return
    valid_alltoall(c, "warm-up alltoall")
    x = dev(np.full((W, 1 << 18), R, dtype=np.float32))   # 1 MiB per peer: MODE_CMA on the host
    WORLD.Barrier()
    if R == FAULT_RANK:
        def die():
            fault("os._exit(7) while the peers have not read its rows yet")
            os._exit(7)
        threading.Timer(1.0, die).start()  # 1 s to announce its rows, however loaded the machine
    else:
        fault(f"rank {FAULT_RANK} will exit before this rank reads its rows")
        time.sleep(2.0)
    exc, out = attempt(c, "alltoall", lambda: c.alltoall(x), expect_error=(R != FAULT_RANK))
    if R == FAULT_RANK:
        time.sleep(60)                    # the timer ends this rank
    close(c)
    finish(peer_lost=True)


def case_diff_op_notify():
    """Rank 0 calls alltoall, the others alltoallv (with the count exchange)."""
    c = make_comm()
    valid_alltoall(c, "warm-up alltoall")
    fault("rank 0 calls alltoall, the others alltoallv")
    if R == 0:
        exc, y = attempt(c, "alltoall", lambda: c.alltoall(dev(a2a_send(R))), expect_error=True)
    else:
        exc, y = attempt(c, "alltoallv", lambda: c.alltoallv(dev(av_send(R, 1)), counts_of(R, 1)),
                         expect_error=True)
    after_failure(c)
    close(c)
    finish()


def case_diff_op_same_bytes():
    """Rank 0 calls alltoall, the others an alltoallv that moves the same bytes (one row each, recv_counts given):
    the wire looks the same, only the operation differs."""
    c = make_comm()
    valid_alltoall(c, "warm-up alltoall")
    # every rank is out of the warm-up before the mismatch (the first rank to see it aborts the communicator, and a
    # rank still inside its warm-up, descheduled on a loaded machine, would rightly raise SymBufferAbortedError there)
    WORLD.Barrier()
    fault("rank 0 calls alltoall, the others alltoallv with the same rows")
    ones = np.ones(W, dtype=np.int64)
    if R == 0:
        attempt(c, "alltoall", lambda: c.alltoall(dev(a2a_send(R))), expect_error=True)
    else:
        attempt(c, "alltoallv", lambda: c.alltoallv(dev(a2a_send(R)), ones, recv_counts=ones), expect_error=True)
    after_failure(c)
    close(c)
    finish()


def case_diff_form_alltoallv():
    """Rank 1 passes recv_counts to alltoallv, the others do not: rank 1 waits for call headers, the others in the
    count exchange. Each wait sees the other form's first message, so every rank raises at once."""
    c = make_comm()
    valid_alltoallv(c, 2, "warm-up alltoallv")
    valid_alltoallv(c, 3, "warm-up alltoallv with recv_counts", recv_counts=True)
    WORLD.Barrier()  # every rank out of the warm-up before the disagreement (see case_diff_op_same_bytes)
    fault("rank 1 passes recv_counts to alltoallv, the others do not")
    rc = np.array([counts_of(s, 4)[R] for s in range(W)], dtype=np.int64) if R == FAULT_RANK else None
    attempt(c, "alltoallv", lambda: c.alltoallv(dev(av_send(R, 4)), counts_of(R, 4), recv_counts=rc),
            expect_error=True)
    after_failure(c)
    close(c)
    finish()


def _recv_counts_off(delta: int):
    c = make_comm()
    valid_alltoall(c, "warm-up alltoall")
    call = 3
    rc = np.array([counts_of(s, call)[R] for s in range(W)], dtype=np.int64)
    if R == 0:
        fault(f"recv_counts from rank {FAULT_RANK} off by {delta:+d}")
        rc[FAULT_RANK] += delta
    else:
        fault(f"rank 0 passes recv_counts off by {delta:+d} for rank {FAULT_RANK}")
    # Only rank 0's receiver can see the disagreement (the call header rank 1 sent carries another row count):
    # rank 0 raises; rank 1's call may return (what it received is right: check it) and its next call raises.
    involved = R == 0
    exc, out = attempt(c, "alltoallv", lambda: c.alltoallv(dev(av_send(R, call)), counts_of(R, call),
                                                            recv_counts=rc), expect_error=involved)
    if exc is None and not involved:
        check("alltoallv", out[0], av_want(call))
    after_failure(c)
    after_failure(c, "second call after failure")
    close(c)
    finish()


def case_recv_self_off():
    """Every rank passes recv_counts[rank] = send_counts[rank] + 1 (its own rows: the GPU self copy once wrote past
    the output for this). Must be rejected (ValueError) or a mismatch on every rank, never a write out of bounds
    (run under compute-sanitizer memcheck by tests/faults/sanitize.sh); the next valid call is correct."""
    c = make_comm()
    valid_alltoall(c, "warm-up alltoall")
    call = 3
    rc = np.array([counts_of(s, call)[R] for s in range(W)], dtype=np.int64)
    rc[R] += 1
    fault("recv_counts[rank] = send_counts[rank] + 1 on every rank")
    exc, _ = attempt(c, "alltoallv", lambda: c.alltoallv(dev(av_send(R, call)), counts_of(R, call),
                                                          recv_counts=rc), expect_error=True)
    if isinstance(exc, ValueError):
        valid_alltoallv(c, 2, "valid alltoallv after rejection")
    else:
        after_failure(c)
    close(c)
    finish()


def case_recv_more():
    _recv_counts_off(+1)


def case_recv_fewer():
    _recv_counts_off(-1)


def _rejected(kind: str):
    """Rank 1's arguments fail its local checks; the others call validly. Every rank must raise ValueError
    (SymBufferRejectedError on the peers), and the next valid calls must return correct data everywhere."""
    c = make_comm()
    valid_alltoall(c, "warm-up alltoall")
    bad = R == FAULT_RANK
    if bad:
        fault(f"{kind}: this rank's arguments are invalid")
    else:
        fault(f"{kind}: rank {FAULT_RANK}'s arguments are invalid")
    if kind == "wrap_counts":           # int64 sum wraps to the row count: [0, n+2, 2**63-1, 2**63-1, ...]
        n = 5
        big = 2 ** 63 - 1
        counts = np.array([0, n + 2, big, big] + [0] * (W - 4), dtype=np.int64) if bad else counts_of(R, 1)
        x = np.zeros((n, 6)) if bad else av_send(R, 1)
        exc, _ = attempt(c, "alltoallv", lambda: c.alltoallv(dev(x), counts), expect_error=True)
    elif kind in ("reject_alltoallv", "reject_alltoallv_rc"):
        counts = counts_of(R, 1).copy()
        if bad:
            counts[0] = -1
        rc = np.array([counts_of(s, 1)[R] for s in range(W)]) if kind.endswith("_rc") else None
        exc, _ = attempt(c, "alltoallv", lambda: c.alltoallv(dev(av_send(R, 1)), counts, recv_counts=rc),
                         expect_error=True)
    elif kind == "reject_alltoall":
        x = np.zeros((W + 1, 8), np.float32) if bad else a2a_send(R)
        exc, _ = attempt(c, "alltoall", lambda: c.alltoall(dev(x)), expect_error=True)
    else:
        raise SystemExit(f"unknown kind {kind}")
    if exc is not None and not isinstance(exc, ValueError):
        say(f"NOT A REJECTION {tag(kind)}: {type(exc).__name__}")
    valid_alltoallv(c, 2, "valid alltoallv after rejection")
    valid_alltoall(c, "valid alltoall after rejection")
    valid_alltoallv(c, 3, "valid alltoallv (recv_counts) after rejection", recv_counts=True)
    close(c)
    finish()


def case_wrap_counts():
    _rejected("wrap_counts")


def case_reject_alltoallv():
    _rejected("reject_alltoallv")


def case_reject_alltoallv_rc():
    _rejected("reject_alltoallv_rc")


def case_reject_alltoall():
    _rejected("reject_alltoall")


def _alltoall_rows(kind: str):
    c = make_comm()
    valid_alltoall(c, "warm-up alltoall")
    x = a2a_send(R)
    if R == FAULT_RANK:
        fault(f"alltoall with a different {kind} on this rank")
        x = {"dtype": lambda: x.view(np.int32), "shape": lambda: x.reshape(W, 2, 4),
             "rowbytes": lambda: a2a_send(R, width=16)}[kind]()
    else:
        fault(f"rank {FAULT_RANK} calls alltoall with a different {kind}")
    exc, y = attempt(c, "alltoall", lambda: c.alltoall(dev(x)), expect_error=True)
    after_failure(c)
    close(c)
    finish()


def case_dtype_alltoall():
    _alltoall_rows("dtype")


def case_shape_alltoall():
    _alltoall_rows("shape")


def case_rowbytes_alltoall():
    _alltoall_rows("rowbytes")


def case_never_calls():
    c = make_comm()
    valid_alltoall(c, "warm-up alltoall")
    if R == FAULT_RANK:
        fault("never calls alltoall (sleeps)")
        time.sleep(3600)
    fault(f"rank {FAULT_RANK} never calls alltoall")
    attempt(c, "alltoall", lambda: c.alltoall(dev(a2a_send(R))), expect_error=True)
    close(c)
    finish(peer_lost=True)


def case_config_mismatch():
    """Same total buffer size, different wire: 1 KiB x 4 slots on rank 0, 2 KiB x 2 slots elsewhere."""
    cfg = cs.Config(chunk_bytes=1024, num_slots=4) if R == 0 else cs.Config(chunk_bytes=2048, num_slots=2)
    fault(f"Communicator with chunk_bytes={cfg.chunk_bytes} num_slots={cfg.num_slots}")
    try:
        c = make_comm(cfg)
    except ValueError as exc:
        say(f"CAUGHT {type(exc).__name__} {one_line(exc)} {tag('Communicator()', exc)}")
        if not HANDLED:
            raise
        finish()
        return
    say(f"NO ERROR {tag('Communicator()')}: constructed with a different Config than a peer")
    _state["no_error"] = True
    for call in range(4):              # would return wrong rows silently: the check catches it
        valid_alltoallv(c, call, f"alltoallv #{call} after mismatched construction")
        valid_alltoall(c, f"alltoall #{call} after mismatched construction")
    close(c)
    finish()


def _close_peer(kind: str):
    c = make_comm()
    valid_alltoall(c, "warm-up alltoall")
    if R == FAULT_RANK:
        if kind == "exits":
            fault("os._exit(0) instead of close()")
            os._exit(0)
        fault("never calls close() (sleeps)")
        time.sleep(3600)
    fault(f"rank {FAULT_RANK} never calls close()")
    close(c)
    finish(peer_lost=True)


def case_close_peer_sleeps():
    _close_peer("sleeps")


def case_close_peer_exits():
    _close_peer("exits")


def case_abort():
    """Rank 1 calls Communicator.abort() 0.5 s after the others entered alltoall."""
    c = make_comm()
    valid_alltoall(c, "warm-up alltoall")
    WORLD.Barrier()
    if R == FAULT_RANK:
        time.sleep(0.5)
        fault("Communicator.abort()")
        attempt(None, "abort", c.abort, expect_error=False)
        say(f"ABORTED t={time.time():.3f} {tag('abort')}")
        # By default this rank's next call raises uncaught and MPI.Abort ends the job; give the peers time to
        # print when they left alltoall first, or their lines may die with the launcher (seen in CI).
        time.sleep(0.5)
    else:
        fault(f"rank {FAULT_RANK} aborts while this rank is in alltoall")
        exc, _ = attempt(c, "alltoall", lambda: c.alltoall(dev(a2a_send(R))), expect_error=True)
        say(f"LEFT t={time.time():.3f} {tag('alltoall')}")
    after_failure(c)
    close(c)
    finish()


# ---- low-latency mode ----------------------------------------------------------------------------------------------
LL_N, LL_H = 4, 64          # tokens per rank at most, hidden (float32 rows)


def ll_buffer(c):
    return cs.LowLatencyBuffer(c, LL_N, LL_H, 2 * W, dtype="float32", max_topk=1)


def ll_inputs(src: int, call: int):
    """Rank ``src``'s (x float32 [n, H], topk_idx int64 [n, 1]) of the ``call``-th low-latency dispatch: token t
    goes to expert (src + t + call) % E; every value names (source, call, token, column)."""
    n = 1 + (src + call) % LL_N
    x = src * 1e5 + call * 1e3 + np.arange(n)[:, None] * 100 + np.arange(LL_H)[None, :]
    idx = ((src + np.arange(n) + call) % (2 * W)).astype(np.int64)[:, None]
    return x.astype(np.float32), idx


def valid_ll(c, ll, call: int, label: str) -> bool:
    """A low-latency dispatch, then a combine of the received rows with weight 1 (gives x back exactly); both
    compared with local references (recv_count, recv_x rows in (source, token) order, combined_x)."""
    x, idx = ll_inputs(R, call)
    exc, out = attempt(c, label, lambda: ll.dispatch(dev(x), dev(idx)), expect_error=False)
    if exc is not None:
        return False
    recv, cnt, handle = out
    L = ll.num_local_experts
    want_cnt, want_rows = [], []
    for el in range(L):
        rows = [ll_inputs(s, call)[0][t] for s in range(W)
                for t in range(ll_inputs(s, call)[1].shape[0]) if ll_inputs(s, call)[1][t, 0] == R * L + el]
        want_cnt.append(len(rows))
        want_rows.append(np.array(rows, np.float32).reshape(-1, LL_H))
    check(label + " recv_count", cnt, np.array(want_cnt, np.int32))
    got = host(recv)
    for el in range(L):
        check(f"{label} recv_x[{el}]", got[el, : want_cnt[el]], want_rows[el])
    w = np.ones(idx.shape, np.float32)
    exc, y = attempt(c, label + " combine", lambda: ll.combine(recv, dev(idx), dev(w), handle), expect_error=False)
    if exc is None:
        check(label + " combine", y, x)
    return exc is None


def case_ll_reject():
    """Rank 1 dispatches one token more than num_max_dispatch_tokens_per_rank (a ValueError on it); the others
    must raise SymBufferRejectedError naming rank 1 (host: from the dispatch; GPU: from synchronize), and the next
    three low-latency calls must be right on every rank."""
    c = make_comm()
    ll = ll_buffer(c)
    valid_ll(c, ll, 0, "warm-up low-latency")
    bad = R == FAULT_RANK
    fault("low_latency_dispatch with too many tokens" if bad else
          f"rank {FAULT_RANK}'s low_latency_dispatch has too many tokens")
    x, idx = ll_inputs(R, 1)
    if bad:
        x, idx = np.zeros((LL_N + 1, LL_H), np.float32), np.zeros((LL_N + 1, 1), np.int64)
    exc, _ = attempt(c, "low_latency_dispatch", lambda: ll.dispatch(dev(x), dev(idx)), expect_error=True)
    if exc is not None and not isinstance(exc, ValueError):
        say(f"NOT A REJECTION {tag('low_latency_dispatch')}: {type(exc).__name__}")
    for call in (2, 3, 4):
        valid_ll(c, ll, call, f"valid low-latency {call} after rejection")
    attempt(None, "close", ll.close, expect_error=False)
    close(c)
    finish()


def case_ll_interrupt():
    """Rank 1 gets a KeyboardInterrupt inside a low-latency dispatch, where the call starts moving rows, 0.5 s after
    the others entered theirs: they leave with SymBufferAbortedError naming rank 1 within 1 s (not timeout_s)."""
    c = make_comm()
    ll = ll_buffer(c)
    valid_ll(c, ll, 0, "warm-up low-latency")
    x, idx = ll_inputs(R, 1)
    WORLD.Barrier()
    if R == FAULT_RANK:
        time.sleep(0.5)

        def interrupted(*args, **kwargs):
            raise KeyboardInterrupt(f"injected Ctrl-C on rank {R} inside low_latency_dispatch")
        # the step after the checks: the kernel launch (GPU) or the host twin's stores and waits
        if BACKEND == "cuda":  # (the buffer's GpuLaunches / HostWire)
            setattr(ll._gpu, "issue_dispatch", interrupted)
        else:
            setattr(ll._host, "dispatch_send", interrupted)
        fault("KeyboardInterrupt inside low_latency_dispatch")
        try:
            ll.dispatch(dev(x), dev(idx))
            say(f"NO ERROR {tag('low_latency_dispatch')}: the injected interrupt did not propagate")
            _state["no_error"] = True
        except KeyboardInterrupt as exc:
            say(f"CAUGHT KeyboardInterrupt {one_line(exc)} {tag('low_latency_dispatch interrupted', exc)}")
        time.sleep(1.0)  # by default this rank's next call ends the job: the peers print first
    else:
        fault(f"rank {FAULT_RANK} is interrupted while this rank is in low_latency_dispatch")
        attempt(c, "low_latency_dispatch", lambda: ll.dispatch(dev(x), dev(idx)), expect_error=True)
    after_failure(c)
    attempt(None, "close", ll.close, expect_error=False)
    close(c)
    finish()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("case", choices=sorted(n[5:] for n in globals() if n.startswith("case_")))
    ap.add_argument("--marker", default="", help="unique tag so the harness can find leftover processes")
    args = ap.parse_args()
    globals()["case_" + args.case]()


if __name__ == "__main__":
    main()
