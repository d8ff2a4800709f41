"""The words an exit-time close reads to tell a peer waiting for this rank (a call it never joined) from a peer
merely behind (``HostTransport.peers_waiting``, ``CudaTransport.peers_waiting``; see ``transport/lifecycle.py``).
One process, no GPU: a rank's buffer is a NumPy image laid out by ``ChannelLayout``, written as the peers' first
words of a call land there (``wire/protocol.py``, ``cuda_src``); the GPU reader's copies are replaced by host
copies of the same addresses."""
import ctypes
import types

import numpy as np
import pytest

from cupy_symbuf.transport import cuda as _cuda
from cupy_symbuf.transport.host import HostTransport
from cupy_symbuf.wire import protocol as P
from cupy_symbuf.wire.channel_layout import ChannelLayout

W, ME = 3, 1
PEERS = [0, 2]


def _layout(small: bool) -> ChannelLayout:
    return ChannelLayout(world_size=W, num_channels=2, num_slots=4, chunk_bytes=4096, max_notify_ints=8,
                         small_bytes=96 * W if small else 0)


class _Image:
    """Rank ``ME``'s buffer after its last call: ``calls`` calls on every pair (the last at counter ``counter``), its
    last count exchange of epoch ``epoch``; every peer's words as that call left them."""

    def __init__(self, layout, *, counter=9, calls=7, epoch=4):
        self.L, self.counter, self.calls, self.epoch = layout, counter, calls, epoch
        self.mem = np.zeros(layout.total_bytes, np.uint8)
        for p in PEERS:
            for c in range(layout.num_channels):
                self.word(layout.tail_offset(c, p), counter)
                self.word(layout.recv_head_offset(c, p), counter)
                self.word(layout.recv_head_offset(c, p) + 8 * P.STATE_SEQ, calls)
            self.word(layout.notify_slot_offset(epoch % 2, p), epoch)
            self.word(layout.notify_slot_offset((epoch - 1) % 2, p), epoch - 1)

    def word(self, offset: int, value: int) -> None:
        self.mem[offset: offset + 8].view(np.int64)[0] = value

    def new_ring_call(self, p: int) -> None:  # the peer's channel-0 call header of the next call
        self.word(self.L.tail_offset(0, p), self.counter + 1)

    def new_count_exchange(self, p: int) -> None:  # the peer's notify slot of the next epoch
        self.word(self.L.notify_slot_offset((self.epoch + 1) % 2, p), self.epoch + 1)

    def small_header(self, p: int, seq: int) -> None:  # the peer's small-protocol header of call seq
        off = self.L.small_slot_offset(seq & 1, p) + 8 * P.SMALL_H_OP
        self.word(off, (P.small_flag(seq) << 32) | P.OPS["alltoall"])


def _host(img: _Image) -> HostTransport:
    tr = HostTransport.__new__(HostTransport)
    tr.layout, tr.rank, tr.world_size = img.L, ME, W
    tr.views = [img.mem if r == ME else None for r in range(W)]
    tr._epoch, tr._form_cache, tr._rings = img.epoch, {}, {}
    return tr


class _FakeCupy:
    """What ``CudaTransport.peers_waiting`` uses of CuPy, with host copies (every address is host memory here)."""

    def __init__(self):
        rt = types.SimpleNamespace(memcpyAsync=lambda dst, src, n, kind, stream: ctypes.memmove(dst, src, n))

        class _Device:
            def __init__(self, _):
                pass

            def __enter__(self):
                return self

            def __exit__(self, *a):
                return False

        self.cuda = types.SimpleNamespace(runtime=rt, Device=_Device)


def _gpu(img: _Image, monkeypatch, *, busy=False) -> "_cuda.CudaTransport":
    tr = _cuda.CudaTransport.__new__(_cuda.CudaTransport)
    tr.layout, tr.rank, tr.world_size = img.L, ME, W
    tr.buf = types.SimpleNamespace(peer_ptrs=[0, img.mem.ctypes.data, 0], device_id=0)
    epoch = np.array([img.epoch], np.int64)
    tr._keep = epoch
    tr._epoch = types.SimpleNamespace(data=types.SimpleNamespace(ptr=epoch.ctypes.data))
    tr.small_peer_bytes = img.L.small_peer_bytes
    tr._launch_stream = types.SimpleNamespace(done=not busy)
    tr._side = types.SimpleNamespace(ptr=0, synchronize=lambda: None)
    monkeypatch.setattr(_cuda._compat, "cupy", _FakeCupy())
    monkeypatch.setattr(_cuda._kernels, "small_flag_mod", lambda: P.SMALL_FLAG_MOD)
    return tr


@pytest.mark.parametrize("engine", ["host", "cuda"])
def test_a_peer_behind_or_done_is_not_waiting(engine, monkeypatch):
    """After this rank's last call: peers whose words are those of that call (done, or still finishing it: their
    slots and tails are never ahead of what this rank consumed), or older ones, are not named."""
    img = _Image(_layout(small=engine == "cuda"))
    tr = _host(img) if engine == "host" else _gpu(img, monkeypatch)
    assert tr.peers_waiting() == []
    img.word(img.L.notify_slot_offset(img.epoch % 2, 2), img.epoch - 2)  # rank 2 behind in the count exchanges
    img.word(img.L.tail_offset(1, 0), img.counter + 3)  # a channel other than 0 says nothing of a new call
    if engine == "cuda":
        img.small_header(0, img.calls - 1)  # rank 0's small header of an earlier call of that half
    assert tr.peers_waiting() == []


@pytest.mark.parametrize("engine", ["host", "cuda"])
@pytest.mark.parametrize("how", ["ring", "counts", "small"])
def test_a_peer_in_a_call_this_rank_never_joined_is_waiting(engine, how, monkeypatch):
    """A peer's first words of the next call in this rank's buffer (channel-0 call header, notify slot of the next
    epoch, on the GPU the small-protocol header of the next call seq) name that peer, and only it."""
    if how == "small" and engine == "host":
        pytest.skip("the small protocol is the GPU's")
    img = _Image(_layout(small=engine == "cuda"))
    tr = _host(img) if engine == "host" else _gpu(img, monkeypatch)
    {"ring": img.new_ring_call, "counts": img.new_count_exchange,
     "small": lambda p: img.small_header(p, img.calls + 1)}[how](2)
    assert tr.peers_waiting() == [2]


def test_gpu_names_nobody_while_a_kernel_is_queued(monkeypatch):
    """A launch of this rank still under way: its call may not have consumed what the peers sent yet."""
    img = _Image(_layout(small=True))
    img.new_ring_call(0)
    assert _gpu(img, monkeypatch, busy=True).peers_waiting() == []
    assert _gpu(img, monkeypatch).peers_waiting() == [0]
