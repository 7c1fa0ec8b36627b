"""The simulated step as a Chrome trace: what it shows is the simulation's run, lane by lane."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest

from dmuon.costmodel.collective import AlphaBeta
from dmuon.costmodel.sim_config import Hardware, SimOptions, StepInputs
from dmuon.costmodel.simulate import RETURNS_IN_BACKWARD, build_step, simulate
from dmuon.costmodel.trace import LANE_NAMES, chrome_trace

HW = Hardware("test", compute_flops=1e12, ns_flops=1e12, elementwise_bytes=1e11,
              links=AlphaBeta(intra_bandwidth=1.0, inter_bandwidth=1.0, intra_latency=1.0, inter_latency=2.0))
OPTIONS = SimOptions(tokens_per_gpu=1000)


def _inputs(replicate: int, shard: int) -> StepInputs:
    shapes = [(6, 5), (5, 7), (8, 4), (3, 9), (6, 5)]
    world = replicate * shard
    owners = [(3 * i + 1) % world for i in range(len(shapes))]
    batches: dict[int, list[list[int]]] = {}
    for i, o in enumerate(owners):
        batches.setdefault(o, []).append([i])
    return StepInputs(shapes=shapes, owners=owners, blocks=[1, 1, 2, 2, 0], replicate=replicate, shard=shard,
                      ns_batches=batches, other_shapes=[(16, 5), (4, 4)], other_blocks=[0, 1], zero=3)


def _by_process(trace: dict) -> dict[str, list[dict]]:
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    out = defaultdict(list)
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            out[names[e["pid"]]].append(e)
    return out


@pytest.mark.parametrize("replicate, shard", [(1, 4), (2, 2)])
def test_the_trace_is_the_simulated_run(replicate, shard):
    """Every rank shown: the last slice ends where simulate() says the step ends, the NS slices add up to
    its NS seconds, the lanes are named, no two slices of a lane overlap (Perfetto needs that), and a
    collective's bytes are the listed collective's; the trace is JSON."""
    inputs = _inputs(replicate, shard)
    strategies = ("dmuon", "fsdp_adamw", RETURNS_IN_BACKWARD)
    trace = json.loads(json.dumps(chrome_trace(inputs, HW, OPTIONS, strategies=strategies,
                                               ranks=range(inputs.world))))
    lanes = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert lanes <= set(LANE_NAMES.values()) and "compute" in lanes
    processes = _by_process(trace)
    labels = {"dmuon": "dmuon", "fsdp_adamw": "FSDP2 + AdamW", RETURNS_IN_BACKWARD: "dmuon, returns in backward"}
    for strategy in strategies:
        figures = simulate(strategy, inputs, HW, OPTIONS)
        events = [e for k in range(inputs.world) for e in processes[f"{labels[strategy]} rank {k}"]]
        assert max(e["ts"] + e["dur"] for e in events) == pytest.approx(figures["step_seconds"] * 1e6)
        ns = [sum(e["args"]["work_us"] for e in processes[f"{labels[strategy]} rank {k}"]
                  if e["cat"].endswith(",ns")) for k in range(inputs.world)]
        assert max(ns) == pytest.approx(figures["ns_seconds"] * 1e6)
        if strategy == "dmuon":
            assert max(ns) > 0 and any(e["cat"].endswith("collective") and e["tid"] > 1 for e in events)
    slices = defaultdict(list)
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            slices[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"]))
    for spans in slices.values():
        spans.sort()
        assert all(b[0] >= a[1] - 1e-6 for a, b in zip(spans, spans[1:]))
    # Bytes: each collective slice carries its rank's part of the listed collective.
    timeline, _ = build_step("dmuon", inputs, HW, OPTIONS)
    timeline.run()
    listed = {(t.name, k): t.collective.ranks[k] for t in timeline.tasks if t.collective is not None
              for k in t.end}
    for k in range(inputs.world):
        for e in processes[f"dmuon rank {k}"]:
            if e["cat"].endswith("collective"):
                assert (e["args"]["bytes_sent"], e["args"]["bytes_received"]) == tuple(listed[(e["name"], k)])


def test_default_ranks_and_bad_ones():
    inputs = _inputs(2, 2)
    trace = chrome_trace(inputs, HW, OPTIONS)
    assert trace["otherData"]["ranks_shown"] == [0, 1]  # the first node
    assert set(trace["otherData"]["last_task_end_ms"]) == {"dmuon", "fsdp_adamw"}
    with pytest.raises(ValueError, match=r"trace ranks must be in \[0, 4\)"):
        chrome_trace(inputs, HW, OPTIONS, ranks=[4])
