"""Single-process references: torch.optim.Muon on the matrices, torch.optim.AdamW on the rest."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable

import torch
from torch import nn

from dmuon.plan.selection import select_matrices
from dmuon.testing.reference import fp32_torch_muon


@contextmanager
def ns_precision(dtype: torch.dtype):
    """Makes ``torch.optim.Muon`` iterate in ``dtype`` (only fp32 needs a change)."""
    if dtype == torch.bfloat16:
        yield
    else:
        with fp32_torch_muon():
            yield


def reference_training(
    model: nn.Module,
    batches: list,
    loss_fn: Callable,
    *,
    muon_kwargs: dict,
    adamw_kwargs: dict,
    ns_dtype: torch.dtype = torch.bfloat16,
    clip: float | None = None,
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Trains ``model`` in one process on ``batches`` (one global batch per step).

    Matrices with more than two dims are optimized through a 2-D view sharing
    their storage, so ``torch.optim.Muon`` sees ``(shape[0], prod(shape[1:]))``.

    ``clip`` applies ``torch.nn.utils.clip_grad_norm_`` to all gradients
    before each step; the norms are appended to ``reference_training.norms``.
    Muon's final momentum buffers, by matrix name in the parameter's shape, are
    left in ``reference_training.momenta``.

    Returns:
        The final parameters by name and the loss of each step.
    """
    reference_training.norms = []
    matrices = select_matrices(model)
    ids = {id(p) for _, p in matrices}
    views = [(p, nn.Parameter(p.data.view(p.shape[0], -1)) if p.ndim > 2 else p) for _, p in matrices]
    muon = torch.optim.Muon([v for _, v in views], **muon_kwargs)
    adamw = torch.optim.AdamW([p for p in model.parameters() if id(p) not in ids], **adamw_kwargs)
    losses = []
    for batch in batches:
        loss = loss_fn(model, batch)
        loss.backward()
        if clip is not None:
            reference_training.norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        for p, v in views:
            if v is not p:
                v.grad = None if p.grad is None else p.grad.view(v.shape)
        with ns_precision(ns_dtype):
            muon.step()
        adamw.step()
        for p, v in views:
            p.grad = None
            v.grad = None
        model.zero_grad(set_to_none=True)
        losses.append(loss.item())
    reference_training.momenta = {
        name: muon.state[v]["momentum_buffer"].detach().clone().view(p.shape)
        for (name, _), (p, v) in zip(matrices, views) if "momentum_buffer" in muon.state[v]
    }
    return {n: p.detach().clone() for n, p in model.named_parameters()}, losses
