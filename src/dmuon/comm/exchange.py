"""Packed, variable-length collectives between matrix owners and the other ranks.

Everything moves in uneven ``all_to_all_single`` calls, one per bucket and
level, which gloo and NCCL both support. On a (replicate x shard) mesh the
shard level is the fast intra-node network and the replicate level the slow
inter-node one; a 1-D mesh is one replica.

* Reduce-to-owner. Hop 1 (shard level): each rank sends each gradient to the
  rank of its own replica that sits in the owner's shard column, which sums the
  S copies. Hop 2 (replicate level): those partial sums go to the owner, which
  sums the R of them. Only R-1 partial sums of a matrix cross the slow level.
* Gather-from-owner (publish, ZeRO-3 materialization). Hop 1 (replicate
  level): the owner sends its matrices to its shard column, one rank per
  replica. Hop 2 (shard level): every rank forwards what its column holds to
  its replica. Again R-1 copies cross the slow level.

A bucket's members are ordered by the owner's ``(s, r)`` coordinates (see
:class:`dmuon.plan.Bucket`), so every destination's share is one contiguous
slice and packing is a single ``cat``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from dmuon.comm.stats import CommStats
from dmuon.comm.topology import Topology
from dmuon.plan.plan import Bucket, MatrixInfo


@dataclass
class PendingGather:
    """An in-flight gather-from-owners; ``wait()`` returns the flat bucket."""

    work: object
    """The async collective's handle (None when nothing is in flight)."""
    flat: torch.Tensor
    """Receive buffer; after ``wait()`` the members' data in bucket order."""
    members: list[int]
    """The matrix indices, in the order they appear in ``flat`` after ``wait()``."""
    stats: CommStats
    then: Callable[[torch.Tensor], torch.Tensor] | None = field(default=None, repr=False)
    """Second hop to run once the first has landed (HSDP)."""

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            start = time.perf_counter()
            self.work.wait()
            self.stats.wait_seconds += time.perf_counter() - start
            self.work = None
        if self.then is not None:
            self.flat, self.then = self.then(self.flat), None
        return self.flat


@dataclass
class PendingReduce:
    """An in-flight reduce-to-owners; ``wait()`` returns ``{index: averaged grad}`` for owned members."""

    work: object
    """The first hop's handle (None when nothing is in flight)."""
    buffer: torch.Tensor | None
    """What the first hop receives into."""
    finish: Callable[[torch.Tensor], dict[int, torch.Tensor]] = field(repr=False)
    """Sums the copies (and runs the HSDP second hop)."""
    stats: CommStats
    result: dict[int, torch.Tensor] | None = field(default=None, repr=False)
    """What ``wait()`` returned, kept so later calls return it again."""

    def wait(self, exposed: bool = True) -> dict[int, torch.Tensor]:
        """Lands the reduction; ``exposed=False`` when a side thread waits (not counted as blocking)."""
        if self.result is not None:
            return self.result
        if self.work is not None:
            start = time.perf_counter()
            self.work.wait()
            if exposed:
                self.stats.wait_seconds += time.perf_counter() - start
            self.work = None
        self.result = self.finish(self.buffer)
        return self.result


