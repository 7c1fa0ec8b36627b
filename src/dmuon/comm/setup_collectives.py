"""The collectives dmuon issues while it sets up: prepare's checks of the layout and the pipeline's check of
weights tied across stages.

Each is issued from the current stream and waited for at once, on every rank of the group in the same order
(whether a rank enters one depends on what every rank knows alike: the plan, the topology, names and shapes
already gathered), so a check that fails on one rank fails on all of them instead of leaving the others
waiting. The step's collectives are elsewhere in ``comm/`` (prepare's momentum-layout check takes the same
minimum as the step's divisor, :func:`dmuon.comm.agree.least_over`); these run once, before the first step.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from dmuon.util.torch_compat import all_gather_into_tensor


def gather_rows(mine: torch.Tensor, group, world_size: int) -> torch.Tensor:
    """Every rank's ``mine`` (the same length on each, on the group's device), stacked in the group's rank
    order: a ``(world_size, mine.numel())`` tensor on ``mine``'s device."""
    flat = mine.reshape(-1)
    gathered = torch.empty(world_size * flat.numel(), dtype=flat.dtype, device=flat.device)
    all_gather_into_tensor(gathered, flat, group=group)
    return gathered.view(world_size, -1)


def gather_objects(mine: Any, group) -> list[Any]:
    """Every rank's picklable ``mine``, in the group's rank order."""
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    return everyone


def add_over(total: torch.Tensor, group) -> None:
    """``total`` (an integer tensor, in place) summed over every rank of ``group``: exact in any order."""
    dist.all_reduce(total, group=group)
