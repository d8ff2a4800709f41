"""The entry of every collective: one thread at a time inside a communicator, and a call that cannot even start
(a mistyped keyword, a missing argument) told to the peers like any other rejected argument.

* :class:`CallGuard`: held by the thread inside one of a communicator's calls (re-entrant for that thread: a
  collective made of collectives). Another thread entering meanwhile gets ``RuntimeError`` at once, naming the
  operation, the communicator and the thread already inside; the call inside is unaffected and the communicator
  stays usable. One non-blocking lock acquire per call (a fraction of a microsecond). For a GPU object
  (``CallGuard.device`` set) the entering thread gets that device current for the call (:func:`use_device`):
  a thread the program started works without ``cupy.cuda.Device(...).use()`` of its own.
* :func:`collective`: the decorator of a public collective method: enters the guard, runs the method, and when
  Python could not bind the call's arguments (``TypeError`` before the method's first line, or before the
  function it forwards ``**kwargs`` to) tells the peers through the owner's rejection path before raising: they
  leave the call at once instead of waiting out ``timeout_s``. The method's signature and documentation are its
  own (``functools.wraps``); the arguments are bound again only on that failure.

Several communicators may be used from several threads at once, each by one thread at a time (on the GPU each
thread on a stream of its own: kernels of two communicators queued on one stream in a different order on two
ranks wait for each other).
"""
from __future__ import annotations

import difflib
import functools
import inspect
import re
import threading
from _thread import get_ident

from ..common import backend as _compat

__all__ = ["CallGuard", "collective", "use_device"]

#: per thread: ``ready`` once this thread made a CUDA device current through :func:`use_device`
_THREAD = threading.local()


def use_device(device: int) -> int:
    """Make CUDA device ``device`` current in the calling thread for one call; returns the device to make current
    again after it (the thread's own, when it had another one current), or -1 when nothing is to be restored.

    A thread the program started has no CUDA context current until a runtime call makes one, and the kernels
    of this package are launched through the driver API (``cuLaunchKernel``), which then fails with
    ``CUDA_ERROR_INVALID_CONTEXT``: the first call of each thread sets the device (``cudaSetDevice``) and, where
    that left no context current (the runtime binds the primary context lazily), binds it with ``cudaFree(0)``.
    A new thread that had no context current is not switched back after the call (that would create a context on
    device 0 for nothing). A thread with another device current is switched for the call and back after it (as
    ``with cupy.cuda.Device(device)``); the results lie on ``device``.
    Cost per call once a thread is ready: ``cudaGetDevice`` and a thread-local read (about 0.1-0.2 us)."""
    cuda = _compat.cupy.cuda
    rt = cuda.runtime
    if getattr(_THREAD, "ready", False):
        here = rt.getDevice()
        if here != device:
            rt.setDevice(device)
            return here
        return -1
    driver = getattr(cuda, "driver", None)
    had_context = driver is None or driver.ctxGetCurrent() != 0
    here = rt.getDevice() if had_context else device
    rt.setDevice(device)
    if driver is not None and driver.ctxGetCurrent() == 0:
        rt.free(0)  # any runtime call that needs the context makes the primary context current
    _THREAD.ready = True
    return here if here != device else -1


def _restore_device(device: int) -> None:
    try:
        _compat.cupy.cuda.runtime.setDevice(device)
    except Exception:  # pragma: no cover - never replace the call's own outcome (a sticky CUDA error shows next call)
        pass


class CallGuard:
    """Who is inside an object's calls: at most one thread at a time (that thread may nest calls).

    ``took = guard.enter(op, obj)`` before a call, and ``guard.leave()`` after it when ``took`` (False: this thread
    was already inside, a nested call). ``RuntimeError`` (:meth:`busy`) when another thread is inside.

    ``device``: the CUDA device (int) of the object's memory and kernels, or None (host): the outermost call of
    a thread makes it current for the call (:func:`use_device`) and restores the thread's own after it."""

    __slots__ = ("lock", "owner", "op", "device", "restore")

    def __init__(self, device=None):
        self.lock = threading.Lock()
        self.owner = None  # the ident of the thread inside (None: free)
        self.op = None     # the outermost operation it is in
        self.device = device
        self.restore = -1  # the device to make current again when the thread inside leaves (-1: none)

    def enter(self, op: str, obj=None) -> bool:
        if self.lock.acquire(False):
            self.owner = get_ident()
            self.op = op
            if self.device is not None:
                try:
                    self.restore = use_device(self.device)
                except BaseException:
                    self.owner = self.op = None
                    self.lock.release()
                    raise
            return True
        if self.owner == get_ident():  # (only this thread could have set it to its own ident)
            return False
        raise self.busy(op, obj)

    def leave(self) -> None:
        back, self.restore = self.restore, -1
        self.owner = self.op = None
        self.lock.release()
        if back >= 0:
            _restore_device(back)

    def busy(self, op: str, obj=None) -> RuntimeError:
        """The error of a thread that found another one inside (nothing was done: its call did not take part)."""
        owner, inside = self.owner, self.op
        who = "another thread"
        if owner is not None:
            for t in threading.enumerate():
                if t.ident == owner:
                    who = f"thread {t.name!r} (ident {owner})"
                    break
            else:
                who = f"thread ident {owner}"
        me = threading.current_thread()
        comm = getattr(obj, "comm", None)  # a LowLatencyBuffer / DeltaExchange: the communicator whose guard it is
        what = f"{obj!r}" + (f" over {comm!r}" if type(comm).__name__ == "Communicator" else "")
        return RuntimeError(
            f"{op}: {who} is inside {inside or 'a call'} of {what}, and this call comes from thread {me.name!r} "
            f"(ident {me.ident}): a communicator takes one thread at a time. This call did nothing (the peers "
            f"were not told of it) and the call inside goes on; use one communicator per thread, or serialise the "
            f"calls (a lock around them, in the same order on every rank)")


