"""``dmuon bench --calibrate``'s arithmetic on constructed samples (no ranks spawned, nothing timed)."""

from __future__ import annotations

import json

import pytest

from dmuon.bench import plan_cli
from dmuon.bench.calibrate_fit import (
    combine,
    compute_flags,
    costs_records,
    fit_link,
    fit_links,
    fit_shared_link,
    link_messages,
    ns_rate,
    plan_flags,
)
from dmuon.plan.cost import gram_ns_flops, ns_flops
from dmuon.plan.profile import load_costs_json

SIZES = (16384, 65536, 262144, 1048576, 4194304)


def _samples(op: str, latency: float, bandwidth: float, world: int = 2) -> list[tuple[str, int, float]]:
    """Exact samples of ``messages x latency + bytes / bandwidth`` at the calibration's sizes."""
    return [(op, n, link_messages(op, world) * latency + n / bandwidth) for n in SIZES]


def test_link_fit_recovers_latency_and_bandwidth():
    samples = [("all_gather", n, 2e-4 + n / 1e9) for n in SIZES]
    latency, bandwidth = fit_link(samples)
    assert latency == pytest.approx(2e-4) and bandwidth == pytest.approx(1e9)
    # No latency in the samples: the fit keeps none rather than a negative one.
    assert fit_link([("all_gather", n, n / 1e9 * (1.05 if n == SIZES[0] else 1.0)) for n in SIZES])[0] >= 0.0


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


def test_the_shared_fit_is_per_message_over_every_kind():
    # Every kind on one link: the shared fit recovers its latency per message, whatever each kind's count.
    for world in (2, 4):
        samples = [s for op in ("all_gather", "reduce_scatter", "all_to_all", "all_reduce")
                   for s in _samples(op, 1e-4, 2e9, world)]
        assert fit_shared_link(samples, world) == pytest.approx((1e-4, 2e9))


def _rank(flops: float, dispatch: float, ns: float) -> dict:
    return {"device": "cpu", "matmul_flops": flops, "effective_flops": flops / 2, "elementwise_bytes": 3 * flops,
            "non_gemm_seconds": 0.05, "fsdp_unit_seconds": 1e-3, "dispatch_seconds": dispatch,
            "dtensor_dispatch_seconds": 10 * dispatch, "dtensor_layout_seconds": 1e-4,
            "ns_seconds": {"4x4x1": ns, "4x4x2": 2 * ns}, "unsupported": {},
            "link_samples": _samples("all_gather", 1e-4, 1e9) + _samples("reduce_scatter", 1e-4, 0.5e9)}


def test_combine_takes_the_slower_rank_and_fits_every_kind():
    figures = combine([_rank(10.0, 2e-6, 1.0), _rank(20.0, 4e-6, 3.0)], world_size=2)
    assert figures["matmul_flops"] == 10.0 and figures["elementwise_bytes"] == 30.0   # the lower rate
    assert figures["dispatch_seconds"] == 4e-6 and figures["dtensor_dispatch_seconds"] == 10 * 4e-6  # the longer
    assert figures["ns_seconds"] == {"4x4x1": 3.0, "4x4x2": 6.0}
    assert figures["link_kinds"]["reduce_scatter"] == pytest.approx({"latency": 1e-4, "bandwidth": 0.5e9})
    assert figures["link_kinds"]["all_gather"] == pytest.approx({"latency": 1e-4, "bandwidth": 1e9})
    assert len(figures["link_samples"]) == 2 * 2 * len(SIZES)  # every rank's samples
    # One rank has no link: no link figures, and no link flags.
    alone = combine([dict(_rank(10.0, 2e-6, 1.0), link_samples=[])])
    assert "link_latency" not in alone and "link_kinds" not in alone
    assert "--intra-latency" not in plan_flags(dict(alone, ns_flops=1e9))


def test_the_ns_rate_counts_auto_flops_per_matrix():
    counts = {(64, 256): 3, (128, 128): 2}
    rate = 5e9
    ns = {f"{r}x{c}x1": min(ns_flops((r, c)), gram_ns_flops((r, c))) / rate for r, c in counts}
    assert ns_rate(ns, counts) == pytest.approx(rate)
    # Each shape weighted by its count: a slower shape that is more numerous pulls the rate further.
    slow = dict(ns, **{"64x256x1": 2 * ns["64x256x1"]})
    assert ns_rate(slow, counts) < ns_rate(slow, {(64, 256): 1, (128, 128): 2}) < rate


def test_costs_records_are_what_dmuon_plan_loads(tmp_path):
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(costs_records({"4x8x1": 0.5, "4x8x2": 0.9, "16x16x1": 2.0})))
    table = load_costs_json(str(path))
    assert (table[((4, 8), 1)], table[((4, 8), 2)], table[((16, 16), 1)]) == (0.5, 0.9, 2.0)


def _figures() -> dict:
    figures = combine([_rank(3e10, 2e-6, 1e-3), _rank(4e10, 3e-6, 2e-3)], world_size=2)
    figures["ns_flops"] = 2.5e10
    return figures


def test_the_flags_set_dmuon_plans_hardware_to_the_figures():
    figures = _figures()
    args = plan_cli.build_parser().parse_args(["--simulate", *plan_flags(figures)])
    hardware = plan_cli.hardware_from_args(args)
    assert hardware.compute_flops == pytest.approx(figures["effective_flops"], rel=1e-5)
    assert hardware.ns_flops == pytest.approx(2.5e10, rel=1e-5)
    assert hardware.elementwise_bytes == pytest.approx(figures["elementwise_bytes"], rel=1e-5)
    for key in ("dispatch_seconds", "dtensor_dispatch_seconds", "dtensor_layout_seconds"):
        assert getattr(hardware, key) == pytest.approx(figures[key], rel=1e-5), key
    assert hardware.fsdp_unit_seconds == 0.0  # inside the effective rate
    assert hardware.links.intra_latency == pytest.approx(figures["link_latency"], rel=1e-5)
    assert hardware.links.intra_bandwidth == pytest.approx(figures["link_bandwidth"], rel=1e-5)
    assert plan_cli.sim_options_from_args(args, None).non_gemm_seconds == 0.0


def test_the_gemms_alone_flags_carry_the_work_beside_them():
    figures = _figures()
    flags = plan_flags(figures, gemms_alone=True)
    assert flags[:len(compute_flags(figures, True))] == compute_flags(figures, True)
    args = plan_cli.build_parser().parse_args(["--simulate", *flags])
    hardware = plan_cli.hardware_from_args(args)
    assert hardware.compute_flops == pytest.approx(figures["matmul_flops"], rel=1e-5)
    assert hardware.fsdp_unit_seconds == pytest.approx(figures["fsdp_unit_seconds"], rel=1e-5)
    assert plan_cli.sim_options_from_args(args, None).non_gemm_seconds == pytest.approx(0.05, rel=1e-5)
