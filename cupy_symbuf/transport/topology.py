"""Topology of a communicator's ranks: nodes and hosts, GPUs by UUID / PCI bus id, and how every pair is linked.

:func:`discover` is collective over an MPI communicator: one ``MPI.COMM_TYPE_SHARED`` split (skipped when the caller
knows the ranks share one node) and one bounded allgather (:func:`cupy_symbuf.transport.agree.exchange_all`) of a small
record per rank, which that rank builds from local queries only:

* the host name, and the lowest rank of its shared-memory group (the node is that group and host name together:
  two machines with one host name, e.g. containers, stay apart, and so do two host names in one shared-memory
  domain);
* on the cuda backend, the current GPU (UUID and PCI bus id from ``cudaGetDeviceProperties``, name, ordinal), its
  active NVLink links through NVML (``nvidia-ml-py``, optional: per link the remote PCI bus id, whether the far end
  is a GPU or an NVSwitch, and the NVLink version), and ``cudaDeviceCanAccessPeer`` towards every other GPU this
  process sees (by PCI bus id).

Every pair ``(a, b)`` is then classified without further communication (:meth:`Topology.link`). Nothing here
raises for a missing or failing optional piece (no CuPy, no GPU, no ``pynvml``, NVML init failing, a query not
supported): the record says which source was used (``"nvml"``, ``"cuda"``, ``"hostname"``) and why the better one
was not (:meth:`Topology.notes`).

``Communicator.topology`` gives a communicator's topology with no communication of its own: construction's first
exchange already carries every rank's record without NVML (``local_record(..., nvml=False)``: host name, GPU, peer
access), and the first read adds the NVLink links through the reading process's NVML (:func:`with_local_nvml`; a
Communicator's ranks share one machine). ``python -m cupy_symbuf info`` prints the topology of ``MPI.COMM_WORLD``
(:func:`discover`).
"""
from __future__ import annotations

import dataclasses
import socket
from typing import Any, Dict, List, Optional

from ..common.checks import check_int

__all__ = ["Topology", "Link", "discover", "local_record", "with_local_nvml", "LINK_KINDS",
           "NVLINK_GBPS_PER_LINK"]

#: Every ``Link.kind``, best first (within a node):
#: ``"self"`` (a rank and itself); ``"same_gpu"`` (two ranks on one GPU, same UUID: MPS); ``"nvlink"`` (NVLink,
#: direct or through NVSwitch); ``"pcie"`` (peer access without NVLink: without NVML, whose absence the notes
#: say, an NVLink pair reads as ``"pcie"`` too, from ``cudaDeviceCanAccessPeer``); ``"none"`` (no peer access);
#: ``"unknown"`` (same node, but neither NVML nor CUDA could say: e.g. the peer GPU is not visible to this process
#: and NVML is absent); ``"shared_memory"`` (host backend, same node); and across nodes ``"host"`` (cuda backend:
#: through host memory and the network) and ``"network"`` (host backend).
LINK_KINDS = ("self", "same_gpu", "nvlink", "pcie", "none", "unknown", "shared_memory", "host", "network")

#: Nominal data rate of one NVLink link, one direction, GB/s, by NVML's ``nvmlNvlinkVersion_t`` (what
#: ``nvmlDeviceGetNvLinkVersion`` returns: an enum, not the version number: 6 is NVLink 4.0, H100 / H200).
#: 1.0: 20; 2.0 to 4.0: 25; 5.0: 50. Versions not listed give ``nvlink_gbps=None``.
NVLINK_GBPS_PER_LINK = {1: 20.0, 2: 25.0, 3: 25.0, 4: 25.0, 5: 25.0, 6: 25.0, 7: 50.0}
_NVLINK_VERSION_NAMES = {1: "1.0", 2: "2.0", 3: "2.2", 4: "3.0", 5: "3.1", 6: "4.0", 7: "5.0", 8: "6.0"}

_ABBREV = {"self": "X", "same_gpu": "GPU", "pcie": "PCIE", "none": "NONE", "unknown": "?",
           "shared_memory": "SHM", "host": "HOST", "network": "NET"}


