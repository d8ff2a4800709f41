"""Two trees' benchmark logs side by side: each row's median over the runs, old against new.

The ``compare`` stage of ``.ci/device.sh`` runs ``python -m cupy_symbuf.bench`` on an old tree and on this one,
interleaved, and writes one log per run, named ``cmp_<bench>_<old|new>_<run>.log`` (bench: control, alltoall,
alltoallv, dispatch). This program reads those logs and prints, per bench and row, the median of every time column
(``*_us``; the control table's ``... us`` value) over the runs of each tree, the ratio new / old and a flag where
the ratio is off 1 by more than ``--threshold`` (default 5%).

    python3 tests/device/bench_compare.py LOGDIR [--threshold 0.05] [--out FILE] [--brief]
    python3 tests/device/bench_compare.py --old a1.log a2.log --new b1.log b2.log

The parser reads the bench's tables by their header line (``size/rank engine timing time_us ...``, ``tokens op
p50_us ...``, ``size/rank pattern engine p50_us ...``) and the control table by its ``NAME  VALUE us   target ...``
lines. Lines it does not recognise (comments, skip notes, profiles, tables without a key column) are ignored, so
rows that exist only on the GPU (NCCL, energy, ce-pull, graph rows) pass through as they come. Pure Python: no
NumPy, no CuPy.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import sys

# columns that name a row (the rest are values); a table without any of them is not compared
KEY_COLUMNS = ("size/rank", "tokens", "pattern", "engine", "op", "timing")
SIZE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")
_CONTROL_ROW = re.compile(r"^(?P<name>\S.*?)\s+(?P<value>[-+]?[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?) us\s+target\b")
_LOG_NAME = re.compile(r"^cmp_(?P<bench>[A-Za-z0-9-]+)_(?P<tree>old|new)_(?P<run>[0-9]+)\.log$")


def _number(token: str):
    """``token`` as a float (a trailing ``x`` or ``%`` dropped), or None where it is no number (``-``, ``nan``)."""
    t = token.rstrip("x%")
    try:
        v = float(t)
    except ValueError:
        return None
    return None if v != v else v


def _merge_sizes(tokens: list) -> list:
    """``['64', 'KiB', 'ours']`` -> ``['64 KiB', 'ours']``: a size and its unit are one cell."""
    out = []
    for t in tokens:
        if t in SIZE_UNITS and out and _number(out[-1]) is not None:
            out[-1] = f"{out[-1]} {t}"
        else:
            out.append(t)
    return out


def parse(text: str) -> dict:
    """Rows of one bench log: ``{row name: {column: value}}``.

    Row names are the key cells joined by spaces (``"64 KiB ours call"``, ``"128 ll-dispatch"``,
    ``"16 MiB zipf ours"``; control rows: their name). Value columns are the header's other names; a cell that is no
    number is left out. Two tables with the same key (a dispatch table and its energy table) merge their columns."""
    rows: dict = {}
    header = None
    for line in text.splitlines():
        s = line.strip()
        if not s or s.startswith("#"):
            continue
        m = _CONTROL_ROW.match(s)
        if m:
            rows.setdefault(m["name"].strip(), {})["us"] = float(m["value"])
            continue
        cells = _merge_sizes(s.split())
        if any(c in KEY_COLUMNS for c in cells) and all(_number(c) is None for c in cells):
            header = cells
            continue
        if header is None or len(cells) != len(header):
            continue
        key, values = [], {}
        for col, cell in zip(header, cells):
            if col in KEY_COLUMNS:
                key.append(cell)
            else:
                v = _number(cell)
                if v is not None:
                    values[col] = v
        if key and values:
            rows.setdefault(" ".join(key), {}).update(values)
    return rows


def is_time_column(column: str) -> bool:
    """The columns compared: times in microseconds (``time_us``, ``p50_us``, ``p99_us``, ``loop_us``; control ``us``)."""
    return column == "us" or column.endswith("_us")


def medians(runs: list) -> dict:
    """``{(row, column): (median, n)}`` over the parsed runs ``runs`` (rows missing from a run are left out of its
    median; n says over how many runs)."""
    vals: dict = {}
    for rows in runs:
        for row, cols in rows.items():
            for col, v in cols.items():
                if is_time_column(col):
                    vals.setdefault((row, col), []).append(v)
    return {k: (statistics.median(v), len(v)) for k, v in vals.items()}


def compare(old_runs: list, new_runs: list, threshold: float = 0.05) -> list:
    """One dict per (row, column) present in either tree: ``row, column, old, new`` (medians or None), ``n_old``,
    ``n_new``, ``ratio`` (new / old, None where one side is missing or old is 0) and ``flag`` (True where
    ``|ratio - 1| > threshold``), in the old tree's row order, then the rows only the new tree has."""
    mo, mn = medians(old_runs), medians(new_runs)
    order = list(mo) + [k for k in mn if k not in mo]
    out = []
    for key in order:
        o, n_o = mo.get(key, (None, 0))
        n, n_n = mn.get(key, (None, 0))
        ratio = n / o if o and n is not None else None
        out.append({"row": key[0], "column": key[1], "old": o, "new": n, "n_old": n_o, "n_new": n_n,
                    "ratio": ratio, "flag": ratio is not None and abs(ratio - 1) > threshold})
    return out


