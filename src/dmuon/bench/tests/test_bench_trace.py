"""``dmuon bench --trace DIR``: a torch.profiler trace of one more step per configuration and rank."""

from __future__ import annotations

import json

from dmuon.bench import cli


def test_bench_trace_writes_each_configurations_step(tmp_path, capsys):
    out = tmp_path / "traces"
    argv = ["--model", "tiny", "--world-size", "2", "--configs", "adamw,dmuon_z3", "--steps", "1", "--warmup", "1",
            "--rounds", "1", "--quiet", "--json", str(tmp_path / "bench.json")]
    assert cli.main(argv + ["--trace", str(out)]) == 0
    assert f"wrote torch.profiler traces to {out}/" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == [f"{c}-rank{k}.json" for c in ("adamw", "dmuon_z3") for k in (0, 1)]
    for k in (0, 1):
        names = {e["name"] for e in json.loads((out / f"dmuon_z3-rank{k}.json").read_text())["traceEvents"]}
        assert {"dmuon.step", "dmuon.launch", "dmuon.ns.batch", "dmuon.apply", "dmuon.adamw"} <= names
        adamw = {e["name"] for e in json.loads((out / f"adamw-rank{k}.json").read_text())["traceEvents"]}
        assert "Optimizer.step#AdamW.step" in adamw and not any(n.startswith("dmuon.") for n in adamw)
    # The results are the timed steps': one loss per step (warm-up and timed), the traced one left out.
    results = json.loads((tmp_path / "bench.json").read_text())["results"]
    assert all(len(r["losses"]) == 2 for r in results)
