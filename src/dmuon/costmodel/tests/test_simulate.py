"""The step simulation against timelines known by hand, and against the alpha-beta sums."""

from __future__ import annotations

import pytest

from dmuon.costmodel.collective import AlphaBeta, Collective, step_figures
from dmuon.costmodel.collectives import step_collectives
from dmuon.costmodel.peer import PEER_STRATEGY, all_to_all_batches, async_runtime_order
from dmuon.costmodel.sim_config import Hardware, SimOptions, StepInputs
from dmuon.costmodel.simulate import (
    NEXT_FORWARD,
    RETURNS_IN_BACKWARD,
    SIM_STRATEGIES,
    Timeline,
    build_step,
    simulate,
    step_builder,
)
from dmuon.plan.cost import gram_ns_flops, ns_flops

from ._helpers import HW, LINKS, small_step_inputs, transfer


def _ends(task) -> dict[int, float]:
    return dict(sorted(task.end.items()))


def test_pure_compute_runs_in_stream_order_and_ranks_in_parallel():
    tl = Timeline(2, LINKS)
    a = tl.compute("a", "compute", [1.0, 2.0], phase="forward")
    b = tl.compute("b", "compute", 3.0, phase="forward")
    c = tl.compute("c", "compute", [None, 1.0], phase="forward")  # only on rank 1
    tl.run()
    assert _ends(a) == {0: 1.0, 1: 2.0}
    assert _ends(b) == {0: 4.0, 1: 5.0}
    assert _ends(c) == {1: 6.0}


def test_compute_of_two_streams_shares_the_engine():
    # Two 1-second tasks on different streams of one rank run at once at half speed each.
    tl = Timeline(1, LINKS)
    a = tl.compute("a", "one", 1.0, phase="step")
    b = tl.compute("b", "two", 1.0, phase="step")
    tl.run()
    assert a.end[0] == pytest.approx(2.0) and b.end[0] == pytest.approx(2.0)
    # Unequal: the short one ends at 2 x 1, the long one runs alone afterwards (2 + 2).
    tl = Timeline(1, LINKS)
    a = tl.compute("a", "one", 1.0, phase="step")
    b = tl.compute("b", "two", 3.0, phase="step")
    tl.run()
    assert a.end[0] == pytest.approx(2.0) and b.end[0] == pytest.approx(4.0)


def test_pure_transfer_is_latency_plus_bytes_over_bandwidth():
    tl = Timeline(2, LINKS)
    t = tl.collective(transfer(2, [(6, 4), (4, 6)], messages=3), "s", phase="step")
    tl.run()
    # 3 latencies of 1 s, then each rank's larger direction, 6 bytes at 1 byte/s.
    assert _ends(t) == {0: pytest.approx(9.0), 1: pytest.approx(9.0)}
    # Across nodes: 2 s latency per message.
    tl = Timeline(2, LINKS)
    t = tl.collective(transfer(2, [(5, 0), (0, 5)], messages=1, level="inter"), "s", phase="step")
    tl.run()
    assert _ends(t) == {0: pytest.approx(7.0), 1: pytest.approx(7.0)}


def test_a_transfer_hides_behind_compute_unless_it_waits_for_it():
    tl = Timeline(2, LINKS)
    work = tl.compute("backward", "compute", 10.0, phase="backward")
    moved = tl.collective(transfer(2, [(4, 4), (4, 4)]), "comm", phase="backward")  # 1 + 4 s, from t=0
    after = tl.compute("next", "compute", 1.0, [moved], phase="step")
    tl.run()
    assert moved.end[0] == pytest.approx(5.0) and work.end[0] == pytest.approx(10.0)
    assert after.end[0] == pytest.approx(11.0)  # hidden: nothing waited
    tl = Timeline(2, LINKS)
    work = tl.compute("backward", "compute", 10.0, phase="backward")
    moved = tl.collective(transfer(2, [(4, 4), (4, 4)]), "comm", [work], phase="backward")
    after = tl.compute("next", "compute", 1.0, [moved], phase="step")
    tl.run()
    assert after.end[0] == pytest.approx(10.0 + 5.0 + 1.0)  # exposed: 5 s of waiting


