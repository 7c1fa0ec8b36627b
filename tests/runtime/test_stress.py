"""Many steps on 4 ranks with random unused blocks and batch sizes equal the single-process run."""

from __future__ import annotations

import random

import pytest
import torch

from support.spawn import run_distributed

from support.cases import MUON_KW, Case, run_cases
from support.models import OddNet, lm_loss, odd_batch
from support.reference import reference_training

WORLD_SIZE = 4


def _schedule(steps: int, seed: int = 0) -> tuple[dict[int, set[int]], dict[int, int]]:
    """Per step: the blocks left out (none, one or two of three) and the per-rank batch size."""
    rng = random.Random(seed)
    skip = {s: set(rng.sample(range(3), rng.choice([0, 0, 1, 2]))) for s in range(steps)}
    sizes = {s: rng.randint(1, 4) for s in range(steps)}
    return skip, sizes


def _reference(steps: int, skip, sizes):
    torch.manual_seed(0)
    model = OddNet()
    batches = []
    for step in range(steps):
        parts = [odd_batch(step, r, batch=sizes[step]) for r in range(WORLD_SIZE)]
        batches.append((torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])))

    def loss_fn(m, batch, _step=[0]):
        m.skip = skip[_step[0]]
        _step[0] += 1
        return lm_loss(m, batch)

    return reference_training(model, batches, loss_fn, muon_kwargs=MUON_KW,
                              adamw_kwargs=dict(lr=3e-3, weight_decay=0.01), ns_dtype=torch.float32)


def _check(steps: int, zeros: tuple[int, ...], tol: float) -> None:
    skip, sizes = _schedule(steps)
    cases = [Case(zero=z, steps=steps, skip=skip, batch_sizes=sizes) for z in zeros]
    results = run_distributed(run_cases, WORLD_SIZE, cases, timeout_s=600)
    ref, ref_losses = _reference(steps, skip, sizes)
    for k, case in enumerate(cases):
        out = results[0][k]
        worst = max(ref, key=lambda n: (out["params"][n] - ref[n]).abs().max().item())
        diff = (out["params"][worst] - ref[worst]).abs().max().item()
        assert diff <= tol, f"ZeRO-{case.zero}: {worst} differs by {diff:.3g} after {steps} steps (tol {tol})"
        assert out["losses"] == pytest.approx(ref_losses, rel=1e-4, abs=1e-5)


def test_stress_short():
    # The CI form: 25 steps of the schedule, ZeRO-3 with overlap.
    _check(25, (3,), tol=1e-5)


@pytest.mark.slow
def test_stress_200_steps():
    _check(200, (2, 3), tol=1e-5)
