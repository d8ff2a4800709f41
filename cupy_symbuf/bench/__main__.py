"""``python -m cupy_symbuf.bench``: see :func:`cupy_symbuf.bench.driver.main`."""
import sys

from .driver import main

sys.exit(main())
