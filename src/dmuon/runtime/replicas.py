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
the wire dtype, through every rank once, wave by wave: one all-gather when the owners' shares of the wave
are even (``(N-1)`` times the largest share), else the scatter route, an all-to-all that evens them out and
an all-gather of the even chunks (about ``(N-1)/N`` of the share and of the wave through the busiest rank),
whichever moves less through the busiest rank, two collectives at most whatever ``N``. With bf16 updates that
is about a quarter of the Muon matrices' all-reduce bytes (:func:`dmuon.plan.replicas.replica_hops`,
:func:`dmuon.costmodel.traffic.replica_collectives`). Every gradient element crosses the wire in fp32 once
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

import dataclasses
import itertools
import time

import torch
import torch.distributed as dist

from dmuon.comm.device_streams import streams_for
from dmuon.comm.stats import CommStats
from dmuon.plan.replicas import owner_shares, replica_hops, scatter_parts
from dmuon.plan.batches import default_return_waves
from dmuon.plan.plan import Plan
from dmuon.runtime.agreement import agreement_flags
from dmuon.runtime.callbacks import CheckedGradients, StepCallbacks, StepMaxima, WeightSums, row_width
from dmuon.runtime.clipping import clip_grad_norm_
from dmuon.runtime.config import ExecutionConfig
from dmuon.runtime.gradients import GradientParts
from dmuon.runtime.report import StepReport
from dmuon.runtime.settle import nonfinite_on_other_stages, with_other_stages
from dmuon.runtime.setup_log import log_setup
from dmuon.runtime.tuning import TunedOwnerWork, wait_for_tuning
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
        # loopback_collectives: one rank's agreement and updates go through its one-member group too.
        self.topo = dataclasses.replace(plan.topology, loopback=True) if config.loopback_collectives else plan.topology
        self.device = plan.device
        self.streams = streams_for(self.device)
        self.stats = CommStats()
        self.row_width = row_width(callbacks)
        waves = config.return_waves if config.return_waves is not None else default_return_waves(self.device.type)
        self.work = TunedOwnerWork(plan, per_block=False, max_waves=waves)
        tune_start = time.perf_counter()
        tuned = self.work.tune(callbacks.owner_work, callbacks.matrices(), self.row_width)  # never inside a step
        tune_seconds = time.perf_counter() - tune_start
        # Every rank of the mesh, before its next collective: the host's ranks tune one by one.
        log_setup(plan, tuned, tune_seconds, spread=wait_for_tuning(self.topo.global_ranks))
        # DDP's group, before the first backward: every pair, as the scatter route's peers follow each
        # wave's shares (:func:`~dmuon.plan.replicas.scatter_parts`), not the plan alone.
        self.topo.warm_up(self.device)
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
        if self.topo.world_size > 1 or self.topo.loopback:
            flags = flags.to(self.device)
            self.streams.issue(lambda: dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.topo.mesh_group,
                                                       async_op=True), reads=(flags,), writes=(flags,)).wait()
        agreed = flags.cpu().tolist()
        if nonfinite is None:
            return decide(agreed)
        # Across the stages before this group decides (its own NaN may raise): every stage takes the all-reduce.
        elsewhere = nonfinite_on_other_stages(agreed, 3 * len(infos) + len(checked), len(infos),
                                              self.pipeline_group, self.device)
        return with_other_stages(decide(agreed), elsewhere, nonfinite)

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
        publications: list[tuple[list[int], dict[int, torch.Tensor], _Publication]] = []
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
                for _, _, earlier in publications:
                    earlier.advance()  # the earlier waves' next hops, behind this wave's work
                publications.append((members, new_rows, _Publication(self, members, updates)))
        cb.independent()  # while the waves travel
        for members, new_rows, publication in publications:
            updates = self._unpack(members, publication.land())
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


