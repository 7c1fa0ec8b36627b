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


ADAMW_GROUP_DEFAULTS = {"amsgrad": False, "maximize": False, "foreach": None, "capturable": False,
                        "differentiable": False, "fused": None, "decoupled_weight_decay": True}
"""torch.optim.AdamW's group keys besides ``lr``, ``betas``, ``eps`` and ``weight_decay``, with its defaults: what
an AdamW group that leaves one out means (a state dict saved before a key existed loads with it)."""


def check_adamw_group(group: dict, where: str = "") -> None:
    """Raises as ``torch.optim.AdamW``'s constructor does for a group's keys (the message after ``where``,
    e.g. ``"param group 1: "``), and ``ValueError`` naming a key whose setting DMuon's AdamW cannot run.

    ``differentiable=True`` (a step inside autograd) and ``decoupled_weight_decay=False`` (Adam's L2 penalty,
    not AdamW) are refused; every other key of torch.optim.AdamW runs as there.
    """
    lr, foreach, capturable = group["lr"], group.get("foreach"), group.get("capturable", False)
    if isinstance(lr, torch.Tensor):
        if foreach and not capturable:
            raise ValueError(f"{where}lr as a Tensor is not supported for capturable=False and foreach=True")
        if lr.numel() != 1:
            raise ValueError(f"{where}Tensor lr must be 1-element")
    betas = group["betas"]
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"{where}betas must be a pair (beta1, beta2), got {betas!r}")
    # torch.optim.AdamW's range checks, in its words.
    if not 0.0 <= lr:
        raise ValueError(f"{where}Invalid learning rate: {lr}")
    if not 0.0 <= group["eps"]:
        raise ValueError(f"{where}Invalid epsilon value: {group['eps']}")
    for k, beta in enumerate(betas):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"{where}Invalid beta parameter at index {k}: {beta}")
    if not 0.0 <= group["weight_decay"]:
        raise ValueError(f"{where}Invalid weight_decay value: {group['weight_decay']}")
    if not (isinstance(betas[0], float) and isinstance(betas[1], float)
            or isinstance(betas[0], torch.Tensor) and isinstance(betas[1], torch.Tensor)):
        raise ValueError(f"{where}betas must be either both floats or both Tensors")
    for k, beta in enumerate(betas):
        if isinstance(beta, torch.Tensor):
            if foreach and not capturable:
                raise ValueError(f"{where}betas[{k}] as a Tensor is not supported for capturable=False and "
                                 "foreach=True")
            if beta.numel() != 1:
                raise ValueError(f"{where}Tensor betas[{k}] must be 1-element")
    if group.get("fused") and foreach:
        raise RuntimeError(f"{where}`fused` and `foreach` cannot be `True` together.")
    if group.get("differentiable", False):
        raise ValueError(f"{where}differentiable=True is not supported: DMuon's step runs outside autograd "
                         "(its updates travel between ranks); leave differentiable=False")
    if not group.get("decoupled_weight_decay", True):
        raise ValueError(f"{where}decoupled_weight_decay=False is not supported: DMuon's rule for the parameters "
                         "Muon does not update is AdamW (decoupled weight decay); leave decoupled_weight_decay=True")


def _with_state(group: dict, state: dict) -> tuple[list, list, list, list, list, list, bool]:
    """The parameters of ``group`` that have a gradient, each with its gradient and AdamW state (made on
    first use, as ``torch.optim.AdamW`` makes it): ``(params, grads, exp_avgs, exp_avg_sqs,
    max_exp_avg_sqs, steps, has_complex)``."""
    amsgrad, fused = group.get("amsgrad", False), group.get("fused")
    capturable = group.get("capturable", False)
    params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = [], [], [], [], [], []
    has_complex = False
    for p in group["params"]:
        if p.grad is None:
            continue
        if p.grad.is_sparse:
            raise RuntimeError("AdamW does not support sparse gradients")
        has_complex |= torch.is_complex(p)
        s = state[p]
        if len(s) == 0:
            # Same scalar dtype and device rule as torch.optim.AdamW, so state dicts interchange.
            # (torch.optim.optimizer._get_scalar_dtype: float32 for fused, else the default dtype's width.)
            step_dtype = torch.float64 if torch.get_default_dtype() == torch.float64 and not fused else torch.float32
            s["step"] = (torch.zeros((), dtype=step_dtype, device=p.device) if capturable or fused
                         else torch.tensor(0.0, dtype=step_dtype))
            s["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            s["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        if amsgrad and "max_exp_avg_sq" not in s:
            s["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        params.append(p)
        grads.append(p.grad)
        exp_avgs.append(s["exp_avg"])
        exp_avg_sqs.append(s["exp_avg_sq"])
        if amsgrad:
            max_exp_avg_sqs.append(s["max_exp_avg_sq"])
        steps.append(s["step"])
    return params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, has_complex


@torch.no_grad()
def adamw_group_step(group: dict, state: dict) -> None:
    """Runs ``torch.optim.AdamW``'s update on every parameter of ``group`` that has a gradient.

    State layout, keys and defaults follow ``torch.optim.AdamW`` (``amsgrad``, ``maximize``,
    ``foreach``, ``fused``, ``capturable``, a tensor ``lr`` or ``betas``), so that state dicts and
    results are interchangeable with it.
    """
    amsgrad, fused = group.get("amsgrad", False), group.get("fused")
    capturable = group.get("capturable", False)
    params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, has_complex = _with_state(group, state)
    if not params:
        return
    foreach, lr = group.get("foreach"), group["lr"]
    if all(aligned(p, g) for p, g in zip(params, grads)):
        # AdamW is elementwise, so each rank may update its own shards directly:
        # the same kernels on the same numbers, without DTensor's per-op dispatch
        # (which costs more than the arithmetic at these sizes).
        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs = (
            [local_tensor(t) for t in ts] for ts in (params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs))
        if foreach is None and not fused and not (isinstance(lr, torch.Tensor) and not capturable):
            # torch picks the per-tensor loop on CPU; the foreach kernels run the same
            # elementwise operations in the same order (bit-identical, tested) with
            # one dispatch per operation instead of one per tensor and operation.
            # (Not with a tensor lr: torch's foreach kernels take one only when capturable.)
            foreach = True
    beta1, beta2 = group["betas"]
    adam(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        max_exp_avg_sqs,
        steps,
        foreach=foreach,
        capturable=capturable,
        fused=fused,
        has_complex=has_complex,
        decoupled_weight_decay=True,
        amsgrad=amsgrad,
        beta1=beta1,
        beta2=beta2,
        lr=lr,
        weight_decay=group["weight_decay"],
        eps=group["eps"],
        maximize=group.get("maximize", False),
    )
