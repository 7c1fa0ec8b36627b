"""dmuon's groups over a part of the world when torch splits every new group from the world's
communicator (a default group bound to a device: ``init_process_group(device_id=...)`` with NCCL).

gloo never splits, so the ranks run under a test double of a splitting default group: it records
which ranks entered a split of which parent (a ``new_group`` counts as a split of the world, as
torch 2.13 makes it then), and hands back a real gloo group for each split so that the groups are
used afterwards.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from dmuon.comm import topology
from dmuon.util import torch_compat

from support.spawn import run_distributed


class _SplittingWorld:
    """Stands for a default group that splits: each entry is ``(parent's ranks, the split this rank
    joined)`` in global ranks, in the order this rank entered them."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world = rank, tuple(range(world_size))
        self.entered: list[tuple[tuple[int, ...], tuple[int, ...] | None]] = []
        self._saved = None

    def install(self):
        self._saved = (torch_compat.new_group_splits_world, dist.new_group, dist.split_group)
        real_new_group = dist.new_group

        def new_group(ranks=None, **kwargs):
            # torch 2.13 splits the world's communicator for every new group, local synchronization or not.
            members = tuple(sorted(ranks)) if ranks is not None else self.world
            self.entered.append((self.world, members if self.rank in members else None))
            return real_new_group(ranks=ranks, **kwargs)

        def split_group(parent_pg=None, split_ranks=None, **kwargs):
            parent = tuple(dist.get_process_group_ranks(parent_pg))
            mine = parent.index(self.rank)
            split = next((sorted(s) for s in split_ranks if mine in s), None)
            members = None if split is None else tuple(parent[k] for k in split)
            self.entered.append((parent, members))
            if members is None:
                return None
            return real_new_group(ranks=list(members), use_local_synchronization=True)

        torch_compat.new_group_splits_world = lambda: True
        dist.new_group, dist.split_group = new_group, split_group

    def remove(self):
        torch_compat.new_group_splits_world, dist.new_group, dist.split_group = self._saved


def _case(rank: int, fake: _SplittingWorld, build) -> dict:
    """``build()`` under the double; what every rank entered, gathered on the (real, gloo) world."""
    fake.entered = []
    fake.install()
    try:
        try:
            out = {"error": None, "result": build()}
        except ValueError as e:
            out = {"error": str(e), "result": None}
    finally:
        fake.remove()
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, fake.entered)
    out["entered"] = everyone
    return out


def _sum_over(group) -> int:
    one = torch.ones(1)
    dist.all_reduce(one, group=group)
    return int(one.item())


def _stages_build(rank: int, world_size: int) -> dict:
    fake = _SplittingWorld(rank, world_size)
    world2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    world3 = init_device_mesh("cpu", (2, 2, 1), mesh_dim_names=("pp", "replicate", "shard"))
    stage = world2.get_local_rank("pp")
    out = {}

    def one_stage_1d():
        # Only the first stage builds dmuon (a model on part of the world; DDP over a subgroup).
        if stage != 0:
            return None
        topo = topology.from_mesh(world2["dp"], replicated=False)
        return {"mesh": _sum_over(topo.mesh_group), "shard_is_mesh": topo.shard_group is topo.mesh_group}

    out["one stage, 1-D"] = _case(rank, fake, one_stage_1d)

    def both_stages_2d():
        # Each stage's (replicate, shard) = (2, 1) ranks, built by both stages at once.
        topo = topology.from_mesh(world3["replicate", "shard"], replicated=True)
        return {"mesh": _sum_over(topo.mesh_group), "replicate": _sum_over(topo.replicate_group),
                "shard": dist.get_world_size(topo.shard_group), "rank": topo.rank}

    out["both stages, 2-D"] = _case(rank, fake, both_stages_2d)

    def no_group_over_the_mesh():
        # A rank that holds no group over exactly its mesh's ranks (a 2-D mesh with both dims over 1 and
        # no flattened dim, which 4 ranks cannot make): every group over its ranks hidden.
        mine = tuple(sorted(world3["replicate", "shard"].mesh.flatten().tolist()))
        real = torch_compat.registered_groups
        torch_compat.registered_groups = lambda: [(g, held) for g, held in real() if held != mine]
        try:
            return topology.from_mesh(world3["replicate", "shard"], replicated=True).rank
        finally:
            torch_compat.registered_groups = real

    out["no group over the mesh"] = _case(rank, fake, no_group_over_the_mesh)
    return out


def _violations(entered: list[list]) -> list[str]:
    """Breaches of ncclCommSplit's rule: every rank of a parent enters each of its splits, in the
    same order, and the k-th split a rank joined is the k-th split of each of its members."""
    found = []
    parents = {parent for seq in entered for parent, _ in seq}
    for parent in sorted(parents):
        seqs = {m: [split for p, split in entered[m] if p == parent] for m in parent}
        counts = {m: len(seq) for m, seq in seqs.items()}
        if len(set(counts.values())) != 1:
            found.append(f"splits of {parent} entered per rank: {counts}")
            continue
        for m, seq in seqs.items():
            for k, split in enumerate(seq):
                if split is not None and (m not in split or any(seqs[o][k] != split for o in split)):
                    found.append(f"split {k} of {parent}: rank {m} joined {split}, its members "
                                 f"{[seqs[o][k] for o in split]}")
    return found


def test_a_part_of_the_world_splits_only_among_its_ranks():
    """CUDA/NCCL rule: with a default group bound to a device, torch 2.13 makes each new group by
    ncclCommSplit of the world's communicator, a collective every rank of the parent must enter
    (members with their colour, the others with none) in the same order; a rank that never enters
    leaves the members waiting in prepare(). dmuon's groups over a part of the world are split from
    a group over exactly the part's ranks, and where there is none every rank of the part raises."""
    per_rank = run_distributed(_stages_build, 4)
    first = per_rank[0]
    for name, case in first.items():
        assert _violations(case["entered"]) == [], name
    # A new_group of the world would have shown up as a split of the world's ranks.
    for name, case in first.items():
        assert all(parent != (0, 1, 2, 3) for seq in case["entered"] for parent, _ in seq), name

    one_d = [r["one stage, 1-D"] for r in per_rank]
    assert [c["result"] for c in one_d] == [{"mesh": 2, "shard_is_mesh": True}] * 2 + [None] * 2
    assert one_d[0]["entered"] == [[((0, 1), (0, 1))]] * 2 + [[], []]

    two_d = [r["both stages, 2-D"] for r in per_rank]
    assert [c["result"] for c in two_d] == [{"mesh": 2, "replicate": 2, "shard": 1, "rank": k} for k in (0, 1)] * 2
    # The mesh group from the stage's group, then the rows and the column from the mesh group.
    for stage in ((0, 1), (2, 3)):
        for k, me in enumerate(stage):
            assert two_d[0]["entered"][me] == [(stage, stage), (stage, (me,)), (stage, stage)]

    refused = [r["no group over the mesh"] for r in per_rank]
    assert all(c["error"] and "flatten" in c["error"] for c in refused)
    assert refused[0]["entered"] == [[], [], [], []]
