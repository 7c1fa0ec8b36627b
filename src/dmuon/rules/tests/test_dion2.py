"""Dion2's owner selection and update against the formula, ties and zero rows included."""

from __future__ import annotations

import math

import pytest
import torch

from dmuon.rules import dion2


def _ns(subs):
    # A stand-in orthogonalization that keeps each row's identity visible: rows scaled by their index + 1.
    return [s * torch.arange(1, s.shape[0] + 1, dtype=s.dtype).view(-1, 1) for s in subs]


@pytest.mark.parametrize("m,fraction,k", [(10, 0.25, 3), (4, 1.0, 4), (1, 0.25, 1), (37, 0.3, 12), (8, 0.01, 1)])
def test_selected_count_is_ceil_fraction_m_at_least_one(m, fraction, k):
    assert dion2.selected_count(m, fraction) == k == min(m, max(1, math.ceil(fraction * m)))


def test_owner_update_is_the_formula():
    g = torch.Generator().manual_seed(0)
    ms = [torch.randn(10, 6, generator=g, dtype=torch.float64) for _ in range(2)]
    out = dion2.owner_updates(ms, [0.25, 0.5], _ns)
    for m, frac, u in zip(ms, (0.25, 0.5), out):
        k = max(1, math.ceil(frac * 10))
        rows = torch.topk(m.abs().sum(dim=-1), k).indices.sort().values
        expected = torch.zeros_like(m)
        expected[rows] = _ns([m[rows]])[0]
        assert torch.equal(u, expected)
        assert torch.equal(dion2.selected_rows(u), torch.isin(torch.arange(10), rows))


def test_ties_follow_topk_on_the_same_matrix_and_zero_rows_change_nothing():
    """Rows of equal L1 norm (exact in float32): the owner's pick is topk's on the same values, which a
    reference calling topk makes too; selected zero rows come back zero, so no rank decays them, which
    is what decaying them would give (0 * ef_decay = 0)."""
    m = torch.tensor([[1.0, -1.0], [2.0, 0.0], [0.0, 0.0], [-1.0, 1.0], [0.0, 0.0], [0.5, 0.5]])
    k = dion2.selected_count(6, 0.5)
    picked = dion2.select_rows(m, 0.5)
    l1 = torch.linalg.vector_norm(m, ord=1, dim=-1)
    assert torch.equal(picked, torch.topk(m.abs().sum(dim=-1), k).indices.sort().values)
    assert torch.equal(l1[picked].sort().values, torch.tensor([2.0, 2.0, 2.0]))
    # All-zero matrix, fraction 1: every row selected, the update all zero, no decay anywhere.
    zero = torch.zeros(3, 4)
    u = dion2.owner_updates([zero], [1.0], _ns)[0]
    assert torch.equal(u, zero) and not dion2.selected_rows(u).any()
    buf = zero.clone()
    dion2.decay_selected(buf, dion2.selected_rows(u), 0.9)
    assert torch.equal(buf, zero)
    # One zero row among the selected: its update row is zero, the others' are not.
    m2 = torch.tensor([[3.0, 1.0], [0.0, 0.0], [1.0, 1.0]])
    u2 = dion2.owner_updates([m2], [1.0], lambda subs: subs)[0]
    assert dion2.selected_rows(u2).tolist() == [True, False, True]


def test_decay_selected_rows_of_a_momentum_part():
    buf = torch.ones(4, 3, 2)
    dion2.decay_selected(buf, torch.tensor([True, False, False, True]), 0.5)
    assert buf[:, 0, 0].tolist() == [0.5, 1.0, 1.0, 0.5]
    assert torch.equal(buf[0], torch.full((3, 2), 0.5))
    assert dion2.selected_rows(torch.tensor([[0.0, float("nan")], [0.0, 0.0]])).tolist() == [True, False]
