"""torchrun jobs without MPI (tests/torchrun_cases.py: 2 ranks, gloo, host backend): alltoall / alltoallv /
dispatch-combine against NumPy, the bounded construction wait, a withdrawn exchange, the end of the job on a
failure, an exception on one rank (its traceback printed, torchrun's root cause naming it, the job over in seconds),
no POSIX shared memory left behind; and the package imports with mpi4py blocked.

The torchrun jobs run from a pytest process that is not an MPI rank (``make test``'s unit stage), once."""
import glob
import os
import re
import subprocess
import sys
import time

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


def _root_cause_rank(stderr: str):
    """The global rank torchrun's failure summary names under "Root Cause (first observed failure)", or None."""
    m = re.search(r"Root Cause \(first observed failure\):\s*\[0\]:.*?^\s*rank\s*:\s*(\d+)", stderr, re.S | re.M)
    return None if m is None else int(m[1])


def _after_fault(r: subprocess.CompletedProcess, ended: float, label: str = "") -> float:
    """Seconds from rank 1's ``FAULT t=`` line to ``label``'s ``t=`` on rank 1 (or to the job's end)."""
    fault = re.search(r"FAULT t=([0-9.]+) rank 1", r.stdout)
    assert fault, r.stdout + r.stderr
    if label:
        m = re.search(label + r" t=([0-9.]+) rank 1", r.stdout)
        assert m, f"rank 1 printed no {label} line\n" + r.stdout + r.stderr
        return float(m[1]) - float(fault[1])
    return ended - float(fault[1])


@jobs
@pytest.mark.parametrize("case", ["raise_with", "raise_nowith"])
def test_torchrun_exception_on_one_rank(case, no_shm_left):
    """Rank 1 raises RuntimeError (inside ``with``, or with the communicator open), ``timeout_s`` 30: rank 0 is
    released by the abort word and ends the job; rank 1 does not wait for it in close(), its traceback is printed,
    and torchrun's summary names rank 1 as the root cause (rank 0 waits for rank 1 to end first)."""
    r = _torchrun(case)
    ended = time.time()
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    assert "CASE " + case + " OK" not in r.stdout and "alltoall returned" not in out, out
    where = "inside" if case == "raise_with" else "outside"
    # rank 1's own traceback, printed by Python in the worker (torch.distributed's excepthook prefixes "[rank1]: ")
    own = "\n".join(line[len("[rank1]: "):] for line in r.stderr.splitlines() if line.startswith("[rank1]: "))
    assert re.search(r"(?m)^RuntimeError: injected failure on rank 1 " + where + " 'with'$", own), out
    assert re.search(r'torchrun_cases\.py", line \d+, in body\n', own), out
    # rank 0 saw rank 1's abort and said so
    assert re.search(r"cupy_symbuf: rank 0: .*aborted by rank 1", r.stderr), out
    if case == "raise_with":  # rank 1's close() returned at once: its exit handler ran
        assert _after_fault(r, ended, "EXITING") < 5.0, out
    assert _after_fault(r, ended) < 15.0, out  # the job ended long before timeout_s (30 s)
    assert _root_cause_rank(r.stderr) == 1, out
    if case == "raise_nowith":  # record() wrote rank 1's error file: the summary shows its exception
        assert re.search(r"Root Cause[\s\S]*RuntimeError: injected failure on rank 1", r.stderr), out


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


@jobs
def test_torchrun_a_rank_leaving_during_an_allocation_step(no_shm_left):
    """tests/test_leaving.py's allocation-step case over the torch bootstrap (close steps numbered apart, the
    closing key read by the other steps' waits)."""
    _passes("alloc_leave")


@jobs
def test_torchrun_a_program_ending_with_the_communicator_open(no_shm_left):
    """tests/test_leaving.py's program-end case under torchrun: rank 0 is released in seconds, not timeout_s."""
    r = _passes("exit_leave", ranks=(0,))
    assert "LEAVING rank 1" in r.stdout, r.stdout + r.stderr


def test_import_without_mpi4py():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "PMIX_", "OMPI_", "HYDI_"))}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", _NO_MPI], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0 and "IMPORTED 17" in r.stdout, r.stdout + r.stderr


@jobs
def test_torchrun_construction_retried_after_a_timeout(no_shm_left):
    """A construction retried on the same group after a timed-out one (rank 1 late) works at once: the timed-out
    exchange's store keys are never read again (each bootstrap has its own key prefix, each exchange its number)."""
    _passes("retry")
