"""Run DeepEP's own test (``tests/test_intranode.py`` or ``tests/test_low_latency.py`` of deepseek-ai/DeepEP, in
``.external/DeepEP``, see README.md) unmodified over cupy_symbuf's DeepEP shim, one process per rank under mpirun.

    mpirun -n 4 -x CUDA_VISIBLE_DEVICES=0 python3 tests/external/run_deepep.py intranode [--num-tokens 4096 ...]
    mpirun -n 4 -x CUDA_VISIBLE_DEVICES=0 python3 tests/external/run_deepep.py low_latency

Only the launch and the group set-up are replaced; everything else is DeepEP's code:

* launch: mpirun starts the ranks (DeepEP: ``torch.multiprocessing.spawn``); this script calls the test's own
  ``test_loop(local_rank=rank, num_local_ranks=world_size, args)`` with DeepEP's default arguments (overridable
  with the same options as their ``__main__``).
* ``utils.init_dist`` (DeepEP's group set-up, NCCL, one GPU per rank) becomes: a gloo process group over every
  rank (``MASTER_ADDR`` / ``MASTER_PORT``, default 127.0.0.1:29531), every rank on CUDA device 0 (several ranks
  share one GPU under MPS; NCCL refuses two ranks on one device), then DeepEP's own defaults
  (``torch.set_default_dtype(torch.bfloat16)``, ``torch.set_default_device('cuda')``).
* gloo's ``all_gather_into_tensor`` refuses a stacked ``[world_size, ...]`` output (NCCL takes it): it is given
  the flat view of the same memory (``[world_size * n, ...]``), which is the same result.
* ``utils.bench_kineto`` (kernel profiling by DeepEP's kernel names): with ``num_kernels_per_period > 1`` (their
  send/receive split, matched as ``::dispatch`` / ``::combine`` in the trace) skipped with the reason printed: our
  low-latency kernels are single launches with C names; otherwise their function runs, and when the names are not
  found once each in the profile it is skipped with the reason printed. Skips return NaN durations, which their
  print lines show.
* ``deep_ep`` resolves to ``tests/external/deep_ep`` (cupy_symbuf.deepep).

Prints ``[adapter] ...`` lines, DeepEP's own output, and at the end ``[adapter] rank R: <test> PASSED`` or the
traceback of the first failure and ``[adapter] rank R: <test> FAILED`` (exit status 1).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
DEEPEP = os.environ.get("DEEPEP_DIR", os.path.join(ROOT, ".external", "DeepEP"))


def _rank_world():
    for r, w in (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), ("PMI_RANK", "PMI_SIZE"), ("RANK", "WORLD_SIZE")):
        if r in os.environ:
            return int(os.environ[r]), int(os.environ[w])
    return 0, 1


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("test", choices=("intranode", "low_latency"))
    # DeepEP's own options and defaults (their __main__)
    p.add_argument("--num-tokens", type=int)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--num-topk", type=int, default=8)
    p.add_argument("--num-experts", type=int)
    p.add_argument("--allow-mnnvl", action="store_true")
    p.add_argument("--disable-nvlink", action="store_true")
    p.add_argument("--use-logfmt", action="store_true")
    p.add_argument("--pressure-test", action="store_true")
    p.add_argument("--shrink-test", action="store_true")
    a = p.parse_args(argv)
    if a.num_tokens is None:
        a.num_tokens = 4096 if a.test == "intranode" else 128
    if a.num_experts is None:
        a.num_experts = 256 if a.test == "intranode" else 288
    return a


def main(argv=None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    rank, world = _rank_world()
    tests_dir = os.path.join(DEEPEP, "tests")
    if not os.path.isfile(os.path.join(tests_dir, f"test_{args.test}.py")):
        print(f"[adapter] DeepEP's tests are not in {tests_dir}: fetch them (tests/external/README.md)", flush=True)
        return 2
    sys.path[:0] = [HERE, tests_dir]  # deep_ep = the shim; utils / test_* = DeepEP's
    import torch
    import torch.distributed as dist
    import utils  # DeepEP's tests/utils.py

    def init_dist(local_rank: int, num_local_ranks: int):
        """DeepEP's init_dist with a gloo group over the mpirun ranks, every rank on CUDA device 0."""
        addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
        port = int(os.environ.get("MASTER_PORT", "29531"))
        dist.init_process_group(backend="gloo", init_method=f"tcp://{addr}:{port}", world_size=world, rank=rank)
        torch.set_default_dtype(torch.bfloat16)
        torch.set_default_device("cuda")
        torch.cuda.set_device(0)
        return dist.get_rank(), dist.get_world_size(), dist.new_group(list(range(world)))

    gather_into = dist.all_gather_into_tensor

    def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
        if output_tensor.dim() == input_tensor.dim() + 1 and output_tensor.is_contiguous():
            output_tensor = output_tensor.view(-1, *input_tensor.shape[1:]) if input_tensor.dim() else \
                output_tensor.view(-1)
        return gather_into(output_tensor, input_tensor, group=group, async_op=async_op)

    bench_kineto = utils.bench_kineto

    def bench_kineto_or_skip(fn, kernel_names, num_tests: int = 30, suppress_kineto_output: bool = False,
                             trace_path=None, barrier_comm_profiling: bool = False, num_kernels_per_period: int = 1):
        names = (kernel_names,) if isinstance(kernel_names, str) else kernel_names
        nan = [math.nan] * num_kernels_per_period if num_kernels_per_period > 1 else math.nan
        skipped = tuple(nan for _ in names) if isinstance(kernel_names, tuple) else nan
        if num_kernels_per_period > 1:
            reason = (f"DeepEP's send/receive-split profile ({num_kernels_per_period} kernels per period, trace names "
                      f"'::{names[0]}') does not apply: cupy_symbuf's low-latency kernels are one launch each with C "
                      f"names (symbuf_ll_dispatch / symbuf_ll_combine)")
        else:
            try:
                return bench_kineto(fn, kernel_names, num_tests=num_tests,
                                    suppress_kineto_output=suppress_kineto_output, trace_path=trace_path,
                                    barrier_comm_profiling=barrier_comm_profiling,
                                    num_kernels_per_period=num_kernels_per_period)
            except Exception as exc:  # their profile-table parsing: names not found once each
                reason = f"the kernel profile by DeepEP's names {names} failed here: {type(exc).__name__}: {exc}"
        print(f"[adapter] rank {rank}: kernel-profile section skipped: {reason}", flush=True)
        return skipped

    utils.init_dist = init_dist
    utils.bench_kineto = bench_kineto_or_skip
    dist.all_gather_into_tensor = all_gather_into_tensor
    if rank == 0:
        commit = open(os.path.join(DEEPEP, "COMMIT")).read().strip() if os.path.exists(
            os.path.join(DEEPEP, "COMMIT")) else "unknown"
        import deep_ep
        print(f"[adapter] DeepEP {commit} tests/test_{args.test}.py, {world} ranks on GPU 0, gloo group; deep_ep = "
              f"{deep_ep.Buffer.__module__}; args {vars(args)}", flush=True)
    name = f"test_{args.test}"
    try:
        mod = __import__(name)
        mod.test_loop(rank, world, args)
    except BaseException:
        print(f"[adapter] rank {rank}: {name} FAILED\n{traceback.format_exc()}", flush=True)
        sys.stdout.flush()
        os._exit(1)  # the peers may be blocked in a collective: mpirun ends the job on a non-zero exit
    print(f"[adapter] rank {rank}: {name} PASSED", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
