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

import sys  # noqa: E402
import time  # noqa: E402

import pytest  # noqa: E402
from mpi4py import MPI  # noqa: E402

from cupy_symbuf.common import backend as _compat  # noqa: E402


def pytest_configure(config):
    if MPI.COMM_WORLD.Get_size() > 1:
        _fence_comm.append(MPI.COMM_WORLD.Dup())
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


#: Seconds a rank waits at the fence after a test for the other ranks (a test's ranks may legitimately finish up to
#: a few of the library's timeouts apart) before it calls the ranks out of step and ends the job.
FENCE_S = float(os.environ.get("CUPY_SYMBUF_TEST_FENCE_S", "150"))
_fence_comm = []  # a duplicate of MPI.COMM_WORLD made at start: no test's collective step is ever matched with it


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Keeps each phase's report on the test item (the fence tells this rank's outcome if it ends the job)."""
    outcome = yield
    rep = outcome.get_result()
    setattr(item, "_rep_" + rep.when, rep)


def _fence_wait(request, stage: str) -> None:
    """Every rank at the fence, bounded by FENCE_S (a non-blocking barrier on the fence's own communicator)."""
    world = MPI.COMM_WORLD
    nodeid = request.node.nodeid
    req = _fence_comm[0].Ibarrier()
    deadline = time.monotonic() + FENCE_S
    while not req.Test():
        if time.monotonic() > deadline:
            rep = getattr(request.node, "_rep_call", None)
            mine = "not run" if rep is None else rep.outcome
            if rep is not None and rep.failed:
                mine += ":\n" + str(rep.longrepr)[-3000:]
            with request.config.pluginmanager.getplugin("capturemanager").global_and_fixture_disabled():
                print(f"\nconftest: rank {world.rank}: after {nodeid} ({stage}) the other ranks did not reach the fence "
                f"within {FENCE_S:g} s: the ranks are out of step (a rank skipped a collective step of this test, "
                f"e.g. a Barrier after an assertion that failed on that rank only). Ending the job here: every later "
                f"test would fail out of step. This rank's outcome of the test: {mine}", file=sys.stderr, flush=True)
            world.Abort(3)
        time.sleep(0.0005)


@pytest.fixture(autouse=True)
def _world_fence(request):
    """After every test (2+ ranks): the ranks meet at a bounded fence on a communicator of its own, and
    cupy_symbuf bootstrap messages left on ``MPI.COMM_WORLD`` are taken off and make the test that left them an
    error (a test that needs a timed-out exchange makes it on a ``scratch_comm``). Without it a stale message put
    every later test on every rank out of step, and the log showed the cascade, not its origin; ranks that no
    longer meet end the job naming the test after which they parted."""
    yield
    world = MPI.COMM_WORLD
    if world.size == 1:
        return
    if not _fence_comm:
        pytest.fail("conftest: the fence's communicator was not made at start", pytrace=False)
    from cupy_symbuf.transport.bootstrap import TAG
    _fence_wait(request, "arriving")
    time.sleep(0.002)  # a message sent just before a peer's fence may still be on its way
    left = []
    status = MPI.Status()
    while True:
        msg = world.improbe(source=MPI.ANY_SOURCE, tag=TAG, status=status)
        if msg is None:
            break
        m = msg.recv()
        left.append((status.Get_source(),) + tuple(m[:2]))
    _fence_wait(request, "leaving")  # no rank starts the next test before every rank looked
    if left:
        pytest.fail(f"rank {world.rank}: the test left {len(left)} cupy_symbuf bootstrap message(s) on "
                    f"MPI.COMM_WORLD (source rank, kind, step): {left}", pytrace=False)


def _gpu_for_rank():
    """Ordinal of the GPU this rank uses (see cupy_symbuf.utils.select_device)."""
    from cupy_symbuf.utils import select_device
    return select_device(MPI.COMM_WORLD)
