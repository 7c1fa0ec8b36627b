"""Exchanges launched from FSDP2's backward, and the owners' work on a worker thread behind them.

FSDP2 calls each sharded parameter's post-accumulate-grad hooks right after it
has written the block's reduced gradient shard (after its reduce-scatter and,
on HSDP, its all-reduce, averaged and cast to the parameter's dtype). Once
every matrix of the block with ``requires_grad`` has landed, or the next block
starts landing, the block is launched: the optimizer's
:meth:`~dmuon.runtime.StepCallbacks.peek` gives this rank's part of each
direction, and the exchange to the owners starts. The launch is
*speculative*: ``step()`` keeps it only if the direction the optimizer commits
from the final gradients is bit for bit the one sent (a gradient clipped or
edited in between fails that check, and the block is exchanged again in
``step()``), so the result never depends on it.

Collective order: hooks fire in FSDP2's post-backward order, which FSDP2
itself requires to be the same on every rank. On HSDP a block's directions
take two hops (across replicas, then inside the owner's replica); each next
hop is issued from the main thread when the next block launches (or ``step()``
takes the launches), so every rank issues them in the same order. On dmuon's
replicate level hop A goes in row chunks over the following launches, each
joined with that unit's gradient column reduce-scatter, as the
:class:`~dmuon.plan.hop_a.HopASpreader` decides (the same on every rank), and
hop B at the launch after the last chunk.

Streams (CUDA; :mod:`dmuon.comm.streams`): FSDP2 calls the hooks on its post-reduce
stream. A 1-D launch (peek, the send buffer, issuing the exchange) stays there: it reads
the gradient and the state and waits for nothing, and FSDP2's ``finalize_backward`` makes
the compute stream wait for that stream, so user code before ``step()`` (clipping) never
overtakes it. Everything that waits (landing earlier hops, the returns of
``returns_in_backward``) and, on the replicate level, all of a unit's work (its joined
collective reads what the landings made) runs on dmuon's own stream, forked from FSDP2's:
FSDP2's stream never waits for dmuon. The NS worker enters the plan's device and runs on
the NS stream: it lands its block's exchange there (after the event of the exchange's
creation) and records an event once the owners' work is enqueued; whoever consumes the
results (the return issued in backward, ``step()``) waits for that event. ``take()``, and on
the replicate level the end of backward, make the compute stream wait for dmuon's stream.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from dmuon.comm import Pending, ShardExchange
from dmuon.comm.device_streams import streams_for
from dmuon.comm.pending import no_result
from dmuon.comm.streams import Interval, kept
from dmuon.plan.hop_a import HopASpreader, column_reduce_loads, slice_shape
from dmuon.plan.plan import MatrixInfo, Plan
from dmuon.runtime.callbacks import RowState, StepCallbacks
from dmuon.runtime.config import ExecutionConfig
from dmuon.runtime.gradients import GradientParts
from dmuon.runtime.owner_work import OwnerFn, OwnerWork
from dmuon.runtime.replicate import ReplicateLevel, Reduction
from dmuon.runtime.worker import DaemonWorker
from dmuon.runtime.schedule_divisor import ScheduleDivisor
from dmuon.util.autocast import autocast_off
from dmuon.util.dtensor import local_tensor
from dmuon.util.observe import ranged
from dmuon.util.torch_compat import in_backward, on_reduced_gradient, queue_end_of_backward

@dataclass
class Launch:
    """A block's direction exchange started in backward."""

    block: int
    members: list[int]
    """Matrices whose gradients had landed, in plan order."""
    sent: dict[int, torch.Tensor]
    """This rank's part of each member's direction, as sent."""
    pending: Pending
    """The exchange; ``wait()`` gives the owned whole directions."""
    rows: dict[int, torch.Tensor] | None = None
    """With a row state: this rank's rows of each member's row state, as sent."""
    grads: dict[int, torch.Tensor] | None = None
    """With ``keep_gradients``: a copy of this rank's part of each member's local gradient as launched
    (on the replicate level its reduced form), for ``step()`` to recognise a uniform rescale."""
    returned: Pending | None = None
    """With ``returns_in_backward``: the return of the owners' updates from this launch's directions,
    issued in backward (``wait()`` gives this rank's rows of them); None until then."""
    hops_issued: bool = False
    """Every hop of the directions has been issued (by the last block landing, or the launch itself):
    with ``returns_in_backward`` the return follows at the next landing."""


