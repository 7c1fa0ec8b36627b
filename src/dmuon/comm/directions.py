"""The directions to their owners: hop A across replicas (HSDP only), then hop B inside the owner's
replica (see :mod:`dmuon.comm.exchange` for the whole exchange)."""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from dmuon.comm.exchange_core import ExchangeCore
from dmuon.comm.pending import Pending, no_result
from dmuon.plan.hop_a import UNITS
from dmuon.util.observe import ranged

ToOwners = Callable[[Sequence[int], dict[int, torch.Tensor], dict[int, torch.Tensor] | None], Pending]
"""Hop B: ``(members, local, rows)`` to the pending exchange of the members' directions to their owners."""


class DirectionSender:
    """The way to the owners of :class:`dmuon.comm.exchange.ShardExchange`: :meth:`send_directions`.

    Args:
        core: The sizes, wire and collectives the exchange shares.
    """

    def __init__(self, core: ExchangeCore) -> None:
        self.core = core

    def send_directions(self, members: Sequence[int], local: dict[int, torch.Tensor],
                        rows: dict[int, torch.Tensor] | None = None,
                        spread: Callable[[], dict[int, int]] | None = None) -> Pending:
        """Sends this rank's piece of each member's direction to the member's owner.

        Args:
            members: Matrix indices, identical and in the same order on every rank.
            local: This rank's part of each member's direction (piece ``s``'s column slice
                ``r``, any view of it), in the wire dtype.
            rows: With a row state: this rank's rows of each member's state, ``(rows, row_width)``
                (every member this rank holds rows of; only some positions send theirs).
            spread: On HSDP, hop A in row chunks: called before each chunk, it gives the units
                (:data:`dmuon.plan.hop_a.UNITS` per matrix) of each member to have sent once
                the chunk has gone (the same on every rank; :class:`dmuon.plan.hop_a.HopASpreader`);
                each :meth:`Pending.forward` issues the next chunk, then hop B once all have
                landed. None: all of it at once.

        Returns:
            A :class:`Pending` whose ``wait()`` gives ``{index: full (m, n) direction}``
            for the members this rank owns (and :meth:`Pending.row_states` their whole
            ``(m, row_width)`` row state).
        """
        if self.core.topo.replicate == 1:
            return self._rows_to_owners(members, local, rows)
        return self._columns_to_owner_replica(members, local, rows, spread)

    def _columns_to_owner_replica(self, members: Sequence[int], local: dict[int, torch.Tensor],
                                  rows: dict[int, torch.Tensor] | None,
                                  spread: Callable[[], dict[int, int]] | None = None) -> Pending:
        """Hop A: column slices to the owner's replica, in one or several row chunks
        (:class:`_SlicesToOwnerReplica`); then hop B (:meth:`_rows_to_owners`) from there."""
        return _SlicesToOwnerReplica(self.core, members, local, rows, spread, self._rows_to_owners).issue()

    @ranged("directions.hop_b")
    def _rows_to_owners(self, members: Sequence[int], local: dict[int, torch.Tensor],
                        rows: dict[int, torch.Tensor] | None = None) -> Pending:
        """Hop B: inside each replica, its ranks' pieces of the members it owns go to their owners
        (each followed by its row state, where it carries one).

        ``local`` needs only the members owned in this rank's replica that this position sends.
        """
        core = self.core
        topo, infos = core.topo, core.infos
        r, s = topo.position
        mine = [i for i in members if infos[i].owner == topo.rank]
        if topo.local:
            pending = Pending([], lambda: {i: local[i].reshape(infos[i].matrix_shape) for i in mine}, core.stats)
            if core.row_elems:
                pending.rows = {i: rows[i].reshape(infos[i].shape[0], core.row_width) for i in mine}
            return pending
        in_replica = [i for i in members if core.owner(i)[0] == r]
        if not in_replica:
            # No matrix of these members is owned in this replica: the whole shard group skips.
            return Pending([], no_result, core.stats)

        def size(i: int, src: int) -> int:
            return core.sent(i, src) + core.row_sent(i, src)

        by_column = sorted(in_replica, key=lambda i: (core.owner(i)[1], i))
        in_splits = [0] * topo.shard
        for i in in_replica:
            in_splits[core.owner(i)[1]] += size(i, s)
        out_splits = [sum(size(i, src) for i in mine) for src in range(topo.shard)]
        parts = []
        for i in by_column:
            if core.sent(i, s):
                parts.append(local[i].reshape(-1))
            if core.row_sent(i, s):
                parts.append(core.encode(rows[i]))
        send = core.cat(parts)
        recv = core.empty(sum(out_splits))
        works = core.all_to_all("intra", recv, send, out_splits, in_splits, s)
        pending = Pending(works, no_result, core.stats)

        def finish() -> dict[int, torch.Tensor]:
            pieces: dict[int, dict[int, torch.Tensor]] = {i: {} for i in mine}
            row_parts: dict[int, dict[int, torch.Tensor]] = {i: {} for i in mine}
            for src, segment in enumerate(recv.split(out_splits)):
                for i, piece in zip(mine, segment.split([size(i, src) for i in mine])):
                    sent = core.sent(i, src)
                    if sent:
                        pieces[i][src] = piece[:sent]
                    if core.row_sent(i, src):
                        row_parts[i][src] = core.decode(piece[sent:], infos[i].pieces[src].rows)
            if core.row_elems:
                pending.rows = {i: torch.cat([row_parts[i][src] for src in
                                              sorted(row_parts[i], key=lambda src: infos[i].pieces[src].row)])
                                for i in mine}
            return {i: infos[i].assemble(pieces[i]) for i in mine}

        pending.finish = finish
        return pending