def test_two_transfers_on_one_link_get_half_the_bandwidth_each():
    # Both send 4 bytes from rank 0 on the same link at once (no latency): 8 s, not 4.
    links = AlphaBeta(intra_bandwidth=1.0, intra_latency=0.0)
    tl = Timeline(2, links)
    a = tl.collective(transfer(2, [(4, 0), (0, 4)], label="a"), "one", phase="step")
    b = tl.collective(transfer(2, [(4, 0), (0, 4)], label="b"), "two", phase="step")
    tl.run()
    assert a.end[0] == pytest.approx(8.0) and b.end[0] == pytest.approx(8.0)
    # 2 and 6 bytes: the first ends at 4 (2 each at half rate), the second moves its last 4 alone: 8.
    tl = Timeline(2, links)
    a = tl.collective(transfer(2, [(2, 0), (0, 2)], label="a"), "one", phase="step")
    b = tl.collective(transfer(2, [(6, 0), (0, 6)], label="b"), "two", phase="step")
    tl.run()
    assert a.end[0] == pytest.approx(4.0) and b.end[0] == pytest.approx(8.0)
    # Opposite directions do not share: each direction of a link has its own bandwidth.
    tl = Timeline(2, links)
    a = tl.collective(transfer(2, [(4, 0), (0, 4)], label="a"), "one", phase="step")
    b = tl.collective(transfer(2, [(0, 4), (4, 0)], label="b"), "two", phase="step")
    tl.run()
    assert a.end[0] == pytest.approx(4.0) and b.end[0] == pytest.approx(4.0)
    # Different levels do not share either.
    tl = Timeline(2, AlphaBeta(intra_bandwidth=1.0, inter_bandwidth=1.0, intra_latency=0.0, inter_latency=0.0))
    a = tl.collective(transfer(2, [(4, 0), (0, 4)], label="a"), "one", phase="step")
    b = tl.collective(Collective("all_to_all", "inter", "step", None, [(4, 0), (0, 4)], 0, "b"), "two",
                      phase="step")
    tl.run()
    assert a.end[0] == pytest.approx(4.0) and b.end[0] == pytest.approx(4.0)


def test_a_collective_starts_when_its_last_rank_arrives_and_streams_are_fifo():
    tl = Timeline(2, LINKS)
    late = tl.compute("late", "compute", [0.0, 5.0], phase="step")
    first = tl.collective(transfer(2, [(1, 1), (1, 1)]), "comm", [late], phase="step")
    second = tl.collective(transfer(2, [(1, 1), (1, 1)]), "comm", phase="step")  # behind it on its stream
    tl.run()
    assert first.start[0] == 0.0 and first.end[0] == pytest.approx(5.0 + 2.0)
    assert second.end[1] == pytest.approx(7.0 + 2.0)


def test_identical_ranks_are_simulated_once_and_copied():
    # Ranks 1-3 do the same; rank 0 differs. Both classes end where they would alone.
    tl = Timeline(4, LINKS)
    work = tl.compute("w", "compute", [3.0, 1.0, 1.0, 1.0], phase="step")
    moved = tl.collective(transfer(4, [(2, 2)] * 4), "comm", [work], phase="step")
    tl.run()
    assert _ends(work) == {0: 3.0, 1: 1.0, 2: 1.0, 3: 1.0}
    assert all(t == pytest.approx(3.0 + 1.0 + 2.0) for t in moved.end.values()) and len(moved.end) == 4


def test_gram_ns_flops_by_hand():
    m, n = 4, 12
    # Five steps, restarting every 3: 6 m²n + 14 m³ with symmetric products, against 20 m²n + 10 m³.
    assert gram_ns_flops((m, n)) == pytest.approx(6 * m * m * n + 14 * m**3)
    assert gram_ns_flops((n, m)) == gram_ns_flops((m, n))
    assert ns_flops((m, n)) == pytest.approx(20 * m * m * n + 10 * m**3)
    # Full products (no symmetric kernels): the two Gram matrices and the m x m products cost twice
    # as much; the two Q X products are full either way.
    assert gram_ns_flops((m, n), symmetric=False) == pytest.approx(8 * m * m * n + 28 * m**3)


