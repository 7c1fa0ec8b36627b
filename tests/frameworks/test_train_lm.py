"""examples/train_lm.py: a run stopped at step K and resumed from its DCP checkpoint gives the same
losses as the uninterrupted run, for AdamW and dmuon, and the JSON has the documented fields.

The uninterrupted run is the script's command line (a subprocess, its ``main``); the resumed one runs
the script's ranks from the test process (``support.train_lm``), so that it pays no second interpreter,
torch import and forkserver start: its ranks are fresh processes all the same, with nothing of the
first run but its checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

from support.spawn import run_distributed
from support.train_lm import SCRIPT, run_rank, script

STEPS, K = 4, 2
# Tiny model and batches, 2 gloo ranks; activation checkpointing and accumulation on, so the
# resumed path goes through them too.
TINY = ["--world-size", "2", "--steps", str(STEPS), "--val-every", "2", "--val-batches", "1",
        "--hidden", "64", "--intermediate", "128", "--layers", "2", "--heads", "4", "--kv-heads", "2",
        "--seq-len", "32", "--batch-size", "2", "--grad-accum", "2", "--corpus-mb", "2",
        "--activation-checkpointing", "--optimizer", "both", "--quiet"]


def _run(*extra: str) -> None:
    proc = subprocess.run([sys.executable, SCRIPT, *TINY, *extra], capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_resume_reproduces_losses_and_json_fields(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    full, resumed = tmp_path / "full.json", tmp_path / "resumed.json"
    # Uninterrupted run, saving at K (and at the end).
    _run("--ckpt-dir", ckpt, "--ckpt-every", str(K), "--json", str(full), "--plot", str(tmp_path / "p.png"))
    # Stopped at K: a fresh process picks the training up from the step-K checkpoint.
    train_lm = script()
    args = train_lm.build_parser().parse_args([*TINY, "--ckpt-dir", ckpt, "--resume", "--resume-step", str(K),
                                               "--json", str(resumed)])
    train_lm.finish(run_distributed(run_rank, args.world_size, args, timeout_s=240)[0], args)

    a, b = json.loads(full.read_text()), json.loads(resumed.read_text())
    assert set(a["runs"]) == {"adamw", "dmuon"}
    assert a["config"]["world_size"] == 2 and a["config"]["steps"] == STEPS
    for name, run in a["runs"].items():
        for field in ("step", "train_loss", "val_loss", "val_step", "seconds"):
            assert isinstance(run[field], list) and run[field], (name, field)
        assert run["step"] == list(range(1, STEPS + 1))
        assert len(run["train_loss"]) == len(run["seconds"]) == STEPS
        assert run["val_step"] == [2, 4] and len(run["val_loss"]) == 2
        assert run["train_loss"][-1] < run["train_loss"][0]
        other = b["runs"][name]
        # The resumed process trained only steps K+1.. (the history before K comes from the
        # checkpoint): equal losses after K mean the weights, optimizer state and schedule were
        # restored, since a fresh model trained from step K gives other losses.
        assert "resumed_from" not in run and other["resumed_from"] == K
        assert other["seconds"][:K] == run["seconds"][:K]
        # Steps after K were computed by the resumed process; bit-identical on the same ranks.
        assert other["step"] == run["step"]
        assert other["train_loss"] == run["train_loss"], name
        assert other["val_loss"] == run["val_loss"], name
    # The two optimizers saw the same initial weights and first batch.
    assert a["runs"]["adamw"]["train_loss"][0] == a["runs"]["dmuon"]["train_loss"][0]
    assert a["runs"]["adamw"]["train_loss"][1] != a["runs"]["dmuon"]["train_loss"][1]
    assert (tmp_path / "p.png").stat().st_size > 0


@pytest.mark.slow  # the example trained once per rate: test_resume_reproduces_losses_and_json_fields trains it by default
def test_lr_sweep_runs_each_rate_and_marks_the_best(tmp_path):
    sweep = os.path.join(os.path.dirname(SCRIPT), "lr_sweep.py")
    tiny = [a for a in TINY if a not in ("--optimizer", "both", "--quiet", "--activation-checkpointing")]
    tiny[tiny.index("--steps") + 1] = "2"
    tiny[tiny.index("--val-every") + 1] = "2"
    out = tmp_path / "sweep.json"
    proc = subprocess.run([sys.executable, sweep, "--adamw-lrs", "1e-3,1e-1", "--muon-lrs", "0.02", "--json",
                           str(out), *tiny], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = json.loads(out.read_text())["runs"]
    assert [(r["optimizer"], r["lr"]) for r in runs] == [("adamw", 1e-3), ("adamw", 1e-1), ("dmuon", 0.02)]
    adamw = [r for r in runs if r["optimizer"] == "adamw"]
    assert adamw[0]["val_loss"] != adamw[1]["val_loss"]  # the rate reached the run
    best = min(adamw, key=lambda r: r["val_loss"])
    assert f"**{best['val_loss']:.4f}**" in proc.stdout and f"**{best['lr']:g}**" in proc.stdout
