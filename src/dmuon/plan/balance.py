"""Owner assignment: map each matrix to exactly one rank."""

from __future__ import annotations

import heapq
from typing import Sequence

BALANCERS = ("greedy", "lpt", "round_robin")


def round_robin(costs: Sequence[float], world_size: int) -> list[int]:
    """Matrix ``i`` goes to rank ``i mod world_size``; the comparison point."""
    return [i % world_size for i in range(len(costs))]


def lpt(costs: Sequence[float], world_size: int) -> list[int]:
    """Greedy longest-processing-time-first assignment.

    Matrices are taken from the most to the least expensive and each goes to
    the rank with the smallest load so far. Ties break on the lower index and
    the lower rank, so every rank computes the identical assignment.
    """
    owners = [0] * len(costs)
    order = sorted(range(len(costs)), key=lambda i: (-costs[i], i))
    loads = [(0.0, r) for r in range(world_size)]
    heapq.heapify(loads)
    for i in order:
        load, rank = heapq.heappop(loads)
        owners[i] = rank
        heapq.heappush(loads, (load + costs[i], rank))
    return owners


def assign_owners(costs: Sequence[float], world_size: int, balancer: str) -> list[int]:
    """Assigns an owner rank to every matrix.

    Args:
        costs: Estimated owner-side cost of each matrix.
        world_size: Number of ranks that can own matrices.
        balancer: ``"greedy"`` (alias ``"lpt"``) or ``"round_robin"``.

    Raises:
        ValueError: For an unknown balancer or a non-positive world size.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if balancer in ("greedy", "lpt"):
        return lpt(costs, world_size)
    if balancer == "round_robin":
        return round_robin(costs, world_size)
    raise ValueError(f"balancer must be one of {BALANCERS}, got {balancer!r}")


def rank_loads(costs: Sequence[float], owners: Sequence[int], world_size: int) -> list[float]:
    """Total cost owned by each rank."""
    loads = [0.0] * world_size
    for cost, owner in zip(costs, owners):
        loads[owner] += cost
    return loads
