"""Recognising a clip (one float32 factor on every gradient) and agreeing on its factor."""

from __future__ import annotations

import torch

from dmuon.runtime.agreement import NONUNIFORM, agreed_scale, scale_flags, uniform_scale


def _clipped(gs, c):
    coef = torch.tensor(c, dtype=torch.float32)
    return [g * coef for g in gs]  # clip_grad_norm_'s _foreach_mul_ by its float32 coefficient


def test_the_factor_a_clip_multiplied_by_is_found_bit_for_bit():
    torch.manual_seed(0)
    gs = [torch.randn(7, 5), torch.randn(3, 11), torch.zeros(2, 2)]
    for c in (0.37, 1e-3, 0.999999, 1.0 / 3.0, 2.5e-8):
        found = uniform_scale(list(zip(gs, _clipped(gs, c))))
        assert found == float(torch.tensor(c, dtype=torch.float32))
        # The factor reproduces every element exactly.
        assert all(torch.equal(a, b) for a, b in zip(_clipped(gs, found), _clipped(gs, c)))


def test_unchanged_zero_and_nonuniform():
    torch.manual_seed(1)
    gs = [torch.randn(4, 4), torch.randn(6)]
    assert uniform_scale([(g, g.clone()) for g in gs]) == 1.0
    assert uniform_scale([(torch.zeros(3), torch.zeros(3))]) is None  # any factor fits
    assert uniform_scale([]) is None
    # Two factors, a masked element, clip_grad_value_: not one factor.
    assert uniform_scale([(gs[0], gs[0] * 0.5), (gs[1], gs[1] * 0.25)]) == NONUNIFORM
    edited = gs[0] * 0.5
    edited[0, 0] = 0.0
    assert uniform_scale([(gs[0], edited)]) == NONUNIFORM
    assert uniform_scale([(gs[0], gs[0].clamp(-0.1, 0.1))]) == NONUNIFORM


def _maximum(*flags):
    return [max(column) for column in zip(*flags)]


def test_ranks_agree_on_a_factor_only_when_every_proposal_is_the_same():
    a, b = 0.25, float(torch.nextafter(torch.tensor(0.25), torch.tensor(1.0)))
    assert agreed_scale(_maximum(scale_flags(a), scale_flags(a))) == a
    assert agreed_scale(_maximum(scale_flags(a), scale_flags(None))) == a  # a rank with nothing to say
    assert agreed_scale(_maximum(scale_flags(None), scale_flags(None))) is None
    assert agreed_scale(_maximum(scale_flags(a), scale_flags(b))) == NONUNIFORM  # one bit apart
    assert agreed_scale(_maximum(scale_flags(a), scale_flags(NONUNIFORM))) == NONUNIFORM
    # Every flag is an integer 0-255, exact in a bfloat16 wire.
    flags = scale_flags(0.1234)
    assert all(0 <= f <= 255 for f in flags)
    assert torch.tensor(flags, dtype=torch.bfloat16).int().tolist() == flags
