"""mpi4py-shaped all-to-all: ``Alltoall(sendbuf, recvbuf)`` and ``Alltoallv(sendbuf, recvbuf)`` taking mpi4py's
buffer specifications, so an mpi4py program ports by replacing ``comm.Alltoallv`` with ``c.Alltoallv``
(:meth:`Communicator.Alltoall` / :meth:`Communicator.Alltoallv` delegate here and carry the user documentation).

Buffer-spec rules from mpi4py (``src/mpi4py/MPI/msgbuffer.pxi``: ``message_simple`` for Alltoall,
``message_vector`` for Alltoallv), followed for the forms accepted here:

* a bare array ``buf``;
* ``[buf, datatype]``;
* Alltoall: ``[buf, count]``, ``[buf, (count, displ)]`` (a tuple or a list), ``[buf, count, datatype]``,
  ``[buf, (count, displ), datatype]``, ``[buf, count, displ, datatype]``: ``count`` elements to (from) every rank,
  the block of rank ``j`` at element ``displ + j * count``; ``count`` None: the buffer's elements after ``displ``
  divided by the world size (they must divide evenly); ``displ`` None: 0;
* Alltoallv: ``[buf, counts]``, ``[buf, (counts, displs)]`` (a tuple only: a list there is the counts),
  ``[buf, counts, datatype]``, ``[buf, (counts, displs), datatype]``, ``[buf, counts, displs, datatype]``: the
  block of rank ``j`` is ``counts[j]`` elements at element ``displs[j]``. ``counts`` a sequence of ``world_size``
  ints, or one int (every rank alike), or None (the buffer's ``n`` elements split as mpi4py does: rank ``j`` gets
  ``n // W + (j < n % W)``); ``displs`` a sequence, or one int ``d`` (rank ``j`` at ``j * d``), or None (packed in
  rank order: the running sum of the counts).

Counts and displacements are in elements of the datatype. Blocks may leave gaps and come in any order; receive
elements outside every block keep their values. The datatype may be left out: it is then the array's dtype
(mpi4py infers it from the buffer's format: float64 is MPI.DOUBLE, complex128 MPI.C_DOUBLE_COMPLEX, int32 MPI.INT).
Given, it is an ``MPI.Datatype`` (predefined only, or a ``Dup()`` of one), a typecode string as mpi4py's (``'d'``,
``'f'``, ``'i'``, ``'l'``, ``'Zd'``, ``'f8'``, ...) or a NumPy dtype / dtype name, and it must describe the array's
elements (its dtype; no reinterpretation of the bytes). Arrays: NumPy (host backend) or CuPy (cuda backend), or
DLPack tensors of that device; C- or Fortran-contiguous, any number of dimensions, viewed flat in memory order as
mpi4py does.

Where this is stricter than mpi4py (which hands the layout to MPI unchecked): a derived datatype is a
``TypeError``, a datatype that does not describe the array's dtype a ``TypeError``, a block outside its buffer or two
receive blocks that overlap a ``ValueError``, and ``recvbuf`` sharing memory with ``sendbuf`` a ``ValueError``
(MPI forbids the aliasing; ``MPI.IN_PLACE`` is not supported). Every such check runs on the calling rank before any
communication; a rejection is told to the peers (they raise :class:`~cupy_symbuf.SymBufferRejectedError`) and the
communicator stays usable.
"""
from __future__ import annotations

import sys
from typing import NamedTuple

import numpy as np

from ..common import backend as _compat
from ..common.address import address_range
from ..common.checks import as_array, type_name
from .alltoall import alltoall as _alltoall, alltoallv_displaced

__all__ = ["Alltoall", "Alltoallv", "Message", "message_block", "message_vector", "datatype_dtype"]

#: what every error says the rules are
RULES = "buffer-spec rules from mpi4py"


class Message:
    """One parsed buffer spec: ``flat`` (the backend's 1-D view of the buffer's memory, ``[n]`` elements of
    ``dtype``), ``counts`` and ``displs`` (int64 ``[world_size]``, in elements: rank ``j``'s block is
    ``flat[displs[j]:displs[j] + counts[j]]``)."""

    __slots__ = ("flat", "dtype", "counts", "displs")

    def __init__(self, flat, dtype, counts, displs):
        self.flat, self.dtype, self.counts, self.displs = flat, dtype, counts, displs


