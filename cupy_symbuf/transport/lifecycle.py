"""Lifetime of communicators and buffers: the job always ends, nothing is freed twice, nothing leaks silently.

* Every open :class:`~cupy_symbuf.Communicator` and standalone :class:`~cupy_symbuf.SymBuffer` is registered (weakly)
  with the pid that made it. At interpreter exit (``atexit``; mpi4py finalizes MPI after Python's handlers) the ones
  still open are closed, newest first, bounded by their ``timeout_s``; objects of another pid (the parent's, after
  ``os.fork()``) are never touched.
* ``abort_on_failure`` (``Config``; default from ``CUPY_SYMBUF_ABORT_ON_FAILURE``, on): a failed communicator
  (timeout, mismatch, abort) that is closed or still registered at exit, or a ``SymBufferError`` that reaches the
  top level (``sys.excepthook``), prints the error with the rank to stderr and calls ``MPI.COMM_WORLD.Abort(1)``
  (without MPI: ``os._exit(1)``, which torchrun turns into the end of the job), so that the job ends instead of
  hanging in a window free or ``MPI_Finalize``. Before that it departs from the bootstraps of its open
  communicators (``Bootstrap.depart``): a peer whose ``close()`` waits for this rank while its own exception
  propagates stops waiting at once, and its traceback gets printed (under MPI the ``MPI_Abort`` ends every rank
  anyway). Without MPI, a rank whose failure was caused by a peer's abort (it names that rank) waits up to
  :data:`CAUSE_FIRST_S` instead of :data:`GRACE_S` before exiting: the causing rank exits first and torchrun,
  which ends the other workers when one fails, names it as the root cause (its first observed failure).
* Any other exception that reaches the top level of a script (not an interactive session) first sets the abort
  word of this rank's open communicators (``ERR_UNCAUGHT``): the peers' collectives leave at once naming this rank,
  and they reach ``close()`` while this rank's exit-time close still waits for them.
* An exception leaving a ``with Communicator`` block does the same for that communicator
  (``Communicator.__exit__``, ``ERR_LEFT_WITH``) before closing it; peers already in ``close()`` then raise
  ``SymBufferAbortedError`` naming the rank (with ``abort_on_failure``: the job ends with it).
* A program that ends without an exception (``sys.exit``, the end of its script: ``SystemExit`` never reaches
  ``sys.excepthook``) with communicators open closes them at exit, as above. Its bounded waits poll
  :func:`exit_watch` (every :data:`EXIT_POLL_S`) while the peers are not all in ``close()``: an open communicator of
  this rank whose peer has begun a call or a step of it that this rank never joined (evidence in this rank's own
  buffer: a count exchange slot of the next epoch, a call header past what this rank consumed, a small-protocol
  header of its next call; or the peer's bootstrap step message) gets its abort word set (``ERR_EXITED``), so that
  peer leaves at once naming this rank. A peer that is only behind (finishing a call this rank completed, or
  computing) is never told: it reaches ``close()`` later and the exit close completes cleanly. Ranks that all leave
  together close as before, the abort word untouched.
* :func:`live_mpi_objects` counts the MPI communicators and windows this package holds (tests check it for leaks).
"""
from __future__ import annotations

import atexit
import itertools
import os
import sys
import threading
import weakref

from ..common.config import env_abort_default

__all__ = ["register", "unregister", "keep_dropped", "open_objects", "abort_job", "env_abort_default",
           "live_mpi_objects", "depart", "peer_cause", "exit_watch"]

_lock = threading.Lock()
#: creation number -> (object, its state callback, its abort callback), all held weakly (Communicator or standalone
#: SymBuffer; see register)
_registry: "dict[int, tuple]" = {}
_counter = itertools.count()
_installed = False
_live = {"comm": 0, "win": 0}
#: Seconds abort_job waits after printing, before MPI_Abort: ranks failing at the same moment (a mismatch raises
#: on every rank involved) get to print their own errors before the job is torn down.
GRACE_S = 1.0
#: Seconds abort_job waits without MPI when another rank's abort caused this rank's failure (``cause``): that rank
#: ends first (its own failure: :data:`GRACE_S`), and the launcher (torchrun) ends this one, naming that rank as the
#: first failure. Bounds the wait when that rank goes on (it caught its exception).
CAUSE_FIRST_S = 5.0
#: Seconds between two looks of an exit-time close at whether a peer waits for this rank in a call it never joined
#: (see the module docstring and :func:`exit_watch`).
EXIT_POLL_S = 0.05


def live_mpi_objects() -> dict:
    """``{"comm": n, "win": m}``: MPI communicators (Dup/Split_type) and windows made here and not yet freed."""
    return dict(_live)


def count(kind: str, delta: int) -> None:
    with _lock:
        _live[kind] += delta


