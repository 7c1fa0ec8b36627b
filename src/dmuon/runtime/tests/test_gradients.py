"""GradientParts: this rank's parts of the gradients, and the copies a launch keeps of them."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from dmuon.runtime.gradients import GradientParts, divided


def _parts() -> tuple[GradientParts, list[torch.Tensor]]:
    grads = [torch.arange(12.0).reshape(3, 4) - 5, torch.linspace(-1, 1, 10).reshape(2, 5)]
    infos = []
    for k, g in enumerate(grads):
        param = torch.zeros_like(g)
        param.grad = g
        # The rank's part: its piece's columns (here the first two).
        infos.append(SimpleNamespace(index=k, param=param, kept_view=lambda local, r, s: local[:, :2]))
    plan = SimpleNamespace(rank=0, shard=1, infos=infos)
    return GradientParts(plan, (0, 0), None), grads


def test_local_parts_are_views_of_the_gradients_as_they_are_now():
    gradients, grads = _parts()
    parts = gradients.local_parts([0, 1])
    assert torch.equal(parts[0], grads[0][:, :2]) and torch.equal(parts[1], grads[1][:, :2])
    grads[0].mul_(3)
    assert torch.equal(parts[0], grads[0][:, :2])  # views: what a later clip leaves


def test_copies_keep_the_gradient_as_launched_divided_as_a_schedule_divides_it():
    gradients, grads = _parts()
    kept = gradients.copies([0, 1])
    assert torch.equal(kept[0], grads[0][:, :2])
    grads[0].mul_(0.5)  # a clip after the launch
    assert torch.equal(kept[0], (grads[0][:, :2] * 2))  # the copy did not move
    third = gradients.copies([0, 1], divisor=3)
    assert torch.equal(third[1], grads[1][:, :2].div(3))
    sums = {1: torch.full((2, 2), 7.0)}  # the replicate level: the landed reduction's sums
    from_sums = gradients.copies([0, 1], sums)
    assert torch.equal(from_sums[1], sums[1]) and from_sums[1].data_ptr() != sums[1].data_ptr()
    assert torch.equal(from_sums[0], grads[0][:, :2])


def test_divided_is_the_schedules_division_and_nothing_for_one():
    parts = {0: torch.tensor([1.0, 2.0, 3.0])}
    assert divided(parts, 1) is parts and divided(parts, None) is parts
    assert torch.equal(divided(parts, 3)[0], torch.tensor([1.0, 2.0, 3.0]).div(3))
