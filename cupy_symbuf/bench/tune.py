"""``python -m cupy_symbuf.bench --tune``: sweep the layout (SMs / channels, chunk size, ring depth) and the send
mode per message size, print the table and write the best layout as this device kind's and world size's default
(:mod:`cupy_symbuf.tuning`), which every later Communicator with unset fields reads.

Method: ``--tune-rounds`` rounds; in each, every candidate layout gets a fresh Communicator, one exact exchange per
size checked against the NumPy reference, then loop timing (``_Timer.time_loop``, max over ranks) of
``alltoall(x, out=out)`` with plain arrays and with symmetric arrays (direct mode). The median over the rounds is
kept (the shared CI machine is noisy). The default is the layout whose time, relative to the best layout at each
size and kind of array, has the smallest geometric mean over them: one layout serves every message size, as the
buffer is carved once per Communicator.
"""
from __future__ import annotations

import datetime
import math
import os
import sys

import numpy as np
from mpi4py import MPI

from ..transport import tuning
from ..communicator import Communicator
from ..common.config import Config

__all__ = ["run", "candidates"]


def candidates(backend: str, ranks_per_gpu: int = 1, sm_count: int = 132, transport: str = "ipc") -> list:
    """The layouts swept: ``Config`` keyword dicts (``num_slots`` from Config's rule for each; ``--num-sms``,
    ``--chunk-bytes`` and ``--num-slots`` are not used by ``--tune``). The staged transport (every flag a PCIe
    round trip, a few microseconds) sweeps larger chunks and fewer SMs: the seed's "batch size by link latency"."""
    if backend == "host":
        return [dict(num_sms=s, chunk_bytes=c) for s in (2, 4) for c in (64 << 10, 256 << 10, 1 << 20)]
    share = max(2, sm_count // max(1, ranks_per_gpu) // 2 * 2)
    if transport == "staged":
        sms = sorted({min(s, share) for s in (8, 16, 32)})
        return [dict(num_sms=s, chunk_bytes=c) for s in sms for c in (128 << 10, 512 << 10, 1 << 20)]
    sms = sorted({min(s, share) for s in (16, 24, 32, 48, 64)})
    return [dict(num_sms=s, chunk_bytes=c) for s in sms for c in (64 << 10, 128 << 10)]


def run(comm, timer, args, backend: str, xp) -> int:
    from .driver import _fmt, parse_size
    me, W = comm.Get_rank(), comm.Get_size()
    sizes = [parse_size(s) for s in (args.sizes if args.sizes_given else "64K,1M,16M").split(",")]
    forced = {} if getattr(args, "transport", None) is None else {"transport": args.transport}
    probe = Communicator(comm, Config(**forced), backend=backend)
    ranks_per_gpu = probe.buffer.ranks_per_gpu
    # the key a later Communicator looks up: the transport planned before its buffer exists (an IPC handle that then
    # fails to open makes the buffer staged, but the lookup was the IPC key's)
    transport = probe.planned_transport
    name, sm_count = "", 132
    if probe.backend == "cuda":
        from ..transport.symbuffer import gpu_identity
        ident = gpu_identity(probe.buffer.device_id)
        name, sm_count = ident.get("name", ""), ident["sm_count"] or 132
    key = tuning.table_key(probe.backend, W, name, ranks_per_gpu, transport)
    probe.close()
    cands = candidates(probe.backend, ranks_per_gpu, sm_count, transport)
    sends = ("out", "sym")  # plain arrays (rings) and symmetric ones (direct mode), both backends
    times = {}  # (candidate index, send, size) -> [seconds per call, one per round]
    slots = {}  # candidate index -> the num_slots its Communicator resolved
    for rnd in range(args.tune_rounds):
        for i, cfg in enumerate(cands):
            c = Communicator(comm, Config(**cfg, **forced), backend=backend)
            slots[i] = c.config.num_slots  # what was measured (explicit layout fields: no table applies)
            try:
                for size in sizes:
                    per_peer = max(1, size // W)
                    x = xp.asarray(np.random.default_rng([me, size, rnd]).integers(0, 255, (W, per_peer),
                                                                                   dtype=np.uint8))
                    want = np.stack([np.random.default_rng([j, size, rnd]).integers(0, 255, (W, per_peer),
                                                                                    dtype=np.uint8)[me]
                                     for j in range(W)])
                    for send in sends:
                        src = x if send == "out" else c.array(x)
                        out = xp.empty_like(x) if send == "out" else c.empty(x.shape, x.dtype)
                        got = c.alltoall(src, out=out)
                        got = got.get() if hasattr(got, "get") else np.asarray(got)
                        if not comm.allreduce(bool(np.array_equal(got, want)), op=MPI.LAND):
                            raise RuntimeError(f"bench --tune: {cfg} {send} gave wrong data at {_fmt(size)}")
                        t = timer.time_loop(lambda: c.alltoall(src, out=out), args.iters, args.warmup, comm,
                                            c.synchronize)
                        times.setdefault((i, send, size), []).append(t)
                        if send == "sym":
                            c.free(out)
                            c.free(src)
            finally:
                c.close()
    med = {k: float(np.median(v)) for k, v in times.items()}
    best = {(d, s): min(med[(i, d, s)] for i in range(len(cands))) for d in sends for s in sizes}
    score = [math.exp(np.mean([math.log(med[(i, d, s)] / best[(d, s)]) for d in sends for s in sizes]))
             for i in range(len(cands))]
    pick = int(np.argmin(score))
    if me == 0:
        print(f"# cupy_symbuf.bench --tune: {key}; {args.tune_rounds} rounds, loop timing, median us per call "
              f"(max over ranks); score = geometric mean of time / best time over the sizes and sends (plain "
              f"arrays through the rings, symmetric ones direct)")
        head = f"{'num_sms':>7} {'chunk':>8} " + " ".join(f"{_fmt(s) + ' ' + send:>16}" for s in sizes
                                                             for send in sends) + f" {'score':>6}"
        print(head)
        for i, cfg in enumerate(cands):
            cells = " ".join(f"{med[(i, send, s)] * 1e6:16.1f}" for s in sizes for send in sends)
            mark = "  <- default" if i == pick else ""
            print(f"{cfg['num_sms']:7d} {_fmt(cfg['chunk_bytes']):>8} {cells} {score[i]:6.3f}{mark}")
        chosen = dict(cands[pick], num_slots=slots[pick])  # the ring depth it was measured with
        entry = {"default": chosen,
                 "measured": f"{datetime.date.today().isoformat()}, {key}",
                 "command": "mpiexec -n %d python -m cupy_symbuf.bench %s" % (W, " ".join(sys.argv[1:])),
                 "sizes": sizes,
                 "rows": [{"config": cfg, "send": send, "us": [med[(i, send, s)] * 1e6 for s in sizes],
                           "score": score[i]} for i, cfg in enumerate(cands) for send in sends]}
        path = args.tune_out or os.environ.get("CUPY_SYMBUF_TUNING") or tuning.user_path()
        tuning.save_entry(path, key, entry)
        print(f"# wrote {key} -> {chosen} to {path}")
    return 0
