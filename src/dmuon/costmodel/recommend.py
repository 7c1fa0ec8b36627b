"""A configuration for a cluster: the layout, balancer and ``ExecutionConfig`` whose simulated step is fastest.

:func:`recommend` plans the matrices with each balancer, simulates one step
(:func:`~dmuon.costmodel.simulate.simulate`) for every way dmuon can run on the mesh, and
returns them all, fastest first, with FSDP2 + AdamW's step beside them. The mesh is the one the
simulation prices: ``(nodes, GPUs per node)``, FSDP2 sharding inside a node (its collectives on the
intra-node links) and replicating across nodes, or one node's 1-D FSDP2. A 1-D FSDP2 mesh across
nodes is not among the candidates: the model prices the shard level at intra-node links.

The choices and what each asks of the user:

* **layout** on more than one node: ``"replicate level"`` (FSDP2 over ``mesh["shard"]``, dmuon
  given ``hsdp_mesh=mesh`` reduces across replicas) or ``"native HSDP"`` (FSDP2 over the 2-D mesh);
  on one node ``"1-D FSDP2"``.
* **execution**: ``"in_step"`` (the default), ``"returns_in_backward"``
  (``ExecutionConfig(ns_in_backward=True, returns_in_backward=True)``) or ``"next_forward"``
  (``ExecutionConfig(apply_updates="next_forward")``); with native HSDP only the default is modelled.
* **balancer**: ``"greedy"`` (LPT, the default), ``"round_robin"``, ``"milp"`` (HiGHS through scipy).

The recommendation is the fastest candidate, except that among candidates within
:data:`TIE` of the fastest the one asking least of the user wins (:data:`ASKS`).
"""

from __future__ import annotations

from typing import Iterable, Sequence

from dmuon.costmodel.offline import (
    _as_table, _mesh, expand, expert_layout, mats_experts, matrix_holders, offline_blocks, owners_and_batches,
    step_inputs,
)
from dmuon.costmodel.sim_config import Hardware, SimOptions
from dmuon.costmodel.simulate import NEXT_FORWARD, RETURNS_IN_BACKWARD, simulate
from dmuon.plan.assign import build_kinds
from dmuon.plan.balance import DEFAULT_MEMORY_FACTOR, DEFAULT_TIME_LIMIT_S, balance
from dmuon.plan.batches import RETURN_WAVES
from dmuon.plan.cost_table import CostTable
from dmuon.plan.spread import place_owners

TIE = 0.005
"""Candidates whose simulated steps are within this fraction of the fastest count as equally fast."""

EXECUTIONS = {
    "in_step": "dmuon.ExecutionConfig()",
    "returns_in_backward": "dmuon.ExecutionConfig(ns_in_backward=True, returns_in_backward=True)",
    "next_forward": 'dmuon.ExecutionConfig(apply_updates="next_forward")',
}
"""Each execution choice as the code that asks for it."""

ASKS = {
    ("layout", "1-D FSDP2"): "",
    ("layout", "native HSDP"): "",
    ("layout", "replicate level"): (
        'fully_shard every module over mesh["shard"] (not the 2-D mesh) and give dmuon hsdp_mesh=mesh; clip with '
        "opt.clip_grad_norm_(max_norm); an FSDP2 all-reduce hook of yours is refused"),
    ("execution", "in_step"): "",
    ("execution", "returns_in_backward"): (
        "a gradient clipped or edited after backward has its blocks exchanged again in step() (same results, "
        "a slower step): for runs that rarely clip"),
    ("execution", "next_forward"): (
        "the updates land in the next forward: call opt.flush_updates() before reading the weights directly "
        "between step() and the next forward (an EMA, evaluation outside the model's forward, saving weights by "
        "hand); step(), state dicts and DCP see them applied"),
    ("balancer", "greedy"): "",
    ("balancer", "round_robin"): "",
    ("balancer", "milp"): "scipy (pip install 'dmuon[milp]'); rank 0 solves, within the time limit, at setup",
}
"""What each choice asks of the user ('': nothing beyond what AdamW asks)."""

STRATEGIES = {
    ("replicate level", "in_step"): "dmuon",
    ("replicate level", "returns_in_backward"): RETURNS_IN_BACKWARD,
    ("replicate level", "next_forward"): NEXT_FORWARD,
    ("native HSDP", "in_step"): "dmuon_native_hsdp",
    ("1-D FSDP2", "in_step"): "dmuon",
    ("1-D FSDP2", "returns_in_backward"): RETURNS_IN_BACKWARD,
    ("1-D FSDP2", "next_forward"): NEXT_FORWARD,
}
"""The simulated strategy of each (layout, execution)."""


def _asked(candidate: dict) -> int:
    return sum(bool(ASKS[(k, candidate[k])]) for k in ("layout", "execution", "balancer"))


