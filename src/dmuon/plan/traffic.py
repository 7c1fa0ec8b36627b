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
) -> list[RankTraffic]:
    """dmuon's traffic per plan rank ``r * shard + s`` for one step with every matrix active.

    Reduce-to-owner runs once. ZeRO-2 then publishes once; ZeRO-3 instead
    materializes every matrix for forward and again for backward.
    """
    gathers = 1 if zero == 2 else 2
    world = replicate * shard
    by_column = [0] * shard              # elements whose owner sits in shard column s
    by_owner = [0] * world
    for n, o in zip(numels, owners):
        by_column[o % shard] += n
        by_owner[o] += n
    total = sum(numels)
    out = []
    for rank in range(world):
        r, s = divmod(rank, shard)
        column_elsewhere = by_column[s] - by_owner[rank]   # my column, owned in other replicas
        t = RankTraffic()
        # Reduce hop 1 (shard level) and hop 2 (replicate level).
        t.intra_sent += total - by_column[s]
        t.intra_received += (shard - 1) * by_column[s]
        t.inter_sent += column_elsewhere
        t.inter_received += (replicate - 1) * by_owner[rank]
        # Gather hop 1 (replicate level) and hop 2 (shard level), per gather.
        t.inter_sent += gathers * (replicate - 1) * by_owner[rank]
        t.inter_received += gathers * column_elsewhere
        t.intra_sent += gathers * (shard - 1) * by_column[s]
        t.intra_received += gathers * (total - by_column[s])
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
