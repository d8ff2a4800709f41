"""Symmetric arrays: NumPy / CuPy arrays that live in symmetric memory, so collectives on them can skip staging.

``Communicator.empty(shape, dtype)`` is collective: every rank asks for the same array, and the heap places it at
the same place on every rank: a byte range ``[offset, offset + nbytes)`` of one of its *segments*. A segment is a
:class:`~cupy_symbuf.SymBuffer` (an MPI shared-memory window on the host, a ``cudaMalloc`` mapped into every peer
through CUDA IPC on the GPU; with ``Communicator.transport == "staged"`` pinned host memory mapped into every GPU,
like the rings): one equally sized block per rank, every peer's block mapped here. Each rank gets back a plain
array over its own block's range. Allocations are collective and made in the same order, so the heap's state (its
segments, the free ranges in them) is the same on every rank; every allocation checks that by exchanging its
``(segment, offset, nbytes)`` in its agreement step. The receiver of a collective whose ``sendbuf`` is a
symmetric array copies its rows straight out of the sender's block (direct mode, one copy per byte, as MPI does
with cross-memory attach), named by ``(segment id, byte offset)``, instead of through the rings (two copies).

Segments grow collectively: an allocation that fits in no free range of a live segment makes a new segment, at
least twice the size of the newest one (from :data:`SEGMENT_MIN_BYTES`, the doubling capped at
:data:`SEGMENT_GROW_MAX_BYTES`; an array larger than that gets a segment of its own size). So thousands of live
arrays take a handful of MPI windows (each with its own communicator: MPI allows about a thousand) and, on the
GPU, a handful of rows of the kernels' symmetric table (``SYM_TABLE_ROWS``, one row per segment).

Lifetime. ``Communicator.free(a)`` is collective and gives the range back at once as far as the heap is
concerned, but the memory stays mapped and the range is not handed out again while ANY rank still holds an array
over it (a view of ``a``, ``a`` itself): at every later allocation (and free) each rank tells the others which
freed ranges it still holds arrays of, and only ranges that no rank holds are reused. A segment whose every range
is free is unmapped (the newest such one is kept for reuse). ``Communicator.close()`` unmaps every segment no rank
holds an array of; the others stay mapped until the process exits. So an array left over from a freed allocation
or a closed communicator reads the bytes it last had (and writes change nothing anyone reads): never a crash,
never another array's data. The collectives refuse such an array (``ValueError`` naming the argument).

The design follows PyTorch's symmetric memory (``torch.distributed._symmetric_memory.empty`` + ``rendezvous``,
its allocations sub-allocated from a pool) and NCCL's window registration (``ncclCommWindowRegister``):
collective allocation, peers' mappings exchanged once per segment, the buffer then used as an ordinary tensor.
"""
from __future__ import annotations

import math
import weakref
from typing import Optional

import numpy as np

from ..common import backend as _compat
from ..common.address import address_of
from ..common.log import logger
from ..wire import protocol as P
from .symbuffer import SymBuffer

__all__ = ["SymmetricHeap", "SymmetricAllocation", "SymmetricSegment", "SEGMENT_MIN_BYTES",
           "SEGMENT_GROW_MAX_BYTES", "ARRAY_ALIGN"]

#: Each rank's block of a segment starts on its own page: no false sharing between ranks.
BLOCK_ALIGN = 4096
#: Every array starts at a multiple of this many bytes of its segment (as ``cudaMalloc``'s alignment).
ARRAY_ALIGN = 256
#: Bytes per rank of the first segment; each new segment is at least twice the newest one ...
SEGMENT_MIN_BYTES = 1 << 20
#: ... up to this many bytes (an array larger than it gets a segment of its own size, page-rounded).
SEGMENT_GROW_MAX_BYTES = 64 << 20
#: The exchange label every allocation uses (empty / zeros / array are the same step on the wire).
_STEP = "Communicator.empty (symmetric allocation)"

#: Segments of closed communicators that some rank still held arrays of at close(): mapped until the process
#: exits (their windows / IPC mappings are released by MPI_Finalize and the CUDA driver then).
_KEPT_UNTIL_EXIT: list = []


_leased_memory_type = None


