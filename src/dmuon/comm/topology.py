"""Where this rank sits in a (replicate x shard) view of the mesh, and the groups dmuon talks on."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from dmuon.comm.warm_peers import warm_splits
from dmuon.plan.layout import position
from dmuon.util import torch_compat
from dmuon.util.torch_compat import process_group_count


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
    mesh_group: object = None
    """Every rank of dmuon's mesh (R*S ranks: the data-parallel group, the world or a part of it, such
    as one pipeline stage's); None in a single process."""
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
    def position(self) -> tuple[int, int]:
        """This rank's ``(replica, shard position)`` (:func:`~dmuon.plan.layout.position`)."""
        return position(self.rank, self.shard)

    def position_of(self, plan_rank: int) -> tuple[int, int]:
        """``(r, s)`` of a plan rank."""
        return position(plan_rank, self.shard)


    def warm_up(self, device, pairs: dict | None = None) -> dict[str, int]:
        """One small collective on each of :attr:`groups`, in their order, before the first backward.

        NCCL creates a group's communicator at the group's first collective, and a peer connection
        (its buffers, outside torch's caching allocator) at the first send to or receive from that
        peer: without this both happen inside the first backward's hooks, with their latency in the
        hot path. Each group gets what dmuon issues on it:

        * a group of dmuon's exchanges (the shard group, and the replicate group on HSDP): one
          all-to-all with one element to each peer of ``pairs`` (:mod:`dmuon.comm.warm_peers`: the
          plan's exchanges and returns), none to the others;
        * a group that carries no all-to-all (dmuon's mesh group on HSDP: the agreement and the
          setup checks, all-reduces and all-gathers; or an exchange group whose pairs are empty):
          a one-element all-reduce, which creates the communicator without an all-to-all's
          all-pairs connections.

        torch (with NCCL 2.14 and later) calls ``ncclSend``/``ncclRecv`` for every peer of an
        all-to-all, zero counts included, and NCCL connects a peer at any send or receive, so an
        exchange group's all-to-all still connects every pair of it: the split sizes keep only what
        the plan sends, the saving is the mesh group's (every rank of the mesh, on HSDP).

        Every rank walks the groups in the one order they were created in and enters each it belongs
        to, so no two ranks wait for each other in opposite orders.

        Args:
            device: Where the collectives run.
            pairs: :func:`dmuon.comm.warm_peers.exchange_pairs` of the plan; None: every pair of the
                exchange groups (a runtime whose peers change from step to step).

        Returns:
            The number of groups warmed by each op, ``{"all_to_all": n, "all_reduce": m}``
            (one-member groups are skipped: dmuon issues nothing on them, its hops are local there).
        """
        warmed = {"all_to_all": 0, "all_reduce": 0}
        r, s = self.position
        for group in self.groups:
            size = dist.get_world_size(group)
            if size == 1:
                continue
            if group is self.shard_group:
                key, me = ("intra", r), s
            elif group is self.replicate_group:
                key, me = ("inter", s), r
            else:
                key, me = None, None
            if key is not None and pairs is None:
                every = frozenset((a, b) for a in range(size) for b in range(size) if a != b)
                ours = every
            else:
                ours = pairs.get(key, frozenset()) if key is not None else frozenset()
            if not ours:
                # No all-to-all on this group (every member knows it alike): the communicator only.
                dist.all_reduce(torch.zeros(1, device=device), group=group)
                warmed["all_reduce"] += 1
                continue
            send, receive = warm_splits(ours, size, me)
            received = torch.empty(sum(receive), device=device)
            dist.all_to_all_single(received, torch.zeros(sum(send), device=device), receive, send, group=group)
            warmed["all_to_all"] += 1
        return warmed


def single_process() -> Topology:
    return Topology(1, 1, 0)


def from_mesh(mesh, replicated: bool, device: torch.device | None = None) -> Topology:
    """Builds dedicated process groups for dmuon's traffic on a DeviceMesh of any dimension.

    The mesh's dims flatten into two levels: with ``replicated`` (HSDP) its dim 0
    is the replicate level R and the other dims (FSDP2's shard dim, a tensor-
    parallel dim) together the shard level S; otherwise R = 1. Plan ranks are
    the row-major positions in the mesh.

    The mesh may be any set of ranks (one pipeline stage's data-parallel group, one of two models
    trained side by side): only the mesh's ranks call this, each in the same order with respect to
    the other process groups it creates (``prepare`` guarantees it). Over the whole world, groups
    are created as ``new_group`` always has (every rank calls it). Over a part of it, exactly the
    mesh's ranks take part, in one of two ways:

    * torch builds a group's communicator on its own (the default group is not bound to a device,
      or its backend cannot split): ``new_group`` with ``use_local_synchronization``, so that other
      parts may create theirs at the same time. torch names such a group by its ranks and the count
      of groups this rank already has, so the mesh's ranks first check over the mesh's own groups
      that their counts agree: otherwise they would wait in the group's rendezvous for each other
      under different names (a hang), and they raise instead.
    * torch splits every new group from the default group's communicator (``init_process_group(
      device_id=...)`` with NCCL: ``ncclCommSplit``, which every rank of the parent must enter): a
      ``new_group`` here would wait for the ranks outside the mesh, which never call it. The groups
      are split instead (``split_group``) from a group over exactly the mesh's ranks, which every
      member enters: a 1-D mesh's own group, or for a mesh of several dims one the user made over
      its ranks (a flattened dim); the rows and columns are then split from dmuon's mesh group.
      Without such a group this raises on every rank of the mesh.

    ``device``: where the check's collective runs (the parameters' device; None: the mesh's device
    type, the current CUDA device for ``"cuda"``).
    """
    replicate = mesh.size(0) if replicated else 1
    grid = mesh.mesh.reshape(replicate, -1)
    shard = grid.shape[1]
    ranks = grid.flatten().tolist()
    if dist.get_rank() not in ranks:
        raise ValueError(f"rank {dist.get_rank()} is not in the parameters' mesh {ranks}: build dmuon only on "
                         "the ranks that hold the model (part) it steps")
    r, s = position(ranks.index(dist.get_rank()), shard)
    rows = [grid[row].tolist() for row in range(replicate)]
    cols = [grid[:, col].tolist() for col in range(shard)]
    everywhere = len(ranks) == dist.get_world_size()
    if not everywhere:
        _check_same_group_count(mesh, ranks, device)
    # A separate set of groups keeps dmuon's collectives apart from FSDP2's.
    if everywhere:
        mesh_group, shard_group, replicate_group = _world_groups(ranks, rows, cols, r, s)
    elif torch_compat.new_group_splits_world():
        mesh_group, shard_group, replicate_group = _split_groups(ranks, rows, cols)
    else:
        mesh_group, shard_group, replicate_group = _local_groups(ranks, rows, cols, r, s)
    # Creation order (the mesh, then the rows, then the columns), the same on every rank.
    mine = [mesh_group] + [g for g in (shard_group, replicate_group) if g is not None and g is not mesh_group]
    return Topology(replicate, shard, r * shard + s, shard_group, replicate_group, mesh_group, tuple(ranks),
                    tuple(mine))


