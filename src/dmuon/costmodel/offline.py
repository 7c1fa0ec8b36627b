"""Plans from shape lists alone: no weights, any cluster size.

Lets ``dmuon plan`` answer "how would 256 ranks split Qwen2.5-7B?" on a laptop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

from dmuon.costmodel.traffic import (
    AlphaBeta,
    RankTraffic,
    compare_hsdp_designs,
    critical_path,
    fsdp2_traffic,
    gather_traffic,
    owner_traffic,
    owner_traffic_column_reduce,
    step_comm,
)
from dmuon.plan.assign import build_kinds
from dmuon.plan.balance import DEFAULT_MEMORY_FACTOR, DEFAULT_TIME_LIMIT_S, balance
from dmuon.plan.layout import position
from dmuon.costmodel.sim_config import Hardware, SimOptions, StepInputs
from dmuon.costmodel.collectives import DDP_STRATEGY
from dmuon.costmodel.moe import ExpertLayout, expert_ring_traffic
from dmuon.costmodel.peer import PEER_STRATEGY
from dmuon.costmodel.simulate import SIM_STRATEGIES, goal_ratios, simulate_strategies
from dmuon.costmodel.trace import chrome_trace
from dmuon.plan.batches import RETURN_WAVES, return_waves
from dmuon.plan.hop_a import default_spread
from dmuon.plan.holders import holder_ranks
from dmuon.plan.plan import row_pieces
from dmuon.plan.spread import place_owners
from dmuon.plan.cost_table import CostTable, analytical_table


@dataclass(frozen=True)
class OfflineMatrix:
    """One matrix of a shape list, expanded from its count."""

    name: str
    """Unique name (``group[k]`` when a group has several matrices; an expert slice ``group[layer][e]``)."""
    shape: tuple[int, int]
    """``(rows, cols)``."""
    layer: int | None = None
    """The decoder layer, where the group says it (``first_layer``, expert stacks); None: from the name."""
    expert: int | None = None
    """An expert slice: its expert in the stack (None: a plain matrix)."""
    experts: int = 0
    """An expert slice: the experts of its stack."""
    token_share: float = 1.0
    """The share of the tokens that run through it (an expert slice: top-k over the experts)."""

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]


def expand(groups: Iterable, muon: bool = True) -> list[OfflineMatrix]:
    """Expands ``(name, shape, count[, muon])`` groups into single Muon matrices (``muon=False``:
    the other parameters instead)."""
    out = []
    for g in groups:
        if getattr(g, "muon", True) != muon:
            continue
        shape = (int(g.shape[0]), int(g.shape[1]))
        experts, first = getattr(g, "experts", 0), getattr(g, "first_layer", 0)
        if experts:
            share = getattr(g, "experts_per_token", 0) / experts
            out.extend(OfflineMatrix(f"{g.name}[{first + k}][{e}]", shape, first + k, e, experts, share)
                       for k in range(g.count) for e in range(experts))
        elif g.count == 1:
            out.append(OfflineMatrix(g.name, shape, first if first else None))
        else:
            out.extend(OfflineMatrix(f"{g.name}[{first + k}]", shape, first + k if first else None)
                       for k in range(g.count))
    return out


def expert_pieces(mats: Sequence[OfflineMatrix], layout) -> list | None:
    """Per matrix its :class:`~dmuon.plan.plan.Piece` per shard position under ``layout``
    (:class:`~dmuon.costmodel.moe.ExpertLayout`) for an expert slice, None for a dense matrix (FSDP2's row
    chunks); None for all when no matrix is an expert slice."""
    if not any(m.expert is not None for m in mats):
        return None
    return [None if m.expert is None else layout.slice_pieces(m.shape, m.experts, m.expert) for m in mats]


def offline_blocks(mats: Sequence[OfflineMatrix]) -> list[int]:
    """The FSDP2 block of each matrix of a shape list, which carries no module structure.

    Assumed: each decoder layer is one FSDP2 module and everything else sits in
    the root. A group whose name has a ``*`` (``layers.*.mlp.up_proj``, one
    matrix per layer) puts its ``k``-th matrix in layer ``k`` of the stack named
    by the text before the ``*``; other groups go to the root, block 0. Layer
    blocks are numbered from 1, stack by stack in order of appearance, then by
    ``k``: the forward order for a single stack.
    """
    keys: list[tuple[str, int] | None] = []
    stacks: dict[str, int] = {}
    for m in mats:
        if "*" not in m.name:
            keys.append(None)
            continue
        prefix = m.name.split("*")[0]
        if getattr(m, "layer", None) is not None:
            k = m.layer
        else:
            k = int(m.name[m.name.rindex("[") + 1 : -1]) if m.name.endswith("]") else 0
        stacks.setdefault(prefix, len(stacks))
        keys.append((prefix, k))
    order = sorted({key for key in keys if key is not None}, key=lambda key: (stacks[key[0]], key[1]))
    index = {key: b + 1 for b, key in enumerate(order)}
    return [0 if key is None else index[key] for key in keys]


def _as_table(costs, mats: Sequence[OfflineMatrix], ns_steps: int) -> CostTable:
    if costs is None:
        return analytical_table([(m.shape, 1) for m in mats], ns_steps)
    if isinstance(costs, CostTable):
        table = costs
    else:
        # The original interface: measured seconds per shape, batch 1.
        table = CostTable({((int(s[0]), int(s[1])), 1): float(v) for s, v in costs.items()}, source="file")
    missing = table.missing(m.shape for m in mats)
    if missing:
        raise ValueError(f"costs: no batch-1 measurement for shapes {missing[:5]}")
    return table


def non_muon_numels(groups: Iterable) -> list[int]:
    """Element counts of the groups Muon does not optimise (``muon=False``), one per group."""
    return [math.prod(int(d) for d in g.shape) * int(g.count) for g in groups if not getattr(g, "muon", True)]


def _uniform(t: RankTraffic) -> dict:
    """A figure that is the same on every rank, with its totals."""
    return {"sent": t.sent, "received": t.received, **t.as_dict()}


# Reads better whole: the length is the public docstring (every argument and every key of the plan).
def plan_offline(
    groups: Iterable,
    world_size: int,
    balancer: str = "greedy",
    zero: int = 2,
    costs: CostTable | dict[tuple[int, int], float] | None = None,
    ns_steps: int = 5,
    *,
    time_limit_s: float = DEFAULT_TIME_LIMIT_S,
    memory_factor: float | None = DEFAULT_MEMORY_FACTOR,
    ranks_per_node: int | None = None,
    wire_bytes: int = 2,
    fsdp_elem_bytes: int = 4,
    param_bytes: int = 2,
    reduce_bytes: int = 4,
    alpha_beta: AlphaBeta | None = None,
    hardware: Hardware | None = None,
    sim_options: SimOptions | None = None,
    max_waves: int = RETURN_WAVES,
    hop_a_spread: int | None = None,
    root_regathered: bool = False,
    trace: dict | None = None,
    ep: int | None = None,
) -> dict:
    """Assigns owners for a shape list and reports per-rank load, memory and traffic.

    Args:
        groups: Objects with ``name``, ``shape``, ``count`` (and optionally ``muon``).
        world_size: Ranks to plan for.
        balancer: A name from :data:`dmuon.plan.balance.BALANCERS`.
        zero: FSDP2's resharding, for the FSDP2 and gather-then-compute figures
            only: 3 re-gathers the weights in backward (``reshard_after_forward``),
            2 does not. dmuon's own exchange is the same for both.
        costs: A :class:`~dmuon.plan.profile.CostTable` (seconds per shape and
            batch size), or measured seconds per shape (batch 1); the analytical
            model when ``None``.
        ns_steps: NS iterations for the analytical model.
        time_limit_s: MILP wall-clock budget.
        memory_factor: MILP per-rank optimizer-state limit over the mean, or ``None``.
        ranks_per_node: HSDP shard size ``S`` (replicate over nodes); all ranks when ``None``.
        wire_bytes: Bytes per element of dmuon's exchange (the NS dtype: 2 for bf16).
        fsdp_elem_bytes: Bytes per element of FSDP2's parameters and gradients
            (the older per-rank figures).
        param_bytes: FSDP2's all-gather element size in ``step_comm`` (bf16).
        reduce_bytes: FSDP2's reduce-scatter and all-reduce element size in ``step_comm`` (fp32).
        alpha_beta: Latencies and bandwidths of ``step_comm``'s seconds (typical H100/H200 by default).
        hardware: With it, also ``simulation``: one step's timeline per strategy
            (:func:`~dmuon.costmodel.simulate.simulate_strategies` on :func:`step_inputs`'s
            inputs, the non-Muon groups included) and ``simulation_model``, its settings.
        sim_options: The simulation's options (default :class:`~dmuon.costmodel.sim_config.SimOptions`).
        max_waves: dmuon's limit on update returns (``return_waves``; 4 on an accelerator).
        hop_a_spread: dmuon's ``ExecutionConfig.hop_a_spread`` for the simulation (the replicate level); None:
            its default per strategy (1 for ``dmuon_rbwd``, 8 for the others).
        root_regathered: The root module resharded after forward and gathered again at the start of
            backward (``fully_shard(root, reshard_after_forward=True)`` passed explicitly), in
            ``step_comm`` and the simulation.
        trace: With ``hardware``: also ``simulation_trace``, the simulated step as a Chrome trace
            (:func:`~dmuon.costmodel.trace.chrome_trace`, called with these keywords: ``strategies``,
            ``ranks``); not JSON-small, so the CLI writes it to its own file.
        ep: Expert-parallel size of the groups' routed-expert stacks (:mod:`dmuon.costmodel.moe`; None: 1);
            it must divide the shard dim. With experts the plan also has ``experts``
            (:func:`expert_summary`), each slice owned on a rank holding it where the balancer's counts
            allow (:func:`~dmuon.plan.holders.prefer_holders`, as the live planner), and no ``hsdp_designs``.

    Returns:
        A JSON-ready dict: ``world_size``, ``balancer``, ``makespan``, ``mean``,
        ``imbalance``, ``cost_unit``, ``cost_source``, ``method``, ``status``,
        ``solve_seconds``, ``lower_bound``, ``memory_cap``, ``notes`` and
        ``ranks`` (each with ``rank``, ``cost``, ``matrices``, ``batches``,
        ``state_bytes``, ``bytes_sent``, ``bytes_received``, ``critical_bytes``
        and the level fields of :class:`~dmuon.costmodel.traffic.RankTraffic`, all
        dmuon's exchange alone, as the runtime issues it: on the replicate level,
        :func:`~dmuon.costmodel.traffic.owner_traffic_column_reduce`, whose
        gradient column reduce-scatter is in ``fsdp_elem_bytes``),
        ``fsdp2_bytes_per_rank``, ``gather_bytes_per_rank`` (the same on
        every rank) and ``critical_path_bytes``: the most bytes one rank sends
        or receives per step, for ``dmuon`` (that exchange),
        ``dmuon_native_hsdp`` (native HSDP's exchange,
        :func:`~dmuon.costmodel.traffic.owner_traffic`, which FSDP2's
        all-reduce comes on top of; ``dmuon``'s with one replica), ``fsdp2``
        and ``gather_then_compute`` (which includes FSDP2's collectives). With more than one replica also
        ``hsdp_designs``: :func:`~dmuon.costmodel.traffic.compare_hsdp_designs`
        for these owners (FSDP2 + AdamW, native HSDP and the replicate level, each with
        ``inter``, ``intra`` and ``inter_whole_model`` ``total``/``critical``
        bytes, and ``non_muon_all_reduce`` for the groups with ``muon=False``;
        dmuon's elements in ``wire_bytes``, FSDP2's and the replicate level's gradient
        reduce in ``fsdp_elem_bytes``). ``step_comm``: one step's collectives
        for ``dmuon`` (the replicate level on HSDP), ``dmuon_native_hsdp`` (native
        HSDP), ``fsdp_adamw`` and ``gather``
        (:func:`~dmuon.costmodel.traffic.step_comm`: ``critical_bytes``,
        ``seconds``, ``collectives``, each ``total``/``intra``/``inter``), with
        blocks from :func:`offline_blocks`, and ``step_comm_model``, its
        settings. Rank costs are batch-aware: each rank's
        matrices of one shape split into the cheapest measured batches.

    Raises:
        ValueError: For a non-positive world size, an unknown balancer or
            costs that miss a shape.
    """
    replicate, shard = _mesh(world_size, zero, ranks_per_node)
    groups = list(groups)
    mats = expand(groups)
    layout, pieces = expert_layout(mats, ep, shard)
    table = _as_table(costs, mats, ns_steps)
    kinds, items = build_kinds([m.shape for m in mats], table)
    result = place_owners(
        balance(kinds, items, world_size, balancer, time_limit_s=time_limit_s, memory_factor=memory_factor),
        items, offline_blocks(mats), [m.numel for m in mats], replicate, matrix_holders(mats, pieces, replicate, shard))
    owners, ns_batches = owners_and_batches(result)
    # The update returns as DMuon pipelines them: wave k holds every owner's k-th NS batch.
    waves = return_waves(ns_batches, [], max_waves)
    shapes = [m.shape for m in mats]
    plan = {
        "world_size": world_size, "balancer": balancer, "method": result.method, "status": result.status,
        "zero": zero, "root_regathered": root_regathered,
        "cost_unit": "seconds" if table.unit == "seconds" else "flops (analytical)", "cost_source": table.source,
        "matrices": len(mats), "makespan": result.makespan, "mean": result.mean, "imbalance": result.imbalance,
        "lower_bound": None if math.isnan(result.lower_bound) else result.lower_bound,
        "solve_seconds": result.solve_seconds, "memory_cap": result.memory_cap, "notes": result.notes,
        "mesh": [replicate, shard], "wire_bytes": wire_bytes, "fsdp_elem_bytes": fsdp_elem_bytes,
        **_traffic(mats, result, waves, replicate, shard, zero, wire_bytes, fsdp_elem_bytes, pieces, layout),
    }
    if layout is not None:
        plan["experts"] = expert_summary(mats, result, pieces, layout, replicate, ns_batches)
    alpha_beta = AlphaBeta() if alpha_beta is None else alpha_beta
    plan["step_comm"] = step_comm(shapes, owners, offline_blocks(mats), replicate, shard,
                                  wire_bytes=wire_bytes, param_bytes=param_bytes, reduce_bytes=reduce_bytes,
                                  zero=zero, root_block=0, model=alpha_beta, waves=waves,
                                  root_regathered=root_regathered, pieces=pieces, experts=layout)
    plan["step_comm_model"] = _step_comm_model(alpha_beta, wire_bytes, param_bytes, reduce_bytes, waves)
    if hardware is not None:
        inputs = step_inputs(groups, owners, ns_batches, replicate, shard, zero=zero, max_waves=max_waves,
                             wire_bytes=wire_bytes, param_bytes=param_bytes, reduce_bytes=reduce_bytes,
                             hop_a_spread=hop_a_spread, root_regathered=root_regathered, ep=ep)
        plan.update(_simulation(inputs, hardware, sim_options or SimOptions(), replicate, shard,
                                experts=layout is not None, trace=trace, zero=zero, root_regathered=root_regathered, max_waves=max_waves,
                                hop_a_spread=hop_a_spread))
    if replicate > 1 and layout is None:
        plan["hsdp_designs"] = compare_hsdp_designs(
            shapes, owners, replicate, shard, wire_bytes, fsdp_elem_bytes,
            reshard_after_forward=zero == 3, other_numels=non_muon_numels(groups), waves=waves)
    return plan


def _simulation(inputs: StepInputs, hardware: Hardware, options: SimOptions, replicate: int, shard: int, *,
                experts: bool, trace: dict | None, zero: int, root_regathered: bool, max_waves: int,
                hop_a_spread: int | None) -> dict:
    """:func:`plan_offline`'s ``simulation``, ``simulation_ratios``, ``simulation_trace`` (with ``trace``)
    and ``simulation_model``: one step's timeline per strategy on ``hardware``."""
    # One rank per replica (the (N, 1) layout): torch's DDP + dmuon is one more way to run it.
    strategies = SIM_STRATEGIES + ((DDP_STRATEGY,) if shard == 1 and replicate > 1 else ())
    if experts:  # the all-to-all peer's batches are not modelled for expert slices
        strategies = tuple(k for k in strategies if k != PEER_STRATEGY)
    out = {"simulation": simulate_strategies(inputs, hardware, options, strategies)}
    out["simulation_ratios"] = goal_ratios(out["simulation"])
    if trace is not None:
        out["simulation_trace"] = chrome_trace(inputs, hardware, options, **trace)
    out["simulation_model"] = {"hardware": hardware.as_dict(), **options.as_dict(), "zero": zero,
                               "root_regathered": root_regathered,
                               "return_waves": max_waves,
                               "hop_a_spread": hop_a_spread if hop_a_spread is not None else
                               f"{default_spread(False)}; {default_spread(True)} for dmuon_rbwd",
                               "blocks": "as step_comm, the non-Muon groups in the root unless named 'stack.*'"}
    return out


def _mesh(world_size: int, zero: int, ranks_per_node: int | None) -> tuple[int, int]:
    """``(replicate, shard)``: replicate across nodes, shard inside one (all ranks without ``ranks_per_node``)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if zero not in (2, 3):
        raise ValueError(f"zero must be 2 or 3, got {zero}")
    shard = world_size if ranks_per_node is None else ranks_per_node
    if shard < 1 or world_size % shard:
        raise ValueError(f"ranks_per_node ({ranks_per_node}) must divide world_size ({world_size})")
    return world_size // shard, shard


def _traffic(mats: list, result, waves: list, replicate: int, shard: int, zero: int, wire_bytes: int,
             fsdp_elem_bytes: int, pieces: list | None = None, layout: ExpertLayout | None = None) -> dict:
    """The plan's per-step bytes: FSDP2's and gather-then-compute's per rank, the critical paths, and per
    rank dmuon's exchange as the runtime issues it (on the replicate level its column reduce-scatter moves
    gradients, in ``fsdp_elem_bytes``; each wave's updates across replicas by the route picked for it).
    With experts (``pieces``, ``layout``) FSDP2's and gather-then-compute's figures are the busiest rank's
    (:func:`~dmuon.costmodel.moe.expert_ring_traffic` for the expert units)."""
    owners, shapes = result.owners, [m.shape for m in mats]
    native = owner_traffic(shapes, owners, replicate, shard, wire_bytes, pieces=pieces, waves=waves)
    traffic = owner_traffic_column_reduce(shapes, owners, replicate, shard, wire_bytes, fsdp_elem_bytes,
                                          pieces=pieces, waves=waves)
    ranks = []
    for r in range(replicate * shard):
        mine = [k for k, o in enumerate(owners) if o == r]
        ranks.append({
            "rank": r,
            "cost": result.loads[r],
            "matrices": [mats[k].name for k in mine],
            "batches": [{"shape": list(shape), "sizes": sizes} for shape, sizes in result.batches[r].items()],
            "state_bytes": result.state_bytes[r],
            "bytes_sent": traffic[r].sent,
            "bytes_received": traffic[r].received,
            "critical_bytes": traffic[r].busiest,
            **traffic[r].as_dict(),
        })
    dense = [m.numel for i, m in enumerate(mats) if pieces is None or pieces[i] is None]
    fsdp2 = fsdp2_traffic(dense, replicate, shard, fsdp_elem_bytes, reshard_after_forward=zero == 3)
    gather = gather_traffic(dense, replicate, shard, fsdp_elem_bytes, reshard_after_forward=zero == 3)
    if layout is not None:
        stacks = [p for p in pieces if p is not None]
        passes = 3 if zero == 3 else 2
        # Gather-then-compute gathers a slice over its holders: one ring pass more where they are several.
        fsdp2 = _added(fsdp2, expert_ring_traffic(stacks, layout, replicate, fsdp_elem_bytes, passes))
        gather = _added(gather, expert_ring_traffic(stacks, layout, replicate, fsdp_elem_bytes,
                                                    passes + (not layout.whole_experts(mats_experts(mats)))))
    return {
        "fsdp2_bytes_per_rank": _uniform(fsdp2),
        "gather_bytes_per_rank": _uniform(gather),
        "critical_path_bytes": {"dmuon": critical_path(traffic), "dmuon_native_hsdp": critical_path(native),
                                "fsdp2": fsdp2.busiest, "gather_then_compute": gather.busiest},
        "ranks": ranks,
    }


def _added(a: RankTraffic, b: RankTraffic) -> RankTraffic:
    return RankTraffic(a.intra_sent + b.intra_sent, a.intra_received + b.intra_received,
                       a.inter_sent + b.inter_sent, a.inter_received + b.inter_received)


def mats_experts(mats: Sequence[OfflineMatrix]) -> int:
    """The experts of the stacks (one count for every stack: torchtitan's layout rule reads it)."""
    counts = {m.experts for m in mats if m.expert is not None}
    if len(counts) > 1:
        raise ValueError(f"expert stacks of different sizes {sorted(counts)}: one --ep layout is modelled")
    return counts.pop() if counts else 0


def expert_layout(mats: Sequence[OfflineMatrix], ep: int | None, shard: int
                  ) -> tuple[ExpertLayout | None, list | None]:
    """The :class:`~dmuon.costmodel.moe.ExpertLayout` of ``mats``' expert stacks over ``ep`` ranks of the
    ``shard`` dim and each matrix's pieces (:func:`expert_pieces`); ``(None, None)`` without experts."""
    experts = mats_experts(mats)
    if not experts:
        if ep not in (None, 1):
            raise ValueError(f"--ep {ep}: the matrices have no routed-expert stack (an MoE shape list takes --ep)")
        return None, None
    layout = ExpertLayout(1 if ep is None else ep, shard)
    return layout, expert_pieces(mats, layout)


def matrix_holders(mats: Sequence[OfflineMatrix], pieces: list | None, replicate: int, shard: int
                   ) -> list[tuple[int, ...] | None]:
    """Each matrix's holder ranks as the live planner reads them (:func:`~dmuon.plan.holders.holder_ranks`):
    an expert slice's from its ``pieces``, a dense matrix's from FSDP2's row chunks (a matrix with fewer
    rows than shard positions is on the first ones); None where every rank holds rows."""
    boxes = [row_pieces(m.shape, shard) if pieces is None or pieces[i] is None else pieces[i]
             for i, m in enumerate(mats)]
    return holder_ranks(boxes, replicate, shard)


def owners_and_batches(result) -> tuple[list[int], dict[int, list[list[int]]]]:
    """The plan's owners (as :func:`~dmuon.plan.spread.place_owners` left them: each matrix some ranks do
    not hold on a holder where the balancer's counts allow) and each owner's NS batches (matrix indices,
    in the order it runs them)."""
    owned: dict[int, list[int]] = {}
    for k, o in enumerate(result.owners):
        owned.setdefault(o, []).append(k)
    return result.owners, {r: result.ns_batches(ks, r) for r, ks in sorted(owned.items())}


def expert_summary(mats: Sequence[OfflineMatrix], result, pieces: list, layout: ExpertLayout, replicate: int,
                   ns_batches: dict[int, list[list[int]]]) -> dict:
    """The expert slices' owners in the plan: the layout, per rank how many expert slices and dense
    matrices it owns and how many of its slices it holds rows of, and the largest NS batch the owners run
    (``ns_batches``: one call of NS on matrices of one shape)."""
    shard = layout.shard
    world = replicate * shard
    slices, dense, on_holder = [0] * world, [0] * world, [0] * world
    for i, owner in enumerate(result.owners):
        if pieces[i] is None:
            dense[owner] += 1
            continue
        slices[owner] += 1
        on_holder[owner] += bool(pieces[i][position(owner, shard)[1]].rows)
    largest = max(((len(batch), mats[batch[0]].shape, r) for r, batches in ns_batches.items()
                   for batch in batches if batch), default=(0, None, None))
    return {**layout.as_dict(mats_experts(mats)), "slices": sum(slices), "dense": sum(dense),
            "slices_per_rank": slices, "dense_per_rank": dense, "owned_where_held": on_holder,
            "largest_batch": {"size": largest[0], "shape": list(largest[1]) if largest[1] else None,
                              "rank": largest[2]}}


def _step_comm_model(alpha_beta: AlphaBeta, wire_bytes: int, param_bytes: int, reduce_bytes: int,
                     waves: list) -> dict:
    """What ``step_comm``'s figures assume."""
    return {
        **alpha_beta.as_dict(), "wire_bytes": wire_bytes, "param_bytes": param_bytes, "reduce_bytes": reduce_bytes,
        "blocks": "root (block 0) + one block per layer k of each 'name.*' group (shape lists carry no modules)",
        "order": "forward all-gathers; per block in backward order: all-gather (ZeRO-3), reduce-scatter, "
                 "on HSDP the all-reduce (FSDP2's; under dmuon, the replicate level, dmuon's of the other parameters, after "
                 "the next all_to_all), dmuon's all_to_alls (on HSDP under dmuon "
                 "the gradient's column slices across replicas, carrying in the same all_to_all the direction "
                 "slices of the block before in backward (the last block's go alone), and the rows to the "
                 "owner); step: dmuon's returns or gather's all-gathers",
        "return_waves": [w for w in waves if w],
    }


def step_inputs(groups: Iterable, owners: Sequence[int], ns_batches: dict[int, list[list[int]]], replicate: int,
                shard: int, *, zero: int = 3, max_waves: int = RETURN_WAVES, wire_bytes: int = 2,
                param_bytes: int = 2, reduce_bytes: int = 4, hop_a_spread: int | None = None,
                root_regathered: bool = False, ep: int | None = None) -> StepInputs:
    """What :mod:`~dmuon.costmodel.simulate` needs of a shape list and its plan: the Muon matrices
    (in :func:`expand` order, with ``owners`` and ``ns_batches`` over those indices), the other
    groups (AdamW's: FSDP2 moves and AdamW updates them too), and every one's block
    (:func:`offline_blocks` over both lists, so a ``stack.*`` group of either is in the same layer)."""
    groups = list(groups)
    mats, others = expand(groups), expand(groups, muon=False)
    blocks = offline_blocks(mats + others)
    layout, pieces = expert_layout(mats, ep, shard)
    return StepInputs(shapes=[m.shape for m in mats], owners=list(owners), blocks=blocks[:len(mats)],
                      replicate=replicate, shard=shard, ns_batches=ns_batches,
                      other_shapes=[m.shape for m in others], other_blocks=blocks[len(mats):],
                      return_waves=max_waves, zero=zero, wire_bytes=wire_bytes, param_bytes=param_bytes,
                      reduce_bytes=reduce_bytes, hop_a_spread=hop_a_spread, root_regathered=root_regathered,
                      pieces=pieces, experts=layout,
                      token_share=None if layout is None else [m.token_share for m in mats])