@dataclasses.dataclass(frozen=True)
class Link:
    """How two ranks are linked (:meth:`Topology.link`).

    Attributes
    ----------
    kind : str
        One of :data:`LINK_KINDS`.
    nvlink_count : int
        Active NVLink links between the two GPUs (``kind == "nvlink"``; through NVSwitch: the smaller of the two
        GPUs' switch link counts, the links one transfer between them can use); 0 otherwise.
    nvlink_gbps : float or None
        ``nvlink_count`` times the nominal per-link rate of the NVLink version (:data:`NVLINK_GBPS_PER_LINK`), GB/s
        one direction; None when not NVLink or the version is unknown. An upper bound, not a measurement.
    source : str
        Where the answer came from: ``"nvml"`` (NVLink state), ``"cuda"`` (``cudaDeviceCanAccessPeer``, or the
        GPU UUID for ``same_gpu``), ``"hostname"`` (the node grouping alone), ``"none"`` (nothing could tell).
    nvswitch : bool
        The NVLink path goes through NVSwitch (the GPUs' links end at a switch, not at each other).
    nvlink_version : str or None
        NVLink version, e.g. ``"4.0"`` (``kind == "nvlink"`` and NVML reported it).
    """

    kind: str
    nvlink_count: int = 0
    nvlink_gbps: Optional[float] = None
    source: str = "hostname"
    nvswitch: bool = False
    nvlink_version: Optional[str] = None

    def as_dict(self) -> dict:
        """The fields as a plain dict (JSON-able)."""
        return dataclasses.asdict(self)

    def short(self) -> str:
        """A few characters for the link matrix of :meth:`Topology.describe`: ``X``, ``GPU``, ``NV18``
        (``NVS18`` through NVSwitch), ``PCIE``, ``NONE``, ``?``, ``SHM``, ``HOST``, ``NET``."""
        if self.kind == "nvlink":
            return f"{'NVS' if self.nvswitch else 'NV'}{self.nvlink_count}"
        return _ABBREV.get(self.kind, self.kind)


Link.__init__.__doc__ = "A link record from its fields (see the class docstring); :meth:`Topology.link` makes them."


# ---- the local record ---------------------------------------------------------------------------------------

def _pci(domain: int, bus: int, device: int, function: int = 0) -> str:
    return "%04x:%02x:%02x.%x" % (int(domain), int(bus), int(device), int(function))


def _norm_pci(text) -> str:
    """``"00000000:18:00.0"`` / ``b"0000:18:00.0"`` -> ``"0000:18:00.0"`` (lower case, 4-digit domain)."""
    if isinstance(text, (bytes, bytearray)):
        text = bytes(text).split(b"\0")[0].decode(errors="replace")
    text = str(text).strip().lower()
    try:
        dom, bus, rest = text.split(":")
        dev, _, fn = rest.partition(".")
        return _pci(int(dom, 16), int(bus, 16), int(dev, 16), int(fn or "0", 16))
    except ValueError:
        return text


def _remote_pci(info) -> str:
    """The normalized bus id of an ``nvmlPciInfo_t`` (its numeric fields, else its ``busId`` text)."""
    try:
        return _pci(info.domain, info.bus, info.device)
    except (AttributeError, TypeError, ValueError):
        return _norm_pci(getattr(info, "busId", b"") or getattr(info, "busIdLegacy", b""))


def _nvml_uuid(uuid_hex: str) -> str:
    """CUDA's 16 UUID bytes (hex) as NVML spells them: ``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx``."""
    h = uuid_hex
    return f"GPU-{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def _runtime():
    """``cupy.cuda.runtime`` (tests replace this function with a fake runtime)."""
    from ..common import backend as _compat
    if _compat.cupy is None:
        raise ImportError("CuPy is not installed")
    return _compat.cupy.cuda.runtime


def _gpu(rt, device: int) -> dict:
    props = rt.getDeviceProperties(device)
    uuid = props.get("uuid", b"")
    uuid = bytes(uuid).hex() if isinstance(uuid, (bytes, bytearray)) else str(uuid)
    name = props.get("name", b"")
    name = bytes(name).split(b"\0")[0].decode(errors="replace") if isinstance(name, (bytes, bytearray)) else str(name)
    return {"ordinal": int(device), "uuid": uuid, "name": name,
            "pci_bus_id": _pci(props.get("pciDomainID", 0), props.get("pciBusID", 0), props.get("pciDeviceID", 0))}


