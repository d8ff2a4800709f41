"""``python -m cupy_symbuf.bench --op adaptive``: adaptive channel assignment (``Config(adaptive=True)``) against the
static split in the same run, on skewed MoE routing.

Patterns (``--patterns``, default ``uniform,zipf1.0,zipf1.5,hot``): the top-k experts of every token drawn without
replacement with probabilities proportional to ``1 / rank^s`` over one random permutation of the experts shared
by every rank (Zipf exponent ``s`` = 1.0 or 1.5: the same experts, and so the same ranks, are hot everywhere),
``hot`` (rank 0's experts 8x as likely as the others'), or ``uniform``. For each pattern two communicators of the
same layout, ``static`` (``adaptive=False``) and ``adaptive`` (``adaptive_interval`` 20, warmed up over 3
intervals so the home map is re-balanced before timing), run ``dispatch`` with the host-count path (a new layout
per call, as a training step does), the cached ``dispatch`` (``handle=``: the layout reused, so the ring kernel
is most of the call) and ``combine``, **interleaved**: rounds of 10 timed calls of one and 10 of
the other, each call after a barrier, the maximum over ranks per call, p50 / p99 over all rounds (``--iters``
calls per engine, at least 20). Before timing, the adaptive communicator's ``recv_x`` and combined output must be
bitwise equal to the static one's (which the test suite checks against NumPy).

Columns: ``p50_us``, ``p99_us``, ``p99_gain`` (static p99 / adaptive p99; the issue's target is >= 1.3 on the
skewed patterns and no loss beyond the run-to-run spread on uniform), ``imbalance`` (the busiest peer's bytes over
the mean, from ``channel_stats``), ``stolen`` (JSON ``stolen_share``: the share of ring chunks copied by a warp of
another group; GPU work sharing only) and ``workers_hot`` (warps starting on the hottest peer's run after re-balancing).
"""
from __future__ import annotations

import dataclasses

import numpy as np
from mpi4py import MPI

__all__ = ["run", "routing"]

PATTERNS = ("uniform", "zipf1.0", "zipf1.5", "hot")


def check_patterns(text) -> list:
    """The ``--patterns`` of ``--op adaptive`` (None: all of :data:`PATTERNS`): ``uniform``, ``hot`` or ``zipfS``
    with ``S`` a finite number > 0; ``ValueError`` naming the bad entry."""
    out = [p.strip() for p in (text or ",".join(PATTERNS)).split(",") if p.strip()]
    for p in out:
        ok = p in ("uniform", "hot")
        if p.startswith("zipf"):
            try:
                ok = np.isfinite(float(p[4:])) and float(p[4:]) > 0
            except ValueError:
                ok = False
        if not ok:
            raise ValueError(f"--patterns: {p!r} is not a pattern of --op adaptive (uniform, hot, or zipfS with S a "
                             f"number > 0, e.g. zipf1.0, zipf1.5)")
    if not out:
        raise ValueError("--patterns: no pattern given")
    return out


def routing(pattern: str, tokens: int, num_experts: int, topk: int, world_size: int, seed) -> np.ndarray:
    """int64 ``[tokens, topk]``: distinct experts per token for ``pattern`` (see the module docstring), drawn with
    the Gumbel top-k trick (sampling without replacement in proportion to the weights)."""
    rng = np.random.default_rng(seed)
    L = num_experts // world_size
    if pattern == "uniform":
        w = np.ones(num_experts)
    elif pattern.startswith("zipf"):
        s = float(pattern[4:])
        order = np.random.default_rng(12345).permutation(num_experts)  # the same on every rank
        w = np.empty(num_experts)
        w[order] = 1.0 / np.arange(1, num_experts + 1) ** s
    elif pattern == "hot":
        w = np.ones(num_experts)
        w[:L] = 8.0
    else:
        raise ValueError(f"bench --op adaptive: unknown pattern {pattern!r}; known: {', '.join(PATTERNS)}")
    g = np.log(w)[None, :] - np.log(-np.log(rng.random((tokens, num_experts))))
    return np.argsort(-g, axis=1)[:, :topk].astype(np.int64)


def _host(a):
    return a.get() if hasattr(a, "get") else np.asarray(a)


def run(c, comm, timer, args, sizes) -> list:
    """Every ``--moe-tokens`` value in turn (see the module docstring); the rows, one per (tokens, pattern, op,
    engine)."""
    results = []
    for tokens in [int(t) for t in str(args.moe_tokens).split(",")]:
        results += _run(c, comm, timer, args, tokens)
    return results


