"""torch.optim.Muon iterating in float32: the single-process reference of a run whose NS is float32.

torch's Muon casts to bfloat16 for its Newton-Schulz iteration; a run of dmuon with ``NSConfig(dtype=
torch.float32)`` is compared with torch's iteration written out here with that cast replaced by float32
(independent of dmuon's NS code), so the two agree to float32 rounding.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


def fp32_newton_schulz(grad: torch.Tensor, ns_coefficients, ns_steps: int, eps: float) -> torch.Tensor:
    """torch.optim.Muon's iteration (``torch.optim._muon._zeropower_via_newtonschulz``) in float32."""
    a, b, c = ns_coefficients
    x = grad.float()
    if grad.size(0) > grad.size(1):
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if grad.size(0) > grad.size(1) else x


@contextlib.contextmanager
def fp32_torch_muon() -> Iterator[None]:
    """torch.optim.Muon iterating in float32 inside the block."""
    import torch.optim._muon as torch_muon

    original = torch_muon._zeropower_via_newtonschulz
    torch_muon._zeropower_via_newtonschulz = fp32_newton_schulz
    try:
        yield
    finally:
        torch_muon._zeropower_via_newtonschulz = original
