"""``dmuon bench --gpu-check``: the CPU dry run end to end, and the kernel comparison."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dmuon.bench import gpu_check


def _syrk_exact(A: torch.Tensor) -> torch.Tensor:
    """What a correct kernel returns: the float64 product, rounded once, exactly symmetric."""
    A64 = A.double()
    return (A64 @ A64.mT).float()


def test_compare_passes_a_right_result_and_flags_corrupted_ones():
    A = torch.randn(40, 70, generator=torch.Generator().manual_seed(0))
    good = _syrk_exact(A)
    assert gpu_check.compare_syrk(good, A)["passed"]

    wrong = good.clone()  # one entry (and its mirror) off by 1e-3 of the row norms' product
    delta = 1e-3 * float(A[3].norm() * A[5].norm())
    wrong[3, 5] += delta
    wrong[5, 3] += delta
    res = gpu_check.compare_syrk(wrong, A)
    assert not res["passed"] and res["symmetric"] and res["max_rel_err"] > res["tolerance"]

    lopsided = good.clone()  # right values, but the mirror not written
    lopsided[5, 3] = 0.0
    res = gpu_check.compare_syrk(lopsided, A)
    assert not res["passed"] and not res["symmetric"]

    no_tail = _syrk_exact(A[:, :64])  # a kernel that drops the K remainder
    assert not gpu_check.compare_syrk(no_tail, A)["passed"]

    nan = good.clone()
    nan[0, 0] = float("nan")
    assert not gpu_check.compare_syrk(nan, A)["passed"]
    assert not gpu_check.compare_syrk(good.double(), A)["passed"]  # the kernel returns float32

    # The fused alpha A Aᵀ + beta C form.
    C = _syrk_exact(A) / 70
    fused = (2.0 * A.double() @ A.double().mT - 0.5 * C.double()).float()
    assert gpu_check.compare_syrk(fused, A, alpha=2.0, beta=-0.5, C=C)["passed"]
    assert not gpu_check.compare_syrk(fused, A, alpha=2.0, beta=0.5, C=C)["passed"]


def test_overlap_vs_sync_fails_on_any_difference_beyond_the_tolerance():
    same = [{"config": "dmuon_z3", "losses": [5.0, 4.0]}, {"config": "dmuon_z3_sync", "losses": [5.0, 4.0]}]
    assert gpu_check.overlap_vs_sync(same) == {"max_rel_diff": 0.0, "tolerance": gpu_check.SYNC_RTOL, "passed": True}
    raced = [same[0], {"config": "dmuon_z3_sync", "losses": [5.0, 4.0 * (1 + 1e-5)]}]
    verdict = gpu_check.overlap_vs_sync(raced)
    assert not verdict["passed"] and verdict["max_rel_diff"] == pytest.approx(1e-5, rel=1e-3)
    checks = gpu_check.collect_checks({"bench": {"overlap_vs_sync": verdict}})
    assert [c["passed"] for c in checks if "overlap" in c["name"]] == [False]


def test_tolerance_grows_with_k_and_for_tf32():
    assert gpu_check.syrk_tolerance(4096) > gpu_check.syrk_tolerance(64)
    assert gpu_check.syrk_tolerance(64, tf32=True) > 2 * gpu_check.U_TF32


def test_a_failed_kernel_case_fails_the_check():
    A = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    bad = _syrk_exact(A)
    bad[1, 2] = bad[2, 1] = bad[1, 2] + 1.0
    case = {"op": "syrk", "dtype": "float32", "M": 8, "K": 16, "check": gpu_check.compare_syrk(bad, A)}
    checks = gpu_check.collect_checks({"kernel": {"cases": [case]}, "bench": {"error": "exit code 1"}})
    failed = {c["name"] for c in checks if not c["passed"]}
    assert failed == {"kernel syrk float32 8x16", "section bench finished"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_without_cuda_it_asks_for_dry_run(tmp_path, capsys):
    assert gpu_check.main(["--json", str(tmp_path / "x.json")]) == 2
    assert "--dry-run" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_dry_run_end_to_end(tmp_path):
    out = tmp_path / "gpu_check.json"
    env = dict(os.environ, DMUON_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("TRITON_INTERPRET", None)  # the check switches it on for the kernel section itself
    src = str(Path(gpu_check.__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")]))
    res = subprocess.run([sys.executable, "-m", "dmuon.bench", "--gpu-check", "--dry-run", "--json", str(out)],
                         env=env, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["device"] == "cpu (dry run)" and data["dry_run"] and data["passed"]
    assert data["torch"] == torch.__version__ and data["triton"]
    assert set(data["sections"]) == set(gpu_check.SECTIONS)
    assert all("error" not in s and _positive(s["wall_s"]) for s in data["sections"].values())
    assert data["checks"] and all(c["passed"] for c in data["checks"])

    kernel = data["sections"]["kernel"]
    assert kernel["interpreted"]
    dtypes = {c["dtype"] for c in kernel["cases"] if c["op"] == "syrk"}
    assert {"float32", "float32+tf32", "bfloat16"} <= dtypes
    assert any(c["op"] == "syrk_poly2" for c in kernel["cases"])
    for c in kernel["cases"]:
        assert c["check"]["passed"] and c["check"]["symmetric"]
        assert {"syrk", "matmul"} <= set(c["times_s"]) or {"syrk", "addmm"} <= set(c["times_s"])
        assert all(_positive(t) for t in c["times_s"].values())

    rows = data["sections"]["ortho"]["rows"]
    assert [tuple(r["shape"]) for r in rows] == list(gpu_check.DRY.ortho_shapes)
    for r in rows:
        assert set(r["times_s"]) == {"standard", "gram", "gram_sym"}
        assert all(_positive(t) for t in r["times_s"].values())
        assert r["autotune"]["method"] in ("standard", "standard32", "gram")
        assert all(_positive(t) for t in r["autotune"]["times_s"].values())

    bench = data["sections"]["bench"]
    assert bench["backend"] == "gloo" and bench["world_size"] == 1 and bench["losses_agree"]
    configs = {r["config"]: r for r in bench["results"]}
    assert {"adamw", "torch_muon", "dmuon_z2", "dmuon_z3_sync"} <= set(configs)
    assert bench["overlap_vs_sync"]["passed"] and bench["overlap_vs_sync"]["max_rel_diff"] == 0.0
    assert all(_positive(r["step_s"]) and math.isfinite(r["final_loss"]) for r in configs.values())

    syncs = data["sections"]["syncs"]
    assert syncs["backend"] == "gloo" and syncs["passed"]
    assert [(r["config"], r["size"]) for r in syncs["rows"]] == [
        (c, size) for size in gpu_check.DRY.sync_sizes for c in ("adamw", "dmuon_z3")]
    counted = {(r["config"], r["size"]): r for r in syncs["rows"]}
    assert counted["dmuon_z3", "tiny"]["matrices"] == 14 and counted["dmuon_z3", "mini"]["matrices"] == 28
    assert counted["dmuon_z3", "tiny"]["syncs"] == counted["dmuon_z3", "mini"]["syncs"]

    recipe = data["sections"]["recipe"]
    assert recipe["backend"] == "gloo" and set(recipe["runs"]) == {"adamw", "dmuon"}
    for run in recipe["runs"].values():
        assert run["steps"] == 2 and run["finite"] and _positive(run["tokens_per_s"])


def test_syncs_that_grow_with_the_matrices_fail_the_check():
    rows = [{"config": "dmuon_z3", "size": "tiny", "matrices": 14, "syncs": 3},
            {"config": "dmuon_z3", "size": "mini", "matrices": 28, "syncs": 31}]
    assert not gpu_check.syncs_passed(rows) and not gpu_check.syncs_passed(rows[:1])
    assert gpu_check.syncs_passed([rows[0], {**rows[1], "syncs": 3}, {"config": "adamw", "syncs": 9}])
    checks = gpu_check.collect_checks({"syncs": {"rows": rows, "passed": gpu_check.syncs_passed(rows)}})
    sync_checks = [c for c in checks if c["name"].startswith("syncs")]
    assert [c["passed"] for c in sync_checks] == [False]
    assert sync_checks[0]["detail"] == "3 with 14 matrices, 31 with 28 matrices"
