"""The FSDP2 schedule (:class:`ShardRuntime`): every dmuon collective and the step's whole schedule.

FSDP2 keeps the weights: storage, mixed precision, the reduce-scatter in
backward and the all-gather in forward. The runtime moves each Muon matrix's
direction from FSDP2's (and TP's) shards to its one owner and the owner's
update back (:mod:`dmuon.comm.exchange`), and decides when everything runs:
the launches from backward (:mod:`dmuon.runtime.backward`), the step's
agreement (:mod:`dmuon.runtime.agreement`), the owners' batches and the return
waves (:mod:`dmuon.runtime.owner_work`). The optimizer supplies the rule as
callbacks (:class:`~dmuon.runtime.callbacks.StepCallbacks`) and calls
:meth:`~dmuon.runtime.base.Runtime.step`; the runtime never reads optimizer state.

One step (:meth:`ShardRuntime._step`, framed by :meth:`~dmuon.runtime.base.Runtime.step`), on every rank:

1. take the launches from backward (and the worker's NS results);
2. settle, with every rank, which matrices have a gradient, which launches
   still stand, and whether a non-finite gradient skips the step; the
   optimizer's ``commit`` advances its state (:mod:`dmuon.runtime.settle`:
   one :class:`~dmuon.runtime.settle.Settled`);
3. collect the whole directions the owners need: what was kept from backward,
   the rest exchanged now (:meth:`ShardRuntime._owner_directions`);
4. run the owners' work in the balancer's batches and return the updates in
   waves (:meth:`ShardRuntime._return_waves`), running ``independent`` (AdamW)
   while transfers travel, and hand each wave's rows to ``apply``
   (:meth:`~dmuon.runtime.base.Runtime._apply`);
5. with a rule that asks for sums over the weight (MuonH's norms), add them over the
   ranks that split each matrix, before the first ``apply`` and after the last
   (:mod:`dmuon.runtime.matrix_norms`: one all-gather each, none when no sums are asked; with the
   updates applied in the next forward, the sums after each return's apply, computed ahead);
6. hand the rule the step's agreed maxima (``finish_step``: QK-clip), then
   record the post-optimizer event.
"""

from __future__ import annotations

from typing import ContextManager, NamedTuple

import torch

from dmuon.comm import Pending, ShardExchange
from dmuon.comm.replicate import ReplicateReduce
from dmuon.comm.warm_peers import exchange_pairs
from dmuon.plan.plan import Plan
from dmuon.runtime.backward import BackwardLaunches
from dmuon.runtime.base import Runtime
from dmuon.runtime.callbacks import Rescalable, StepCallbacks, StepMaxima, WeightSums
from dmuon.runtime.clipping import clip_grad_norm_
from dmuon.runtime.config import ExecutionConfig
from dmuon.runtime.next_forward import NextForwardUpdates
from dmuon.runtime.gradients import GradientParts
from dmuon.runtime.matrix_norms import MatrixNorms, TotalsBehind
from dmuon.runtime.owner_momentum import OwnerMomentum
from dmuon.runtime.replicate import ReplicateLevel
from dmuon.runtime.report import StepReport
from dmuon.runtime.settle import Settled, StepSettler, land_unused


class _Directions(NamedTuple):
    """The whole directions this rank's owners work on in ``step()`` (step 3)."""

    full: dict[int, torch.Tensor]
    """Each owned matrix's whole direction (wire dtype), the rescaled ones formed by the owner."""
    rows: dict[int, torch.Tensor]
    """Their whole row states (empty without a :class:`~dmuon.runtime.callbacks.RowState` rule)."""
    used: dict[int, torch.Tensor]
    """With the owners' momentum copies in use: each owned matrix's direction this step, to advance
    its copy (empty otherwise)."""


