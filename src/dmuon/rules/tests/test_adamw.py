"""AdamW on FSDP2 shards: dmuon's local-shard path against torch.optim.AdamW on the DTensors."""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from dmuon.rules.adamw import adamw_group_step
from dmuon.util.spawn import run_distributed

HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _sharded_model(mesh) -> nn.Module:
    torch.manual_seed(0)
    # 7 and 1 rows do not divide by 2 or 3 ranks: uneven and empty local shards.
    model = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 1), nn.LayerNorm(1))
    fully_shard(model, mesh=mesh)
    return model


def compare_on_ranks(rank: int, world_size: int) -> list[bool]:
    mesh = init_device_mesh("cpu", (world_size,))
    ours, theirs = _sharded_model(mesh), _sharded_model(mesh)
    reference = torch.optim.AdamW(theirs.parameters(), **HYPER)
    group = {"params": list(ours.parameters()), "foreach": None, **HYPER}
    state: dict = defaultdict(dict)  # as torch.optim.Optimizer.state
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(4, 5, generator=gen)
        for model in (ours, theirs):
            model(x).square().sum().backward()
        adamw_group_step(group, state)
        reference.step()
        for model in (ours, theirs):
            model.zero_grad(set_to_none=True)
    same = []
    for p, q in zip(ours.parameters(), theirs.parameters()):
        assert isinstance(p, DTensor)
        same.append(torch.equal(p.to_local(), q.to_local()))
        for key in ("exp_avg", "exp_avg_sq"):
            assert isinstance(state[p][key], DTensor)
            same.append(torch.equal(state[p][key].to_local(), reference.state[q][key].to_local()))
        same.append(torch.equal(state[p]["step"], reference.state[q]["step"]))
    return same


def test_local_shard_adamw_is_bitwise_torch_adamw_on_dtensors():
    for world_size in (2, 3):
        for same in run_distributed(compare_on_ranks, world_size):
            assert all(same)
