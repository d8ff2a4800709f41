"""Symmetric arrays: NumPy / CuPy arrays that live in symmetric memory, so collectives on them can skip staging.

``Communicator.empty(shape, dtype)`` is collective: every rank allocates one equally sized block (a
:class:`~cupy_symbuf.SymBuffer` of its own: an MPI shared-memory window on the host, a ``cudaMalloc`` mapped into
every peer through CUDA IPC on the GPU; with ``Communicator.transport == "staged"`` pinned host memory mapped into
every GPU, like the rings) and gets back a plain array over its own block. Every rank makes the same
allocations in the same order, so an allocation is named by its number (its *id*), the same on every rank, and a
peer's block of allocation ``id`` is mapped here: the receiver of a collective whose ``sendbuf`` is a symmetric
array copies its rows straight out of the sender's block (direct mode, one copy per byte, as MPI does with
cross-memory attach), instead of through the rings (two copies).

The design follows PyTorch's ``torch.distributed._symmetric_memory.empty`` + ``rendezvous`` and NCCL's window
registration (``ncclCommWindowRegister``): collective allocation, peers' mappings exchanged once, the buffer then
used as an ordinary tensor.

Lifetime: the blocks are freed collectively, by :meth:`Communicator.free` or :meth:`Communicator.close`. An array
(or a view of it) used after that points at freed memory: do not keep them past ``close()``.
"""
from __future__ import annotations

import math
import weakref
from typing import Optional

import numpy as np

from ..common import backend as _compat
from ..common.log import logger
from .symbuffer import SymBuffer

__all__ = ["SymmetricHeap", "SymmetricAllocation"]


class SymmetricAllocation:
    """One collective allocation: its id, shape, dtype, this rank's array and every rank's block.

    Attributes
    ----------
    id : int
        Allocation number, the same on every rank.
    shape, dtype : tuple, numpy.dtype
        As allocated (the same on every rank).
    nbytes : int
        Bytes per rank.
    buffer : SymBuffer
        The blocks (``buffer.host_view(r)`` / ``buffer.peer_ptrs[r]``).
    base : int
        Address of this rank's block in this process.
    """

    __slots__ = ("id", "shape", "dtype", "nbytes", "buffer", "base", "array", "root", "registered")

    def __init__(self, id_: int, shape: tuple, dtype: np.dtype, nbytes: int, buffer: SymBuffer, array):
        self.id, self.shape, self.dtype, self.buffer = id_, shape, dtype, buffer
        self.nbytes = nbytes  # the array's bytes (each rank's block is padded to BLOCK_ALIGN)
        self.array = array
        self.root = _root(array)
        self.base = _address(array)
        self.registered = False  # GPU: entered in the transport's symmetric table (direct mode possible)

    def peer_bytes(self, rank: int) -> np.ndarray:
        """(host) ``uint8 [nbytes]`` view of ``rank``'s block."""
        return self.buffer.host_view(rank)

    def __repr__(self) -> str:
        return f"SymmetricAllocation(id={self.id}, shape={self.shape}, dtype={self.dtype}, nbytes={self.nbytes})"


def _address(a) -> int:
    """Address of the first byte of ``a`` (NumPy: the data pointer; CuPy: ``data.ptr``)."""
    if isinstance(a, np.ndarray):
        return a.__array_interface__["data"][0]
    return int(a.data.ptr)


def _root(a):
    """What owns ``a``'s memory: the NumPy array at the end of its ``.base`` chain, or CuPy's memory object. Views
    of a symmetric array share it; an array left over from a freed allocation (whose address a new allocation may
    reuse) does not, so it is never taken for the new one."""
    if isinstance(a, np.ndarray):
        while isinstance(a.base, np.ndarray):
            a = a.base
        return a
    return a.data.mem


def _transport_of(buffer) -> str:
    """The rings' transport as a SymBuffer request: a symmetric array lives where its rings do."""
    t = getattr(buffer, "transport", None)
    return t if t in ("ipc", "staged") else "auto"