def _leased_memory(ptr: int, nbytes: int, device_id: int):
    """(GPU) One allocation's CuPy memory object: an ``UnownedMemory`` that takes weak references (CuPy's does
    not). Every view of the array holds it, so a weak reference to it says whether any array over the allocation
    is still alive in this process."""
    global _leased_memory_type
    if _leased_memory_type is None:
        class LeasedMemory(_compat.cupy.cuda.UnownedMemory):
            pass
        _leased_memory_type = LeasedMemory
    return _leased_memory_type(ptr, nbytes, None, device_id)


class SymmetricSegment:
    """One segment of the heap: a :class:`SymBuffer` of ``nbytes`` per rank and the free ranges in it (the same
    on every rank).

    Attributes
    ----------
    id : int
        Segment number, the same on every rank (the GPU kernels' symmetric table row holds ``id + 1``; direct-mode
        call headers name it).
    nbytes : int
        Bytes per rank.
    buffer : SymBuffer
        The blocks (``buffer.host_view(r)`` / ``buffer.peer_ptrs[r]``).
    registered : bool
        (GPU) Entered in the transport's symmetric table (direct mode possible).
    """

    __slots__ = ("id", "nbytes", "buffer", "registered", "holes", "used", "fresh")

    def __init__(self, id_: int, buffer: SymBuffer):
        self.id, self.buffer, self.nbytes = id_, buffer, buffer.nbytes
        self.registered = False
        self.holes = [[0, self.nbytes]]  # free [offset, bytes], sorted, never adjacent
        self.used = 0                    # live and freed-but-held allocations placed here
        self.fresh = True                # never handed out a range (its bytes are the zeros SymBuffer wrote)

    def fit(self, span: int) -> Optional[int]:
        """The offset a ``span``-byte range would get (first fit), or None."""
        for off, size in self.holes:
            if size >= span:
                return off
        return None

    def take(self, off: int, span: int) -> None:
        """Mark ``[off, off + span)`` used (it lies inside one free range)."""
        for i, (o, size) in enumerate(self.holes):
            if o <= off and off + span <= o + size:
                parts = [[o, off - o], [off + span, o + size - off - span]]
                self.holes[i: i + 1] = [h for h in parts if h[1] > 0]
                self.used += 1
                return
        raise AssertionError(f"symmetric segment {self.id}: [{off}, {off + span}) is not free")

    def give_back(self, off: int, span: int) -> None:
        holes = self.holes
        i = 0
        while i < len(holes) and holes[i][0] < off:
            i += 1
        holes.insert(i, [off, span])
        if i + 1 < len(holes) and off + span == holes[i + 1][0]:  # merge with the next
            holes[i][1] += holes.pop(i + 1)[1]
        if i > 0 and holes[i - 1][0] + holes[i - 1][1] == off:    # and the previous
            holes[i - 1][1] += holes.pop(i)[1]
        self.used -= 1

    @property
    def idle(self) -> bool:
        """No live array and no freed range still held anywhere."""
        return self.used == 0

    def peer_bytes(self, rank: int) -> np.ndarray:
        """(host) ``uint8 [nbytes]`` view of ``rank``'s block."""
        return self.buffer.host_view(rank)

    def __repr__(self) -> str:
        free = sum(s for _, s in self.holes)
        return f"SymmetricSegment(id={self.id}, nbytes={self.nbytes}, free={free})"


class SymmetricAllocation:
    """One collective allocation: its id, shape, dtype, where it lies (segment, offset) and this rank's array.

    Attributes
    ----------
    id : int
        Allocation number, the same on every rank.
    shape, dtype : tuple, numpy.dtype
        As allocated (the same on every rank).
    nbytes : int
        Bytes of the array per rank.
    segment : SymmetricSegment
        The segment it lies in; ``offset``: its first byte there (the same on every rank).
    base : int
        Address of this rank's array in this process.
    """

    __slots__ = ("id", "shape", "dtype", "nbytes", "segment", "offset", "span", "base", "array", "root",
                 "token_ref")

    def __init__(self, id_: int, shape: tuple, dtype: np.dtype, nbytes: int, segment: SymmetricSegment,
                 offset: int, span: int, array):
        self.id, self.shape, self.dtype, self.nbytes = id_, shape, dtype, nbytes
        self.segment, self.offset, self.span = segment, offset, span
        self.array = array  # held while live (None once freed: then only token_ref says whether views remain)
        self.root = _token(array)
        self.token_ref = weakref.ref(self.root)
        self.base = address_of(array)

    @property
    def buffer(self) -> SymBuffer:
        """The segment's :class:`SymBuffer`."""
        return self.segment.buffer

    @property
    def registered(self) -> bool:
        return self.segment.registered

    def viewed(self) -> bool:
        """Whether any array over this allocation is alive in this process."""
        return self.token_ref() is not None

    def peer_bytes(self, rank: int) -> np.ndarray:
        """(host) ``uint8 [nbytes]`` view of ``rank``'s copy of this array."""
        return self.segment.buffer.host_view(rank)[self.offset: self.offset + self.nbytes]

    def __repr__(self) -> str:
        return (f"SymmetricAllocation(id={self.id}, shape={self.shape}, dtype={self.dtype}, nbytes={self.nbytes}, "
                f"segment={self.segment.id}, offset={self.offset})")


