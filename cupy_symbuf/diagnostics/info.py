"""``cupy_symbuf.info()`` / ``python -m cupy_symbuf info``: what this installation and machine offer the transport.

Versions (cupy_symbuf, protocol, Python, NumPy, mpi4py and the MPI library, CuPy and CUDA, NVRTC, ml_dtypes,
torch), the backend ``auto`` resolves to, the CPU and cross-memory attach (the host path's one-copy mode), the GPUs
(name, UUID, PCI bus id, SMs, memory), peer access between them and their NVLink state through NVML
(``nvidia-ml-py``, optional), whether MPS looks active, and the tuning table entry that applies. Under ``mpiexec``
the CLI also builds a Communicator over ``MPI.COMM_WORLD`` and prints its resolved config and buffer map
(:meth:`Communicator.describe`) from rank 0, and the topology of every rank of ``MPI.COMM_WORLD``
(:func:`cupy_symbuf.topology.discover`: nodes, hosts, GPUs, the link of every pair), gathered on rank 0; on the cuda
backend the transport (``Config.transport``: ``ipc`` or ``staged``) that topology gives and the one the Communicator
chose (``--transport`` forces one).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys

__all__ = ["info", "main"]


def _version(module: str):
    try:
        mod = __import__(module)
    except Exception as exc:  # noqa: BLE001 - report, never fail
        return f"not available ({type(exc).__name__})"
    return getattr(mod, "__version__", "unknown")


def _gpus() -> dict:
    from ..common import backend as _compat
    out: dict = {"available": _compat.cuda_available()}
    if not out["available"]:
        return out
    cp = _compat.cupy
    from ..transport.symbuffer import gpu_identity
    rt = cp.cuda.runtime
    n = rt.getDeviceCount()
    devices = []
    for d in range(n):
        ident = gpu_identity(d)
        with cp.cuda.Device(d):
            free, total = rt.memGetInfo()
        devices.append(dict(ident, ordinal=d, memory_total_bytes=int(total), memory_free_bytes=int(free)))
    out["devices"] = devices
    out["peer_access"] = [[bool(i == j or rt.deviceCanAccessPeer(i, j)) for j in range(n)] for i in range(n)]
    out["cuda_runtime"] = rt.runtimeGetVersion()
    out["cuda_driver"] = rt.driverGetVersion()
    out["mps"] = _mps()
    out["nvlink"] = _nvlink(devices)
    return out


def _mps() -> str:
    """A hint, not a proof: the MPS pipe directory exists (``CUDA_MPS_PIPE_DIRECTORY`` or /tmp/nvidia-mps)."""
    pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")
    return f"control pipe found at {pipe}" if os.path.exists(os.path.join(pipe, "control")) else \
        f"no control pipe at {pipe} (not active, or elsewhere)"


def _nvlink(devices: list) -> dict:
    """Active NVLink links per GPU (by PCI bus id) through NVML, or why not."""
    try:
        import pynvml
    except ImportError:
        return {"status": "nvidia-ml-py not installed (pip install nvidia-ml-py)"}
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001
        return {"status": f"NVML init failed: {exc}"}
    out = {"status": "ok", "links": {}}
    try:
        for dev in devices:
            h = pynvml.nvmlDeviceGetHandleByPciBusId(dev["pci_bus_id"].encode())
            active = 0
            for link in range(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)):
                try:
                    active += pynvml.nvmlDeviceGetNvLinkState(h, link) == pynvml.NVML_FEATURE_ENABLED
                except pynvml.NVMLError:
                    break
            out["links"][dev["pci_bus_id"]] = active
    finally:
        pynvml.nvmlShutdown()
    return out


def info() -> dict:
    """The report as a dict (local to this process; no communication). Never raises for a missing optional
    piece: it says what is missing instead. ``live_communicators``: this process's communicators still
    allocated, ``{"count", "bytes" (symmetric memory on this rank), "dropped" (of them, dropped without close():
    allocated until exit), "dropped_at" (their creation sites, ``file:line``)}``."""
    from mpi4py import MPI

    from ..common.version import __version__
    from ..transport import cma as _cma
    from ..wire import protocol as _protocol
    from ..transport import tuning
    from ..transport.symbuffer import resolve_backend
    try:
        backend = resolve_backend("auto")
    except Exception as exc:  # noqa: BLE001
        backend = f"none ({exc})"
    report = {
        "cupy_symbuf": __version__, "protocol_version": _protocol.PROTOCOL_VERSION,
        "python": sys.version.split()[0], "platform": platform.platform(),
        "numpy": _version("numpy"), "mpi4py": _version("mpi4py"),
        "mpi_library": MPI.Get_library_version().strip().splitlines()[0],
        "cupy": _version("cupy"), "ml_dtypes": _version("ml_dtypes"), "torch": _version("torch"),
        "backend_auto": backend,
        "host": {"cpu": tuning.host_kind(), "cross_memory_attach": _cma.supported(),
                 "yama_ptrace_scope": _read("/proc/sys/kernel/yama/ptrace_scope")},
    }
    try:  # the kernels' compiler (also used with no GPU, to check every kernel in CI)
        from cupy_backends.cuda.libs import nvrtc
        report["nvrtc"] = ".".join(str(v) for v in nvrtc.getVersion())
    except Exception as exc:  # noqa: BLE001
        report["nvrtc"] = f"not available ({type(exc).__name__})"
    try:
        report["gpus"] = _gpus()
    except Exception as exc:  # noqa: BLE001
        report["gpus"] = {"available": False, "error": f"{type(exc).__name__}: {exc}"}
    from ..communicator import live_communicators
    # this process's communicators still allocated (dropped unclosed ones stay allocated until exit)
    report["live_communicators"] = live_communicators()
    world = MPI.COMM_WORLD.Get_size()
    key = tuning.table_key("host", world) if not backend.startswith("cuda") else None
    if key is not None:
        try:
            fields, source = tuning.lookup(key)
            report["tuning"] = {"key": key, "fields": fields, "source": source}
        except ValueError as exc:
            report["tuning"] = {"key": key, "error": str(exc)}
    return report


def _read(path: str):
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return "absent"


def _cuda_unavailable():
    """None when CuPy imports and sees a GPU, else why not (one line)."""
    from ..common import backend as _compat
    if _compat.cupy is None:
        return "CuPy is not installed (or failed to import), so no CUDA device is available"
    try:
        n = int(_compat.cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:  # noqa: BLE001 - e.g. no driver: cudaErrorInsufficientDriver / NoDevice
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return f"no CUDA device is available (CuPy: {text})"
    if n < 1:
        return "no CUDA device is available (CuPy sees 0 GPUs)"
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cupy_symbuf info", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    ap.add_argument("--no-communicator", action="store_true",
                    help="do not build a Communicator (otherwise: over MPI.COMM_WORLD, its config and buffer map)")
    ap.add_argument("--backend", default="auto", choices=("auto", "host", "cuda"))
    ap.add_argument("--transport", default=None, choices=("auto", "ipc", "staged"),
                    help="Config.transport of the Communicator (cuda; default: $CUPY_SYMBUF_TRANSPORT, else auto)")
    args = ap.parse_args(argv)
    if args.backend == "cuda":
        why = _cuda_unavailable()
        if why is not None:  # one clear line instead of a Communicator traceback (every rank says it: local check)
            print(f"python -m cupy_symbuf info: --backend cuda: {why}; use --backend host or auto", file=sys.stderr)
            return 1
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    report = info()
    backend = args.backend
    if backend == "auto":
        backend = "cuda" if report["backend_auto"] == "cuda" else "host"
    if backend == "cuda" and report.get("gpus", {}).get("available"):
        from ..utils import select_device
        select_device(comm)
    from ..transport.topology import discover
    topo = discover(comm, backend)  # collective over COMM_WORLD (every rank runs main); never fails for a missing piece
    report["topology"] = topo.as_dict()
    from ..common.config import Config
    try:
        config = Config() if args.transport is None else Config(transport=args.transport)
    except (TypeError, ValueError) as exc:  # e.g. a bad CUPY_SYMBUF_TRANSPORT: one line, no traceback
        print(f"python -m cupy_symbuf info: {exc}", file=sys.stderr)
        return 1
    if backend == "cuda":  # what a cuda Communicator would choose from this topology (before any IPC handle opens)
        from ..transport.symbuffer import choose_transport
        try:
            t, why = choose_transport(config.transport, topo)
            report["transport"] = {"requested": config.transport, "from_topology": t, "reason": why}
        except Exception as exc:  # noqa: BLE001 - reported, never fatal here
            report["transport"] = {"requested": config.transport, "error": f"{type(exc).__name__}: {exc}"}
    if not args.no_communicator:
        from ..communicator import Communicator
        with Communicator(comm, config, backend=args.backend) as c:
            report["communicator"] = {"backend": c.backend, "world_size": c.world_size,
                                      "transport": c.transport, "transport_reason": c.transport_reason,
                                      "cross_memory_attach_between_ranks": getattr(c.engine.transport, "cma_pids", None)
                                      is not None, "describe": c.describe()}
    if comm.Get_rank() == 0:
        if args.json:
            print(json.dumps(report, indent=1, default=str))
        else:
            for k, v in report.items():
                if k == "communicator":
                    print(f"communicator: backend={v['backend']} world_size={v['world_size']} transport="
                          f"{v['transport']} ({v['transport_reason']}) cross-memory attach between ranks: "
                          f"{v['cross_memory_attach_between_ranks']}")
                    print(v["describe"])
                elif k == "topology":
                    print(topo.describe())
                elif k == "transport":
                    print(f"transport: requested {v['requested']}, from the topology: "
                          + (f"{v['from_topology']} ({v['reason']})" if "error" not in v else v["error"]))
                else:
                    print(f"{k}: {v}")
    return 0
