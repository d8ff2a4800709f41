"""The one place that finds, compiles and caches the CUDA sources in ``cuda_src/``.

``get_function(source, name)`` compiles ``cuda_src/<source>`` once per device through ``cupy.RawModule`` (NVRTC)
and caches the module. ``compile_ptx(source)`` calls NVRTC directly for a given virtual architecture with no GPU,
which is how CI checks that every kernel compiles (CuPy's RawModule would ask the GPU for its architecture).

Every source is compiled as ``wire/protocol.py``'s ``cuda_header()`` (the constants shared with Python) and
``wire/kernel_args.py``'s (every kernel's argument struct), generated: no hand copy in ``cuda_src/``, followed by
the file's text; ``build_id`` hashes exactly that text, every ``cuda_src/*.cuh`` it may
include and the option list, for the construction fingerprint (ranks must run the same kernels).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
from pathlib import Path
from typing import Iterable, Optional

from ..common import backend as _compat
from ..wire import kernel_args as _kernel_args
from ..wire import protocol as _protocol

__all__ = ["cuda_src_dir", "list_sources", "get_module", "get_function", "get_launcher", "new_launcher", "Launcher",
           "compile_ptx",
           "build_id", "source_text", "generated_header", "small_flag_mod"]

_OPTIONS = ("-std=c++17",)


@functools.lru_cache(maxsize=None)
def _tuning_defines() -> tuple:
    """Extra ``-D`` options from ``CUPY_SYMBUF_NVRTC_DEFINES`` (space-separated, e.g. ``"-DSYMBUF_UNROLL=4"``): the
    compile-time tuning knobs of ``cuda_src`` (``SYMBUF_UNROLL``, ``SYMBUF_PUBLISH_BATCH``), for benchmark sweeps.
    Read once per process, when a source is first compiled."""
    opts = tuple(os.environ.get("CUPY_SYMBUF_NVRTC_DEFINES", "").split())
    for o in opts:
        if not o.startswith("-D"):
            raise ValueError(f"CUPY_SYMBUF_NVRTC_DEFINES: only -D options are accepted, got {o!r}")
    return opts


@functools.lru_cache(maxsize=None)
def _debug_defines() -> tuple:
    """``("-DSYMBUF_DEBUG=1",)`` when ``CUPY_SYMBUF_DEBUG`` is set (and not ``0``): the kernels then check every ring
    slot against its (channel, peer) region and the ring invariants after every counter read. Read once."""
    return ("-DSYMBUF_DEBUG=1",) if os.environ.get("CUPY_SYMBUF_DEBUG", "") not in ("", "0") else ()


def small_flag_mod() -> int:
    """The small protocol's flag modulus the kernels of this process are built with: ``SMALL_FLAG_MOD``, or the
    test hook's ``-DSYMBUF_SMALL_FLAG_MOD=M`` in ``CUPY_SYMBUF_NVRTC_DEFINES`` (an odd M >= 3: the flag then wraps
    after 2 M calls; ``cuda_src/protocol.cuh`` refuses other values). Part of the construction fingerprint through
    the defines, so every rank has the same."""
    mod = _protocol.SMALL_FLAG_MOD
    for opt in _tuning_defines():
        name, _, value = opt[2:].partition("=")
        if name == "SYMBUF_SMALL_FLAG_MOD":
            mod = int(value, 0)
    return mod


def _defines(defines: Iterable[str] = ()) -> tuple:
    """Every ``-D`` option of a compilation: the caller's variant, then the environment's tuning and debug."""
    return tuple(defines) + _tuning_defines() + _debug_defines()


def cuda_src_dir() -> Path:
    """Folder holding the ``.cu``/``.cuh`` files: the source tree's ``cuda_src/`` or the installed package data."""
    here = Path(__file__).resolve().parent.parent  # the package root (this module lives in transport/)
    # source tree (cuda_src/ beside the package), then an installed wheel (package data at cupy_symbuf/cuda_src/)
    for candidate in (here.parent / "cuda_src", here / "cuda_src"):
        if (candidate / "primitives.cuh").is_file():
            return candidate
    raise FileNotFoundError(f"cupy_symbuf: CUDA sources not found in {here.parent / 'cuda_src'} nor in "
                            f"{here / 'cuda_src'}")


