"""docs/api.md is generated from the docstrings (cupy_symbuf.diagnostics.apidoc) and must be current: regenerate with
``python -m cupy_symbuf.diagnostics.apidoc > docs/api.md``."""
import os

from cupy_symbuf.diagnostics import apidoc as _apidoc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_api_reference_is_current():
    with open(os.path.join(ROOT, "docs", "api.md")) as f:
        on_disk = f.read()
    assert on_disk == _apidoc.render(), "docs/api.md is stale: run python -m cupy_symbuf.diagnostics.apidoc > docs/api.md"


def test_every_public_name_is_documented():
    """Every name in cupy_symbuf.__all__ has a section, and every public entry has a docstring (the dunder
    context-manager methods aside)."""
    import cupy_symbuf as cs
    text = _apidoc.render()
    for name in cs.__all__:
        if (name.startswith("SymBuffer") and name.endswith(("Error", "Warning"))) or name in ("layout", "__version__"):
            continue  # the errors and the warning are under "## Errors", the layout module under ChannelLayout
        assert f"## {name}" in text, name
    entries = text.split("\n### ")[1:]
    missing = [e.splitlines()[0] for e in entries
               if "(no docstring)" in e.split("\n### ")[0] and "__enter__" not in e and "__exit__" not in e]
    assert not missing, f"public entries without a docstring: {missing}"
