"""The wire and the sizes both directions of dmuon's exchange share (see :mod:`dmuon.comm.exchange`)."""

from __future__ import annotations

from typing import Sequence

import torch

from dmuon.comm.coalesce import GroupAllToAll
from dmuon.comm.pending import Pending, no_result
from dmuon.comm.stats import CommStats
from dmuon.comm.topology import Topology
from dmuon.plan.plan import MatrixInfo
from dmuon.plan.publication import ROUTES


class ExchangeCore:
    """What both directions of dmuon's exchange share: the plan's sizes per shard position, the
    wire encoding of row state and flags, and the all-to-alls (counted) on each level.

    :class:`dmuon.comm.returns.UpdateReturns` adds the way back and
    :class:`dmuon.comm.exchange.ShardExchange` the way to the owners.

    Args:
        infos: The plan's matrices (owners and row splits set).
        topology: Mesh shape, this rank's place in it and dmuon's process groups.
        stats: Counters to update.
        wire_dtype: Dtype of everything sent (NS's input and output dtype).
        device: Device of the buffers.
        row_width: float32 values of row state per matrix row that travel with the
            matrices (see the module docstring); 0: none.
        publication: How hop 2 crosses the replicas: None picks per return wave
            (:func:`dmuon.plan.publication.choose_route`), ``"direct"`` or ``"scatter"``
            forces one route for every wave (tests; every rank must pass the same).
    """

    def __init__(self, infos: Sequence[MatrixInfo], topology: Topology, stats: CommStats,
                 wire_dtype: torch.dtype, device: torch.device, row_width: int = 0,
                 publication: str | None = None) -> None:
        if publication is not None and publication not in ROUTES:
            raise ValueError(f"publication must be None or one of {ROUTES}, got {publication!r}")
        self.infos = infos
        self.topo = topology
        self.stats = stats
        self.wire_dtype = wire_dtype
        self.device = device
        r, s = topology.coords
        self.within = GroupAllToAll(topology.shard_group, s, topology.shard, "intra", stats)
        """All-to-alls inside this rank's replica (the shard group)."""
        self.across = GroupAllToAll(topology.replicate_group, r, topology.replicate, "inter", stats)
        """All-to-alls across replicas (this shard position's replicate group); the replicate
        level's reductions share it, so that :meth:`GroupAllToAll.coalesced` can join theirs with hop A."""
        self.row_width = row_width
        self.row_elems = row_width * row_state_ratio(wire_dtype)
        """Wire elements per matrix row of the row state."""
        self.publication = publication
        self._routes: dict[tuple[int, ...], str] = {}

    # ------------------------------------------------------------ row state
    def _encode(self, rows: torch.Tensor) -> torch.Tensor:
        """float32 row state as wire elements, bit for bit (flat)."""
        rows = rows.to(device=self.device, dtype=torch.float32).contiguous().reshape(-1)
        if self.wire_dtype.itemsize >= 4:
            return rows.to(self.wire_dtype)  # float32 and wider hold every float32 exactly
        return rows.view(self.wire_dtype)

    def _decode(self, flat: torch.Tensor, rows: int) -> torch.Tensor:
        """The ``(rows, row_width)`` float32 row state from its wire elements."""
        if self.wire_dtype.itemsize >= 4:
            return flat.to(torch.float32).view(rows, self.row_width)
        # A slice of a receive buffer may start at an odd element: copy before reinterpreting.
        return flat.clone().view(torch.float32).view(rows, self.row_width)

    def _row_sent(self, i: int, s: int) -> int:
        """Wire elements of row state position ``s`` sends with its piece: its rows' state when it
        sends its piece and the piece starts at column 0 (each row's state once)."""
        p = self.infos[i].pieces[s]
        return p.rows * self.row_elems if p.sends and p.col == 0 else 0

    def _row_back(self, i: int, s: int) -> int:
        """Wire elements of row state that come back to position ``s``: every row it holds."""
        return self.infos[i].pieces[s].rows * self.row_elems

    def _cat(self, parts: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(parts) if parts else torch.empty(0, dtype=self.wire_dtype, device=self.device)

    def _empty(self, numel: int) -> torch.Tensor:
        return torch.empty(numel, dtype=self.wire_dtype, device=self.device)

    def _owner(self, i: int) -> tuple[int, int]:
        return self.topo.coords_of(self.infos[i].owner)

    def _piece(self, i: int, s: int) -> int:
        """Elements of matrix ``i`` on shard position ``s`` (what comes back there)."""
        return self.infos[i].piece_numel(s)

    def _sent(self, i: int, s: int) -> int:
        """Elements of matrix ``i`` shard position ``s`` sends to the owner (none from a copy)."""
        return self.infos[i].sent_numel(s)

    def _all_to_all(self, level: str, out: torch.Tensor, inp: torch.Tensor,
                    out_splits: list[int], in_splits: list[int], me: int, flags: int = 0) -> list:
        """``flags``: elements per peer that are the agreement's flags, not counted (as the
        agreement's own all-reduce is not): the counters stay what the traffic model prices."""
        elem, peers = inp.element_size(), len(in_splits) - 1
        issue = self.within if level == "intra" else self.across
        return issue(out, inp, out_splits, in_splits, (sum(in_splits) - in_splits[me] - peers * flags) * elem,
                     (sum(out_splits) - out_splits[me] - peers * flags) * elem)

    def _flag_elems(self, flags: torch.Tensor | None) -> int:
        """Wire elements the flags take in every destination's share (0 without flags)."""
        return 0 if flags is None else flags.numel() * row_state_ratio(self.wire_dtype)

    def _with_flags(self, parts: list[torch.Tensor], flags: torch.Tensor | None) -> list[torch.Tensor]:
        # Bit for bit, not converted: a converted 0/1 would be exact, but a float32's bit pattern
        # (a logit maximum) is not representable in a 16-bit float, nor above 2**24 in float32.
        if flags is None:
            return parts
        flags = flags.to(device=self.device, dtype=torch.int32).reshape(-1)
        if self.wire_dtype.itemsize > 4:
            flags = flags.to(_INT_OF_SIZE[self.wire_dtype.itemsize])  # one wire element per flag, sign kept
        return [*parts, flags.view(self.wire_dtype)]

    def _flags_landed(self, wire: torch.Tensor) -> torch.Tensor:
        """One source's flags from their wire elements (:meth:`_with_flags`), as int32."""
        # A slice of a receive buffer may start at an odd element: copy before reinterpreting.
        wire = wire.clone()
        if self.wire_dtype.itemsize > 4:
            return wire.view(_INT_OF_SIZE[self.wire_dtype.itemsize]).to(torch.int32)
        return wire.view(torch.int32)

    def _landing(self, works: list, recv: torch.Tensor, splits: list[int], members_of: dict[int, list[int]], s: int,
                 nflags: int) -> Pending:
        """The Pending of a return hop: rows by source, and the maximum of the flags every source appended."""
        pending = Pending(works, no_result, self.stats)

        def finish() -> dict[int, torch.Tensor]:
            segments = recv.split(splits)
            if nflags:
                pending.flags = torch.stack([self._flags_landed(seg[seg.numel() - nflags:])
                                             for seg in segments]).amax(0).cpu()
                segments = [seg[: seg.numel() - nflags] for seg in segments]
            updates, rows = self._rows_by_source(segments, members_of, s)
            if self.row_elems:
                pending.rows = rows
            return updates

        pending.finish = finish
        return pending

    def _rows_by_source(self, segments: Sequence[torch.Tensor], members_of: dict[int, list[int]],
                        s: int) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
        """Cuts the landed segments (one per source) into this position's piece ``(rows, cols * inner)`` of
        each member and its rows' state; members this position holds nothing of get no entry."""
        updates, rows = {}, {}
        for source, segment in enumerate(segments):
            members = members_of[source]
            for i, piece in zip(members, segment.split([self._piece(i, s) + self._row_back(i, s) for i in members])):
                numel = self._piece(i, s)
                if numel:
                    info = self.infos[i]
                    updates[i] = piece[:numel].view(info.rows[s], info.pieces[s].cols * info.inner)
                    if self.row_elems:
                        rows[i] = self._decode(piece[numel:], info.rows[s])
        return updates, rows


_INT_OF_SIZE = {8: torch.int64}
"""The integer dtype a flag widens to in a wire dtype wider than int32 (one element per flag)."""


def row_state_ratio(wire_dtype: torch.dtype) -> int:
    """Wire elements per float32 value of row state: 1 in a wire dtype of 4 bytes or more (converted
    exactly), else ``4 // itemsize`` (the float32's bits reinterpreted)."""
    return 1 if wire_dtype.itemsize >= 4 else 4 // wire_dtype.itemsize
