"""The step simulation against timelines known by hand, and against the alpha-beta sums."""

from __future__ import annotations

import itertools
import pytest

from dmuon.costmodel.collective import AlphaBeta, Collective, step_figures
from dmuon.costmodel.collectives import step_collectives
from dmuon.costmodel.peer import PEER_STRATEGY, all_to_all_batches, async_runtime_order
from dmuon.costmodel.schedule import StepBuilder
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

# Round numbers: 1 byte/s per link direction, latencies of 1 s inside a node and 2 s across.
LINKS = AlphaBeta(intra_bandwidth=1.0, inter_bandwidth=1.0, intra_latency=1.0, inter_latency=2.0)


def _transfer(world: int, parts, messages: int = 1, level: str = "intra", label: str = "t") -> Collective:
    """A collective with the given (sent, received) per rank (None: not taking part)."""
    return Collective("all_to_all", level, "step", None, list(parts), messages, label)


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
    t = tl.collective(_transfer(2, [(6, 4), (4, 6)], messages=3), "s", phase="step")
    tl.run()
    # 3 latencies of 1 s, then each rank's larger direction, 6 bytes at 1 byte/s.
    assert _ends(t) == {0: pytest.approx(9.0), 1: pytest.approx(9.0)}
    # Across nodes: 2 s latency per message.
    tl = Timeline(2, LINKS)
    t = tl.collective(_transfer(2, [(5, 0), (0, 5)], messages=1, level="inter"), "s", phase="step")
    tl.run()
    assert _ends(t) == {0: pytest.approx(7.0), 1: pytest.approx(7.0)}


def test_a_transfer_hides_behind_compute_unless_it_waits_for_it():
    tl = Timeline(2, LINKS)
    work = tl.compute("backward", "compute", 10.0, phase="backward")
    moved = tl.collective(_transfer(2, [(4, 4), (4, 4)]), "comm", phase="backward")  # 1 + 4 s, from t=0
    after = tl.compute("next", "compute", 1.0, [moved], phase="step")
    tl.run()
    assert moved.end[0] == pytest.approx(5.0) and work.end[0] == pytest.approx(10.0)
    assert after.end[0] == pytest.approx(11.0)  # hidden: nothing waited
    tl = Timeline(2, LINKS)
    work = tl.compute("backward", "compute", 10.0, phase="backward")
    moved = tl.collective(_transfer(2, [(4, 4), (4, 4)]), "comm", [work], phase="backward")
    after = tl.compute("next", "compute", 1.0, [moved], phase="step")
    tl.run()
    assert after.end[0] == pytest.approx(10.0 + 5.0 + 1.0)  # exposed: 5 s of waiting


def test_two_transfers_on_one_link_get_half_the_bandwidth_each():
    # Both send 4 bytes from rank 0 on the same link at once (no latency): 8 s, not 4.
    links = AlphaBeta(intra_bandwidth=1.0, intra_latency=0.0)
    tl = Timeline(2, links)
    a = tl.collective(_transfer(2, [(4, 0), (0, 4)], label="a"), "one", phase="step")
    b = tl.collective(_transfer(2, [(4, 0), (0, 4)], label="b"), "two", phase="step")
    tl.run()
    assert a.end[0] == pytest.approx(8.0) and b.end[0] == pytest.approx(8.0)
    # 2 and 6 bytes: the first ends at 4 (2 each at half rate), the second moves its last 4 alone: 8.
    tl = Timeline(2, links)
    a = tl.collective(_transfer(2, [(2, 0), (0, 2)], label="a"), "one", phase="step")
    b = tl.collective(_transfer(2, [(6, 0), (0, 6)], label="b"), "two", phase="step")
    tl.run()
    assert a.end[0] == pytest.approx(4.0) and b.end[0] == pytest.approx(8.0)
    # Opposite directions do not share: each direction of a link has its own bandwidth.
    tl = Timeline(2, links)
    a = tl.collective(_transfer(2, [(4, 0), (0, 4)], label="a"), "one", phase="step")
    b = tl.collective(_transfer(2, [(0, 4), (4, 0)], label="b"), "two", phase="step")
    tl.run()
    assert a.end[0] == pytest.approx(4.0) and b.end[0] == pytest.approx(4.0)
    # Different levels do not share either.
    tl = Timeline(2, AlphaBeta(intra_bandwidth=1.0, inter_bandwidth=1.0, intra_latency=0.0, inter_latency=0.0))
    a = tl.collective(_transfer(2, [(4, 0), (0, 4)], label="a"), "one", phase="step")
    b = tl.collective(Collective("all_to_all", "inter", "step", None, [(4, 0), (0, 4)], 0, "b"), "two",
                      phase="step")
    tl.run()
    assert a.end[0] == pytest.approx(4.0) and b.end[0] == pytest.approx(4.0)


