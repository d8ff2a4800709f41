"""Every kernel in cuda_src/ compiles with NVRTC for sm_90 (compute_90 PTX) with no GPU, without warnings, in every
variant; every kernel takes one argument struct generated from cupy_symbuf.wire.kernel_args, laid out as its host
packer; the constants shared by Python and CUDA come only from the generated header (cupy_symbuf.wire.protocol), and
Python holds no second copy of them; build_id follows what is compiled."""
import os
import re

import pytest

from cupy_symbuf.transport import kernels as _kernels

from cupy_symbuf.wire import kernel_args as _kernel_args
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
            ("-DSYMBUF_HEADER_FOLD=0", "-DSYMBUF_ADAPTIVE=1", "-DSYMBUF_MAX_THREADS=1024"),
            ("-DSYMBUF_LL_FENCE=0", "-DSYMBUF_LL_SELF=0", "-DSYMBUF_MAX_THREADS=512")]
VARIANT_IDS = ["default", "512-threads", "1024-threads", "debug", "512-threads-debug", "bulk-512", "bulk-1024",
               "trace-512", "trace-1024", "adaptive-512", "adaptive-1024", "adaptive-trace-debug-1024",
               "adaptive-trace-512", "unroll4-batch4-512", "no-header-fold-512", "no-header-fold-adaptive-1024",
               "previous-ll-fences-512"]


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


@pytest.mark.parametrize("arch", ["compute_90", "compute_80"])
@pytest.mark.parametrize("source", ["small_exchange.cu", "ring_exchange.cu"])
def test_small_flag_wrap_hook_compiles_and_zeroes(source, arch):
    """The small protocol's flag-wrap test hook (-DSYMBUF_SMALL_FLAG_MOD=7) builds, and both kernels that make a call
    on a pair (the small kernel and the ring kernel) carry the slot zeroing of the flag's wrap (protocol.cuh,
    small_zero_slot, a function of its own), with and without the hook."""
    _nvrtc_or_skip()
    for defines in ((), ("-DSYMBUF_SMALL_FLAG_MOD=7",)):
        ptx, log = _kernels.compile_ptx(source, arch, defines=defines, return_log=True)
        assert re.search(r"\.func[^\n]*small_zero_slot", ptx), (source, defines)
        assert "warning" not in log.lower(), log


def _ptx_function(ptx: str, head: str) -> str:
    """The body (braces included) of the PTX function whose declaration contains ``head``."""
    at = ptx.index(head)
    start = ptx.index("\n{", at) + 1
    depth = 0
    for k in range(start, len(ptx)):
        depth += {"{": 1, "}": -1}.get(ptx[k], 0)
        if depth == 0:
            return ptx[start:k + 1]
    raise AssertionError(f"unterminated PTX function {head}")


def _ptx_calls(body: str) -> set:
    return set(re.findall(r"call(?:\.uni)?\s*(?:\([^)]*\),\s*)?(\w+)", body))


@pytest.mark.parametrize("defines", [("-DSYMBUF_MAX_THREADS=512",), ("-DSYMBUF_MAX_THREADS=1024",),
                                     ("-DSYMBUF_BULK=1", "-DSYMBUF_MAX_THREADS=512"),
                                     ("-DSYMBUF_SMALL_FLAG_MOD=7", "-DSYMBUF_MAX_THREADS=512")],
                         ids=["512", "1024", "bulk-512", "wrap-hook-512"])