def _lenient(sig: inspect.Signature, args: tuple, kwargs: dict) -> dict:
    """The arguments of a call that did not bind, as far as they go (surplus positionals dropped; defaults filled
    in; a missing required argument absent). An unknown keyword that is a close misspelling of a keyword the call
    did not get (``recv_countz`` for ``recv_counts``) counts as that keyword, else it is dropped: the rejection
    then takes the form (say, a call with or without the count exchange) the caller meant, the one its peers wait
    in."""
    params = list(sig.parameters.values())[1:]  # without self
    npos = sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)
    if not any(p.kind is p.VAR_POSITIONAL for p in params):
        args = args[:npos]
    taken = {p.name for p in params[:len(args)]}
    keywords = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    named = {k: v for k, v in kwargs.items() if k in keywords and k not in taken}
    for k, v in kwargs.items():
        if k not in sig.parameters:
            meant = difflib.get_close_matches(k, sorted(keywords - taken - named.keys()), n=1, cutoff=0.8)
            if meant:
                named[meant[0]] = v
    out = {p.name: p.default for p in params if p.default is not p.empty}
    try:
        out.update(sig.bind_partial(None, *args, **named).arguments)
    except TypeError:
        pass
    return out


def _hint(exc: TypeError, known) -> str:
    m = re.search(r"unexpected keyword argument '(\w+)'", str(exc))
    if m:
        close = difflib.get_close_matches(m.group(1), sorted(known), n=1)
        if close:
            return f" (did you mean {close[0]!r}?)"
    return ""


def collective(op: str, *, guard, reject=None, forwards=None):
    """Decorate the public collective method ``op`` (the name errors give, e.g. ``"alltoall"``).

    ``guard(self)``: the :class:`CallGuard` of the object. ``reject(self, arguments, exc)``: tell the peers that
    this rank's call failed before its first step (``arguments``: what could be bound, defaults filled in;
    ``exc``: the ``TypeError``); returns what the peers see (a phrase), or None where nothing can be told.
    ``forwards``: the function the method passes its ``**kwargs`` to, its first parameter taking the engine (a
    keyword neither accepts is a binding error too). The method keeps its own signature and documentation.

    Cost per call: one non-blocking lock acquire and release and two attribute writes (about 0.1-0.3 us on a
    host CPU), and for a GPU object :func:`use_device` (about 0.1-0.2 us more); arguments are bound again only
    when a ``TypeError`` leaves the call."""

    def deco(fn):
        sig = inspect.signature(fn)
        known = set(sig.parameters) - {"self"}
        if forwards is not None:
            known |= set(list(inspect.signature(forwards).parameters)[1:])  # (its first: the engine)
        known -= {p.name for p in sig.parameters.values() if p.kind is p.VAR_KEYWORD}

        def bad_call(self, exc, args, kwargs):
            told = None
            if reject is not None:
                told = reject(self, _lenient(sig, args, kwargs), exc)
            text = str(exc)
            if told:
                after = f"the peers were told (their call raises {told}) and this object stays usable"
            elif told == "":
                after = "nothing was communicated"
            else:
                after = "the peers could not be told"
            msg = f"{op}: {text}{_hint(exc, known)}; {after}"
            err = TypeError(msg)
            err.symbuf_told = True
            return err

        @functools.wraps(fn)
        def wrapper(self, *args, **kwargs):
            g = guard(self)
            took = False
            try:
                # (CallGuard.enter, inline; the acquire's result is stored before anything can interrupt, so
                # a KeyboardInterrupt anywhere after it still releases the lock in `finally`)
                took = g.lock.acquire(False)
                if took:
                    g.owner = get_ident()
                    g.op = op
                    if g.device is not None:  # a GPU object: its device current for the call
                        g.restore = use_device(g.device)
                elif g.owner == get_ident():
                    return fn(self, *args, **kwargs)  # nested: the outermost call of this thread handles errors
                else:
                    raise g.busy(op, self)
                return fn(self, *args, **kwargs)
            except TypeError as exc:
                # a binding error: raised before the method's first line (no frame of it in the traceback), or
                # by the call it forwards **kwargs to (a keyword neither knows); every other TypeError is an
                # argument check, already told to the peers
                if took and not getattr(exc, "symbuf_told", False) and (
                        exc.__traceback__.tb_next is None or
                        (forwards is not None and not kwargs.keys() <= known)):
                    raise bad_call(self, exc, args, kwargs) from None
                raise
            finally:
                if took:
                    g.leave()

        wrapper.__signature__ = sig
        return wrapper

    return deco


def guarded(op: str, *, guard):
    """Decorate a method that takes part in the object's calls but has no rejection path (``close``,
    ``synchronize``): the :class:`CallGuard` only."""

    def deco(fn):
        @functools.wraps(fn)
        def wrapper(self, *args, **kwargs):
            g = guard(self)
            took = False
            try:
                took = g.enter(op, self)
                return fn(self, *args, **kwargs)
            finally:
                if took:
                    g.leave()

        return wrapper

    return deco