def list_sources() -> list:
    """Names of the compilable ``.cu`` files."""
    return sorted(p.name for p in cuda_src_dir().glob("*.cu"))


def _read(source: str) -> str:
    path = cuda_src_dir() / source
    if not path.is_file():
        raise FileNotFoundError(f"cupy_symbuf: no CUDA source {source!r} in {cuda_src_dir()}")
    return path.read_text()


def source_text(source: str) -> str:
    """The exact text NVRTC compiles for ``cuda_src/<source>``: the generated headers (the protocol constants, then
    the kernel argument structs), then the file (a ``#line`` directive keeps NVRTC's line numbers those of the file;
    the headers' unused constants do not warn)."""
    return generated_header() + f'#line 1 "{source}"\n' + _read(source)


def generated_header() -> str:
    """What :func:`source_text` puts in front of every source: ``wire/protocol.py``'s constants and
    ``wire/kernel_args.py``'s argument structs."""
    # 177: a constant of the generated header that this source does not use (most of them, in every source)
    return "#pragma nv_diag_suppress 177\n" + _protocol.cuda_header() + _kernel_args.cuda_header() + \
        "#pragma nv_diag_default 177\n"


def build_id(source: str, defines: Iterable[str] = ()) -> str:
    """sha256 (hex) of what decides the compiled kernel: the text compiled for ``cuda_src/<source>``
    (:func:`source_text`), every ``cuda_src/*.cuh`` (name and text, the headers it may include) and the options
    (the fixed ones, ``defines``, ``CUPY_SYMBUF_NVRTC_DEFINES``, ``CUPY_SYMBUF_DEBUG``). Include folders and the
    architecture are left out (they differ between machines, not between what ranks run)."""
    h = hashlib.sha256()

    def put(text: str) -> None:
        data = text.encode()
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)

    put(source)
    put(source_text(source))
    for path in sorted(cuda_src_dir().glob("*.cuh")):
        put(path.name)
        put(path.read_text())
    for opt in _OPTIONS + _defines(defines):
        put(opt)
    return h.hexdigest()


@functools.lru_cache(maxsize=None)
def get_module(source: str, device_id: int, defines: tuple = ()):
    """``cupy.RawModule`` for ``cuda_src/<source>`` on ``device_id`` compiled with the ``-D`` options ``defines``
    (a variant chosen by the caller, e.g. ``("-DSYMBUF_MAX_THREADS=512",)``); compiled on first use, then cached."""
    cp = _compat.cupy
    options = _OPTIONS + (f"-I{cuda_src_dir()}",) + _defines(defines)
    with cp.cuda.Device(device_id):
        module = cp.RawModule(code=source_text(source), options=options, backend="nvrtc")
        module.compile()
    return module


def get_function(source: str, name: str, defines: tuple = ()):
    """Kernel ``name`` of ``cuda_src/<source>`` (variant ``defines``) for the current CuPy device."""
    cp = _compat.cupy
    return get_module(source, cp.cuda.Device().id, tuple(defines)).get_function(name)


class Launcher:
    """One kernel launched through the driver API (``cuLaunchKernel``) with its one argument, the struct
    ``args_struct`` of :mod:`cupy_symbuf.wire.kernel_args`, kept in :attr:`args` (a ``ctypes.Structure`` built
    once): a call writes the fields that change (attributes of :attr:`args`, or all of them with :attr:`fill`) and
    launches on a stream (a few us, where CuPy's argument marshalling of a RawKernel call takes 10-40 us for 10-30
    arguments). The driver copies the struct at launch (and into the node when a stream is being captured), so it
    may be rewritten at once."""

    def __init__(self, function, args_struct: str):
        from cupy_backends.cuda.api import driver
        self._launch = driver.launchKernel
        self.function = function
        self._fn = int(function.kernel.ptr)
        #: the kernel's argument (fields by name; pointers as int addresses), kept between calls
        self.args = _kernel_args.host_struct(args_struct)()
        self._ptrs = (ctypes.c_void_p * 1)(ctypes.addressof(self.args))
        self._params = ctypes.addressof(self._ptrs)
        #: ``fill(**every_field)``: write all of :attr:`args` at once (``kernel_args.filler``; not for the
        #: descriptor's word array)
        self.fill = None if args_struct == "RingArgs" else _kernel_args.filler(args_struct, self.args)
        #: ``pack(*every_field)``: the same, positionally in the struct's field order (``kernel_args.packer``)
        self.pack = None if args_struct == "RingArgs" else _kernel_args.packer(args_struct, self.args)

    def __call__(self, grid: int, block: int, *, shared_mem: int = 0, stream=None) -> None:
        """Launch with :attr:`args` as they are on ``stream`` (default: the current CuPy stream)."""
        if stream is None:
            stream = _compat.cupy.cuda.get_current_stream()
        self._launch(self._fn, grid, 1, 1, block, 1, 1, shared_mem, stream.ptr, self._params, 0)


