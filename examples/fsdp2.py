"""FSDP2 on a 1-D mesh (docs/guides/fsdp2.md): ZeRO-2, two micro-batches accumulated, torch's clipping,
the plan and the last step's report. ``python examples/fsdp2.py`` runs it on 2 gloo CPU ranks.

``options`` of :func:`train` are more ``DMuon`` keywords (tests/layouts/test_examples.py passes an fp32 NS to
compare every parameter with one process running torch.optim.Muon + AdamW).
"""

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dmuon
from dmuon.testing.spawn import run_distributed
from quickstart import TinyLM, batch, loss_of


def train(rank: int, world_size: int, steps: int = 3, **options) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = TinyLM()
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.layers:
        fully_shard(block, mesh=mesh, reshard_after_forward=False)   # ZeRO-2 (True, the default: ZeRO-3)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    opt = dmuon.DMuon(model, lr=0.02, adamw=dmuon.AdamWConfig(lr=3e-3), **options)
    for step in range(steps):
        tokens = batch(step, rank)
        loss = 0.0
        for micro in range(2):          # reduce (and send the owners their directions) after the last only
            model.set_requires_gradient_sync(micro == 1)
            half = loss_of(model, tokens[2 * micro:2 * micro + 2]) / 2
            half.backward()
            loss += half.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)   # torch's own
        opt.step()
        opt.zero_grad()
        if rank == 0:
            print(f"step {step}: loss {loss:.4f} (rank 0's batch)")
    if rank == 0:
        print(opt.plan)                 # each Muon matrix's owner and costs
        print(opt.last_step_report())   # the last step's bytes and seconds
    return {name: p.full_tensor() for name, p in model.named_parameters()}


if __name__ == "__main__":
    run_distributed(train, 2)
