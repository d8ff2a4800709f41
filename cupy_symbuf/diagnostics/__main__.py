"""``python -m cupy_symbuf.diagnostics``: see :func:`cupy_symbuf.diagnostics.traces.main`."""
import sys

from .traces import main

sys.exit(main())
