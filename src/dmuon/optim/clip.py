"""Global gradient-norm clipping across owner-held and FSDP2-sharded gradients."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from dmuon.optim.dmuon import DMuon


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, max_norm: float, optimizer: DMuon, eps: float = 1e-6) -> torch.Tensor:
    """Clips the global 2-norm of all gradients, like ``torch.nn.utils.clip_grad_norm_``.

    The norm is that of the gradient the optimizer will apply: each Muon
    matrix's gradient averaged over ranks (reduced to its owner first, so it
    is counted once in the cluster) and FSDP2's sharded gradients (each shard
    counted once per replica group). Call it on every rank, after backward
    and before ``optimizer.step()``.

    Args:
        model: The model (after ``fully_shard``).
        max_norm: Largest allowed total norm.
        optimizer: The model's :class:`~dmuon.DMuon`.
        eps: Added to the norm in the clipping coefficient, as torch does.

    Returns:
        The total norm before clipping (a scalar tensor, the same on every rank).

    Raises:
        ValueError: If ``max_norm`` is negative.
    """
    if max_norm < 0:
        raise ValueError(f"max_norm must be >= 0, got {max_norm}")
    reduced = optimizer.reduce_gradients()
    plan = optimizer.plan
    replicate = plan.replicate
    matrices = {id(i.param) for i in plan.infos}
    square = torch.zeros((), dtype=torch.float64)
    for grad in reduced.values():
        square += grad.double().pow(2).sum().cpu()
    others = []
    for p in model.parameters():
        if id(p) in matrices or p.grad is None:
            continue
        others.append(p.grad)
        local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        # FSDP2 shards are replicated across the R replicas; unsharded tensors
        # are the same on every rank. Count each element once.
        copies = replicate if isinstance(p.grad, DTensor) else plan.world_size
        square += local.double().pow(2).sum().cpu() / copies
    if plan.world_size > 1:
        dist.all_reduce(square, group=plan.runtime.exchanger.group)
    total = square.sqrt().float()
    coef = torch.clamp(max_norm / (total + eps), max=1.0)
    for grad in list(reduced.values()) + others:
        (grad.to_local() if isinstance(grad, DTensor) else grad).mul_(coef.to(grad.device))
    return total
