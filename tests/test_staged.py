"""The staged transport (``Config.transport``): the symmetric buffer of the cuda backend in host memory
when some pair of GPUs has no peer access, an IPC handle does not open, or it is asked for.

Host part (runs everywhere, 1 / 2 / 4 ranks): :func:`cupy_symbuf.transport.symbuffer.choose_transport` against Topologies
built from fake records; ``Config.transport`` and ``CUPY_SYMBUF_TRANSPORT``; and the whole cuda SymBuffer
construction (choice, agreement, IPC fallback, registration of the real MPI shared-memory window, close) with CuPy
replaced by a fake CUDA runtime that records every call: the window is real, only the CUDA calls are faked.

GPU part (skipped without a GPU; ``.ci/device.sh staged`` runs it under ``mpirun -n 2``): a cuda Communicator
with ``Config(transport="staged")`` against NumPy for alltoall, alltoallv, symmetric sendbufs, MoE dispatch /
combine, and the automatic fallback when an IPC handle fails to open.
"""
from __future__ import annotations

import types

import numpy as np
import pytest
from mpi4py import MPI

import cupy_symbuf as cs
from cupy_symbuf.transport import agree as _agree
from cupy_symbuf.common import backend as _compat
from cupy_symbuf.transport import lifecycle as _lifecycle
from cupy_symbuf.common.config import Config
from cupy_symbuf.transport.symbuffer import SymBuffer, _PAGE, choose_transport
from cupy_symbuf.transport.topology import Topology
from _util import RankChecks, all_ranks

WORLD = MPI.COMM_WORLD
RANK, W = WORLD.Get_rank(), WORLD.Get_size()


# ---- the decision, from fake topologies ---------------------------------------------------------------------

def _pci(i: int) -> str:
    return "0000:%02x:00.0" % (0x10 + i)


def _topo(gpus, peer, hosts=None):
    """A cuda Topology of ``len(gpus)`` ranks: rank r on GPU ``gpus[r]``; ``peer(a, b)``: rank a's answer of
    cudaDeviceCanAccessPeer towards GPU b (None: rank a cannot see GPU b)."""
    return Topology("cuda", _records(gpus, peer, hosts), rank=0)


def _records(gpus, peer, hosts=None):
    """The per-rank records of :func:`_topo`'s Topology."""
    n_gpu = max(gpus) + 1
    recs = []
    for r, g in enumerate(gpus):
        pa = {}
        for b in range(n_gpu):
            if b != g and peer(g, b) is not None:
                pa[_pci(b)] = bool(peer(g, b))
        recs.append({"host": (hosts or ["h"] * len(gpus))[r], "shm": 0 if hosts is None else hosts.index(hosts[r]),
                     "gpu": {"ordinal": g, "uuid": "%02x" % (g + 1) * 16, "pci_bus_id": _pci(g), "name": "Fake"},
                     "nvml": None, "peer_access": pa, "source": "cuda", "notes": []})
    return recs


def test_planned_transport_keys_the_tuning_table():
    """A layout per link class: the tuning table's key carries the transport the topology chooses before
    the buffer exists (``planned_transport``, SymBuffer's rule), so an entry measured over CUDA IPC never sets the
    layout of a staged communicator; IPC keys are what they were (the packaged entries still apply)."""
    from cupy_symbuf.transport import tuning
    from cupy_symbuf.communicator import planned_transport
    ok, cut = _records([0, 1], lambda a, b: True), _records([0, 1], lambda a, b: False)
    assert planned_transport("auto", "cuda", ok) == "ipc"
    assert planned_transport("auto", "cuda", cut) == "staged"
    assert planned_transport("staged", "cuda", ok) == "staged"
    assert planned_transport("ipc", "cuda", cut) == "ipc"  # refused by SymBuffer, on every rank
    assert planned_transport("auto", "cuda", _records([0, 0], lambda a, b: False)) == "ipc"  # one GPU (MPS)
    assert planned_transport("auto", "cuda", ok[:1]) == "ipc" and planned_transport("staged", "cuda", ok[:1]) == \
        "staged"
    assert planned_transport("auto", "host", cut) == "ipc"
    two_nodes = _records([0, 1], lambda a, b: True, hosts=["a", "b"])
    assert planned_transport("auto", "cuda", two_nodes) == "ipc"  # SymBuffer raises NotImplementedError there
    key = tuning.table_key("cuda", 2, "NVIDIA H200", 2)
    assert key == "cuda/NVIDIA H200/ranks_per_gpu=2/world=2" == tuning.table_key("cuda", 2, "NVIDIA H200", 2, "ipc")
    assert tuning.table_key("cuda", 2, "NVIDIA H200", 2, "staged") == key + "/transport=staged"
    assert tuning.table_key("host", 2, transport="staged") == tuning.table_key("host", 2)
    with pytest.raises(ValueError, match="transport must be 'ipc' or 'staged'"):
        tuning.table_key("cuda", 2, "NVIDIA H200", 2, "shared_memory")


