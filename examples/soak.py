"""Soak test: many iterations of mixed collectives with sampled bitwise checks against NumPy.

Run::

    mpiexec -n 4 python examples/soak.py --iters 2000 --backend host          # CI-sized on the host path
    mpirun -n 2 python examples/soak.py --backend cuda                          # the full 10,000 on GPUs
    CUPY_SYMBUF_SOAK_NO_POOL=1 compute-sanitizer --tool memcheck python examples/soak.py --iters 20 --max-rows 64

Every iteration draws its operation and sizes from a generator seeded by ``(--seed, iteration)``, so every rank
makes the same call sequence with no communication; the data of rank ``s`` comes from ``(--seed, iteration, s)``,
so any rank can rebuild what its peers sent and compute its reference locally. Operations:

* ``alltoall``: rows of a random dtype (float32, float16, bfloat16 when ml_dtypes imports, int8, uint64) and width;
* ``alltoallv``: a random count matrix (rows per (source, destination), with zeros, some ranks sending nothing),
  with and without ``recv_counts``;
* ``moe``: ``get_dispatch_layout``, ``dispatch`` (random top-k routing with ``-1`` padding), ``combine`` of fresh
  expert outputs through the handle, then a cached ``dispatch(x2, handle=handle)`` of new rows.

On the GPU path iterations alternate between two CuPy streams (host: one), and the device memory in use is
compared between the end of the first iteration and the end (CuPy pool used bytes and ``cudaMemGetInfo``).
Every ``--check-every``-th iteration all results are compared bitwise with the reference (combine: float32 sums in
ascending source-rank order, rounded once, as documented). Prints ``soak: N iterations, M checked, K mismatches,
...`` on rank 0; exits 1 on any mismatch (on any rank).
``CUPY_SYMBUF_SOAK_NO_POOL=1`` turns CuPy's memory pool off (``cupy.cuda.set_allocator(None)``), so that
compute-sanitizer sees every allocation's real bounds.
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from cupy_symbuf import Communicator  # noqa: E402

try:
    import ml_dtypes
    BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover
    ml_dtypes, BF16 = None, None

WORLD = MPI.COMM_WORLD
RANK, W = WORLD.Get_rank(), WORLD.Get_size()
UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
MOVE_DTYPES = [np.dtype(np.float32), np.dtype(np.float16), np.dtype(np.int8), np.dtype(np.uint64)] + \
    ([BF16] if BF16 is not None else [])
MOE_DTYPES = ["fp32", "fp16"] + (["bf16"] if BF16 is not None else [])


class Soak:
    def __init__(self, args):
        self.args = args
        from cupy_symbuf import Config
        cfg = Config(adaptive=True, adaptive_interval=7) if args.adaptive else Config()
        self.comm = Communicator(WORLD, cfg, backend=args.backend)
        self.backend = self.comm.backend
        self.xp = self.comm.xp
        self.checked = 0
        self.mismatches = 0
        self.ops = {}
        self.streams = [None]
        if self.backend == "cuda":
            import cupy
            self.cupy = cupy
            self.streams = [cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)]

    # ---- data ---------------------------------------------------------------------------------------------
    def rng(self, it: int, *key) -> np.random.Generator:
        return np.random.default_rng([self.args.seed, it] + [int(k) for k in key])

    def raw(self, it: int, src: int, tag: int, shape, dtype) -> np.ndarray:
        """Random bytes of ``src``'s array ``tag`` (every bit pattern; never all zero)."""
        dtype = np.dtype(dtype)
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        return self.rng(it, 1000 + src, tag).integers(1, 256, size=n, dtype=np.uint8).view(dtype).reshape(shape)

    def values(self, it: int, src: int, tag: int, shape, kind: str) -> np.ndarray:
        """Finite nonzero values, |v| in [0.25, 4], of a MoE dtype (fp32, fp16, bf16)."""
        g = self.rng(it, 1000 + src, tag)
        f = (g.uniform(0.25, 4.0, size=shape) * g.choice([-1.0, 1.0], size=shape)).astype(np.float32)
        return {"fp32": f, "fp16": f.astype(np.float16), "bf16": f.astype(BF16) if BF16 is not None else f}[kind]

    def dev(self, a: np.ndarray):
        """NumPy -> backend; on CuPy a dtype it lacks (bfloat16) travels as its raw unsigned bits."""
        if self.backend == "host":
            return a
        try:
            d = self.cupy.asarray(a)
            if d.dtype == a.dtype:
                return d
        except Exception:  # noqa: BLE001
            pass
        return self.cupy.asarray(np.ascontiguousarray(a).view(UINT[a.dtype.itemsize]))

    @staticmethod
    def host(a) -> np.ndarray:
        return a.get() if hasattr(a, "get") else np.asarray(a)

    def same(self, it: int, what: str, got, want: np.ndarray) -> None:
        g = np.ascontiguousarray(self.host(got))
        w = np.ascontiguousarray(want)
        if it == self.args.corrupt and RANK == 0 and g.size:      # self-test of the checker
            g = g.copy()
            g.reshape(-1).view(np.uint8)[0] ^= 1
        ok = g.shape == w.shape and g.dtype.itemsize == w.dtype.itemsize and g.tobytes() == w.tobytes()
        if not ok:
            self.mismatches += 1
            if self.mismatches <= 10:
                print(f"MISMATCH rank {RANK} iteration {it} {what}: got {g.dtype}{g.shape} want {w.dtype}{w.shape}",
                      flush=True)

    # ---- operations ---------------------------------------------------------------------------------------
    def op_alltoall(self, it, g, check):
        dtype = MOVE_DTYPES[g.integers(len(MOVE_DTYPES))]
        width = int(g.integers(1, 65))
        y = self.comm.alltoall(self.dev(self.raw(it, RANK, 0, (W, width), dtype)))
        if check:
            want = np.stack([self.raw(it, s, 0, (W, width), dtype)[RANK] for s in range(W)])
            self.same(it, f"alltoall {dtype} x{width}", y, want)

    def op_alltoallv(self, it, g, check, with_recv_counts: bool):
        dtype = MOVE_DTYPES[g.integers(len(MOVE_DTYPES))]
        width = int(g.integers(1, 129))
        counts = g.integers(0, self.args.max_rows + 1, size=(W, W))
        counts[g.random((W, W)) < 0.25] = 0                      # zeros, and sometimes a rank sends nothing
        if g.random() < 0.1:
            counts[int(g.integers(W))] = 0
        mine = counts[RANK]
        x = self.dev(self.raw(it, RANK, 1, (int(mine.sum()), width), dtype))
        rc = counts[:, RANK].copy() if with_recv_counts else None
        y, got_counts = self.comm.alltoallv(x, mine, recv_counts=rc)
        if check:
            parts = []
            for s in range(W):
                xs = self.raw(it, s, 1, (int(counts[s].sum()), width), dtype)
                off = np.concatenate([[0], np.cumsum(counts[s])])
                parts.append(xs[off[RANK]: off[RANK + 1]])
            self.same(it, f"alltoallv {dtype} x{width}", y, np.concatenate(parts).reshape(-1, width))
            self.same(it, "alltoallv recv_counts", np.asarray(got_counts, np.int64), counts[:, RANK].astype(np.int64))

    def routing(self, it, src, num_tokens, num_experts, topk) -> np.ndarray:
        g = self.rng(it, 2000 + src)
        idx = np.argsort(g.random((num_tokens, num_experts)), axis=1)[:, :topk].astype(np.int64)
        idx[g.random(idx.shape) < 0.15] = -1                    # padding, sometimes whole rows
        return idx

    def op_moe(self, it, g, check):
        c = self.comm
        epr = int(g.choice([1, 2, 4]))
        num_experts = W * epr
        topk = int(g.integers(1, min(4, num_experts) + 1))
        kind = MOE_DTYPES[g.integers(len(MOE_DTYPES))]
        hidden = int(g.integers(1, 97))
        tokens = [int(t) for t in g.integers(0, self.args.max_rows + 1, size=W)]
        idx = self.routing(it, RANK, tokens[RANK], num_experts, topk)
        w = self.rng(it, 3000 + RANK).uniform(0.05, 1.0, size=idx.shape).astype(np.float32)
        x = self.values(it, RANK, 4, (tokens[RANK], hidden), kind)
        per_rank, _, _ = c.get_dispatch_layout(self.dev(idx), num_experts)
        recv_x, recv_idx, recv_w, per_expert, handle = c.dispatch(self.dev(x), self.dev(idx), self.dev(w),
                                                                  num_experts)
        n_recv = handle.num_recv_tokens
        cx = self.values(it, RANK, 5, (n_recv, hidden), kind)
        cw = self.rng(it, 4000 + RANK).uniform(0.05, 1.0, size=(n_recv, topk)).astype(np.float32)
        cx_dev = self.dev(cx)
        kw = {"dtype": "bfloat16"} if (kind == "bf16" and cx_dev.dtype == np.uint16) else {}  # raw bf16 bits
        combined, combined_w = c.combine(cx_dev, handle, self.dev(cw), **kw)
        x2 = self.values(it, RANK, 6, (tokens[RANK], hidden), kind)
        recv_x2 = c.dispatch(self.dev(x2), handle=handle)[0]     # cached layout: no count exchange
        if not check:
            return
        all_idx = [self.routing(it, s, tokens[s], num_experts, topk) for s in range(W)]
        in_rank = [np.zeros((tokens[s], W), bool) for s in range(W)]
        for s in range(W):
            rows, cols = np.nonzero(all_idx[s] >= 0)
            in_rank[s][rows, all_idx[s][rows, cols] // epr] = True
        routes = [[(s, t) for s in range(W) for t in np.flatnonzero(in_rank[s][:, r])] for r in range(W)]
        mine = routes[RANK]
        self.same(it, "num_tokens_per_rank", per_rank, in_rank[RANK].sum(axis=0).astype(np.int32))
        xs = {s: self.values(it, s, 4, (tokens[s], hidden), kind) for s in range(W)}
        x2s = {s: self.values(it, s, 6, (tokens[s], hidden), kind) for s in range(W)}
        ws = {s: self.rng(it, 3000 + s).uniform(0.05, 1.0, size=(tokens[s], topk)).astype(np.float32)
              for s in range(W)}
        empty = np.empty((0, hidden), x.dtype)
        self.same(it, f"dispatch recv_x {kind} h{hidden}", recv_x,
                  np.stack([xs[s][t] for s, t in mine]) if mine else empty)
        self.same(it, "cached dispatch recv_x", recv_x2, np.stack([x2s[s][t] for s, t in mine]) if mine else empty)
        lo = RANK * epr
        want_idx = np.stack([np.where((all_idx[s][t] >= lo) & (all_idx[s][t] < lo + epr), all_idx[s][t] - lo, -1)
                             for s, t in mine]) if mine else np.empty((0, topk), np.int64)
        self.same(it, "dispatch recv_topk_idx", recv_idx, want_idx.astype(np.int64))
        want_w = np.stack([ws[s][t] for s, t in mine]) if mine else np.empty((0, topk), np.float32)
        self.same(it, "dispatch recv_topk_weights", recv_w, np.where(want_idx >= 0, want_w, 0).astype(np.float32))
        counts = np.bincount(want_idx[want_idx >= 0], minlength=epr)
        if list(per_expert) != [int(v) for v in counts]:
            self.same(it, "num_recv_tokens_per_expert", np.array(per_expert), counts)
        # combine: every rank r's rows for our tokens, summed in float32 over r ascending, rounded once
        acc = np.zeros((tokens[RANK], hidden), np.float32)
        acc_w = np.zeros((tokens[RANK], topk), np.float32)
        for r in range(W):
            n_r = len(routes[r])
            cx_r = self.values(it, r, 5, (n_r, hidden), kind).astype(np.float32)
            cw_r = self.rng(it, 4000 + r).uniform(0.05, 1.0, size=(n_r, topk)).astype(np.float32)
            for i, (s, t) in enumerate(routes[r]):
                if s == RANK:
                    acc[t] += cx_r[i]
                    acc_w[t] += cw_r[i]
        self.same(it, f"combine x {kind}", combined, acc.astype(x.dtype))
        self.same(it, "combine topk_weights", combined_w, acc_w)

    # ---- driver -------------------------------------------------------------------------------------------
    def memory(self):
        if self.backend != "cuda":
            return None
        cp = self.cupy
        cp.cuda.Device().synchronize()
        gc.collect()
        free, total = cp.cuda.runtime.memGetInfo()
        return {"pool_used": cp.get_default_memory_pool().used_bytes(), "device_used": total - free}

    def run(self):
        a = self.args
        kinds = ["alltoall", "alltoallv", "alltoallv_rc", "moe"]
        weights = np.array([2, 3, 2, 3], float) * [k in a.ops for k in kinds]
        mem0 = None
        t0 = time.perf_counter()
        for it in range(a.iters):
            g = self.rng(it)                                    # the same on every rank
            op = kinds[g.choice(len(kinds), p=weights / weights.sum())]
            check = it % a.check_every == 0 or it == a.iters - 1
            stream = self.streams[it % len(self.streams)]
            if stream is not None:
                stream.__enter__()
            try:
                if op == "alltoall":
                    self.op_alltoall(it, g, check)
                elif op == "moe":
                    self.op_moe(it, g, check)
                else:
                    self.op_alltoallv(it, g, check, op == "alltoallv_rc")
            finally:
                if stream is not None:
                    stream.__exit__(None, None, None)
            self.ops[op] = self.ops.get(op, 0) + 1
            self.checked += int(check)
            if it == 0:
                mem0 = self.memory()
            if a.report_every and (it + 1) % a.report_every == 0 and RANK == 0:
                print(f"  {it + 1} iterations, {time.perf_counter() - t0:.1f} s", flush=True)
        if self.backend == "cuda":
            self.comm.synchronize()
        elapsed = time.perf_counter() - t0
        gc.collect()                                            # arrays held only by reference cycles
        mem1 = self.memory()
        return elapsed, mem0, mem1

    def close(self):
        self.comm.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=10000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-rows", type=int, default=128, help="largest rows per (source, destination) / tokens")
    ap.add_argument("--backend", default="auto", choices=["auto", "host", "cuda"])
    ap.add_argument("--check-every", type=int, default=10, help="bitwise check every k-th iteration (and the last)")
    ap.add_argument("--corrupt", type=int, default=-1, metavar="ITER",
                    help="self-test: flip one received bit on rank 0 at iteration ITER (must report a mismatch)")
    ap.add_argument("--report-every", type=int, default=0, help="progress line every n iterations (rank 0)")
    ap.add_argument("--adaptive", action="store_true",
                    help="Config(adaptive=True, adaptive_interval=7): work sharing and re-balanced home maps")
    ap.add_argument("--ops", default="alltoall,alltoallv,alltoallv_rc,moe",
                    help="operations to mix (alltoallv_rc = alltoallv with recv_counts; moe = layout, dispatch, "
                         "combine, cached dispatch)")
    args = ap.parse_args()
    args.ops = [o for o in args.ops.split(",") if o]
    bad = set(args.ops) - {"alltoall", "alltoallv", "alltoallv_rc", "moe"}
    if bad or not args.ops:
        ap.error(f"--ops: unknown {sorted(bad)}" if bad else "--ops: none given")
    if args.iters < 1 or args.check_every < 1 or args.max_rows < 0:
        ap.error("--iters and --check-every must be >= 1, --max-rows >= 0")
    if args.backend in ("auto", "cuda"):
        try:
            from cupy_symbuf.common import backend as _compat
            if args.backend == "cuda" or _compat.cuda_available():
                import cupy
                from cupy_symbuf.utils import select_device
                select_device(WORLD)
                if os.environ.get("CUPY_SYMBUF_SOAK_NO_POOL") == "1":
                    cupy.cuda.set_allocator(None)
                    cupy.cuda.set_pinned_memory_allocator(None)
        except ImportError:
            if args.backend == "cuda":
                raise
    soak = Soak(args)
    elapsed, mem0, mem1 = soak.run()
    checked = soak.checked                               # iterations checked (the same on every rank)
    mismatches = WORLD.allreduce(soak.mismatches)
    mem = ""
    if mem0 is not None:
        growth = {k: WORLD.allreduce(mem1[k] - mem0[k], op=MPI.MAX) for k in mem0}
        mem = (f", device memory growth (max over ranks, after iteration 1 -> end): pool {growth['pool_used']} B, "
               f"cudaMemGetInfo {growth['device_used']} B")
    soak.close()
    del soak.comm
    gc.collect()              # free what cycles still hold, so a sanitizer's leak check reports only real leaks
    if RANK == 0:
        ops = " ".join(f"{k}={v}" for k, v in sorted(soak.ops.items()))
        print(f"soak: {args.iters} iterations, {checked} checked, {mismatches} mismatches, {W} ranks, "
              f"backend {soak.backend}, {elapsed:.1f} s ({ops}){mem}", flush=True)
    sys.exit(1 if mismatches else 0)


if __name__ == "__main__":
    main()
