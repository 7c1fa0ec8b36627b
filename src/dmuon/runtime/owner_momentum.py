"""Each owner's copy of its matrices' whole momentum, so that a launch survives clipping.

Gradient clipping multiplies every gradient by one factor ``c`` once the last
block's gradients exist, after the launches from backward sent the directions
of the unclipped gradients. The direction is linear in the gradient with a
momentum part (``d = K buf + (1 - K) g``: Muon's ``K = mu^2`` with Nesterov), so
the owner can form the clipped direction from the launched one,
``c d0 + (1 - c) K buf``, without a new exchange, if it knows ``buf``, the
matrix's whole momentum before the step. The ranks hold the momentum split by
rows (and on HSDP by columns); the owner keeps a copy of its own matrices'
whole momentum instead, advanced after every step from the direction the step
used (``StepCallbacks.advance_momentum``), which needs no gradient and no
traffic. The copy starts at zero with the rule's momentum; after a state dict
is saved or loaded the ranks send their parts of the momentum to the owners
once, in float32, at the end of the next step (which exchanges clipped blocks
again), so a resumed run and the one that went on take the same steps, bit
for bit.

The copy follows the directions as they arrived: in a 16-bit wire dtype each
carries its rounding, and an error in the copy shrinks by ``mu / (1 + mu)`` a
step (Nesterov; under 1/2), so the copy stays within about the largest
rounding of the recent directions of the rule's momentum, and a clipped
direction within ``(1 - c) K`` of that of the one computed on the ranks (README,
"Clipping"). With a float32 wire the difference is float32 rounding.
"""

from __future__ import annotations

import torch

from dmuon.plan.plan import Plan


class OwnerMomentum:
    """This rank's copies of the whole momentum of the matrices it owns."""

    def __init__(self, plan: Plan, device: torch.device) -> None:
        self.plan = plan
        self.device = device
        self._copies: dict[int, torch.Tensor] = {}
        self.ready = True
        """Whether the copies can be used (the same on every rank: set False only by the step's
        agreement, when some rank's copies were invalidated; True again once the momentum was sent)."""
        self.invalidated = False
        """This rank's copies were invalidated since the last step's agreement (a state saved or loaded)."""

    def of(self, index: int) -> torch.Tensor:
        """The whole ``(m, n)`` float32 momentum of owned matrix ``index`` (zeros before its first step)."""
        copy = self._copies.get(index)
        if copy is None:
            copy = self._copies[index] = torch.zeros(self.plan.infos[index].matrix_shape, device=self.device)
        return copy

    def replace(self, wholes: dict[int, torch.Tensor]) -> None:
        """Takes the whole momenta the ranks sent (float32), and is ready again."""
        self._copies = {i: whole.to(device=self.device, dtype=torch.float32).reshape(self.plan.infos[i].matrix_shape)
                        for i, whole in wholes.items()}
        self.ready = True
        self.invalidated = False

    def invalidate(self) -> None:
        """The rule's momentum was loaded, or saved (a run resumed from it starts from the exact
        momentum, so the run that goes on does too): the copies are stale until sent again. Local
        and collective-free (a state dict may be taken on one rank only); the next step's
        agreement carries it to every rank."""
        self._copies.clear()
        self.invalidated = True

    def numel(self) -> int:
        """Elements held (float32)."""
        return sum(c.numel() for c in self._copies.values())
