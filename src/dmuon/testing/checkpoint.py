"""Save on one cluster, resume on another, through torch's own checkpoint API (run inside spawned ranks).

Nothing here is dmuon-specific: the calls are the ones a training script makes
for FSDP2 + AdamW (``get_model_state_dict``/``get_optimizer_state_dict``,
``dcp.save``/``dcp.load``, ``set_model_state_dict``/``set_optimizer_state_dict``),
with the default (strict) options. DMuon's state lives beside the parameter
shards as DTensors, so DCP reshards it like AdamW's.
"""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_optimizer_state_dict, set_model_state_dict, set_optimizer_state_dict,
)

from dmuon.testing.cases import full_params, sharded_oddnet
from dmuon.testing.models import lm_loss

GLOBAL_BATCH = 12  # divides by 1, 2, 3 and 4 ranks


def global_batch(step: int, vocab: int = 50, seq: int = 7):
    """The whole batch of ``step`` (the single-process reference trains on it)."""
    g = torch.Generator().manual_seed(500 + step)
    tokens = torch.randint(0, vocab, (GLOBAL_BATCH, seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _local(step: int, rank: int, world_size: int):
    """This rank's slice of the global batch (every rank of the world gets a distinct slice)."""
    tokens, targets = global_batch(step)
    per = GLOBAL_BATCH // world_size
    return tokens[rank * per : (rank + 1) * per], targets[rank * per : (rank + 1) * per]


def _train(model, opt, rank, world_size, steps):
    for step in steps:
        lm_loss(model, _local(step, rank, world_size)).backward()
        opt.step()
        opt.zero_grad()


def save(model, opt, path: str) -> None:
    """What a user writes to save FSDP2 + any torch optimizer."""
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.save(state, checkpoint_id=path)


def load(model, opt, path: str) -> None:
    """What a user writes to resume (default options: strict)."""
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])


def _full_model_state(model) -> dict[str, torch.Tensor]:
    """The full, CPU model state dict (a collective; rank 0 gets the tensors, as torch documents)."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.detach().clone() for k, v in state.items()}


def save_after(rank: int, world_size: int, path: str, steps: int, zero: int, mesh_shape=None) -> dict | None:
    """Trains ``steps`` steps, saves a DCP checkpoint at ``path``.

    Returns (rank 0): the full CPU model state dict taken after the save and
    the live full parameters, for the plain-model check.
    """
    model, _, opt = sharded_oddnet(world_size, zero=zero, mesh_shape=mesh_shape)
    _train(model, opt, rank, world_size, range(steps))
    save(model, opt, path)
    state = _full_model_state(model)
    params = full_params(model)
    return {"state": state, "params": params} if rank == 0 else None


def resume_and_train(rank: int, world_size: int, path: str, start: int, steps: int, zero: int,
                     mesh_shape=None) -> dict | None:
    """Builds a fresh model on this cluster, resumes from ``path`` and trains ``steps`` more steps.

    Returns (rank 0): every parameter's full value.
    """
    model, _, opt = sharded_oddnet(world_size, zero=zero, mesh_shape=mesh_shape)
    load(model, opt, path)
    _train(model, opt, rank, world_size, range(start, start + steps))
    params = full_params(model)
    return params if rank == 0 else None


def resume_matches_continuing(rank: int, world_size: int, path: str, saved_at: int, more: int,
                              frozen: tuple[str, ...]) -> dict | None:
    """bf16 mixed precision with frozen parameters: save, then both continue and resume.

    One model trains ``saved_at`` steps, saves, and trains ``more`` steps on;
    a fresh model resumes from the checkpoint and trains the same ``more`` steps.

    Returns (rank 0): both runs' full parameters, the frozen parameters'
    initial values and which parameters had optimizer state after the load.
    """
    kw = dict(zero=3, bf16=True, frozen=frozen)
    model, _, opt = sharded_oddnet(world_size, **kw)
    initial = full_params(model)
    _train(model, opt, rank, world_size, range(saved_at))
    save(model, opt, path)
    _train(model, opt, rank, world_size, range(saved_at, saved_at + more))
    continued = full_params(model)
    del model, opt

    model, _, opt = sharded_oddnet(world_size, **kw)
    load(model, opt, path)
    with_state = sorted(n for n, p in model.named_parameters() if opt.state.get(p))
    _train(model, opt, rank, world_size, range(saved_at, saved_at + more))
    resumed = full_params(model)
    if rank != 0:
        return None
    return {"continued": continued, "resumed": resumed, "initial": initial, "with_state": with_state}


def on_4_ranks(rank: int, world_size: int, directory: str, saved_at: int, more: int,
               frozen: tuple[str, ...]) -> dict | None:
    """The 4-rank work of the checkpoint tests in one process group (one spawn costs more than the work).

    ``save_after`` (fp32, ZeRO-3) into ``directory/fp32``, then
    ``resume_matches_continuing`` (bf16, ``frozen``) in ``directory/bf16``.
    """
    saved = save_after(rank, world_size, f"{directory}/fp32", saved_at, 3)
    bf16 = resume_matches_continuing(rank, world_size, f"{directory}/bf16", saved_at, more, frozen)
    return {"saved": saved, "bf16": bf16} if rank == 0 else None
