"""The gradient norm over every rank, each element counted once, and clipping by it.

``torch.nn.utils.clip_grad_norm_`` on FSDP2's DTensors computes the norm through DTensor's
reductions, which raises for parameters on different meshes (tensor parallelism beside
FSDP2-only parameters) and, on dmuon's replicate level, would read each replica's own reduced
column slices. :func:`clip_grad_norm_` instead adds each rank's local ``|g|^p`` (divided by how
many ranks hold the same shard), in one scalar all-reduce over every rank, and scales the local
gradients in place: the same total and the same ``mul_`` as torch's on one process.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from dmuon.comm.sums import reduce_scalar
from dmuon.runtime.replicate import ReplicateLevel
from dmuon.util.dtensor import local_tensor


@torch.no_grad()
def clip_grad_norm_(params: list[torch.Tensor], max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, *, replicate: ReplicateLevel | None = None,
                    group: dist.ProcessGroup | None = None, across: dist.ProcessGroup | None = None,
                    device: torch.device | str = "cpu") -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_``'s result on every rank of ``group``.

    Each rank adds its local shards' ``|g|^p``, divided by how many ranks hold the same shard (the
    mesh dims where the gradient is ``Replicate``); one scalar all-reduce over ``group`` sums them
    (a maximum for ``inf``; no collective with ``group=None``, one rank). With the replicate level
    (``replicate``, its gradients already reduced: :meth:`ReplicateLevel.finish`) a Muon matrix's
    reduced form holds R times its mean on one replica per column slice, so it counts once, divided
    by R. The norms are summed on ``device`` in parameter order and nothing is read to the host (a
    read per parameter would wait for an accelerator each time). ``across``: the group spanning the
    pipeline stages, whose ranks hold the other parts of the model: a second scalar all-reduce adds
    their totals (torchtitan's ``pp_mesh``), so every stage clips by the whole model's norm.

    Returns:
        The total norm before clipping, a float32 tensor on ``device``.
    """
    norm_type = float(norm_type)
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.zeros((), dtype=torch.float64, device=device)
    for (_, _, copies, sums), tensors in _norm_classes(params, replicate).items():
        norms = torch.stack(torch._foreach_norm(tensors, norm_type)).double().to(device)
        if sums:
            norms = norms / replicate.replicate
        if math.isinf(norm_type):
            total = torch.maximum(total, norms.max())
        else:
            total = total + (norms ** norm_type).sum() / copies
    if group is not None:
        reduce_scalar(total, math.isinf(norm_type), group)
    if across is not None:
        reduce_scalar(total, math.isinf(norm_type), across)
    if not math.isinf(norm_type):
        total = total ** (1.0 / norm_type)
    total = total.float()
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, "
                           "so it cannot be clipped. To disable this error and scale the gradients by the "
                           "non-finite norm anyway, set `error_if_nonfinite=False`")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    _scale(grads, coef)
    return total


def _norm_classes(params: list[torch.Tensor], replicate: ReplicateLevel | None) -> dict[tuple, list[torch.Tensor]]:
    """The local gradients by ``(device, dtype, copies, sums)``: how many ranks hold each shard and whether
    it holds the replicate level's sums (both divide its norm), in parameter order."""
    # As torch's clip_grad_norm_: one _foreach_norm per group of gradients alike, a constant number of
    # kernels per group rather than about five per parameter.
    classes: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is None:
            continue
        copies = 1
        if isinstance(p.grad, DTensor):
            mesh = p.grad.device_mesh
            copies = math.prod(mesh.size(d) for d, pl in enumerate(p.grad.placements) if isinstance(pl, Replicate))
        sums = replicate is not None and replicate.holds_sums(p)
        local = local_tensor(p.grad)
        classes.setdefault((local.device, local.dtype, copies, sums), []).append(local)
    return classes


def _scale(grads: list[torch.Tensor], coef: torch.Tensor) -> None:
    """Every local gradient times ``coef``, one ``_foreach_mul_`` per device and dtype."""
    by_device: dict[tuple, list[torch.Tensor]] = {}
    for g in grads:
        local = local_tensor(g)
        by_device.setdefault((local.device, local.dtype), []).append(local)
    for (where, _), tensors in by_device.items():
        torch._foreach_mul_(tensors, coef.to(where))  # as torch's: the float32 factor, per device and dtype
