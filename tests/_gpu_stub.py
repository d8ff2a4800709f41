"""The GPU path's host code without a GPU: CuPy arrays over unowned (fake) device addresses, kernel launches
recorded instead of made, an :class:`~cupy_symbuf.transport.engine.Engine` over a
:class:`~cupy_symbuf.transport.cuda.CudaTransport` built without a symmetric buffer. For tests of what the host
hands the kernels (launch arguments, descriptor words, records kept per call shape) and for timing the host time per
call on a machine with no GPU (``python tests/_gpu_stub.py``: microseconds per call of the GPU hot paths, the
launches and allocations stubbed, so a device host adds its real ``cuLaunchKernel`` and pool costs).

Nothing here touches device memory: the arrays' addresses are made up and never dereferenced (no kernel runs).
Use :func:`stubbed` as a context manager; it restores CuPy and the package on exit.
"""
from __future__ import annotations

import contextlib
import ctypes
import math
import sys
import timeit
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

cupy = __import__("cupy")


class FakeStream:
    """A CuPy-stream stand-in: ``ptr``, ``is_capturing()`` (counted), ``synchronize()``."""

    def __init__(self, ptr: int = 0, capturing: bool = False):
        self.ptr = ptr
        self.capturing = capturing
        self.capture_queries = 0

    def is_capturing(self) -> bool:
        self.capture_queries += 1
        return self.capturing

    def synchronize(self) -> None:
        pass

    def wait_event(self, event) -> None:
        self.waited = getattr(self, "waited", []) + [event.stream_ptr]


class FakeEvent:
    """A CuPy-event stand-in: remembers the stream it was recorded on."""

    def __init__(self, *args, **kwargs):
        self.stream_ptr = None
        self.done = True

    def record(self, stream=None) -> None:
        self.stream_ptr = None if stream is None else stream.ptr


class Launches:
    """Every stubbed kernel launch: ``(kind, args, grid, block, stream ptr)``; ``kind`` "ring" (args: a copy of the
    descriptor words) or a kernel name (args: a dict of its argument struct's fields). ``use_stream(s)``: the
    stream ``cupy.cuda.get_current_stream()`` returns from then on."""

    def __init__(self):
        self.log = []
        #: False: launches are not logged (timing: a log entry costs more than a real launch's host part)
        self.record = True

    def clear(self):
        self.log.clear()


class _FakeFunction:
    def __init__(self, name: str):
        self.name = name
        self.kernel = type("K", (), {"ptr": 0})()
        self.max_threads_per_block = 1024
        self.shared_size_bytes = 0


@contextlib.contextmanager
def stubbed(stream: FakeStream = None):
    """Patch CuPy and the package so the GPU path's host code runs here; yields ``(launches, stream)``."""
    from cupy_symbuf.transport import kernels as _kernels
    from cupy_symbuf.transport import status as _status
    from cupy_symbuf.wire import kernel_args as _kargs
    stream = stream or FakeStream()
    launches = Launches()
    current = [stream]
    launches.use_stream = lambda s: current.__setitem__(0, s)  # what get_current_stream() returns from now on
    top = [1 << 40]  # the next made-up address: allocations never overlap, 1 MiB aligned, never dereferenced
    saved = []

    def patch(obj, name, value):
        saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    def alloc(nbytes):
        size = max(int(nbytes), 1)
        ptr = top[0]
        top[0] += (size + (1 << 20) - 1) >> 20 << 20
        return cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(ptr, size, None, 0), 0)

    def empty(shape, dtype=float, order="C"):
        n = shape if isinstance(shape, int) else math.prod(shape)
        return cupy.ndarray(shape, dtype, memptr=alloc(n * np.dtype(dtype).itemsize))

    def ascontiguousarray(a, dtype=None):  # the copy's values are not made (no kernel runs)
        if a._c_contiguous and (dtype is None or a.dtype == dtype):
            return a
        return empty(a.shape, a.dtype if dtype is None else dtype)

    def pinned_init(self, count):
        self.nbytes = 8 * count
        self._keep = np.zeros(count, np.int64)
        self.ptr = self._keep.ctypes.data
        self.array = self._keep

    class FakeLauncher(_kernels.Launcher):
        def __init__(self, function, args_struct):
            self.function = function
            self._fn = 0
            self.args = _kargs.host_struct(args_struct)()
            self._ptrs = (ctypes.c_void_p * 1)(ctypes.addressof(self.args))
            self._params = 0
            self.fill = None if args_struct == "RingArgs" else _kargs.filler(args_struct, self.args)
            self.pack = None if args_struct == "RingArgs" else _kargs.packer(args_struct, self.args)
            self._struct = args_struct

        def __call__(self, grid, block, *, shared_mem=0, stream=None):
            if stream is None:
                stream = cupy.cuda.get_current_stream()
            if launches.record:
                    launches.log.append((self.function.name,
                                     {f: getattr(self.args, f) for f in _kargs.fields(self._struct)}, grid, block,
                                     stream.ptr))

    launchers = {}

    def get_launcher(source, name, defines=()):
        fn = launchers.get(name)
        if fn is None:
            fn = launchers[name] = FakeLauncher(_FakeFunction(name), _kargs.KERNELS[name])
        return fn

    patch(cupy.cuda.runtime, "getDevice", lambda: 0)
    patch(cupy.cuda, "get_current_stream", lambda: current[0])
    patch(cupy.cuda, "alloc", alloc)
    patch(cupy.cuda, "Event", FakeEvent)
    patch(cupy, "empty", empty)
    patch(cupy, "ascontiguousarray", ascontiguousarray)
    patch(_status.Pinned, "__init__", pinned_init)
    patch(_status.Pinned, "free", lambda self: None)
    patch(_kernels, "get_launcher", get_launcher)
    patch(_kernels, "new_launcher", lambda source, name, defines=(): FakeLauncher(_FakeFunction(name),
                                                                                  _kargs.KERNELS[name]))
    try:
        yield launches, stream
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)


