"""Rules that must not change silently (issue #63): what decides how a matrix is stepped is the selection and the
configuration, never where or when its work runs. Each test names the behaviour it stands for; each compares
against an independent reference (torch.optim.Muon + AdamW in one process, or the same run without the
disturbance) or counts what it keeps."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import dmuon
from support.cases import full_params, sharded_oddnet
from support.equivalence import max_diff
from support.models import lm_loss, odd_batch
from support.spawn import run_distributed

FP32_NS = dmuon.NSConfig(method="standard", dtype=torch.float32)


def _small() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))


def _small_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(5, 6, generator=g), torch.randn(5, 4, generator=g)


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# ----------------------------------------------------------------------------- step() under the caller's autocast
def _autocast_run(step_autocast: bool, execution: dmuon.ExecutionConfig | None = None) -> dict[str, torch.Tensor]:
    model = _small()
    opt = dmuon.DMuon(model, lr=0.02, ns=FP32_NS, execution=execution)
    for step in range(3):
        x, y = _small_batch(step)
        ((model(x) - y) ** 2).mean().backward()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=step_autocast):
            opt.step()
        opt.zero_grad()
    opt.flush_updates()
    return _params(model)


def test_step_under_autocast_runs_as_configured_in_one_process():
    """The owners' work follows NSConfig.dtype, not the caller's autocast: ``step()`` inside
    ``torch.autocast("cpu", dtype=torch.bfloat16)`` steps bit for bit as without it (fp32 NS; before, the
    NS matmuls ran in bf16 on the main thread: 2e-3 off after three steps)."""
    diff, where = max_diff(_autocast_run(True), _autocast_run(False))
    assert diff == 0.0, f"{where} differs by {diff}"


def _autocast_ranks(rank: int, world_size: int) -> dict | None:
    """Per execution: the run with ``step()`` (or the whole loop) under bf16 autocast against the run without."""
    out = {}
    variants = {
        "default, step under autocast": (dmuon.ExecutionConfig(), "step"),
        "ns_in_backward, whole loop under autocast": (dmuon.ExecutionConfig(ns_in_backward=True), "loop"),
        "next_forward, whole loop under autocast": (dmuon.ExecutionConfig(apply_updates="next_forward"), "loop"),
    }
    for name, (execution, where) in variants.items():
        results = []
        for autocast in (False, True):
            model, _, opt = sharded_oddnet(world_size, blocks=2, execution=execution)
            for step in range(3):
                # The forward always under autocast (the same gradients in both runs); the loop's backward and
                # step() under it in one run only.
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = lm_loss(model, odd_batch(step, rank))
                    if autocast and where == "loop":
                        loss.backward()
                if not (autocast and where == "loop"):
                    loss.backward()
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                    opt.step()
                opt.zero_grad()
            opt.flush_updates()
            results.append(full_params(model))
        out[name] = max_diff(*results)
    dist.barrier()
    return out if rank == 0 else None


def test_step_under_autocast_runs_as_configured_on_two_ranks():
    """On 2 ranks (FSDP2, fp32 NS) a matrix's result does not depend on whether its NS ran on the main
    thread (under the caller's autocast) or on the NS worker (never under it): ``step()``, and with
    ``ns_in_backward`` or ``apply_updates="next_forward"`` the whole loop, under bf16 autocast step bit for
    bit as without it (before: 8e-4 off after three steps)."""
    result = run_distributed(_autocast_ranks, 2)[0]
    for name, (diff, where) in result.items():
        assert diff == 0.0, f"{name}: {where} differs by {diff}"
