"""``dmuon bench --calibrate``'s arithmetic on constructed samples (no ranks spawned, nothing timed)."""

from __future__ import annotations

import pytest

from dmuon.bench.calibrate_fit import (
    CONFIGS,
    TWIN_PATHS,
    calibrated_hardware,
    combine,
    compare,
    drift,
    fit_links,
    link_messages,
    order_check,
    path_host_factors,
    predict,
    predict_by_round,
    rank_unit_seconds,
    separated,
)
from dmuon.bench.shapes import bench_model_shapes

SIZES = (16384, 65536, 262144, 1048576, 4194304)


def _samples(op: str, latency: float, bandwidth: float, world: int = 2) -> list[tuple[str, int, float]]:
    """Exact samples of ``messages x latency + bytes / bandwidth`` at the calibration's sizes."""
    return [(op, n, link_messages(op, world) * latency + n / bandwidth) for n in SIZES]


def test_each_kind_gets_its_own_latency_per_message_and_bandwidth():
    truth = {"all_gather": (2e-4, 1.3e9), "reduce_scatter": (3e-4, 0.45e9), "all_to_all": (1.5e-4, 1.2e9),
             "all_reduce": (1.2e-4, 1.5e9)}
    for world in (2, 4):
        samples = [s for op, (a, b) in truth.items() for s in _samples(op, a, b, world)]
        fitted = fit_links(samples, world)
        for op, (a, b) in truth.items():
            assert fitted[op] == pytest.approx((a, b))
    # An all-reduce pays 2 (W - 1) latencies (a ring's two passes), the others W - 1.
    assert (link_messages("all_reduce", 4), link_messages("all_gather", 4)) == (6, 3)


def _point(flops: float, dispatch: float, layout: float) -> dict:
    return {"matmul_flops": flops, "effective_flops": flops / 2, "elementwise_bytes": 1.0,
            "dispatch_seconds": dispatch, "dtensor_dispatch_seconds": 10 * dispatch,
            "dtensor_layout_seconds": layout, "fsdp_unit_seconds": 1e-3, "unlisted_tensors": 5,
            "ns_seconds": {"4x4x1": 1.0},
            "link_samples": _samples("all_gather", 1e-4, 1e9) + _samples("reduce_scatter", 1e-4, 0.5e9)}


def test_combine_takes_the_slower_rank_for_rates_and_times_and_fits_every_kind():
    figures = combine([[_point(10.0, 2e-6, 1e-4), _point(30.0, 1e-6, 3e-4)],
                       [_point(20.0, 4e-6, 2e-4), _point(40.0, 1e-6, 1e-4)]], world_size=2)
    assert figures["matmul_flops"] == pytest.approx((10.0 + 30.0) / 2)        # the lower rate at each point
    assert figures["dispatch_seconds"] == pytest.approx((4e-6 + 1e-6) / 2)    # the longer time at each point
    assert figures["dtensor_layout_seconds"] == pytest.approx((2e-4 + 3e-4) / 2)
    assert figures["link_kinds"]["reduce_scatter"] == pytest.approx({"latency": 1e-4, "bandwidth": 0.5e9})
    assert figures["link_kinds"]["all_gather"] == pytest.approx({"latency": 1e-4, "bandwidth": 1e9})
    assert figures["unlisted_tensors"] == 5 and figures["points"] == 2


