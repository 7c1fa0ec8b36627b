"""Worker for the TP test: each workload's blocks split by ``block_tp_plan`` beside the plain model."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from dmuon.bench.models.moe import MOE_SIZES, moe_workload
from dmuon.bench.models.qwen2 import QWEN2_SIZES, qwen2_workload
from dmuon.bench.models.tp_plan import block_tp_plan
from dmuon.bench.models.vla import VLA_SIZES, vla_workload

BUILDERS = {
    "qwen2": lambda: qwen2_workload("qwen2", "tiny", QWEN2_SIZES["tiny"], 0, torch.float32),
    "vla": lambda: vla_workload("tiny", VLA_SIZES["tiny"], 0, torch.float32),
    "moe": lambda: moe_workload("tiny", MOE_SIZES["tiny"], 0, torch.float32),
}


def tp_worker(rank: int, world: int, names: tuple[str, ...]) -> dict:
    """Per workload: the loss and the worst gradient difference, TP (every block) vs plain."""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    out = {}
    for name in names:
        torch.manual_seed(0)
        w = BUILDERS[name]()
        torch.manual_seed(0)
        ref = BUILDERS[name]()
        split = 0
        for block in w.blocks:
            plan = block_tp_plan(block, world)
            split += len(plan)
            parallelize_module(block, mesh, plan)
        batch = w.make_batch(0, 0)
        loss, ref_loss = w.loss_fn(w.model, batch), ref.loss_fn(ref.model, batch)
        loss.backward()
        ref_loss.backward()
        ref_grads = {n: p.grad for n, p in ref.model.named_parameters()}
        worst = max(((p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad) - ref_grads[n]).abs().max().item()
                    for n, p in w.model.named_parameters() if p.grad is not None)
        out[name] = {"loss": loss.item(), "ref_loss": ref_loss.item(), "grad_diff": worst, "split": split,
                     "dtensors": sum(isinstance(p, DTensor) for p in w.model.parameters())}
    return out
