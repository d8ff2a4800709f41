"""Pictures and a report from channel traces (``Config(trace=True)``, ``Communicator.save_trace``):
``python -m cupy_symbuf.diagnostics trace_rank*.npz --out DIR``.

The design article's debugging section, as files:

* ``channels.png``: for every channel (one panel each), the ``tail`` each sender published into each peer's ring
  over time (one line per sender -> receiver pair): flat stretches are stalls, a steep line a fast run;
* ``sizes.png``: the histogram of chunk sizes per channel (how the row runs were cut);
* ``traffic.png``: the rank-by-rank heatmap of payload bytes (row: source, column: destination; a rank's own rows
  on the diagonal);
* ``busy.png``: per rank and channel, the time spent copying (load balance across channels, i.e. SMs on the GPU);
* ``report.txt`` (also printed): the hot ranks (most bytes received), the slowest channel (most busy time), and
  the stalls: time idle while send runs waited for ring space or peers, and while receive runs waited for
  data.

matplotlib is needed for the PNGs (``pip install matplotlib``; the report works without it). The traces come from
the host engine today; the GPU kernels do not record yet.
"""
from __future__ import annotations

import argparse
import glob
import os
from typing import Optional

import numpy as np

from ..transport.trace import IDLE, PULL, SELF, SEND

__all__ = ["load", "summarize", "report", "plot", "main"]


def load(paths) -> list:
    """``[(rank, world_size, records, dropped events), ...]`` sorted by rank, from ``.npz`` files written by ``save_trace``."""
    out = []
    for path in paths:
        try:
            with np.load(path, allow_pickle=False) as z:
                out.append((int(z["rank"]), int(z["world_size"]), z["records"].copy(),
                            int(z["dropped"]) if "dropped" in z.files else 0))
        except (OSError, KeyError, ValueError) as exc:
            raise ValueError(f"diagnostics: {path} is not a trace file of Communicator.save_trace ({exc})") from None
    if not out:
        raise ValueError("diagnostics: no trace files given")
    sizes = {w for _, w, _, _ in out}
    if len(sizes) != 1:
        raise ValueError(f"diagnostics: the traces come from different world sizes {sorted(sizes)}")
    ranks = [r for r, _, _, _ in out]
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"diagnostics: several trace files of the same rank: ranks {sorted(ranks)}")
    return sorted(out, key=lambda x: x[0])


def summarize(traces: list) -> dict:
    """Numbers behind the report: ``traffic[src, dst]`` payload bytes, per-rank bytes received, per (rank,
    channel) busy seconds, idle seconds split into waiting for space / for data, chunk sizes per channel."""
    W = traces[0][1]
    traffic = np.zeros((W, W), np.int64)
    channels = sorted({int(c) for _, _, r, _ in traces for c in r["channel"][r["kind"] != IDLE] if c >= 0})
    busy = {}
    idle_send = idle_recv = 0.0
    sizes = {c: [] for c in channels}
    for rank, _, rec, _ in traces:
        for kind in (SEND, PULL):
            sel = rec[rec["kind"] == kind]
            for peer, nbytes in zip(sel["peer"], sel["bytes"]):
                if kind == SEND:
                    traffic[rank, peer] += nbytes
                else:  # a pull moves the peer's rows to this rank
                    traffic[peer, rank] += nbytes
        own = rec[rec["kind"] == SELF]
        traffic[rank, rank] += int(own["bytes"].sum())
        work = rec[(rec["kind"] != IDLE) & (rec["channel"] >= 0)]
        for c in channels:
            sel = work[work["channel"] == c]
            busy[(rank, c)] = float((sel["t1"] - sel["t0"]).sum())
            sizes[c].extend(sel["bytes"][np.isin(sel["kind"], (SEND, PULL))].tolist())
        idle = rec[rec["kind"] == IDLE]
        dur = idle["t1"] - idle["t0"]
        both = np.maximum(idle["head"] + idle["tail"], 1)
        idle_send += float((dur * idle["head"] / both).sum())  # split each spell by the runs it waited on
        idle_recv += float((dur * idle["tail"] / both).sum())
    return {"world_size": W, "ranks": [r for r, _, _, _ in traces], "dropped": sum(d for _, _, _, d in traces),
            "events": sum(len(r) for _, _, r, _ in traces), "traffic": traffic, "received": traffic.sum(axis=0), "busy": busy,
            "idle_send_s": idle_send, "idle_recv_s": idle_recv, "sizes": sizes, "channels": channels}