def test_a_collective_starts_when_its_last_rank_arrives_and_streams_are_fifo():
    tl = Timeline(2, LINKS)
    late = tl.compute("late", "compute", [0.0, 5.0], phase="step")
    first = tl.collective(_transfer(2, [(1, 1), (1, 1)]), "comm", [late], phase="step")
    second = tl.collective(_transfer(2, [(1, 1), (1, 1)]), "comm", phase="step")  # behind it on its stream
    tl.run()
    assert first.start[0] == 0.0 and first.end[0] == pytest.approx(5.0 + 2.0)
    assert second.end[1] == pytest.approx(7.0 + 2.0)


def test_identical_ranks_are_simulated_once_and_copied():
    # Ranks 1-3 do the same; rank 0 differs. Both classes end where they would alone.
    tl = Timeline(4, LINKS)
    work = tl.compute("w", "compute", [3.0, 1.0, 1.0, 1.0], phase="step")
    moved = tl.collective(_transfer(4, [(2, 2)] * 4), "comm", [work], phase="step")
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
HW = Hardware("test", compute_flops=1e12, ns_flops=1e12, elementwise_bytes=1e11, links=LINKS)


def _inputs(replicate: int, shard: int, return_waves: int = 4, zero: int = 3, publication: str | None = None
            ) -> StepInputs:
    """Five Muon matrices in blocks 1-2 and the root, two AdamW ones (an embedding in the root, one in block 1)."""
    shapes = [(6, 5), (5, 7), (8, 4), (3, 9), (6, 5)]
    blocks = [1, 1, 2, 2, 0]
    world = replicate * shard
    owners = [(3 * i + 1) % world for i in range(len(shapes))]
    batches: dict[int, list[list[int]]] = {}
    for i, o in enumerate(owners):
        batches.setdefault(o, []).append([i])
    return StepInputs(shapes=shapes, owners=owners, blocks=blocks, replicate=replicate, shard=shard,
                      ns_batches=batches, other_shapes=[(16, 5), (4, 4)], other_blocks=[0, 1],
                      return_waves=return_waves, zero=zero, publication=publication)


@pytest.mark.parametrize("replicate,shard", [(1, 4), (2, 2), (2, 3), (3, 2)])
@pytest.mark.parametrize("return_waves", [1, 4])
@pytest.mark.parametrize("publication", [None, "direct", "scatter"])
def test_serialised_without_compute_is_the_alpha_beta_sum(replicate, shard, return_waves, publication):
    inputs = _inputs(replicate, shard, return_waves, publication=publication)
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
                inputs = _inputs(replicate, shard, return_waves, zero, publication)
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
    inputs = _inputs(3, 2, publication="scatter")
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
    inputs = _inputs(2, 2)
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
        simulate("adam", _inputs(1, 2), HW)


# ------------------------------------------------------------------ per-kind links and the host's work
def _kind(op: str, sent: int, messages: int = 1) -> Collective:
    return Collective(op, "intra", "step", None, [(sent, 0), (0, sent)], messages, op)


