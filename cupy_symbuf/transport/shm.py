"""POSIX shared memory for the symmetric buffer when the bootstrap is not MPI (a ``torchrun`` job).

:class:`PosixSharedWindow` is what ``MPI.Win.Allocate_shared`` gives the host backend and the staged transport under
MPI: ``world_size`` parts of ``part_bytes`` each, every rank's part mapped in every process of the node. Rank 0
creates one POSIX shared-memory object (``shm_open``, ``O_CREAT | O_EXCL``, mode 0600, named
``/cupy_symbuf-<pid>-<random>``), sizes it and sends its name through the bootstrap; every rank maps it; once every
rank has reported (bounded: the bootstrap's allgather), rank 0 unlinks the name, on success and on every failure
alike. From then on the memory lives only in the mappings, so a crash of any rank later leaves nothing in
``/dev/shm``; only a rank 0 killed between creating the object and that exchange can leave one.

Layout: part ``r`` starts at ``r * part_bytes`` of one mapping (a multiple of the page size when ``part_bytes`` is),
so every part is page-aligned, as the staged transport needs and the host backend's 16-byte accesses expect.

The object duck-types the three window methods :class:`~cupy_symbuf.SymBuffer` calls: ``Sync()`` (a memory barrier:
a lock's acquire and release, on x86-64 a locked instruction, i.e. a full fence), ``Unlock_all()`` (nothing) and
``Free()`` (unmaps; local, no communication).
"""
from __future__ import annotations

import mmap
import os
import secrets
import threading

import numpy as np

__all__ = ["PosixSharedWindow", "NAME_PREFIX"]

#: Every object's name starts with this (``/dev/shm/cupy_symbuf-*`` on Linux).
NAME_PREFIX = "cupy_symbuf-"

_FENCE = threading.Lock()


def _shm_open(name: str, create: bool, nbytes: int = 0) -> int:
    """A file descriptor of the POSIX shared-memory object ``name`` (created with ``nbytes`` bytes when ``create``)."""
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    try:
        import _posixshmem  # CPython's binding of shm_open / shm_unlink (multiprocessing.shared_memory uses it)
        fd = _posixshmem.shm_open("/" + name, flags, 0o600)
    except ImportError:  # pragma: no cover - a Python without it: Linux's mount of the same objects
        fd = os.open(os.path.join("/dev/shm", name), flags, 0o600)
    if create:
        try:
            os.ftruncate(fd, nbytes)
        except BaseException:
            os.close(fd)
            _shm_unlink(name)
            raise
    return fd


def _shm_unlink(name: str) -> None:
    try:
        import _posixshmem
        _posixshmem.shm_unlink("/" + name)
    except ImportError:  # pragma: no cover
        os.unlink(os.path.join("/dev/shm", name))


class PosixSharedWindow:
    """``size`` parts of ``part_bytes`` bytes in one POSIX shared-memory mapping shared by the ranks of ``bootstrap``
    (all on one node); collective, bounded by ``timeout_s`` (:class:`CollectiveTimeoutError` naming the missing
    ranks). ``part(r)``: rank ``r``'s part as a ``uint8 [part_bytes]`` NumPy view.

    Raises ``RuntimeError`` on every rank naming the rank and the error when rank 0 cannot create the object or a
    rank cannot map it (e.g. ``/dev/shm`` full or missing).
    """

    def __init__(self, bootstrap, part_bytes: int, timeout_s: float, what: str = "SymBuffer construction"):
        self._map = None
        self.part_bytes = int(part_bytes)
        size, rank = bootstrap.size, bootstrap.rank
        total = self.part_bytes * size
        if total == 0:
            return
        name, err = None, None
        if rank == 0:
            try:
                name = f"{NAME_PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
                os.close(_shm_open(name, True, total))
            except Exception as exc:  # noqa: BLE001 - told to every rank
                name, err = None, f"{type(exc).__name__}: {exc}"
        try:
            name, err = bootstrap.bcast((name, err), timeout_s, what + " (shared memory named)")
            if err is not None:
                raise RuntimeError(f"{what}: rank 0 could not create a POSIX shared-memory object of {total} bytes: "
                                   f"{err}")
            mine = None
            try:
                fd = _shm_open(name, False)
                try:
                    self._map = mmap.mmap(fd, total, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
                finally:
                    os.close(fd)
            except Exception as exc:  # noqa: BLE001 - told to every rank
                mine = f"{type(exc).__name__}: {exc}"
            errs = bootstrap.allgather(mine, timeout_s, what + " (shared memory mapped)")
            bad = next(((r, e) for r, e in enumerate(errs) if e), None)
            if bad is not None:
                raise RuntimeError(f"{what}: rank {bad[0]} could not map the POSIX shared-memory object "
                                   f"/{name}: {bad[1]}")
        except BaseException:
            self.Free()
            raise
        finally:
            if rank == 0 and name is not None:
                try:
                    _shm_unlink(name)  # every rank has it mapped (or the construction failed): no name is left
                except FileNotFoundError:  # pragma: no cover
                    pass
        self._base = np.frombuffer(self._map, dtype=np.uint8)

    def part(self, r: int) -> np.ndarray:
        if self._map is None:
            return np.zeros(0, np.uint8)
        return self._base[r * self.part_bytes: (r + 1) * self.part_bytes]

    def Sync(self) -> None:  # noqa: N802 - the window method it stands for
        with _FENCE:
            pass

    def Unlock_all(self) -> None:  # noqa: N802
        pass

    def Free(self) -> None:  # noqa: N802
        """Unmap (local). Views still held elsewhere keep the mapping alive until they are gone."""
        m, self._map = self._map, None
        self._base = None
        if m is not None:
            try:
                m.close()
            except BufferError:  # a view is still exported: the mapping goes with the last one
                pass