def test_choose_all_peer_access_is_ipc():
    t, why = choose_transport("auto", _topo([0, 1, 2, 3], lambda a, b: True))
    assert t == "ipc" and "peer-accessible" in why and "pcie 6" in why


def test_choose_one_pair_without_access_is_staged_and_named():
    """One direction of one pair says no (GPU 2 cannot reach GPU 3): staged, the pair named with its bus ids."""
    t, why = choose_transport("auto", _topo([0, 1, 2, 3], lambda a, b: not (a == 2 and b == 3)))
    assert t == "staged"
    assert why == f"no peer access between ranks 2 and 3 (GPUs {_pci(2)}, {_pci(3)})"


def test_choose_many_pairs_are_counted():
    t, why = choose_transport("auto", _topo(list(range(6)), lambda a, b: False))
    assert t == "staged" and why.count("ranks ") == 4 and why.endswith("and 11 more pairs")


def test_choose_same_gpu_and_unknown_try_ipc():
    """MPS (two ranks on one GPU) needs no peer access; a pair nobody can see is tried through IPC."""
    assert choose_transport("auto", _topo([0, 0, 1, 1], lambda a, b: True))[0] == "ipc"
    t, why = choose_transport("auto", _topo([0, 1], lambda a, b: None))
    assert t == "ipc" and "unknown" in why and "staged if a handle does not open" in why
    assert choose_transport("auto", None)[0] == "ipc"
    assert choose_transport("auto", _topo([0], lambda a, b: True))[0] == "ipc"


def test_choose_forced():
    no_access = _topo([0, 1], lambda a, b: False)
    t, why = choose_transport("staged", _topo([0, 1], lambda a, b: True))
    assert t == "staged" and "requested" in why
    assert choose_transport("staged", None)[0] == "staged"
    assert choose_transport("ipc", _topo([0, 1], lambda a, b: True)) == ("ipc", "requested (Config.transport='ipc')")
    with pytest.raises(RuntimeError, match=r"transport='ipc' but there is no peer access between ranks 0 and 1"):
        choose_transport("ipc", no_access)


def test_choose_refuses():
    with pytest.raises(ValueError, match="requested must be one of"):
        choose_transport("nvlink", None)
    host = Topology("host", [{"host": "h", "shm": 0}, {"host": "h", "shm": 0}])
    with pytest.raises(ValueError, match="cuda backend"):
        choose_transport("auto", host)
    two_nodes = _topo([0, 1], lambda a, b: True, hosts=["a", "b"])
    for req in ("auto", "staged", "ipc"):  # the window cannot span nodes: today's clear error stays
        with pytest.raises(NotImplementedError, match="different nodes"):
            choose_transport(req, two_nodes)


# ---- Config ---------------------------------------------------------------------------------------------------

def test_config_transport_field(monkeypatch):
    monkeypatch.delenv("CUPY_SYMBUF_TRANSPORT", raising=False)
    assert Config().transport == "auto" and Config(transport="staged").transport == "staged"
    with pytest.raises(ValueError, match="transport must be one of"):
        Config(transport="shm")
    monkeypatch.setenv("CUPY_SYMBUF_TRANSPORT", "Staged")
    assert Config().transport == "staged" and Config(transport="ipc").transport == "ipc"
    monkeypatch.setenv("CUPY_SYMBUF_TRANSPORT", "p2p")
    with pytest.raises(ValueError, match="CUPY_SYMBUF_TRANSPORT"):
        Config()


