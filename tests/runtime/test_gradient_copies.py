"""The launches' copies of their gradients exist only where a later rescale needs them (2 gloo ranks, FSDP2).

A launch from backward stands after a rescale (a clip, a grad scaler's ``unscale_``) only once the
owners keep the momentum, and then only on proof, bit for bit, that every element of its gradient
parts is the launched one times the factor: only then does it keep a copy of them. Before (a run
that never rescales, the first rescaled step), each launch keeps its parts' extrema, two elements
per matrix, from which the first rescale is recognised. Counted here, with the launches kept and
rescaled per step, which say that nothing else changed (test_clip compares the results with
``overlap=False``). CUDA rule it stands for: the copies are allocator memory held from backward to
``step()``, at the peak of a step.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from support.cases import sharded_oddnet
from support.models import lm_loss, odd_batch
from support.spawn import run_distributed

WORLD, STEPS, BLOCKS = 2, 3, 4
CLIP = 0.3  # below this model's gradient norms: the clip acts every step


def _kept_bytes(rank: int, world_size: int, how: str) -> list[dict]:
    model, _, opt = sharded_oddnet(world_size)
    scaler = ShardedGradScaler("cpu", init_scale=256.0) if how == "grad scaler" else None
    launches, out = opt.runtime.backward, []
    for step in range(STEPS):
        loss = lm_loss(model, odd_batch(step, rank))
        (loss if scaler is None else scaler.scale(loss)).backward()
        members = sorted(i for launch in launches._launches.values() for i in launch.members)
        parts = opt.runtime.gradients.local_parts(members).values()
        row = {"kept": launches.kept_gradient_bytes(), "launched": len(members),
               "parts": sum(t.numel() * t.element_size() for t in parts), "held": sum(t.numel() > 0 for t in parts)}
        if how == "clip":
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)  # torch's: dmuon does not see it coming
        if scaler is None:
            opt.step()
        else:
            scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
        opt.zero_grad()
        stats = opt.last_step_stats()
        out.append(row | {"exchanged": stats["blocks_exchanged_in_backward"], "rescaled": stats["rescaled_launches"]})
    return out


@pytest.fixture(scope="module")
def runs() -> dict[str, list[list[dict]]]:
    return {how: run_distributed(_kept_bytes, WORLD, how, timeout_s=180) for how in ("none", "clip", "grad scaler")}


def _extrema_only(row: dict) -> bool:
    # Two float32 elements per matrix this rank holds a part of: nothing that grows with the gradients.
    return row["held"] > 0 and row["kept"] == 2 * 4 * row["held"]


def test_a_run_that_never_rescales_keeps_no_copy(runs):
    for rank in runs["none"]:
        assert all(row["launched"] > 0 and _extrema_only(row) for row in rank), rank
        assert [row["exchanged"] for row in rank] == [BLOCKS] * STEPS
        assert [row["rescaled"] for row in rank] == [0] * STEPS


@pytest.mark.parametrize("how", ["clip", "grad scaler"])
def test_copies_start_with_the_first_rescale(runs, how):
    """The first rescaled step is recognised from the extrema (its blocks exchanged again, the momentum
    sent to the owners); from the next step on each launch keeps a copy of its gradient parts, and the
    rescaled launches stand."""
    for rank in runs[how]:
        first, *later = rank
        assert _extrema_only(first), first
        assert all(row["parts"] > 0 and row["kept"] == row["parts"] for row in later), later
        assert [row["exchanged"] for row in rank] == [0] + [BLOCKS] * (STEPS - 1)
        assert [row["rescaled"] for row in rank] == [0] + [BLOCKS] * (STEPS - 1)