class OwnerResults(NamedTuple):
    """This rank's owner work on one block, computed ahead of the step."""

    updates: dict[int, torch.Tensor]
    """The whole update of each matrix this rank owns."""
    rows: dict[int, torch.Tensor]
    """Their new row states (empty without a row state)."""
    spent: Interval | None
    """The time it took, on the block that paid for it (None on the others of one run)."""


EarlyWork = dict[int, OwnerResults]
"""Per block: this rank's owner results computed ahead of the step."""


_NEWEST: dict[int, weakref.ref] = {}
"""Per hooked parameter (by id, while it lives), the newest launches that hooked it: only they act
on its gradients (nothing is written onto torch's parameters)."""


@dataclass
class _Unit:
    """What lands together: FSDP2 reduces these parameters in one post-backward."""

    params: list[torch.Tensor]
    """The hooked parameters (trainable)."""
    block: int | None
    """Its Muon matrices' block (``Plan.blocks``), or None."""
    root: str = ""
    """Its outermost ``fully_shard``-ed module (``ReductionGroup.root``; replicate level only)."""


class BackwardLaunches:
    """The launches of one runtime: hooks on every hooked parameter, and with ``owner_work`` the NS worker.

    Without ``replicate`` the units are the plan's blocks and only Muon matrices are hooked;
    with it (dmuon's replicate level) every FSDP2 group's trainable parameters are, and a
    unit's landing first starts its reduction across replicas, the directions following once
    it has landed.

    Args:
        plan: The ownership plan.
        exchange: Where launches send.
        callbacks: The rule: ``matrices`` (only those are launched), ``peek`` (the directions, state
            untouched), with ``config.ns_in_backward`` ``owner_work`` (run per block on a worker
            thread as soon as the block's directions have landed), and a
            :class:`~dmuon.runtime.callbacks.RowState` rule's ``row_states`` (sent beside the
            directions).
        config: ``overlap`` (launch the direction exchanges; without, with ``replicate`` the hooks
            only start the reductions), ``ns_in_backward``, ``returns_in_backward`` (with the worker:
            each block's updates return in backward, :attr:`Launch.returned`, at the block landing
            after the one that issued its directions' last hop; the main thread waits there for the
            worker's results of it) and, with ``replicate``, the hop A spread
            (:class:`~dmuon.plan.hop_a.HopASpreader`).
        gradients: This rank's gradient parts (no replicate level) and the gradients' check.
        work: The owners' batching (per block with the worker).
        replicate: dmuon's replicate level, or None.
        keep_gradients: Keep a copy of each launch's gradient parts (:attr:`Launch.grads`).
    """

    def __init__(self, plan: Plan, exchange: ShardExchange, callbacks: StepCallbacks, config: ExecutionConfig,
                 gradients: GradientParts, work: OwnerWork, replicate: ReplicateLevel | None = None,
                 keep_gradients: bool = False) -> None:
        self.plan = plan
        self.exchange = exchange
        self._peek = callbacks.peek
        self._grad_parts = gradients.parts
        self._managed = callbacks.matrices
        self._check = gradients.check
        self._owner_work: OwnerFn | None = callbacks.owner_work if config.ns_in_backward else None
        self._work = work
        self._directions = config.overlap
        self.replicate = replicate
        self._row_states = callbacks.row_states if isinstance(callbacks, RowState) else None
        self._keep_gradients = keep_gradients
        self._returns = config.returns_in_backward and self._owner_work is not None
        hop_a_spread = config.resolved_hop_a_spread
        self._spreader: HopASpreader | None = None
        if replicate is not None and self._directions:
            self._spreader = HopASpreader({i.index: _slice_shape(i, plan.shard) for i in plan.infos},
                                          plan.replicate, plan.shard, exchange.wire_dtype.itemsize, hop_a_spread)
        self.streams = streams_for(plan.device)
        self._compute = self.streams.current()
        """The stream the main thread computes on (built and stepped there), which waits for the
        reductions landed outside autograd."""
        self._own_done = None
        """Event on dmuon's stream after the hooks' latest work (None: nothing since the compute stream waited)."""
        # The worker thread enters the plan's device first: Triton launches on the thread's current device.
        # A daemon: a rank that raises mid-backward exits although its worker waits for a hop never issued.
        self._worker = DaemonWorker("dmuon-ns", initializer=self.streams.enter) if self._owner_work else None
        self._early: dict[int, Future] = {}
        self._ns_done: dict[int, Any] = {}
        """Per block: the event on the NS stream after the worker's work on it."""
        self._matrices: dict[int, list[int]] = {}
        for info in plan.infos:
            self._matrices.setdefault(id(info.param), []).append(info.index)
        # The column loads of a unit's reduced parameters: the same every step (shapes and dtypes do not change).
        self._loads: dict[tuple[int, ...], list[list[float]]] = {}
        if replicate is None:
            units = [_Unit(list({id(plan.infos[i].param): plan.infos[i].param for i in b.members
                                 if plan.infos[i].param.requires_grad}.values()), b.index) for b in plan.blocks]
        else:
            units = [_Unit(list(g.params), g.block, g.root) for g in plan.groups]
        self._units = [u for u in units if u.params]
        # Per fully_shard root (a pipeline stage's module), its units: the schedule reduces them by hand in one go.
        self._stage_units: dict[str, set[int]] = {}
        for k, u in enumerate(self._units):
            self._stage_units.setdefault(u.root, set()).add(k)
        self._unit_of = {id(p): k for k, u in enumerate(self._units) for p in u.params}
        self._landed: dict[int, list[torch.Tensor]] = {}
        self._current: int | None = None
        self._fired: set[int] = set()
        self._in_backward = False
        self._by_hand = False
        """The latest hook ran in FSDP2's reduction called by hand (a pipeline schedule's), not in a backward pass."""
        self.divisor = ScheduleDivisor(plan.device)
        """What a pipeline schedule divides the gradients by after its reduction (learned once)."""
        self._to_keep: list[int] = []
        """Replicate level: matrices whose launch was deferred, kept once their reduction lands."""
        self._launches: dict[int, Launch] = {}
        self._ref = weakref.ref(self)
        for u in self._units:
            for p in u.params:
                if id(p) not in _NEWEST:
                    weakref.finalize(p, _NEWEST.pop, id(p), None)
                _NEWEST[id(p)] = self._ref  # the newest launches on a parameter take its hooks
        self._hooks: list[Any] = [on_reduced_gradient(p, self._hook())
                                  for u in self._units for p in u.params]

    def _hook(self):
        # The hook outlives nothing: once these launches (and their runtime) are gone, or newer
        # launches hooked the same parameter (a new optimizer on resume, whether or not the old one
        # has been garbage-collected yet, which can differ between ranks), the hook does nothing.
        launches = self._ref

        @torch.compiler.disable  # eager, as FSDP2's own hooks: host bookkeeping, collectives, a worker thread
        def hook(param: torch.Tensor) -> None:
            me = launches()
            if me is not None and _NEWEST.get(id(param)) is launches:
                # A backward under the caller's autocast (its state travels into autograd's hooks): the
                # launch's directions as configured, as the step's (dmuon.util.autocast).
                with me.streams.fsdp2_hook(), autocast_off(me.plan.device):
                    me._landed_one(param)

        return hook

    @contextlib.contextmanager
    def _on_own_stream(self):
        """Runs the block on dmuon's stream, forked from the current one (FSDP2's, in a hook); the
        compute stream waits for it in :meth:`take` or at the end of backward."""
        with self.streams.use(self.streams.own("dmuon")):
            yield
            self._own_done = self.streams.record()

    def _join_own_stream(self) -> None:
        """The current (compute) stream waits for what the hooks left on dmuon's stream."""
        if self._own_done is not None:
            # No hand-over depends on this wait alone today: what dmuon's stream produces reaches the compute
            # stream through a Pending (the event of its making or of its result) or a collective landed there
            # (its stream forked from dmuon's at the issue), and dmuon's stream reads the gradients only
            # before issuing the collectives that carry them (landed on the compute stream before step() or a
            # clip reads them). Kept: one wait per backward orders whatever a later hand-over leaves out.
            self.streams.wait(self._own_done)
            self._own_done = None

    def _landed_one(self, param: torch.Tensor) -> None:
        # FSDP2's reduction called by hand, outside autograd: torch's pipeline schedules reduce a
        # stage's gradients once after its last micro-batch (REDUCE_GRAD), then scale them in place
        # on the compute stream (what the launches divide by: ScheduleDivisor). No end of a backward
        # pass follows to hook into, so on the replicate level each unit's reductions land as soon
        # as the unit completes.
        self._by_hand = by_hand = not self._in_backward and not in_backward()
        if self.replicate is not None and not self._in_backward and not by_hand:
            # Every reduction across replicas lands before this backward returns, and the compute
            # stream waits for dmuon's, so user code before step() (clipping) never races one in
            # flight. An autograd final callback runs after FSDP2's own (which reduces the root):
            # the only hook into the end of a backward pass; FSDP2, DDP and FSDP1 install theirs the
            # same way.
            self._in_backward = True
            queue_end_of_backward(self._end_of_backward)
        if self.replicate is not None:
            self.replicate.arrived(param)
        unit = self._unit_of[id(param)]
        if self._current is not None and self._current != unit:
            self._complete(self._current)
        self._current = unit
        landed = self._landed.setdefault(unit, [])
        landed.append(param)
        if len(landed) == len(self._units[unit].params):
            self._complete(unit)
        if by_hand and self.replicate is not None and self._current is None and self._stage_reduced(unit):
            self._land_by_hand()

    def _stage_reduced(self, unit: int) -> bool:
        """Whether every unit of ``unit``'s stage (its ``fully_shard`` root) has completed this step: the
        schedule's reduction by hand of that stage is over, and what it does next (its division) reads
        the gradients on the compute stream."""
        return self._stage_units[self._units[unit].root] <= self._fired

    def _land_by_hand(self) -> None:
        """Outside autograd (FSDP2's reduction called by hand), once a stage's last unit completed: the
        reductions in flight land on dmuon's stream, and the compute stream (where the schedule divides
        the gradients next, or the caller reads them) waits for it, once per stage. Not per unit: FSDP2's
        reduce-scatter stream waits for the compute stream before each unit's reduce-scatter, so a wait
        per unit would queue the next unit's reduce-scatter, and the compute of the stages an
        interleaved or V schedule runs meanwhile, behind each unit's reduction across replicas. FSDP2's
        stream never waits for dmuon's. Every buffer the landings read stays with its Flight until
        landed on dmuon's stream (``Streams.land`` keeps it there); the compute stream reads only the
        gradients, after this wait."""
        with self._on_own_stream():
            self.replicate.land_all()
            if self._to_keep:  # the deferred launches' gradients, as the reductions left them
                self.divisor.keep(self._kept_parts(self._to_keep))
                self._to_keep = []
        with self.streams.use(self._compute, fork=False):
            self._join_own_stream()

    @torch.no_grad()
    @ranged("launch")
    def _complete(self, unit: int) -> None:
        """A unit's gradients have landed (all of them, or the next unit started landing)."""
        landed = {id(p) for p in self._landed.pop(unit)}
        if self._current == unit:
            self._current = None
        if self.replicate is None:
            # Landing earlier hops waits: on dmuon's stream. The launch only reads the gradient
            # and the state and issues, on FSDP2's stream, whose end FSDP2 makes the compute
            # stream wait for (finalize_backward): clipping then never overtakes what it read.
            with self._on_own_stream():
                self._advance()
            self._launch(unit, landed)
            return
        # The pending blocks' hop A chunks and this unit's column reduce-scatter go to the same
        # peers now: one collective across nodes (one latency per peer, not one per part); the
        # spreader sizes the chunks so that no replica receives much more than the others.
        # All of it on dmuon's stream: the joined collective reads what the landings there made.
        params = self._reduced_params(unit, landed)
        with self._on_own_stream():
            with self.exchange.across.coalesced():
                if self._spreader is not None:
                    self._spreader.decide(self._column_loads(params))
                self._advance()
                reduction = self._launch(unit, landed, params)
            self.replicate.start_mean(reduction)

    def _reduced_params(self, unit: int, landed: set[int]) -> list[torch.Tensor]:
        """The parameters of a completed unit whose gradients its reduction across replicas reads."""
        return [p for p in self._units[unit].params if id(p) in landed and p.grad is not None]

    def _column_loads(self, params: list[torch.Tensor]) -> list[list[float]]:
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

    def _launch(self, unit: int, landed: set[int], params: list[torch.Tensor] | None = None) -> Reduction | None:
        """Starts what a completed unit sends: its reduction across replicas of ``params`` (the caller
        issues its other parameters' all-reduce), its directions."""
        first = unit not in self._fired
        self._fired.add(unit)
        block = self._units[unit].block
        # A matrix outside the optimizer's param groups is not stepped: nothing to send.
        members = [i for i in self._managed() if id(self.plan.infos[i].param) in landed] if block is not None else []
        defer = self._by_hand and self.divisor.defers
        divisor = self.divisor.value if self._by_hand else 1
        if self.replicate is not None:
            reduction = self.replicate.start_columns(params)
            if first and members and self._directions and defer:
                self._to_keep.extend(members)
            elif first and members and self._directions:
                launch = Launch(block, members, {}, None)  # type: ignore[arg-type]
                launch.pending = Pending([], no_result, self.exchange.stats,
                                         then=lambda: self._send_after(reduction, launch, divisor))
                self._add(launch)
                if self._spreader is not None:
                    self._spreader.add(block, members)
            return reduction
        if not first or not members:
            # A second reduction in one step (accumulation without FSDP2's no-sync): the
            # launch is stale, and step()'s check will redo it.
            return None
        if defer:
            self.divisor.keep(self._kept_parts(members))
            return None
        for i in members:
            self._check(i)
        sent = self._peek(members, self._divided(self._grad_parts(members), divisor))
        rows = self._rows_sent(members)
        self._add(Launch(block, members, sent, self.exchange.send_directions(members, sent, rows), rows,
                         self._gradient_copies(members, divisor=divisor)))
        return None

    def _kept_parts(self, members: list[int]) -> dict[int, torch.Tensor]:
        """This rank's part of each member's local gradient as it is now (``MatrixInfo.kept_view``)."""
        r, s = self.plan.position
        return {i: self.plan.infos[i].kept_view(local_tensor(self.plan.infos[i].param.grad), r, s) for i in members}

    @staticmethod
    def _divided(parts: dict[int, torch.Tensor], divisor: int | None) -> dict[int, torch.Tensor]:
        """``parts`` as a schedule's in-place division by ``divisor`` leaves them (themselves for 1)."""
        return parts if not divisor or divisor == 1 else {i: t.div(divisor) for i, t in parts.items()}

    def _end_of_backward(self) -> None:
        """Autograd final callback, on the compute stream after FSDP2's: the compute stream waits for
        dmuon's; on the replicate level the last unit completes and every reduction lands."""
        self._in_backward = False
        if self._current is not None:
            with autocast_off(self.plan.device):  # the last launch, as the hooks' (under the caller's autocast)
                self._complete(self._current)
        self._join_own_stream()
        self.replicate.land_all()

    def _send_after(self, reduction: Reduction, launch: Launch, divisor: int | None = 1) -> Pending:
        """Main thread, once the unit's reduction across replicas has landed: the directions from it
        (from its sums divided by a pipeline schedule's ``divisor`` first, as the schedule divides them)."""
        self.replicate.land(reduction)
        for i in launch.members:
            self._check(i)
        sums = self._divided(reduction.columns.wait(), divisor)
        sent = self._peek(launch.members, self.replicate.mean_parts_of(reduction, launch.members, sums))
        launch.sent.update(sent)
        launch.rows = self._rows_sent(launch.members)
        # What the directions came from: the reduction's sums (a clip since scaled the gradients, not them).
        launch.grads = self._gradient_copies(launch.members, sums)
        spread = None if self._spreader is None else functools.partial(self._spreader.upto, launch.block)
        return self.exchange.send_directions(launch.members, sent, launch.rows, spread)

    def _gradient_copies(self, members: list[int], sums: dict[int, torch.Tensor] | None = None,
                         divisor: int | None = 1) -> dict[int, torch.Tensor] | None:
        """With ``keep_gradients``: a copy of this rank's part of each member's local gradient (``sums``:
        on the replicate level, the landed reduction's, where the gradient holds them), divided by a
        pipeline schedule's ``divisor``."""
        if not self._keep_gradients:
            return None
        sums = sums or {}
        local = self._kept_parts([i for i in members if i not in sums])
        parts = {i: sums[i] if i in sums else local[i] for i in members}
        if divisor and divisor != 1:
            return self._divided(parts, divisor)  # copies already
        return {i: t.clone() for i, t in parts.items()}

    def _rows_sent(self, members: list[int]) -> dict[int, torch.Tensor] | None:
        """With a row state, a copy of this rank's rows of it: the launch keeps what it sent until
        ``step()`` compares it with the state then (the rule hands out views of its state)."""
        if self._row_states is None:
            return None
        rows = self._row_states(members)
        # One copy for the block (the views split it), not one per matrix.
        copies = torch.cat([rows[i].reshape(-1) for i in members]).split([rows[i].numel() for i in members])
        return {i: copy.view(rows[i].shape) for i, copy in zip(members, copies)}

    def _add(self, launch: Launch) -> None:
        launch.hops_issued = launch.pending.issued()
        self._launches[launch.block] = launch
        if self._worker is not None:
            self._early[launch.block] = self._worker.submit(self._block_work, launch)

    def _advance(self) -> None:
        """The earlier launches' next hops (their first has had a block's backward to land); with
        ``returns_in_backward`` their returns' next hops, and the returns now due.

        Which return is issued when depends only on the order of the landings (every rank issues
        the same collectives in the same order): a launch's return goes at the landing after the
        one that issued its directions' last hop, a block's backward later, so that its
        directions have landed and the owners' NS has had that time (the main thread waits here
        for the worker's result).
        """
        for earlier in self._launches.values():
            earlier.pending.forward()
            if earlier.returned is not None:
                earlier.returned.forward()
        if self._returns:
            for launch in self._launches.values():  # in launch order
                if launch.returned is None and launch.hops_issued:
                    launch.returned = self._return(launch)
                launch.hops_issued = launch.pending.issued()
        if self.replicate is not None:
            self.replicate.land_all()

    def _return(self, launch: Launch) -> Pending:
        """Main thread: issues the return of the owners' updates from ``launch``'s directions."""
        updates, new_rows, _ = self._worker_result(launch.block)
        return self.exchange.return_updates(launch.members, updates, None,
                                            new_rows if self._row_states is not None else None)

    def _worker_result(self, block: int) -> OwnerResults:
        """The worker's results for ``block`` (blocking the host until it has enqueued them), ordered
        before the current stream's next work and kept for it."""
        result = self._early[block].result()
        self.streams.wait(self._ns_done[block])
        # Redundant on every path today: the results stay referenced (self._early, then step()'s settled work)
        # past take(), and the NS stream's next allocation follows its landing of the next backward's exchange,
        # whose Pending first waits for the event of its making, on a stream forked (through FSDP2's
        # reduce-scatter stream, which waits for the compute stream) after take() joined dmuon's stream into
        # the compute stream. Kept as every hand-over to another stream is.
        self.streams.keep(kept([result.updates, result.rows]))
        return result

    @torch.no_grad()
    @ranged("ns.worker")
    def _block_work(self, launch: Launch) -> OwnerResults:
        # Worker thread: waits only on an exchange the main thread launched and issues
        # no collective itself, so every rank's collective order stays the main thread's.
        assert self._owner_work is not None
        # Not forked from this thread's default stream (backward's compute): only the exchange's events order NS.
        with self.streams.use(self.streams.own("ns"), fork=False):
            full = launch.pending.wait(exposed=False)
            # Landed: row_states() reads what wait() found, it issues nothing.
            rows = None if self._row_states is None else launch.pending.row_states()
            with self.streams.interval() as spent:  # on the NS stream: the device's time there too
                updates, new_rows = self._work.run(self._owner_work, sorted(full), full, rows)
            self._ns_done[launch.block] = self.streams.record()
        return OwnerResults(updates, new_rows, spent)

    def take(self) -> tuple[dict[int, Launch], EarlyWork]:
        """The launches since the last call (a partly landed unit completes now), every hop of
        theirs issued, and the worker's results for them (empty without a worker)."""
        self._compute = self.streams.current()
        if self._current is not None:
            self._complete(self._current)
        self._join_own_stream()
        self._learn_divisor()
        launches, self._launches = self._launches, {}
        self._landed.clear()
        self._fired.clear()
        if self._spreader is not None:
            if self._spreader.pending():
                # The last collective of the step's hop A: what every block has left, at once.
                self._spreader.decide([[0, 0]] * (self.plan.replicate * self.plan.shard), final=True)
                with self.exchange.across.coalesced():
                    for launch in launches.values():
                        launch.pending.forward()
            self._spreader.reset()
        for launch in launches.values():
            launch.pending.issue_all()
            if launch.returned is not None:
                launch.returned.issue_all()
        early = {b: self._worker_result(b) for b in sorted(self._early)}
        self._early.clear()
        self._ns_done.clear()
        return launches, early

    def learn_divisor(self) -> None:
        """Before a clip scales the gradients (``DMuon.clip_grad_norm_``, called on every rank of the
        mesh): the schedule's divisor from the gradients as its division left them. After the
        clip's scaling ``step()`` could not learn it (``schedule_divisor``'s docstring), and a
        run that clips on every step would defer every launch for good."""
        self._compute = self.streams.current()
        self._join_own_stream()
        self._learn_divisor()

    def _learn_divisor(self) -> None:
        """After launches deferred from a reduction called by hand: the schedule's divisor, from the
        gradients as reduced and as they are now (every rank alike: one small all-reduce)."""
        kept = self.divisor.kept()
        if kept is None:
            return
        self.streams.keep(kept.values())  # copied on FSDP2's (or dmuon's) stream, read and freed here
        topo = self.plan.topology
        self.divisor.learn(self._kept_parts(list(kept)), topo.mesh_group if topo.world_size > 1 else None)

    def close(self) -> None:
        """Removes the hooks and stops the worker, waking it where it waits for a hop of a launch
        that the main thread will not forward any more (it then ends that block with an error)."""
        for handle in getattr(self, "_hooks", ()):
            handle.remove()
        self._hooks = []
        for launch in getattr(self, "_launches", {}).values():
            launch.pending.abandon()
        if getattr(self, "_worker", None) is not None:
            self._worker.shutdown()
            self._worker = None

    def __del__(self) -> None:
        self.close()


def _slice_shape(info: MatrixInfo, shard: int):
    """What the matrix's hop A moves (:class:`~dmuon.plan.hop_a.SliceShape`)."""
    return slice_shape(info.owner // shard, [(p.rows, p.cols, p.sends) for p in info.pieces], info.replicate,
                       info.inner)
