"""The layering rules import-linter cannot see (``.importlinter`` holds the ones it can; ``make lint`` runs it).

A layer package (``wire``, ``common``, ``transport``, ``collectives``, ``moe``, ``scaleout``, ``compat``,
``diagnostics``, ``bench``; ``communicator.py`` counts as one) uses only the public names of the others:

* no ``from ..moe.normal import _check_x``: an underscore name imported from another package;
* no ``_moe._check_x``: an underscore attribute of a module of another package reached through its import alias;
* no ``c._engine`` / ``tr._transport`` / ``owner._heap``: an underscore attribute that only another package's
  classes define (its private state), read or written on an object that is not ``self`` / ``cls``.

Dunder names (``__version__``, ``__dict__``) are not private. Names every package defines alike are not told
apart (a package reading ``x._closed`` on its own objects is fine); the rules aim at no false positives on the
tree, and the checks at the end feed them the patterns they exist to catch.
"""
from __future__ import annotations

import ast
import os
import sys

import pytest

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "cupy_symbuf")
PACKAGE = "cupy_symbuf"
LAYERS = ("wire", "common", "transport", "collectives", "moe", "scaleout", "compat", "diagnostics", "bench",
          "communicator")

#: (file relative to cupy_symbuf/, private name) pairs still allowed while other work removes them. Every entry
#: says what removes it.
ALLOWED: set = set()


def _private(name: str) -> bool:
    # ``_sunder_`` names (ctypes' ``_fields_``, enum's ``_value_``) are those libraries' public API
    return name.startswith("_") and not name.startswith("__") and not name.endswith("_")


def layer_of(rel: str) -> str:
    """The layer of a file given relative to ``cupy_symbuf/`` (``"moe/normal.py"`` -> ``"moe"``); a top-level module
    other than ``communicator.py`` (the package's faces, ``utils``, ``__init__``) -> ``"top"``."""
    parts = rel.replace(os.sep, "/").split("/")
    if len(parts) > 1:
        return parts[0]
    return "communicator" if parts[0] == "communicator.py" else "top"


def _module_of(rel: str) -> list:
    """``"moe/normal.py"`` -> ``["cupy_symbuf", "moe", "normal"]`` (a package's ``__init__`` -> the package)."""
    parts = [PACKAGE] + rel.replace(os.sep, "/")[:-3].split("/")
    return parts[:-1] if parts[-1] == "__init__" else parts


def _resolve(rel: str, node: ast.ImportFrom) -> list:
    """The absolute dotted module of a ``from ... import`` in file ``rel``, as a list of names."""
    if node.level == 0:
        return (node.module or "").split(".")
    here = _module_of(rel)
    is_pkg = rel.endswith("__init__.py")
    base = here if is_pkg else here[:-1]
    base = base[:len(base) - (node.level - 1)] if node.level > 1 else base
    return base + (node.module.split(".") if node.module else [])


def _layer_of_module(mod: list) -> str:
    """The layer of an absolute module name (``cupy_symbuf.moe.normal`` -> ``"moe"``), or None outside the package
    or for the package itself."""
    if len(mod) < 2 or mod[0] != PACKAGE:
        return None
    return mod[1] if mod[1] in LAYERS else "top"


def private_defs(sources: dict, by=None) -> dict:
    """``{layer: set of underscore attribute names its classes define}`` (``by``: a function of the file's path
    giving the key instead of its layer): ``self._x = ...`` (and ``obj.__dict__``-free
    forms: ``self._x: T = ...``), ``def _x`` inside a class, class-level ``_x = ...`` and ``__slots__`` entries."""
    out: dict = {}
    for rel, tree in sources.items():
        names = out.setdefault((by or layer_of)(rel), set())
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and _private(item.name):
                        names.add(item.name)
                    targets = item.targets if isinstance(item, ast.Assign) else \
                        [item.target] if isinstance(item, ast.AnnAssign) else []
                    for t in targets:
                        if isinstance(t, ast.Name) and _private(t.id):
                            names.add(t.id)
                        if isinstance(t, ast.Name) and t.id == "__slots__" and isinstance(item.value, (ast.Tuple, ast.List)):
                            names.update(e.value for e in item.value.elts
                                         if isinstance(e, ast.Constant) and isinstance(e.value, str) and _private(e.value))
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    for sub in ast.walk(t):
                        if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and \
                                sub.value.id in ("self", "cls") and _private(sub.attr):
                            names.add(sub.attr)
    return out


def violations(sources: dict, allowed=frozenset()) -> list:
    """Every use of another layer's private name in ``sources`` (``{path relative to cupy_symbuf/: ast.Module}``),
    as ``(path, line, text)``, less the ``(path, name)`` pairs of ``allowed``."""
    return sorted((rel, line, text) for rel, line, text, name in findings(sources) if (rel, name) not in allowed)


