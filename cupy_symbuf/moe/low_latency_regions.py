"""The low-latency mode's buffer map (its *regions*: where each call kind's flag lines, metadata and rows sit in
its symmetric buffer, both halves) and the names its three parts share: the call kinds, the kernel phases, the
element kinds and the ``n`` of a rejected call. Used by the public face (``low_latency``), the host wire
(``low_latency_host``) and the GPU launches (``low_latency_cuda``); the layout itself is described in
``low_latency``'s module docstring and ``wire/protocol.py``."""
from __future__ import annotations

from typing import Optional

from ..common import dtypes as _dt
from ..wire import protocol as P

__all__ = ["LINE", "KINDS", "ITEMSIZE", "OPS", "REJECTED", "SEND", "RECV", "BOTH", "regions", "kind_of"]

LINE = P.LINE_BYTES
KINDS = {_dt.BFLOAT16: P.LL_KIND_BF16, _dt.FLOAT16: P.LL_KIND_F16, _dt.FLOAT32: P.LL_KIND_F32}
ITEMSIZE = {_dt.BFLOAT16: 2, _dt.FLOAT16: 2, _dt.FLOAT32: 4}
OPS = ("low_latency_dispatch", "low_latency_combine")
#: the n of a rejected call: in its kernel arguments and in the flag lines it publishes
REJECTED = P.LL_REJECTED
SEND, RECV, BOTH = P.LL_PHASE_SEND, P.LL_PHASE_RECV, P.LL_PHASE_BOTH


def _align(v: int, a: int) -> int:
    return (v + a - 1) // a * a


def regions(W: int, N: int, H: int, itemsize: int, K: int) -> dict:
    """The low-latency regions: offsets (bytes) of the symmetric buffer's areas and its size; every area
    128-aligned."""
    R = _align(H * itemsize, 16)
    meta = _align(W * N * K * 4, LINE)
    rows = _align(W * N * R, LINE)
    d = {"row_bytes": R, "d_flags": 0, "d_meta": W * LINE, "d_rows": W * LINE + meta}
    d["d_half"] = d["d_rows"] + rows
    d["c_wflags"], d["c_weights"] = 0, W * LINE
    d["c_pflags"] = d["c_weights"] + meta
    d["c_prows"] = d["c_pflags"] + W * LINE
    d["c_half"] = d["c_prows"] + rows
    d["d0"] = 2 * LINE
    d["c0"] = d["d0"] + 2 * d["d_half"]
    d["nbytes"] = d["c0"] + 2 * d["c_half"]
    return d


def kind_of(dtype) -> Optional[str]:
    return _dt.float_kind(dtype, raw_uint16=_dt.BFLOAT16)
