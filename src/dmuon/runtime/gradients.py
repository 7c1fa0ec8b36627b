"""This rank's part of each Muon matrix's reduced gradient, where the launches and the step read it."""

from __future__ import annotations

import torch

from dmuon.plan.plan import Plan
from dmuon.runtime.replicate import ReplicateLevel
from dmuon.util.dtensor import local_tensor


class GradientParts:
    """Hands out this rank's part of each matrix's reduced gradient and refuses the kinds Muon cannot take.

    Args:
        plan: The ownership plan.
        position: This rank's ``(replica, shard position)``.
        replicate: dmuon's replicate level, whose mean over replicas is the reduced gradient; None:
            FSDP2 (or HSDP) reduced it into ``param.grad``.
    """

    def __init__(self, plan: Plan, position: tuple[int, int], replicate: ReplicateLevel | None) -> None:
        self.plan = plan
        self.position = position
        self.replicate = replicate

    def parts(self, members: list[int]) -> dict[int, torch.Tensor]:
        """This rank's part of each member's reduced gradient (``MatrixInfo.kept_view``; with the
        replicate level, of the mean over replicas once :meth:`ReplicateLevel.finish` ran)."""
        if self.replicate is not None:
            return {i: self.replicate.mean_part(i) for i in members}
        r, s = self.position
        infos = self.plan.infos
        return {i: infos[i].kept_view(local_tensor(infos[i].param.grad), r, s) for i in members}

    def check(self, index: int) -> None:
        """Raises for a gradient Muon cannot step, naming the parameter."""
        grad = self.plan.infos[index].param.grad
        if grad.is_sparse or torch.is_complex(grad):
            raise ValueError(f"parameter {self.plan.infos[index].name!r}: sparse and complex gradients are "
                             "not supported by Muon")
