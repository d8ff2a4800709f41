"""The application examples as whole MPI jobs: ``examples/embedding.py``, ``examples/fft_transpose.py``,
``examples/fft_transpose_mpi4py.py`` and ``examples/moe_layer.py``, each run in a subprocess under ``mpiexec -n N``
(as ``tests/test_faults.py`` runs the soak), checked on exit status 0 and on the check line the example prints after
comparing its result with its own NumPy reference (bitwise for the embedding lookup, a float64-derived tolerance for
the FFT and the MoE layer), and on its communication-share lines (not the mpi4py FFT's, which times nothing).
``--corrupt`` runs change one value after the exchange and must exit 1 with ``WRONG DATA``: the checks can fail.

Like the fault tests these run only from a pytest process that is not itself an MPI rank (a nested mpiexec inside
``mpiexec -n N pytest`` would run every job N times). Environment: ``MPIEXEC`` (launcher command, default the venv's
``mpiexec`` next to ``sys.executable``), ``CUPY_SYMBUF_EXAMPLE_BACKEND`` (else ``CUPY_SYMBUF_FAULT_BACKEND``, else
``host``; ``cuda`` on a GPU machine), ``CUPY_SYMBUF_TIMEOUT_S`` (default 20 here).
"""
from __future__ import annotations

import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
BACKEND = os.environ.get("CUPY_SYMBUF_EXAMPLE_BACKEND", os.environ.get("CUPY_SYMBUF_FAULT_BACKEND", "host"))
LIMIT_S = 180                        # per job; a hang fails the test

from _jobs import LAUNCHER, UNDER_MPIEXEC, clean_env, mpi_command, run_job  # noqa: E402

pytestmark = pytest.mark.skipif(UNDER_MPIEXEC, reason="example jobs launch their own mpiexec; they run from the "
                                                      "single-process pytest pass")


def run_example(script: str, n: int, *args: str):
    """``mpiexec -n n python examples/<script> --backend BACKEND <args>``: (exit status, stdout + stderr)."""
    if not LAUNCHER:
        pytest.skip("no mpiexec found (set MPIEXEC)")
    env = clean_env()
    env.setdefault("CUPY_SYMBUF_TIMEOUT_S", "20")
    rc, out, killed = run_job(mpi_command(n, [sys.executable, os.path.join(EXAMPLES, script), "--backend", BACKEND,
                                              *args]), env, LIMIT_S)
    if killed:
        pytest.fail(f"{script} on {n} ranks did not end within {LIMIT_S} s\n{out[-4000:]}")
    return rc, out


def _share(out: str, label: str) -> float:
    """The percentage on the line ``<label> ... communication share ... NN.N%``."""
    m = re.search(re.escape(label) + r"[^\n]*communication share of the \w+ (\d+(?:\.\d+)?)%", out)
    assert m, f"no communication share line for {label!r}\n{out[-4000:]}"
    return float(m[1])


# ---- embedding ----------------------------------------------------------------------------------------------------

EMB_SMALL = ("--rows", "5000", "--dim", "32", "--batch", "2048", "--iters", "3", "--warmup", "1")


@pytest.mark.parametrize("n,extra", [
    (2, ()),
    (3, ("--rows", "1001", "--zipf", "1.2")),         # uneven row blocks (333/334), skewed ids: rank 0 is hot
    (2, ("--dtype", "float16", "--batch", "1")),       # a batch of one id: some ranks send nothing
], ids=["n2", "n3-uneven-zipf", "n2-fp16-one-id"])
def test_embedding(n, extra):
    rc, out = run_example("embedding.py", n, *EMB_SMALL, *extra)
    assert rc == 0, out[-4000:]
    assert re.search(r"check vs single-table NumPy lookup \(bitwise[^\n]*: correct$", out, re.M), out[-4000:]
    assert "WRONG DATA" not in out, out[-4000:]
    ours = _share(out, "cupy_symbuf:")
    assert 0.0 < ours <= 100.0
    if BACKEND == "host":
        assert 0.0 < _share(out, "MPI.Alltoallv:") <= 100.0
    else:
        assert re.search(r"NCCL: communication share|peer baseline skipped: \S", out), out[-4000:]
    # one line per engine per rank, each checked
    assert len(re.findall(r"^\s+cupy_symbuf\s+\|\s+\d+ \|[^\n]*\| correct$", out, re.M)) == n, out[-4000:]


def test_embedding_corrupt_fails():
    rc, out = run_example("embedding.py", 2, *EMB_SMALL, "--corrupt")
    assert rc == 1, out[-4000:]
    assert re.search(r"check vs single-table NumPy lookup[^\n]*: WRONG DATA$", out, re.M), out[-4000:]
    assert re.search(r"^\s+cupy_symbuf\s+\|\s+1 \|[^\n]*WRONG DATA \(1 rows differ\)$", out, re.M), out[-4000:]


# ---- distributed 2-D FFT ------------------------------------------------------------------------------------------

FFT_SMALL = ("--iters", "3", "--warmup", "1")


