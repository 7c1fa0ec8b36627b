"""What the runtime's setup tells on rank 0, at INFO on the ``dmuon`` logger (:mod:`dmuon.util.observe`)."""

from __future__ import annotations

import logging

from dmuon.plan.plan import Plan
from dmuon.util import jsoncache
from dmuon.util.observe import logger

_said_unlocked = False


def predicted_ns(plan: Plan) -> str:
    """The slowest owner's NS per step as the balancer priced it: seconds where the costs were measured
    (``prepare(profile=True)`` or a cost table), else the analytical model's FLOPs, which predict no time."""
    slowest = max(plan.rank_costs(), default=0.0)
    unit = getattr(plan.balance_result, "cost_unit", "flops")
    if unit == "seconds":
        return f"{slowest * 1e3:.3g} ms on the slowest owner (measured costs)"
    if unit == "flops":
        return (f"{slowest / 1e9:.3g} GFLOP on the slowest owner (the analytical model predicts no time: "
                "prepare(profile=True) measures seconds)")
    return f"{slowest:.3g} ({unit} costs) on the slowest owner"


def log_setup(plan: Plan, tuned_batches: int, tune_seconds: float, spread: float | None = None) -> None:
    """On plan rank 0: the matrices and their owners (the plan's table), the balance (the largest
    owner's cost over the mean), the predicted NS time, the NS tuning done and how long it took, and
    ``spread``, the seconds between the first and the last rank's end of tuning. Nothing on the other
    ranks, nor where INFO is off. On any rank, once per process, at WARNING: that the tuning ran
    without the host's lock (the file system refused ``flock``), so the host's ranks measured at once."""
    global _said_unlocked
    if jsoncache.UNLOCKED and not _said_unlocked:
        _said_unlocked = True
        logger.warning("dmuon setup: NS tuning ran without the host's lock (%s): the host's ranks measured at "
                       "the same time, each timing the others' load", jsoncache.UNLOCKED[0])
    if plan.rank != 0 or not logger.isEnabledFor(logging.INFO):
        return
    logger.info("%s", plan)
    balance = plan.balance_result
    ns = plan.ns
    if tuned_batches:
        tuning = (f"{tuned_batches} NS batches tuned on rank 0 in {tune_seconds:.2f} s "
                  f"(method={ns.method}, batching={ns.batching}; the other ranks tune their own)")
    else:
        tuning = f"no NS tuning (method={ns.method}, batching={ns.batching} fixed)"
    if spread is not None:
        tuning += f"; the ranks ended tuning within {spread:.2f} s of each other (waited on the store)"
    solve = f", balanced in {balance.solve_seconds:.2f} s ({balance.method})" if balance is not None else ""
    logger.info("dmuon setup: %d Muon matrices on %d ranks, balancer=%s%s; balance (largest owner's cost "
                "over the mean) %.3f; predicted NS per step: %s; %s", len(plan.infos), plan.world_size,
                plan.balancer, solve, plan.imbalance(), predicted_ns(plan), tuning)
