"""Ownership planning: matrix selection, cost model, balancing and the plan itself."""

from dmuon.plan.balance import BALANCERS, assign_owners, lpt, round_robin
from dmuon.plan.plan import BlockInfo, Bucket, MatrixInfo, Plan, build_buckets
from dmuon.plan.selection import default_is_matrix, select_matrices

__all__ = [
    "BALANCERS",
    "BlockInfo",
    "Bucket",
    "MatrixInfo",
    "Plan",
    "assign_owners",
    "build_buckets",
    "default_is_matrix",
    "lpt",
    "round_robin",
    "select_matrices",
]
