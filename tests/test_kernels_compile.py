"""Every kernel in cuda_src/ compiles with NVRTC for sm_90 (compute_90 PTX) with no GPU, without warnings, in every
variant; the protocol constants come only from the generated header (cupy_symbuf.wire.protocol); build_id follows
what is compiled."""
import os
import re

import pytest

from cupy_symbuf.transport import kernels as _kernels

from cupy_symbuf.wire import protocol as _protocol

REQUIRED = os.environ.get("CUPY_SYMBUF_REQUIRE_NVRTC") == "1"
RING = "ring_exchange.cu"
VARIANTS = [(), ("-DSYMBUF_MAX_THREADS=512",), ("-DSYMBUF_MAX_THREADS=1024",), ("-DSYMBUF_DEBUG=1",),
            ("-DSYMBUF_MAX_THREADS=512", "-DSYMBUF_DEBUG=1"), ("-DSYMBUF_BULK=1", "-DSYMBUF_MAX_THREADS=512"),
            ("-DSYMBUF_BULK=1", "-DSYMBUF_MAX_THREADS=1024"), ("-DSYMBUF_TRACE=1", "-DSYMBUF_MAX_THREADS=512"),
            ("-DSYMBUF_TRACE=1", "-DSYMBUF_MAX_THREADS=1024"), ("-DSYMBUF_ADAPTIVE=1", "-DSYMBUF_MAX_THREADS=512"),
            ("-DSYMBUF_ADAPTIVE=1", "-DSYMBUF_MAX_THREADS=1024"),
            ("-DSYMBUF_ADAPTIVE=1", "-DSYMBUF_TRACE=1", "-DSYMBUF_DEBUG=1", "-DSYMBUF_MAX_THREADS=1024"),
            ("-DSYMBUF_ADAPTIVE=1", "-DSYMBUF_TRACE=1", "-DSYMBUF_MAX_THREADS=512"),
            ("-DSYMBUF_UNROLL=4", "-DSYMBUF_PUBLISH_BATCH=4", "-DSYMBUF_MAX_THREADS=512"),
            ("-DSYMBUF_HEADER_FOLD=0", "-DSYMBUF_MAX_THREADS=512"),
            ("-DSYMBUF_HEADER_FOLD=0", "-DSYMBUF_ADAPTIVE=1", "-DSYMBUF_MAX_THREADS=1024")]
VARIANT_IDS = ["default", "512-threads", "1024-threads", "debug", "512-threads-debug", "bulk-512", "bulk-1024",
               "trace-512", "trace-1024", "adaptive-512", "adaptive-1024", "adaptive-trace-debug-1024",
               "adaptive-trace-512", "unroll4-batch4-512", "no-header-fold-512", "no-header-fold-adaptive-1024"]


def _nvrtc_or_skip():
    try:
        import cupy  # noqa: F401
        from cupy_backends.cuda.libs import nvrtc
        nvrtc.getVersion()
    except Exception as exc:  # pragma: no cover
        if REQUIRED:
            raise
        pytest.skip(f"NVRTC not available: {exc}")


def _generated_names() -> set:
    return set(re.findall(r"constexpr [\w ]+? (\w+) = ", _protocol.cuda_header()))


def _cuda_files():
    return sorted(p for p in _kernels.cuda_src_dir().iterdir() if p.suffix in (".cu", ".cuh"))


def _code(text: str) -> str:
    """Source without comments."""
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


