"""The MILP balancer against brute force, LPT and its own promises (memory, determinism, fallbacks)."""

from __future__ import annotations

import functools
import itertools
import math
import random
import re
import sys

import pytest

from dmuon.plan import balance as balance_mod
from dmuon.plan import milp
from dmuon.plan.balance import BALANCERS, balance, evaluate, lpt
from dmuon.plan.milp import Kind, best_partition, owners_from_counts, useful_batch_sizes

from ._balancing import assign_owners


def _brute_partition(costs: dict[int, float], n: int) -> float:
    """Cheapest split of n into available batch sizes, by plain recursion (independent of the DP)."""

    @functools.lru_cache(None)
    def go(m: int, largest: int) -> float:
        if m == 0:
            return 0.0
        return min((costs[b] + go(m - b, b) for b in costs if b <= min(m, largest)), default=math.inf)

    return go(n, n)


def _brute_loads(kinds, items, owners, world_size):
    loads, state = [0.0] * world_size, [0] * world_size
    for r in range(world_size):
        for k, kind in enumerate(kinds):
            n = sum(1 for i, o in zip(items, owners) if o == r and i == k)
            if n:
                loads[r] += _brute_partition(dict(kind.costs), n)
                state[r] += n * kind.state_bytes
    return loads, state


def _brute_force(kinds, items, world_size, cap=None):
    """(best makespan, least total time among assignments reaching it), over every owner vector."""
    best = (math.inf, math.inf)
    for owners in itertools.product(range(world_size), repeat=len(items)):
        loads, state = _brute_loads(kinds, items, owners, world_size)
        if cap is not None and max(state) > cap:
            continue
        best = min(best, (round(max(loads), 9), round(sum(loads), 9)))
    return best


def _random_instance(rng: random.Random, n_kinds: int, max_count: int, batching: bool):
    kinds = []
    for k in range(n_kinds):
        unit = rng.randint(2, 40)
        costs = {1: float(unit)}
        if batching:
            for b in range(2, max_count + 1):
                # Sometimes a real saving, sometimes a batch that loses to running singly.
                costs[b] = float(unit * b - rng.randint(0, unit * (b - 1)) + rng.choice([0, 0, unit]))
        kinds.append(Kind((k + 1, 8), costs, rng.randint(1, 9) * 100))
    items = [k for k in range(n_kinds) for _ in range(rng.randint(1, max_count))]
    rng.shuffle(items)
    return kinds, items


def test_best_partition_matches_recursion():
    rng = random.Random(0)
    for _ in range(30):
        costs = {1: float(rng.randint(1, 9))} | {b: float(rng.randint(1, 30)) for b in rng.sample(range(2, 9), 3)}
        kind = Kind("k", costs, 1)
        for n in range(0, 12):
            cost, sizes = best_partition(kind, n)
            assert sum(sizes) == n and all(b in costs for b in sizes)
            assert cost == pytest.approx(_brute_partition(costs, n))
            assert cost == pytest.approx(sum(costs[b] for b in sizes))


def test_dominated_batch_sizes_are_dropped():
    kind = Kind("k", {1: 1.0, 2: 2.5, 3: 2.0, 4: 3.9, 6: 4.5}, 1)
    # 2 (2.5) loses to 1+1 (2.0), 4 (3.9) to 3+1 (3.0), 6 (4.5) to 3+3 (4.0).
    assert useful_batch_sizes(kind, 6) == [1, 3]
    assert useful_batch_sizes(kind, 2) == [1]
    with pytest.raises(ValueError, match="batch size 1"):
        Kind("k", {2: 1.0}, 1)


@pytest.mark.parametrize("seed", range(8))
def test_milp_equals_brute_force(seed):
    rng = random.Random(seed)
    world_size = 2 + seed % 2
    kinds, items = _random_instance(rng, n_kinds=2, max_count=3 + (seed % 2), batching=seed % 4 != 0)
    while len(items) > 7:
        items.pop()
    res = balance(kinds, items, world_size, "milp", memory_factor=None, time_limit_s=20)
    best_makespan, best_total = _brute_force(kinds, items, world_size)
    assert res.status == "optimal"
    # HiGHS stops at a 1e-4 relative gap; these integer costs never differ by that little.
    assert res.makespan == pytest.approx(best_makespan, rel=1e-9)
    assert sum(res.loads) == pytest.approx(best_total, rel=1e-9)
    # Loads and batches are what the owners imply.
    loads, _ = _brute_loads(kinds, items, res.owners, world_size)
    assert res.loads == pytest.approx(loads)
    for r, plan in enumerate(res.batches):
        for key, sizes in plan.items():
            k = next(i for i, kind in enumerate(kinds) if kind.key == key)
            assert sum(sizes) == sum(1 for i, o in zip(items, res.owners) if i == k and o == r)


