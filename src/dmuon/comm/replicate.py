"""The replicate level's gradient reductions, when dmuon (not FSDP2) reduces across replicas.

With ``hsdp_mesh`` the model is ``fully_shard``-ed over the shard sub-mesh, so
FSDP2 reduces each gradient inside a replica only (a mean over its S ranks)
and dmuon reduces across the R replicas, on each shard column's replicate
group (the R ranks ``(r, s)`` holding the same shards):

* **Other parameters** (AdamW's): one ``all_reduce`` (sum) per block of their
  local shards, flattened, then divided by R: what FSDP2's native HSDP does.
* **Muon matrices**: only as far as the owner needs. Rank ``(r, s)`` keeps the
  momentum of piece ``s``'s column slice ``r`` (``MatrixInfo.replica_columns``),
  so one uneven ``all_to_all`` per block sends every other replica ``q`` its
  slice ``q`` of the piece, and each rank sums the R slices it receives: a
  reduce-scatter by column slices, ``(R-1)/R`` of the gradient each way instead
  of the all-reduce's ``2 (R-1)/R``. The result is the *sum* over replicas of
  the replica means (the caller divides by R).

Both send copies (the gradients may change while the collective is in flight)
and count their bytes on the ``"inter"`` level; an all-reduce is counted as a
ring moves it (``2 (R-1)/R`` of the buffer each way, as the step model prices
FSDP2's), an all-to-all exactly.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from dmuon.comm.coalesce import GroupAllToAll
from dmuon.comm.device_streams import active
from dmuon.comm.pending import Pending, no_result
from dmuon.comm.stats import CommStats
from dmuon.comm.topology import Topology
from dmuon.plan.plan import MatrixInfo
from dmuon.util.observe import ranged


class ReplicateReduce:
    """Issues the replicate level's reductions for one plan (see the module docstring).

    Args:
        infos: The plan's matrices.
        topology: The mesh's levels and dmuon's process groups (``replicate > 1``).
        stats: Counters to update.
        device: Device of the buffers.
        across: The all-to-alls on this position's replicate group (the exchange's
            :attr:`~dmuon.comm.ShardExchange.across`, so that hop A can join the column
            reduce-scatter in one collective).
    """

    def __init__(self, infos: Sequence[MatrixInfo], topology: Topology, stats: CommStats,
                 device: torch.device, across: GroupAllToAll) -> None:
        self.infos = infos
        self.topo = topology
        self.stats = stats
        self.device = device
        self.across = across

    @ranged("replicate.all_reduce")
    def all_reduce_mean(self, tensors: Sequence[torch.Tensor]) -> Pending:
        """The mean over the replicas of each tensor (this rank's local shards, any dtype).

        Returns:
            A :class:`Pending` whose ``wait()`` gives ``{k: mean of tensors[k]}`` (float32
            where the input was a lower precision, else its dtype; shaped as the input).
        """
        if not tensors:
            return Pending([], no_result, self.stats)
        dtype = torch.promote_types(tensors[0].dtype, torch.float32)
        flat = torch.cat([t.reshape(-1).to(dtype) for t in tensors])
        replicate = self.topo.replicate
        moved = 2 * (replicate - 1) * flat.numel() * flat.element_size() // replicate
        self.stats.add("inter", moved, moved)
        work = active().issue(
            lambda: dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.topo.replicate_group, async_op=True),
            reads=(flat,), writes=(flat,))

        def finish() -> dict[int, torch.Tensor]:
            flat.div_(replicate)
            return {k: part.view(t.shape) for k, (t, part) in
                    enumerate(zip(tensors, flat.split([t.numel() for t in tensors])))}

        return Pending([work], finish, self.stats)

    def _slice_numel(self, i: int, q: int, s: int) -> int:
        """Elements of piece ``s``'s column slice ``q`` of matrix ``i`` (every holder's, copies too)."""
        info = self.infos[i]
        return info.pieces[s].rows * info.replica_columns(s)[q] * info.inner

    @ranged("replicate.reduce_columns")
    def reduce_columns(self, members: Sequence[int], pieces: dict[int, torch.Tensor]) -> Pending:
        """Each member's column slice ``r`` summed over the replicas, on rank ``(r, s)``.

        Args:
            members: Matrix indices, identical and in the same order on every rank of the
                replicate group.
            pieces: This rank's piece of each member's gradient, ``(rows, cols, *shape[2:])``
                (``MatrixInfo.local_view``), the same shards on every replica.

        Returns:
            A :class:`Pending` whose ``wait()`` gives ``{i: (rows, own columns, *shape[2:])}``,
            the sum over the replicas (float32 or wider), for the members this position holds
            rows of.
        """
        topo, infos = self.topo, self.infos
        r, s = topo.position
        held = [i for i in members if infos[i].pieces[s].rows]
        if not held:
            return Pending([], no_result, self.stats)  # the whole replicate group of this column skips
        dtype = torch.promote_types(pieces[held[0]].dtype, torch.float32)
        in_splits = [sum(self._slice_numel(i, q, s) for i in held) for q in range(topo.replicate)]
        own = sum(self._slice_numel(i, r, s) for i in held)
        out_splits = [own] * topo.replicate
        # Each column slice is strided in the gradient: copied once, straight into the send buffer.
        send = torch.empty(sum(in_splits), dtype=dtype, device=self.device)
        offset = 0
        for q in range(topo.replicate):
            for i in held:
                info = infos[i]
                start, width = info.column_start(q, s), info.replica_columns(s)[q]
                part = pieces[i].narrow(1, start, width)
                send[offset:offset + part.numel()].view(part.shape).copy_(part)
                offset += part.numel()
        recv = torch.empty(sum(out_splits), dtype=dtype, device=self.device)
        elem = send.element_size()
        works = self.across(recv, send, out_splits, in_splits, (sum(in_splits) - in_splits[r]) * elem,
                            (topo.replicate - 1) * own * elem)

        def finish() -> dict[int, torch.Tensor]:
            total = None
            for segment in recv.split(out_splits):
                total = segment.clone() if total is None else total.add_(segment)
            sizes = [self._slice_numel(i, r, s) for i in held]
            out = {}
            for i, part in zip(held, total.split(sizes)):
                info = infos[i]
                out[i] = part.view(info.pieces[s].rows, info.replica_columns(s)[r], *info.shape[2:])
            return out

        return Pending(works, finish, self.stats)
