"""``dmuon plan``: the ownership plan for a model or shape list, without training."""

from __future__ import annotations

import argparse
import json
import sys

from dmuon.bench.shapes import FULL_SIZE_NAMES, full_size_shapes, load_shapes_json
from dmuon.plan.balance import BALANCERS
from dmuon.plan.offline import plan_offline


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dmuon plan", description=__doc__)
    p.add_argument("--model", default="qwen2.5-7b", choices=FULL_SIZE_NAMES,
                   help="a bench model (built on the meta device) or a full-size shape list")
    p.add_argument("--size", default="small", help="size preset of the bench models")
    p.add_argument("--shapes", default=None, metavar="FILE",
                   help='JSON list of {"name": str, "shape": [m, n], "count": int}; overrides --model')
    p.add_argument("--world-size", type=int, default=8)
    p.add_argument("--balancer", default="greedy", choices=BALANCERS)
    p.add_argument("--zero", type=int, default=2, choices=[2, 3])
    p.add_argument("--json", default=None, metavar="PATH")
    p.add_argument("--show-matrices", action="store_true", help="list each rank's matrices")
    return p


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def format_plan(plan: dict, show_matrices: bool = False, max_rows: int = 16) -> str:
    lines = [
        f"world size {plan['world_size']}, balancer {plan['balancer']}, ZeRO-{plan['zero']}, "
        f"{plan['matrices']} Muon matrices, cost unit: {plan['cost_unit']}",
        f"makespan {plan['makespan']:.4g}  mean {plan['mean']:.4g}  imbalance (max/mean) {plan['imbalance']:.3f}",
        "",
        "rank  matrices  est. cost   state MiB  sent MiB  recv MiB",
    ]
    ranks = plan["ranks"]
    shown = ranks if len(ranks) <= max_rows else ranks[: max_rows // 2] + ranks[-max_rows // 2 :]
    for k, r in enumerate(shown):
        if len(ranks) > max_rows and k == max_rows // 2:
            lines.append(f"... {len(ranks) - max_rows} more ranks ...")
        lines.append(f"{r['rank']:<4}  {len(r['matrices']):<8}  {r['cost']:<10.4g}  {_mib(r['state_bytes']):<9}  "
                     f"{_mib(r['bytes_sent']):<8}  {_mib(r['bytes_received'])}")
        if show_matrices and r["matrices"]:
            lines.append("      " + ", ".join(r["matrices"]))
    g = plan["gather_bytes_per_rank"]
    worst = max(ranks, key=lambda r: r["bytes_sent"] + r["bytes_received"])
    lines.append("")
    lines.append(f"per-rank traffic per step for these matrices: dmuon max {_mib(worst['bytes_sent'] + worst['bytes_received'])} MiB "
                 f"vs gather-then-compute on FSDP2 {_mib(g['sent'] + g['received'])} MiB (sent + received)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.world_size < 1:
        print("dmuon plan: --world-size must be >= 1", file=sys.stderr)
        return 2
    groups = load_shapes_json(args.shapes) if args.shapes else full_size_shapes(args.model, size=args.size)
    plan = plan_offline(groups, args.world_size, args.balancer, args.zero)
    print(format_plan(plan, args.show_matrices))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(plan, f, indent=1)
        print(f"wrote {args.json}")
    return 0
