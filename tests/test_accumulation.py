"""Gradient accumulation reduces and orthogonalizes once per step and equals one large batch."""

from __future__ import annotations

import pytest
import torch

from dmuon.testing import run_distributed
from dmuon.testing.cases import MUON_KW, run_accumulation
from dmuon.testing.models import OddNet, lm_loss, odd_batch
from dmuon.testing.reference import reference_training


@pytest.mark.parametrize("zero,overlap", [(2, True), (3, False)])
def test_accumulation_matches_one_large_batch(zero, overlap):
    world_size, steps = 2, 2
    out = run_distributed(run_accumulation, world_size, zero, overlap, 2, steps, timeout_s=120)
    torch.manual_seed(0)
    model = OddNet()
    batches = []
    for step in range(steps):
        parts = [odd_batch(step, r, batch=4) for r in range(world_size)]
        batches.append((torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])))
    ref, _ = reference_training(model, batches, lm_loss, muon_kwargs=MUON_KW,
                                adamw_kwargs=dict(lr=3e-3, weight_decay=0.01), ns_dtype=torch.float32)
    got = out[0]["params"]
    worst = max(got, key=lambda n: (got[n] - ref[n]).abs().max().item())
    assert (got[worst] - ref[worst]).abs().max().item() <= 1e-5, worst
    assert sum(o["orthogonalized"] for o in out) == 12