class _Heap:
    segments = allocations = ()

    def check_live(self, op, name, a):
        pass

    def find(self, a):
        return None


def engine(launches, world_size: int = 2, rank: int = 0, **config):
    """An Engine (backend "cuda") over a CudaTransport made without a buffer; ring launches go to ``launches``."""
    from cupy_symbuf.common.config import Config
    from cupy_symbuf.transport.cuda import CudaTransport
    from cupy_symbuf.transport.engine import Engine
    from cupy_symbuf.transport.status import DeviceStatus
    from cupy_symbuf.wire import protocol as P
    from cupy_symbuf.wire.channel_layout import ChannelLayout
    cfg = Config(**config).resolved("cuda")
    layout = ChannelLayout.from_config(cfg, world_size)
    tr = object.__new__(CudaTransport)
    tr.rank, tr.world_size, tr.layout, tr.timeout_s = rank, world_size, layout, cfg.timeout_s
    tr.timeout_ns, tr.staged = np.uint64(int(cfg.timeout_s * 1e9)), False
    tr.status = DeviceStatus(rank, cfg.timeout_s, lambda: np.zeros(P.HDR_WORDS, np.int64))
    tr._desc = np.zeros(P.DESC_WORDS, np.int64)
    tr._desc[P.DESC_RANK], tr._desc[P.DESC_WORLD_SIZE] = rank, world_size
    tr._arg_ptrs = (ctypes.c_void_p * 1)(tr._desc.ctypes.data)
    tr._home = None
    tr.blocking = False
    tr._launch_stream = None
    tr.kernel_events = None
    tr.copy_engine = False
    tr.graph_keep = []
    tr.direct_calls = tr.push_calls = tr.ce_calls = 0
    tr.trace = tr.load = None
    tr._init_small(0)  # Config.small_bytes: the small-message alltoall's launcher (stubbed) and descriptor words

    from cupy_symbuf.transport import kernels as _kernels
    from cupy_symbuf.transport.status import Pinned
    tr._l_notify = _kernels.get_launcher("ring_exchange.cu", "symbuf_notify")
    tr._l_notify.args.rank, tr._l_notify.args.world_size = rank, world_size  # (static fields, as CudaTransport's)
    tr._meta_in = Pinned(world_size * layout.max_notify_ints)
    tr._ticket = 0
    tr.layout_error = Pinned(2)
    tr._notify_done = Pinned(1)

    def notify_result(op, M):  # every rank's header as this one's, and these values as every rank's
        a = tr._l_notify.args  # (the fused layout + count exchange's, when it was the last one waited for)
        if tr._l_moe_notify is not None and tr._l_moe_notify.args.ticket == tr._ticket:
            a = tr._l_moe_notify.args
        out = np.zeros((world_size, P.NOTIFY_HDR_WORDS - 1 + M), np.int64)
        out[:, 0], out[:, 1], out[:, 2] = a.op, a.call_status, a.sig
        out[:, 3:] = tr._meta_in.array[: world_size * M].reshape(world_size, M)
        out[:, 3] = notify_rows
        return out

    notify_rows = 32
    tr.notify_result = notify_result

    def launch(stream_ptr):
        if launches.record:
            launches.log.append(("ring", ctypes.cast(tr._arg_ptrs[0], ctypes.POINTER(ctypes.c_int64 * P.DESC_WORDS))
                                 .contents[:], 1, 1, stream_ptr))
    tr._launch = launch
    state = {"broken": None}
    eng = Engine(tr, layout, cfg, rank=rank, world_size=world_size, backend="cuda", heap=_Heap(),
                 check_open=lambda: None, failure=lambda: state["broken"],
                 on_broken=lambda msg: state.__setitem__("broken", msg))
    return eng


