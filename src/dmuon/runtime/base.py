"""The runtime interface: what both schedules share, the FSDP2 one and torch's DDP one.

A runtime owns dmuon's collectives and the step's schedule for one plan; the optimizer supplies the rule
as callbacks (:class:`~dmuon.runtime.callbacks.StepCallbacks`, whose written contract each schedule keeps)
and calls :meth:`Runtime.step`. Two schedules:

* :class:`~dmuon.runtime.runtime.ShardRuntime` (FSDP2, HSDP, TP): every rank holds a part of each matrix;
  directions go to their owners and the updates back, launched from backward where they can be;
* :class:`~dmuon.runtime.ddp.DdpRuntime` (torch's ``DistributedDataParallel``): every rank holds
  every matrix whole; the owners' updates go to every rank.

Shared here: the setup (the topology, loopback included; the streams; the owners' NS tuned at build
and the setup log; the groups warmed), the step's frame and report, the owners' batches wave by wave
with each wave's return issued behind them (:meth:`Runtime._run_waves`), and the applies
(:meth:`Runtime._apply`). The step's prelude (which matrices have a gradient) and its agreement are
:mod:`dmuon.runtime.settle`'s. Every collective is issued from :mod:`dmuon.comm`, each in flight as a
:class:`~dmuon.comm.pending.Pending` (``forward`` issues its next hop, ``wait`` lands it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import ContextManager

import torch

from dmuon.comm import CommStats, Pending
from dmuon.comm.device_streams import streams_for
from dmuon.comm.topology import Topology
from dmuon.plan.batches import default_return_waves
from dmuon.plan.plan import Plan
from dmuon.runtime.callbacks import StepCallbacks, row_width
from dmuon.runtime.config import ExecutionConfig
from dmuon.runtime.matrix_norms import TotalsBehind
from dmuon.runtime.report import StepReport
from dmuon.runtime.setup_log import log_setup
from dmuon.runtime.tuning import TunedOwnerWork, wait_for_tuning
from dmuon.util.observe import ranged

Waves = list[tuple[list[int], list[list[int]]]]
"""The owners' work wave by wave: each wave's members and this rank's batches of them
(:meth:`~dmuon.runtime.owner_work.OwnerWork.return_waves`)."""


class Runtime:
    """What the FSDP2 and the DDP schedules share (module docstring); a schedule supplies :meth:`_step`,
    :meth:`_return`, and what it warms (:meth:`_warm_pairs`).

    Args:
        plan: The ownership plan (from :func:`dmuon.prepare`); its ``ns.dtype`` is the wire dtype of
            directions and updates.
        callbacks: The optimizer's rule.
        config: When things run (:class:`~dmuon.runtime.config.ExecutionConfig`).
        pipeline_group: The process group spanning the pipeline stages, or None: the gradient norm and
            ``nonfinite`` then cover the whole model.
        per_block: The owners' batches per launched block (``ns_in_backward``).
        waves_by_unit: One return wave per FSDP2 unit (``apply_updates="next_forward"``).

    Raises:
        ValueError: ``loopback_collectives`` with a plan made without torch.distributed; a
            :class:`~dmuon.runtime.callbacks.RowState` rule with a bad ``row_width``.
    """

    def __init__(self, plan: Plan, callbacks: StepCallbacks, config: ExecutionConfig, pipeline_group=None, *,
                 per_block: bool = False, waves_by_unit: bool = False) -> None:
        self.plan = plan
        self.callbacks = callbacks
        self.config = config
        self.pipeline_group = pipeline_group
        self.topo = _topology(plan, config)
        self.device = plan.device
        self.streams = streams_for(self.device)
        """Where every stream, event and wait of this runtime goes (:mod:`dmuon.comm.streams`)."""
        self.stats = CommStats()
        self.row_width = row_width(callbacks)
        waves = config.return_waves if config.return_waves is not None else default_return_waves(self.device.type)
        self.work = TunedOwnerWork(plan, per_block=per_block, max_waves=waves, waves_by_unit=waves_by_unit)
        tune_start = time.perf_counter()
        tuned = self.work.tune(callbacks.owner_work, callbacks.matrices(), self.row_width)  # never inside a step
        tune_seconds = time.perf_counter() - tune_start
        # Every rank of the mesh, before its next collective: the host's ranks tune one by one.
        log_setup(plan, tuned, tune_seconds, spread=wait_for_tuning(self.topo.global_ranks))
        # dmuon's communicators and the peer connections its collectives use, before the first backward;
        # made here, not in prepare(): the peers follow the plan's owners and this config.
        self.topo.warm_up(self.device, self._warm_pairs())

    def _warm_pairs(self) -> dict | None:
        """The peers of each exchange group the schedule sends to (:meth:`Topology.warm_up`); None: every pair."""
        return None

    # ---------------------------------------------------------------- the step
    @torch.no_grad()
    @ranged("step")
    def step(self) -> StepReport:
        """Runs one step on every rank (a collective call); what it did on this rank."""
        start = time.perf_counter()
        report = self._step()
        report.traffic = CommStats(**self.stats.as_dict())
        report.step_seconds = time.perf_counter() - start
        self.stats.reset()
        return report

    def _step(self) -> StepReport:
        """The schedule's step; the frame (:meth:`step`) adds the traffic and the time."""
        raise NotImplementedError

    def _return(self, members: list[int], owned: dict[int, torch.Tensor],
                owned_rows: dict[int, torch.Tensor]) -> Pending:
        """Issues one wave's return: ``members``' updates (``owned``: this rank's, with their new rows)."""
        raise NotImplementedError

    def _coalesced(self) -> ContextManager[None]:
        """Where the hops one :meth:`_forward_returns` issues may travel together; none by default."""
        return contextlib.nullcontext()

    def _run_waves(self, waves: Waves, full: dict[int, torch.Tensor], full_rows: dict[int, torch.Tensor],
                   owned: dict[int, torch.Tensor], owned_rows: dict[int, torch.Tensor], returns: list[Pending],
                   behind: TotalsBehind | None = None) -> list[Pending]:
        """The owners' batches wave by wave (the whole directions ``full`` and row states ``full_rows``
        taken as they run), each wave's return issued behind its batches, the earlier waves' next hops
        behind the next wave's work; ``returns`` (those already in flight first) gains each, in order,
        each followed by ``behind``. Adds the results to ``owned``/``owned_rows``."""
        for members, batches in waves:
            for batch in batches:
                updates, new_rows = self.work.run_batch(
                    self.callbacks.owner_work, batch, [full.pop(i) for i in batch],
                    [full_rows.pop(i) for i in batch] if self.row_width else None)
                owned.update(updates)
                owned_rows.update(new_rows)
            self._forward_returns(returns)  # the earlier waves' next hops, behind this wave's work
            if behind is not None:
                behind.issue_ready()
            returns.append(self._return(members, {i: owned[i] for i in members if i in owned},
                                        {i: owned_rows[i] for i in members if i in owned_rows}))
            if behind is not None:
                behind.follow(returns[-1], list(members))
        return returns

    def _forward_returns(self, returns: list[Pending]) -> None:
        """Advances every return in flight by one hop (:meth:`Pending.forward`)."""
        with self._coalesced():
            for pending in returns:
                pending.forward()

    @ranged("apply")
    def _apply(self, returns: list[Pending]) -> None:
        """Hands each return's updates (and rows) to the rule's ``apply``, in order, forwarding the later
        ones' hops."""
        for k, wave in enumerate(returns):
            while not wave.issued():
                self._forward_returns(returns[k:])
            if self.row_width:
                self.callbacks.apply(wave.wait(), wave.row_states())
            else:
                self.callbacks.apply(wave.wait())

    # ---------------------------------------------------------------- the rest
    def flush_updates(self) -> None:
        """Applies the updates a step left for the next forward; nothing when none are pending. No collective."""

    def close(self) -> None:
        """Removes what the runtime installed (hooks, a worker); also done when the runtime is freed."""


def _topology(plan: Plan, config: ExecutionConfig) -> Topology:
    """The plan's topology, marked loopback with ``loopback_collectives`` (read by the exchanges' hops
    and the agreement: :attr:`Topology.loopback`; the plan's stays as it is)."""
    if not config.loopback_collectives:
        return plan.topology
    if plan.topology.mesh_group is None:
        raise ValueError("loopback_collectives=True needs dmuon's process groups: prepare() the "
                         "plan with torch.distributed initialized (one rank is enough)")
    return dataclasses.replace(plan.topology, loopback=True)