def test_transport_shapes_the_wire():
    """Not local policy: ranks asking for different transports fail construction, naming the field."""
    assert "transport" not in _agree.LOCAL_POLICY_FIELDS
    from cupy_symbuf.wire.channel_layout import ChannelLayout
    cfg = Config(transport="staged").resolved("host", world_size=2)
    fp = _agree.fingerprint(cfg, ChannelLayout.from_config(cfg, 2), "host")
    assert fp["config.transport"] == "staged"


def test_communicator_transport_mismatch_and_host_report():
    if W == 1:
        with cs.Communicator(WORLD, Config(transport="staged"), backend="host") as c:
            assert c.transport == "shared_memory" and c.buffer.transport == "shared_memory"
            assert "\n  transport: " not in c.describe()  # a cuda line
        return
    with pytest.raises(ValueError, match="config.transport"):
        cs.Communicator(WORLD, Config(transport="staged" if RANK == 0 else "auto"), backend="host")
    with cs.Communicator(WORLD, Config(transport="staged"), backend="host") as c:
        assert c.transport == "shared_memory"


# ---- the cuda SymBuffer with a fake CUDA runtime ---------------------------------------------------------------

DEV_OFFSET = 1 << 44  # fake device address = host address + this: a host address used as a device one shows


class _Attrs:
    def __init__(self, dev):
        self.devicePointer = dev


class FakeRuntime:
    """The calls SymBuffer and topology.local_record make, recorded. Rank r is on GPU r of W visible GPUs."""

    cudaIpcMemLazyEnablePeerAccess = 1

    def __init__(self, peer=lambda a, b: True, open_fails=lambda r: False, register_fails=False):
        self.peer, self.open_fails, self.register_fails = peer, open_fails, register_fails
        self.calls = []
        self.registered = {}   # host start -> bytes
        self.malloced, self.freed, self.opened, self.closed = [], [], [], []
        self._next = 0x7F0000000000 + RANK * (1 << 36)

    def getDeviceCount(self):
        return W

    def getDevice(self):
        return RANK

    def getDeviceProperties(self, d):
        return {"uuid": bytes([d + 1]) * 16, "name": b"Fake GPU", "pciDomainID": 0, "pciBusID": 0x10 + d,
                "pciDeviceID": 0, "multiProcessorCount": 132}

    def deviceCanAccessPeer(self, a, b):
        return int(self.peer(a, b))

    def memGetInfo(self):
        return 1 << 40, 1 << 40

    def deviceSynchronize(self):
        self.calls.append("sync")

    def malloc(self, n):
        self._next += 1 << 30
        self.malloced.append(self._next)
        return self._next

    def memset(self, p, v, n):
        pass

    def free(self, p):
        self.freed.append(p)

    def ipcGetMemHandle(self, p):
        return b"H" + int(p).to_bytes(8, "little")

    def ipcOpenMemHandle(self, h, flags):
        if self.open_fails(RANK):
            raise RuntimeError("cudaErrorPeerAccessUnsupported: peer access is not supported between these two "
                               "devices")
        p = int.from_bytes(h[1:], "little") + (1 << 20)  # "mapped here"
        self.opened.append(p)
        return p

    def ipcCloseMemHandle(self, p):
        self.closed.append(p)

    def hostRegister(self, ptr, size, flags):
        self.calls.append(("register", ptr, size, flags))
        if self.register_fails:
            raise RuntimeError("cudaErrorHostMemoryAlreadyRegistered (fake)")
        assert ptr % _PAGE == 0 and size % _PAGE == 0 and size > 0, (ptr, size)
        for s, n in self.registered.items():
            assert ptr + size <= s or s + n <= ptr, "a page registered twice"
        self.registered[ptr] = size

    def hostUnregister(self, ptr):
        self.calls.append(("unregister", ptr))
        del self.registered[ptr]

    def pointerGetAttributes(self, ptr):
        for s, n in self.registered.items():
            if s <= ptr < s + n:
                return _Attrs(ptr + DEV_OFFSET)
        return _Attrs(0)


