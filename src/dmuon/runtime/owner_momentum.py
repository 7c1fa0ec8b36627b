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
traffic.

The copies cost memory (about the Muon momentum's size per rank, on average),
so they exist only while clipping does: a run starts without them; the first
step whose gradients every rank finds scaled by one factor exchanges its
clipped blocks again (as without copies) and then has every rank send its part
of the momentum to the owners, once, in float32; from then on clipped steps
keep their launches. After :data:`IDLE_STEPS` steps without a clip the copies
are dropped (the next clip starts them again). Saving or loading a state dict
drops them too (the next clip sends the momentum again), so a run resumed from
a checkpoint and the one that saved it take the same steps, bit for bit. Every
one of these decisions comes from the step's agreement, the same on every rank.

Telling a rescale needs the gradients as launched. Only while the copies are
ready does a rescaled launch stand, on proof that every element is the launched
one times the factor, bit for bit: only then does each launch keep a copy of its
gradient parts (``Launch.grads``, about the Muon gradients' size per rank from
backward to ``step()``). Before, a rescale only starts the copies, and each
launch keeps its parts' least and largest elements (``Launch.grad_extrema``: a
positive factor maps them exactly, rounding keeps the order), from which the
first rescale is recognised as from the whole parts; a run that never clips
keeps no copy.

The copy follows the directions as they arrived: in a 16-bit wire dtype each
carries its rounding, and an error in the copy shrinks by ``mu / (1 + mu)`` a
step (Nesterov; under 1/2), so the copy stays within about the largest
rounding of the recent directions of the rule's momentum, and a clipped
direction within ``(1 - c) K`` of that of the one computed on the ranks (README,
"Clipping"). With a float32 wire the difference is float32 rounding.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dmuon.plan.plan import Plan
from dmuon.runtime.agreement import NONUNIFORM, SCALE_FLAGS, agreed_scale, scale_flags, uniform_scales
from dmuon.runtime.gradients import extrema
from dmuon.util.bits import any_bits_differ
from dmuon.util.dtensor import local_tensor

if TYPE_CHECKING:
    from dmuon.runtime.launch import Launch

IDLE_STEPS = 100
"""Steps without a clip after which the owners drop their copies (their memory)."""