def _world_groups(ranks: list[int], rows: list[list[int]], cols: list[list[int]], r: int, s: int):
    """Over the whole world every rank creates every group (``new_group``'s contract)."""
    mesh_group = dist.new_group(ranks=ranks)
    shard_group = mesh_group if len(rows) == 1 else [dist.new_group(ranks=row) for row in rows][r]
    replicate_group = [dist.new_group(ranks=col) for col in cols][s] if len(rows) > 1 else None
    return mesh_group, shard_group, replicate_group


def _local_groups(ranks: list[int], rows: list[list[int]], cols: list[list[int]], r: int, s: int):
    """Over a part of the world, when torch builds each communicator on its own: each rank creates
    only the groups it belongs to (``use_local_synchronization``)."""
    def group(members: list[int]):
        return dist.new_group(ranks=members, use_local_synchronization=True)

    mesh_group = group(ranks)
    shard_group = mesh_group if len(rows) == 1 else group(rows[r])
    replicate_group = group(cols[s]) if len(rows) > 1 else None
    return mesh_group, shard_group, replicate_group


def _split_groups(ranks: list[int], rows: list[list[int]], cols: list[list[int]]):
    """Over a part of the world, when torch splits new groups from the world's communicator: each
    group split from one every member of which enters the split (the NCCL rule of ``ncclCommSplit``)
    and no other rank. ``split_group`` takes the members' ranks in the parent group and sorts them:
    dmuon's mesh group, like ``new_group``'s, then lists the ranks in ascending order."""
    members = tuple(sorted(ranks))
    parent = next((g for g, held in torch_compat.registered_groups()
                   if held == members and g is not _default_group()), None)
    if parent is None:
        raise ValueError(
            f"dmuon's mesh {ranks} is part of the world, and torch makes every new group by splitting the "
            "default group's communicator (init_process_group(device_id=...)), a split the ranks outside the "
            "mesh would have to enter; dmuon splits its groups from a process group over exactly the mesh's "
            "ranks instead, and this rank has none: create one on every rank before building dmuon (flatten "
            "the mesh's dims, e.g. world_mesh['replicate', 'shard']._flatten('dp'), or dist.new_group(ranks) "
            "for each such set of ranks)")
    mesh_group = dist.split_group(parent_pg=parent, split_ranks=[list(range(len(members)))])

    def local(sets: list[list[int]]) -> list[list[int]]:
        return [[dist.get_group_rank(mesh_group, g) for g in members_] for members_ in sets]

    # Every rank of the mesh enters each split once, with every row (every column): each gets its own.
    shard_group = mesh_group if len(rows) == 1 else dist.split_group(parent_pg=mesh_group, split_ranks=local(rows))
    replicate_group = dist.split_group(parent_pg=mesh_group, split_ranks=local(cols)) if len(rows) > 1 else None
    return mesh_group, shard_group, replicate_group


def _default_group():
    return dist.group.WORLD


def _check_same_group_count(mesh, ranks: list[int], device: torch.device | None) -> None:
    """Raises on every rank of ``mesh`` when they hold different numbers of process groups (see
    :func:`from_mesh`).

    Two all-reduces (the least and the most) per mesh dim, on the groups the mesh already has
    (FSDP2's; once, at setup): reduced along each dim in turn, they cover the whole mesh.
    """
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" \
            else torch.device(mesh.device_type)
    # torch's hashed group names count every group this rank knows of, its own included.
    count = process_group_count()
    low = torch.tensor([count], dtype=torch.int64, device=device)
    high = low.clone()
    for dim in range(mesh.ndim):
        dist.all_reduce(low, op=dist.ReduceOp.MIN, group=mesh.get_group(dim))
        dist.all_reduce(high, op=dist.ReduceOp.MAX, group=mesh.get_group(dim))
    low, high = int(low.item()), int(high.item())
    if low != high:
        raise ValueError(
            f"the ranks of dmuon's mesh {ranks} hold different numbers of process groups ({low} to "
            f"{high}; this rank {count}), so they cannot create dmuon's groups together: create the same "
            "process groups (new_group, DeviceMesh) on every rank of a data-parallel group before building dmuon")
