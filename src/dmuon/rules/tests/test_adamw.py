"""AdamW on FSDP2 shards: dmuon's local-shard path against torch.optim.AdamW on the DTensors."""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from dmuon.rules.adamw import adamw_group_step
from support.spawn import run_distributed

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


def aligned_cases(rank: int, world_size: int) -> dict[str, bool]:
    from torch.distributed.tensor import Partial, Replicate, Shard

    from dmuon.rules.adamw import aligned

    hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    other = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "shard"))
    flipped = init_device_mesh("cpu", (2, 2), mesh_dim_names=("shard", "replicate"))
    shard = hsdp["shard"]
    p = DTensor.from_local(torch.zeros(3, 4), shard, (Shard(0),), run_check=False)

    def grad(mesh, placements):
        return DTensor.from_local(torch.zeros(3, 4), mesh, placements, run_check=False)

    return {
        "same layout": aligned(p, grad(shard, (Shard(0),))),
        "copies over the replicate dim (native HSDP's layout)": aligned(p, grad(hsdp, (Replicate(), Shard(0)))),
        "other placements": aligned(p, grad(shard, (Replicate(),))),
        "a partial replicate dim": aligned(p, grad(hsdp, (Partial("avg"), Shard(0)))),
        "sharded over the replicate dim": aligned(p, grad(hsdp, (Shard(1), Shard(0)))),
        # The same dim names, but this rank's slice of the larger mesh is not p's mesh.
        "another mesh's trailing dim": aligned(p, grad(flipped["replicate"], (Shard(0),))),
        "a mesh whose trailing dim is not p's ranks": aligned(p, grad(flipped, (Replicate(), Shard(0)))),
        "a plain gradient of a DTensor": aligned(p, torch.zeros(3, 4)),
        "plain and plain": aligned(torch.zeros(2), torch.zeros(2)),
        "another outer mesh with p's ranks": aligned(p, grad(other, (Replicate(), Shard(0)))),
    }


def test_aligned_layouts_are_exactly_those_whose_local_tensors_match():
    expected = {
        "same layout": True,
        "copies over the replicate dim (native HSDP's layout)": True,
        "other placements": False,
        "a partial replicate dim": False,
        "sharded over the replicate dim": False,
        "another mesh's trailing dim": False,
        "a mesh whose trailing dim is not p's ranks": False,
        "a plain gradient of a DTensor": False,
        "plain and plain": True,
        # The trailing dim has p's name and, on this rank, p's ranks in p's order: the local
        # tensors match element for element whatever the leading dim is called.
        "another outer mesh with p's ranks": True,
    }
    for result in run_distributed(aligned_cases, 4):
        assert result == expected
