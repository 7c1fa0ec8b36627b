"""Plans from shape lists alone: no weights, any cluster size.

Lets ``dmuon plan`` answer "how would 256 ranks split Qwen2.5-7B?" on a laptop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from dmuon.plan.balance import assign_owners, rank_loads
from dmuon.plan.cost import update_cost


@dataclass(frozen=True)
class OfflineMatrix:
    """One matrix of a shape list, expanded from its count."""

    name: str
    """Unique name (``group[k]`` when a group has several matrices)."""
    shape: tuple[int, int]
    """``(rows, cols)``."""

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]


def expand(groups: Iterable) -> list[OfflineMatrix]:
    """Expands ``(name, shape, count[, muon])`` groups into single Muon matrices."""
    out = []
    for g in groups:
        if not getattr(g, "muon", True):
            continue
        shape = (int(g.shape[0]), int(g.shape[1]))
        if g.count == 1:
            out.append(OfflineMatrix(g.name, shape))
        else:
            out.extend(OfflineMatrix(f"{g.name}[{k}]", shape) for k in range(g.count))
    return out


def traffic_per_rank(
    numels: Sequence[int], owners: Sequence[int], world_size: int, zero: int, elem_bytes: int = 4
) -> list[tuple[int, int]]:
    """``(bytes_sent, bytes_received)`` of dmuon's collectives per rank and step.

    Reduce-to-owner: each rank sends every gradient it does not own to its
    owner and the owner receives W-1 copies. ZeRO-2 then publishes once
    (owner sends W-1 copies, others receive); ZeRO-3 instead gathers each
    matrix for forward and again for backward.
    """
    total = sum(numels)
    owned = [0] * world_size
    for n, o in zip(numels, owners):
        owned[o] += n
    publishes = 1 if zero == 2 else 2
    out = []
    for r in range(world_size):
        others = total - owned[r]
        fan_out = (world_size - 1) * owned[r]
        sent = others + publishes * fan_out
        received = fan_out + publishes * others
        out.append((sent * elem_bytes, received * elem_bytes))
    return out


def gather_traffic_per_rank(numels: Sequence[int], world_size: int, elem_bytes: int = 4) -> tuple[int, int]:
    """Gather-then-compute on FSDP2 (ZeRO-3) for the same matrices, per rank and step.

    Four ring collectives of each matrix: the weight all-gathered for forward
    and for backward, the gradient reduce-scattered, and the update direction
    all-gathered for NS; each moves (W-1)/W of the matrix through every rank.
    """
    moved = 4 * sum(n * (world_size - 1) // world_size for n in numels) * elem_bytes
    return moved, moved


def plan_offline(
    groups: Iterable,
    world_size: int,
    balancer: str = "greedy",
    zero: int = 2,
    costs: dict[tuple[int, int], float] | None = None,
    ns_steps: int = 5,
) -> dict:
    """Assigns owners for a shape list and reports per-rank load, memory and traffic.

    Args:
        groups: Objects with ``name``, ``shape``, ``count`` (and optionally ``muon``).
        world_size: Ranks to plan for.
        balancer: A balancer name accepted by :func:`dmuon.plan.assign_owners`.
        zero: 2 or 3 (affects traffic only).
        costs: Optional measured seconds per shape; the analytical model otherwise.
        ns_steps: NS iterations for the analytical model.

    Returns:
        A JSON-ready dict: ``world_size``, ``balancer``, ``makespan``, ``mean``,
        ``imbalance``, ``cost_unit`` and ``ranks`` (each with ``rank``, ``cost``,
        ``matrices``, ``state_bytes``, ``bytes_sent``, ``bytes_received``).

    Raises:
        ValueError: For a non-positive world size or an unknown balancer.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    mats = expand(groups)
    if costs is not None:
        missing = sorted({m.shape for m in mats if m.shape not in costs})
        if missing:
            raise ValueError(f"costs: no measurement for shapes {missing[:5]}")
        cost = [costs[m.shape] for m in mats]
    else:
        cost = [update_cost(m.shape, ns_steps) for m in mats]
    owners = assign_owners(cost, world_size, balancer)
    loads = rank_loads(cost, owners, world_size)
    traffic = traffic_per_rank([m.numel for m in mats], owners, world_size, zero)
    ranks = []
    for r in range(world_size):
        mine = [k for k, o in enumerate(owners) if o == r]
        ranks.append({
            "rank": r,
            "cost": loads[r],
            "matrices": [mats[k].name for k in mine],
            "state_bytes": sum(mats[k].numel for k in mine) * 4,
            "bytes_sent": traffic[r][0],
            "bytes_received": traffic[r][1],
        })
    mean = sum(loads) / world_size
    makespan = max(loads)
    g_sent, g_recv = gather_traffic_per_rank([m.numel for m in mats], world_size)
    return {
        "world_size": world_size,
        "balancer": balancer,
        "zero": zero,
        "cost_unit": "seconds" if costs is not None else "flops (analytical)",
        "matrices": len(mats),
        "makespan": makespan,
        "mean": mean,
        "imbalance": makespan / mean if mean > 0 else 1.0,
        "gather_bytes_per_rank": {"sent": g_sent, "received": g_recv},
        "ranks": ranks,
    }
