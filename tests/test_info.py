"""cupy_symbuf.info() and ``python -m cupy_symbuf info``: the report has its fields and the real values of this
process (versions from the imported modules, the resolved backend, the Communicator's buffer map)."""
import json
import subprocess
import sys

import numpy as np
from mpi4py import MPI

import cupy_symbuf as cs
from cupy_symbuf.diagnostics import info as _info


def test_info_fields():
    r = cs.info()
    assert r["cupy_symbuf"] == cs.__version__ and r["numpy"] == np.__version__
    assert r["protocol_version"] == cs.wire.protocol.PROTOCOL_VERSION
    assert r["mpi_library"] and r["backend_auto"] in ("host", "cuda")
    assert r["host"]["cpu"].endswith("/cores=%d" % (__import__("os").cpu_count() or 1))
    assert r["gpus"]["available"] == cs.common.backend.cuda_available()
    json.dumps(r, default=str)  # serialisable


def test_info_cli_with_communicator(capsys):
    assert _info.main(["--json", "--backend", "host"]) == 0
    out = capsys.readouterr().out
    if MPI.COMM_WORLD.Get_rank() == 0:
        r = json.loads(out)
        assert r["communicator"]["world_size"] == MPI.COMM_WORLD.Get_size()
        assert "SymBuffer layout" in r["communicator"]["describe"]
    else:
        assert out == ""


def test_module_entry_point():
    if MPI.COMM_WORLD.Get_size() > 1:
        return  # a subprocess per rank would start its own MPI job: once, from the single-process run
    from _jobs import clean_env
    env = clean_env()
    p = subprocess.run([sys.executable, "-m", "cupy_symbuf", "info", "--no-communicator"], capture_output=True,
                       text=True, timeout=120, env=env)
    assert p.returncode == 0 and "cupy_symbuf: " in p.stdout, p.stdout + p.stderr
    p = subprocess.run([sys.executable, "-m", "cupy_symbuf", "nonsense"], capture_output=True, text=True, timeout=60,
                       env=env)
    assert p.returncode == 2 and "unknown command" in p.stderr


def test_info_cuda_without_gpu_is_one_line(monkeypatch, capsys):
    """``info --backend cuda`` where CuPy is missing: exit code 1 and one line on stderr saying no CUDA device is
    available (it was a Communicator traceback, or with --no-communicator a report of a backend that cannot run)."""
    monkeypatch.setattr(cs.common.backend, "cupy", None)
    for extra in ([], ["--no-communicator"], ["--json"]):
        assert _info.main(["--backend", "cuda"] + extra) == 1
        cap = capsys.readouterr()
        assert cap.out == "" and cap.err.count("\n") == 1, cap
        assert "no CUDA device" in cap.err and "CuPy is not installed" in cap.err and "--backend host" in cap.err


def test_module_entry_point_cuda_without_gpu():
    """The same through ``python -m cupy_symbuf info --backend cuda`` on a machine without a GPU: no traceback."""
    if MPI.COMM_WORLD.Get_size() > 1 or cs.common.backend.cuda_available():
        return  # the real machine has a GPU: nothing to refuse (the in-process test above fakes its absence)
    from _jobs import clean_env
    p = subprocess.run([sys.executable, "-m", "cupy_symbuf", "info", "--backend", "cuda"], capture_output=True,
                       text=True, timeout=120, env=clean_env())
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stdout + p.stderr
    assert p.stderr.count("\n") == 1 and "no CUDA device is available" in p.stderr, p.stderr