class _Spec(NamedTuple):
    buf: object
    counts: object
    displs: object
    datatype: object


def _mpi_module():
    """``mpi4py.MPI`` when the program has imported it (nothing is imported here: mpi4py is optional)."""
    return sys.modules.get("mpi4py.MPI")


def _is_mpi_datatype(obj) -> bool:
    mpi = _mpi_module()
    return mpi is not None and isinstance(obj, mpi.Datatype)


def _is_datatype(obj) -> bool:
    """What may stand in a spec's datatype slot: an ``MPI.Datatype``, a string (as mpi4py), a NumPy dtype or scalar
    type."""
    return (_is_mpi_datatype(obj) or isinstance(obj, (str, np.dtype)) or
            (isinstance(obj, type) and issubclass(obj, np.generic)))


def _is_array(obj) -> bool:
    return (isinstance(obj, np.ndarray) or _compat.is_cupy_array(obj) or hasattr(obj, "__dlpack__") or
            hasattr(obj, "__cuda_array_interface__"))


def _is_int(obj) -> bool:
    return isinstance(obj, (int, np.integer)) and not isinstance(obj, (bool, np.bool_))


def _combiner_name(mpi, code) -> str:
    for k in dir(mpi):
        if k.startswith("COMBINER_") and getattr(mpi, k) == code:
            return k
    return f"combiner {code}"


def datatype_dtype(op: str, name: str, datatype) -> np.dtype:
    """The NumPy dtype a spec's datatype stands for. ``MPI.Datatype``: predefined only, or a ``Dup()`` of one (the
    same type map; what ``mpi4py.util.dtlib.from_numpy_dtype`` returns); a derived one (e.g.
    ``MPI.DOUBLE.Create_contiguous(2)``) or ``MPI.DATATYPE_NULL``: ``TypeError`` naming ``name``; a string: mpi4py's
    typecodes (``'Zf'`` / ``'Zd'`` / ``'Zg'`` for the complex types) or any NumPy dtype string; a NumPy dtype or scalar
    type as it is."""
    if _is_mpi_datatype(datatype):
        mpi = _mpi_module()
        if datatype == mpi.DATATYPE_NULL:
            raise TypeError(f"{op}: argument '{name}' has datatype MPI.DATATYPE_NULL; a predefined MPI datatype "
                            f"(MPI.DOUBLE, MPI.INT, ...) or none (inferred from the array) is needed ({RULES})")
        combiner = datatype.Get_envelope()[-1]  # (counts of its arguments..., combiner)
        if combiner == mpi.COMBINER_DUP:  # the same type map (mpi4py.util.dtlib.from_numpy_dtype returns one)
            return datatype_dtype(op, name, datatype.Get_contents()[-1][0])
        if combiner != mpi.COMBINER_NAMED:  # a predefined datatype is the only one named by MPI itself
            what = _combiner_name(mpi, combiner)
            raise TypeError(f"{op}: argument '{name}' has a derived MPI datatype ({what}); only predefined "
                            f"datatypes (MPI.DOUBLE, MPI.INT, MPI.C_DOUBLE_COMPLEX, ...) are supported: describe the "
                            f"block with counts and displacements in elements instead ({RULES})")
        try:
            from mpi4py.util.dtlib import to_numpy_dtype
            return np.dtype(to_numpy_dtype(datatype))
        except Exception as exc:  # noqa: BLE001 - reported as the argument's error
            raise TypeError(f"{op}: argument '{name}' has MPI datatype {datatype.Get_name()}, which has no NumPy "
                            f"dtype ({exc})") from exc
    if isinstance(datatype, str):
        code = datatype
        if len(code) == 2 and code[0] == "Z" and code[1] in "fdg":  # mpi4py's complex typecodes
            code = code[1].upper()
        try:
            return np.dtype(code)
        except TypeError:
            raise TypeError(f"{op}: argument '{name}' has datatype {datatype!r}, which is no typecode mpi4py or "
                            f"NumPy knows ('d', 'f', 'i', 'l', 'Zd', 'f8', 'complex128', ...) ({RULES})") from None
    return np.dtype(datatype)


