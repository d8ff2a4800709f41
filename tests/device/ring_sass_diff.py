"""The ring kernel's machine code (SASS, sm_90) of two source trees compared: ptxas resources, instructions, the
convergence-barrier moves (BMOV), and the chunk loop (the copy warps' loop over their chunks: wait, copy, hand-off)
instruction by instruction, its inner loops with their schedule (stall counts, yield, reuse flags and the waits,
scoreboard numbers taken out). No GPU: NVRTC (compute_90 PTX, the tree's own compile_ptx), ptxas -arch=sm_90 and
cuobjdump -sass (the CUDA toolkit's, on PATH, under /usr/local/cuda*/bin, or from the pip packages
nvidia-cuda-cuobjdump; ptxas: PTXAS).

    python3 tests/device/ring_sass_diff.py OLD NEW [-DNAME=VALUE ...]

OLD and NEW: source trees (folders with cupy_symbuf/ and cuda_src/) or git revisions of this repository (exported
with git archive). Without -D options, the builds a 2-rank GPU run uses: -DSYMBUF_MAX_THREADS=512 (the default, no
bulk copies) and -DSYMBUF_BULK=1 -DSYMBUF_MAX_THREADS=512 (CUPY_SYMBUF_NVRTC_DEFINES=-DSYMBUF_BULK=1).
"""
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
from difflib import SequenceMatcher

KERNEL = "symbuf_ring_exchange"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = """
import os, sys
from cupy_symbuf.transport import kernels
assert str(kernels.cuda_src_dir()).startswith(os.getcwd()), (kernels.cuda_src_dir(), os.getcwd())
sys.stdout.write(kernels.compile_ptx("ring_exchange.cu", "compute_90", defines=tuple(sys.argv[1:])))
"""


def tool(name: str) -> str:
    found = shutil.which(name) or next(iter(sorted(glob.glob(f"/usr/local/cuda*/bin/{name}"))), None)
    if found is None:
        for base in sys.path:
            found = found or next(iter(glob.glob(os.path.join(base, "nvidia", "*", "bin", name))), None)
    if found is None:
        sys.exit(f"{name} not found (CUDA toolkit, or pip install nvidia-cuda-cuobjdump)")
    return found


