"""Data parallelism without sharding (docs/guides/ddp.md): torch's ``DistributedDataParallel`` stepped by
DMuon (``kind="ddp"``), and DDP with dmuon (``kind="route"``: FSDP2 over the one-rank shard dim of an
``(N, 1)`` mesh, dmuon's replicate level across the ranks). ``python examples/ddp.py`` runs both on 2
gloo CPU ranks. ``options``: more ``DMuon`` keywords.
"""

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import dmuon
from dmuon.testing.spawn import run_distributed
from quickstart import TinyLM, batch, loss_of


def build(world_size: int, kind: str, options: dict):
    torch.manual_seed(0)
    model = TinyLM()
    if kind == "ddp":
        model = DistributedDataParallel(model)   # find_unused_parameters, no_sync(), ... as you use them
        return model, dmuon.DMuon(model, lr=0.02, adamw=dmuon.AdamWConfig(lr=3e-3), **options)
    mesh = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("replicate", "shard"))
    for block in [*model.layers, model]:
        fully_shard(block, mesh=mesh["shard"])
    return model, dmuon.DMuon(model, lr=0.02, adamw=dmuon.AdamWConfig(lr=3e-3), hsdp_mesh=mesh, **options)


def train(rank: int, world_size: int, kind: str = "ddp", steps: int = 3, **options) -> dict[str, torch.Tensor]:
    model, opt = build(world_size, kind, options)
    for step in range(steps):
        loss = loss_of(model, batch(step, rank))
        loss.backward()
        opt.step()
        opt.zero_grad()
        if rank == 0:
            print(f"step {step}: loss {loss.item():.4f} (rank 0's batch)")
    if kind == "ddp":
        return {name: p.detach().clone() for name, p in model.module.named_parameters()}
    return {name: p.full_tensor() for name, p in model.named_parameters()}


if __name__ == "__main__":
    for kind in ("ddp", "route"):
        print("torch's DDP:" if kind == "ddp" else "DDP with dmuon:", flush=True)
        run_distributed(train, 2, kind)
