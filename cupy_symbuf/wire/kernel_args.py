"""The one definition of every kernel's argument: a struct passed by value, its fields declared here once.

Every ``extern "C" __global__`` kernel of ``cuda_src/`` takes exactly one parameter, ``const __grid_constant__
<Struct> a``, whose fields (in order, with their C types) are listed in :data:`STRUCTS`. Two things are generated
from that list, so the host and the device cannot disagree:

* :func:`cuda_header`: the C ``struct`` definitions, each followed by ``static_assert``\\ s of every field's size
  and alignment and of the struct's size, as the host packer has them (equal sizes and alignments in the same
  order give equal offsets: both lay fields out naturally; ``tests/test_kernels_compile.py`` checks the packer's
  offsets against that rule); ``transport/kernels.py`` puts it in front of every source (after the
  protocol constants of :mod:`cupy_symbuf.wire.protocol`, which array lengths may name);
* :func:`host_struct`: the matching ``ctypes.Structure`` (natural alignment, as NVRTC lays the struct out), which
  the launch code fills by field name (a few changing fields as attributes, or every field at once through
  :func:`filler`) and hands to ``cuLaunchKernel`` as the kernel's one parameter (``transport/kernels.py``
  ``Launcher``). The driver copies the parameter at launch, so the host may rewrite its structure for the next call
  while this one is still queued.

Field types: ``i32`` ``i64`` ``u64`` ``f32`` ``u32``; pointers to any of ``i32 i64 u64 f32 u32 u16 u8 void``
(``"const i64*"``; 8 bytes, given as an address, an int; 0 is ``nullptr``); ``"i64[N]"``, an array of N words,
where N is an int or the name of a protocol constant (``"i64[DESC_WORDS]"``). Every field lies at its natural
alignment; a struct's size is a multiple of its widest field.

:data:`KERNELS` names the struct of every kernel; ``tests/test_kernels_compile.py`` checks that every kernel entry in
the compiled PTX is listed there and takes one parameter of exactly that struct's size.
"""
from __future__ import annotations

import ctypes
import functools
import re
import struct as _struct

from . import protocol as _protocol

__all__ = ["STRUCTS", "KERNELS", "cuda_header", "host_struct", "host_format", "filler", "field_offsets", "struct_size",
           "fields"]

# ---- the structs --------------------------------------------------------------------------------------------------

#: The ring kernel (``symbuf_ring_exchange``): its launch descriptor, DESC_WORDS int64 words whose meaning the
#: protocol's ``DESC_*`` indices give (:mod:`cupy_symbuf.wire.protocol`); the host keeps it as a NumPy int64 block
#: (built once per plan and part strides, a call writes only its addresses) and each block copies it into shared
#: memory at launch.
RING_ARGS = (("words", "i64[DESC_WORDS]"),)

#: The count exchange (``symbuf_notify``; ``cuda_src/ring_exchange.cu`` says what each field does). The layout
#: fields are ``ChannelLayout.kernel_args()`` in order (``struct Layout``).
NOTIFY_ARGS = (
    ("send_meta", "const i64*"), ("recv_meta", "i64*"), ("num_values", "i32"), ("epoch_word", "i64*"),
    ("op", "i64"), ("call_status", "i64"), ("sig", "i64"), ("peer_bases", "const u64*"), ("rank", "i32"),
    ("world_size", "i32"), ("region_bytes", "i64"), ("channel_bytes", "i64"), ("num_slots", "i64"),
    ("chunk_bytes", "i64"), ("notify_offset", "i64"), ("notify_slot_bytes", "i64"), ("abort_offset", "i64"),
    ("timeout_ns", "u64"), ("status", "i64*"), ("seq", "u64"), ("local_reject", "const i64*"),
    ("send_echo", "i64*"), ("sums", "i64*"), ("table", "i64*"), ("scale", "i64"), ("capacity", "i64"),
    ("device_checks", "i32"), ("done", "u64*"), ("ticket", "u64"),
)

