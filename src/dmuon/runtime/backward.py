"""Exchanges launched from FSDP2's backward, and the owners' work on a worker thread behind them.

Once every matrix of a unit with ``requires_grad`` has landed, or the next unit starts landing
(:mod:`dmuon.runtime.gradient_hooks`), the unit is launched: the optimizer's
:meth:`~dmuon.runtime.StepCallbacks.peek` gives this rank's part of each direction, and the
exchange to the owners starts. The launch is *speculative*: ``step()`` keeps it only if the
direction the optimizer commits from the final gradients is bit for bit the one sent (a gradient
clipped or edited in between fails that check, and the block is exchanged again in ``step()``), so
the result never depends on it.

Collective order: on HSDP a block's directions take two hops (across replicas, then inside the
owner's replica); each next hop is issued from the main thread when the next block launches (or
``step()`` takes the launches), so every rank issues them in the same order. On dmuon's replicate
level each unit's reduction across replicas goes first, joined with the launched blocks' hop A
(:mod:`dmuon.runtime.replicate_backward`). With ``ns_in_backward`` the owners' work runs on a worker
thread (:mod:`dmuon.runtime.worker`), and with ``returns_in_backward`` each block's updates return
at a later landing.

Streams (CUDA; :mod:`dmuon.comm.streams`): FSDP2 calls the hooks on its post-reduce stream. A 1-D
launch (peek, the send buffer, issuing the exchange) stays there: it reads the gradient and the
state and waits for nothing, and FSDP2's ``finalize_backward`` makes the compute stream wait for
that stream, so user code before ``step()`` (clipping) never overtakes it. Everything that waits
(landing earlier hops, the returns of ``returns_in_backward``) and, on the replicate level, all of
a unit's work runs on dmuon's own stream (:mod:`dmuon.runtime.own_stream`), forked from FSDP2's:
FSDP2's stream never waits for dmuon. ``take()``, and on the replicate level the end of backward,
make the compute stream wait for dmuon's stream.
"""

from __future__ import annotations

import torch

from dmuon.comm import Pending, ShardExchange
from dmuon.comm.device_streams import streams_for
from dmuon.comm.pending import no_result
from dmuon.plan.plan import Plan
from dmuon.runtime.callbacks import RowState, StepCallbacks
from dmuon.runtime.config import ExecutionConfig
from dmuon.runtime.gradient_hooks import GradientHooks, hooked_units
from dmuon.runtime.gradients import GradientParts, divided
from dmuon.runtime.launch import Launch
from dmuon.runtime.own_stream import OwnStream
from dmuon.runtime.owner_momentum import OwnerMomentum
from dmuon.runtime.owner_work import OwnerWork
from dmuon.runtime.replicate import ReplicateLevel, Reduction
from dmuon.runtime.replicate_backward import ReplicateBackward
from dmuon.runtime.schedule_divisor import ScheduleDivisor
from dmuon.runtime.worker import EarlyWork, NSWorker

__all__ = ["BackwardLaunches"]


