"""How the owners batch and order their work in one step: NS batches and the pipelined return waves.

Pure functions of the plan (every rank can compute any rank's batches, so
every rank issues the same return collectives); nothing here communicates.
The work itself is the optimizer's (:meth:`StepCallbacks.owner_work`).
"""

from __future__ import annotations

from typing import Callable

import torch

from dmuon.plan.batches import return_waves
from dmuon.plan.plan import Plan
from dmuon.util.observe import ranged

OwnerFn = Callable[..., "list[torch.Tensor] | tuple[list[torch.Tensor], list[torch.Tensor]]"]
"""A batch of matrices and their whole directions -> their whole updates; with a row state
(:attr:`~dmuon.runtime.callbacks.RowState.row_width`) also their whole row states in, and ``(updates, new row states)`` out."""

Results = tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]
"""The owner's work on some matrices: each one's whole update, and its new row state (empty without one)."""


class OwnerWork:
    """How owners batch and order their work.

    Args:
        plan: The ownership plan (owners, the balancer's batch sizes).
        per_block: Batch per block (``ns_in_backward``: as the worker batches,
            so the batches do not depend on how far backward got).
        max_waves: Update returns per step (see :meth:`return_waves`).
        waves_by_unit: One return wave per block instead, in plan order (``apply_updates="next_forward"``:
            the next forward lands each unit's updates where it needs them); batches then per block.
    """

    def __init__(self, plan: Plan, per_block: bool, max_waves: int, waves_by_unit: bool = False) -> None:
        self.plan = plan
        self.per_block = per_block or waves_by_unit
        self.max_waves = max_waves
        self.waves_by_unit = waves_by_unit

    def batches(self, indices: list[int], rank: int) -> list[list[int]]:
        """The batches ``rank`` runs for its ``indices``, in the order it runs them.

        The batches the balancer priced the rank's load with (:meth:`Plan.ns_batches`),
        per block with ``per_block``.
        """
        units: dict[int, list[int]] = {}
        for i in sorted(indices):
            units.setdefault(self.plan.infos[i].block if self.per_block else 0, []).append(i)
        out = []
        for members in units.values():
            out.extend(self.plan.ns_batches(members, rank))
        return out

    def return_waves(self, active: list[int], ready: set[int]) -> list[tuple[list[int], list[list[int]]]]:
        """The step's update returns, pipelined with the owners' batches.

        :func:`dmuon.plan.batches.return_waves` over every owner's batches, so
        every rank issues the same collectives; ``ready`` (every rank's
        matrices whose work ran in backward) go in wave 0. Each rank runs its
        batches of a wave, then issues the wave's return, so one wave's
        transfer overlaps the next wave's work.

        With ``waves_by_unit`` each block's matrices are one wave, blocks in plan order.

        Returns:
            Per non-empty wave: its members (plan order) and this rank's batches in it.
        """
        if self.waves_by_unit:
            return self._unit_waves(active, ready)
        owned: dict[int, list[int]] = {}
        for i in active:
            if i not in ready:
                owned.setdefault(self.plan.infos[i].owner, []).append(i)
        batches = {rank: self.batches(indices, rank) for rank, indices in sorted(owned.items())}
        waves = return_waves(batches, ready, self.max_waves)
        mine: list[list[list[int]]] = [[] for _ in waves]
        for k, batch in enumerate(batches.get(self.plan.rank, [])):
            mine[min(k, self.max_waves - 1)].append(batch)
        return [(w, b) for w, b in zip(waves, mine) if w]

    def _unit_waves(self, active: list[int], ready: set[int]) -> list[tuple[list[int], list[list[int]]]]:
        """One wave per block of ``active``, in plan order, with this rank's batches of the block."""
        units: dict[int, list[int]] = {}
        for i in sorted(active):
            units.setdefault(self.plan.infos[i].block, []).append(i)
        rank = self.plan.rank
        return [(members, self.batches([i for i in members if i not in ready and self.plan.infos[i].owner == rank], rank))
                for _, members in sorted(units.items())]

    @ranged("ns.batch")
    def run_batch(self, work: OwnerFn, batch: list[int], directions: list[torch.Tensor],
                  rows: list[torch.Tensor] | None = None) -> Results:
        """One call of the owner's work for a batch (``rows``: their whole row states, with a row state)."""
        if rows is None:
            return dict(zip(batch, work(batch, directions))), {}
        updates, new_rows = work(batch, directions, rows)
        return dict(zip(batch, updates)), dict(zip(batch, new_rows))

    def run(self, work: OwnerFn, indices: list[int], directions: dict[int, torch.Tensor],
            rows: dict[int, torch.Tensor] | None = None) -> Results:
        """The owner's work on this rank's whole ``directions`` of ``indices``, in its batches."""
        updates: dict[int, torch.Tensor] = {}
        new_rows: dict[int, torch.Tensor] = {}
        for batch in self.batches(indices, self.plan.rank):
            done, done_rows = self.run_batch(work, batch, [directions[i] for i in batch],
                                             None if rows is None else [rows[i] for i in batch])
            updates.update(done)
            new_rows.update(done_rows)
        return updates, new_rows
