"""Where one small GPU call's time goes, on the GPU's clock (``.devout`` calls; 2 ranks on one GPU under MPS).

Every kernel launch of the library is preceded on its stream by a one-thread kernel that stores ``%globaltimer``
(``cupy_backends.cuda.api.driver.launchKernel`` wrapped before the package is imported), and a call is bracketed by
two more, so each kernel's start (when its stream reached it) and the call's end are stamped on the clock the
ranks share on one GPU. With ``Config(trace=True)`` the ring kernel adds its per-chunk events (send / recv / self:
t0 before the event's wait, t1 after its copy). Rank 0 prints, for the last of ``REPS`` runs of each call (after a
synchronize and a barrier), every stamp relative to the earliest "begin" of the ranks, and the trace events per
kind (count, first start, last end, median length) and per channel. The stamp kernels add a launch gap each (~1-3
us), so the timeline is the call's structure, not its exact time: the totals without stamps and trace are printed
too (loop of 20 calls, CUDA events, max over ranks).

    mpirun -n 2 -x CUDA_VISIBLE_DEVICES=0 python3 tests/device/call_timeline.py
"""
import ctypes
import os
import sys
from pathlib import Path

import numpy as np
from cupy_backends.cuda.api import driver

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import cupy as cp  # noqa: E402
from mpi4py import MPI  # noqa: E402

world = MPI.COMM_WORLD
me, W = world.Get_rank(), world.Get_size()
REPS = int(os.environ.get("TIMELINE_REPS", "5"))
SLOTS = 1 << 14

_real = driver.launchKernel
_stamp_k = cp.RawKernel(r"""
extern "C" __global__ void symbuf_timeline_stamp(long long* out) {
  long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  *out = t;
}""", "symbuf_timeline_stamp")
stamps = cp.zeros(SLOTS, np.int64)
_stamp_fn = int(_stamp_k.kernel.ptr)
_addrs = (ctypes.c_uint64 * SLOTS)(*[stamps.data.ptr + 8 * i for i in range(SLOTS)])
_params = [(ctypes.c_void_p * 1)(ctypes.addressof(_addrs) + 8 * i) for i in range(SLOTS)]
log = []          # (label, slot)
names = {}        # kernel function pointer -> label
on = [False]


def stamp(stream_ptr: int, label: str) -> None:
    i = len(log) % SLOTS
    _real(_stamp_fn, 1, 1, 1, 1, 1, 1, 0, stream_ptr, ctypes.addressof(_params[i]), 0)
    log.append((label, i))


def _wrapped(fn, gx, gy, gz, bx, by, bz, smem, stream_ptr, params, extra):
    if on[0]:
        stamp(stream_ptr, names.get(fn, f"ring({gx}x{bx})"))
    return _real(fn, gx, gy, gz, bx, by, bz, smem, stream_ptr, params, extra)


driver.launchKernel = _wrapped

import cupy_symbuf as cs  # noqa: E402
from cupy_symbuf.transport import kernels as _kernels  # noqa: E402
from cupy_symbuf.utils import select_device  # noqa: E402

_init = _kernels.Launcher.__init__


def _named_init(self, function, args_struct):
    _init(self, function, args_struct)
    names[self._fn] = args_struct.replace("Args", "")


_kernels.Launcher.__init__ = _named_init
select_device(world)