class OwnerMomentum:
    """This rank's copies of the whole momentum of the matrices it owns."""

    def __init__(self, plan: Plan, device: torch.device) -> None:
        self.plan = plan
        self.device = device
        self._copies: dict[int, torch.Tensor] = {}
        self.ready = False
        """Whether the copies are the rule's momentum and can be used (the same on every rank: set by
        the step's agreement and the momentum's sending, never by one rank alone)."""
        self.invalidated = False
        """This rank's copies were invalidated since the last step's agreement (a state saved or loaded)."""
        self.wanted = False
        """The last step's agreement found a clip the copies would have served (they were not ready):
        the runtime sends the momentum to the owners at the end of the step."""
        self.idle = 0
        """Steps since the last clip (while ready)."""

    def of(self, index: int) -> torch.Tensor:
        """The whole ``(m, n)`` float32 momentum of owned matrix ``index`` (zeros before its first step)."""
        copy = self._copies.get(index)
        if copy is None:
            copy = self._copies[index] = torch.zeros(self.plan.infos[index].matrix_shape, device=self.device)
        return copy

    def replace(self, wholes: dict[int, torch.Tensor]) -> None:
        """Takes the whole momenta the ranks sent (float32), and is ready. Copies them: with one rank (or
        a piece the owner holds whole) they may be views of the rule's own momentum."""
        self._copies = {i: whole.to(device=self.device, dtype=torch.float32, copy=True)
                        .reshape(self.plan.infos[i].matrix_shape) for i, whole in wholes.items()}
        self.ready, self.wanted, self.invalidated, self.idle = True, False, False, 0

    def drop(self) -> None:
        """Frees the copies (every rank at once: after :data:`IDLE_STEPS` agreed steps without a clip)."""
        self._copies.clear()
        self.ready = False

    def tensors(self) -> list[torch.Tensor]:
        """The copies held (for live-memory measurements)."""
        return list(self._copies.values())

    def invalidate(self) -> None:
        """The rule's momentum was loaded, or saved (a run resumed from it starts from the exact
        momentum, so the run that goes on does too): the copies are stale until sent again. Local
        and collective-free (a state dict may be taken on one rank only); the next step's
        agreement carries it to every rank."""
        self._copies.clear()
        self.invalidated = True

    # ------------------------------------------------------------ the launches' verdict
    def launch_flags(self, launches: dict[int, "Launch"], active: list[int], rows: dict[int, torch.Tensor] | None,
                     position: tuple[int, int]) -> list[int]:
        """This rank's flags on the launches (block order), beside the runtime's stale flags: per
        launch whether its gradients are now those launched times a factor other than 1, whether
        they are unchanged and not all zero, whether neither (nor are its members and row states
        the same), then :func:`scale_flags` of the one factor the rescaled launches share, and
        whether this rank's copies were invalidated.

        A launch's directions may have been formed after a clip (the last unit's, on the replicate
        level, in ``step()``), so each launch is judged against its own copy of its gradients."""
        r, s = position
        infos = self.plan.infos
        now = {i: infos[i].kept_view(local_tensor(infos[i].param.grad), r, s) for i in active}
        blocks = sorted(launches)
        same = [launches[b].members == sorted(i for i in active if infos[i].block == b) for b in blocks]
        if rows is not None and any(same):
            # The row states compared on the device and read once (not once per matrix).
            differ = torch.stack([any_bits_differ([(launches[b].rows[i], rows[i]) for i in launches[b].members],
                                                  self.device) for b in blocks]).tolist()
            same = [ok and not d for ok, d in zip(same, differ)]
        found = iter(uniform_scales([self._as_launched(launches[b], now) for b, ok in zip(blocks, same) if ok]))
        factors = [next(found) if ok else NONUNIFORM for ok in same]
        scales = {f for f in factors if f not in (None, 1.0, NONUNIFORM)}
        proposal = scales.pop() if len(scales) == 1 else (NONUNIFORM if scales else None)
        rescaled = [int(f not in (None, 1.0, NONUNIFORM)) for f in factors]
        unchanged = [int(f == 1.0) for f in factors]
        incompatible = [int(f == NONUNIFORM or (f not in (None, 1.0) and f != proposal)) for f in factors]
        return rescaled + unchanged + incompatible + scale_flags(proposal) + [int(self.invalidated)]

    def _as_launched(self, launch: "Launch", now: dict[int, torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per member, its gradient part as launched and as it is now: whole while the copies serve (a
        rescaled launch stands only on a bit-for-bit proof), else their extrema (the first rescale)."""
        if launch.grads is not None:
            return [(launch.grads[i], now[i]) for i in launch.members]
        # The launches keep only extrema while the copies are not ready, and ready turns on only at a step's end.
        assert not self.ready and launch.grad_extrema is not None, "a launch kept nothing of its gradients"
        return [(launch.grad_extrema[i], extrema(now[i])) for i in launch.members]

    def verdict(self, stale: list[int], flags: list[int], launches: int) -> tuple[list[int], list[int], float | None]:
        """From the maxima over every rank of the stale flags and :meth:`launch_flags`: per launch 1
        where it is stale, per launch 1 where it stands for its gradients scaled by the returned
        factor (the owners form its directions), and that factor (None: no launch is rescaled).
        When some rank's copies were invalidated, they are not ready on any rank from here on."""
        n = launches
        rescaled, unchanged, incompatible = (flags[k * n:(k + 1) * n] for k in range(3))
        scale = agreed_scale(flags[3 * n:3 * n + SCALE_FLAGS])
        if flags[3 * n + SCALE_FLAGS]:
            self.drop()
        clipped = scale not in (None, NONUNIFORM, 1.0)
        self.idle = 0 if clipped else self.idle + 1
        if not self.ready:
            self.wanted = clipped  # send the momentum after this step: the next clip keeps its launches
            return stale, [0] * n, None
        if self.idle > IDLE_STEPS:
            self.drop()
            return stale, [0] * n, None
        if not clipped:
            return stale, [0] * n, None
        # Rescaled on some rank, unchanged (and not zero) on none, compatible everywhere.
        scaled = [int(rescaled[k] and not unchanged[k] and not incompatible[k]) for k in range(n)]
        return [int(stale[k] and not scaled[k]) for k in range(n)], scaled, (scale if any(scaled) else None)
