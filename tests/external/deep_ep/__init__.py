"""``import deep_ep`` for DeepEP's own tests run by ``tests/external/run_deepep.py``: cupy_symbuf's DeepEP shim
(:mod:`cupy_symbuf.deepep`) under DeepEP's package name. Only this folder on ``sys.path`` makes it so."""
from cupy_symbuf.deepep import Buffer, Config, EventOverlap  # noqa: F401
from cupy_symbuf.compat.deepep import topk_idx_t  # noqa: F401  (torch.int64; imports PyTorch)
