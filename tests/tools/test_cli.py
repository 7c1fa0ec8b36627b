"""`dmuon bench` end to end in a short mode, and `dmuon plan` invariants."""

from __future__ import annotations

import json

import pytest

from dmuon.bench import cli as bench_cli
from dmuon.bench import plan_cli
from dmuon.bench.report import format_ratios, ratios
from dmuon.bench.runner import round_sizes
from dmuon.costmodel.offline import expand, plan_offline
from dmuon.costmodel.traffic import owner_traffic, shard_rows
from dmuon.bench.shapes import full_size_shapes, load_shapes_json

RESULT_FIELDS = {"config", "step_s", "step_s_min", "step_s_max", "optimizer_s", "fwd_bwd_s",
                 "bytes_per_step", "peak_mem_bytes", "final_loss"}


def test_bench_short_mode_writes_every_field(tmp_path):
    out = tmp_path / "bench.json"
    plot = tmp_path / "bench.png"
    code = bench_cli.main(["--model", "tiny", "--world-size", "2", "--steps", "1", "--warmup", "1",
                           "--configs", "adamw,adamw_local,gather,dmuon_z3", "--json", str(out),
                           "--plot", str(plot),
                           "--quiet"])
    assert code == 0
    payload = json.loads(out.read_text())
    assert {"machine", "world_size", "model", "results", "ratios"} <= payload.keys()
    assert payload["world_size"] == 2 and payload["model"] == "tiny"
    assert [r["config"] for r in payload["results"]] == ["adamw", "adamw_local", "gather", "dmuon_z3"]
    for r in payload["results"]:
        assert RESULT_FIELDS <= r.keys()
        assert r["step_s_min"] <= r["step_s"] <= r["step_s_max"]
        assert r["step_s"] == pytest.approx(r["fwd_bwd_s"] + r["optimizer_s"], rel=1e-6)
    # gather and dmuon run the same update rule from the same data.
    losses = {r["config"]: r["losses"] for r in payload["results"]}
    assert losses["gather"] == pytest.approx(losses["dmuon_z3"], rel=1e-4)
    # adamw_local is torch.optim.AdamW's kernel on the local shards: the same training.
    assert losses["adamw_local"] == pytest.approx(losses["adamw"], rel=1e-6)
    assert {"dmuon_z3_overhead_vs_adamw_pct", "dmuon_z3_overhead_vs_adamw_local_pct"} <= payload["ratios"].keys()
    assert payload["losses_agree"] is True
    assert plot.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow  # torchrun's launch of the bench; the spawned bench runs by default (test_bench_short_mode_writes_every_field)
def test_bench_under_torchrun(tmp_path):
    """``torchrun -m dmuon.bench``: the ranks are torchrun's, rank 0 writes the results, and every
    rank leaves cleanly (before the bench freed its models while the process groups lived, gloo's
    threads aborted a rank at interpreter exit in 3 of 8 runs on 4 ranks)."""
    import os
    import subprocess
    import sys

    out = tmp_path / "bench.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                           "-m", "dmuon.bench", "--model", "tiny", "--steps", "1", "--configs", "adamw,dmuon_z2",
                           "--quiet", "--json", str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "terminate called" not in done.stderr
    payload = json.loads(out.read_text())
    assert payload["world_size"] == 4
    assert [r["config"] for r in payload["results"]] == ["adamw", "dmuon_z2"]
    assert all(r["phases_on_one_clock"] for r in payload["results"])


def test_bench_on_an_hsdp_mesh(tmp_path):
    out = tmp_path / "hsdp.json"
    assert bench_cli.main(["--model", "tiny", "--world-size", "4", "--hsdp", "2", "--steps", "1",
                           "--warmup", "0", "--configs", "dmuon_z2", "--json", str(out), "--quiet",
                           "--sequential"]) == 0
    payload = json.loads(out.read_text())
    assert payload["mesh"] == [2, 2]
    assert payload["results"][0]["inter_bytes_per_step"] > 0


