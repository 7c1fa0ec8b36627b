"""Save on one cluster, resume on another (run inside spawned ranks)."""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_optimizer_state_dict, set_model_state_dict, set_optimizer_state_dict,
)

import dmuon
from dmuon.testing.cases import full_params, sharded_oddnet
from dmuon.testing.models import lm_loss

GLOBAL_BATCH = 12  # divides by 1, 2, 3 and 4 ranks


def global_batch(step: int, vocab: int = 50, seq: int = 7):
    g = torch.Generator().manual_seed(500 + step)
    tokens = torch.randint(0, vocab, (GLOBAL_BATCH, seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _local(step: int, rank: int, world_size: int):
    tokens, targets = global_batch(step)
    per = GLOBAL_BATCH // world_size
    return tokens[rank * per : (rank + 1) * per], targets[rank * per : (rank + 1) * per]


def _build(world_size: int, zero: int, mesh_shape=None):
    return sharded_oddnet(world_size, zero=zero, mesh_shape=mesh_shape)


def _train(model, opt, rank, world_size, steps):
    for step in steps:
        lm_loss(model, _local(step, rank, world_size)).backward()
        opt.step()
        opt.zero_grad()


def save_after(rank: int, world_size: int, path: str, steps: int, zero: int, mesh_shape=None) -> None:
    model, plan, opt = _build(world_size, zero, mesh_shape)
    _train(model, opt, rank, world_size, range(steps))
    with dmuon.full_weights(plan):
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
        dcp.save(state, checkpoint_id=path)


def resume_and_train(rank: int, world_size: int, path: str, start: int, steps: int, zero: int,
                     mesh_shape=None) -> dict:
    model, plan, opt = _build(world_size, zero, mesh_shape)
    with dmuon.full_weights(plan):
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(model, state["model"])
        # Momentum lives on owners only, so non-owners legitimately lack it.
        set_optimizer_state_dict(model, opt, state["optim"], options=StateDictOptions(strict=False))
    _train(model, opt, rank, world_size, range(start, start + steps))
    params = full_params(model, plan)
    return params if rank == 0 else None


def full_model_state(rank: int, world_size: int, zero: int) -> dict | None:
    """A full, CPU model state dict from a sharded dmuon model (rank 0), plus the live values."""
    model, plan, opt = _build(world_size, zero)
    _train(model, opt, rank, world_size, range(2))
    with dmuon.full_weights(plan):
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        # The matrices' entries alias the live (ZeRO-3: soon freed) storage.
        state = {k: v.detach().clone() for k, v in state.items()}
    params = full_params(model, plan)
    return {"state": state, "params": params} if rank == 0 else None
