"""The simulated step as a Chrome trace (the Trace Event Format Perfetto and chrome://tracing open).

Each strategy's step (:func:`~dmuon.costmodel.simulate.build_step`, run on a
:class:`~dmuon.costmodel.timeline.Timeline`) becomes one process per rank shown, named
``"<strategy> rank k"``, and each of the rank's streams one thread (a lane): ``compute``
(forward, backward, the elementwise work: AdamW, the applies), ``NS`` (the owners' Newton-Schulz on
the compute stream; ``ns_worker``: backward's NS worker), FSDP2's collectives (``fsdp_all_gather``,
``fsdp_reduce_scatter``, ``fsdp_all_reduce``) and dmuon's (``dmuon_shard``, ``dmuon_replicate``,
``dmuon_world``). A collective's slice runs from when the rank reached it to when its bytes had
moved (waiting for the other ranks included); ``args`` give its bytes, level and when it started
moving. Zero-length markers (a wait) are left out. Times are the simulation's, in microseconds
from the step's start.
"""

from __future__ import annotations

from typing import Sequence

from dmuon.costmodel.sim_config import Hardware, SimOptions, StepInputs
from dmuon.costmodel.simulate import build_step
from dmuon.costmodel.timeline import Task

LANES = ("compute", "NS", "ns_worker", "fsdp_all_gather", "fsdp_reduce_scatter", "fsdp_all_reduce", "dmuon_shard",
         "dmuon_replicate", "dmuon_world", "gather", "peer", "serial")
"""The lanes of a rank, top to bottom (a stream not listed goes below them)."""

LANE_NAMES = {"compute": "compute", "NS": "NS (owners)", "ns_worker": "NS (owners, backward's worker)",
              "fsdp_all_gather": "FSDP2 all-gather",
              "fsdp_reduce_scatter": "FSDP2 reduce-scatter", "fsdp_all_reduce": "FSDP2 all-reduce",
              "dmuon_shard": "dmuon collectives, shard level", "dmuon_replicate": "dmuon collectives, replicate level",
              "dmuon_world": "dmuon collectives, world", "gather": "gather-then-compute collectives",
              "peer": "all-to-all peer collectives", "serial": "serialised (--serial)"}

STRATEGY_NAMES = {"dmuon": "dmuon", "fsdp_adamw": "FSDP2 + AdamW", "gather": "gather-then-compute",
                  "dmuon_native_hsdp": "dmuon (native HSDP)", "dmuon_rbwd": "dmuon, returns in backward",
                  "dmuon_nfwd": "dmuon, applied in next forward", "dion_all_to_all": "all-to-all peer"}


def lane(task: Task) -> str:
    """The lane a task is drawn in: NS on the compute stream in its own (one stream: they never overlap
    there), everything else on its stream's (backward's NS worker included)."""
    return "NS" if task.kind == "ns" and task.stream in ("compute", "serial") else task.stream


def step_events(strategy: str, tasks: Sequence[Task], ranks: Sequence[int], pid_base: int) -> list[dict]:
    """The trace events of one run step's ``tasks`` on ``ranks``: metadata naming each process and lane,
    then one complete ("X") event per task and rank it ran on for a positive time."""
    events: list[dict] = []
    label = STRATEGY_NAMES.get(strategy, strategy)
    lanes = sorted({lane(t) for t in tasks}, key=lambda s: (LANES.index(s) if s in LANES else len(LANES), s))
    for order, k in enumerate(ranks):
        pid = pid_base + k
        events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": f"{label} rank {k}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": pid_base + order}})
        for tid, name in enumerate(lanes):
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                           "args": {"name": LANE_NAMES.get(name, name)}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid,
                           "args": {"sort_index": tid}})
    tid_of = {name: tid for tid, name in enumerate(lanes)}
    for task in tasks:
        for k in ranks:
            if k not in task.end or task.end[k] <= task.start[k]:
                continue
            args: dict = {"phase": task.phase, "kind": task.kind}
            if task.collective is not None:
                sent, received = task.collective.ranks[k]
                args.update(level=task.collective.level, bytes_sent=sent, bytes_received=received)
                if task.moving is not None:
                    args["moving_from_us"] = task.moving * 1e6
            elif task.seconds is not None:
                args["work_us"] = task.seconds[k] * 1e6
            events.append({"ph": "X", "name": task.name, "cat": f"{task.phase},{task.kind}", "pid": pid_base + k,
                           "tid": tid_of[lane(task)], "ts": task.start[k] * 1e6,
                           "dur": (task.end[k] - task.start[k]) * 1e6, "args": args})
    return events


def chrome_trace(inputs: StepInputs, hardware: Hardware, options: SimOptions | None = None,
                 strategies: Sequence[str] = ("dmuon", "fsdp_adamw"), ranks: Sequence[int] | None = None) -> dict:
    """Each strategy's simulated step as one Chrome trace, the strategies one above the other.

    Args:
        inputs, hardware, options: What :func:`~dmuon.costmodel.simulate.simulate` takes.
        strategies: The steps to draw (default: dmuon, and FSDP2 + AdamW beside it).
        ranks: The ranks to draw (default: the first node's, at most 8; the simulation runs every rank).

    Returns:
        ``{"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}``, JSON-ready.

    Raises:
        ValueError: For a rank outside the world, or an unknown strategy.
    """
    world = inputs.world
    ranks = list(range(min(world, inputs.shard, 8))) if ranks is None else list(ranks)
    bad = [k for k in ranks if not 0 <= k < world]
    if bad or not ranks:
        raise ValueError(f"trace ranks must be in [0, {world}), got {list(ranks)}")
    events: list[dict] = []
    steps = {}
    pid_stride = 10 ** len(str(world))
    for n, strategy in enumerate(strategies):
        timeline, _ = build_step(strategy, inputs, hardware, options)
        timeline.run()
        steps[strategy] = max(max(t.end.values(), default=0.0) for t in timeline.tasks) * 1e3
        events += step_events(strategy, timeline.tasks, ranks, (n + 1) * pid_stride)
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"source": "dmuon plan --simulate (modelled, not measured)", "hardware": hardware.name,
                          "world": world, "mesh": [inputs.replicate, inputs.shard], "ranks_shown": ranks,
                          "last_task_end_ms": steps}}
