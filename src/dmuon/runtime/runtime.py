"""The shard runtime: every dmuon collective and the step's whole schedule.

FSDP2 keeps the weights: storage, mixed precision, the reduce-scatter in
backward and the all-gather in forward. The runtime moves each Muon matrix's
direction from FSDP2's (and TP's) shards to its one owner and the owner's
update back (:mod:`dmuon.comm.exchange`), and decides when everything runs:
the launches from backward (:mod:`dmuon.runtime.backward`), the step's
agreement (:mod:`dmuon.runtime.agreement`), the owners' batches and the return
waves (:mod:`dmuon.runtime.owner_work`). The optimizer supplies the rule as
callbacks (:class:`~dmuon.runtime.callbacks.StepCallbacks`) and calls
:meth:`ShardRuntime.step`; the runtime never reads optimizer state.

One step (:meth:`ShardRuntime.step`), on every rank:

1. take the launches from backward (and the worker's NS results);
2. settle, with every rank, which matrices have a gradient, which launches
   still stand, and whether a non-finite gradient skips the step
   (:meth:`_settle_unchecked` with ``nonfinite=None``, else
   :meth:`_settle_checked`); the optimizer's ``commit`` advances its state;
3. exchange what was not kept from backward, run the owners' work in the
   balancer's batches, return the updates in waves
   (:meth:`_exchange_and_apply`), running ``independent`` (AdamW) while
   transfers travel, and hand each wave's rows to ``apply``;
4. with a rule that asks for sums over the weight (MuonH's norms), add them over the
   ranks that split each matrix, before the first ``apply`` and after the last
   (:mod:`dmuon.runtime.matrix_norms`: one all-reduce each, none when no sums are asked);
5. hand the rule the step's agreed maxima (``finish_step``: QK-clip), then
   record the post-optimizer event.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist

from dmuon.comm import CommStats, Pending, ShardExchange
from dmuon.comm.device_streams import streams_for
from dmuon.comm.replicate import ReplicateReduce
from dmuon.plan.batches import default_return_waves
from dmuon.plan.plan import Plan
from dmuon.runtime.agreement import Agreement, agreement_flags
from dmuon.runtime.backward import BackwardLaunches, EarlyWork, Launch, OwnerResults
from dmuon.runtime.callbacks import StepCallbacks
from dmuon.runtime.clipping import clip_grad_norm_
from dmuon.runtime.config import ExecutionConfig
from dmuon.runtime.matrix_norms import MatrixNorms
from dmuon.runtime.owner_momentum import OwnerMomentum
from dmuon.runtime.replicate import ReplicateLevel
from dmuon.runtime.report import StepReport
from dmuon.runtime.tuning import TunedOwnerWork
from dmuon.util.bits import any_bits_differ
from dmuon.util.dtensor import local_tensor


class _Settled(NamedTuple):
    """What step 2 settled, identically on every rank (but ``directions``, this rank's)."""

    agreement: Agreement
    directions: dict[int, torch.Tensor]
    """This rank's part of each active matrix's direction (empty for a skipped step)."""
    rows: dict[int, torch.Tensor] | None
    """With a row state: this rank's rows of each active matrix's row state (None without one)."""
    independent_done: bool
    """``independent`` already ran (while the flags travelled)."""
    speculative: EarlyWork | None = None
    """The owners' results computed before the agreement, kept (every launch stood)."""
    returned: Pending | None = None
    """Their return, issued with the agreement's flags."""


class ShardRuntime:
    """Owns dmuon's collectives and the step's schedule for one plan.

    Args:
        plan: The ownership plan (from :func:`dmuon.prepare`); its ``ns.dtype`` is the
            wire dtype of directions and updates.
        callbacks: The optimizer's rule (:class:`~dmuon.runtime.callbacks.StepCallbacks`).
        config: When things run (:class:`~dmuon.runtime.config.ExecutionConfig`).
        root: FSDP2's root module, for ``config.post_optim_event``.

    Raises:
        ValueError: ``post_optim_event`` on a device without events (CPU), or without a root;
            ``loopback_collectives`` with a plan made without torch.distributed.
    """

    def __init__(self, plan: Plan, callbacks: StepCallbacks, config: ExecutionConfig = ExecutionConfig(),
                 root=None) -> None:
        self.plan = plan
        self.topo = plan.topology
        if config.loopback_collectives:
            if self.topo.world_group is None:
                raise ValueError("loopback_collectives=True needs dmuon's process groups: prepare() the "
                                 "plan with torch.distributed initialized (one rank is enough)")
            # Read by the exchange's hops and the agreement (Topology.loopback); the plan's stays as it is.
            self.topo = dataclasses.replace(self.topo, loopback=True)
        self.device = plan.device
        self.streams = streams_for(self.device)
        """Where every stream, event and wait of this runtime goes (:mod:`dmuon.comm.streams`)."""
        self.config = config
        self.callbacks = callbacks
        if config.post_optim_event and self.device.type == "cpu":
            raise ValueError("post_optim_event=True needs a device with events (CUDA); the CPU backend has none")
        if config.post_optim_event and not hasattr(root, "set_post_optim_event"):
            raise ValueError("post_optim_event=True needs the fully_shard-ed root module (FSDPModule)")
        self._root = root if config.post_optim_event else None
        self.stats = CommStats()
        self.row_width = callbacks.row_width
        if not (isinstance(self.row_width, int) and self.row_width >= 0):
            raise ValueError(f"the rule's row_width must be an int >= 0, got {self.row_width!r}")
        self.exchange = ShardExchange(plan.infos, self.topo, self.stats, plan.ns.dtype, self.device, self.row_width)
        self.norms = MatrixNorms(plan, self.stats)
        """The rule's per-matrix sums over the weight, added over the ranks that split each matrix."""
        waves = config.return_waves if config.return_waves is not None else default_return_waves(self.device.type)
        self.work = TunedOwnerWork(plan, per_block=config.ns_in_backward, max_waves=waves)
        self.work.tune(callbacks.owner_work, callbacks.matrices(), self.row_width)  # never inside a step
        self.replicate: ReplicateLevel | None = None
        """dmuon's replicate level (``hsdp_mesh``): every gradient reduced across replicas by dmuon."""
        if plan.reduces_replicas:
            self.replicate = ReplicateLevel(plan, ReplicateReduce(plan.infos, self.topo, self.stats, self.device,
                                                                   self.exchange.across))
        self.owner_momentum: OwnerMomentum | None = None
        """With ``clipped_overlap`` (and a rescalable rule): the owners' copies of their whole momenta."""
        if config.overlap and config.clipped_overlap and callbacks.rescalable:
            self.owner_momentum = OwnerMomentum(plan, self.device)
        self._last_scaled = False
        """The last step's launches stood for rescaled gradients (the same on every rank)."""
        self.backward: BackwardLaunches | None = None
        if config.overlap or self.replicate is not None:
            self.backward = BackwardLaunches(plan, self.exchange, callbacks.peek, self.grad_parts, callbacks.matrices,
                                             self._check_grad, callbacks.owner_work if config.ns_in_backward else None,
                                             self.work, directions=config.overlap, replicate=self.replicate,
                                             row_states=callbacks.row_states if self.row_width else None,
                                             hop_a_spread=config.resolved_hop_a_spread,
                                             keep_gradients=self.owner_momentum is not None,
                                             returns_in_backward=config.returns_in_backward)

    @property
    def column(self) -> int:
        """This rank's shard position: which piece of each matrix it holds."""
        return self.topo.coords[1]

    def grad_parts(self, members: list[int]) -> dict[int, torch.Tensor]:
        """This rank's part of each member's reduced gradient (``MatrixInfo.kept_view``; with the
        replicate level, of the mean over replicas once :meth:`ReplicateLevel.finish` ran)."""
        if self.replicate is not None:
            return {i: self.replicate.mean_part(i) for i in members}
        r, s = self.topo.coords
        infos = self.plan.infos
        return {i: infos[i].kept_view(local_tensor(infos[i].param.grad), r, s) for i in members}

    def _check_grad(self, index: int) -> None:
        grad = self.plan.infos[index].param.grad
        if grad.is_sparse or torch.is_complex(grad):
            raise ValueError(f"parameter {self.plan.infos[index].name!r}: sparse and complex gradients are "
                             "not supported by Muon")

    # ---------------------------------------------------------------- the step
    @torch.no_grad()
    def step(self) -> StepReport:
        """Runs one step on every rank (a collective call); what it did on this rank."""
        start = time.perf_counter()
        cb = self.callbacks
        launches, early = self.backward.take() if self.backward is not None else ({}, {})
        if self.replicate is not None:
            self.replicate.finish()
        managed = cb.matrices()
        here = [i for i in managed if self.plan.infos[i].param.grad is not None]
        for i in here:
            self._check_grad(i)
        maxima = cb.step_maxima()
        if self.config.nonfinite is None:
            settled = self._settle_unchecked(launches, early, managed, here, maxima)
        else:
            try:
                settled = self._settle_checked(launches, managed, here, maxima)
            except FloatingPointError:
                # Every rank raises alike (nonfinite="raise"): what backward sent lands first, so
                # no exchange is left in flight, holding buffers, behind a caught error.
                self._land_unused(launches)
                raise
        report = StepReport(skipped_nonfinite=settled.agreement.skipped)
        if settled.agreement.skipped:
            self._land_unused(launches)
        else:
            stale = settled.agreement.stale
            kept = {b for k, b in enumerate(sorted(launches)) if not stale[k]}
            if settled.speculative is not None:
                early = settled.speculative
                report.orthogonalized_while_agreeing = sum(len(w.updates) for w in early.values())
            # The weights as the last step left them (MuonH: a new matrix's radius), then the updated ones.
            self.norms.run(cb, settled.agreement.active, applied=False)
            self._exchange_and_apply(settled, launches, kept, early, report)
            self.norms.run(cb, settled.agreement.active, applied=True)
            report.blocks_exchanged_in_backward = len(kept)
            if self.config.ns_in_backward:
                rescaled = {b for k, b in enumerate(sorted(launches)) if settled.agreement.rescaled[k]}
                # A rescaled launch's early NS ran on the launched directions: redone in step().
                report.orthogonalized_in_backward = sum(len(w.updates) for b, w in early.items()
                                                        if b in kept - rescaled)
            # Part of the step: before the event, so the next forward's all-gathers wait for it too.
            cb.finish_step(settled.agreement.active, settled.agreement.maxima)
            if self._root is not None:
                event = torch.Event(device=self.device)
                event.record()  # after every update of this step, on the current stream
                self._root.set_post_optim_event(event)
        self._last_scaled = any(settled.agreement.rescaled)
        report.rescaled_launches = sum(settled.agreement.rescaled)
        if self.owner_momentum is not None and self.owner_momentum.wanted:
            self._send_momentum_to_owners(managed)
        report.traffic = CommStats(**self.stats.as_dict())
        report.step_seconds = time.perf_counter() - start
        self.stats.reset()
        return report

    @staticmethod
    def _land_unused(launches: dict[int, Launch]) -> None:
        """Lands every exchange of ``launches`` unused, on every rank alike."""
        for launch in launches.values():
            launch.pending.wait()
            if launch.returned is not None:
                launch.returned.wait()

    def _settle_unchecked(self, launches: dict[int, Launch], early: EarlyWork, managed: list[int],
                          here: list[int], maxima: torch.Tensor | None) -> _Settled:
        """``nonfinite=None``: nothing can skip the step, so the state advances first and one
        agreement settles the active set, the launches' verdicts and the rule's maxima."""
        cb = self.callbacks
        directions = cb.commit(here, self.grad_parts(here))
        rows = self._row_states(here)
        flags, settle = agreement_flags(self.plan.infos, self.column, managed, here, None, (),
                                        self._verdicts(launches, here, directions, rows), maxima)
        settle = self._with_scale(settle, len(launches))
        # The owners' work on what landed from backward, returned with the agreement's flags (no
        # collective of its own: on shared cores each one issued costs the issuing rank its turn);
        # kept only if the flags keep every launch and the launches cover every active matrix
        # (else the batches would differ). Only with one return wave: several waves return each
        # batch as soon as it is done instead.
        # Not after a step whose launches stood for rescaled gradients (clipping usually goes on): the
        # owners' work would then run on directions the agreement replaces.
        if launches and not early and self.work.max_waves == 1 and not self._last_scaled:
            speculative = self._speculate(launches)
            members = sorted(i for launch in launches.values() for i in launch.members)
            owned = {i: o for w in speculative.values() for i, o in w.updates.items()}
            owned_rows = {i: o for w in speculative.values() for i, o in w.rows.items()}
            returned = self.exchange.return_updates(members, owned, flags, owned_rows if self.row_width else None)
            cb.independent()  # nothing can skip the step: it runs while updates and flags travel
            agreement = settle(returned.agreed().tolist())
            if not any(agreement.stale) and not any(agreement.rescaled) and \
                    all(self.plan.infos[i].block in launches for i in agreement.active):
                return _Settled(agreement, directions, rows, True, speculative, returned)
            return _Settled(agreement, directions, rows, True)  # landed unused; every rank drops it alike
        decide = self._start_all_reduce_max(flags)
        cb.independent()  # while the flags travel
        return _Settled(settle(decide().tolist()), directions, rows, True)

    def _settle_checked(self, launches: dict[int, Launch], managed: list[int], here: list[int],
                        maxima: torch.Tensor | None) -> _Settled:
        """``nonfinite=`` set: agree on the step (skip or raise) and the rule's maxima before any
        state advances, then on the launches' verdicts."""
        checked = self.callbacks.checked_gradients()
        flags, settle = agreement_flags(self.plan.infos, self.column, managed, here, self.config.nonfinite,
                                        checked, None, maxima)
        agreement = settle(self._start_all_reduce_max(flags)().tolist())
        if agreement.skipped:
            return _Settled(agreement, {}, None, False)
        directions = self.callbacks.commit(agreement.active, self.grad_parts(agreement.active))
        rows = self._row_states(agreement.active)
        verdicts = self._start_all_reduce_max(self._verdicts(launches, agreement.active, directions, rows))().tolist()
        stale, scaled, scale = self._launch_verdict(verdicts, len(launches))
        return _Settled(agreement._replace(stale=stale, rescaled=scaled, scale=scale), directions, rows, False)

    def _row_states(self, members: list[int]) -> dict[int, torch.Tensor] | None:
        """With a row state, the rule's rows of it for ``members`` (what travels beside their directions)."""
        return self.callbacks.row_states(members) if self.row_width else None

    def _speculate(self, launches: dict[int, Launch]) -> EarlyWork:
        """The owners' work on every launched block, before the step's agreement is known.

        Batched exactly as :meth:`_exchange_and_apply` would batch them without launches
        (all of this rank's landed matrices at once), so the results are bit-identical to
        those of ``overlap=False`` when the agreement keeps every launch. Per block, as
        ``ns_in_backward``'s are (the time on the first block).
        """
        full: dict[int, torch.Tensor] = {}
        full_rows: dict[int, torch.Tensor] = {}
        for b in sorted(launches):
            full.update(launches[b].pending.wait())
            full_rows.update(launches[b].pending.row_states())
        with self.streams.interval() as spent:
            orthos, new_rows = self.work.run(self.callbacks.owner_work, sorted(full), full,
                                             full_rows if self.row_width else None)
        infos = self.plan.infos
        return {b: OwnerResults({i: o for i, o in orthos.items() if infos[i].block == b},
                                {i: o for i, o in new_rows.items() if infos[i].block == b}, spent if k == 0 else None)
                for k, b in enumerate(sorted(launches))}

    def _stale(self, launches: dict[int, Launch], active: list[int], directions: dict[int, torch.Tensor],
               rows: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
        """Per launch (block order), 1 unless it sent exactly these matrices and, bit for bit, these
        directions (and row states). int32 on this rank's device, read by no one before the
        agreement lands (a comparison read on the host would wait for the device once per matrix)."""
        if not launches:
            return torch.zeros(0, dtype=torch.int32)
        by_block: dict[int, list[int]] = {}
        for i in active:
            by_block.setdefault(self.plan.infos[i].block, []).append(i)
        stale = []
        for b in sorted(launches):
            launch = launches[b]
            if launch.members != by_block.get(b, []):
                stale.append(torch.ones((), dtype=torch.bool, device=self.device))
                continue
            pairs = [(launch.sent[i], directions[i]) for i in launch.members]
            if rows is not None:
                pairs.append(tuple(torch.cat([r[i].reshape(-1) for i in launch.members]) for r in (launch.rows, rows)))
            stale.append(any_bits_differ(pairs, self.device))
        return torch.stack(stale).to(torch.int32)

    def _verdicts(self, launches: dict[int, Launch], active: list[int], directions: dict[int, torch.Tensor],
                  rows: dict[int, torch.Tensor] | None) -> torch.Tensor:
        """This rank's flags on the launches (block order): :meth:`_stale`'s, then with ``clipped_overlap``
        :meth:`OwnerMomentum.launch_flags`."""
        stale = self._stale(launches, active, directions, rows)
        if self.owner_momentum is None:
            return stale
        extra = self.owner_momentum.launch_flags(launches, active, rows, self.topo.coords)
        return torch.cat([stale, torch.tensor(extra, dtype=torch.int32, device=stale.device)])

    def _launch_verdict(self, flags: list[int], launches: int) -> tuple[list[int], list[int], float | None]:
        """From the maxima of every rank's :meth:`_verdicts`: per launch 1 where it is stale, per launch
        1 where it stands for rescaled gradients, and their factor (:meth:`OwnerMomentum.verdict`)."""
        if self.owner_momentum is None:
            return flags, [0] * launches, None
        return self.owner_momentum.verdict(flags[:launches], flags[launches:], launches)

    def _with_scale(self, settle: Callable[[list[int]], Agreement], launches: int) -> Callable[[list[int]], Agreement]:
        """``settle`` whose agreement's stale flags, rescaled launches and factor come from
        :meth:`_launch_verdict` (of the flags :meth:`_verdicts` added, which ``settle`` returns as its
        stale flags)."""
        if self.owner_momentum is None:
            return settle

        def decide(flags: list[int]) -> Agreement:
            agreement = settle(flags)
            stale, scaled, scale = self._launch_verdict(list(agreement.stale), launches)
            return agreement._replace(stale=stale, rescaled=scaled, scale=scale)

        return decide

    def _send_momentum_to_owners(self, managed: list[int]) -> None:
        """At the end of a step that clipped while the owners kept no copies (the first clip, or the first
        after a state dict or a long run without one): every rank's part of each managed matrix's
        momentum to its owner, in float32, once; the owners' copies start from it."""
        exchange = ShardExchange(self.plan.infos, self.topo, self.stats, torch.float32, self.device)
        parts = self.callbacks.momentum_parts(managed)
        pending = exchange.send_directions(managed, {i: p.float() for i, p in parts.items()})
        pending.issue_all()
        self.owner_momentum.replace(pending.wait())

    def _exchange_and_apply(self, settled: _Settled, launches: dict[int, Launch], kept: set[int],
                            early: EarlyWork, report: StepReport) -> None:
        """Step 3, once the agreement is in: the owners' work and the updates' way back.

        With a kept speculation its return is already in flight; otherwise everything not
        kept from backward goes to the owners in one exchange, and the owners run their
        batches wave by wave, each wave's return issued behind its batches.
        """
        infos, cb = self.plan.infos, self.callbacks
        active = settled.agreement.active
        scale = settled.agreement.scale
        rescaled = {b for k, b in enumerate(sorted(launches)) if settled.agreement.rescaled[k]}
        for b in launches:
            if b not in kept:
                launches[b].pending.wait()  # stale: lands unused
        # Launches standing for rescaled gradients: their early NS ran on the launched directions.
        done = (kept & early.keys()) - rescaled
        # Returns issued in backward (returns_in_backward): those of launches done stand, the others land unused.
        back = {b: launches[b].returned for b in sorted(launches) if launches[b].returned is not None}
        for b in back.keys() - done:
            back.pop(b).wait()
        report.blocks_returned_in_backward = len(back)
        ns_spans = [early[b].spent for b in done if early[b].spent is not None]
        # With the owners' copies kept: each owned matrix's direction this step, to advance its copy.
        tracking = self.owner_momentum is not None and self.owner_momentum.ready
        used: dict[int, torch.Tensor] = {}
        if tracking:
            for b in sorted(done if settled.returned is None else kept):
                used.update(launches[b].pending.wait())
        orthos: dict[int, torch.Tensor] = {}
        new_rows: dict[int, torch.Tensor] = {}
        for b in done:
            orthos.update(early[b].updates)  # this rank's own
            new_rows.update(early[b].rows)
        if settled.returned is not None:
            returns = [settled.returned]
            report.return_waves = [list(active)]
        else:
            # Matrices whose updates came back in backward take no part in the step's waves.
            active = [i for i in active if infos[i].block not in back]
            rest = [i for i in active if infos[i].block not in kept]
            pending = [launches[b].pending for b in sorted(kept) if b not in done]
            pending.append(self.exchange.send_directions(rest, settled.directions, settled.rows))
            with self.streams.interval() as in_step:  # on the compute stream: the device's time there too
                ns_spans.append(in_step)
                full: dict[int, torch.Tensor] = {}
                full_rows: dict[int, torch.Tensor] = {}
                for p in pending:
                    full.update(p.wait())
                    full_rows.update(p.row_states())
                if rescaled:
                    # The directions for the clipped gradients, from the launched ones and the momentum.
                    for i in full:
                        if infos[i].block in rescaled:
                            used[i] = cb.rescale_direction(i, full[i], self.owner_momentum.of(i), scale)
                            full[i] = used[i].to(full[i].dtype)
                if tracking:
                    for i, d in full.items():
                        used.setdefault(i, d)
                # Every rank's matrices whose work ran in backward (not only this rank's): the waves must agree.
                waves = self.work.return_waves(active, {i for i in active if infos[i].block in done})
                report.return_waves = [members for members, _ in waves]
                returns = list(back.values())
                for members, batches in waves:
                    for batch in batches:
                        batch_updates, batch_rows = self.work.run_batch(
                            cb.owner_work, batch, [full.pop(i) for i in batch],
                            [full_rows.pop(i) for i in batch] if self.row_width else None)
                        orthos.update(batch_updates)
                        new_rows.update(batch_rows)
                    self._forward_returns(returns)  # HSDP: the earlier waves' next hops, behind this wave's work
                    returns.append(self.exchange.return_updates(
                        members, {i: orthos[i] for i in members if i in orthos}, None,
                        {i: new_rows[i] for i in members if i in new_rows} if self.row_width else None))
        if tracking:
            for i, d in used.items():  # NS does not modify its inputs; nothing reads the copies after this
                cb.advance_momentum(i, self.owner_momentum.of(i), d)
        if not settled.independent_done:
            cb.independent()  # while the last wave travels
        for k, wave in enumerate(returns):
            while not wave.issued():
                self._forward_returns(returns[k:])
            if self.row_width:
                cb.apply(wave.wait(), wave.row_states())
            else:
                cb.apply(wave.wait())
        report.orthogonalized = len(orthos)
        report.ns_seconds = sum(span.host_seconds for span in ns_spans)
        report.ns_spans = ns_spans

    def _forward_returns(self, returns: list[Pending]) -> None:
        """Advances every return in flight by one hop (:meth:`Pending.forward`). On HSDP the hops this
        issues across replicas (one wave's first, the scatter route's all-gather of the wave before)
        go to the same peers at the same moment, so they travel as one all-to-all: a latency per
        peer saved per wave (``owner_exchange_collectives`` lists them as one collective)."""
        with self.exchange.across.coalesced():
            for pending in returns:
                pending.forward()

    # ---------------------------------------------------------------- clipping
    @torch.no_grad()
    def clip_grad_norm_(self, params: list[torch.Tensor], max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_``'s result on every rank, each gradient element counted
        once (:func:`dmuon.runtime.clipping.clip_grad_norm_`); with the replicate level the
        gradients are reduced across replicas first (:meth:`ReplicateLevel.finish`)."""
        if self.replicate is not None:
            self.replicate.finish()
        return clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite, replicate=self.replicate,
                               group=self.topo.world_group if self.topo.world_size > 1 else None,
                               device=self.device)

    # ------------------------------------------------------------- collectives
    def _start_all_reduce_max(self, flags: torch.Tensor) -> Callable[[], torch.Tensor]:
        """Issues the elementwise maximum of ``flags`` over every rank; the returned function waits
        for it (work can go on meanwhile)."""
        if self.topo.world_size == 1 and not self.topo.loopback:
            return lambda: flags.cpu()
        flags = flags.to(self.device)
        work = self.streams.issue(
            lambda: dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.topo.world_group, async_op=True),
            reads=(flags,), writes=(flags,))

        def landed() -> torch.Tensor:
            work.wait()
            return flags.cpu()

        return landed

    def close(self) -> None:
        """Removes the backward hooks and stops the NS worker (also done when the runtime is freed)."""
        if self.backward is not None:
            self.backward.close()