def test_ring_kernel_body_has_no_flag_wrap_zeroing(defines):
    """The ring kernel's flag-wrap zeroing (small_zero_slot) runs in call_header_step, a function of its own that
    only the leader calls, and not in the kernel's body: there (a warp's zeroing, __syncwarp and fences) it changes
    ptxas's code for the whole body, its copy loops included (convergence barriers saved through registers, the
    loops moved and rescheduled; docs/perf-notes.md has the SASS comparison, tests/device/ring_sass_diff.py)."""
    _nvrtc_or_skip()
    ptx = _kernels.compile_ptx(RING, "compute_90", defines=defines)
    kernel = _ptx_function(ptx, ".entry symbuf_ring_exchange(")
    header_step = _ptx_function(ptx, "call_header_step")
    zero = next(name for name in re.findall(r"\.func\s+(\w*small_zero_slot\w*)", ptx))
    assert zero not in _ptx_calls(kernel), "the ring kernel's body zeroes small slots itself"
    assert "membar.sys" not in kernel  # __threadfence_system: the zeroing's fence
    assert zero in _ptx_calls(header_step), "call_header_step does not zero the flag wrap's slot"


@pytest.mark.parametrize("arch", ["compute_90", "compute_80"])
def test_small_profile_build_compiles_and_is_off_by_default(arch):
    """The small kernel's phase-stamp build (-DSYMBUF_SMALL_PROFILE=1, tests/device/small_profile.py) compiles
    without warnings and has its record array and clock stamps; the default build has neither."""
    _nvrtc_or_skip()
    ptx, log = _kernels.compile_ptx("small_exchange.cu", arch, defines=("-DSYMBUF_SMALL_PROFILE=1",),
                                    return_log=True)
    assert "warning" not in log.lower(), log
    size = _protocol.SMALL_PROF_BLOCKS * (1 + _protocol.SMALL_PROF_CALLS * _protocol.SMALL_PROF_RECORD)
    assert f".global .align 8 .b8 symbuf_small_prof[{8 * size}];" in ptx
    assert "%clock64" in ptx
    plain = _kernels.compile_ptx("small_exchange.cu", arch)
    assert "symbuf_small_prof" not in plain and "%clock64" not in plain
    # another build: another build id (the construction fingerprint's, so ranks must agree on it)
    profiled = _kernels.build_id("small_exchange.cu", ("-DSYMBUF_SMALL_PROFILE=1",))
    assert profiled != _kernels.build_id("small_exchange.cu")


SMALL_VARIANTS = [(), ("-DSYMBUF_SMALL_PIPELINE=0",), ("-DSYMBUF_SMALL_PROFILE=1",),
                  ("-DSYMBUF_SMALL_PIPELINE=0", "-DSYMBUF_SMALL_PROFILE=1"), ("-DSYMBUF_SMALL_BATCH=8",),
                  ("-DSYMBUF_SMALL_BATCH=24", "-DSYMBUF_SMALL_PROFILE=1"),
                  ("-DSYMBUF_SMALL_PIPELINE=0", "-DSYMBUF_SMALL_FLAG_MOD=7"), ("-DSYMBUF_SMALL_FLAG_MOD=7",),
                  ("-DSYMBUF_SMALL_FINISH=0",), ("-DSYMBUF_SMALL_FINISH=0", "-DSYMBUF_SMALL_PROFILE=1")]


@pytest.mark.parametrize("arch", ["compute_90", "compute_80"])
@pytest.mark.parametrize("defines", SMALL_VARIANTS, ids=lambda d: "+".join(x[2:] for x in d) or "default")
def test_small_kernel_variants_compile(defines, arch):
    """Every build of the small kernel compiles without warnings on sm_90 and sm_80: batched (the default) or one
    word at a time (SYMBUF_SMALL_PIPELINE=0), other batch sizes, with phase stamps, with the flag-wrap hook."""
    _nvrtc_or_skip()
    ptx, log = _kernels.compile_ptx("small_exchange.cu", arch, defines=defines, return_log=True)
    assert re.findall(r"\.entry symbuf_small_alltoall", ptx)
    assert "warning" not in log.lower(), log