def _candidates(balancer: str, result, inputs, hardware: Hardware, options: SimOptions | None,
                layouts: Sequence[str], baseline: dict) -> list[dict]:
    """One candidate per (layout, execution) of ``layouts`` for one balancer's owners, simulated."""
    out = []
    for (layout, execution), strategy in STRATEGIES.items():
        if layout not in layouts:
            continue
        figures = simulate(strategy, inputs, hardware, options)
        out.append({
            "layout": layout, "execution": execution, "balancer": balancer, "strategy": strategy,
            "step_seconds": figures["step_seconds"], "optimizer_seconds": figures["optimizer_seconds"],
            "exposed_comm_seconds": figures["exposed_comm_seconds"],
            "vs_fsdp_adamw": figures["step_seconds"] / baseline["step_seconds"],
            "imbalance": result.imbalance, "balancer_method": result.method,
        })
    return out


def _recommended(candidates: list[dict]) -> dict:
    """Of the candidates within :data:`TIE` of the fastest (sorted fastest first), the one asking the
    least of the user, with ``asks``: what each of its choices asks."""
    fastest = candidates[0]["step_seconds"]
    near = [c for c in candidates if c["step_seconds"] <= fastest * (1 + TIE)]
    best = dict(min(near, key=lambda c: (_asked(c), c["step_seconds"])))
    best["asks"] = {k: ASKS[(k, best[k])] for k in ("layout", "execution", "balancer") if ASKS[(k, best[k])]}
    return best


def recommend(groups: Iterable, world_size: int, gpus_per_node: int, hardware: Hardware,
              options: SimOptions | None = None, *, zero: int = 3,
              balancers: Sequence[str] = ("greedy", "round_robin", "milp"),
              costs: CostTable | None = None, ns_steps: int = 5, wire_bytes: int = 2, param_bytes: int = 2,
              reduce_bytes: int = 4, max_waves: int = RETURN_WAVES, time_limit_s: float = DEFAULT_TIME_LIMIT_S,
              memory_factor: float | None = DEFAULT_MEMORY_FACTOR, ep: int | None = None) -> dict:
    """Simulates every candidate configuration on a ``world_size``-GPU cluster of ``gpus_per_node``-GPU nodes.

    Args:
        groups: The shapes (``name``, ``shape``, ``count``, optionally ``muon``), as ``dmuon plan`` reads them.
        world_size, gpus_per_node: The cluster (``gpus_per_node`` must divide ``world_size``; a world
            within one node is one node's 1-D FSDP2).
        hardware, options: The simulation's (:class:`~dmuon.costmodel.sim_config.Hardware`,
            :class:`~dmuon.costmodel.sim_config.SimOptions`).
        zero: FSDP2's resharding (3: ``reshard_after_forward=True``; 2: ``False``).
        balancers: The balancers to try (``"milp"`` needs scipy).
        costs, ns_steps, wire_bytes, param_bytes, reduce_bytes, max_waves, time_limit_s, memory_factor, ep:
            As :func:`~dmuon.costmodel.offline.plan_offline` takes them (``ep``: the routed experts'
            expert-parallel size, the same in every candidate and in FSDP2 + AdamW's step).

    Returns:
        JSON-ready: ``mesh`` ``[R, S]``, ``zero``, ``fsdp_adamw`` (FSDP2 + AdamW's figures on that mesh),
        ``candidates`` (fastest first: ``layout``, ``execution``, ``balancer``, ``strategy``,
        ``step_seconds``, ``optimizer_seconds``, ``exposed_comm_seconds``, ``vs_fsdp_adamw``,
        ``imbalance``, ``balancer_method``), ``recommended`` (one of them, with ``asks``: what each of its
        choices asks of the user) and ``tie``.

    Raises:
        ValueError: ``gpus_per_node`` not dividing ``world_size``, or an unknown balancer.
    """
    if gpus_per_node < 1 or world_size % gpus_per_node:
        raise ValueError(f"gpus_per_node ({gpus_per_node}) must divide world_size ({world_size})")
    replicate, shard = _mesh(world_size, zero, min(gpus_per_node, world_size))
    groups = list(groups)
    mats = expand(groups)
    _, pieces = expert_layout(mats, ep, shard)
    table = _as_table(costs, mats, ns_steps)
    kinds, items = build_kinds([m.shape for m in mats], table)
    holders = matrix_holders(mats, pieces, replicate, shard)
    layouts = ("replicate level", "native HSDP") if replicate > 1 else ("1-D FSDP2",)
    baseline = None
    candidates = []
    for name in balancers:
        result = place_owners(balance(kinds, items, world_size, name, time_limit_s=time_limit_s,
                                      memory_factor=memory_factor),
                              items, offline_blocks(mats), [m.numel for m in mats], replicate, holders)
        owners, ns_batches = owners_and_batches(result)
        inputs = step_inputs(groups, owners, ns_batches, replicate, shard, zero=zero, max_waves=max_waves,
                             wire_bytes=wire_bytes, param_bytes=param_bytes, reduce_bytes=reduce_bytes, ep=ep)
        if baseline is None:  # FSDP2 + AdamW has no owners: one run
            baseline = simulate("fsdp_adamw", inputs, hardware, options)
        candidates += _candidates(name, result, inputs, hardware, options, layouts, baseline)
    candidates.sort(key=lambda c: (c["step_seconds"], _asked(c)))
    best = _recommended(candidates)
    layout, _ = expert_layout(mats, ep, shard)
    return {"world_size": world_size, "gpus_per_node": gpus_per_node, "mesh": [replicate, shard], "zero": zero,
            "experts": None if layout is None else layout.as_dict(mats_experts(mats)),
            "hardware": hardware.name, "cost_unit": table.unit, "fsdp_adamw": baseline,
            "candidates": candidates, "recommended": best, "tie": TIE}