class _SlicesToOwnerReplica:
    """Hop A of one exchange: every rank's column slice of each member's direction to the same shard
    position of the member's owner replica, whose rank there joins the R slices into its piece.

    It goes in chunks of rows (unit ranges, :mod:`dmuon.plan.hop_a`): each :meth:`issue` sends
    rows ``[rows_s * a // UNITS, rows_s * b // UNITS)`` of every member's slice, from the units
    already sent ``a`` to what ``spread()`` asks for ``b`` (everything without ``spread``), as one
    uneven ``all_to_all`` on the replicate group (none where this position moves no row: its whole
    group agrees). Landed chunks are pasted into the receiving pieces; once every unit has gone
    and landed, ``to_owners`` (hop B) starts from the pieces.
    """

    def __init__(self, core: ExchangeCore, members: Sequence[int], local: dict[int, torch.Tensor],
                 rows: dict[int, torch.Tensor] | None, spread: Callable[[], dict[int, int]] | None,
                 to_owners: ToOwners) -> None:
        self.core = core
        self.members = list(members)
        self.local = local
        self.rows = rows
        self.spread = spread
        self.to_owners = to_owners
        r, s = core.topo.position
        # Members owned in this replica, whose slices this position receives (where it sends its piece).
        self.ours = [i for i in self.members if core.owner(i)[0] == r and core.sent(i, s)]
        self.to_replica = sorted(self.members, key=lambda i: (core.owner(i)[0], i))
        self.sent = {i: 0 for i in self.members}
        self.pieces = {i: core.empty(core.sent(i, s)).view(core.infos[i].rows[s], -1) for i in self.ours}

    def _rows(self, i: int, a: int, b: int) -> tuple[int, int]:
        """The rows of this position's piece of member ``i`` in the unit range ``[a, b)`` (none from a copy)."""
        s = self.core.topo.position[1]
        held = self.core.infos[i].rows[s] if self.core.sent(i, s) else 0
        return held * a // UNITS, held * b // UNITS

    @ranged("directions.hop_a")
    def issue(self) -> Pending:
        core, infos = self.core, self.core.infos
        topo = core.topo
        r, s = topo.position
        upto = self.spread() if self.spread is not None else {i: UNITS for i in self.members}
        span = {i: self._rows(i, self.sent[i], upto[i]) for i in self.members}
        self.sent = {i: upto[i] for i in self.members}
        last = all(units == UNITS for units in self.sent.values())
        if all(stop == start for start, stop in span.values()):
            # No row of this position moves in this chunk (on any replica: they hold the same rows).
            return Pending([], no_result, core.stats, then=self._hop_b if last else self.issue)

        def width(i: int, q: int) -> int:
            return infos[i].replica_columns(s)[q] * infos[i].inner

        in_splits = [0] * topo.replicate
        parts = []
        for i in self.to_replica:
            start, stop = span[i]
            if stop > start and width(i, r):
                in_splits[core.owner(i)[0]] += (stop - start) * width(i, r)
                parts.append(self.local[i].reshape(infos[i].rows[s], -1)[start:stop].reshape(-1))
        out_splits = [sum((span[i][1] - span[i][0]) * width(i, q) for i in self.ours) for q in range(topo.replicate)]
        recv = core.empty(sum(out_splits))
        works = core.all_to_all("inter", recv, core.cat(parts), out_splits, in_splits, r)

        def landed() -> Pending:
            for q, segment in enumerate(recv.split(out_splits)):
                sizes = [(span[i][1] - span[i][0]) * width(i, q) for i in self.ours]
                for i, chunk in zip(self.ours, segment.split(sizes)):
                    start, stop = span[i]
                    if stop > start and width(i, q):
                        column = infos[i].column_start(q, s) * infos[i].inner
                        self.pieces[i][start:stop, column:column + width(i, q)] = chunk.view(stop - start, -1)
            return self._hop_b() if last else self.issue()

        return Pending(works, no_result, core.stats, then=landed)

    def _hop_b(self) -> Pending:
        # The R column slices side by side are this position's piece of the direction; the row
        # state does not cross replicas (this replica holds the same copy).
        return self.to_owners(self.members, {i: piece.reshape(-1) for i, piece in self.pieces.items()}, self.rows)
