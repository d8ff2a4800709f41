"""``python -m cupy_symbuf.bench --backend host --op hier --node-size K [--sizes 64K,1M]``: the hierarchical
all-to-all (:class:`~cupy_symbuf.HierarchicalCommunicator`: MPI between virtual nodes of ``K`` ranks, our channels
inside them) beside the flat one (``Communicator.alltoall`` with ``out=``) and ``MPI.Alltoall`` in the same run;
every engine checked against the reference first; loop timing, max over ranks."""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

from .hierarchical import HierarchicalCommunicator

__all__ = ["run"]


def run(c, comm, timer, args, sizes) -> list:
    from .bench import _fmt
    W, me = c.world_size, c.rank
    k = args.node_size or W
    results = []
    with HierarchicalCommunicator(comm, node_size=k) as h:
        if me == 0:
            print(f"# hierarchical: {h.num_nodes} node(s) of {k} rank(s); between them MPI, inside our channels")
            print(f"{'size/rank':>10} {'engine':>12} {'loop_us':>10} {'algbw_GB/s':>11}")
        for size in sizes:
            per_peer = max(1, size // W)
            x = np.random.default_rng([me, size]).integers(0, 255, (W, per_peer), dtype=np.uint8)
            want = np.stack([np.random.default_rng([j, size]).integers(0, 255, (W, per_peer), dtype=np.uint8)[me]
                             for j in range(W)])
            out = np.empty_like(x)
            engines = {"hierarchical": lambda: h.alltoall(x), "ours-out": lambda: c.alltoall(x, out=out),
                       "mpi": lambda: comm.Alltoall(x, out)}
            for name, fn in engines.items():
                got = fn()
                got = out if got is None else got
                if not comm.allreduce(bool(np.array_equal(got, want)), op=MPI.LAND):
                    raise RuntimeError(f"bench --op hier: {name} gave wrong data at {_fmt(W * per_peer)}")
                t = timer.time_loop(fn, args.iters, args.warmup, comm, c.synchronize)
                results.append({"op": "hier", "engine": name, "size_per_rank": W * per_peer,
                                "loop_us": t * 1e6, "node_size": k, "world_size": W})
                if me == 0:
                    print(f"{_fmt(W * per_peer):>10} {name:>12} {t * 1e6:10.1f} {W * per_peer / t / 1e9:11.2f}")
    return results

