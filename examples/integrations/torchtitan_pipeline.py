"""torchtitan's pipeline-parallel layout with dmuon: one optimizer per model part through its optimizer container.

Each pipeline rank holds one stage (a model part keeping its parameter names, torchtitan's split), the
part ``fully_shard``-ed over its stage's data-parallel ranks of a ``(pp, dp)`` mesh; torch's pipeline
schedule (``Schedule1F1B``, as torchtitan builds it) runs the micro-batches; torchtitan's
``OptimizersContainer`` (the subclass of ``torchtitan_container.py`` that knows ``"DMuon"``) builds one
DMuon for the part, torchtitan's ``clip_grad_norm_(..., pp_mesh=)`` clips by the whole model's norm,
its LR scheduler container schedules, and its flat, name-keyed state goes through DCP::

    optimizers = DMuonOptimizersContainer.Config(param_groups=[ParamGroupConfig(
        pattern=r".*", optimizer_name="DMuon", optimizer_kwargs={...})]).build(model_parts=model_parts)

4 gloo ranks as (pp=2, dp=2), plainly launched or under torchrun. It trains 4 steps of 4 micro-batches,
saves after step 2, resumes fresh objects from the checkpoint and checks they end bit for bit where the
first run ends, and that the container without a scheduler equals ``DMuon(part)`` used directly.
"""

from __future__ import annotations

import copy
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tiny import DIM, VOCAB, Block, batch, full_params, launch, scratch_dir  # noqa: E402
from torchtitan_container import checkpoint, optimizers_for  # noqa: E402

STEPS, SAVE_AT, MICRO, LAYERS, PP = 4, 2, 4, 4, 2


class PipeLM(nn.Module):
    """The tiny LM as torchtitan splits it: each part the whole model with other stages' layers removed
    (``None``), so every parameter keeps its name."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(k): Block() for k in range(LAYERS)})
        self.norm = nn.RMSNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for layer in self.layers.values():
            x = layer(x)
        return self.lm_head(self.norm(x)) if self.lm_head is not None else x


def part_of(stage: int) -> PipeLM:
    torch.manual_seed(0)
    part = PipeLM()
    per = LAYERS // PP
    for name in list(part.layers):
        if not stage * per <= int(name) < (stage + 1) * per:
            del part.layers[name]
    if stage != 0:
        part.embed = None
    if stage != PP - 1:
        part.norm = part.lm_head = None
    return copy.deepcopy(part)


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def train(rank: int, world_size: int, path: str, mode: str) -> dict:
    """``mode``: ``"container"`` (saves at SAVE_AT), ``"resume"`` (loads it), ``"plain"`` (container,
    no scheduler) or ``"direct"`` (``DMuon(part)``, no scheduler)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    from torchtitan.distributed.utils import clip_grad_norm_

    world = init_device_mesh("cpu", (PP, world_size // PP), mesh_dim_names=("pp", "dp"))
    stage, dp_rank = world.get_local_rank("pp"), world.get_local_rank("dp")
    part = part_of(stage)
    for layer in part.layers.values():
        fully_shard(layer, mesh=world["dp"], reshard_after_forward=False)  # torchtitan's default under PP
    fully_shard(part, mesh=world["dp"], reshard_after_forward=False)
    schedule = Schedule1F1B(PipelineStage(part, stage, PP, torch.device("cpu"), group=world.get_group("pp")),
                            MICRO, loss_fn=loss_fn)
    optimizers, schedulers = optimizers_for(part, mode, STEPS)  # the container's model parts: this stage's
    start = 0
    if mode == "resume":
        checkpoint(part, optimizers, schedulers, path, load=True)
        start = SAVE_AT
    for step in range(start, STEPS):
        inputs, labels = batch(step, dp_rank, size=MICRO)
        schedule.step(*([inputs] if stage == 0 else []), **({"target": labels} if stage == PP - 1 else {}))
        clip_grad_norm_(list(part.parameters()), 1.0, pp_mesh=world["pp"])
        optimizers.step()
        if schedulers is not None:
            schedulers.step()
        optimizers.zero_grad()
        if mode == "container" and step + 1 == SAVE_AT:
            checkpoint(part, optimizers, schedulers, path, load=False)
    return {"params": full_params(part), "losses": []}


def run(rank: int, world_size: int, directory: str) -> dict:
    """Every mode on this rank; each rank checks its own stage (:func:`check`)."""
    path = os.path.join(directory, "torchtitan-pp-ckpt")
    out = {mode: train(rank, world_size, path, mode) for mode in ("container", "resume", "plain", "direct")}
    check(out)
    return out


def check(out: dict) -> None:
    from tiny import assert_runs_equal

    assert_runs_equal(out, "container", "resume")
    assert_runs_equal(out, "direct", "plain")


if __name__ == "__main__":
    results = launch(run, scratch_dir(), world_size=4)
    check(results)
    print("pipeline stages through torchtitan's container: resumed run and container == DMuon(part): ok")