@pytest.mark.parametrize("seed", range(3))
def test_memory_cap_is_respected_and_optimal_under_it(seed):
    rng = random.Random(100 + seed)
    # Cheap matrices hold a lot of state, expensive ones little: the time optimum overloads memory.
    kinds = [Kind("cheap-big", {1: 1.0}, 1000), Kind("dear-small", {1: float(rng.randint(3, 6))}, 10)]
    items = [0, 0, 0, 0, 1, 1, 1, 0][: 6 + seed]
    world_size = 3
    free = balance(kinds, items, world_size, "milp", memory_factor=None)
    capped = balance(kinds, items, world_size, "milp", memory_factor=1.25)
    total = sum(kinds[k].state_bytes for k in items)
    assert capped.memory_cap >= 1.25 * total / world_size - 1e-9
    assert max(capped.state_bytes) <= capped.memory_cap
    best_makespan, _ = _brute_force(kinds, items, world_size, cap=capped.memory_cap)
    assert capped.makespan == pytest.approx(best_makespan, rel=1e-9)
    assert capped.makespan >= free.makespan - 1e-9


def test_memory_cap_relaxed_with_a_note_when_matrices_are_few():
    kinds = [Kind((64, 64), {1: 3.0}, 4 * 64 * 64), Kind((8, 8), {1: 1.0}, 4 * 8 * 8)]
    items = [0, 1, 1]
    res = balance(kinds, items, 8, "milp")
    assert res.memory_cap == 4 * 64 * 64
    assert any("memory cap raised" in n for n in res.notes)
    assert max(res.state_bytes) <= res.memory_cap
    assert res.makespan == 3.0 and sorted(res.owners) == sorted(set(res.owners))


def test_memory_cap_relaxed_after_infeasible_solve():
    # State 5, 5, 5, 3, 3 on two ranks at factor 1.0: cap 10.5 passes the
    # pigeonhole bound (10) but no split fits (10 | 11 at best), so HiGHS
    # reports infeasible and the cap grows to the greedy packing's 11.
    kinds = [Kind("a", {1: 1.0}, 3), Kind("b", {1: 1.0}, 5)]
    items = [0, 0, 1, 1, 1]
    assert milp.memory_cap(kinds, [2, 3], 2, 1.0) == (10.5, [])
    res = balance(kinds, items, 2, "milp", memory_factor=1.0)
    assert res.memory_cap == 11 and sorted(res.state_bytes) == [10, 11]
    assert any("relaxed" in n for n in res.notes)


@pytest.mark.parametrize("seed", range(10))
def test_never_worse_than_lpt(seed):
    rng = random.Random(1000 + seed)
    kinds, items = _random_instance(rng, n_kinds=rng.randint(2, 5), max_count=rng.randint(3, 8),
                                    batching=seed % 2 == 1)
    world_size = rng.randint(2, 6)
    res = balance(kinds, items, world_size, "milp", memory_factor=None, time_limit_s=2)
    greedy = lpt([kinds[k].costs[1] for k in items], world_size)
    greedy_loads, _, _ = evaluate(kinds, items, greedy, world_size)
    assert res.makespan <= max(greedy_loads) * (1 + 1e-12)
    assert res.lower_bound <= res.makespan * (1 + 1e-9)
    assert set(res.owners) <= set(range(world_size)) and len(res.owners) == len(items)


def test_deterministic_and_owners_follow_index_order():
    rng = random.Random(7)
    kinds, items = _random_instance(rng, n_kinds=3, max_count=6, batching=True)
    a = balance(kinds, items, 4, "milp", memory_factor=None)
    b = balance(list(kinds), list(items), 4, "milp", memory_factor=None)
    assert a.owners == b.owners and a.batches == b.batches
    # Within each kind, owners never decrease along the matrix index.
    for k in range(len(kinds)):
        mine = [o for i, o in zip(items, a.owners) if i == k]
        assert mine == sorted(mine)
    assert owners_from_counts([0, 1, 0, 0, 1], [[1, 2], [0, 2]]) == [0, 1, 1, 1, 1]
    with pytest.raises(ValueError, match="kind 0"):
        owners_from_counts([0, 0], [[1, 0]])


def test_phase_two_batches_off_the_critical_rank():
    # One expensive matrix fixes the makespan at 10 and the six cheap ones fit
    # beside it in many ways; only phase 2 (least total time) asks for the one
    # batch of six (2.1 instead of up to 12 run singly).
    kinds = [Kind("big", {1: 10.0}, 1), Kind("small", {1: 2.0, 6: 2.1}, 1)]
    items = [0] + [1] * 6
    res = balance(kinds, items, 4, "milp", memory_factor=None)
    assert res.makespan == 10.0
    assert sum(res.loads) == pytest.approx(12.1)
    assert sorted(sizes for p in res.batches for key, sizes in p.items() if key == "small") == [[6]]
    assert any("phase 2" in n for n in res.notes)


