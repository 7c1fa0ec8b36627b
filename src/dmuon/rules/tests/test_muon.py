"""The Muon rule: what backward peeks at is bit for bit what step() commits; torch.optim.Muon's update."""

from __future__ import annotations

import pytest
import torch

from dmuon.rules.muon import apply_update, momentum_update, peek_direction


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("shape", [(37, 91), (1, 200), (13, 37, 3), (0, 5)])
@pytest.mark.parametrize("fresh", [True, False])
def test_peek_equals_the_committed_direction_and_leaves_the_buffer(nesterov, shape, fresh):
    gen = torch.Generator().manual_seed(sum(shape))
    grad = torch.randn(shape, generator=gen)
    buf = torch.zeros(shape) if fresh else torch.randn(shape, generator=gen)
    before = buf.clone()
    peeked = peek_direction(grad, None if fresh else buf, 0.95, nesterov)
    assert torch.equal(buf, before)
    committed = momentum_update(grad, buf, 0.95, nesterov)
    assert torch.equal(peeked, committed)
    assert not torch.equal(buf, before) or grad.numel() == 0


def test_one_step_equals_torch_optim_muon():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(24, 40, generator=gen)
    grad = torch.randn(24, 40, generator=gen)
    ref = torch.nn.Parameter(weight.clone())
    ref.grad = grad.clone()
    muon = torch.optim.Muon([ref], lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True)
    muon.step()
    ortho_of = torch.optim._muon._zeropower_via_newtonschulz
    buf = torch.zeros_like(weight)
    direction = momentum_update(grad, buf, 0.95, True)
    ortho = ortho_of(direction, (3.4445, -4.7750, 2.0315), 5, 1e-7)
    mine = weight.clone()
    apply_update(mine, ortho, lr=0.02, weight_decay=0.1, adjust_lr_fn=None, matrix_shape=(24, 40))
    assert torch.equal(mine, ref.detach())
    assert torch.equal(buf, muon.state[ref]["momentum_buffer"])
