"""Data parallelism without sharding: torch's ``DistributedDataParallel`` (stepped as replicas of the whole
model, :mod:`dmuon.runtime.ddp`) and FSDP2's ``replicate`` (read as replicas of one rank each).

Under DDP every rank holds every parameter whole and, after backward, its mean gradient (DDP's all-reduce):
dmuon gives each Muon matrix one owner among DDP's ranks, which alone keeps its momentum and runs its NS, and
all-gathers the updates. What finds the DDP wrapper and checks the ways it can be misused lives here; the
plan is made by :func:`dmuon.prepare.prepare` as for any model.
"""

from __future__ import annotations

import gc

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
    "for data parallelism at DDP's bytes or below (\"DDP with dmuon\", README \"DDP\": the gradients reduced "
    "by dmuon, the momentum split over the ranks, NS once per matrix) write: "
    "mesh = init_device_mesh(device_type, (world_size, 1), mesh_dim_names=(\"replicate\", \"shard\")); "
    "fully_shard(block, mesh=mesh[\"shard\"]) for each block, then fully_shard(model, mesh=mesh[\"shard\"]) "
    "(or torch's replicate(..., mesh=mesh[\"shard\"])); opt = dmuon.DMuon(model, ..., hsdp_mesh=mesh)"
)
"""The route at DDP's bytes or below, named where a DDP setup cannot be stepped."""


def _ddp_type():
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel


def _sharded(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in module.modules()) or \
        any(isinstance(p, DTensor) for p in module.parameters())


def ddp_root(model: nn.Module):
    """``model`` itself when it is a torch ``DistributedDataParallel`` dmuon can step (also under
    ``torch.compile``: the DDP it compiled), else None.

    Raises:
        ValueError: A DDP inside the model (not its root), or a DDP around a model that also uses
            ``fully_shard``, naming what to write instead. Structural (no collective): every rank with
            the same model raises the same error.
    """
    ddp_type = _ddp_type()
    compiled = getattr(model, "_orig_mod", None)  # torch.compile(DDP(model)): the wrapper under the compiled one
    if isinstance(compiled, ddp_type):
        model = compiled
    inner = [name for name, m in model.named_modules() if name and isinstance(m, ddp_type)]
    if inner:
        raise ValueError(f"submodule {inner[0]!r} is a torch DistributedDataParallel inside the model: DDP "
                         "wraps the whole model (model = DistributedDataParallel(model)), and dmuon steps it "
                         "given that wrapper, its .module or its parameters")
    if not isinstance(model, ddp_type):
        return None
    if _sharded(model.module):
        raise ValueError("the model is a torch DistributedDataParallel and also uses fully_shard (FSDP2): the two "
                         "reduce gradients each on their own and dmuon steps no such mix; use one of them: "
                         "DistributedDataParallel(model) alone, or " + RECOMMENDED)
    return model


def wrapping_ddp(module: nn.Module):
    """The torch ``DistributedDataParallel`` whose ``.module`` is ``module``, or None.

    The one running its forward now when there is one (DDP records it); otherwise found among the
    process's objects (an optimizer given ``ddp.module`` or its parameters, set up before any forward:
    a state load on resume). Local: no collective.
    """
    active = active_ddp_module()
    if active is not None and active.module is module:
        return active
    ddp_type = _ddp_type()
    found = [o for o in gc.get_objects() if isinstance(o, ddp_type) and o.module is module]
    return found[0] if found else None


def ddp_mesh(ddp, device_type: str):
    """DDP's process group as a 1-D DeviceMesh (dmuon makes its own groups over those ranks)."""
    from torch.distributed.device_mesh import DeviceMesh

    group = ddp.process_group if getattr(ddp, "process_group", None) is not None else dist.group.WORLD
    return DeviceMesh.from_group(group, device_type, mesh_dim_names=("ddp",))