@pytest.mark.parametrize("n,extra", [
    (2, ("--n", "256", "--scaling")),
    (3, ("--n", "100", "--scaling")),                  # uneven row blocks: 34, 34, 32
    (4, ("--n", "5", "--dtype", "complex64")),         # blocks of 2 rows: 2, 2, 1, 0
], ids=["n2-scaling", "n3-uneven-scaling", "n4-tiny-complex64"])
def test_fft_transpose(n, extra):
    rc, out = run_example("fft_transpose.py", n, *FFT_SMALL, *extra)
    assert rc == 0, out[-4000:]
    assert re.search(r"^check vs numpy\.fft\.fft2 [^\n]*: correct$", out, re.M), out[-4000:]
    assert len(re.findall(r"\| correct$", out, re.M)) == n, out[-4000:]
    assert 0.0 < _share(out, "") <= 100.0
    if "--scaling" in extra:
        m = re.search(r"strong scaling: 1 rank [\d.]+ us[^\n]*, %d ranks [\d.]+ us: speedup ([\d.]+)x, "
                      r"efficiency ([\d.]+)%%" % n, out)
        assert m and float(m[1]) > 0 and float(m[2]) > 0, out[-4000:]


def test_fft_transpose_corrupt_fails():
    rc, out = run_example("fft_transpose.py", 2, *FFT_SMALL, "--n", "64", "--corrupt")
    assert rc == 1, out[-4000:]
    assert re.search(r"^check vs numpy\.fft\.fft2 [^\n]*: WRONG DATA$", out, re.M), out[-4000:]


# ---- the same FFT as a plain mpi4py program, ported by one line (c.Alltoallv) --------------------------------------

@pytest.mark.parametrize("n,extra", [
    (1, ("--n", "33")),
    (3, ("--n", "100")),                               # uneven slabs 34, 33, 33: the Alltoallv counts differ
    (4, ("--n", "6", "--dtype", "complex64")),         # slabs 2, 2, 1, 1
    (3, ("--n", "2")),                                 # fewer rows than ranks: rank 2 owns none
], ids=["n1", "n3-uneven", "n4-tiny-complex64", "n3-empty-rank"])
def test_fft_transpose_mpi4py(n, extra):
    rc, out = run_example("fft_transpose_mpi4py.py", n, *extra)
    assert rc == 0, out[-4000:]
    assert re.search(r"^check vs numpy\.fft\.fft2 [^\n]*: correct$", out, re.M), out[-4000:]
    assert "WRONG DATA" not in out, out[-4000:]


def test_fft_transpose_mpi4py_is_one_line_from_mpi4py():
    """The example's only cupy_symbuf lines: the import, the communicator made beside the call, and the call that
    replaces the (commented) original mpi4py line with the same arguments."""
    import ast
    with open(os.path.join(EXAMPLES, "fft_transpose_mpi4py.py")) as f:
        text = f.read()
    after_docstring = ast.parse(text).body[0].end_lineno
    code = [ln for ln in text.splitlines()[after_docstring:] if ln.strip()]
    ours = [ln for ln in code if "cupy_symbuf" in ln or re.match(r"\s*c\.", ln)]
    assert [ln.split("#")[0].strip() for ln in ours] == [
        "import cupy_symbuf", "c = cupy_symbuf.Communicator(comm, backend=args.backend)",
        "c.Alltoallv([sendbuf, (scounts, sdispls), mpi_type], [recvbuf, (rcounts, rdispls), mpi_type])"], ours
    assert "# comm.Alltoallv([sendbuf, (scounts, sdispls), mpi_type], [recvbuf, (rcounts, rdispls), mpi_type])" in code


def test_fft_transpose_mpi4py_corrupt_fails():
    rc, out = run_example("fft_transpose_mpi4py.py", 2, "--n", "64", "--corrupt")
    assert rc == 1, out[-4000:]
    assert re.search(r"^check vs numpy\.fft\.fft2 [^\n]*: WRONG DATA$", out, re.M), out[-4000:]


# ---- MoE layer ----------------------------------------------------------------------------------------------------

MOE_SMALL = ("--tokens", "128", "--hidden", "128", "--topk", "4", "--inter", "32", "--dtype", "fp32",
             "--iters", "3", "--warmup", "1")


@pytest.mark.parametrize("n,experts", [(2, "16"), (4, "32")], ids=["n2", "n4"])
def test_moe_layer(n, experts):
    rc, out = run_example("moe_layer.py", n, *MOE_SMALL, "--experts", experts)
    assert rc == 0, out[-4000:]
    assert re.search(r"^RESULT: PASS$", out, re.M), out[-4000:]
    assert len(re.findall(r"check rank \d+: max \|y - ref\| / tol = ([\d.]+) \(<= 1 passes\)", out)) == n, \
        out[-4000:]
    per_rank = re.findall(r"rank \d+: layer\s+[\d.]+ us, dispatch \+ combine\s+[\d.]+ us = ([\d.]+)%", out)
    assert len(per_rank) == n and all(0.0 < float(s) <= 100.0 for s in per_rank), out[-4000:]
    assert 0.0 < _share(out, "") <= 100.0


def test_every_example_defaults_to_the_auto_backend():
    """Every example with a ``--backend`` option defaults to ``auto`` (the GPU where one is visible), so a user on a
    GPU machine who runs one without options gets the GPU path (symmetric_alltoall.py defaulted to ``host``)."""
    import ast
    found = []
    for name in sorted(os.listdir(EXAMPLES)):
        if not name.endswith(".py"):
            continue
        tree = ast.parse(open(os.path.join(EXAMPLES, name)).read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument" and node.args and \
                    isinstance(node.args[0], ast.Constant) and node.args[0].value == "--backend":
                default = {k.arg: k.value for k in node.keywords}.get("default")
                found.append((name, getattr(default, "value", None)))
    assert ("symmetric_alltoall.py", "auto") in found
    assert all(d == "auto" for _, d in found), found