def test_the_peer_batches_and_its_runtime_order():
    # Same-shape matrices batch together (order of first appearance), S to a batch.
    assert all_to_all_batches([(4, 2), (2, 4), (4, 2), (4, 2)], 2) == [((4, 2), [0, 2]), ((4, 2), [3]),
                                                                      ((2, 4), [1])]
    # AsyncRuntime: a new batch starts each pass; the others advance one segment, oldest last.
    assert async_runtime_order(3) == [(0, 0), (0, 1), (1, 0), (0, 2), (1, 1), (2, 0), (1, 2), (2, 1), (2, 2)]
    assert async_runtime_order(2, max_concurrent=1) == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]


# ---------------------------------------------------------------- whole steps
@pytest.mark.parametrize("replicate,shard", [(1, 4), (2, 2), (2, 3), (3, 2)])
@pytest.mark.parametrize("return_waves", [1, 4])
@pytest.mark.parametrize("publication", [None, "direct", "scatter"])
def test_serialised_without_compute_is_the_alpha_beta_sum(replicate, shard, return_waves, publication):
    inputs = small_step_inputs(replicate, shard, return_waves, publication=publication)
    options = SimOptions(overlap=False, compute=False)
    for strategy in SIM_STRATEGIES:
        timeline, _ = build_step(strategy, inputs, HW, options)
        # NEXT_FORWARD's step is the period from one forward's end to the next's: the next forward's
        # all-gathers stand in for this one's.
        nfwd = strategy == NEXT_FORWARD
        used = [t.collective for t in timeline.tasks if t.collective is not None
                and not (nfwd and t.phase == "forward")]
        figures = simulate(strategy, inputs, HW, options)
        assert figures["step_seconds"] == pytest.approx(step_figures(used, LINKS)["seconds"]["total"]), strategy
        # The collectives are step_collectives' (the same code as step_comm's), plus dmuon's agreement.
        rbwd = strategy == RETURNS_IN_BACKWARD
        listed = step_collectives("dmuon" if rbwd or nfwd else strategy, inputs.shapes, inputs.owners, inputs.blocks,
                                  replicate, shard, waves=step_builder(strategy, inputs, HW, options).waves,
                                  other_shapes=inputs.other_shapes, other_blocks=inputs.other_blocks,
                                  publication=publication, returns_in_backward=rbwd)
        extra = [c for c in used if c.role == "agreement"]
        # NS in backward leaves the speculative step (its flags on the return): the agreement goes alone.
        assert len(extra) == (strategy.startswith("dmuon") and (return_waves > 1 or rbwd or nfwd))
        assert sorted(c.label for c in used if c.role != "agreement") == sorted(c.label for c in listed)
        if not extra:
            assert figures["step_seconds"] == pytest.approx(step_figures(listed, LINKS)["seconds"]["total"])


@pytest.mark.parametrize("replicate,shard", [(1, 1), (1, 4), (2, 2), (4, 2)])
@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_every_strategy_schedules_every_collective_and_adds_up(replicate, shard, backend):
    for zero in (2, 3):
        for return_waves in (1, 4):
            for publication in (None, "scatter"):  # the route across replicas as chosen, and forced
                inputs = small_step_inputs(replicate, shard, return_waves, zero, publication)
                for strategy in SIM_STRATEGIES:
                    # build_step raises if a collective of step_collectives has no place in the schedule.
                    f = simulate(strategy, inputs, HW, SimOptions(tokens_per_gpu=1000, backend=backend))
                    assert f["step_seconds"] == pytest.approx(f["forward_backward_seconds"] + f["optimizer_seconds"])
                    assert f["step_seconds"] >= f["compute_seconds"] > 0
                    assert f["exposed_comm_seconds"] >= -1e-12 and f["optimizer_seconds"] >= 0