def tree(spec: str, work: str) -> str:
    if os.path.isdir(os.path.join(spec, "cuda_src")):
        return os.path.abspath(spec)
    out = os.path.join(work, re.sub(r"\W", "_", spec))
    os.makedirs(out, exist_ok=True)
    archive = subprocess.run(["git", "-C", REPO, "archive", spec], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", out], input=archive, check=True)
    return out


def build(src: str, defines, work: str):
    """(ptxas resource line, [(address, text, control word)]) of the ring kernel of tree `src`."""
    ptx = subprocess.run([sys.executable, "-c", BUILD, *defines], check=True, capture_output=True, text=True,
                         cwd=src, env=dict(os.environ, PYTHONPATH=src)).stdout
    base = os.path.join(work, f"{abs(hash((src, defines)))}")
    with open(base + ".ptx", "w") as f:
        f.write(ptx)
    r = subprocess.run([os.environ.get("PTXAS", tool("ptxas")), "-arch=sm_90", "-v", base + ".ptx", "-o",
                        base + ".cubin"], check=True, capture_output=True, text=True)
    lines = r.stderr.splitlines()
    at = next(i for i, line in enumerate(lines) if f"entry function '{KERNEL}'" in line)
    used = next(line.split(":", 1)[1].strip() for line in lines[at:] if "Used" in line)
    sass = subprocess.run([tool("cuobjdump"), "-sass", "-fun", KERNEL, base + ".cubin"], check=True,
                          capture_output=True, text=True).stdout.splitlines()
    ins = []
    for i, line in enumerate(sass):
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;?\s*/\* (0x[0-9a-f]+) \*/", line)
        if m:
            ctrl = int(re.match(r"\s+/\* (0x[0-9a-f]+) \*/", sass[i + 1]).group(1), 16)
            ins.append((int(m.group(1), 16), m.group(2).strip().rstrip(";").strip(), ctrl))
    return used, ins


def norm(t: str) -> str:
    """Registers, predicates, barriers and constants (addresses) taken out."""
    t = re.sub(r"\bU?R\d+\b", "R", t)
    t = re.sub(r"\bU?P\d\b", "P", t)
    t = re.sub(r"\bB\d+\b", "B", t)
    return re.sub(r"0x[0-9a-f]+", "X", t)


def loops(ins, most: int = 10 ** 6):
    """Every backward branch's body (target .. branch)."""
    at = {a: i for i, (a, _, _) in enumerate(ins)}
    out = []
    for i, (a, t, _) in enumerate(ins):
        m = re.search(r"\bBRA\S*\s+.*?(0x[0-9a-f]+)\s*$", t)
        if m and int(m.group(1), 16) <= a and int(m.group(1), 16) in at and i + 1 - at[int(m.group(1), 16)] <= most:
            out.append(ins[at[int(m.group(1), 16)]:i + 1])
    return out


def chunk_loop(ins):
    """The smallest loop holding the send copy (.nc loads), the receive copy (.cg loads: STRONG.GPU) and the done
    mark's st.release.cta (STRONG.SM)."""
    need = ("LDG.E.NA.128.CONSTANT", "LDG.E.128.STRONG.GPU", "ST.E.64.STRONG.SM")
    return min((body for body in loops(ins) if all(any(k in t for _, t, _ in body) for k in need)), key=len)


def schedule(body):
    """Per instruction: stall cycles, yield, reuse flags, and the instructions (offsets in the body) it waits for,
    over two passes (loop-carried waits), whatever scoreboard numbers carry them."""
    board, out = {k: [] for k in range(6)}, []
    for turn in range(2):
        for i, (_, _, ctrl) in enumerate(body):
            c = ctrl >> 41
            wait, wr, rd = (c >> 11) & 63, (c >> 5) & 7, (c >> 8) & 7
            waited = sorted({x for k in range(6) if (wait >> k) & 1 for x in board[k]})
            for k in range(6):
                if (wait >> k) & 1:
                    board[k] = []
            for k in (wr, rd):
                if k != 7:
                    board[k].append(i)
            if turn:
                out.append((c & 15, (c >> 4) & 1, (c >> 17) & 15, tuple(waited)))
    return out


def relative(body):
    base = body[0][0]
    return [re.sub(r"0x[0-9a-f]{3,}$", lambda m: hex(int(m.group(0), 16) - base), t) for _, t, _ in body]


def compare(old, new) -> None:
    (u_old, a), (u_new, b) = old, new
    print(f"  ptxas: old {u_old}\n         new {u_new}")
    print(f"  instructions: old {len(a)}, new {len(b)}; BMOV (convergence barriers through registers): "
          f"old {sum('BMOV' in t for _, t, _ in a)}, new {sum('BMOV' in t for _, t, _ in b)}")
    ha, hb = chunk_loop(a), chunk_loop(b)
    sm = SequenceMatcher(None, [norm(t) for _, t, _ in ha], [norm(t) for _, t, _ in hb], autojunk=False)
    ops = sm.get_opcodes()
    differ = sum(max(i2 - i1, j2 - j1) for tag, i1, i2, j1, j2 in ops if tag != "equal")
    print(f"  chunk loop: old {ha[0][0]:#x}..{ha[-1][0]:#x} ({len(ha)} instructions), new {hb[0][0]:#x}.."
          f"{hb[-1][0]:#x} ({len(hb)}), new - old address {hb[0][0] - ha[0][0]:+#x}; {differ} instructions differ "
          f"(registers and constants taken out)")
    pair = {ha[i1 + k][0]: hb[j1 + k][0] for tag, i1, i2, j1, j2 in ops if tag == "equal" for k in range(i2 - i1)}
    new_loops = {body[0][0]: body for body in loops(hb, 80)}
    same, other = 0, []
    for body in loops(ha, 80):
        twin = new_loops.get(pair.get(body[0][0]))
        if twin is not None and relative(body) == relative(twin) and \
                schedule(body) == schedule(twin):
            same += 1
        else:
            other.append(f"{body[0][0]:#x} ({len(body)} instructions)")
    print(f"  inner loops of the chunk loop (<= 80 instructions): {same} identical in the new build (instructions, "
          f"registers, schedule), {len(other)} not" + (f": {', '.join(other)}" if other else ""))


def main(argv) -> int:
    specs = [a for a in argv if not a.startswith("-D")]
    if len(specs) != 2:
        print(__doc__)
        return 2
    given = tuple(a for a in argv if a.startswith("-D"))
    variants = [given] if given else [("-DSYMBUF_MAX_THREADS=512",), ("-DSYMBUF_BULK=1", "-DSYMBUF_MAX_THREADS=512")]
    with tempfile.TemporaryDirectory() as work:
        old, new = (tree(s, work) for s in specs)
        for defines in variants:
            print(f"{' '.join(defines)}: {specs[0]} (old) vs {specs[1]} (new)", flush=True)
            compare(build(old, defines, work), build(new, defines, work))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
