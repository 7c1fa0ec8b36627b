"""Where Muon's momentum lives: beside the parameter's shards, and on HSDP split over the replicas too."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from dmuon.plan.plan import MatrixInfo, Plan
from dmuon.prepare import momentum_layout


class MomentumLayout:
    """The momentum buffer of each Muon matrix on this rank.

    FSDP (and FSDP + TP): sharded like the parameter, a DTensor like AdamW's
    state. HSDP: the parameter's shards over the shard (and TP) dims and its
    columns (``shape[1]``) split over the replicas inside them
    (:func:`dmuon.prepare.momentum_layout`), so each element lives on one
    rank of the mesh only (``MatrixInfo.replica_columns``); the direction's
    column slices then travel to the owner's replica (hop A of
    :mod:`dmuon.comm.exchange`).
    """

    def __init__(self, plan: Plan) -> None:
        self.replicate = plan.replicate
        self.hsdp_mesh = plan.hsdp_mesh
        """With dmuon's replicate level, the mesh the momentum lives on (the parameters on its sub-mesh)."""

    def layout_for(self, info: MatrixInfo) -> tuple:
        """``(mesh, placements)`` of the momentum of ``info``'s parameter: the parameter's, and on HSDP
        its columns split over the replicas (a stack's columns are its dim 2)."""
        if self.replicate == 1 or not isinstance(info.param, DTensor):
            return getattr(info.param, "device_mesh", None), tuple(getattr(info.param, "placements", ()))
        return momentum_layout(info.param, info.param_dim, self.hsdp_mesh)

    def new_buffer(self, info: MatrixInfo) -> torch.Tensor:
        """A zero float32 momentum buffer for ``info``'s whole parameter, in this layout."""
        param = info.param
        if self.replicate == 1 or not isinstance(param, DTensor):
            return torch.zeros_like(param, dtype=torch.float32, memory_format=torch.preserve_format)
        mesh, placements = self.layout_for(info)
        # prepare checked that this layout gives every rank exactly the columns it keeps.
        shape, _ = compute_local_shape_and_global_offset(param.shape, mesh, placements)
        buffer = torch.zeros(shape, dtype=torch.float32, device=param.device)
        return DTensor.from_local(buffer, mesh, placements, run_check=False,
                                  shape=param.shape, stride=torch.empty(param.shape, device="meta").stride())
