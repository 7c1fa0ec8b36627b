"""The standard equivalence run the distributed tests share: OddNet for ``STEPS`` steps with one
block left out at step 1, its single-process reference, and the checks on what the ranks report."""

from __future__ import annotations

import torch

from support.cases import MUON_KW
from support.models import OddNet, lm_loss, odd_batch
from support.reference import reference_training

STEPS = 3
SKIP = {1: {1}}  # block 1 is unused at step 1 on every rank
N_MATRICES = 12  # conv, 3 per block x 3 blocks, gate, lift


def all_ranks_batches(world_size: int):
    """Every rank's OddNet batches of ``STEPS`` steps joined into one per step, and the loss that
    leaves ``SKIP``'s blocks out: what one process trains on to equal ``world_size`` ranks."""
    batches = []
    for step in range(STEPS):
        parts = [odd_batch(step, r) for r in range(world_size)]
        batches.append((torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])))

    def loss_fn(m, batch, _step=[0]):
        m.skip = SKIP.get(_step[0], set())
        _step[0] += 1
        return lm_loss(m, batch)

    return batches, loss_fn


def reference(world_size: int, ns_dtype: torch.dtype, frozen: tuple[str, ...] = ()):
    """One process training OddNet (seed 0) on all ``world_size`` ranks' batches of ``STEPS`` steps,
    ``SKIP`` applied, with torch.optim.Muon + AdamW: ``(params, losses)``."""
    torch.manual_seed(0)
    model = OddNet()
    for name, p in model.named_parameters():
        if name.startswith(frozen):
            p.requires_grad_(False)
    batches, loss_fn = all_ranks_batches(world_size)
    return reference_training(
        model, batches, loss_fn, muon_kwargs=MUON_KW,
        adamw_kwargs=dict(lr=3e-3, weight_decay=0.01), ns_dtype=ns_dtype,
    )


def max_diff(a: dict, b: dict) -> tuple[float, str]:
    """The largest absolute difference between two name -> tensor dicts (same keys), and where."""
    assert a.keys() == b.keys()
    worst = max(a, key=lambda n: (a[n] - b[n]).abs().max().item())
    return (a[worst] - b[worst]).abs().max().item(), worst


def check_sharded_state(results, k, shapes) -> None:
    """Momentum lives beside the shards: each matrix's buffers over all ranks add up to it once."""
    for name, shape in shapes.items():
        total = sum(r[k]["momentum_numel"].get(name, 0) for r in results)
        assert total == torch.Size(shape).numel(), name
