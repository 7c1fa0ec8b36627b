"""Small numerical helpers shared by the ortho tests."""

from __future__ import annotations

import torch


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative Frobenius distance of ``a`` to ``b``, computed in float64."""
    a64, b64 = a.double(), b.double()
    return float((a64 - b64).norm() / b64.norm())


def polar_factor(G: torch.Tensor) -> torch.Tensor:
    """``U Vᵀ`` from a float64 SVD: the exact orthogonal polar factor of ``G``."""
    U, _, Vh = torch.linalg.svd(G.double(), full_matrices=False)
    return U @ Vh


def with_spectrum(m: int, n: int, s: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """A float32 ``(m, n)`` matrix with singular values ``s`` and random singular vectors."""
    k = min(m, n)
    U, _ = torch.linalg.qr(torch.randn(m, k, generator=gen, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(n, k, generator=gen, dtype=torch.float64))
    return ((U * s.to(torch.float64)) @ V.T).float()


def gradient_like(kind: str, m: int, n: int, seed: int = 0) -> torch.Tensor:
    """Test matrices: ``gauss``, ``lowrank`` (low rank plus noise), ``powerlaw`` and
    ``logspec`` (heavy-tailed spectra), ``student`` (heavy-tailed entries)."""
    gen = torch.Generator().manual_seed(seed)
    k = min(m, n)
    if kind == "gauss":
        return torch.randn(m, n, generator=gen)
    if kind == "lowrank":
        r = max(1, k // 16)
        return torch.randn(m, r, generator=gen) @ torch.randn(r, n, generator=gen) + 0.01 * torch.randn(m, n, generator=gen)
    if kind == "powerlaw":
        return with_spectrum(m, n, torch.arange(1, k + 1, dtype=torch.float64) ** -1.5, gen)
    if kind == "logspec":
        return with_spectrum(m, n, torch.logspace(0, -6, k, dtype=torch.float64), gen)
    if kind == "student":
        u = torch.rand(m, n, generator=gen, dtype=torch.float64).clamp(1e-12, 1 - 1e-12)
        # Cauchy-like tails via the inverse CDF (no global RNG state touched).
        return torch.tan(torch.pi * (u - 0.5)).clamp(-1e4, 1e4).float()
    raise ValueError(kind)


def emulated_bf16_newton_schulz(G: torch.Tensor, schedule, steps: int = 5, eps: float = 1e-7,
                                dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The standard 16-bit iteration with float32 matmuls and rounding to ``dtype`` after each op.

    Same arithmetic model as torch's CPU bf16 matmul (bf16 operands, float32
    accumulation, bf16 result), minus its speed problem: on the development CPU a
    bf16 ``(m, m) @ (m, n)`` product is ~100x slower than float32, which makes the
    real path impractical for the large accuracy tests. Agreement with the real
    path is checked in test_accuracy.py.
    """
    from dmuon.ortho.coefficients import resolve_schedule

    bf = dtype
    X = G.to(bf)
    tall = X.shape[0] > X.shape[1]
    if tall:
        X = X.T
    X = (X.float() / X.norm().clamp(min=eps).float()).to(bf)
    for a, b, c in resolve_schedule(schedule, steps):
        Xf = X.float()
        A = (Xf @ Xf.T).to(bf).float()
        B = (b * A + c * (A @ A)).to(bf).float()
        X = (a * Xf + B @ Xf).to(bf)
    return X.T if tall else X
