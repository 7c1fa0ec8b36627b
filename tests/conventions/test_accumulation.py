"""Gradient accumulation through FSDP2's set_requires_gradient_sync equals one large batch."""

from __future__ import annotations

import pytest
import torch

from support.spawn import run_distributed

from support.cases import MUON_KW, Case, run_cases
from support.models import OddNet, lm_loss, odd_batch
from support.reference import reference_training


def test_accumulation_matches_one_large_batch():
    world_size, steps, micro = 2, 2, 2
    cases = [Case(zero=z, overlap=o, steps=steps, micro_batches=micro) for z, o in ((2, True), (3, False))]
    out = run_distributed(run_cases, world_size, cases, timeout_s=120)
    torch.manual_seed(0)
    model = OddNet()
    batches = []
    for step in range(steps):
        parts = [odd_batch(step, r, batch=2 * micro) for r in range(world_size)]
        batches.append((torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])))
    ref, losses = reference_training(model, batches, lm_loss, muon_kwargs=MUON_KW,
                                     adamw_kwargs=dict(lr=3e-3, weight_decay=0.01), ns_dtype=torch.float32)
    for k in range(len(cases)):
        got = out[0][k]["params"]
        worst = max(got, key=lambda n: (got[n] - ref[n]).abs().max().item())
        assert (got[worst] - ref[worst]).abs().max().item() <= 1e-5, worst
        assert out[0][k]["losses"] == pytest.approx(losses, rel=1e-5)
        # Reduced and orthogonalized once per step, not once per micro-batch.
        assert all(sum(r[k]["stats"][s]["orthogonalized"] for r in out) == 12 for s in range(steps))
    assert all(s["blocks_exchanged_in_backward"] == 4 for s in out[0][0]["stats"])
