"""Config and ChannelLayout unit tests (no communication)."""
import dataclasses

import numpy as np
import pytest

import cupy_symbuf as cs
from cupy_symbuf.wire.channel_layout import ChannelLayout, channel_row_range, LINE_BYTES


@pytest.mark.parametrize("kwargs, word", [
    ({"num_sms": 3}, "even"), ({"num_sms": 0}, "even"), ({"chunk_bytes": 100}, "multiple of 128"),
    ({"num_slots": 1}, ">= 2"), ({"timeout_s": 0}, "positive"), ({"max_notify_ints": 0}, ">= 1"),
])
def test_config_rejects_with_rule(kwargs, word):
    with pytest.raises(ValueError, match=word):
        cs.Config(**kwargs)


def test_config_frozen_and_resolved():
    cfg = cs.Config(num_slots=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.num_slots = 5
    gpu = cfg.resolved("cuda", ranks_per_gpu=1, gpu_sm_count=132)
    assert gpu.num_sms == 24 and gpu.num_channels == 12 and gpu.chunk_bytes == 65536
    shared = cfg.resolved("cuda", ranks_per_gpu=8, gpu_sm_count=132)
    assert shared.num_sms == 16 and shared.num_sms * 8 <= 132
    many = cfg.resolved("cuda", ranks_per_gpu=100, gpu_sm_count=132)
    assert many.num_sms == 2
    host = cfg.resolved("host")
    assert host.num_channels == 2 and host.chunk_bytes == 256 * 1024
    assert gpu.num_slots == host.num_slots == 4  # an explicit num_slots is kept
    auto = cs.Config()
    assert auto.num_slots is None
    # default ring depth: twice the copy warps per (channel, peer) run on the GPU, 16 on the host
    assert [auto.resolved("cuda", world_size=w).num_slots for w in (1, 2, 4, 8, 16, 32)] == [64, 32, 16, 8, 4, 4]
    assert auto.resolved("host", world_size=4).num_slots == 16
    with pytest.raises(ValueError, match="not resolved"):
        cfg.num_channels


@pytest.mark.parametrize("world_size, channels, slots, chunk", [(1, 1, 2, 128), (4, 3, 5, 1024), (8, 12, 8, 65536)])
def test_layout_offsets_disjoint_and_aligned(world_size, channels, slots, chunk):
    L = ChannelLayout(world_size, channels, slots, chunk, max_notify_ints=17)
    spans = []
    for c in range(channels):
        for p in range(world_size):
            for off, size in ((L.tail_offset(c, p), LINE_BYTES), (L.head_offset(c, p), LINE_BYTES),
                              (L.send_tail_offset(c, p), LINE_BYTES), (L.recv_head_offset(c, p), LINE_BYTES),
                              (L.ring_offset(c, p), L.ring_bytes)):
                assert off % LINE_BYTES == 0
                spans.append((off, off + size))
    for parity in (0, 1):
        for s in range(world_size):
            off = L.notify_slot_offset(parity, s)
            assert off % LINE_BYTES == 0
            spans.append((off, off + L.notify_slot_bytes))
    assert L.abort_offset % LINE_BYTES == 0
    spans.append((L.abort_offset, L.abort_offset + LINE_BYTES))
    spans.sort()
    for (a0, a1), (b0, b1) in zip(spans, spans[1:]):
        assert a1 <= b0, "regions overlap"
    assert spans[-1][1] == L.total_bytes
    assert sum(b - a for a, b in spans) == L.total_bytes  # no gaps either
    assert L.slot_offset(0, 0, slots + 1) == L.ring_offset(0, 0) + chunk  # slot = counter % num_slots
    text = L.describe()
    assert "tail" in text and "head" in text and str(L.total_bytes) in text


def test_layout_64bit_offsets():
    L = ChannelLayout(8, 64, 64, 1 << 20)  # > 32 GiB map: offsets must not wrap
    assert L.ring_offset(63, 7) > 2 ** 32
    assert L.total_bytes == 64 * 8 * (512 + 64 * (1 << 20)) + L.notify_bytes + LINE_BYTES  # + the abort line


def test_layout_rejects():
    with pytest.raises(ValueError, match="multiple of 128"):
        ChannelLayout(2, 1, 2, 100)
    with pytest.raises(IndexError):
        ChannelLayout(2, 1, 2, 128).ring_offset(1, 0)


@pytest.mark.parametrize("nbytes", [0, 1, 14, 15, 16, 17, 1000, 7168 * 2 * 3 + 14, 10 ** 9 + 7])
@pytest.mark.parametrize("channels", [1, 3, 12])
def test_channel_split_covers_message(nbytes, channels):
    ranges = [channel_row_range(nbytes, c, channels, 16) for c in range(channels)]  # a byte run's cuts
    assert ranges[0][0] == 0 and ranges[-1][1] == nbytes
    for (lo, hi), (lo2, hi2) in zip(ranges, ranges[1:]):
        assert hi == lo2 and lo <= hi and lo % 16 == 0
    total = sum((hi - lo + 4095) // 4096 for lo, hi in ranges)
    assert total >= (nbytes + 4095) // 4096


def test_config_accepts_numpy_ints_and_rejects_odd_numbers(monkeypatch):
    import numpy as np
    cfg = cs.Config(chunk_bytes=np.int64(256), num_slots=np.int32(4), num_sms=np.int64(8))
    assert (cfg.chunk_bytes, cfg.num_slots, cfg.num_sms) == (256, 4, 8) and type(cfg.chunk_bytes) is int
    for bad in (True, float("inf"), float("nan"), -1.0):
        with pytest.raises(ValueError, match="timeout_s"):
            cs.Config(timeout_s=bad)
    monkeypatch.setenv("CUPY_SYMBUF_TIMEOUT_S", "abc")
    with pytest.raises(ValueError, match="CUPY_SYMBUF_TIMEOUT_S"):
        cs.Config()


def test_warp_groups():
    from cupy_symbuf.transport.cuda import warp_groups
    # (ring warps per peer group, self-group warps); the block is (W - 1) * ring + self warps
    assert warp_groups(1, 512) == (0, 16)             # one rank: only the self copy
    assert warp_groups(2, 512) == (11, 5)             # 10 copy warps on the ring, 5 on the half-size local copy
    assert warp_groups(4, 512) == (4, 4) and warp_groups(8, 1024) == (4, 4)
    assert warp_groups(3, 1024) == (13, 6) and warp_groups(15, 512) == (1, 2)
    assert warp_groups(16) == (1, 1) and warp_groups(32) == (1, 1)   # beyond 15 peers: one warp per group
    for w in range(1, 33):
        for max_threads in (512, 1024):
            if w > max_threads // 32:
                continue
            ring, own = warp_groups(w, max_threads)
            assert (w - 1) * ring + own <= max_threads // 32 and own >= 1 and (ring >= 1 or w == 1)
            assert own >= -(-(ring - 1) // 2)         # the self group keeps up with half a ring group's bytes
    with pytest.raises(ValueError, match="world_size must be <= 32"):
        warp_groups(33)
    with pytest.raises(ValueError, match="world_size must be <= 16"):
        warp_groups(17, 512)


def test_wire_format_depends_only_on_shared_facts():
    """The row-exchange wire format (byte run or packed rows) must be the same on every rank: it depends only on
    the number of parts and on whether rows are gathered, never on a rank's strides."""
    from cupy_symbuf.wire.channel_layout import check_row_fits, is_byte_run, run_units
    assert is_byte_run(1, False)                       # alltoall(v), combine without weights
    assert not is_byte_run(1, True)                    # cached dispatch (gather through the token index)
    assert not is_byte_run(3, True) and not is_byte_run(2, False)   # dispatch, combine with weights
    check_row_fits("dispatch", 65536, 65536, False)    # a row may fill a slot exactly
    check_row_fits("alltoall", 1 << 30, 65536, True)   # byte runs have no row limit
    with pytest.raises(ValueError, match=r"dispatch: one row is 65537 bytes .* Config\.chunk_bytes=65536.*65664"):
        check_row_fits("dispatch", 65537, 65536, False)
    assert run_units(True, 14) == (1, 16)              # bytes, channel cuts 16-byte aligned
    assert run_units(False, 14432) == (14432, 1)       # DeepSeek-V3 dispatch rows, cut on row boundaries


def test_chunk_rows_spreads_short_runs_and_keeps_alignment():
    """Ring chunks (the same formula as the kernel's chunk_rows): at most one slot, at least 4 KiB, byte runs cut
    on 512-byte multiples (16-byte aligned copies), a short run spread over every copy warp, no extra rounds."""
    from cupy_symbuf.wire.channel_layout import chunk_rows
    rng = np.random.default_rng(7)
    for _ in range(2000):
        unit = int(rng.choice([1, 2, 14, 4096, 14432]))
        chunk = int(rng.choice([1024, 4096, 65536, 3 * 128]))
        if unit > chunk:
            continue
        num_copy = int(rng.choice([1, 3, 7, 15]))
        n = int(rng.integers(1, 10 ** int(rng.integers(1, 8)) + 1))
        r = chunk_rows(n, unit, chunk, num_copy)
        max_rows = chunk // unit
        assert 1 <= r <= max_rows
        if unit == 1:
            assert r % 16 == 0 and (r % 512 == 0 or r == max_rows)
        assert r * unit >= min(4096, max_rows * unit) or r == max_rows
        chunks = -(-n // r)
        rounds = -(-n // (num_copy * max_rows))
        assert chunks <= num_copy * rounds  # never more rounds than whole slots need
    # 1 MiB alltoall on 2 ranks, 12 channels: 43690 bytes per channel go to all 7 copy warps, not to one
    assert -(-43690 // chunk_rows(43690, 1, 65536, 7)) == 7
    # 128 MiB: 91 chunks = 13 full rounds of 7 warps (whole 64 KiB slots would give 86: a last round of 2)
    assert -(-5592405 // chunk_rows(5592405, 1, 65536, 7)) == 91
    assert chunk_rows(10 ** 6, 1, 65536, 1) <= 65536 and chunk_rows(5, 14432, 65536, 7) == 1
    assert chunk_rows(0, 1, 65536, 7) == 65536           # an empty run has no chunks (no division by zero)
    assert chunk_rows(4, 14432, 65536, 7) == 1           # 4 packed rows over 4 copy warps, one row each


def test_chunk_rows_same_in_kernel_source():
    """The kernel's chunk_rows (cuda_src/ring_prims.cuh, __host__ __device__, with the generated protocol header
    for CHUNK_GRAIN_BYTES / CHUNK_LEAST_BYTES) compiled by the host C++ compiler gives
    what layout.chunk_rows gives, over a grid of run lengths, row sizes, slot sizes and copy warps: sender
    (GPU) and the Python mirror that documents and tests the formula must not drift apart."""
    import os
    import re
    import shutil
    import subprocess
    import tempfile
    from cupy_symbuf.transport import kernels as _kernels
    from cupy_symbuf.wire import protocol as _protocol
    from cupy_symbuf.wire.channel_layout import chunk_rows
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no host C++ compiler")
    text = (_kernels.cuda_src_dir() / "ring_prims.cuh").read_text()
    body = re.search(r"__host__ __device__ __forceinline__ i64 chunk_rows\(.*?\n}\n", text, re.S).group(0)
    cases = [(n, unit, chunk, nc) for n in (0, 1, 5, 15, 16, 511, 4096, 43690, 733003, 5592405, 44739242)
             for unit in (1, 2, 14, 4096, 14432) for chunk in (1024, 65536) for nc in (1, 3, 7, 10, 15)
             if unit <= chunk]
    src = ("#include <algorithm>\n#include <cstdio>\ntypedef long long i64;\nusing std::min; using std::max;\n"
           "#define __host__\n#define __device__\n#define __forceinline__ inline\n" + _protocol.cuda_header() + body +
           "int main() { i64 n, u, c; int k; while (std::scanf(\"%lld %lld %lld %d\", &n, &u, &c, &k) == 4) "
           "std::printf(\"%lld\\n\", chunk_rows(n, u, c, k)); return 0; }\n")
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "c.cpp"), "w") as f:
            f.write(src)
        subprocess.run([cxx, "-std=c++17", "-O1", "-o", os.path.join(tmp, "c"), os.path.join(tmp, "c.cpp")],
                       check=True, capture_output=True)
        out = subprocess.run([os.path.join(tmp, "c")], input="\n".join(" ".join(map(str, c)) for c in cases),
                             check=True, capture_output=True, text=True).stdout.split()
    assert [int(v) for v in out] == [chunk_rows(*c) for c in cases]
