"""Whole MPI jobs started from a pytest process (the fault cases, the soak, the examples): the launcher, a clean
environment, one runner. Such tests run only from a pytest process that is not itself an MPI rank (a nested mpiexec
inside ``mpiexec -n N pytest`` would run every job N times): ``UNDER_MPIEXEC``. ``MPIEXEC`` names the launcher
(default the venv's ``mpiexec`` next to ``sys.executable``)."""
from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_MPI_ENV = ("PMI_RANK", "PMI_SIZE", "PMI_FD", "PMI_PORT", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE", "HYDI_CONTROL_FD")
UNDER_MPIEXEC = any(k in os.environ for k in _MPI_ENV)


def _launcher() -> list:
    if os.environ.get("MPIEXEC"):
        return shlex.split(os.environ["MPIEXEC"])
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if os.path.exists(here):
        return [here]
    found = shutil.which("mpiexec") or shutil.which("mpirun")
    return [found] if found else []


LAUNCHER = _launcher()


def _launcher_kind() -> str:
    if not LAUNCHER:
        return "none"
    try:
        out = subprocess.run(LAUNCHER + ["--version"], capture_output=True, text=True, timeout=20).stdout
    except Exception:  # noqa: BLE001
        return "unknown"
    if "HYDRA" in out.upper():
        return "hydra"
    if "Open MPI" in out or "OpenRTE" in out or "open-mpi" in out.lower():
        return "openmpi"
    return "unknown"


#: "hydra" (MPICH), "openmpi", "unknown" or "none" (no launcher, or this process is itself a rank)
KIND = _launcher_kind() if not UNDER_MPIEXEC else "none"


def clean_env(**overrides) -> dict:
    """This process's environment without the MPI launcher's variables (a child job must not think it is one of
    our ranks), unbuffered, plus ``overrides``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "PMIX_", "OMPI_COMM_WORLD", "HYDI_"))}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(overrides)
    return env


def mpi_command(n: int, argv: list, *, cleanup: bool = True) -> list:
    """``mpiexec -n n <argv>`` for this launcher (Open MPI oversubscribes; ``cleanup=False``: hydra's
    ``-disable-auto-cleanup``, so survivors of a dead rank must leave on their own)."""
    cmd = list(LAUNCHER) + (["--oversubscribe"] if KIND == "openmpi" else [])
    if not cleanup:
        cmd += ["-disable-auto-cleanup"]
    return cmd + ["-n", str(n)] + list(argv)


def run_job(cmd: list, env: dict, timeout_s: float) -> tuple:
    """Run ``cmd`` (from the repository root, its own process group); ``(returncode, output, killed)``: a job
    still running after ``timeout_s`` is killed with its whole process group."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
        return proc.returncode, out, False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)      # the launcher's process group: the job we started
        out, _ = proc.communicate()
        return proc.returncode, out, True