@pytest.mark.parametrize("arch", ["compute_90", "compute_80"])
def test_small_finish_counts_with_one_acq_rel_atomic(arch):
    """An item's end-of-call count is one acq_rel add (SYMBUF_SMALL_FINISH, the default) where
    SYMBUF_SMALL_FINISH=0 keeps two full fences around an add and an exchange."""
    _nvrtc_or_skip()
    new = _kernels.compile_ptx("small_exchange.cu", arch)
    old = _kernels.compile_ptx("small_exchange.cu", arch, defines=("-DSYMBUF_SMALL_FINISH=0",))
    assert "atom.acq_rel.gpu.global.add.u32" in new
    assert "atom.acq_rel.gpu" not in old and "atom.exch.b32" in old and "membar.gl" in old
    assert "atom.exch.b32" not in new and "membar.gl" not in new
    assert _kernels.build_id("small_exchange.cu", ("-DSYMBUF_SMALL_FINISH=0",)) != \
        _kernels.build_id("small_exchange.cu")


def _longest_run(ptx: str, op: str, breakers: tuple) -> int:
    """Most ``op`` instructions in a row in the small kernel's entry, with none of ``breakers`` between them."""
    body = ptx[ptx.index(".entry symbuf_small_alltoall"):]
    best = run = 0
    for tok in re.findall("|".join(re.escape(t) for t in (op,) + breakers), body):
        run = run + 1 if tok == op else 0
        best = max(best, run)
    return best


def test_small_kernel_batches_its_loads():
    """The default build issues a batch of loads before it uses them (SYMBUF_SMALL_BATCH of the sender's source
    words before any store, and of the receiver's words), where SYMBUF_SMALL_PIPELINE=0 stores after every source
    load and loads 4 words at a time."""
    _nvrtc_or_skip()
    src, word = "ld.global.nc.L1::no_allocate.u32", "ld.volatile.global.s64"
    store = ("st.volatile.global.s64",)
    for defines, batch in (((), 16), (("-DSYMBUF_SMALL_BATCH=8",), 8)):
        ptx = _kernels.compile_ptx("small_exchange.cu", "compute_90", defines=defines)
        assert _longest_run(ptx, src, store) >= batch, defines
        assert _longest_run(ptx, word, store + ("bar.sync", "call")) >= batch, defines
    old = _kernels.compile_ptx("small_exchange.cu", "compute_90", defines=("-DSYMBUF_SMALL_PIPELINE=0",))
    assert _longest_run(old, word, store + ("bar.sync", "call")) < 8


@pytest.mark.parametrize("mod", ["8", "1", "4294967297"])
def test_small_flag_wrap_hook_refuses_a_bad_modulus(mod):
    """An even modulus would repeat a flag within an epoch, 1 would be the flag of seq - 2, more than 2^32 - 1 would
    not fit the word: NVRTC refuses them (protocol.cuh's static_assert)."""
    _nvrtc_or_skip()
    with pytest.raises(RuntimeError, match="modulus"):
        _kernels.compile_ptx("small_exchange.cu", "compute_90", defines=(f"-DSYMBUF_SMALL_FLAG_MOD={mod}",))


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
    # (the MoE layout's per-expert counters in the same source are shared-memory atomic adds too: not claims)
    plain = plain.replace(_ptx_function(plain, ".entry symbuf_moe_layout_notify("), "")
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


def test_every_kernel_takes_one_generated_struct():
    """Every kernel entry of every source takes one parameter, its struct of wire/kernel_args.py (KERNELS) passed by
    value, of exactly the host packer's size; every kernel KERNELS names exists."""
    _nvrtc_or_skip()
    seen = set()
    for source in _kernels.list_sources():
        ptx = _kernels.compile_ptx(source, "compute_90")
        for name, params in re.findall(r"\.entry (\w+)\((.*?)\)", ptx, re.S):
            assert name in _kernel_args.KERNELS, f"{source}: kernel {name} has no argument struct in KERNELS"
            size = _kernel_args.struct_size(_kernel_args.KERNELS[name])
            assert re.fullmatch(r"\s*\.param \.align 8 \.b8 \w+\[%d\]\s*" % size, params), \
                f"{source}: {name} takes {' '.join(params.split())}, not one {_kernel_args.KERNELS[name]} ({size} B)"
            seen.add(name)
    assert seen == set(_kernel_args.KERNELS), sorted(set(_kernel_args.KERNELS) - seen)
    assert "symbuf_alltoallv" not in seen


