"""Dion2 (Ahn et al., arXiv 2512.16928): orthogonalize only the rows of largest L1 norm.

Per matrix ``W`` (``(m, n)``), with ``M`` the error-feedback buffer (microsoft/dion's
``dion/dion2.py``; dmuon's own code)::

    M += G                                    # plain accumulation (no lerp)
    S = top-k rows of M by L1 norm, k = max(1, ceil(fraction * m))
    O = NS(M[S])                              # the k x n submatrix, rows in matrix order
    M[S] *= ef_decay
    W *= 1 - lr * weight_decay
    W[S] -= adjusted_lr * O                   # dion's "spectral_norm": lr * sqrt(m / n)

The selection needs whole rows of the whole ``M``: it runs on the owner, exactly (dion's
``selection_scope="global"``; its FSDP default selects per local shard). Always rows, the
output dim, on any mesh. The owner returns the full-size update, zero outside ``S``; each
rank finds its selected rows as the nonzero rows of its part of the update
(:func:`selected_rows`), as dion's global path does. That is exact: a selected row of ``O``
is zero only if the row of ``M[S]`` is zero (NS maps rows through ``X -> p(XX^T) X``, and a
zero row stays zero; a nonzero one cannot vanish, the NS polynomials have no positive root),
and decaying a zero row of ``M`` changes nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch


def selected_count(rows: int, fraction: float) -> int:
    """``k = max(1, ceil(fraction * rows))``, at most ``rows`` (dion's)."""
    return min(rows, max(1, math.ceil(fraction * rows)))


def select_rows(direction: torch.Tensor, fraction: float) -> torch.Tensor:
    """The rows of the top ``k`` L1 norms of ``direction`` (``(m, n)``), ascending (int64).

    The L1 norm in float32 (or wider) (``torch.linalg.vector_norm(ord=1)``), then ``torch.topk``: among
    tied rows topk's choice stands, and every rank applies what the owner chose."""
    k = selected_count(direction.shape[0], fraction)
    l1 = torch.linalg.vector_norm(direction, ord=1, dim=-1, dtype=torch.promote_types(direction.dtype, torch.float32))
    return torch.topk(l1, k, dim=-1, sorted=False).indices.sort().values


def owner_updates(directions: Sequence[torch.Tensor], fractions: Sequence[float],
                  orthogonalize: Callable[[list[torch.Tensor]], list[torch.Tensor]]) -> list[torch.Tensor]:
    """The whole updates of same-shape whole directions (the accumulated ``M``): each one's
    selected submatrix orthogonalized (one ``orthogonalize`` call on all of them: same ``k``
    for the same fraction), scattered back into a zero ``(m, n)`` tensor of the input dtype."""
    picks = [select_rows(d, f) for d, f in zip(directions, fractions)]
    subs = [d.index_select(0, idx) for d, idx in zip(directions, picks)]
    by_shape: dict[tuple, list[int]] = {}
    for k, s in enumerate(subs):
        by_shape.setdefault(tuple(s.shape), []).append(k)
    orthos: list[torch.Tensor | None] = [None] * len(subs)
    for members in by_shape.values():
        for k, o in zip(members, orthogonalize([subs[k] for k in members])):
            orthos[k] = o
    out = []
    for d, idx, o in zip(directions, picks, orthos):
        full = torch.zeros_like(d)
        full.index_copy_(0, idx, o.to(d.dtype))
        out.append(full)
    return out


def selected_rows(update: torch.Tensor) -> torch.Tensor:
    """Which rows of this rank's part of a returned update (``(rows, ...)``) were selected: any
    nonzero element (NaN counts as nonzero)."""
    return update.reshape(update.shape[0], -1).ne(0).any(dim=1)


def decay_selected(momentum: torch.Tensor, selected: torch.Tensor, ef_decay: float) -> None:
    """``momentum[selected] *= ef_decay`` in place (``momentum``: ``(rows, ...)``), without a sync."""
    factor = torch.where(selected, ef_decay, 1.0).to(momentum.dtype)
    momentum.mul_(factor.view(-1, *([1] * (momentum.dim() - 1))))