@pytest.fixture
def fake_cuda(monkeypatch):
    """Install a FakeRuntime as CuPy (``fake_cuda(**kw)`` returns it); the backend then resolves to cuda."""
    def install(**kw):
        rt = FakeRuntime(**kw)

        class Device:
            def __init__(self, i=None):
                self.id = RANK if i is None else i

            @property
            def pci_bus_id(self):
                return _pci(self.id).upper()

        cp = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=rt, Device=Device),
                                   array=lambda a: np.array(a))
        monkeypatch.setattr(_compat, "cupy", cp)
        monkeypatch.setattr(_compat, "cuda_available", lambda: True)
        return rt
    return install


def _windows():
    return _lifecycle.live_mpi_objects()["win"]


def test_fake_staged_forced_maps_the_window(fake_cuda):
    """transport='staged': no cudaMalloc; every rank's part of one real MPI shared-memory window is registered
    (Portable | Mapped, whole pages, each page once) and peer_ptrs are the parts' device addresses; bytes one rank
    writes into its part are seen by every rank; close unregisters every range and frees the window, nothing is
    cudaFree'd."""
    rt = fake_cuda()
    wins = _windows()
    nbytes = 10000  # not a whole number of pages
    b = SymBuffer(WORLD, nbytes, backend="cuda", transport="staged")
    try:
        assert _windows() == wins + 1
        addrs = [b.host_view(r).__array_interface__["data"][0] for r in range(W)]
        regs = [c for c in rt.calls if c[0] == "register"]

        def check():
            assert b.transport == "staged" and "requested" in b.transport_reason
            assert rt.malloced == [] and rt.opened == []
            assert all(flags == 3 for _, _, _, flags in regs) and 1 <= len(regs) <= W
            assert b.peer_ptrs == [a + DEV_OFFSET for a in addrs]
            assert b.local_ptr == b.peer_ptrs[RANK] and list(b.peer_ptrs_device) == b.peer_ptrs
            assert all(b.host_view(r).shape == (nbytes,) for r in range(W))
            # every part starts on a page (MPI's window headers leave the raw parts 8 bytes past a 16-byte boundary:
            # the low-latency kernels' 16-byte accesses faulted there), and the registered spans are exactly them
            assert all(a % 4096 == 0 for a in addrs), [a % 4096 for a in addrs]
            assert all(s % 4096 == 0 and n % 4096 == 0 for s, n in rt.registered.items())
            assert all(any(s <= a and a + nbytes <= s + n for s, n in rt.registered.items()) for a in addrs)
        all_ranks(check)
        b.host_view(RANK)[:] = RANK + 1
        WORLD.Barrier()
        b.sync()
        all_ranks(lambda: [np.testing.assert_array_equal(b.host_view(r), r + 1) for r in range(W)])
        assert "transport='staged'" in repr(b)
    finally:
        b.close()
    all_ranks(lambda: (rt.registered == {} and rt.freed == [] and _windows() == wins) or
              pytest.fail(f"left registered {rt.registered}, freed {rt.freed}, windows {_windows()} (was {wins})"))


def test_fake_auto_without_peer_access_is_staged_everywhere(fake_cuda, caplog):
    """auto, GPU 0 cannot reach GPU 1 (one direction, as rank 0 sees it): every rank chooses staged without trying
    IPC (no cudaMalloc anywhere), and rank 0 logs a warning saying so; one rank alone needs no peer access: ipc."""
    rt = fake_cuda(peer=lambda a, b: not (a == 0 and b == 1))
    with caplog.at_level("WARNING", logger="cupy_symbuf"):
        b = SymBuffer(WORLD, 4096, backend="cuda")
    try:
        def check():
            if W == 1:
                assert b.transport == "ipc" and rt.malloced
                return
            warned = [r.getMessage() for r in caplog.records if "staged transport" in r.getMessage()]
            assert len(warned) == (1 if RANK == 0 else 0), warned
            assert not warned or "no peer access between ranks 0 and 1" in warned[0]
            assert b.transport == "staged", b.transport_reason
            assert b.transport_reason == f"no peer access between ranks 0 and 1 (GPUs {_pci(0)}, {_pci(1)})"
            assert rt.malloced == [] and rt.registered
        all_ranks(check)
    finally:
        b.close()
    all_ranks(lambda: rt.registered == {} or pytest.fail(str(rt.registered)))