def _nvml_links(nvml, gpu: dict) -> dict:
    """``{"links": {remote_pci: {"count", "version"}}, "switch": {"count", "version"}}``: the active NVLink links of
    ``gpu`` through the initialized NVML module ``nvml``, grouped by the far end (a GPU's bus id, or the NVSwitch
    fabric). Raises when the GPU is not found."""
    try:
        h = nvml.nvmlDeviceGetHandleByPciBusId(gpu["pci_bus_id"].encode())
    except Exception:  # noqa: BLE001 - some drivers want the 8-digit domain; the UUID is unambiguous
        h = nvml.nvmlDeviceGetHandleByUUID(_nvml_uuid(gpu["uuid"]).encode())
    enabled = getattr(nvml, "NVML_FEATURE_ENABLED", 1)
    switch_type = getattr(nvml, "NVML_NVLINK_DEVICE_TYPE_SWITCH", 2)
    links: Dict[str, dict] = {}
    switch: Dict[str, Any] = {"count": 0, "version": None}
    for i in range(int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18))):
        try:
            if nvml.nvmlDeviceGetNvLinkState(h, i) != enabled:
                continue
        except Exception:  # noqa: BLE001 - no such link on this GPU (NotSupported / InvalidArgument)
            continue
        try:
            version = int(nvml.nvmlDeviceGetNvLinkVersion(h, i))
        except Exception:  # noqa: BLE001
            version = None
        try:
            to_switch = nvml.nvmlDeviceGetNvLinkRemoteDeviceType(h, i) == switch_type
        except Exception:  # noqa: BLE001 - older NVML: the remote bus id alone decides (a switch matches no GPU)
            to_switch = False
        if to_switch:
            entry = switch
        else:
            entry = links.setdefault(_remote_pci(nvml.nvmlDeviceGetNvLinkRemotePciInfo(h, i)),
                                     {"count": 0, "version": None})
        entry["count"] += 1
        if version is not None:
            entry["version"] = version if entry["version"] is None else min(entry["version"], version)
    return {"links": links, "switch": switch}


def _nvml_views(gpus: List[dict]) -> Dict[str, Any]:
    """``{pci_bus_id: links dict, or the error text}`` for every GPU of ``gpus`` (one NVML init); raises
    ``ImportError`` without ``nvidia-ml-py`` and the NVML error when init fails."""
    import pynvml as nvml  # ImportError: nvidia-ml-py is not installed
    nvml.nvmlInit()
    out: Dict[str, Any] = {}
    try:
        for g in gpus:
            try:
                out[g["pci_bus_id"]] = _nvml_links(nvml, g)
            except Exception as exc:  # noqa: BLE001
                out[g["pci_bus_id"]] = f"{type(exc).__name__}: {exc}"
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass
    return out


def _nvml_failure(exc: BaseException) -> str:
    if isinstance(exc, ImportError):
        return "nvidia-ml-py is not installed (pip install nvidia-ml-py): no NVLink details"
    return f"{type(exc).__name__}: {exc}"


