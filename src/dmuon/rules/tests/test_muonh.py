"""MuonH's owner and apply math against the formula, in float64, on one matrix."""

from __future__ import annotations

import torch

from dmuon.rules import muonh


def test_normalize_is_u_over_its_frobenius_norm_per_matrix():
    g = torch.Generator().manual_seed(0)
    us = [torch.randn(5, 3, generator=g, dtype=torch.float64) * s for s in (1.0, 1e-3, 40.0)]
    out = muonh.normalize(us, 1e-7)
    for u, n in zip(us, out):
        assert n.dtype == u.dtype
        assert torch.allclose(n, u / u.norm(), rtol=1e-6, atol=0)
        assert abs(n.norm().item() - 1.0) < 1e-6
    # A zero update stays zero (the norm is clamped at eps, no NaN).
    assert torch.equal(muonh.normalize([torch.zeros(2, 2)], 1e-7)[0], torch.zeros(2, 2))


def test_step_then_projection_is_the_formula_and_keeps_the_norm():
    """W' = W - s R N; W = R W' / ||W'|| with ||W'|| from split rows' partial sums (as ranks give them)."""
    g = torch.Generator().manual_seed(1)
    w0 = torch.randn(7, 4, generator=g, dtype=torch.float64)
    r = muonh.radius(muonh.sum_of_squares(w0).double(), 1e-7)
    assert abs(r.item() - w0.norm().item()) < 1e-6
    w = w0 * 1.3  # off the sphere, as after an update
    n = muonh.normalize([torch.randn(7, 4, generator=g, dtype=torch.float64)], 1e-7)[0]
    expected = w - 0.05 * r * n
    expected = r * expected / expected.norm()
    parts = [w[:3].clone(), w[3:].clone(), w[7:].clone()]  # three ranks' rows, one of them empty
    for part, rows in zip(parts, (slice(0, 3), slice(3, 7), slice(7, 7))):
        muonh.step(part, n[rows], r, 0.05)
    total = sum(muonh.sum_of_squares(p) for p in parts)
    for part in parts:
        muonh.project(part, r, total, 1e-7)
    got = torch.cat(parts)
    assert torch.allclose(got, expected, rtol=1e-6, atol=1e-7)
    assert abs(got.norm().item() - r.item()) < 1e-5 * r.item()
