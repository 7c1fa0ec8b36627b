"""`dmuon plan` with balancer choices, measured cost files and the comparison table."""

from __future__ import annotations

import json

import pytest

from dmuon.bench import plan_cli
from dmuon.bench.shapes import full_size_shapes
from dmuon.costmodel.offline import expand, plan_offline
from dmuon.plan.profile import load_costs_json

SHAPES = [{"name": "a", "shape": [64, 256], "count": 5}, {"name": "b", "shape": [256, 64], "count": 2},
          {"name": "c", "shape": [32, 32], "count": 3}]


def _write(tmp_path, name, payload):
    path = tmp_path / name
    path.write_text(payload if isinstance(payload, str) else json.dumps(payload))
    return str(path)


@pytest.mark.parametrize("payload,message", [
    ("{oops", "invalid JSON"),
    ({"shape": [1, 2]}, "expected a JSON list"),
    ([{"shape": [8, 8], "batch": 1, "seconds": 0.1}, 3], "entry 1: expected an object"),
    ([{"shape": [8, 8], "batch": 1}], "entry 0: missing field 'seconds'"),
    ([{"shape": [8, 8], "batch": 1, "seconds": 0.1, "device": "x"}], "entry 0: unknown field 'device'"),
    ([{"shape": [8], "batch": 1, "seconds": 0.1}], "entry 0: field 'shape'"),
    ([{"shape": [8, 0], "batch": 1, "seconds": 0.1}], "entry 0: field 'shape'"),
    ([{"shape": [8, 8], "batch": 0, "seconds": 0.1}], "entry 0: field 'batch'"),
    ([{"shape": [8, 8], "batch": True, "seconds": 0.1}], "entry 0: field 'batch'"),
    ([{"shape": [8, 8], "batch": 1, "seconds": -1}], "entry 0: field 'seconds'"),
    ([{"shape": [8, 8], "batch": 1, "seconds": "0.1"}], "entry 0: field 'seconds'"),
    ([{"shape": [8, 8], "batch": 1, "seconds": 0.1}, {"shape": [8, 8], "batch": 1, "seconds": 0.2}],
     "entry 1: duplicate"),
])
def test_costs_loader_names_the_entry_and_field(tmp_path, payload, message):
    path = _write(tmp_path, "costs.json", payload)
    with pytest.raises(ValueError, match=message):
        load_costs_json(path)


def test_cli_reports_cost_errors_and_missing_shapes(tmp_path, capsys):
    shapes = _write(tmp_path, "shapes.json", SHAPES)
    bad = _write(tmp_path, "bad.json", [{"shape": [64, 256], "batch": 1, "seconds": "x"}])
    assert plan_cli.main(["--shapes", shapes, "--costs", bad]) == 2
    assert "entry 0: field 'seconds'" in capsys.readouterr().err
    partial = _write(tmp_path, "partial.json", [{"shape": [64, 256], "batch": 1, "seconds": 1.0}])
    assert plan_cli.main(["--shapes", shapes, "--costs", partial]) == 2
    assert "(32, 32)" in capsys.readouterr().err
    assert plan_cli.main(["--shapes", shapes, "--costs", str(tmp_path / "nope.json")]) == 2


