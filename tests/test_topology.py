"""Topology discovery (cupy_symbuf.transport.topology, ``Communicator.topology``, ``python -m cupy_symbuf info``).

Under mpiexec (1, 2, 4 ranks): nodes, hosts and local ranks against a reference built here from ``MPI.COMM_WORLD``,
``socket.gethostname()`` and ``Split_type`` (and with host names faked per rank, so one machine holds several
nodes); the link of every pair. The GPU paths run on any machine through fakes: a ``pynvml`` module describing two
GPUs with 18 NVLink 4.0 links between them (or through NVSwitch), and a CUDA runtime with peer access for the
fallback; with a GPU (the ``backend`` fixture), the cuda Communicator's topology against CuPy's own answers.
"""
import json
import re
import socket
import sys
import types

import pytest
from mpi4py import MPI

import cupy_symbuf as cs
from cupy_symbuf.diagnostics import info as _info
from cupy_symbuf.transport import topology
from cupy_symbuf.transport.topology import Link, Topology, discover, local_record
from _util import all_ranks


# ---- the reference: nodes from MPI and the host name, computed independently --------------------------------

def _reference(comm, hostname=None):
    """``(hosts, nodes, local_ranks, node_members)`` of every rank: a node is a shared-memory group (its lowest rank
    by an allreduce) and a host name; nodes numbered by their lowest rank; local rank = index in rank order."""
    host = hostname if hostname is not None else socket.gethostname()
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
    leader = local.allreduce(comm.rank, op=MPI.MIN)
    local.Free()
    keys = comm.allgather((leader, host))
    hosts = [h for _, h in keys]
    order = []
    for k in keys:
        if k not in order:
            order.append(k)
    nodes = [order.index(k) for k in keys]
    members = [[r for r in range(comm.size) if nodes[r] == n] for n in range(len(order))]
    local_ranks = [members[nodes[r]].index(r) for r in range(comm.size)]
    return hosts, nodes, local_ranks, members


def _check_against(t, comm, hosts, nodes, local_ranks, members):
    W = comm.size
    assert (t.world_size, t.num_nodes, t.rank, t.backend) == (W, len(members), comm.rank, "host")
    for r in range(W):
        assert (t.host_of(r), t.node_of(r), t.local_rank_of(r)) == (hosts[r], nodes[r], local_ranks[r]), r
        assert t.gpu_of(r) is None and t.source_of(r) == "hostname" and t.notes(r) == []
    for n, m in enumerate(members):
        assert t.ranks_on_node(n) == m
    for a in range(W):
        for b in range(W):
            want = "self" if a == b else ("shared_memory" if nodes[a] == nodes[b] else "network")
            assert t.link(a, b) == Link(want, source="hostname"), (a, b)


def test_discover_host_matches_mpi(comm):
    ref = _reference(comm)
    t = discover(comm, "host")

    def check():
        _check_against(t, comm, *ref)
        text = t.describe()
        assert f"{comm.size} rank" in text and text.count("\n  rank ") == comm.size
        if comm.size > 1:
            assert "SHM" in text and "  links:" in text
        back = Topology.from_dict(json.loads(json.dumps(t.as_dict())))
        assert back.links() == t.links() and [back.node_of(r) for r in range(comm.size)] == ref[1]
    all_ranks(check)


def test_host_names_split_one_machine_into_nodes(comm, monkeypatch):
    """Ranks of one shared-memory group with different host names are different nodes (so several nodes on this
    machine): 2 ranks per fake host, and the single-node shortcut of Communicator kept apart too."""
    fake = f"fakehost-{comm.rank // 2}"
    monkeypatch.setattr(socket, "gethostname", lambda: fake)
    ref = _reference(comm, fake)
    t = discover(comm, "host")
    t1 = discover(comm, "host", single_node=True)

    def check():
        _check_against(t, comm, *ref)
        assert t.num_nodes == (comm.size + 1) // 2
        assert t1.links() == t.links()
        if comm.size > 2:
            assert t.link(0, 2).kind == "network" and t.link(1, 0).kind == "shared_memory"
            assert "NET" in t.describe()
    all_ranks(check)


