"""ScheduleDivisor: the divisor a pipeline schedule applies after its reduction, learned from one step's
gradients as reduced and as divided in place (one process: no agreement collective)."""

import torch

from dmuon.runtime.schedule_divisor import ScheduleDivisor


def _learned(before: dict, divide) -> int | None:
    divisor = ScheduleDivisor(torch.device("cpu"))
    assert divisor.defers and divisor.kept() is None
    divisor.keep(before)
    now = {i: divide(t.clone()) for i, t in before.items()}
    divisor.learn(now, None)
    assert divisor.kept() is None  # the copies are dropped once learned from
    return divisor.value


def _gradients(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {0: torch.randn(7, 5, generator=g), 3: torch.randn(4, 9, generator=g), 5: torch.zeros(0, 9)}


def test_the_schedules_divisor_is_found_bit_for_bit():
    for n in (1, 2, 3, 4, 7, 12):
        assert _learned(_gradients(n), lambda t: t.div_(n)) == n


def test_a_multiplication_by_the_reciprocal_is_no_divisor():
    # g * fl(1/3) differs from g / 3 in some elements: not what a schedule's div_ leaves.
    before = _gradients(1)
    assert any(not torch.equal(t.div(3), t.mul(1 / 3)) for t in before.values() if t.numel())
    assert _learned(before, lambda t: t.mul_(1 / 3)) is None


def test_gradients_edited_otherwise_teach_nothing():
    assert _learned(_gradients(2), lambda t: t.clamp_(-0.5, 0.5)) is None
    assert _learned(_gradients(2), lambda t: t.mul_(2)) is None  # no integer divisor


def test_nothing_to_learn_from_zero_or_empty_parts():
    assert _learned({0: torch.zeros(3, 3), 1: torch.zeros(0, 4)}, lambda t: t) is None


def test_learning_reads_the_host_a_fixed_number_of_times():
    # On an accelerator each read waits for the device: not one (or several) per matrix.
    from dmuon.bench.op_count import HostReadCounter

    counts = []
    for parts in (2, 20):
        g = torch.Generator().manual_seed(parts)
        before = {i: torch.randn(6, 5, generator=g) for i in range(parts)}
        divisor = ScheduleDivisor(torch.device("cpu"))
        divisor.keep(before)
        with HostReadCounter() as reads:
            divisor.learn({i: t.div(4) for i, t in before.items()}, None)
        assert divisor.value == 4
        counts.append(reads.count)
    assert counts[0] == counts[1] <= 2, counts


def test_launches_from_a_reduction_by_hand_wait_until_the_divisor_is_known():
    divisor = ScheduleDivisor(torch.device("cpu"))
    assert divisor.for_reduction(by_hand=False) == (False, 1)  # a backward pass: nothing divides after it
    assert divisor.for_reduction(by_hand=True) == (True, None)
    divisor.value = 4
    assert divisor.for_reduction(by_hand=True) == (False, 4)
    assert divisor.for_reduction(by_hand=False) == (False, 1)


def test_learning_from_the_gradients_reads_them_as_they_are_now():
    from types import SimpleNamespace

    from dmuon.comm.streams import HostStreams

    before = _gradients(3)
    grads = {i: t.clone() for i, t in before.items()}
    gradients = SimpleNamespace(local_parts=lambda members: {i: grads[i] for i in members})
    divisor = ScheduleDivisor(torch.device("cpu"))
    divisor.learn_from(gradients, HostStreams(), None)
    assert divisor.value is None  # nothing deferred: nothing to learn, no collective
    divisor.keep(grads)
    for t in grads.values():
        t.div_(6)  # the schedule's division, in place, after the copies
    divisor.learn_from(gradients, HostStreams(), None)
    assert divisor.value == 6 and divisor.kept() is None
