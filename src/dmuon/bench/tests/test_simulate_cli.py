"""``dmuon plan --simulate`` (no ranks spawned)."""

from __future__ import annotations

import json

import pytest

from dmuon.bench import plan_cli
from dmuon.costmodel.sim_config import HARDWARE_PRESETS
from dmuon.costmodel.simulate import SIM_STRATEGIES


def test_plan_simulate_json_and_overrides(tmp_path, capsys):
    out = tmp_path / "plan.json"
    argv = ["--model", "pi0", "--world-size", "16", "--ranks-per-node", "8", "--zero", "3", "--simulate"]
    assert plan_cli.main(argv + ["--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "one training step, simulated on every rank (h100" in printed
    plan = json.loads(out.read_text())
    assert set(plan["simulation"]) == set(SIM_STRATEGIES)
    for figures in plan["simulation"].values():
        assert {"step_seconds", "optimizer_seconds", "exposed_comm_seconds"} <= set(figures)
    assert plan["simulation_model"]["hardware"]["compute_flops"] == HARDWARE_PRESETS["h100"].compute_flops
    assert plan["simulation_model"]["tokens_per_gpu"] == 4096
    ratios = plan["simulation_ratios"]["dmuon"]
    assert ratios["step_vs_fsdp_adamw"] == pytest.approx(
        plan["simulation"]["dmuon"]["step_seconds"] / plan["simulation"]["fsdp_adamw"]["step_seconds"])
    # Every figure is overridable: half the compute rate doubles the forward+backward compute.
    slow = tmp_path / "slow.json"
    assert plan_cli.main(argv + ["--compute-tflops", "200", "--inter-bandwidth", "25", "--json", str(slow)]) == 0
    slow_plan = json.loads(slow.read_text())
    assert slow_plan["simulation"]["fsdp_adamw"]["compute_seconds"] == pytest.approx(
        2 * plan["simulation"]["fsdp_adamw"]["compute_seconds"])
    assert slow_plan["simulation_model"]["hardware"]["inter_bandwidth"] == 25e9
    assert slow_plan["step_comm_model"]["inter_bandwidth"] == 25e9  # the same links price step_comm
    # A800: its own links unless given.
    a800 = tmp_path / "a800.json"
    assert plan_cli.main(argv + ["--hardware", "a800", "--json", str(a800)]) == 0
    assert json.loads(a800.read_text())["simulation_model"]["hardware"]["intra_bandwidth"] == 200e9
    capsys.readouterr()
    assert plan_cli.main(argv + ["--sim-ns", "profile", "--analytical"]) == 2  # FLOPs are not seconds


def test_plan_simulate_scale_table(tmp_path, capsys):
    assert plan_cli.main(["--simulate", "--scale-table", "pi0", "--world-sizes", "8,16", "--zero", "3"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].startswith("| model | ranks | FSDP2 + AdamW | gather-then-compute | dmuon (replicate level)")
    assert [line.split(" | ")[1] for line in table[2:4]] == ["8", "16"]


def test_plan_simulate_host_figures_override_the_preset(tmp_path):
    argv = ["--model", "pi0", "--world-size", "8", "--zero", "3", "--simulate"]
    base, host = tmp_path / "base.json", tmp_path / "host.json"
    assert plan_cli.main(argv + ["--json", str(base)]) == 0
    assert plan_cli.main(argv + ["--dispatch-us", "5", "--dtensor-dispatch-us", "30", "--json", str(host)]) == 0
    base_plan, host_plan = json.loads(base.read_text()), json.loads(host.read_text())
    hardware = host_plan["simulation_model"]["hardware"]
    assert hardware["dispatch_seconds"] == pytest.approx(5e-6) and hardware["dtensor_dispatch_seconds"] == 30e-6
    assert "host overridden" in hardware["name"]
    assert base_plan["simulation_model"]["hardware"]["dispatch_seconds"] == 0.0  # the presets: no host work
    # gather-then-compute's per-matrix DTensor operations lengthen its optimizer phase.
    assert host_plan["simulation"]["gather"]["optimizer_seconds"] > base_plan["simulation"]["gather"]["optimizer_seconds"]


def test_plan_root_reshard_adds_the_roots_all_gather_to_every_strategys_backward(tmp_path, capsys):
    argv = ["--model", "qwen2.5-7b", "--world-size", "16", "--ranks-per-node", "8", "--zero", "3", "--simulate"]
    kept, again = tmp_path / "kept.json", tmp_path / "again.json"
    assert plan_cli.main(argv + ["--json", str(kept)]) == 0
    assert plan_cli.main(argv + ["--root-reshard", "--json", str(again)]) == 0
    assert "the root gathered again at the start of backward (--root-reshard)" in capsys.readouterr().out
    kept_plan, again_plan = json.loads(kept.read_text()), json.loads(again.read_text())
    assert again_plan["root_regathered"] and not kept_plan["root_regathered"]
    assert again_plan["simulation_model"]["root_regathered"]
    # The root (embedding and head, about 1.09e9 bf16 parameters) gathered over the node's 8 ranks again:
    # 7/8 of 2.18 GB at 450 GB/s, 4.24 ms, and 7 latencies of 10 us, exposed before the head's backward,
    # the same for everyone.
    for strategy, figures in again_plan["simulation"].items():
        added = figures["forward_backward_seconds"] - kept_plan["simulation"][strategy]["forward_backward_seconds"]
        assert 3.5e-3 < added < 5e-3, (strategy, added)


def test_plan_non_gemm_ms_adds_its_seconds_to_every_strategys_compute(tmp_path, capsys):
    argv = ["--model", "pi0", "--world-size", "8", "--zero", "3", "--simulate"]
    base, more = tmp_path / "base.json", tmp_path / "more.json"
    assert plan_cli.main(argv + ["--json", str(base)]) == 0
    assert plan_cli.main(argv + ["--non-gemm-ms", "30", "--json", str(more)]) == 0
    base_plan, more_plan = json.loads(base.read_text()), json.loads(more.read_text())
    assert more_plan["simulation_model"]["non_gemm_seconds"] == pytest.approx(0.030)
    for strategy, figures in more_plan["simulation"].items():
        assert figures["compute_seconds"] - base_plan["simulation"][strategy]["compute_seconds"] == \
            pytest.approx(0.030), strategy
    capsys.readouterr()
    assert plan_cli.main(argv + ["--non-gemm-ms", "-1"]) == 2
    assert "--non-gemm-ms" in capsys.readouterr().err


def test_plan_simulate_trace_and_its_picture(tmp_path, capsys):
    """``--trace``: the simulated step of dmuon and FSDP2 + AdamW as a Chrome trace (the first node's ranks),
    whose steps are the simulation table's; the picture of it is a PNG; --json holds no trace."""
    from dmuon.bench import trace_plot

    trace_path, out, png = tmp_path / "step.json", tmp_path / "plan.json", tmp_path / "step.png"
    argv = ["--model", "pi0", "--world-size", "16", "--ranks-per-node", "8", "--zero", "3", "--simulate"]
    assert plan_cli.main(argv + ["--trace", str(trace_path), "--json", str(out)]) == 0
    assert f"wrote {trace_path}" in capsys.readouterr().out
    trace, plan = json.loads(trace_path.read_text()), json.loads(out.read_text())
    assert "simulation_trace" not in plan
    assert trace["otherData"]["ranks_shown"] == list(range(8))
    for strategy in ("dmuon", "fsdp_adamw"):
        assert trace["otherData"]["last_task_end_ms"][strategy] == pytest.approx(
            plan["simulation"][strategy]["step_seconds"] * 1e3)
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert {"dmuon rank 0", "FSDP2 + AdamW rank 7"} <= names
    assert trace_plot.main([str(trace_path), str(png), "--rank", "3"]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert trace_plot.main([str(trace_path), str(tmp_path / "x.png"), "--rank", "9"]) == 2  # not drawn
    # Choices, and what --trace refuses.
    two = tmp_path / "two.json"
    assert plan_cli.main(argv + ["--trace", str(two), "--trace-strategies", "dmuon_nfwd",
                                 "--trace-ranks", "0,15"]) == 0
    assert json.loads(two.read_text())["otherData"]["ranks_shown"] == [0, 15]
    capsys.readouterr()
    assert plan_cli.main(argv[:-1] + ["--trace", str(two)]) == 2
    assert "add --simulate" in capsys.readouterr().err
    assert plan_cli.main(argv + ["--trace", str(two), "--trace-strategies", "adam"]) == 2
    assert plan_cli.main(argv + ["--trace", str(two), "--trace-ranks", "16"]) == 2


@pytest.mark.slow  # the recommender over every layout; src/dmuon/costmodel/tests/test_recommend.py tests it by default
def test_plan_recommend(tmp_path, capsys):
    """``--recommend``: the fastest configuration as code, against FSDP2 + AdamW, with what it asks; the
    candidates in --json, the printed one among them."""
    out = tmp_path / "rec.json"
    assert plan_cli.main(["--model", "pi0", "--world-size", "16", "--ranks-per-node", "8", "--zero", "3",
                          "--analytical", "--recommend", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    rec = json.loads(out.read_text())
    best = rec["recommended"]
    assert rec["mesh"] == [2, 8] and len(rec["candidates"]) == 3 * 4  # 3 balancers x 4 (layout, execution)
    assert f"layout {best['layout']}, ExecutionConfig: {best['execution']}, balancer {best['balancer']}" in printed
    assert (f"predicted step {best['step_seconds'] * 1e3:.1f} ms against FSDP2 + AdamW's "
            f"{rec['fsdp_adamw']['step_seconds'] * 1e3:.1f} ms") in printed
    assert 'init_device_mesh("cuda", (2, 8), mesh_dim_names=("replicate", "shard"))' in printed
    for text in best["asks"].values():
        assert text in printed
    assert plan_cli.main(["--model", "pi0", "--world-size", "16", "--ranks-per-node", "3", "--recommend"]) == 2