H, E, K, T = 7168, 256, 8, 128
rng = np.random.default_rng([me, 31])
idx = cp.asarray(np.argsort(rng.random((T, E)), axis=1)[:, :K].astype(np.int64))
x = cp.asarray(rng.standard_normal((T, H)).astype(np.float16))
w = cp.asarray(rng.random((T, K)).astype(np.float32))
a64 = cp.asarray(rng.integers(0, 255, (W, (64 << 10) // W), dtype=np.uint8))


def loop_us(c, fn, n=20) -> float:
    for _ in range(3):
        fn()
    c.synchronize()
    world.Barrier()
    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
    e0.record()
    for _ in range(n):
        fn()
    e1.record()
    e1.synchronize()
    return world.allreduce(cp.cuda.get_elapsed_time(e0, e1) * 1e3 / n, op=MPI.MAX)


def timeline(c, label, fn, traced: bool) -> None:
    """Run ``fn`` REPS times stamped; rank 0 prints the last run's stamps and trace events."""
    tr = getattr(c, "_transport", None)
    rec = getattr(tr, "trace", None) if traced else None
    for _ in range(REPS):
        c.synchronize()
        if rec is not None:
            rec.clear()
        world.Barrier()
        first = len(log)
        on[0] = True
        s = cp.cuda.get_current_stream().ptr
        stamp(s, "begin")
        fn()
        stamp(s, "end")
        on[0] = False
        c.synchronize()
    st = stamps.get()
    mine = [(lab, int(st[i])) for lab, i in log[first:]]
    events = None
    if rec is not None:
        n = min(int(rec.buffer[0].get()), rec.capacity)
        raw = rec.buffer[16:16 + n * 8].get().reshape(n, 8)
        events = raw
    allm = world.gather((mine, events), root=0)
    if me != 0:
        return
    t_ref = min(m[0][1] for m, _ in allm)
    print(f"\n== {label} (2 ranks; us from the earliest begin)", flush=True)
    for r, (m, ev) in enumerate(allm):
        print(f"  rank {r}: " + "  ".join(f"{lab} {(t - t_ref) / 1e3:.1f}" for lab, t in m))
        if ev is None or not len(ev):
            continue
        kind = (ev[:, 3] >> 8) & 0xFF
        ch = (ev[:, 3] >> 16) & 0xFFFF
        t0, t1 = (ev[:, 0] - t_ref) / 1e3, (ev[:, 1] - t_ref) / 1e3
        for k, kn in ((0, "send"), (1, "recv"), (3, "self"), (2, "pull")):
            sel = kind == k
            if sel.any():
                print(f"    {kn}: {int(sel.sum())} events, first start {t0[sel].min():.1f}, last end "
                      f"{t1[sel].max():.1f}, length median {np.median(t1[sel] - t0[sel]):.1f} max "
                      f"{(t1[sel] - t0[sel]).max():.1f}, bytes {int(ev[sel, 4].sum())}")
        for chn in sorted(set(ch.tolist()))[:4]:
            sel = ch == chn
            order = np.argsort(t0[sel])
            items = [f"{ {0: 's', 1: 'r', 2: 'p', 3: 'o'}[int(kk)]}{a:.1f}-{b:.1f}"
                     for kk, a, b in zip(kind[sel][order], t0[sel][order], t1[sel][order])]
            print(f"    ch {chn}: " + " ".join(items))


for traced in (False, True):
    cfg = cs.Config(trace=True) if traced else cs.Config()
    with cs.Communicator(world, cfg) as c:
        rx, _, rw, _, h = c.dispatch(x, idx, w, E)
        c.synchronize()
        cases = [
            ("alltoall 64 KiB", lambda: c.alltoall(a64)),
            ("dispatch with cached handle, 128 tokens", lambda: c.dispatch(x, handle=h)),
            ("combine, 128 tokens (weights)", lambda: c.combine(rx, h, rw)),
            ("dispatch without handle, 128 tokens (eager)", lambda: c.dispatch(x, idx, w, E)),
            ("dispatch, worst-case mode, 128 tokens", lambda: c.dispatch(x, idx, w, E, num_worst_tokens=W * T)),
        ]
        if not traced:
            tot = {lab: loop_us(c, fn) for lab, fn in cases}
            if me == 0:
                print("# loop us per call, no stamps, no trace (max over ranks): " +
                      "; ".join(f"{k} {v:.1f}" for k, v in tot.items()), flush=True)
        for lab, fn in cases:
            timeline(c, lab + (" [trace build]" if traced else ""), fn, traced)
        world.Barrier()

# How the 128-token rows scale with the blocks the ring kernel takes (loop us, no stamps): more channels = more copy
# warps in parallel and fewer rows a channel; if the rows barely move, the copies are not what holds them.
on[0] = False
for sms in (8, 24, 48, 96):
    with cs.Communicator(world, cs.Config(num_sms=sms)) as c:
        rx, _, rw, _, h = c.dispatch(x, idx, w, E)
        c.synchronize()
        d = loop_us(c, lambda: c.dispatch(x, handle=h))
        cb = loop_us(c, lambda: c.combine(rx, h, rw))
        a = loop_us(c, lambda: c.alltoall(a64))
        if me == 0:
            print(f"# num_sms {sms:3d}: cached dispatch 128 {d:6.1f} us, combine 128 {cb:6.1f} us, alltoall 64 KiB "
                  f"{a:6.1f} us (loop)", flush=True)
