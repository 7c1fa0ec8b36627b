"""``dmuon plan``: the ownership plan for a model or shape list, without training."""

from __future__ import annotations

import json
import sys

from dmuon.bench.plan_options import NS_DTYPES, build_parser
from dmuon.bench.scale_table import format_scale_table, format_simulation_table, scale_rows
from dmuon.bench.shapes import FULL_SIZE_NAMES, full_size_shapes, load_shapes_json, pipeline_stages
from dmuon.costmodel.offline import expand, plan_offline
from dmuon.costmodel.recommend import recommend, recommended_code
from dmuon.plan.profile import CostTable, cached_costs, load_costs_json, profile_costs
from dmuon.costmodel.sim_config import HARDWARE_PRESETS, Hardware, SimOptions
from dmuon.costmodel.simulate import SIM_STRATEGIES
from dmuon.costmodel.traffic import STEP_STRATEGIES, AlphaBeta

# FSDP2's parameters and gradients in the comparison figures: fp32, no mixed precision.
FSDP_ELEM_BYTES = 4
# What `--balancer all` compares ("greedy" is LPT; "auto" is one of the others).
COMPARED = ("round_robin", "lpt", "milp")


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def _both(t: dict) -> str:
    """Sent + received MiB, and the inter-node part of it."""
    return f"{_mib(t['sent'] + t['received'])} MiB (inter-node {_mib(t['inter_sent'] + t['inter_received'])})"


def _traffic_lines(plan: dict) -> list[str]:
    """The traffic summary: dmuon's exchange next to what FSDP2 and gather-then-compute move."""
    ranks = plan["ranks"]
    replicate, shard = plan["mesh"]
    worst = max(ranks, key=lambda r: r["bytes_sent"] + r["bytes_received"])
    worst_inter = max(r["inter_sent"] + r["inter_received"] for r in ranks)
    crit = plan["critical_path_bytes"]
    resharding = "re-gathered in backward" if plan["zero"] == 3 else "gathered once"
    if plan.get("root_regathered"):
        resharding += ", the root gathered again at the start of backward (--root-reshard)"
    if replicate > 1:
        exchange = ("dmuon's exchange, the replicate level (the gradient's column slices reduce-scattered across replicas "
                    "in place of FSDP2's all-reduce, then the directions and updates)")
        fsdp2 = "next to FSDP2 + AdamW's collectives"
        native = (f", dmuon_native_hsdp (native HSDP's exchange, on top of FSDP2's all-reduce) "
                  f"{_mib(crit['dmuon_native_hsdp'])} MiB")
    else:
        exchange, fsdp2, native = "dmuon's exchange", "on top of FSDP2's own collectives", ""
    return [
        f"mesh {replicate} x {shard} (replicate x shard); dmuon sends {plan['wire_bytes']}-byte elements, "
        f"FSDP2 {plan['fsdp_elem_bytes']}-byte parameters and gradients, weights {resharding} (--zero {plan['zero']})",
        f"per-rank traffic per step for these matrices (sent + received): {exchange} max "
        f"{_mib(worst['bytes_sent'] + worst['bytes_received'])} MiB (inter-node max {_mib(worst_inter)}), "
        f"{fsdp2} {_both(plan['fsdp2_bytes_per_rank'])}; "
        f"gather-then-compute {_both(plan['gather_bytes_per_rank'])} including FSDP2's",
        f"critical path (most bytes one rank sends or receives per step): dmuon {_mib(crit['dmuon'])} MiB"
        f"{native}, gather-then-compute {_mib(crit['gather_then_compute'])} MiB, FSDP2 collectives "
        f"{_mib(crit['fsdp2'])} MiB",
    ]


# Design labels of the HSDP comparison, in plan["hsdp_designs"]' order.
_DESIGN_LABELS = {
    "fsdp2_adamw": "FSDP2 + AdamW (gradient all-reduce)",
    "a": "native HSDP, dmuon_native_hsdp (FSDP2's all-reduce + update to the replicas)",
    "b": "replicate level, dmuon (gradient column reduce-scatter + update to the replicas)",
    "ddp": "torch's DistributedDataParallel + dmuon (DDP's all-reduce + the updates to every rank)",
}


_STEP_LABELS = {"dmuon": "dmuon (replicate level on HSDP: FSDP2 in the node + dmuon's exchange)",
                "dmuon_native_hsdp": "dmuon_native_hsdp (native HSDP: FSDP2's HSDP + dmuon's exchange)",
                "fsdp_adamw": "FSDP2 + AdamW", "gather": "gather-then-compute"}