#: An eager MoE dispatch's layout and count exchange in one launch (``symbuf_moe_layout_notify``,
#: ``cuda_src/ring_exchange.cu``): the count exchange's fields, then the layout's input and routing outputs; the
#: layout writes the values at ``send_meta`` and its bad-value count at ``local_reject``.
MOE_NOTIFY_ARGS = NOTIFY_ARGS + (
    ("idx", "const i64*"), ("num_tokens", "i64"), ("num_topk", "i32"), ("num_experts", "i32"), ("in_rank", "u8*"),
    ("pos", "i64*"), ("send_idx", "i64*"),
)

#: The copy-engine alltoall's hand-back of the header slots (``symbuf_ce_finish``).
CE_FINISH_ARGS = (
    ("peer_bases", "const u64*"), ("rank", "i32"), ("world_size", "i32"), ("num_channels", "i32"),
    ("region_bytes", "i64"), ("channel_bytes", "i64"), ("abort_offset", "i64"), ("timeout_ns", "u64"),
    ("status", "i64*"), ("seq", "u64"),
)

#: The small-message alltoall (``symbuf_small_alltoall``, ``cuda_src/small_exchange.cu``): ``bytes`` per peer, the
#: layout fields of ``struct Layout`` it needs, the small region (``ChannelLayout.small_offset`` /
#: ``small_slot_bytes``), the telemetry buffer (``Config(trace=True)``; 0: none) and its capacity in records.
SMALL_ARGS = (
    ("send", "const u8*"), ("recv", "u8*"), ("bytes", "i64"), ("op", "i64"), ("sig", "i64"),
    ("peer_bases", "const u64*"), ("rank", "i32"), ("world_size", "i32"), ("num_channels", "i32"),
    ("items_per_peer", "i32"), ("region_bytes", "i64"), ("channel_bytes", "i64"), ("num_slots", "i64"),
    ("chunk_bytes", "i64"), ("small_offset", "i64"), ("slot_bytes", "i64"), ("abort_offset", "i64"),
    ("timeout_ns", "u64"), ("status", "i64*"), ("seq", "u64"), ("trace", "i64*"), ("trace_cap", "i64"),
)

#: alltoallv with device counts: the counts become the count exchange's values (``symbuf_counts_meta``).
COUNTS_META_ARGS = (
    ("counts", "const i64*"), ("world_size", "i32"), ("rows", "i64"), ("meta", "i64*"), ("bad", "i64*"),
)

#: The MoE layout kernel (``symbuf_moe_layout``, ``cuda_src/moe.cu``); null outputs are skipped.
MOE_LAYOUT_ARGS = (
    ("idx", "const i64*"), ("num_tokens", "i64"), ("num_topk", "i32"), ("num_experts", "i32"), ("world_size", "i32"),
    ("per_rank", "i32*"), ("per_expert", "i32*"), ("in_rank", "u8*"), ("meta", "i64*"), ("bad", "i64*"),
    ("bad_sticky", "i64*"), ("pos", "i64*"), ("send_idx", "i64*"),
)

#: The MoE receive fix-up (``symbuf_moe_recv_fixup``).
MOE_FIXUP_ARGS = (
    ("gidx", "i64*"), ("w", "f32*"), ("rows", "i64"), ("num_topk", "i32"), ("first_expert", "i64"), ("epr", "i32"),
    ("table", "const i64*"), ("sums", "const i64*"), ("counts_out", "i64*"), ("align", "i64"),
)

