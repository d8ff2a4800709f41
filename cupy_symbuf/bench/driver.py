"""Benchmarks: ``mpiexec -n N python -m cupy_symbuf.bench [--sizes 1M,16M,128M] [--no-reference] [--breakdown]``;
``--tune``: sweep the layout per message size and write the library's defaults (``cupy_symbuf.bench.tune``);
``--control [--tokens 4096]``: the control-path table (MoE layout, dispatch / combine, CUDA graphs, low-latency
mode, alltoall host issue time); ``--op alltoallv --patterns uniform,zipf,hot`` (``cupy_symbuf.bench.alltoallv``)
``--backend host --op latency`` (the small-message host rows against MPI with their targets,
``cupy_symbuf.bench.host_latency``) and ``--op dispatch --moe-tokens 4096,128`` (MoE dispatch, cached dispatch and combine, ``cupy_symbuf.bench.moe``;
the low-latency mode's ``ll-dispatch`` / ``ll-combine`` at 128 tokens, ``cupy_symbuf.bench.low_latency``): p50 / p99 per
call.

Times ``Communicator.alltoall`` on equal blocks for each per-rank input size, and the same traffic through a
reference engine in the same run: NCCL grouped send/recv (``cupy.cuda.nccl``) on GPUs, ``MPI.Alltoall`` on the
host. Rows (``--sends``): ``ours`` (plain arrays, a fresh output per call), ``ours-out`` (plain arrays, ``out=``
reused), ``ours-sym`` (input and output from ``Communicator.empty``: the receivers copy straight out of the
sender's array, one copy per byte; with ``--mode copy_engine`` the copy engines do it from 16 MiB per peer), the
reference, ``ce-pull`` (``--sends ce``: the copy engines' rate, no flags) and ``copy``. Bandwidths:

* ``algbw``: per-rank input bytes / time.
* ``busbw``: bytes that leave each rank for OTHER ranks / time = ``(W - 1) / W * input / time``
  (for 2 ranks: half the input, i.e. what crosses NVLink per direction).
* ``copy_share``: all ranks' input bytes per second / the copy rate measured in the same run (every rank copying
  its input between two of its own arrays at once; row ``copy``): how close a collective comes to one copy per byte.

Two timings (``--timing``), each the max over ranks:

* ``call``: every call timed alone, after a barrier (CUDA events around it on the GPU), median over ``--iters``.
  Host work before the launch and the ranks' skew count in full.
* ``loop``: the nccl-tests method: ``--iters`` calls issued back to back after one barrier, one pair of events around
  all of them, time / iters. Host work overlaps the previous call's kernel, as in a training step.

``vs_peer``: the peer baseline's time / the row's time, same timing, same run (> 1: faster than the peer). The peer
is NCCL where it runs, else ``mpi-cuda`` on GPUs (``--references mpi``: CUDA-aware ``MPI.Alltoall`` straight on the
CuPy arrays, ``cupy_symbuf.bench.mpi_cuda``; the baseline where ranks share a GPU and NCCL refuses them), and
``MPI.Alltoall`` on the host.

Energy (``--energy``, on by default on GPUs when ``pynvml`` from nvidia-ml-py imports; ``--no-energy``): for every
row, NVML's energy counter of **the whole GPU** (summed over the run's GPUs, read by the lowest rank on each) around
at least one second of back-to-back calls; ``J/GB`` = joules / (calls x all ranks' input bytes / 1e9), with the
idle power (``idle_W``, nothing running, sampled over 0.5 s at the start) beside it and ``energy_above_idle_J_per_GB``
in the JSON. With several ranks on one GPU (MPS) the figure covers all of them. Without pynvml, on the host path or
when NVML fails, one line says why and the fields are null (``cupy_symbuf.bench.energy``). ``--op dispatch``
rows get the same fields (bytes: all ranks' received / sent token bytes) and a table after the rows.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np
from mpi4py import MPI

from . import energy as _energy
from . import mpi_cuda as _mpi_cuda
from .profiling import profile_calls, top_functions
from ..common import backend as _compat
from ..communicator import Communicator
from ..common.config import Config
from ..utils import select_device
from .units import fmt_bytes as _fmt, parse_size  # noqa: F401 (parse_size: the public cupy_symbuf.bench.parse_size)

class _Timer:
    def __init__(self, backend: str):
        self.backend = backend

    def _local_samples(self, fn, iters: int, warmup: int, comm, sync=None) -> np.ndarray:
        """This rank's seconds of each of ``iters`` calls, each after a barrier (CUDA events around it on the
        GPU). ``sync()`` is called after the timed calls (outside the timing) to raise what a queued call
        recorded."""
        for _ in range(warmup):
            fn()
        local = np.empty(iters, np.float64)
        cp = _compat.cupy if self.backend == "cuda" else None
        for i in range(iters):
            if cp is not None:
                cp.cuda.get_current_stream().synchronize()
                comm.Barrier()
                start, stop = cp.cuda.Event(), cp.cuda.Event()
                start.record()
                fn()
                stop.record()
                stop.synchronize()
                local[i] = cp.cuda.get_elapsed_time(start, stop) * 1e-3
            else:
                comm.Barrier()
                t0 = time.perf_counter()
                fn()
                local[i] = time.perf_counter() - t0
        if sync is not None:
            sync()
        return local

    def time(self, fn, iters: int, warmup: int, comm, sync=None) -> float:
        """``call`` timing: median seconds of one call after a barrier, max over ranks."""
        return comm.allreduce(float(np.median(self._local_samples(fn, iters, warmup, comm, sync))), op=MPI.MAX)

    def samples(self, fn, iters: int, warmup: int, comm, sync=None) -> np.ndarray:
        """Seconds of each of ``iters`` calls, each after a barrier, as the maximum over ranks per call (float64
        ``[iters]``, the same on every rank): what p50 / p99 are taken of."""
        local = self._local_samples(fn, iters, warmup, comm, sync)
        out = np.empty_like(local)
        comm.Allreduce(local, out, op=MPI.MAX)
        return out

    def time_loop(self, fn, iters: int, warmup: int, comm, sync=None) -> float:
        """``loop`` timing (nccl-tests): ``iters`` calls back to back after one barrier; seconds per call, max over
        ranks."""
        for _ in range(warmup):
            fn()
        if self.backend == "cuda":
            cp = _compat.cupy
            cp.cuda.get_current_stream().synchronize()
            comm.Barrier()
            start, stop = cp.cuda.Event(), cp.cuda.Event()
            start.record()
            for _ in range(iters):
                fn()
            stop.record()
            stop.synchronize()
            elapsed = cp.cuda.get_elapsed_time(start, stop) * 1e-3
        else:
            comm.Barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            elapsed = time.perf_counter() - t0
        if sync is not None:
            sync()
        return comm.allreduce(elapsed / iters, op=MPI.MAX)


def _nccl_alltoall(comm, nbytes_per_peer: int):
    """A function doing all-to-all of ``nbytes_per_peer`` bytes per peer through NCCL grouped send/recv."""
    cp = _compat.cupy
    from cupy.cuda import nccl
    W, me = comm.Get_size(), comm.Get_rank()
    uid = comm.bcast(nccl.get_unique_id() if me == 0 else None, root=0)
    nc = nccl.NcclCommunicator(W, uid, me)
    send = cp.empty(W * nbytes_per_peer, cp.uint8)
    recv = cp.empty_like(send)

    def run():
        stream = cp.cuda.get_current_stream().ptr
        nccl.groupStart()
        for p in range(W):
            nc.send(send.data.ptr + p * nbytes_per_peer, nbytes_per_peer, nccl.NCCL_UINT8, p, stream)
            nc.recv(recv.data.ptr + p * nbytes_per_peer, nbytes_per_peer, nccl.NCCL_UINT8, p, stream)
        nccl.groupEnd()
    return run, nc


def _nccl_skip_reason(c):
    """Why the NCCL baseline cannot run with this communicator's ranks, or None: NCCL refuses two ranks on one GPU
    (``ncclInvalidUsage``), so under MPS it is skipped (the same answer on every rank: from the agreed GPU list)."""
    if c.buffer.ranks_per_gpu > 1:
        return f"{c.buffer.ranks_per_gpu} ranks share one GPU (MPS); NCCL refuses two ranks on one device"
    try:
        from cupy.cuda import nccl  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - the same install on every rank of the node
        return f"CuPy's NCCL binding is not available ({type(exc).__name__}: {exc})"
    return None


_TORCH = {"ready": None}  # torch.distributed, initialised once per run: None (not tried), True, or the skip reason


def _torch_setup(comm, c):
    """Initialise ``torch.distributed`` for the ``torch`` baseline row: gloo on the host path, NCCL on GPUs with a
    rank per GPU. Returns None when ready, else why it is skipped (the same answer on every rank)."""
    if _TORCH["ready"] is not None:
        return None if _TORCH["ready"] is True else _TORCH["ready"]
    why = None
    try:
        import torch
        import torch.distributed as dist
        if not dist.is_available():
            why = "torch.distributed is not available in this torch build"
        elif c.backend == "cuda":
            why = _nccl_skip_reason(c) or (None if torch.cuda.is_available() else "torch has no CUDA")
    except ImportError:
        why = "torch is not installed"
    except Exception as exc:  # noqa: BLE001 - a broken torch install: the row is skipped, the bench goes on
        why = f"torch failed to load ({type(exc).__name__}: {exc})"
    why = next((w for w in comm.allgather(why) if w), None)  # one answer on every rank
    if why is None:
        import socket
        import torch.distributed as dist
        node = comm.Split_type(MPI.COMM_TYPE_SHARED)
        one_node = node.Get_size() == comm.Get_size()
        node.Free()
        if comm.Get_rank() == 0:
            s = socket.socket()
            s.bind(("", 0))
            port = s.getsockname()[1]
            s.close()
            addr = "127.0.0.1" if one_node else socket.gethostname()
        else:
            addr, port = None, None
        addr, port = comm.bcast((addr, port))
        try:
            if c.backend == "cuda":
                torch.cuda.set_device(c.buffer.device_id)
            import datetime
            dist.init_process_group("gloo" if c.backend == "host" else "nccl", init_method=f"tcp://{addr}:{port}",
                                    rank=comm.Get_rank(), world_size=comm.Get_size(),
                                    timeout=datetime.timedelta(seconds=max(30.0, c.config.timeout_s)))
        except Exception as exc:  # noqa: BLE001 - reported as the row's skip reason
            why = f"init_process_group failed: {type(exc).__name__}: {exc}"
        why = comm.allgather(why)
        why = next((w for w in why if w), None)
    _TORCH["ready"] = True if why is None else why
    return why


def _torch_alltoall(x, expected, comm):
    """``torch.distributed.all_to_all_single`` of ``x``'s bytes (NumPy or CuPy, no copy), checked once against
    ``expected``; returns the function to time."""
    import torch
    import torch.distributed as dist
    src = torch.from_numpy(np.ascontiguousarray(x).reshape(-1)) if isinstance(x, np.ndarray) else \
        torch.from_dlpack(x.reshape(-1))
    dst = torch.empty_like(src)
    dist.all_to_all_single(dst, src)
    got = dst.cpu().numpy().reshape(expected.shape)
    if not comm.allreduce(bool(np.array_equal(got, expected)), op=MPI.LAND):
        raise RuntimeError("bench: torch.distributed all_to_all_single gave wrong data; not timing it")
    return lambda: dist.all_to_all_single(dst, src)


def _progress(items, rank: int, what: str):
    """``items``, with a progress bar on rank 0's stderr when tqdm is installed (``pip install tqdm``)."""
    if rank != 0:
        return items
    try:
        from tqdm import tqdm
    except ImportError:
        return items
    return tqdm(items, desc=what, leave=False)


