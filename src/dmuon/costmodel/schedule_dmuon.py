"""dmuon's step on the timeline (:class:`DMuonStepBuilder`, on :class:`~dmuon.costmodel.schedule.StepBuilder`'s
FSDP2 forward and backward): its exchanges issued from FSDP2's post-reduce stream as the runtime issues them
(``docs/architecture.md``: hop A, hop B one block later; the replicate level's reductions across replicas, each
block's gradient-column all_to_all carrying the hop A of the block landed before), the step's agreement,
the owners' NS batches wave by wave with each wave's return behind them (every return in flight one hop
further before each wave's hop 1, as ``ShardRuntime._forward_returns`` advances them: a hop across
replicas waits for the return's hop before it to land), AdamW, the applies; and two variants: the returns
in backward (:data:`RETURNS_IN_BACKWARD`) and the updates applied in the next forward (:data:`NEXT_FORWARD`),
as the runtime runs them with ``ExecutionConfig(returns_in_backward=True)`` and ``ExecutionConfig(apply_updates=
"next_forward")``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dmuon.costmodel.backward_order import RETURN_ROLES
from dmuon.costmodel.collective import Collective
from dmuon.costmodel.schedule import C, DR, DS, DW, StepBuilder
from dmuon.costmodel.sim_config import (
    APPLY_BYTES,
    MOMENTUM_BYTES,
    PEEK_BYTES,
    STALE_BYTES,
    Hardware,
    SimOptions,
    StepInputs,
)
from dmuon.costmodel.timeline import Task

RETURNS_IN_BACKWARD = "dmuon_rbwd"
"""dmuon (the recommended design) with ``ExecutionConfig(ns_in_backward=True, returns_in_backward=True)``
and every launch standing: each block's NS on the worker as its directions land, its return (and
publication across replicas) issued in backward, ``step()`` applying them."""
NEXT_FORWARD = "dmuon_nfwd"
"""dmuon (the recommended design) with ``ExecutionConfig(apply_updates="next_forward")``
(:mod:`dmuon.runtime.next_forward`): NS and the returns in waves of one block each, in forward order,
the publication's hops across replicas chained on the replicate stream (a side stream, not the compute
stream), ``step()`` returning once every wave's return is issued; in the next
forward each unit's pre-hook waits for the next unit's updates to land, applies them on the compute
stream and then issues that unit's all-gather (FSDP2's prefetch, now after the apply). Its
``step_seconds`` is the steady-state period, from one forward's end to the next's (backward, the step
and the next forward, stretched where an update lands late); ``optimizer_seconds`` that less the
forward and backward the other strategies count."""
_ACROSS_ROLES = frozenset(RETURN_ROLES.values())
"""The roles of a return's hops across replicas; with ``"return_shard"`` (hop 1) every hop of a return."""


class _Launch:
    """A block's direction exchange in backward, hop by hop (``stage``: ``"R"`` reducing across replicas,
    ``"A"`` hop A under way (the replicate level: directions computed, chunks going with the following
    collectives until ``complete``), ``"B"`` hop B in flight)."""

    def __init__(self, block: int, stage: str, reductions: list[Task] | None = None):
        self.block, self.stage = block, stage
        self.reductions = reductions or []
        self.directions: Task | None = None
        self.hop_a: list[Task] = []
        """The collectives carrying its hop A (the replicate level: its chunks), in order."""
        self.complete = False
        """The replicate level: its last hop A chunk has been issued."""
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