def _step_lines(plan: dict) -> list[str]:
    """One step's collectives per strategy: summed per-collective critical bytes and alpha-beta seconds."""
    comm = plan.get("step_comm")
    if not comm:
        return []
    base, base_s = comm["fsdp_adamw"]["critical_bytes"], comm["fsdp_adamw"]["seconds"]["total"]

    def ratio(value: float, of: float) -> str:
        return f"{value / of:.3f}x" if of else "-"

    lines = ["one training step, Muon matrices (sum over collectives of the most one rank sends or receives; "
             "alpha-beta seconds, no overlap; ratios to FSDP2 + AdamW's):"]
    for key in STEP_STRATEGIES:
        crit, secs = comm[key]["critical_bytes"], comm[key]["seconds"]
        lines.append(f"  {_STEP_LABELS[key]}: {_mib(crit['total'])} MiB ({ratio(crit['total'], base['total'])}; "
                     f"intra {_mib(crit['intra'])}, inter {_mib(crit['inter'])} "
                     f"({ratio(crit['inter'], base['inter'])})), "
                     f"{secs['total'] * 1e3:.2f} ms ({ratio(secs['total'], base_s)}; inter "
                     f"{secs['inter'] * 1e3:.2f}), {comm[key]['collectives']['total']} collectives")
    return lines


SIM_LABELS = {"fsdp_adamw": "FSDP2 + AdamW", "gather": "gather-then-compute",
              "dmuon": "dmuon (replicate level on HSDP)", "dmuon_native_hsdp": "dmuon_native_hsdp (native HSDP)",
              "dmuon_rbwd": "dmuon, returns in backward", "dmuon_nfwd": "dmuon, applied in next forward",
              "dion_all_to_all": "all-to-all peer (dion, DistMuon)", "ddp_dmuon": "torch's DDP + dmuon"}
"""Row names of the simulation's table, in :data:`SIM_STRATEGIES` order."""


def _simulation_lines(plan: dict) -> list[str]:
    """The simulated step per strategy, and the settings it ran with."""
    sim = plan.get("simulation")
    if not sim:
        return []
    m = plan["simulation_model"]
    hw = m["hardware"]
    ratios = plan["simulation_ratios"]
    ns = "profiled" if m["ns_seconds"] else m["ns_method"]
    lines = [f"one training step, simulated on every rank ({hw['name']}: {hw['compute_flops'] / 1e12:g} TFLOP/s "
             f"forward+backward, NS {hw['ns_flops'] / 1e12:g} TFLOP/s ({ns}), "
             f"elementwise {hw['elementwise_bytes'] / 1e9:g} GB/s, links {hw['intra_bandwidth'] / 1e9:g} / "
             f"{hw['inter_bandwidth'] / 1e9:g} GB/s and {hw['intra_latency'] * 1e6:g} / "
             f"{hw['inter_latency'] * 1e6:g} us "
             f"intra / inter; {m['tokens_per_gpu']} tokens per GPU, ZeRO-{m['zero']}, {m['return_waves']} return "
             f"waves{'; serialised' if not m['overlap'] else ''}):",
             f"  {'strategy':<34} {'step ms':>9} {'vs AdamW':>9} {'optimizer ms':>13} {'gather opt /':>13} "
             f"{'exposed comm ms':>16}  optimizer phase, busiest rank: NS / elementwise / intra / inter link ms"]
    for key in sim:  # SIM_STRATEGIES, then torch's DDP + dmuon on one rank per replica
        f, r = sim[key], ratios[key]
        over = r["gather_optimizer_over_this"]
        lines.append(f"  {SIM_LABELS[key]:<34} {f['step_seconds'] * 1e3:>9.1f} {r['step_vs_fsdp_adamw']:>8.3f}x "
                     f"{f['optimizer_seconds'] * 1e3:>13.1f} {(f'{over:.2f}x' if over else '-'):>13} "
                     f"{f['exposed_comm_seconds'] * 1e3:>16.1f}  "
                     + " / ".join(f"{v * 1e3:.1f}" for v in f["optimizer_busy_seconds"].values()))
    lines.append("  applied in next forward: ExecutionConfig(apply_updates=\"next_forward\"), each unit's updates applied "
                 "in the next forward just before its all-gather; its step is the period from one forward's end to the next's")
    return lines


