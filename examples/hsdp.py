"""HSDP on a (replicate, shard) mesh, both kinds (docs/guides/hsdp.md): dmuon's replicate level
(``kind="dmuon"``: FSDP2 over the shard dim, ``hsdp_mesh=`` the whole mesh) and FSDP2's own
(``kind="fsdp2"``: ``fully_shard`` over the 2-D mesh). ``python examples/hsdp.py`` runs both on 4 gloo
CPU ranks, a (2, 2) mesh. ``options``: more ``DMuon`` keywords.
"""

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dmuon
from dmuon.testing.spawn import run_distributed
from quickstart import TinyLM, batch, loss_of


def train(rank: int, world_size: int, kind: str = "dmuon", steps: int = 3, **options) -> dict[str, torch.Tensor]:
    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = TinyLM()
    fsdp_mesh = mesh["shard"] if kind == "dmuon" else mesh        # dmuon's level: FSDP2 over mesh["shard"] only
    for block in model.layers:
        fully_shard(block, mesh=fsdp_mesh)
    fully_shard(model, mesh=fsdp_mesh)
    opt = dmuon.DMuon(model, lr=0.02, adamw=dmuon.AdamWConfig(lr=3e-3),
                      hsdp_mesh=mesh if kind == "dmuon" else None, **options)
    for step in range(steps):
        loss = loss_of(model, batch(step, rank))   # every rank reads its own batch
        loss.backward()
        opt.clip_grad_norm_(1.0)                       # one scalar all-reduce, on either kind
        opt.step()
        opt.zero_grad()
        if rank == 0:
            print(f"step {step}: loss {loss.item():.4f} (rank 0's batch)")
    return {name: p.full_tensor() for name, p in model.named_parameters()}


if __name__ == "__main__":
    for kind in ("dmuon", "fsdp2"):
        print(f"HSDP, {kind}:", flush=True)
        run_distributed(train, 4, kind)
