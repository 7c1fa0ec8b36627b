"""AdamW for the parameters FSDP2 shards, through torch's own functional kernel."""

from __future__ import annotations

import functools

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.optim.adam import adam

from dmuon.util.dtensor import local_tensor


def aligned(p: torch.Tensor, grad: torch.Tensor) -> bool:
    """Whether ``grad``'s local tensor is, element for element, the gradient of ``p``'s local tensor.

    True for the same layout, and for a gradient kept on a larger mesh whose extra leading dims
    hold copies: ``(Replicate(), ..., *p.placements)`` over ``(extra dims, *p's mesh dims)``, where
    this rank's slice of the larger mesh is ``p``'s mesh. That is how native HSDP (FSDP2 on a 2-D
    mesh) and dmuon's replicate level leave a gradient reduced across replicas, so AdamW reads it
    in place instead of building a DTensor per parameter on ``p``'s mesh (which costs more host
    time than AdamW's arithmetic on a small parameter).
    """
    if not isinstance(p, DTensor):
        return not isinstance(grad, DTensor)
    if not isinstance(grad, DTensor):
        return False
    if grad.device_mesh == p.device_mesh:
        return grad.placements == p.placements
    extra = grad.device_mesh.ndim - p.device_mesh.ndim
    return (extra > 0 and all(isinstance(pl, Replicate) for pl in grad.placements[:extra])
            and tuple(grad.placements[extra:]) == tuple(p.placements)
            and _copies_over_leading_dims(grad.device_mesh, p.device_mesh, extra))


@functools.lru_cache(maxsize=64)
def _copies_over_leading_dims(outer: DeviceMesh, inner: DeviceMesh, extra: int) -> bool:
    """Whether ``outer``'s trailing dims are ``inner`` (by name) and this rank's slice of ``outer``
    over its ``extra`` leading dims is ``inner``'s ranks in ``inner``'s order."""
    names, inner_names = outer.mesh_dim_names, inner.mesh_dim_names
    if names is None or inner_names is None or tuple(names[extra:]) != tuple(inner_names):
        return False
    coordinate = outer.get_coordinate()
    if coordinate is None:
        return False
    return torch.equal(outer.mesh[tuple(coordinate[:extra])], inner.mesh)


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
    if all(aligned(p, g) for p, g in zip(params, grads)):
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