def test_the_drift_is_relative_to_the_slower_ranks_compute():
    # The ranks meet every block, so the blocks with meetings take both 1.5 s; the meetings alone 0.1 s.
    # Rank 0 computes in 1.2 s, rank 1 in 1.0 s: the slower rank's delay is (1.5 - 0.1 - 1.2) / 1.2, not
    # the faster rank's (1.5 - 0.1 - 1.0) / 1.0, which holds its wait for the slower one too. A meeting per
    # matrix times as a meeting per block does (the same seconds): no delay per meeting.
    often = {"met_often": 1.5, "meetings_often": 0.1, "count": 8, "count_often": 56}
    ranks = [{"alone": 1.2, "met": 1.5, "meetings": 0.1, **often}, {"alone": 1.0, "met": 1.5, "meetings": 0.1, **often}]
    assert drift([{"skew_seconds": r} for r in ranks]) == pytest.approx((0.2 / 1.2, 0.0))
    # Lockstep ranks (the meetings alone explain the blocks with meetings): no drift, never negative.
    lockstep = {"alone": 1.0, "met": 1.05, "meetings": 0.1, "met_often": 1.05, "meetings_often": 0.1, "count": 8,
                "count_often": 56}
    assert drift([{"skew_seconds": lockstep}] * 2) == (0.0, 0.0)
    # Two points: the first as above, the second with both ranks at 1.0 s (drift 0.4).
    first = [dict(_point(10.0, 1e-6, 1e-4), skew_seconds=r) for r in ranks]
    second = [dict(_point(10.0, 1e-6, 1e-4), skew_seconds=ranks[1]) for _ in ranks]
    figures = combine([[first[0], second[0]], [first[1], second[1]]], world_size=2)
    assert figures["sync_skew"] == pytest.approx((0.2 / 1.2 + 0.4) / 2)   # the mean over the two points
    assert figures["spread"]["sync_skew"] == pytest.approx([0.2 / 1.2, 0.4])
    assert figures["sync_delay"] == 0.0


def test_the_drift_splits_into_a_fraction_and_a_delay_per_meeting():
    # Ranks whose drift is 0.1 x the compute plus 2 ms per meeting: 8 meetings over 1.0 s of compute take
    # 1.0 + 0.1 + 8 x 0.002 s beyond the meetings alone, 56 meetings over the same compute 1.0 + 0.1 + 56 x 0.002.
    def timings(alone: float) -> dict:
        return {"alone": alone, "met": 0.05 + 1.0 + 0.1 + 8 * 0.002, "meetings": 0.05,
                "met_often": 0.3 + 1.0 + 0.1 + 56 * 0.002, "meetings_often": 0.3, "count": 8, "count_often": 56}

    assert drift([{"skew_seconds": timings(1.0)}, {"skew_seconds": timings(0.9)}]) == pytest.approx((0.1, 0.002))
    # A faster rank changes nothing (the slower one's compute is the prediction's); no more delay with more
    # meetings: none per meeting.
    flat = dict(timings(1.0), met_often=0.3 + 1.0 + 0.1 + 8 * 0.002)
    assert drift([{"skew_seconds": flat}] * 2) == pytest.approx((0.1 + 8 * 0.002, 0.0))
    figures = combine([[dict(_point(10.0, 1e-6, 1e-4), skew_seconds=timings(1.0))]] * 2, world_size=2)
    hardware = calibrated_hardware(figures)
    assert (hardware.sync_skew, hardware.sync_delay) == pytest.approx((0.1, 0.002))
    assert calibrated_hardware(figures, skew=False).sync_delay == 0.0


def test_calibrated_hardware_options():
    figures = combine([[_point(10.0, 2e-6, 1e-4)], [_point(20.0, 2e-6, 1e-4)]], world_size=2)
    full = calibrated_hardware(figures)
    assert set(full.op_links) == {"all_gather", "reduce_scatter"} and full.fsdp_unit_seconds == 1e-3
    assert full.dtensor_dispatch_seconds == pytest.approx(2e-5)
    # At the effective rate FSDP2's per-unit work is inside the rate already.
    assert calibrated_hardware(figures, "effective_flops").fsdp_unit_seconds == 0.0
    bare = calibrated_hardware(figures, per_kind=False, host=False)
    assert bare.op_links == {} and bare.dispatch_seconds == bare.dtensor_dispatch_seconds == 0.0


