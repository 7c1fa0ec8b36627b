"""The step's schedules: how each strategy's step is laid on a :class:`~dmuon.costmodel.timeline.Timeline`,
task by task, in the order the host issues it (:mod:`dmuon.costmodel.simulate` picks the builder and runs
the timeline).

This module lays what every strategy shares and the steps without an owner exchange: FSDP2's forward and
backward with its prefetch (the next block's all-gather behind the current block's compute), the
reduce-scatter behind backward, the HSDP all-reduce, each strategy's hook after a block's reduction
(:class:`StepBuilder`); FSDP2 + AdamW's step, gather-then-compute's serial gather-NS-apply per matrix and
the all-to-all peer's batches in its runtime's order. dmuon's exchanges, its step and its two variants
build on it in :mod:`dmuon.costmodel.schedule_dmuon`.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

from dmuon.costmodel.collective import Collective
from dmuon.costmodel.collectives import step_collectives
from dmuon.costmodel.peer import PEER_STRATEGY, all_to_all_batches, async_runtime_order
from dmuon.costmodel.host import OpCount, host_seconds, with_host
from dmuon.costmodel.sim_config import (
    ADAMW_BYTES,
    APPLY_BYTES,
    MOMENTUM_BYTES,
    OWNER_COPY_BYTES,
    Hardware,
    SimOptions,
    StepInputs,
)
from dmuon.costmodel.timeline import Task, Timeline
from dmuon.costmodel.rank_traffic import row_width
from dmuon.plan.cost import gram_ns_flops, ns_flops

# Streams (per rank): compute, FSDP2's three, dmuon's three process groups, gather's and the peer's.
C, AG, RS, AR = "compute", "fsdp_all_gather", "fsdp_reduce_scatter", "fsdp_all_reduce"
DS, DR, DW, GATHER, PEER = "dmuon_shard", "dmuon_replicate", "dmuon_world", "gather", "peer"


def _numel(shape: Sequence[int]) -> int:
    return int(shape[0]) * row_width(shape)


class StepBuilder:
    """Builds one strategy's step on a :class:`Timeline`, in the order the host issues it: FSDP2's forward and
    backward with the strategy's :meth:`backward_hook` after each block's reduction, then its :meth:`step`.
    This class lays the strategies without an owner exchange (:attr:`STRATEGIES`);
    :class:`~dmuon.costmodel.schedule_dmuon.DMuonStepBuilder` extends it with dmuon's."""

    next_forward: bool = False
    """Whether the step's updates are applied in the next forward (dmuon's ``NEXT_FORWARD``): the step's
    figures then run from one forward's end to the next's."""
    returns_in_backward: bool = False
    """Whether updates come back in backward (dmuon's ``RETURNS_IN_BACKWARD``): ``step_collectives`` then lists
    their returns among backward's collectives."""

    STRATEGIES: tuple[str, ...] = ("fsdp_adamw", "gather", PEER_STRATEGY)
    """The strategies this builder lays; :func:`dmuon.costmodel.simulate.step_builder` picks dmuon's builder for
    its own."""

    def __init__(self, strategy: str, inputs: StepInputs, hardware: Hardware, options: SimOptions):
        if strategy not in self.STRATEGIES:
            raise ValueError(f"{type(self).__name__} lays {self.STRATEGIES}, got {strategy!r}")
        self.strategy, self.inp, self.hw, self.opt = strategy, inputs, hardware, options
        self.tl = Timeline(inputs.world, hardware.links, options.overlap, hardware.op_links, hardware.sync_skew,
                           hardware.sync_delay)
        self.ns_batches = inputs.ns_batches
        self.waves = self.return_waves()
        self.collectives: dict[tuple, Collective] = {}
        for c in self.listed(self.waves):
            key = (c.role, c.phase, c.block, c.index)
            if key in self.collectives:
                raise ValueError(f"two collectives with key {key}")
            self.collectives[key] = c
            self.note(key, c)
        self.used: set[tuple] = set()
        # The replicate level: dmuon reduces across replicas in place of FSDP2's all-reduce.
        self.design_b = self.strategy == "dmuon" and inputs.replicate > 1
        self.native_all_reduce = inputs.replicate > 1 and not self.design_b
        gloo = options.backend == "gloo"
        # On gloo FSDP2's collectives (and gather's) block the rank's thread: they run on its one queue.
        self.s = {name: (C if gloo and name in (AG, RS, AR, GATHER) else name)
                  for name in (C, AG, RS, AR, DS, DR, DW, GATHER, PEER)}
        # Where FSDP2 calls the post-accumulate-grad hooks: after the all-reduce on native HSDP.
        self.post_reduce = self.s[AR] if self.native_all_reduce else self.s[RS]
        self.backward_end: Task | None = None
        self.forward_ends: list[Task] = []
        """The end of each forward built (two with dmuon's ``next_forward``: this step's and the next)."""

    def return_waves(self) -> list[list[int]]:
        """dmuon's return waves of the owners' NS batches (``step_collectives`` reads them for dmuon only)."""
        from dmuon.plan.batches import return_waves
        return [w for w in return_waves(self.ns_batches, [], self.inp.return_waves) if w]

    def listed(self, waves: list[list[int]]) -> list[Collective]:
        """The step's collectives as :func:`~dmuon.costmodel.collectives.step_collectives` lists them."""
        inputs, options = self.inp, self.opt
        return step_collectives(
            self.strategy, inputs.shapes, inputs.owners, inputs.blocks, inputs.replicate, inputs.shard,
            wire_bytes=inputs.wire_bytes, param_bytes=inputs.param_bytes, reduce_bytes=inputs.reduce_bytes,
            zero=inputs.zero, root_block=inputs.root_block, waves=waves, other_shapes=inputs.other_shapes,
            other_blocks=inputs.other_blocks, max_concurrent=options.peer_concurrency,
            hop_a_spread=inputs.hop_a_spread, publication=inputs.publication,
            returns_in_backward=self.returns_in_backward, root_regathered=inputs.root_regathered,
            pieces=inputs.pieces, experts=inputs.experts)

    def note(self, key: tuple, c: Collective) -> None:
        """Reads a listed collective as it is keyed (a strategy's builder notes what it schedules by)."""

    # -- helpers
    def coll(self, role: str, phase: str, block, index, stream: str, deps=()) -> Task | None:
        """The collective ``step_collectives`` made for this place, on ``stream`` (None if it made none)."""
        key = (role, phase, block, index)
        c = self.collectives.get(key)
        if c is None:
            return None
        self.used.add(key)
        return self.tl.collective(c, self.s[stream], deps, phase=phase)

    def seconds(self, flops: float, rate: float) -> float:
        return flops / rate if self.opt.compute else 0.0

    def elementwise(self, name: str, stream: str, nbytes: float, deps=(), *, phase: str = "step",
                    host: OpCount | None = None) -> Task:
        """Memory-bound work of ``nbytes``, with the host's ``host`` operations (:meth:`with_host`)."""
        seconds = self.with_host(self.seconds(nbytes, self.hw.elementwise_bytes), host)
        return self.tl.compute(name, self.s[stream], seconds, deps, phase=phase, kind="elementwise")

    def with_host(self, seconds: float, host: OpCount | float | None) -> float:
        """``seconds`` of device work with the host's work (operations at the hardware's dispatch
        figures, or seconds), as :func:`~dmuon.costmodel.host.with_host` combines them."""
        if host is None or not self.opt.compute:
            return seconds
        if isinstance(host, OpCount):
            host = host_seconds(host, self.hw.dispatch_seconds, self.hw.dtensor_dispatch_seconds,
                                self.hw.dtensor_layout_seconds)
        return with_host(seconds, host, self.opt.backend)

    def wait(self, name: str, stream: str, deps, phase: str = "step") -> Task:
        return self.tl.wait(name, self.s[stream], deps, phase=phase)

    def agreement(self, flags: int, stream: str, deps=()) -> Task:
        """dmuon's step agreement: a tree all-reduce (up and down) of ``flags`` values of
        :attr:`SimOptions.agreement_bytes` each, on the replicate level when there is one."""
        inp = self.inp
        nbytes = self.opt.agreement_bytes * flags
        hops = 2 * math.ceil(math.log2(inp.world))
        c = Collective("all_reduce", "inter" if inp.replicate > 1 else "intra", "step", None,
                       [(nbytes, nbytes)] * inp.world, hops, "dmuon agreement", "agreement")
        return self.tl.collective(c, self.s[stream], deps, phase="step")

    def owner_wave_batches(self) -> list[list[list[tuple[tuple[int, int], int]]]]:
        """Per rank, per return wave, its NS batches as ``(shape, count)``: its k-th batch in wave k, the
        batches past the last wave in the last (:func:`dmuon.plan.batches.return_waves`)."""
        last = len(self.waves) - 1
        out = [[[] for _ in self.waves] for _ in range(self.inp.world)]
        for rank, batches in self.ns_batches.items():
            for k, batch in enumerate(batches):
                if batch:
                    out[rank][min(k, last)].append((self.inp.shapes[batch[0]], len(batch)))
        return out

    def ns_seconds(self, shape: tuple[int, int], count: int, owner_copy: bool) -> float:
        """One NS batch of ``count`` matrices of ``shape`` (with the owner's assembling and cutting)."""
        if not self.opt.compute or count == 0:
            return 0.0
        copy = OWNER_COPY_BYTES * _numel(shape) * count / self.hw.elementwise_bytes if owner_copy else 0.0
        if self.opt.ns_seconds is not None:
            return self.opt.ns_seconds(shape, count) + copy
        steps = self.opt.ns_steps
        flops = {"standard": ns_flops(shape, steps), "gram": gram_ns_flops(shape, steps)}
        chosen = min(flops.values()) if self.opt.ns_method == "auto" else flops[self.opt.ns_method]
        return count * chosen / self.hw.ns_flops + copy

    def block_numel(self, b: int, muon: bool = True, other: bool = True, active: bool = False) -> float:
        """Elements of block ``b``'s matrices; ``active``: those one token runs through (an expert slice
        counted at its :attr:`StepInputs.token_share`)."""
        inp = self.inp
        share = inp.token_share if active and inp.token_share is not None else [1.0] * len(inp.shapes)
        return (sum(_numel(s) * f for s, x, f in zip(inp.shapes, inp.blocks, share) if x == b) * muon
                + sum(_numel(s) for s, x in zip(inp.other_shapes, inp.other_blocks) if x == b) * other)

    # -- FSDP2: forward and backward, the strategy's hook after each block's reduction
    def units(self) -> tuple[int | None, list[int]]:
        """The root unit (None without one) and the layers, in forward order."""
        order = sorted(set(self.inp.blocks) | set(self.inp.other_blocks))
        root = self.inp.root_block if self.inp.root_block in order else None
        return root, [b for b in order if b != root]

    def forward_order(self) -> list[int]:
        """The units in the order forward gathers them: the root (embedding and head) first."""
        root, layers = self.units()
        return ([root] if root is not None else []) + layers

    def forward_seconds(self) -> dict[int, float]:
        """Each unit's forward: its GEMMs (2 x parameters x tokens) and its share of the work beyond
        them; backward twice that."""
        order = self.forward_order()
        numel = {b: self.block_numel(b, active=True) for b in order}
        beyond = self.opt.non_gemm_seconds / 3 / max(1, sum(numel.values())) if self.opt.compute else 0.0
        return {b: self.seconds(2.0 * numel[b] * self.opt.tokens_per_gpu, self.hw.compute_flops) + beyond * numel[b]
                for b in order}

    def forward(self, sequence: list[Task], phase: str = "forward", landed: dict[int, list[Task]] | None = None
                ) -> None:
        """FSDP2's forward, its compute tasks appended to ``sequence``: each unit's all-gather issued in
        the pre-forward of the unit before it (the root's at the start), once the compute before that
        one has ended (two units unsharded at once). With ``landed`` (``next_forward``'s next forward,
        ``phase`` ``"next_forward"``) that pre-forward first applies the unit's updates on the compute
        stream once they have landed, and the all-gather waits for the apply."""
        tl, order, fwd = self.tl, self.forward_order(), self.forward_seconds()
        root, _ = self.units()
        unit = self.hw.fsdp_unit_seconds  # FSDP2's host work per unit and pass

        def gather(b: int, deps: list[Task]) -> Task | None:
            key = ("fsdp_all_gather", "forward", b, None)
            if landed is None:
                return self.coll(*key, AG, deps)
            if b in landed:
                deps = deps + [self.elementwise(f"apply block {b}", C,
                                                APPLY_BYTES * self.row_elements(self.muon_in(b)), landed[b],
                                                phase=phase)]
            c = self.collectives.get(key)
            return None if c is None else tl.collective(c, self.s[AG], deps, phase=phase)

        gathered = {order[0]: gather(order[0], [])} if order else {}
        for k, b in enumerate(order):
            if k + 1 < len(order):  # unit b's pre-forward: the next unit's all-gather
                gathered[order[k + 1]] = gather(order[k + 1], sequence[-1:])
            name, seconds = ("embedding", 0.0) if b == root else (f"forward block {b}", fwd[b])
            sequence.append(tl.compute(name, C, self.with_host(seconds, unit), [gathered[b]], phase=phase))
        if root is not None:
            sequence.append(tl.compute("forward head", C, fwd[root], phase=phase))
        self.forward_ends.append(sequence[-1])

    def forward_backward(self, hook: Callable[[int], None]) -> None:
        inp, tl = self.inp, self.tl
        root, layers = self.units()
        fwd = self.forward_seconds()
        unit = self.hw.fsdp_unit_seconds  # FSDP2's host work per unit and pass
        sequence: list[Task] = []  # every forward and backward compute task, in order

        def prefetched() -> list[Task]:
            # FSDP2 gathers a block while the block before it computes: its all-gather
            # starts once the compute two places earlier has ended (two blocks unsharded at once).
            return sequence[-2:-1]

        def run(task: Task) -> Task:
            sequence.append(task)
            return task

        self.forward(sequence)
        if root is not None:
            # The root's parameters (the head) compute after the layers and stay gathered for backward,
            # unless resharded after forward (root_regathered): then gathered again before the head's
            # backward, with nothing to hide behind.
            head = sequence[-1]
            again = self.coll("fsdp_all_gather", "backward", root, None, AG, [head]) if inp.root_regathered else None
            run(tl.compute("backward head", C, 2 * fwd[root], [again], phase="backward"))
        for b in reversed(layers):
            gathered = self.coll("fsdp_all_gather", "backward", b, None, AG, prefetched()) if inp.zero == 3 else None
            done = run(tl.compute(f"backward block {b}", C, self.with_host(2 * fwd[b], unit), [gathered],
                                  phase="backward"))
            self.reduce(b, done, hook)
        if root is not None:
            done = run(tl.compute("backward embedding", C, self.with_host(0.0, unit), phase="backward"))
            self.reduce(root, done, hook)
        # FSDP2's final callback: the compute stream waits for every reduction (and what the hooks queued).
        drained = [self.wait(f"{s} drained", s, [], "backward") for s in (RS, AR) if self.s[s] != C]
        drained += self.final_callback()
        self.backward_end = self.wait("backward end", C, drained, "backward")

    def final_callback(self) -> list[Task]:
        """What the end of backward waits for beyond FSDP2's reductions (a strategy's own final callback)."""
        return []

    def reduce(self, b: int, done: Task, hook: Callable[[int], None]) -> None:
        """FSDP2's post-backward of block ``b``: reduce-scatter, HSDP all-reduce, then the hooks."""
        rs = self.coll("fsdp_reduce_scatter", "backward", b, None, RS, [done])
        if rs is None:  # one shard position: nothing to reduce-scatter, but what follows waits for the block
            rs = self.wait(f"block {b} backward done", RS, [done], "backward")
        self.coll("fsdp_all_reduce", "backward", b, None, AR, [rs])
        hook(b)

    # -- the Muon matrices of a block, and their parts on a rank
    def muon_in(self, b: int) -> list[int]:
        """The Muon matrices of block ``b``."""
        return [i for i, x in enumerate(self.inp.blocks) if x == b]

    def kept_elements(self, members: list[int]) -> float:
        """Elements of this rank's part of the directions: its rows' column slice (1/(R S))."""
        return sum(_numel(self.inp.shapes[i]) for i in members) / self.inp.world

    def row_elements(self, members: list[int]) -> float:
        """Elements of this rank's rows of the matrices (1/S)."""
        return sum(_numel(self.inp.shapes[i]) for i in members) / self.inp.shard

    # -- the steps without an owner exchange
    def adamw(self, numel: float, deps=(), host: OpCount | None = None) -> Task:
        return self.elementwise("adamw", C, ADAMW_BYTES * numel, deps, host=host)

    def other_local(self) -> float:
        return sum(_numel(s) for s in self.inp.other_shapes) / self.inp.shard

    def other_tensors(self) -> int:
        """The parameter tensors AdamW updates besides the Muon matrices (listed or not)."""
        return len(self.inp.other_shapes) + self.opt.unlisted_tensors

    def local_adamw_ops(self) -> OpCount:
        """dmuon's (gather's) AdamW on the other parameters' local shards: foreach."""
        ops = self.opt.host_ops
        return ops.local_foreach_adamw + ops.foreach_adamw_per_tensor * self.other_tensors()

    def step_fsdp_adamw(self) -> None:
        # torch.optim.AdamW over DTensors: its per-tensor loop on CPU, foreach on accelerators.
        ops, tensors = self.opt.host_ops, len(self.inp.shapes) + self.other_tensors()
        host = (ops.adamw_per_tensor * tensors if self.opt.backend == "gloo"
                else ops.foreach_adamw + ops.foreach_adamw_per_tensor * tensors)
        self.adamw(self.other_local() + sum(_numel(s) for s in self.inp.shapes) / self.inp.shard, host=host)

    def step_gather(self) -> None:
        """GatherThenCompute: per matrix its momentum, the all-gather, NS on every rank, the apply."""
        for i, shape in enumerate(self.inp.shapes):
            # The matrix's DTensor and plain operations (NS's aside), all on the host before its all-gather.
            momentum = self.elementwise(f"momentum {i}", C, MOMENTUM_BYTES * _numel(shape) / self.inp.shard,
                                        host=self.opt.host_ops.gather_per_matrix)
            gathered = self.coll("gather", "step", self.inp.blocks[i], i, GATHER, [momentum])
            seconds = self.ns_seconds(shape, 1, owner_copy=False)
            pieces = None if self.inp.pieces is None else self.inp.pieces[i]
            if pieces is not None:  # an expert slice: the ranks holding its rows run its NS
                seconds = [seconds if p.rows else None for p in pieces] * self.inp.replicate
            ns = self.tl.compute(f"NS {i}", C, seconds, [gathered], phase="step", kind="ns")
            self.elementwise(f"apply {i}", C, APPLY_BYTES * _numel(shape) / self.inp.shard, [ns])
        self.adamw(self.other_local(), host=self.local_adamw_ops())

    def step_peer(self) -> None:
        """The all-to-all peer's ``AsyncRuntime``: momentum and out, NS and back, apply, per batch."""
        inp, tl = self.inp, self.tl
        batches = all_to_all_batches(inp.shapes, inp.shard)
        out: dict[int, Task | None] = {}
        back: dict[int, Task | None] = {}
        for segment, k in async_runtime_order(len(batches), self.opt.peer_concurrency):
            (rows, width), _ = batches[k]
            local = -(-rows // inp.shard) * width * inp.shard  # this rank's shard of each of the S (padded) matrices
            if segment == 0:
                momentum = self.elementwise(f"momentum batch {k}", C, MOMENTUM_BYTES * local)
                out[k] = self.coll("a2a_out", "step", None, k, PEER, [momentum])
            elif segment == 1:
                arrived = self.wait(f"batch {k} at its owners", C, [out[k]])
                ns = tl.compute(f"NS batch {k}", C, self.ns_seconds((rows, width), 1, owner_copy=True), [arrived],
                                phase="step", kind="ns")
                back[k] = self.coll("a2a_back", "step", None, k, PEER, [ns])
            else:
                landed = self.wait(f"batch {k} back", C, [back[k]])
                self.elementwise(f"apply batch {k}", C, APPLY_BYTES * local, [landed])
        self.adamw(self.other_local())

    def backward_hook(self, b: int) -> None:
        """What the strategy does after block ``b``'s reduction in backward (FSDP2's post-backward hooks)."""

    def step(self) -> None:
        """The optimizer step, after backward."""
        {"fsdp_adamw": self.step_fsdp_adamw, "gather": self.step_gather, PEER_STRATEGY: self.step_peer}[self.strategy]()

    def build(self) -> Timeline:
        self.forward_backward(self.backward_hook)
        self.step()
        unused = set(self.collectives) - self.used
        if unused:
            raise AssertionError(f"{self.strategy}: collectives not scheduled: {sorted(map(str, unused))[:5]}")
        return self.tl
