"""The tuning table: measured defaults of ``Config.num_sms`` / ``chunk_bytes`` / ``num_slots`` per device kind,
ranks per device and world size, written by ``python -m cupy_symbuf.bench --tune`` and read when a
:class:`~cupy_symbuf.Communicator` resolves the fields its ``Config`` left unset.

Where the table comes from, first found wins:

1. the file named by the environment variable ``CUPY_SYMBUF_TUNING`` (``--tune`` writes there when it is set);
   when it is set, no other table is read (a missing file: no table, the built-in defaults);
2. ``~/.config/cupy_symbuf/tuning.json`` (``--tune``'s default output);
3. the table shipped with the package (``cupy_symbuf/tuning.json``: what was measured on the project's machines).

An entry applies only to a Config that sets none of ``num_sms``, ``chunk_bytes``, ``num_slots`` (its values were
measured together).

A key names what the measurement depends on: ``"host/AMD EPYC/cores=2/world=2"`` (CPU model and core count),
``"cuda/NVIDIA H200/ranks_per_gpu=2/world=2"``. On the GPU the key carries the link class the layout was measured
over ("a chunk size per link class"): ranks sharing one GPU under MPS (``ranks_per_gpu`` equal to the
world size) or one GPU each (peers over NVLink or PCIe through CUDA IPC), and the transport. A key for the staged
transport, where every byte and every flag crosses PCIe, ends in ``"/transport=staged"``:
``"cuda/NVIDIA H200/ranks_per_gpu=2/world=2/transport=staged"``. So an entry measured over IPC never sets the
layout of a staged communicator, and the reverse. The key uses the transport that the topology chooses before the
buffer exists (:func:`cupy_symbuf.symbuffer.choose_transport`). In the rare case where an IPC handle then fails to
open and the buffer falls back to staged, the IPC entry's layout is kept, and the log says so.
Without an entry the built-in defaults apply (``Config.resolved``). Every rank must resolve the same values: the
construction fingerprint compares them, so ranks reading different tables fail loudly on every rank.

Format (JSON)::

    {"version": 1,
     "entries": {KEY: {"default": {"num_sms": 2, "chunk_bytes": 262144, "num_slots": 16},
                       "measured": "2026-12-01 host, 2 ranks", "command": "...",
                       "sizes": [65536, ...], "rows": [{"config": {...}, "send": "out", "us": [...]}, ...]}}}
"""
from __future__ import annotations

import json
import os
from typing import Optional

__all__ = ["table_key", "lookup", "load", "save_entry", "user_path", "packaged_path", "FIELDS"]

VERSION = 1
#: Config fields a table entry may set.
FIELDS = ("num_sms", "chunk_bytes", "num_slots")


def packaged_path() -> str:
    """The table shipped with the package (``cupy_symbuf/tuning.json``)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "tuning.json")


def user_path() -> str:
    """``~/.config/cupy_symbuf/tuning.json``: where ``bench --tune`` writes by default."""
    return os.path.join(os.path.expanduser("~"), ".config", "cupy_symbuf", "tuning.json")


def host_kind() -> str:
    """``"<CPU model>/cores=<n>"`` of this machine (``/proc/cpuinfo``'s model name, else ``platform.processor()``;
    ``os.cpu_count()``): the host path's "device kind"."""
    import platform
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    model = " ".join((model or platform.processor() or platform.machine() or "unknown CPU").split())
    return f"{model.replace('/', '_')}/cores={os.cpu_count() or 1}"


def table_key(backend: str, world_size: int, device_name: str = "", ranks_per_gpu: int = 1,
              transport: str = "ipc") -> str:
    """The key of a table entry (see the module docstring). ``transport``: ``"ipc"`` or ``"staged"``, the cuda
    backend's transport (ignored on the host); raises ``ValueError`` for any other value."""
    if backend == "host":
        return f"host/{host_kind()}/world={world_size}"
    if transport not in ("ipc", "staged"):
        raise ValueError(f"table_key: transport must be 'ipc' or 'staged', got {transport!r}")
    return (f"cuda/{device_name or 'unknown GPU'}/ranks_per_gpu={ranks_per_gpu}/world={world_size}"
            + ("/transport=staged" if transport == "staged" else ""))


def _read(path: str) -> Optional[dict]:
    try:
        with open(path) as f:
            table = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ValueError(f"cupy_symbuf tuning table {path}: unreadable ({exc}); fix or remove it") from None
    if not isinstance(table, dict) or table.get("version") != VERSION or not isinstance(table.get("entries"), dict):
        raise ValueError(f"cupy_symbuf tuning table {path}: not a version-{VERSION} table "
                         f"(python -m cupy_symbuf.bench --tune writes one)")
    return table


def load() -> tuple:
    """``(table, path)`` of the first table found (see the module docstring), or ``(None, None)``."""
    env = os.environ.get("CUPY_SYMBUF_TUNING")
    for path in [env] if env else [user_path(), packaged_path()]:
        table = _read(path)
        if table is not None:
            return table, path
    return None, None


def lookup(key: str) -> tuple:
    """``({field: value}, source)`` of the entry ``key``: only ``FIELDS``, checked to be ints; ``({}, None)``
    when no table has it (the first table found is the only one read)."""
    table, path = load()
    if table is None:
        return {}, None
    entry = table["entries"].get(key)
    if not entry:
        return {}, None
    default = entry.get("default", {}) if isinstance(entry, dict) else None
    if not isinstance(default, dict):
        raise ValueError(f"cupy_symbuf tuning table {path}: entry {key!r} must be an object with a 'default' object "
                         f"of {', '.join(FIELDS)}, got {entry!r}")
    unknown = sorted(set(default) - set(FIELDS))
    if unknown:
        raise ValueError(f"cupy_symbuf tuning table {path}: entry {key!r} has unknown fields {unknown} (known: "
                         f"{', '.join(FIELDS)})")
    out = {}
    for name in FIELDS:
        value = default.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"cupy_symbuf tuning table {path}: entry {key!r} field {name} must be an int, got "
                             f"{value!r}")
        out[name] = value
    return out, f"{path} [{key}]"


def save_entry(path: str, key: str, entry: dict) -> None:
    """Write (or replace) entry ``key`` of the table at ``path``, keeping its other entries."""
    table = _read(path) if os.path.exists(path) else None
    if table is None:
        table = {"version": VERSION, "entries": {}}
    table["entries"][key] = entry
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(table, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)