def _copy_rate(comm, xp, timer, nbytes: int, iters: int, warmup: int, energy=None) -> float:
    """The machine's copy rate in bytes per second, measured in the same run: every rank copies ``nbytes`` (its
    alltoall input) between two of its own arrays at once, back to back (``loop`` timing, max over ranks);
    returns all ranks' bytes / time. On one GPU shared by the ranks (MPS) this is the device-to-device rate the
    ranks share; on the host, the memory bandwidth the ranks share. ``copy_share`` in the table = all ranks' input
    bytes per second of a collective / this rate (an all-to-all that copies every byte once reaches ~100%).
    ``energy(fn, seconds_per_call)``, when given, is called (collectively) with the copy to measure its energy."""
    src = xp.ones(max(1, nbytes), dtype=np.uint8)
    dst = xp.empty_like(src)
    fn = lambda: xp.copyto(dst, src)  # noqa: E731
    per = timer.time_loop(fn, iters, warmup, comm)
    if energy is not None:
        energy(fn, per)
    return comm.Get_size() * max(1, nbytes) / per


def _ce_pull(c, x, expected, comm):
    """The copy-engine rate of an all-to-all (``--sends ce``): ``x`` copied into a symmetric array once; each call
    issues one ``cudaMemcpyAsync`` per rank (rank j's block, this rank's rows) into a local output on the current
    stream. No flags order it against the peers (the inputs never change here), so it is a rate, checked once
    against the reference, not a collective. Returns ``(run, the symmetric array to free after timing)``."""
    cp = _compat.cupy
    rt = cp.cuda.runtime
    W, me = c.world_size, c.rank
    xs = c.array(x)
    out = cp.empty_like(x)
    alloc, off = c.engine.find_symmetric(xs)
    n = x.nbytes // W
    srcs = [p + off + me * n for p in alloc.buffer.peer_ptrs]
    dst = int(out.data.ptr)
    c.synchronize()
    comm.Barrier()

    def run():
        s = cp.cuda.get_current_stream().ptr
        for j in range(W):
            rt.memcpyAsync(dst + j * n, srcs[j], n, 4, s)  # cudaMemcpyDefault: device or staged host memory
    run()
    cp.cuda.get_current_stream().synchronize()
    if not comm.allreduce(bool(np.array_equal(out.get(), expected)), op=MPI.LAND):
        raise RuntimeError("bench: the copy-engine pull gave wrong data; not timing it")
    return run, xs