def register(obj, *, state, abort=None, depart=None, leave=None, exit_close=None) -> int:
    """Remember ``obj`` (closed at exit if still open, by ``obj.close()``); returns its token for :func:`unregister`.

    The registry reads ``obj`` only through the bound methods it hands over (held weakly, like ``obj``):
    ``state()`` returns ``(pid that made it, open, why it failed or None, abort_on_failure or None for the
    environment's default)``; ``abort(exc_type)`` (optional) is called when this rank's program ends with an
    uncaught exception: it sets the object's abort word so that its peers stop waiting for this rank;
    ``depart(reason)`` (optional) is called by :func:`abort_job` before the job ends: this rank takes part in no
    further exchange of the object (``Bootstrap.depart``); ``leave()`` (optional) is polled at exit while a close
    there waits for the peers (:func:`exit_watch`): this rank's program has ended and takes part in no further
    collective of the object, so when a peer waits for it in one, the object sets its abort word; it returns True
    once it need not be polled again; ``exit_close(watch)`` (optional) closes the object at exit instead of
    ``obj.close()``, its bounded waits polling ``watch`` (no arguments)."""
    global _installed
    with _lock:
        if not _installed:
            atexit.register(_at_exit)
            _install_excepthook()
            _installed = True
        token = next(_counter)
        _registry[token] = (weakref.ref(obj), weakref.WeakMethod(state),
                            None if abort is None else weakref.WeakMethod(abort),
                            None if depart is None else weakref.WeakMethod(depart),
                            None if leave is None else weakref.WeakMethod(leave),
                            None if exit_close is None else weakref.WeakMethod(exit_close))
        return token


def unregister(token) -> None:
    with _lock:
        _registry.pop(token, None)


def keep_dropped(token, obj, *, state, abort=None, depart=None, leave=None, exit_close=None) -> None:
    """Hold the registered ``obj`` strongly from now on (its finalizer found it dropped while open): it stays in
    its place in the registry, so exit closes it collectively with the others, newest first, in the same order
    on every rank. Called from a finalizer: takes no lock (replacing a present key's value is atomic and never
    changes the dict's size under an iteration)."""
    if token in _registry:
        _registry[token] = ((lambda: obj), (lambda: state), None if abort is None else (lambda: abort),
                            None if depart is None else (lambda: depart), None if leave is None else (lambda: leave),
                            None if exit_close is None else (lambda: exit_close))


def open_objects() -> list:
    """The registered objects still open and made by this process (dropped ones held by :func:`keep_dropped`
    included), newest first."""
    return _open_objects()


def _mpi_abort(code: int) -> None:  # tests replace this
    from .bootstrap import abort_process
    abort_process(code)


def _world_rank() -> int:
    from .bootstrap import world_rank
    return world_rank()


def say(rank, *lines: str) -> None:
    """Write ``lines`` to stderr, each as ``cupy_symbuf: rank R: ...``, flushed; never raises (used while an error
    propagates or the job is about to be torn down)."""
    try:
        sys.stderr.write("".join(f"cupy_symbuf: rank {rank}: {line}\n" for line in lines))
        sys.stderr.flush()
    except Exception:  # pragma: no cover
        pass


def abort_job(message: str, rank: int = None, *, cause: int = None) -> None:
    """Print ``message`` to stderr with the rank, then end every rank of the job: ``MPI.COMM_WORLD.Abort(1)`` under
    MPI, else ``os._exit(1)`` (torchrun ends the other workers when one exits non-zero).

    First this rank departs from its open registered objects (``depart``, see :func:`register`; the caller departs
    from the one it is closing). ``cause``: the rank (of the communicator that failed) whose abort caused this
    failure, if another: without MPI this rank then waits up to :data:`CAUSE_FIRST_S`, not :data:`GRACE_S`, so that
    rank exits first and torchrun reports it as the root cause."""
    from .bootstrap import mpi_in_use
    rank = _world_rank() if rank is None else rank
    under_mpi = mpi_in_use()
    wait = GRACE_S
    if under_mpi:
        how = "calling MPI.COMM_WORLD.Abort(1)"
    elif cause is not None and GRACE_S > 0:  # (tests that replace the abort set GRACE_S to 0: no wait at all)
        wait = max(GRACE_S, CAUSE_FIRST_S)
        how = (f"waiting up to {wait:g} s for rank {cause} (whose abort caused this) to exit first, then exiting "
               f"with status 1 (os._exit)")
    else:
        how = "exiting with status 1 (os._exit)"
    say(rank, message, f"{how} so the job ends (Config.abort_on_failure; "
                       "CUPY_SYMBUF_ABORT_ON_FAILURE=0 turns this off)")
    for entry in _open_entries():
        if entry[4] is not None:
            try:
                entry[4](message)
            except Exception:  # pragma: no cover - the job is ending
                pass
    if wait > 0:
        import time
        time.sleep(wait)
    _mpi_abort(1)


