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

__all__ = ["read_into", "supported"]


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


def read_into(pid: int, address: int, dst: np.ndarray) -> None:
    """Copy ``dst.nbytes`` bytes at ``address`` in process ``pid`` into ``dst`` (C-contiguous). Raises ``OSError``
    with the kernel's errno (EPERM: not allowed; EFAULT: the range is not mapped there; ESRCH: no such process)."""
    n = dst.nbytes
    done = 0
    base = dst.__array_interface__["data"][0]
    local, remote = _IOVec(), _IOVec()
    while done < n:
        local.iov_base, local.iov_len = base + done, n - done
        remote.iov_base, remote.iov_len = address + done, n - done
        got = _readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if got <= 0:
            err = ctypes.get_errno() if got < 0 else 0
            raise OSError(err, f"process_vm_readv of {n - done} bytes at {address + done:#x} in pid {pid}: "
                               f"{os.strerror(err) if err else 'nothing read'}")
        done += got
