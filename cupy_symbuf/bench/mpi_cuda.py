"""The CUDA-aware MPI reference of ``python -m cupy_symbuf.bench`` (``--references mpi``, row ``mpi-cuda``):
``MPI.COMM_WORLD.Alltoall`` / ``Alltoallv`` called directly on the CuPy arrays (mpi4py takes objects with
``__cuda_array_interface__`` / DLPack; the current stream is synchronised before every call, as MPI does not order
itself against CUDA streams). Where NCCL cannot run (ranks sharing a GPU) it is the peer baseline of ``vs_peer``.

Whether the MPI library takes device pointers is decided before any device array reaches it (a library without
CUDA support would read device addresses as host memory and crash the process), in this order:

1. ``CUPY_SYMBUF_MPI_CUDA=1`` / ``=0`` in the environment: forced on / off;
2. ``mpi4py.MPI.Query_cuda_support()`` where mpi4py has it;
3. ``MPIX_Query_cuda_support()`` of the loaded ``libmpi`` through ctypes (Open MPI's CUDA extension; MPICH has
   it too): 0 means no;
4. Open MPI without that symbol: ``ompi_info --parsable --all``'s ``mpi_built_with_cuda_support:value``;
5. none of these: skipped ("cannot tell").

When the answer is yes, one tiny ``Alltoall`` of device arrays is checked against the expected bytes before the
row is timed (and every timed size is checked once more). Any "no" or failure skips the row on every rank with the
reason printed once.
"""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from typing import Optional

import numpy as np
from mpi4py import MPI

__all__ = ["cuda_support", "skip_reason", "alltoall_fn", "alltoallv_fn"]

_STATE = {"why": 0}  # decided once per run: 0 = not yet, None = usable, str = why not


def _loaded_libmpi() -> list:
    paths = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                p = line.split()[-1] if line.strip() else ""
                if "/libmpi" in p and ".so" in p and p not in paths:
                    paths.append(p)
    except OSError:
        pass
    return paths


def _ompi_info_cuda(libs: list) -> Optional[bool]:
    """Open MPI's ``mpi_built_with_cuda_support`` (``ompi_info`` beside the loaded library, else on PATH), or None."""
    cands = [os.path.join(os.path.dirname(os.path.dirname(p)), "bin", "ompi_info") for p in libs]
    cands = [p for p in cands if os.access(p, os.X_OK)] + ([shutil.which("ompi_info")] if shutil.which("ompi_info")
                                                           else [])
    for exe in cands:
        try:
            out = subprocess.run([exe, "--parsable", "--all"], capture_output=True, text=True, timeout=60).stdout
        except (OSError, subprocess.SubprocessError):
            continue
        for line in out.splitlines():
            if "mpi_built_with_cuda_support:value:" in line:
                return line.rsplit(":", 1)[1].strip().lower() in ("true", "1", "yes")
    return None


def cuda_support() -> tuple:
    """``(True | False | None, how it was told)`` for this process's MPI library (no device array touched)."""
    env = os.environ.get("CUPY_SYMBUF_MPI_CUDA", "").strip().lower()
    if env in ("1", "true", "yes", "on"):
        return True, "CUPY_SYMBUF_MPI_CUDA=1"
    if env in ("0", "false", "no", "off"):
        return False, "CUPY_SYMBUF_MPI_CUDA=0"
    q = getattr(MPI, "Query_cuda_support", None)
    if q is not None:
        try:
            return bool(q()), "mpi4py.MPI.Query_cuda_support()"
        except Exception:  # noqa: BLE001 - fall through to the library's own symbol
            pass
    libs = _loaded_libmpi()
    for p in libs:
        try:
            fn = getattr(ctypes.CDLL(p), "MPIX_Query_cuda_support", None)
        except OSError:
            continue
        if fn is not None:
            fn.restype, fn.argtypes = ctypes.c_int, []
            return bool(fn()), f"MPIX_Query_cuda_support() of {os.path.basename(p)}"
    if "open mpi" in MPI.Get_library_version().lower():
        b = _ompi_info_cuda(libs)
        if b is not None:
            return b, "ompi_info mpi_built_with_cuda_support"
    return None, "no MPIX_Query_cuda_support in the MPI library and no ompi_info answer"


