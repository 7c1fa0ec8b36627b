"""The hop A spreader: every row once, within its delay, each collective's ranks near one level."""

from __future__ import annotations

import random

import pytest

from dmuon.plan.hop_a import UNITS, HopASpreader, SliceShape, column_reduce_loads, slice_shape
from dmuon.plan.layout import shard_rows

R, S, WIRE = 4, 2, 2


def _shape(rows: int, cols: int, owner_replica: int) -> SliceShape:
    pieces = [(m, cols, True) for m in shard_rows(rows, S)]
    return slice_shape(owner_replica, pieces, R, 1)


def _blocks(seed: int) -> list[list[tuple[int, int, int]]]:
    """Ten blocks of three matrices of unequal sizes, owners on random replicas."""
    rng = random.Random(seed)
    return [[(rows, cols, rng.randrange(R)) for rows, cols in ((64, 16), (16, 16), (8, 16))] for _ in range(10)]


def _run(blocks, max_delay: int):
    """Drives a spreader as the runtime does; per collective the loads, and every unit range sent."""
    shapes, members = {}, []
    for b, mats in enumerate(blocks):
        members.append([])
        for rows, cols, owner in mats:
            i = len(shapes)
            shapes[i] = _shape(rows, cols, owner)
            members[-1].append((i, rows, cols))
    spreader = HopASpreader(shapes, R, S, WIRE, max_delay)
    sent = {i: [] for i in shapes}
    decided_at: dict[int, list[int]] = {}
    loads, bases = [], []
    for j, mats in enumerate(members + [None]):
        final = mats is None
        base = [[0, 0] for _ in range(R * S)] if final else column_reduce_loads(
            [[(m, cols, True) for m in shard_rows(rows, S)] for _, rows, cols in mats], [1] * len(mats), R, S, 4)
        before = {b: spreader.upto(b) for b in spreader.pending()}
        loads.append(spreader.decide(base, final=final))
        bases.append(base)
        for b, was in before.items():
            now = spreader.upto(b)
            for i in was:
                if now[i] > was[i]:
                    sent[i].append((was[i], now[i]))
                    decided_at.setdefault(b, []).append(j)
        if not final:
            spreader.add(j, [i for i, _, _ in mats])
    return shapes, sent, decided_at, loads, bases


@pytest.mark.parametrize("max_delay", [1, 3, 8])
def test_every_unit_goes_once_and_in_time(max_delay):
    shapes, sent, decided_at, loads, _ = _run(_blocks(0), max_delay)
    for i, ranges in sent.items():
        # Contiguous, non-overlapping, covering [0, UNITS).
        assert ranges[0][0] == 0 and ranges[-1][1] == UNITS
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    for b, at in decided_at.items():
        # Block b becomes ready at collective b + 1; its last chunk goes within max_delay of it
        # (the last blocks' with the final collective).
        last = len(loads) - 1
        assert min(at) >= b + 1 and max(at) <= min(b + max_delay, last)
    if max_delay == 1:  # all at once, with the next collective
        assert all(len(ranges) == 1 for ranges in sent.values())
    # The loads the spreader returns are the exact bytes: base plus the rows of the ranges chosen.
    total = sum(load[k][1] for load in loads for k in range(R * S))
    assert total == sum(sum(b[1] for b in base) for base in _run(_blocks(0), max_delay)[4]) + \
        sum(shape.received_bytes(S, WIRE) for shape in shapes.values())


def test_spreading_lowers_the_busiest_ranks_bytes():
    for seed in range(3):
        _, _, _, once, _ = _run(_blocks(seed), 1)
        _, _, _, spread, _ = _run(_blocks(seed), 8)
        busiest = [sum(max(max(x) for x in load) for load in run) for run in (once, spread)]
        # The same bytes in all; the sum of each collective's busiest rank drops.
        assert sum(sum(map(sum, load)) for load in once) == sum(sum(map(sum, load)) for load in spread)
        assert busiest[1] < 0.95 * busiest[0], seed


def test_a_collective_stays_within_its_level_unless_a_deadline_forces_more():
    # Whatever is not forced goes only while every rank stays within the level: the busiest rank's
    # base plus the average a rank receives per block so far (one row of slack for rounding).
    shapes, _, _, loads, bases = _run(_blocks(1), 8)
    row = max(max(w for w in widths) for shape in shapes.values() for widths in shape.widths) * WIRE
    received, launched = 0.0, 0
    for j, (load, base) in enumerate(zip(loads[:-1], bases[:-1])):
        fair = received / max(launched, 1) / (R * S)
        level = max(max(x) for x in base) + fair
        peak = max(max(x) for x in load)
        assert peak <= level + 4 * row or j >= 8, j  # from collective 8 on deadlines may force more
        received += sum(shapes[i].received_bytes(S, WIRE) for i in range(3 * j, 3 * j + 3))
        launched += 1


def test_max_delay_is_validated():
    with pytest.raises(ValueError, match="max_delay"):
        HopASpreader({}, R, S, WIRE, 0)
