"""Cross-memory attach (Linux ``process_vm_readv``): one rank copies bytes straight out of another process's
memory, one copy, done by the kernel. MPICH and Open MPI move large intranode messages this way; here the host
engine uses it for plain NumPy sendbufs (``protocol.MODE_CMA``), so a receiver copies its rows straight out of
the sender's array instead of through the rings.

It needs the kernel to allow it (same user; Yama ``ptrace_scope`` 0, or a ptracer grant): :func:`probe` finds out
at construction, on every pair of ranks, and the engine uses it only when every rank can read every other.
``CUPY_SYMBUF_CMA=0`` turns it off.
"""
from __future__ import annotations

import ctypes
import os
import sys

import numpy as np

from ..common.address import address_of

__all__ = ["Reader", "read_into", "supported"]


class _IOVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


def _load():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.process_vm_readv
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_ssize_t
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(_IOVec), ctypes.c_ulong, ctypes.POINTER(_IOVec), ctypes.c_ulong,
                   ctypes.c_ulong]
    return fn


_readv = _load()


def supported() -> bool:
    """This process can call ``process_vm_readv`` at all (Linux, libc has it)."""
    return _readv is not None


class Reader:
    """:func:`read_into` between raw addresses with its two ``iovec`` made once (no ctypes objects per call): one per
    user that never reads from two threads at once (a transport: its calls are serialised by the call guard)."""

    __slots__ = ("local", "remote", "_args")

    def __init__(self):
        self.local, self.remote = _IOVec(), _IOVec()
        self._args = (ctypes.byref(self.local), 1, ctypes.byref(self.remote), 1, 0)

    def read(self, pid: int, address: int, dst_address: int, n: int) -> None:
        """Copy ``n`` bytes at ``address`` in process ``pid`` to ``dst_address`` in this process (which must hold
        ``n`` writeable bytes there). Raises ``OSError`` as :func:`read_into`."""
        local, remote = self.local, self.remote
        done = 0
        while done < n:
            local.iov_base, local.iov_len = dst_address + done, n - done
            remote.iov_base, remote.iov_len = address + done, n - done
            got = _readv(pid, *self._args)
            if got <= 0:
                _raise(got, pid, address + done, n - done)
            done += got


def _raise(got: int, pid: int, address: int, n: int):
    err = ctypes.get_errno() if got < 0 else 0
    raise OSError(err, f"process_vm_readv of {n} bytes at {address:#x} in pid {pid}: "
                       f"{os.strerror(err) if err else 'nothing read'}")


def read_into(pid: int, address: int, dst: np.ndarray) -> None:
    """Copy ``dst.nbytes`` bytes at ``address`` in process ``pid`` into ``dst`` (C-contiguous). Raises ``OSError``
    with the kernel's errno (EPERM: not allowed; EFAULT: the range is not mapped there; ESRCH: no such process)."""
    n = dst.nbytes
    done = 0
    base = address_of(dst) if n else 0
    local, remote = _IOVec(), _IOVec()
    while done < n:
        local.iov_base, local.iov_len = base + done, n - done
        remote.iov_base, remote.iov_len = address + done, n - done
        got = _readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if got <= 0:
            _raise(got, pid, address + done, n - done)
        done += got
