"""A picture (PNG) of a simulated step's Chrome trace, from ``dmuon plan --simulate --trace``.

    python -m dmuon.bench.trace_plot TRACE.json OUT.png [--rank K] [--title TEXT]

One panel per strategy in the trace (dmuon above FSDP2 + AdamW by default), one row per lane of rank
``K`` (its compute, NS, FSDP2's and dmuon's collectives), each task a bar coloured by what it is.
Needs matplotlib (the ``bench`` and ``test`` extras).
"""

from __future__ import annotations

import argparse
import json
import sys

COLOURS = {"forward": "#4c72b0", "backward": "#55a868", "elementwise": "#c44e52", "ns": "#8172b2",
           "fsdp": "#937860", "dmuon": "#dd8452", "other": "#8c8c8c"}
"""Bar colours: compute by phase, elementwise work (AdamW, momentum, applies), NS, FSDP2's collectives,
dmuon's, and anything else."""

LEGEND = {"forward": "forward", "backward": "backward", "elementwise": "elementwise (AdamW, momentum, applies)",
          "ns": "Newton-Schulz (owners)", "fsdp": "FSDP2 collectives", "dmuon": "dmuon collectives",
          "other": "other"}


def _colour_key(event: dict, lane: str) -> str:
    phase, kind = event["cat"].split(",")
    if kind == "collective":
        return "fsdp" if lane.startswith("FSDP2") else "dmuon" if lane.startswith("dmuon") else "other"
    if kind in ("ns", "elementwise"):
        return kind
    return phase if phase in ("forward", "backward") else "backward" if phase == "next_forward" else "other"


def read_lanes(trace: dict, rank: int) -> list[tuple[str, dict[str, list[dict]]]]:
    """Per strategy (in the trace's order): its rank ``rank``'s lanes, ``{lane name: [events]}`` in order.

    Raises:
        ValueError: The trace does not show ``rank``.
    """
    events = trace["traceEvents"]
    processes = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    wanted = {pid: name.rsplit(" rank ", 1)[0] for pid, name in processes.items()
              if name.endswith(f" rank {rank}")}
    if not wanted:
        shown = sorted({name.rsplit(" rank ", 1)[1] for name in processes.values()}, key=int)
        raise ValueError(f"the trace shows ranks {', '.join(shown)}, not {rank}")
    lane_names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
                  if e["ph"] == "M" and e["name"] == "thread_name"}
    out = []
    for pid in sorted(wanted):
        tids = sorted(tid for p, tid in lane_names if p == pid)
        lanes = {lane_names[(pid, tid)]: sorted((e for e in events if e["ph"] == "X" and e["pid"] == pid
                                                 and e["tid"] == tid), key=lambda e: e["ts"]) for tid in tids}
        out.append((wanted[pid], {name: evs for name, evs in lanes.items() if evs}))
    return out


def plot(trace: dict, path: str, rank: int = 0, title: str | None = None) -> None:
    """Draws rank ``rank``'s lanes of every strategy in ``trace`` into the PNG ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    panels = read_lanes(trace, rank)
    heights = [max(len(lanes), 1) for _, lanes in panels]
    fig, axes = plt.subplots(len(panels), 1, figsize=(14, 1.2 + 0.45 * sum(heights)), sharex=True,
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    used = set()
    end_ms = 0.0
    for ax, (strategy, lanes) in zip(axes[:, 0], panels):
        names = list(lanes)
        for row, name in enumerate(names):
            for e in lanes[name]:
                key = _colour_key(e, name)
                used.add(key)
                start, width = e["ts"] / 1e3, e["dur"] / 1e3
                end_ms = max(end_ms, start + width)
                ax.broken_barh([(start, width)], (row - 0.4, 0.8), facecolors=COLOURS[key], edgecolor="white",
                               linewidth=0.2)
        last = max((e["ts"] + e["dur"]) / 1e3 for evs in lanes.values() for e in evs)
        ax.axvline(last, color="black", linewidth=0.8, linestyle="--")
        ax.text(last, len(names) - 0.5, f" {last:.1f} ms", va="top", fontsize=8)
        ax.set_yticks(range(len(names)), names, fontsize=8)
        ax.set_ylim(len(names) - 0.5, -0.5)
        ax.set_title(f"{strategy}, rank {rank}", fontsize=10, loc="left")
    axes[-1, 0].set_xlabel("ms from the step's first all-gather (simulated)")
    axes[-1, 0].set_xlim(0, end_ms * 1.06)
    fig.legend(handles=[Patch(color=COLOURS[k], label=LEGEND[k]) for k in COLOURS if k in used],
               loc="lower center", ncol=len(used), fontsize=8, frameon=False)
    info = trace.get("otherData", {})
    fig.suptitle(title or f"One simulated step, {info.get('world', '?')} GPUs (mesh {info.get('mesh', '?')}, "
                 f"{info.get('hardware', '?')}): modelled, not measured", fontsize=11)
    fig.tight_layout(rect=(0, 0.04, 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dmuon.bench.trace_plot", description=__doc__.splitlines()[0])
    parser.add_argument("trace", help="a trace from dmuon plan --simulate --trace")
    parser.add_argument("png", help="where the picture goes")
    parser.add_argument("--rank", type=int, default=0, help="the rank drawn (default 0)")
    parser.add_argument("--title", default=None)
    args = parser.parse_args(argv)
    try:
        with open(args.trace) as f:
            trace = json.load(f)
        plot(trace, args.png, args.rank, args.title)
    except (OSError, ValueError, KeyError) as err:
        print(f"trace_plot: {err}", file=sys.stderr)
        return 2
    print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
