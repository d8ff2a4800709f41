"""Outputs that repeated GPU calls of one shape hand out again instead of allocating (:class:`OutputPool`).

A GPU collective returns new arrays; allocating them (CuPy's pool, an ``ndarray`` each) is a large share of the host
time of a small repeated call. A caller's record of one call shape keeps an :class:`OutputPool`: a set of arrays it
handed out is handed out again only when nothing outside the pool refers to it any more, and only on the stream it
was made on (the only one it is handed out on). That is when CuPy's own pool would give the same memory to the next
allocation on that stream: the earlier work on the arrays (the caller's kernels that read them) stays before the
next write in stream order.

"Refers to it" is counted with ``sys.getrefcount`` of each array (a view holds its base array: ``ndarray.base``;
DLPack and ``__cuda_array_interface__`` consumers such as ``torch.as_tensor`` hold the array), of its memory pointer
(``ndarray.data``, which another array made over it holds) and of the allocation (every memory pointer into it holds
it): each must be what it was when only the pool held the set. A bare integer address kept by the caller
(``a.data.ptr``) is not a reference: the memory behind it is reused, as it would be by CuPy's pool once the array is
dropped.
"""
from __future__ import annotations

import sys

__all__ = ["OutputPool"]

_refs = sys.getrefcount


def _held(arrays: list) -> tuple:
    """The reference counts that say whether anything outside the pool holds ``arrays`` (see the module doc); the
    pool compares them with those it counted, in this same function, when it alone held the set."""
    if len(arrays) == 1:
        a = arrays[0]
        return _refs(a), _refs(a.data), _refs(a.data.mem)
    a, b = arrays
    return _refs(a), _refs(a.data), _refs(b), _refs(b.data), _refs(a.data.mem)


class OutputPool:
    """Sets of arrays (a tuple of one or two CuPy arrays over one allocation, made by ``make()``) handed out again by
    the repeated calls of one call shape (see the module doc): :meth:`take` returns a set nothing outside the pool
    holds that was last handed out on the same stream, else a new one. At most ``size`` sets are kept (a new set
    past that takes the place of the oldest, which CuPy's pool gets back once its holder drops it); a caller that
    keeps every output it got (``y = f()`` in a loop keeps the previous one while the next call runs) is served
    from two."""

    __slots__ = ("_make", "_sets", "_size")

    def __init__(self, make, size: int = 2):
        self._make = make
        self._sets = []  # [stream pointer, arrays, their counts when only the pool held them]
        self._size = size

    def take(self, stream_ptr: int) -> tuple:
        """A set of arrays for a call on the stream ``stream_ptr`` (see the class doc). Raises what ``make()``
        raises (out of memory)."""
        # The pool keeps each set as a list and returns a new tuple of it: a caller that hands the tuple on as it is
        # (combine's (x, weights)) holds the arrays through it, which their counts see (the pool's own tuple would
        # hold them invisibly).
        # The caller gets views of the set's arrays: what it changes in the array objects it got (their shape, a
        # flag) stays in its views, and the views hold the arrays and their memory, which the counts see.
        for s in self._sets:
            if s[0] == stream_ptr and _held(s[1]) == s[2]:
                return tuple([a.view() for a in s[1]])
        arrays = list(self._make())
        if len(self._sets) >= self._size:
            del self._sets[0]
        self._sets.append([stream_ptr, arrays, _held(arrays)])
        return tuple([a.view() for a in arrays])

    def __len__(self) -> int:
        return len(self._sets)