def test_bench_with_tensor_parallelism(tmp_path):
    """--tp 2: torch's parallelize_module on each decoder layer, FSDP2 over dp; dmuon and the
    gather oracle (fp32 NS) on the same TP model agree to fp32 round-off."""
    out = tmp_path / "tp.json"
    assert bench_cli.main(["--model", "tiny", "--world-size", "4", "--tp", "2", "--steps", "2", "--warmup", "1",
                           "--configs", "gather,dmuon_z3", "--ns-dtype", "float32", "--json", str(out),
                           "--quiet"]) == 0
    payload = json.loads(out.read_text())
    assert payload["mesh"] == [2, 2] and payload["losses_agree"]
    dmuon_run, gather_run = (next(r for r in payload["results"] if r["config"] == c) for c in ("dmuon_z3", "gather"))
    assert abs(dmuon_run["final_loss"] - gather_run["final_loss"]) <= 1e-5 * abs(gather_run["final_loss"])
    with pytest.raises(SystemExit, match="does not divide the world size"):
        bench_cli.main(["--model", "tiny", "--world-size", "4", "--tp", "3", "--quiet"])


def test_bench_moe_workload_orthogonalizes_each_expert(tmp_path):
    """--model moe: stacked expert weights; dmuon and gather-then-compute (both per expert) agree."""
    out = tmp_path / "moe.json"
    assert bench_cli.main(["--model", "moe", "--size", "tiny", "--world-size", "2", "--steps", "2", "--warmup", "1",
                           "--configs", "gather,dmuon_z3,torch_muon", "--ns-dtype", "float32", "--json", str(out),
                           "--quiet"]) == 0
    payload = json.loads(out.read_text())
    assert payload["losses_agree"] and "torch_muon" not in payload["loss_check"]
    dmuon_run = next(r for r in payload["results"] if r["config"] == "dmuon_z3")
    gather_run = next(r for r in payload["results"] if r["config"] == "gather")
    assert abs(dmuon_run["final_loss"] - gather_run["final_loss"]) <= 1e-5 * abs(gather_run["final_loss"])


def test_moe_workload_has_expert_stacks_dmuon_sees_one_by_one():
    import dmuon
    from dmuon.bench.models import build_workload

    w = build_workload("moe", size="tiny")
    names = [i.name for i in dmuon.prepare(w.model).infos]
    assert "model.layers.0.mlp.gate_proj[7]" in names and "model.layers.0.mlp.router.weight" in names
    assert sum(n.startswith("model.layers.0.mlp.down_proj[") for n in names) == 8


def test_interleaved_rounds_train_as_sequential_runs(tmp_path, monkeypatch):
    """Interleaving configurations on one process group must not change what each one computes. The NS tuning
    cache is the test's own: both runs then take the choices the first one measured, which another process
    tuning into the host's cache between them (a second test run beside this one) could otherwise change."""
    monkeypatch.setenv("DMUON_CACHE_DIR", str(tmp_path / "cache"))
    args = ["--model", "tiny", "--world-size", "2", "--steps", "3", "--rounds", "2", "--warmup", "1",
            "--configs", "adamw,dmuon_z2,dmuon_z3", "--quiet"]
    payloads = {}
    for mode in ("interleaved", "sequential"):
        out = tmp_path / f"{mode}.json"
        assert bench_cli.main(args + ["--json", str(out)] + (["--sequential"] if mode == "sequential" else [])) == 0
        payloads[mode] = json.loads(out.read_text())
    inter, seq = payloads["interleaved"], payloads["sequential"]
    assert inter["schedule"] == "interleaved, 2 rounds" and seq["schedule"] == "sequential"
    for a, b in zip(inter["results"], seq["results"]):
        assert a["config"] == b["config"]
        assert len(a["losses"]) == len(b["losses"]) == 4
        assert a["losses"] == pytest.approx(b["losses"], rel=1e-6)
        assert len(a["step_s_all"]) == 3 and len(a["step_s_by_round"]) == 2
    per_round = inter["ratios"]["dmuon_z2_overhead_vs_adamw_by_round_pct"]
    assert len(per_round) == 2
    by = {r["config"]: r for r in inter["results"]}
    expected = [100 * (a / b - 1) for a, b in zip(by["dmuon_z2"]["step_s_by_round"], by["adamw"]["step_s_by_round"])]
    assert per_round == pytest.approx(expected)