def test_per_kind_links_equal_to_the_shared_fit_predict_what_the_shared_fit_does():
    ns = {f"{r}x{c}x{b}": 1e-3 * b for g in bench_model_shapes("qwen2", "tiny") if g.muon
          for r, c in [g.shape] for b in range(1, g.count + 1)}
    shared = {"matmul_flops": 5e10, "effective_flops": 4e10, "elementwise_bytes": 5e9, "link_latency": 2e-4,
              "link_bandwidth": 1e9, "ns_seconds": ns,
              "link_kinds": {op: {"latency": 2e-4, "bandwidth": 1e9} for op in ("all_gather", "reduce_scatter",
                                                                             "all_to_all", "all_reduce")}}
    with_kinds = predict(shared, "qwen2", "tiny", 2, 64)
    without = predict(shared, "qwen2", "tiny", 2, 64, per_kind=False)
    for config in CONFIGS:
        assert with_kinds[config]["step_seconds"] == pytest.approx(without[config]["step_seconds"])
    # A slower reduce-scatter lengthens every configuration's forward+backward (FSDP2 reduce-scatters).
    slow = dict(shared, link_kinds=dict(shared["link_kinds"], reduce_scatter={"latency": 2e-4, "bandwidth": 3e8}))
    slower = predict(slow, "qwen2", "tiny", 2, 64)
    assert all(slower[c]["forward_backward_seconds"] > without[c]["forward_backward_seconds"] for c in CONFIGS)


def test_the_work_beyond_the_gemms_adds_to_forward_backward_at_the_matmul_rate_only():
    ns = {f"{r}x{c}x{b}": 1e-3 * b for g in bench_model_shapes("qwen2", "tiny") if g.muon
          for r, c in [g.shape] for b in range(1, g.count + 1)}
    figures = {"matmul_flops": 5e10, "effective_flops": 4e10, "elementwise_bytes": 5e9, "link_latency": 2e-4,
               "link_bandwidth": 1e9, "ns_seconds": ns, "non_gemm_seconds": 0.05, "fsdp_unit_seconds": 1e-3}
    split = predict(figures, "qwen2", "tiny", 2, 64)  # the default: gemms_and_rest
    gemms = predict(figures, "qwen2", "tiny", 2, 64, "matmul_flops")
    effective = predict(figures, "qwen2", "tiny", 2, 64, "effective_flops")
    without = predict(dict(figures, non_gemm_seconds=0.0), "qwen2", "tiny", 2, 64)
    assert effective == predict(dict(figures, non_gemm_seconds=0.0), "qwen2", "tiny", 2, 64, "effective_flops")
    for config in CONFIGS:
        assert gemms[config]["step_seconds"] == pytest.approx(without[config]["step_seconds"])
        added = split[config]["forward_backward_seconds"] - gemms[config]["forward_backward_seconds"]
        if config in ("adamw", "gather"):  # gloo: FSDP2's collectives block the thread, so compute adds up
            assert added == pytest.approx(0.05)
        else:  # dmuon's exchanges in backward progress beside the compute: they may hide more of themselves
            assert 0.0 < added <= 0.05 + 1e-12
    # The matmul rate carries FSDP2's per-unit work, the effective rate has it inside.
    assert calibrated_hardware(figures).fsdp_unit_seconds == 1e-3
    assert calibrated_hardware(figures).compute_flops == 5e10
    with pytest.raises(ValueError, match="compute"):
        calibrated_hardware(figures, "svd_flops")