class _Publication:
    """One wave's updates on their way to every rank (:func:`~dmuon.plan.replicas.replica_hops`' route,
    decided from the plan alike on every rank), hop by hop: issued from the compute stream, the first hop at
    once, the next by :meth:`advance` (after the next wave's work, so that the transfer overlaps it).

    The updates lie end to end in the group's rank order (each owner's, its members in plan order); on the
    all-gather route each owner's share padded to the largest, on the scatter route cut in even chunks, each
    rank's chunk gathered by an all-to-all first."""

    def __init__(self, runtime: "ReplicaRuntime", members: list[int], updates: dict[int, torch.Tensor]) -> None:
        plan, n, me = runtime.plan, runtime.plan.world_size, runtime.plan.rank
        self.runtime, self.slot = runtime, runtime._slot
        shares = owner_shares([info.numel for info in plan.infos], [info.owner for info in plan.infos], n, members)
        self.shares = [0] * n  # by slot: the group's rank order
        for r in range(n):
            self.shares[self.slot[r]] = shares[r]
        self.mine = torch.empty(shares[me], dtype=plan.ns.dtype, device=runtime.device)
        offset = 0
        for i in members:
            if plan.infos[i].owner == me:
                numel = plan.infos[i].numel
                self.mine[offset : offset + numel].copy_(updates[i].reshape(-1))
                offset += numel
        self.flights: list = []
        self.gathered: torch.Tensor | None = None
        local = n == 1 and not runtime.topo.loopback  # with loopback, one rank's all-gather with itself
        self.route, self.hops = ("local", []) if local else replica_hops(self.shares, self.mine.element_size())
        if self.route == "all_gather":
            self.chunk = max(self.shares)
            send = torch.zeros(self.chunk, dtype=self.mine.dtype, device=runtime.device)
            send[: self.mine.numel()].copy_(self.mine)
            self._all_gather(send)
        elif self.route == "scatter":
            parts, self.chunk = scatter_parts(self.shares)
            mine = self.slot[me]
            self.received = torch.empty(sum(parts[a][mine] for a in range(n)), dtype=self.mine.dtype,
                                        device=runtime.device)
            mine_in, mine_out = parts[mine], [parts[a][mine] for a in range(n)]
            group, received, send = runtime.topo.mesh_group, self.received, self.mine
            self._issue(lambda: dist.all_to_all_single(received, send, mine_out, mine_in, group=group, async_op=True),
                        (send,), (received,), 0)

    @property
    def issued(self) -> bool:
        """Every hop is issued (what is left is landing it)."""
        return self.gathered is not None or self.route == "local"

    def _issue(self, collective, reads, writes, hop: int) -> None:
        runtime = self.runtime
        self.flights.append(runtime.streams.issue(collective, reads, writes))
        runtime.stats.add("intra", *self.hops[hop][self.slot[runtime.plan.rank]])

    def _all_gather(self, send: torch.Tensor) -> None:
        runtime = self.runtime
        self.gathered = torch.empty(runtime.plan.world_size * self.chunk, dtype=send.dtype, device=runtime.device)
        all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        group, gathered = runtime.topo.mesh_group, self.gathered
        self._issue(lambda: all_gather(gathered, send, group=group, async_op=True), (send,), (gathered,),
                    len(self.hops) - 1)

    @ranged("exchange")
    def advance(self) -> None:
        """Issues the next hop, if any: on the scatter route the even chunks' all-gather, once the compute
        stream has waited for the all-to-all that brought this rank's chunk."""
        if self.issued:
            return
        self.flights[-1].wait()
        send = torch.zeros(self.chunk, dtype=self.mine.dtype, device=self.runtime.device)
        send[: self.received.numel()].copy_(self.received)
        self._all_gather(send)

    def land(self) -> dict[int, torch.Tensor]:
        """Every hop issued and landed on the compute stream; each owner's updates by plan rank (views of the
        landed buffer: a view is a read, taken only now)."""
        self.advance()
        for flight in self.flights:
            flight.wait()
        n = self.runtime.plan.world_size
        if self.route == "local":
            return {self.runtime.plan.rank: self.mine}
        if self.route == "all_gather":
            start = [self.slot[r] * self.chunk for r in range(n)]
        else:
            ends = list(itertools.accumulate(self.shares))
            start = [ends[self.slot[r]] - self.shares[self.slot[r]] for r in range(n)]
        by_slot = {r: self.shares[self.slot[r]] for r in range(n)}
        return {r: self.gathered[start[r] : start[r] + by_slot[r]] for r in range(n)}
