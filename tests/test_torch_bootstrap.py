"""torchrun jobs without MPI (tests/torchrun_cases.py: 2 ranks, gloo, host backend): alltoall / alltoallv /
dispatch-combine against NumPy, the bounded construction wait, a withdrawn exchange, the end of the job on a
failure, no POSIX shared memory left behind; and the package imports with mpi4py blocked.

The torchrun jobs run from a pytest process that is not an MPI rank (``make test``'s unit stage), once."""
import glob
import os
import subprocess
import sys

import pytest

from _jobs import ROOT, UNDER_MPIEXEC

torch = pytest.importorskip("torch")
jobs = pytest.mark.skipif(UNDER_MPIEXEC, reason="torchrun jobs run from the pytest process that is not an MPI rank")

SHM = "/dev/shm/cupy_symbuf-*"


def _torchrun(case: str, timeout: float = 150.0) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "PMIX_", "OMPI_", "HYDI_", "MPIR_"))}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    env["CUPY_SYMBUF_ABORT_ON_FAILURE"] = "1"  # the default (the pytest process turns it off for itself)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(ROOT, "tests", "torchrun_cases.py"), case]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def _passes(case: str, ranks=(0, 1)) -> subprocess.CompletedProcess:
    """Run ``case``: the job must exit 0 with the case's OK line from each of ``ranks``."""
    r = _torchrun(case)
    assert r.returncode == 0, r.stdout + r.stderr
    for rank in ranks:
        assert f"CASE {case} OK rank {rank}" in r.stdout, r.stdout + r.stderr
    return r


@pytest.fixture
def no_shm_left():
    before = set(glob.glob(SHM))
    yield
    left = set(glob.glob(SHM)) - before
    assert not left, f"POSIX shared memory left behind: {sorted(left)}"


@jobs
def test_torchrun_collectives_match_numpy(no_shm_left):
    _passes("correct")


@jobs
def test_torchrun_construction_wait_is_bounded(no_shm_left):
    r = _passes("never", ranks=(0,))
    assert "rank 0 raised: Communicator construction: timeout after 1.5 s on rank 0: rank 1 never arrived" in r.stdout


@jobs
def test_torchrun_late_peer_sees_withdrawn():
    _passes("withdrawn")


@jobs
def test_torchrun_failure_ends_the_job(no_shm_left):
    r = _torchrun("abort")
    assert r.returncode != 0, r.stdout + r.stderr
    assert "exiting with status 1 (os._exit) so the job ends" in r.stderr, r.stderr
    assert "SymBufferAbortedError" in r.stderr or "abort" in r.stderr.lower()
    assert "CLOSE RETURNED" not in r.stdout and "CASE abort OK" not in r.stdout


_NO_MPI = r"""
import importlib, sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "mpi4py" or name.startswith("mpi4py."):
            raise ImportError("mpi4py is blocked in this test")
sys.meta_path.insert(0, Block())
import cupy_symbuf
faces = ["adaptive", "autograd", "config", "deepep", "delta", "dtypes", "errors", "hierarchical", "layout",
         "low_latency", "quant", "symbuffer", "symmetric", "topology", "tuning", "utils", "communicator"]
for name in faces:
    importlib.import_module("cupy_symbuf." + name)
from cupy_symbuf.transport.bootstrap import as_bootstrap
try:
    as_bootstrap(None)
except RuntimeError as exc:
    assert "torchrun" in str(exc) and "mpiexec" in str(exc), exc
else:
    raise AssertionError("as_bootstrap(None) without torch.distributed or mpi4py returned")
assert not any(m.startswith("mpi4py") for m in sys.modules), sorted(m for m in sys.modules if "mpi" in m)
print("IMPORTED", len(faces))
"""


def test_import_without_mpi4py():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "PMIX_", "OMPI_", "HYDI_"))}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", _NO_MPI], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0 and "IMPORTED 17" in r.stdout, r.stdout + r.stderr