def _open_entries() -> list:
    """``(object, failure, policy, abort, depart, leave and exit_close callbacks)`` of the registered objects
    still alive, open and made by this process, newest first (``failure``: why it failed, or None; ``policy``: its
    ``abort_on_failure``)."""
    pid = os.getpid()
    with _lock:
        items = sorted(_registry.items(), reverse=True)
    out = []
    for _, (ref, state_ref, abort_ref, depart_ref, leave_ref, exit_ref) in items:
        obj, state = ref(), state_ref()
        if obj is None or state is None:
            continue
        made_by, is_open, failure, policy = state()
        if made_by == pid and is_open:
            out.append((obj, failure, env_abort_default() if policy is None else policy,
                        None if abort_ref is None else abort_ref(), None if depart_ref is None else depart_ref(),
                        None if leave_ref is None else leave_ref(), None if exit_ref is None else exit_ref()))
    return out


def _open_objects() -> list:
    """Registered objects still alive, open and made by this process, newest first."""
    return [e[0] for e in _open_entries()]


def exit_watch():
    """A callable (no arguments, never raises) for the bounded waits of an exit-time close: at most every
    :data:`EXIT_POLL_S` it polls the ``leave`` callback of every object open now (see :func:`register`), each of
    which sets its object's abort word when a peer waits for this rank in a call of it that this rank never joined;
    one that answers True (told, failed or closed) is not polled again."""
    import time
    leaves = [e[5] for e in _open_entries() if e[5] is not None]
    done: set = set()
    due = [0.0]

    def watch() -> None:
        now = time.monotonic()
        if now < due[0]:
            return
        due[0] = now + EXIT_POLL_S
        for i, leave in enumerate(leaves):
            if i in done:
                continue
            try:
                if leave():
                    done.add(i)
            except Exception:  # pragma: no cover - the process is ending
                done.add(i)

    return watch


def _at_exit() -> None:
    entries = _open_entries()
    watch = exit_watch()
    for obj, broken, policy, _, _, _, closer in entries:
        if broken and policy:
            abort_job(f"{type(obj).__name__} failed and was never closed: {broken}", getattr(obj, "rank", None))
            return
        try:
            if closer is not None:
                closer(watch)
            else:
                obj.close()  # bounded; aborts by itself for a failed communicator with the policy on
        except Exception as exc:
            if policy:
                abort_job(f"closing {type(obj).__name__} at exit failed: {exc}", getattr(obj, "rank", None))
                return
            try:
                sys.stderr.write(f"cupy_symbuf: rank {getattr(obj, 'rank', '?')}: closing {obj!r} at exit failed "
                                 f"(left allocated): {exc}\n")
            except Exception:  # pragma: no cover
                pass


def _abort_open(exc_type) -> None:
    """This rank's program ends with an uncaught exception: its open communicators will never take part in another
    collective, so set their abort words (``protocol.ERR_UNCAUGHT``): a peer waiting in (or entering) a collective
    leaves at once with :class:`~cupy_symbuf.SymBufferAbortedError` naming this rank instead of waiting out
    ``timeout_s``, and reaches ``close()`` while this rank's exit-time close still waits for it."""
    if hasattr(sys, "ps1") or sys.flags.interactive:  # an interactive session goes on after the traceback
        return
    for _, broken, _, abort, _, _, _ in _open_entries():
        if abort is None or broken:
            continue
        try:
            abort(exc_type)
        except Exception:  # pragma: no cover - never mask the original error
            pass


def peer_cause(aborting_rank, rank: int):
    """``aborting_rank`` (the rank that set an abort word) when it is a rank other than ``rank`` (the one
    reporting), else None (None or negative: no rank known; ``rank`` itself): the ``cause`` of :func:`abort_job`."""
    if aborting_rank is not None and 0 <= aborting_rank != rank:
        return aborting_rank
    return None


def depart(bootstrap, reason: str) -> None:
    """``bootstrap.depart(reason)`` (``Bootstrap.depart``: this rank takes part in no further exchange of it, and
    peers waiting for it stop waiting) unless ``bootstrap`` is None (freed); never raises: the job is ending."""
    try:
        if bootstrap is not None:
            bootstrap.depart(reason)
    except Exception:  # noqa: BLE001 - never mask the failure that ends the job
        pass


def _cause_of(exc):
    """The rank whose abort ``exc`` reports when that is another rank (``SymBufferAbortedError``), else None."""
    from ..common.errors import SymBufferAbortedError
    return peer_cause(exc.aborting_rank, exc.rank) if isinstance(exc, SymBufferAbortedError) else None


def _install_excepthook() -> None:
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        previous(exc_type, exc, tb)
        from ..common.errors import SymBufferError
        if not isinstance(exc, SymBufferError):
            _abort_open(exc_type)
            return
        policy = getattr(exc, "abort_on_failure", None)
        failed = [e for e in _open_entries() if e[1]]
        if failed:
            policy = any(e[2] for e in failed)
        if policy is None:
            policy = env_abort_default()
        if policy:
            abort_job(f"uncaught {exc_type.__name__}: {exc}", cause=_cause_of(exc))

    sys.excepthook = hook
