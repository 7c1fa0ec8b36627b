"""Analytical per-rank traffic of dmuon and of gather-then-compute, on FSDP and HSDP meshes.

Mirrors the routing in :mod:`dmuon.comm.exchange` hop by hop, so the counted
bytes of a real run equal these numbers (tested).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence


@dataclass
class RankTraffic:
    """Bytes one rank moves per training step, split by network level."""

    intra_sent: int = 0
    """Sent on the shard (intra-node) level."""
    intra_received: int = 0
    """Received on the shard level."""
    inter_sent: int = 0
    """Sent on the replicate (inter-node) level."""
    inter_received: int = 0
    """Received on the replicate level."""

    @property
    def sent(self) -> int:
        return self.intra_sent + self.inter_sent

    @property
    def received(self) -> int:
        return self.intra_received + self.inter_received

    def as_dict(self) -> dict:
        return asdict(self)


def owner_traffic(
    numels: Sequence[int],
    owners: Sequence[int],
    replicate: int,
    shard: int,
    zero: int,
    elem_bytes: int = 4,
    gathers: Sequence[int] | None = None,
) -> list[RankTraffic]:
    """dmuon's traffic per plan rank ``r * shard + s`` for one step with every matrix active.

    Reduce-to-owner runs once. ZeRO-2 then publishes once; ZeRO-3 instead
    materializes every matrix for forward and again for backward, except the
    block kept resident through backward (``OwnerRuntime.resident_through_backward``),
    whose matrices are gathered once.

    Args:
        gathers: Per matrix, how often it is gathered from its owner in a step.
            Default: 1 (ZeRO-2), 2 (ZeRO-3; an upper bound without block information).
    """
    if gathers is None:
        gathers = [1 if zero == 2 else 2] * len(numels)
    world = replicate * shard

    def split(weights: Sequence[int]) -> tuple[list[int], list[int], int]:
        by_column = [0] * shard          # elements whose owner sits in shard column s
        by_owner = [0] * world
        for n, o in zip(weights, owners):
            by_column[o % shard] += n
            by_owner[o] += n
        return by_column, by_owner, sum(weights)

    # Every formula is linear in the elements moved, so a matrix gathered g times
    # counts as g times its size on the gather side.
    red_column, red_owner, red_total = split(numels)
    gat_column, gat_owner, gat_total = split([n * g for n, g in zip(numels, gathers)])
    out = []
    for rank in range(world):
        r, s = divmod(rank, shard)
        t = RankTraffic()
        # Reduce hop 1 (shard level) and hop 2 (replicate level).
        t.intra_sent += red_total - red_column[s]
        t.intra_received += (shard - 1) * red_column[s]
        t.inter_sent += red_column[s] - red_owner[rank]     # my column, owned in other replicas
        t.inter_received += (replicate - 1) * red_owner[rank]
        # Gather hop 1 (replicate level) and hop 2 (shard level).
        t.inter_sent += (replicate - 1) * gat_owner[rank]
        t.inter_received += gat_column[s] - gat_owner[rank]
        t.intra_sent += (shard - 1) * gat_column[s]
        t.intra_received += gat_total - gat_column[s]
        out.append(RankTraffic(*(v * elem_bytes for v in asdict(t).values())))
    return out


def gather_traffic(numels: Sequence[int], replicate: int, shard: int, elem_bytes: int = 4) -> RankTraffic:
    """Gather-then-compute on FSDP2/HSDP for the same matrices, per rank and step.

    Within a replica: weights all-gathered for forward and backward, gradients
    reduce-scattered, update directions all-gathered for NS: four ring passes
    of (S-1)/S each. Across replicas: the gradient shard is all-reduced
    (a ring all-reduce moves 2 (R-1)/R of it each way).
    """
    total = sum(numels)
    intra = 4 * total * (shard - 1) // shard * elem_bytes
    inter = 2 * (total // shard) * (replicate - 1) // replicate * elem_bytes
    return RankTraffic(intra, intra, inter, inter)