def test_communicator_topology(comm, backend):
    """``comm.topology``: built on first read (not at construction), local (rank 0 reads it alone first: no
    collective to hang), cached, read-only, readable after close; the same nodes as the reference; on the GPU,
    every rank's GPU and the pairs that share one against CuPy's own answers."""
    ref = _reference(comm)
    with cs.Communicator(comm, backend=backend) as c:
        lazy = "_topology_obj" not in c.__dict__  # checked with the rest below, on every rank (all_ranks)
        if comm.rank == 0:
            alone = c.topology.describe()
        comm.Barrier()
        t = c.topology
        alone_same = comm.rank != 0 or alone == t.describe()
        gpus = None
        if backend == "cuda":
            import cupy
            props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
            gpus = comm.allgather((bytes(props["uuid"]).hex(), cupy.cuda.Device().pci_bus_id.lower()))

    def check():
        assert lazy, "the topology was built at construction"
        assert alone_same, "rank 0's topology read alone differs from the one read after the Barrier"
        assert c.topology is t and isinstance(t, cs.Topology)
        with pytest.raises(AttributeError):
            c.topology = None
        W = comm.size
        assert (t.world_size, t.backend, t.rank) == (W, backend, comm.rank)
        for r in range(W):
            assert (t.host_of(r), t.node_of(r), t.local_rank_of(r)) == (ref[0][r], ref[1][r], ref[2][r])
        for a in range(W):
            for b in range(W):
                lk = t.link(a, b)
                assert lk.kind in topology.LINK_KINDS and lk.kind == t.link(b, a).kind
                if backend == "host":
                    assert lk.kind == ("self" if a == b else "shared_memory")
                elif a == b:
                    assert lk.kind == "self"
                else:
                    assert (lk.kind == "same_gpu") == (gpus[a] == gpus[b]), (a, b, lk)
                    assert lk.kind in ("same_gpu", "nvlink", "pcie", "none"), (a, b, lk, t.notes(a))
                    assert (lk.nvlink_count > 0) == (lk.kind == "nvlink")
        if backend == "cuda":
            for r in range(W):
                g = t.gpu_of(r)
                assert (g["uuid"], g["pci_bus_id"]) == gpus[r] and t.source_of(r) in ("nvml", "cuda")
            if comm.rank == 0:
                print("\n" + t.describe())  # on the GPU machine: what the test saw (pytest -s)
    all_ranks(check)
    c2 = cs.Communicator(comm, backend=backend)
    c2.close()
    assert c2.topology.world_size == comm.size  # first read after close: still local


def test_argument_errors(comm):
    t = discover(comm, "host")
    W = comm.size

    def check():
        with pytest.raises(ValueError, match=r"Topology.link: argument 'a' must be a rank in \[0, %d\], got %d" % (W - 1, W)):
            t.link(W, 0)
        with pytest.raises(ValueError, match=r"Topology.link: argument 'b' must be a rank in \[0, %d\], got -1" % (W - 1)):
            t.link(0, -1)
        with pytest.raises(TypeError, match="'b' must be an int"):
            t.link(0, 1.0)
        with pytest.raises(TypeError, match="'a' must be an int"):
            t.link(True, 0)
        import numpy as np
        assert t.link(np.int64(0), np.int32(0)).kind == "self"
        for fn in (t.node_of, t.local_rank_of, t.host_of, t.gpu_of, t.source_of, t.notes):
            with pytest.raises(ValueError, match="'rank' must be a rank"):
                fn(W)
        with pytest.raises(ValueError, match=r"ranks_on_node: argument 'node' must be a node in \[0, %d\], got %d"
                           % (t.num_nodes - 1, t.num_nodes)):
            t.ranks_on_node(t.num_nodes)
        with pytest.raises(ValueError, match="backend must be 'host' or 'cuda'"):
            discover(comm, "gpu")  # checked before anything collective: alike on every rank
        with pytest.raises(ValueError, match="backend"):
            Topology("gpu", [{"host": "h", "shm": 0}])
        with pytest.raises(ValueError, match="one record per rank"):
            Topology("host", [])
        with pytest.raises(ValueError, match="record of rank 1"):
            Topology("host", [{"host": "h", "shm": 0}, {"host": "h"}])
    all_ranks(check)


# ---- synthetic multi-node records ---------------------------------------------------------------------------

