"""Sums over ranks: the rule's per-matrix sums over the weight added over the shard level, and the
gradient norm's scalar over a group.

Both add in rank order, so every rank gets the same bits however the values were grouped.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from dmuon.comm import device_streams
from dmuon.comm.pending import Pending
from dmuon.comm.stats import CommStats
from dmuon.comm.topology import Topology


def ring_all_gather_bytes(nbytes: int, ranks: int) -> int:
    """Bytes one rank sends (and receives) in a ring all-gather of ``nbytes`` from each of ``ranks``."""
    return (ranks - 1) * nbytes


def add_over_shard(flat: torch.Tensor, topo: Topology, stats: CommStats,
                   totals: Callable[[torch.Tensor], dict[int, torch.Tensor]]) -> Pending:
    """Issues the addition of every shard position's ``flat`` (float32, the same length on every rank) from
    the current stream: one all-gather on the shard group, added in rank order once landed; ``wait()``
    gives ``totals`` of the sum. One position: ``totals(flat)``, no collective."""
    shard = topo.shard
    if shard == 1:
        return Pending([], lambda: totals(flat), stats)
    gathered = [torch.empty_like(flat) for _ in range(shard)]
    moved = ring_all_gather_bytes(flat.numel() * flat.element_size(), shard)
    stats.add("intra", moved, moved)
    flight = device_streams.active().issue(
        lambda: dist.all_gather(gathered, flat, group=topo.shard_group, async_op=True),
        reads=(flat,), writes=tuple(gathered))

    def finish() -> dict[int, torch.Tensor]:
        added = gathered[0].clone()
        for part in gathered[1:]:  # rank order: the same bits on every rank, however the calls group
            added += part
        return totals(added)

    return Pending([flight], finish, stats)


def reduce_scalar(total: torch.Tensor, maximum: bool, group) -> None:
    """``total`` (in place) summed, or its maximum taken, over ``group``; waited for at once."""
    dist.all_reduce(total, op=dist.ReduceOp.MAX if maximum else dist.ReduceOp.SUM, group=group)
