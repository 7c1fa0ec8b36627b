"""The step under torch's ``DistributedDataParallel``: every rank holds the whole model.

DDP keeps what it does: it all-reduces every gradient in backward (its buckets, on its own stream;
``no_sync``, ``find_unused_parameters``, ``static_graph``, comm hooks as the user set them), so that
after backward every rank holds every parameter's mean gradient, whole. What is left to split is the
optimizer: each Muon matrix has one owner among DDP's ranks (the plan's balancer), which alone keeps its
momentum (and the rule's other state), forms its direction from the gradient it already holds and runs
its NS. The updates are all-gathered in the wire dtype (``NSConfig.dtype``), wave by wave behind the
owners' batches, and every rank applies every update, so the weights stay equal on every rank. No
direction moves.

Bytes per rank and step, besides DDP's all-reduce (``2 (N-1)/N`` of the fp32 gradients): the updates in
the wire dtype, through every rank once, wave by wave: one all-gather when the owners' shares of the wave
are even (``(N-1)`` times the largest share), else the scatter route, an all-to-all that evens them out and
an all-gather of the even chunks (about ``(N-1)/N`` of the share and of the wave through the busiest rank),
whichever moves less through the busiest rank, two collectives at most whatever ``N``. With bf16 updates that
is about a quarter of the Muon matrices' all-reduce bytes (:func:`dmuon.plan.ddp.ddp_hops`,
:func:`dmuon.costmodel.traffic.ddp_collectives`). Every gradient element crosses the wire in fp32 once
more than on the route where dmuon reduces the gradients itself (README "DDP").

One step, on every rank alike (the same collectives in the same order, decided by the plan and the
agreed flags):

1. agree, in one small all-reduce, which matrices have a gradient (DDP gives every rank a gradient or
   none), whether one is non-finite (``nonfinite=``), and the rule's step maxima (QK-clip);
2. on each owner: ``commit`` (the momentum advances there only), then the owner's work batch by batch,
   each wave's publication (an all-gather, or the scatter's all-to-all) issued as soon as its batches are
   done, its second hop (the scatter's all-gather) behind the next wave's batches;
3. ``independent`` (AdamW) while the waves travel;
4. each wave landed, every rank ``apply``-s every update of it (with a row state, the owner alone
   stores the new rows: nobody else keeps them);
5. the rule's sums over the weight (MuonH) are this rank's own: every rank holds each matrix whole.

Streams: everything runs on the thread calling ``step()``, on its current stream (the compute stream).
DDP's reducer has already made that stream wait for its all-reduces when backward returns (its
finalization copies the reduced buckets into the gradients there). A wave's send buffer is written on
the compute stream before its collectives are issued from it (:meth:`~dmuon.comm.streams.Streams.issue`:
the communicator's stream waits for it), the compute stream waits for each of them before unpacking the
wave (:meth:`~dmuon.comm.streams.Flight.wait`), and each flight holds its buffers until then. Whether a
rank enters a collective depends only on the plan and the agreement.
"""

from __future__ import annotations

import torch

from dmuon.comm import Pending
from dmuon.comm.ddp_returns import DdpReturns
from dmuon.plan.plan import Plan
from dmuon.runtime.base import Runtime
from dmuon.runtime.callbacks import StepCallbacks, StepMaxima, WeightSums
from dmuon.runtime.clipping import clip_grad_norm_
from dmuon.runtime.config import ExecutionConfig
from dmuon.runtime.gradients import GradientParts
from dmuon.runtime.report import StepReport
from dmuon.runtime.settle import agree_before_commit, read_gradients

_NOT_UNDER_DDP = {
    "ns_in_backward": "DDP's gradients exist only once its backward ends",
    "returns_in_backward": "DDP's gradients exist only once its backward ends",
    "post_optim_event": "it orders FSDP2's next all-gathers; DDP has none",
}


def check_ddp_execution(config: ExecutionConfig) -> None:
    """Raises ``ValueError`` naming an ``ExecutionConfig`` setting a DDP model cannot take.

    ``overlap`` and ``clipped_overlap`` are accepted and change nothing there: nothing is launched in
    backward, so nothing can go stale or need rescaling."""
    for name, why in _NOT_UNDER_DDP.items():
        if getattr(config, name):
            raise ValueError(f"ExecutionConfig({name}=True) does not apply to a DistributedDataParallel model ({why}); "
                             f"leave {name} at its default")
    if config.apply_updates != "in_step":
        raise ValueError("ExecutionConfig(apply_updates=\"next_forward\") does not apply to a DistributedDataParallel "
                         "model (DDP has no per-unit all-gather in forward to apply them before); leave it \"in_step\"")


