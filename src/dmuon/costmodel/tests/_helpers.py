"""Helpers shared by the cost model's traffic and simulation tests."""

from __future__ import annotations

from dmuon.costmodel.collective import AlphaBeta, Collective
from dmuon.costmodel.sim_config import Hardware, StepInputs
from dmuon.costmodel.traffic import RankTraffic


def summed_per_rank(collectives, world: int) -> list[RankTraffic]:
    """Each rank's bytes over ``collectives``, by level."""
    out = [RankTraffic() for _ in range(world)]
    for c in collectives:
        for k, t in enumerate(c.ranks):
            if t is not None:
                setattr(out[k], f"{c.level}_sent", getattr(out[k], f"{c.level}_sent") + t[0])
                setattr(out[k], f"{c.level}_received", getattr(out[k], f"{c.level}_received") + t[1])
    return out


# Round numbers: 1 byte/s per link direction, latencies of 1 s inside a node and 2 s across.
LINKS = AlphaBeta(intra_bandwidth=1.0, inter_bandwidth=1.0, intra_latency=1.0, inter_latency=2.0)


def transfer(world: int, parts, messages: int = 1, level: str = "intra", label: str = "t") -> Collective:
    """A collective with the given (sent, received) per rank (None: not taking part)."""
    return Collective("all_to_all", level, "step", None, list(parts), messages, label)


HW = Hardware("test", compute_flops=1e12, ns_flops=1e12, elementwise_bytes=1e11, links=LINKS)


def small_step_inputs(replicate: int, shard: int, return_waves: int = 4, zero: int = 3, publication: str | None = None
            ) -> StepInputs:
    """Five Muon matrices in blocks 1-2 and the root, two AdamW ones (an embedding in the root, one in block 1)."""
    shapes = [(6, 5), (5, 7), (8, 4), (3, 9), (6, 5)]
    blocks = [1, 1, 2, 2, 0]
    world = replicate * shard
    owners = [(3 * i + 1) % world for i in range(len(shapes))]
    batches: dict[int, list[list[int]]] = {}
    for i, o in enumerate(owners):
        batches.setdefault(o, []).append([i])
    return StepInputs(shapes=shapes, owners=owners, blocks=blocks, replicate=replicate, shard=shard,
                      ns_batches=batches, other_shapes=[(16, 5), (4, 4)], other_blocks=[0, 1],
                      return_waves=return_waves, zero=zero, publication=publication)
