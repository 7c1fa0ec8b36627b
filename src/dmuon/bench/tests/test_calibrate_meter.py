"""``dmuon bench --calibrate``'s measurements on real ranks: every figure the fit reads is measured, in
its units, and the fit predicts every configuration from them (timings are not checked: 2 shared cores)."""

from __future__ import annotations

import math

import torch

from dmuon.bench.calibrate import _measure
from dmuon.bench.calibrate_fit import CONFIGS, LINK_KINDS, RATES, TWIN_PATHS, combine, path_host_factors, predict
from dmuon.bench.calibrate_meter import LINK_SIZES, _muon_counts
from dmuon.bench.models import build_workload
from dmuon.bench.shapes import bench_model_shapes
from support.spawn import run_distributed

MODEL, SIZE, WORLD = "qwen2", "tiny", 2


def test_every_figure_the_fit_reads_is_measured_on_every_rank():
    with torch.device("meta"):
        tokens = build_workload(MODEL, size=SIZE).tokens_per_rank
    per_rank = run_distributed(_measure, WORLD, MODEL, SIZE, tokens, 1, timeout_s=600)
    assert len(per_rank) == WORLD and all(len(points) == 1 for points in per_rank)
    groups = bench_model_shapes(MODEL, SIZE)
    # One NS entry per Muon shape and batch size the owners can be handed: 1 up to that shape's matrices.
    ns_keys = {f"{r}x{c}x{b}" for (r, c), n in _muon_counts(groups).items() for b in range(1, n + 1)}
    assert ns_keys, "the model has Muon matrices"
    for points in per_rank:
        m = points[0]
        for key in RATES[:3]:
            assert m[key] > 0 and math.isfinite(m[key]), key
        for key in RATES[3:]:
            assert m[key] >= 0 and math.isfinite(m[key]), key
        assert m["twin_plain_seconds"] > 0 and m["twin_world_seconds"] > 0
        assert set(m["ns_seconds"]) == ns_keys and all(t > 0 for t in m["ns_seconds"].values())
        assert set(m["twin_ns_seconds"]) == ns_keys  # the twin of the tiny model is the tiny model
        assert set(m["twin_optimizer_seconds"]) == set(TWIN_PATHS)
        assert all(t > 0 for t in m["twin_optimizer_seconds"].values())
        # Every collective kind at every size, each sample's bytes as the step model counts what a rank sends.
        for op in LINK_KINDS:
            if op in m["unsupported"]:
                continue
            sent = sorted(s for kind, s, _ in m["link_samples"] if kind == op)
            factor = 2 if op == "all_reduce" else 1
            assert sent == [factor * n * (WORLD - 1) for n in LINK_SIZES], op
        assert all(t > 0 for _, _, t in m["link_samples"])
        assert set(m["unsupported"]) <= set(LINK_KINDS)
    figures = combine(per_rank, WORLD)
    assert set(path_host_factors(figures, MODEL, WORLD)) <= set(TWIN_PATHS)
    predicted = predict(figures, MODEL, SIZE, WORLD, tokens)
    assert set(predicted) == set(CONFIGS)
    for config, p in predicted.items():
        assert 0 < p["optimizer_seconds"] < p["step_seconds"] and math.isfinite(p["step_seconds"]), config
