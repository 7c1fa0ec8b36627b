"""Data parallelism without sharding: FSDP2's ``replicate`` (read as replicas of one rank) and torch's
``DistributedDataParallel`` (refused, naming the route to write instead: ``RECOMMENDED``)."""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from dmuon.util.torch_compat import active_ddp_module


def replicate_only(model: nn.Module, mesh) -> bool:
    """Whether the model is data parallel over a 1-D mesh without sharding (torch's FSDP2-based
    ``replicate``: every parameter a ``Replicate()`` DTensor of ``mesh``).

    dmuon then reads the mesh as ``mesh.size(0)`` replicas of one rank each (native HSDP with
    shards of one rank): each rank keeps its column slice of every Muon matrix's momentum and sends
    the owner that slice's direction. Read as ``mesh.size(0)`` shards instead, every rank's piece
    would be the whole matrix: every rank would keep every momentum, and the first of the identical
    pieces would send every direction. (FSDP2 still all-reduces every gradient here; over the
    one-rank shard dim of an ``(N, 1)`` mesh with ``hsdp_mesh`` dmuon reduces them itself, for fewer
    bytes: README "DDP".)
    """
    if mesh is None or mesh.ndim != 1 or mesh.size(0) == 1:
        return False
    params = [p for p in model.parameters() if isinstance(p, DTensor)]
    return bool(params) and all(p.device_mesh == mesh and all(isinstance(q, Replicate) for q in p.placements)
                                for p in params)


RECOMMENDED = (
    "for data parallelism without sharding with dmuon (\"DDP with dmuon\", README \"DDP\": at most DDP's bytes, "
    "the momentum split over the ranks, NS once per matrix) drop DistributedDataParallel and write: "
    "mesh = init_device_mesh(device_type, (world_size, 1), mesh_dim_names=(\"replicate\", \"shard\")); "
    "fully_shard(block, mesh=mesh[\"shard\"]) for each block, then fully_shard(model, mesh=mesh[\"shard\"]) "
    "(or torch's replicate(..., mesh=mesh[\"shard\"])); opt = dmuon.DMuon(model, ..., hsdp_mesh=mesh)"
)
"""What a DDP user writes instead, named by every DDP error."""


def _ddp_type():
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel


def _sharded(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in module.modules()) or \
        any(isinstance(p, DTensor) for p in module.parameters())


def check_no_ddp(model: nn.Module) -> None:
    """Raises ``ValueError`` naming what to write instead when ``model`` is, or holds, a torch
    ``DistributedDataParallel``: DDP all-reduces every gradient itself, in buckets of its own choosing,
    so dmuon would reduce them a second time and could not split the momentum.

    Structural (no collective): every rank with the same model raises the same error.
    """
    ddp_type = _ddp_type()
    wrappers = [(name, m) for name, m in model.named_modules() if isinstance(m, ddp_type)]
    if not wrappers:
        return
    name, ddp = wrappers[0]
    where = "the model is" if not name else f"submodule {name!r} is"
    if _sharded(model):
        raise ValueError(f"{where} a torch DistributedDataParallel and the model also uses fully_shard (FSDP2): "
                         "the two reduce gradients each on their own and dmuon steps no such mix; " + RECOMMENDED)
    world = dist.get_world_size() if dist.is_initialized() else 1
    group = getattr(ddp, "process_group", None)
    size = dist.get_world_size(group) if group is not None and dist.is_initialized() else world
    if size != world:
        raise ValueError(f"{where} a torch DistributedDataParallel over a process group of {size} of the {world} "
                         "ranks; dmuon does not step DDP models, and it reduces over the parameters' DeviceMesh "
                         "(not a DDP process group); " + RECOMMENDED)
    raise ValueError(f"{where} a torch DistributedDataParallel: dmuon does not step DDP models (DDP all-reduces "
                     "every gradient itself; dmuon would reduce the Muon matrices again and keep every "
                     "momentum on every rank); " + RECOMMENDED)


def check_not_under_ddp(model: nn.Module) -> None:
    """Raises ``ValueError`` when ``model`` runs its forward inside a torch ``DistributedDataParallel``'s (the
    optimizer was given ``ddp.module`` or the parameters, or was built before ``DDP(...)`` wrapped the
    model): called at the model's first forward, on every rank."""
    active = active_ddp_module()
    if active is not None and active.module is model:
        raise ValueError("the model runs inside a torch DistributedDataParallel (DMuon was given ddp.module or "
                         "its parameters, or was built before DDP(...) wrapped the model): dmuon does not step "
                         "DDP models; " + RECOMMENDED)