def _design_lines(plan: dict) -> list[str]:
    """One line per HSDP replicate-level design: inter-node bytes of the Muon matrices per step."""
    designs = plan.get("hsdp_designs")
    if not designs:
        return []
    base = designs["fsdp2_adamw"]["inter"]["total"]
    rest = designs["non_muon_all_reduce"]
    lines = ["HSDP replicate level, inter-node bytes per step for the Muon matrices "
             "(total over ranks; critical path = most one rank sends or receives):"]
    for key, label in _DESIGN_LABELS.items():
        if key not in designs:
            continue  # "ddp": one rank per replica only
        inter = designs[key]["inter"]
        ratio = f"{inter['total'] / base:.3f}x" if base else "-"
        lines.append(f"  {label}: total {_mib(inter['total'])} MiB ({ratio} FSDP2 + AdamW), "
                     f"critical path {_mib(inter['critical'])} MiB")
    lines.append(f"  non-Muon parameters' all-reduce, the same under every design: total {_mib(rest['total'])} MiB, "
                 f"critical path {_mib(rest['critical'])} MiB")
    return lines


def _expert_lines(plan: dict) -> list[str]:
    """The expert slices' owners: the layout, how the slices and dense matrices spread over the ranks,
    how many slices their owner already holds rows of, and the largest NS batch."""
    x = plan.get("experts")
    if not x:
        return []
    slices, dense, held = x["slices_per_rank"], x["dense_per_rank"], x["owned_where_held"]
    owning = sum(1 for n in slices if n)
    big = x["largest_batch"]
    dim = "whole experts per rank (dim 0)" if x["fsdp_dim"] == 0 else "each expert's rows split (dim 1)"
    return [
        f"routed experts: ep {x['ep']} x efsdp {x['efsdp']} in each shard dim, {min(x['experts_per_ep_rank'])}-"
        f"{max(x['experts_per_ep_rank'])} experts per ep rank, FSDP2 over efsdp: {dim}",
        f"expert-slice owners: {x['slices']} slices over {owning} of {len(slices)} ranks ({min(slices)}-{max(slices)} "
        f"per rank), {x['dense']} dense matrices ({min(dense)}-{max(dense)} per rank); {sum(held)} slices owned "
        f"on a rank holding their rows ({sum(held) / max(1, x['slices']):.1%}); largest NS batch "
        f"{big['size']} x {tuple(big['shape']) if big['shape'] else '-'} (rank {big['rank']})",
    ]


