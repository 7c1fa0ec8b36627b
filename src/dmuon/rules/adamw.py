"""AdamW for the parameters FSDP2 shards, through torch's own functional kernel."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.optim.adam import adam


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: a DTensor's local shard, a plain tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def _same_layout(p: torch.Tensor, grad: torch.Tensor) -> bool:
    if not isinstance(p, DTensor):
        return not isinstance(grad, DTensor)
    return isinstance(grad, DTensor) and grad.placements == p.placements and grad.device_mesh == p.device_mesh


@torch.no_grad()
def adamw_group_step(group: dict, state: dict) -> None:
    """Runs ``torch.optim.AdamW``'s update on every parameter of ``group`` that has a gradient.

    State layout and defaults follow ``torch.optim.AdamW`` so that state dicts
    and results are interchangeable with it.
    """
    params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
    has_complex = False
    for p in group["params"]:
        if p.grad is None:
            continue
        if p.grad.is_sparse:
            raise RuntimeError("AdamW does not support sparse gradients")
        has_complex |= torch.is_complex(p)
        s = state[p]
        if len(s) == 0:
            # Same scalar dtype rule as torch.optim.AdamW, so state dicts interchange.
            step_dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
            s["step"] = torch.tensor(0.0, dtype=step_dtype)
            s["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            s["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        params.append(p)
        grads.append(p.grad)
        exp_avgs.append(s["exp_avg"])
        exp_avg_sqs.append(s["exp_avg_sq"])
        steps.append(s["step"])
    if not params:
        return
    foreach = group.get("foreach")
    if all(_same_layout(p, g) for p, g in zip(params, grads)):
        # AdamW is elementwise, so each rank may update its own shards directly:
        # the same kernels on the same numbers, without DTensor's per-op dispatch
        # (which costs more than the arithmetic at these sizes).
        params, grads, exp_avgs, exp_avg_sqs = (
            [local_tensor(t) for t in ts] for ts in (params, grads, exp_avgs, exp_avg_sqs))
        if foreach is None:
            # torch picks the per-tensor loop on CPU; the foreach kernels run the same
            # elementwise operations in the same order (bit-identical, tested) with
            # one dispatch per operation instead of one per tensor and operation.
            foreach = True
    beta1, beta2 = group["betas"]
    adam(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        [],
        steps,
        foreach=foreach,
        has_complex=has_complex,
        decoupled_weight_decay=True,
        amsgrad=False,
        beta1=beta1,
        beta2=beta2,
        lr=group["lr"],
        weight_decay=group["weight_decay"],
        eps=group["eps"],
        maximize=False,
    )
