"""Each return wave's updates from their owners to every rank of torch's ``DistributedDataParallel`` group.

Every rank holds every matrix whole, so each owner's updates go to all of them, in the wire dtype, by
:func:`~dmuon.plan.ddp.ddp_hops`' route (decided from the plan alike on every rank): one
all-gather, each owner's share padded to the largest; or the scatter route, an all-to-all that evens the
updates out over the ranks (:func:`~dmuon.plan.ddp.scatter_parts`), then an all-gather of the even
chunks. The updates lie end to end in the group's rank order, each owner's members in plan order.

A wave is one :class:`~dmuon.comm.pending.Pending`, hop by hop as every exchange of :mod:`dmuon.comm`:
the first hop issued at once from the current stream (the send buffer written there first, so the
communicator's stream waits for it: :meth:`~dmuon.comm.streams.Streams.issue`), the scatter route's
all-gather by :meth:`Pending.forward` once the stream has waited for the all-to-all, and ``wait()``
lands the wave on the calling stream, each flight holding its buffers until then. One rank without
loopback hands the updates over locally.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from dmuon.comm.device_streams import active
from dmuon.comm.pending import Pending, no_result
from dmuon.comm.stats import CommStats
from dmuon.comm.topology import Topology
from dmuon.plan.plan import MatrixInfo
from dmuon.plan.ddp import owner_shares, ddp_hops, scatter_parts
from dmuon.util.torch_compat import all_gather_into_tensor


class DdpReturns:
    """Issues each wave's updates to every rank of DDP's group.

    Args:
        infos: The plan's matrices (their owners and sizes).
        topology: The runtime's topology (DDP's group as a 1-D mesh; ``loopback`` included).
        stats: Where each hop's bytes are counted (level ``"intra"``).
        wire_dtype: The updates' dtype on the wire (``NSConfig.dtype``).
        device: Where the buffers live.
    """

    def __init__(self, infos: Sequence[MatrixInfo], topology: Topology, stats: CommStats, wire_dtype: torch.dtype,
                 device: torch.device) -> None:
        self.infos, self.topo, self.stats = infos, topology, stats
        self.wire_dtype, self.device = wire_dtype, device
        # The all-gather orders its outputs by the group's ranks (the global ranks, ascending); plan
        # ranks follow DDP's group: each plan rank's slot in the gathered buffer.
        ranks = list(topology.global_ranks) or [0]
        self.slot = [sorted(ranks).index(g) for g in ranks]

    def return_updates(self, members: list[int], owned: dict[int, torch.Tensor],
                       rows: dict[int, torch.Tensor] | None = None) -> Pending:
        """Issues the first hop of one wave: ``members``' updates, ``owned`` those this rank owns (each of
        its members' whole update). Lands as every member's whole update (views of the landed buffer, in
        ``members``' order); ``rows``: this rank's new row states, handed back as they are by
        :meth:`Pending.row_states` (the owner is the only holder of a row state)."""
        infos, topo = self.infos, self.topo
        n, me = topo.world_size, topo.rank
        by_rank = owner_shares([info.numel for info in infos], [info.owner for info in infos], n, members)
        shares = [0] * n  # by slot: the group's rank order
        for r in range(n):
            shares[self.slot[r]] = by_rank[r]
        mine = torch.empty(by_rank[me], dtype=self.wire_dtype, device=self.device)
        offset = 0
        for i in members:
            if infos[i].owner == me:
                numel = infos[i].numel
                mine[offset : offset + numel].copy_(owned[i].reshape(-1))
                offset += numel
        if n == 1 and not topo.loopback:
            return Pending([], lambda: self._unpack(members, {me: mine}), self.stats, rows=rows)
        route, hops = ddp_hops(shares, mine.element_size())
        if route == "all_gather":
            chunk = max(shares)
            send = torch.zeros(chunk, dtype=mine.dtype, device=self.device)
            send[: mine.numel()].copy_(mine)
            return self._all_gather(members, send, chunk, shares, hops[-1], rows, padded=True)
        parts, chunk = scatter_parts(shares)
        at = self.slot[me]
        received = torch.empty(sum(parts[a][at] for a in range(n)), dtype=mine.dtype, device=self.device)
        mine_in, mine_out = parts[at], [parts[a][at] for a in range(n)]
        group = topo.mesh_group
        flight = self._issue(lambda: dist.all_to_all_single(received, mine, mine_out, mine_in, group=group,
                                                            async_op=True), (mine,), (received,), hops[0])

        def even_chunks() -> Pending:
            send = torch.zeros(chunk, dtype=mine.dtype, device=self.device)
            send[: received.numel()].copy_(received)
            return self._all_gather(members, send, chunk, shares, hops[-1], rows, padded=False)

        return Pending([flight], no_result, self.stats, then=even_chunks)

    def _issue(self, collective, reads, writes, hop: list[tuple[int, int]]):
        flight = active().issue(collective, reads, writes)
        self.stats.add("intra", *hop[self.slot[self.topo.rank]])
        return flight

    def _all_gather(self, members: list[int], send: torch.Tensor, chunk: int, shares: list[int],
                    hop: list[tuple[int, int]], rows: dict[int, torch.Tensor] | None, padded: bool) -> Pending:
        """The last hop: every rank's ``chunk`` gathered; lands as the members' updates, each owner's share
        at its slot's chunk (``padded``: the all-gather route) or end to end (the scatter route)."""
        n = self.topo.world_size
        gathered = torch.empty(n * chunk, dtype=send.dtype, device=self.device)
        group = self.topo.mesh_group
        flight = self._issue(lambda: all_gather_into_tensor(gathered, send, group=group, async_op=True),
                             (send,), (gathered,), hop)

        def landed() -> dict[int, torch.Tensor]:
            ends = [sum(shares[: k + 1]) for k in range(n)]
            segments = {}
            for r in range(n):
                k = self.slot[r]
                start = k * chunk if padded else ends[k] - shares[k]
                segments[r] = gathered[start : start + shares[k]]
            return self._unpack(members, segments)

        return Pending([flight], landed, self.stats, rows=rows)

    def _unpack(self, members: list[int], segments: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """Each member's whole update from the landed wave: its owner's segment, the owner's members in plan
        order (views: a view is a read, taken only once the wave landed)."""
        offsets = dict.fromkeys(segments, 0)
        out = {}
        for i in members:
            info = self.infos[i]
            start = offsets[info.owner]
            out[i] = segments[info.owner][start : start + info.numel].view(info.matrix_shape)
            offsets[info.owner] += info.numel
        return out
