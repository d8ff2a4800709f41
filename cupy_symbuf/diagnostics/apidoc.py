"""Writes ``docs/api.md`` from the docstrings (one source: the code): ``python -m cupy_symbuf.diagnostics.apidoc >
docs/api.md``. ``tests/test_apidoc.py`` fails when the file is out of date."""
from __future__ import annotations

import inspect

#: (heading, object path) of every public name, in the order of the page.
PUBLIC = [
    ("Communicator", "cupy_symbuf.Communicator"),
    ("Config", "cupy_symbuf.Config"),
    ("SymBuffer", "cupy_symbuf.SymBuffer"),
    ("Transport choice (cupy_symbuf.symbuffer.choose_transport)", "cupy_symbuf.symbuffer.choose_transport"),
    ("CollectiveEvent", "cupy_symbuf.CollectiveEvent"),
    ("ChannelLayout", "cupy_symbuf.ChannelLayout"),
    ("LowLatencyBuffer", "cupy_symbuf.LowLatencyBuffer"),
    ("Errors", "cupy_symbuf.errors"),
    ("MoE (module functions)", "cupy_symbuf.moe.normal"),
    ("DeepEP shim", "cupy_symbuf.deepep"),
    ("PyTorch autograd", "cupy_symbuf.autograd"),
    ("DeltaExchange", "cupy_symbuf.DeltaExchange"),
    ("HierarchicalCommunicator", "cupy_symbuf.HierarchicalCommunicator"),
    ("HierarchicalDispatchHandle (cupy_symbuf.hierarchical)", "cupy_symbuf.hierarchical.HierarchicalDispatchHandle"),
    ("Topology", "cupy_symbuf.Topology"),
    ("Topology link (cupy_symbuf.topology.Link)", "cupy_symbuf.topology.Link"),
    ("Topology discovery (cupy_symbuf.topology.discover)", "cupy_symbuf.topology.discover"),
    ("Symmetric arrays", "cupy_symbuf.symmetric"),
    ("Tuning table", "cupy_symbuf.tuning"),
    ("Diagnostics", "cupy_symbuf.diagnostics.traces"),
    ("info", "cupy_symbuf.info"),
    ("Benchmark", "cupy_symbuf.bench.driver"),
]


def _resolve(path: str):
    import importlib
    mod, _, attr = path.rpartition(".")
    try:
        return importlib.import_module(path)
    except ImportError:
        return getattr(importlib.import_module(mod), attr)


def _sig(obj) -> str:
    try:
        return str(inspect.signature(obj))
    except (TypeError, ValueError):
        return "(...)"


def _block(doc: str) -> list:
    return ["```text", doc.rstrip(), "```", ""] if doc else ["(no docstring)", ""]


def _members(cls) -> list:
    out = []
    for name, member in cls.__dict__.items():
        if name.startswith("_") and name not in ("__init__", "__enter__", "__exit__"):
            continue
        if isinstance(member, (staticmethod, classmethod)):
            member = member.__func__
        if isinstance(member, property):
            out.append((name, None, inspect.getdoc(member) or ""))
        elif inspect.isfunction(member):
            out.append((name, member, inspect.getdoc(member) or ""))
    return out


def render() -> str:
    lines = ["# API reference", "",
             "Generated from the docstrings by `python -m cupy_symbuf.diagnostics.apidoc > docs/api.md` (do not edit by hand; "
             "`tests/test_apidoc.py` checks it is current). Shapes, dtypes, units and the errors raised are in each "
             "entry.", ""]
    for heading, path in PUBLIC:
        obj = _resolve(path)
        lines += [f"## {heading}", ""]
        if inspect.ismodule(obj):
            lines += _block(inspect.getdoc(obj) or "")
            names = getattr(obj, "__all__", [])
            for name in names:
                member = getattr(obj, name, None)
                if member is None or inspect.ismodule(member):
                    continue
                if inspect.isclass(member) or inspect.isfunction(member):
                    kind = "class" if inspect.isclass(member) else "function"
                    lines += [f"### `{path}.{name}{_sig(member)}` ({kind})", ""]
                    lines += _block(inspect.getdoc(member) or "")
        elif inspect.isclass(obj):
            lines += [f"`{path}{_sig(obj)}`", ""]
            lines += _block(inspect.getdoc(obj) or "")
            for name, member, doc in _members(obj):
                sig = _sig(member) if member is not None else " (property)"
                lines += [f"### `{obj.__name__}.{name}{sig}`", ""]
                lines += _block(doc)
        else:
            lines += [f"`{path}{_sig(obj)}`", ""]
            lines += _block(inspect.getdoc(obj) or "")
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    import sys
    sys.stdout.write(render())