def _root(a):
    """The NumPy array at the end of ``a``'s ``.base`` chain (NumPy), or CuPy's memory object."""
    if isinstance(a, np.ndarray):
        while isinstance(a.base, np.ndarray):
            a = a.base
        return a
    return a.data.mem


def _token(a):
    """What every array over one allocation holds, and nothing else does: the array made over its range by
    ``np.frombuffer`` (NumPy: the end of every view's ``.base`` chain), or its CuPy memory object
    (:func:`_leased_memory`). Weakly referenceable: a dead reference means no array over the allocation is left
    here."""
    return _root(a)


def _transport_of(buffer) -> str:
    """The rings' transport as a SymBuffer request: a symmetric array lives where its rings do."""
    t = getattr(buffer, "transport", None)
    return t if t in ("ipc", "staged") else "auto"


def _round(n: int, to: int) -> int:
    return -(-n // to) * to


class SymmetricHeap:
    """The symmetric arrays of one communicator (``Communicator.empty`` / ``zeros`` / ``array`` / ``free``),
    sub-allocated from a few collectively grown segments (see the module docstring).

    ``find(a)`` tells whether an array lies inside a live one (the collectives ask it per call: a short scan of
    the live allocations, newest first) and returns ``(segment, byte offset in the segment)``.

    Parameters
    ----------
    buffer : SymBuffer
        The communicator's rings: its ``bootstrap`` runs every allocation's agreement step, its backend and
        transport are the segments'.
    transport : Transport
        The communicator's engine; on the GPU each segment is entered in its symmetric table
        (``sym_register`` / ``sym_unregister``).
    timeout_s : float
        Bound of every agreement step.
    check_open : callable
        Raises unless the communicator may be used (called first by :meth:`empty` and :meth:`free`).
    on_broken : callable, optional
        ``on_broken(why)`` marks the communicator unusable: called when an agreement step fails with a
        :class:`~cupy_symbuf.SymBufferError` (a timeout, a peer that aborted or is closing, ranks out of step).
    """

    def __init__(self, buffer: SymBuffer, transport, timeout_s: float, check_open, on_broken=None):
        self.buffer, self.transport, self.timeout_s = buffer, transport, timeout_s
        self.check_open = check_open
        self.on_broken = on_broken
        self.backend, self.rank = buffer.backend, buffer.rank
        self._next_id = 0
        self._next_segment = 0
        self.allocations: list = []
        self._live: dict = {}   # id(token) -> live allocation (find / _owning per collective call: no scan)
        self.segments: list = []
        #: freed allocations whose range some rank may still hold arrays of (allocation id -> allocation, the same
        #: on every rank): recycled once every rank has reported that it holds no array over it
        self.freed: dict = {}
        self._freed_tokens: dict = {}  # id(token) -> freed allocation whose token is alive here (check_live)
        self._gone_here: list = []     # ids of freed allocations whose last array here died, not yet reported
        self._gone_count: dict = {}    # allocation id -> ranks that reported it gone
        self._warned_table = False

    # ---- collective allocation ----------------------------------------------------------------------------
    def empty(self, shape, dtype, what: str = "empty", err: Optional[BaseException] = None):
        """A new symmetric array of ``shape`` / ``dtype`` (collective; every rank passes the same). ``err``: an
        error the caller already found in its arguments (``Communicator.array``): it takes part in the agreement
        step and raises it, so the peers raise too instead of waiting."""
        op = f"Communicator.{what}"
        self.check_open()
        mine = None
        if err is None:
            try:
                shape = _shape(op, shape)
                dtype = np.dtype(dtype)
                if dtype.hasobject:
                    raise TypeError(f"{op}: dtype {dtype} holds Python objects; symmetric arrays hold raw bytes")
                if dtype.subdtype is not None:
                    raise TypeError(f"{op}: dtype {dtype} is a subarray dtype; pass its base dtype "
                                    f"{dtype.subdtype[0]} and add {dtype.subdtype[1]} to the shape")
                nbytes = math.prod(shape) * dtype.itemsize
                mine = (shape, dtype.str, str(dtype), self._next_id)
            except (TypeError, ValueError) as exc:
                err = exc
        span = _round(max(nbytes, 1), ARRAY_ALIGN) if mine is not None else 0
        place = self._place(span) if mine is not None else None  # (segment id, offset): new segment id if none fits
        report = list(self._gone_here)
        everyone = self._agree((mine, place, report, None if err is None else f"{type(err).__name__}: {err}"),
                               _STEP, op)
        self._recycle(report, [g for _, _, g, _ in everyone])  # the same on every rank, whatever is raised below
        if err is not None:
            raise err
        bad = [(r, e) for r, (_, _, _, e) in enumerate(everyone) if e is not None]
        if bad:
            raise ValueError(f"{op}: rank {bad[0][0]} rejected its arguments ({bad[0][1]}); nothing was allocated")
        for r, (theirs, _, _, _) in enumerate(everyone):
            if theirs != mine:
                raise ValueError(
                    f"{op}: every rank must allocate the same shape and dtype in the same order: rank "
                    f"{self.rank} asks for allocation {mine[3]} of shape {mine[0]} dtype {mine[2]}, rank {r} for "
                    f"allocation {theirs[3]} of shape {theirs[0]} dtype {theirs[2]}; nothing was allocated")
        for r, (_, theirs, _, _) in enumerate(everyone):
            if theirs != place:  # pragma: no cover - the heaps are deterministic; a difference is a library bug
                raise RuntimeError(
                    f"{op}: internal: the ranks' symmetric heaps differ: rank {self.rank} places allocation "
                    f"{mine[3]} ({span} B) at (segment, offset) {place}, rank {r} at {theirs}; nothing was allocated")
        seg_id, off = place
        seg = self._segment(seg_id)
        if seg is None:  # a new segment, on every rank alike
            seg = self._grow(op, seg_id, span, nbytes)
        try:
            seg.take(off, span)
            array, fresh = self._array(seg, off, nbytes, shape, dtype)
            if not fresh:
                self._zero(array, seg, off, nbytes)  # a reused range: zeroed, as a new block always was
        except BaseException:
            if seg.idle:
                self._drop(seg)
            raise
        alloc = SymmetricAllocation(self._next_id, shape, dtype, nbytes, seg, off, span, array)
        self._next_id += 1
        self.allocations.append(alloc)
        self._live[id(alloc.root)] = alloc
        self._trim()
        logger.debug("%s: symmetric allocation %d, shape %s dtype %s, %d B per rank at segment %d offset %d", op,
                     alloc.id, shape, dtype, nbytes, seg.id, off)
        return array

    def _place(self, span: int) -> tuple:
        """Where a ``span``-byte range goes: ``(segment id, offset)`` in the first live segment with a free range
        that fits (segments in the order made), else ``(the next segment id, 0)``."""
        for seg in self.segments:
            off = seg.fit(span)
            if off is not None:
                return seg.id, off
        return self._next_segment, 0

    def _grow(self, op: str, seg_id: int, span: int, nbytes: int) -> SymmetricSegment:
        """Make segment ``seg_id`` (collective) of at least ``span`` bytes per rank: twice the newest segment,
        from SEGMENT_MIN_BYTES up to SEGMENT_GROW_MAX_BYTES, or exactly ``span`` (page-rounded) when that is
        larger, or when the doubled size does not fit in memory (decided alike on every rank)."""
        need = _round(span, BLOCK_ALIGN)
        newest = self.segments[-1].nbytes if self.segments else 0
        grown = max(need, min(max(SEGMENT_MIN_BYTES, 2 * newest), SEGMENT_GROW_MAX_BYTES))
        boot = self.buffer.bootstrap
        try:
            try:
                buf = SymBuffer(boot, grown, backend=self.backend, timeout_s=self.timeout_s,
                                transport=_transport_of(self.buffer), _managed=True)
            except ValueError:  # the memory verdict, agreed on every rank: try the exact size
                if grown == need:
                    raise
                buf = SymBuffer(boot, need, backend=self.backend, timeout_s=self.timeout_s,
                                transport=_transport_of(self.buffer), _managed=True)
        except Exception as exc:  # on every rank alike (SymBuffer agrees first); e.g. out of memory, or windows
            msg = (f"{op}: symmetric allocation {self._next_id} of {nbytes} B per rank needs a new symmetric segment "
                   f"of {need} B or more, which failed ({len(self.allocations)} live symmetric arrays, "
                   f"{self.total_bytes} B per rank, in {len(self.segments)} segments of {self.segment_bytes} B per "
                   f"rank; each segment is an MPI window and communicator of its own): {exc}")
            try:
                wrapped = type(exc)(msg)
            except Exception:  # an error type with structured fields (mpi4py's MPI.Exception takes a code)
                wrapped = RuntimeError(msg)
            raise wrapped from exc
        seg = SymmetricSegment(seg_id, buf)
        self._next_segment = seg_id + 1
        self.segments.append(seg)
        if self.backend == "cuda":  # the kernels find its peers' blocks in the symmetric table (direct mode)
            seg.registered = bool(self.transport.sym_register(seg))
            if not seg.registered and not self._warned_table:
                self._warned_table = True
                logger.warning(
                    "%s: symmetric segment %d has no row in the GPU's symmetric table (SYM_TABLE_ROWS=%d rows, "
                    "%d segments live): sendbufs in it travel through the rings, not directly", op, seg_id,
                    P.SYM_TABLE_ROWS, len(self.segments))
        logger.debug("%s: symmetric segment %d of %d B per rank (%d segments)", op, seg_id, buf.nbytes,
                     len(self.segments))
        return seg

    def _array(self, seg: SymmetricSegment, off: int, nbytes: int, shape: tuple, dtype: np.dtype):
        """This rank's array over ``[off, off + nbytes)`` of ``seg``, made so that every view of it holds one
        object of its own (:func:`_token`); and whether those bytes are still the zeros of a new segment."""
        fresh = seg.fresh
        seg.fresh = False
        if self.backend == "host":
            # through a memoryview: the new array's .base is not an ndarray, so it ends every view's .base chain
            root = np.frombuffer(memoryview(seg.buffer.host_view(self.rank)[off: off + nbytes]), np.uint8)
            return root.view(dtype).reshape(shape), fresh
        cp = _compat.cupy
        buf = seg.buffer
        mem = _leased_memory(buf.peer_ptrs[self.rank] + off, nbytes,
                             buf.device_id if buf.transport == "staged" else -1)
        return cp.ndarray(shape, dtype, memptr=cp.cuda.MemoryPointer(mem, 0)), fresh

    def _zero(self, array, seg: SymmetricSegment, off: int, nbytes: int) -> None:
        if not nbytes:
            return
        if self.backend == "host":
            seg.buffer.host_view(self.rank)[off: off + nbytes] = 0
        else:
            _compat.cupy.cuda.runtime.memset(seg.buffer.peer_ptrs[self.rank] + off, 0, nbytes)

    def free(self, a) -> None:
        """Free the allocation ``a`` belongs to (collective: every rank frees the same allocation). Its range is
        reused only once no rank holds an array over it (see the module docstring)."""
        op = "Communicator.free"
        self.check_open()
        alloc = self._owning(a)
        mine = alloc.id if alloc is not None else None
        report = list(self._gone_here)
        everyone = self._agree((mine, report), op, op)
        self._recycle(report, [g for _, g in everyone])
        ids = [x for x, _ in everyone]
        if mine is None:
            raise ValueError(f"{op}: argument 'a' is not a live symmetric array of this communicator "
                             f"(Communicator.empty / zeros / array); nothing was freed")
        if any(x != mine for x in ids):
            raise ValueError(f"{op}: every rank must free the same allocation: rank {self.rank} frees "
                             f"allocation {mine}, the ranks free {ids}; nothing was freed")
        if self.backend == "cuda":
            _compat.cupy.cuda.runtime.deviceSynchronize()  # queued collectives may still read or write it
        self.allocations.remove(alloc)
        token = alloc.root
        del self._live[id(token)]
        alloc.array = alloc.root = None  # from now on only the arrays the program holds keep its token alive
        self.freed[alloc.id] = alloc
        self._freed_tokens[id(token)] = alloc
        gone, tokens, key = self._gone_here, self._freed_tokens, id(token)

        def last_array_gone(_ref, aid=alloc.id):  # (at garbage collection; appends only)
            tokens.pop(key, None)
            gone.append(aid)
        alloc.token_ref = weakref.ref(token, last_array_gone)
        del token
        self._trim()

    def _agree(self, obj, what: str, op: str) -> list:
        """The agreement step ``what`` of ``op`` (every rank's ``obj``, bounded by ``timeout_s``). While it waits,
        the communicator's abort word is read: a peer that aborted (an exception left its ``with`` block,
        ``abort()``, its program ended) releases this rank at once with its
        :class:`~cupy_symbuf.SymBufferAbortedError`; a peer found closing instead gives that error when the word
        is set, else the bootstrap's ``closing`` error naming it. Any such failure marks the communicator
        unusable (``on_broken``)."""
        from ..common.errors import SymBufferAbortedError, SymBufferError
        check = getattr(self.transport, "check_abort", None)
        try:
            return self.buffer.bootstrap.allgather(obj, self.timeout_s, what,
                                                   interrupt=None if check is None else (lambda: check(op)))
        except SymBufferAbortedError as exc:
            self._broken(exc)
            raise
        except SymBufferError as exc:
            if check is not None:
                try:
                    check(op)  # the abort word a failing peer set before it closed names it and its reason
                except SymBufferAbortedError as aborted:
                    self._broken(aborted)
                    raise aborted from exc
                except Exception:  # noqa: BLE001 - reading our own memory; the step's error stands
                    pass
            self._broken(exc)
            raise

    def _broken(self, exc: BaseException) -> None:
        if self.on_broken is not None:
            self.on_broken(f"{type(exc).__name__}: {exc}")

    def _recycle(self, mine: list, reports: list) -> None:
        """Count every rank's report of freed allocations whose last array there died (``reports``: one list of
        allocation ids per rank, from one agreement step, so the same on every rank; ``mine``: what this rank
        sent, now told); a range every rank has reported is given back to its segment."""
        del self._gone_here[:len(mine)]
        ready = []
        for report in reports:
            for aid in report:
                n = self._gone_count.get(aid, 0) + 1
                self._gone_count[aid] = n
                if n == len(reports):
                    ready.append(aid)
        for aid in sorted(ready):
            del self._gone_count[aid]
            f = self.freed.pop(aid)
            f.segment.give_back(f.offset, f.span)

    def _trim(self) -> None:
        """Unmap the idle segments (collective, the same ones on every rank), all but the newest idle one."""
        idle = [s for s in self.segments if s.idle]
        for seg in idle[:-1]:
            self._drop(seg)

    def _drop(self, seg: SymmetricSegment) -> None:
        self.segments.remove(seg)
        if self.backend == "cuda":
            _compat.cupy.cuda.runtime.deviceSynchronize()  # no queued kernel reads it any more
            self.transport.sym_unregister(seg)
        seg.buffer.close()

    def _segment(self, seg_id: int) -> Optional[SymmetricSegment]:
        for seg in self.segments:
            if seg.id == seg_id:
                return seg
        return None

    def close(self, on_slow=None, interrupt=None) -> None:
        """Release every segment (collective; from ``Communicator.close``), newest first; those that some rank
        still holds arrays over (live or freed) stay mapped until the process exits. ``on_slow`` (``(seconds,
        fn)``) and ``interrupt`` (polled): the bootstrap's, for the agreement step."""
        live, self.allocations = self.allocations, []
        self._live = {}
        for alloc in live:
            alloc.array = alloc.root = None
        gone = live + list(self.freed.values())
        self.freed, self._freed_tokens, self._gone_count = {}, {}, {}
        mine = sorted({a.segment.id for a in gone if a.viewed()})
        segments, self.segments = self.segments, []
        if not segments:
            return
        everyone = self.buffer.bootstrap.allgather(mine, self.timeout_s, "Communicator.close (symmetric arrays)",
                                                   role="close", on_slow=on_slow, interrupt=interrupt)
        held = set()
        for h in everyone:
            held.update(h)
        for seg in reversed(segments):
            if seg.id in held:
                _KEPT_UNTIL_EXIT.append(seg.buffer)
                logger.debug("Communicator.close: symmetric segment %d stays mapped (arrays over it are alive)",
                             seg.id)
            else:
                seg.buffer.close()

    def check_live(self, op: str, name: str, a) -> None:
        """``ValueError`` naming ``name`` when ``a`` is (a view of) a symmetric array this communicator has freed
        (its range may be reused once no rank holds it: the collectives refuse it)."""
        if not self._freed_tokens or not (isinstance(a, np.ndarray) or _compat.is_cupy_array(a)):
            return
        token = _token(a)
        f = self._freed_tokens.get(id(token))
        if f is not None and f.token_ref() is token:
            raise ValueError(f"{op}: argument '{name}' is a view of a symmetric array freed by "
                                 f"Communicator.free")

    # ---- lookup -------------------------------------------------------------------------------------------
    def _owning(self, a) -> Optional[SymmetricAllocation]:
        """The live allocation ``a`` is a view of (by the object every view of it holds, then by address)."""
        if not (isinstance(a, np.ndarray) or _compat.is_cupy_array(a)):
            return None
        token = _token(a)
        alloc = self._live.get(id(token))
        if alloc is not None and token is alloc.root:
            start = address_of(a)
            if a.nbytes == 0 or alloc.base <= start < alloc.base + alloc.nbytes:
                return alloc
        return None

    def find(self, a) -> Optional[tuple]:
        """``(segment, byte offset in it)`` when ``a`` is C-contiguous and lies wholly inside a live symmetric
        array, else None. The segment has ``id`` (what direct-mode headers and the GPU's table name),
        ``buffer`` (its SymBuffer), ``nbytes``, ``registered`` and ``peer_bytes(rank)``."""
        if not self.allocations or not a.flags.c_contiguous or a.nbytes == 0:
            return None
        alloc = self._owning(a)
        if alloc is None:
            return None
        off = address_of(a) - alloc.base
        if off + a.nbytes > alloc.nbytes:
            return None
        return alloc.segment, alloc.offset + off

    def by_id(self, id_: int) -> Optional[SymmetricSegment]:
        """The live segment numbered ``id_`` (a direct-mode call header's), or None."""
        return self._segment(id_)

    @property
    def in_use(self) -> bool:
        """Whether any symmetric array is live, or freed while an array of it is still alive here (then
        :meth:`find` and :meth:`check_live` may answer something other than None for a plain array's call)."""
        return bool(self.allocations or self._freed_tokens)

    @property
    def total_bytes(self) -> int:
        """Bytes per rank held by live symmetric arrays."""
        return sum(a.nbytes for a in self.allocations)

    @property
    def segment_bytes(self) -> int:
        """Bytes per rank of the live segments."""
        return sum(s.nbytes for s in self.segments)

    def describe(self) -> str:
        held = f"; {len(self.freed)} freed, still held by some rank" if self.freed else ""
        if not self.allocations:
            if not self.segments:
                return "  symmetric arrays: none"
            return (f"  symmetric arrays: none ({len(self.segments)} segment(s) of {self.segment_bytes} B per rank "
                    f"kept{held})")
        lines = [f"  symmetric arrays: {len(self.allocations)}, {self.total_bytes} B per rank "
                 f"({self.total_bytes / 2**20:.2f} MiB), in {len(self.segments)} {self.backend} segment(s) of "
                 f"{self.segment_bytes} B per rank on every rank{held}:"]
        for a in self.allocations[:32]:
            lines.append(f"    id {a.id}: shape {a.shape} dtype {a.dtype} = {a.nbytes} B (segment {a.segment.id} "
                         f"offset {a.offset})")
        if len(self.allocations) > 32:
            lines.append(f"    ... and {len(self.allocations) - 32} more")
        return "\n".join(lines)


def _shape(op: str, shape) -> tuple:
    if isinstance(shape, (int, np.integer)) and not isinstance(shape, bool):
        shape = (int(shape),)
    try:
        shape = tuple(shape)
    except TypeError:
        raise TypeError(f"{op}: argument 'shape' must be an int or a tuple of ints, got {shape!r}") from None
    for s in shape:
        if isinstance(s, bool) or not isinstance(s, (int, np.integer)) or int(s) < 0:
            raise ValueError(f"{op}: argument 'shape' must hold ints >= 0, got {shape!r}")
    return tuple(int(s) for s in shape)
