"""``python -m cupy_symbuf.bench [--backend host|cuda] --op hier --node-size K [--sizes 64K,1M] [--moe-tokens 512]
[--hidden 2048] [--num-experts 64] [--topk 8] [--dtype float16]``: the hierarchical collectives
(:class:`~cupy_symbuf.HierarchicalCommunicator`: MPI between virtual nodes of ``K`` ranks, our channels inside
them) beside the flat ones and plain MPI, in the same run; every engine checked first; max over ranks.

- all-to-all, per ``--sizes``: ``h.alltoall`` against the flat ``Communicator.alltoall`` (``out=``) and
  ``MPI.Alltoall`` (on the GPU ``mpi-staged``: device to host, ``MPI.Alltoall``, back; the MPI here is not
  CUDA-aware); loop timing (rows ``op: hier``). The MPI rows of the MoE part move host NumPy buffers on both
  backends (the bare transfer of the same bytes).
- MoE, per ``--moe-tokens``: ``h.dispatch`` / cached ``h.dispatch`` / ``h.combine`` against the flat
  ``Communicator.dispatch`` / ``combine`` and against one ``MPI.Alltoallv`` of the flat call's bytes per rank pair
  (dispatch: each (token, destination rank) row of x | top-k ids | weights; combine: each returned row of x;
  pre-packed buffers, no layout: the bare transfer) (rows ``op: hier-moe``); p50 of calls after a barrier and the
  loop time. Routing: ``--topk`` distinct experts per token, uniform (DeepEP's benchmark setting). Checked before
  timing: the hierarchical dispatch equals the flat one bitwise, its combine equals the flat one to float16 /
  bfloat16 rounding (``rtol`` 2**-7), the MPI rows deliver the right bytes. ``internode_KB``: the token bytes a
  rank sends to other (virtual) nodes per call, max over ranks: the hierarchical path sends a token once per
  remote node, the flat one once per remote rank.
"""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

from .units import fmt_bytes as _fmt

from ..scaleout.hierarchical import HierarchicalCommunicator

__all__ = ["run"]


