"""Where Muon's momentum lives: beside the parameter's shards, and on HSDP split over the replicas too."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from dmuon.util.torch_compat import local_shape_and_offset, strided_shard_type
_StridedShard = strided_shard_type()

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
        shape, _ = local_shape_and_offset(param.shape, mesh, placements)
        buffer = torch.zeros(shape, dtype=torch.float32, device=param.device)
        return DTensor.from_local(buffer, mesh, placements, run_check=False,
                                  shape=param.shape, stride=torch.empty(param.shape, device="meta").stride())

    def row_layout_for(self, info: MatrixInfo) -> tuple:
        """``(mesh, placements)`` of a per-row state of ``info``'s parameter (NorMuon's second moment,
        shaped ``(*param.shape[:param_dim], width)``): the parameter's rows, whole on every holder of
        a row: the parameter's placements with every split of a column dim (TP's, FSDP2's
        ``Shard(1)``) made ``Replicate``, on the parameter's mesh (on HSDP each replica keeps a
        copy, which the owner's return keeps equal)."""
        param = info.param
        if not isinstance(param, DTensor):
            return None, ()
        # Splits of the rows (FSDP2's Shard(0), its _StridedShard inside TP's) stay the parameter's.
        return param.device_mesh, tuple(Replicate() if isinstance(p, (Shard, _StridedShard))
                                        and p.dim >= info.param_dim else p
                                        for p in param.placements)

    def new_row_buffer(self, info: MatrixInfo, width: int) -> torch.Tensor:
        """A zero float32 per-row state of ``info``'s whole parameter, ``width`` values a row, in
        :meth:`row_layout_for`'s layout."""
        param = info.param
        shape = (*param.shape[: info.param_dim], width)
        if not isinstance(param, DTensor):
            return torch.zeros(shape, dtype=torch.float32, device=param.device)
        mesh, placements = self.row_layout_for(info)
        local_shape, _ = local_shape_and_offset(shape, mesh, placements)
        rows = param.to_local().shape[: info.param_dim]
        if tuple(local_shape[: info.param_dim]) != tuple(rows):
            raise ValueError(f"parameter {info.name!r}: its per-row state would hold rows {tuple(local_shape)} "
                             f"on this rank, its shard holds {tuple(rows)}; this layout is not supported")
        buffer = torch.zeros(local_shape, dtype=torch.float32, device=param.device)
        return DTensor.from_local(buffer, mesh, placements, run_check=False, shape=torch.Size(shape),
                                  stride=torch.empty(shape, device="meta").stride())

    def scalar_layout_for(self, info: MatrixInfo) -> tuple:
        """``(mesh, placements)`` of a per-matrix state of ``info``'s parameter (MuonH's radius, one value
        per matrix of the parameter): whole on every rank, ``Replicate`` on the parameter's mesh."""
        param = info.param
        if not isinstance(param, DTensor):
            return None, ()
        return param.device_mesh, (Replicate(),) * param.device_mesh.ndim

    def new_scalar_buffer(self, info: MatrixInfo, count: int) -> torch.Tensor:
        """A zero float32 per-matrix state of ``info``'s parameter, ``count`` values (its matrices), in
        :meth:`scalar_layout_for`'s layout."""
        param = info.param
        buffer = torch.zeros(count, dtype=torch.float32, device=param.device)
        if not isinstance(param, DTensor):
            return buffer
        mesh, placements = self.scalar_layout_for(info)
        return DTensor.from_local(buffer, mesh, placements, run_check=False, shape=torch.Size((count,)),
                                  stride=(1,))
