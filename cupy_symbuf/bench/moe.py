"""``python -m cupy_symbuf.bench --op dispatch [--moe-tokens 4096,128] [--hidden 7168] [--num-experts 256] [--topk 8]``:
MoE dispatch (with and without a cached handle) and combine, p50 / p99 latency per call and bandwidth in both
conventions.

Routing: every rank's tokens pick ``--topk`` distinct experts uniformly at random (``numpy.random``, seeded by rank),
DeepEP's benchmark setting. Before any timing, one dispatch + combine per token count is checked exactly: combining
the dispatched tokens unweighted gives each token times the number of ranks it went to (float32 sum, rounded once).
Timings, max over ranks: ``p50`` / ``p99`` of ``--iters`` calls each after a barrier (the cross-rank maximum of
each call, then the percentile; use ``--iters 200`` or more for a p99 worth the name) and ``loop`` (calls back to
back). ``--wire fp8`` adds the same dispatches with ``wire_dtype="fp8"`` (their bandwidth counts the bytes on the
wire) and prints the relative L2 error of the received tokens. Bandwidth (GB/s, of the p50 time): ``nvl`` = token bytes received from (dispatch) or sent to (combine)
other ranks, ``deepep`` = all token bytes received (dispatch) or sent (combine), a rank's own included: DeepEP's
convention (its 331.8 / 321.9 GB/s on 8 x H200). The low-latency mode (:class:`~cupy_symbuf.LowLatencyBuffer`):
rows ``ll-dispatch`` / ``ll-combine`` at ``--ll-tokens`` (default: 128 when ``--moe-tokens`` has it), checked
against NumPy first and timed with at least ``--ll-iters`` (200) calls (``cupy_symbuf.bench.low_latency``). With
``--energy`` (GPU) every row also carries J/GB from NVML over at least a second of back-to-back calls, the bytes
being all ranks' received token bytes (dispatch) or sent ones (combine), DeepEP's convention summed over ranks
(``cupy_symbuf.bench.energy``; a table after the rows).
"""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

from . import energy as _energy

__all__ = ["run", "routing"]


def routing(rng, tokens: int, num_experts: int, topk: int) -> np.ndarray:
    """int64 ``[tokens, topk]``: distinct experts per token, uniform."""
    if topk > num_experts:
        raise ValueError(f"--topk ({topk}) must be <= --num-experts ({num_experts})")
    keys = rng.random((tokens, num_experts))
    return np.argsort(keys, axis=1)[:, :topk].astype(np.int64)


def _host(a) -> np.ndarray:
    return a.get() if hasattr(a, "get") else np.asarray(a)