def communicator(eng):
    """A :class:`~cupy_symbuf.Communicator` over ``eng`` (made without ``__init__``: its guard and engine only), for
    timing the public methods' wrapper (the guard's entry with the GPU made current, the keyword handling) as the
    device's benchmark calls them."""
    from cupy_symbuf.communicator import Communicator
    from cupy_symbuf.transport import guard as _guard
    c = object.__new__(type("StubCommunicator", (Communicator,), {"__del__": lambda self: None}))
    c.__dict__["_engine_obj"] = eng
    c._guard = eng.guard  # (one guard, as Communicator.engine makes it: the engine's entries are nested ones)
    eng.guard.device = 0  # GPU 0 made current by every outermost entry (use_device: the stub's getDevice)
    _guard._THREAD.ready = True  # (this thread's context is bound: use_device asks the driver nothing here)
    return c


def handle(eng, num_tokens: int = 128, hidden: int = 7168, num_topk: int = 8, num_experts: int = 256,
           send_rows=None, recv_rows=None, dispatch_id: int = 1, worst: int = 0):
    """A GPU DispatchHandle of ``eng`` with device routing (its arrays at fake addresses)."""
    from cupy_symbuf.moe import gpu as _gpu
    from cupy_symbuf.moe.normal_handle import DispatchHandle, make_ref
    W = eng.world_size
    epr = num_experts // W
    rt = _gpu.Routing(num_tokens, num_topk, W, 1 + epr)
    send_rows = num_tokens * min(W, num_topk) // 2 if send_rows is None else send_rows
    recv_rows = send_rows if recv_rows is None else recv_rows
    counts = np.full(W, send_rows // W, np.int64)
    counts[0] += send_rows - counts.sum()
    rcounts = np.full(W, recv_rows // W, np.int64)
    rcounts[0] += recv_rows - rcounts.sum()
    for a in (counts, rcounts):
        a.setflags(write=False)
    return DispatchHandle(_comm_ref=make_ref(eng), rank=eng.rank, world_size=W, backend="cuda",
                          num_experts=num_experts, num_tokens=num_tokens, num_topk=num_topk, hidden=hidden,
                          is_token_in_rank=rt.in_rank, send_token_idx=rt.send_idx[:send_rows], send_counts=counts,
                          recv_counts=None if worst else rcounts,
                          num_recv_tokens_per_expert_raw=None if worst else tuple(range(epr)),
                          expert_alignment=1, num_worst_tokens=worst, routing=rt, send_rows=send_rows,
                          dispatch_id=dispatch_id)


def _time(fn, n: int = 2000, repeat: int = 5) -> float:
    """Best of ``repeat`` means of ``n`` calls, in us."""
    return min(timeit.repeat(fn, number=n, repeat=repeat)) / n * 1e6


def main() -> None:
    from cupy_symbuf.collectives.alltoall import alltoall
    from cupy_symbuf.moe import normal
    with stubbed() as (launches, stream):
        eng = engine(launches)
        h = handle(eng)
        dt = getattr(cupy, "bfloat16", np.float16)
        x = cupy.empty((h.num_recv_tokens, h.hidden), dt)
        w = cupy.empty((h.num_recv_tokens, h.num_topk), np.float32)
        xs = cupy.empty((h.num_tokens, h.hidden), dt)
        a64 = cupy.empty((2, 32 << 10), np.uint8)
        idx = cupy.empty((h.num_tokens, h.num_topk), np.int64)
        ws = cupy.empty((h.num_tokens, h.num_topk), np.float32)
        idx4k = cupy.empty((4096, h.num_topk), np.int64)
        rows = [("alltoall 64 KiB", lambda: alltoall(eng, a64)),
                ("get_dispatch_layout, 4096 tokens", lambda: normal.get_dispatch_layout(eng, idx4k, h.num_experts)),
                ("eager dispatch, 128 tokens (no wait)", lambda: normal.dispatch(eng, xs, idx, ws, h.num_experts)),
                ("cached dispatch, 128 tokens", lambda: normal.dispatch(eng, xs, handle=h)),
                ("combine with weights, 128 tokens", lambda: normal.combine(eng, x, h, w)),
                ("combine without weights, 128 tokens", lambda: normal.combine(eng, x, h))]
        c = []  # the Communicator, made once the engine's rows ran (its guard then makes GPU 0 current)
        rows += [("Communicator.alltoall 64 KiB", lambda: c[0].alltoall(a64)),
                 ("Communicator.dispatch, cached, 128 tokens", lambda: c[0].dispatch(xs, handle=h)),
                 ("Communicator.combine with weights, 128", lambda: c[0].combine(x, h, w))]
        print("# host us per call, launches and allocations stubbed (this machine; best of 5 x 2000 calls)")
        for name, fn in rows:
            if name.startswith("Communicator.") and not c:
                c.append(communicator(eng))
            fn()
            launches.clear()
            stream.capture_queries = 0
            fn()
            per = (len(launches.log), stream.capture_queries)
            launches.record = False
            us = _time(fn)
            launches.record = True
            launches.clear()
            print(f"{name:40s} {us:7.2f} us   launches {per[0]}, cudaStreamIsCapturing {per[1]}")


if __name__ == "__main__":
    main()