class DdpRuntime(Runtime):
    """Owns dmuon's collectives and the step's schedule for a DDP plan (``Plan.ddp``): the DDP
    schedule of :class:`~dmuon.runtime.base.Runtime`.

    Args:
        plan: The plan :func:`dmuon.prepare` made for a ``DistributedDataParallel`` model.
        callbacks: The optimizer's rule (:class:`~dmuon.runtime.callbacks.StepCallbacks`); called as
            the module docstring says: ``peek`` never, ``commit`` and ``owner_work`` on the owners.
        config: When things run; settings that need FSDP2 raise (:func:`check_ddp_execution`);
            ``loopback_collectives`` issues the agreement and the updates' route on a one-rank group too.
        pipeline_group: The group spanning the pipeline stages (DDP per stage), or None: the gradient
            norm and ``nonfinite`` then cover the whole model.
    """

    owner_momentum = None
    """No owner copies: the owners keep the momentum itself."""

    def __init__(self, plan: Plan, callbacks: StepCallbacks, config: ExecutionConfig = ExecutionConfig(),
                 pipeline_group=None) -> None:
        if not plan.ddp:
            raise ValueError("DdpRuntime steps a plan made for a DistributedDataParallel model (Plan.ddp)")
        check_ddp_execution(config)
        # DDP's group is warmed on every pair: the scatter route's peers follow each wave's shares
        # (:func:`~dmuon.plan.ddp.scatter_parts`), not the plan alone.
        super().__init__(plan, callbacks, config, pipeline_group)
        self.gradients = GradientParts(plan, self.topo.position, None)
        self.returns = DdpReturns(plan.infos, self.topo, self.stats, plan.ns.dtype, self.device)
        """Each wave's updates from their owners to every rank."""

    # ---------------------------------------------------------------- the step
    def _step(self) -> StepReport:
        """Step 1: the flags' maximum over every rank (one all-reduce), decided alike everywhere; then the rest."""
        seen = read_gradients(self.plan, self.callbacks, self.gradients)
        agreement = agree_before_commit(self.plan, self.topo, self.streams, self.callbacks, self.config.nonfinite,
                                        seen, self.pipeline_group)
        report = StepReport(skipped_nonfinite=agreement.skipped)
        if not agreement.skipped:
            self._update(agreement, report)
        return report

    def _update(self, agreement, report: StepReport) -> None:
        """Steps 2 to 5 of a step that is not skipped."""
        cb, plan = self.callbacks, self.plan
        active = agreement.active
        mine = [i for i in active if plan.infos[i].owner == plan.rank]
        directions = cb.commit(mine, self.gradients.parts(mine))
        full = {i: d.view(plan.infos[i].matrix_shape) for i, d in directions.items()}
        rows = cb.row_states(mine) if self.row_width else {}
        self._weight_totals(active, applied=False)
        waves = self.work.return_waves(active, set())
        report.return_waves = [list(members) for members, _ in waves]
        with self.streams.interval() as span:  # on the compute stream: the device's time there too
            returns = self._run_waves(waves, full, rows, {}, {}, [])
        cb.independent()  # while the waves travel
        self._apply(returns)  # with a row state, the owner's rows: the only holder of the row state
        self._weight_totals(active, applied=True)
        if isinstance(cb, StepMaxima):
            cb.finish_step(active, agreement.maxima)
        report.orthogonalized = len(mine)
        report.ns_seconds = span.host_seconds
        report.ns_spans = [span]

    def _return(self, members: list[int], owned: dict[int, torch.Tensor],
                owned_rows: dict[int, torch.Tensor]) -> Pending:
        """One wave's updates to every rank (:meth:`DdpReturns.return_updates`)."""
        return self.returns.return_updates(members, owned, owned_rows)

    def _weight_totals(self, active: list[int], applied: bool) -> None:
        """A :class:`WeightSums` rule's sums: every rank holds each matrix whole, so its own sums are the
        totals (the same on every rank: the weights are)."""
        cb = self.callbacks
        if isinstance(cb, WeightSums):
            sums = cb.weight_sums(active, applied)
            if sums:
                cb.weight_totals({i: s.to(torch.float32).to(self.device) for i, s in sums.items()}, applied)

    # ---------------------------------------------------------------- the rest
    @torch.no_grad()
    def clip_grad_norm_(self, params: list[torch.Tensor], max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_``'s result: every rank holds every mean gradient whole, so the
        norm is this rank's own (no collective; across pipeline stages, one scalar all-reduce)."""
        return clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite, group=None,
                               across=self.pipeline_group, device=self.device)