def run(c, comm, timer, args, sizes=None) -> list:  # sizes: unused (token counts come from --moe-tokens)
    W, me, xp = c.world_size, c.rank, c.xp
    E, K, H = args.num_experts, args.topk, args.hidden
    if E % W:
        raise ValueError(f"--num-experts ({E}) must be a multiple of the world size ({W})")
    L = E // W
    dtype = np.dtype(args.dtype)
    results = []
    if me == 0:
        print(f"# MoE: hidden {H} {dtype.name}, top-{K} of {E} experts, world_size {W}, {args.iters} calls per row")
        print(f"{'tokens':>7} {'op':>19} {'p50_us':>10} {'p99_us':>10} {'loop_us':>10} {'nvl_GB/s':>9} "
              f"{'deepep_GB/s':>11}")
    for tokens in [int(t) for t in args.moe_tokens.split(",")]:
        rng = np.random.default_rng([me, tokens, 7])
        idx_h = routing(rng, tokens, E, K)
        x_h = (rng.standard_normal((tokens, H)) * 4).astype(dtype)
        weights = xp.asarray(rng.random((tokens, K)).astype(np.float32))
        x, idx = xp.asarray(x_h), xp.asarray(idx_h)
        recv_x, _, _, _, handle = c.dispatch(x, idx, weights, E)
        y, _ = c.combine(recv_x, handle)
        y = y.get() if hasattr(y, "get") else np.asarray(y)
        ranks = np.zeros((tokens, W), bool)
        np.put_along_axis(ranks, idx_h // L, True, axis=1)
        want = (x_h.astype(np.float32) * ranks.sum(axis=1, keepdims=True)).astype(dtype)
        if not comm.allreduce(bool(np.array_equal(y, want)), op=MPI.LAND):
            raise RuntimeError(f"bench --op dispatch: combine(dispatch(x)) != x * ranks reached at {tokens} tokens; "
                               f"not timing it")
        row = H * dtype.itemsize
        n_recv = int(handle.num_recv_tokens)
        own = int(ranks[:, me].sum())  # tokens of this rank that stay on it
        nvl = comm.allreduce((n_recv - own) * row, op=MPI.MAX)
        allb = comm.allreduce(n_recv * row, op=MPI.MAX)
        sent_nvl = comm.allreduce(int(ranks.sum() - own) * row, op=MPI.MAX)
        sent_all = comm.allreduce(int(ranks.sum()) * row, op=MPI.MAX)
        e_disp = comm.allreduce(n_recv * row)  # all ranks' received token bytes: the energy rows' bytes per call
        e_comb = comm.allreduce(int(ranks.sum()) * row)  # all ranks' sent token bytes
        rows = {"dispatch": (lambda: c.dispatch(x, idx, weights, E), nvl, allb),
                "dispatch-cached": (lambda: c.dispatch(x, handle=handle), nvl, allb),
                "combine": (lambda: c.combine(recv_x, handle), sent_nvl, sent_all)}
        # direct mode: the tokens land in a symmetric out (GPU: the peers write them there, one copy per byte)
        sym_out = c.empty((tokens * W, H), dtype)
        got = c.dispatch(x, handle=handle, out=sym_out)[0]
        if not comm.allreduce(bool(np.array_equal(_host(got), _host(recv_x))), op=MPI.LAND):
            raise RuntimeError(f"bench --op dispatch: dispatch into a symmetric out differs from the plain one at "
                               f"{tokens} tokens; not timing it")
        rows["dispatch-sym"] = (lambda: c.dispatch(x, idx, weights, E, out=sym_out), nvl, allb)
        rows["dispatch-cached-sym"] = (lambda: c.dispatch(x, handle=handle, out=sym_out), nvl, allb)
        rel_err = None
        if args.wire == "fp8":  # low-precision transfer: codes + scales on the wire (1 + 4/128 bytes an element)
            q = c.dispatch(x, handle=handle, wire_dtype="fp8")[0]
            d = (q.astype(np.float32) - recv_x.astype(np.float32))
            num, den = float((d * d).sum()), float((recv_x.astype(np.float32) ** 2).sum())
            rel_err = (comm.allreduce(num) / max(comm.allreduce(den), 1e-30)) ** 0.5
            f = (H + 4 * (H // 128)) / (H * dtype.itemsize)  # wire bytes per token byte
            rows["dispatch-fp8"] = (lambda: c.dispatch(x, idx, weights, E, wire_dtype="fp8"), nvl * f, allb * f)
            rows["dispatch-cached-fp8"] = (lambda: c.dispatch(x, handle=handle, wire_dtype="fp8"), nvl * f,
                                           allb * f)
            if me == 0:
                print(f"# {tokens} tokens, fp8 wire: relative L2 error of recv_x {rel_err:.3e}")
        for op, (fn, b_nvl, b_all) in rows.items():
            samples = timer.samples(fn, args.iters, args.warmup, comm, c.synchronize)
            p50, p99 = float(np.percentile(samples, 50)), float(np.percentile(samples, 99))
            loop = timer.time_loop(fn, args.iters, args.warmup, comm, c.synchronize)
            results.append({"op": op, "tokens": tokens, "rel_l2_error": rel_err if op.endswith("fp8") else 0.0, "hidden": H, "dtype": dtype.name, "num_experts": E,
                            "topk": K, "world_size": W, "backend": c.backend, "p50_us": p50 * 1e6,
                            "p99_us": p99 * 1e6, "loop_us": loop * 1e6, "nvl_GBps": b_nvl / p50 / 1e9,
                            "deepep_GBps": b_all / p50 / 1e9,
                            **_energy.row_fields(timer, fn, c.synchronize,
                                                 e_comb if op == "combine" else e_disp * b_all / max(allb, 1),
                                                 loop, _energy.MOE_BYTES[op == "combine"])})
            if me == 0:
                print(f"{tokens:7d} {op:>19} {p50 * 1e6:10.1f} {p99 * 1e6:10.1f} {loop * 1e6:10.1f} "
                      f"{b_nvl / p50 / 1e9:9.2f} {b_all / p50 / 1e9:11.2f}")
        c.free(sym_out)
    return results
