"""The step simulation's per-kind links, the host's work and ranks drifting apart, against timelines known by hand."""

from __future__ import annotations

import pytest

from dmuon.costmodel.collective import AlphaBeta, Collective
from dmuon.costmodel.sim_config import Hardware, SimOptions, StepInputs
from dmuon.costmodel.simulate import SIM_STRATEGIES, Timeline, build_step, simulate

from ._helpers import LINKS, small_step_inputs, transfer


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
            assert simulate(strategy, small_step_inputs(replicate, shard), listed, options) == \
                simulate(strategy, small_step_inputs(replicate, shard), plain, options)


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
    first = tl.collective(transfer(2, [(1, 1), (1, 1)]), "compute", phase="forward")
    tl.compute("b", "compute", 2.0, phase="forward")
    second = tl.collective(transfer(2, [(1, 1), (1, 1)]), "compute", phase="forward")
    beside = tl.collective(transfer(2, [(1, 1), (1, 1)]), "other", [second], phase="forward")
    c = tl.compute("c", "compute", 4.0, [second], phase="forward")
    issued = tl.collective(transfer(2, [(1, 1), (1, 1)]), "other", [c], phase="forward")
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
    first = tl.collective(transfer(2, [(1, 1), (1, 1)]), "compute", phase="forward")
    tl.compute("b", "compute", 2.0, phase="forward")
    second = tl.collective(transfer(2, [(1, 1), (1, 1)]), "compute", phase="forward")
    beside = tl.collective(transfer(2, [(1, 1), (1, 1)]), "other", [second], phase="forward")
    again = tl.collective(transfer(2, [(1, 1), (1, 1)]), "compute", [beside], phase="forward")
    tl.run()
    assert first.end[0] == pytest.approx(4.0 + 1.0 + 0.5 * 4.0 + 0.25 + 1.0)          # 8.25
    assert second.end[0] == pytest.approx(8.25 + 2.0 + 1.0 + 0.5 * 2.0 + 0.25 + 1.0)  # 13.5
    assert beside.end[0] == pytest.approx(13.5 + 1.0 + 1.0)     # no compute since the meeting: no delay
    assert again.end[0] == pytest.approx(15.5 + 1.0 + 1.0)      # the thread's next, no compute between: none
    with pytest.raises(ValueError, match="sync_delay"):
        Hardware("x", 1.0, 1.0, 1.0, sync_delay=-1.0)
