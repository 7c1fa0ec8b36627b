"""``dmuon.prepare``: read the sharded model, choose the Muon matrices, assign owners."""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate, Shard

from dmuon.comm.topology import Topology, from_mesh, single_process
from dmuon.ortho.config import NSConfig
from dmuon.plan.assign import assign
from dmuon.plan.balance import BALANCERS
from dmuon.plan.plan import BlockInfo, MatrixInfo, Plan
from dmuon.plan.selection import SelectFn, ViewFn, matrix_views, select_matrices
from dmuon.plan.traffic import shard_rows
from dmuon.rules.adamw import local_tensor


def _fingerprint(model: nn.Module, chosen: list[str], balancer: str, ns: NSConfig) -> torch.Tensor:
    h = hashlib.sha256(f"{balancer}|{sorted(ns.cache_key().items())}|{','.join(chosen)}".encode())
    for name, p in model.named_parameters():
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype}:{p.requires_grad};".encode())
    return torch.frombuffer(bytearray(h.digest()), dtype=torch.uint8).to(torch.int64)


def _check_same_everywhere(fingerprint: torch.Tensor, topology: Topology, device) -> None:
    world_size = topology.world_size
    gathered = torch.zeros(world_size * fingerprint.numel(), dtype=fingerprint.dtype, device=device)
    # torch 2.13 renamed all_gather_into_tensor; keep older releases working.
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    all_gather(gathered, fingerprint.to(device), group=topology.world_group)
    rows = gathered.view(world_size, -1).cpu()
    differing = [r for r in range(world_size) if not torch.equal(rows[r], rows[0])]
    if differing:
        raise ValueError(
            "dmuon.prepare: ranks disagree on the model's parameters (names, shapes, dtypes, "
            f"requires_grad, order) or on prepare's arguments; ranks {differing} differ from rank 0"
        )


def _mesh_of(model: nn.Module):
    """The one DeviceMesh FSDP2 sharded the model on (None for a model without DTensors).

    Raises:
        ValueError: For trainable plain parameters in a multi-process run (not
            under ``fully_shard``), parameters on different meshes, or layouts
            other than FSDP2's ``Shard(0)`` (HSDP: ``(Replicate(), Shard(0))``).
    """
    mesh, first = None, None
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    for name, p in model.named_parameters():
        if p.device.type == "meta":
            raise ValueError(f"parameter {name!r} is on the meta device: materialize weights first")
        if not isinstance(p, DTensor):
            if distributed and p.requires_grad:
                raise ValueError(
                    f"parameter {name!r} is not managed by any fully_shard: call fully_shard on the model "
                    "(and its blocks) before dmuon.prepare / dmuon.DMuon"
                )
            continue
        if mesh is None:
            mesh, first = p.device_mesh, name
        elif p.device_mesh != mesh:
            raise ValueError(f"parameter {name!r} lives on another DeviceMesh than {first!r}; "
                             "dmuon needs every parameter on one FSDP/HSDP mesh")
        expected = (Shard(0),) if mesh.ndim == 1 else (Replicate(), Shard(0))
        if tuple(p.placements) != expected:
            raise ValueError(
                f"parameter {name!r} has placements {tuple(p.placements)}; dmuon supports FSDP2's row "
                f"sharding {expected} (no shard_placement_fn, no tensor parallelism yet)"
            )
    if mesh is not None and mesh.ndim not in (1, 2):
        raise ValueError(f"mesh must be 1-D (FSDP) or 2-D (replicate, shard) for HSDP, got {mesh.ndim}-D")
    return mesh