def format_plan(plan: dict, show_matrices: bool = False, max_rows: int = 16) -> str:
    lines = [
        f"world size {plan['world_size']}, balancer {plan['balancer']}, "
        f"{plan['matrices']} Muon matrices, cost unit: {plan['cost_unit']}",
        f"makespan {plan['makespan']:.4g}  mean {plan['mean']:.4g}  imbalance (max/mean) {plan['imbalance']:.3f}"
        f"  ({plan['method']}, {plan['status']}, {plan['solve_seconds']:.3f}s, costs: {plan['cost_source']})",
        *[f"note: {n}" for n in plan.get("notes", ())],
        "",
        "rank  matrices  est. cost   state MiB  sent MiB  recv MiB  intra MiB  inter MiB",
    ]
    ranks = plan["ranks"]
    shown = ranks if len(ranks) <= max_rows else ranks[: max_rows // 2] + ranks[-max_rows // 2 :]
    for k, r in enumerate(shown):
        if len(ranks) > max_rows and k == max_rows // 2:
            lines.append(f"... {len(ranks) - max_rows} more ranks ...")
        lines.append(f"{r['rank']:<4}  {len(r['matrices']):<8}  {r['cost']:<10.4g}  {_mib(r['state_bytes']):<9}  "
                     f"{_mib(r['bytes_sent']):<8}  {_mib(r['bytes_received']):<8}  "
                     f"{_mib(r['intra_sent'] + r['intra_received']):<9}  {_mib(r['inter_sent'] + r['inter_received'])}")
        if show_matrices and r["matrices"]:
            lines.append("      " + ", ".join(r["matrices"]))
    lines.append("")
    lines.extend(_expert_lines(plan))
    lines.extend(_traffic_lines(plan))
    lines.extend(_design_lines(plan))
    lines.extend(_step_lines(plan))
    lines.extend(_simulation_lines(plan))
    return "\n".join(lines)


def _cost_table(args, groups) -> CostTable | None:
    if args.costs:
        return load_costs_json(args.costs)
    if args.analytical:
        return None
    counts: dict[tuple[int, int], int] = {}
    for m in expand(groups):
        counts[m.shape] = counts.get(m.shape, 0) + 1
    if not counts:
        return None
    ns = {"steps": args.ns_steps, "dtype": NS_DTYPES[args.ns_dtype]}
    if args.profile:
        table = profile_costs(counts, ns_kwargs=ns, budget_s=args.profile_budget, max_batch=args.max_batch)
        print(f"profiled {table.measured} entries on {table.device} in {table.profile_seconds:.1f}s "
              f"({len(table)} in the table)")
        return table
    return cached_costs(counts, ns_kwargs=ns)


def format_comparison(plans: list[dict]) -> str:
    """The ``--balancer all`` table: one row per balancer."""
    lines = [f"{'balancer':<12} {'makespan':>11} {'mean':>11} {'imbalance':>9} {'max state MiB':>13} "
             f"{'solve s':>8}  status"]
    for p in plans:
        state = max(r["state_bytes"] for r in p["ranks"])
        status = p["status"] if p["method"] == p["balancer"] else f"{p['status']} (via {p['method']})"
        lines.append(f"{p['balancer']:<12} {p['makespan']:>11.4g} {p['mean']:>11.4g} {p['imbalance']:>9.4f} "
                     f"{_mib(state):>13} {p['solve_seconds']:>8.3f}  {status}")
    return "\n".join(lines)


def hardware_from_args(args) -> Hardware:
    """The --hardware preset with every figure given on the command line in its place."""
    preset = HARDWARE_PRESETS[args.hardware]
    links = preset.links
    links = AlphaBeta(
        intra_bandwidth=links.intra_bandwidth if args.intra_bandwidth is None else args.intra_bandwidth * 1e9,
        inter_bandwidth=links.inter_bandwidth if args.inter_bandwidth is None else args.inter_bandwidth * 1e9,
        intra_latency=links.intra_latency if args.intra_latency is None else args.intra_latency / 1e6,
        inter_latency=links.inter_latency if args.inter_latency is None else args.inter_latency / 1e6)
    host = {"dispatch_seconds": getattr(args, "dispatch_us", None),
            "dtensor_dispatch_seconds": getattr(args, "dtensor_dispatch_us", None),
            "dtensor_layout_seconds": getattr(args, "layout_us", None),
            "fsdp_unit_seconds": getattr(args, "fsdp_unit_us", None)}
    given = [name for name, value in (("compute", args.compute_tflops), ("ns", args.ns_tflops),
                                      ("elementwise", args.elementwise_gbps), ("links", args.intra_bandwidth),
                                      ("links", args.inter_bandwidth), ("links", args.intra_latency),
                                      ("links", args.inter_latency), *(("host", v) for v in host.values()))
             if value is not None]
    return Hardware(
        preset.name + (f" ({', '.join(sorted(set(given)))} overridden)" if given else ""),
        preset.compute_flops if args.compute_tflops is None else args.compute_tflops * 1e12,
        preset.ns_flops if args.ns_tflops is None else args.ns_tflops * 1e12,
        preset.elementwise_bytes if args.elementwise_gbps is None else args.elementwise_gbps * 1e9,
        links, op_links=dict(preset.op_links),
        **{k: getattr(preset, k) if v is None else v / 1e6 for k, v in host.items()})


def _profiled(table: CostTable | None):
    """NS seconds per ``(shape, batch)`` from a measured cost table (linear in the batch where unmeasured)."""
    if table is None or table.unit != "seconds":
        raise ValueError("--sim-ns profile needs measured costs (--costs FILE, --profile, or a cache covering "
                         "the shapes); the analytical table is in FLOPs")

    def seconds(shape: tuple[int, int], batch: int) -> float:
        if (shape, batch) in table:
            return table[(shape, batch)]
        return batch * table[(shape, 1)]

    return seconds


def sim_options_from_args(args, table: CostTable | None) -> SimOptions:
    if args.tokens_per_gpu < 0:
        raise ValueError(f"--tokens-per-gpu must be >= 0, got {args.tokens_per_gpu}")
    if not args.non_gemm_ms >= 0:
        raise ValueError(f"--non-gemm-ms must be >= 0, got {args.non_gemm_ms}")
    profile = args.sim_ns == "profile"
    return SimOptions(tokens_per_gpu=args.tokens_per_gpu, non_gemm_seconds=args.non_gemm_ms / 1e3,
                      ns_method="auto" if profile else args.sim_ns,
                      ns_steps=args.ns_steps, ns_seconds=_profiled(table) if profile else None,
                      overlap=not args.serial)


def _plan(args, groups, world_size: int, balancer: str, table, model: AlphaBeta) -> dict:
    if args.return_waves < 1:
        raise ValueError(f"--return-waves must be >= 1, got {args.return_waves}")
    if args.hop_a_spread is not None and args.hop_a_spread < 1:
        raise ValueError(f"--hop-a-spread must be >= 1, got {args.hop_a_spread}")
    return plan_offline(groups, world_size, balancer, args.zero, costs=table, ns_steps=args.ns_steps,
                        time_limit_s=args.time_limit, memory_factor=args.memory_factor,
                        ranks_per_node=args.ranks_per_node, wire_bytes=NS_DTYPES[args.ns_dtype].itemsize,
                        fsdp_elem_bytes=FSDP_ELEM_BYTES, param_bytes=NS_DTYPES[args.param_dtype].itemsize,
                        reduce_bytes=NS_DTYPES[args.reduce_dtype].itemsize, alpha_beta=model,
                        hardware=hardware_from_args(args) if args.simulate else None,
                        sim_options=sim_options_from_args(args, table) if args.simulate else None,
                        max_waves=args.return_waves, hop_a_spread=args.hop_a_spread,
                        root_regathered=args.root_reshard, trace=_trace_request(args), ep=args.ep)


def _trace_request(args) -> dict | None:
    """``plan_offline``'s ``trace`` keywords from ``--trace`` (None without it)."""
    if getattr(args, "trace", None) is None:
        return None
    if not args.simulate:
        raise ValueError("--trace draws the simulated step: add --simulate")
    strategies = [s for s in args.trace_strategies.split(",") if s]
    unknown = [s for s in strategies if s not in SIM_STRATEGIES]
    if unknown or not strategies:
        raise ValueError(f"--trace-strategies takes names from {SIM_STRATEGIES}, got {args.trace_strategies!r}")
    ranks = None
    if args.trace_ranks is not None:
        try:
            ranks = [int(k) for k in args.trace_ranks.split(",") if k]
        except ValueError:
            raise ValueError(f"--trace-ranks takes rank numbers, got {args.trace_ranks!r}") from None
    return {"strategies": strategies, "ranks": ranks}


def write_trace(plan: dict, path: str) -> None:
    """Moves the plan's ``simulation_trace`` to ``path`` (JSON), saying where it went."""
    trace = plan.pop("simulation_trace")
    with open(path, "w") as f:
        json.dump(trace, f)
    shown = trace["otherData"]
    print(f"wrote {path}: the simulated step of {', '.join(shown['last_task_end_ms'])} on ranks "
          f"{shown['ranks_shown']} (Chrome trace: open it in Perfetto or chrome://tracing)")


def _scale_table(args, model: AlphaBeta) -> int:
    names = [m for m in args.scale_table.split(",") if m]
    unknown = [m for m in names if m not in FULL_SIZE_NAMES]
    try:
        sizes = [int(w) for w in args.world_sizes.split(",") if w]
    except ValueError:
        sizes = []
    if unknown or not names:
        print(f"dmuon plan: --scale-table takes models from {FULL_SIZE_NAMES}, got {args.scale_table!r}",
              file=sys.stderr)
        return 2
    if args.ranks_per_node is None:
        args.ranks_per_node = 8
    if not sizes or any(w < 1 or w % args.ranks_per_node for w in sizes):
        print(f"dmuon plan: --world-sizes must be positive multiples of --ranks-per-node ({args.ranks_per_node}), "
              f"got {args.world_sizes!r}", file=sys.stderr)
        return 2
    groups = {m: full_size_shapes(m) for m in names}
    try:
        rows = scale_rows(names, sizes, lambda m, w: _plan(args, groups[m], w, args.balancer,
                                                           _cost_table(args, groups[m]), model))
    except (OSError, ValueError) as err:
        print(f"dmuon plan: {err}", file=sys.stderr)
        return 2
    print(format_simulation_table(rows) if args.simulate else format_scale_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows}, f, indent=1)
        print(f"wrote {args.json}")
    return 0