def test_round_sizes_split_steps_evenly():
    assert round_sizes(4, 2) == [2, 2]
    assert round_sizes(5, 3) == [2, 2, 1]
    assert round_sizes(2, 5) == [1, 1]


def test_bench_rejects_warmup_zero_when_interleaved():
    with pytest.raises(SystemExit, match="--warmup"):
        bench_cli.main(["--warmup", "0", "--quiet"])


def test_bench_rejects_a_size_the_model_lacks():
    with pytest.raises(SystemExit, match="--size mini for --model vla: size must be one of"):
        bench_cli.main(["--model", "vla", "--size", "mini", "--quiet"])


def test_calibration_ratio_is_torch_muons_optimizer_over_its_fwd_bwd():
    results = [
        {"config": "adamw", "step_s": 1.0, "optimizer_s": 0.1, "fwd_bwd_s": 0.9},
        {"config": "torch_muon", "step_s": 5.0, "optimizer_s": 4.2, "fwd_bwd_s": 0.8},
        {"config": "dmuon_z2", "step_s": 1.05, "optimizer_s": 0.15, "fwd_bwd_s": 0.9},
    ]
    r = ratios(results)
    assert r["torch_muon_optimizer_per_fwd_bwd"] == pytest.approx(5.25)
    assert r["dmuon_z2_overhead_vs_adamw_pct"] == pytest.approx(5.0)
    assert r["dmuon_z2_optimizer_speedup_vs_torch_muon"] == pytest.approx(28.0)
    assert "torch_muon_optimizer_per_fwd_bwd" not in ratios(results[::2])
    assert "torch_muon_optimizer_per_fwd_bwd: 5.25x" in format_ratios(r)


def test_bench_rejects_unknown_config():
    with pytest.raises(SystemExit, match="nope"):
        bench_cli.main(["--configs", "adamw,nope", "--quiet"])


@pytest.mark.parametrize("model,world_size", [("qwen2.5-7b", 8), ("pi0", 64), ("qwen2", 3), ("qwen2.5-7b", 1024)])
def test_plan_costs_sum_and_single_owner(model, world_size):
    groups = full_size_shapes(model)
    plan = plan_offline(groups, world_size)
    names = [n for r in plan["ranks"] for n in r["matrices"]]
    expected = [m.name for m in expand(groups)]
    assert sorted(names) == sorted(expected) and len(set(names)) == len(names)
    from dmuon.plan.cost import update_cost
    total = sum(update_cost(m.shape) for m in expand(groups))
    assert sum(r["cost"] for r in plan["ranks"]) == pytest.approx(total)
    assert plan["makespan"] == max(r["cost"] for r in plan["ranks"])
    assert plan["imbalance"] == pytest.approx(plan["makespan"] / plan["mean"])


