"""The step simulation under dmuon's execution options (returns in backward, the root gathered again, updates in
the next forward) and torch's DDP, against timelines known by hand and the alpha-beta sums."""

from __future__ import annotations

import itertools

import pytest

from dmuon.costmodel.collective import AlphaBeta, step_figures
from dmuon.costmodel.collectives import step_collectives
from dmuon.costmodel.schedule import StepBuilder
from dmuon.costmodel.sim_config import Hardware, SimOptions, StepInputs
from dmuon.costmodel.simulate import (
    NEXT_FORWARD,
    RETURNS_IN_BACKWARD,
    build_step,
    simulate,
    step_builder,
)

from ._helpers import HW, LINKS, small_step_inputs


@pytest.mark.parametrize("replicate,shard", [(1, 4), (2, 2), (4, 2)])
def test_returns_in_backward_move_the_returns_behind_backward(replicate, shard):
    """With backward long enough to hide them, the blocks returned in backward leave the optimizer phase
    only the other blocks' NS and returns and the applies: a shorter phase than dmuon's, and their NS
    runs in backward (on the worker's stream, sharing the engine)."""
    # Eight layers of two matrices and a root: the replicate level's hops A and B take two landings
    # before a block can return, so the first blocks do.
    shapes = [(6 + k % 3, 5 + k % 4) for k in range(16)] + [(6, 5)]
    blocks = [1 + k // 2 for k in range(16)] + [0]
    world = replicate * shard
    owners = [(3 * i + 1) % world for i in range(len(shapes))]
    batches: dict[int, list[list[int]]] = {}
    for i, o in enumerate(owners):
        batches.setdefault(o, []).append([i])
    inputs = StepInputs(shapes=shapes, owners=owners, blocks=blocks, replicate=replicate, shard=shard,
                        ns_batches=batches, other_shapes=[(16, 5)], other_blocks=[0], return_waves=4,
                        hop_a_spread=1)
    options = SimOptions(tokens_per_gpu=20000)
    plain, back = (simulate(s, inputs, HW, options) for s in ("dmuon", RETURNS_IN_BACKWARD))
    assert back["optimizer_seconds"] < plain["optimizer_seconds"]
    builder = step_builder(RETURNS_IN_BACKWARD, inputs, HW, options)
    assert builder.back and builder.back < set(inputs.blocks)  # some blocks, not all
    timeline = builder.build()
    in_backward = [t for t in timeline.tasks if t.kind == "ns" and t.phase == "backward"]
    assert {int(t.name.split()[-1]) for t in in_backward} == builder.back
    returns = [t.collective for t in timeline.tasks if t.collective is not None and t.collective.role == "return_shard"]
    assert {c.block for c in returns if c.phase == "backward"} == builder.back


@pytest.mark.parametrize("replicate,shard", [(1, 4), (2, 2)])
def test_the_root_gathered_again_at_the_start_of_backward(replicate, shard):
    """``root_regathered`` (an explicit ``reshard_after_forward=True`` on the root): one more all-gather,
    the root's forward one again, listed first in backward; in the timeline the head's backward waits
    for it; serialised without compute it adds exactly its alpha-beta seconds."""
    from dataclasses import replace

    for zero in (2, 3):
        kept = small_step_inputs(replicate, shard, zero=zero)
        again = replace(kept, root_regathered=True)
        for strategy in ("fsdp_adamw", "gather", "dmuon"):
            def listed(inputs):
                return step_collectives(strategy, inputs.shapes, inputs.owners, inputs.blocks, replicate, shard,
                                        zero=zero, other_shapes=inputs.other_shapes,
                                        other_blocks=inputs.other_blocks, root_regathered=inputs.root_regathered)
            before, after = listed(kept), listed(again)
            assert len(after) == len(before) + 1
            forward_root = [c for c in after if c.op == "all_gather" and c.phase == "forward" and c.block == 0]
            backward_root = [c for c in after if c.op == "all_gather" and c.phase == "backward" and c.block == 0]
            assert len(forward_root) == len(backward_root) == 1 and not [
                c for c in before if c.op == "all_gather" and c.phase == "backward" and c.block == 0]
            assert backward_root[0].ranks == forward_root[0].ranks
            first_backward = next(c for c in after if c.phase == "backward")
            assert first_backward is backward_root[0]
            serial = SimOptions(overlap=False, compute=False)
            added = simulate(strategy, again, HW, serial)["step_seconds"] - \
                simulate(strategy, kept, HW, serial)["step_seconds"]
            assert added == pytest.approx(LINKS.seconds(backward_root[0]))
            timeline, _ = build_step(strategy, again, HW, SimOptions(tokens_per_gpu=1000))
            timeline.run()
            tasks = {t.name: t for t in timeline.tasks}
            gathered = tasks[backward_root[0].label]
            assert gathered.phase == "backward"
            assert all(tasks["backward head"].start[k] >= gathered.end[k] - 1e-12 for k in gathered.end)


def test_updates_applied_in_the_next_forward_by_hand():
    """NEXT_FORWARD (``apply_updates="next_forward"``): on one rank nothing overlaps, so the period is dmuon's step; with
    free links too; with a slow link across replicas the publication goes behind the next forward: every
    unit's update is applied once its wave has landed, before that unit is gathered, in the pre-forward of
    the unit before it; the period is shorter than dmuon's step by nearly its publication."""
    options = SimOptions(tokens_per_gpu=1000)
    one = small_step_inputs(1, 1)
    assert simulate(NEXT_FORWARD, one, HW, options)["step_seconds"] == pytest.approx(
        simulate("dmuon", one, HW, options)["step_seconds"])
    free = Hardware("free", 1e12, 1e12, 1e11, AlphaBeta(intra_bandwidth=1e30, inter_bandwidth=1e30,
                                                        intra_latency=0.0, inter_latency=0.0))
    assert simulate(NEXT_FORWARD, small_step_inputs(2, 2), free, options)["step_seconds"] == pytest.approx(
        simulate("dmuon", small_step_inputs(2, 2), free, options)["step_seconds"])
    # Eight layers of two matrices and a root, 2 x 2 ranks; across replicas 1 byte per second (the
    # publication takes minutes), a forward of minutes per unit; the next forward needs block 1 first.
    shapes = [(6 + k % 3, 5 + k % 4) for k in range(16)] + [(6, 5)]
    blocks = [1 + k // 2 for k in range(16)] + [0]
    owners = [(3 * i + 1) % 4 for i in range(len(shapes))]
    inputs = StepInputs(shapes=shapes, owners=owners, blocks=blocks, replicate=2, shard=2,
                        ns_batches={o: [[i] for i in range(len(shapes)) if owners[i] == o] for o in range(4)},
                        other_shapes=[(16, 5)], other_blocks=[0], return_waves=4)
    slow = Hardware("slow", 1e12, 1e12, 1e11, AlphaBeta(intra_bandwidth=1e30, inter_bandwidth=1.0,
                                                        intra_latency=0.0, inter_latency=0.0))
    long = SimOptions(tokens_per_gpu=10**12)
    plain, nfwd = (simulate(s, inputs, slow, long) for s in ("dmuon", NEXT_FORWARD))
    # dmuon's optimizer phase is mostly the publication (9 waves here); the next forward needs the root's
    # and block 1's updates before any compute, the others land behind the forward of the units before.
    publication = plain["optimizer_busy_seconds"]["inter"]
    assert publication > 0.8 * plain["optimizer_seconds"]
    assert nfwd["step_seconds"] < plain["step_seconds"] - 0.3 * publication
    assert nfwd["exposed_comm_seconds"] < plain["exposed_comm_seconds"] - 0.3 * publication
    builder = step_builder(NEXT_FORWARD, inputs, slow, long)
    # One wave per unit with Muon matrices, the root's first (the order the next forward needs them); each
    # rank publishes the same bytes as in dmuon's waves (in more, smaller collectives).
    assert builder.waves == [[16]] + [[2 * k, 2 * k + 1] for k in range(8)]

    def published(b: StepBuilder) -> list[tuple[int, int]]:
        across = [c.ranks for c in b.collectives.values() if c.level == "inter" and c.phase == "step"]
        return [tuple(map(sum, zip(*(r[k] or (0, 0) for r in across)))) for k in range(4)]

    assert published(builder) == published(step_builder("dmuon", inputs, slow, long))
    timeline = builder.build()
    timeline.run()
    tasks = {(t.phase, t.name): t for t in timeline.tasks}
    gathers = {t.collective.block: t for t in timeline.tasks
               if t.phase == "next_forward" and t.collective is not None}
    computes = {0: tasks[("next_forward", "embedding")]}
    computes.update({b: tasks[("next_forward", f"forward block {b}")] for b in range(1, 9)})
    for b, k in itertools.product(range(9), range(4)):  # each rank's own timeline
        apply = tasks[("next_forward", f"apply block {b}")]
        assert apply.start[k] >= max(dep.end[k] for dep in builder.landed[b] if k in dep.end)
        assert gathers[b].start[k] >= apply.end[k] and computes[b].start[k] >= gathers[b].end[k]
        if b:  # in the pre-forward of the unit before it: before that unit's compute
            assert apply.end[k] <= computes[b - 1].start[k]
    # The period: from this forward's end to the next's.
    first_end = max(builder.forward_ends[0].end.values())
    assert nfwd["step_seconds"] == pytest.approx(max(builder.forward_ends[1].end.values()) - first_end)


@pytest.mark.parametrize("replicate", [1, 2, 4])
@pytest.mark.parametrize("return_waves", [1, 4])
def test_torchs_ddp_with_dmuon_serialised_is_the_alpha_beta_sum_of_its_collectives(replicate, return_waves):
    """dmuon under torch's DDP (one rank per replica): serialised and without compute, its step is the alpha-beta
    sum of step_collectives' list for it (FSDP2's all-reduce per unit: DDP's buckets) and the agreement; the
    updates' collectives carry per rank what ddp_collectives counts (the runtime's bytes)."""
    from dmuon.costmodel.collectives import DDP_STRATEGY
    from dmuon.costmodel.traffic import ddp_collectives

    inputs = small_step_inputs(replicate, 1, return_waves)
    options = SimOptions(overlap=False, compute=False)
    timeline, _ = build_step(DDP_STRATEGY, inputs, HW, options)
    used = [t.collective for t in timeline.tasks if t.collective is not None]
    figures = simulate(DDP_STRATEGY, inputs, HW, options)
    assert figures["step_seconds"] == pytest.approx(step_figures(used, LINKS)["seconds"]["total"])
    waves = step_builder(DDP_STRATEGY, inputs, HW, options).waves
    listed = step_collectives(DDP_STRATEGY, inputs.shapes, inputs.owners, inputs.blocks, replicate, 1,
                              waves=waves, other_shapes=inputs.other_shapes, other_blocks=inputs.other_blocks)
    assert sorted(c.label for c in used if c.role != "agreement") == sorted(c.label for c in listed)
    assert len([c for c in used if c.role == "agreement"]) == (replicate > 1)
    assert not [c for c in listed if c.role in ("fsdp_all_gather", "fsdp_reduce_scatter") and max(map(max, c.ranks))]
    published = [c for c in listed if c.role == "ddp_publish"]
    for rank in range(replicate):
        assert [tuple(c.ranks[rank]) for c in published] == ddp_collectives(
            inputs.shapes, inputs.owners, replicate, waves, 2, rank)
    with pytest.raises(ValueError, match="shard must be 1"):
        step_collectives(DDP_STRATEGY, inputs.shapes, inputs.owners, inputs.blocks, 1, 2)
    with pytest.raises(ValueError, match="shard must be 1"):
        build_step(DDP_STRATEGY, small_step_inputs(1, 2), HW, options)
