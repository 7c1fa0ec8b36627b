"""Distributed training cases shared by the tests (run inside spawned ranks)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import dmuon
from dmuon.baselines import GatherThenCompute
from dmuon.fsdp.runtime import full_matrices
from dmuon.testing.models import OddNet, lm_loss, odd_batch


@dataclass
class Case:
    """One distributed training run on :class:`OddNet`."""

    kind: str = "dmuon"
    """``"dmuon"`` or ``"gather"``."""
    zero: int = 3
    """ZeRO level for dmuon."""
    ns_dtype: torch.dtype = torch.float32
    """NS iteration dtype."""
    steps: int = 3
    """Optimizer steps."""
    skip: dict[int, set[int]] = field(default_factory=dict)
    """step -> blocks left out of that step's forward (on every rank)."""
    batch_sizes: dict[int, int] = field(default_factory=dict)
    """step -> samples per rank that step (default 2; the same on every rank)."""
    lr: float = 0.02
    adamw_lr: float = 3e-3
    balancer: str = "greedy"
    ns_method: str = "standard"
    overlap: bool = True
    """DMuon's overlap mode."""
    clip: float | None = None
    """``dmuon.clip_grad_norm_`` before each step."""
    mesh_shape: tuple[int, int] | None = None
    """``(replicate, shard)`` for HSDP; None for a 1-D mesh over all ranks."""
    ns_in_backward: bool = False
    """DMuon's ``ns_in_backward``."""
    activation_checkpointing: str | None = None
    """OddNet's ``checkpoint`` mode (``"early_stop"``, ``"full"``, ``"reentrant"``; None: off)."""


MUON_KW = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True)


def make_mesh(world_size: int, mesh_shape: tuple[int, int] | None = None):
    """A 1-D CPU mesh over every rank, or a ``(replicate, shard)`` HSDP mesh."""
    if mesh_shape is None:
        return init_device_mesh("cpu", (world_size,))
    return init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard"))


def sharded_oddnet(world_size: int, *, zero: int, mesh_shape=None, balancer: str = "greedy", **dmuon_kwargs):
    """OddNet (seed 0) under dmuon + FSDP2; fp32 standard NS unless ``dmuon_kwargs`` say otherwise.

    Returns:
        ``(model, plan, optimizer)``.
    """
    mesh = make_mesh(world_size, mesh_shape)
    torch.manual_seed(0)
    model = OddNet()
    plan = dmuon.prepare(model, mesh, zero=zero, balancer=balancer)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, ignored_params=plan.matrices)
    fully_shard(model, mesh=mesh, ignored_params=plan.matrices)
    kw = dict(lr=0.02, adamw_lr=3e-3, ns_method="standard", ns_dtype=torch.float32) | dmuon_kwargs
    return model, plan, dmuon.DMuon(model, plan, **kw)


def full_params(model, plan) -> dict[str, torch.Tensor]:
    """Every parameter's full value, on every rank."""
    out = full_matrices(plan.runtime) if plan is not None else {}
    for name, p in model.named_parameters():
        if name not in out:
            out[name] = (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
    return out


def run_case(rank: int, world_size: int, case: Case) -> dict:
    """Trains OddNet under FSDP2 with dmuon (or the gather baseline) and reports everything."""
    kw = dict(lr=case.lr, adamw_lr=case.adamw_lr, ns_dtype=case.ns_dtype, ns_method=case.ns_method)
    if case.kind == "dmuon":
        model, plan, opt = sharded_oddnet(world_size, zero=case.zero, mesh_shape=case.mesh_shape,
                                          balancer=case.balancer, overlap=case.overlap,
                                          ns_in_backward=case.ns_in_backward, **kw)
    else:
        mesh = make_mesh(world_size, case.mesh_shape)
        torch.manual_seed(0)
        model, plan = OddNet(), None
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = GatherThenCompute(model, **kw)
    model.checkpoint = case.activation_checkpointing
    losses, stats, norms = [], [], []
    for step in range(case.steps):
        model.skip = case.skip.get(step, set())
        loss = lm_loss(model, odd_batch(step, rank, batch=case.batch_sizes.get(step, 2)))
        loss.backward()
        if case.clip is not None:
            norms.append(dmuon.clip_grad_norm_(model, case.clip, opt).item())
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world_size)
        stats.append(opt.last_step_stats())
    params = full_params(model, plan)
    return {
        "params": params if rank == 0 else None,
        "losses": losses,
        "norms": norms,
        "stats": stats,
        "owners": {i.name: i.owner for i in plan.infos} if plan else None,
        "numels": {i.name: i.numel for i in plan.infos} if plan else None,
        "gathers": {i.name: plan.runtime.gathers_per_step(i.index) for i in plan.infos} if plan else None,
        "state_keys": sorted(n for n, p in model.named_parameters() if p in opt.state and "momentum_buffer" in opt.state[p]),
    }


def run_accumulation(rank: int, world_size: int, zero: int, overlap: bool, micro: int = 2, steps: int = 2) -> dict:
    """Gradient accumulation: ``micro`` backward passes (earlier ones under no_sync) per step."""
    model, plan, opt = sharded_oddnet(world_size, zero=zero, overlap=overlap)
    for step in range(steps):
        tokens, targets = odd_batch(step, rank, batch=2 * micro)
        for m in range(micro):
            last = m == micro - 1
            model.set_requires_gradient_sync(last)
            part = (tokens[2 * m : 2 * m + 2], targets[2 * m : 2 * m + 2])
            if last:
                (lm_loss(model, part) / micro).backward()
            else:
                with opt.no_sync():
                    (lm_loss(model, part) / micro).backward()
        opt.step()
        opt.zero_grad()
    params = full_params(model, plan)  # a collective: every rank calls it
    return {"params": params if rank == 0 else None,
            "orthogonalized": opt.last_step_stats()["orthogonalized"]}
