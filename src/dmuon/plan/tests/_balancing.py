"""One cost per matrix into the library's balancers: the plan tests' short way to call them."""

from __future__ import annotations

from typing import Sequence

from dmuon.plan.balance import DEFAULT_TIME_LIMIT_S, balance, canonical, lpt, round_robin
from dmuon.plan.milp import Kind


def kinds_from_costs(costs: Sequence[float]) -> tuple[list[Kind], list[int]]:
    """Groups per-matrix costs into kinds of equal cost (linear in the batch size)."""
    index: dict[float, int] = {}
    items = []
    for c in costs:
        items.append(index.setdefault(float(c), len(index)))
    kinds = [Kind(c, {1: c}, 0) for c in index]
    return kinds, items


def assign_owners(
    costs: Sequence[float],
    world_size: int,
    balancer: str,
    *,
    time_limit_s: float = DEFAULT_TIME_LIMIT_S,
) -> list[int]:
    """Assigns an owner rank to every matrix from one cost per matrix.

    ``"milp"``/``"auto"`` treat matrices of equal cost as interchangeable and
    apply no memory limit (sizes are unknown here); use :func:`balance` for
    batch tables and memory.

    Args:
        costs: Estimated owner-side cost of each matrix.
        world_size: Number of ranks that can own matrices.
        balancer: A name from :data:`BALANCERS`.
        time_limit_s: MILP wall-clock budget.

    Raises:
        ValueError: For an unknown balancer or a non-positive world size.
    """
    name = canonical(balancer)
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if name == "lpt":
        return lpt(costs, world_size)
    if name == "round_robin":
        return round_robin(costs, world_size)
    kinds, items = kinds_from_costs(costs)
    return balance(kinds, items, world_size, name, time_limit_s=time_limit_s, memory_factor=None).owners