def _pipeline(args, groups, model: AlphaBeta) -> int:
    """``--pp P``: each stage's plan on its own data-parallel ranks (world size / P), one after another."""
    if args.pp < 1 or args.world_size % args.pp:
        print(f"dmuon plan: --pp must be >= 1 and divide --world-size ({args.world_size}), got {args.pp}",
              file=sys.stderr)
        return 2
    dp = args.world_size // args.pp
    if args.ranks_per_node is not None and dp % args.ranks_per_node:
        print(f"dmuon plan: --ranks-per-node must divide each stage's {dp} data-parallel ranks", file=sys.stderr)
        return 2
    if args.balancer == "all":
        print("dmuon plan: --balancer all compares one plan; with --pp name one balancer", file=sys.stderr)
        return 2
    plans = []
    try:
        for stage, stage_groups in enumerate(pipeline_stages(groups, args.pp)):
            plans.append(_plan(args, stage_groups, dp, args.balancer, _cost_table(args, stage_groups), model))
    except (OSError, ValueError) as err:
        print(f"dmuon plan: {err}", file=sys.stderr)
        return 2
    for stage, plan in enumerate(plans):
        print(f"pipeline stage {stage} of {args.pp}: {dp} data-parallel ranks")
        print(format_plan(plan, args.show_matrices))
        print("")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"pp": args.pp, "stages": plans}, f, indent=1)
        print(f"wrote {args.json}")
    return 0