def test_scatter_route_hops_wait_for_the_hop_before_and_the_all_gather_rides_with_the_next_wave():
    """3 x 2 mesh, three return waves on the scatter route: each wave's scatter starts once its hop 1 has
    landed, in one all_to_all with the wave before's all-gather (which needs that wave's scatter landed);
    the last all-gather goes alone; a wave is applied once its all-gather has landed."""
    inputs = small_step_inputs(3, 2, publication="scatter")
    waves = inputs.waves()
    assert len(waves) == 3
    timeline, _ = build_step("dmuon", inputs, HW, SimOptions(tokens_per_gpu=1000))
    timeline.run()
    task = {t.name: t for t in timeline.tasks}
    hop_1 = [task[f"dmuon updates to the shard columns wave {w}"] for w in range(3)]
    first = [task["dmuon update slices to the replicas wave 0"],
             *(task[f"dmuon update slices to the replicas wave {w} + the slices' all-gather wave {w - 1}"]
               for w in (1, 2))]
    last_gather = task["dmuon update slices' all-gather wave 2"]
    assert [c.collective.carries_gather for c in first] == [None, 0, 1]
    gathers = [first[1], first[2], last_gather]  # where each wave's all-gather travels

    def after(later, earlier) -> bool:
        """Every rank starts ``later`` once its part of ``earlier`` has ended."""
        return all(later.start[k] >= end - 1e-9 for k, end in earlier.end.items() if k in later.start)

    for w in range(3):
        assert after(first[w], hop_1[w]) and after(gathers[w], first[w]) and after(task[f"apply wave {w}"], gathers[w])
        assert len(gathers[w].start) == 6  # every rank of a 3 x 2 mesh takes part in the all-gather


@pytest.mark.parametrize("tokens,bound", [(20, "reduce-scatter"), (1, "columns")])
def test_design_b_hop_a_rides_with_the_next_blocks_columns_by_hand(tokens, bound):
    """The replicate level, 2 x 2 mesh, two blocks of one 2 x 4 matrix each (block 2's owned by (0, 1), block 1's
    by (1, 0)), hop A all at once (``hop_a_spread=1``): block 2's hop A leaves in block 1's
    gradient-column all_to_all, which starts once block 1's reduce-scatter has landed and block 2's
    directions are computed, whichever is later."""
    inputs = StepInputs(shapes=[(2, 4), (2, 4)], owners=[1, 2], blocks=[2, 1], replicate=2, shard=2,
                        ns_batches={1: [[0]], 2: [[1]]}, zero=2, hop_a_spread=1)
    # Free intra-node links (FSDP2's collectives and hop B take no time), 1 byte/s and 2 s a message
    # across nodes; forward of a block = 2 x 8 x tokens / 16 = tokens s, backward twice that; block 2's
    # directions 10 B x 8 / 4 ranks at 10 B/s = 2 s.
    hw = Hardware("hand", compute_flops=16.0, ns_flops=1.0, elementwise_bytes=10.0,
                  links=AlphaBeta(intra_bandwidth=1e30, inter_bandwidth=1.0, intra_latency=0.0, inter_latency=2.0))
    timeline, _ = build_step("dmuon", inputs, hw, SimOptions(tokens_per_gpu=tokens, ns_method="standard"))
    timeline.run()
    task = {t.name: t for t in timeline.tasks}
    columns = task["dmuon gradient columns block 2"]
    merged = task["dmuon gradient columns block 1 + direction slices of blocks [2]"]
    hop_b = task["dmuon directions block 2"]
    # Block 2's backward ends at 2 t + 2 t (forward of both, its own backward); its column slices
    # (fp32, 1 row x 2 columns each way) take 2 + 8 s. Block 1's backward ends 2 t later.
    t = float(tokens)
    block_2, block_1 = 4 * t, 6 * t
    assert all(v == pytest.approx(block_2 + 10) for v in columns.end.values())
    if bound == "reduce-scatter":  # 6 t = 120 > 90: block 1's reduce-scatter lands last
        assert block_1 > block_2 + 10
        start = block_1 + 2
    else:  # 6 = 6 t < 14: block 2's column slices land last
        assert block_1 < block_2 + 10
        start = block_2 + 10 + 2
    assert all(v == pytest.approx(start) for v in merged.start.values())
    # One latency, then each rank's larger direction: block 1's columns 8 bytes each way plus block 2's
    # hop A, 1 row x 2 columns in bf16 = 4 bytes from replica 1 to replica 0: 12 bytes.
    assert [merged.collective.ranks[k] for k in range(4)] == [(8, 12), (8, 12), (12, 8), (12, 8)]
    assert all(v == pytest.approx(start + 2 + 12) for v in merged.end.values())
    # Block 2's hop B waits for it; block 1's hop A goes alone in step().
    assert min(hop_b.start.values()) >= start + 14 - 1e-9
    assert task["dmuon direction slices of blocks [1] left at the end of backward"].collective.role == "hop_a"


