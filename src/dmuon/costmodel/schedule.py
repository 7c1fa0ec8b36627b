"""The step's schedules: how each strategy's step is laid on a :class:`~dmuon.costmodel.timeline.Timeline`,
task by task, in the order the host issues it (:func:`build_step`; :mod:`dmuon.costmodel.simulate` runs
the timeline and reads its figures).

FSDP2's forward and backward with its prefetch (the next block's all-gather behind the current
block's compute), the reduce-scatter behind backward, the HSDP all-reduce; dmuon's exchanges issued
from FSDP2's post-reduce stream as the runtime issues them (``docs/architecture.md``: hop A, hop B one
block later; design (b)'s reductions across replicas, each block's gradient-column all_to_all carrying
the hop A of the block landed before), the step's agreement, the owners' NS batches wave by wave with
each wave's return behind them (every return in flight one hop further before each wave's hop 1, as
``ShardRuntime._forward_returns`` advances them: a hop across replicas waits for the return's hop before
it to land), AdamW, the applies; gather-then-compute's serial gather-NS-apply per matrix; the all-to-all
peer's batches in its runtime's order; and two variants of dmuon: the returns in backward
(:data:`RETURNS_IN_BACKWARD`, which the runtime offers) and the updates applied in the next forward
(:data:`NEXT_FORWARD`, which it does not yet).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

from dmuon.costmodel.backward_order import RETURN_ROLES
from dmuon.costmodel.collective import Collective
from dmuon.costmodel.collectives import STEP_STRATEGIES, step_collectives
from dmuon.costmodel.peer import PEER_STRATEGY, all_to_all_batches, async_runtime_order
from dmuon.costmodel.host import OpCount, host_seconds, with_host
from dmuon.costmodel.sim_config import (
    ADAMW_BYTES,
    APPLY_BYTES,
    MOMENTUM_BYTES,
    OWNER_COPY_BYTES,
    PEEK_BYTES,
    STALE_BYTES,
    Hardware,
    SimOptions,
    StepInputs,
)
from dmuon.costmodel.timeline import Task, Timeline
from dmuon.costmodel.rank_traffic import row_width
from dmuon.plan.cost import gram_ns_flops, ns_flops

RETURNS_IN_BACKWARD = "dmuon_rbwd"
"""dmuon (the recommended design) with ``ExecutionConfig(ns_in_backward=True, returns_in_backward=True)``
and every launch standing: each block's NS on the worker as its directions land, its return (and
publication across replicas) issued in backward, ``step()`` applying them."""
NEXT_FORWARD = "dmuon_nfwd"
"""dmuon (the recommended design) with the updates applied in the next forward, a design the runtime does
not offer yet (``docs/architecture.md``, "the route not built"): NS and the returns in waves of one block
each, in forward order, the publication's hops across replicas chained on the replicate stream (a side
stream, not the compute stream), ``step()`` returning once every wave's return is issued; in the next
forward each unit's pre-hook waits for the next unit's updates to land, applies them on the compute
stream and then issues that unit's all-gather (FSDP2's prefetch, now after the apply). Its
``step_seconds`` is the steady-state period, from one forward's end to the next's (backward, the step
and the next forward, stretched where an update lands late); ``optimizer_seconds`` that less the
forward and backward the other strategies count. Modelled to decide whether to build it; nothing runs it."""
_ACROSS_ROLES = frozenset(RETURN_ROLES.values())
"""The roles of a return's hops across replicas; with ``"return_shard"`` (hop 1) every hop of a return."""

# Streams (per rank): compute, FSDP2's three, dmuon's three process groups, gather's and the peer's.
C, AG, RS, AR = "compute", "fsdp_all_gather", "fsdp_reduce_scatter", "fsdp_all_reduce"
DS, DR, DW, GATHER, PEER = "dmuon_shard", "dmuon_replicate", "dmuon_world", "gather", "peer"


def _numel(shape: Sequence[int]) -> int:
    return int(shape[0]) * row_width(shape)


