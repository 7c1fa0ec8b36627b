"""The replicate level in backward: where a stage's reductions by hand land and how often the compute
stream waits for them (one process, under the stream checker), and dmuon's own stream's join."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from dmuon.runtime.own_stream import OwnStream
from dmuon.runtime.replicate_backward import ReplicateBackward
from dmuon.runtime.schedule_divisor import ScheduleDivisor


class Level:
    """A replicate level that notes the stream each ``land_all`` ran on."""

    def __init__(self, streams) -> None:
        self.streams = streams
        self.landed_on: list[str] = []

    def land_all(self) -> None:
        self.landed_on.append(self.streams.current())


def _replicate(checker) -> tuple[ReplicateBackward, Level]:
    level = Level(checker)
    return ReplicateBackward(level, SimpleNamespace(infos=[]), None, None, OwnStream(checker)), level


def test_the_compute_stream_waits_once_per_stage_reduced_by_hand(checker):
    """CUDA rule: FSDP2's reduce-scatter stream waits for the compute stream before each unit's
    reduce-scatter, so a wait of the compute stream per unit would queue the next unit (and other
    stages' compute) behind each reduction across replicas: the compute stream joins dmuon's once,
    when the stage's last unit has completed; FSDP2's stream never waits for dmuon's."""
    replicate, level = _replicate(checker)
    gradient = torch.arange(6.0).reshape(2, 3)  # the schedule's reduced gradient, before its division
    gradients = SimpleNamespace(local_parts=lambda members: {i: gradient for i in members})
    divisor = ScheduleDivisor(torch.device("cpu"))
    replicate.to_keep = [4]
    with checker.use("fsdp2-post-reduce"):  # the hooks run on FSDP2's stream
        replicate.land_stage(divisor, gradients)
    assert level.landed_on == ["dmuon"]
    assert checker.waits[("compute", "dmuon")] == 1
    assert not any(waiting == "fsdp2-post-reduce" for waiting, _ in checker.waits)
    kept = divisor.kept()
    assert replicate.to_keep == [] and list(kept) == [4] and torch.equal(kept[4], gradient)
    assert kept[4].data_ptr() != gradient.data_ptr()  # a copy: the schedule divides the gradient in place next
    gradient.div_(2)  # the schedule's division, on the compute stream: after the wait
    with checker.use("fsdp2-post-reduce"):
        replicate.land_stage(divisor, gradients)  # the next stage
    assert checker.waits[("compute", "dmuon")] == 2 and level.landed_on == ["dmuon", "dmuon"]


def test_the_end_of_backward_joins_dmuons_stream_and_lands_every_reduction(checker):
    replicate, level = _replicate(checker)
    replicate.backward_ended()
    assert level.landed_on == ["compute"] and not checker.waits  # nothing ran on dmuon's stream: no wait
    with checker.use("fsdp2-post-reduce"):
        with replicate.own.use():
            made = torch.ones(3) * 2
    replicate.backward_ended()
    assert checker.waits[("compute", "dmuon")] == 1
    assert (made + 1).sum().item() == 9  # read on the compute stream after the join
    replicate.backward_ended()
    assert checker.waits[("compute", "dmuon")] == 1  # joined once for what ran there


def test_the_own_stream_joins_into_the_compute_stream_from_a_hook(checker):
    own = OwnStream(checker)
    with checker.use("fsdp2-post-reduce"):
        with own.use():
            made = torch.ones(2) * 3
        own.join_into_compute()
    assert checker.waits == {("compute", "dmuon"): 1}
    assert (made * 2).sum().item() == 12