#: --references accepted (beside the NCCL / MPI rows that --no-reference turns off)
_REFERENCES = {"torch", "mpi"}
#: the --op values each --references entry adds a row to (``mpi``: the mpi-cuda row of alltoall and alltoallv;
#: ``torch``: alltoall, and it is the default, so other ops skip it without a word)
_REFERENCE_OPS = {"mpi": ("alltoall", "alltoallv")}


def _int_at_least(lo: int):
    """An argparse ``type``: an int >= ``lo`` (else "must be an int >= lo, got '...'")."""
    def parse(text):
        try:
            value = int(text)
        except (TypeError, ValueError):
            value = None
        if value is None or value < lo:
            raise argparse.ArgumentTypeError(f"must be an int >= {lo}, got {text!r}")
        return value
    parse.__name__ = f"int >= {lo}"
    return parse


def _int_list_at_least(lo: int):
    """An argparse ``type``: comma-separated ints, each >= ``lo``; returns the text (normalised: ``"4096,128"``)."""
    one = _int_at_least(lo)

    def parse(text):
        items = [t.strip() for t in str(text).split(",")]
        if not items or any(not t for t in items):
            raise argparse.ArgumentTypeError(f"must be comma-separated ints, each an int >= {lo}, got {text!r}")
        try:
            return ",".join(str(one(t)) for t in items)
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(f"must be comma-separated ints, each an int >= {lo}, got "
                                             f"{text!r}") from None
    parse.__name__ = f"list of int >= {lo}"
    return parse


def _print_moe_energy(results: list) -> None:
    """Rank 0: the energy table of ``--op dispatch`` (rows with a measurement)."""
    rows = [r for r in results if r.get("energy_J_per_GB") is not None]
    if not rows:
        return
    print(f"# energy per row ({rows[0]['energy_scope']}; bytes: all ranks' received token bytes for dispatch, sent "
          f"for combine)")
    print(f"{'tokens':>7} {'op':>19} {'J/GB':>9} {'above_idle':>10} {'avg_W':>7} {'idle_W':>7} {'seconds':>8} "
          f"{'calls':>7}")
    for r in rows:
        above = r["energy_above_idle_J_per_GB"]
        print(f"{r['tokens']:7d} {r['op']:>19} {r['energy_J_per_GB']:9.3f} "
              f"{(f'{above:10.3f}' if above is not None else '-'):>10} {r['energy_avg_W']:7.1f} "
              f"{(r['idle_W'] or float('nan')):7.1f} {r['energy_s']:8.2f} {r['energy_calls']:7d}")


