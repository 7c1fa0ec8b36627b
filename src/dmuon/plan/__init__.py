"""Ownership planning: matrix selection, cost model, balancing and the plan itself."""

from dmuon.plan.balance import BALANCERS, lpt, round_robin
from dmuon.plan.plan import BlockInfo, MatrixInfo, Plan
from dmuon.plan.selection import default_is_matrix, select_matrices

__all__ = [
    "BALANCERS",
    "BlockInfo",
    "MatrixInfo",
    "Plan",
    "default_is_matrix",
    "lpt",
    "round_robin",
    "select_matrices",
]