def test_fake_auto_all_peer_access_is_ipc(fake_cuda):
    rt = fake_cuda()
    b = SymBuffer(WORLD, 4096, backend="cuda")
    try:
        def check():
            assert b.transport == "ipc" and len(rt.malloced) == 1 and rt.registered == {}
            assert b.peer_ptrs[RANK] == rt.malloced[0] and sorted(rt.opened) == sorted(
                p for r, p in enumerate(b.peer_ptrs) if r != RANK)
        all_ranks(check)
    finally:
        b.close()
    all_ranks(lambda: (rt.freed == rt.malloced and sorted(rt.closed) == sorted(rt.opened)) or pytest.fail(
        f"freed {rt.freed} of {rt.malloced}, closed {rt.closed} of {rt.opened}"))


def test_fake_auto_ipc_open_failure_falls_back(fake_cuda):
    """Every pair says peer access, but the last rank cannot open a handle: every rank undoes IPC (mappings
    closed, cudaMalloc freed) and goes staged, the reason naming the rank that failed and why."""
    last = W - 1
    rt = fake_cuda(open_fails=lambda r: r == last and W > 1)
    b = SymBuffer(WORLD, 4096, backend="cuda")
    try:
        def check():
            if W == 1:
                assert b.transport == "ipc"
                return
            assert b.transport == "staged"
            assert b.transport_reason.startswith(f"CUDA IPC failed: rank {last} (GPU {_pci(last)}) could not open "
                                                 f"rank 0's CUDA IPC handle"), b.transport_reason
            assert "peer access is not supported" in b.transport_reason
            assert rt.freed == rt.malloced and len(rt.malloced) == 1 and sorted(rt.closed) == sorted(rt.opened)
            assert b.peer_ptrs[RANK] == b.host_view(RANK).__array_interface__["data"][0] + DEV_OFFSET
        all_ranks(check)
        reasons = WORLD.allgather(b.transport_reason)
        assert all(r == reasons[0] for r in reasons)
    finally:
        b.close()


def test_fake_forced_ipc_open_failure_raises_everywhere(fake_cuda):
    if W == 1:
        return  # no peer handle to open
    rt = fake_cuda(open_fails=lambda r: r == 0)
    err = None
    try:
        SymBuffer(WORLD, 4096, backend="cuda", transport="ipc").close()
    except RuntimeError as exc:
        err = str(exc)
    all_ranks(lambda: (err is not None and "rank 0 (GPU" in err and "could not open" in err
                       and "Config.transport='ipc'" in err and rt.freed == rt.malloced and rt.malloced)
              or pytest.fail(f"{err!r}, freed {rt.freed} of {rt.malloced}"))


def test_fake_forced_ipc_without_peer_access_raises_everywhere(fake_cuda):
    """transport='ipc' where the topology says no peer access: RuntimeError on every rank naming the pair, before
    anything is allocated (the old code went on to the failing ipcOpenMemHandle, on one rank only)."""
    if W == 1:
        return
    rt = fake_cuda(peer=lambda a, b: False)
    err = None
    try:
        SymBuffer(WORLD, 4096, backend="cuda", transport="ipc").close()
    except RuntimeError as exc:
        err = str(exc)
    all_ranks(lambda: (err is not None and "transport='ipc' but there is no peer access between ranks 0 and 1" in err
                       and rt.malloced == []) or pytest.fail(f"{err!r} malloced {rt.malloced}"))