def _fsdp_blocks(model: nn.Module) -> list[tuple[str, nn.Module, list[nn.Parameter]]]:
    """Each ``fully_shard``-ed module with the parameters it manages itself (not its FSDP children's)."""
    blocks = []
    for name, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        nested = {
            id(p)
            for child_name, child in module.named_modules()
            if child is not module and isinstance(child, FSDPModule)
            for p in child.parameters()
        }
        blocks.append((name, module, [p for p in module.parameters() if id(p) not in nested]))
    return blocks


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
) -> Plan:
    """Reads a ``fully_shard``-ed model, selects its Muon matrices and assigns each one owner.

    Call it on every rank after ``fully_shard`` (exactly as for AdamW) and pass
    the plan to :class:`dmuon.DMuon`; ``DMuon(model)`` calls it with the defaults.

    Args:
        model: The model: every parameter a DTensor of one FSDP2 mesh (1-D, or
            2-D ``(replicate, shard)`` for HSDP), or plain tensors in a single process.
        select: ``select(name, param) -> bool`` overriding the default matrix rule.
            Parameters with ``requires_grad=False`` are never Muon matrices.
        matrix_view: How each chosen parameter of 3 or more dims is seen:
            ``"flatten"`` (one ``(shape[0], prod(shape[1:]))`` matrix, the default
            for ``nn.Conv*`` weights) or ``"stack"`` (``shape[0]`` experts, each
            its own ``shape[1:]`` matrix with its own owner, the default for other
            parameters of three or more dims). A function ``(name, param) -> view``
            or a dict by parameter name (others keep the default).
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
    mesh = _mesh_of(model)
    topology = single_process() if mesh is None else from_mesh(mesh)
    chosen = [(n, p) for n, p in select_matrices(model, select) if p.requires_grad]
    views = matrix_views(model, chosen, matrix_view)
    device = torch.device("cpu")
    if mesh is not None:
        device = torch.device(mesh.device_type, torch.cuda.current_device()) if mesh.device_type == "cuda" \
            else torch.device(mesh.device_type)
    if topology.world_size > 1:
        _check_same_everywhere(_fingerprint(model, [f"{n}:{views[n]}" for n, _ in chosen], balancer, ns), topology, device)

    if mesh is None:
        block_list = [("", model, list(model.parameters()))]
    else:
        block_list = _fsdp_blocks(model)
    block_of: dict[int, int] = {}
    for b, (_, _, params) in enumerate(block_list):
        for p in params:
            block_of[id(p)] = b
    blocks = [BlockInfo(b, name, module) for b, (name, module, _) in enumerate(block_list)]

    infos = []
    shard = topology.shard
    column = topology.coords[1]
    for name, p in chosen:
        if id(p) not in block_of:
            raise ValueError(f"parameter {name!r} is not managed by any fully_shard module")
        split = tuple(shard_rows(p.shape[0], shard))
        local = local_tensor(p)
        if tuple(local.shape) != (split[column], *p.shape[1:]):
            raise ValueError(f"parameter {name!r}: local shard {tuple(local.shape)} is not the row split "
                             f"{split} dmuon expects for shape {tuple(p.shape)}")
        if views[name] == "flatten":
            columns = tuple(shard_rows(p.shape[1], topology.replicate))
            matrices = [MatrixInfo(len(infos), name, p, tuple(p.shape), block_of[id(p)], rows=split,
                                   columns=columns)]
        else:
            # A stack of experts: FSDP2's Shard(0) puts each expert whole on one shard column.
            starts = [sum(split[:s]) for s in range(shard)]
            columns = tuple(shard_rows(p.shape[2], topology.replicate))
            matrices = []
            for e in range(p.shape[0]):
                rows = tuple(p.shape[1] if starts[s] <= e < starts[s] + split[s] else 0 for s in range(shard))
                matrices.append(MatrixInfo(len(infos) + e, f"{name}[{e}]", p, tuple(p.shape[1:]), block_of[id(p)],
                                           rows=rows, columns=columns, expert=e, experts=split))
        for info in matrices:
            infos.append(info)
            blocks[info.block].members.append(info.index)
    blocks = [b for b in blocks if b.members]
    renumber = {b.index: k for k, b in enumerate(blocks)}
    for k, b in enumerate(blocks):
        b.index = k
    for info in infos:
        info.block = renumber[info.block]
    balance = assign(
        infos, topology.world_size, balancer, ns_steps=ns.steps, costs=cost_table, profile=profile,
        ns_kwargs=ns.kwargs(), group=topology.world_group if topology.world_size > 1 else None,
        time_limit_s=time_limit_s, memory_factor=memory_factor, cache_dir=cache_dir,
        replicate=topology.replicate,
    )
    plan = Plan(infos, blocks, topology.world_size, topology.rank, balancer, topology.replicate, mesh)
    plan.balance_result = balance
    plan.param_names = tuple(n for n, _ in model.named_parameters())
    plan.topology = topology
    plan.device = device
    plan.ns = ns
    return plan
