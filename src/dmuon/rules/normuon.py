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

    Args:
        orthos: Each matrix's whole NS output ``(m, n)``, in the NS dtype.
        second_moments: Each matrix's second moment ``(m, 1)``, float32 (read, not written).
        beta2: Each matrix's ``beta2`` (its param group's).

    Returns:
        The normalized updates (in the NS dtype) and the new second moments (float32).
    """
    o = torch.stack([t.float() for t in orthos])
    v = torch.stack(list(second_moments)).to(torch.float32)
    weight = torch.tensor([1.0 - b for b in beta2], dtype=torch.float32, device=o.device).view(-1, 1, 1)
    v = v.lerp(o.square().mean(dim=-1, keepdim=True), weight)
    o2 = o / (v.sqrt() + EPS)
    # Per matrix: the normalized update keeps the orthogonalized one's Frobenius norm.
    o2 *= torch.linalg.vector_norm(o, dim=(-2, -1), keepdim=True) / (
        torch.linalg.vector_norm(o2, dim=(-2, -1), keepdim=True) + EPS)
    dtype = orthos[0].dtype
    return [u.to(dtype) for u in o2.unbind()], list(v.unbind())
