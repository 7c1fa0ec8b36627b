"""This rank's live bytes of the training state, measured from the tensors themselves (not from shapes).

Parameters as the unique storages under the local shards, gradients the same,
optimizer state as the storages of every tensor in ``opt.state`` (local shards
of DTensors). The benchmark runner reports these; the tests compare FSDP2 +
AdamW against FSDP2 + DMuon with them.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from dmuon.util.dtensor import local_tensor


def state_tensors(optimizer):
    """Every tensor in the optimizer's per-parameter state (both optimizers of a Muon + AdamW pair), and
    DMuon's owners' momentum copies while it keeps them (``ExecutionConfig.clipped_overlap``)."""
    for opt in getattr(optimizer, "opts", (optimizer,)):
        for state in opt.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    yield value
    owner_momentum = getattr(getattr(optimizer, "runtime", None), "owner_momentum", None)
    if owner_momentum is not None:
        yield from owner_momentum.tensors()


def storages(tensors: Iterable[torch.Tensor]) -> dict[int, int]:
    """``data_ptr -> nbytes`` of the unique storages under ``tensors`` (their local shards)."""
    return {local_tensor(t).untyped_storage().data_ptr(): local_tensor(t).untyped_storage().nbytes() for t in tensors}


def live_bytes_of(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the unique storages under ``tensors`` (local shards; deduplicated by data_ptr)."""
    return sum(storages(tensors).values())


def live_state_bytes(model: nn.Module, optimizer) -> dict[str, int]:
    """This rank's live bytes of the training state, measured from the tensors themselves.

    The unique storages (``untyped_storage().nbytes()``, deduplicated by their
    ``data_ptr()``) reachable from the model's parameters, their gradients and
    the optimizer's state tensors, each taken as this rank's local shard
    (``DTensor.to_local()``): what this rank actually holds, padding and shared
    buffers included, not what the shapes say. ``total`` deduplicates across
    the three kinds.
    """
    kinds = {
        "params": storages(model.parameters()),
        "grads": storages(p.grad for p in model.parameters() if p.grad is not None),
        "optimizer_state": storages(state_tensors(optimizer)),
    }
    out = {kind: sum(found.values()) for kind, found in kinds.items()}
    out["total"] = sum({k: v for found in kinds.values() for k, v in found.items()}.values())
    return out