class BackwardLaunches:
    """The launches of one runtime, from its gradient hooks' landings (:func:`hooked_units`), with
    ``ns_in_backward`` the NS worker behind them.

    Args:
        plan: The ownership plan.
        exchange: Where launches send.
        callbacks: The rule: ``matrices`` (only those are launched), ``peek`` (the directions, state
            untouched), with ``config.ns_in_backward`` ``owner_work`` (:class:`~dmuon.runtime.worker.NSWorker`),
            and a :class:`~dmuon.runtime.callbacks.RowState` rule's ``row_states`` (sent beside the
            directions).
        config: ``overlap`` (launch the direction exchanges; without, with ``replicate`` the hooks
            only start the reductions), ``ns_in_backward``, ``returns_in_backward`` (with the worker:
            each block's updates return in backward, :attr:`Launch.returned`, at the block landing
            after the one that issued its directions' last hop; the main thread waits there for the
            worker's results of it) and, with ``replicate``, the hop A spread.
        gradients: This rank's gradient parts (no replicate level) and the gradients' check.
        work: The owners' batching (per block with the worker).
        replicate: dmuon's replicate level, or None.
        owner_momentum: With ``clipped_overlap``, the owners' momentum copies: the launches keep what
            tells a later rescale (:attr:`Launch.grads`, :attr:`Launch.grad_extrema`); None: nothing.
    """

    def __init__(self, plan: Plan, exchange: ShardExchange, callbacks: StepCallbacks, config: ExecutionConfig,
                 gradients: GradientParts, work: OwnerWork, replicate: ReplicateLevel | None = None,
                 owner_momentum: OwnerMomentum | None = None) -> None:
        self.plan, self.exchange, self.callbacks, self.config = plan, exchange, callbacks, config
        self.gradients = gradients
        self.owner_momentum = owner_momentum
        self.streams = streams_for(plan.device)
        self.own = OwnStream(self.streams)
        self.replicate: ReplicateBackward | None = None
        if replicate is not None:
            spread = config.resolved_hop_a_spread if config.overlap else None
            self.replicate = ReplicateBackward(replicate, plan, exchange, spread, self.own)
        # The worker thread enters the plan's device first: Triton launches on the thread's current device.
        self.worker = NSWorker(self.streams, callbacks, work) if config.ns_in_backward else None
        self._returns = config.returns_in_backward and self.worker is not None
        self.divisor = ScheduleDivisor(plan.device)
        """What a pipeline schedule divides the gradients by after its reduction (learned once)."""
        self._launches: dict[int, Launch] = {}
        self.hooks = GradientHooks(plan, hooked_units(plan, replicate is not None), self.streams, self, replicate)

    # ------------------------------------------------------------ the hooks' landings
    def complete(self, unit: int, landed: set[int], first: bool) -> None:
        """A unit's gradients have landed (:meth:`GradientHooks.complete`)."""
        block = self.hooks.units[unit].block
        if self.replicate is None:
            # Landing earlier hops waits: on dmuon's stream. The launch only reads the gradient
            # and the state and issues, on FSDP2's stream, whose end FSDP2 makes the compute
            # stream wait for (finalize_backward): clipping then never overtakes what it read.
            with self.own.use():
                self._advance()
            self._launch(block, landed, first)
            return
        # The pending blocks' hop A chunks and this unit's column reduce-scatter go to the same
        # peers now: one collective across nodes (one latency per peer, not one per part); the
        # spreader sizes the chunks so that no replica receives much more than the others.
        # All of it on dmuon's stream: the joined collective reads what the landings there made.
        params = self.replicate.reduced_params(self.hooks.units[unit].params, landed)
        with self.own.use():
            with self.exchange.across.coalesced():
                self.replicate.decide_spread(params)
                self._advance()
                reduction = self._launch_replicated(block, landed, first, params)
            self.replicate.level.start_mean(reduction)

    def backward_ended(self) -> None:  # replicate level only
        self.replicate.backward_ended()

    def stage_reduced(self) -> None:  # replicate level only
        self.replicate.land_stage(self.divisor, self.gradients)

    # ------------------------------------------------------------ launching
    def _members(self, block: int | None, landed: set[int]) -> list[int]:
        """The unit's matrices to launch: a matrix outside the optimizer's param groups is not stepped."""
        infos = self.plan.infos
        return [i for i in self.callbacks.matrices() if id(infos[i].param) in landed] if block is not None else []

    def _launch(self, block: int | None, landed: set[int], first: bool) -> None:
        """Starts a completed unit's directions (no replicate level)."""
        members = self._members(block, landed)
        defer, divisor = self.divisor.for_reduction(self.hooks.by_hand)
        if not first or not members:
            # A second reduction in one step (accumulation without FSDP2's no-sync): the
            # launch is stale, and step()'s check will redo it.
            return
        if defer:
            self.divisor.keep(self.gradients.local_parts(members))
            return
        for i in members:
            self.gradients.check(i)
        sent = self.callbacks.peek(members, divided(self.gradients.parts(members), divisor))
        rows = self._rows_sent(members)
        launch = Launch(block, members, sent, self.exchange.send_directions(members, sent, rows), rows)
        self._keep_gradients(launch, divisor=divisor)
        self._add(launch)

    def _launch_replicated(self, block: int | None, landed: set[int], first: bool,
                           params: list[torch.Tensor]) -> Reduction:
        """Starts what a completed unit sends on the replicate level: its reduction across replicas of
        ``params`` (the caller issues its other parameters' all-reduce), then its directions."""
        members = self._members(block, landed)
        defer, divisor = self.divisor.for_reduction(self.hooks.by_hand)
        reduction = self.replicate.level.start_columns(params)
        if first and members and self.config.overlap and defer:
            self.replicate.to_keep.extend(members)
        elif first and members and self.config.overlap:
            launch = Launch(block, members, {}, None)  # type: ignore[arg-type]
            launch.pending = Pending([], no_result, self.exchange.stats,
                                     then=lambda: self._send_after(reduction, launch, divisor))
            self._add(launch)
            self.replicate.add(block, members)
        return reduction

    def _send_after(self, reduction: Reduction, launch: Launch, divisor: int | None = 1) -> Pending:
        """Main thread, once the unit's reduction across replicas has landed: the directions from it
        (from its sums divided by a pipeline schedule's ``divisor`` first, as the schedule divides them)."""
        level = self.replicate.level
        level.land(reduction)
        for i in launch.members:
            self.gradients.check(i)
        sums = divided(reduction.columns.wait(), divisor)
        sent = self.callbacks.peek(launch.members, level.mean_parts_of(reduction, launch.members, sums))
        launch.sent.update(sent)
        launch.rows = self._rows_sent(launch.members)
        # What the directions came from: the reduction's sums (a clip since scaled the gradients, not them).
        self._keep_gradients(launch, sums)
        return self.exchange.send_directions(launch.members, sent, launch.rows, self.replicate.spread_for(launch.block))

    def _keep_gradients(self, launch: Launch, sums: dict[int, torch.Tensor] | None = None,
                        divisor: int | None = 1) -> None:
        """What ``step()`` needs to tell a rescale of the launch's gradients: copies of them only while
        the owners' momentum copies serve (a rescaled launch then stands), else their extrema (the
        first rescale, which the owners' copies wait for); nothing without ``clipped_overlap``."""
        if self.owner_momentum is None:
            return
        if self.owner_momentum.ready:
            launch.grads = self.gradients.copies(launch.members, sums, divisor)
        else:
            launch.grad_extrema = self.gradients.extrema(launch.members, sums, divisor)

    def kept_gradient_bytes(self) -> int:
        """The bytes the launches since the last ``take()`` keep of their gradients (memory measurements)."""
        kept = [t for launch in self._launches.values() for part in (launch.grads, launch.grad_extrema)
                if part is not None for t in part.values()]
        return sum(t.numel() * t.element_size() for t in kept)

    def _rows_sent(self, members: list[int]) -> dict[int, torch.Tensor] | None:
        """With a row state, a copy of this rank's rows of it: the launch keeps what it sent until
        ``step()`` compares it with the state then (the rule hands out views of its state)."""
        if not isinstance(self.callbacks, RowState):
            return None
        rows = self.callbacks.row_states(members)
        # One copy for the block (the views split it), not one per matrix.
        copies = torch.cat([rows[i].reshape(-1) for i in members]).split([rows[i].numel() for i in members])
        return {i: copy.view(rows[i].shape) for i, copy in zip(members, copies)}

    def _add(self, launch: Launch) -> None:
        launch.hops_issued = launch.pending.issued()
        self._launches[launch.block] = launch
        if self.worker is not None:
            self.worker.submit(launch)

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
            self.replicate.level.land_all()

    def _return(self, launch: Launch) -> Pending:
        """Main thread: issues the return of the owners' updates from ``launch``'s directions."""
        updates, new_rows, _ = self.worker.result(launch.block)
        return self.exchange.return_updates(launch.members, updates, None,
                                            new_rows if isinstance(self.callbacks, RowState) else None)

    # ------------------------------------------------------------ the step's side
    def take(self) -> tuple[dict[int, Launch], EarlyWork]:
        """The launches since the last call (a partly landed unit completes now), every hop of
        theirs issued, and the worker's results for them (empty without a worker)."""
        self.own.mark_compute()
        self.hooks.complete_current()
        self.own.join()
        self._learn_divisor()
        launches, self._launches = self._launches, {}
        self.hooks.reset()
        if self.replicate is not None:
            self.replicate.finish_spread([launch.pending for launch in launches.values()])
        for launch in launches.values():
            launch.pending.issue_all()
            if launch.returned is not None:
                launch.returned.issue_all()
        return launches, (self.worker.take() if self.worker is not None else {})

    def learn_divisor(self) -> None:
        """Before a clip scales the gradients (``DMuon.clip_grad_norm_``, called on every rank of the
        mesh): the schedule's divisor from the gradients as its division left them. After the
        clip's scaling ``step()`` could not learn it (``schedule_divisor``'s docstring), and a
        run that clips on every step would defer every launch for good."""
        self.own.mark_compute()
        self.own.join()
        self._learn_divisor()

    def _learn_divisor(self) -> None:
        topo = self.plan.topology
        self.divisor.learn_from(self.gradients, self.streams, topo.mesh_group if topo.world_size > 1 else None)

    def close(self) -> None:
        """Removes the hooks and stops the worker, waking it where it waits for a hop of a launch
        that the main thread will not forward any more (it then ends that block with an error)."""
        if getattr(self, "hooks", None) is not None:
            self.hooks.close()
        for launch in getattr(self, "_launches", {}).values():
            launch.pending.abandon()
        if getattr(self, "worker", None) is not None:
            self.worker.shutdown()
            self.worker = None

    def __del__(self) -> None:
        self.close()