def test_design_b_a_unit_without_muon_matrices_carries_the_hop_a_alone():
    # Muon blocks 3 and 1, block 2 (between them in backward) and the root only other parameters:
    # block 3's hop A goes alone when block 2 lands, before block 2's all-reduce (one queue: the
    # replicate group's), block 1's columns carry nothing, block 1's hop A goes alone when the root lands.
    inputs = StepInputs(shapes=[(6, 5), (5, 7)], owners=[1, 2], blocks=[3, 1], replicate=2, shard=2,
                        ns_batches={1: [[0]], 2: [[1]]}, other_shapes=[(16, 5), (4, 4)], other_blocks=[0, 2],
                        hop_a_spread=1)
    listed = step_collectives("dmuon", inputs.shapes, inputs.owners, inputs.blocks, 2, 2, waves=inputs.waves(),
                              other_shapes=inputs.other_shapes, other_blocks=inputs.other_blocks, hop_a_spread=1)
    assert [(c.role, c.block, c.carries_hop_a) for c in listed if c.role in ("grad_columns", "hop_a")] == [
        ("grad_columns", 3, ()), ("hop_a", 2, (3,)), ("grad_columns", 1, ()), ("hop_a", 0, (1,))]
    timeline, _ = build_step("dmuon", inputs, HW, SimOptions(tokens_per_gpu=1000))
    timeline.run()
    task = {t.name: t for t in timeline.tasks}
    reduced_2 = task["dmuon all_reduce of the other parameters block 2"]
    alone_3 = task["dmuon direction slices of blocks [3]"]
    assert min(reduced_2.start.values()) >= max(alone_3.end.values())
    # Serialised without compute: the alpha-beta sum of what step_collectives lists, plus the agreement.
    options = SimOptions(overlap=False, compute=False)
    timeline, _ = build_step("dmuon", inputs, HW, options)
    used = [t.collective for t in timeline.tasks if t.collective is not None]
    assert sorted(c.label for c in used if c.role != "agreement") == sorted(c.label for c in listed)
    assert simulate("dmuon", inputs, HW, options)["step_seconds"] == pytest.approx(
        step_figures(used, LINKS)["seconds"]["total"])