def local_record(backend: str, device: Optional[int] = None, *, nvml: bool = True) -> dict:
    """This process's part of the topology, from local queries only; never raises.

    Parameters
    ----------
    backend : {"host", "cuda"}
        ``"host"``: the host name only. ``"cuda"``: also the GPU ``device`` (default: the current CUDA device), its
        NVLink links (NVML) and its peer access towards every GPU this process sees.
    device : int, optional
        CUDA device ordinal of this rank's GPU.
    nvml : bool
        Query NVML too (False: leave ``nvml`` None, for :func:`with_local_nvml` to fill in later; what
        ``Communicator`` construction gathers, so that it never pays for NVML).

    Returns
    -------
    dict
        ``host`` (str), ``gpu`` (``{"ordinal", "uuid", "pci_bus_id", "name"}`` or None), ``nvml`` (the GPU's
        active NVLink links ``{"links": {remote_pci_bus_id: {"count", "version"}}, "switch": {"count",
        "version"}}``, or None), ``peer_access`` (``{pci_bus_id: bool}`` or None), ``source`` (the best
        link source that worked: ``"nvml"``, ``"cuda"``, ``"hostname"``), ``notes`` (list of str: what failed).
        :func:`discover` adds ``shm`` (lowest rank of the shared-memory group).
    """
    rec: Dict[str, Any] = {"host": socket.gethostname(), "gpu": None, "nvml": None, "peer_access": None,
                           "source": "hostname", "notes": []}
    if backend != "cuda":
        return rec
    try:
        rt = _runtime()
        me = int(rt.getDevice()) if device is None else int(device)
        rec["gpu"] = _gpu(rt, me)
    except Exception as exc:  # noqa: BLE001 - reported, never fatal
        rec["notes"].append(f"cuda: no GPU identity ({type(exc).__name__}: {exc})")
        return rec
    try:
        peers = {}
        for d in range(int(rt.getDeviceCount())):
            if d != me:
                peers[_gpu(rt, d)["pci_bus_id"]] = bool(rt.deviceCanAccessPeer(me, d))
        rec["peer_access"] = peers
        rec["source"] = "cuda"
    except Exception as exc:  # noqa: BLE001
        rec["notes"].append(f"cuda: cudaDeviceCanAccessPeer failed ({type(exc).__name__}: {exc})")
    if nvml:
        _fill_nvml([rec], "")
    return rec


def _fill_nvml(records: List[dict], where: str) -> None:
    """Set ``nvml`` (and ``source`` "nvml") of every record with a GPU from this process's NVML, or add a note."""
    gpus = {r["gpu"]["pci_bus_id"]: r["gpu"] for r in records if r.get("gpu")}
    if not gpus:
        return
    try:
        views: Dict[str, Any] = _nvml_views(list(gpus.values()))
    except Exception as exc:  # noqa: BLE001 - ImportError included: reported, never fatal
        views = {pci: _nvml_failure(exc) for pci in gpus}
    for r in records:
        if not r.get("gpu"):
            continue
        view = views[r["gpu"]["pci_bus_id"]]
        if isinstance(view, dict):
            r["nvml"], r["source"] = view, "nvml"
        else:
            r["notes"] = list(r.get("notes") or []) + [f"nvml{where}: {view}"]


def with_local_nvml(records: List[dict], rank: Optional[int] = None) -> List[dict]:
    """Copies of ``records`` (ranks of this node, gathered without NVML: ``local_record(..., nvml=False)``) with
    every GPU's NVLink links read through this process's NVML (which sees every GPU of the machine, whatever
    ``CUDA_VISIBLE_DEVICES`` says); local, never raises (a failure is a note of each record, naming ``rank``, the
    rank that queried). Only for ranks on this process's machine: NVML cannot see another node's GPUs."""
    out = [dict(r, notes=list(r.get("notes") or [])) for r in records]
    _fill_nvml(out, "" if rank is None else f" (queried on rank {rank})")
    return out


def discover(comm, backend: str = "host", timeout_s: float = 30.0, *, device: Optional[int] = None,
             single_node: bool = False) -> "Topology":
    """The :class:`Topology` of ``comm``'s ranks. Collective over ``comm``.

    Parameters
    ----------
    comm : mpi4py.MPI.Comm
        Intra-communicator; every rank calls.
    backend : {"host", "cuda"}
        Which links to describe (see :func:`local_record`); the same on every rank.
    timeout_s : float
        Bound of the allgather (:class:`~cupy_symbuf.transport.agree.CollectiveTimeoutError` naming the ranks that never
        called).
    device : int, optional
        (cuda) This rank's GPU ordinal; default the current device.
    single_node : bool
        The caller knows every rank shares one node's memory (a :class:`~cupy_symbuf.Communicator` checked it):
        no ``Split_type``, only the allgather.

    Cost: one ``MPI.COMM_TYPE_SHARED`` split (blocking, unless ``single_node``), one bounded allgather of a few
    hundred bytes per rank, and the local NVML / CUDA queries (NVML init is the slowest part, milliseconds).
    """
    from mpi4py import MPI

    from . import agree as _agree
    if backend not in ("host", "cuda"):
        raise ValueError(f"discover: backend must be 'host' or 'cuda', got {backend!r}")
    rank = comm.Get_rank()
    shm = 0
    if not single_node:
        node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
        g_node, g_comm = node.Get_group(), comm.Get_group()
        try:
            shm = int(g_node.Translate_ranks([0], g_comm)[0])  # key=rank: local rank 0 is the group's lowest rank
        finally:
            g_node.Free()
            g_comm.Free()
            node.Free()
    rec = local_record(backend, device)
    rec["shm"] = shm
    records = _agree.exchange_all(comm, rec, timeout_s, "topology discovery")
    return Topology(backend, records, rank=rank)


