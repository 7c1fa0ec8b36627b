"""Per-matrix sums over the weight, added over the ranks that split each matrix: one all-gather.

A rule whose formula needs a scalar of the whole weight (MuonH: ``||W||_F`` after the
update, to put ``W`` back on its sphere; and ``||W_0||_F`` once, the sphere's radius)
cannot compute it on the owner: the owner has the whole direction, not the whole weight.
Every rank holds its piece of the weight, so the rule gives its partial sums
(:meth:`~dmuon.runtime.callbacks.WeightSums.weight_sums`, no collective) and the runtime
adds them:

* **over the shard level only** (``Topology.shard_group``: FSDP2's shard dim and TP's dim
  together): HSDP's replicas, FSDP2's native ones and dmuon's replicate level alike, hold
  the same weights, so each replica adds its own pieces and every replica gets the same
  totals (the same inputs in the same order), with no traffic across replicas;
* **each piece once**: a piece that several shard positions hold (a matrix TP leaves whole is
  ``Replicate`` on the tp dim, ``Piece.sends`` False on all but its first holder) counts only
  on its first holder, the others' entries are zeroed here;
* **in rank order**: the partial sums are all-gathered (one flat float32 ``all_gather`` per
  call, on every rank of the shard level alike, a rank with no piece giving zeros) and added
  in shard-rank order on every rank. A ring all-reduce would add each value in an order that
  depends on where it falls in the buffer; in rank order the totals are the same bits however
  the matrices are grouped into calls: one call after the step's last update
  (``apply_updates="in_step"``) or one per return of updates
  (``"next_forward"``, :meth:`MatrixNorms.after_apply`). One shard position per replica (or
  one process): no collective, the local sums are the totals.

Counted in :class:`~dmuon.comm.stats.CommStats` as a ring all-gather's bytes (``S-1`` times the
rank's buffer each way), level ``"intra"``; the step model prices it the same way
(:func:`dmuon.costmodel.collectives.weight_norm_collective`).
"""

from __future__ import annotations

import math

import torch

from dmuon.comm import CommStats, Pending
from dmuon.comm.streams import Streams
from dmuon.comm.sums import add_over_shard
from dmuon.plan.plan import Plan
from dmuon.runtime.callbacks import StepCallbacks, WeightSums


class MatrixNorms:
    """Adds the rule's per-matrix partial sums over the weight across the ranks that split each matrix.

    Args:
        plan: The plan (its pieces say who holds what; its topology the groups).
        stats: The runtime's counters (the all-gather is counted there).
    """

    def __init__(self, plan: Plan, stats: CommStats) -> None:
        self.plan = plan
        self.topo = plan.topology
        self.stats = stats
        self.device = plan.device

    def run(self, callbacks: StepCallbacks, active: list[int], applied: bool) -> bool:
        """Asks a :class:`~dmuon.runtime.callbacks.WeightSums` rule's ``weight_sums(active, applied)``,
        adds them up and hands the totals to its ``weight_totals``; whether any were asked for (every
        rank alike; never for another rule)."""
        if not isinstance(callbacks, WeightSums):
            return False
        sums = callbacks.weight_sums(active, applied)
        if not sums:
            return False
        callbacks.weight_totals(self.add(sums).wait(), applied)
        return True

    def after_apply(self, callbacks: WeightSums, members: list[int], returned: Pending) -> Pending:
        """``apply_updates="next_forward"``: lands ``returned`` (the return carrying ``members``, every
        rank's list) on the current stream, asks the rule for the sums its apply will leave
        (``weight_sums_after``) and issues their addition; the totals ``weight_totals(..., applied=True)``
        takes once the apply ran (the same bits as :meth:`run` after the apply would give)."""
        return self.add(callbacks.weight_sums_after(members, returned.wait()))

    def add(self, sums: dict[int, torch.Tensor]) -> Pending:
        """Issues the addition of this rank's partial ``sums`` (by plan index, the same keys and shapes on
        every rank) over the shard level; its ``wait()`` gives the totals (float32, on the runtime's
        device, the same bits on every rank)."""
        order = sorted(sums)
        column = self.topo.position[1]
        infos = self.plan.infos
        shapes, parts = [], []
        for i in order:
            value = sums[i].detach().to(device=self.device, dtype=torch.float32)
            shapes.append(value.shape)
            piece = infos[i].pieces[column]
            # A copy of another position's piece (TP's Replicate) counts on its first holder only.
            parts.append(value.reshape(-1) if piece.sends and piece.rows else torch.zeros_like(value).reshape(-1))
        flat = torch.cat(parts) if parts else torch.zeros(0, device=self.device)

        def totals(added: torch.Tensor) -> dict[int, torch.Tensor]:
            return {i: part.view(shape) for i, part, shape in
                    zip(order, added.split([math.prod(s) for s in shapes]), shapes)}

        return add_over_shard(flat, self.topo, self.stats, totals)


class TotalsBehind:
    """``apply_updates="next_forward"`` with a :class:`~dmuon.runtime.callbacks.WeightSums` rule: each
    return of a step gets the weight totals its apply will need, issued in ``step()`` right behind the
    return, so the next forward's apply issues no collective.

    The runtime hands it every return with its members (:meth:`follow`, in the order it applies them:
    :attr:`followed`, what the next forward applies) and calls :meth:`issue_ready` whenever it issued
    hops: each return whose every hop is issued gets its
    totals issued (:meth:`MatrixNorms.after_apply`), in the returns' order, on dmuon's own stream (the
    return lands there; the compute stream waits for none of it in ``step()``). Which returns are
    issued depends only on what was issued, the same on every rank: every rank issues the same
    all-gathers in the same order. Does nothing for a rule without sums (``callbacks`` None).

    Args:
        norms: The runtime's :class:`MatrixNorms`.
        callbacks: The rule, or None (nothing to add).
        streams: The process's streams (:mod:`dmuon.comm.streams`).
    """

    def __init__(self, norms: MatrixNorms, callbacks: WeightSums | None, streams: Streams) -> None:
        self._norms = norms
        self._callbacks = callbacks
        self._streams = streams
        self.followed: list[tuple[Pending, list[int]]] = []
        """Every return of the step so far with the matrices it carries (every rank's list), in order."""
        self.totals: list[Pending] = []
        """Per return followed so far whose every hop is issued, its totals (``wait()`` on the stream of
        the apply)."""

    def follow(self, returned: Pending, members: list[int]) -> None:
        """The next return of the step (``members``: every rank's matrices it carries)."""
        self.followed.append((returned, members))
        self.issue_ready()

    def issue_ready(self) -> None:
        """Issues the totals of every followed return whose hops are all issued (in order)."""
        if self._callbacks is None:
            return
        with self._streams.use(self._streams.own("dmuon")):
            while len(self.totals) < len(self.followed) and self.followed[len(self.totals)][0].issued():
                returned, members = self.followed[len(self.totals)]
                self.totals.append(self._norms.after_apply(self._callbacks, members, returned))

    def all_issued(self) -> list[Pending] | None:
        """Every followed return's totals, once all are issued (None for a rule without sums)."""
        if self._callbacks is None:
            return None
        self.issue_ready()
        assert len(self.totals) == len(self.followed), "a return's hops were left unissued"
        return self.totals