def _run(c, comm, timer, args, tokens: int) -> list:
    """One ``--moe-tokens`` value: every pattern, static and adaptive interleaved."""
    from ..communicator import Communicator
    W, me, xp = c.world_size, c.rank, c.xp
    H, E, K = args.hidden, args.num_experts, args.topk
    dtype = np.dtype(args.dtype)
    patterns = check_patterns(args.patterns)
    if E % W or K > E:
        raise SystemExit(f"bench --op adaptive: --num-experts ({E}) must be a multiple of the world size ({W}) "
                         f"and >= --topk ({K})")
    interval = 20
    ca = Communicator(comm, dataclasses.replace(c.config, adaptive=True, adaptive_interval=interval),
                      backend=c.backend)
    results = []
    try:
        if me == 0:
            print(f"# adaptive channels: {tokens} tokens x {H} {dtype.name}, top-{K} of {E} experts, {W} ranks, "
                  f"{c.layout.num_channels} channels; rounds of 10 calls interleaved")
            print(f"{'pattern':>8} {'op':>8} {'engine':>9} {'p50_us':>10} {'p99_us':>10} {'p99_gain':>8} "
                  f"{'imbalance':>9} {'stolen':>7} {'workers_hot':>11}")
        iters = max(20, args.iters) // 10 * 10
        for pattern in patterns:
            idx_h = routing(pattern, tokens, E, K, W, [me, 7])
            rng = np.random.default_rng([me, 8])
            x = xp.asarray(rng.standard_normal((tokens, H)).astype(dtype))
            idx = xp.asarray(idx_h)
            weights = xp.asarray(rng.uniform(0.1, 1.0, (tokens, K)).astype(np.float32))
            outs = {}
            for name, comm_ in (("static", c), ("adaptive", ca)):
                recv_x, _, _, _, handle = comm_.dispatch(x, idx, weights, E)
                y, _ = comm_.combine(recv_x, handle)
                outs[name] = (_host(recv_x), _host(y), recv_x, handle)
            same = all(np.array_equal(outs["static"][i].view(np.uint8), outs["adaptive"][i].view(np.uint8))
                       for i in (0, 1))
            if not comm.allreduce(bool(same), op=MPI.LAND):
                raise RuntimeError(f"bench --op adaptive: the adaptive communicator's dispatch / combine differ from "
                                   f"the static one's ({pattern}); not timing")
            for _ in range(3 * interval + 5):  # the home map re-balanced (GPU: its counters read asynchronously)
                ca.dispatch(x, idx, weights, E)
            ca.synchronize()
            ca.channel_stats(reset=True)
            for op in ("dispatch", "cached", "combine"):
                fns = {}
                for name, comm_ in (("static", c), ("adaptive", ca)):
                    if op == "dispatch":
                        fns[name] = (lambda cc=comm_: cc.dispatch(x, idx, weights, E))
                    elif op == "cached":  # the layout reused: the ring kernel is most of the call
                        fns[name] = (lambda cc=comm_, h=outs[name][3]: cc.dispatch(x, handle=h))
                    else:
                        rx, h = outs[name][2], outs[name][3]
                        fns[name] = (lambda cc=comm_, rx=rx, h=h: cc.combine(rx, h))
                samples = {"static": [], "adaptive": []}
                for r in range(iters // 10):
                    for name in (("static", "adaptive") if r % 2 == 0 else ("adaptive", "static")):
                        cc = c if name == "static" else ca
                        samples[name].append(timer.samples(fns[name], 10, args.warmup if r == 0 else 0, comm,
                                                           cc.synchronize))
                st = ca.channel_stats()
                per_peer = np.asarray(st["send"]["bytes_per_peer"])
                chunks = np.asarray(st["send"]["chunks"]).sum() + np.asarray(st["recv"]["chunks"]).sum()
                stolen = (np.asarray(st["send"]["stolen"]).sum() + np.asarray(st["recv"]["stolen"]).sum()) / \
                    max(1, chunks)
                hot = int(np.argmax(per_peer)) if per_peer.any() else (me + 1) % W
                workers_hot = st["send"]["workers"][hot]
                imbalance = comm.allreduce(st["send"]["imbalance"], op=MPI.MAX)
                stolen = comm.allreduce(float(stolen), op=MPI.MAX)
                p = {}
                for name in ("static", "adaptive"):
                    s = np.concatenate(samples[name])
                    p[name] = (float(np.percentile(s, 50)), float(np.percentile(s, 99)))
                gain = p["static"][1] / p["adaptive"][1]
                for name in ("static", "adaptive"):
                    row = {"op": f"adaptive-{op}", "pattern": pattern, "engine": name, "tokens": tokens, "hidden": H,
                           "num_experts": E, "topk": K, "world_size": W, "backend": c.backend,
                           "p50_us": p[name][0] * 1e6, "p99_us": p[name][1] * 1e6,
                           "p99_gain": gain if name == "adaptive" else 1.0, "imbalance": imbalance,
                           "stolen_share": stolen if name == "adaptive" else 0.0,
                           "workers_hot": workers_hot if name == "adaptive" else None}
                    results.append(row)
                    if me == 0:
                        print(f"{pattern:>8} {op:>8} {name:>9} {p[name][0] * 1e6:10.1f} {p[name][1] * 1e6:10.1f} "
                              f"{row['p99_gain']:8.2f} {imbalance:9.2f} {row['stolen_share']:7.3f} "
                              f"{workers_hot if name == 'adaptive' else '-':>11}")
    finally:
        ca.close()
    return results
