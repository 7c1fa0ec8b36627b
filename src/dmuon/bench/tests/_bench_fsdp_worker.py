"""Worker for the FSDP2 test: shards a workload on gloo and runs a reference beside it."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from dmuon.bench.models import build_workload
from support.spawn import run_distributed


def _fsdp_worker(rank: int, world: int, names: tuple[str, ...], steps: int) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    result = {}
    for name in names:
        w = build_workload(name, size="tiny")
        ref = build_workload(name, size="tiny")
        for block in w.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(w.model, mesh=mesh)
        opt = torch.optim.SGD(w.model.parameters(), lr=0.2)
        ref_opt = torch.optim.SGD(ref.model.parameters(), lr=0.2)
        losses = []
        for step in range(steps):
            loss = w.loss_fn(w.model, w.make_batch(step, rank))
            loss.backward()
            opt.step()
            opt.zero_grad()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            ref_loss = ref.loss_fn(ref.model, ref.global_batch(step, world))
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            losses.append((mean.item() / world, ref_loss.item()))
        ref_params = dict(ref.model.named_parameters())
        diff = max((p.full_tensor() - ref_params[n]).abs().max().item()
                   for n, p in w.model.named_parameters())
        result[name] = (losses, diff)
    return result


def run(world: int, names: tuple[str, ...], steps: int) -> dict:
    """Runs ``steps`` sharded SGD steps per workload on ``world`` gloo ranks.

    Returns:
        ``{name: (losses, max_param_diff)}`` where ``losses`` is a list of
        ``(mean sharded loss, single-process global-batch loss)`` per step and
        ``max_param_diff`` the largest absolute difference between the
        gathered sharded parameters and the reference ones afterwards.
    """
    return run_distributed(_fsdp_worker, world, names, steps)[0]