@functools.lru_cache(maxsize=None)
def _launcher(source: str, name: str, device_id: int, defines: tuple) -> Launcher:
    return Launcher(get_module(source, device_id, defines).get_function(name), _kernel_args.KERNELS[name])


def get_launcher(source: str, name: str, defines: tuple = ()) -> Launcher:
    """The cached :class:`Launcher` of kernel ``name`` of ``cuda_src/<source>`` on the current CuPy device (its
    argument struct: ``kernel_args.KERNELS[name]``). Shared by every caller of that kernel on the device: a call
    writes every field (:attr:`Launcher.fill`) before it launches."""
    return _launcher(source, name, _compat.cupy.cuda.Device().id, tuple(defines))


def new_launcher(source: str, name: str, defines: tuple = ()) -> Launcher:
    """A :class:`Launcher` of kernel ``name`` of ``cuda_src/<source>`` on the current CuPy device that is the
    caller's own (its argument struct shared with no one): for a launcher kept per communicator, which two threads
    using two communicators on one GPU must not fill at once (one thread's fields could be launched by the other)."""
    return Launcher(get_function(source, name, tuple(defines)), _kernel_args.KERNELS[name])


def _default_include_dirs() -> list:
    """Include folders of the pip CUDA headers (``cuda_bf16.h`` from nvidia-cuda-runtime-cu12, ``<cuda/atomic>``
    from nvidia-cuda-cccl-cu12), where installed."""
    dirs = []
    try:
        import nvidia  # namespace package of the nvidia-* wheels
        for base in nvidia.__path__:
            for sub in ("cuda_runtime/include", "cuda_cccl/include", "cu13/include"):
                p = Path(base) / sub
                if p.is_dir():
                    dirs.append(str(p))
    except ImportError:
        pass
    return dirs


def compile_ptx(source: str, arch: str = "compute_90", include_dirs: Optional[Iterable[str]] = None,
                defines: tuple = (), return_log: bool = False):
    """Compile ``cuda_src/<source>`` to PTX with NVRTC for ``arch``; no GPU needed. With ``return_log``,
    ``(ptx, log)``: NVRTC's log (its warnings) of a successful compilation.

    Raises ``RuntimeError`` with the NVRTC log when compilation fails.
    """
    cp = _compat.cupy
    if cp is None:
        raise RuntimeError("compile_ptx needs CuPy (for its NVRTC binding)")
    from cupy_backends.cuda.libs import nvrtc
    dirs = list(include_dirs) if include_dirs is not None else _default_include_dirs()
    opts = list(_OPTIONS) + [f"--gpu-architecture={arch}", f"-I{cuda_src_dir()}"] + [f"-I{d}" for d in dirs] \
        + list(_defines(defines))
    prog = nvrtc.createProgram(source_text(source), source, [], [])
    try:
        try:
            nvrtc.compileProgram(prog, opts)
        except nvrtc.NVRTCError as exc:
            log = nvrtc.getProgramLog(prog)
            raise RuntimeError(f"NVRTC failed to compile {source} for {arch}: {exc}\n{log}") from exc
        ptx = nvrtc.getPTX(prog)
        ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
        if not return_log:
            return ptx
        log = nvrtc.getProgramLog(prog)
        log = log.decode() if isinstance(log, bytes) else log
        return ptx, log.strip("\x00").strip()
    finally:
        nvrtc.destroyProgram(prog)


if __name__ == "__main__":  # python -m cupy_symbuf.transport.kernels: compile every source to PTX
    for src in list_sources():
        ptx = compile_ptx(src)
        print(f"{src}: {len(ptx)} bytes of PTX ({os.environ.get('CUPY_SYMBUF_ARCH', 'compute_90')})")
