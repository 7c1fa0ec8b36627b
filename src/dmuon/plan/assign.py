"""Owner assignment for a live model: costs for each matrix, then a balancer."""

from __future__ import annotations

from typing import Sequence

from dmuon.plan.balance import assign_owners
from dmuon.plan.cost import update_cost
from dmuon.plan.plan import MatrixInfo


def assign(infos: Sequence[MatrixInfo], world_size: int, balancer: str, *, ns_steps: int = 5) -> None:
    """Sets ``cost`` and ``owner`` on every matrix; identical on every rank.

    Args:
        infos: The plan's matrices.
        world_size: Ranks that can own matrices (all ranks of the mesh).
        balancer: Balancer name (see :data:`dmuon.plan.balance.BALANCERS`).
        ns_steps: NS iterations, for the cost model.
    """
    for info in infos:
        info.cost = update_cost(info.matrix_shape, ns_steps)
    for info, owner in zip(infos, assign_owners([i.cost for i in infos], world_size, balancer)):
        info.owner = owner
