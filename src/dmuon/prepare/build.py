"""``dmuon.prepare``: read the sharded model, choose the Muon matrices, assign owners.

Four steps, on every rank alike (each raises on every rank, never leaving one waiting in a
collective): the model's layout (its mesh, HSDP kind, device, and that every rank has the
same model: :mod:`dmuon.prepare.mesh`); each chosen matrix's pieces on the shard positions
(:mod:`dmuon.prepare.pieces`); the blocks FSDP2 reduces together; the owners (the balancer,
:func:`dmuon.plan.assign.assign`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch import nn

from dmuon.comm.agree import least_over
from dmuon.comm.topology import Topology, from_mesh, single_process
from dmuon.ortho.config import NSConfig
from dmuon.plan.assign import assign
from dmuon.plan.balance import BALANCERS
from dmuon.plan.plan import BlockInfo, MatrixInfo, Plan, ReductionGroup
from dmuon.plan.selection import SelectFn, ViewFn, matrix_views, row_sizes, select_matrices
from dmuon.prepare.mesh import (
    check_no_all_reduce_hook,
    check_expert_split,
    check_same_everywhere,
    fingerprint,
    fsdp_blocks,
    layout_of,
    parameter_device,
)
from dmuon.prepare.ddp import ddp_mesh, ddp_root, replicate_only
from dmuon.prepare.pieces import gather_boxes, matrix_pieces, momentum_ok


@dataclass
class _Layout:
    """What step 1 read: the mesh and how the ranks sit on it, the chosen matrices, where they live."""

    mesh: object
    topology: Topology
    chosen: list[tuple[str, nn.Parameter]]
    views: dict[str, object]
    device: torch.device


# Reads better whole: the length is the public docstring (every argument of dmuon's entry point).
def prepare(
    model: nn.Module,
    *,
    select: SelectFn | None = None,
    matrix_view: ViewFn | dict[str, str] | None = None,
    balancer: str = "greedy",
    ns: NSConfig | None = None,
    profile: bool = False,
    cost_table=None,
    time_limit_s: float = 10.0,
    memory_factor: float | None = 1.25,
    cache_dir=None,
    hsdp_mesh=None,
) -> Plan:
    """Reads a ``fully_shard``-ed (or ``DistributedDataParallel``) model, selects its Muon matrices and
    assigns each one owner.

    Call it on every rank after ``fully_shard`` or ``DistributedDataParallel(...)`` (exactly as for AdamW)
    and pass the plan to :class:`dmuon.DMuon`; ``DMuon(model)`` calls it with the defaults.

    Args:
        model: The model: every trainable parameter a DTensor on meshes cut from one
            root mesh (1-D FSDP, 2-D ``(replicate, shard)`` HSDP, with a tensor- or
            expert-parallel dim after them; torchtitan's dense ``fsdp`` and expert
            ``(efsdp, ep)`` views of one world mesh); a torch
            ``DistributedDataParallel`` (the plan is then its ``.module``'s, over DDP's
            process group: ``Plan.ddp``); or plain tensors in a single process.
        select: ``select(name, param) -> bool`` overriding the default matrix rule.
            Parameters with ``requires_grad=False`` are never Muon matrices.
        matrix_view: How each chosen parameter is seen: ``"flatten"`` (one
            ``(shape[0], prod(shape[1:]))`` matrix, the default for 2-D parameters
            and ``nn.Conv*`` weights), ``"stack"`` (``shape[0]`` experts, each its
            own ``shape[1:]`` matrix with its own owner, the default for other
            parameters of three or more dims), ``"rows:K"`` (K equal row groups,
            each its own matrix and owner: a fused QKV per part, ``"rows:3"``, or
            per head) or row groups of given sizes, ``"rows:q,k,v"`` or a tuple
            ``(q, k, v)`` (a fused GQA QKV; the sizes must sum to the rows). A
            function ``(name, param) -> view`` or a dict by parameter name (others
            keep the default).
        balancer: ``"greedy"``/``"lpt"`` (longest-processing-time first),
            ``"milp"`` (HiGHS: minimize the slowest rank, then the total),
            ``"auto"`` (MILP when small enough, else LPT) or ``"round_robin"``.
        ns: How the owners will run Newton-Schulz (default: ``NSConfig()``, DMuon's
            defaults): the costs are priced, or with ``profile=True`` measured,
            with it, and :class:`dmuon.DMuon` given this plan runs it.
        profile: Measure the owner update per (shape, batch) on this device
            (rank 0 measures and broadcasts; cached on disk) instead of using
            the analytical FLOP model.
        cost_table: A :class:`~dmuon.plan.profile.CostTable` measured elsewhere.
        time_limit_s: MILP time limit; the best solution found is kept.
        memory_factor: Cap on the owner workspace a rank holds, as a multiple of
            the mean (None: no cap).
        cache_dir: Profile cache directory (default ``$DMUON_CACHE_DIR`` or ``~/.cache/dmuon``).
        hsdp_mesh: HSDP with dmuon's replicate level: the ``(replicate, shard[, tp])``
            DeviceMesh whose non-replicate dims the model is ``fully_shard``-ed over
            (``mesh=hsdp_mesh["shard"]``). dmuon then reduces every gradient across the
            replicas itself, each Muon matrix only as far as its owner needs, instead of
            FSDP2's all-reduce (``docs/architecture.md``, "HSDP"). With parameters on several
            views of one root (expert parallelism), a tuple of ``(replicate, ...)`` views, each
            parameter on one view's non-replicate dims. None: the mesh the parameters live on
            (FSDP2's native HSDP when it is 2-D).

    Returns:
        The :class:`~dmuon.plan.Plan`.

    Raises:
        ValueError: For bad arguments, parameters outside ``fully_shard``,
            unsupported layouts (named), or ranks whose models differ; raised
            on every rank.
    """
    if balancer not in BALANCERS:
        raise ValueError(f"balancer must be one of {BALANCERS}, got {balancer!r}")
    if ns is None:
        ns = NSConfig()
    elif not isinstance(ns, NSConfig):
        raise ValueError(f"ns must be a dmuon.NSConfig, got {type(ns).__name__}")
    ddp = ddp_root(model)
    if ddp is not None:
        model = ddp.module
    layout = _read_layout(model, select, matrix_view, balancer, ns, hsdp_mesh, ddp)
    topology = layout.topology
    whole = layout.mesh is None or ddp is not None  # one block: the model (nothing reduces it by units)
    block_list = [("", model, list(model.parameters()))] if whole else fsdp_blocks(model)
    infos, blocks = _matrices(layout, block_list)
    if topology.replicate > 1:
        _check_momentum_layouts(infos, topology, hsdp_mesh, layout.device)
    blocks, renumber = _renumber(blocks, infos)
    groups = _reduction_groups(block_list, renumber)
    balance = assign(
        infos, topology.world_size, balancer, ns_steps=ns.steps, costs=cost_table, profile=profile,
        ns_kwargs=ns.kwargs(), group=topology.mesh_group if topology.world_size > 1 else None,
        time_limit_s=time_limit_s, memory_factor=memory_factor, cache_dir=cache_dir,
        replicate=topology.replicate,
    )
    plan = Plan(infos, blocks, topology.world_size, topology.rank, balancer, topology.replicate, layout.mesh)
    plan.balance_result = balance
    plan.param_names = tuple(n for n, _ in model.named_parameters())
    plan.topology = topology
    plan.device = layout.device
    plan.ns = ns
    plan.hsdp_mesh = hsdp_mesh
    plan.groups = groups
    plan.ddp = ddp is not None
    return plan


def _reduction_groups(block_list: list, renumber: dict) -> list[ReductionGroup]:
    """What FSDP2 reduces together, every trainable parameter included: dmuon's replicate level
    reduces these groups (with hsdp_mesh), the Muon matrices' block by block."""
    names = [name for name, _, _ in block_list]

    def root(name: str) -> str:
        return next(r for r in names if r == name or r == "" or name.startswith(r + "."))

    return [ReductionGroup(name, [p for p in params if p.requires_grad], renumber.get(b), root(name))
            for b, (name, _, params) in enumerate(block_list) if any(p.requires_grad for p in params)]


def _read_layout(model: nn.Module, select, matrix_view, balancer: str, ns: NSConfig, hsdp_mesh, ddp=None) -> _Layout:
    """Step 1: the mesh, the chosen matrices and their views, the device; every rank checks that
    every rank read the same (one all-gather), so a difference raises everywhere.

    Under ``ddp`` (torch's DistributedDataParallel around ``model``) the mesh is DDP's process group,
    1-D: every rank a shard position holding every matrix whole."""
    if ddp is not None:
        if hsdp_mesh is not None:
            raise ValueError("hsdp_mesh is for a model fully_shard-ed over its shard dims; a DistributedDataParallel "
                             "model has no such dims: drop hsdp_mesh (DDP's process group is the data-parallel group)")
        mesh, replicated = None, False
    else:
        mesh, replicated = layout_of(model, hsdp_mesh)
        replicated = replicated or replicate_only(model, mesh)
    if hsdp_mesh is not None:
        check_no_all_reduce_hook(model)
    chosen = [(n, p) for n, p in select_matrices(model, select) if p.requires_grad]
    views = matrix_views(model, chosen, matrix_view)
    device, mixed = parameter_device(model, chosen, mesh)
    if ddp is not None:
        mesh = ddp_mesh(ddp, device.type)
    topology = single_process() if mesh is None else from_mesh(mesh, replicated, device)
    if topology.world_size > 1:
        # Whether this rank's parameters share one device is part of what every rank compares, so
        # a rank with mixed devices makes every rank raise, none waits in a collective for it.
        chosen_views = [f"{n}:{views[n]}" for n, _ in chosen] + [f"hsdp_mesh:{hsdp_mesh is not None}",
                                                                 f"one_device:{mixed is None}"]
        try:
            check_same_everywhere(fingerprint(model, chosen_views, balancer, ns), topology, device)
        except ValueError:
            if mixed is not None:
                raise ValueError(mixed) from None
            raise
    if mixed is not None:
        raise ValueError(mixed)
    return _Layout(mesh, topology, chosen, views, device)


def _matrices(layout: _Layout, block_list: list) -> tuple[list[MatrixInfo], list[BlockInfo]]:
    """Step 2: every chosen parameter's matrices (one, a stack's experts, or row groups), each with its
    pieces on the shard positions, and the blocks they belong to (FSDP2's units, numbered as listed)."""
    block_of = {id(p): b for b, (_, _, params) in enumerate(block_list) for p in params}
    blocks = [BlockInfo(b, name, module) for b, (name, module, _) in enumerate(block_list)]
    for name, p in layout.chosen:
        if id(p) not in block_of:
            raise ValueError(f"parameter {name!r} is not managed by any fully_shard module")
    topology = layout.topology
    boxes = gather_boxes(layout.chosen, topology, layout.device)
    bad = [name for k, (name, _) in enumerate(layout.chosen) if not all(rank[k][0] for rank in boxes)]
    if bad:
        raise ValueError(f"parameters {bad[:5]}: a local shard is not where its DTensor placements put it "
                         "(or not contiguous), a layout dmuon does not support")
    infos: list[MatrixInfo] = []
    shard = topology.shard
    for k, (name, p) in enumerate(layout.chosen):
        for r in range(1, topology.replicate):
            if [b[k] for b in boxes[r * shard : (r + 1) * shard]] != [b[k] for b in boxes[:shard]]:
                raise ValueError(f"parameter {name!r}: replica {r} holds other shards than replica 0; "
                                 "dmuon needs the replicate dim to replicate every parameter")
        for info in _matrices_of(name, p, layout.views[name], [b[k] for b in boxes], len(infos), block_of[id(p)],
                                 topology):
            infos.append(info)
            blocks[info.block].members.append(info.index)
    return infos, blocks


def _matrices_of(name: str, p: nn.Parameter, view, column: list, first: int, block: int,
                 topology: Topology) -> list[MatrixInfo]:
    """The matrices of one parameter as ``view`` sees it, numbered from ``first``; ``column`` holds
    every rank's box of it."""
    shard, replicate = topology.shard, topology.replicate
    if view == "stack":
        check_expert_split(name, p)
    sizes = row_sizes(view, p.shape[0])
    if sizes:
        matrices = []
        for g, (start, height) in enumerate(zip(itertools.accumulate((0, *sizes)), sizes)):
            pieces, starts = matrix_pieces(name, p, column, None, shard, rows_of=(start, height))
            matrices.append(MatrixInfo(first + g, f"{name}[rows {start}:{start + height}]", p,
                                       (height, *p.shape[1:]), block, pieces=pieces, group=g,
                                       group_starts=starts, replicate=replicate))
        return matrices
    if view == "flatten":
        pieces, _ = matrix_pieces(name, p, column, None, shard)
        return [MatrixInfo(first, name, p, tuple(p.shape), block, pieces=pieces, replicate=replicate)]
    matrices = []
    for e in range(p.shape[0]):
        pieces, starts = matrix_pieces(name, p, column, e, shard)
        matrices.append(MatrixInfo(first + e, f"{name}[{e}]", p, tuple(p.shape[1:]), block,
                                   pieces=pieces, expert=e, stack_starts=starts, replicate=replicate))
    return matrices


def _check_momentum_layouts(infos: list[MatrixInfo], topology: Topology, hsdp_mesh, device) -> None:
    """HSDP: every matrix's momentum has a DTensor layout splitting its columns over the replicas.

    Each rank can check only its own momentum shard: one all-reduce puts every rank on the error."""
    r, s = topology.position
    ok = torch.tensor([int(momentum_ok(info, s, r, hsdp_mesh)) for info in infos] or [1], dtype=torch.int32).to(device)
    ok = least_over(ok, topology.mesh_group)
    bad = sorted({infos[k].name.split("[")[0] for k, v in enumerate(ok) if not v and infos})
    if bad:
        raise ValueError(f"parameters {bad[:5]}: no DTensor layout splits their momentum's columns over the "
                         "replicas inside their tensor-parallel split; dmuon does not support it")


def _renumber(blocks: list[BlockInfo], infos: list[MatrixInfo]) -> tuple[list[BlockInfo], dict[int, int]]:
    """Step 3: the blocks holding Muon matrices, numbered in order (the matrices' ``block`` follows),
    and each one's new number by its old."""
    kept = [b for b in blocks if b.members]
    renumber = {b.index: k for k, b in enumerate(kept)}
    for k, b in enumerate(kept):
        b.index = k
    for info in infos:
        info.block = renumber[info.block]
    return kept, renumber
