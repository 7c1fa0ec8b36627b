import runpy
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from dmuon.bench.ortho_bench import format_kernel_table, format_table, main, run_kernel_bench, run_ortho_bench



@pytest.fixture(autouse=True)
def _no_cooldown(monkeypatch):
    """The pause before each timed block (0.25 s on CPU, run_ortho_bench's and the kernel table's default)
    keeps one variant's BLAS spin off the next one's clock: it matters for real measurements, not for
    these tests of the rows and the entry points, where it was nearly all of their time."""
    from dmuon.ortho import timing

    monkeypatch.setattr(timing, "time", SimpleNamespace(perf_counter=time.perf_counter, sleep=lambda s: None))


def test_run_ortho_bench_rows():
    rows = run_ortho_bench(shapes=[(16, 64)], dtype=torch.float32, repeats=1, batches=[(3, 8, 16)], cooldown_s=0.0)
    method, method_fp32, batch = rows
    # Default cadences: DMuon's for bf16 results, then for fp32 results; one standard timing.
    assert (method["restart_every"], method_fp32["restart_every"]) == (3, 2)
    assert method["standard_s"] == method_fp32["standard_s"]
    assert method["kind"] == "method" and method["shape"] == (16, 64)
    for k in ("standard_s", "gram_s", "gram_sym_s"):
        assert method[k] > 0
    assert method["gram_sym_speedup"] == pytest.approx(method["standard_s"] / method["gram_sym_s"])
    assert batch["kind"] == "batch" and batch["batch"] == 3
    assert batch["auto_method"] in ("standard", "gram") and batch["auto_vs_best"] >= 1.0
    table = format_table(rows)
    assert "16x64" in table and "pick/best" in table


def test_restart_cadences_are_validated_and_deduplicated():
    rows = run_ortho_bench(shapes=[(8, 24)], repeats=1, batches=[], cooldown_s=0.0, restarts=[0, 0, 1])
    assert [r["restart_every"] for r in rows] == [0, 1]
    with pytest.raises(ValueError, match="restarts"):
        run_ortho_bench(shapes=[(8, 24)], repeats=1, batches=[], restarts=[-1])


def test_kernel_bench_rows():
    rows = run_kernel_bench(sizes=(130,), repeats=1)
    assert {r["op"] for r in rows} == {"gram", "sym_poly2", "sym_product"}
    assert "sym_product" in format_kernel_table(rows)


# runpy re-runs the module this file imported, as `python -m` would in a fresh interpreter (whose start-up,
# torch's import, took most of this test's time); the warning says the module was imported already.
@pytest.mark.filterwarnings("ignore:'dmuon.bench.ortho_bench' found in sys.modules:RuntimeWarning")
def test_main_and_module_entry(capsys, monkeypatch):
    assert main(["--shapes", "8x24", "--batches", "", "--repeats", "1"]) == 0
    assert "8x24" in capsys.readouterr().out
    assert main(["--shapes", "8x", "--repeats", "1"]) == 2
    capsys.readouterr()
    monkeypatch.setattr(sys, "argv", ["ortho_bench", "--shapes", "8x16", "--batches", "2x4x8", "--repeats", "1",
                                      "--json"])
    with pytest.raises(SystemExit) as done:
        runpy.run_module("dmuon.bench.ortho_bench", run_name="__main__", alter_sys=True)
    assert done.value.code == 0
    assert '"kind": "batch"' in capsys.readouterr().out
