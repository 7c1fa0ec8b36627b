"""NorMuon's owner-side step: Muon's orthogonalized update normalized per output row.

The rule of zichongli5/NorMuon's ``SingleDeviceNorMuon``, in torch's conventions
(momentum and the shape-scaled step are Muon's, :mod:`dmuon.rules.muon`): from
the orthogonalized direction ``O`` (``m x n``) and the per-row second moment
``v`` (``m x 1``, float32),

* ``v.lerp_(O.square().mean(dim=-1, keepdim=True), 1 - beta2)``;
* ``O2 = O / (v.sqrt() + 1e-10)``;
* ``O2 *= O.norm() / (O2.norm() + 1e-10)``.

The row statistics and both norms need the whole matrix: this runs on the owner.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

EPS = 1e-10
"""NorMuon's guard on the row scale and on the norm ratio."""


def normalize_rows(orthos: Sequence[torch.Tensor], second_moments: Sequence[torch.Tensor],
                   beta2: Sequence[float]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """NorMuon's normalization of same-shape orthogonalized updates, batched.

    Both steps scale rows, so they are one per-row factor: with ``q`` each row's sum of
    squares of ``O`` and ``s = 1 / (sqrt(v) + 1e-10)``, ``O2 = s O`` has
    ``||O2||^2 = sum(s^2 q)`` and ``||O||^2 = sum(q)``, and the update is
    ``O * s * ||O|| / (||O2|| + 1e-10)``: one reduction over ``O`` and one product (the
    formula's divisions and norms, taken on ``m`` numbers instead of ``m n``).

    Args:
        orthos: Each matrix's whole NS output ``(m, n)``, in the NS dtype.
        second_moments: Each matrix's second moment ``(m, 1)``, float32 (read, not written).
        beta2: Each matrix's ``beta2`` (its param group's).

    Returns:
        The normalized updates (in the NS dtype) and the new second moments (float32).
    """
    o = torch.stack(list(orthos))
    sums = torch.linalg.vector_norm(o, dim=-1, keepdim=True, dtype=torch.float32).square()  # (B, m, 1)
    weight = torch.tensor([1.0 - b for b in beta2], dtype=torch.float32, device=o.device).view(-1, 1, 1)
    v = torch.stack(list(second_moments)).to(torch.float32).lerp(sums / o.shape[-1], weight)
    scale = 1.0 / (v.sqrt() + EPS)
    norm = sums.sum(dim=(-2, -1), keepdim=True).sqrt()
    scaled_norm = (scale.square() * sums).sum(dim=(-2, -1), keepdim=True).sqrt()
    # In place on the stacked copy: computed in float32, rounded once to the NS dtype.
    o.mul_(scale * (norm / (scaled_norm + EPS)))
    return list(o.unbind()), list(v.unbind())
