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
        return self.local_parts(members)

    def local_parts(self, members: list[int]) -> dict[int, torch.Tensor]:
        """This rank's part of each member's local gradient as it is now (``MatrixInfo.kept_view`` of
        ``param.grad``; on the replicate level its reduced form: R times the mean, once landed)."""
        r, s = self.position
        infos = self.plan.infos
        return {i: infos[i].kept_view(local_tensor(infos[i].param.grad), r, s) for i in members}

    def copies(self, members: list[int], sums: dict[int, torch.Tensor] | None = None,
               divisor: int | None = 1) -> dict[int, torch.Tensor]:
        """A copy of :meth:`local_parts` (``sums``: on the replicate level, the landed reduction's, where
        the gradient holds them), divided by a pipeline schedule's ``divisor``."""
        sums = sums or {}
        local = self.local_parts([i for i in members if i not in sums])
        parts = {i: sums[i] if i in sums else local[i] for i in members}
        if divisor and divisor != 1:
            return divided(parts, divisor)  # copies already
        return {i: t.clone() for i, t in parts.items()}

    def extrema(self, members: list[int], sums: dict[int, torch.Tensor] | None = None,
                divisor: int | None = 1) -> dict[int, torch.Tensor]:
        """:func:`extrema` of each part :meth:`copies` would copy, without copying the parts (a division
        by a positive divisor keeps the order of the elements, so it divides the extrema alike)."""
        sums = sums or {}
        local = self.local_parts([i for i in members if i not in sums])
        return divided({i: extrema(sums[i] if i in sums else local[i]) for i in members}, divisor)

    def check(self, index: int) -> None:
        """Raises for a gradient Muon cannot step, naming the parameter."""
        grad = self.plan.infos[index].param.grad
        if grad.is_sparse or torch.is_complex(grad):
            raise ValueError(f"parameter {self.plan.infos[index].name!r}: sparse and complex gradients are "
                             "not supported by Muon")


def divided(parts: dict[int, torch.Tensor], divisor: int | None) -> dict[int, torch.Tensor]:
    """``parts`` as a pipeline schedule's in-place division by ``divisor`` leaves them (themselves for 1)."""
    return parts if not divisor or divisor == 1 else {i: t.div(divisor) for i, t in parts.items()}


def extrema(part: torch.Tensor) -> torch.Tensor:
    """``part``'s least and largest element (empty for an empty part), in its dtype.

    Enough to recognise a gradient scaled by one positive factor ``c`` since (a clip, a grad scaler's
    unscale): rounding keeps the order, so ``fl(part * c)``'s extrema are ``fl(extrema * c)``, bit for
    bit, and an edit that is no one factor almost never keeps that for every matrix's extrema."""
    if not part.numel():
        return part.new_empty(0)
    return torch.stack(torch.aminmax(part.reshape(-1)))