def _one_d_bytes(shape, owner, rank, shard, elem):
    """dmuon's bytes each way on 1-D FSDP: rows to the owner, the update's rows back."""
    m, n = shape
    chunk = -(-m // shard)
    rows = [max(0, min(m, (s + 1) * chunk) - s * chunk) for s in range(shard)]
    return (m - rows[owner]) * n * elem if rank == owner else rows[rank] * n * elem


@pytest.mark.parametrize("ns_dtype,elem", [(None, 2), ("fp32", 4), ("float32", 4)])
def test_plan_cli_json(tmp_path, capsys, ns_dtype, elem):
    shapes = tmp_path / "shapes.json"
    # 64 and 256 rows over 3 ranks: uneven shards ([22, 22, 20] and [86, 86, 84]).
    shapes.write_text(json.dumps([{"name": "a", "shape": [64, 256], "count": 5},
                                  {"name": "b", "shape": [256, 64], "count": 2}]))
    out = tmp_path / "plan.json"
    dtype = [] if ns_dtype is None else ["--ns-dtype", ns_dtype]
    assert plan_cli.main(["--shapes", str(shapes), "--world-size", "3", "--analytical", "--json", str(out)]
                         + dtype) == 0
    plan = json.loads(out.read_text())
    assert {"world_size", "balancer", "makespan", "mean", "imbalance", "ranks"} <= plan.keys()
    assert sum(len(r["matrices"]) for r in plan["ranks"]) == 7
    assert plan["mesh"] == [1, 3] and plan["wire_bytes"] == elem
    owner = {name: r["rank"] for r in plan["ranks"] for name in r["matrices"]}
    shape = {m.name: m.shape for m in expand(load_shapes_json(str(shapes)))}
    for r in plan["ranks"]:
        expected = sum(_one_d_bytes(shape[k], owner[k], r["rank"], 3, elem) for k in shape)
        assert r["bytes_sent"] == r["bytes_received"] == r["intra_sent"] == expected
        assert r["inter_sent"] == r["inter_received"] == 0 and r["critical_bytes"] == expected
    crit = plan["critical_path_bytes"]
    assert crit["dmuon"] == max(r["bytes_sent"] for r in plan["ranks"])
    # FSDP2 (ZeRO-2: one all-gather, one reduce-scatter) of 7 * 16384 fp32 elements over 3 ranks.
    assert crit["fsdp2"] == 2 * 7 * 16384 * 2 // 3 * 4
    assert crit["gather_then_compute"] == 3 * 7 * 16384 * 2 // 3 * 4
    text = capsys.readouterr().out
    assert "imbalance" in text
    assert (f"critical path (most bytes one rank sends or receives per step): dmuon {crit['dmuon'] / 2**20:.1f} MiB"
            in text)


# 1024 ranks (128 replicas) under -m slow: planning its step's collectives takes about 10 s;
# [64] checks every figure below by default on 8 replicas of 8 ranks.
@pytest.mark.parametrize("world_size", [64, pytest.param(1024, marks=pytest.mark.slow)])
def test_plan_hsdp_traffic_levels(tmp_path, capsys, world_size):
    out = tmp_path / "hsdp.json"
    replicas = world_size // 8
    assert plan_cli.main(["--model", "qwen2.5-7b", "--world-size", str(world_size), "--ranks-per-node", "8",
                          "--json", str(out)]) == 0
    plan = json.loads(out.read_text())
    assert plan["mesh"] == [replicas, 8]
    ranks = plan["ranks"]
    mats = expand(full_size_shapes("qwen2.5-7b"))
    numel = sum(m.numel for m in mats)
    total = numel * 2  # bf16 on dmuon's wire
    # Across nodes (the replicate level, the runtime's on HSDP): each rank's fp32 gradient rows go, column
    # slice by column slice, to the other R - 1 replicas ((R - 1) / R of every matrix from each of the
    # R replicas: R - 1 copies in all); each matrix's update reaches the other R - 1 replicas once,
    # and the direction's column slices kept by the other replicas (the momentum's Shard(1) over
    # the replicas) reach the owner's replica once.
    owner = {name: r["rank"] for r in ranks for name in r["matrices"]}
    slices = sum((m.numel - m.shape[0] * shard_rows(m.shape[1], replicas)[owner[m.name] // 8]) * 2 for m in mats)
    assert (sum(r["inter_sent"] for r in ranks) == sum(r["inter_received"] for r in ranks)
            == (replicas - 1) * (numel * 4 + total) + slices)
    # Shard level: each matrix's rows off the owner go to it and come back once.
    intra = 0
    for m in mats:
        chunk = -(-m.shape[0] // 8)
        own_rows = max(0, min(m.shape[0], (owner[m.name] % 8 + 1) * chunk) - owner[m.name] % 8 * chunk)
        intra += 2 * (m.shape[0] - own_rows) * m.shape[1] * 2
    assert sum(r["intra_sent"] for r in ranks) == sum(r["intra_received"] for r in ranks) == intra
    assert all(r["bytes_sent"] == r["intra_sent"] + r["inter_sent"] for r in ranks)
    # FSDP2's HSDP gradient all-reduce crosses nodes; so does gather-then-compute's, no more.
    fsdp2, gather = plan["fsdp2_bytes_per_rank"], plan["gather_bytes_per_rank"]
    assert fsdp2["inter_sent"] == gather["inter_sent"] == 2 * (numel // 8) * (replicas - 1) // replicas * 4
    crit = plan["critical_path_bytes"]
    assert crit["dmuon"] == max(max(r["bytes_sent"], r["bytes_received"]) for r in ranks)
    native = owner_traffic([m.shape for m in mats], [owner[m.name] for m in mats], replicas, 8, 2)
    assert crit["dmuon_native_hsdp"] == max(t.busiest for t in native)
    assert crit["dmuon_native_hsdp"] < crit["dmuon"] < crit["fsdp2"] < crit["gather_then_compute"]
    # The replicate-level designs, inter level, Muon matrices: FSDP2's all-reduce on every
    # rank; (a) adds the update's R - 1 copies and the direction slices; (b) replaces the
    # all-reduce by the column reduce-scatter (R - 1 fp32 copies in all) and adds the same.
    designs = plan["hsdp_designs"]
    assert designs["fsdp2_adamw"]["inter"] == {"total": world_size * fsdp2["inter_sent"], "critical": fsdp2["inter_sent"]}
    assert designs["a"]["inter"]["total"] == world_size * fsdp2["inter_sent"] + (replicas - 1) * total + slices
    assert designs["b"]["inter"]["total"] == (replicas - 1) * (numel * 4 + total) + slices
    assert designs["a"]["inter"]["critical"] == fsdp2["inter_sent"] + max(
        max(t.inter_sent, t.inter_received) for t in native)
    assert designs["b"]["inter"]["critical"] == max(max(r["inter_sent"], r["inter_received"]) for r in ranks)
    assert designs["a"]["intra"] == designs["b"]["intra"]
    assert designs["a"]["intra"]["total"] == world_size * fsdp2["intra_sent"] + intra
    # The embedding and LM head are all-reduced alike under every design.
    other = sum(g.numel for g in full_size_shapes("qwen2.5-7b") if not g.muon)
    rest = 2 * (other // 8) * (replicas - 1) // replicas * 4
    assert designs["non_muon_all_reduce"] == {"total": world_size * rest, "critical": rest}
    for key in ("fsdp2_adamw", "a", "b"):
        whole = designs[key]["inter_whole_model"]
        assert whole == {"total": designs[key]["inter"]["total"] + world_size * rest,
                         "critical": designs[key]["inter"]["critical"] + rest}
    text = capsys.readouterr().out
    for label in ("FSDP2 + AdamW (gradient all-reduce): total", "native HSDP, dmuon_native_hsdp",
                  "replicate level, dmuon (gradient column reduce-scatter"):
        assert sum(line.lstrip().startswith(label) for line in text.splitlines()) == 1, label
    assert (f"replicate level, dmuon (gradient column reduce-scatter + update to the replicas): total "
            f"{designs['b']['inter']['total'] / 2**20:.1f} MiB" in text)


def test_plan_hsdp_designs_only_with_replicas(capsys):
    groups = full_size_shapes("pi0")
    assert "hsdp_designs" not in plan_offline(groups, 4, "round_robin")
    assert "hsdp_designs" not in plan_offline(groups, 8, "round_robin", ranks_per_node=8)
    plan = plan_offline(groups, 8, "round_robin", ranks_per_node=4)
    d = plan["hsdp_designs"]
    assert set(d) == {"fsdp2_adamw", "a", "b", "non_muon_all_reduce"}
    # Two replicas: per other replica 8 (FSDP2's fp32 all-reduce), 10 + 2/R and 6 + 2/R bytes per
    # element, up to the all-reduce's rounding of each rank's shard and the column split.
    mats = expand(groups)
    numel = sum(m.numel for m in mats)
    owner = {name: r["rank"] for r in plan["ranks"] for name in r["matrices"]}
    slices = sum((m.numel - m.numel // m.shape[1] * shard_rows(m.shape[1], 2)[owner[m.name] // 4]) * 2 for m in mats)
    assert slices == pytest.approx(numel, rel=0.01)
    assert d["a"]["inter"]["total"] - d["fsdp2_adamw"]["inter"]["total"] == numel * 2 + slices
    assert d["b"]["inter"]["total"] == numel * 4 + numel * 2 + slices
    assert d["fsdp2_adamw"]["inter"]["total"] == pytest.approx(numel * 8, abs=8 * 8)
    assert plan_cli.main(["--model", "pi0", "--world-size", "4", "--balancer", "round_robin"]) == 0
    text = capsys.readouterr().out
    assert "HSDP replicate level" not in text and "replicate level, dmuon (gradient" not in text


def test_plan_zero_changes_only_the_fsdp2_figures():
    groups = full_size_shapes("pi0")
    z2, z3 = (plan_offline(groups, 16, "round_robin", zero, ranks_per_node=4) for zero in (2, 3))
    assert [r["bytes_sent"] for r in z2["ranks"]] == [r["bytes_sent"] for r in z3["ranks"]]
    assert z2["critical_path_bytes"]["dmuon"] == z3["critical_path_bytes"]["dmuon"]
    numel = sum(m.numel for m in expand(groups))
    # ZeRO-3 all-gathers the weights once more, in backward: one more ring pass.
    assert z3["fsdp2_bytes_per_rank"]["intra_sent"] - z2["fsdp2_bytes_per_rank"]["intra_sent"] == pytest.approx(
        numel * 3 / 4 * 4, abs=8)
    with pytest.raises(ValueError, match="zero must be 2 or 3"):
        plan_offline(groups, 16, zero=1)


@pytest.mark.slow  # three balancers' benches; each balancer is tested by default in src/dmuon/plan/tests
def test_bench_balancer_sweep_with_profiled_costs(tmp_path, monkeypatch):
    monkeypatch.setenv("DMUON_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "sweep.json"
    assert bench_cli.main(["--model", "tiny", "--world-size", "2", "--steps", "1", "--warmup", "1",
                           "--configs", "adamw,dmuon_z2", "--balancer", "all", "--profile",
                           "--json", str(out), "--quiet"]) == 0
    payload = json.loads(out.read_text())
    names = [r["config"] for r in payload["results"]]
    assert names == ["adamw", "dmuon_z2@round_robin", "dmuon_z2@lpt", "dmuon_z2@milp"]
    assert "dmuon_z2@milp_overhead_vs_adamw_pct" in payload["ratios"]
    # Same update rule whatever the owners: the three dmuon runs end at the same loss.
    assert payload["losses_agree"] is True
    # The measured table went to the cache directory the later configurations read.
    assert any(p.name.startswith("plan-profile-") for p in (tmp_path / "cache").iterdir())


def test_plan_offline_blocks_are_the_root_and_one_per_layer():
    from dmuon.costmodel.offline import offline_blocks
    groups = load_shapes_json_text([{"name": "head", "shape": [8, 4], "count": 1},
                                    {"name": "layers.*.up", "shape": [8, 4], "count": 2},
                                    {"name": "layers.*.down", "shape": [4, 8], "count": 2},
                                    {"name": "vision.layers.*.fc", "shape": [4, 4], "count": 1}])
    mats = expand(groups)
    assert [m.name for m in mats] == ["head", "layers.*.up[0]", "layers.*.up[1]", "layers.*.down[0]",
                                      "layers.*.down[1]", "vision.layers.*.fc"]
    assert offline_blocks(mats) == [0, 1, 2, 1, 2, 3]


def load_shapes_json_text(records):
    from dmuon.bench.shapes import MatrixShape
    return [MatrixShape(r["name"], tuple(r["shape"]), r["count"]) for r in records]


def test_plan_cli_step_comm(tmp_path, capsys):
    from dmuon.costmodel.offline import offline_blocks
    from dmuon.costmodel.traffic import AlphaBeta, step_comm
    shapes = tmp_path / "shapes.json"
    shapes.write_text(json.dumps([{"name": "proj", "shape": [64, 32], "count": 1},
                                  {"name": "layers.*.a", "shape": [64, 256], "count": 3},
                                  {"name": "layers.*.b", "shape": [256, 64], "count": 3}]))
    out = tmp_path / "plan.json"
    assert plan_cli.main(["--shapes", str(shapes), "--world-size", "4", "--ranks-per-node", "2", "--zero", "3",
                          "--analytical", "--intra-bandwidth", "100", "--inter-latency", "5",
                          "--json", str(out)]) == 0
    plan = json.loads(out.read_text())
    comm = plan["step_comm"]
    assert set(comm) == {"dmuon", "dmuon_native_hsdp", "fsdp_adamw", "gather"}
    mats = expand(load_shapes_json(str(shapes)))
    owner = {name: r["rank"] for r in plan["ranks"] for name in r["matrices"]}
    model = AlphaBeta(intra_bandwidth=100e9, inter_latency=5e-6)
    assert plan["step_comm_model"]["intra_bandwidth"] == 100e9 and plan["step_comm_model"]["param_bytes"] == 2
    # The returns go in waves, one per owner batch (analytical costs: one batch per kind and owner).
    waves = plan["step_comm_model"]["return_waves"]
    assert sorted(sum(waves, [])) == list(range(len(mats))) and 1 < len(waves) <= 4
    expected = step_comm([m.shape for m in mats], [owner[m.name] for m in mats], offline_blocks(mats), 2, 2,
                         wire_bytes=2, param_bytes=2, reduce_bytes=4, zero=3, model=model, waves=waves)
    for key in expected:
        assert comm[key]["critical_bytes"] == expected[key]["critical_bytes"]
        assert comm[key]["collectives"] == expected[key]["collectives"]
        assert comm[key]["seconds"] == pytest.approx(expected[key]["seconds"])
    # FSDP2 + AdamW by hand: the root holds proj (1024 elements per rank), each layer a and b (8192 each).
    # Forward all-gather (bf16) of 4 blocks, backward all-gather of the 3 layers (not the root),
    # reduce-scatter (fp32) of 4; each ring over 2 ranks moves one shard; all-reduce over 2 replicas one shard.
    shard_elems = {0: 1024, 1: 2 * 8192, 2: 2 * 8192, 3: 2 * 8192}
    intra = sum(2 * e for e in shard_elems.values()) + sum(2 * shard_elems[b] for b in (1, 2, 3)) \
        + sum(4 * e for e in shard_elems.values())
    inter = sum(4 * e for e in shard_elems.values())
    assert comm["fsdp_adamw"]["critical_bytes"] == {"total": intra + inter, "intra": intra, "inter": inter}
    assert comm["dmuon_native_hsdp"]["critical_bytes"]["total"] > comm["fsdp_adamw"]["critical_bytes"]["total"]
    assert comm["gather"]["critical_bytes"]["inter"] == inter
    # the replicate level (dmuon on HSDP) leaves out FSDP2's all-reduce; its own collectives across replicas
    # (the gradient's column slices, the direction slices, the updates) move less here.
    assert comm["dmuon"]["critical_bytes"]["intra"] == comm["dmuon_native_hsdp"]["critical_bytes"]["intra"]
    assert comm["dmuon"]["critical_bytes"]["inter"] < comm["dmuon_native_hsdp"]["critical_bytes"]["inter"]
    text = capsys.readouterr().out
    assert "FSDP2 + AdamW: " in text and "gather-then-compute: " in text
    assert "  dmuon (replicate level" in text and "  dmuon_native_hsdp (native HSDP" in text
    # --param-dtype fp32 doubles the all-gathers.
    assert plan_cli.main(["--shapes", str(shapes), "--world-size", "4", "--ranks-per-node", "2", "--zero", "3",
                          "--analytical", "--param-dtype", "fp32", "--json", str(out)]) == 0
    again = json.loads(out.read_text())["step_comm"]["fsdp_adamw"]["critical_bytes"]
    assert again["intra"] == intra + sum(2 * e for e in shard_elems.values()) + sum(2 * shard_elems[b] for b in (1, 2, 3))


def test_plan_scale_table_rows_are_the_plans_step_comm(tmp_path, capsys):
    out = tmp_path / "scale.json"
    assert plan_cli.main(["--scale-table", "pi0", "--world-sizes", "8,16", "--zero", "3", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["model"], r["world_size"], r["mesh"]) for r in rows] == [("pi0", 8, [1, 8]), ("pi0", 16, [2, 8])]
    single = plan_offline(full_size_shapes("pi0"), 16, "greedy", 3, ranks_per_node=8)
    for key in ("dmuon", "dmuon_native_hsdp", "fsdp_adamw", "gather"):
        assert rows[1][f"{key}_critical_bytes"] == single["step_comm"][key]["critical_bytes"]["total"]
        assert rows[1][f"{key}_inter_critical_bytes"] == single["step_comm"][key]["critical_bytes"]["inter"]
        assert rows[1][f"{key}_seconds"] == single["step_comm"][key]["seconds"]["total"]
    assert rows[1]["makespan"] == single["makespan"]
    # One replica: the two dmuon designs are the same collectives.
    assert rows[0]["dmuon_critical_bytes"] == rows[0]["dmuon_native_hsdp_critical_bytes"]
    text = capsys.readouterr().out
    ratio = rows[1]["dmuon_critical_bytes"] / rows[1]["fsdp_adamw_critical_bytes"]
    inter = rows[1]["dmuon_inter_critical_bytes"] / rows[1]["fsdp_adamw_inter_critical_bytes"]
    assert (f"| pi0 | 16 | {rows[1]['dmuon_critical_bytes'] / 2**30:.1f} ({ratio:.2f}x), inter "
            f"{rows[1]['dmuon_inter_critical_bytes'] / 2**30:.2f} ({inter:.2f}x) /" in text)
    assert "| dmuon (replicate level) | dmuon_native_hsdp (native HSDP) |" in text
    assert plan_cli.main(["--scale-table", "nope"]) == 2
    assert plan_cli.main(["--scale-table", "pi0", "--world-sizes", "12"]) == 2  # not a multiple of 8
    assert "multiples of --ranks-per-node" in capsys.readouterr().err


def test_block_spreading_meets_the_cluster_scale_target():
    """Issue 16's target: dmuon's critical bytes at most 1.15x FSDP2 + AdamW's, qwen2.5-7b, ZeRO-3."""
    groups = full_size_shapes("qwen2.5-7b")
    for world in (8, 64):
        comm = plan_offline(groups, world, "greedy", 3, ranks_per_node=8)["step_comm"]
        for key in ("dmuon", "dmuon_native_hsdp"):
            assert comm[key]["critical_bytes"]["total"] <= 1.15 * comm["fsdp_adamw"]["critical_bytes"]["total"], (
                key, world)


def test_plan_splits_the_layers_over_pipeline_stages(tmp_path, capsys):
    """--pp: the repeated layers split evenly over the stages (the earlier ones taking one more), the
    embeddings on the first stage and the head on the last, each stage planned on its own ranks."""
    from dmuon.bench.shapes import pipeline_stages

    groups = full_size_shapes("qwen2.5-7b")  # 28 layers, an embedding and a head
    stages = pipeline_stages(groups, 3)
    counts = [{g.name: g.count for g in stage} for stage in stages]
    assert [c["layers.*.self_attn.q_proj"] for c in counts] == [10, 9, 9]
    assert "embed_tokens" in counts[0] and all("embed_tokens" not in c for c in counts[1:])
    assert "lm_head" in counts[2] and all("lm_head" not in c for c in counts[:2])
    for g in groups:
        assert sum(c.get(g.name, 0) for c in counts) == g.count, g.name

    out = tmp_path / "plan.json"
    assert plan_cli.main(["--model", "qwen2.5-7b", "--world-size", "12", "--pp", "3", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.count("data-parallel ranks") == 3 and "pipeline stage 2 of 3" in printed
    plans = json.loads(out.read_text())["stages"]
    assert [p["world_size"] for p in plans] == [4, 4, 4]
    assert [p["matrices"] for p in plans] == [70, 63, 63]  # 7 Muon matrices per layer
    assert plan_cli.main(["--world-size", "12", "--pp", "5"]) == 2