def test_nodes_from_records():
    """Real multi-node layouts, from records: two hosts; one host name on two machines (containers); two names in
    one shared-memory group; interleaved ranks."""
    t = Topology("host", [{"host": h, "shm": s} for h, s in [("a", 0), ("a", 0), ("b", 2), ("b", 2)]])
    assert t.num_nodes == 2 and [t.node_of(r) for r in range(4)] == [0, 0, 1, 1]
    assert [t.local_rank_of(r) for r in range(4)] == [0, 1, 0, 1] and t.ranks_on_node(1) == [2, 3]
    assert t.link(1, 2).kind == "network" and t.link(2, 3).kind == "shared_memory"
    t = Topology("host", [{"host": "localhost", "shm": s} for s in (0, 1, 0, 1)])  # interleaved, one name
    assert [t.node_of(r) for r in range(4)] == [0, 1, 0, 1] and t.ranks_on_node(1) == [1, 3]
    assert [t.local_rank_of(r) for r in range(4)] == [0, 0, 1, 1]
    t = Topology("host", [{"host": h, "shm": 0} for h in ("x", "y")])
    assert t.num_nodes == 2 and t.link(0, 1).kind == "network"
    recs = [dict(host=h, shm=s, gpu=None, notes=[]) for h, s in [("a", 0), ("b", 1)]]
    t = Topology("cuda", recs)
    assert t.link(0, 1) == Link("host", source="hostname") and t.link(0, 1).short() == "HOST"
    assert t.rank is None and "node 1: host b, ranks 1" in t.describe()
    big = Topology("host", [{"host": f"h{r // 8}", "shm": r // 8 * 8} for r in range(32)])
    text = big.describe()
    assert "node 3: host h3, ranks 24-31" in text and "pairs by link: NET 384, SHM 112" in text
    assert topology._ranges([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"


# ---- the GPU paths, through fakes ---------------------------------------------------------------------------

class _FakeNVMLError(Exception):
    pass


class _FakeRuntime:
    """``cupy.cuda.runtime`` as far as topology uses it: GPUs by (domain, bus, device, uuid byte) and a peer-access
    table."""

    def __init__(self, buses, peer, current=0):
        self.buses, self.peer, self.current = buses, peer, current

    def getDeviceCount(self):
        return len(self.buses)

    def getDevice(self):
        return self.current

    def getDeviceProperties(self, d):
        dom, bus, dev = self.buses[d]
        return {"name": b"Fake H200\0\0", "uuid": bytes([d + 1] * 16), "pciDomainID": dom, "pciBusID": bus,
                "pciDeviceID": dev, "multiProcessorCount": 132}

    def deviceCanAccessPeer(self, a, b):
        return int(self.peer(a, b))


BUSES = [(0, 0x18, 0), (0, 0x2A, 0), (0, 0x3A, 0)]
PCI = ["0000:18:00.0", "0000:2a:00.0", "0000:3a:00.0"]


def _fake_pynvml(remote, *, version=6, switch=False, init_error=None, pci_lookup=True):
    """A ``pynvml`` module: GPU ``i`` (by ``PCI[i]``) has ``remote[i]`` = the remote bus ids of its active links
    (links past them are not supported, like a GPU with fewer than NVML_NVLINK_MAX_LINKS); ``switch``: every link
    ends at an NVSwitch. ``calls`` counts init / shutdown."""
    m = types.ModuleType("pynvml")
    m.NVMLError = _FakeNVMLError
    m.NVML_FEATURE_ENABLED, m.NVML_NVLINK_MAX_LINKS = 1, 36
    m.NVML_NVLINK_DEVICE_TYPE_GPU, m.NVML_NVLINK_DEVICE_TYPE_SWITCH = 0, 2
    m.calls = {"init": 0, "shutdown": 0, "by_uuid": 0}

    def init():
        if init_error:
            raise _FakeNVMLError(init_error)
        m.calls["init"] += 1

    def shutdown():
        m.calls["shutdown"] += 1

    def by_pci(bus):
        assert isinstance(bus, bytes)
        if not pci_lookup or bus.decode() not in PCI:
            raise _FakeNVMLError("Not Found")
        return ("h", PCI.index(bus.decode()))

    def by_uuid(uuid):
        m.calls["by_uuid"] += 1
        for i in range(len(PCI)):
            h = bytes([i + 1] * 16).hex()
            if uuid == f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}".encode():
                return ("h", i)
        raise _FakeNVMLError("Not Found")

    def link_of(h, i):
        if i >= len(remote[h[1]]):
            raise _FakeNVMLError("Not Supported")
        return remote[h[1]][i]

    def state(h, i):
        link_of(h, i)
        return 1

    def remote_pci(h, i):
        bus = link_of(h, i)
        dom, b, dev = (int(x, 16) for x in bus.replace(".", ":").split(":")[:3])
        return types.SimpleNamespace(domain=dom, bus=b, device=dev, busId=("%08X:%02X:%02X.0" % (dom, b, dev)).encode())

    def remote_type(h, i):
        link_of(h, i)
        return 2 if switch else 0

    def nvl_version(h, i):
        link_of(h, i)
        return version

    m.nvmlInit, m.nvmlShutdown = init, shutdown
    m.nvmlDeviceGetHandleByPciBusId, m.nvmlDeviceGetHandleByUUID = by_pci, by_uuid
    m.nvmlDeviceGetNvLinkState, m.nvmlDeviceGetNvLinkRemotePciInfo = state, remote_pci
    m.nvmlDeviceGetNvLinkRemoteDeviceType, m.nvmlDeviceGetNvLinkVersion = remote_type, nvl_version
    return m


def _records(monkeypatch, rt, devices, host="node-a", nvml=True):
    """One cuda record per device ordinal (as many ranks on one host), built through ``local_record``."""
    monkeypatch.setattr(topology, "_runtime", lambda: rt)
    monkeypatch.setattr(socket, "gethostname", lambda: host)
    out = []
    for d in devices:
        rec = local_record("cuda", device=d, nvml=nvml)
        rec["shm"] = 0
        out.append(rec)
    return out


def test_nvml_two_gpus_18_nvlinks(monkeypatch):
    """Two GPUs with 18 NVLink 4.0 links between them (H100 / H200 NVL style), a third rank on GPU 0 (MPS): NVML
    is the source, 18 links, 450 GB/s one direction; the MPS pair is the same GPU; the CUDA answer is not used."""
    nv = _fake_pynvml([[PCI[1]] * 18, [PCI[0]] * 18])
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    rt = _FakeRuntime(BUSES[:2], peer=lambda a, b: False)  # NVML must win over a (wrong) CUDA "no peer access"
    recs = _records(monkeypatch, rt, [0, 1, 0])
    assert nv.calls["init"] == nv.calls["shutdown"] == 3 and nv.calls["by_uuid"] == 0
    t = Topology("cuda", recs, rank=0)
    want = Link("nvlink", nvlink_count=18, nvlink_gbps=450.0, source="nvml", nvswitch=False, nvlink_version="4.0")
    assert t.link(0, 1) == t.link(1, 0) == t.link(2, 1) == want
    assert t.link(0, 2) == Link("same_gpu", source="cuda") and t.link(1, 1).kind == "self"
    assert [t.source_of(r) for r in range(3)] == ["nvml"] * 3 and t.notes(0) == []
    assert t.gpu_of(1) == {"ordinal": 1, "uuid": "02" * 16, "name": "Fake H200", "pci_bus_id": PCI[1]}
    assert recs[0]["nvml"] == {"links": {PCI[1]: {"count": 18, "version": 6}}, "switch": {"count": 0,
                                                                                          "version": None}}
    text = t.describe()
    assert "NV18" in text and "GPU" in text and "NV18: 18 NVLink 4.0 links, 450 GB/s per direction" in text
    assert f"pci={PCI[1]}" in text and "links from nvml" in text
    back = Topology.from_dict(json.loads(json.dumps(t.as_dict())))
    assert back.links() == t.links() and back.rank == 0
    assert t.as_dict()["links"][0][1]["nvlink_count"] == 18


def test_nvml_through_nvswitch_and_uuid_lookup(monkeypatch):
    """HGX style: every link of both GPUs ends at an NVSwitch (the remote bus id is the switch's, never the peer
    GPU's): still NVLink, 18 links through NVSwitch; NVLink 5.0 is 50 GB/s a link; the handle found by UUID when
    the bus id lookup fails."""
    nv = _fake_pynvml([["0000:c0:00.0"] * 18, ["0000:c1:00.0"] * 18], version=7, switch=True, pci_lookup=False)
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    recs = _records(monkeypatch, _FakeRuntime(BUSES[:2], peer=lambda a, b: True), [0, 1])
    assert nv.calls["by_uuid"] == 2
    t = Topology("cuda", recs)
    assert t.link(0, 1) == Link("nvlink", 18, 900.0, "nvml", nvswitch=True, nvlink_version="5.0")
    assert t.link(0, 1).short() == "NVS18" and "through NVSwitch" in t.describe()


def test_nvml_half_known_and_unknown_version(monkeypatch):
    """NVML fails on one rank: the other rank's view decides; an NVLink version outside the table gives no speed;
    a GPU with no NVLink (PCIe card) falls to CUDA peer access."""
    nv = _fake_pynvml([[PCI[1]] * 4, [PCI[0]] * 4, []], version=99)
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    recs = _records(monkeypatch, _FakeRuntime(BUSES, peer=lambda a, b: {a, b} == {0, 2}), [0, 1, 2])
    recs[0]["nvml"], recs[0]["source"] = None, "cuda"  # as if NVML failed there
    t = Topology("cuda", recs)
    assert t.link(0, 1) == Link("nvlink", 4, None, "nvml", nvlink_version="enum 99")
    assert t.link(0, 2) == Link("pcie", source="cuda") and t.link(1, 2) == Link("none", source="cuda")
    assert "speed unknown" in t.describe()


def test_communicator_records_get_nvml_on_first_read(monkeypatch):
    """Communicator's path: records gathered without NVML (construction never calls it), then one process's NVML
    fills in every GPU of the node (``with_local_nvml``); the records themselves stay as gathered."""
    nv = _fake_pynvml([[PCI[1]] * 18, [PCI[0]] * 18])
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    recs = _records(monkeypatch, _FakeRuntime(BUSES[:2], peer=lambda a, b: True), [0, 1], nvml=False)
    assert nv.calls["init"] == 0 and [r["nvml"] for r in recs] == [None, None]
    assert Topology("cuda", recs).link(0, 1) == Link("pcie", source="cuda")
    filled = topology.with_local_nvml(recs, rank=1)
    assert nv.calls["init"] == nv.calls["shutdown"] == 1 and recs[0]["nvml"] is None
    t = Topology("cuda", filled, rank=1)
    assert t.link(0, 1) == Link("nvlink", 18, 450.0, "nvml", nvlink_version="4.0")
    assert [t.source_of(r) for r in range(2)] == ["nvml", "nvml"]
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml([[], []], init_error="Driver Not Loaded"))
    t = Topology("cuda", topology.with_local_nvml(recs, rank=1))
    assert t.link(0, 1).kind == "pcie" and t.notes(0) == ["nvml (queried on rank 1): _FakeNVMLError: Driver Not "
                                                          "Loaded"]
    assert topology.with_local_nvml([{"host": "h", "shm": 0, "gpu": None}]) == [
        {"host": "h", "shm": 0, "gpu": None, "notes": []}]


def test_fallback_without_nvml(monkeypatch):
    """No nvidia-ml-py: links from cudaDeviceCanAccessPeer (pcie / none), the reason in the notes; NVML init
    failing: the same, with NVML's message."""
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    rt = _FakeRuntime(BUSES, peer=lambda a, b: {a, b} == {0, 1})
    recs = _records(monkeypatch, rt, [0, 1, 2])
    t = Topology("cuda", recs)
    assert t.link(0, 1) == t.link(1, 0) == Link("pcie", source="cuda")
    assert t.link(0, 2) == t.link(2, 1) == Link("none", source="cuda")
    assert t.source_of(0) == "cuda" and "nvidia-ml-py is not installed" in t.notes(0)[0]
    assert recs[0]["peer_access"] == {PCI[1]: True, PCI[2]: False}
    assert "PCIE" in t.describe() and "NONE" in t.describe() and "note: nvml:" in t.describe()
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml([[], [], []], init_error="Driver Not Loaded"))
    recs = _records(monkeypatch, rt, [0, 1])
    t = Topology("cuda", recs)
    assert t.link(0, 1).kind == "pcie" and t.notes(1) == ["nvml: _FakeNVMLError: Driver Not Loaded"]


def test_fallback_when_cuda_fails_too(monkeypatch):
    """No CuPy (or a broken runtime): no GPU identity, the pair is "unknown", nothing raises; a peer GPU that this
    process does not see (CUDA_VISIBLE_DEVICES) with no NVML: "unknown" too."""
    monkeypatch.setitem(sys.modules, "pynvml", None)

    def broken():
        raise ImportError("CuPy is not installed")
    monkeypatch.setattr(topology, "_runtime", broken)
    rec = local_record("cuda")
    assert rec["gpu"] is None and rec["source"] == "hostname" and "CuPy is not installed" in rec["notes"][0]
    t = Topology("cuda", [dict(rec, shm=0), dict(rec, shm=0)])
    assert t.link(0, 1) == Link("unknown", source="none") and t.gpu_of(0) is None
    assert "?" in t.describe()

    class Failing(_FakeRuntime):
        def deviceCanAccessPeer(self, a, b):
            raise RuntimeError("cudaErrorInvalidDevice")
    recs = _records(monkeypatch, Failing(BUSES[:2], None), [0])
    assert recs[0]["gpu"]["pci_bus_id"] == PCI[0] and "cudaDeviceCanAccessPeer failed" in recs[0]["notes"][0]
    alone = [_records(monkeypatch, _FakeRuntime([b], peer=lambda a, c: True), [0])[0] for b in BUSES[:2]]
    alone[1]["gpu"]["uuid"] = "ff" * 16
    t = Topology("cuda", alone)
    assert t.link(0, 1) == Link("unknown", source="none")


def test_pci_bus_id_forms():
    assert topology._norm_pci(b"00000000:2A:00.0\0\0") == "0000:2a:00.0"
    assert topology._norm_pci("0001:c1:1f.3") == "0001:c1:1f.3" and topology._norm_pci("junk") == "junk"
    assert topology._remote_pci(types.SimpleNamespace(busId=b"00000000:3A:00.0")) == "0000:3a:00.0"
    assert topology._nvml_uuid("0123456789abcdef0123456789abcdef") == "GPU-01234567-89ab-cdef-0123-456789abcdef"


# ---- python -m cupy_symbuf info ------------------------------------------------------------------------------

def test_info_prints_every_ranks_topology(comm, capsys):
    ref = _reference(comm)
    assert _info.main(["--json", "--backend", "host", "--no-communicator"]) == 0
    out_json = capsys.readouterr().out
    assert _info.main(["--backend", "host", "--no-communicator"]) == 0
    out_text = capsys.readouterr().out

    def check():
        if comm.rank != 0:
            assert out_json == out_text == ""
            return
        d = json.loads(out_json)["topology"]
        assert (d["world_size"], d["num_nodes"], d["backend"]) == (comm.size, len(ref[3]), "host")
        assert [(x["host"], x["node"], x["local_rank"]) for x in d["ranks"]] == list(zip(*ref[:3]))
        assert "Topology: backend=host, %d rank" % comm.size in out_text
        for r in range(comm.size):
            assert f"  rank {r}: node {ref[1][r]} local {ref[2][r]} host {ref[0][r]}" in out_text
    all_ranks(check)


@pytest.mark.parametrize("mutate, field", [
    (lambda d: d.pop("backend"), "'backend'"),
    (lambda d: d.pop("ranks"), "'ranks'"),
    (lambda d: d.__setitem__("ranks", []), "'ranks'"),
    (lambda d: d.__setitem__("ranks", "abc"), "'ranks'"),
    (lambda d: d["ranks"].__setitem__(1, "rank one"), "'ranks[1]'"),
    (lambda d: d["ranks"][0].pop("host"), "'ranks[0].host'"),
    (lambda d: d["ranks"][1].pop("shm"), "'ranks[1].shm'"),
    (lambda d: d["ranks"][1].__setitem__("shm", "zero"), "'ranks[1].shm'"),
    (lambda d: d["ranks"][0].__setitem__("host", 7), "'ranks[0].host'"),
    (lambda d: d["ranks"][0].__setitem__("gpu", "GPU0"), "'ranks[0].gpu'"),
    (lambda d: d["ranks"][1]["gpu"].pop("uuid"), "'ranks[1].gpu.uuid'"),
    (lambda d: d["ranks"][0].__setitem__("peer_access", [True]), "'ranks[0].peer_access'"),
    (lambda d: d["ranks"][0].__setitem__("notes", 3), "'ranks[0].notes'"),
    (lambda d: d.__setitem__("rank", 9), "'rank'"),
])
def test_from_dict_malformed_names_the_field(mutate, field):
    """A malformed record gives ValueError naming the field, not a raw KeyError / TypeError (which the old code
    raised for every one of these but the empty list)."""
    gpu = lambda i: {"ordinal": i, "uuid": "%02d" % i * 16, "pci_bus_id": "0000:%02x:00.0" % (i + 1), "name": "G"}
    recs = [{"host": "h", "shm": 0, "gpu": gpu(i), "nvml": None, "peer_access": {}, "source": "cuda", "notes": []}
            for i in range(2)]
    d = json.loads(json.dumps(Topology("cuda", recs, rank=0).as_dict()))
    assert Topology.from_dict(json.loads(json.dumps(d))).links()[0][1].kind == "unknown"
    mutate(d)
    with pytest.raises(ValueError, match=re.escape(field)):
        Topology.from_dict(d)
    with pytest.raises(ValueError, match="expected a dict"):
        Topology.from_dict([d])
