"""One training step's timeline at cluster scale: a discrete-event simulation on every rank.

:func:`step_comm` (``collectives.py``) sums alpha-beta seconds with no overlap, so it
cannot say whether an exchange hides behind backward. This module runs the same
collective lists (:func:`~dmuon.costmodel.collectives.step_collectives`) as a timeline:

* **Work** (:class:`Timeline`): per rank, compute tasks (forward and backward per
  block, counted as 2 and 4 x parameters x tokens FLOPs; the owners' NS; elementwise
  passes such as AdamW) and collectives, each on a *stream*: a per-rank FIFO queue,
  as a CUDA stream or an NCCL communicator runs its work in issue order. A task starts
  when it heads its stream and its dependencies are done; compute tasks of several
  streams running at once share the rank's compute engine equally (a GPU interleaves
  their kernels).
* **Collectives** start once every taking-part rank has reached them, spend
  ``messages x latency``, then move each rank's bytes over that rank's link of the
  level (intra, inter), one link per direction, whose bandwidth is shared equally
  between the transfers on it at that moment (two at once get half each); a rank's part
  ends when its bytes have moved.
* **Schedules** (:mod:`dmuon.costmodel.schedule` and :mod:`dmuon.costmodel.schedule_dmuon`,
  :func:`build_step`): each strategy's step task
  by task as the host issues it: FSDP2's forward and backward with its prefetch, dmuon's
  exchanges as the runtime issues them, the step's agreement, NS and return waves,
  gather-then-compute's and the all-to-all peer's steps.
* **Figures** (:func:`simulate`, here): the step, its phases, what is exposed and what
  keeps the ranks busy, read from the run timeline.

Ranks given the same work in every task have the same timeline (the simulation is
deterministic), so one of each such class is simulated (FSDP2 + AdamW's 256 ranks are one).
With ``overlap=False`` every task waits for the one before it on every rank: with no
compute the step is then :func:`~dmuon.costmodel.collectives.step_figures`' alpha-beta
total. The event loop (tasks, streams, shared links and engines) is
:mod:`dmuon.costmodel.timeline`, the host's work per code path :mod:`dmuon.costmodel.host`.
Only ``dmuon plan`` (:mod:`dmuon.bench.plan_cli`) and the bench's calibration use this module.
"""

from __future__ import annotations

from typing import Sequence

from dmuon.costmodel.peer import PEER_STRATEGY
from dmuon.costmodel.schedule import StepBuilder
from dmuon.costmodel.schedule_dmuon import NEXT_FORWARD, RETURNS_IN_BACKWARD, DMuonStepBuilder
from dmuon.costmodel.schedule_ddp import DdpStepBuilder
from dmuon.costmodel.sim_config import Hardware, SimOptions, StepInputs
from dmuon.costmodel.timeline import Task, Timeline

__all__ = ["NEXT_FORWARD", "RETURNS_IN_BACKWARD", "SIM_STRATEGIES", "build_step", "goal_ratios", "simulate",
           "simulate_strategies", "step_builder"]

SIM_STRATEGIES: tuple[str, ...] = ("fsdp_adamw", "gather", "dmuon", "dmuon_native_hsdp", RETURNS_IN_BACKWARD,
                                   NEXT_FORWARD, PEER_STRATEGY)
"""What :func:`simulate_strategies` runs by default, FSDP2 + AdamW first (the reference)."""


def step_builder(strategy: str, inputs: StepInputs, hardware: Hardware, options: SimOptions | None = None
                 ) -> StepBuilder:
    """The builder of ``strategy``'s step: dmuon's (:mod:`dmuon.costmodel.schedule_dmuon`) for dmuon and its
    variants, :mod:`dmuon.costmodel.schedule_ddp`'s for dmuon under torch's DDP,
    :class:`~dmuon.costmodel.schedule.StepBuilder` for the others."""
    builders = (DMuonStepBuilder, DdpStepBuilder, StepBuilder)
    known = tuple(s for b in builders for s in b.STRATEGIES)
    if strategy not in known:
        raise ValueError(f"strategy must be one of {known}, got {strategy!r}")
    builder = next(b for b in builders if strategy in b.STRATEGIES)
    return builder(strategy, inputs, hardware, options or SimOptions())


def build_step(strategy: str, inputs: StepInputs, hardware: Hardware, options: SimOptions | None = None
               ) -> tuple[Timeline, Task]:
    """The timeline of one step under ``strategy`` (not yet run) and its end-of-backward marker."""
    builder = step_builder(strategy, inputs, hardware, options)
    timeline = builder.build()
    return timeline, builder.backward_end


