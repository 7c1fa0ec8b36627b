"""The owners' Newton-Schulz work in one step: batches, the pipelined return waves, the NS calls.

Pure functions of the plan (every rank can compute any rank's batches and
so every rank issues the same return collectives); nothing here communicates.
"""

from __future__ import annotations

import torch

from dmuon.ortho.owner import owner_update
from dmuon.ortho.config import NSConfig
from dmuon.plan.batches import return_waves
from dmuon.plan.plan import Plan


class OwnerWork:
    """How owners batch and order their NS.

    Args:
        plan: The ownership plan (owners, the balancer's batch sizes).
        ns: The NS configuration (per-group ``ns_coefficients``, ``ns_steps``
            and ``eps`` override its fields).
        per_block: Batch per block (``ns_in_backward``: as the worker batches,
            so the batches do not depend on how far backward got).
        max_waves: Update returns per step (see :meth:`return_waves`).
    """

    def __init__(self, plan: Plan, ns: NSConfig, per_block: bool, max_waves: int) -> None:
        self.plan = plan
        self.ns = ns
        self.per_block = per_block
        self.max_waves = max_waves

    def batches(self, indices: list[int], rank: int, group_of: dict[int, dict]) -> list[list[int]]:
        """The NS batches ``rank`` runs for its ``indices``, in the order it runs them.

        Per param group (NS settings may differ), the batches the balancer priced
        the rank's load with (:meth:`Plan.ns_batches`), per block with ``per_block``.
        """
        units: dict[int, list[int]] = {}
        for i in sorted(indices):
            units.setdefault(self.plan.infos[i].block if self.per_block else 0, []).append(i)
        out = []
        for unit in units.values():
            by_group: dict[int, list[int]] = {}
            for i in unit:
                by_group.setdefault(id(group_of[i]), []).append(i)
            for members in by_group.values():
                out.extend(self.plan.ns_batches(members, rank))
        return out

    def return_waves(self, active: list[int], ready: set[int],
                     group_of: dict[int, dict]) -> list[tuple[list[int], list[list[int]]]]:
        """The step's update returns, pipelined with the owners' NS batches.

        :func:`dmuon.plan.batches.return_waves` over every owner's batches, so
        every rank issues the same collectives; ``ready`` (every rank's
        matrices whose NS ran in backward) go in wave 0. Each rank runs its
        batches of a wave, then issues the wave's return, so one wave's
        transfer overlaps the next wave's NS.

        Returns:
            Per non-empty wave: its members (plan order) and this rank's batches in it.
        """
        owned: dict[int, list[int]] = {}
        for i in active:
            if i not in ready:
                owned.setdefault(self.plan.infos[i].owner, []).append(i)
        batches = {rank: self.batches(indices, rank, group_of) for rank, indices in sorted(owned.items())}
        waves = return_waves(batches, ready, self.max_waves)
        mine: list[list[list[int]]] = [[] for _ in waves]
        for k, batch in enumerate(batches.get(self.plan.rank, [])):
            mine[min(k, self.max_waves - 1)].append(batch)
        return [(w, b) for w, b in zip(waves, mine) if w]

    def orthogonalize_batch(self, batch: list[int], directions: list[torch.Tensor],
                            group_of: dict[int, dict]) -> dict[int, torch.Tensor]:
        """One NS call for a batch of one param group's matrices."""
        return dict(zip(batch, owner_update(directions, self.ns, group_of[batch[0]])))

    def orthogonalize(self, indices: list[int], directions: dict[int, torch.Tensor],
                      group_of: dict[int, dict]) -> dict[int, torch.Tensor]:
        """Orthogonalizes this rank's full ``directions`` of ``indices`` in its batches."""
        out: dict[int, torch.Tensor] = {}
        for batch in self.batches(indices, self.plan.rank, group_of):
            out.update(self.orthogonalize_batch(batch, [directions[i] for i in batch], group_of))
        return out