def findings(sources: dict) -> list:
    """:func:`violations` before the allow-list, as ``(path, line, text, private name)``."""
    defs = private_defs(sources)
    own = private_defs(sources, by=lambda rel: rel)
    found = []
    for rel, tree in sources.items():
        mine = layer_of(rel)
        if mine == "top":
            continue  # the faces and the package's __init__ re-export; they are not a layer
        aliases: dict = {}  # local name -> layer of the module it is bound to (modules of other layers only)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                mod = _resolve(rel, node)
                theirs = _layer_of_module(mod)
                for a in node.names:
                    sub = _layer_of_module(mod + [a.name])
                    if theirs is None and sub is None:
                        continue
                    if (sub or theirs) != mine and _private(a.name):
                        found.append((rel, node.lineno, f"imports {a.name} from {'.'.join(mod)}", a.name))
                    # `from ..moe import normal as _moe`: the alias names a module of another layer
                    if sub is not None and sub != mine and sub != "top" and len(mod) >= 2:
                        aliases[a.asname or a.name] = sub
            elif isinstance(node, ast.Import):
                for a in node.names:
                    mod = a.name.split(".")
                    theirs = _layer_of_module(mod)
                    if theirs is not None and theirs != mine and a.asname:
                        aliases[a.asname] = theirs
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                    node.func.id in ("getattr", "setattr", "hasattr") and len(node.args) >= 2 and \
                    isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
                # getattr(owner, "_broken", None) is owner._broken
                node = ast.copy_location(ast.Attribute(value=node.args[0], attr=node.args[1].value, ctx=ast.Load()),
                                         node)
            if not isinstance(node, ast.Attribute) or not _private(node.attr):
                continue
            base = node.value
            name = base.id if isinstance(base, ast.Name) else None
            if name in ("self", "cls"):
                continue
            if name in aliases:
                found.append((rel, node.lineno, f"{name}.{node.attr} (a private name of {aliases[name]})",
                              node.attr))
                continue
            if node.attr in own.get(rel, ()):
                continue  # the module defines such a name itself: taken for its own object's
            owners = sorted(layer for layer, names in defs.items() if node.attr in names and layer != mine)
            if owners:
                found.append((rel, node.lineno, f"{ast.unparse(node)} (private state of {', '.join(owners)})",
                              node.attr))
    return found


_TREE: dict = {}


def _tree() -> dict:
    """Every module of the package, parsed (once)."""
    if _TREE:
        return _TREE
    out = _TREE
    for dirpath, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, ROOT).replace(os.sep, "/")
                with open(path, encoding="utf-8") as fh:
                    out[rel] = ast.parse(fh.read(), filename=path)
    return out


def test_no_private_names_across_layers():
    found = violations(_tree(), ALLOWED)
    assert not found, "private names used across layers:\n" + "\n".join(f"  {r}:{n}: {t}" for r, n, t in found)


def test_allow_list_has_no_stale_entries():
    """An entry whose use is gone must leave the list (so the list only shrinks towards empty)."""
    used = {(rel, name) for rel, _, _, name in findings(_tree())}
    assert not ALLOWED - used, f"allow-list entries with no use left: {sorted(ALLOWED - used)}"


# ---- the checks see what they exist to catch ------------------------------------------------------------------

_OWNER = """
class Communicator:
    @property
    def _engine(self):
        return self._engine_obj
    def __init__(self):
        self._engine_obj = None
        self._transport = None
        self._heap = None
        self._broken = None
    def _check_open(self):
        pass
"""
_TRANSPORT = """
class Engine:
    def __init__(self, owner):
        self.owner = owner
        self._epoch = 0
"""


def _snippets(**files) -> dict:
    base = {"communicator.py": _OWNER, "transport/engine.py": _TRANSPORT, "moe/normal.py": "def _check_x(): pass\n"}
    base.update({k.replace("__", "/") + ".py": v for k, v in files.items()})
    return {rel: ast.parse(src) for rel, src in base.items()}


@pytest.mark.parametrize("rel, src, what", [
    ("collectives/delta.py", "def f(c):\n    c._engine.reject('alltoall', notify=False)\n", "_engine"),
    ("bench/driver.py", "def f(c):\n    return c._transport.bulk_smem\n", "_transport"),
    ("transport/engine.py", "class E:\n    def f(self):\n        self.owner._broken = 'x'\n", "_broken"),
    ("moe/normal.py", "def f(comm, a):\n    comm.owner._heap.check_live('op', 'a', a)\n", "_heap"),
    ("transport/streams.py", "def f(comm):\n    comm._check_open()\n", "_check_open"),
    ("transport/lifecycle.py", "def f(obj):\n    return getattr(obj, '_transport', None)\n", "_transport"),
    ("scaleout/hierarchical.py", "from ..moe.normal import _check_x\n", "_check_x"),
    ("scaleout/hierarchical.py", "from ..moe import normal as _moe\n\ndef f():\n    _moe._check_x()\n", "_check_x"),
    ("scaleout/hierarchical.py", "import cupy_symbuf.moe.normal as m\n\ndef f():\n    m._check_x()\n", "_check_x"),
])
def test_old_patterns_are_caught(rel, src, what):
    found = violations(_snippets(**{rel[:-3].replace("/", "__"): src}))
    assert any(r == rel and what in t for r, _, t in found), found


@pytest.mark.parametrize("rel, src", [
    ("transport/engine.py", "class E:\n    def f(self):\n        self._epoch += 1\n"),  # its own state
    ("collectives/delta.py", "def f(c):\n    c.engine.reject('alltoall', notify=False)\n"),  # the public seam
    ("moe/gpu.py", "from .normal import _check_x\n"),  # the same package
    ("diagnostics/info.py", "from .. import __version__\n"),  # a dunder
    ("moe/low_latency.py", "def f(x):\n    return x._c_contiguous\n"),  # nobody's here (CuPy's)
])
def test_allowed_patterns_pass(rel, src):
    assert violations(_snippets(**{rel[:-3].replace("/", "__"): src})) == []


def test_allow_list_names_only_what_it_allows():
    src = "def f(c):\n    return c._transport\n"
    trees = _snippets(bench__driver=src)
    assert violations(trees, {("bench/driver.py", "_transport")}) == []
    assert violations(trees, {("diagnostics/info.py", "_transport")}) != []


if __name__ == "__main__":  # python tests/test_layers.py: list what the rules find, allow-list ignored
    for r, n, t in violations(_tree()):
        print(f"{r}:{n}: {t}")
    sys.exit(0)
