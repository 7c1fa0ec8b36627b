"""step() reads tensor values to the host a fixed number of times, however many matrices it steps.

On an accelerator each such read (``.item()``, ``bool(t)``, ``torch.equal``) waits for the device
to finish everything queued before it, so a read per matrix stalls the host once per matrix and
leaves the device idle in between. The runtime's checks of the launches from backward (were the
directions sent those the step computes; were the gradients clipped since) therefore stay on the
device and travel with the step's agreement. Counted here on CPU with a dispatch mode: the reads
a model with 2 blocks makes equal those one with 5 blocks makes, with and without clipping (torch's
``clip_grad_norm_`` or DMuon's, which itself reads nothing), with ``nonfinite="skip"`` (its
checks of every gradient), on a 1-D mesh and on dmuon's replicate level. torch.optim's AdamW
reads its step counters, which live on the host (no wait for the device); those are not counted
(``dmuon bench --gpu-check`` counts every synchronizing call on CUDA).
"""

from __future__ import annotations

import functools

import pytest
import torch

import dmuon
from dmuon.bench.op_count import HostReadCounter
from support.spawn import run_distributed

from support.cases import sharded_oddnet
from support.checkpoint import _local
from support.models import lm_loss
from support.scenarios import succeeded

# Its point is stream order (the launches' check reading the device): every rank runs under the stream checker.
pytestmark = pytest.mark.streams


def _reads_per_step(rank: int, world_size: int, mesh_shape, blocks: int, variant: str) -> list[int]:
    execution = dmuon.ExecutionConfig(nonfinite="skip" if variant == "nonfinite" else None)
    model, plan, opt = sharded_oddnet(world_size, mesh_shape=mesh_shape, blocks=blocks,
                                      hsdp="dmuon" if mesh_shape else "fsdp2", execution=execution)
    counts = []
    for step in range(4):
        lm_loss(model, _local(step, rank, world_size)).backward()
        reads = HostReadCounter(s["step"] for s in opt.state.values() if isinstance(s.get("step"), torch.Tensor))
        if variant == "torch clip":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        with reads:
            if variant == "dmuon clip":
                opt.clip_grad_norm_(0.05)
            opt.step()
        opt.zero_grad()
        counts.append(reads.count)
    # The launches were checked, and every one stood.
    assert opt.last_step_stats()["blocks_exchanged_in_backward"] == len(plan.blocks) > blocks
    return counts


VARIANTS = ("no clip", "torch clip", "dmuon clip", "nonfinite")


def _every_variant(rank: int, world_size: int, mesh_shape) -> dict:
    """:func:`_reads_per_step` for each variant with 2 and with 5 blocks, in one process group (a launch costs
    more than a run); a run that raised fails only its variant's assertions (:func:`support.scenarios.run_each`)."""
    from support.scenarios import run_each

    return run_each({(variant, blocks): functools.partial(_reads_per_step, rank, world_size, mesh_shape, blocks, variant)
                     for variant in VARIANTS for blocks in (2, 5)})


@pytest.mark.parametrize("mesh_shape", [None, pytest.param((2, 2), marks=pytest.mark.slow)])  # 2x2: under -m slow
def test_step_reads_the_device_a_fixed_number_of_times(mesh_shape):
    world_size = 2 if mesh_shape is None else 4
    results = run_distributed(_every_variant, world_size, mesh_shape, timeout_s=180)
    for variant in VARIANTS:
        few, many = ([succeeded(r[variant, blocks]) for r in results] for blocks in (2, 5))
        # The first step sets up (no launches to check); from the second on the launches are checked
        # (and with clipping, from the third on the owners' copies rescale them).
        assert [r[1:] for r in few] == [r[1:] for r in many], (variant, few, many)
        assert max(max(r[1:]) for r in few) <= 4, (variant, few)