class Exchanger:
    """Runs dmuon's collectives for one plan.

    Args:
        infos: The plan's matrices.
        topology: Mesh shape, this rank's place in it and dmuon's process groups.
        stats: Counters to update.
    """

    def __init__(self, infos: Sequence[MatrixInfo], topology: Topology, stats: CommStats) -> None:
        self.infos = infos
        self.topo = topology
        self.stats = stats

    @property
    def group(self):
        """The group spanning every rank (for small agreement collectives)."""
        return self.topo.world_group

    # ---------------------------------------------------------------- helpers
    def _owner_coords(self, i: int) -> tuple[int, int]:
        return self.topo.coords_of(self.infos[i].owner)

    def _sizes_by(self, members: Sequence[int], key: Callable[[int], int], n: int) -> list[int]:
        sizes = [0] * n
        for i in members:
            sizes[key(i)] += self.infos[i].numel
        return sizes

    def _count(self, level: str, out_splits, in_splits, me: int, elem: int) -> None:
        sent = (sum(in_splits) - in_splits[me]) * elem
        received = (sum(out_splits) - out_splits[me]) * elem
        self.stats.add(level, sent, received)

    def _all_to_all(self, level: str, group, out, inp, out_splits, in_splits, async_op, me, count=True):
        if count:
            self._count(level, out_splits, in_splits, me, inp.element_size())
        start = time.perf_counter()
        work = dist.all_to_all_single(out, inp, out_splits, in_splits, group=group, async_op=async_op)
        if not async_op:
            self.stats.wait_seconds += time.perf_counter() - start
        return work

    # ------------------------------------------------------- reduce to owner
    def reduce_to_owners(
        self,
        bucket: Bucket,
        members: Sequence[int],
        grads: dict[int, torch.Tensor | None],
        async_op: bool = False,
    ):
        """Averages each member's gradient over all ranks, onto its owner only.

        Args:
            bucket: The bucket the members belong to.
            members: Active members (a gradient exists on some rank), in bucket
                order; identical on every rank.
            grads: This rank's local gradient per member; None counts as zero.
                Read (copied into the send buffer) before this returns.
            async_op: Return a :class:`PendingReduce` while the first hop is in flight.

        Returns:
            The averaged gradient of each member this rank owns, shaped like the
            parameter (or a :class:`PendingReduce` whose ``wait()`` returns it).
        """
        pending = self._start_reduce(bucket, members, grads, async_op)
        return pending if async_op else pending.wait()

    def _start_reduce(self, bucket, members, grads, async_op) -> "PendingReduce":
        topo = self.topo
        r, s = topo.coords
        owned = [i for i in members if self.infos[i].owner == topo.rank]
        if topo.world_size == 1:
            return PendingReduce(None, None, lambda _: {i: grads[i] for i in owned}, self.stats)
        chunks = []
        for i in members:
            g = grads.get(i)
            info = self.infos[i]
            chunks.append(
                torch.zeros(info.numel, dtype=bucket.dtype, device=info.param.device)
                if g is None
                else g.reshape(-1).to(bucket.dtype)
            )
        partial = torch.cat(chunks)
        work = None
        if topo.shard > 1:
            in_splits = self._sizes_by(members, lambda i: self._owner_coords(i)[1], topo.shard)
            mine = in_splits[s]
            recv = partial.new_empty(mine * topo.shard)
            work = self._all_to_all("intra", topo.shard_group, recv, partial, [mine] * topo.shard,
                                    in_splits, async_op, s)
            buffer, rows = recv, topo.shard
        else:
            buffer, rows = partial, 1
        column = [i for i in members if self._owner_coords(i)[1] == s]

        def finish(buf: torch.Tensor) -> dict[int, torch.Tensor]:
            # Sum in rank order so every run reduces identically.
            part = buf.view(rows, -1).sum(dim=0)
            if topo.replicate > 1:
                in_splits = self._sizes_by(column, lambda i: self._owner_coords(i)[0], topo.replicate)
                mine = in_splits[r]
                recv = part.new_empty(mine * topo.replicate)
                self._all_to_all("inter", topo.replicate_group, recv, part, [mine] * topo.replicate,
                                 in_splits, False, r)
                part = recv.view(topo.replicate, mine).sum(dim=0)
            total = part.div_(topo.world_size)
            out, pos = {}, 0
            for i in owned:
                info = self.infos[i]
                out[i] = total[pos : pos + info.numel].view(info.shape)
                pos += info.numel
            return out

        return PendingReduce(work if async_op else None, buffer, finish, self.stats)

    # ----------------------------------------------------- gather from owner
    def gather_from_owners(
        self,
        bucket: Bucket,
        members: Sequence[int],
        owned_values: dict[int, torch.Tensor],
        async_op: bool = False,
    ) -> PendingGather:
        """Sends each owned member to every rank and receives the others.

        Args:
            bucket: The bucket the members belong to.
            members: Members to move, in bucket order; identical on every rank.
            owned_values: Current value of each member this rank owns.
            async_op: Return before the data has arrived (the first hop is in
                flight; an HSDP second hop runs in ``wait()``).

        Returns:
            A :class:`PendingGather` whose flat buffer holds every member in order.
        """
        topo = self.topo
        r, s = topo.coords
        device = self.infos[members[0]].param.device
        owned = [i for i in members if self.infos[i].owner == topo.rank]
        mine = (
            torch.cat([owned_values[i].reshape(-1).to(bucket.dtype) for i in owned])
            if owned
            else torch.empty(0, dtype=bucket.dtype, device=device)
        )
        if topo.world_size == 1:
            return PendingGather(None, mine, list(members), self.stats)

        shard_splits = self._sizes_by(members, lambda i: self._owner_coords(i)[1], topo.shard)

        def shard_hop(column: torch.Tensor, async_hop: bool, count: bool = True):
            if topo.shard == 1:
                return None, column
            recv = torch.empty(sum(shard_splits), dtype=bucket.dtype, device=device)
            work = self._all_to_all("intra", topo.shard_group, recv, column.repeat(topo.shard),
                                    shard_splits, [column.numel()] * topo.shard, async_hop, s, count)
            return work, recv

        if topo.replicate == 1:
            work, recv = shard_hop(mine, async_op)
            return PendingGather(work, recv, list(members), self.stats)

        column = [i for i in members if self._owner_coords(i)[1] == s]
        out_splits = self._sizes_by(column, lambda i: self._owner_coords(i)[0], topo.replicate)
        col_buf = torch.empty(sum(out_splits), dtype=bucket.dtype, device=device)
        work = self._all_to_all("inter", topo.replicate_group, col_buf, mine.repeat(topo.replicate),
                                out_splits, [mine.numel()] * topo.replicate, async_op, r)

        # Traffic is booked when an operation is issued, so a publication
        # finished during the next forward still counts for the step that sent it.
        if topo.shard > 1:
            self._count("intra", shard_splits, [shard_splits[s]] * topo.shard, s, col_buf.element_size())

        def second_hop(col: torch.Tensor) -> torch.Tensor:
            hop_work, full = shard_hop(col, False, count=False)
            return full

        pending = PendingGather(work if async_op else None, col_buf, list(members), self.stats, then=second_hop)
        if not async_op:
            pending.wait()
        return pending