# ---- the topology ---------------------------------------------------------------------------------------------

def _require(where: str, obj: dict, prefix: str, keys) -> None:
    """``ValueError`` naming the first of ``keys`` missing from ``obj`` (as ``'<prefix><key>'``)."""
    for key in keys:
        if key not in obj:
            raise ValueError(f"{where}: missing field '{prefix}{key}'")


class Topology:
    """Nodes, hosts, GPUs and pairwise links of ``world_size`` ranks (made by :func:`discover`; read-only).

    Parameters
    ----------
    backend : {"host", "cuda"}
        The backend the records describe.
    records : list of dict
        One :func:`local_record` per rank (with ``shm``), indexed by rank.
    rank : int, optional
        The rank of the process holding this object (None: not one of them, e.g. rebuilt by :meth:`from_dict`).

    Nodes are numbered by their lowest rank (node 0 holds rank 0); a rank's local rank is its index among its
    node's ranks in rank order. All queries are local (no communication).

    Raises
    ------
    ValueError
        ``backend`` unknown, no records, or a record missing ``host`` / ``shm``.
    """

    def __init__(self, backend: str, records: List[dict], *, rank: Optional[int] = None):
        """From every rank's record (local, no communication; :func:`discover` gathers the records)."""
        if backend not in ("host", "cuda"):
            raise ValueError(f"Topology: backend must be 'host' or 'cuda', got {backend!r}")
        if not records:
            raise ValueError("Topology: records must hold one record per rank, got none")
        for r, rec in enumerate(records):
            if not isinstance(rec, dict) or "host" not in rec or "shm" not in rec:
                raise ValueError(f"Topology: record of rank {r} must be a dict with 'host' and 'shm', got {rec!r}")
        self._backend = backend
        self._records = [dict(rec) for rec in records]
        self._rank = rank
        keys: Dict[tuple, int] = {}
        self._node: List[int] = []
        for rec in self._records:
            self._node.append(keys.setdefault((int(rec["shm"]), str(rec["host"])), len(keys)))
        self._members: List[List[int]] = [[] for _ in keys]
        for r, n in enumerate(self._node):
            self._members[n].append(r)
        self._local = [self._members[n].index(r) for r, n in enumerate(self._node)]
        self._links: Dict[tuple, Link] = {}

    @classmethod
    def from_dict(cls, d: dict) -> "Topology":
        """The topology :meth:`as_dict` wrote (e.g. read back from ``python -m cupy_symbuf info --json``).

        Parameters
        ----------
        d : dict
            ``backend`` (str), ``ranks`` (list of per-rank dicts, each with ``host`` (str) and ``shm`` (int), and
            optionally ``gpu`` (dict with ``ordinal``, ``uuid``, ``pci_bus_id``, ``name``, or None), ``nvml`` and
            ``peer_access`` (dict or None), ``source`` (str), ``notes`` (list of str)), optionally ``rank`` (int or
            None). Other keys (``links``, ``nodes``, ...) are ignored: the links are recomputed.

        Raises
        ------
        ValueError
            A malformed record: not a dict, a required field missing, or a field of the wrong type; the message
            names the field (``ranks[i].gpu.uuid``, ...).
        """
        raw = ("host", "shm", "gpu", "nvml", "peer_access", "source", "notes")
        where = "Topology.from_dict"
        if not isinstance(d, dict):
            raise ValueError(f"{where}: expected a dict (Topology.as_dict()), got {type(d).__name__}")
        _require(where, d, "", ("backend", "ranks"))
        if not isinstance(d["backend"], str):
            raise ValueError(f"{where}: field 'backend' must be a str, got {type(d['backend']).__name__}")
        ranks = d["ranks"]
        if not isinstance(ranks, (list, tuple)) or not ranks:
            raise ValueError(f"{where}: field 'ranks' must be a non-empty list of per-rank records, got "
                             f"{type(ranks).__name__ if not isinstance(ranks, (list, tuple)) else 'an empty list'}")
        records = []
        for i, rec in enumerate(ranks):
            name = f"ranks[{i}]"
            if not isinstance(rec, dict):
                raise ValueError(f"{where}: field {name!r} must be a dict, got {type(rec).__name__}")
            _require(where, rec, name + ".", ("host", "shm"))
            if not isinstance(rec["host"], str):
                raise ValueError(f"{where}: field '{name}.host' must be a str, got {type(rec['host']).__name__}")
            if isinstance(rec["shm"], bool) or not isinstance(rec["shm"], int):
                raise ValueError(f"{where}: field '{name}.shm' must be an int, got {type(rec['shm']).__name__}")
            for key in ("nvml", "peer_access"):
                if rec.get(key) is not None and not isinstance(rec[key], dict):
                    raise ValueError(f"{where}: field '{name}.{key}' must be a dict or null, got "
                                     f"{type(rec[key]).__name__}")
            if rec.get("notes") is not None and not isinstance(rec["notes"], (list, tuple)):
                raise ValueError(f"{where}: field '{name}.notes' must be a list or null, got "
                                 f"{type(rec['notes']).__name__}")
            if rec.get("source") is not None and not isinstance(rec["source"], str):
                raise ValueError(f"{where}: field '{name}.source' must be a str, got {type(rec['source']).__name__}")
            gpu = rec.get("gpu")
            if gpu is not None:
                if not isinstance(gpu, dict):
                    raise ValueError(f"{where}: field '{name}.gpu' must be a dict or null, got {type(gpu).__name__}")
                _require(where, gpu, name + ".gpu.", ("ordinal", "uuid", "pci_bus_id", "name"))
            records.append({k: rec.get(k) for k in raw})
        rank = d.get("rank")
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < len(records)):
            raise ValueError(f"{where}: field 'rank' must be null or an int in [0, {len(records)}), got {rank!r}")
        return cls(d["backend"], records, rank=rank)

    # ---- ranks and nodes -----------------------------------------------------------------------------------
    @property
    def backend(self) -> str:
        """``"host"`` or ``"cuda"``: which links the topology describes."""
        return self._backend

    @property
    def rank(self) -> Optional[int]:
        """The rank of the process that discovered it (None when rebuilt elsewhere)."""
        return self._rank

    @property
    def world_size(self) -> int:
        """Number of ranks."""
        return len(self._records)

    @property
    def num_nodes(self) -> int:
        """Number of nodes (shared-memory group and host name)."""
        return len(self._members)

    def _r(self, where: str, name: str, rank) -> int:
        return check_int(f"Topology.{where}", name, rank, minimum=0, maximum=self.world_size - 1, what="a rank")

    def node_of(self, rank: int) -> int:
        """Node index of ``rank`` (``ValueError``/``TypeError`` naming ``rank`` when not a rank)."""
        return self._node[self._r("node_of", "rank", rank)]

    def local_rank_of(self, rank: int) -> int:
        """Index of ``rank`` among its node's ranks."""
        return self._local[self._r("local_rank_of", "rank", rank)]

    def host_of(self, rank: int) -> str:
        """Host name of ``rank`` (``socket.gethostname()`` there)."""
        return str(self._records[self._r("host_of", "rank", rank)]["host"])

    def ranks_on_node(self, node: int) -> List[int]:
        """The ranks of ``node`` in rank order (``ValueError``/``TypeError`` naming ``node`` when out of
        ``[0, num_nodes)``)."""
        return list(self._members[check_int("Topology.ranks_on_node", "node", node, minimum=0,
                                            maximum=self.num_nodes - 1, what="a node")])

    def gpu_of(self, rank: int) -> Optional[dict]:
        """(cuda) ``{"ordinal", "uuid", "pci_bus_id", "name"}`` of ``rank``'s GPU, or None (host backend, or no GPU
        could be identified there: see :meth:`notes`)."""
        g = self._records[self._r("gpu_of", "rank", rank)].get("gpu")
        return dict(g) if g else None

    def source_of(self, rank: int) -> str:
        """The best link source that worked on ``rank``: ``"nvml"``, ``"cuda"`` or ``"hostname"``."""
        return str(self._records[self._r("source_of", "rank", rank)].get("source", "hostname"))

    def notes(self, rank: int) -> List[str]:
        """What failed on ``rank`` while discovering (e.g. NVML missing), as text; empty when nothing did."""
        return list(self._records[self._r("notes", "rank", rank)].get("notes") or [])

    # ---- links ---------------------------------------------------------------------------------------------
    def link(self, a: int, b: int) -> Link:
        """How ranks ``a`` and ``b`` are linked (a :class:`Link`; ``link(a, b) == link(b, a)`` when both ranks'
        queries agree, which they do on one machine).

        Across nodes: ``"host"`` (cuda) or ``"network"`` (host backend). Within a node, on the host backend:
        ``"shared_memory"``. On the cuda backend: ``"same_gpu"`` (one UUID), ``"nvlink"`` (NVML on either rank
        found active links between the two GPUs, directly or both through NVSwitch), else ``"pcie"`` / ``"none"``
        from ``cudaDeviceCanAccessPeer`` (``a``'s answer, else ``b``'s), else ``"unknown"``.

        Raises ``ValueError`` naming ``a`` or ``b`` when it is not a rank in ``[0, world_size)`` (``TypeError``
        when not an int).
        """
        a = self._r("link", "a", a)
        b = self._r("link", "b", b)
        got = self._links.get((a, b))
        if got is None:
            got = self._links[(a, b)] = self._classify(a, b)
        return got

    def _classify(self, a: int, b: int) -> Link:
        if a == b:
            return Link("self", source="hostname")
        if self._node[a] != self._node[b]:
            return Link("host" if self._backend == "cuda" else "network", source="hostname")
        if self._backend == "host":
            return Link("shared_memory", source="hostname")
        ra, rb = self._records[a], self._records[b]
        ga, gb = ra.get("gpu"), rb.get("gpu")
        if not ga or not gb:
            return Link("unknown", source="none")
        if (ga["uuid"], ga["pci_bus_id"]) == (gb["uuid"], gb["pci_bus_id"]):
            return Link("same_gpu", source="cuda")
        for x, y in ((ra, gb), (rb, ga)):  # NVLink seen from a, else from b
            nv = x.get("nvml")
            if not nv:
                continue
            direct = (nv.get("links") or {}).get(y["pci_bus_id"])
            if direct and direct.get("count"):
                return self._nvlink(direct["count"], direct.get("version"), False)
        sa, sb = [((r.get("nvml") or {}).get("switch") or {}) for r in (ra, rb)]
        if sa.get("count") and sb.get("count"):
            versions = [v for v in (sa.get("version"), sb.get("version")) if v is not None]
            return self._nvlink(min(sa["count"], sb["count"]), min(versions) if versions else None, True)
        for x, y in ((ra, gb), (rb, ga)):
            peers = x.get("peer_access")
            if peers is not None and y["pci_bus_id"] in peers:
                return Link("pcie" if peers[y["pci_bus_id"]] else "none", source="cuda")
        return Link("unknown", source="none")

    @staticmethod
    def _nvlink(count: int, version: Optional[int], via_switch: bool) -> Link:
        per = NVLINK_GBPS_PER_LINK.get(version) if version is not None else None
        return Link("nvlink", nvlink_count=int(count), nvlink_gbps=None if per is None else per * int(count),
                    source="nvml", nvswitch=via_switch,
                    nvlink_version=None if version is None else _NVLINK_VERSION_NAMES.get(version, f"enum {version}"))

    def links(self) -> List[List[Link]]:
        """``links()[a][b] == link(a, b)`` for every pair (``world_size`` x ``world_size``)."""
        return [[self.link(a, b) for b in range(self.world_size)] for a in range(self.world_size)]

    # ---- reports -------------------------------------------------------------------------------------------
    def as_dict(self) -> dict:
        """Everything, JSON-able: ``backend``, ``rank``, ``world_size``, ``num_nodes``, ``nodes`` (``{"node",
        "host", "ranks"}``), ``ranks`` (each rank's record plus ``rank``, ``node``, ``local_rank``) and ``links``
        (``world_size`` x ``world_size`` of :meth:`Link.as_dict`). :meth:`from_dict` reads it back."""
        import json
        nodes = [{"node": n, "host": self.host_of(m[0]), "ranks": list(m)} for n, m in enumerate(self._members)]
        ranks = [dict(rec, rank=r, node=self._node[r], local_rank=self._local[r])
                 for r, rec in enumerate(self._records)]
        out = {"backend": self._backend, "rank": self._rank, "world_size": self.world_size,
               "num_nodes": self.num_nodes, "nodes": nodes, "ranks": ranks,
               "links": [[link.as_dict() for link in row] for row in self.links()]}
        return json.loads(json.dumps(out, default=str))  # plain types only (the records came through pickle)

    def describe(self, max_matrix: int = 16) -> str:
        """A text report: one line per node, one per rank (host, local rank, GPU, link source, notes), then the
        link matrix (``X`` self, ``GPU`` same GPU, ``NV<n>`` n NVLink links, ``NVS<n>`` through NVSwitch, ``PCIE``,
        ``NONE``, ``?`` unknown, ``SHM`` shared memory, ``HOST`` / ``NET`` another node) when ``world_size <=
        max_matrix``, else the number of pairs of each kind."""
        W = self.world_size
        lines = [f"Topology: backend={self._backend}, {W} rank{'s' if W != 1 else ''} on {self.num_nodes} "
                 f"node{'s' if self.num_nodes != 1 else ''}"]
        for n, m in enumerate(self._members):
            lines.append(f"  node {n}: host {self.host_of(m[0])}, ranks {_ranges(m)}")
        for r, rec in enumerate(self._records):
            g = rec.get("gpu")
            gpu = (f" GPU {g['ordinal']} {g['name']} uuid={g['uuid']} pci={g['pci_bus_id']}" if g else "")
            src = f" links from {rec.get('source', 'hostname')}" if self._backend == "cuda" else ""
            line = f"  rank {r}: node {self._node[r]} local {self._local[r]} host {rec['host']}{gpu}{src}"
            for note in rec.get("notes") or []:
                line += f"\n    note: {note}"
            lines.append(line)
        if W > 1 and W <= max_matrix:
            width = max(4, max(len(self.link(a, b).short()) for a in range(W) for b in range(W)) + 1)
            lines.append("  links:" + "".join(f"{b:>{width}}" for b in range(W)))
            for a in range(W):
                lines.append(f"  {a:>6}" + "".join(f"{self.link(a, b).short():>{width}}" for b in range(W)))
            speeds = sorted({(lk.nvlink_count, lk.nvlink_gbps, lk.nvlink_version, lk.nvswitch)
                             for row in self.links() for lk in row if lk.kind == "nvlink"}, key=str)
            for count, gbps, version, sw in speeds:
                lines.append(f"  {'NVS' if sw else 'NV'}{count}: {count} NVLink {version or '(version unknown)'} "
                             f"links{' through NVSwitch' if sw else ''}, "
                             f"{'%g GB/s per direction (nominal)' % gbps if gbps is not None else 'speed unknown'}")
        elif W > 1:
            counts: Dict[str, int] = {}
            for a in range(W):
                for b in range(a + 1, W):
                    k = self.link(a, b).short()
                    counts[k] = counts.get(k, 0) + 1
            lines.append("  pairs by link: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"Topology(backend={self._backend!r}, world_size={self.world_size}, num_nodes={self.num_nodes})"


def _ranges(ranks: List[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    out, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            out.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ",".join(out)

