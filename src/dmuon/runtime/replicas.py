"""The step on replicas of the whole model: torch's ``DistributedDataParallel``.

DDP keeps what it does: it all-reduces every gradient in backward (its buckets, on its own stream;
``no_sync``, ``find_unused_parameters``, ``static_graph``, comm hooks as the user set them), so that
after backward every rank holds every parameter's mean gradient, whole. What is left to split is the
optimizer: each Muon matrix has one owner among DDP's ranks (the plan's balancer), which alone keeps its
momentum (and the rule's other state), forms its direction from the gradient it already holds and runs
its NS. The updates are all-gathered in the wire dtype (``NSConfig.dtype``), wave by wave behind the
owners' batches, and every rank applies every update, so the weights stay equal on every rank. No
direction moves.

Bytes per rank and step, besides DDP's all-reduce (``2 (N-1)/N`` of the fp32 gradients): the updates in
the wire dtype, once through every rank, wave by wave: one all-gather when the owners' shares of the wave
are even (``(N-1)`` times the largest share), one broadcast per owner when padding to the largest would
cost more (every share once; more ranks than matrices). With bf16 updates that is about a quarter of the
Muon matrices' all-reduce bytes (:func:`dmuon.costmodel.traffic.replica_route`,
:func:`~dmuon.costmodel.traffic.replica_collectives`). Every
gradient element crosses the wire in fp32 once more than on the route where dmuon reduces the gradients
itself (README "DDP").

One step, on every rank alike (the same collectives in the same order, decided by the plan and the
agreed flags):

1. agree, in one small all-reduce, which matrices have a gradient (DDP gives every rank a gradient or
   none), whether one is non-finite (``nonfinite=``), and the rule's step maxima (QK-clip);
2. on each owner: ``commit`` (the momentum advances there only), then the owner's work batch by batch,
   each wave's publication (an all-gather, or a broadcast per owner) issued as soon as its batches are done;
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

import time

import torch
import torch.distributed as dist

from dmuon.comm.device_streams import streams_for
from dmuon.comm.stats import CommStats
from dmuon.costmodel.traffic import chain_bytes, replica_route
from dmuon.plan.batches import default_return_waves
from dmuon.plan.plan import Plan
from dmuon.runtime.agreement import agreement_flags
from dmuon.runtime.callbacks import CheckedGradients, StepCallbacks, StepMaxima, WeightSums, row_width
from dmuon.runtime.clipping import clip_grad_norm_
from dmuon.runtime.config import ExecutionConfig
from dmuon.runtime.gradients import GradientParts
from dmuon.runtime.report import StepReport
from dmuon.runtime.setup_log import log_setup
from dmuon.runtime.tuning import TunedOwnerWork
from dmuon.util.observe import ranged

_NOT_UNDER_DDP = {
    "ns_in_backward": "DDP's gradients exist only once its backward ends",
    "returns_in_backward": "DDP's gradients exist only once its backward ends",
    "post_optim_event": "it orders FSDP2's next all-gathers; DDP has none",
}


def check_replica_execution(config: ExecutionConfig) -> None:
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


def owner_shares(plan: Plan, members: list[int]) -> list[int]:
    """Each plan rank's elements among ``members`` (the updates it owns in the wave)."""
    share = [0] * plan.world_size
    for i in members:
        share[plan.infos[i].owner] += plan.infos[i].numel
    return share


