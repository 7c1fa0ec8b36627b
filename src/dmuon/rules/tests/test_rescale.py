"""The owner's direction for a rescaled (clipped) gradient, and its copy of the momentum, against
torch.optim.Muon's momentum written out, with the error bound of ``dmuon.runtime.owner_momentum``."""

from __future__ import annotations

import pytest
import torch

from dmuon.rules.muon import momentum_after, momentum_update, peek_direction, rescaled_direction

U_BF16 = 2.0 ** -8  # bfloat16's unit roundoff (8 significand bits with the implicit one, round to nearest)
U_FP32 = 2.0 ** -24


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("wire", [torch.bfloat16, torch.float32])
def test_owner_direction_for_a_clipped_gradient_stays_within_the_wire_rounding(nesterov, wire):
    """Over 12 steps, clipped on some: the owner keeps the momentum from the directions it received (in
    the wire dtype) and forms a clipped step's direction as ``c d0 + (1 - c) K buf``. Its error against
    torch's direction for the clipped gradient stays within the largest wire rounding of the launched
    directions so far (each error in the copy shrinks by mu / (1 + mu) a step), plus float32 rounding."""
    torch.manual_seed(0)
    mu, shape = 0.95, (16, 24)
    buf = torch.zeros(shape)            # the ranks' momentum, as torch.optim.Muon keeps it
    copy = torch.zeros(shape)           # the owner's copy
    u = U_BF16 if wire == torch.bfloat16 else U_FP32
    # The bound, elementwise: the largest error any step's direction may carry so far, i.e. the wire's
    # rounding of the launched direction plus float32 rounding of the owner's arithmetic; errors in
    # the copy only shrink (weights mu / (1 + mu) and 1 / (1 + mu) sum to 1), so it stays within it.
    bound = torch.zeros(shape)
    largest = torch.zeros(shape)
    clips = {2: 0.5, 3: 0.3, 4: 0.9, 7: 0.05, 8: 0.7, 11: 0.2}
    for step in range(12):
        g = torch.randn(shape) * (1 + step % 3)
        exact = peek_direction(g, buf, mu, nesterov)
        largest = torch.maximum(largest, exact.abs())
        launched = exact.to(wire)  # what backward sent
        c = clips.get(step, 1.0)
        if step in clips:
            used = rescaled_direction(launched, copy, c, mu, nesterov)
            g = g.mul(torch.tensor(c))  # clip_grad_norm_'s mul_
        else:
            used = launched.float()
        truth = momentum_update(g, buf, mu, nesterov).clone()
        largest = torch.maximum(largest, torch.maximum(truth.abs(), copy.abs()))
        arithmetic = 4 * U_FP32 * (truth.abs() + copy.abs() + exact.abs())
        bound = torch.maximum(bound, c * u * exact.abs() + (1 - c) * bound + arithmetic)
        assert bool(((used - truth).abs() <= bound).all()), f"step {step}"
        momentum_after(copy, used, mu, nesterov)
        assert bool(((copy - buf).abs() <= bound + 4 * U_FP32 * buf.abs()).all()), f"step {step}"
    # No growth: one wire rounding of the largest direction, plus float32's (which a clip by c can
    # raise to 1 / c of itself in the recurrence above).
    assert bool((bound <= (u + 16 * U_FP32 / min(clips.values())) * largest).all())


def test_rescaled_direction_is_linear_in_the_gradient():
    # With a float32 wire and the exact momentum, the formula is torch's direction up to rounding.
    torch.manual_seed(1)
    g, buf = torch.randn(5, 7), torch.randn(5, 7)
    for nesterov in (True, False):
        d0 = peek_direction(g, buf, 0.9, nesterov)
        want = peek_direction(g * 0.25, buf, 0.9, nesterov)
        got = rescaled_direction(d0, buf, 0.25, 0.9, nesterov)
        assert torch.allclose(got, want, rtol=0, atol=4 * U_FP32 * (want.abs().max() + buf.abs().max()))
