"""The wire and the sizes both directions of dmuon's exchange share (see :mod:`dmuon.comm.exchange`)."""

from __future__ import annotations

from typing import Sequence

import torch

from dmuon.comm.coalesce import GroupAllToAll
from dmuon.comm.stats import CommStats
from dmuon.comm.topology import Topology
from dmuon.plan.plan import MatrixInfo


class ExchangeCore:
    """What both directions of dmuon's exchange share: the plan's sizes per shard position, the
    wire encoding of row state and flags, and the all-to-alls (counted) on each level.

    :class:`dmuon.comm.directions.DirectionSender` (the way to the owners) and
    :class:`dmuon.comm.returns.UpdateReturns` (the way back) each hold the same core;
    :class:`dmuon.comm.exchange.ShardExchange` holds the three.

    Args:
        infos: The plan's matrices (owners and row splits set).
        topology: Mesh shape, this rank's place in it and dmuon's process groups.
        stats: Counters to update.
        wire_dtype: Dtype of everything sent (NS's input and output dtype).
        device: Device of the buffers.
        row_width: float32 values of row state per matrix row that travel with the
            matrices (see :mod:`dmuon.comm.exchange`); 0: none.
    """

    def __init__(self, infos: Sequence[MatrixInfo], topology: Topology, stats: CommStats,
                 wire_dtype: torch.dtype, device: torch.device, row_width: int = 0) -> None:
        self.infos = infos
        self.topo = topology
        self.stats = stats
        self.wire_dtype = wire_dtype
        self.device = device
        self.within = GroupAllToAll(topology.shard_group, topology.shard, "intra", stats)
        """All-to-alls inside this rank's replica (the shard group)."""
        self.across = GroupAllToAll(topology.replicate_group, topology.replicate, "inter", stats)
        """All-to-alls across replicas (this shard position's replicate group); the replicate
        level's reductions share it, so that :meth:`GroupAllToAll.coalesced` can join theirs with hop A."""
        self.row_width = row_width
        self.row_elems = row_width * row_state_ratio(wire_dtype)
        """Wire elements per matrix row of the row state."""

    # ----------------------------------------------------------------- sizes
    def owner(self, i: int) -> tuple[int, int]:
        """The ``(replica, shard position)`` of matrix ``i``'s owner."""
        return self.topo.position_of(self.infos[i].owner)

    def piece(self, i: int, s: int) -> int:
        """Elements of matrix ``i`` on shard position ``s`` (what comes back there)."""
        return self.infos[i].piece_numel(s)

    def sent(self, i: int, s: int) -> int:
        """Elements of matrix ``i`` shard position ``s`` sends to the owner (none from a copy)."""
        return self.infos[i].sent_numel(s)

    def row_sent(self, i: int, s: int) -> int:
        """Wire elements of row state position ``s`` sends with its piece: its rows' state when it
        sends its piece and the piece starts at column 0 (each row's state once)."""
        p = self.infos[i].pieces[s]
        return p.rows * self.row_elems if p.sends and p.col == 0 else 0

    def row_back(self, i: int, s: int) -> int:
        """Wire elements of row state that come back to position ``s``: every row it holds."""
        return self.infos[i].pieces[s].rows * self.row_elems

    # --------------------------------------------------------------- buffers
    def cat(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """The parts joined into one send buffer (an empty one without parts)."""
        return torch.cat(parts) if parts else torch.empty(0, dtype=self.wire_dtype, device=self.device)

    def empty(self, numel: int) -> torch.Tensor:
        """A receive buffer of ``numel`` wire elements."""
        return torch.empty(numel, dtype=self.wire_dtype, device=self.device)

    # ------------------------------------------------------------- row state
    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        """float32 row state as wire elements, bit for bit (flat)."""
        rows = rows.to(device=self.device, dtype=torch.float32).contiguous().reshape(-1)
        if self.wire_dtype.itemsize >= 4:
            return rows.to(self.wire_dtype)  # float32 and wider hold every float32 exactly
        return rows.view(self.wire_dtype)

    def decode(self, flat: torch.Tensor, rows: int) -> torch.Tensor:
        """The ``(rows, row_width)`` float32 row state from its wire elements."""
        if self.wire_dtype.itemsize >= 4:
            return flat.to(torch.float32).view(rows, self.row_width)
        # A slice of a receive buffer may start at an odd element: copy before reinterpreting.
        return flat.clone().view(torch.float32).view(rows, self.row_width)

    # ----------------------------------------------------------------- flags
    def flag_elems(self, flags: torch.Tensor | None) -> int:
        """Wire elements the flags take in every destination's share (0 without flags)."""
        return 0 if flags is None else flags.numel() * row_state_ratio(self.wire_dtype)

    def with_flags(self, parts: list[torch.Tensor], flags: torch.Tensor | None) -> list[torch.Tensor]:
        """One destination's parts followed by the flags' wire elements (the parts alone without flags)."""
        # Bit for bit, not converted: a converted 0/1 would be exact, but a float32's bit pattern
        # (a logit maximum) is not representable in a 16-bit float, nor above 2**24 in float32.
        if flags is None:
            return parts
        flags = flags.to(device=self.device, dtype=torch.int32).reshape(-1)
        if self.wire_dtype.itemsize > 4:
            flags = flags.to(_INT_OF_SIZE[self.wire_dtype.itemsize])  # one wire element per flag, sign kept
        return [*parts, flags.view(self.wire_dtype)]

    def flags_landed(self, wire: torch.Tensor) -> torch.Tensor:
        """One source's flags from their wire elements (:meth:`with_flags`), as int32."""
        # A slice of a receive buffer may start at an odd element: copy before reinterpreting.
        wire = wire.clone()
        if self.wire_dtype.itemsize > 4:
            return wire.view(_INT_OF_SIZE[self.wire_dtype.itemsize]).to(torch.int32)
        return wire.view(torch.int32)

    def split_flags(self, segments: Sequence[torch.Tensor],
                    nflags: int) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """The landed segments (one per source) without their last ``nflags`` wire elements, and the
        elementwise maximum of every source's flags there (None where ``nflags`` is 0)."""
        if not nflags:
            return list(segments), None
        agreed = torch.stack([self.flags_landed(seg[seg.numel() - nflags:]) for seg in segments]).amax(0).cpu()
        return [seg[: seg.numel() - nflags] for seg in segments], agreed

    # ----------------------------------------------------------- collectives
    def all_to_all(self, level: str, out: torch.Tensor, inp: torch.Tensor,
                   out_splits: list[int], in_splits: list[int], me: int, flags: int = 0) -> list:
        """One uneven all-to-all on ``level`` (``"intra"``: :attr:`within`, ``"inter"``: :attr:`across`),
        counted. ``flags``: elements per peer that are the agreement's flags, not counted (as the
        agreement's own all-reduce is not): the counters stay what the traffic model prices."""
        elem, peers = inp.element_size(), len(in_splits) - 1
        issue = self.within if level == "intra" else self.across
        return issue(out, inp, out_splits, in_splits, (sum(in_splits) - in_splits[me] - peers * flags) * elem,
                     (sum(out_splits) - out_splits[me] - peers * flags) * elem)


_INT_OF_SIZE = {8: torch.int64}
"""The integer dtype a flag widens to in a wire dtype wider than int32 (one element per flag)."""


def row_state_ratio(wire_dtype: torch.dtype) -> int:
    """Wire elements per float32 value of row state: 1 in a wire dtype of 4 bytes or more (converted
    exactly), else ``4 // itemsize`` (the float32's bits reinterpreted)."""
    return 1 if wire_dtype.itemsize >= 4 else 4 // wire_dtype.itemsize
