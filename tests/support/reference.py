"""Single-process references: torch.optim.Muon on the matrices, torch.optim.AdamW on the rest."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
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


@dataclass
class TorchPair:
    """torch.optim.Muon on a model's Muon matrices (one over two dims through a 2-D view sharing its storage, so
    Muon sees ``(shape[0], prod(shape[1:]))``, as dmuon does) and torch.optim.AdamW on the rest."""

    model: nn.Module
    matrices: list[tuple[str, nn.Parameter]]
    views: list[tuple[nn.Parameter, nn.Parameter]]
    """Per matrix: the parameter and what Muon steps (the parameter itself, or its 2-D view)."""
    muon: torch.optim.Muon
    adamw: torch.optim.AdamW

    def hand_grads(self) -> None:
        """Each view its parameter's gradient (None where the parameter has none)."""
        for p, v in self.views:
            if v is not p:
                v.grad = None if p.grad is None else p.grad.view(v.shape)

    def step(self, ns_dtype: torch.dtype) -> None:
        with ns_precision(ns_dtype):
            self.muon.step()
        self.adamw.step()

    def zero_grad(self) -> None:
        self.model.zero_grad(set_to_none=True)
        for _, v in self.views:
            v.grad = None


def torch_pair(model: nn.Module, muon_kwargs: dict, adamw_kwargs: dict) -> TorchPair:
    """:class:`TorchPair` over ``model``'s Muon matrices (dmuon's selection)."""
    matrices = select_matrices(model)
    ids = {id(p) for _, p in matrices}
    views = [(p, nn.Parameter(p.data.view(p.shape[0], -1)) if p.ndim > 2 else p) for _, p in matrices]
    muon = torch.optim.Muon([v for _, v in views], **muon_kwargs)
    adamw = torch.optim.AdamW([p for p in model.parameters() if id(p) not in ids], **adamw_kwargs)
    return TorchPair(model, matrices, views, muon, adamw)


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

    torch's pair as :func:`torch_pair` builds it.

    ``clip`` applies ``torch.nn.utils.clip_grad_norm_`` to all gradients
    before each step; the norms are appended to ``reference_training.norms``.
    Muon's final momentum buffers, by matrix name in the parameter's shape, are
    left in ``reference_training.momenta``.

    Returns:
        The final parameters by name and the loss of each step.
    """
    reference_training.norms = []
    pair = torch_pair(model, muon_kwargs, adamw_kwargs)
    losses = []
    for batch in batches:
        loss = loss_fn(model, batch)
        loss.backward()
        if clip is not None:
            reference_training.norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        pair.hand_grads()
        pair.step(ns_dtype)
        pair.zero_grad()
        losses.append(loss.item())
    reference_training.momenta = {
        name: pair.muon.state[v]["momentum_buffer"].detach().clone().view(p.shape)
        for (name, _), (p, v) in zip(pair.matrices, pair.views) if "momentum_buffer" in pair.muon.state[v]
    }
    return {n: p.detach().clone() for n, p in model.named_parameters()}, losses
