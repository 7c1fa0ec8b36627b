"""``dmuon plan``'s text reports: a plan with its traffic, step and simulation figures, the
``--balancer all`` comparison and the ``--recommend`` report (:mod:`dmuon.bench.plan_cli` prints them)."""

from __future__ import annotations

from dmuon.costmodel.recommend import recommended_code
from dmuon.costmodel.simulate import SIM_STRATEGIES
from dmuon.costmodel.traffic import STEP_STRATEGIES


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
