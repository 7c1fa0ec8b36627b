"""The per-matrix Muon update rule, exactly as ``torch.optim.Muon`` applies it.

Kept apart from the distributed runtime: given a reduced gradient and the
owner's momentum buffer, these functions produce the new weights.
"""

from __future__ import annotations

import math

import torch

ADJUST_LR_FNS = (None, "original", "match_rms_adamw")


def adjusted_lr(lr: float, adjust_lr_fn: str | None, matrix_shape: tuple[int, int]) -> float:
    """The learning rate scaled for a matrix's shape, as ``torch.optim.Muon`` does."""
    rows, cols = matrix_shape
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr


def momentum_update(
    grad: torch.Tensor, buf: torch.Tensor, momentum: float, nesterov: bool
) -> torch.Tensor:
    """Advances ``buf`` in place and returns the direction to orthogonalize."""
    buf.lerp_(grad.to(buf.dtype), 1 - momentum)
    return grad.to(buf.dtype).lerp(buf, momentum) if nesterov else buf


def peek_direction(
    grad: torch.Tensor, buf: torch.Tensor | None, momentum: float, nesterov: bool
) -> torch.Tensor:
    """The direction :func:`momentum_update` would return, leaving ``buf`` as it is.

    Same kernels on the same numbers, so the result is bit-identical to the
    committed update's (``buf=None`` stands for a fresh zero buffer).
    """
    grad = grad.to(torch.float32 if buf is None else buf.dtype)
    # Out of place, the same elementwise kernel as ``lerp_``: bit-identical, one pass fewer than a clone.
    advanced = (torch.zeros_like(grad) if buf is None else buf).lerp(grad, 1 - momentum)
    return grad.lerp(advanced, momentum) if nesterov else advanced


def apply_update(
    param: torch.Tensor,
    ortho: torch.Tensor,
    *,
    lr: float,
    weight_decay: float,
    adjust_lr_fn: str | None,
    matrix_shape: tuple[int, int],
) -> None:
    """Decoupled weight decay with the raw lr, then the shape-adjusted step."""
    param.mul_(1 - lr * weight_decay)
    # As torch.optim.Muon: the NS-dtype update added as is (promoted inside the kernel, no copy).
    param.add_(ortho.view(param.shape), alpha=-adjusted_lr(lr, adjust_lr_fn, matrix_shape))