def _tiny_point(flops: float) -> dict:
    """One rank's measurement at one point for the qwen2 tiny model, its GEMMs at ``flops``."""
    ns = {f"{r}x{c}x{b}": 1e-3 * b for g in bench_model_shapes("qwen2", "tiny") if g.muon
          for r, c in [g.shape] for b in range(1, g.count + 1)}
    return {"matmul_flops": flops, "effective_flops": flops / 2, "elementwise_bytes": 5e9, "non_gemm_seconds": 0.01,
            "dispatch_seconds": 2e-6, "dtensor_dispatch_seconds": 2e-5, "dtensor_layout_seconds": 1e-4,
            "fsdp_unit_seconds": 1e-3, "unlisted_tensors": 5, "ns_seconds": ns,
            "link_samples": _samples("all_gather", 1e-4, 1e9) + _samples("reduce_scatter", 1e-4, 0.5e9)
            + _samples("all_to_all", 1e-4, 1e9) + _samples("all_reduce", 1e-4, 1e9)}


def test_each_round_is_predicted_at_the_figures_measured_around_it():
    # Three points (before round 0, between the rounds, after round 1) on two ranks; rank 1 is faster.
    rates = [2e10, 2e10, 8e10]
    per_rank = [[_tiny_point(f) for f in rates], [_tiny_point(2 * f) for f in rates]]
    result = predict_by_round(per_rank, 2, "qwen2", "tiny", 64)
    rounds = [predict(combine([r[k:k + 2] for r in per_rank], 2), "qwen2", "tiny", 2, 64) for k in range(2)]
    for config in CONFIGS:
        for key in ("step_seconds", "forward_backward_seconds", "optimizer_seconds"):
            by_hand = [p[config][key] for p in rounds]
            assert [r[key] for r in result[config]["by_round"]] == pytest.approx(by_hand)
            assert result[config][key] == pytest.approx(sum(by_hand) / 2)  # the median of two rounds
    # Round 0 ran at the slower rank's 2e10 on both sides, round 1 between 2e10 and 8e10 (their mean, 5e10).
    assert rounds[0]["adamw"]["step_seconds"] > rounds[1]["adamw"]["step_seconds"]
    # At the run's mean figures (4e10) every round is priced at one rate: shorter than the rounds' median,
    # as the mean of 1 / rate exceeds 1 / (the mean rate).
    at_mean = predict(combine(per_rank, 2), "qwen2", "tiny", 2, 64)
    assert all(result[c]["step_seconds"] > at_mean[c]["step_seconds"] for c in CONFIGS)
    # A machine that holds still: the rounds' median is the prediction at the mean figures.
    still = [[_tiny_point(3e10)] * 3, [_tiny_point(6e10)] * 3]
    steady, mean = predict_by_round(still, 2, "qwen2", "tiny", 64), predict(combine(still, 2), "qwen2", "tiny", 2, 64)
    assert all(steady[c]["step_seconds"] == pytest.approx(mean[c]["step_seconds"]) for c in CONFIGS)
    with pytest.raises(ValueError, match="point before and after"):
        predict_by_round([[_tiny_point(2e10)], [_tiny_point(2e10)]], 2, "qwen2", "tiny", 64)


def test_fsdp2s_work_on_the_ranks_own_mesh_from_the_twin():
    import torch

    from dmuon.bench.models import build_workload

    figures = combine([[_tiny_point(3e10)], [_tiny_point(3e10)]], 2)
    assert rank_unit_seconds(figures, "qwen2", 2) == 0.0  # no twin measured: nothing added
    twin = dict(figures, twin_plain_seconds=0.004, twin_units=3)
    # What the twin's measured forward+backward exceeds its prediction by, over its 3 units x 2 passes.
    slow, slower = (rank_unit_seconds(dict(twin, twin_world_seconds=t), "qwen2", 2) for t in (10.0, 10.06))
    assert slow > 0.0 and slower - slow == pytest.approx(0.06 / 6)
    assert rank_unit_seconds(dict(twin, twin_world_seconds=1e-6), "qwen2", 2) == 0.0  # the prediction is not short
    # The check adds it to FSDP2's one-rank figure per unit and pass: every configuration's forward and
    # backward is one unit figure per unit and pass longer (gloo: FSDP2's work blocks the rank's thread).
    with torch.device("meta"):
        units = len(build_workload("qwen2", size="tiny").blocks) + 1
    base = predict(dict(figures, rank_unit_seconds=0.0), "qwen2", "tiny", 2, 64)
    more = predict(dict(figures, rank_unit_seconds=2e-3), "qwen2", "tiny", 2, 64)
    for config in ("adamw", "gather"):
        added = more[config]["forward_backward_seconds"] - base[config]["forward_backward_seconds"]
        assert added == pytest.approx(2 * units * 2e-3)
    # Measured, it is what the check uses; the matmul-only and effective-rate predictions leave it out.
    measured = dict(twin, twin_world_seconds=10.0)
    assert predict(measured, "qwen2", "tiny", 2, 64)["adamw"]["step_seconds"] == pytest.approx(
        predict(dict(figures, rank_unit_seconds=slow), "qwen2", "tiny", 2, 64)["adamw"]["step_seconds"])
    assert predict(measured, "qwen2", "tiny", 2, 64, "matmul_flops") == predict(figures, "qwen2", "tiny", 2, 64,
                                                                               "matmul_flops")


