"""Pipeline stages (docs/guides/pipeline.md): torch.distributed.pipelining's 1F1B over 2 stages, each
stage ``fully_shard``-ed over its own data-parallel ranks, one DMuon per stage with ``pp_group`` (clipping
by the whole model's norm). ``python examples/pipeline.py`` runs it on 4 gloo CPU ranks, a (pp 2, dp 2)
mesh. ``options``: more ``DMuon`` keywords.
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

import dmuon
from dmuon.testing.spawn import run_distributed
from quickstart import TinyLM, batch


class Stage(nn.Module):
    """Stage ``index`` of ``stages``: a run of the model's layers, the first stage with the embedding, the
    last with the head; the parameters keep the whole model's names (``layers.1.up.weight``)."""

    def __init__(self, model: TinyLM, index: int, stages: int) -> None:
        super().__init__()
        per = len(model.layers) // stages
        self.embed = model.embed if index == 0 else None
        self.layers = nn.ModuleDict({str(k): model.layers[k] for k in range(index * per, (index + 1) * per)})
        self.head = model.head if index == stages - 1 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x if self.embed is None else self.embed(x)
        for layer in self.layers.values():
            x = layer(x)
        return x if self.head is None else self.head(x)


def train(rank: int, world_size: int, steps: int = 3, **options) -> dict[str, torch.Tensor]:
    world = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("pp", "dp"))
    pp_rank, dp_rank = world.get_local_rank("pp"), world.get_local_rank("dp")
    torch.manual_seed(0)
    part = Stage(TinyLM(), pp_rank, 2)
    for block in part.layers.values():
        fully_shard(block, mesh=world["dp"], reshard_after_forward=False)
    fully_shard(part, mesh=world["dp"], reshard_after_forward=False)
    stage = PipelineStage(part, pp_rank, 2, torch.device("cpu"), group=world.get_group("pp"))
    opt = dmuon.DMuon(part, lr=0.02, adamw=dmuon.AdamWConfig(lr=3e-3), pp_group=world["pp"], **options)
    schedule = Schedule1F1B(stage, n_microbatches=2,
                            loss_fn=lambda logits, targets: F.cross_entropy(logits.flatten(0, 1), targets.flatten()))
    for step in range(steps):
        tokens, losses = batch(step, dp_rank), []
        if pp_rank == 0:
            schedule.step(tokens[:, :-1])
        else:
            schedule.step(target=tokens[:, 1:], losses=losses)     # the last stage: each micro-batch's loss
        opt.clip_grad_norm_(1.0)        # the whole model's norm: one scalar all-reduce over pp
        opt.step()
        opt.zero_grad()
        if losses and dp_rank == 0:
            print(f"step {step}: loss {sum(l.item() for l in losses) / len(losses):.4f} (dp rank 0's batch)")
    return {name: p.full_tensor() for name, p in part.named_parameters()}


if __name__ == "__main__":
    run_distributed(train, 4)