def test_measured_costs_with_batches_drive_the_plan(tmp_path):
    shapes = _write(tmp_path, "shapes.json", SHAPES)
    # Batches of "a" are nearly free after the first: the MILP should exploit it.
    costs = [{"shape": [64, 256], "batch": b, "seconds": 1.0 + 0.1 * (b - 1)} for b in range(1, 6)]
    costs += [{"shape": [256, 64], "batch": 1, "seconds": 0.9}, {"shape": [32, 32], "batch": 1, "seconds": 0.2}]
    cost_file = _write(tmp_path, "costs.json", costs)
    out = tmp_path / "plan.json"
    assert plan_cli.main(["--shapes", shapes, "--costs", cost_file, "--world-size", "3", "--balancer", "all",
                          "--memory-factor", "none", "--json", str(out)]) == 0
    plan = json.loads(out.read_text())
    assert {"world_size", "balancer", "makespan", "mean", "imbalance", "ranks"} <= plan.keys()
    assert plan["cost_unit"] == "seconds" and plan["cost_source"] == "file"
    rows = {r["balancer"]: r for r in plan["comparison"]}
    assert set(rows) == {"round_robin", "lpt", "milp"}
    # LPT only sees batch-1 costs, so here it even loses to round-robin.
    assert rows["milp"]["makespan"] < rows["round_robin"]["makespan"] < rows["lpt"]["makespan"]
    # All five "a" in one batch (1.4 s) beats any split LPT makes over three ranks.
    assert rows["milp"]["makespan"] == pytest.approx(1.4)
    assert plan["balancer"] == "milp"
    a_batches = [b["sizes"] for r in plan["ranks"] for b in r["batches"] if b["shape"] == [64, 256]]
    assert a_batches == [[5]]
    assert sum(len(r["matrices"]) for r in plan["ranks"]) == 10

    # The default memory limit forbids holding five of the seven large matrices.
    assert plan_cli.main(["--shapes", shapes, "--costs", cost_file, "--world-size", "3", "--balancer", "milp",
                          "--json", str(out)]) == 0
    capped = json.loads(out.read_text())
    assert max(r["state_bytes"] for r in capped["ranks"]) <= capped["memory_cap"] == 3 * 64 * 256 * 4
    assert capped["makespan"] > 1.4 and any("memory cap raised" in n for n in capped["notes"])


def test_single_balancer_keeps_the_plan_fields(tmp_path, capsys):
    shapes = _write(tmp_path, "shapes.json", SHAPES)
    out = tmp_path / "plan.json"
    assert plan_cli.main(["--shapes", shapes, "--world-size", "4", "--balancer", "milp", "--analytical",
                          "--memory-factor", "none", "--json", str(out)]) == 0
    plan = json.loads(out.read_text())
    assert plan["balancer"] == "milp" and plan["cost_source"] == "analytical" and plan["memory_cap"] is None
    assert plan["makespan"] == max(r["cost"] for r in plan["ranks"])
    assert "imbalance" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        plan_cli.main(["--shapes", shapes, "--memory-factor", "0.5"])


@pytest.mark.parametrize("model", ["qwen2.5-7b", "pi0"])
def test_full_size_lists_milp_never_worse(model):
    groups = full_size_shapes(model)
    n = len(expand(groups))
    for world_size in (8, 64):
        got = {b: plan_offline(groups, world_size, b, time_limit_s=2.0, memory_factor=None)
               for b in ("round_robin", "lpt", "milp")}
        assert got["milp"]["makespan"] <= got["lpt"]["makespan"] * (1 + 1e-12)
        assert got["lpt"]["makespan"] <= got["round_robin"]["makespan"]
        assert sum(len(r["matrices"]) for r in got["milp"]["ranks"]) == n
        assert got["milp"]["lower_bound"] <= got["milp"]["makespan"] * (1 + 1e-9)


def test_profile_save_and_reuse(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DMUON_CACHE_DIR", str(tmp_path / "cache"))
    shapes = _write(tmp_path, "shapes.json", [{"name": "a", "shape": [8, 16], "count": 3},
                                              {"name": "b", "shape": [16, 4], "count": 1}])
    saved = tmp_path / "costs.json"
    args = ["--shapes", shapes, "--world-size", "2", "--ns-dtype", "float32", "--ns-steps", "2"]
    assert plan_cli.main(args + ["--profile", "--max-batch", "2", "--save-costs", str(saved)]) == 0
    assert "profiled 3 entries" in capsys.readouterr().out
    records = json.loads(saved.read_text())
    assert sorted((tuple(r["shape"]), r["batch"]) for r in records) == [((8, 16), 1), ((8, 16), 2), ((16, 4), 1)]
    out = tmp_path / "plan.json"
    # Without --costs the cache written above is found; --analytical and another NS setting skip it.
    assert plan_cli.main(args + ["--json", str(out)]) == 0
    assert json.loads(out.read_text())["cost_source"] == "cache"
    assert plan_cli.main(args + ["--analytical", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["cost_source"] == "analytical"
    assert plan_cli.main(args[:-2] + ["--ns-steps", "3", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["cost_source"] == "analytical"
    assert plan_cli.main(args + ["--costs", str(saved), "--json", str(out)]) == 0
    plan = json.loads(out.read_text())
    assert plan["cost_source"] == "file" and plan["cost_unit"] == "seconds"
