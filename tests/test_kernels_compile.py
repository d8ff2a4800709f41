"""Every kernel in cuda_src/ compiles with NVRTC for sm_90 (compute_90 PTX) with no GPU."""
import os
import re

import pytest

from cupy_symbuf import _kernels

REQUIRED = os.environ.get("CUPY_SYMBUF_REQUIRE_NVRTC") == "1"


def _nvrtc_or_skip():
    try:
        import cupy  # noqa: F401
        from cupy_backends.cuda.libs import nvrtc
        nvrtc.getVersion()
    except Exception as exc:  # pragma: no cover
        if REQUIRED:
            raise
        pytest.skip(f"NVRTC not available: {exc}")


@pytest.mark.parametrize("defines", [(), ("-DSYMBUF_MAX_THREADS=512",)], ids=["default", "512-threads"])
@pytest.mark.parametrize("source", _kernels.list_sources())
def test_compiles_for_sm90(source, defines):
    _nvrtc_or_skip()
    ptx = _kernels.compile_ptx(source, "compute_90", defines=defines)
    assert ".target sm_90" in ptx
    entries = re.findall(r"\.entry (\w+)", ptx)
    assert entries, f"no kernels in {source}"


def test_ring_protocol_uses_release_acquire():
    _nvrtc_or_skip()
    ptx = _kernels.compile_ptx("alltoall.cu", "compute_90")
    assert "st.release.sys.global.u64" in ptx  # tail (publisher) and head (receiver)
    assert "ld.acquire.sys.global.u64" in ptx
    assert "st.release.cta.u64" in ptx and "ld.acquire.cta.u64" in ptx  # copy warps -> publisher hand-off
    assert "%globaltimer" in ptx  # every wait is bounded


def test_sources_found():
    assert "alltoall.cu" in _kernels.list_sources()


def test_descriptor_words_match_header():
    """The launch descriptor written by _cuda.py and read by alltoall.cu use the same word numbers."""
    from cupy_symbuf import _cuda
    text = (_kernels.cuda_src_dir() / "layout.cuh").read_text()
    enum = text[text.index("enum {\n  DESC_RANK"):]
    enum = enum[:enum.index("};")]
    names, value = {}, -1
    for item in re.sub(r"//[^\n]*", "", enum[len("enum {"):]).split(","):
        item = item.strip()
        if not item:
            continue
        if "=" in item:
            name, expr = (t.strip() for t in item.split("="))
            value = eval(expr.replace("SYMBUF_MAX_PEERS", str(_cuda.MAX_PEERS)), {}, dict(names))
        else:
            name, value = item, value + 1
        names[name] = value
    assert len(names) == 21
    for name, v in names.items():
        assert getattr(_cuda, name) == v, name
    assert f"#define SYMBUF_MAX_PARTS {_cuda.MAX_PARTS}" in text
    assert f"#define SYMBUF_MAX_PEERS {_cuda.MAX_PEERS}" in text
