# Public face of cupy_symbuf.moe.low_latency (cupy_symbuf/moe/low_latency.py): keeps ``cupy_symbuf.low_latency`` importable, every public name and
# attribute access to the rest. Low-latency MoE dispatch / combine (DeepEP's low-latency mode).
from .moe.low_latency import *  # noqa: F401,F403
from .moe.low_latency import __all__  # noqa: F401
from . import moe as _layer

__doc__ = _layer.low_latency.__doc__  # help() and docs/api.md show the module's own text


def __getattr__(name):
    if name == "bench_low_latency":  # (cupy_symbuf.bench.low_latency; that package imports mpi4py: loaded on use)
        from .bench.low_latency import bench_low_latency
        return bench_low_latency
    return getattr(_layer.low_latency, name)