class _Launch:
    """A block's direction exchange in backward, hop by hop (``stage``: ``"R"`` reducing across replicas,
    ``"A"`` hop A under way (design (b): directions computed, chunks going with the following
    collectives until ``complete``), ``"B"`` hop B in flight)."""

    def __init__(self, block: int, stage: str, reductions: list[Task] | None = None):
        self.block, self.stage = block, stage
        self.reductions = reductions or []
        self.directions: Task | None = None
        self.hop_a: list[Task] = []
        """The collectives carrying its hop A (design (b): its chunks), in order."""
        self.complete = False
        """Design (b): its last hop A chunk has been issued."""
        self.hop_b: Task | None = None
        self.ns: Task | None = None
        """``returns_in_backward``: the owners' NS of the block on the worker, once its directions landed."""
        self.hops_issued = False
        """``returns_in_backward``: every direction hop was issued by the last landing (its return is due)."""
        self.returned: list[Task | None] | None = None
        """``returns_in_backward``: the return's hops issued (None: not issued yet)."""
        self.ahead: list[str] = []
        """``returns_in_backward``: the roles of the return's hops across replicas still to go."""

    def landing(self) -> list[Task]:
        """What the owners wait for: hop B (hop A where the shard level has one rank)."""
        return [self.hop_b] if self.hop_b is not None else self.hop_a


@dataclass
class _Return:
    """One return wave's hops, as ``Pending`` chains them: issued (hop 1 first), and the hops across
    replicas still ahead (``"first"``: the direct route's one or the scatter; ``"gather"``: the all-gather)."""

    w: int
    issued: list[Task | None]
    ahead: list[str] = field(default_factory=list)