def _probe(comm) -> Optional[str]:
    """One tiny Alltoall of device arrays, checked. None when right, else why not (collective)."""
    from ..common import backend as _compat
    cp = _compat.cupy
    W, me = comm.Get_size(), comm.Get_rank()
    n = 16
    host = (np.arange(W * n, dtype=np.int64).reshape(W, n) + 1000 * me) % 251
    x = cp.asarray(host.astype(np.uint8))
    y = cp.zeros_like(x)
    want = np.stack([((np.arange(W * n).reshape(W, n) + 1000 * j) % 251)[me] for j in range(W)]).astype(np.uint8)
    err = None
    try:
        cp.cuda.get_current_stream().synchronize()
        comm.Alltoall([x, MPI.BYTE], [y, MPI.BYTE])
        if not np.array_equal(y.get(), want):
            err = "a probe Alltoall of device arrays gave wrong bytes"
    except Exception as exc:  # noqa: BLE001 - reported as the skip reason
        err = f"a probe Alltoall of device arrays failed: {type(exc).__name__}: {exc}"
    return next((e for e in comm.allgather(err) if e), None)


def skip_reason(c, comm) -> Optional[str]:
    """Why the ``mpi-cuda`` row cannot run (the same on every rank), or None; decided once per run."""
    if c.backend != "cuda":
        return "host backend (its MPI reference is the 'mpi' row: MPI.Alltoall of the NumPy arrays)"
    if _STATE["why"] != 0:
        return _STATE["why"]
    ok, how = cuda_support()
    why = None if ok else (f"MPI has no CUDA support ({how})" if ok is False else
                           f"cannot tell whether MPI takes device arrays ({how}); CUPY_SYMBUF_MPI_CUDA=1 forces it")
    why = next((w for w in comm.allgather(why) if w), None)
    if why is None:
        why = _probe(comm)
    _STATE["why"] = why
    return why


def alltoall_fn(comm, x, expected):
    """The function to time: ``Alltoall`` of ``x`` (CuPy, ``[W, per_peer]`` bytes) into one reused output; checked
    once against ``expected`` (NumPy) first."""
    from ..common import backend as _compat
    cp = _compat.cupy
    y = cp.empty_like(x)
    sspec, rspec = [x, MPI.BYTE], [y, MPI.BYTE]

    def run():
        cp.cuda.get_current_stream().synchronize()
        comm.Alltoall(sspec, rspec)
    run()
    if not comm.allreduce(bool(np.array_equal(y.get(), expected)), op=MPI.LAND):
        raise RuntimeError("bench: CUDA-aware MPI Alltoall gave wrong data; not timing it")
    return run


def alltoallv_fn(comm, x, counts, recv_counts, row_bytes: int, expected):
    """``Alltoallv`` of ``x`` (CuPy rows of ``row_bytes``) with ``counts`` rows to each rank, ``recv_counts`` from
    each; checked once against ``expected`` (NumPy rows) first."""
    from ..common import backend as _compat
    cp = _compat.cupy
    counts = np.asarray(counts, np.int64)
    recv_counts = np.asarray(recv_counts, np.int64)
    sdisp = np.concatenate([[0], np.cumsum(counts)[:-1]]) * row_bytes
    rdisp = np.concatenate([[0], np.cumsum(recv_counts)[:-1]]) * row_bytes
    y = cp.empty((max(1, int(recv_counts.sum())), row_bytes), np.uint8)
    xs = x if x.size else cp.empty((1, row_bytes), np.uint8)  # no zero-byte device buffer handed to MPI
    sspec = [xs, (counts * row_bytes, sdisp), MPI.BYTE]
    rspec = [y, (recv_counts * row_bytes, rdisp), MPI.BYTE]

    def run():
        cp.cuda.get_current_stream().synchronize()
        comm.Alltoallv(sspec, rspec)
    run()
    got = y.get()[: int(recv_counts.sum())]
    if not comm.allreduce(bool(np.array_equal(got, expected)), op=MPI.LAND):
        raise RuntimeError("bench: CUDA-aware MPI Alltoallv gave wrong data; not timing it")
    return run