#: --op (other than alltoall) -> the module that benchmarks it (its run(c, comm, timer, args, sizes) -> rows)
_OP_MODULES = {"alltoallv": "alltoallv", "dispatch": "moe", "delta": "delta", "hier": "hier",
               "adaptive": "adaptive", "latency": "host_latency"}


def _parser() -> argparse.ArgumentParser:
    """The command line of :func:`main`."""
    ap = argparse.ArgumentParser(prog="python -m cupy_symbuf.bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default=None,
                    help="per-rank input sizes, comma-separated (K/M/G suffix); default 1M,16M,128M (--tune: 64K,1M,16M)")
    ap.add_argument("--backend", default="auto", choices=("auto", "cuda", "host"),
                    help="cuda (CuPy arrays, GPU kernels) or host (NumPy, MPI shared memory); default: auto")
    ap.add_argument("--iters", type=_int_at_least(1), default=20,
                    help="timed calls per size (call timing: median; loop: mean; default 20)")
    ap.add_argument("--warmup", type=_int_at_least(0), default=5, help="untimed calls before timing (default 5)")
    ap.add_argument("--num-sms", type=_int_at_least(2), default=None, help="Config.num_sms (default: per device)")
    ap.add_argument("--small-bytes", type=_int_at_least(0), default=None,
                    help="Config.small_bytes: GPU alltoalls up to this many bytes per rank go by the small-message "
                         "protocol (0: off, every call through the rings; default: CUPY_SYMBUF_SMALL_BYTES, else 1 MiB)")
    ap.add_argument("--chunk-bytes", type=parse_size, default=None,
                    help="Config.chunk_bytes, e.g. 64K (default: per backend)")
    ap.add_argument("--num-slots", type=_int_at_least(2), default=None, help="Config.num_slots (default: Config's)")
    ap.add_argument("--no-reference", action="store_true", help="skip NCCL / MPI reference timings")
    ap.add_argument("--references", default="torch",
                    help="extra references beside NCCL (GPU) / MPI (host), comma-separated: torch "
                         "(torch.distributed all_to_all_single: gloo on the host, NCCL on GPUs with a rank per "
                         "GPU; skipped with the reason where torch cannot run it), mpi (GPU: row mpi-cuda, "
                         "CUDA-aware MPI Alltoall / Alltoallv on the CuPy arrays, the peer baseline where NCCL "
                         "cannot run; skipped with the reason where MPI has no CUDA support); '' for none. "
                         "Default: torch")
    ap.add_argument("--energy", action=argparse.BooleanOptionalAction, default=True,
                    help="GPU: J/GB per row from NVML's energy counter (whole GPU, >= 1 s of back-to-back calls) "
                         "and the idle power (needs nvidia-ml-py; skipped with the reason otherwise). Default: on")
    ap.add_argument("--relaxed", action="store_true",
                    help="also time the ours-sym row with sync='relaxed' (row ours-sym-relaxed)")
    ap.add_argument("--adaptive", action="store_true",
                    help="Config(adaptive=True) for the communicator under test (GPU: the work-sharing ring kernel); "
                         "--op adaptive compares both itself")
    ap.add_argument("--mode", default="auto", choices=("auto", "ring", "direct", "copy_engine"),
                    help="Config.mode (default auto); copy_engine: the ours-sym row of at least 16 MiB per peer is "
                         "pulled by the copy engines")
    ap.add_argument("--transport", default=None, choices=("auto", "ipc", "staged"),
                    help="Config.transport (GPU): staged puts the buffer in pinned host memory (every byte crosses "
                         "PCIe twice); default: $CUPY_SYMBUF_TRANSPORT, else auto")
    ap.add_argument("--sends", default=None,
                    help="which alltoall rows to time, comma-separated: plain (fresh output per call: 'ours'), out "
                         "(plain arrays, out= reused: 'ours-out'), sym (symmetric input and output from "
                         "Communicator.empty: 'ours-sym'; direct mode), ce (GPU: the copy-engine rate, 'ce-pull': "
                         "every rank pulls its rows out of every peer's symmetric block with cudaMemcpyAsync, no "
                         "flags: a rate for the SM / copy-engine crossover, not a collective). Default: the first three "
                         "(--mode copy_engine: sym, since it refuses large plain arrays)")
    ap.add_argument("--timing", default="both", choices=("call", "loop", "both"),
                    help="call: each call alone after a barrier (median); loop: nccl-tests style, calls back to "
                         "back (mean); default both")
    ap.add_argument("--json", default=None, help="write results to this file (rank 0)")
    ap.add_argument("--plot", default=None, metavar="DIR",
                    help="write bandwidth.png and latency.png (against the size, every engine) into DIR (rank 0; "
                         "needs matplotlib)")
    ap.add_argument("--profile", action="store_true",
                    help="after timing the first size, run 100 more calls under cProfile and print rank 0's "
                         "profile after the table (host-side cost per call); with --control: rank 0's profile of "
                         "the 128-token dispatch (eager, cached), combine and the 64 KiB alltoall, first pass")
    ap.add_argument("--breakdown", action="store_true",
                    help="GPU only (ignored on the host): also time the ring kernel alone (CUDA events around the "
                         "launch); the rest of a call is host work (argument checks, launch plan, launch)")
    ap.add_argument("--control", action="store_true",
                    help="the control-path table instead of the sizes: MoE layout, dispatch / combine with and "
                         "without handle, 128-token batches eager and in CUDA graphs, low-latency mode, alltoall "
                         "host issue time (cupy_symbuf.bench.control)")
    ap.add_argument("--tokens", type=_int_at_least(1), default=4096, help="--control: tokens per rank (default 4096)")
    ap.add_argument("--repeat", type=_int_at_least(1), default=1,
                    help="--control: passes of the whole table in this run, each row's median printed (default 1)")
    ap.add_argument("--op", default="alltoall", choices=("alltoall", "alltoallv", "dispatch", "delta", "hier", "adaptive",
                                                                "latency"),
                    help="alltoall (equal blocks; default), alltoallv with --patterns (p50 / p99 per call, "
                         "cupy_symbuf.bench.alltoallv) or dispatch (MoE dispatch / cached dispatch / combine, p50 / "
                         "p99, cupy_symbuf.bench.moe) or delta (DeltaExchange against the plain alltoall, "
                         "cupy_symbuf.bench.delta) or hier (the hierarchical all-to-all over --node-size virtual "
                         "nodes beside the flat one and MPI; cupy_symbuf.bench.hier) or adaptive (MoE "
                         "dispatch / cached dispatch / combine on skewed routing, Config(adaptive=True) against the static split, "
                         "interleaved, p50 / p99; cupy_symbuf.bench.adaptive) or latency (host backend: the small-message "
                         "rows, alltoall / alltoallv with and without recv_counts against MPI, each call after a "
                         "barrier, median, with the target ratios; default --sizes 64K,1M; "
                         "cupy_symbuf.bench.host_latency)")
    ap.add_argument("--node-size", type=_int_at_least(1), default=None,
                    help="--op hier: ranks per virtual node (default: CUPY_SYMBUF_NODE_SIZE, else all)")
    ap.add_argument("--moe-tokens", default="4096,128", type=_int_list_at_least(1),
                    help="--op dispatch: tokens per rank, comma-separated (default 4096,128)")
    ap.add_argument("--ll-tokens", default=None,
                    help="--op dispatch: tokens per rank of the low-latency rows ll-dispatch / ll-combine, "
                         "comma-separated ('' or 0: none; default 128 when --moe-tokens has it)")
    ap.add_argument("--ll-iters", type=_int_at_least(1), default=None,
                    help="--op dispatch: timed calls of each low-latency row, at least (the larger of this and "
                         "--iters; default 200 on GPUs, --iters on the host)")
    ap.add_argument("--hidden", type=_int_at_least(1), default=7168, help="--op dispatch: hidden size (default 7168)")
    ap.add_argument("--num-experts", type=_int_at_least(1), default=256, help="--op dispatch: experts in all (default 256)")
    ap.add_argument("--topk", type=_int_at_least(1), default=8, help="--op dispatch: experts per token (default 8)")
    ap.add_argument("--dtype", default="float16", choices=("float16", "float32"),
                    help="--op dispatch: token dtype (default float16)")
    ap.add_argument("--wire", default=None, choices=("fp8",),
                    help="--op dispatch: also time the dispatches with wire_dtype='fp8' (low-precision transfer)")
    ap.add_argument("--patterns", default=None,
                    help="--op alltoallv: traffic patterns, comma-separated: uniform, zipf, hot (default: all); "
                         "--op adaptive: uniform, zipf1.0, zipf1.5, hot (default: all)")
    ap.add_argument("--tune", action="store_true",
                    help="sweep layouts (num_sms, chunk_bytes) and send modes per size, print the table and write the "
                         "best layout to the tuning table the library reads for its defaults (cupy_symbuf.tuning)")
    ap.add_argument("--tune-rounds", type=_int_at_least(1), default=3, help="--tune: rounds, median kept (default 3)")
    ap.add_argument("--tune-out", default=None,
                    help="--tune: table file to write (default: $CUPY_SYMBUF_TUNING, else "
                         "~/.config/cupy_symbuf/tuning.json)")
    return ap