def simulate(strategy: str, inputs: StepInputs, hardware: Hardware, options: SimOptions | None = None) -> dict:
    """Runs one step under ``strategy``; its figures, JSON-ready.

    Returns:
        ``step_seconds`` (first all-gather to the last rank's last update: when the next
        forward may start), ``forward_backward_seconds`` (until the last rank's backward
        has ended, FSDP2's reductions and dmuon's final callback included),
        ``optimizer_seconds`` (the rest: after backward until the next forward may start),
        ``exposed_comm_seconds`` (the step less the busiest rank's compute: the time that
        rank waits on transfers, or on other ranks through them), the same split
        into ``exposed_forward_backward_seconds`` and ``exposed_optimizer_seconds``,
        ``compute_seconds`` (forward and backward compute: the FLOPs and
        :attr:`SimOptions.non_gemm_seconds`), ``ns_seconds`` and
        ``elementwise_seconds`` (the most any rank spends), ``optimizer_busy_seconds``
        (during the optimizer phase: the most any rank spends on NS and on elementwise work,
        and the longest any rank's intra- and inter-node link carries bytes: what bounds
        the phase), ``collectives`` and ``bounding_rank`` (the rank with the most compute).
    """
    builder = step_builder(strategy, inputs, hardware, options)
    timeline, backward_end = builder.build(), builder.backward_end
    timeline.run()
    world = inputs.world
    busy = {phase: [0.0] * world for phase in ("forward", "backward", "step", "next_forward")}
    by_kind = {kind: [0.0] * world for kind in ("compute", "ns", "elementwise")}
    # The work of one step: with next_forward the next forward's stands in for this one's.
    counted = ("backward", "step", "next_forward") if builder.next_forward else ("forward", "backward", "step")
    step = 0.0
    for task in timeline.tasks:
        for k, t in task.end.items():
            step = max(step, t)
            if task.seconds is not None and task.seconds[k]:
                busy[task.phase][k] += task.seconds[k]
                if task.phase in counted:
                    by_kind[task.kind][k] += task.seconds[k]
    in_backward = max(busy["forward"][k] + busy["backward"][k] for k in range(world))
    if builder.next_forward:
        # The steady-state period, from this forward's end to the next's: backward starts when a forward
        # ends, whatever delayed that forward, so the period repeats. In the period's sums the next
        # forward's work (its applies included) stands in for this one's.
        step -= max(builder.forward_ends[0].end.values())
        busy["forward"] = busy["next_forward"]
    del busy["next_forward"]
    total = [sum(busy[p][k] for p in busy) for k in range(world)]
    bound = max(range(world), key=lambda k: total[k])
    backward = max(backward_end.end.values())
    return {
        "step_seconds": step,
        "forward_backward_seconds": backward,
        "optimizer_seconds": step - backward,
        "exposed_comm_seconds": step - total[bound],
        "exposed_forward_backward_seconds": backward - in_backward,
        "exposed_optimizer_seconds": (step - backward) - max(busy["step"]),
        "compute_seconds": max(by_kind["compute"]),
        "ns_seconds": max(by_kind["ns"]),
        "elementwise_seconds": max(by_kind["elementwise"]),
        "optimizer_busy_seconds": _busy_after(timeline, backward, world),
        "collectives": sum(1 for t in timeline.tasks if t.collective is not None and t.ranks),
        "bounding_rank": bound,
    }


def _busy_after(timeline: Timeline, start: float, world: int) -> dict:
    """What kept the ranks busy from ``start`` (the end of backward) on: the most any rank spent on NS
    and on elementwise work, and the longest any rank's intra- and inter-node link carried bytes
    (either direction; overlapping transfers counted once). The step's own work: the next forward's
    (``next_forward``) is left out, its links' transfers and applies included."""
    work = {"ns": [0.0] * world, "elementwise": [0.0] * world}
    spans: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for task in timeline.tasks:
        if task.phase == "next_forward":
            continue
        if task.collective is not None:
            for k in task.ranks:
                if task.moving is not None and max(task.collective.ranks[k]) > 0 and task.end[k] > start:
                    spans.setdefault((k, task.collective.level), []).append((max(task.moving, start), task.end[k]))
        elif task.kind in work:
            for k in task.ranks:
                if task.seconds[k] and task.end[k] > start:
                    # Its share after ``start`` (all of it unless it began in backward).
                    whole = task.end[k] - task.start[k]
                    work[task.kind][k] += task.seconds[k] * min(1.0, (task.end[k] - start) / whole) if whole else 0.0
    links = {"intra": 0.0, "inter": 0.0}
    for (k, level), intervals in spans.items():
        covered, reach = 0.0, start
        for a, b in sorted(intervals):
            if b > reach:
                covered += b - max(a, reach)
                reach = b
        links[level] = max(links[level], covered)
    return {"ns": max(work["ns"]), "elementwise": max(work["elementwise"]), **links}


def simulate_strategies(inputs: StepInputs, hardware: Hardware, options: SimOptions | None = None,
                        strategies: Sequence[str] = SIM_STRATEGIES) -> dict:
    """:func:`simulate` for each strategy, ``{strategy: figures}``."""
    return {s: simulate(s, inputs, hardware, options) for s in strategies}


def goal_ratios(figures: dict) -> dict:
    """Per strategy of ``{strategy: simulate(...)}``: its step over FSDP2 + AdamW's
    (``step_vs_fsdp_adamw``), gather-then-compute's optimizer phase over its own
    (``gather_optimizer_over_this``) and gather-then-compute's step over its own
    (``gather_step_over_this``): the ratios the paper's claims are made of."""
    base = figures["fsdp_adamw"]["step_seconds"] if "fsdp_adamw" in figures else None
    gather = figures.get("gather")

    def over(key: str, value: float) -> float | None:
        return gather[key] / value if gather and value else None

    return {k: {"step_vs_fsdp_adamw": v["step_seconds"] / base if base else None,
                "gather_optimizer_over_this": over("optimizer_seconds", v["optimizer_seconds"]),
                "gather_step_over_this": over("step_seconds", v["step_seconds"])}
            for k, v in figures.items()}