#: (size, alignment) of the C types a field may have, as the C ABI lays them out (x86-64 and aarch64 alike)
_C_SCALARS = {"i32": (4, 4), "u32": (4, 4), "i64": (8, 8), "u64": (8, 8), "f32": (4, 4)}


def _natural_layout(spec) -> tuple:
    """Offsets and size of a struct of ``spec`` laid out as C does (each field at the next multiple of its
    alignment; the size a multiple of the widest), computed here without ctypes."""
    off, widest, offsets = 0, 1, {}
    for field, ctype in spec:
        m = re.fullmatch(r"(\w+)\[(\w+)\]", ctype)
        if ctype.endswith("*"):
            size = align = 8
        elif m:
            n = int(m.group(2)) if m.group(2).isdigit() else getattr(_protocol, m.group(2))
            size, align = _C_SCALARS[m.group(1)][0] * n, _C_SCALARS[m.group(1)][1]
        else:
            size, align = _C_SCALARS[ctype]
        off = -(-off // align) * align
        offsets[field] = off
        off += size
        widest = max(widest, align)
    return offsets, -(-off // widest) * widest


@pytest.mark.parametrize("name", sorted(_kernel_args.STRUCTS))
def test_host_packer_matches_the_generated_struct(name):
    """The host packer (ctypes) puts every field at the offset C gives it, and the generated header asserts the
    fields' sizes and alignments and the struct's size the packer has (so NVRTC's offsets are the same)."""
    offsets, size = _natural_layout(_kernel_args.STRUCTS[name])
    assert _kernel_args.field_offsets(name) == offsets
    assert _kernel_args.struct_size(name) == size
    header = _kernel_args.cuda_header()
    assert f"static_assert(sizeof({name}) == {size}," in header
    for field in _kernel_args.fields(name):
        assert re.search(r"static_assert\(sizeof\(%s::%s\) == \d+ && alignof" % (name, field), header)
    assert header in _kernels.source_text("quant.cu")
    spec = _kernel_args.STRUCTS[name]
    if any("[" in t for _, t in spec):
        with pytest.raises(ValueError, match="array"):
            _kernel_args.host_format(name)
        return
    # the whole-struct filler writes every field where the ctypes fields read it back
    target = _kernel_args.host_struct(name)()
    values = {f: (i + 0.5 if t == "f32" else (1 << 40) + i if t.endswith("*") or "64" in t else i + 1)
              for i, (f, t) in enumerate(spec)}
    _kernel_args.filler(name, target)(**values)
    assert {f: getattr(target, f) for f in values} == values
    first = next(iter(values))
    with pytest.raises(TypeError, match=first):
        _kernel_args.filler(name, target)(**{f: v for f, v in values.items() if f != first})
    # the positional packer (the same fields in order) writes the same bytes
    other = _kernel_args.host_struct(name)()
    _kernel_args.packer(name, other)(*values.values())
    assert bytes(other) == bytes(target)
    with pytest.raises(TypeError, match="packer: target must be"):
        _kernel_args.packer(name, object())


def test_struct_layout_disagreement_does_not_compile(monkeypatch):
    """A host packer whose field differs from the C struct's (here a 4-byte host field for a C long long) makes
    every source fail to compile, naming the field."""
    _nvrtc_or_skip()
    import ctypes
    real = _kernel_args._parse

    def wrong(field, ctype):
        decl, t = real(field, ctype)
        return (decl, ctypes.c_int32) if field == "num_blocks" else (decl, t)

    monkeypatch.setattr(_kernel_args, "_parse", wrong)
    _kernel_args.host_struct.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="QuantArgs.num_blocks"):
            _kernels.compile_ptx("quant.cu", "compute_90")
    finally:
        monkeypatch.undo()
        _kernel_args.host_struct.cache_clear()


def test_kernel_args_spec_rejects_unknown_types():
    for bad in ("i128", "float*", "i64[NO_SUCH_CONSTANT]", "i64[0]"):
        with pytest.raises(ValueError, match="kernel_args: field 'f'"):
            _kernel_args._parse("f", bad)


def test_sources_found():
    names = {p.name for p in _cuda_files()}
    assert RING in _kernels.list_sources()
    assert "alltoall.cu" not in names
    assert {"primitives.cuh", "layout.cuh", "protocol.cuh", "ring_prims.cuh"} <= names


def test_descriptor_fits_parameter_space():
    assert 8 * _protocol.DESC_WORDS == _kernel_args.struct_size("RingArgs")
    assert 8 * _protocol.DESC_WORDS <= 4096  # the descriptor, by value: the ring kernel's one parameter
    assert _protocol.DESC_SEND_PARTS > _protocol.DESC_ABORT_OFFSET


def test_no_hand_copied_protocol_constants():
    """cuda_src defines no protocol constant itself: the old hand copies are gone and none of the generated names
    is (re)defined, and every protocol-looking name the sources use is one the generator emits."""
    generated = _generated_names()
    assert {"DESC_RANK", "DESC_WORDS", "HDR_MAGIC_VALUE", "TAIL_OFFSET", "STATE_SEQ", "FLAG_REJECT", "MAX_PEERS",
            "CHUNK_GRAIN_BYTES", "OP_ALLTOALL", "QUANT_BLOCK", "QUANT_FP8_MAX", "QUANT_AMAX_FLOOR", "LL_CTRL_EXIT",
            "LL_LINE_SIG", "LL_SEG_ELEMS", "LL_PROF_STAMPS", "LL_KIND_F32"} <= generated
    used = set()
    for path in _cuda_files():
        code = _code(path.read_text())
        for old in ("SYMBUF_LINE", "SYMBUF_TAIL_OFFSET", "SYMBUF_HEAD_OFFSET", "SYMBUF_SEND_TAIL_OFFSET",
                    "SYMBUF_RECV_HEAD_OFFSET", "SYMBUF_RING_OFFSET", "SYMBUF_MAX_PARTS", "SYMBUF_MAX_PEERS",
                    "SYMBUF_ROLE_"):
            assert old not in code, f"{path.name}: hand copy {old}"
        assert not re.search(r"\bDESC_\w+\s*=[^=]", code), f"{path.name}: DESC_* defined by hand"
        for name in _kernel_args.STRUCTS:  # the argument structs come from wire/kernel_args.py
            assert not re.search(r"\bstruct\s+%s\s*{" % name, code), f"{path.name}: struct {name} by hand"
        for name in generated:
            assert not re.search(r"#define\s+%s\b" % name, code), f"{path.name}: #define {name}"
            assert not re.search(r"\b(?:enum\b[^;]*?|constexpr\b[^;=]*?|,\s*)\b%s\s*=[^=]" % name, code), \
                f"{path.name}: defines {name}"
        used |= set(re.findall(r"(?<![\w])((?:DESC|HDR|STATUS|ABORT|ERR|FIELD|ROLE|OP|STATE|NOTIFY|FLAG|CHUNK|MAX|"
                               r"QUANT|LL)"
                               r"_[A-Z0-9_]+|(?:TAIL|HEAD|SEND_STATE|RECV_STATE|RING)_OFFSET|LINE_BYTES)\b", code))
    missing = sorted(used - generated)
    assert not missing, f"cuda_src uses protocol names the generator does not emit: {missing}"
    prims = _code((_kernels.cuda_src_dir() / "ring_prims.cuh").read_text())
    body = re.search(r"i64 chunk_rows\(.*?\n}\n", prims, re.S).group(0)
    assert "512" not in body and "4096" not in body


#: Python names that hold a constant of the generated header under another name (public API kept)
_PY_ALIASES = {"FP8_BLOCK": "QUANT_BLOCK", "FP8_MAX": "QUANT_FP8_MAX", "AMAX_FLOOR": "QUANT_AMAX_FLOOR"}


def _literal_number(node) -> bool:
    """A number written in the source: 128, -1.5, np.float32(448.0)."""
    import ast
    if isinstance(node, ast.UnaryOp):
        node = node.operand
    if isinstance(node, ast.Call) and len(node.args) == 1:
        node = node.args[0]
    return isinstance(node, ast.Constant) and type(node.value) in (int, float)


def test_no_hand_copied_constants_in_python():
    """Outside wire/ (where the generated header's constants are defined), no module of the package assigns a
    number literal to a name of the generated header (or to a public alias of one: FP8_BLOCK, FP8_MAX,
    AMAX_FLOOR): each is read from wire/protocol.py. The aliases equal their source; the MoE count exchange's
    default bound is Config's."""
    import ast
    from pathlib import Path

    import cupy_symbuf
    from cupy_symbuf.collectives import quant
    from cupy_symbuf.moe import normal
    watched = _generated_names() | set(_PY_ALIASES)
    root = Path(cupy_symbuf.__file__).parent
    for path in sorted(root.rglob("*.py")):
        if path.parent.name == "wire":
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names = {t.id for t in targets if isinstance(t, ast.Name)}
                hit = names & watched
                assert not (hit and _literal_number(node.value)), \
                    f"{path.relative_to(root)}:{node.lineno}: {sorted(hit)} copied by hand; read wire/protocol.py"
    assert normal.FP8_BLOCK == quant.QUANT_BLOCK == _protocol.QUANT_BLOCK
    assert quant.FP8_MAX == _protocol.float32(_protocol.QUANT_FP8_MAX)
    assert quant.AMAX_FLOOR == _protocol.float32(_protocol.QUANT_AMAX_FLOOR)
    assert not hasattr(normal, "_DEFAULT_MAX_NOTIFY_INTS")
    header = _protocol.cuda_header()
    for name in ("QUANT_FP8_MAX", "QUANT_AMAX_FLOOR"):  # floats: the float32 value, exactly
        value = float.fromhex(re.search(r"constexpr float %s = (\S+)f;" % name, header).group(1))
        assert value == _protocol.float32(getattr(_protocol, name))


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


def test_low_latency_dispatch_shared_memory_fits():
    """symbuf_ll_dispatch keeps its receive masks in dynamic shared memory (LowLatencyBuffer refuses more than
    SMEM_DYNAMIC_MAX bytes of them) next to its static block state, launched without the opt-in attribute: both
    together must fit the default 48 KiB per block."""
    _nvrtc_or_skip()
    from cupy_symbuf.moe import low_latency_cuda as _llc
    ptx = _kernels.compile_ptx("low_latency.cu")
    found = re.findall(r"\.shared \.align \d+ \.b8 (\w*(?:LLDispatchArgs|dispatch_body)\w*)\[(\d+)\];", ptx)
    state = [int(n) for name, n in found if "ll_prologue" in name]
    per_body = [int(n) for name, n in found if "dispatch_body" in name]
    assert state and per_body, f"the PTX pattern no longer matches: {found}"
    static = max(state) + max(per_body) + 16  # (alignment between the two)
    assert static + _llc.SMEM_DYNAMIC_MAX <= 48 * 1024, (
        f"symbuf_ll_dispatch: {static} static + {_llc.SMEM_DYNAMIC_MAX} dynamic bytes of shared memory exceed 48 KiB")


_SHARED_SIZES = {"b8": 1, "u32": 4, "s32": 4, "b32": 4, "u64": 8, "s64": 8, "b64": 8}


def _static_shared(ptx: str, name_part: str) -> int:
    """Bytes of the static shared arrays whose PTX names contain ``name_part`` (laid out in order, aligned)."""
    static = 0
    for align, kind, n in re.findall(r"\.shared \.align (\d+) \.(\w+) _ZZ\w*?%s\w*?(?:\[(\d+)\])?;" % name_part, ptx):
        static = -(-static // int(align)) * int(align) + _SHARED_SIZES[kind] * int(n or 1)
    return static


def test_moe_layout_notify_shared_memory_fits_max_experts():
    """symbuf_moe_layout_notify (an eager dispatch's layout and count exchange in one launch) holds the layout's
    static arrays and num_experts int32 counters (dynamic) and the count exchange's static arrays, launched without
    the opt-in attribute: all of it at MAX_EXPERTS must fit the default 48 KiB per block."""
    _nvrtc_or_skip()
    from cupy_symbuf.moe import gpu as _gpu
    layout = _static_shared(_kernels.compile_ptx("moe.cu"), "moe_layout_body")
    assert layout > 8192, f"parsed {layout} bytes of static shared memory: the PTX pattern no longer matches"
    ring = _kernels.compile_ptx(RING)
    notify = _static_shared(ring, "notify_bodyI13MoeNotifyArgs")
    assert notify > 1024, f"parsed {notify} bytes of the count exchange's shared memory: the pattern no longer matches"
    assert _static_shared(ring, "moe_layout_body") == layout
    static = layout + notify + 8  # (+ alignment between the two bodies' arrays)
    assert static + 4 * _gpu.MAX_EXPERTS <= 48 * 1024, (
        f"symbuf_moe_layout_notify: {static} static + 4 * MAX_EXPERTS={_gpu.MAX_EXPERTS} bytes of shared memory "
        f"exceed 48 KiB")


def test_moe_layout_shared_memory_fits_max_experts():
    """symbuf_moe_layout keeps num_experts int32 counters in dynamic shared memory next to its static arrays and is
    launched without the opt-in attribute: static + 4 * MAX_EXPERTS must fit the default 48 KiB per block, or a
    dispatch with num_experts near MAX_EXPERTS fails at launch."""
    _nvrtc_or_skip()
    from cupy_symbuf.moe import gpu as _gpu
    ptx = _kernels.compile_ptx("moe.cu")
    sizes = {"b8": 1, "u32": 4, "s32": 4, "b32": 4, "u64": 8, "s64": 8, "b64": 8}
    static = 0
    for align, kind, n in re.findall(r"\.shared \.align (\d+) \.(\w+) _ZZ15moe_layout_body\w+?E\w+?(?:\[(\d+)\])?;",
                                     ptx):  # (its body, moe_layout.cuh)
        static = -(-static // int(align)) * int(align) + sizes[kind] * int(n or 1)
    assert static > 8192, f"parsed {static} bytes of static shared memory: the PTX pattern no longer matches"
    assert static + 4 * _gpu.MAX_EXPERTS <= 48 * 1024, (
        f"symbuf_moe_layout: {static} static + 4 * MAX_EXPERTS={_gpu.MAX_EXPERTS} bytes of shared memory exceed "
        f"48 KiB")


def test_low_latency_releases_without_sc_fences():
    """SYMBUF_LL_FENCE (default): the low-latency kernels release their flag lines with fence.acq_rel.sys then the
    relaxed counts, or the weights line's st.release.sys alone; SYMBUF_LL_FENCE=0 keeps __threadfence_system
    (membar.sys, an SC fence) before them. SYMBUF_LL_SELF=0 builds the dispatch that stages its own tokens too."""
    _nvrtc_or_skip()
    new = _kernels.compile_ptx("low_latency.cu", "compute_90")
    old = _kernels.compile_ptx("low_latency.cu", "compute_90", defines=("-DSYMBUF_LL_FENCE=0",))
    assert "fence.acq_rel.sys" in new and "membar.sys" not in new and "fence.sc.sys" not in new
    assert "membar.sys" in old and "fence.acq_rel.sys" not in old
    assert "red.relaxed.sys.global.add.u64" in new and "st.release.sys.global.u64" in new
    staged = _kernels.compile_ptx("low_latency.cu", "compute_90", defines=("-DSYMBUF_LL_SELF=0",))
    assert staged != new


