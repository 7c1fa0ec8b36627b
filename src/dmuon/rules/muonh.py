"""MuonH (Muon Hyperball): Muon's direction, the weight kept on the sphere of its initial norm.

Wen, Dang, Lyu, Ma, Liang, "Fantastic Pretraining Optimizers and Where to Find Them II:
Hyperball Optimization" (arXiv 2606.16899), per matrix ``W`` (``(m, n)``)::

    R = max(||W_0||_F, eps)                          # once, at the matrix's first step
    u = NS(Muon's momentum / Nesterov direction)      # torch.optim.Muon's
    W' = W - adjusted_lr(lr) * R * u / max(||u||_F, eps)
    W  = R * W' / max(||W'||_F, eps)

``adjusted_lr`` is Muon's shape scaling (``adjust_lr_fn``; torch's default
``sqrt(max(1, m/n))``) and ``eps`` the NS epsilon (1e-7): the conventions of the
authors' reference ("MuonH and AdamH optimizers", adapted from torch 2.10's Muon), which
scales the step by torch's ``_adjust_lr`` and clamps every norm at the group's ``eps``. No
weight decay: the sphere replaces it.

Where each part runs: ``u / ||u||`` needs the whole ``u``, on the owner (:func:`normalize`);
``||W_0||`` and ``||W'||`` need every rank's piece of the weight: each rank gives its sum of
squares (:func:`sum_of_squares`) and the runtime adds them (:mod:`dmuon.runtime.matrix_norms`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def normalize(updates: Sequence[torch.Tensor], eps: float) -> list[torch.Tensor]:
    """Each whole update divided by its Frobenius norm clamped at ``eps`` (computed in float32
    or wider, returned in the update's dtype)."""
    if not updates:
        return []
    u = torch.stack(list(updates))
    wide = torch.promote_types(u.dtype, torch.float32)
    norms = torch.linalg.vector_norm(u, dim=(-2, -1), keepdim=True, dtype=wide).clamp_min(eps)
    return list((u.to(wide) / norms).to(u.dtype).unbind())


def sum_of_squares(part: torch.Tensor) -> torch.Tensor:
    """This rank's part of a matrix's ``||W||_F^2``, float32, 0-dim (0 for an empty part); summed over
    the contiguous layout, so a copy and the part it was taken from give the same bits."""
    return part.contiguous().to(torch.promote_types(part.dtype, torch.float32)).square().sum()


def radius(total: torch.Tensor, eps: float) -> torch.Tensor:
    """A matrix's Frobenius norm from its total sum of squares, clamped at ``eps``."""
    return total.sqrt().clamp_min(eps)


def step(param: torch.Tensor, update: torch.Tensor, radius_: torch.Tensor, scaled_lr: float) -> None:
    """``param -= scaled_lr * R * update`` in place (``update``: this rank's rows of ``u / ||u||``)."""
    param.add_(update.view(param.shape).to(radius_.dtype) * radius_, alpha=-scaled_lr)


def project(param: torch.Tensor, radius_: torch.Tensor, total: torch.Tensor, eps: float) -> None:
    """``param *= R / max(||W'||, eps)`` in place, ``total`` being ``||W'||^2`` over the whole matrix."""
    param.mul_(radius_ / total.sqrt().clamp_min(eps))