def test_fake_register_failure_raises_everywhere_and_frees(fake_cuda):
    """cudaHostRegister failing on one rank: RuntimeError on every rank, window freed, nothing left registered."""
    fails = RANK == W - 1
    rt = fake_cuda(register_fails=fails)
    wins = _windows()
    err = None
    try:
        SymBuffer(WORLD, 4096, backend="cuda", transport="staged").close()
    except RuntimeError as exc:
        err = str(exc)
    all_ranks(lambda: (err is not None and f"rank {W - 1}: cudaHostRegister" in err and rt.registered == {}
                       and _windows() == wins) or pytest.fail(f"{err!r} {rt.registered} {_windows()} {wins}"))


def test_fake_transport_disagreement(fake_cuda):
    if W == 1:
        return
    fake_cuda()
    with pytest.raises(ValueError, match="transport must be the same on every rank"):
        SymBuffer(WORLD, 4096, backend="cuda", transport="staged" if RANK == 0 else "auto")
    with pytest.raises(ValueError, match="transport must be one of"):
        SymBuffer(WORLD, 4096, backend="cuda", transport="host")


def test_fake_communicator_looks_up_the_planned_transports_key(fake_cuda, monkeypatch):
    """A cuda Communicator's tuning lookup uses the key of the transport its buffer will have: staged when asked or
    when a pair has no peer access, else the IPC key (the lookup is stopped there, before any buffer exists; the
    error reaches every rank through the fingerprint exchange)."""
    from cupy_symbuf.transport import tuning
    seen = []

    def lookup(key):
        seen.append(key)
        raise RuntimeError("lookup stopped by the test")
    monkeypatch.setattr(tuning, "lookup", lookup)
    cases = [(lambda a, b: True, "staged", "staged"), (lambda a, b: True, "auto", "ipc"),
             (lambda a, b: False, "auto", "staged" if W > 1 else "ipc")]
    for peer, requested, want in cases:
        rt = fake_cuda(peer=peer)
        seen.clear()
        with pytest.raises(Exception, match="lookup stopped by the test"):
            cs.Communicator(WORLD, Config(transport=requested), backend="cuda")
        assert len(seen) == 1 and seen[0].endswith("/transport=staged") == (want == "staged"), (requested, seen)
        assert f"/ranks_per_gpu=1/world={W}" in seen[0] and rt.malloced == [] and rt.registered == {}


def test_fake_zero_bytes_staged(fake_cuda):
    rt = fake_cuda()
    with SymBuffer(WORLD, 0, backend="cuda", transport="staged") as b:
        all_ranks(lambda: (b.transport == "staged" and b.peer_ptrs == [0] * W and rt.registered == {})
                  or pytest.fail(str(b.peer_ptrs)))


# ---- GPU: a staged cuda Communicator against NumPy (skipped without a GPU) ----------------------------------------

gpu = pytest.mark.skipif(not _compat.cuda_available(), reason="needs CuPy and a GPU")


@pytest.fixture(scope="module")
def staged():
    if not _compat.cuda_available():
        pytest.skip("needs CuPy and a GPU")
    from cupy_symbuf.utils import select_device
    select_device(WORLD)
    c = cs.Communicator(WORLD, Config(transport="staged"), backend="cuda")
    yield c
    c.close()


def _np(a):
    return a.get() if hasattr(a, "get") else np.asarray(a)


@gpu
def test_gpu_staged_is_reported(staged):
    c = staged
    assert c.transport == "staged" and c.buffer.transport == "staged"
    assert "transport: staged" in c.describe()
    # the rings are host memory: this rank's part is a NumPy view of the window the GPU writes
    assert c.buffer.host_view(c.rank).nbytes == c.layout.total_bytes


@gpu
@pytest.mark.parametrize("per_peer", [1, 1000, 3 << 20])
def test_gpu_staged_alltoall(staged, per_peer):
    import cupy
    c = staged
    rng = np.random.default_rng([14, RANK, per_peer])
    x = rng.integers(0, 255, (W, per_peer), dtype=np.uint8)
    everyone = WORLD.allgather(x)
    want = np.stack([everyone[j][RANK] for j in range(W)])
    got = c.alltoall(cupy.asarray(x))
    c.synchronize()
    all_ranks(lambda: np.testing.assert_array_equal(_np(got), want))


