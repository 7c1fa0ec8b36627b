"""Tensor parallelism with FSDP2 (docs/guides/tp.md): torch's ``parallelize_module`` on the tp dim of a
``(dp, tp)`` mesh (each block's ``up`` colwise, ``down`` rowwise), then ``fully_shard`` over dp.
``python examples/tp.py`` runs it on 4 gloo CPU ranks, a (2, 2) mesh. ``options``: more ``DMuon`` keywords.
"""

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import dmuon
from dmuon.testing.spawn import run_distributed
from quickstart import TinyLM, batch, loss_of


def train(rank: int, world_size: int, steps: int = 3, **options) -> dict[str, torch.Tensor]:
    mesh = init_device_mesh("cpu", (world_size // 2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = TinyLM()
    for block in model.layers:
        parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    opt = dmuon.DMuon(model, lr=0.02, adamw=dmuon.AdamWConfig(lr=3e-3), **options)
    for step in range(steps):
        loss = loss_of(model, batch(step, mesh.get_local_rank("dp")))   # a dp rank's tp ranks read alike
        loss.backward()
        opt.step()
        opt.zero_grad()
        if rank == 0:
            print(f"step {step}: loss {loss.item():.4f} (rank 0's batch)")
    return {name: p.full_tensor() for name, p in model.named_parameters()}


if __name__ == "__main__":
    run_distributed(train, 4)