def run(c, comm, timer, args, sizes) -> list:
    W, me = c.world_size, c.rank
    k = args.node_size or W
    results = []
    xp = c.xp
    import dataclasses
    # the bench's own Config (its --num-sms / --chunk-bytes / --num-slots / --mode / --adaptive), resolved by the
    # node communicator for its k ranks
    cfg = dataclasses.replace(c.config, num_sms=args.num_sms, chunk_bytes=args.chunk_bytes, num_slots=args.num_slots)
    with HierarchicalCommunicator(comm, cfg, node_size=k, backend=c.backend) as h:
        if me == 0:
            print(f"# hierarchical: {h.num_nodes} node(s) of {k} rank(s); between them {h.inter_node.upper()}, "
                  f"inside our channels")
            print(f"{'size/rank':>10} {'engine':>12} {'loop_us':>10} {'algbw_GB/s':>11}")
        for size in sizes:
            per_peer = max(1, size // W)
            x_h = np.random.default_rng([me, size]).integers(0, 255, (W, per_peer), dtype=np.uint8)
            want = np.stack([np.random.default_rng([j, size]).integers(0, 255, (W, per_peer), dtype=np.uint8)[me]
                             for j in range(W)])
            x = xp.asarray(x_h)
            out = xp.empty_like(x)
            out_h = np.empty_like(x_h)

            def mpi():  # plain MPI (on the GPU staged through host memory: the MPI here is not CUDA-aware)
                if xp is np:
                    comm.Alltoall(x, out)
                    return out
                comm.Alltoall(xp.asnumpy(x), out_h)
                return xp.asarray(out_h)
            engines = {"hierarchical": lambda: h.alltoall(x), "ours-out": lambda: c.alltoall(x, out=out),
                       ("mpi" if xp is np else "mpi-staged"): mpi}
            for name, fn in engines.items():
                got = fn()
                got = out if got is None else got
                if not comm.allreduce(bool(np.array_equal(_host(got), want)), op=MPI.LAND):
                    raise RuntimeError(f"bench --op hier: {name} gave wrong data at {_fmt(W * per_peer)}")
                t = timer.time_loop(fn, args.iters, args.warmup, comm, c.synchronize)
                results.append({"op": "hier", "engine": name, "size_per_rank": W * per_peer,
                                "loop_us": t * 1e6, "node_size": k, "world_size": W, "inter_node": h.inter_node})
                if me == 0:
                    print(f"{_fmt(W * per_peer):>10} {name:>12} {t * 1e6:10.1f} {W * per_peer / t / 1e9:11.2f}")
        results += _moe(h, c, comm, timer, args, k)
    return results


def _mpi_bytes(comm, send_bytes: np.ndarray, tag: int):
    """An ``MPI.Alltoallv`` of ``send_bytes[d]`` bytes to each rank ``d`` (pre-packed, filled with a pattern of
    (source, destination, ``tag``)); returns the call and a check of what it received."""
    W, me = comm.Get_size(), comm.Get_rank()
    recv_bytes = np.empty(W, np.int64)
    comm.Alltoall(np.asarray(send_bytes, np.int64), recv_bytes)
    sd = np.concatenate([[0], np.cumsum(send_bytes)[:-1]]).astype(np.int64)
    rd = np.concatenate([[0], np.cumsum(recv_bytes)[:-1]]).astype(np.int64)
    send = np.empty(int(np.sum(send_bytes)), np.uint8)
    for d in range(W):
        send[sd[d]: sd[d] + send_bytes[d]] = (me * 31 + d * 7 + tag) % 251
    recv = np.empty(int(recv_bytes.sum()), np.uint8)

    def call():
        comm.Alltoallv([send, (send_bytes, sd), MPI.BYTE], [recv, (recv_bytes, rd), MPI.BYTE])

    def ok():
        return all((recv[rd[s]: rd[s] + recv_bytes[s]] == (s * 31 + me * 7 + tag) % 251).all() for s in range(W))
    return call, ok


def _moe(h, c, comm, timer, args, k) -> list:
    from .moe import routing
    W, me, xp = c.world_size, c.rank, c.xp
    E, K, H = args.num_experts, args.topk, args.hidden
    if E % W:
        raise ValueError(f"--num-experts ({E}) must be a multiple of the world size ({W})")
    dtype = np.dtype(args.dtype)
    node_of = np.arange(W) // k
    results = []
    if me == 0:
        print(f"# MoE over {h.num_nodes} node(s) of {k}: hidden {H} {dtype.name}, top-{K} of {E} experts, "
              f"{args.iters} calls per row")
        print(f"{'tokens':>7} {'engine':>22} {'p50_us':>10} {'loop_us':>10} {'internode_KB':>13}")
    for tokens in [int(t) for t in args.moe_tokens.split(",")]:
        rng = np.random.default_rng([me, tokens, 14])
        idx_h = routing(rng, tokens, E, K)
        x_h = (rng.standard_normal((tokens, H)) * 4).astype(dtype)
        w_h = rng.random((tokens, K)).astype(np.float32)
        x, idx, w = xp.asarray(x_h), xp.asarray(idx_h), xp.asarray(w_h)
        hx, hidx, hw, hcounts, hh = h.dispatch(x, idx, w, E)
        fx, fidx, fw, fcounts, fh = c.dispatch(x, idx, w, E)
        same = all(np.array_equal(_host(a), _host(b)) for a, b in ((hx, fx), (hidx, fidx), (hw, fw))) and \
            hcounts == fcounts and np.array_equal(_host(h.dispatch(x, handle=hh)[0]), _host(fx))
        hy = _host(h.combine(hx, hh, hw)[0]).astype(np.float32)
        fy = _host(c.combine(fx, fh, fw)[0]).astype(np.float32)
        same = same and bool(np.allclose(hy, fy, rtol=2.0 ** -7, atol=2.0 ** -7 * float(np.abs(fy).max(initial=1))))
        row = H * dtype.itemsize
        disp_row = row + K * 8 + K * 4  # x | top-k ids | weights, as the flat dispatch packs them
        send_counts = np.asarray(fh.send_counts, np.int64)
        recv_counts = np.asarray(fh.recv_counts, np.int64)
        mpi_disp, ok_disp = _mpi_bytes(comm, send_counts * disp_row, 1)
        mpi_comb, ok_comb = _mpi_bytes(comm, recv_counts * row, 2)
        mpi_disp()
        mpi_comb()
        same = same and ok_disp() and ok_comb()
        if not comm.allreduce(bool(same), op=MPI.LAND):
            raise RuntimeError(f"bench --op hier: the hierarchical dispatch / combine differ from the flat ones (or "
                               f"the MPI rows from the pattern) at {tokens} tokens; not timing them")
        remote_nodes = np.asarray(hh.rail_send_counts, np.int64).copy()
        remote_nodes[h.node] = 0
        off_node = node_of != h.node
        hier_kb = comm.allreduce(int(remote_nodes.sum()) * disp_row, op=MPI.MAX) / 1e3
        flat_kb = comm.allreduce(int(send_counts[off_node].sum()) * disp_row, op=MPI.MAX) / 1e3
        mpi_kb = flat_kb
        hier_comb_kb = comm.allreduce(int(np.asarray(hh.rail_recv_counts)[np.arange(h.num_nodes) != h.node].sum())
                                      * row, op=MPI.MAX) / 1e3
        flat_comb_kb = comm.allreduce(int(recv_counts[off_node].sum()) * row, op=MPI.MAX) / 1e3
        rows = {"hier-dispatch": (lambda: h.dispatch(x, idx, w, E), hier_kb),
                "flat-dispatch": (lambda: c.dispatch(x, idx, w, E), flat_kb),
                "mpi-alltoallv-dispatch": (mpi_disp, mpi_kb),
                "hier-dispatch-cached": (lambda: h.dispatch(x, handle=hh), hier_kb * row / disp_row),
                "flat-dispatch-cached": (lambda: c.dispatch(x, handle=fh), flat_kb * row / disp_row),
                "hier-combine": (lambda: h.combine(hx, hh), hier_comb_kb),
                "flat-combine": (lambda: c.combine(fx, fh), flat_comb_kb),
                "mpi-alltoallv-combine": (mpi_comb, flat_comb_kb)}
        for name, (fn, kb) in rows.items():
            samples = timer.samples(fn, args.iters, args.warmup, comm, c.synchronize)
            p50 = float(np.percentile(samples, 50))
            loop = timer.time_loop(fn, args.iters, args.warmup, comm, c.synchronize)
            results.append({"op": "hier-moe", "engine": name, "tokens": tokens, "hidden": H, "dtype": dtype.name,
                            "num_experts": E, "topk": K, "node_size": k, "world_size": W, "inter_node": h.inter_node,
                            "p50_us": p50 * 1e6,
                            "loop_us": loop * 1e6, "internode_KB": kb})
            if me == 0:
                print(f"{tokens:7d} {name:>22} {p50 * 1e6:10.1f} {loop * 1e6:10.1f} {kb:13.1f}")
    return results


def _host(a) -> np.ndarray:
    return a.get() if hasattr(a, "get") else np.asarray(a)