def _datatype_name(datatype) -> str:
    if _is_mpi_datatype(datatype):
        return datatype.Get_name() or "an MPI datatype"
    return repr(datatype)


def _flat(op: str, name: str, buf, backend: str, writable: bool):
    """The backend's 1-D view of ``buf``'s memory (mpi4py reads and writes the buffer as its memory in order)."""
    if buf is None:
        raise TypeError(f"{op}: argument '{name}' has no buffer (None; MPI.BOTTOM and MPI.IN_PLACE are not "
                        f"supported): pass a NumPy or CuPy array ({RULES})")
    a = as_array(op, name, buf, backend, min_ndim=0, contiguous=False)
    if a.flags.c_contiguous:
        flat = a.reshape(-1)
    elif a.flags.f_contiguous:
        flat = a.T.reshape(-1)  # memory order
    else:
        raise ValueError(f"{op}: argument '{name}' must be a contiguous array (C or Fortran order: the buffer is its "
                         f"memory), got shape {tuple(a.shape)} strides {tuple(a.strides)}")
    if writable and not getattr(a.flags, "writeable", True):  # CuPy arrays have no such flag (always writeable)
        raise ValueError(f"{op}: argument '{name}' must be writeable (the received elements are written into it)")
    return flat


def _unpack(op: str, name: str, spec, vector: bool) -> _Spec:
    """Split a spec into (buf, counts, displs, datatype) as mpi4py's ``message_vector`` (``vector``) or
    ``message_simple`` does."""
    if _is_array(spec):
        return _Spec(spec, None, None, None)
    if not isinstance(spec, (list, tuple)):
        raise TypeError(f"{op}: argument '{name}' must be an array or a list/tuple [buf, counts, displs, datatype] "
                        f"({RULES}), got {type_name(spec)}")
    pair = (tuple,) if vector else (tuple, list)  # mpi4py: (counts, displs) is a tuple; (count, displ) either
    counts = displs = datatype = None
    if len(spec) == 2:
        buf, counts = spec
        if _is_datatype(counts):
            counts, datatype = None, counts
        elif isinstance(counts, pair):
            counts, displs = _pair(op, name, counts)
    elif len(spec) == 3:
        buf, counts, datatype = spec
        if isinstance(counts, pair):
            counts, displs = _pair(op, name, counts)
    elif len(spec) == 4:
        buf, counts, displs, datatype = spec
    else:
        form = "[buf, counts, displs, datatype]" if vector else "[buf, count, displ, datatype]"
        raise ValueError(f"{op}: argument '{name}' must be an array or a list/tuple of 2 to 4 items {form} "
                         f"({RULES}), got {len(spec)} items")
    if datatype is not None and not _is_datatype(datatype):
        raise TypeError(f"{op}: argument '{name}' has datatype of type {type_name(datatype)}; an MPI.Datatype, a "
                        f"typecode string ('d', 'i', ...) or a NumPy dtype is needed ({RULES})")
    return _Spec(buf, counts, displs, datatype)


def _pair(op: str, name: str, pair):
    if len(pair) != 2:
        raise ValueError(f"{op}: argument '{name}' must give (counts, displs) as a pair, got {len(pair)} items "
                         f"({RULES})")
    return pair[0], pair[1]


def _typed_flat(op: str, name: str, s: _Spec, backend: str, writable: bool):
    flat = _flat(op, name, s.buf, backend, writable)
    if s.datatype is None:
        if flat.dtype.kind == "V":
            raise TypeError(f"{op}: argument '{name}' has dtype {flat.dtype}, which no predefined MPI datatype "
                            f"describes (mpi4py cannot infer one either); view it as plain integers of its size "
                            f"({RULES})")
        return flat, np.dtype(flat.dtype)
    dt = datatype_dtype(op, name, s.datatype)
    if dt != flat.dtype:
        raise TypeError(f"{op}: argument '{name}' has datatype {_datatype_name(s.datatype)} ({dt}), which does not "
                        f"describe the array's elements ({flat.dtype}); pass the matching datatype, or none (it is "
                        f"inferred from the array) ({RULES})")
    return flat, dt


