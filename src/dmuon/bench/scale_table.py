"""``dmuon plan --scale-table``: one step's communication and NS makespan across cluster sizes, as Markdown.

The cluster-scale table (README, docs/benchmarks/2026-12-04-modelled-h100-a800.md) is this module's output: per model and world
size, the critical bytes (all, and inter-node) and alpha-beta seconds of one step (``step_comm``)
for dmuon (the replicate level on HSDP), dmuon_native_hsdp (native HSDP), FSDP2 + AdamW and
gather-then-compute, and the balancer's NS makespan per rank. Everything is modelled from shape
lists; the per-collective bytes are checked against counted runs on 4 gloo ranks by
``tests/runtime/test_step_comm.py``.
"""

from __future__ import annotations

from typing import Callable, Sequence

GIB = 2**30


def scale_rows(models: Sequence[str], world_sizes: Sequence[int], plan_for: Callable[[str, int], dict]) -> list[dict]:
    """One row per (model, world size) from ``plan_for(model, world_size)``, a :func:`plan_offline` dict."""
    rows = []
    for model in models:
        for world in world_sizes:
            plan = plan_for(model, world)
            comm = plan["step_comm"]
            rows.append({
                "model": model,
                "world_size": world,
                "mesh": plan["mesh"],
                "balancer": plan["method"],
                "cost_unit": plan["cost_unit"],
                "makespan": plan["makespan"],
                "imbalance": plan["imbalance"],
                **{f"{k}_critical_bytes": comm[k]["critical_bytes"]["total"] for k in comm},
                **{f"{k}_inter_critical_bytes": comm[k]["critical_bytes"]["inter"] for k in comm},
                **{f"{k}_seconds": comm[k]["seconds"]["total"] for k in comm},
                **{f"{k}_inter_seconds": comm[k]["seconds"]["inter"] for k in comm},
            })
            if "simulation" in plan:
                rows[-1]["simulation"] = plan["simulation"]
                rows[-1]["simulation_ratios"] = plan["simulation_ratios"]
    return rows


def _makespan(row: dict) -> str:
    if row["cost_unit"].startswith("flops"):
        return f"{row['makespan'] / 1e12:.1f} TFLOP ({row['imbalance']:.3f})"
    return f"{row['makespan'] * 1e3:.1f} ms ({row['imbalance']:.3f})"


def _ratio(value: float, base: float) -> str:
    return f"{value / base:.2f}x" if base else "-"


def format_scale_table(rows: Sequence[dict]) -> str:
    """The rows as a Markdown table: per strategy critical GiB, of which inter-node, and ms, each with
    its ratio to FSDP2 + AdamW's; and the NS makespan (max/mean)."""
    lines = ["| model | ranks | dmuon (replicate level) | dmuon_native_hsdp (native HSDP) | FSDP2 + AdamW | "
             "gather-then-compute | NS makespan per rank (max/mean) |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:

        def cell(key: str, ratio: bool = True) -> str:
            figures = [(row[f"{key}_critical_bytes"] / GIB, row[f"{key}_critical_bytes"],
                        row["fsdp_adamw_critical_bytes"]),
                       (row[f"{key}_inter_critical_bytes"] / GIB, row[f"{key}_inter_critical_bytes"],
                        row["fsdp_adamw_inter_critical_bytes"])]
            (total, t, tb), (inter, i, ib) = figures
            ms, base_ms = row[f"{key}_seconds"] * 1e3, row["fsdp_adamw_seconds"] * 1e3
            if not ratio:
                return f"{total:.1f}, inter {inter:.2f} / {ms:.0f} ms"
            return (f"{total:.1f} ({_ratio(t, tb)}), inter {inter:.2f} ({_ratio(i, ib)}) / "
                    f"{ms:.0f} ms ({_ratio(ms, base_ms)})")

        lines.append(f"| {row['model']} | {row['world_size']} | {cell('dmuon')} | {cell('dmuon_native_hsdp')} | "
                     f"{cell('fsdp_adamw', False)} | {cell('gather')} | {_makespan(row)} |")
    return "\n".join(lines)


SIMULATED = ("fsdp_adamw", "gather", "dmuon", "dmuon_native_hsdp", "dmuon_rbwd", "dmuon_nfwd", "dion_all_to_all")
"""Columns of :func:`format_simulation_table`, in order."""


def format_simulation_table(rows: Sequence[dict]) -> str:
    """``dmuon plan --simulate --scale-table``: per model and world size, each strategy's simulated
    step / optimizer phase / exposed communication in ms, the step's ratio to FSDP2 + AdamW's,
    gather-then-compute's optimizer phase over dmuon's (both designs, the replicate level with
    ``returns_in_backward``, and the replicate level with its updates applied in the next forward,
    ``apply_updates="next_forward"``: ``simulate.NEXT_FORWARD``), and what keeps dmuon's busiest rank busy in its optimizer phase."""
    names = {"fsdp_adamw": "FSDP2 + AdamW", "gather": "gather-then-compute", "dmuon": "dmuon (replicate level)",
             "dmuon_native_hsdp": "dmuon_native_hsdp (native HSDP)",
             "dmuon_rbwd": "dmuon, returns in backward (rbwd)",
             "dmuon_nfwd": "dmuon, applied in the next forward (nfwd)", "dion_all_to_all": "all-to-all peer"}
    lines = ["| model | ranks | " + " | ".join(names[k] for k in SIMULATED)
             + " | dmuon step ÷ FSDP2 + AdamW's (repl / native / rbwd / nfwd) | gather's optimizer ÷ dmuon's (repl / native / "
             "rbwd / nfwd) | gather's step ÷ dmuon's (repl / native / rbwd / nfwd) | dmuon (replicate level)'s optimizer phase: NS / "
             "elementwise / "
             "intra / inter link ms |",
             "|---|---|" + "---|" * (len(SIMULATED) + 4)]
    for row in rows:
        sim, ratios = row["simulation"], row["simulation_ratios"]

        def cell(key: str) -> str:
            f = sim[key]
            step = f"{f['step_seconds'] * 1e3:.1f}"
            if key != "fsdp_adamw":
                step += f" ({ratios[key]['step_vs_fsdp_adamw']:.3f}x)"
            return f"{step} / {f['optimizer_seconds'] * 1e3:.1f} / {f['exposed_comm_seconds'] * 1e3:.1f}"

        def both(field: str, digits: int) -> str:
            return " / ".join(f"{ratios[k][field]:.{digits}f}x"
                              for k in ("dmuon", "dmuon_native_hsdp", "dmuon_rbwd", "dmuon_nfwd"))

        lines.append(f"| {row['model']} | {row['world_size']} | " + " | ".join(cell(k) for k in SIMULATED)
                     + f" | {both('step_vs_fsdp_adamw', 3)} | {both('gather_optimizer_over_this', 1)} | "
                     + f"{both('gather_step_over_this', 2)} | "
                     + " / ".join(f"{v * 1e3:.1f}" for v in sim["dmuon"]["optimizer_busy_seconds"].values()) + " |")
    return "\n".join(lines)
