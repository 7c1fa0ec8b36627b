"""``dmuon bench --calibrate`` on real ranks: every figure is measured, in its units, and the command it
prints runs ``dmuon plan --simulate`` on them (timings are not checked: 2 shared cores)."""

from __future__ import annotations

import json
import math
import shlex

import pytest

from dmuon.bench import calibrate, plan_cli
from dmuon.bench.calibrate_fit import LINK_KINDS, RATES, SECONDS
from dmuon.bench.calibrate_meter import LINK_SIZES, muon_counts
from dmuon.bench.shapes import bench_model_shapes

MODEL, SIZE, WORLD = "qwen2", "tiny", 2


def _check_rank(m: dict, ns_keys: set[str]) -> None:
    for key in RATES:
        assert m[key] > 0 and math.isfinite(m[key]), key
    for key in SECONDS:
        assert m[key] >= 0 and math.isfinite(m[key]), key
    assert m["device"] == "cpu"
    assert set(m["ns_seconds"]) == ns_keys and all(t > 0 for t in m["ns_seconds"].values())
    # Every collective kind at every size, each sample's bytes as the step model counts what a rank sends.
    for op in LINK_KINDS:
        if op in m["unsupported"]:
            continue
        sent = sorted(s for kind, s, _ in m["link_samples"] if kind == op)
        factor = 2 if op == "all_reduce" else 1
        assert sent == [factor * n * (WORLD - 1) for n in LINK_SIZES], op
    assert all(t > 0 for _, _, t in m["link_samples"])
    assert set(m["unsupported"]) <= set(LINK_KINDS)


def test_every_figure_is_measured_and_the_printed_command_runs(tmp_path, capsys):
    out, costs = tmp_path / "calibration.json", tmp_path / "costs.json"
    assert calibrate.main(["--model", MODEL, "--size", SIZE, "--world-size", str(WORLD), "--repeats", "1",
                           "--save-costs", str(costs), "--json", str(out)]) == 0
    payload = json.loads(out.read_text())
    assert payload["world_size"] == WORLD and len(payload["per_rank"]) == WORLD
    # One NS entry per Muon shape and batch size the owners can be handed: 1 up to that shape's matrices.
    counts = muon_counts(bench_model_shapes(MODEL, SIZE))
    ns_keys = {f"{r}x{c}x{b}" for (r, c), n in counts.items() for b in range(1, n + 1)}
    assert ns_keys, "the model has Muon matrices"
    for m in payload["per_rank"]:
        _check_rank(m, ns_keys)
    figures = payload["figures"]
    assert figures["ns_flops"] > 0 and figures["link_bandwidth"] > 0 and figures["link_latency"] >= 0
    # The command is printed as run: `dmuon plan` takes it, with the NS seconds just written.
    printed = capsys.readouterr().out
    command = payload["command"]
    assert shlex.join(command) in printed and command[:2] == ["dmuon", "plan"]
    assert command[command.index("--costs") + 1] == str(costs)
    plan_json = tmp_path / "plan.json"
    assert plan_cli.main(command[2:] + ["--json", str(plan_json)]) == 0
    hardware = json.loads(plan_json.read_text())["simulation_model"]["hardware"]
    assert hardware["compute_flops"] == pytest.approx(figures["effective_flops"], rel=1e-5)
    assert hardware["intra_bandwidth"] == pytest.approx(figures["link_bandwidth"], rel=1e-5)
