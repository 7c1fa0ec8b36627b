"""Where this rank sits in a (replicate x shard) view of the mesh, and the groups dmuon talks on."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Topology:
    """A two-level view of the ranks: ``replicate`` (slow, inter-node) x ``shard`` (fast, intra-node).

    Plan ranks are flat indices ``r * shard + s`` of mesh coordinates ``(r, s)``.
    A 1-D mesh is the special case ``replicate == 1``.
    """

    replicate: int
    """R: number of replicas (size of the slow level)."""
    shard: int
    """S: ranks per replica (size of the fast level)."""
    rank: int
    """This process's flat plan rank ``r * S + s``."""
    shard_group: object = None
    """Process group of this rank's replica (S ranks, ordered by ``s``); None when S == 1."""
    replicate_group: object = None
    """Process group of this rank's shard position across replicas (R ranks, ordered by ``r``); None when R == 1."""
    world_group: object = None
    """All R*S ranks; None in a single process."""
    global_ranks: tuple[int, ...] = ()
    """The default group's rank of each plan rank (empty in a single process)."""
    groups: tuple = ()
    """The groups above that this rank belongs to, each once, in the order every rank created them."""
    loopback: bool = False
    """Issue the exchanges, the returns and the agreement on one-member groups too (an all-to-all or
    all-reduce of this rank with itself) instead of handing the tensors over locally
    (``ExecutionConfig.loopback_collectives``): one device then runs the collective paths, their
    buffers and stream waits, that otherwise run only with several ranks."""

    @property
    def local(self) -> bool:
        """Whether this rank's one-member shard level hands the tensors over without a collective."""
        return self.shard == 1 and not self.loopback

    @property
    def world_size(self) -> int:
        return self.replicate * self.shard

    @property
    def coords(self) -> tuple[int, int]:
        return divmod(self.rank, self.shard)

    def coords_of(self, plan_rank: int) -> tuple[int, int]:
        """``(r, s)`` of a plan rank."""
        return divmod(plan_rank, self.shard)


    def warm_up(self, device) -> int:
        """One small all-to-all on each of :attr:`groups`, in their order, before any step.

        NCCL creates a group's communicator, and the connections of an all-to-all to each peer,
        at the group's first collective: without this that is the first all-to-all inside the
        first backward's hooks, with its latency and memory in the hot path. An all-to-all (one
        element per member) sets up what dmuon's exchanges use; the all-reduces share the
        communicator. Every rank walks the groups in the one order they were created in and
        blocks on each it belongs to, so no two ranks wait for each other in opposite orders.

        Returns:
            The number of groups warmed (one-member groups are skipped).
        """
        warmed = 0
        for group in self.groups:
            size = dist.get_world_size(group)
            if size == 1:
                continue  # dmuon issues nothing on a one-member level (its hops are local there)
            received = torch.empty(size, device=device)
            dist.all_to_all_single(received, torch.zeros(size, device=device), group=group)
            warmed += 1
        return warmed


def single_process() -> Topology:
    return Topology(1, 1, 0)


def from_mesh(mesh, replicated: bool) -> Topology:
    """Builds dedicated process groups for dmuon's traffic on a DeviceMesh of any dimension.

    The mesh's dims flatten into two levels: with ``replicated`` (HSDP) its dim 0
    is the replicate level R and the other dims (FSDP2's shard dim, a tensor-
    parallel dim) together the shard level S; otherwise R = 1. Plan ranks are
    the row-major positions in the mesh.

    Every rank of the default group must call this (``new_group`` is collective
    over the world), in the same order, which ``prepare`` guarantees.
    """
    replicate = mesh.size(0) if replicated else 1
    grid = mesh.mesh.reshape(replicate, -1)
    shard = grid.shape[1]
    ranks = grid.flatten().tolist()
    assert dist.get_rank() in ranks, "this rank is not part of the mesh"
    r, s = divmod(ranks.index(dist.get_rank()), shard)
    # A separate set of groups keeps dmuon's collectives apart from FSDP2's.
    world_group = dist.new_group(ranks=ranks)
    shard_group = replicate_group = None
    for row in range(replicate):
        g = world_group if replicate == 1 else dist.new_group(ranks=grid[row].tolist())
        if row == r:
            shard_group = g
    if replicate > 1:
        for col in range(shard):
            g = dist.new_group(ranks=grid[:, col].tolist())
            if col == s:
                replicate_group = g
    # Creation order (world, then the rows, then the columns), the same on every rank.
    mine = [world_group] + [g for g in (shard_group, replicate_group) if g is not None and g is not world_group]
    return Topology(replicate, shard, r * shard + s, shard_group, replicate_group, world_group, tuple(ranks),
                    tuple(mine))