def main(argv=None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    args.sizes_given = args.sizes is not None
    if args.sizes is None:
        args.sizes = "64K,1M" if args.op == "latency" else "1M,16M,128M"

    comm = MPI.COMM_WORLD
    # argument errors every rank finds alike, before anything collective: one line each, no traceback
    if args.backend == "cuda" and not _compat.cuda_available():
        ap.error("--backend cuda: no CUDA device is available here (CuPy with a visible GPU); use --backend host")
    if args.tune:  # the sweep times plain alltoall layouts only, and its entry is every later Communicator's default
        ignored = [flag for flag, on in (("--op", args.op != "alltoall"), ("--wire", args.wire is not None),
                                         ("--mode", args.mode != "auto"), ("--relaxed", args.relaxed)) if on]
        if ignored:
            ap.error(f"--tune sweeps the alltoall layout alone; {', '.join(ignored)} would be ignored (drop "
                     f"{'it' if len(ignored) == 1 else 'them'})")
    elif args.tune_out is not None:
        ap.error("--tune-out is --tune's output file; give --tune too")
    if args.wire is not None and args.op != "dispatch":
        ap.error(f"--wire applies to --op dispatch only (got --op {args.op}); alltoallv's wire_dtype is an argument "
                 f"of Communicator.alltoallv")
    if args.op == "latency" and args.backend != "host":
        ap.error("--op latency: the host rows need --backend host (the GPU's small-message rows: --control)")
    if args.op == "adaptive":
        from .adaptive import check_patterns
        try:
            check_patterns(args.patterns)
        except ValueError as exc:
            ap.error(str(exc))
    if args.op == "hier":
        k = args.node_size
        if k is None:
            from ..scaleout.hierarchical import node_size_from_env
            try:
                k = node_size_from_env()
            except ValueError as exc:
                ap.error(str(exc))
        if k is not None and comm.Get_size() % k:
            ap.error(f"--node-size {k} must divide the world size ({comm.Get_size()})")
    if args.backend != "host":
        select_device(comm)
    try:
        cfg = Config(num_sms=args.num_sms, chunk_bytes=args.chunk_bytes, mode=args.mode,
                     adaptive=args.adaptive and args.op != "adaptive",
                     **({} if args.num_slots is None else {"num_slots": args.num_slots}),
                     **({} if args.small_bytes is None else {"small_bytes": args.small_bytes}),
                     **({} if args.transport is None else {"transport": args.transport}))
    except (TypeError, ValueError) as exc:  # e.g. a bad CUPY_SYMBUF_TRANSPORT / CUPY_SYMBUF_TIMEOUT_S
        ap.error(str(exc))
    profile_stats = None
    results = []
    if args.tune:
        from . import tune as _tune
        from ..transport.symbuffer import resolve_backend
        backend = resolve_backend(args.backend)
        return _tune.run(comm, _Timer(backend), args, backend, _compat.array_module(backend))
    refs = set(r for r in args.references.split(",") if r)
    if not refs <= _REFERENCES:
        ap.error(f"--references: unknown {sorted(refs - _REFERENCES)}")
    for ref in sorted(refs):  # asked for, but nothing of this run would time it: refuse (before anything collective)
        ops = _REFERENCE_OPS.get(ref)
        if ops is not None and not args.no_reference and (args.control or args.op not in ops):
            ap.error(f"--references {ref}: the {ref} reference covers --op {' and '.join(ops)} only (without "
                     f"--control), not {'--control' if args.control else '--op ' + args.op}")
    with Communicator(comm, cfg, backend=args.backend) as c:
        W, me, xp = c.world_size, c.rank, c.xp
        timer = _Timer(c.backend)
        meter = None
        if not args.control and args.op in ("alltoall", "dispatch"):
            meter, timer.energy_skip = _energy.setup(c, comm, args.energy)
            timer.energy = meter
        if me == 0:
            print(f"# cupy_symbuf.bench: backend={c.backend} world_size={W} num_channels={c.layout.num_channels} "
                  f"chunk={c.config.chunk_bytes} slots={c.config.num_slots} transport={c.transport}"
                  + (f" ({c.transport_reason})" if c.transport == "staged" else "")
                  + (f" small_bytes={c.layout.small_bytes}" if c.backend == "cuda" else ""))
            if c.backend == "cuda":
                tr = c.engine.transport
                k = tr.ring_kernel
                try:  # the SMs the ring kernel takes (one block per SM: sender and receiver per channel)
                    sms = int(c.xp.cuda.Device().attributes["MultiProcessorCount"])
                    blocks = 2 * c.layout.num_channels
                    print(f"# SMs used: {blocks} of the GPU's {sms} ({100 * blocks / sms:.0f}%) per rank; ranks on "
                          f"one GPU (MPS) share them")
                except Exception as exc:  # pragma: no cover - a report line, never a failure
                    print(f"# SMs used: {2 * c.layout.num_channels} blocks (SM count unknown: {exc})")
                bulk = tr.bulk_smem
                print(f"# ring kernel: {k.num_regs} registers/thread, {k.local_size_bytes} B local memory/thread "
                      f"(spills), {tr.threads} threads/block"
                      + (f", bulk copies (cp.async.bulk) through {bulk // 1024} KiB of shared memory" if bulk else ""))
            if not args.control and args.op in ("alltoall", "dispatch"):
                print(f"# energy: NVML energy counter, {meter.scope}; idle {meter.idle_w:.1f} W (sampled over "
                      f"{meter.idle_s} s)" if meter is not None else f"# energy: skipped: {timer.energy_skip}")
            if not args.control and args.op == "alltoall":
                print(f"{'size/rank':>10} {'engine':>12} {'timing':>7} {'time_us':>10} {'algbw_GB/s':>11} "
                      f"{'busbw_GB/s':>11} {'copy_share':>10}" + ("" if args.no_reference else f" {'vs_peer':>8}")
                      + ("" if meter is None else f" {'J/GB':>8} {'idle_W':>7}"))
        if args.op != "alltoall":  # the other operations' benchmarks: one module each, same output path
            if args.op == "hier":
                from ..scaleout.hierarchical import node_size_from_env
                args.node_size = args.node_size or node_size_from_env()
            import importlib
            module = importlib.import_module(f".{_OP_MODULES[args.op]}", __package__)
            sizes = [parse_size(x) for x in args.sizes.split(",")]
            results = module.run(c, comm, timer, args, sizes)
            if args.op == "dispatch":
                from . import low_latency as _low_latency
                results += _low_latency.run(c, comm, timer, args)
                if me == 0 and meter is not None:
                    _print_moe_energy(results)
            if meter is not None:
                meter.close()
            if me == 0 and args.json:
                with open(args.json, "w") as f:
                    json.dump(results, f, indent=1)
            return 0
        if args.control:
            from . import control as _control
            rows = _control.run(c, comm, timer, args)
            if me == 0 and args.json:
                with open(args.json, "w") as f:
                    json.dump([{"row": r, "us": v, "target": t, "world_size": W} for r, v, t in rows], f, indent=1)
            return 0
        timings = ("call", "loop") if args.timing == "both" else (args.timing,)
        sends = set((args.sends or ("sym" if args.mode == "copy_engine" else "plain,out,sym")).split(","))
        if not sends <= {"plain", "out", "sym", "ce"}:
            ap.error(f"--sends: unknown kinds {sorted(sends - {'plain', 'out', 'sym', 'ce'})}")

        def timed(fn, sync=None, engine=None):  # {timing: seconds per call}; with engine: its energy too
            out = {}
            if "call" in timings:
                out["call"] = timer.time(fn, args.iters, args.warmup, comm, sync)
            if "loop" in timings:
                out["loop"] = timer.time_loop(fn, args.iters, args.warmup, comm, sync)
            if engine is not None:
                energies[engine] = _energy.row_fields(timer, fn, sync, W * W * per_peer,
                                                      out.get("loop", out.get("call")), _energy.A2A_BYTES)
            return out
        skipped = {}  # reference rows asked for but not run: name -> why (every row's JSON says so)
        sizes = [parse_size(s) for s in args.sizes.split(",")]
        for size in _progress(sizes, me, "sizes"):
            per_peer = size // W
            host_x = np.random.default_rng([me, size]).integers(0, 255, (W, per_peer), dtype=np.uint8)
            x = xp.asarray(host_x)
            # Correct first: one checked exchange per size against the NumPy reference before any timing.
            probe = c.array(x) if args.mode == "copy_engine" else x  # copy_engine refuses plain arrays >= 16 MiB per peer
            got = c.alltoall(probe)
            got = got.get() if hasattr(got, "get") else got
            if probe is not x:
                c.free(probe)
            expected = np.stack([np.random.default_rng([j, size]).integers(0, 255, (W, per_peer), dtype=np.uint8)[me]
                                 for j in range(W)])
            if not comm.allreduce(bool(np.array_equal(got, expected)), op=MPI.LAND):
                raise RuntimeError(f"bench: alltoall of {_fmt(W * per_peer)} per rank gave wrong data; not timing it")
            rows = {}
            energies = {}
            if "plain" in sends:
                rows["ours"] = timed(lambda: c.alltoall(x), c.synchronize, "ours")
            if "out" in sends:  # plain arrays, the output reused (no fresh pages / pool blocks per call)
                out = xp.empty_like(x)
                rows["ours-out"] = timed(lambda: c.alltoall(x, out=out), c.synchronize, "ours-out")
                del out
            if "sym" in sends:  # symmetric input and output (Communicator.empty): direct mode on the host
                xs, outs = c.array(x), c.empty(x.shape, x.dtype)
                got = c.alltoall(xs, out=outs)
                got = got.get() if hasattr(got, "get") else got
                if not comm.allreduce(bool(np.array_equal(got, expected)), op=MPI.LAND):
                    raise RuntimeError(f"bench: alltoall of symmetric arrays of {_fmt(W * per_peer)} per rank gave "
                                       f"wrong data; not timing it")
                rows["ours-sym"] = timed(lambda: c.alltoall(xs, out=outs), c.synchronize, "ours-sym")
                if args.relaxed:  # selective synchronisation: the next call waits for the peers' copies
                    rows["ours-sym-relaxed"] = timed(lambda: c.alltoall(xs, out=outs, sync="relaxed"),
                                                     c.synchronize, "ours-sym-relaxed")
                c.free(outs)
                c.free(xs)
            if "ce" in sends and c.backend == "cuda":
                run, xs = _ce_pull(c, x, expected, comm)
                rows["ce-pull"] = timed(run, None, "ce-pull")
                c.synchronize()
                c.free(xs)
            if args.profile and not results:
                c.synchronize()
                comm.Barrier()
                t0 = time.perf_counter()
                for _ in range(100):  # host time to issue a call, without the profiler's own overhead
                    c.alltoall(x)
                issue_us = (time.perf_counter() - t0) * 1e4
                c.synchronize()
                comm.Barrier()
                stats = profile_calls(lambda: c.alltoall(x), 100, done=c.synchronize)
                profile_stats = (issue_us, stats) if me == 0 else None
            if args.breakdown and c.backend == "cuda":
                cp = _compat.cupy
                tr = c.engine.transport
                tr.kernel_events = (cp.cuda.Event(), cp.cuda.Event())
                samples = []
                for _ in range(args.iters):
                    comm.Barrier()
                    c.alltoall(x)
                    c.synchronize()
                    samples.append(cp.cuda.get_elapsed_time(*tr.kernel_events) * 1e-3)
                tr.kernel_events = None
                rows["ours-kernel"] = {"call": comm.allreduce(float(np.median(samples)), op=MPI.MAX)}
            if not args.no_reference:
                if c.backend == "cuda":
                    why = _nccl_skip_reason(c)
                    if why is None:
                        run, nc = _nccl_alltoall(comm, per_peer)
                        rows["nccl"] = timed(run, None, "nccl")
                        del nc
                    else:
                        skipped["nccl"] = why
                        if me == 0 and not results:
                            print(f"# nccl: skipped: {why}")
                else:
                    xh = np.asarray(x)
                    yh = np.empty_like(xh)
                    rows["mpi"] = timed(lambda: comm.Alltoall(xh, yh), None, "mpi")
                if "mpi" in refs:  # CUDA-aware MPI on the device arrays (GPU only)
                    why = _mpi_cuda.skip_reason(c, comm)
                    if why is None:
                        rows["mpi-cuda"] = timed(_mpi_cuda.alltoall_fn(comm, x, expected), None, "mpi-cuda")
                    else:
                        skipped["mpi-cuda"] = why
                        if me == 0 and not results:
                            print(f"# mpi-cuda: skipped: {why}")
                if "torch" in refs:
                    why = _torch_setup(comm, c)
                    if why is None:
                        rows["torch"] = timed(_torch_alltoall(x, expected, comm), None, "torch")
                    else:
                        skipped["torch"] = why
                        if me == 0 and not results:
                            print(f"# torch.distributed: skipped: {why}")
            copy_bps = _copy_rate(comm, xp, timer, W * per_peer, args.iters, args.warmup,
                                  energy=lambda fn, t: energies.__setitem__("copy", _energy.row_fields(
                                      timer, fn, None, W * W * per_peer, t, _energy.A2A_BYTES)))
            rows["copy"] = {"loop": W * W * per_peer / copy_bps}  # every rank copying its input at once
            peer = next((p for p in ("nccl", "mpi-cuda", "mpi") if p in rows), None)
            if me == 0 and not results and peer is not None:
                print(f"# vs_peer: {peer}'s time / the row's time (> 1: faster than {peer})")
            for timing in ("call", "loop"):
                for engine, by_timing in rows.items():
                    if timing not in by_timing:
                        continue
                    t = by_timing[timing]
                    algbw = W * per_peer / t / 1e9
                    busbw = (W - 1) * per_peer / t / 1e9
                    share = W * W * per_peer / t / copy_bps  # all ranks' input bytes per second / copy rate
                    vs = rows[peer][timing] / t if peer is not None and timing in rows[peer] else None
                    en = energies.get(engine) or dict(_energy.EMPTY, energy_skipped=(
                        timer.energy_skip if meter is None else "not measured for this row"))
                    results.append({"size_per_rank": W * per_peer, "engine": engine, "timing": timing,
                                    "time_us": t * 1e6, "algbw_GBps": algbw, "busbw_GBps": busbw, "world_size": W,
                                    "backend": c.backend, "copy_share": share, "copy_GBps": copy_bps / 1e9,
                                    "peer": peer, "vs_peer": vs, **en, "skipped": dict(skipped)})
                    if me == 0:
                        extra = ""
                        if not args.no_reference:
                            extra += f" {vs:7.2f}x" if vs is not None else f" {'-':>8}"
                        if meter is not None:
                            j, idle = en["energy_J_per_GB"], en["idle_W"]
                            extra += (f" {j:8.3f}" if j is not None else f" {'-':>8}") + \
                                (f" {idle:7.1f}" if idle is not None else f" {'-':>7}")
                        print(f"{_fmt(W * per_peer):>10} {engine:>12} {timing:>7} {t * 1e6:10.1f} {algbw:11.1f} "
                              f"{busbw:11.1f} {share:10.0%}" + extra)
    if profile_stats is not None:
        issue_us, stats = profile_stats
        print(f"# host time to issue one call of the first size: {issue_us:.1f} us (100 calls, no profiler); "
              f"profile of 100 more (rank 0; us per call, profiler overhead included):")
        print(f"{'self_us':>9} {'total_us':>9} {'calls':>6}  function")
        for self_us, total_us, per_call, where in top_functions(stats, 100, 20):
            print(f"{self_us:9.2f} {total_us:9.2f} {per_call:6.1f}  {where}")
    if meter is not None:
        meter.close()
    if me == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    if me == 0 and args.plot:
        for path in plot_results(results, args.plot):
            print(f"# wrote {path}")
    return 0


def plot_results(results: list, out_dir: str) -> list:
    """PNGs of an alltoall run (the ``results`` rows ``main`` prints): busbw and time per call against the size per
    rank, one line per engine (ours, ours-out, ours-sym, the reference, the copy limit), loop timing where measured.
    Returns the paths (``ImportError`` without matplotlib: ``pip install matplotlib``)."""
    import os

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    os.makedirs(out_dir, exist_ok=True)
    timing = "loop" if any(r["timing"] == "loop" for r in results) else "call"
    rows = [r for r in results if r["timing"] == timing]
    engines = list(dict.fromkeys(r["engine"] for r in rows))
    paths = []
    for key, label, name in (("busbw_GBps", "busbw (GB/s)", "bandwidth.png"), ("time_us", "us per call",
                                                                               "latency.png")):
        fig, ax = plt.subplots(figsize=(6.5, 4))
        for e in engines:
            pts = sorted((r["size_per_rank"], r[key]) for r in rows if r["engine"] == e)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=e)
        ax.set_xscale("log", base=2)
        if key == "time_us":
            ax.set_yscale("log")
        ax.set_xlabel("bytes per rank")
        ax.set_ylabel(label)
        first = rows[0] if rows else {}
        ax.set_title(f"alltoall, {first.get('backend', '?')}, {first.get('world_size', '?')} ranks ({timing} timing)")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = os.path.join(out_dir, name)
        fig.savefig(path, dpi=90)
        plt.close(fig)
        paths.append(path)
    return paths


if __name__ == "__main__":
    raise SystemExit(main())
