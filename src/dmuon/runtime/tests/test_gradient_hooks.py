"""GradientHooks: which unit's gradients have landed, when a unit completes, and which hooks act (one process)."""

from __future__ import annotations

import gc
from types import SimpleNamespace

import torch

from dmuon.comm.streams import HostStreams
from dmuon.runtime.gradient_hooks import GradientHooks, Unit


class Landings:
    """Records what the hooks tell."""

    def __init__(self) -> None:
        self.completed: list[tuple[int, set[int], bool]] = []
        self.ended = 0
        self.stages = 0

    def complete(self, unit: int, landed: set[int], first: bool) -> None:
        self.completed.append((unit, landed, first))

    def backward_ended(self) -> None:
        self.ended += 1

    def stage_reduced(self) -> None:
        self.stages += 1


def _hooks(units: list[Unit], landings: Landings) -> GradientHooks:
    return GradientHooks(SimpleNamespace(device=torch.device("cpu")), units, HostStreams(), landings, None)


def _params(n: int) -> list[torch.Tensor]:
    return [torch.randn(3, 2, requires_grad=True) for _ in range(n)]


def test_a_unit_completes_when_its_last_parameter_lands_or_the_next_unit_starts():
    a, b, c = _params(3)
    landings = Landings()
    hooks = _hooks([Unit([a, b], 0), Unit([c], 1)], landings)
    hooks.landed(a)
    assert landings.completed == [] and hooks.current == 0
    hooks.landed(c)  # the next unit starts landing: unit 0 completes with what landed of it
    assert landings.completed == [(0, {id(a)}, True), (1, {id(c)}, True)]
    assert hooks.current is None and hooks.fired == {0, 1}
    hooks.landed(a)
    hooks.landed(b)  # a second reduction in the same step: not its first completion
    assert landings.completed[-1] == (0, {id(a), id(b)}, False)
    hooks.reset()
    hooks.landed(b)
    hooks.complete_current()  # take(): the partly landed unit completes now
    assert landings.completed[-1] == (0, {id(b)}, True)
    hooks.complete_current()  # nothing partly landed: nothing more
    assert len(landings.completed) == 4


def test_a_reduction_outside_backward_is_by_hand():
    """torch's pipeline schedules reduce a stage's gradients by hand, outside autograd: the launches
    then read them before the schedule's division (ScheduleDivisor)."""
    a, b = _params(2)
    landings = Landings()
    hooks = _hooks([Unit([a], 0), Unit([b], 1)], landings)
    hooks.landed(a)
    assert hooks.by_hand
    (a * b).sum().backward()  # the hooks fire inside autograd's backward
    assert not hooks.by_hand
    assert sorted(u for u, _, _ in landings.completed) == [0, 0, 1]


def test_the_replicate_level_hears_each_arrival_each_backwards_end_and_each_stage_reduced_by_hand():
    """On the replicate level every reduction across replicas must land before backward returns (an
    autograd final callback), and after a pipeline stage's reduction by hand once its last unit completed."""
    a, b, c = _params(3)
    arrived: list[int] = []
    landings = Landings()
    units = [Unit([a], 0, root="stage0"), Unit([b], 1, root="stage0"), Unit([c], 2, root="stage1")]
    hooks = GradientHooks(SimpleNamespace(device=torch.device("cpu")), units, HostStreams(), landings,
                          SimpleNamespace(arrived=lambda p: arrived.append(id(p))))
    (a * b * c).sum().backward()
    assert landings.ended == 1 and landings.stages == 0 and sorted(arrived) == sorted(map(id, (a, b, c)))
    (a * b * c).sum().backward()
    assert landings.ended == 2  # once per backward pass
    hooks.reset()
    hooks.landed(a)
    assert landings.stages == 0  # stage0's unit 1 has not completed
    hooks.landed(b)
    assert landings.stages == 1
    hooks.landed(c)
    assert landings.stages == 2 and landings.ended == 2


def test_only_the_newest_hooks_on_a_parameter_act():
    """A new optimizer on the same parameters (resume): the old one's hooks must do nothing, whether
    or not it has been garbage-collected yet (that can differ between ranks, and its launches
    would issue collectives the others do not)."""
    a, b = _params(2)
    old, new = Landings(), Landings()
    old_hooks = _hooks([Unit([a, b], 0)], old)
    new_hooks = _hooks([Unit([a, b], 0)], new)
    (a * b).sum().backward()
    assert old.completed == [] and new.completed == [(0, {id(a), id(b)}, True)]
    new_hooks.close()
    new_hooks.reset()
    (a * b).sum().backward()
    assert old.completed == [] and len(new.completed) == 1  # removed; the old ones still not the newest
    del old_hooks


def test_hooks_whose_launches_are_gone_do_nothing():
    a, b = _params(2)
    landings = Landings()
    hooks = _hooks([Unit([a, b], 0)], landings)
    (a * b).sum().backward()
    assert len(landings.completed) == 1
    del landings
    gc.collect()
    hooks.reset()
    (a * b).sum().backward()  # would raise in _tell() if it acted
    assert hooks.fired == set()
