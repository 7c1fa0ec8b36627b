"""Data parallelism without sharding: FSDP2's ``replicate`` and torch's ``DistributedDataParallel``."""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate


def replicate_only(model: nn.Module, mesh) -> bool:
    """Whether the model is data parallel over a 1-D mesh without sharding (torch's FSDP2-based
    ``replicate``: every parameter a ``Replicate()`` DTensor of ``mesh``).

    dmuon then reads the mesh as ``mesh.size(0)`` replicas of one rank each (native HSDP with
    shards of one rank): each rank holds its column slice of every Muon matrix's momentum and
    sends only that slice's updates, instead of every rank sending everything as the first of
    identical pieces.
    """
    if mesh is None or mesh.ndim != 1 or mesh.size(0) == 1:
        return False
    params = [p for p in model.parameters() if isinstance(p, DTensor)]
    return bool(params) and all(p.device_mesh == mesh and all(isinstance(q, Replicate) for q in p.placements)
                                for p in params)
