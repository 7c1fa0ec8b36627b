"""Two gloo ranks: one profile (rank 0 measures, everyone gets it) and one identical plan."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn

from dmuon.plan import milp, profile
from dmuon.plan.assign import assign
from dmuon.plan.plan import MatrixInfo
from support.spawn import run_distributed

SHAPES = [(8, 16), (16, 4), (8, 16), (12, 12), (16, 4), (8, 16), (4, 8)]
NS = {"method": "standard", "batching": "batched", "steps": 2}


def _infos():
    return [MatrixInfo(i, f"m{i}", nn.Parameter(torch.zeros(s)), s, 0) for i, s in enumerate(SHAPES)]


def plan_on_ranks(rank: int, world_size: int, cache_root: str) -> dict:
    """Worker: profile through ``assign``, balance with the MILP, and report what happened here."""
    cache = os.path.join(cache_root, f"rank{rank}")
    measured, solves = [], []
    real_measure, real_solve = profile.measure_update, milp.solve

    def measure(*args, **kwargs):
        measured.append(args[:2])
        return real_measure(*args, **kwargs)

    def solve(*args, **kwargs):
        solves.append(1)
        return real_solve(*args, **kwargs)

    profile.measure_update, milp.solve = measure, solve
    try:
        group = dist.group.WORLD
        counts = {}
        for s in SHAPES:
            counts[s] = counts.get(s, 0) + 1
        table = profile.profile_costs(counts, dtype=torch.float32, ns_kwargs=NS, group=group, cache_dir=cache,
                                      device="cpu", repeats=1)
        infos = _infos()
        grouped = assign(infos, world_size, "milp", profile=True, ns_kwargs=NS, group=group, cache_dir=cache,
                         memory_factor=None)
        solves_with_group = len(solves)
        local = assign(_infos(), world_size, "milp", costs=table, memory_factor=None)
    finally:
        profile.measure_update, milp.solve = real_measure, real_solve
    return {
        "entries": sorted(table.entries.items()),
        "measured": len(measured),
        "table_measured": table.measured,
        "cache_files": sorted(os.listdir(cache)) if os.path.isdir(cache) else [],
        "owners": grouped.owners,
        "batches": grouped.batches,
        "costs": [i.cost for i in infos],
        "method": grouped.method,
        "solves_with_group": solves_with_group,
        "local_owners": local.owners,
    }


def test_profile_and_plan_identical_on_two_ranks(tmp_path):
    out = run_distributed(plan_on_ranks, 2, str(tmp_path), timeout_s=120)
    r0, r1 = out
    # One measurement per (shape, batch), on rank 0 only; assign's profile hits rank 0's cache.
    assert r0["measured"] == 3 + 2 + 1 + 1 and r1["measured"] == 0
    assert r0["table_measured"] == r1["table_measured"] == r0["measured"]
    assert r0["cache_files"] and r1["cache_files"] == []
    assert r0["entries"] == r1["entries"]
    # Rank 0 solves and broadcasts.
    assert r0["solves_with_group"] >= 1 or r0["method"] == "lpt"
    assert r1["solves_with_group"] == 0
    assert r0["owners"] == r1["owners"] and r0["batches"] == r1["batches"] and r0["costs"] == r1["costs"]
    # Without a group each rank solves alone; HiGHS (one thread, fixed seed) agrees with itself.
    assert r0["local_owners"] == r1["local_owners"]
    assert sorted(set(r0["owners"])) == [0, 1]
