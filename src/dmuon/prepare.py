"""``dmuon.prepare``: choose the Muon matrices, assign owners, install the runtime."""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from dmuon.comm.topology import from_mesh, single_process
from dmuon.fsdp.runtime import OwnerRuntime
from dmuon.plan.assign import assign
from dmuon.plan.balance import BALANCERS
from dmuon.plan.plan import BlockInfo, MatrixInfo, Plan, build_buckets
from dmuon.plan.selection import SelectFn, select_matrices


def find_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Default blocks: the entries of every outermost ``nn.ModuleList``, in order.

    These are the transformer layers a training script passes to
    ``fully_shard`` one by one.
    """
    found: list[tuple[str, nn.Module]] = []

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            path = f"{prefix}.{name}" if prefix else name
            if isinstance(child, nn.ModuleList):
                found.extend((f"{path}.{k}", m) for k, m in child.named_children())
            else:
                visit(path, child)

    visit("", model)
    return found


def _fingerprint(model: nn.Module, chosen: list[str], zero: int, balancer: str) -> torch.Tensor:
    h = hashlib.sha256(f"{zero}|{balancer}|{','.join(chosen)}".encode())
    for name, p in model.named_parameters():
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype};".encode())
    return torch.frombuffer(bytearray(h.digest()), dtype=torch.uint8).to(torch.int64)


def _check_same_everywhere(fingerprint: torch.Tensor, group, world_size: int, device) -> None:
    gathered = torch.zeros(world_size * fingerprint.numel(), dtype=fingerprint.dtype, device=device)
    # torch 2.13 renamed all_gather_into_tensor; keep older releases working.
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    all_gather(gathered, fingerprint.to(device), group=group)
    rows = gathered.view(world_size, -1).cpu()
    differing = [r for r in range(world_size) if not torch.equal(rows[r], rows[0])]
    if differing:
        raise ValueError(
            "dmuon.prepare: ranks disagree on the model's parameters (names, shapes, dtypes, "
            f"order) or on prepare's arguments; ranks {differing} differ from rank 0"
        )


def _check_zero3_storage(info: MatrixInfo) -> None:
    p = info.param
    if not p.is_contiguous() or p.storage_offset() != 0 or p.untyped_storage().nbytes() != p.numel() * p.element_size():
        raise ValueError(
            f"parameter {info.name!r}: zero=3 needs each matrix to own a contiguous storage; "
            "use zero=2 or allocate the weight as its own tensor"
        )


def prepare(
    model: nn.Module,
    mesh=None,
    *,
    zero: int = 3,
    select: SelectFn | None = None,
    balancer: str = "greedy",
    blocks: list[nn.Module] | None = None,
    ns_steps: int = 5,
    profile: bool = False,
    cost_table=None,
    ns_kwargs: dict | None = None,
    time_limit_s: float = 10.0,
    memory_factor: float | None = 1.25,
    cache_dir=None,
) -> Plan:
    """Selects the Muon matrices, assigns each one owner rank and installs the runtime.

    Call it on every rank, before ``fully_shard``, then pass ``plan.matrices``
    as ``ignored_params`` to every ``fully_shard`` call.

    Args:
        model: The model, with real (non-meta) weights on its training device.
        mesh: A 1-D ``DeviceMesh`` (FSDP), a 2-D one ``(replicate, shard)`` (HSDP:
            owners are global over all R*S ranks, traffic routed intra-replica
            first), or None for a single process without a process group.
        zero: 2 keeps full matrices resident on every rank; 3 frees them on
            non-owners between uses and re-materializes them before forward/backward.
        select: ``select(name, param) -> bool`` overriding the default matrix rule.
        balancer: ``"greedy"``/``"lpt"`` (longest-processing-time first),
            ``"milp"`` (HiGHS: minimize the slowest rank, then the total),
            ``"auto"`` (MILP when small enough, else LPT) or ``"round_robin"``.
        blocks: Modules that form the packing/prefetch units, in forward order
            (default: the entries of the model's ``nn.ModuleList``s).
        ns_steps: NS iterations, for the cost estimate.
        profile: Measure the owner update per (shape, batch) on this device
            (rank 0 measures and broadcasts; cached on disk) instead of using
            the analytical FLOP model.
        cost_table: A :class:`~dmuon.plan.profile.CostTable` measured elsewhere.
        ns_kwargs: NS settings for profiling (method, dtype, steps...).
        time_limit_s: MILP time limit; the best solution found is kept.
        memory_factor: Cap on the optimizer state a rank owns, as a multiple of
            the mean (None: no cap).
        cache_dir: Profile cache directory (default ``$DMUON_CACHE_DIR`` or ``~/.cache/dmuon``).

    Returns:
        The :class:`~dmuon.plan.Plan`.

    Raises:
        ValueError: For bad arguments, models already sharded, unsupported
            parameters (named), or ranks whose models differ.
    """
    if zero not in (2, 3):
        raise ValueError(f"zero must be 2 or 3, got {zero!r}")
    if balancer not in BALANCERS:
        raise ValueError(f"balancer must be one of {BALANCERS}, got {balancer!r}")
    if mesh is None:
        topology = single_process()
    else:
        if not dist.is_initialized():
            raise ValueError("mesh was given but torch.distributed is not initialized")
        topology = from_mesh(mesh)
    group, rank, world_size = topology.world_group, topology.rank, topology.world_size

    for name, p in model.named_parameters():
        if isinstance(p, DTensor):
            raise ValueError(f"parameter {name!r} is already sharded: call dmuon.prepare before fully_shard")
        if p.device.type == "meta":
            raise ValueError(f"parameter {name!r} is on the meta device: materialize weights before prepare")
    chosen = select_matrices(model, select)
    if world_size > 1:
        device = chosen[0][1].device if chosen else torch.device("cpu")
        if dist.get_backend(group) == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        _check_same_everywhere(_fingerprint(model, [n for n, _ in chosen], zero, balancer), group, world_size, device)

    block_list = [("", model)] + (
        [(next((n for n, m in model.named_modules() if m is b), f"block{k}"), b) for k, b in enumerate(blocks)]
        if blocks is not None
        else find_blocks(model)
    )
    block_of: dict[int, int] = {}
    for b, (_, module) in enumerate(block_list[1:], start=1):
        for p in module.parameters():
            block_of[id(p)] = b  # innermost listed block wins when blocks nest
    block_infos = [BlockInfo(b, name, module) for b, (name, module) in enumerate(block_list)]

    infos = []
    for index, (name, p) in enumerate(chosen):
        info = MatrixInfo(index, name, p, tuple(p.shape), block_of.get(id(p), 0))
        infos.append(info)
        block_infos[info.block].matrices.append(index)
    balance = assign(
        infos, world_size, balancer, ns_steps=ns_steps, costs=cost_table, profile=profile,
        ns_kwargs=ns_kwargs, group=group if world_size > 1 else None,
        time_limit_s=time_limit_s, memory_factor=memory_factor, cache_dir=cache_dir,
    )
    if zero == 3:
        for info in infos:
            _check_zero3_storage(info)

    plan = Plan(infos, block_infos, build_buckets(infos, block_infos, topology.shard),
                world_size, rank, zero, balancer, topology.replicate, mesh)
    plan.balance = balance
    plan.param_names = tuple(n for n, _ in model.named_parameters())
    plan.runtime = OwnerRuntime(plan, topology)
    if zero == 2:
        # Start from the owners' values so ranks that initialized differently agree.
        plan.runtime.publish_all()
    else:
        plan.runtime.drain()
        plan.runtime.install_zero3_hooks()
    # Set-up traffic is not part of any training step.
    plan.runtime.stats.reset()
    return plan
