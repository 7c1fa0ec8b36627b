"""Packed, variable-length collectives between matrix owners and the other ranks.

Both directions use one uneven ``all_to_all_single`` per bucket, which gloo
and NCCL both support:

* reduce-to-owner: every rank sends its local gradient of each matrix to the
  matrix's owner only; the owner sums the copies. Nobody gathers a matrix it
  does not own.
* gather-from-owner (publish / ZeRO-3 materialization): each owner sends the
  matrices it owns to every rank.

A bucket's members are laid out by owner (see :class:`dmuon.plan.Bucket`), so
each rank's share is one contiguous slice and packing is a single ``cat``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from dmuon.comm.stats import CommStats
from dmuon.plan.plan import Bucket, MatrixInfo


@dataclass
class PendingGather:
    """An in-flight gather-from-owners; ``wait()`` returns the flat bucket."""

    work: object
    """The async collective's handle (None when the data is already local)."""
    flat: torch.Tensor
    """Receive buffer: the active members' data in bucket order."""
    members: list[int]
    """The active matrix indices, in the order they appear in ``flat``."""
    stats: CommStats

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            start = time.perf_counter()
            self.work.wait()
            self.stats.wait_seconds += time.perf_counter() - start
            self.work = None
        return self.flat


class Exchanger:
    """Runs dmuon's collectives for one plan on one process group.

    Args:
        infos: The plan's matrices.
        group: Process group (None for a single process).
        rank: This process's rank in ``group``.
        world_size: Size of ``group``.
        stats: Counters to update.
    """

    def __init__(
        self,
        infos: Sequence[MatrixInfo],
        group: dist.ProcessGroup | None,
        rank: int,
        world_size: int,
        stats: CommStats,
    ) -> None:
        self.infos = infos
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.stats = stats

    def _split(self, members: Sequence[int]) -> list[int]:
        sizes = [0] * self.world_size
        for i in members:
            sizes[self.infos[i].owner] += self.infos[i].numel
        return sizes

    def _all_to_all(self, out, inp, out_splits, in_splits, async_op):
        elem = inp.element_size()
        self.stats.bytes_sent += (sum(in_splits) - in_splits[self.rank]) * elem
        self.stats.bytes_received += (sum(out_splits) - out_splits[self.rank]) * elem
        self.stats.collectives += 1
        return dist.all_to_all_single(
            out, inp, out_splits, in_splits, group=self.group, async_op=async_op
        )

    def reduce_to_owners(
        self,
        bucket: Bucket,
        members: Sequence[int],
        grads: dict[int, torch.Tensor | None],
    ) -> dict[int, torch.Tensor]:
        """Averages each member's gradient over ranks, onto its owner only.

        Args:
            bucket: The bucket the members belong to.
            members: Active members (a gradient exists on some rank), in bucket order.
                Must be identical on every rank.
            grads: This rank's local gradient per member; None counts as zero.

        Returns:
            The averaged gradient of each member this rank owns, shaped like the parameter.
        """
        owned = [i for i in members if self.infos[i].owner == self.rank]
        if self.world_size == 1:
            return {i: grads[i] for i in owned}
        chunks = []
        for i in members:
            g = grads.get(i)
            info = self.infos[i]
            chunks.append(
                torch.zeros(info.numel, dtype=bucket.dtype, device=info.param.device)
                if g is None
                else g.reshape(-1).to(bucket.dtype)
            )
        send = torch.cat(chunks)
        in_splits = self._split(members)
        mine = in_splits[self.rank]
        recv = send.new_empty(mine * self.world_size)
        start = time.perf_counter()
        self._all_to_all(recv, send, [mine] * self.world_size, in_splits, async_op=False)
        self.stats.wait_seconds += time.perf_counter() - start
        # Sum in rank order so every run reduces identically.
        total = recv.view(self.world_size, mine).sum(dim=0).div_(self.world_size)
        out, pos = {}, 0
        for i in owned:
            info = self.infos[i]
            out[i] = total[pos : pos + info.numel].view(info.shape)
            pos += info.numel
        return out

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
            async_op: Return before the data has arrived.

        Returns:
            A :class:`PendingGather` whose flat buffer holds every member in order.
        """
        device = self.infos[members[0]].param.device
        owned = [i for i in members if self.infos[i].owner == self.rank]
        mine = (
            torch.cat([owned_values[i].reshape(-1).to(bucket.dtype) for i in owned])
            if owned
            else torch.empty(0, dtype=bucket.dtype, device=device)
        )
        if self.world_size == 1:
            return PendingGather(None, mine, list(members), self.stats)
        out_splits = self._split(members)
        send = mine.repeat(self.world_size)
        recv = torch.empty(sum(out_splits), dtype=bucket.dtype, device=device)
        start = time.perf_counter()
        work = self._all_to_all(recv, send, out_splits, [mine.numel()] * self.world_size, async_op)
        if not async_op:
            self.stats.wait_seconds += time.perf_counter() - start
            work = None
        return PendingGather(work, recv, list(members), self.stats)