class ReplicaRuntime:
    """Owns dmuon's collectives and the step's schedule for a replicas plan (``Plan.replicas``).

    Args:
        plan: The plan :func:`dmuon.prepare` made for a ``DistributedDataParallel`` model.
        callbacks: The optimizer's rule (:class:`~dmuon.runtime.callbacks.StepCallbacks`); called as
            the module docstring says: ``peek`` never, ``commit`` and ``owner_work`` on the owners.
        config: When things run; settings that need FSDP2 raise (:func:`check_replica_execution`).
        pipeline_group: The group spanning the pipeline stages (DDP per stage), or None: the gradient
            norm and ``nonfinite`` then cover the whole model.
    """

    owner_momentum = None
    """No owner copies: the owners keep the momentum itself."""

    def __init__(self, plan: Plan, callbacks: StepCallbacks, config: ExecutionConfig = ExecutionConfig(),
                 pipeline_group=None) -> None:
        if not plan.replicas:
            raise ValueError("ReplicaRuntime steps a plan made for a DistributedDataParallel model (Plan.replicas)")
        check_replica_execution(config)
        self.plan = plan
        self.callbacks = callbacks
        self.config = config
        self.pipeline_group = pipeline_group
        self.topo = plan.topology
        self.device = plan.device
        self.streams = streams_for(self.device)
        self.stats = CommStats()
        self.row_width = row_width(callbacks)
        waves = config.return_waves if config.return_waves is not None else default_return_waves(self.device.type)
        self.work = TunedOwnerWork(plan, per_block=False, max_waves=waves)
        tune_start = time.perf_counter()
        tuned = self.work.tune(callbacks.owner_work, callbacks.matrices(), self.row_width)  # never inside a step
        log_setup(plan, tuned, time.perf_counter() - tune_start)
        self.gradients = GradientParts(plan, self.topo.coords, None)
        # The all-gather orders its outputs by the group's ranks (the global ranks, ascending); plan
        # ranks follow DDP's group: each plan rank's slot in the gathered buffer.
        ranks = list(self.topo.global_ranks) or [0]
        self._slot = [sorted(ranks).index(g) for g in ranks]

    # ---------------------------------------------------------------- the step
    @torch.no_grad()
    @ranged("step")
    def step(self) -> StepReport:
        """Runs one step on every rank of DDP's group (a collective call); what it did on this rank."""
        start = time.perf_counter()
        agreement = self._agree()
        report = StepReport(skipped_nonfinite=agreement.skipped)
        if not agreement.skipped:
            self._update(agreement, report)
        report.traffic = CommStats(**self.stats.as_dict())
        report.step_seconds = time.perf_counter() - start
        self.stats.reset()
        return report

    def _agree(self):
        """Step 1: the flags' maximum over every rank (one all-reduce), decided alike everywhere."""
        cb, infos = self.callbacks, self.plan.infos
        managed = cb.matrices()
        here = [i for i in managed if infos[i].param.grad is not None]
        for i in here:
            self.gradients.check(i)
        nonfinite = self.config.nonfinite
        checked = cb.checked_gradients() if nonfinite is not None and isinstance(cb, CheckedGradients) else []
        maxima = cb.step_maxima() if isinstance(cb, StepMaxima) else None
        flags, decide = agreement_flags(infos, self.topo.coords[1], managed, here, nonfinite, checked, None, maxima)
        if self.topo.world_size > 1:
            flags = flags.to(self.device)
            self.streams.issue(lambda: dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.topo.mesh_group,
                                                       async_op=True), reads=(flags,), writes=(flags,)).wait()
        agreed = flags.cpu().tolist()
        agreement = decide(agreed)
        if nonfinite is not None and self.pipeline_group is not None:
            n = len(infos)
            mine = any(agreed[2 * n : 2 * n + n + len(checked)])
            seen = torch.tensor([int(mine)], dtype=torch.int32, device=self.device)
            dist.all_reduce(seen, op=dist.ReduceOp.MAX, group=self.pipeline_group)
            if bool(seen.item()) and not agreement.skipped:
                if nonfinite == "raise":
                    raise FloatingPointError("non-finite gradients on another pipeline stage")
                agreement = agreement._replace(skipped=True)
        return agreement

    def _update(self, agreement, report: StepReport) -> None:
        """Steps 2 to 5 of a step that is not skipped."""
        cb, plan = self.callbacks, self.plan
        active = agreement.active
        mine = [i for i in active if plan.infos[i].owner == plan.rank]
        directions = cb.commit(mine, self.gradients.parts(mine))
        rows = cb.row_states(mine) if self.row_width else None
        self._weight_totals(active, applied=False)
        waves = self.work.return_waves(active, set())
        report.return_waves = [list(members) for members, _ in waves]
        flights = []
        with self.streams.interval() as span:  # on the compute stream: the device's time there too
            for members, batches in waves:
                updates: dict[int, torch.Tensor] = {}
                new_rows: dict[int, torch.Tensor] = {}
                for batch in batches:
                    done, done_rows = self.work.run_batch(
                        cb.owner_work, batch, [directions.pop(i).view(plan.infos[i].matrix_shape) for i in batch],
                        [rows.pop(i) for i in batch] if self.row_width else None)
                    updates.update(done)
                    new_rows.update(done_rows)
                flights.append((members, new_rows, *self._publish(members, updates)))
        cb.independent()  # while the waves travel
        for members, new_rows, landing, segments in flights:
            for flight in landing:
                flight.wait()
            updates = self._unpack(members, segments())
            if self.row_width:
                cb.apply(updates, new_rows)  # the owner's rows: the only holder of the row state
            else:
                cb.apply(updates)
        self._weight_totals(active, applied=True)
        if isinstance(cb, StepMaxima):
            cb.finish_step(active, agreement.maxima)
        report.orthogonalized = len(mine)
        report.ns_seconds = span.host_seconds
        report.ns_spans = [span]

    @ranged("exchange")
    def _publish(self, members: list[int], updates: dict[int, torch.Tensor]):
        """Issues one wave's collectives carrying every owner's updates to every rank, by
        :func:`~dmuon.costmodel.traffic.replica_route` (decided from the plan, alike on every rank): one
        all-gather of the shares padded to the largest, or one broadcast per owner with a share.

        Returns ``(flights, segments)``: once the flights have landed, ``segments()[r]`` holds owner ``r``'s
        updates of the wave, in plan order."""
        plan, n, me = self.plan, self.plan.world_size, self.plan.rank
        shares = owner_shares(plan, members)
        mine = torch.empty(shares[me], dtype=plan.ns.dtype, device=self.device)
        offset = 0
        for i in members:
            if plan.infos[i].owner == me:
                numel = plan.infos[i].numel
                mine[offset : offset + numel].copy_(updates[i].reshape(-1))
                offset += numel
        if n == 1:
            return [], lambda: {me: mine}
        group, elem = self.topo.mesh_group, mine.element_size()
        if replica_route(shares) == "all_gather":
            chunk = max(shares)
            send = torch.zeros(chunk, dtype=mine.dtype, device=self.device)
            send[: shares[me]].copy_(mine)
            gathered = torch.empty(n * chunk, dtype=mine.dtype, device=self.device)
            all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            flight = self.streams.issue(lambda: all_gather(gathered, send, group=group, async_op=True),
                                        reads=(send,), writes=(gathered,))
            self.stats.add("intra", (n - 1) * chunk * elem, (n - 1) * chunk * elem)
            start = [self._slot[r] * chunk for r in range(n)]
            # Cut once landed: a view is a read of the buffer the collective writes.
            return [flight], lambda: {r: gathered[start[r] : start[r] + shares[r]] for r in range(n)}
        flights, segments = [], {}
        for r in range(n):  # owner order, the same on every rank
            if not shares[r]:
                continue
            segment = mine if r == me else torch.empty(shares[r], dtype=mine.dtype, device=self.device)
            source = self.topo.global_ranks[r]
            flights.append(self.streams.issue(
                lambda segment=segment, source=source: dist.broadcast(segment, src=source, group=group,
                                                                       async_op=True),
                reads=(segment,), writes=(segment,)))
            self.stats.add("intra", *chain_bytes(shares[r] * elem, r, me, n))
            segments[r] = segment
        return flights, lambda: segments

    def _unpack(self, members: list[int], segments: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """Each member's whole update from the landed wave: its owner's segment, the owner's members in plan order."""
        offsets = dict.fromkeys(segments, 0)
        out = {}
        for i in members:
            info = self.plan.infos[i]
            start = offsets[info.owner]
            out[i] = segments[info.owner][start : start + info.numel].view(info.matrix_shape)
            offsets[info.owner] += info.numel
        return out

    def _weight_totals(self, active: list[int], applied: bool) -> None:
        """A :class:`WeightSums` rule's sums: every rank holds each matrix whole, so its own sums are the
        totals (the same on every rank: the weights are)."""
        cb = self.callbacks
        if isinstance(cb, WeightSums):
            sums = cb.weight_sums(active, applied)
            if sums:
                cb.weight_totals({i: s.to(torch.float32).to(self.device) for i, s in sums.items()}, applied)

    # ---------------------------------------------------------------- the rest
    def flush_updates(self) -> None:
        """Nothing is left for the next forward under DDP (every update is applied in ``step()``)."""

    @torch.no_grad()
    def clip_grad_norm_(self, params: list[torch.Tensor], max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_``'s result: every rank holds every mean gradient whole, so the
        norm is this rank's own (no collective; across pipeline stages, one scalar all-reduce)."""
        return clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite, group=None,
                               across=self.pipeline_group, device=self.device)

    def close(self) -> None:
        """Nothing to remove: no hook, no worker."""