#: The MoE combine's reduction (``symbuf_combine_reduce_{bf16,f16,f32}``), x and the top-k weights in one launch:
#: x's rows of the entry's element type (``back``, ``out``, ``self_rows``), the weights' float32 rows of ``num_topk``
#: (``w_back``, ``w_out``: null without weights, ``w_self_rows``).
COMBINE_REDUCE_ARGS = (
    ("back", "const void*"), ("pos", "const i64*"), ("out", "void*"), ("num_tokens", "i64"), ("hidden", "i64"),
    ("world_size", "i32"), ("vec", "i32"), ("self_rows", "const void*"), ("self_stride", "i64"),
    ("table", "const i64*"), ("rank", "i32"), ("w_back", "const f32*"), ("w_out", "f32*"),
    ("w_self_rows", "const f32*"), ("w_self_stride", "i64"), ("num_topk", "i64"),
)

#: The fp8 block quantiser and dequantiser (``cuda_src/quant.cu``, one entry per element type).
QUANT_ARGS = (("x", "const void*"), ("num_blocks", "i64"), ("ue8m0", "i32"), ("q", "u32*"), ("scales", "f32*"))
DEQUANT_ARGS = (("q", "const u32*"), ("scales", "const f32*"), ("num_blocks", "i64"), ("out", "void*"))

#: Low-latency dispatch / combine (``cuda_src/low_latency.cu``): every field an int64 word (addresses too).
#: ``dispatch_id``: the address of the output set's int64 word that a dispatch's receive sets to the call's sequence
#: number and that a combine reads from its handle's set; ``tag`` / ``why``: what a rejected dispatch's flag lines
#: carry (``LowLatencyBuffer.announce``); ``d_half0`` / ``d_half_bytes`` / ``d_meta_off``: where a combine finds the
#: top-k indices its handle's dispatch sent (the dispatch regions).
LL_DISPATCH_ARGS = tuple((f, "i64") for f in (
    "x", "x_stride", "topk", "n", "k", "ll_bases", "half0", "half_bytes", "flags_off", "meta_off", "rows_off",
    "row_bytes", "N", "H", "L", "W", "rank", "use_fp8", "ue8m0", "kind", "sig", "recv_x", "recv_scales", "recv_count",
    "src_info", "layout_range", "inv", "recv_ntok", "status", "comm_bases", "abort_offset", "timeout_ns",
    "launch_seq", "ctrl", "grid", "prof", "phase", "dispatch_id", "tag", "why"))
LL_COMBINE_ARGS = tuple((f, "i64") for f in (
    "x", "topk", "weights", "n", "k", "inv", "recv_ntok", "ll_bases", "half0", "half_bytes", "wflags_off",
    "weights_off", "pflags_off", "prows_off", "row_bytes", "N", "H", "L", "W", "rank", "kind", "sig", "out", "status",
    "comm_bases", "abort_offset", "timeout_ns", "launch_seq", "ctrl", "grid", "prof", "phase", "dispatch_id",
    "d_half0", "d_half_bytes", "d_meta_off"))

#: C struct name -> its fields, in order.
STRUCTS = {
    "RingArgs": RING_ARGS, "NotifyArgs": NOTIFY_ARGS, "MoeNotifyArgs": MOE_NOTIFY_ARGS, "CeFinishArgs": CE_FINISH_ARGS,
    "SmallArgs": SMALL_ARGS,
    "CountsMetaArgs": COUNTS_META_ARGS, "MoeLayoutArgs": MOE_LAYOUT_ARGS, "MoeFixupArgs": MOE_FIXUP_ARGS,
    "CombineReduceArgs": COMBINE_REDUCE_ARGS, "QuantArgs": QUANT_ARGS, "DequantArgs": DEQUANT_ARGS,
    "LLDispatchArgs": LL_DISPATCH_ARGS, "LLCombineArgs": LL_COMBINE_ARGS,
}

