"""The low-latency rows of ``python -m cupy_symbuf.bench --op dispatch`` (``ll-dispatch``, ``ll-combine``):
:class:`~cupy_symbuf.LowLatencyBuffer` dispatch / combine (DeepEP's ``low_latency_dispatch`` / ``_combine``) at
``--ll-tokens`` tokens per rank (default: 128, the decode size, when ``--moe-tokens`` has it), with the hidden size,
dtype, experts and top-k of the other dispatch rows and routing drawn the same way (top-k distinct experts,
uniform, seeded by rank).

Checked once before timing against NumPy, bitwise: every rank's ``recv_x`` rows of each local expert are the
tokens of every source routed to it, in (source rank, token) order, ``recv_count`` their number; ``combine`` of
those rows (each expert returns its input) with the top-k weights equals the documented arithmetic: per expert rank
a float32 sum over its slots in order, rounded once to the dtype, then the partials summed over the ranks in order
in float32 and rounded once.

Timings as the other dispatch rows: ``p50`` / ``p99`` of ``max(--iters, --ll-iters)`` calls (``--ll-iters`` is 200
by default on GPUs; on the host ``--iters``, the host twin's combine being slow at full size), each after a
barrier, the maximum over ranks per call taken before the percentiles, and ``loop`` (calls back to back). On the
GPU every call is on one non-blocking stream (low-latency calls of a rank must not overlap). Bandwidth conventions
as the other rows (``nvl``: token bytes from / to other ranks; ``deepep``: all token bytes, a rank's own included;
one copy per (token, destination rank) either way, which is what the low-latency kernels move). With ``--energy``
the rows carry the same energy fields as the others.

Also :func:`bench_low_latency`, the low-latency rows of the control table (``--control``, ``bench/control.py``):
CUDA events around back-to-back calls, graph replays, host time per issue and the kernels' phase profile.
"""
from __future__ import annotations

import contextlib
import time
from typing import Optional

import numpy as np
from mpi4py import MPI

from ..common import backend as _compat
from ..common import dtypes as _dt
from ..wire import protocol as P

__all__ = ["run", "ll_tokens", "reference_dispatch", "reference_combine", "bench_low_latency"]


def reference_dispatch(all_x: list, all_idx: list, me: int, L: int) -> tuple:
    """``(rows per local expert [list of [n_e, H] arrays], recv_count int32 [L])``: what rank ``me`` receives."""
    rows = []
    for el in range(L):
        e = me * L + el
        rows.append(np.concatenate([x[(idx == e).any(axis=1)] for x, idx in zip(all_x, all_idx)]))
    return rows, np.array([r.shape[0] for r in rows], np.int32)


