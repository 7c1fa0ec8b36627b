"""``dmuon bench --gpu-check``: the dry run of the plumbing, the verdicts on made-up failures, the
kernel comparison, and the stream section run for real on CPU (gloo, loopback, stream checker)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dmuon.bench import gpu_check
from dmuon.bench import gpu_check_bench as gb
from dmuon.bench import gpu_check_sections as gs

_REPO = Path(gpu_check.__file__).resolve().parents[3]
_SRC = str(_REPO / "src")


def _env(**extra) -> dict:
    env = dict(os.environ, **extra)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [_SRC, env.get("PYTHONPATH")]))
    return env


def _syrk_exact(A: torch.Tensor) -> torch.Tensor:
    """What a correct kernel returns: the float64 product, rounded once, exactly symmetric."""
    A64 = A.double()
    return (A64 @ A64.mT).float()


def test_compare_passes_a_right_result_and_flags_corrupted_ones():
    A = torch.randn(40, 70, generator=torch.Generator().manual_seed(0))
    good = _syrk_exact(A)
    assert gs.compare_syrk(good, A)["passed"]

    wrong = good.clone()  # one entry (and its mirror) off by 1e-3 of the row norms' product
    delta = 1e-3 * float(A[3].norm() * A[5].norm())
    wrong[3, 5] += delta
    wrong[5, 3] += delta
    res = gs.compare_syrk(wrong, A)
    assert not res["passed"] and res["symmetric"] and res["max_rel_err"] > res["tolerance"]

    lopsided = good.clone()  # right values, but the mirror not written
    lopsided[5, 3] = 0.0
    assert not gs.compare_syrk(lopsided, A)["symmetric"]
    assert not gs.compare_syrk(_syrk_exact(A[:, :64]), A)["passed"]  # a kernel that drops the K remainder
    nan = good.clone()
    nan[0, 0] = float("nan")
    assert not gs.compare_syrk(nan, A)["passed"]
    assert not gs.compare_syrk(good.double(), A)["passed"]  # the kernel returns float32

    C = _syrk_exact(A) / 70  # the fused alpha A Aᵀ + beta C form
    fused = (2.0 * A.double() @ A.double().mT - 0.5 * C.double()).float()
    assert gs.compare_syrk(fused, A, alpha=2.0, beta=-0.5, C=C)["passed"]
    assert not gs.compare_syrk(fused, A, alpha=2.0, beta=0.5, C=C)["passed"]
    assert gs.syrk_tolerance(4096) > gs.syrk_tolerance(64)
    assert gs.syrk_tolerance(64, tf32=True) > 2 * gs.U_TF32


def test_the_syrk_plan_covers_every_tile_config_at_ragged_shapes():
    from dmuon.ortho.triton_syrk import TILE_CONFIGS

    cases = gs.plan_syrk()
    assert {tuple(c["config"]) for c in cases} == set(TILE_CONFIGS)
    for cfg in TILE_CONFIGS:
        mine = [c for c in cases if tuple(c["config"]) == cfg]
        assert {(c["M"], c["K"]) for c in mine} == set(gs.SYRK_SHAPES) | {gs.SYRK_LARGE}
        assert {c["variant"] for c in mine} == set(gs.SYRK_VARIANTS)
    block_ks = {c[1] for c in TILE_CONFIGS}
    blocks = {c[0] for c in TILE_CONFIGS}
    # Every BLOCK leaves a partial row tile and every BLOCK_K a K tail at some shape.
    assert all(any(M % b and M > b for M, _ in gs.SYRK_SHAPES) for b in blocks)
    assert all(any(K % bk and K > bk for _, K in gs.SYRK_SHAPES) for bk in block_ks)
    assert (1, 1) in gs.SYRK_SHAPES

    payload = {"cases": [{**c, "check": {"passed": True, "max_rel_err": 0.0, "tolerance": 1.0}} for c in cases]}
    assert [v["passed"] for v in gs.syrk_verdicts(payload)] == [True]
    payload["cases"][7]["check"] = {"passed": False, "error": "CompilationError: out of shared memory"}
    (verdict,) = gs.syrk_verdicts(payload)
    assert not verdict["passed"] and "out of shared memory" in verdict["detail"]
    assert not gs.syrk_verdicts({"cases": payload["cases"][:-1]})[0]["passed"]  # a case missing (a timeout)


def _run(config: str, variant: str, exchanged: list[int], losses: list[float], blocks: int = 4, **extra) -> dict:
    reports = [{"blocks_exchanged_in_backward": e, "rescaled_launches": e if "_clip" in config else 0,
                "orthogonalized": 14, "orthogonalized_in_backward": 14 if "bwd" in config else 0,
                "blocks_returned_in_backward": blocks - 1 if config.endswith("_rbwd") else 0} for e in exchanged]
    return {"config": config, "variant": variant, "blocks": blocks, "losses": losses, "reports": reports,
            "collectives": {"all_to_all_single": 6}, "delays": 3, **extra}


def _all_runs(losses=(5.0, 4.0, 3.0)) -> list[dict]:
    runs = []
    for config, variant in gb.plan_runs():
        exchanged = [0, 0, 0] if config.endswith("_sync") else ([0, 4, 4] if "_clip" in config else [4, 4, 4])
        runs.append(_run(config, variant, exchanged, list(losses)))
    return runs


def test_bench_verdicts_pass_standing_launches_and_fail_each_fault():
    assert all(c["passed"] for c in gb.verdicts(_all_runs(), "cuda"))

    def failing(runs):
        return {c["name"] for c in gb.verdicts(runs, "cuda") if not c["passed"]}

    stale = _all_runs()  # one launch went stale on the device
    stale[3]["reports"][2]["blocks_exchanged_in_backward"] = 3
    assert failing(stale) == {"bench dmuon_z3 launches stand"}
    raced = _all_runs()  # the delayed run of rbwd moved its losses
    k = next(i for i, r in enumerate(raced) if (r["config"], r["variant"]) == ("dmuon_z3_rbwd", "delayed"))
    raced[k]["losses"][-1] += 1e-6
    assert failing(raced) == {"bench dmuon_z3_rbwd reduce-scatter stream delayed: same losses"}
    idle = _all_runs()  # a delay patch that never fired proves nothing
    idle[k]["delays"] = 0
    assert failing(idle) == {"bench dmuon_z3_rbwd reduce-scatter stream delayed: same losses"}
    local = _all_runs()  # loopback engaged nothing
    local[3]["collectives"] = {}
    assert failing(local) == {"bench dmuon_z3 launches stand"}
    # A measured tolerance admits what the repeat differs by, and no more.
    noisy = _all_runs()
    for r in noisy:
        if r["config"] == "dmuon_z3_clip" and r["variant"] in ("repeat", "delayed"):
            r["losses"] = [5.0, 4.0, 3.0 * (1 + 1e-7)]
    assert not failing(noisy)
    k = next(i for i, r in enumerate(noisy) if (r["config"], r["variant"]) == ("dmuon_z3_clip", "delayed"))
    noisy[k]["losses"][-1] = 3.0 * (1 + 1e-6)
    assert failing(noisy) == {"bench dmuon_z3_clip reduce-scatter stream delayed: same losses"}
    missing = [r for r in _all_runs() if r["config"] != "dmuon_z3_nsbwd" or r["variant"] != "run"]
    assert failing(missing) == {"bench dmuon_z3_nsbwd ran", "bench dmuon_z3_rbwd equals dmuon_z3_nsbwd"}


def test_csan_reports_are_listed_verbatim():
    rows = [{"config": c, "reports": []} for c in gs.plan_csan()]
    rows[2]["reports"] = ["torch.cuda._sanitizer.CUDASanitizerErrors: Detected 1 data race: stream 7 ..."]
    checks = gs.csan_verdicts({"sanitizer_enabled": True, "rows": rows})
    failed = [c for c in checks if not c["passed"]]
    assert [c["name"] for c in failed] == [f"csan {rows[2]['config']} 2 steps, no report"]
    assert failed[0]["detail"] == rows[2]["reports"][0]
    assert {"dmuon_z3_nsbwd", "dmuon_z3_rbwd", "dmuon_z3_event", "adamw"} <= set(gs.plan_csan())
    assert not gs.csan_verdicts({"sanitizer_enabled": False, "rows": []})[0]["passed"]


def test_the_budget_adds_up_and_every_section_has_a_timeout():
    assert set(gpu_check.TIMEOUTS_S) == set(gpu_check.SECTIONS)
    b = gpu_check.budget()
    assert b["total_s"] == sum(gpu_check.TIMEOUTS_S.values()) + gpu_check.OVERHEAD_S <= gpu_check.BUDGET_S == 480
    assert b["fits"]
    assert gpu_check.SECTIONS[-1] == "ns"  # the measurement last: a slow one cannot cost a correctness verdict


def test_a_section_that_hangs_keeps_its_partial_results_and_the_others_run(tmp_path, monkeypatch):
    script = ("import json, sys, time; json.dump({'cases': []}, open(sys.argv[1], 'w')); time.sleep(60)")
    monkeypatch.setattr(gpu_check, "section_command",
                        lambda name, out: ([sys.executable, "-c", script, out], {}))
    data = gpu_check.run_section("syrk", str(tmp_path), timeout_s=3)
    assert data["error"] == "timed out after 3 s" and data["cases"] == [] and data["wall_s"] < 30
    checks = gpu_check.collect_checks({"syrk": data, "syncs": {"rows": [], "passed": True, "wall_s": 1.0}})
    assert [(c["name"], c["passed"]) for c in checks if c["name"].startswith("section")] == [
        ("section syrk finished", False), ("section syncs finished", True)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_without_cuda_it_asks_for_dry_run(tmp_path, capsys):
    assert gpu_check.main(["--out-dir", str(tmp_path / "x")]) == 2
    assert "--dry-run" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_dry_run_through_the_script(tmp_path):
    out = tmp_path / "out"
    res = subprocess.run(["bash", str(_REPO / "scripts" / "gpu_check.sh"), str(out), "--dry-run"],
                         env=_env(PYTHON=sys.executable), capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    data = json.loads((out / "gpu_check.json").read_text())
    table = (out / "gpu_check.md").read_text()
    assert table in res.stdout and table.startswith("| verdict | section | check | detail |")
    assert list(data["sections"]) == list(gpu_check.SECTIONS) and data["budget"]["fits"]
    for name, plan in data["sections"].items():
        assert plan["command"][-4:] == ["--section", name, "--out", f"<outdir>/{name}.json"]
        assert plan["timeout_s"] == gpu_check.TIMEOUTS_S[name] and plan["cases"]
    assert data["sections"]["bench"]["env"]["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert data["sections"]["csan"]["env"]["TORCH_CUDA_SANITIZER"] == "1"
    assert len(data["sections"]["syrk"]["cases"]) == len(gs.plan_syrk())
    # The made-up results fail one check in each section and pass the rest; both render.
    failed = {c["section"] for c in data["fake_checks"] if not c["passed"]}
    assert failed == set(gpu_check.SECTIONS) - {"syncs"}
    assert table.count("| FAIL |") == len([c for c in data["fake_checks"] if not c["passed"]])
    assert "CSANError: made-up report" in table


@pytest.mark.slow  # a whole bench section on gloo; scripts/gpu_check.sh runs it on the device, the dry run here by default
def test_bench_section_on_cpu_with_loopback(tmp_path):
    """The stream section for real on CPU (gloo, every run's streams under the checker): the launch
    verdicts, the measured tolerance and the comparisons pass (no delay: CPU has no streams to delay)."""
    out = tmp_path / "bench.json"
    code = ("import sys, torch; from dmuon.bench.gpu_check_bench import bench_section; "
            "bench_section('tiny', 3, torch.device('cpu'), sys.argv[1])")
    res = subprocess.run([sys.executable, "-c", code, str(out)], env=_env(DMUON_CHECK_STREAMS="1"),
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    payload = json.loads(out.read_text())
    assert payload["backend"] == "gloo"
    assert "errors" not in payload, "runs that raised:\n" + "\n".join(payload["errors"]) + "\n" + res.stderr[-3000:]
    checks = gpu_check.collect_checks({"bench": {**payload, "wall_s": 1.0}})
    assert all(c["passed"] for c in checks), [c for c in checks if not c["passed"]]
    ran = {(r["config"], r["variant"]) for r in payload["runs"]}
    assert ran == {(c, v) for c, v in gb.plan_runs() if v != "delayed"}
    assert all(sum(r["collectives"].values()) > 0 for r in payload["runs"] if r["variant"] != "local")


def test_syncs_that_grow_with_the_matrices_fail_the_check():
    rows = [{"config": "dmuon_z3", "size": "tiny", "matrices": 14, "syncs": 3},
            {"config": "dmuon_z3", "size": "mini", "matrices": 28, "syncs": 31}]
    assert not gpu_check.syncs_passed(rows) and not gpu_check.syncs_passed(rows[:1])
    assert gpu_check.syncs_passed([rows[0], {**rows[1], "syncs": 3}, {"config": "adamw", "syncs": 9}])
    check, device_lr = gpu_check.syncs_verdicts({"rows": rows, "passed": gpu_check.syncs_passed(rows)})
    assert not device_lr["passed"] and device_lr["detail"] == "no device-lr run"
    assert not check["passed"] and check["detail"] == "3 with 14 matrices, 31 with 28 matrices"


def test_a_device_lr_that_adds_waits_fails_the_check():
    rows = [{"config": "dmuon_z3", "size": "tiny", "matrices": 14, "syncs": 3},
            {"config": "dmuon_z3", "size": "mini", "matrices": 28, "syncs": 3},
            {"config": "dmuon_z3_device_lr", "size": "tiny", "matrices": 14, "syncs": 3}]
    assert gpu_check.device_lr_passed(rows)
    assert not gpu_check.device_lr_passed(rows[:2] + [{**rows[2], "syncs": 4}])  # one read of the lr a step
    assert not gpu_check.device_lr_passed(rows[:2])  # the run is missing (a timeout)
    assert not gpu_check.device_lr_passed([rows[1], rows[2]])  # no float-lr run at its size to compare with
    checks = gpu_check.syncs_verdicts({"rows": rows[:2] + [{**rows[2], "syncs": 4}], "passed": True})
    assert [c["passed"] for c in checks] == [True, False]
    assert checks[1]["detail"] == "4 with a device lr, 14 matrices"


def test_device_lr_syncs_on_cpu(monkeypatch):
    """The row's runs for real on CPU (host reads counted at dispatch): a device lr reads nothing more
    than a float; a step that reads its lr on the host (injected) is caught."""
    import dmuon
    from dmuon.bench.gpu_check_base import one_rank

    cpu = torch.device("cpu")
    with one_rank(cpu):
        rows = [gpu_check._step_syncs("dmuon_z3", "tiny", cpu), gpu_check._step_syncs("dmuon_z3", "tiny", cpu, True)]
        assert gpu_check.device_lr_passed(rows), rows
        step = dmuon.DMuon.step

        def reading_lr(self, *args, **kwargs):
            for group in self.param_groups:
                if isinstance(group["lr"], torch.Tensor):
                    float(group["lr"])  # what a scheduler-unaware step would do
            return step(self, *args, **kwargs)

        monkeypatch.setattr(dmuon.DMuon, "step", reading_lr)
        reading = gpu_check._step_syncs("dmuon_z3", "tiny", cpu, True)
    assert reading["syncs"] > rows[0]["syncs"] and not gpu_check.device_lr_passed([rows[0], reading])


def test_one_rank_leaves_the_launcher_variables_as_it_found_them(monkeypatch):
    """A section's one-rank group sets torchrun's variables for its run only: `dmuon bench` later in the
    same process reads them to tell a torchrun rank, and would take itself for rank 0 of 1."""
    from dmuon.bench.gpu_check_base import one_rank

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("MASTER_PORT", "12345")
    with one_rank(torch.device("cpu")):
        assert os.environ["RANK"] == "0" and os.environ["MASTER_PORT"] != "12345"
    assert "RANK" not in os.environ and os.environ["MASTER_PORT"] == "12345"