class StepBuilder:
    """Builds one strategy's step on a :class:`Timeline`, in the order the host issues it."""

    def __init__(self, strategy: str, inputs: StepInputs, hardware: Hardware, options: SimOptions):
        known = STEP_STRATEGIES + (PEER_STRATEGY, RETURNS_IN_BACKWARD, NEXT_FORWARD)
        if strategy not in known:
            raise ValueError(f"strategy must be one of {known}, got {strategy!r}")
        self.returns_in_backward = strategy == RETURNS_IN_BACKWARD
        self.next_forward = strategy == NEXT_FORWARD
        strategy = "dmuon" if self.returns_in_backward or self.next_forward else strategy
        self.strategy, self.inp, self.hw, self.opt = strategy, inputs, hardware, options
        self.tl = Timeline(inputs.world, hardware.links, options.overlap, hardware.op_links, hardware.sync_skew,
                           hardware.sync_delay)
        self.ns_batches = inputs.ns_batches
        self.back: set[int] = set()
        """``returns_in_backward``: the blocks whose updates come back in backward."""

        def listed(waves):
            return step_collectives(
                strategy, inputs.shapes, inputs.owners, inputs.blocks, inputs.replicate, inputs.shard,
                wire_bytes=inputs.wire_bytes, param_bytes=inputs.param_bytes, reduce_bytes=inputs.reduce_bytes,
                zero=inputs.zero, root_block=inputs.root_block, waves=waves, other_shapes=inputs.other_shapes,
                other_blocks=inputs.other_blocks, max_concurrent=options.peer_concurrency,
                hop_a_spread=inputs.hop_a_spread, publication=inputs.publication,
                returns_in_backward=self.returns_in_backward, root_regathered=inputs.root_regathered)

        if self.returns_in_backward:
            # NS per block (the worker's batches), the returned blocks' in backward, the others' waves in step().
            self.back = {c.block for c in listed([]) if c.phase == "backward"
                         and (c.role == "return_shard" or c.role in _ACROSS_ROLES)}
            self.ns_batches = {rank: [part for batch in batches for part in self.by_block(batch)
                                      if inputs.blocks[part[0]] not in self.back]
                               for rank, batches in inputs.ns_batches.items()}
        from dmuon.plan.batches import return_waves
        if self.next_forward:
            # One wave per unit with Muon matrices, in the order the next forward needs them (the root first).
            self.waves = [self.muon_in(b) for b in self.forward_order() if self.muon_in(b)]
        else:
            self.waves = [w for w in return_waves(self.ns_batches, [], inputs.return_waves) if w]
        collectives = listed(self.waves)
        self.collectives: dict[tuple, Collective] = {}
        self.landing_across: dict[int, tuple] = {}
        """Design (b): per unit, its landing's all_to_all across replicas (gradient columns, hop A chunks
        and, with ``returns_in_backward``, returns' hops), by key."""
        self.across: dict[int, list[str]] = {}
        """``returns_in_backward``: per returned block, its return's hops across replicas, in order:
        ``"ride"`` (in a landing's all_to_all) or the role of its own collective (in ``take()``)."""
        for c in collectives:
            key = (c.role, c.phase, c.block, c.index)
            if key in self.collectives:
                raise ValueError(f"two collectives with key {key}")
            self.collectives[key] = c
            if c.phase == "backward" and c.level == "inter" and c.issued_at is not None and (
                    c.role in ("grad_columns", "hop_a") or c.carries_returns):
                self.landing_across[c.issued_at] = key
            for b in c.carries_returns:
                self.across.setdefault(b, []).append("ride")
            if c.phase == "backward" and c.role in _ACROSS_ROLES and not c.carries_returns:
                self.across.setdefault(c.block, []).append(c.role)
        self.used: set[tuple] = set()
        self.design_b = strategy == "dmuon" and inputs.replicate > 1
        self.native_all_reduce = inputs.replicate > 1 and not self.design_b
        gloo = options.backend == "gloo"
        # On gloo FSDP2's collectives (and gather's) block the rank's thread: they run on its one queue.
        self.s = {name: (C if gloo and name in (AG, RS, AR, GATHER) else name)
                  for name in (C, AG, RS, AR, DS, DR, DW, GATHER, PEER)}
        # Where FSDP2 calls the post-accumulate-grad hooks: after the all-reduce on native HSDP.
        self.post_reduce = self.s[AR] if self.native_all_reduce else self.s[RS]
        self.launches: list[_Launch] = []
        self.unlanded: list[Task] = []  # design (b): reductions across replicas not yet waited for
        self.backward_end: Task | None = None
        self.forward_ends: list[Task] = []
        """The end of each forward built (two with ``next_forward``: this step's and the next)."""
        self.landed: dict[int, list[Task]] = {}
        """``next_forward``: per unit, what its updates' landing waits for (its wave's last hop)."""

    # -- helpers
    def by_block(self, batch: list[int]) -> list[list[int]]:
        """An NS batch cut by block (``ns_in_backward``'s worker batches each block alone)."""
        parts: dict[int, list[int]] = {}
        for i in batch:
            parts.setdefault(self.inp.blocks[i], []).append(i)
        return list(parts.values())

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

    def block_numel(self, b: int, muon: bool = True, other: bool = True) -> int:
        inp = self.inp
        return (sum(_numel(s) for s, x in zip(inp.shapes, inp.blocks) if x == b) * muon
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
        numel = {b: self.block_numel(b) for b in order}
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
        if self.design_b:
            # dmuon's final callback lands every reduction across replicas.
            drained.append(self.wait("replicate level landed", C, self.unlanded, "backward"))
            self.unlanded = []
        self.backward_end = self.wait("backward end", C, drained, "backward")

    def reduce(self, b: int, done: Task, hook: Callable[[int], None]) -> None:
        """FSDP2's post-backward of block ``b``: reduce-scatter, HSDP all-reduce, then the hooks."""
        rs = self.coll("fsdp_reduce_scatter", "backward", b, None, RS, [done])
        if rs is None:  # one shard position: nothing to reduce-scatter, but what follows waits for the block
            rs = self.wait(f"block {b} backward done", RS, [done], "backward")
        self.coll("fsdp_all_reduce", "backward", b, None, AR, [rs])
        hook(b)

    # -- dmuon in backward (comm/exchange.py, runtime/backward.py)
    def muon_in(self, b: int) -> list[int]:
        return [i for i, x in enumerate(self.inp.blocks) if x == b]

    def kept_elements(self, members: list[int]) -> float:
        """Elements of this rank's part of the directions: its rows' column slice (1/(R S))."""
        return sum(_numel(self.inp.shapes[i]) for i in members) / self.inp.world

    def row_elements(self, members: list[int]) -> float:
        """Elements of this rank's rows of the matrices (1/S)."""
        return sum(_numel(self.inp.shapes[i]) for i in members) / self.inp.shard

    def advance(self, stream: str, returns: bool = True) -> list[tuple[_Launch, Task]]:
        """Each earlier launch one hop further, waits on ``stream`` (``Pending.forward``): hop B behind a
        landed hop A (design (b): behind its last chunk; a launch with chunks to go waits for the one
        in flight); design (b)'s launch still reducing gets its directions (stage ``"A"``).

        ``returns_in_backward`` (at a landing, ``returns``): then every return in flight one hop across
        replicas (on design (b) inside this landing's all_to_all: returned, with the landed hop
        before, for that collective to wait for), and the hop 1 of each launch whose direction hops
        were all issued by the last landing (behind its NS)."""
        joining: list[Task] = []
        for launch in self.launches:
            if launch.stage == "A":
                landed = self.wait(f"hop A {launch.block} landed", stream, launch.hop_a[-1:], "backward")
                if launch.complete or not self.design_b:
                    launch.hop_b = self.coll("hop_b", "backward", launch.block, None, DS, [landed])
                    launch.stage = "B"
                    self.start_ns(launch)
            elif launch.stage == "R":
                self.directions_after_reduction(launch, stream)
            if returns and launch.ahead:
                landed = self.wait(f"block {launch.block} return hop landed", stream, launch.returned[-1:], "backward")
                if launch.ahead[0] == "ride":  # design (b): in this landing's all_to_all, set there
                    joining.append((launch, landed))
                    launch.returned.append(None)
                else:
                    launch.returned.append(self.coll(launch.ahead[0], "backward", launch.block, None, DR, [landed]))
                launch.ahead.pop(0)
        if returns and self.returns_in_backward:
            for launch in self.launches:
                if launch.returned is None and launch.hops_issued:
                    self.start_return(launch, stream)
                launch.hops_issued = launch.stage == "B"
        return joining

    def batches_by_shape(self, members: list[int]) -> list[list[tuple[tuple[int, int], int]]]:
        """Per rank, its matrices among ``members`` as NS batches of one shape each: ``(shape, count)``."""
        out: list[dict[tuple[int, int], int]] = [{} for _ in range(self.inp.world)]
        for i in members:
            counts = out[self.inp.owners[i]]
            counts[self.inp.shapes[i]] = counts.get(self.inp.shapes[i], 0) + 1
        return [list(counts.items()) for counts in out]

    def start_ns(self, launch: _Launch) -> None:
        """``returns_in_backward``: the worker's NS of the block, once its directions have landed (each
        rank its own matrices of the block, per shape)."""
        if not self.returns_in_backward or launch.block not in self.back:
            return
        seconds = [sum(self.ns_seconds(shape, n, owner_copy=True) for shape, n in batches)
                   for batches in self.batches_by_shape(self.muon_in(launch.block))]
        launch.ns = self.tl.compute(f"NS block {launch.block}", "ns_worker", seconds, launch.landing(),
                                    phase="backward", kind="ns")

    def start_return(self, launch: _Launch, stream: str) -> None:
        """``BackwardLaunches._return``: the main thread waits for the worker's NS, then hop 1."""
        if self.inp.world == 1:
            return  # nothing to send: the step applies the worker's results
        if launch.block not in self.back:
            raise AssertionError(f"block {launch.block} returns in backward here, not in step_collectives' list")
        ready = self.wait(f"NS block {launch.block} done", stream, [launch.ns], "backward")
        launch.returned = [self.coll("return_shard", "backward", launch.block, None, DS, [ready])]
        launch.ahead = list(self.across.get(launch.block, []))

    def directions_after_reduction(self, launch: _Launch, stream: str) -> None:
        """Design (b): the block's reduction has landed; its directions (hop A chunks to follow)."""
        landed = self.wait(f"block {launch.block} reduced", stream, launch.reductions, "backward")
        members = self.muon_in(launch.block)
        launch.directions = self.elementwise(f"directions block {launch.block}", stream,
                                             PEEK_BYTES * self.kept_elements(members), [landed], phase="backward")
        launch.stage = "A"

    def carry(self, collective: Task | None, what: str) -> None:
        """Design (b): the launches whose hop A chunks ride in ``collective`` (as the schedule says)."""
        if collective is None:
            return
        riding, completing = collective.collective.carries_hop_a, collective.collective.completes_hop_a
        under_way = {launch.block: launch for launch in self.launches if launch.stage == "A"}
        if not set(riding) | set(completing) <= set(under_way):
            raise AssertionError(f"{what} carries hop A of blocks {riding} (completing {completing}), "
                                 f"the launches under way are {sorted(under_way)}")
        for b in riding:
            under_way[b].hop_a.append(collective)
        for b in completing:
            under_way[b].complete = True

    def riding(self, key: tuple) -> list[Task]:
        """The directions the collective at ``key`` waits for: those of the blocks whose chunks ride in it."""
        c = self.collectives.get(key)
        blocks = () if c is None else c.carries_hop_a
        return [launch.directions for launch in self.launches if launch.block in blocks and launch.directions]

    def send(self, b: int, stream: str) -> None:
        """Design (a), or one replica: the block's directions from the reduced gradient, hop A or hop B."""
        members = self.muon_in(b)
        if not members:
            return
        peek = self.elementwise(f"directions block {b}", stream, PEEK_BYTES * self.kept_elements(members),
                                phase="backward")
        launch = _Launch(b, "A")
        hop_a = self.coll("hop_a", "backward", b, None, DR, [peek])
        if hop_a is None:
            launch.hop_b = self.coll("hop_b", "backward", b, None, DS, [peek])
            launch.stage = "B"
            launch.hops_issued = True
            self.start_ns(launch)
        else:
            launch.hop_a = [hop_a]
        self.launches.append(launch)

    def dmuon_hook(self, b: int) -> None:
        """``BackwardLaunches._complete`` of unit ``b``: the earlier launches' next hops, then (design (b))
        the unit's reduction across replicas: its gradient columns' all_to_all carrying the hop A of
        the block landed before (one collective: it starts once this unit's reduce-scatter has landed
        and that block's directions are computed), then its other parameters' all-reduce."""
        p = self.post_reduce
        if not self.design_b and not self.muon_in(b):
            return  # no unit of the runtime's: only blocks with Muon matrices are hooked (no landing)
        joining = self.advance(p)
        if not self.design_b:
            self.send(b, p)
            return
        if self.unlanded:  # ReplicateLevel.land_all
            self.wait("reductions landed", p, self.unlanded, "backward")
            self.unlanded = []
        here = self.wait(f"block {b} reduce-scattered", p, [], "backward")
        # One all_to_all across replicas: this unit's gradient columns and the hop A chunks the
        # spreader chose (a unit with no Muon matrix: the chunks alone), with returns_in_backward the
        # returns' hops across replicas.
        key = self.landing_across.get(b, ("grad_columns", "backward", b, None))
        columns = self.coll(*key, DR, [here] + self.riding(key) + [landed for _, landed in joining])
        for launch, _ in joining:
            launch.returned[-1] = columns
        self.carry(columns, f"unit {b}'s collective")
        # ReplicateLevel.start_mean: the other parameters' all-reduce after the column all-to-all
        # (which may carry hop A, on its way to the owners' NS).
        all_reduce = self.coll("replicate_all_reduce", "backward", b, None, DR, [here])
        reductions = [t for t in (all_reduce, columns) if t is not None and t.collective.role != "hop_a"]
        self.unlanded += reductions
        if self.muon_in(b):
            self.launches.append(_Launch(b, "R", reductions))

    # -- the steps
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
            ns = self.tl.compute(f"NS {i}", C, self.ns_seconds(shape, 1, owner_copy=False), [gathered],
                                 phase="step", kind="ns")
            self.elementwise(f"apply {i}", C, APPLY_BYTES * _numel(shape) / self.inp.shard, [ns])
        self.adamw(self.other_local(), host=self.local_adamw_ops())

    def step_dmuon(self) -> None:
        """``ShardRuntime.step``: the remaining hops, momentum, agreement, NS wave by wave, applies."""
        inp, tl = self.inp, self.tl
        # BackwardLaunches.take: design (b) sends what is left of every block's hop A in one
        # collective (a launch complete before it sends its hop B first), then every hop in launch order.
        if self.design_b:
            self.advance(C, returns=False)
            final = self.coll("hop_a", "backward", None, None, DR, self.riding(("hop_a", "backward", None, None)))
            self.carry(final, "the last hop A collective")
        for launch in self.launches:
            if launch.stage == "A":
                landed = self.wait(f"hop A {launch.block} landed", C, launch.hop_a[-1:])
                launch.hop_b = self.coll("hop_b", "backward", launch.block, None, DS, [landed])
                launch.stage = "B"
            while launch.ahead:  # returns_in_backward: what is left of the return, hop by hop
                landed = self.wait(f"block {launch.block} return hop landed", C, launch.returned[-1:])
                launch.returned.append(self.coll(launch.ahead.pop(0), "backward", launch.block, None, DR, [landed]))
        everything = list(range(len(inp.shapes)))
        # step()'s host operations (its AdamW's included), counted per step and matrix, with the momentum.
        ops = self.opt.host_ops
        self.elementwise("momentum", C, MOMENTUM_BYTES * self.kept_elements(everything),
                         host=ops.dmuon_per_step + ops.dmuon_per_matrix * len(inp.shapes))
        checked = self.elementwise("launch check", C, STALE_BYTES * self.kept_elements(everything))
        # ns_in_backward (returns_in_backward) leaves the speculative step: the agreement goes alone.
        speculative = inp.return_waves == 1 and not (self.returns_in_backward or self.next_forward)
        agreement = None
        if not speculative and inp.world > 1:
            flags = self.opt.agreement_bytes * (len(inp.shapes) + len(set(inp.blocks)))
            hops = 2 * math.ceil(math.log2(inp.world))  # a tree all-reduce: up and down
            c = Collective("all_reduce", "inter" if inp.replicate > 1 else "intra", "step", None,
                           [(flags, flags)] * inp.world, hops, "dmuon agreement", "agreement")
            agreement = tl.collective(c, self.s[DW], [checked], phase="step")
            self.adamw(self.other_local())  # while the flags travel
            self.wait("agreed", C, [agreement])
        self.wait("directions at the owners", C, [t for launch in self.launches for t in launch.landing()])
        mine = self.wave_batches()
        returns: list[_Return] = []
        for w in range(len(self.waves)):
            seconds = [sum(self.ns_seconds(shape, n, owner_copy=True) for shape, n in mine[k][w])
                       for k in range(inp.world)]
            ns = tl.compute(f"NS wave {w}", C, seconds, phase="step", kind="ns")
            self.forward_returns(returns)  # the earlier waves' next hops, behind this wave's NS
            returns.append(self.new_return(w, self.coll("return_shard", "step", None, w, DS, [ns])))
        if speculative or agreement is None:
            self.adamw(self.other_local())  # while the (last) return travels
        for launch in self.launches:  # returns_in_backward: the updates that came back in backward first
            if launch.returned is not None:
                landed = self.wait(f"block {launch.block} returned", C, launch.returned[-1:])
                self.elementwise(f"apply block {launch.block}", C,
                                 APPLY_BYTES * self.row_elements(self.muon_in(launch.block)), [landed])
        for w, wave in enumerate(self.waves):
            while returns[w].ahead:
                self.forward_returns(returns[w:])
            if self.next_forward:  # applied in the next forward, by the unit before it
                self.landed[self.inp.blocks[wave[0]]] = returns[w].issued
                continue
            landed = self.wait(f"wave {w} landed", C, returns[w].issued)
            self.elementwise(f"apply wave {w}", C, APPLY_BYTES * self.row_elements(wave), [landed])

    def new_return(self, w: int, shard_return: Task | None) -> "_Return":
        """Wave ``w``'s return with hop 1 issued; its hops across replicas as ``step_collectives`` lists them."""
        ret = _Return(w, [shard_return])
        if self.inp.replicate > 1:
            direct = ("return_replicas", "step", None, w) in self.collectives
            ret.ahead = ["first"] if direct else ["first", "gather"]
        return ret

    def forward_returns(self, returns: list["_Return"]) -> None:
        """``ShardRuntime._forward_returns``: every return in flight lands its latest hop (on the compute
        stream; ``next_forward``: on the replicate stream, a side stream that leaves compute free) and
        issues its next, all of them in one all_to_all on the replicate group (the collective
        ``step_collectives`` lists under the round's first hop across replicas, or, with none, the last
        wave's all-gather)."""
        moving = [ret for ret in returns if ret.ahead]
        if not moving:
            return
        stream = DR if self.next_forward else C
        landed = [self.wait(f"wave {ret.w} hop {len(ret.issued)} landed", stream, ret.issued[-1:])
                  for ret in moving]
        firsts = [ret.w for ret in moving if ret.ahead[0] == "first"]
        if firsts:
            w, = firsts  # the runtime advances one wave past hop 1 per round
            role = "return_replicas" if ("return_replicas", "step", None, w) in self.collectives else "return_scatter"
            key = (role, w)
        else:
            key = ("return_gather", moving[-1].w)
        task = self.coll(key[0], "step", None, key[1], DR, landed)
        for ret in moving:
            ret.ahead.pop(0)
            ret.issued.append(task)

    def wave_batches(self) -> list[list[list[tuple[tuple[int, int], int]]]]:
        """Per rank, per wave, its NS batches as ``(shape, count)`` (``next_forward``: each wave one unit's
        matrices, each owner's of one shape in one batch)."""
        if self.next_forward:
            per_wave = [self.batches_by_shape(wave) for wave in self.waves]
            return [[batches[rank] for batches in per_wave] for rank in range(self.inp.world)]
        last = len(self.waves) - 1
        out = [[[] for _ in self.waves] for _ in range(self.inp.world)]
        for rank, batches in self.ns_batches.items():
            for k, batch in enumerate(batches):
                if batch:
                    out[rank][min(k, last)].append((self.inp.shapes[batch[0]], len(batch)))
        return out

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

    def build(self) -> Timeline:
        muon = self.strategy in ("dmuon", "dmuon_native_hsdp")
        self.forward_backward(self.dmuon_hook if muon else (lambda b: None))
        {"fsdp_adamw": self.step_fsdp_adamw, "gather": self.step_gather, "dmuon": self.step_dmuon,
         "dmuon_native_hsdp": self.step_dmuon, PEER_STRATEGY: self.step_peer}[self.strategy]()
        if self.next_forward:
            self.forward([], "next_forward", self.landed)
        unused = set(self.collectives) - self.used
        if unused:
            raise AssertionError(f"{self.strategy}: collectives not scheduled: {sorted(map(str, unused))[:5]}")
        return self.tl


def build_step(strategy: str, inputs: StepInputs, hardware: Hardware, options: SimOptions | None = None
               ) -> tuple[Timeline, Task]:
    """The timeline of one step under ``strategy`` (not yet run) and its end-of-backward marker."""
    builder = StepBuilder(strategy, inputs, hardware, options or SimOptions())
    timeline = builder.build()
    return timeline, builder.backward_end