def recommended_code(rec: dict) -> list[str]:
    """The recommendation as the lines of a training script that ask for it (with routed experts,
    torchtitan's expert-parallel layout: dense and expert views of one world mesh)."""
    best = rec["recommended"]
    replicate, shard = rec["mesh"]
    reshard = "True" if rec["zero"] == 3 else "False"
    execution = "" if best["execution"] == "in_step" else f", execution={EXECUTIONS[best['execution']]}"
    replicate_level = best["layout"] == "replicate level"
    experts = rec.get("experts")
    if experts:
        return _expert_parallel_code(best, replicate, shard, reshard, execution, experts)
    if best["layout"] == "1-D FSDP2":  # over every rank of the cluster
        lines = [f'mesh = init_device_mesh("cuda", ({replicate * shard},))', "shard_over = mesh"]
        hsdp = ""
    else:
        lines = [f'mesh = init_device_mesh("cuda", ({replicate}, {shard}), mesh_dim_names=("replicate", "shard"))']
        lines.append('shard_over = mesh["shard"]' if replicate_level else "shard_over = mesh")
        hsdp = ", hsdp_mesh=mesh" if replicate_level else ""
    lines += ["for block in model.layers:",
              f"    fully_shard(block, mesh=shard_over, reshard_after_forward={reshard})",
              f"fully_shard(model, mesh=shard_over, reshard_after_forward={reshard})"]
    return lines + _optimizer_lines(best["balancer"], hsdp, execution)


def _optimizer_lines(balancer: str, hsdp: str, execution: str) -> list[str]:
    if balancer == "greedy":
        return [f"opt = dmuon.DMuon(model{hsdp}{execution}, lr=0.02, adamw=dmuon.AdamWConfig(lr=3e-4))"]
    return [f'plan = dmuon.prepare(model, balancer="{balancer}"{hsdp})',
            f"opt = dmuon.DMuon(model, plan{execution}, lr=0.02, adamw=dmuon.AdamWConfig(lr=3e-4))"]


def _expert_parallel_code(best: dict, replicate: int, shard: int, reshard: str, execution: str,
                          experts: dict) -> list[str]:
    """torchtitan's layout (README, "MoE and expert parallelism"): the dense parameters over the shard dim,
    each routed-expert stack split whole over ``ep`` and sharded over ``efsdp``, both unflattened from one
    world mesh with the replicate dim first; the experts' gradient divided by every data rank."""
    ep, efsdp, dim = experts["ep"], experts["efsdp"], experts["fsdp_dim"]
    one_d = best["layout"] == "1-D FSDP2"
    replicate_level = best["layout"] == "replicate level"
    outer = () if one_d else (replicate,)
    outer_names = () if one_d else ("replicate",)
    if one_d:  # the experts sharded over every other data rank of the cluster
        shard, efsdp = replicate * shard, replicate * efsdp
        dim = 1 if efsdp * ep > sum(experts["experts_per_ep_rank"]) else 0

    def view(sizes: tuple, dims: tuple) -> str:
        return f"world._unflatten(0, {sizes}, {dims})"

    lines = [f'world = init_device_mesh("cuda", ({replicate * shard},), mesh_dim_names=("world",))',
             f"dense = {view((*outer, shard), (*outer_names, 'shard'))}",
             f"experts = {view((*outer, efsdp, ep), (*outer_names, 'efsdp', 'ep'))}"]
    dense_over, experts_over = ('dense["shard"]', 'experts["efsdp"]') if replicate_level or one_d else \
        ("dense", 'experts["replicate", "efsdp"]')
    divide = shard if replicate_level or one_d else replicate * shard
    placement = ", shard_placement_fn=lambda p: Shard(1)" if dim == 1 else ""
    lines += ["for block in model.layers:",
              "    routed = block.moe.experts  # torchtitan's names; ExpertParallel() also dispatches the tokens",
              "    for name, w in list(routed.named_parameters(recurse=False)):",
              '        setattr(routed, name, nn.Parameter(distribute_tensor(w.data, experts["ep"], [Shard(0)])))',
              f"    fully_shard(routed, mesh={experts_over}{placement}, reshard_after_forward={reshard})",
              f"    routed.set_gradient_divide_factor({divide})",
              f"    fully_shard(block, mesh={dense_over}, reshard_after_forward={reshard})",
              f"fully_shard(model, mesh={dense_over}, reshard_after_forward={reshard})"]
    return lines + _optimizer_lines(best["balancer"], ", hsdp_mesh=(dense, experts)" if replicate_level else "",
                                    execution)
