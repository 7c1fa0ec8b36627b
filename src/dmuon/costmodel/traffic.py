"""dmuon's traffic model: what each strategy moves per rank and step, and collective by collective.

Two concerns, one module each, every public name importable from here:

* :mod:`dmuon.costmodel.rank_traffic`: each rank's bytes per step and network level
  (:class:`RankTraffic`) for dmuon (:func:`owner_traffic`), gather-then-compute
  (:func:`gather_traffic`) and FSDP2's own collectives (:func:`fsdp2_traffic`),
  the two HSDP designs (:func:`owner_traffic_column_reduce`,
  :func:`compare_hsdp_designs`), and FSDP2's row split
  (:func:`shard_rows`, from :mod:`dmuon.plan.layout`);
* :mod:`dmuon.costmodel.collectives`: one training step collective by collective, in
  issue order, every rank's bytes in each (:class:`Collective`, from
  :mod:`dmuon.costmodel.collective`; :func:`owner_exchange_collectives`, whose backward
  order is :mod:`dmuon.costmodel.backward_order`'s; :func:`step_collectives`), and its
  alpha-beta time (:class:`AlphaBeta`, :func:`step_figures`, :func:`step_comm`).
"""

from __future__ import annotations

from dmuon.costmodel.collective import AlphaBeta, Collective, step_figures
from dmuon.costmodel.collectives import (
    STEP_STRATEGIES,
    fsdp2_block_collectives,
    owner_exchange_collectives,
    step_collectives,
    step_comm,
    weight_norm_collective,
    with_weight_norms_per_wave,
)
from dmuon.costmodel.rank_traffic import (
    HSDP_DESIGNS,
    RankTraffic,
    compare_hsdp_designs,
    critical_path,
    fsdp2_traffic,
    gather_traffic,
    hsdp_design_traffic,
    level_figures,
    owner_traffic,
    owner_traffic_column_reduce,
    ddp_collectives,
    replicate_all_reduce_traffic,
    row_width,
)
from dmuon.plan.layout import shard_rows
from dmuon.plan.ddp import ddp_hops, ddp_route, scatter_parts  # the routes priced here

__all__ = [
    "HSDP_DESIGNS",
    "STEP_STRATEGIES",
    "AlphaBeta",
    "Collective",
    "RankTraffic",
    "compare_hsdp_designs",
    "critical_path",
    "fsdp2_block_collectives",
    "fsdp2_traffic",
    "gather_traffic",
    "hsdp_design_traffic",
    "level_figures",
    "owner_exchange_collectives",
    "owner_traffic",
    "ddp_collectives",
    "ddp_hops",
    "ddp_route",
    "owner_traffic_column_reduce",
    "replicate_all_reduce_traffic",
    "row_width",
    "scatter_parts",
    "shard_rows",
    "step_collectives",
    "step_comm",
    "step_figures",
    "weight_norm_collective",
    "with_weight_norms_per_wave",
]