#: Every kernel entry of cuda_src/ -> the struct it takes.
KERNELS = {
    "symbuf_ring_exchange": "RingArgs", "symbuf_notify": "NotifyArgs",
    "symbuf_moe_layout_notify": "MoeNotifyArgs", "symbuf_ce_finish": "CeFinishArgs",
    "symbuf_small_alltoall": "SmallArgs",
    "symbuf_counts_meta": "CountsMetaArgs", "symbuf_moe_layout": "MoeLayoutArgs",
    "symbuf_moe_recv_fixup": "MoeFixupArgs", "symbuf_combine_reduce_bf16": "CombineReduceArgs",
    "symbuf_combine_reduce_f16": "CombineReduceArgs", "symbuf_combine_reduce_f32": "CombineReduceArgs",
    "symbuf_quant_fp8": "QuantArgs", "symbuf_quant_fp8_f16": "QuantArgs", "symbuf_quant_fp8_bf16": "QuantArgs",
    "symbuf_dequant_fp8": "DequantArgs", "symbuf_dequant_fp8_f16": "DequantArgs",
    "symbuf_dequant_fp8_bf16": "DequantArgs", "symbuf_ll_dispatch": "LLDispatchArgs",
    "symbuf_ll_combine": "LLCombineArgs",
}

# ---- the types ----------------------------------------------------------------------------------------------------

#: scalar type -> (C spelling, ctypes type)
_SCALARS = {"i32": ("int", ctypes.c_int32), "u32": ("unsigned int", ctypes.c_uint32),
            "i64": ("long long", ctypes.c_int64), "u64": ("unsigned long long", ctypes.c_uint64),
            "f32": ("float", ctypes.c_float)}
#: what a pointer may point to -> its C spelling
_POINTEES = {"i32": "int", "u32": "unsigned int", "i64": "long long", "u64": "unsigned long long", "f32": "float",
             "u16": "unsigned short", "u8": "unsigned char", "void": "void"}
_POINTER = re.compile(r"(const )?(\w+)\*")
_ARRAY = re.compile(r"(\w+)\[(\w+)\]")


def _parse(field: str, ctype: str):
    """``(C declaration of the field, ctypes type)`` of one field; ``ValueError`` for a type outside the rules."""
    m = _POINTER.fullmatch(ctype)
    if m and m.group(2) in _POINTEES:
        return f"{m.group(1) or ''}{_POINTEES[m.group(2)]}* {field}", ctypes.c_uint64
    m = _ARRAY.fullmatch(ctype)
    if m and m.group(1) in _SCALARS:
        n = m.group(2)
        count = int(n) if n.isdigit() else getattr(_protocol, n, None)
        if not isinstance(count, int) or count < 1:
            raise ValueError(f"kernel_args: field {field!r}: array length {n!r} is neither a positive int nor a "
                             f"protocol constant")
        c, t = _SCALARS[m.group(1)]
        return f"{c} {field}[{n}]", t * count
    if ctype in _SCALARS:
        c, t = _SCALARS[ctype]
        return f"{c} {field}", t
    raise ValueError(f"kernel_args: field {field!r} has type {ctype!r}; allowed: {sorted(_SCALARS)}, pointers to "
                     f"{sorted(_POINTEES)} ('const i64*'), arrays 'i64[N]'")


def fields(name: str) -> tuple:
    """The field names of struct ``name``, in order."""
    return tuple(f for f, _ in STRUCTS[name])


@functools.lru_cache(maxsize=None)
def host_struct(name: str) -> type:
    """The ``ctypes.Structure`` with struct ``name``'s layout (fields by name; pointers are ``c_uint64``
    addresses). ``KeyError`` for an unknown name."""
    spec = STRUCTS[name]
    return type(name, (ctypes.Structure,), {"_fields_": [(f, _parse(f, t)[1]) for f, t in spec],
                                            "__slots__": ()})


#: scalar type -> its character in a native-alignment ``struct`` format (pointers: "Q")
_FORMAT = {"i32": "i", "u32": "I", "i64": "q", "u64": "Q", "f32": "f"}