def reference_combine(x: np.ndarray, idx: np.ndarray, w: np.ndarray, W: int, L: int) -> np.ndarray:
    """The low-latency combine of ``x``'s own tokens when every expert returns its input (see the module
    docstring): ``[n, H]`` of ``x``'s dtype."""
    xf = x.astype(np.float32)
    total = np.zeros(xf.shape, np.float32)
    for d in range(W):
        acc = np.zeros(xf.shape, np.float32)
        hit = np.zeros(x.shape[0], bool)
        for j in range(idx.shape[1]):
            m = (idx[:, j] >= 0) & (idx[:, j] // L == d)
            acc = np.where(m[:, None], acc + w[:, j:j + 1].astype(np.float32) * xf, acc)
            hit |= m
        partial = acc.astype(x.dtype).astype(np.float32)
        total = np.where(hit[:, None], total + partial, total)
    return total.astype(x.dtype)


def _host(a):
    return a.get() if hasattr(a, "get") else np.asarray(a)


def ll_tokens(args) -> list:
    """Token counts of the low-latency rows: ``--ll-tokens`` (comma-separated; '' or 0: none), by default 128 when
    ``--moe-tokens`` has it (the decode size), else none."""
    given = getattr(args, "ll_tokens", None)
    if given is None:
        return [128] if 128 in [int(t) for t in str(args.moe_tokens).split(",") if t.strip()] else []
    return [int(t) for t in str(given).split(",") if t.strip() and int(t) > 0]


def run(c, comm, timer, args) -> list:
    """Print and return the low-latency rows (JSON dicts like ``bench/moe.py``'s, ``op`` ``ll-dispatch`` /
    ``ll-combine``) for every :func:`ll_tokens` count; none, with the reason printed on rank 0, where the
    low-latency mode cannot run with these parameters."""
    counts = ll_tokens(args)
    if not counts:
        return []
    me = c.rank
    ll_iters = getattr(args, "ll_iters", None)
    if ll_iters is None:  # GPU: 200 (a p99 worth the name); host: --iters (the host twin is slow at full size)
        ll_iters = 200 if c.backend == "cuda" else 0
    iters = max(args.iters, ll_iters)
    if me == 0:
        print(f"# low-latency mode (LowLatencyBuffer): {args.hidden} {np.dtype(args.dtype).name}, top-{args.topk} "
              f"of {args.num_experts} experts, {iters} calls per row")
        print(f"{'tokens':>7} {'op':>19} {'p50_us':>10} {'p99_us':>10} {'loop_us':>10} {'nvl_GB/s':>9} "
              f"{'deepep_GB/s':>11}")
    out = []
    for tokens in counts:
        out += _run_one(c, comm, timer, args, tokens, iters)
    return out


def _row(c, comm, timer, args, op, tokens, fn, sync, b_nvl, b_all, e_bytes, iters) -> dict:
    from . import energy as _energy
    samples = timer.samples(fn, iters, args.warmup, comm, sync)
    p50, p99 = float(np.percentile(samples, 50)), float(np.percentile(samples, 99))
    loop = timer.time_loop(fn, iters, args.warmup, comm, sync)
    r = {"op": op, "tokens": tokens, "rel_l2_error": 0.0, "hidden": args.hidden, "dtype": np.dtype(args.dtype).name,
         "num_experts": args.num_experts, "topk": args.topk, "world_size": c.world_size, "backend": c.backend,
         "p50_us": p50 * 1e6, "p99_us": p99 * 1e6, "loop_us": loop * 1e6, "nvl_GBps": b_nvl / p50 / 1e9,
         "deepep_GBps": b_all / p50 / 1e9, "iters": iters,
         **_energy.row_fields(timer, fn, sync, e_bytes, loop, _energy.MOE_BYTES[op == "ll-combine"])}
    if c.rank == 0:
        print(f"{tokens:7d} {op:>19} {p50 * 1e6:10.1f} {p99 * 1e6:10.1f} {loop * 1e6:10.1f} "
              f"{b_nvl / p50 / 1e9:9.2f} {b_all / p50 / 1e9:11.2f}", flush=True)
    return r


def _run_one(c, comm, timer, args, tokens: int, iters: int) -> list:
    from .moe import routing
    W, me, xp = c.world_size, c.rank, c.xp
    E, K, H = args.num_experts, args.topk, args.hidden
    L = E // W
    dtype = np.dtype(args.dtype)
    try:
        from ..moe.low_latency import LowLatencyBuffer
    except Exception as exc:  # noqa: BLE001 - the same install everywhere: every rank skips
        if me == 0:
            print(f"# ll-dispatch / ll-combine: skipped: low-latency mode not importable ({type(exc).__name__}: "
                  f"{exc})")
        return []
    try:
        ll = LowLatencyBuffer(c, tokens, H, E, dtype=dtype.name, max_topk=K)
    except (TypeError, ValueError, ImportError, NotImplementedError) as exc:  # raised on every rank alike
        if me == 0:
            print(f"# ll-dispatch / ll-combine: skipped: {type(exc).__name__}: {exc}")
        return []
    rng = np.random.default_rng([me, tokens, 11])
    idx_h = routing(rng, tokens, E, K)
    x_h = (rng.standard_normal((tokens, H)) * 4).astype(dtype)
    w_h = rng.random((tokens, K)).astype(np.float32)
    all_x, all_idx = comm.allgather(x_h), comm.allgather(idx_h)
    want_rows, want_count = reference_dispatch(all_x, all_idx, me, L)
    want_y = reference_combine(x_h, idx_h, w_h, W, L)
    stream = None
    if c.backend == "cuda":
        from ..common import backend as _compat
        stream = _compat.cupy.cuda.Stream(non_blocking=True)
    results = []
    with ll, (stream if stream is not None else contextlib.nullcontext()):
        x, idx, w = xp.asarray(x_h), xp.asarray(idx_h), xp.asarray(w_h)
        recv, cnt, h = ll.dispatch(x, idx)
        y = recv.copy()  # the experts' outputs: their inputs
        out = ll.combine(y, idx, w, h)
        ll.synchronize()
        got_count = _host(cnt)
        got_recv = _host(recv)
        ok = np.array_equal(got_count, want_count) and all(
            np.array_equal(got_recv[el, : want_count[el]].view(np.uint8), want_rows[el].view(np.uint8))
            for el in range(L))
        ok_c = np.array_equal(_host(out).view(np.uint8), want_y.view(np.uint8))
        oks = comm.allgather((bool(ok), bool(ok_c)))
        if not all(a for a, _ in oks):
            raise RuntimeError(f"bench --op dispatch: low-latency dispatch of {tokens} tokens differs from the NumPy "
                               f"reference (recv_x / recv_count); not timing it")
        if not all(b for _, b in oks):
            raise RuntimeError(f"bench --op dispatch: low-latency combine of {tokens} tokens differs from the NumPy "
                               f"reference; not timing it")
        row = H * dtype.itemsize
        reach = np.zeros((tokens, W), bool)
        np.put_along_axis(reach, idx_h // L, True, axis=1)
        n_recv = sum(int((a // L == me).any(axis=1).sum()) for a in all_idx)  # (source token, me) pairs
        own = int(reach[:, me].sum())
        nvl = comm.allreduce((n_recv - own) * row, op=MPI.MAX)
        allb = comm.allreduce(n_recv * row, op=MPI.MAX)
        sent_nvl = comm.allreduce(int(reach.sum() - own) * row, op=MPI.MAX)
        sent_all = comm.allreduce(int(reach.sum()) * row, op=MPI.MAX)
        e_disp = comm.allreduce(n_recv * row)  # all ranks' received token bytes (the energy rows' bytes)
        e_comb = comm.allreduce(int(reach.sum()) * row)
        hs = {"h": h}

        def d_call():
            return ll.dispatch(x, idx)

        def c_call():
            return ll.combine(y, idx, w, hs["h"])
        results.append(_row(c, comm, timer, args, "ll-dispatch", tokens, d_call, ll.synchronize, nvl, allb, e_disp,
                            iters))
        hs["h"] = ll.dispatch(x, idx)[2]  # a handle lasts two dispatches: a fresh one for the combine row
        ll.synchronize()
        results.append(_row(c, comm, timer, args, "ll-combine", tokens, c_call, ll.synchronize, sent_nvl, sent_all,
                            e_comb, iters))
        ll.synchronize()
    return results


class _BenchGroup:
    """The benchmark's barrier, allgather and max over the ranks of ``buf`` (a SymBuffer): its MPI communicator's
    blocking collectives, or, over a bootstrap that is not MPI, the bootstrap's bounded exchanges."""

    def __init__(self, buf):
        self.comm, self.boot, self.timeout_s = buf.comm, buf.bootstrap, buf.timeout_s

    def Barrier(self) -> None:  # noqa: N802 - MPI's name
        if self.comm is not None:
            self.comm.Barrier()
        else:
            self.boot.barrier(self.timeout_s, "bench_low_latency (barrier)", role="construction")

    def allgather(self, obj) -> list:
        if self.comm is not None:
            return self.comm.allgather(obj)
        return self.boot.allgather(obj, self.timeout_s, "bench_low_latency (allgather)")

    def allreduce_max(self, v: float) -> float:
        if self.comm is not None:
            from mpi4py import MPI
            return self.comm.allreduce(v, op=MPI.MAX)
        return max(self.allgather(v))


def _profile_phases(ll, mpi, stream, d_call, c_call, fresh_handle, iters: int) -> dict:
    """Phase ends of back-to-back calls from the kernels' ``%globaltimer`` stamps (``prof`` words), see
    :func:`bench_low_latency`. Collective; the stamps of ranks on one GPU share a clock (on several GPUs the
    cross-rank numbers mix clocks)."""
    cp = _compat.cupy
    out = {}
    bufs = cp.zeros((iters, ll.grid, P.LL_PROF_STAMPS), np.uint64)
    for name, call in (("dispatch", d_call), ("combine", c_call)):
        fresh_handle()
        bufs[...] = 0
        with stream:
            stream.synchronize()
            mpi.Barrier()
            for i in range(iters):
                ll.set_profile(bufs[i].data.ptr)
                call()
            ll.set_profile(0)
            stream.synchronize()
            ll.synchronize()
        st = bufs.get().astype(np.int64)                       # [iters, grid, LL_PROF_STAMPS] ns
        starts = st[:, :, 0].min(axis=1)                        # per call: earliest block start of this rank
        ends = st[:, :, 1:5].max(axis=1)                        # per call: latest block at each phase end
        allv = mpi.allgather((starts, ends))
        s_all = np.stack([a[0] for a in allv])                  # [ranks, iters]
        e_all = np.stack([a[1] for a in allv])                  # [ranks, iters, 4]
        ref = s_all.min(axis=0)                                 # earliest start of any rank per call
        phases = (e_all.max(axis=0) - ref[:, None]) / 1e3       # [iters, 4] us
        out[f"{name}_phases_us"] = [round(float(v), 2) for v in np.median(phases, axis=0)]
        out[f"{name}_start_skew_us"] = round(float(np.median((s_all.max(axis=0) - ref) / 1e3)), 2)
    return out


def bench_low_latency(comm, num_tokens: int = 128, hidden: int = 7168, num_experts: int = 256, topk: int = 8,
                      iters: int = 50, warmup: int = 5, use_fp8: bool = False, graph: bool = True,
                      seed: int = 0, host_issue: int = 1000, profile: bool = False,
                      num_blocks: Optional[int] = None) -> dict:
    """Microseconds per low-latency dispatch and per combine (max over ranks), CUDA events around ``iters``
    back-to-back calls on one stream after ``warmup`` calls; with ``graph`` also the same calls replayed from a
    CUDA graph (kernel time without Python launch overhead). Host backend: wall clock. Collective.

    Returns ``{"dispatch_us", "combine_us", "dispatch_graph_us", "combine_graph_us", "bytes_dispatch",
    "bytes_combine"}`` (bytes a rank stores into peers' buffers per call, itself excluded); on the GPU also
    ``"dispatch_host_us"`` / ``"combine_host_us"``: host time per call to issue (``time.perf_counter`` around
    ``host_issue`` calls in batches of 200, no synchronisation inside a batch; max over ranks), and with
    ``profile`` ``"dispatch_phases_us"`` / ``"combine_phases_us"``: medians over ``iters`` back-to-back calls of
    the kernel's phase ends (``%globaltimer`` stamps of every block, max over blocks and ranks) measured from the
    earliest block start of any rank (dispatch: sent, flags seen, layout built, end; combine: weights seen,
    partials sent, partials seen, end), and ``"*_start_skew_us"``: latest minus earliest rank start."""
    xp = comm.xp
    W = comm.world_size
    rng = np.random.default_rng(seed + comm.rank)
    scores = rng.random((num_tokens, num_experts))
    idx = np.argsort(-scores, axis=1)[:, :topk].astype(np.int64)
    wts = rng.random((num_tokens, topk)).astype(np.float32)
    xb = _dt.float32_to_bf16_bits(np, rng.standard_normal((num_tokens, hidden)).astype(np.float32))
    L = num_experts // W
    ranks = idx // L
    sent = sum(int((ranks == d).any(axis=1).sum()) for d in range(W) if d != comm.rank)
    row = hidden * 2
    res = {"bytes_dispatch": sent * (hidden + hidden // 32 if use_fp8 else row), "bytes_combine": sent * row}
    from ..moe.low_latency import LowLatencyBuffer
    ll = LowLatencyBuffer(comm, num_tokens, hidden, num_experts, dtype="bfloat16", max_topk=topk,
                          num_blocks=num_blocks)
    mpi = _BenchGroup(ll.buffer)
    # GPU: every call on one non-default stream (low-latency calls of a rank must not overlap; graphs need it)
    stream = _compat.cupy.cuda.Stream(non_blocking=True) if comm.backend == "cuda" else None
    try:
      with (stream if stream is not None else contextlib.nullcontext()):
          x, ti, tw = xp.asarray(xb), xp.asarray(idx), xp.asarray(wts)
          y = ll.dispatch(x, ti)[0].copy()  # the experts' outputs: recv_x itself

          def d_call():
              return ll.dispatch(x, ti, use_fp8=use_fp8)

          hs = {}

          def c_call():
              return ll.combine(y, ti, tw, hs["h"])

          def fresh_handle():  # a handle lasts two dispatches: take one right before combine is timed
              hs["h"] = ll.dispatch(x, ti, use_fp8=use_fp8)[2]

          for _ in range(warmup):
              h = d_call()[2]
              ll.combine(y, ti, tw, h)
          if comm.backend == "cuda":
              cp = _compat.cupy
  
              def timed(fn, n):
                  with stream:
                      ll.synchronize()
                      stream.synchronize()
                      mpi.Barrier()
                      e0, e1 = cp.cuda.Event(), cp.cuda.Event()
                      e0.record(stream)
                      fn(n)
                      e1.record(stream)
                      e1.synchronize()
                      ll.synchronize()
                      return cp.cuda.get_elapsed_time(e0, e1) * 1e3 / n

              def loop(call):
                  return lambda n: [call() for _ in range(n)]

              t_d = timed(loop(d_call), iters)
              fresh_handle()
              t_c = timed(loop(c_call), iters)
              res["dispatch_us"], res["combine_us"] = t_d, t_c
              res["grid"] = ll.grid
              if host_issue:
                  for name, call in (("dispatch_host_us", d_call), ("combine_host_us", c_call)):
                      fresh_handle()
                      total, done = 0.0, 0
                      while done < host_issue:
                          m = min(200, host_issue - done)
                          stream.synchronize()
                          mpi.Barrier()
                          t0 = time.perf_counter()
                          for _ in range(m):
                              call()
                          total += time.perf_counter() - t0
                          done += m
                      stream.synchronize()
                      ll.synchronize()
                      res[name] = total * 1e6 / done
              if profile:
                  res.update(_profile_phases(ll, mpi, stream, d_call, c_call, fresh_handle, iters))
              if graph:
                  for name, call in (("dispatch_graph_us", d_call), ("combine_graph_us", c_call)):
                      fresh_handle()
                      with stream:
                          ll.synchronize()
                          mpi.Barrier()
                          stream.begin_capture()
                          for _ in range(10):
                              call()
                          g = stream.end_capture()
                          g.launch(stream)  # warm replay
                          stream.synchronize()
                          res[name] = timed(lambda n, g=g: [g.launch(stream) for _ in range(n // 10)],
                                            max(10, iters // 10 * 10))
          else:
              for name, call in (("dispatch_us", d_call), ("combine_us", c_call)):
                  fresh_handle()
                  mpi.Barrier()
                  t0 = time.perf_counter()
                  for _ in range(iters):
                      call()
                  res[name] = (time.perf_counter() - t0) * 1e6 / iters
          for k in [k for k in res if k.endswith("_us") and isinstance(res[k], float)]:
              res[k] = mpi.allreduce_max(float(res[k]))
    finally:
        ll.close()
    return res
