"""Recognising a clip (one float32 factor on every gradient) and agreeing on its factor."""

from __future__ import annotations

import torch

from dmuon.bench.op_count import HostReadCounter
from dmuon.runtime.agreement import NONUNIFORM, agreed_scale, scale_flags, uniform_scale, uniform_scales


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


def test_the_launches_at_once_on_the_device_equal_the_plain_version_per_launch():
    torch.manual_seed(2)
    gs = [torch.randn(7, 5), torch.randn(3, 11), torch.zeros(2, 2)]
    half = torch.randn(4, 4).to(torch.bfloat16)
    edited = gs[0] * 0.5
    edited[0, 0] = 0.0
    factors = (0.37, 1e-3, 0.999999, 1.0 / 3.0, 2.5e-8)
    # clip_grad_norm_'s in-place _foreach_mul_ by its float32 coefficient, which keeps each gradient's dtype.
    launches = [[(g, g.clone().mul_(torch.tensor(c, dtype=torch.float32))) for g in gs] for c in factors]
    launches += [
        [(g, g.clone()) for g in gs],  # unchanged
        [(torch.zeros(3), torch.zeros(3))],  # any factor fits
        [],
        [(torch.zeros(0), torch.zeros(0)), (torch.zeros(0, 4), torch.zeros(0, 4))],  # empty shards
        [(torch.zeros(0), torch.zeros(0)), (gs[0], gs[0] * 0.25)],
        [(gs[0], gs[0] * 0.5), (gs[1], gs[1] * 0.25)],  # two factors
        [(gs[0], edited)],  # a masked element
        [(gs[0], gs[0].clamp(-0.1, 0.1))],  # clip_grad_value_
        [(torch.zeros(3), torch.ones(3))],  # the changed pair's largest element is zero
        [(gs[0], gs[0].double())],  # another dtype
        [(gs[0], gs[0].reshape(5, 7))],  # another shape
        [(gs[2], gs[2].clone()), (gs[1], gs[1] * 0.5)],  # the first pair unchanged (and zero)
        [(half, half.clone().mul_(torch.tensor(0.5))), (half, half.clone().mul_(torch.tensor(0.37)))],  # bfloat16
    ]
    reads = HostReadCounter()
    with reads:
        found = uniform_scales(launches)
    assert reads.count == 0  # what is read goes through .tolist() (twice, not per pair)
    assert found == [uniform_scale(pairs) for pairs in launches]
    assert all(isinstance(f, float) for f in found[:5]) and found[5:8] == [1.0, None, None]
    assert uniform_scales([]) == []