@gpu
def test_gpu_staged_alltoallv(staged):
    import cupy
    c = staged
    rng = np.random.default_rng([15, RANK])
    counts = rng.integers(0, 50, W).astype(np.int64)
    counts[(RANK + 1) % W] = 0  # a peer that gets nothing
    x = rng.standard_normal((int(counts.sum()), 33)).astype(np.float32)
    every = WORLD.allgather((x, counts))
    parts = []
    for xj, cj in every:
        off = np.concatenate([[0], np.cumsum(cj)])
        parts.append(xj[off[RANK]: off[RANK + 1]])
    want = np.concatenate(parts)
    got, recv_counts = c.alltoallv(cupy.asarray(x), counts)
    c.synchronize()
    all_ranks(lambda: (np.testing.assert_array_equal(_np(got), want),
                       np.testing.assert_array_equal(_np(recv_counts), [int(cj[RANK]) for _, cj in every])))


@gpu
def test_gpu_staged_symmetric_sendbuf(staged):
    """A symmetric array of a staged communicator lives in host memory too; the receivers read it directly."""
    c = staged
    per_peer = 1 << 16
    src = c.empty((W, per_peer), np.uint8)
    try:
        assert c.is_symmetric(src)
        x = np.random.default_rng([16, RANK]).integers(0, 255, (W, per_peer), dtype=np.uint8)
        src[...] = _compat.cupy.asarray(x)
        everyone = WORLD.allgather(x)
        want = np.stack([everyone[j][RANK] for j in range(W)])
        for _ in range(3):
            got = c.alltoall(src)
            c.synchronize()
            all_ranks(lambda: np.testing.assert_array_equal(_np(got), want))
        found = c._heap.find(src)
        assert found is not None and found[0].buffer.transport == "staged"
    finally:
        c.free(src)


@gpu
def test_gpu_staged_dispatch_combine(staged):
    from test_moe import to_dev
    from test_moe_device import _inputs, _ranks_of, _reference
    c = staged
    n_exp, topk, hidden, tokens = 8 * W, 4, 128, 37
    idx, x, w = _inputs(("staged", c.backend), tokens, hidden, n_exp, topk, "random")
    recv_x, recv_idx, recv_w, counts, h = c.dispatch(to_dev(c, x), to_dev(c, idx), to_dev(c, w), n_exp)
    rx, ri, rw, per_expert = _reference(idx, x, w, n_exp)
    all_ranks(lambda: (np.testing.assert_array_equal(_np(recv_x), rx),
                       np.testing.assert_array_equal(_np(recv_idx), ri),
                       np.testing.assert_array_equal(_np(recv_w), rw),
                       np.testing.assert_array_equal(np.asarray(counts, np.int64), per_expert)))
    combined, _ = c.combine(recv_x, h, recv_w)
    ranks = _ranks_of(idx, n_exp)
    all_ranks(lambda: np.testing.assert_array_equal(_np(combined), x * ranks[:, None]))


@gpu
def test_gpu_auto_falls_back_when_a_handle_does_not_open(monkeypatch):
    """auto on this machine, with the last rank's cudaIpcOpenMemHandle made to fail: the communicator comes up
    staged on every rank and alltoall is exact (the real fallback path: IPC undone, window registered)."""
    if W == 1:
        pytest.skip("no peer handle to open with one rank")
    import cupy
    from cupy_symbuf.utils import select_device
    select_device(WORLD)
    rt = cupy.cuda.runtime
    real = rt.ipcOpenMemHandle

    def failing(*a, **k):
        if RANK == W - 1:
            raise cupy.cuda.runtime.CUDARuntimeError(217)  # cudaErrorPeerAccessUnsupported
        return real(*a, **k)
    monkeypatch.setattr(rt, "ipcOpenMemHandle", failing)
    with cs.Communicator(WORLD, Config(transport="auto"), backend="cuda") as c:
        monkeypatch.setattr(rt, "ipcOpenMemHandle", real)
        all_ranks(lambda: (c.transport == "staged" and "CUDA IPC failed" in c.transport_reason)
                  or pytest.fail(f"{c.transport}: {c.transport_reason}"))
        x = np.random.default_rng([17, RANK]).integers(0, 255, (W, 4096), dtype=np.uint8)
        everyone = WORLD.allgather(x)
        got = c.alltoall(cupy.asarray(x))
        c.synchronize()
        all_ranks(lambda: np.testing.assert_array_equal(_np(got), np.stack([everyone[j][RANK] for j in range(W)])))