def format_table(bench: str, result: list, threshold: float, brief: bool = False) -> str:
    """The printed summary of one bench (``brief``: only the flagged rows and those in one tree alone)."""
    width = max([len(r["row"]) for r in result] + [20])
    lines = [f"## {bench}: median over the runs, ratio = new / old, '*' = off by more than {threshold:.0%}",
             f"{'row':<{width}} {'column':>8} {'old':>11} {'new':>11} {'ratio':>7}  runs"]
    for r in result:
        if brief and not r["flag"] and r["old"] is not None and r["new"] is not None:
            continue
        f = lambda v: f"{v:11.1f}" if v is not None else f"{'-':>11}"  # noqa: E731
        ratio = f"{r['ratio']:7.3f}" if r["ratio"] is not None else f"{'-':>7}"
        note = " *" + (" slower" if r["ratio"] > 1 else " faster") if r["flag"] else ""
        if r["old"] is None or r["new"] is None:
            note = " (only in the " + ("new" if r["old"] is None else "old") + " tree)"
        lines.append(f"{r['row']:<{width}} {r['column']:>8} {f(r['old'])} {f(r['new'])} {ratio}  "
                     f"{r['n_old']}/{r['n_new']}{note}")
    flagged = sum(r["flag"] for r in result)
    lines.append(f"# {bench}: {len(result)} values, {flagged} off by more than {threshold:.0%}")
    return "\n".join(lines)


def logs_in(directory: str) -> dict:
    """``{bench: {"old": [paths], "new": [paths]}}`` of the ``cmp_<bench>_<tree>_<run>.log`` files in ``directory``
    (runs in order)."""
    found: dict = {}
    for name in sorted(os.listdir(directory), key=lambda n: (len(n), n)):
        m = _LOG_NAME.match(name)
        if m:
            found.setdefault(m["bench"], {"old": [], "new": []})[m["tree"]].append(os.path.join(directory, name))
    return found


def _read(path: str) -> dict:
    with open(path, errors="replace") as f:
        return parse(f.read())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="bench_compare", description=__doc__.split("\n\n")[0])
    ap.add_argument("logdir", nargs="?", help="directory with cmp_<bench>_<old|new>_<run>.log files")
    ap.add_argument("--old", nargs="+", default=None, help="old tree's logs of one bench (instead of LOGDIR)")
    ap.add_argument("--new", nargs="+", default=None, help="new tree's logs of the same bench")
    ap.add_argument("--threshold", type=float, default=0.05, help="flag ratios off 1 by more (default 0.05)")
    ap.add_argument("--out", default=None, help="also write the whole summary to this file")
    ap.add_argument("--brief", action="store_true",
                    help="print only the flagged rows and the rows of one tree alone (--out still gets every row)")
    args = ap.parse_args(argv)
    if (args.old is None) != (args.new is None):
        ap.error("--old and --new go together")
    if args.old is not None:
        benches = {"bench": {"old": args.old, "new": args.new}}
    elif args.logdir:
        benches = logs_in(args.logdir)
        if not benches:
            ap.error(f"no cmp_<bench>_<old|new>_<run>.log files in {args.logdir}")
    else:
        ap.error("give LOGDIR or --old ... --new ...")
    results = {bench: compare([_read(p) for p in trees["old"]], [_read(p) for p in trees["new"]], args.threshold)
               for bench, trees in benches.items()}
    text = lambda brief: "\n\n".join(format_table(b, r, args.threshold, brief) for b, r in results.items())  # noqa: E731
    print(text(args.brief))
    if args.out:
        with open(args.out, "w") as f:
            f.write(text(False) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
