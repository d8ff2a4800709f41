"""Outputs that repeated calls of one shape hand out again instead of allocating (:class:`OutputPool`): the GPU
calls' CuPy arrays and the host engine's NumPy ones.

A collective returns new arrays; allocating them (CuPy's pool, an ``ndarray`` each; NumPy's allocator) is a large
share of the host time of a small repeated call. A caller's record of one call shape keeps an :class:`OutputPool`: a
set of arrays it handed out is handed out again only when nothing outside the pool refers to it any more, and (GPU)
only on the stream it was made on (the only one it is handed out on). That is when CuPy's own pool would give the
same memory to the next allocation on that stream: the earlier work on the arrays (the caller's kernels that read
them) stays before the next write in stream order. Host calls are synchronous: their pools use one key (0) for all.

"Refers to it" is counted with ``sys.getrefcount``, compared with the counts the pool took, in the same function,
when it alone held the set. CuPy: of each array (a view holds its base array: ``ndarray.base``; DLPack and
``__cuda_array_interface__`` consumers such as ``torch.as_tensor`` hold the array), of its memory pointer
(``ndarray.data``, which another array made over it holds) and of the allocation (every memory pointer into it holds
it). NumPy: of each array and, when it is a view, of its base (NumPy's ``ndarray.data`` is a new memoryview at each
access, which counts nothing; every view, memoryview, ctypes object, ``np.frombuffer`` array or DLPack consumer made
from an array holds it or its base). The caller always gets views of the pool's arrays, so what it changes in the
array objects it got (their shape, dtype, a flag; NumPy refuses to ``resize`` a view) never reaches the pool; and the
pool keeps views of the arrays ``make()`` returns, never those arrays themselves (NumPy and CuPy make a view of a
view a view of the owner), so the ``base`` of what the caller got is an owner the pool never hands out views of:
what the caller changes in it (``y.base.shape``, ``dtype``, the writeable flag) does not reach the pool either, and
the pool counts the owners too (holding only ``y.base`` holds the memory). A bare
integer address kept by the caller (``a.data.ptr``, ``a.ctypes.data``) is not a reference: the memory behind it is
reused, as it would be by the allocator once the array is dropped.
"""
from __future__ import annotations

import sys

from ..common.address import address_of

__all__ = ["OutputPool"]

_refs = sys.getrefcount


def _held(arrays: list) -> tuple:
    """CuPy: the reference counts that say whether anything outside the pool holds ``arrays`` (see the module doc):
    of each array, of the owner it is a view of, of its memory pointer and of the allocation; the pool compares
    them with those it counted, in this same function, when it alone held the set."""
    if len(arrays) == 1:
        a = arrays[0]
        return _refs(a), _refs(a.base), _refs(a.data), _refs(a.data.mem)
    a, b = arrays
    return _refs(a), _refs(a.base), _refs(a.data), _refs(b), _refs(b.base), _refs(b.data), _refs(a.data.mem)


def _held_host(arrays: list) -> tuple:
    """NumPy: the counts of each array and of its base (the owner it is a view of; see the module doc)."""
    if len(arrays) == 1:
        a = arrays[0]
        return _refs(a), _refs(a.base)
    a, b = arrays
    return _refs(a), _refs(a.base), _refs(b), _refs(b.base)


class OutputPool:
    """Sets of arrays (a tuple of one or two CuPy arrays over one allocation, or of NumPy arrays with ``host``, made by
    ``make()``) handed out again by the repeated calls of one call shape (see the module doc): :meth:`take` returns
    views of a set nothing outside the pool holds that was last handed out on the same stream (host: key 0), else
    of a new one. At most ``size`` sets are kept (a new set past that takes the place of the oldest, which the
    allocator gets back once its holder drops it); a caller that keeps every output it got (``y = f()`` in a loop
    keeps the previous one while the next call runs) is served from two."""

    __slots__ = ("_make", "_sets", "_size", "_held")

    def __init__(self, make, size: int = 2, *, host: bool = False):
        self._make = make
        # [stream pointer, arrays, their counts when only the pool held them, the first array's data address]
        self._sets = []
        self._size = size
        self._held = _held_host if host else _held

    def take(self, stream_ptr: int = 0) -> tuple:
        """Views of a set of arrays for a call on the stream ``stream_ptr`` (see the class doc). Raises what
        ``make()`` raises (out of memory)."""
        # The pool keeps each set as a list and returns a new tuple of it: a caller that hands the tuple on as it is
        # (combine's (x, weights)) holds the arrays through it, which their counts see (the pool's own tuple would
        # hold them invisibly).
        # The caller gets views of the set's arrays: what it changes in the array objects it got (their shape, a
        # flag) stays in its views, and the views hold the arrays and their memory, which the counts see.
        held = self._held
        for s in self._sets:
            if s[0] == stream_ptr and held(s[1]) == s[2]:
                return tuple([a.view() for a in s[1]])
        return tuple([a.view() for a in self._new(stream_ptr)[1]])

    def take_one(self, stream_ptr: int = 0) -> tuple:
        """``(view, address)``: :meth:`take` of a pool of one-array sets, with the data address of the array (taken
        once, when the set was made: the host engine's prepared exchanges write to raw addresses)."""
        held = self._held
        for s in self._sets:
            if s[0] == stream_ptr and held(s[1]) == s[2]:
                return s[1][0].view(), s[3]
        s = self._new(stream_ptr)
        return s[1][0].view(), s[3]

    def _new(self, stream_ptr: int) -> list:
        """A new set from ``make()``, its counts taken while only the pool holds it, in place of the oldest set
        when the pool is full."""
        arrays = [a.view() for a in self._make()]  # (views of owners never handed out: see the module doc)
        if len(self._sets) >= self._size:
            del self._sets[0]
        s = [stream_ptr, arrays, self._held(arrays), address_of(arrays[0])]
        self._sets.append(s)
        return s

    def __len__(self) -> int:
        return len(self._sets)
