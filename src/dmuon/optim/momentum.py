"""Where Muon's momentum lives: beside FSDP2's row shards, and on HSDP split over the replicas too."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Shard

from dmuon.comm.topology import Topology
from dmuon.plan.plan import MatrixInfo


class MomentumLayout:
    """The momentum buffer of each Muon matrix on this rank.

    FSDP: sharded like the parameter (``Shard(0)``, a DTensor like AdamW's
    state). HSDP: the parameter's rows ``Shard(0)`` over the shard level and its
    columns (``shape[1]``) ``Shard(1)`` over the replicas, so each element lives
    on one rank of the mesh only (``MatrixInfo.columns``); the direction's
    column slices then travel to the owner's replica (hop A of
    :mod:`dmuon.comm.exchange`).
    """

    def __init__(self, topology: Topology) -> None:
        self.topo = topology

    @property
    def placements(self) -> tuple:
        return (Shard(1), Shard(0)) if self.topo.replicate > 1 else (Shard(0),)

    def kept_slice(self, info: MatrixInfo, local: torch.Tensor) -> torch.Tensor:
        """The part of a local row shard whose momentum this rank keeps (HSDP: its replica's columns)."""
        if self.topo.replicate == 1:
            return local
        r = self.topo.coords[0]
        return local.narrow(1, info.column_start(r), info.columns[r])

    def new_buffer(self, info: MatrixInfo) -> torch.Tensor:
        """A zero float32 momentum buffer in this layout."""
        param = info.param
        if self.topo.replicate == 1 or not isinstance(param, DTensor):
            return torch.zeros_like(param, dtype=torch.float32, memory_format=torch.preserve_format)
        kept = self.kept_slice(info, param.to_local())
        local = torch.zeros(kept.shape, dtype=torch.float32, device=kept.device)
        return DTensor.from_local(local, param.device_mesh, self.placements, run_check=False,
                                  shape=param.shape, stride=torch.empty(param.shape, device="meta").stride())
