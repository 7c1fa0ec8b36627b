"""The divisor a pipeline schedule applies to the gradients after reducing them, learned once.

torch's pipeline schedules reduce a stage's gradients by hand after its last micro-batch
(``REDUCE_GRAD``, outside autograd) and then, by default (``scale_grads=True``), divide every
gradient in place by the number of micro-batches. dmuon's launches read the gradients at the
reduction, before that division: launched as they are, every block would arrive at ``step()``
as rescaled (``clipped_overlap``'s path: the owners' momentum copies; a divisor that is no power of
two is not even one float32 factor, and the block is exchanged again).

The division is the same every step, known before backward. So the first step that reduces by
hand launches nothing from the reduction (its blocks are exchanged in ``step()``, as with
``overlap=False``: no extra bytes) and keeps a copy of this rank's part of each matrix's gradient as
reduced; the first of ``DMuon.clip_grad_norm_`` (before it scales anything) and ``step()`` then finds
the integer ``n`` with ``reduced.div(n) == now``, bit for bit, on every part, and the ranks agree on
it in one small all-reduce. From the next step on, the launches read ``gradient.div(n)``, the very
bits the schedule's ``div_`` leaves, and stand as sent. A step whose gradients were edited otherwise
(a clip on top) is what it always is: the launch's verdict in ``step()`` (rescaled or stale). When no
``n`` fits (gradients edited otherwise at that first step), the next step learns again.

Why learn in DMuon's clip: a clip that acts (torchtitan clips every step) multiplies every gradient
by its coefficient ``c`` after the schedule's division, so ``step()`` sees ``reduced / n * c``. From
those bits ``n`` is not even determined: for ``n`` a power of two, ``(n, c)`` and ``(1, c / n)`` give
the same bits, and nothing dmuon can observe between the schedule's ``div_`` and a foreign clip
(torch's ``stage.scale_grads`` runs inside the schedule's ``REDUCE_GRAD``, with no hook after it)
tells them apart. DMuon's own ``clip_grad_norm_`` is such a point: there the gradients hold
``reduced / n`` exactly, and every rank of the stage calls it (it is collective), so the agreement
takes the same path everywhere. Under torch's clip that acts on every step nothing is learned (each
step exchanges its blocks in ``step()``); the learning reads a fixed number of host values however
many matrices it covers.
"""

from __future__ import annotations

import torch

from dmuon.comm.agree import least_over
from dmuon.comm.streams import Streams
from dmuon.runtime.gradients import GradientParts

UNKNOWN = None
NO_ANSWER = 0
"""A rank's proposal when it holds no nonzero element to learn from."""
REFUTED = -1
"""A rank's proposal when no integer divisor gives its gradients."""
_NONE_ABOVE = 2**31 - 1


class ScheduleDivisor:
    """Whether launches from a reduction called by hand wait, what they divide by, and the learning.

    Args:
        device: Where the agreement's all-reduce runs.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.value: int | None = UNKNOWN
        """The divisor every rank agreed on (1: the schedule does not scale), or None: not learned yet."""
        self._reduced: dict[int, torch.Tensor] = {}
        self._learning = False

    @property
    def defers(self) -> bool:
        """Whether a launch from a reduction called by hand waits for ``step()`` (the divisor unknown)."""
        return self.value is UNKNOWN

    def for_reduction(self, by_hand: bool) -> tuple[bool, int | None]:
        """For a launch from a reduction (``by_hand``: called by a pipeline schedule): whether it waits
        for ``step()`` (the divisor unknown), and what its gradients are divided by (1 in a backward pass)."""
        return by_hand and self.defers, (self.value if by_hand else 1)

    def keep(self, parts: dict[int, torch.Tensor]) -> None:
        """A deferred launch: a copy of this rank's part of each matrix's gradient as reduced."""
        self._learning = True
        for i, part in parts.items():
            self._reduced[i] = part.clone()

    def kept(self) -> dict[int, torch.Tensor] | None:
        """The copies kept since the last :meth:`learn`, or None when no launch was deferred."""
        return self._reduced if self._learning else None

    def learn(self, now: dict[int, torch.Tensor], group) -> None:
        """At ``step()`` after a deferred launch, on every rank alike: the divisor from the kept copies and
        ``now`` (this rank's parts of the same matrices, as the gradients hold them now), agreed over
        ``group`` (None: one rank)."""
        proposal = _proposal(self._reduced, now)
        self._reduced, self._learning = {}, False
        if group is None:
            agreed = [max(proposal, 0), proposal if proposal != NO_ANSWER else _NONE_ABOVE]
        else:
            # The largest proposal, and the least with "no answer" counted as none: equal when every
            # rank that proposed a divisor proposed the same one and none refuted every divisor.
            flags = torch.tensor([-max(proposal, 0), proposal if proposal != NO_ANSWER else _NONE_ABOVE],
                                 dtype=torch.int64, device=self.device)
            least = least_over(flags, group)
            agreed = [-least[0], least[1]]
        largest, least = agreed
        if largest >= 1 and least == largest:
            self.value = largest

    def learn_from(self, gradients: GradientParts, streams: Streams, group) -> None:
        """After launches deferred from a reduction called by hand, at ``step()`` or before a clip: the
        divisor from the gradients as reduced and as they are now (every rank alike: one small
        all-reduce over ``group``, None for one rank); nothing when no launch was deferred."""
        kept = self.kept()
        if kept is None:
            return
        streams.keep(kept.values())  # copied on FSDP2's (or dmuon's) stream, read and freed here
        self.learn(gradients.local_parts(list(kept)), group)


def _proposal(reduced: dict[int, torch.Tensor], now: dict[int, torch.Tensor]) -> int:
    """This rank's divisor: the integer ``n`` with ``reduced[i].div(n) == now[i]`` bit for bit for every
    ``i`` (guessed from each part's largest element, where the quotient's rounding matters least), or
    :data:`NO_ANSWER` / :data:`REFUTED`.

    Two host reads in all, however many parts: every part's guess travels in one tensor, and the
    bit-for-bit check of every part is one flag (on an accelerator a read per matrix would wait for
    the device once per matrix)."""
    keys = [i for i, before in reduced.items() if before.numel()]
    if not keys:
        return NO_ANSWER
    tops, bottoms = [], []
    for i in keys:
        flat = reduced[i].reshape(-1)
        at = flat.abs().argmax().reshape(1)
        tops.append(flat.index_select(0, at).double())
        bottoms.append(now[i].reshape(-1).index_select(0, at).double())
    top, bottom = torch.cat(tops), torch.cat(bottoms)
    # NaN where the part teaches nothing (its largest element zero or not finite); 0 where it turned
    # zero or non-finite since (no divisor gives that: refuted below).
    fits = (bottom != 0) & torch.isfinite(bottom)
    ratio = torch.where(fits, top / torch.where(fits, bottom, torch.ones_like(bottom)), torch.zeros_like(top))
    ratio = torch.where((top != 0) & torch.isfinite(top), ratio, torch.full_like(top, float("nan")))
    guesses = {round(r) if r >= 0.5 else REFUTED for r in ratio.tolist() if r == r}
    if not guesses:
        return NO_ANSWER
    if len(guesses) > 1 or min(guesses) < 1:
        return REFUTED
    candidate = guesses.pop()
    same = torch.stack([((before.div(candidate) if candidate != 1 else before) == now[i]).all()
                        for i, before in reduced.items()])
    return candidate if bool(same.all()) else REFUTED
