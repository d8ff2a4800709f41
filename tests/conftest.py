"""Test setup shared by every file: runs unchanged on 1 rank and under ``mpiexec -n N python -m pytest``.

Each test is parametrized over the backends this machine has (``host`` always, ``cuda`` when CuPy sees a GPU).
Ranks other than 0 print only failures, so the log has one report per failing rank.
"""
import os

# In-process tests catch cupy_symbuf's failures themselves: a failed communicator must not end pytest with
# MPI.COMM_WORLD.Abort (Config.abort_on_failure; the fault tests in subprocesses exercise the default).
os.environ.setdefault("CUPY_SYMBUF_ABORT_ON_FAILURE", "0")
# The tests see the built-in Config defaults, not a tuning table (cupy_symbuf.transport.tuning: a set CUPY_SYMBUF_TUNING naming
# no file means no table); tests/test_tuning.py points it at its own tables and checks the packaged one.
os.environ.setdefault("CUPY_SYMBUF_TUNING", os.path.join(os.path.dirname(__file__), "no-tuning-table.json"))

import time  # noqa: E402

import pytest  # noqa: E402
from mpi4py import MPI  # noqa: E402

from cupy_symbuf.common import backend as _compat  # noqa: E402


def pytest_configure(config):
    if MPI.COMM_WORLD.Get_rank() != 0:
        config.option.verbose = -1
        config.option.reportchars = "fE"


def available_backends():
    names = ["host"]
    if _compat.cuda_available():
        names.append("cuda")
    only = os.environ.get("CUPY_SYMBUF_TEST_BACKENDS")
    if only:
        names = [n for n in names if n in only.split(",")]
    return names


@pytest.fixture(params=available_backends())
def backend(request):
    if request.param == "cuda":
        from cupy_symbuf.utils import select_device
        select_device(MPI.COMM_WORLD)  # one GPU per local rank, or all on GPU 0 under MPS
    return request.param


@pytest.fixture
def comm():
    return MPI.COMM_WORLD


@pytest.fixture(autouse=True)
def _world_fence():
    """After every test (2+ ranks): the ranks meet, and bootstrap messages left on ``MPI.COMM_WORLD`` are taken
    off and make the test that left them an error (a test that needs a timed-out exchange makes it on a
    ``scratch_comm``). Without the fence one rank's failure (it skipped the test's later collective steps) or
    one stale message put every later test on every rank out of step, and the log showed the cascade, not its
    origin."""
    yield
    world = MPI.COMM_WORLD
    if world.size == 1:
        return
    from cupy_symbuf.transport.bootstrap import TAG
    world.Barrier()
    time.sleep(0.002)  # a message sent just before a peer's Barrier may still be on its way
    left = []
    status = MPI.Status()
    while True:
        msg = world.improbe(source=MPI.ANY_SOURCE, tag=TAG, status=status)
        if msg is None:
            break
        m = msg.recv()
        left.append((status.Get_source(),) + tuple(m[:2]))
    world.Barrier()
    if left:
        pytest.fail(f"rank {world.rank}: the test left {len(left)} cupy_symbuf bootstrap message(s) on "
                    f"MPI.COMM_WORLD (source rank, kind, step): {left}", pytrace=False)


def _gpu_for_rank():
    """Ordinal of the GPU this rank uses (see cupy_symbuf.utils.select_device)."""
    from cupy_symbuf.utils import select_device
    return select_device(MPI.COMM_WORLD)