def format_recommendation(rec: dict, what: str) -> str:
    """The ``--recommend`` report: the fastest configuration as code, its step against FSDP2 + AdamW's,
    what it asks of the user, and every candidate."""
    best, base = rec["recommended"], rec["fsdp_adamw"]["step_seconds"]
    replicate, shard = rec["mesh"]
    lines = [f"recommended for {what} on {rec['world_size']} GPUs ({replicate} x {shard}: nodes x GPUs per node), "
             f"ZeRO-{rec['zero']}, {rec['hardware']} (simulated step: modelled, not measured):",
             f"  layout {best['layout']}, ExecutionConfig: {best['execution']}, balancer {best['balancer']}",
             *[f"    {line}" for line in recommended_code(rec)],
             f"  predicted step {best['step_seconds'] * 1e3:.1f} ms against FSDP2 + AdamW's {base * 1e3:.1f} ms "
             f"({best['vs_fsdp_adamw']:.3f}x; optimizer phase {best['optimizer_seconds'] * 1e3:.1f} ms, against "
             f"{rec['fsdp_adamw']['optimizer_seconds'] * 1e3:.1f} ms)"]
    if best["asks"]:
        lines.append("  what it asks of you:")
        lines += [f"    {choice}: {text}" for choice, text in best["asks"].items()]
    else:
        lines.append("  what it asks of you: nothing beyond what AdamW asks")
    lines.append(f"  (among candidates within {rec['tie'] * 100:g}% of the fastest, the one asking least)")
    lines.append("candidates, fastest first:")
    lines.append(f"  {'layout':<16} {'execution':<20} {'balancer':<12} {'step ms':>9} {'vs AdamW':>9} "
                 f"{'optimizer ms':>13} {'imbalance':>10}")
    for c in rec["candidates"]:
        lines.append(f"  {c['layout']:<16} {c['execution']:<20} {c['balancer']:<12} {c['step_seconds'] * 1e3:>9.1f} "
                     f"{c['vs_fsdp_adamw']:>8.3f}x {c['optimizer_seconds'] * 1e3:>13.1f} {c['imbalance']:>10.3f}")
    return "\n".join(lines)


def _recommend(args, groups) -> int:
    """``dmuon plan --recommend``."""
    gpus_per_node = args.ranks_per_node
    if gpus_per_node is None:
        gpus_per_node = 8 if args.world_size % 8 == 0 else args.world_size
    balancers = ("greedy", "round_robin", "milp")
    try:
        import scipy  # noqa: F401 - the MILP's solver
    except ImportError:
        balancers = ("greedy", "round_robin")
        print("note: scipy is not installed: the MILP balancer is not tried (pip install 'dmuon[milp]')")
    try:
        table = _cost_table(args, groups)
        if args.return_waves < 1:
            raise ValueError(f"--return-waves must be >= 1, got {args.return_waves}")
        rec = recommend(groups, args.world_size, gpus_per_node, hardware_from_args(args),
                        sim_options_from_args(args, table), zero=args.zero, balancers=balancers, costs=table,
                        ns_steps=args.ns_steps, wire_bytes=NS_DTYPES[args.ns_dtype].itemsize,
                        param_bytes=NS_DTYPES[args.param_dtype].itemsize,
                        reduce_bytes=NS_DTYPES[args.reduce_dtype].itemsize, max_waves=args.return_waves,
                        time_limit_s=args.time_limit, memory_factor=args.memory_factor, ep=args.ep)
    except (OSError, ValueError) as err:
        print(f"dmuon plan: {err}", file=sys.stderr)
        return 2
    print(format_recommendation(rec, args.shapes or args.model))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rec, f, indent=1)
        print(f"wrote {args.json}")
    return 0