def _int(op: str, name: str, what: str, value) -> int:
    if not _is_int(value):
        raise TypeError(f"{op}: argument '{name}' {what} must be an int, got {type_name(value)} ({RULES})")
    return int(value)


def _ints(op: str, name: str, what: str, value, world_size: int) -> np.ndarray:
    """``value`` (a sequence or array of ``world_size`` ints) as int64 ``[world_size]``."""
    if _compat.is_cupy_array(value):
        value = value.get()
    arr = np.asarray(value)
    if arr.dtype == object or not (np.issubdtype(arr.dtype, np.integer) or arr.size == 0) or \
            arr.dtype == np.bool_:
        raise TypeError(f"{op}: argument '{name}' {what} must hold ints, got dtype {arr.dtype} ({RULES})")
    if arr.shape != (world_size,):
        raise ValueError(f"{op}: argument '{name}' {what} must have one entry per rank (world_size = {world_size}), "
                         f"got shape {arr.shape} ({RULES})")
    if arr.size and (int(arr.max()) > np.iinfo(np.int64).max // 2 or int(arr.min()) < -(np.iinfo(np.int64).max // 2)):
        raise ValueError(f"{op}: argument '{name}' {what} must fit in int64 (< 2**62), got {arr.tolist()}")
    return arr.astype(np.int64)


def message_vector(op: str, name: str, spec, world_size: int, backend: str, *, writable: bool) -> Message:
    """Parse an Alltoallv buffer spec (see the module docstring) and check its blocks: counts >= 0, each block of
    a positive count inside the buffer, and (``writable``: a receive buffer) no two blocks overlapping. Raises
    ``TypeError`` / ``ValueError`` naming ``name``."""
    s = _unpack(op, name, spec, vector=True)
    flat, dt = _typed_flat(op, name, s, backend, writable)
    W, n = world_size, int(flat.shape[0])
    if s.counts is None:  # mpi4py: the n elements split over the ranks, the first n % W get one more
        counts = np.full(W, n // W, np.int64)
        counts[:n % W] += 1
    elif _is_int(s.counts):
        counts = np.full(W, int(s.counts), np.int64)
    else:
        counts = _ints(op, name, "counts", s.counts, W)
    if (counts < 0).any():
        raise ValueError(f"{op}: argument '{name}' counts must be >= 0, got {counts.tolist()} ({RULES})")
    if s.displs is None:  # packed in rank order
        displs = np.cumsum(counts) - counts
    elif _is_int(s.displs):  # strided
        displs = np.arange(W, dtype=np.int64) * int(s.displs)
    else:
        displs = _ints(op, name, "displs", s.displs, W)
    nz = counts > 0
    bad = nz & ((displs < 0) | (displs + counts > n))
    if bad.any():
        j = int(np.argmax(bad))
        raise ValueError(f"{op}: argument '{name}': the block of rank {j} ({counts[j]} elements at displacement "
                         f"{displs[j]}) must lie inside the buffer's {n} elements (0 <= displs[j] and displs[j] + "
                         f"counts[j] <= {n}, in elements of the datatype; {RULES})")
    if writable and int(nz.sum()) > 1:
        order = np.flatnonzero(nz)[np.argsort(displs[nz], kind="stable")]
        ends = displs[order] + counts[order]
        clash = ends[:-1] > displs[order[1:]]
        if clash.any():
            k = int(np.argmax(clash))
            a, b = int(order[k]), int(order[k + 1])
            raise ValueError(f"{op}: argument '{name}': the blocks of ranks {a} ([{displs[a]}, {ends[k]})) and {b} "
                             f"([{displs[b]}, {displs[b] + counts[b]})) overlap; every received element needs a "
                             f"place of its own ({RULES})")
    return Message(flat, dt, counts, displs)


def message_block(op: str, name: str, spec, world_size: int, backend: str, *, writable: bool) -> Message:
    """Parse an Alltoall buffer spec (see the module docstring): the ``Message`` of ``world_size`` equal blocks
    (``counts`` all equal, ``displs[j] = displ + j * count``). Raises ``TypeError`` / ``ValueError`` naming
    ``name``."""
    s = _unpack(op, name, spec, vector=False)
    flat, dt = _typed_flat(op, name, s, backend, writable)
    W, n = world_size, int(flat.shape[0])
    displ = 0 if s.displs is None else _int(op, name, "displ", s.displs)
    if not 0 <= displ <= n:
        raise ValueError(f"{op}: argument '{name}' displ must be in [0, {n}] (the buffer's elements), got {displ} "
                         f"({RULES})")
    if s.counts is None:
        if (n - displ) % W:
            raise ValueError(f"{op}: argument '{name}': cannot infer the count: the buffer's {n - displ} elements"
                             f"{f' after displ {displ}' if displ else ''} are not a multiple of world_size = {W} "
                             f"({RULES})")
        count = (n - displ) // W
    else:
        count = _int(op, name, "count", s.counts)
        if count < 0:
            raise ValueError(f"{op}: argument '{name}' count must be >= 0, got {count} ({RULES})")
        if displ + W * count > n:
            raise ValueError(f"{op}: argument '{name}': world_size x count = {W} x {count} elements from displ "
                             f"{displ} must fit in the buffer's {n} elements ({RULES})")
    counts = np.full(W, count, np.int64)
    return Message(flat, dt, counts, displ + np.arange(W, dtype=np.int64) * count)


def _check_pair(op: str, snd: Message, rcv: Message, rank: int, backend: str) -> None:
    """What one rank can check of a send and receive spec together: the same datatype (the self block must match),
    the self block's counts, no shared memory."""
    if snd.dtype != rcv.dtype:
        raise TypeError(f"{op}: argument 'recvbuf' has datatype {rcv.dtype} but 'sendbuf' {snd.dtype}; they must be "
                        f"the same predefined datatype (no conversion on the way)")
    if snd.counts[rank] != rcv.counts[rank]:
        raise ValueError(f"{op}: argument 'recvbuf' expects {rcv.counts[rank]} elements from this rank ({rank}) but "
                         f"'sendbuf' sends it {snd.counts[rank]}; the counts of a rank's block to itself must agree")
    if snd.flat.size and rcv.flat.size:
        slo, shi = address_range(snd.flat)
        rlo, rhi = address_range(rcv.flat)
        if slo < rhi and rlo < shi:
            raise ValueError(f"{op}: argument 'recvbuf' shares memory with 'sendbuf' (MPI forbids the aliasing; "
                             f"MPI.IN_PLACE is not supported): pass separate buffers")


def _checked_messages(eng, op: str, parse, sendbuf, recvbuf, collective: str):
    """``(snd, rcv)``: ``sendbuf`` and ``recvbuf`` read by ``parse`` (:func:`message_block` or
    :func:`message_vector`) and checked together, every check before the first step; a rejection is told to the
    peers (the ``collective`` they call), then re-raised."""
    eng.check_open()
    W, backend = eng.world_size, eng.backend
    try:
        snd = parse(op, "sendbuf", sendbuf, W, backend, writable=False)
        rcv = parse(op, "recvbuf", recvbuf, W, backend, writable=True)
        _check_pair(op, snd, rcv, eng.rank, backend)
    except BaseException:
        eng.reject(collective, notify=False)
        raise
    return snd, rcv


def Alltoall(eng, sendbuf, recvbuf) -> None:
    """See :meth:`Communicator.Alltoall` (``eng``: its engine)."""
    snd, rcv = _checked_messages(eng, "Alltoall", message_block, sendbuf, recvbuf, "alltoall")
    W, count = eng.world_size, int(snd.counts[0])  # (checked: W blocks of count elements fit from each displ)
    s0, r0 = int(snd.displs[0]), int(rcv.displs[0])
    _alltoall(eng, snd.flat[s0:s0 + W * count].reshape(W, count), rcv.flat[r0:r0 + W * count].reshape(W, count))


def Alltoallv(eng, sendbuf, recvbuf) -> None:
    """See :meth:`Communicator.Alltoallv` (``eng``: its engine)."""
    snd, rcv = _checked_messages(eng, "Alltoallv", message_vector, sendbuf, recvbuf, "alltoallv")
    alltoallv_displaced(eng, snd.flat, snd.counts, snd.displs, rcv.flat, rcv.counts, rcv.displs)