#: Each rank's block of a symmetric array starts on its own page: no false sharing between ranks, aligned rows.
BLOCK_ALIGN = 4096
#: The exchange label every allocation uses (empty / zeros / array are the same step on the wire).
_STEP = "Communicator.empty (symmetric allocation)"


class SymmetricHeap:
    """The symmetric allocations of one communicator (``Communicator.empty`` / ``zeros`` / ``array`` / ``free``).

    ``find(a)`` tells whether an array lies inside one of them (the collectives ask it per call: a short scan of
    the live allocations, newest first).

    Parameters
    ----------
    buffer : SymBuffer
        The communicator's rings: its ``bootstrap`` runs every allocation's agreement step, its backend and
        transport are the allocations'.
    transport : Transport
        The communicator's engine; on the GPU each allocation is entered in its symmetric table
        (``sym_register`` / ``sym_unregister``).
    timeout_s : float
        Bound of every agreement step.
    check_open : callable
        Raises unless the communicator may be used (called first by :meth:`empty` and :meth:`free`).
    """

    def __init__(self, buffer: SymBuffer, transport, timeout_s: float, check_open):
        self.buffer, self.transport, self.timeout_s = buffer, transport, timeout_s
        self.check_open = check_open
        self.backend, self.rank = buffer.backend, buffer.rank
        self._next_id = 0
        self.allocations: list = []
        #: what owned the memory of freed allocations (weakly): an array left over from one is refused by the
        #: collectives (check_live) instead of being read or written after its memory was unmapped
        self._freed: dict = {}  # id(owner) -> weak reference to it (NumPy arrays are not hashable)

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
        boot = self.buffer.bootstrap
        timeout = self.timeout_s
        everyone = boot.allgather((mine, None if err is None else f"{type(err).__name__}: {err}"), timeout, _STEP)
        if err is not None:
            raise err
        bad = [(r, e) for r, (_, e) in enumerate(everyone) if e is not None]
        if bad:
            raise ValueError(f"{op}: rank {bad[0][0]} rejected its arguments ({bad[0][1]}); nothing was allocated")
        for r, (theirs, _) in enumerate(everyone):
            if theirs != mine:
                raise ValueError(
                    f"{op}: every rank must allocate the same shape and dtype in the same order: rank "
                    f"{self.rank} asks for allocation {mine[3]} of shape {mine[0]} dtype {mine[2]}, rank {r} for "
                    f"allocation {theirs[3]} of shape {theirs[0]} dtype {theirs[2]}; nothing was allocated")
        try:
            buf = SymBuffer(boot, -(-max(nbytes, 1) // BLOCK_ALIGN) * BLOCK_ALIGN, backend=self.backend,
                            timeout_s=timeout, transport=_transport_of(self.buffer), _managed=True)
        except Exception as exc:  # on every rank alike (SymBuffer agrees first); e.g. out of memory, or windows
            many = len(self.allocations) >= 256  # each is an MPI window and communicator of its own
            msg = (f"{op}: symmetric allocation {self._next_id} of {nbytes} B per rank failed "
                   f"({len(self.allocations)} live, {self.total_bytes} B per rank"
                   f"{'; each is an MPI window and communicator of its own, and MPI allows about a thousand' if many else ''}"
                   f"): {exc}")
            try:
                wrapped = type(exc)(msg)
            except Exception:  # an error type with structured fields (its own message says what failed)
                raise exc from None
            raise wrapped from exc
        try:
            # a byte view of the block, cut to the array (so a zero-size array is still a view of its allocation)
            if self.backend == "host":
                raw = buf.host_view(self.rank)
            else:
                raw = buf.peer_view(self.rank, np.uint8, (buf.nbytes,))
            array = raw[:nbytes].view(dtype).reshape(shape)
        except BaseException:
            buf.close()
            raise
        alloc = SymmetricAllocation(self._next_id, shape, dtype, nbytes, buf, array)
        if self.backend == "cuda":  # the kernels find its peers' blocks in the symmetric table (direct mode)
            alloc.registered = self.transport.sym_register(alloc)
        logger.debug("%s: symmetric allocation %d, shape %s dtype %s, %d B per rank", op, alloc.id, shape, dtype,
                     nbytes)
        self._next_id += 1
        self.allocations.append(alloc)
        return array

    def free(self, a) -> None:
        """Free the allocation ``a`` belongs to (collective: every rank frees the same allocation)."""
        op = "Communicator.free"
        self.check_open()
        alloc = self._owning(a)
        mine = alloc.id if alloc is not None else None
        everyone = self.buffer.bootstrap.allgather(mine, self.timeout_s, op)
        if mine is None:
            raise ValueError(f"{op}: argument 'a' is not a live symmetric array of this communicator "
                             f"(Communicator.empty / zeros / array); nothing was freed")
        if any(x != mine for x in everyone):
            raise ValueError(f"{op}: every rank must free the same allocation: rank {self.rank} frees "
                             f"allocation {mine}, the ranks free {everyone}; nothing was freed")
        if self.backend == "cuda":
            _compat.cupy.cuda.runtime.deviceSynchronize()  # queued collectives may still read or write it
        self.allocations.remove(alloc)
        if self.backend == "cuda":
            self.transport.sym_unregister(alloc)
        self._freed = {k: r for k, r in self._freed.items() if r() is not None}  # drop the collected ones
        try:
            self._freed[id(alloc.root)] = weakref.ref(alloc.root)
        except TypeError:  # an owner that takes no weak reference (CuPy's memory object): a strong one (small; it
            root = alloc.root  # owns no device memory, SymBuffer freed that), which also keeps its id unique
            self._freed[id(root)] = lambda: root
        alloc.buffer.close()

    def close(self) -> None:
        """Free every allocation (collective; from ``Communicator.close``), newest first."""
        while self.allocations:
            self.allocations.pop().buffer.close()

    def check_live(self, op: str, name: str, a) -> None:
        """``ValueError`` naming ``name`` when ``a`` is (a view of) a symmetric array this communicator has freed:
        its memory is unmapped, so any access would crash the process or hit another allocation."""
        if not self._freed or not (isinstance(a, np.ndarray) or _compat.is_cupy_array(a)):
            return
        root = _root(a)
        ref = self._freed.get(id(root))
        if ref is not None and ref() is root:
            raise ValueError(f"{op}: argument '{name}' is a view of a symmetric array freed by Communicator.free; "
                             f"its memory is unmapped")

    # ---- lookup -------------------------------------------------------------------------------------------
    def _owning(self, a) -> Optional[SymmetricAllocation]:
        """The live allocation ``a`` is a view of (by what owns its memory, then by address), or None."""
        if not (isinstance(a, np.ndarray) or _compat.is_cupy_array(a)):
            return None
        root = _root(a)
        start = _address(a)
        for alloc in reversed(self.allocations):
            if root is alloc.root and (a.nbytes == 0 or alloc.base <= start < alloc.base + alloc.nbytes):
                return alloc
        return None

    def find(self, a) -> Optional[tuple]:
        """``(allocation, byte offset)`` when ``a`` is C-contiguous and lies wholly inside a live symmetric
        allocation, else None."""
        if not self.allocations or not a.flags.c_contiguous or a.nbytes == 0:
            return None
        alloc = self._owning(a)
        if alloc is None:
            return None
        off = _address(a) - alloc.base
        if off + a.nbytes > alloc.nbytes:
            return None
        return alloc, off

    def by_id(self, id_: int) -> Optional[SymmetricAllocation]:
        for alloc in self.allocations:
            if alloc.id == id_:
                return alloc
        return None

    @property
    def total_bytes(self) -> int:
        """Bytes per rank held by live symmetric arrays."""
        return sum(a.nbytes for a in self.allocations)

    def describe(self) -> str:
        if not self.allocations:
            return "  symmetric arrays: none"
        lines = [f"  symmetric arrays: {len(self.allocations)}, {self.total_bytes} B per rank "
                 f"({self.total_bytes / 2**20:.2f} MiB), each its own {self.backend} allocation on every rank:"]
        for a in self.allocations:
            lines.append(f"    id {a.id}: shape {a.shape} dtype {a.dtype} = {a.nbytes} B")
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