def test_hand_step_on_one_rank_per_strategy():
    # One rank, no communication: the step is the sum of its work.
    inputs = StepInputs(shapes=[(4, 8)], owners=[0], blocks=[1], replicate=1, shard=1, ns_batches={0: [[0]]},
                        other_shapes=[(10, 4)], other_blocks=[0], return_waves=4)
    hw = Hardware("t", compute_flops=1.0, ns_flops=1.0, elementwise_bytes=1.0, links=LINKS)
    options = SimOptions(tokens_per_gpu=1, ns_method="standard")
    fwd_bwd = 6 * (32 + 40)  # 6 x parameters x tokens
    adamw_all = 28 * (32 + 40)
    assert simulate("fsdp_adamw", inputs, hw, options)["step_seconds"] == pytest.approx(fwd_bwd + adamw_all)
    ns = ns_flops((4, 8))
    # gather: momentum 14 B, NS, apply 10 B per Muon element; AdamW on the other 40.
    gather = simulate("gather", inputs, hw, options)
    assert gather["optimizer_seconds"] == pytest.approx(14 * 32 + ns + 10 * 32 + 28 * 40)
    # dmuon: direction in backward (10 B), momentum (14), check (4), AdamW, NS with the owner's copies (8), apply.
    dmuon = simulate("dmuon", inputs, hw, options)
    assert dmuon["step_seconds"] == pytest.approx(
        fwd_bwd + 10 * 32 + 14 * 32 + 4 * 32 + 28 * 40 + ns + 8 * 32 + 10 * 32)
    assert dmuon["ns_seconds"] == pytest.approx(ns + 8 * 32)
    # After backward: NS, and the momentum, check, AdamW and apply passes; no link.
    assert dmuon["optimizer_busy_seconds"] == pytest.approx(
        {"ns": ns + 8 * 32, "elementwise": 14 * 32 + 4 * 32 + 28 * 40 + 10 * 32, "intra": 0.0, "inter": 0.0})


def test_the_optimizer_phase_counts_link_time_once_per_rank():
    # After a 2 s "backward", two overlapping transfers on rank 0's link (4 bytes each at half rate: 8 s)
    # and one later one (1 + 2 s): busy 8 + 2 s of link time, not 8 + 8 + 2.
    tl = Timeline(2, AlphaBeta(intra_bandwidth=1.0, intra_latency=1.0))
    backward = tl.compute("backward", "compute", 2.0, phase="backward")
    end = tl.wait("backward end", "compute", [backward], phase="backward")
    a = tl.collective(Collective("all_to_all", "intra", "step", None, [(4, 0), (0, 4)], 0, "a"), "one", [end],
                      phase="step")
    tl.collective(Collective("all_to_all", "intra", "step", None, [(4, 0), (0, 4)], 0, "b"), "two", [end],
                  phase="step")
    tl.collective(Collective("all_to_all", "intra", "step", None, [(2, 0), (0, 2)], 1, "c"), "one", [a],
                  phase="step")
    tl.run()
    from dmuon.costmodel.simulate import _busy_after
    assert _busy_after(tl, 2.0, 2) == pytest.approx({"ns": 0.0, "elementwise": 0.0, "intra": 10.0, "inter": 0.0})


def test_nothing_is_exposed_with_free_links_and_gather_pays_every_ns():
    free = Hardware("free", 1e12, 1e12, 1e11, AlphaBeta(intra_bandwidth=1e30, inter_bandwidth=1e30,
                                                        intra_latency=0.0, inter_latency=0.0))
    inputs = small_step_inputs(2, 2)
    options = SimOptions(tokens_per_gpu=10**6)
    adamw = simulate("fsdp_adamw", inputs, free, options)
    assert adamw["exposed_comm_seconds"] == pytest.approx(0.0, abs=1e-12)
    gather = simulate("gather", inputs, free, options)
    dmuon = simulate("dmuon", inputs, free, options)
    # Every rank runs every NS under gather; dmuon's busiest owner runs its own.
    assert gather["ns_seconds"] > dmuon["ns_seconds"]
    assert simulate(PEER_STRATEGY, inputs, free, options)["exposed_comm_seconds"] == pytest.approx(0.0, abs=1e-9)


def test_options_are_checked():
    with pytest.raises(ValueError):
        SimOptions(ns_method="svd")
    with pytest.raises(ValueError):
        SimOptions(backend="mpi")
    with pytest.raises(ValueError, match="non_gemm_seconds"):
        SimOptions(non_gemm_seconds=-1.0)
    with pytest.raises(ValueError):
        Hardware("x", 0.0, 1.0, 1.0)
    with pytest.raises(ValueError, match="strategy must be one of"):
        simulate("adam", small_step_inputs(1, 2), HW)
