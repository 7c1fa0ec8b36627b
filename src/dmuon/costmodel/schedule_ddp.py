"""dmuon's step under torch's ``DistributedDataParallel`` on the timeline (:class:`DdpStepBuilder`), as
:class:`dmuon.runtime.ddp.DdpRuntime` runs it.

Forward and backward are :class:`~dmuon.costmodel.schedule.StepBuilder`'s on the ``(N, 1)`` layout: nothing is
gathered and every unit's gradients are all-reduced as backward produces them, which is DDP's bucketed
all-reduce with the units as its buckets (the same bytes, overlapped with the backward of the units before).
Nothing of dmuon's runs in backward. ``step()``: the agreement's all-reduce with AdamW while it travels, each
owner's momentum on its matrices, then wave by wave the owners' NS and the wave's updates to every rank
(:func:`~dmuon.costmodel.ddp_collectives.ddp_publish_collectives`: on the scatter route its all-gather goes
behind the next wave's NS, as the runtime advances it), and every rank's apply of every update.
"""

from __future__ import annotations

import math

from dmuon.costmodel.collectives import DDP_STRATEGY
from dmuon.costmodel.schedule import C, DW, StepBuilder
from dmuon.costmodel.sim_config import APPLY_BYTES, MOMENTUM_BYTES, Hardware, SimOptions, StepInputs
from dmuon.costmodel.timeline import Task


class DdpStepBuilder(StepBuilder):
    """torch's DDP + dmuon (:data:`~dmuon.costmodel.collectives.DDP_STRATEGY`) on one rank per replica."""

    STRATEGIES = (DDP_STRATEGY,)

    def __init__(self, strategy: str, inputs: StepInputs, hardware: Hardware, options: SimOptions):
        if inputs.shard != 1:
            raise ValueError(f"{DDP_STRATEGY} is one rank per replica (torch's DDP): shard must be 1, "
                             f"got {inputs.shard}")
        super().__init__(strategy, inputs, hardware, options)

    def _owned(self, rank: int, members) -> int:
        return sum(math.prod(self.inp.shapes[i]) for i in members if self.inp.owners[i] == rank)

    def step(self) -> None:
        inp, tl = self.inp, self.tl
        rate = self.hw.elementwise_bytes
        everything = range(len(inp.shapes))
        agreement = self.agreement(len(inp.shapes), DW) if inp.world > 1 else None
        self.adamw(self.other_local())  # while the flags travel
        if agreement is not None:
            self.wait("agreed", C, [agreement])
        tl.compute("momentum (owners)", C, [self.seconds(MOMENTUM_BYTES * self._owned(k, everything), rate)
                                           for k in range(inp.world)], phase="step", kind="elementwise")
        mine = self.owner_wave_batches()
        published: dict[int, Task] = {}
        scattered: list[tuple[int, Task]] = []  # the scatter's all-to-all issued, its all-gather not yet

        def second_hops() -> None:  # the runtime's advance(): each earlier wave's all-gather, behind this work
            while scattered:
                w, first = scattered.pop(0)
                landed = self.wait(f"wave {w} scattered", C, [first])
                published[w] = self.coll("ddp_publish", "step", None, 2 * w + 1, DW, [landed])

        for w, wave in enumerate(self.waves):
            ns = tl.compute(f"NS wave {w}", C, [sum(self.ns_seconds(shape, n, owner_copy=False) for shape, n in
                                                    mine[k][w]) for k in range(inp.world)], phase="step", kind="ns")
            second_hops()
            first = self.coll("ddp_publish", "step", None, 2 * w, DW, [ns])
            if first is not None:
                scattered.append((w, first))
            else:
                published[w] = self.coll("ddp_publish", "step", None, 2 * w + 1, DW, [ns])
        second_hops()
        for w, wave in enumerate(self.waves):
            landed = self.wait(f"wave {w} landed", C, [published[w]])
            self.elementwise(f"apply wave {w}", C, APPLY_BYTES * sum(math.prod(inp.shapes[i]) for i in wave),
                             [landed])