@pytest.mark.parametrize("defines", VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("source", _kernels.list_sources())
def test_compiles_for_sm90(source, defines):
    _nvrtc_or_skip()
    ptx, log = _kernels.compile_ptx(source, "compute_90", defines=defines, return_log=True)
    assert ".target sm_90" in ptx
    entries = re.findall(r"\.entry (\w+)", ptx)
    assert entries, f"no kernels in {source}"
    assert "warning" not in log.lower(), log


@pytest.mark.parametrize("defines", [(), ("-DSYMBUF_BULK=1",)], ids=["default", "bulk"])
@pytest.mark.parametrize("source", _kernels.list_sources())
def test_compiles_for_sm80(source, defines):
    """A100 (sm_80) has no cp.async.bulk: every kernel compiles there, the bulk variant to the register copy."""
    _nvrtc_or_skip()
    ptx, log = _kernels.compile_ptx(source, "compute_80", defines=defines, return_log=True)
    assert ".target sm_80" in ptx and re.findall(r"\.entry (\w+)", ptx)
    assert "cp.async.bulk" not in ptx and "mbarrier" not in ptx
    assert "warning" not in log.lower(), log


def test_bulk_copies_only_in_the_ring_kernel_on_sm90():
    """SYMBUF_BULK=1 on sm_90: the ring kernel's copy warps get the TMA path (bulk loads completing on an mbarrier,
    bulk stores in groups, proxy fences); the default build and the other sources have none."""
    _nvrtc_or_skip()
    bulk = _kernels.compile_ptx(RING, "compute_90", defines=("-DSYMBUF_BULK=1",))
    for needle in ("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes",
                   "cp.async.bulk.global.shared::cta.bulk_group", "cp.async.bulk.commit_group",
                   "cp.async.bulk.wait_group", "mbarrier.try_wait.parity", "fence.proxy.async", "%dynamic_smem_size"):
        assert needle in bulk, needle
    assert "cp.async.bulk" not in _kernels.compile_ptx(RING, "compute_90")
    for other in [s for s in _kernels.list_sources() if s != RING]:
        assert "cp.async.bulk" not in _kernels.compile_ptx(other, "compute_90", defines=("-DSYMBUF_BULK=1",))


def test_adaptive_build_shares_work():
    """SYMBUF_ADAPTIVE=1: chunks are claimed from shared-memory counters (32-bit atomic adds) and handed over
    with cta-scope release/acquire marks; the default build has neither the claims nor the share loop."""
    _nvrtc_or_skip()
    adaptive = _kernels.compile_ptx(RING, "compute_90", defines=("-DSYMBUF_ADAPTIVE=1",))
    plain = _kernels.compile_ptx(RING, "compute_90")
    claim = r"atom(\.shared)?\.add\.u32"  # the claim counters (generic addressing through the share context)
    assert re.search(claim, adaptive) and not re.search(claim, plain)
    assert "share_chunks" in adaptive and "share_chunks" not in plain


@pytest.mark.parametrize("defines", [(), ("-DSYMBUF_DEBUG=1",), ("-DSYMBUF_ADAPTIVE=1",)],
                         ids=["default", "debug", "adaptive"])
def test_ring_protocol_uses_release_acquire(defines):
    _nvrtc_or_skip()
    ptx = _kernels.compile_ptx(RING, "compute_90", defines=defines)
    assert "st.release.sys.global.u64" in ptx  # tail / head, call header announce, abort flag, error record flag
    assert "ld.acquire.sys.global.u64" in ptx  # counters and the abort flag
    assert "st.release.cta.u64" in ptx and "ld.acquire.cta.u64" in ptx  # copy warps <-> publisher hand-off
    assert "%globaltimer" in ptx  # every wait is bounded
    assert "atom.global.cas.b64" in ptx or "atom.cas.b64" in ptx  # error record claim, rejection record


def _entry_params(ptx: str, name: str) -> int:
    m = re.search(r"\.entry %s\((.*?)\)" % name, ptx, re.S)
    assert m, name
    return len(re.findall(r"\.param\b", m.group(1)))


def test_kernel_argument_lists():
    """The argument lists transport/cuda.py launches with: the ring kernel (desc by value, peer bases, error record) and the
    notify kernel (send_meta, recv_meta, num_values, epoch word, op, call_status, sig, peer_bases, rank,
    world_size, 6 layout scalars, abort_offset, timeout_ns, status, seq, local_reject, send_echo, sums, table,
    scale, capacity, device_checks, done, ticket); the MoE layout (13) and receive fix-up (10) kernels of moe.cu."""
    _nvrtc_or_skip()
    ptx = _kernels.compile_ptx(RING, "compute_90")
    assert _entry_params(ptx, "symbuf_ring_exchange") == 3
    assert re.search(r"\.entry symbuf_ring_exchange\(\s*\.param \.align 8 \.b8 \w+\[%d\]" % (8 * _protocol.DESC_WORDS),
                     ptx), "the descriptor is DESC_WORDS int64 passed by value"
    assert _entry_params(ptx, "symbuf_notify") == 29
    moe = _kernels.compile_ptx("moe.cu", "compute_90")
    assert _entry_params(moe, "symbuf_moe_layout") == 13
    assert _entry_params(moe, "symbuf_moe_recv_fixup") == 10
    assert "symbuf_alltoallv" not in ptx


def test_sources_found():
    names = {p.name for p in _cuda_files()}
    assert RING in _kernels.list_sources()
    assert "alltoall.cu" not in names
    assert {"primitives.cuh", "layout.cuh", "protocol.cuh", "ring_prims.cuh"} <= names


def test_descriptor_fits_parameter_space():
    assert 8 * _protocol.DESC_WORDS <= 4096 - 16  # the descriptor and the two pointers, by value
    assert _protocol.DESC_SEND_PARTS > _protocol.DESC_ABORT_OFFSET


def test_no_hand_copied_protocol_constants():
    """cuda_src defines no protocol constant itself: the old hand copies are gone and none of the generated names
    is (re)defined, and every protocol-looking name the sources use is one the generator emits."""
    generated = _generated_names()
    assert {"DESC_RANK", "DESC_WORDS", "HDR_MAGIC_VALUE", "TAIL_OFFSET", "STATE_SEQ", "FLAG_REJECT", "MAX_PEERS",
            "CHUNK_GRAIN_BYTES", "OP_ALLTOALL"} <= generated
    used = set()
    for path in _cuda_files():
        code = _code(path.read_text())
        for old in ("SYMBUF_LINE", "SYMBUF_TAIL_OFFSET", "SYMBUF_HEAD_OFFSET", "SYMBUF_SEND_TAIL_OFFSET",
                    "SYMBUF_RECV_HEAD_OFFSET", "SYMBUF_RING_OFFSET", "SYMBUF_MAX_PARTS", "SYMBUF_MAX_PEERS",
                    "SYMBUF_ROLE_"):
            assert old not in code, f"{path.name}: hand copy {old}"
        assert not re.search(r"\bDESC_\w+\s*=[^=]", code), f"{path.name}: DESC_* defined by hand"
        for name in generated:
            assert not re.search(r"#define\s+%s\b" % name, code), f"{path.name}: #define {name}"
            assert not re.search(r"\b(?:enum\b[^;]*?|constexpr\b[^;=]*?|,\s*)\b%s\s*=[^=]" % name, code), \
                f"{path.name}: defines {name}"
        used |= set(re.findall(r"(?<![\w])((?:DESC|HDR|STATUS|ABORT|ERR|FIELD|ROLE|OP|STATE|NOTIFY|FLAG|CHUNK|MAX)"
                               r"_[A-Z0-9_]+|(?:TAIL|HEAD|SEND_STATE|RECV_STATE|RING)_OFFSET|LINE_BYTES)\b", code))
    missing = sorted(used - generated)
    assert not missing, f"cuda_src uses protocol names the generator does not emit: {missing}"
    prims = _code((_kernels.cuda_src_dir() / "ring_prims.cuh").read_text())
    body = re.search(r"i64 chunk_rows\(.*?\n}\n", prims, re.S).group(0)
    assert "512" not in body and "4096" not in body


def test_source_text_is_header_then_file():
    text = _kernels.source_text(RING)
    assert _protocol.cuda_header() in text
    assert text.endswith((_kernels.cuda_src_dir() / RING).read_text())


def test_build_id_follows_what_is_compiled(tmp_path, monkeypatch):
    base = _kernels.build_id(RING, ("-DSYMBUF_MAX_THREADS=512",))
    assert re.fullmatch(r"[0-9a-f]{64}", base)
    assert base == _kernels.build_id(RING, ("-DSYMBUF_MAX_THREADS=512",))
    assert base != _kernels.build_id(RING, ("-DSYMBUF_MAX_THREADS=1024",))
    assert base != _kernels.build_id(RING, ("-DSYMBUF_MAX_THREADS=512", "-DSYMBUF_DEBUG=1"))
    assert base != _kernels.build_id("moe.cu", ("-DSYMBUF_MAX_THREADS=512",))
    # an edit of an included header changes it too
    for p in _cuda_files():
        (tmp_path / p.name).write_text(p.read_text())
    monkeypatch.setattr(_kernels, "cuda_src_dir", lambda: tmp_path)
    assert _kernels.build_id(RING, ("-DSYMBUF_MAX_THREADS=512",)) == base
    (tmp_path / "protocol.cuh").write_text((tmp_path / "protocol.cuh").read_text() + "\n// edited\n")
    assert _kernels.build_id(RING, ("-DSYMBUF_MAX_THREADS=512",)) != base


def test_debug_env_adds_define(monkeypatch):
    try:
        for value, expect in (("1", ("-DSYMBUF_DEBUG=1",)), ("0", ()), ("", ())):
            monkeypatch.setenv("CUPY_SYMBUF_DEBUG", value)
            _kernels._debug_defines.cache_clear()
            assert _kernels._debug_defines() == expect
            assert _kernels._defines(("-DX=1",)) == ("-DX=1",) + _kernels._tuning_defines() + expect
        monkeypatch.setenv("CUPY_SYMBUF_DEBUG", "1")
        _kernels._debug_defines.cache_clear()
        on = _kernels.build_id(RING)
        monkeypatch.delenv("CUPY_SYMBUF_DEBUG")
        _kernels._debug_defines.cache_clear()
        assert _kernels.build_id(RING) != on
    finally:
        monkeypatch.undo()
        _kernels._debug_defines.cache_clear()


def test_moe_layout_shared_memory_fits_max_experts():
    """symbuf_moe_layout keeps num_experts int32 counters in dynamic shared memory next to its static arrays and is
    launched without the opt-in attribute: static + 4 * MAX_EXPERTS must fit the default 48 KiB per block, or a
    dispatch with num_experts near MAX_EXPERTS fails at launch."""
    _nvrtc_or_skip()
    from cupy_symbuf.moe import gpu as _moe_cuda
    ptx = _kernels.compile_ptx("moe.cu")
    sizes = {"b8": 1, "u32": 4, "s32": 4, "b32": 4, "u64": 8, "s64": 8, "b64": 8}
    static = 0
    for align, kind, n in re.findall(r"\.shared \.align (\d+) \.(\w+) _ZZ17symbuf_moe_layoutE\w+?(?:\[(\d+)\])?;",
                                     ptx):
        static = -(-static // int(align)) * int(align) + sizes[kind] * int(n or 1)
    assert static > 8192, f"parsed {static} bytes of static shared memory: the PTX pattern no longer matches"
    assert static + 4 * _moe_cuda.MAX_EXPERTS <= 48 * 1024, (
        f"symbuf_moe_layout: {static} static + 4 * MAX_EXPERTS={_moe_cuda.MAX_EXPERTS} bytes of shared memory exceed "
        f"48 KiB")
