"""The step's one agreement: every rank takes the same collective path.

Which matrices have a gradient, whether a gradient is non-finite (with
``nonfinite=``), and which launches from backward went stale are settled by
one small MAX all-reduce before any collective that depends on them. The
speculative step (see :meth:`dmuon.DMuon.step`) sends the same flags with its
update return instead: that return is the one collective depending on them,
and its rows are used only if the flags, landed with them, keep them.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import torch

from dmuon.plan.plan import MatrixInfo
from dmuon.rules.adamw import local_tensor
from dmuon.runtime.runtime import ShardRuntime


class Agreement(NamedTuple):
    """What every rank settled on."""

    active: list[int]
    """Matrices with a gradient (on every rank), plan order."""
    skipped: bool
    """The whole step is skipped (``nonfinite="skip"`` saw a NaN/Inf)."""
    stale: list[int]
    """Per launch from backward (block order): 1 where some rank's directions differ from those sent."""


def start_agreement(runtime: ShardRuntime, infos: Sequence[MatrixInfo], group_of: dict[int, dict], here: list[int],
                    others: list[torch.Tensor], nonfinite: str | None, stale: torch.Tensor | None,
                    other_names: list[str]) -> Callable[[], Agreement]:
    """One small all-reduce of 0/1 flags, then the same decision on every rank.

    The all-reduce is issued here; the returned function waits for it and
    decides, so local work can run while the flags travel.

    Args:
        runtime: Whose ``start_agree`` (MAX over every rank) to use.
        infos: The plan's matrices.
        group_of: Plan index -> param group, for every Muon matrix.
        here: Matrices with a gradient on this rank.
        others: The AdamW parameters (checked with ``nonfinite``).
        nonfinite: ``None``, ``"skip"`` or ``"raise"``.
        stale: Per launch, 1 where this rank's directions differ from those sent.
        other_names: Names of ``others``, for the error.

    Raises:
        RuntimeError: A matrix has a gradient on some ranks only.
        FloatingPointError: ``nonfinite="raise"`` and a gradient is non-finite (on any rank).
    """
    flags, settle = agreement_flags(runtime, infos, group_of, here, others, nonfinite, stale, other_names)
    landed = runtime.start_agree(flags)
    return lambda: settle(landed().tolist())


def agreement_flags(runtime: ShardRuntime, infos: Sequence[MatrixInfo], group_of: dict[int, dict], here: list[int],
                    others: list[torch.Tensor], nonfinite: str | None, stale: torch.Tensor | None,
                    other_names: list[str]) -> tuple[torch.Tensor, Callable[[list[int]], Agreement]]:
    """This rank's flags, and the decision from their maximum over every rank (however that travelled).

    :func:`start_agreement` all-reduces them; the speculative step sends them
    with its update return instead (:meth:`dmuon.comm.ShardExchange.return_updates`).
    Arguments and errors as :func:`start_agreement`'s.
    """
    n = len(infos)
    check = nonfinite is not None
    checked = n + len(others) if check else 0
    stale = torch.zeros(0, dtype=torch.int32) if stale is None else stale
    # Built as a list: element-wise writes into a tensor cost microseconds each.
    values = [0] * (2 * n + checked)
    for i in group_of:
        values[n + i] = 1  # "some rank lacks it": FSDP2 gives every rank a shard or none
    for i in here:
        values[i], values[n + i] = 1, 0
        if check:
            part = infos[i].local_view(local_tensor(infos[i].param.grad), runtime.topo.coords[1])
            values[2 * n + i] = int(not torch.isfinite(part).all())
    if check:
        for k, p in enumerate(others):
            if p.grad is not None:
                values[3 * n + k] = int(not torch.isfinite(local_tensor(p.grad)).all())
    flags = torch.cat([torch.tensor(values, dtype=torch.int32), stale.to(torch.int32)])
    return flags, lambda agreed: _decide(agreed, infos, group_of, others, nonfinite, other_names, checked)


def _decide(flags: list[int], infos: Sequence[MatrixInfo], group_of: dict[int, dict], others: list[torch.Tensor],
            nonfinite: str | None, other_names: list[str], checked: int) -> Agreement:
    n, check = len(infos), nonfinite is not None
    uneven = [infos[i].name for i in range(n) if flags[i] and flags[n + i]]
    if uneven:
        raise RuntimeError(f"gradients of {uneven[:5]} exist on some ranks only; FSDP2 reduces a block's "
                           "gradients on every rank or on none")
    active = [i for i in sorted(group_of) if flags[i]]
    agreed_stale = flags[2 * n + checked:]
    if not check or not any(flags[2 * n : 2 * n + checked]):
        return Agreement(active, False, agreed_stale)
    if nonfinite == "raise":
        names = [infos[i].name for i in range(n) if flags[2 * n + i]]
        names += [other_names[k] for k in range(len(others)) if flags[3 * n + k]]
        raise FloatingPointError(f"non-finite gradients in {names}")
    return Agreement(active, True, agreed_stale)
