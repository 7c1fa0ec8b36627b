"""``dmuon plan``: the ownership plan for a model or shape list, without training."""

from __future__ import annotations

import json
import sys

from dmuon.bench.plan_options import NS_DTYPES, build_parser
from dmuon.bench.plan_report import format_comparison, format_plan, format_recommendation
from dmuon.bench.scale_table import format_scale_table, format_simulation_table, scale_rows
from dmuon.bench.shapes import FULL_SIZE_NAMES, full_size_shapes, load_shapes_json, pipeline_stages
from dmuon.costmodel.offline import expand, plan_offline
from dmuon.costmodel.recommend import recommend
from dmuon.plan.profile import CostTable, cached_costs, load_costs_json, profile_costs
from dmuon.costmodel.sim_config import HARDWARE_PRESETS, Hardware, SimOptions
from dmuon.costmodel.simulate import SIM_STRATEGIES
from dmuon.costmodel.traffic import AlphaBeta

# FSDP2's parameters and gradients in the comparison figures: fp32, no mixed precision.
FSDP_ELEM_BYTES = 4
# What `--balancer all` compares ("greedy" is LPT; "auto" is one of the others).
COMPARED = ("round_robin", "lpt", "milp")


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


def _report(args, plans: list[dict]) -> int:
    """Prints the plan (with ``--balancer all``, the comparison and the fastest plan), writes its trace and
    its JSON."""
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
    return _report(args, plans)