def test_a_kind_with_its_own_link_figures_pays_its_own_latency_and_bandwidth():
    # reduce-scatter: 3 s per message and 0.5 byte/s; all-gather keeps LINKS' 1 s and 1 byte/s.
    kinds = {"reduce_scatter": AlphaBeta(intra_bandwidth=0.5, inter_bandwidth=0.5, intra_latency=3.0)}
    tl = Timeline(2, LINKS, op_links=kinds)
    rs = tl.collective(_kind("reduce_scatter", 4), "one", phase="step")
    ag = tl.collective(_kind("all_gather", 4), "two", [rs], phase="step")
    tl.run()
    assert rs.end[0] == pytest.approx(3.0 + 4 / 0.5) and ag.end[0] == pytest.approx(11.0 + 1.0 + 4.0)


def test_kinds_share_the_level_link_each_at_its_own_cost_per_byte():
    # No latency. The reduce-scatter's 4 bytes occupy the 1 byte/s link as 8 (it runs at 0.5 byte/s
    # alone); with an all-gather of 4 beside it, each gets half: the all-gather ends at 8, by then the
    # reduce-scatter has done 4 of its 8 and finishes the rest alone at 12.
    links = AlphaBeta(intra_bandwidth=1.0, intra_latency=0.0)
    kinds = {"reduce_scatter": AlphaBeta(intra_bandwidth=0.5, intra_latency=0.0)}
    tl = Timeline(2, links, op_links=kinds)
    rs = tl.collective(_kind("reduce_scatter", 4), "one", phase="step")
    ag = tl.collective(_kind("all_gather", 4), "two", phase="step")
    tl.run()
    assert ag.end[0] == pytest.approx(8.0) and rs.end[0] == pytest.approx(12.0)


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_kinds_given_the_shared_figures_and_zero_host_figures_change_nothing(backend):
    same = {op: LINKS for op in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")}
    plain = Hardware("t", 1e12, 1e12, 1e11, LINKS)
    listed = Hardware("t", 1e12, 1e12, 1e11, LINKS, op_links=same, dispatch_seconds=0.0,
                      dtensor_dispatch_seconds=0.0, dtensor_layout_seconds=0.0, fsdp_unit_seconds=0.0)
    options = SimOptions(tokens_per_gpu=1000, backend=backend, unlisted_tensors=7)
    for replicate, shard in ((1, 2), (2, 2)):
        for strategy in SIM_STRATEGIES:
            assert simulate(strategy, _inputs(replicate, shard), listed, options) == \
                simulate(strategy, _inputs(replicate, shard), plain, options)


def test_work_beyond_the_gemms_by_hand_on_one_rank():
    # One rank, 1 FLOP/s: block 1 (32 parameters) and the root (40). 72 s beyond the GEMMs go 32 : 40 to the
    # units and 1 : 2 to forward and backward: block 1's forward 2 x 32 + 72 / 3 x 32 / 72 = 64 + 32 / 3 s.
    inputs = StepInputs(shapes=[(4, 8)], owners=[0], blocks=[1], replicate=1, shard=1, ns_batches={0: [[0]]},
                        other_shapes=[(10, 4)], other_blocks=[0], return_waves=4)
    hw = Hardware("t", compute_flops=1.0, ns_flops=1.0, elementwise_bytes=1.0, links=LINKS)
    for backend in ("gloo", "nccl"):
        plain = SimOptions(tokens_per_gpu=1, ns_method="standard", backend=backend)
        beyond = SimOptions(tokens_per_gpu=1, ns_method="standard", backend=backend, non_gemm_seconds=72.0)
        timeline, _ = build_step("fsdp_adamw", inputs, hw, beyond)
        seconds = {t.name: t.seconds[0] for t in timeline.tasks if t.seconds is not None}
        assert seconds["forward block 1"] == pytest.approx(64 + 32 / 3)
        assert seconds["backward block 1"] == pytest.approx(2 * (64 + 32 / 3))
        assert seconds["forward head"] == pytest.approx(80 + 40 / 3)
        assert seconds["backward head"] == pytest.approx(2 * (80 + 40 / 3))
        for strategy in ("fsdp_adamw", "gather", "dmuon"):
            before, after = simulate(strategy, inputs, hw, plain), simulate(strategy, inputs, hw, beyond)
            assert after["forward_backward_seconds"] == pytest.approx(before["forward_backward_seconds"] + 72)
            assert after["compute_seconds"] == pytest.approx(before["compute_seconds"] + 72)
            assert after["optimizer_seconds"] == pytest.approx(before["optimizer_seconds"])
        # Without compute nothing is added.
        idle = SimOptions(tokens_per_gpu=1, backend=backend, compute=False, non_gemm_seconds=72.0)
        assert simulate("fsdp_adamw", inputs, hw, idle)["compute_seconds"] == 0.0


def test_host_work_by_hand_on_one_rank():
    # One rank, 1 FLOP/s, 1 byte/s: every task's seconds by hand. Host: 1 s per plain op, 10 per DTensor
    # op, 100 per layout call; FSDP2 1000 s per unit and pass (two units: block 1 and the root).
    from dmuon.costmodel.host import HostOps

    inputs = StepInputs(shapes=[(4, 8)], owners=[0], blocks=[1], replicate=1, shard=1, ns_batches={0: [[0]]},
                        other_shapes=[(10, 4)], other_blocks=[0], return_waves=4)
    base = Hardware("t", compute_flops=1.0, ns_flops=1.0, elementwise_bytes=1.0, links=LINKS)
    host = Hardware("t", compute_flops=1.0, ns_flops=1.0, elementwise_bytes=1.0, links=LINKS, dispatch_seconds=1.0,
                    dtensor_dispatch_seconds=10.0, dtensor_layout_seconds=100.0, fsdp_unit_seconds=1000.0)
    ops = HostOps()
    fsdp = 2 * 2 * 1000.0  # two units, forward and backward
    for backend in ("gloo", "nccl"):
        options = SimOptions(tokens_per_gpu=1, ns_method="standard", backend=backend, unlisted_tensors=3)
        before = {s: simulate(s, inputs, base, options) for s in ("fsdp_adamw", "gather", "dmuon")}
        after = {s: simulate(s, inputs, host, options) for s in ("fsdp_adamw", "gather", "dmuon")}
        tensors = 1 + 1 + 3
        if backend == "gloo":  # one thread: host and device work add up
            adamw = tensors * (ops.adamw_per_tensor.plain + 10 * ops.adamw_per_tensor.dtensor)
            assert after["fsdp_adamw"]["step_seconds"] == pytest.approx(before["fsdp_adamw"]["step_seconds"]
                                                                        + fsdp + adamw)
            matrix = ops.gather_per_matrix
            local = ops.local_foreach_adamw.plain + ops.foreach_adamw_per_tensor.plain * (1 + 3)
            assert after["gather"]["optimizer_seconds"] == pytest.approx(
                before["gather"]["optimizer_seconds"] + matrix.plain + 10 * matrix.dtensor + 100 * matrix.layout + local)
            dmuon = ops.dmuon_per_step.plain + ops.dmuon_per_matrix.plain * 1
            assert after["dmuon"]["step_seconds"] == pytest.approx(before["dmuon"]["step_seconds"] + fsdp + dmuon)
        else:  # the host queues ahead: each task takes the longer of its device and host work
            adamw = 10 * ops.foreach_adamw.dtensor + tensors * ops.foreach_adamw_per_tensor.plain
            adamw_bytes = 28 * (32 + 40)
            fwd_bwd = 6 * (32 + 40)
            # Each unit's pass: the longer of its compute (block 1: 2 x 32 forward, 4 x 32 backward; the root's
            # 0-second embedding passes) and 1000 s of host work; the head's compute (2 x 40, 4 x 40) stays.
            passes = 4 * 1000.0
            assert after["fsdp_adamw"]["step_seconds"] == pytest.approx(
                passes + 6 * 40 + max(adamw_bytes, adamw))
            assert before["fsdp_adamw"]["step_seconds"] == pytest.approx(fwd_bwd + adamw_bytes)


def test_host_figures_are_checked():
    with pytest.raises(ValueError):
        Hardware("x", 1.0, 1.0, 1.0, dispatch_seconds=-1.0)
    with pytest.raises(ValueError):
        Hardware("x", 1.0, 1.0, 1.0, op_links={"broadcast": LINKS})
    with pytest.raises(ValueError):
        SimOptions(unlisted_tensors=-1)


def test_ranks_drifting_apart_meet_late_and_blocking_collectives_bring_them_back_in_step():
    # sync_skew 0.5: a collective starts 0.5 x the compute each rank ran since the ranks last met (at a
    # collective on the compute stream, which blocks their threads) later.
    tl = Timeline(2, LINKS, sync_skew=0.5)
    tl.compute("a", "compute", 4.0, phase="forward")
    first = tl.collective(_transfer(2, [(1, 1), (1, 1)]), "compute", phase="forward")
    tl.compute("b", "compute", 2.0, phase="forward")
    second = tl.collective(_transfer(2, [(1, 1), (1, 1)]), "compute", phase="forward")
    beside = tl.collective(_transfer(2, [(1, 1), (1, 1)]), "other", [second], phase="forward")
    c = tl.compute("c", "compute", 4.0, [second], phase="forward")
    issued = tl.collective(_transfer(2, [(1, 1), (1, 1)]), "other", [c], phase="forward")
    tl.run()
    assert first.end[0] == pytest.approx(4.0 + 1.0 + 0.5 * 4.0 + 1.0)          # 8
    assert second.end[0] == pytest.approx(8.0 + 2.0 + 1.0 + 0.5 * 2.0 + 1.0)   # 13: only b since the first
    assert beside.end[0] == pytest.approx(13.0 + 1.0 + 1.0)                     # met at 13: no drift yet
    # Issued beside the thread after c (4 s since the meeting): its later rank issues it 2 s late.
    assert issued.end[0] == pytest.approx(17.0 + 1.0 + 0.5 * 4.0 + 1.0)


def test_a_fixed_delay_per_meeting_after_compute_beside_the_fraction():
    # sync_delay 0.25 more at each collective issued after some compute since the last meeting; none at one
    # issued right after a meeting.
    tl = Timeline(2, LINKS, sync_skew=0.5, sync_delay=0.25)
    tl.compute("a", "compute", 4.0, phase="forward")
    first = tl.collective(_transfer(2, [(1, 1), (1, 1)]), "compute", phase="forward")
    tl.compute("b", "compute", 2.0, phase="forward")
    second = tl.collective(_transfer(2, [(1, 1), (1, 1)]), "compute", phase="forward")
    beside = tl.collective(_transfer(2, [(1, 1), (1, 1)]), "other", [second], phase="forward")
    again = tl.collective(_transfer(2, [(1, 1), (1, 1)]), "compute", [beside], phase="forward")
    tl.run()
    assert first.end[0] == pytest.approx(4.0 + 1.0 + 0.5 * 4.0 + 0.25 + 1.0)          # 8.25
    assert second.end[0] == pytest.approx(8.25 + 2.0 + 1.0 + 0.5 * 2.0 + 0.25 + 1.0)  # 13.5
    assert beside.end[0] == pytest.approx(13.5 + 1.0 + 1.0)     # no compute since the meeting: no delay
    assert again.end[0] == pytest.approx(15.5 + 1.0 + 1.0)      # the thread's next, no compute between: none
    with pytest.raises(ValueError, match="sync_delay"):
        Hardware("x", 1.0, 1.0, 1.0, sync_delay=-1.0)


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
        kept = _inputs(replicate, shard, zero=zero)
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
    one = _inputs(1, 1)
    assert simulate(NEXT_FORWARD, one, HW, options)["step_seconds"] == pytest.approx(
        simulate("dmuon", one, HW, options)["step_seconds"])
    free = Hardware("free", 1e12, 1e12, 1e11, AlphaBeta(intra_bandwidth=1e30, inter_bandwidth=1e30,
                                                        intra_latency=0.0, inter_latency=0.0))
    assert simulate(NEXT_FORWARD, _inputs(2, 2), free, options)["step_seconds"] == pytest.approx(
        simulate("dmuon", _inputs(2, 2), free, options)["step_seconds"])
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

    inputs = _inputs(replicate, 1, return_waves)
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
        build_step(DDP_STRATEGY, _inputs(1, 2), HW, options)
