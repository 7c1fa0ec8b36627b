"""Bad input gets a clear error on every rank (no hang); failures propagate; odd training still exact."""

from __future__ import annotations

import pytest
import torch

from support.spawn import run_distributed, run_with_crashes

from support import faults
from support.cases import Case, run_cases
from support.equivalence import SKIP, STEPS, max_diff, reference
from support.scenarios import run_each, shared_runs


def _on_two(rank: int, world: int) -> dict:
    """The 2-rank misuse cases in one process group (each raises on every rank alike, then the next runs),
    each with its own result or its own error."""
    return run_each({"mismatched": lambda: faults.mismatched_models(rank, world),
                     "root": lambda: faults.root_not_sharded(rank, world),
                     "another plan": lambda: faults.plan_for_another_model(rank, world)})


def _on_three(rank: int, world: int) -> dict:
    """The 3-rank cases in one process group."""
    return run_each({
        "kernel": lambda: faults.kernel_sharded(rank, world),
        "blocks": lambda: faults.fsdp_blocks(rank, world),
        "skip": lambda: faults.nonfinite(rank, world, "skip"),
        "raise": lambda: faults.nonfinite(rank, world, "raise"),
        # The updates of the blocks launched first come back in backward; the skip drops them too.
        "skip, returns in backward": lambda: faults.nonfinite(rank, world, "skip", ns_in_backward=True,
                                                              returns_in_backward=True),
        "milp": lambda: faults.milp_owners(rank, world)})


_two = shared_runs(_on_two, 2, timeout_s=120)  # each rank's result of a 2-rank case (its ranks' error when it raised)
_three = shared_runs(_on_three, 3, timeout_s=120)


def test_ranks_with_different_models_fail_clearly():
    out = _two("mismatched")
    assert all(o.startswith("ValueError") and "ranks [1] differ" in o for o in out), out


def test_parameter_outside_fully_shard_is_named():
    out = _two("root")
    assert all("not managed by any fully_shard" in o and "embed.weight" in o for o in out), out


def test_unsupported_layout_is_named():
    out = _three("kernel")  # FSDP2 splits dim 2 only evenly
    assert all(o.startswith("ValueError") and "'conv.weight' is split on its dim 2" in o for o in out), out


def test_plan_for_another_model_is_refused():
    out = _two("another plan")
    assert all(o.startswith("ValueError") and "plan" in o for o in out), out


def test_sparse_gradient_names_the_parameter():
    out = faults.sparse_gradient()
    assert "table.weight" in out and "sparse" in out, out


def test_blocks_are_the_fsdp2_modules_and_rows_follow_shard0():
    out = _three("blocks")
    for o in out:
        assert o["blocks"] == ["", "layers.0", "layers.1", "layers.2"]
        assert o["block_of"]["conv.weight"] == 0 and o["block_of"]["layers.2.down.weight"] == 3
        assert o["rows"]["layers.1.mid.weight"] == (67, 67, 66)
        assert o["rows"]["gate.weight"] == (1, 0, 0) and o["rows"]["lift.weight"] == (13, 13, 11)


@pytest.mark.parametrize("mode", ["skip", "raise", "skip, returns in backward"])
def test_nonfinite_gradient_is_handled_on_every_rank(mode):
    out = _three(mode)
    for o in out:
        assert o["outcome"][0] == ("stepped", True)
        if mode.startswith("skip"):
            assert o["outcome"][1] == ("skipped", False)
        else:
            assert o["outcome"][1][0] == "raised" and "layers.1." in o["outcome"][1][1]


def test_milp_plan_is_identical_on_every_rank():
    out = _three("milp")
    assert all(o == out[0] for o in out) and set(out[0]) == {0, 1, 2}


# Process-group timeout of the crash tests: the survivors must fail within it.
CRASH_TIMEOUT_S = 15.0


@pytest.mark.parametrize("where,zero", [("backward", 3), ("step", 2)])
def test_a_rank_that_raises_makes_the_others_fail_not_hang(where, zero):
    results = run_with_crashes(faults.rank_crashes, 3, where, zero, timeout_s=CRASH_TIMEOUT_S, deadline_s=90.0)
    assert results[1] == {"raised": f"RuntimeError: injected failure inside {where}" + ("()" if where == "step" else "")}
    for rank in (0, 2):
        r = results[rank]
        assert "hung" not in r and "finished" not in r, r
        assert r["failed_after_s"] < CRASH_TIMEOUT_S + 10.0, r


def test_activation_checkpointing_inside_blocks():
    """Blocks recomputed in backward (FSDP2 re-gathers them) train as without checkpointing."""
    world_size = 3
    modes = ("early_stop", "full", "reentrant")
    cases = [Case(zero=z, ns_dtype=torch.float32, steps=STEPS, skip=SKIP, activation_checkpointing=m)
             for m in modes for z in (2, 3)]
    results = run_distributed(run_cases, world_size, cases, timeout_s=180)
    ref, ref_losses = reference(world_size, torch.float32)
    for k, case in enumerate(cases):
        diff, worst = max_diff(results[0][k]["params"], ref)
        assert diff <= 1e-5, (case.activation_checkpointing, case.zero, worst)
        assert results[0][k]["losses"] == pytest.approx(ref_losses, rel=1e-5)
