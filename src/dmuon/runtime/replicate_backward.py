"""The replicate level in backward: each unit's reduction across replicas, and hop A spread over them.

On dmuon's replicate level (:mod:`dmuon.runtime.replicate`) a unit's landing first starts its
reduction across replicas; its directions follow once that has landed. Hop A of the launched
blocks goes in row chunks over the following landings, each joined with that unit's gradient
column reduce-scatter (one collective across nodes: one latency per peer, not one per part), as the
:class:`~dmuon.plan.hop_a.HopASpreader` decides (the same on every rank), and hop B at the launch
after the last chunk. All of a unit's work runs on dmuon's stream (:mod:`dmuon.runtime.own_stream`):
its joined collective reads what the landings there made.

Every reduction issued in a backward pass lands before that backward returns. A pipeline
schedule's reduction by hand (``REDUCE_GRAD``, outside autograd) has no end of backward: its
reductions land once its stage's last unit completed (:meth:`ReplicateBackward.land_stage`).
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

from dmuon.comm import ShardExchange
from dmuon.plan.hop_a import HopASpreader, column_reduce_loads, slice_shape
from dmuon.plan.plan import MatrixInfo, Plan
from dmuon.runtime.gradients import GradientParts
from dmuon.runtime.own_stream import OwnStream
from dmuon.runtime.replicate import ReplicateLevel
from dmuon.runtime.schedule_divisor import ScheduleDivisor


class ReplicateBackward:
    """The replicate level's part of the launches: reductions joined with hop A, landings by hand.

    Args:
        level: dmuon's replicate level.
        plan: The ownership plan.
        exchange: Where the launches send (its ``across`` group carries the joined collectives).
        spread: Launch directions (``ExecutionConfig.overlap``): hop A is spread over at most this
            many following collectives (``ExecutionConfig.resolved_hop_a_spread``); None: no directions.
        own: dmuon's stream in backward.
    """

    def __init__(self, level: ReplicateLevel, plan: Plan, exchange: ShardExchange, spread: int | None,
                 own: OwnStream) -> None:
        self.level = level
        self.plan = plan
        self.exchange = exchange
        self.own = own
        self.spreader: HopASpreader | None = None
        if spread is not None:
            self.spreader = HopASpreader({i.index: _slice_shape(i, plan.shard) for i in plan.infos},
                                         plan.replicate, plan.shard, exchange.wire_dtype.itemsize, spread)
        self._matrices: dict[int, list[int]] = {}
        for info in plan.infos:
            self._matrices.setdefault(id(info.param), []).append(info.index)
        # The column loads of a unit's reduced parameters: the same every step (shapes and dtypes do not change).
        self._loads: dict[tuple[int, ...], list[list[float]]] = {}
        self.to_keep: list[int] = []
        """Matrices whose launch was deferred (a schedule divisor not learned yet), kept once their reduction lands."""

    @staticmethod
    def reduced_params(params: list[torch.Tensor], landed: set[int]) -> list[torch.Tensor]:
        """The parameters of a completed unit whose gradients its reduction across replicas reads."""
        return [p for p in params if id(p) in landed and p.grad is not None]

    def decide_spread(self, params: list[torch.Tensor]) -> None:
        """Sizes the pending blocks' hop A chunks that join the column reduce-scatter of ``params``."""
        if self.spreader is not None:
            self.spreader.decide(self.column_loads(params))

    def column_loads(self, params: list[torch.Tensor]) -> list[list[float]]:
        """Every rank's bytes in the column reduce-scatter of ``params``' Muon matrices (the same on
        every rank: the spreader's decision must be)."""
        key = tuple(id(p) for p in params)
        if key in self._loads:
            return self._loads[key]
        matrices = [p for p in params if id(p) in self._matrices]
        infos = [self.plan.infos[i] for p in matrices for i in self._matrices[id(p)]]
        # As ReplicateReduce.reduce_columns sends them: float32 or wider.
        gradient_bytes = {torch.promote_types(p.dtype, torch.float32).itemsize for p in matrices}
        loads = column_reduce_loads([[(q.rows, q.cols, q.sends) for q in info.pieces] for info in infos],
                                    [info.inner for info in infos], self.plan.replicate, self.plan.shard,
                                    max(gradient_bytes, default=4))
        self._loads[key] = loads
        return loads

    def add(self, block: int, members: list[int]) -> None:
        """A launched block whose hop A the following collectives carry."""
        if self.spreader is not None:
            self.spreader.add(block, members)

    def spread_for(self, block: int) -> Callable | None:
        """How far ``block``'s hop A may go at each of its hops (None: all at once)."""
        return None if self.spreader is None else functools.partial(self.spreader.upto, block)

    def finish_spread(self, pendings: list) -> None:
        """``step()``: the last collective of the step's hop A, what every block has left, at once."""
        if self.spreader is None:
            return
        if self.spreader.pending():
            self.spreader.decide([[0, 0]] * (self.plan.replicate * self.plan.shard), final=True)
            with self.exchange.across.coalesced():
                for pending in pendings:
                    pending.forward()
        self.spreader.reset()

    def backward_ended(self) -> None:
        """Autograd final callback, on the compute stream: it waits for dmuon's, every reduction lands."""
        self.own.join()
        self.level.land_all()

    def land_stage(self, divisor: ScheduleDivisor, gradients: GradientParts) -> None:
        """Outside autograd (FSDP2's reduction called by hand), once a stage's last unit completed: the
        reductions in flight land on dmuon's stream, and the compute stream (where the schedule divides
        the gradients next, or the caller reads them) waits for it, once per stage. Not per unit: FSDP2's
        reduce-scatter stream waits for the compute stream before each unit's reduce-scatter, so a wait
        per unit would queue the next unit's reduce-scatter, and the compute of the stages an
        interleaved or V schedule runs meanwhile, behind each unit's reduction across replicas. FSDP2's
        stream never waits for dmuon's. Every buffer the landings read stays with its Flight until
        landed on dmuon's stream (``Streams.land`` keeps it there); the compute stream reads only the
        gradients, after this wait."""
        with self.own.use():
            self.level.land_all()
            if self.to_keep:  # the deferred launches' gradients, as the reductions left them
                divisor.keep(gradients.local_parts(self.to_keep))
                self.to_keep = []
        self.own.join_into_compute()


def _slice_shape(info: MatrixInfo, shard: int):
    """What the matrix's hop A moves (:class:`~dmuon.plan.hop_a.SliceShape`)."""
    return slice_shape(info.owner // shard, [(p.rows, p.cols, p.sends) for p in info.pieces], info.replicate,
                       info.inner)