class ShardRuntime(Runtime):
    """Owns dmuon's collectives and the step's schedule for one plan (the FSDP2 schedule of
    :class:`~dmuon.runtime.base.Runtime`).

    Args:
        plan: The ownership plan (from :func:`dmuon.prepare`); its ``ns.dtype`` is the
            wire dtype of directions and updates.
        callbacks: The optimizer's rule (:class:`~dmuon.runtime.callbacks.StepCallbacks`).
        config: When things run (:class:`~dmuon.runtime.config.ExecutionConfig`).
        root: FSDP2's root module, for ``config.post_optim_event``.
        pipeline_group: The process group spanning the pipeline stages (this rank's peers holding the
            other parts of the model), or None: the gradient norm and ``nonfinite`` cover the whole
            model there (one more scalar all-reduce each).

    Raises:
        ValueError: ``post_optim_event`` on a device without events (CPU), or without a root;
            ``loopback_collectives`` with a plan made without torch.distributed; a
            :class:`~dmuon.runtime.callbacks.RowState` rule with a bad ``row_width``.
    """

    def __init__(self, plan: Plan, callbacks: StepCallbacks, config: ExecutionConfig = ExecutionConfig(),
                 root=None, pipeline_group=None) -> None:
        self._root = _post_optim_root(root, config, plan.device)
        super().__init__(plan, callbacks, config, pipeline_group, per_block=config.ns_in_backward,
                         waves_by_unit=config.apply_updates == "next_forward")
        self.exchange = ShardExchange(plan.infos, self.topo, self.stats, plan.ns.dtype, self.device, self.row_width)
        self.norms = MatrixNorms(plan, self.stats)
        """The rule's per-matrix sums over the weight, added over the ranks that split each matrix."""
        self.replicate: ReplicateLevel | None = None
        """dmuon's replicate level (``hsdp_mesh``): every gradient reduced across replicas by dmuon."""
        if plan.replicate_level:
            self.replicate = ReplicateLevel(plan, ReplicateReduce(plan.infos, self.topo, self.stats, self.device,
                                                                   self.exchange.across))
        self.gradients = GradientParts(plan, self.topo.position, self.replicate)
        self.owner_momentum: OwnerMomentum | None = None
        """With ``clipped_overlap`` (and a :class:`~dmuon.runtime.callbacks.Rescalable` rule): the owners'
        copies of their whole momenta."""
        if config.overlap and config.clipped_overlap and isinstance(callbacks, Rescalable):
            self.owner_momentum = OwnerMomentum(plan, self.device)
        self.settler = StepSettler(plan, self.topo, callbacks, config, self.gradients, self.exchange, self.work,
                                   self.streams, self.owner_momentum, pipeline_group)
        self.next_forward: NextForwardUpdates | None = None
        """With ``apply_updates="next_forward"``: the last step's updates, applied in the next forward."""
        if config.apply_updates == "next_forward":
            project = ((lambda totals: callbacks.weight_totals(totals, applied=True))
                       if isinstance(callbacks, WeightSums) else None)
            self.next_forward = NextForwardUpdates(plan, callbacks.apply, self.row_width, root, project)
        self.backward: BackwardLaunches | None = None
        if config.overlap or self.replicate is not None:
            self.backward = BackwardLaunches(plan, self.exchange, callbacks, config, self.gradients, self.work,
                                             replicate=self.replicate,
                                             owner_momentum=self.owner_momentum)

    def _warm_pairs(self) -> dict:
        """The peers of the plan's exchanges and returns (:func:`~dmuon.comm.warm_peers.exchange_pairs`)."""
        plan = self.plan
        return exchange_pairs(plan.infos, self.topo.replicate, self.topo.shard, replicate_level=plan.replicate_level,
                              agreement_in_returns=agreement_in_returns(self.config, self.work.max_waves))

    # ---------------------------------------------------------------- the step
    def _step(self) -> StepReport:
        self.flush_updates()  # the last step's updates no forward applied (a unit that did not run)
        launches, early = self.backward.take() if self.backward is not None else ({}, {})
        if self.replicate is not None:
            self.replicate.finish()
        settled = self.settler.settle(launches, early)
        report = StepReport(skipped_nonfinite=settled.skipped)
        if settled.skipped:
            land_unused(launches)
        else:
            self._update(settled, report)
        report.rescaled_launches = sum(settled.agreement.rescaled)
        if self.owner_momentum is not None and self.owner_momentum.wanted:
            self._send_momentum_to_owners(settled.managed)
        return report

    def _update(self, settled: Settled, report: StepReport) -> None:
        """Steps 3 to 6 of a step that is not skipped: the owners' work, the returns, the applies."""
        cb, active = self.callbacks, settled.agreement.active
        # The weights as the last step left them (MuonH: a new matrix's radius), then the updated ones.
        self.norms.run(cb, active, applied=False)
        for b in settled.launches.keys() - settled.kept:
            settled.launches[b].pending.wait()  # stale: lands unused
        back = self._returned_in_backward(settled)
        report.blocks_returned_in_backward = len(back)
        # The next forward's applies add no sums over the ranks: the totals follow each return from step().
        behind = TotalsBehind(self.norms, cb if self.next_forward is not None and isinstance(cb, WeightSums)
                              else None, self.streams)
        ns_spans = [settled.early[b].spent for b in settled.done if settled.early[b].spent is not None]
        owned = {i: u for b in settled.done for i, u in settled.early[b].updates.items()}  # this rank's own
        owned_rows = {i: r for b in settled.done for i, r in settled.early[b].rows.items()}
        if settled.speculative_return is not None:
            returns = [settled.speculative_return]
            report.return_waves = [list(active)]
            report.orthogonalized_while_agreeing = len(owned)
            used = self._used_directions(settled, settled.kept)
        else:
            used = self._used_directions(settled, settled.done)
            pending = self._exchange_rest(settled, back)
            with self.streams.interval() as in_step:  # on the compute stream: the device's time there too
                ns_spans.append(in_step)
                directions = self._owner_directions(settled, pending, used)
                returns = self._return_waves(settled, directions, back, owned, owned_rows, report, behind)
        for i, d in used.items():  # NS does not modify its inputs; nothing reads the copies after this
            cb.advance_momentum(i, self.owner_momentum.of(i), d)
        if not settled.independent_done:
            cb.independent()  # while the last wave travels
        maxima = settled.agreement.maxima
        if self.next_forward is not None:
            self._publish(returns, behind)
            finish = (lambda members: cb.finish_step(members, maxima)) if isinstance(cb, StepMaxima) else None
            self.next_forward.hold(behind.followed, finish, behind.all_issued())
        else:
            self._apply(returns)
            self.norms.run(cb, active, applied=True)
        report.blocks_exchanged_in_backward = len(settled.kept)
        if self.config.ns_in_backward:
            # A rescaled launch's early NS ran on the launched directions: redone in step().
            report.orthogonalized_in_backward = sum(len(settled.early[b].updates) for b in settled.done)
        report.orthogonalized = len(owned)
        report.ns_seconds = sum(span.host_seconds for span in ns_spans)
        report.ns_spans = ns_spans
        # Part of the step: before the event, so the next forward's all-gathers wait for it too. With the
        # updates left for the next forward, each unit's matrices follow their apply there (finish above).
        if isinstance(cb, StepMaxima):
            cb.finish_step(active if self.next_forward is None else [], maxima)
        if self._root is not None:
            event = torch.Event(device=self.device)
            event.record()  # after every update of this step, on the current stream
            self._root.set_post_optim_event(event)

    @staticmethod
    def _returned_in_backward(settled: Settled) -> dict[int, Pending]:
        """The returns issued in backward (``returns_in_backward``) that stand, by block: those of the
        blocks whose early results stand; the others land unused."""
        launches = settled.launches
        back = {b: launches[b].returned for b in sorted(launches) if launches[b].returned is not None}
        for b in back.keys() - settled.done:
            back.pop(b).wait()
        return back

    def _tracking(self) -> bool:
        """The owners' momentum copies are in use this step (the same on every rank)."""
        return self.owner_momentum is not None and self.owner_momentum.ready

    def _used_directions(self, settled: Settled, blocks: set[int]) -> dict[int, torch.Tensor]:
        """With the owners' copies in use: the whole directions ``blocks``' launches brought (empty otherwise)."""
        used: dict[int, torch.Tensor] = {}
        if self._tracking():
            for b in sorted(blocks):
                used.update(settled.launches[b].pending.wait())
        return used

    def _exchange_rest(self, settled: Settled, back: dict[int, Pending]) -> list[Pending]:
        """Step 3's exchanges: the kept launches whose owner results are not in, and one exchange, issued
        now, of every active matrix no launch kept (nor returned in backward)."""
        infos = self.plan.infos
        rest = [i for i in settled.agreement.active if infos[i].block not in back and infos[i].block not in settled.kept]
        pending = [settled.launches[b].pending for b in sorted(settled.kept) if b not in settled.done]
        pending.append(self.exchange.send_directions(rest, settled.directions, settled.rows))
        return pending

    def _owner_directions(self, settled: Settled, pending: list[Pending], used: dict[int, torch.Tensor]
                          ) -> _Directions:
        """Step 3: the whole directions of the matrices whose owner work runs in ``step()``, this rank's,
        landed from ``pending`` (the rescaled ones formed here); ``used`` gains what the owners'
        momentum copies follow."""
        infos, rescaled = self.plan.infos, settled.rescaled
        full: dict[int, torch.Tensor] = {}
        full_rows: dict[int, torch.Tensor] = {}
        for p in pending:
            full.update(p.wait())
            full_rows.update(p.row_states())
        # The directions for the clipped gradients, from the launched ones and the momentum.
        for i in full:
            if infos[i].block in rescaled:
                used[i] = self.callbacks.rescale_direction(i, full[i], self.owner_momentum.of(i),
                                                           settled.agreement.scale)
                full[i] = used[i].to(full[i].dtype)
        if self._tracking():
            for i, d in full.items():
                used.setdefault(i, d)
        return _Directions(full, full_rows, used)

    def _return_waves(self, settled: Settled, directions: _Directions, back: dict[int, Pending],
                      owned: dict[int, torch.Tensor], owned_rows: dict[int, torch.Tensor],
                      report: StepReport, behind: TotalsBehind) -> list[Pending]:
        """Step 4: the owners' batches wave by wave, each wave's return issued behind its batches; the
        returns to apply, in order (those issued in backward first), each followed by ``behind``. Adds to
        ``owned``/``owned_rows``."""
        infos = self.plan.infos
        # Matrices whose updates came back in backward take no part in the step's waves.
        active = [i for i in settled.agreement.active if infos[i].block not in back]
        # Every rank's matrices whose work ran in backward (not only this rank's): the waves must agree.
        waves = self.work.return_waves(active, {i for i in active if infos[i].block in settled.done})
        report.return_waves = [members for members, _ in waves]
        returns = list(back.values())
        for b, returned in back.items():
            behind.follow(returned, settled.launches[b].members)
        return self._run_waves(waves, directions.full, directions.rows, owned, owned_rows, returns, behind)

    def _return(self, members: list[int], owned: dict[int, torch.Tensor],
                owned_rows: dict[int, torch.Tensor]) -> Pending:
        """One wave's updates back to the ranks that hold their pieces (:meth:`ShardExchange.return_updates`)."""
        return self.exchange.return_updates(members, owned, None, owned_rows if self.row_width else None)

    def _publish(self, returns: list[Pending], behind: TotalsBehind) -> None:
        """``apply_updates="next_forward"``: every hop of every return issued now, in the order
        :meth:`_apply` issues them, on dmuon's own stream (forked from the compute stream, which
        waits for none of it here: the next forward lands each return where its unit needs it);
        ``behind`` issues each return's weight totals once its last hop is out."""
        with self.streams.use(self.streams.own("dmuon")):
            for k, wave in enumerate(returns):
                while not wave.issued():
                    self._forward_returns(returns[k:])
                    behind.issue_ready()

    def flush_updates(self) -> None:
        """Applies the updates a step left for the next forward (``apply_updates="next_forward"``);
        nothing when none are pending. No collective."""
        if self.next_forward is not None and self.next_forward.pending:
            self.next_forward.flush()

    def _coalesced(self) -> ContextManager[None]:
        """On HSDP the hops one :meth:`_forward_returns` issues across replicas (one wave's first, the
        scatter route's all-gather of the wave before) go to the same peers at the same moment, so they
        travel as one all-to-all: a latency per peer saved per wave (``owner_exchange_collectives``
        lists them as one collective)."""
        return self.exchange.across.coalesced()

    def _send_momentum_to_owners(self, managed: list[int]) -> None:
        """At the end of a step that clipped while the owners kept no copies (the first clip, or the first
        after a state dict or a long run without one): every rank's part of each managed matrix's
        momentum to its owner, in float32, once; the owners' copies start from it."""
        exchange = ShardExchange(self.plan.infos, self.topo, self.stats, torch.float32, self.device)
        parts = self.callbacks.momentum_parts(managed)
        pending = exchange.send_directions(managed, {i: p.float() for i, p in parts.items()})
        pending.issue_all()
        self.owner_momentum.replace(pending.wait())

    # ---------------------------------------------------------------- clipping
    @torch.no_grad()
    def clip_grad_norm_(self, params: list[torch.Tensor], max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_``'s result on every rank, each gradient element counted
        once (:func:`dmuon.runtime.clipping.clip_grad_norm_`); with the replicate level the
        gradients are reduced across replicas first (:meth:`ReplicateLevel.finish`)."""
        if self.replicate is not None:
            self.replicate.finish()
        if self.backward is not None:
            # A pipeline schedule's divisor, where the gradients still hold what its division left:
            # after the scaling below step() could not tell it (runtime/schedule_divisor.py).
            self.backward.learn_divisor()
        return clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite, replicate=self.replicate,
                               group=self.topo.mesh_group if self.topo.world_size > 1 else None,
                               across=self.pipeline_group, device=self.device)

    def close(self) -> None:
        """Removes the backward hooks and stops the NS worker (also done when the runtime is freed)."""
        if self.backward is not None:
            self.backward.close()
        if self.next_forward is not None:
            self.next_forward.close()


def agreement_in_returns(config: ExecutionConfig, waves: int) -> bool:
    """Whether a step's agreement may travel with the update return (:meth:`StepSettler._speculate`:
    launches from backward, one return wave, nothing checked first), its flags then going to every
    member of every exchange group."""
    return config.overlap and waves == 1 and config.apply_updates == "in_step" and config.nonfinite is None


def _post_optim_root(root, config: ExecutionConfig, device: torch.device):
    """The root whose post-optimizer event the step sets (``post_optim_event``), else None."""
    if not config.post_optim_event:
        return None
    if device.type == "cpu":
        raise ValueError("post_optim_event=True needs a device with events (CUDA); the CPU backend has none")
    if not hasattr(root, "set_post_optim_event"):
        raise ValueError("post_optim_event=True needs the fully_shard-ed root module (FSDPModule)")
    return root
