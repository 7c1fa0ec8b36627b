"""torch.nn.utils.clip_grad_norm_ on the FSDP2 model, as is, equals it on one process."""

from __future__ import annotations

import pytest
import torch

from dmuon.util.spawn import run_distributed

from support.cases import MUON_KW, Case, run_cases
from support.models import OddNet, lm_loss, odd_batch
from support.reference import reference_training


CLIP = 0.3  # below the gradient norms of this model, so clipping acts every step


@pytest.mark.parametrize("world_size,mesh_shape", [(3, None), (4, (2, 2))])
def test_torch_clip_matches_one_process(world_size, mesh_shape):
    steps = 2
    cases = [Case(zero=z, ns_dtype=torch.float32, steps=steps, clip=CLIP, mesh_shape=mesh_shape, overlap=o)
             for z, o in ((2, True), (3, False))]
    results = run_distributed(run_cases, world_size, cases, timeout_s=180)
    torch.manual_seed(0)
    model = OddNet()
    batches = []
    for step in range(steps):
        parts = [odd_batch(step, r) for r in range(world_size)]
        batches.append((torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])))
    ref, _ = reference_training(model, batches, lm_loss, muon_kwargs=MUON_KW,
                                adamw_kwargs=dict(lr=3e-3, weight_decay=0.01),
                                ns_dtype=torch.float32, clip=CLIP)
    ref_norms = reference_training.norms
    assert min(ref_norms) > CLIP
    for k in range(len(cases)):
        for r in results:
            assert r[k]["norms"] == pytest.approx(ref_norms, rel=1e-5)
            # The clipped gradients differ from what backward launched: step() exchanged them again.
            assert all(s["blocks_exchanged_in_backward"] == 0 for s in r[k]["stats"])
            # Nothing orthogonalized while agreeing was kept: the launches went stale.
            assert all(s["orthogonalized_while_agreeing"] == 0 for s in r[k]["stats"])
        got = results[0][k]["params"]
        worst = max(got, key=lambda n: (got[n] - ref[n]).abs().max().item())
        assert (got[worst] - ref[worst]).abs().max().item() <= 1e-5, worst
