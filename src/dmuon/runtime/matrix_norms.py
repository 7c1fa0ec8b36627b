"""Per-matrix sums over the weight, added over the ranks that split each matrix: one all-reduce.

A rule whose formula needs a scalar of the whole weight (MuonH: ``||W||_F`` after the
update, to put ``W`` back on its sphere; and ``||W_0||_F`` once, the sphere's radius)
cannot compute it on the owner: the owner has the whole direction, not the whole weight.
Every rank holds its piece of the weight, so the rule gives its partial sums
(:meth:`~dmuon.runtime.callbacks.WeightSums.weight_sums`, no collective) and the runtime
adds them:

* **over the shard level only** (``Topology.shard_group``: FSDP2's shard dim and TP's dim
  together): HSDP's replicas, FSDP2's native ones and dmuon's replicate level alike, hold
  the same weights, so each replica adds its own pieces and every replica gets the same
  totals (the same inputs in the same reduction), with no traffic across replicas;
* **each piece once**: a piece that several shard positions hold (a matrix TP leaves whole is
  ``Replicate`` on the tp dim, ``Piece.sends`` False on all but its first holder) counts only
  on its first holder, the others' entries are zeroed here;
* **in one collective per call**: every matrix's sums in one flat float32 ``all_reduce``
  (SUM), on every rank of the shard level alike, a rank with no piece adding zeros. One
  shard position per replica (or one process): no collective, the local sums are the totals.

Counted in :class:`~dmuon.comm.stats.CommStats` as a ring's bytes (``2 (S-1)/S`` of the
buffer each way, FSDP2's all-reduce's convention), level ``"intra"``; the step model prices
it the same way (:func:`dmuon.costmodel.collectives.weight_norm_collective`).
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from dmuon.comm import CommStats
from dmuon.plan.plan import Plan
from dmuon.runtime.callbacks import StepCallbacks, WeightSums


def ring_all_reduce_bytes(nbytes: int, ranks: int) -> int:
    """Bytes one rank sends (and receives) in a ring all-reduce of ``nbytes`` over ``ranks``."""
    return 2 * (ranks - 1) * nbytes // ranks


class MatrixNorms:
    """Adds the rule's per-matrix partial sums over the weight across the ranks that split each matrix.

    Args:
        plan: The plan (its pieces say who holds what; its topology the groups).
        stats: The runtime's counters (the all-reduce is counted there).
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
        order = sorted(sums)
        column = self.topo.coords[1]
        infos = self.plan.infos
        shapes, parts = [], []
        for i in order:
            value = sums[i].detach().to(device=self.device, dtype=torch.float32)
            shapes.append(value.shape)
            piece = infos[i].pieces[column]
            # A copy of another position's piece (TP's Replicate) counts on its first holder only.
            parts.append(value.reshape(-1) if piece.sends and piece.rows else torch.zeros_like(value).reshape(-1))
        flat = torch.cat(parts)
        shard = self.topo.shard
        if shard > 1:
            moved = ring_all_reduce_bytes(flat.numel() * flat.element_size(), shard)
            self.stats.add("intra", moved, moved)
            start = time.perf_counter()
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.topo.shard_group)
            self.stats.wait_seconds += time.perf_counter() - start
        totals = {i: part.view(shape) for i, part, shape in
                  zip(order, flat.split([math.prod(s) for s in shapes]), shapes)}
        callbacks.weight_totals(totals, applied)
        return True

