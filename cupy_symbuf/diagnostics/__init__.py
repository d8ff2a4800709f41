"""Layer 8: diagnostics: channel traces (load, summarize, report, plot; ``python -m cupy_symbuf.diagnostics``),
``cupy_symbuf.info()`` (``info``) and the API-doc checker (``apidoc``).

This package is also the public face ``cupy_symbuf.diagnostics``: it re-exports the trace tools.
"""
from .traces import *  # noqa: F401,F403
from .traces import __all__  # noqa: F401
from . import traces as _traces


def __getattr__(name):
    return getattr(_traces, name)