class DMuonStepBuilder(StepBuilder):
    """dmuon's step (native HSDP or the replicate level, and its two variants) on FSDP2's forward and backward."""

    STRATEGIES = ("dmuon", "dmuon_native_hsdp", RETURNS_IN_BACKWARD, NEXT_FORWARD)

    def __init__(self, strategy: str, inputs: StepInputs, hardware: Hardware, options: SimOptions):
        self.returns_in_backward = strategy == RETURNS_IN_BACKWARD
        self.next_forward = strategy == NEXT_FORWARD
        self.back: set[int] = set()
        """``returns_in_backward``: the blocks whose updates come back in backward."""
        self.landing_across: dict[int, tuple] = {}
        """The replicate level: per unit, its landing's all_to_all across replicas (gradient columns, hop A chunks
        and, with ``returns_in_backward``, returns' hops), by key."""
        self.across: dict[int, list[str]] = {}
        """``returns_in_backward``: per returned block, its return's hops across replicas, in order:
        ``"ride"`` (in a landing's all_to_all) or the role of its own collective (in ``take()``)."""
        # The variants run dmuon's collectives (step_collectives lists them for "dmuon").
        super().__init__("dmuon" if self.returns_in_backward or self.next_forward else strategy, inputs,
                         hardware, options)
        self.launches: list[_Launch] = []
        self.unlanded: list[Task] = []  # the replicate level: reductions across replicas not yet waited for
        self.landed: dict[int, list[Task]] = {}
        """``next_forward``: per unit, what its updates' landing waits for (its wave's last hop)."""

    def return_waves(self) -> list[list[int]]:
        if self.returns_in_backward:
            # NS per block (the worker's batches), the returned blocks' in backward, the others' waves in step().
            # A return's hop 1 is no collective on one shard position (DDP with dmuon's (N, 1) mesh); there
            # its first hop across replicas may ride in a landing's all_to_all (carries_returns).
            listed = [c for c in self.listed([]) if c.phase == "backward"]
            self.back = {c.block for c in listed if c.role == "return_shard" or c.role in _ACROSS_ROLES} | \
                {b for c in listed for b in c.carries_returns}
            self.ns_batches = {rank: [part for batch in batches for part in self.by_block(batch)
                                      if self.inp.blocks[part[0]] not in self.back]
                               for rank, batches in self.inp.ns_batches.items()}
        if self.next_forward:
            # One wave per unit with Muon matrices, in the order the next forward needs them (the root first).
            return [self.muon_in(b) for b in self.forward_order() if self.muon_in(b)]
        return super().return_waves()

    def note(self, key: tuple, c: Collective) -> None:
        if c.phase == "backward" and c.level == "inter" and c.issued_at is not None and (
                c.role in ("grad_columns", "hop_a") or c.carries_returns):
            self.landing_across[c.issued_at] = key
        for b in c.carries_returns:
            self.across.setdefault(b, []).append("ride")
        if c.phase == "backward" and c.role in _ACROSS_ROLES and not c.carries_returns:
            self.across.setdefault(c.block, []).append(c.role)

    def by_block(self, batch: list[int]) -> list[list[int]]:
        """An NS batch cut by block (``ns_in_backward``'s worker batches each block alone)."""
        parts: dict[int, list[int]] = {}
        for i in batch:
            parts.setdefault(self.inp.blocks[i], []).append(i)
        return list(parts.values())

    def final_callback(self) -> list[Task]:
        if not self.design_b:
            return []
        # dmuon's final callback lands every reduction across replicas.
        landed = self.wait("replicate level landed", C, self.unlanded, "backward")
        self.unlanded = []
        return [landed]

    # -- in backward (comm/exchange.py, runtime/backward.py)
    def advance(self, stream: str, returns: bool = True) -> list[tuple[_Launch, Task]]:
        """Each earlier launch one hop further, waits on ``stream`` (``Pending.forward``): hop B behind a
        landed hop A (the replicate level: behind its last chunk; a launch with chunks to go waits for the one
        in flight); the replicate level's launch still reducing gets its directions (stage ``"A"``).

        ``returns_in_backward`` (at a landing, ``returns``): then every return in flight one hop across
        replicas (on the replicate level inside this landing's all_to_all: returned, with the landed hop
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
                if launch.ahead[0] == "ride":  # the replicate level: in this landing's all_to_all, set there
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
        """The replicate level: the block's reduction has landed; its directions (hop A chunks to follow)."""
        landed = self.wait(f"block {launch.block} reduced", stream, launch.reductions, "backward")
        members = self.muon_in(launch.block)
        launch.directions = self.elementwise(f"directions block {launch.block}", stream,
                                             PEEK_BYTES * self.kept_elements(members), [landed], phase="backward")
        launch.stage = "A"

    def carry(self, collective: Task | None, what: str) -> None:
        """The replicate level: the launches whose hop A chunks ride in ``collective`` (as the schedule says)."""
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
        """Native HSDP, or one replica: the block's directions from the reduced gradient, hop A or hop B."""
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

    def backward_hook(self, b: int) -> None:
        """``BackwardLaunches.complete`` of unit ``b``: the earlier launches' next hops, then (the replicate level)
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

    # -- the step
    def step(self) -> None:
        self.step_dmuon()
        if self.next_forward:  # the next forward applies the updates, each unit's before its all-gather
            self.forward([], "next_forward", self.landed)

    def step_dmuon(self) -> None:
        """``ShardRuntime.step``: the remaining hops, momentum, agreement, NS wave by wave, applies."""
        inp, tl = self.inp, self.tl
        # BackwardLaunches.take: the replicate level sends what is left of every block's hop A in one
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
            agreement = self.agreement(len(inp.shapes) + len(set(inp.blocks)), DW, [checked])
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
        return self.owner_wave_batches()