def test_phase_two_after_a_phase_one_search():
    # LPT's makespan (24) is above the lower bound (19.3), so phase 1 searches;
    # of the makespan-24 plans only some batch the second kind well.
    kinds = [Kind("a", {1: 8.0}, 1), Kind("b", {1: 8.0, 2: 15.0, 3: 20.0, 4: 19.0, 5: 26.0, 6: 24.0}, 1)]
    items = [0, 0, 0, 0, 1, 1, 1, 1, 1]
    res = balance(kinds, items, 3, "milp", memory_factor=None)
    assert any("phase 1 (makespan" in n for n in res.notes) and any("phase 2" in n for n in res.notes)
    assert (res.makespan, sum(res.loads)) == _brute_force(kinds, items, 3) == (24.0, 59.0)


def test_fallbacks_to_lpt(monkeypatch):
    kinds = [Kind("a", {1: 4.0, 2: 5.0}, 1), Kind("b", {1: 3.0, 3: 4.0}, 1)]
    items = [0, 1, 0, 1, 1, 0, 0, 1, 1]
    big = balance(kinds, items, 4, "milp", memory_factor=None, max_milp_variables=1)
    assert big.method == "lpt" and any("variables" in n for n in big.notes)

    def boom(*args, **kwargs):
        raise RuntimeError("solver exploded")

    monkeypatch.setattr(milp, "_run", boom)
    failed = balance(kinds, items, 4, "milp", memory_factor=None)
    assert failed.method == "lpt" and any("solver exploded" in n for n in failed.notes)
    assert failed.owners == big.owners


def test_auto_and_names():
    assert {"milp", "lpt", "round_robin", "auto", "greedy"} <= set(BALANCERS)
    costs = [5.0, 4.0, 3.0, 3.0, 2.0, 2.0, 1.0]
    assert assign_owners(costs, 3, "greedy") == assign_owners(costs, 3, "lpt") == lpt(costs, 3)
    kinds = [Kind(c, {1: c}, 0) for c in sorted(set(costs))]
    items = [sorted(set(costs)).index(c) for c in costs]
    small = balance(kinds, items, 3, "auto")
    assert small.method in ("milp", "lpt") and small.status == "optimal"
    forced = balance(kinds, items, 3, "auto", max_milp_variables=2)
    assert forced.method == "lpt" and forced.status == "heuristic"
    for owners in (assign_owners(costs, 3, "milp"), assign_owners(costs, 3, "auto")):
        assert max(balance_mod.rank_loads(costs, owners, 3)) == 7.0  # 20 / 3 rounds up to 7
    with pytest.raises(ValueError, match="balancer"):
        balance(kinds, items, 3, "magic")
    with pytest.raises(ValueError, match="memory_factor"):
        balance(kinds, items, 3, "milp", memory_factor=0.5)
    with pytest.raises(ValueError, match="time_limit_s"):
        balance(kinds, items, 3, "milp", time_limit_s=0)


@pytest.fixture
def without_scipy(monkeypatch):
    """scipy as on an install without the ``milp`` extra: a None entry in sys.modules makes importing it
    raise ImportError."""
    for name in ("scipy", "scipy.optimize", "scipy.sparse"):
        monkeypatch.setitem(sys.modules, name, None)


def test_milp_without_scipy_names_the_extra(without_scipy):
    kinds = [Kind("a", {1: 4.0, 2: 5.0}, 1), Kind("b", {1: 3.0, 3: 4.0}, 1)]
    items = [0, 1, 0, 1, 1, 0, 0, 1, 1]
    # Up front, even where the solver would not be reached (one rank).
    for world_size in (4, 1):
        with pytest.raises(ImportError, match=re.escape("pip install dmuon[milp]")):
            balance(kinds, items, world_size, "milp", memory_factor=None)
    # "auto" picks the best balancer there is: LPT, with a note naming the extra.
    auto = balance(kinds, items, 4, "auto", memory_factor=None)
    assert auto.method == "lpt" and any("dmuon[milp]" in n for n in auto.notes), auto.notes
    # The other balancers never needed scipy.
    assert balance(kinds, items, 4, "greedy").owners == lpt([kinds[k].costs[1] for k in items], 4)


def test_prepare_with_the_milp_balancer_without_scipy_names_the_extra(without_scipy):
    import torch

    import dmuon

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    with pytest.raises(ImportError, match=re.escape("pip install dmuon[milp]")):
        dmuon.prepare(model, balancer="milp")
    assert dmuon.prepare(model, balancer="greedy").infos