@functools.lru_cache(maxsize=None)
def host_format(name: str) -> _struct.Struct:
    """A ``struct.Struct`` packing every field of struct ``name`` in order at the host packer's offsets (native
    alignment, trailing padding to its size). ``ValueError`` for a struct with an array field (fill it by field)."""
    chars = []
    for f, t in STRUCTS[name]:
        if _ARRAY.fullmatch(t):
            raise ValueError(f"kernel_args: {name}.{f} is an array: {name} has no whole-struct format")
        chars.append("Q" if t.endswith("*") else _FORMAT[t])
    fmt = "@" + "".join(chars)
    fmt += "x" * (struct_size(name) - _struct.calcsize(fmt))
    if _struct.calcsize(fmt) != struct_size(name):
        raise AssertionError(f"kernel_args: {name}: format {fmt!r} is not {struct_size(name)} bytes")
    return _struct.Struct(fmt)


def filler(name: str, target: ctypes.Structure):
    """A function taking every field of struct ``name`` as a keyword argument (all required; ``TypeError`` names a
    missing or unknown one) that writes them all into ``target`` (a :func:`host_struct` instance) in one
    ``struct.pack_into`` (about twice as fast as setting a dozen ctypes fields one by one: launches on the hot path
    use it)."""
    names = fields(name)
    if not isinstance(target, host_struct(name)):
        raise TypeError(f"kernel_args.filler: target must be a {name} (host_struct({name!r})), got "
                        f"{type(target).__name__}")
    code = f"def fill_{name}(*, {', '.join(names)}):\n    _pack(_target, 0, {', '.join(names)})\n"
    scope = {"_pack": host_format(name).pack_into, "_target": target}
    exec(compile(code, f"<kernel_args.filler {name}>", "exec"), scope)
    fill = scope[f"fill_{name}"]
    fill.__doc__ = f"Write every field of {name} ({', '.join(names)}) into its launcher's argument struct."
    return fill


def packer(name: str, target: ctypes.Structure):
    """A function taking every field of struct ``name`` positionally, in :func:`fields` order, that writes them all
    into ``target`` in one ``struct.pack_into`` (:func:`filler` without the keywords: for a caller that keeps the
    fields of one call shape in order)."""
    if not isinstance(target, host_struct(name)):
        raise TypeError(f"kernel_args.packer: target must be a {name} (host_struct({name!r})), got "
                        f"{type(target).__name__}")
    return functools.partial(host_format(name).pack_into, target, 0)


def field_offsets(name: str) -> dict:
    """Byte offset of every field of struct ``name`` in the host packer (what the generated header asserts)."""
    s = host_struct(name)
    return {f: getattr(s, f).offset for f in fields(name)}


def struct_size(name: str) -> int:
    """Bytes of struct ``name`` (the kernel's parameter size)."""
    return ctypes.sizeof(host_struct(name))


def cuda_header() -> str:
    """C++ text defining every struct of :data:`STRUCTS`, each followed by ``static_assert``\\ s of its fields'
    sizes and alignments and its size (the host packer's): a layout the two sides disagree on does not compile."""
    lines = ["// Generated from cupy_symbuf/wire/kernel_args.py at NVRTC time: do not edit; change the Python.",
             "#ifndef SYMBUF_KERNEL_ARGS_GENERATED", "#define SYMBUF_KERNEL_ARGS_GENERATED"]
    for name, spec in STRUCTS.items():
        lines.append(f"struct {name} {{")
        lines += [f"  {_parse(f, t)[0]};" for f, t in spec]
        lines.append("};")
        packer = host_struct(name)
        for f, _ in spec:  # with every field's size and alignment equal, the offsets are (natural layout)
            t = dict(packer._fields_)[f]
            size, align = ctypes.sizeof(t), ctypes.alignment(t)
            lines.append(f"static_assert(sizeof({name}::{f}) == {size} && alignof(decltype({name}::{f})) == {align}, "
                         f'"{name}.{f}: the host packer has {size} bytes, aligned on {align}");')
        size = struct_size(name)
        lines.append(f'static_assert(sizeof({name}) == {size}, "{name}: the host packer has {size} bytes");')
    lines.append("#endif")
    return "\n".join(lines) + "\n"
