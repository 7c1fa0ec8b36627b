"""DMuon on FSDP2 over 1-4 gloo ranks equals one process running torch.optim.Muon + AdamW,
and equals gather-then-compute on the same fully_shard setup however FSDP2 is configured."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dmuon.plan.batches import default_return_waves

from support.cases import Case, run_cases
from support.equivalence import N_MATRICES, SKIP, STEPS, check_sharded_state, max_diff, reference
from support.models import OddNet
from support.spawn import run_distributed


# bf16 NS: the distributed gradient differs from the single-process one by
# summation order (~1e-7 relative). Inside bf16 NS that can flip the rounding
# of an element (relative 2^-8), changing an NS output entry by a few bf16 ulps
# of its O(1) magnitude. Each step moves a weight by lr * sqrt(max(1, m/n)) *
# |NS entry| <= 0.02 * 5.4 * 1.2; a flip changes the step by at most 2^-6 of that
# with margin, so after STEPS steps the bound is STEPS * 0.02 * 5.4 * 1.2 / 64.
BF16_TOL = STEPS * 0.02 * 5.4 * 1.2 / 64


# 2 ranks under -m slow: [4] runs the same cases on an even split by default, [3] on an uneven one and [1] on
# one rank.
@pytest.mark.parametrize("world_size", [1, pytest.param(2, marks=pytest.mark.slow), 3, 4])
def test_matches_single_process_reference(world_size):
    cases = [
        Case(zero=2, ns_dtype=torch.float32, steps=STEPS, skip=SKIP),
        # The update returns pipelined in up to 4 waves (the CPU default is one).
        Case(zero=3, ns_dtype=torch.float32, steps=STEPS, skip=SKIP, return_waves=4),
        Case(zero=3, ns_dtype=torch.bfloat16, steps=STEPS, skip=SKIP),
        Case(kind="gather", ns_dtype=torch.float32, steps=STEPS, skip=SKIP),
    ]
    if 200 % world_size == 0:
        # FSDP2 sharding two matrices by columns (its shard_placement_fn; FSDP2 splits dims
        # other than 0 only evenly): their pieces are column boxes.
        cases.append(Case(zero=3, ns_dtype=torch.float32, steps=STEPS, skip=SKIP,
                          column_sharded=("layers.1.down.weight", "layers.2.down.weight")))
    results = run_distributed(run_cases, world_size, cases)
    ref32, losses32 = reference(world_size, torch.float32)
    ref16, _ = reference(world_size, torch.bfloat16)
    per_step_active = [N_MATRICES - 3 * len(SKIP.get(s, ())) for s in range(STEPS)]
    for k, case in enumerate(cases):
        out = results[0][k]
        ref = ref16 if case.ns_dtype == torch.bfloat16 else ref32
        tol = BF16_TOL if case.ns_dtype == torch.bfloat16 else 1e-5
        diff, worst = max_diff(out["params"], ref)
        assert diff <= tol, f"{case}: {worst} differs by {diff:.3g} (tol {tol:.3g})"
        if case.ns_dtype == torch.float32:
            assert out["losses"] == pytest.approx(losses32, rel=1e-5, abs=1e-6)
        if case.kind == "dmuon":
            for step in range(STEPS):
                # Each active matrix orthogonalized exactly once in the cluster.
                assert sum(r[k]["stats"][step]["orthogonalized"] for r in results) == per_step_active[step]
                # Every block with gradients was exchanged from backward (root + 3 layers, one skipped at step 1).
                assert out["stats"][step]["blocks_exchanged_in_backward"] == 4 - len(SKIP.get(step, ()))
            check_sharded_state(results, k, out["shapes"])
            assert set(out["owners"].values()) == set(range(world_size))


FROZEN = ("layers.0.", "layers.2.mid.")  # a whole block and one matrix of another


def _oracle_pairs() -> list[tuple[str, Case]]:
    base = Case(ns_dtype=torch.float32, steps=STEPS, skip=SKIP)
    settings = {
        "bf16 mixed precision": dict(bf16=True),
        "bf16 mixed precision, ZeRO-2": dict(bf16=True, zero=2),
        "frozen parameters": dict(frozen=FROZEN),
        "activation checkpointing": dict(activation_checkpointing="early_stop"),
        "torch.compile per block": dict(compile=True, steps=2),
        "bf16 NS, ns_in_backward": dict(ns_dtype=torch.bfloat16, ns_in_backward=True),
        # What a step is on an accelerator: its default return waves (so no speculation), bf16 mixed precision.
        "accelerator defaults, bf16 mixed precision": dict(bf16=True, return_waves=default_return_waves("cuda")),
    }
    return [(label, dataclasses.replace(base, **kw)) for label, kw in settings.items()]


def test_equals_gather_then_compute_under_fsdp2_settings():
    pairs = _oracle_pairs()
    cases = []
    for _, case in pairs:
        cases += [case, dataclasses.replace(case, kind="gather", ns_in_backward=False)]
    results = run_distributed(run_cases, 3, cases, timeout_s=300)
    torch.manual_seed(0)
    start = {n: p.detach().clone() for n, p in OddNet().named_parameters()}
    for k, (label, case) in enumerate(pairs):
        got, oracle = results[0][2 * k], results[0][2 * k + 1]
        diff, worst = max_diff(got["params"], oracle["params"])
        assert diff <= 1e-5, f"{label}: {worst} differs from gather-then-compute by {diff:.3g}"
        assert got["losses"] == pytest.approx(oracle["losses"], rel=1e-5), label
        moved = [n for n in start if not torch.equal(got["params"][n], start[n])]
        if case.frozen:
            frozen = [n for n in start if n.startswith(case.frozen)]
            assert frozen and not set(frozen) & set(moved), label
            assert not set(frozen) & {n for r in results for n in r[2 * k]["state_keys"]}, label
            assert sum(r[2 * k]["stats"][0]["orthogonalized"] for r in results) == N_MATRICES - 4
        else:
            assert len(moved) == len(start), label