def _ep_problem(args, groups) -> str | None:
    """What is wrong with ``--ep`` for these shapes and ranks (None: nothing)."""
    moe = any(getattr(g, "experts", 0) for g in groups)
    if moe and args.pp != 1:
        return "--pp: pipeline stages of an MoE model (routed-expert stacks) are not modelled"
    if args.ep is None:
        return None
    if not moe:
        return f"--ep {args.ep}: {args.shapes or args.model} has no routed experts (--ep is for an MoE model)"
    shard = args.ranks_per_node or (8 if args.recommend and args.world_size % 8 == 0 else args.world_size)
    if args.ep < 1 or args.ep > args.world_size or shard % args.ep:
        return (f"--ep ({args.ep}) must divide the ranks each parameter is sharded over ({shard}: --ranks-per-node "
                f"under HSDP, else --world-size)")
    return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.ddp:
        if args.ranks_per_node not in (None, 1):
            print("dmuon plan: --ddp is the (N, 1) layout, one rank per replica; drop --ranks-per-node",
                  file=sys.stderr)
            return 2
        args.ranks_per_node = 1
    model = hardware_from_args(args).links
    if args.scale_table is not None:
        if args.trace is not None:
            print("dmuon plan: --trace draws one configuration's step, not a --scale-table", file=sys.stderr)
            return 2
        return _scale_table(args, model)
    if args.world_size < 1:
        print("dmuon plan: --world-size must be >= 1", file=sys.stderr)
        return 2
    if args.ranks_per_node is not None and (args.ranks_per_node < 1 or args.world_size % args.ranks_per_node):
        print("dmuon plan: --ranks-per-node must divide --world-size", file=sys.stderr)
        return 2
    groups = load_shapes_json(args.shapes) if args.shapes else full_size_shapes(args.model, size=args.size)
    problem = _ep_problem(args, groups)
    if problem:
        print(f"dmuon plan: {problem}", file=sys.stderr)
        return 2
    if args.pp != 1:
        if args.recommend or args.trace is not None:
            print("dmuon plan: --pp plans each stage; --recommend and --trace take one stage's shapes (--shapes)",
                  file=sys.stderr)
            return 2
        return _pipeline(args, groups, model)
    if args.recommend:
        return _recommend(args, groups)
    try:
        table = _cost_table(args, groups)
        names = COMPARED if args.balancer == "all" else (args.balancer,)
        plans = [_plan(args, groups, args.world_size, name, table, model) for name in names]
    except (OSError, ValueError) as err:
        print(f"dmuon plan: {err}", file=sys.stderr)
        return 2
    if args.save_costs and table is not None:
        with open(args.save_costs, "w") as f:
            json.dump(table.to_records(), f, indent=1)
        print(f"wrote {args.save_costs} ({len(table)} entries)")
    if args.balancer == "all":
        # The fastest plan is the one reported in full (ties: the simpler balancer).
        plan = dict(min(plans, key=lambda p: p["makespan"]))
        plan["comparison"] = [{k: p[k] for k in ("balancer", "method", "status", "makespan", "mean", "imbalance",
                                                   "solve_seconds", "lower_bound")}
                              | {"max_state_bytes": max(r["state_bytes"] for r in p["ranks"])} for p in plans]
        print(format_comparison(plans))
        print("")
        print(f"best: {plan['balancer']}")
    else:
        plan = plans[0]
    trace = plan.pop("simulation_trace", None)
    for other in plans:
        other.pop("simulation_trace", None)
    print(format_plan(plan, args.show_matrices))
    if trace is not None:
        write_trace({"simulation_trace": trace}, args.trace)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(plan, f, indent=1)
        print(f"wrote {args.json}")
    return 0