@gpu
def test_gpu_auto_on_this_machine_reports(monkeypatch):
    """Whatever this machine has, auto picks one transport for every rank and says why (H200 NVLink: ipc)."""
    from cupy_symbuf.utils import select_device
    select_device(WORLD)
    monkeypatch.delenv("CUPY_SYMBUF_TRANSPORT", raising=False)
    with cs.Communicator(WORLD, backend="cuda") as c:
        got = WORLD.allgather((c.transport, c.transport_reason))
        assert all(g == got[0] for g in got) and got[0][0] in ("ipc", "staged") and got[0][1]
        if RANK == 0:
            print(f"\nauto transport on this machine: {got[0]}")


@gpu
def test_gpu_info_reports_the_transport(capsys):
    """``python -m cupy_symbuf info --backend cuda --transport staged``: the transport the topology gives and the
    one the Communicator chose, in the JSON report (rank 0) and the text."""
    import json

    from cupy_symbuf.diagnostics import info as _info
    checks = RankChecks()  # rank 0's checks of the first report may fail there only: every rank makes the second
    rc = _info.main(["--json", "--backend", "cuda", "--transport", "staged"])
    out = capsys.readouterr().out
    with checks.local("the JSON report"):
        assert rc == 0, rc
        if RANK == 0:
            r = json.loads(out)
            assert r["transport"] == {"requested": "staged", "from_topology": "staged",
                                      "reason": "requested (Config.transport='staged' / CUPY_SYMBUF_TRANSPORT=staged)"}
            assert r["communicator"]["transport"] == "staged" and "transport: staged" in r["communicator"]["describe"]
    rc = _info.main(["--backend", "cuda", "--transport", "staged"])
    out = capsys.readouterr().out
    with checks.local("the text report"):
        assert rc == 0, rc
        if RANK == 0:
            assert "transport=staged (requested" in out and \
                "transport: requested staged, from the topology: staged" in out, out
    checks.gather()


def test_fake_staged_parts_start_on_pages_whatever_mpi_returns(fake_cuda, monkeypatch):
    """From a review: Open MPI 4.1 returns each rank's part of a shared window 8 bytes past a 16-byte boundary (its
    segment header), where the low-latency kernels' 16-byte accesses fault. Simulated here (mpich's parts are
    page-aligned) by a window whose Shared_query returns every part 8 bytes in: the staged buffer's parts must still
    start on pages, and what a rank writes is what the others read."""
    import cupy_symbuf.transport.symbuffer as sb
    real = MPI

    class _Win:
        def __init__(self, win):
            self._w = win

        def Shared_query(self, r):
            buf, unit = self._w.Shared_query(r)
            return memoryview(buf)[8:], unit

        def __getattr__(self, name):
            return getattr(self._w, name)

    class _WinType:
        @staticmethod
        def Allocate_shared(*a, **kw):
            return _Win(real.Win.Allocate_shared(*a, **kw))

    class _MPI:
        Win = _WinType

        def __getattr__(self, name):
            return getattr(real, name)

    monkeypatch.setattr(sb, "_mpi", _MPI)
    fake_cuda()
    b = SymBuffer(WORLD, 10000, backend="cuda", transport="staged")
    try:
        addrs = [b.host_view(r).__array_interface__["data"][0] for r in range(W)]
        all_ranks(lambda: all(a % _PAGE == 0 for a in addrs) or pytest.fail(f"parts at {[a % _PAGE for a in addrs]}"))
        b.host_view(RANK)[:] = RANK + 1
        WORLD.Barrier()
        all_ranks(lambda: all(int(b.host_view(r)[-1]) == r + 1 for r in range(W)) or pytest.fail("not shared"))
    finally:
        b.close()