def report(summary: dict) -> str:
    """The text report (see the module docstring)."""
    W = summary["world_size"]
    recv = summary["received"]
    mean = recv.mean() if W else 0
    order = np.argsort(-recv, kind="stable")
    lines = [f"cupy_symbuf diagnostics: {W} ranks, {int(summary['traffic'].sum())} payload bytes traced"]
    missing = sorted(set(range(W)) - set(summary["ranks"]))
    if missing:
        lines.append(f"WARNING: no trace of ranks {missing}: the hot ranks, traffic and stalls below count only what "
                     f"ranks {summary['ranks']} recorded (a rank's receives are seen only in its own trace)")
    if summary["dropped"]:
        lines.append(f"WARNING: {summary['dropped']} events were dropped (trace buffers full): the numbers cover the "
                     f"first events only; trace fewer calls, or read with Communicator.trace(clear=True) in between")
    if not summary["events"]:
        lines.append("no events traced (was the Communicator built with Config(trace=True), and did it run?)")
        return "\n".join(lines) + "\n"
    hot = [int(r) for r in order if mean > 0 and recv[r] > 1.25 * mean]
    lines.append("hot ranks (received > 1.25x the mean): " +
                 (", ".join(f"rank {r} ({recv[r] / mean:.2f}x the mean)" for r in hot) if hot else "none"))
    lines.append("bytes received per rank: " + ", ".join(f"{r}: {int(recv[r])}" for r in range(W)))
    if summary["busy"]:
        (rank, ch), t = max(summary["busy"].items(), key=lambda kv: kv[1])
        per_ch = {}
        for (r, c), v in summary["busy"].items():
            per_ch[c] = per_ch.get(c, 0.0) + v
        slow = max(per_ch, key=per_ch.get)
        lines.append(f"slowest channel: {slow} ({per_ch[slow] * 1e3:.3f} ms copying over all ranks; "
                     f"busiest (rank, channel): ({rank}, {ch}) {t * 1e3:.3f} ms)")
        lines.append("busy ms per channel: " + ", ".join(f"{c}: {v * 1e3:.3f}" for c, v in sorted(per_ch.items())))
    lines.append(f"stalls: {summary['idle_send_s'] * 1e3:.3f} ms idle with send runs waiting for ring space or "
                 f"peers, {summary['idle_recv_s'] * 1e3:.3f} ms with receive runs waiting for data")
    return "\n".join(lines) + "\n"


def plot(traces: list, summary: dict, out_dir: str) -> list:
    """Write the PNGs into ``out_dir``; returns their paths. ``ImportError`` without matplotlib."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    os.makedirs(out_dir, exist_ok=True)
    W, channels = summary["world_size"], summary["channels"] or [0]
    if not summary["events"]:
        return []
    t_start = min(float(r["t0"].min()) for _, _, r, _ in traces if len(r))
    paths = []

    fig, axes = plt.subplots(len(channels), 1, figsize=(9, 2.4 * len(channels)), squeeze=False, sharex=True)
    for ax, c in zip(axes[:, 0], channels):
        for rank, _, rec, _ in traces:
            sel = rec[(rec["kind"] == SEND) & (rec["channel"] == c)]
            for peer in np.unique(sel["peer"]):
                s = sel[sel["peer"] == peer]
                ax.step((s["t1"] - t_start) * 1e3, s["tail"], where="post", label=f"{rank}->{peer}", lw=1)
        ax.set_ylabel(f"ch {c}: tail")
        if W <= 8 and ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6, ncol=4, loc="upper left")
    axes[-1, 0].set_xlabel("ms")
    fig.suptitle("ring tail per channel over time (flat = stalled)")
    paths.append(_save(fig, out_dir, "channels.png"))

    fig, axes = plt.subplots(1, len(channels), figsize=(3 * len(channels) + 1, 2.8), squeeze=False)
    for ax, c in zip(axes[0], channels):
        sizes = np.asarray(summary["sizes"].get(c, []), np.float64)
        if len(sizes):
            ax.hist(sizes / 1024, bins=20)
        ax.set_title(f"channel {c}")
        ax.set_xlabel("KiB per chunk")
    fig.suptitle("chunk sizes per channel")
    paths.append(_save(fig, out_dir, "sizes.png"))

    fig, ax = plt.subplots(figsize=(4 + 0.3 * W, 3.5 + 0.3 * W))
    im = ax.imshow(summary["traffic"] / 2 ** 20, cmap="viridis")
    ax.set_xlabel("destination rank")
    ax.set_ylabel("source rank")
    fig.colorbar(im, ax=ax, label="MiB")
    ax.set_title("payload bytes, rank by rank")
    paths.append(_save(fig, out_dir, "traffic.png"))

    fig, ax = plt.subplots(figsize=(6, 3))
    width = 0.8 / max(1, len(channels))
    for i, c in enumerate(channels):
        ax.bar(np.arange(W) + i * width, [summary["busy"].get((r, c), 0.0) * 1e3 for r in range(W)], width,
               label=f"channel {c}")
    ax.set_xlabel("rank")
    ax.set_ylabel("ms copying")
    ax.legend(fontsize=7)
    ax.set_title("busy time per rank and channel")
    paths.append(_save(fig, out_dir, "busy.png"))
    return paths


def _save(fig, out_dir: str, name: str) -> str:
    path = os.path.join(out_dir, name)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    import matplotlib.pyplot as plt
    plt.close(fig)
    return path


def main(argv: Optional[list] = None) -> int:
    """The CLI (``python -m cupy_symbuf.diagnostics TRACES... --out DIR``): loads the traces, prints and writes the
    report, writes the PNGs when matplotlib is installed; returns the exit status."""
    ap = argparse.ArgumentParser(prog="python -m cupy_symbuf.diagnostics", description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="+", help="trace files (Communicator.save_trace), one per rank; globs allowed")
    ap.add_argument("--out", default="symbuf-diagnostics", help="folder for the PNGs and report.txt")
    args = ap.parse_args(argv)
    paths = sorted({p for pattern in args.traces for p in (glob.glob(pattern) or [pattern])})
    try:
        traces = load(paths)
    except ValueError as exc:
        ap.error(str(exc))
    summary = summarize(traces)
    text = report(summary)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "report.txt"), "w") as f:
        f.write(text)
    print(text, end="")
    try:
        for p in plot(traces, summary, args.out):
            print(f"wrote {p}")
    except ImportError:
        print("matplotlib is not installed: report only (pip install matplotlib for the PNGs)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