def test_a_pair_is_ordered_only_when_every_round_agrees():
    assert separated([1.0, 2.0, 3.0], [2.0, 3.0, 4.0]) == -1
    assert separated([3.0, 4.0], [1.0, 2.0]) == 1
    assert separated([1.0, 5.0, 3.0], [2.0, 3.0, 4.0]) == 0   # the rounds disagree: a tie
    assert separated([1.0], [2.0]) == 0                       # one round decides nothing
    assert separated([1.0, 2.0], [1.0, 3.0]) == 0             # an equal round is no evidence


def _measured(rounds: dict[str, list[float]]) -> dict:
    return {c: {"step_s": sorted(r)[len(r) // 2], "fwd_bwd_s": 1.0, "optimizer_s": 0.1, "step_s_by_round": r}
            for c, r in rounds.items()}


def test_orders_agree_when_no_separated_pair_is_reversed():
    # gather is slower than everything in every round; adamw and the dmuon pair swap between rounds (ties).
    measured = _measured({"adamw": [4.0, 5.0, 4.5], "gather": [9.0, 9.5, 9.2], "dmuon_z2": [4.2, 4.8, 4.1],
                          "dmuon_z3": [4.9, 4.4, 4.6]})
    predicted = {c: {"step_seconds": s, "forward_backward_seconds": 1.0, "optimizer_seconds": 0.1}
                 for c, s in (("adamw", 3.9), ("gather", 8.0), ("dmuon_z2", 4.0), ("dmuon_z3", 4.3))}
    check = order_check(measured, predicted)
    assert check["separated"] == 3 and check["agree"] and not check["same_order"]
    # gather predicted the fastest: the three pairs with it disagree.
    predicted["gather"]["step_seconds"] = 1.0
    check = order_check(measured, predicted)
    assert not check["agree"] and len(check["disagree"]) == 3


def test_compare_errors_orders_and_the_20_percent_verdict():
    measured = _measured({"adamw": [10.0, 10.0], "gather": [20.0, 20.0], "dmuon_z2": [11.0, 11.0],
                          "dmuon_z3": [12.0, 12.0]})
    predicted = {c: {"step_seconds": m["step_s"] * 0.9, "forward_backward_seconds": 1.0, "optimizer_seconds": 0.11}
                 for c, m in measured.items()}
    result = compare(measured, predicted)
    assert result["configs"]["adamw"]["step"]["error"] == pytest.approx(-0.1)
    assert result["configs"]["gather"]["optimizer"]["error"] == pytest.approx(0.1)
    assert result["same_order"] and result["order"]["agree"] and result["within_20_percent"]
    predicted["gather"]["optimizer_seconds"] = 0.05
    assert not compare(measured, predicted)["within_20_percent"]


def test_each_code_paths_host_time_from_its_twin():
    import torch

    from dmuon.bench.models import build_workload

    figures = combine([[_tiny_point(3e10)], [_tiny_point(3e10)]], 2)
    assert path_host_factors(figures, "qwen2", 2) == {}  # no twin measured: every path at the host figures
    with torch.device("meta"):
        tiny = build_workload("qwen2", size="tiny")
    tokens = tiny.tokens_per_rank
    # The twin of the tiny model is itself: its prediction without host work and with it, by hand, with its
    # own parameter tensors outside the shape lists (the figures hold the bench model's count, 5 here).
    own = len(list(tiny.model.parameters())) - sum(g.count for g in bench_model_shapes("qwen2", "tiny"))
    assert own != figures["unlisted_tensors"]
    twin = dict(figures, twin_ns_seconds=figures["ns_seconds"], rank_unit_seconds=0.0, host_factors={},
                unlisted_tensors=own)
    paths = TWIN_PATHS
    bare = predict(twin, "qwen2", "tiny", 2, tokens, host=False, configs=paths)
    priced = predict(twin, "qwen2", "tiny", 2, tokens, configs=paths)
    host = {c: priced[c]["optimizer_seconds"] - bare[c]["optimizer_seconds"] for c in paths}
    assert all(h > 0 for h in host.values())
    factor = {"adamw": 0.5, "gather": 1.8, "dmuon_z3": 2.5}
    measured = {c: bare[c]["optimizer_seconds"] + factor[c] * host[c] for c in paths}
    found = path_host_factors(dict(figures, twin_ns_seconds=figures["ns_seconds"], twin_optimizer_seconds=measured),
                              "qwen2", 2)
    assert found == pytest.approx(factor)
    # The bench model's count of tensors outside its shape lists does not enter the twin's factors.
    for count in (0, 50):
        assert path_host_factors(dict(figures, unlisted_tensors=count, twin_ns_seconds=figures["ns_seconds"],
                                      twin_optimizer_seconds=measured), "qwen2", 2) == pytest.approx(factor)
    # A twin faster than its prediction without any host work: no host time at all.
    fast = {c: 0.5 * bare[c]["optimizer_seconds"] for c in paths}
    assert path_host_factors(dict(twin, twin_optimizer_seconds=fast, host_factors=None), "qwen2", 2) == \
        pytest.approx(dict.fromkeys(paths, 0.0))
    # The prediction prices each path's host work that many times: on gloo host and device add up, so
    # adamw's optimizer phase (one elementwise task) grows by (factor - 1) x its host time, exactly.
    base = predict(twin, "qwen2", "tiny", 2, tokens)
    scaled = predict(dict(twin, host_factors={"adamw": 3.0}), "qwen2", "tiny", 2, tokens)
    assert scaled["adamw"]["optimizer_seconds"] - base["adamw"]["optimizer_seconds"] == pytest.approx(2 * host["adamw"])
    assert all(scaled[c] == base[c] for c in ("gather", "dmuon_z2", "dmuon_z3"))
    # Both dmuon configurations run the same step(): dmuon_z3's twin prices dmuon_z2's too.
    dmuon = predict(dict(twin, host_factors={"dmuon_z3": 2.0}), "qwen2", "tiny", 2, tokens)
    for config in ("dmuon_z2", "dmuon_z3"):
        assert dmuon[config]["optimizer_seconds"] > base[config]["optimizer_seconds"]
    assert dmuon["adamw"] == base["adamw"]
    # Measured, the factors are what the check uses (computed from the figures when not given).
    with_twin = dict(figures, twin_ns_seconds=figures["ns_seconds"], twin_optimizer_seconds=measured,
                     rank_unit_seconds=0.0)
    assert predict(with_twin, "qwen2", "tiny", 2, tokens)["gather"] == predict(
        dict(with_twin, host_factors=found), "qwen2", "tiny", 2, tokens)["gather"]
