"""Registers, spills and shared memory of the ring kernel's builds, from ptxas (``.ci/device.sh sass``; needs the CUDA
toolkit's ptxas, no GPU): the default, work-sharing (SYMBUF_ADAPTIVE) and bulk-copy (SYMBUF_BULK) builds at 512 and
1024 threads per block, compiled to compute_90 PTX by NVRTC and assembled for sm_90.

    python3 tests/device/ring_sass.py [WORKDIR]     (SASS_SOURCE / SASS_KERNEL: another source file / kernel)
"""
import os
import subprocess
import sys
import tempfile

from cupy_symbuf.transport import kernels

source = os.environ.get("SASS_SOURCE", "ring_exchange.cu")
kernel = os.environ.get("SASS_KERNEL", "symbuf_ring_exchange")
work = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp()
ptx = os.path.join(work, "ring.ptx")
for threads in (512, 1024):
    for name, defines in (("default", ()), ("work sharing", ("-DSYMBUF_ADAPTIVE=1",)),
                          ("bulk copies", ("-DSYMBUF_BULK=1",))):
        with open(ptx, "w") as f:
            f.write(kernels.compile_ptx(source, "compute_90", defines=defines + (f"-DSYMBUF_MAX_THREADS={threads}",)))
        r = subprocess.run(["ptxas", "-arch=sm_90", "-v", ptx, "-o", ptx[:-3] + "cubin"], capture_output=True,
                           text=True)
        lines = r.stderr.splitlines()
        at = next((i for i, line in enumerate(lines) if kernel in line), None)
        shown = lines[at + 1: at + 4] if at is not None else [f"{kernel} not found; ptxas said: {r.stderr[-400:]}"]
        print(f"{name}, {threads} threads:", *shown, sep="\n  ", flush=True)
