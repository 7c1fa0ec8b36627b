"""Rank function for ``tests/conventions/test_clip.py``: clipped training resumed from an optimizer state dict."""

from __future__ import annotations

import torch

import dmuon

from support.cases import full_params, sharded_oddnet
from support.models import lm_loss, odd_batch

CLIP = 0.3


def resumed_clipping(rank: int, world_size: int, mesh_shape, hsdp: str, steps: int = 4, resume_at: int = 2) -> dict:
    """Trains OddNet ``steps`` clipped steps twice, each taking the optimizer's state dict after
    ``resume_at`` steps: straight through, and with the optimizer replaced by a new one loaded from it.
    Returns both runs' parameters (rank 0) and per-step stats."""
    runs = {}
    for resumed in (False, True):
        model, plan, opt = sharded_oddnet(world_size, mesh_shape=mesh_shape, hsdp=hsdp)
        stats = []
        for step in range(steps):
            if step == resume_at:
                state = opt.state_dict()  # a checkpoint; the straight run goes on with its optimizer
                if resumed:
                    opt = dmuon.DMuon(model, plan, lr=0.02, adamw=dmuon.AdamWConfig(lr=3e-3),
                                      ns=dmuon.NSConfig(method="standard", dtype=torch.float32))
                    opt.load_state_dict(state)
            lm_loss(model, odd_batch(step, rank)).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            opt.zero_grad()
            stats.append(opt.last_step_stats())
        params = full_params(model)  # a collective: on every rank
        runs[resumed] = {"params": params if rank == 0 else None, "stats": stats}
    return {"straight": runs[False], "resumed": runs[True]}


def state_dict_on_one_rank(rank: int, world_size: int, steps: int = 4, at: int = 2) -> list[dict]:
    """Clipped training where only rank 0 takes the optimizer's state dict, after ``at`` steps: every
    rank's per-step stats (the next step must go the same way on every rank, not hang)."""
    model, plan, opt = sharded_oddnet(world_size)
    stats = []
    for step in range(steps):
        if step == at and rank == 0:
            opt.state_dict()
        lm_loss(model, odd_batch(step, rank)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        stats.append(opt.last_step_stats())
    return stats
