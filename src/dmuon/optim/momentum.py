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

    def placements_for(self, info: MatrixInfo) -> tuple:
        """The momentum's placements for ``info``'s parameter (a stack's columns are its dim 2)."""
        return (Shard(info.param_dim), Shard(0)) if self.topo.replicate > 1 else (Shard(0),)

    def kept_slice(self, info: MatrixInfo, view: torch.Tensor) -> torch.Tensor:
        """The part of a matrix's local rows (``info.local_view``) whose momentum this rank keeps
        (HSDP: its replica's columns)."""
        if self.topo.replicate == 1:
            return view
        r = self.topo.coords[0]
        return view.narrow(1, info.column_start(r), info.columns[r])

    def new_buffer(self, info: MatrixInfo) -> torch.Tensor:
        """A zero float32 momentum buffer for ``info``'s whole parameter, in this layout."""
        param = info.param
        if self.topo.replicate == 1 or not isinstance(param, DTensor):
            return torch.zeros_like(param, dtype=torch.float32, memory_format=torch.preserve_format)
        local = param.to_local()
        shape = list(local.shape)
        shape[info.param_dim] = info.columns[self.topo.coords[0]]
        buffer = torch.zeros(shape, dtype=torch.float32, device=local.device)
        return DTensor.from_local(buffer, param.device_mesh, self.placements_for(info), run_check=False,
                                  shape=param.shape, stride=torch.empty(param.shape, device="meta").stride())
