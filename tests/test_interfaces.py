"""The declared seams of ``transport/``: the Transport protocols both engines implement, the Bootstrap every
construction-time exchange goes through, and the Engine that reaches its communicator only through callbacks."""
import numpy as np
import pytest
from mpi4py import MPI

import cupy_symbuf as cs
from cupy_symbuf.transport import agree
from cupy_symbuf.transport.base import DeviceTransport, Transport, implements
from cupy_symbuf.transport.bootstrap import Bootstrap, CollectiveTimeoutError, MpiBootstrap, as_bootstrap
from cupy_symbuf.transport.cuda import CudaTransport
from cupy_symbuf.transport.engine import Engine
from cupy_symbuf.transport.host import HostTransport
from _util import RankChecks


def test_both_engines_declare_and_conform_to_the_transport_protocol():
    assert Transport in HostTransport.__implements__ and DeviceTransport in CudaTransport.__implements__
    # structural conformance (runtime_checkable looks at the methods; no GPU needed to build an empty instance)
    assert isinstance(object.__new__(HostTransport), Transport)
    assert isinstance(object.__new__(CudaTransport), Transport)
    assert isinstance(object.__new__(CudaTransport), DeviceTransport)
    assert not isinstance(object.__new__(HostTransport), DeviceTransport)  # no device-count calls on the host


def test_a_live_host_transport_conforms(comm):
    with cs.Communicator(comm, backend="host") as c:
        assert isinstance(c.engine.transport, Transport)
        assert c.engine.transport is c._transport and c.engine.heap is c._heap
        assert c.engine is c.engine  # made once


def test_implements_names_what_is_missing_or_incompatible():
    with pytest.raises(TypeError, match=r"Half does not implement Transport: .*notify: missing"):
        @implements(Transport)
        class Half:
            def exchange_rows(self, plan, send_parts, send_index, recv_parts, op, direct=None, **kwargs):
                return []

    with pytest.raises(TypeError, match=r"synchronize: parameter 'op' needs a default"):
        @implements(Transport)
        class NoDefault(HostTransport):
            def synchronize(self, op):
                pass


def test_mpi_bootstrap_is_a_bootstrap_and_exchanges(comm):
    boot = MpiBootstrap(comm)
    assert isinstance(boot, Bootstrap) and as_bootstrap(comm).rank == boot.rank == comm.Get_rank()
    assert as_bootstrap(boot) is boot
    W = comm.Get_size()
    assert boot.allgather(boot.rank * 10, 30.0, "test allgather") == [r * 10 for r in range(W)]
    assert boot.bcast(("hello", boot.rank), 30.0, "test bcast", root=W - 1) == ("hello", W - 1)
    boot.barrier(30.0, "test barrier")
    node = boot.split_node()
    dup = boot.dup()
    try:
        assert node.size == W  # one node here
        assert dup.allgather(dup.rank, 30.0, "test dup") == list(range(W))
    finally:
        node.free()
        dup.free()
    assert agree.exchange_all(comm, 1, 30.0, "test agree") == [1] * W  # the agree helpers take a comm as before
    with pytest.raises(TypeError, match="mpi4py intra-communicator, a torch.distributed ProcessGroup, None or a Bootstrap"):
        as_bootstrap("COMM_WORLD")
    with pytest.raises(ValueError, match=r"root must be a rank"):
        boot.bcast(1, 1.0, "test bcast", root=W)


@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() < 2, reason="needs a peer that does not come")
def test_bootstrap_wait_is_bounded(comm):
    boot = MpiBootstrap(comm)
    sub = boot.dup()
    checks = RankChecks()  # rank 0's check may fail there only: every rank still makes both Barriers
    try:
        if sub.rank == 0:
            with checks.local("rank 0's lonely step times out"):
                with pytest.raises(CollectiveTimeoutError) as info:
                    sub.allgather(None, 0.3, "test lonely step")
                assert info.value.missing == list(range(1, sub.size)), info.value.missing
        sub.comm.Barrier()
        sub.discard_leftovers()  # rank 0's messages the others never took
        sub.comm.Barrier()
    finally:
        sub.free()
    checks.gather()


def test_communicator_and_symbuffer_take_a_bootstrap(comm):
    """SymBuffer construction accepts a Bootstrap as well as a comm, and builds its own on a duplicate."""
    boot = MpiBootstrap(comm)
    with cs.SymBuffer(boot, 4096, backend="host") as buf:
        assert isinstance(buf.bootstrap, Bootstrap) and buf.bootstrap is not boot
        assert buf.bootstrap.size == comm.Get_size()
    with pytest.raises(TypeError, match="mpi4py intra-communicator"):
        cs.SymBuffer(object(), 4096, backend="host")


def test_engine_reaches_its_owner_only_through_callbacks():
    """An Engine built from callbacks alone (no communicator): broken state, open checks and the heap are theirs."""
    state = {"broken": None, "open": True}

    def check_open():
        if not state["open"]:
            raise cs.SymBufferClosedError("closed")

    class Heap:
        def find(self, a):
            return None

        def check_live(self, op, name, a):
            if a is None:
                raise ValueError(f"{op}: {name} freed")

    class Tr:
        aborts = []

        def set_abort(self, reason, *args):
            self.aborts.append(reason)

    cfg = cs.Config(num_sms=2, chunk_bytes=4096, num_slots=2).resolved("host", world_size=1)
    layout = cs.ChannelLayout.from_config(cfg, 1)
    tr = Tr()
    eng = Engine(tr, layout, cfg, rank=0, world_size=1, backend="host", heap=Heap(), check_open=check_open,
                 failure=lambda: state["broken"], on_broken=lambda msg: state.update(broken=msg))
    assert eng.transport is tr and eng.broken is None
    eng.fail(RuntimeError("boom"))
    assert state["broken"] == "RuntimeError: boom" and eng.broken == state["broken"] and tr.aborts
    eng.fail(RuntimeError("second"))  # once
    assert state["broken"] == "RuntimeError: boom"
    assert eng.find_symmetric(np.zeros(4)) is None
    with pytest.raises(ValueError, match="freed"):
        eng.check_live("op", "out", None)
    state["open"] = False
    with pytest.raises(cs.SymBufferClosedError):
        eng.check_open()
    eng.reject("alltoall", notify=False)  # closed: nothing to tell, no error
