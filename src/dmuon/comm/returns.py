"""The owners' updates back to every holder: hop 1 inside the owner's replica, hop 2 across replicas
by the direct or the scatter route (see :mod:`dmuon.comm.exchange` for the whole exchange)."""

from __future__ import annotations

from typing import Sequence

import torch

from dmuon.comm.exchange_core import ExchangeCore
from dmuon.comm.pending import Pending, no_result
from dmuon.plan.publication import DIRECT, ROUTES, Published, choose_route, state_rows
from dmuon.util.observe import ranged

Part = tuple[torch.Tensor, torch.Tensor | None]
"""Part ``q`` of a piece on the scatter route: its column slice ``(rows, cols_q, inner)`` and its row
chunk's state ``(rows_q, row_width)`` (None without a row state)."""


class UpdateReturns:
    """The way back of :class:`dmuon.comm.exchange.ShardExchange`: :meth:`return_updates` and its routes.

    Args:
        core: The sizes, wire and collectives the exchange shares.
        publication: How hop 2 crosses the replicas: None picks per return wave
            (:func:`dmuon.plan.publication.choose_route`), ``"direct"`` or ``"scatter"``
            forces one route for every wave (tests; every rank must pass the same).
    """

    def __init__(self, core: ExchangeCore, publication: str | None = None) -> None:
        if publication is not None and publication not in ROUTES:
            raise ValueError(f"publication must be None or one of {ROUTES}, got {publication!r}")
        self.core = core
        self.publication = publication
        self._routes: dict[tuple[int, ...], str] = {}

    def return_updates(self, members: Sequence[int], owned: dict[int, torch.Tensor],
                       flags: torch.Tensor | None = None, rows: dict[int, torch.Tensor] | None = None) -> Pending:
        """Sends each shard position its piece of the owners' updates (then across replicas).

        Args:
            members: Matrix indices, identical and in the same order on every rank.
            owned: The full ``(m, n)`` update of each member this rank owns.
            flags: The step's agreement (int32, the same length on every rank: 0/1 flags and
                non-negative float32 bit patterns), sent along bit for bit so that no collective
                of its own is needed: every hop then issues, even one with no rows to move, and
                :meth:`Pending.agreed` gives their elementwise maximum over every rank (int32).
            rows: With a row state: the whole ``(m, row_width)`` new row state of each member
                this rank owns.

        Returns:
            A :class:`Pending` whose ``wait()`` gives this rank's piece ``(rows, cols * inner)``
            of every member's update (no entry where it holds nothing of a member), and
            :meth:`Pending.row_states` its rows of their row state. On HSDP hop 2 follows hop 1
            (one all-to-all on the direct route, two on the scatter route: :meth:`route`); each
            :meth:`Pending.forward` (main thread) lands the latest hop and issues the next.
        """
        core = self.core
        topo = core.topo
        if topo.world_size == 1 and not topo.loopback:
            return Pending([], lambda: dict(owned), core.stats, flags=flags,
                           rows=dict(rows) if core.row_elems else None)
        hop1 = self._updates_to_columns(members, owned, flags, rows)
        if topo.replicate == 1:
            return hop1
        publish = self._rows_to_replicas if self.route(members) == DIRECT else self._slices_to_replicas
        return Pending([], no_result, core.stats,
                       then=lambda: publish(members, hop1.wait(), hop1.flags, hop1.row_states()))

    def route(self, members: Sequence[int]) -> str:
        """The route of hop 2 for a return of ``members`` (:mod:`dmuon.plan.publication`): the forced
        one, else the one whose collectives' critical bytes add up to less (the same on every rank)."""
        if self.publication is not None:
            return self.publication
        key = tuple(members)
        route = self._routes.get(key)
        if route is None:
            core = self.core
            wave = [Published(core.owner(i)[0], tuple((p.rows, p.cols) for p in core.infos[i].pieces),
                              core.infos[i].inner) for i in members]
            elem = core.wire_dtype.itemsize
            route = choose_route(wave, core.topo.replicate, core.topo.shard, elem, core.row_elems * elem)
            if len(self._routes) >= 64:  # the waves repeat step after step; a changing active set would not
                self._routes.clear()
            self._routes[key] = route
        return route

    # ------------------------------------------------------------------ hop 1
    def _update_parts(self, update: torch.Tensor, rows: torch.Tensor | None) -> list[torch.Tensor]:
        """What travels back of one member's piece: its update, then (with a row state) its rows' state."""
        return [update.reshape(-1)] if not self.core.row_elems else [update.reshape(-1), self.core.encode(rows)]

    @ranged("returns.hop_1")
    def _updates_to_columns(self, members: Sequence[int], owned: dict[int, torch.Tensor],
                            flags: torch.Tensor | None, rows: dict[int, torch.Tensor] | None) -> Pending:
        """Hop 1: inside each replica, the owners send every shard position its piece of the members
        the replica owns; ``wait()`` gives this rank's rows of those."""
        core = self.core
        topo, infos = core.topo, core.infos
        r, s = topo.position
        in_replica = [i for i in members if core.owner(i)[0] == r]
        if topo.local or (not in_replica and flags is None):
            return Pending([], lambda: {i: owned[i] for i in in_replica}, core.stats, flags=flags,
                           rows={i: rows[i] for i in in_replica} if core.row_elems else None)

        nflags = core.flag_elems(flags)
        mine = [i for i in members if infos[i].owner == topo.rank]
        from_column = {c: [i for i in in_replica if core.owner(i)[1] == c] for c in range(topo.shard)}
        in_splits = [sum(core.piece(i, dst) + core.row_back(i, dst) for i in mine) + nflags
                     for dst in range(topo.shard)]
        out_splits = [sum(core.piece(i, s) + core.row_back(i, s) for i in from_column[c]) + nflags
                      for c in range(topo.shard)]
        parts = []
        for dst in range(topo.shard):
            box = {i: infos[i].pieces[dst] for i in mine}
            pieces = [part for i in mine for part in self._update_parts(
                infos[i].cut(owned[i], dst),
                rows[i][box[i].row : box[i].row + box[i].rows] if core.row_elems else None)]
            parts += core.with_flags(pieces, flags)
        send = core.cat(parts)
        recv = core.empty(sum(out_splits))
        works = core.all_to_all("intra", recv, send, out_splits, in_splits, s, nflags)
        return self._landing(works, recv, out_splits, from_column, s, nflags)

    def _landing(self, works: list, recv: torch.Tensor, splits: list[int], members_of: dict[int, list[int]], s: int,
                 nflags: int) -> Pending:
        """The Pending of hop 1 or the direct route's hop 2: rows by source, and the maximum of the
        flags every source appended."""
        pending = Pending(works, no_result, self.core.stats)

        def finish() -> dict[int, torch.Tensor]:
            segments, pending.flags = self.core.split_flags(recv.split(splits), nflags)
            updates, rows = self._rows_by_source(segments, members_of, s)
            if self.core.row_elems:
                pending.rows = rows
            return updates

        pending.finish = finish
        return pending

    def _rows_by_source(self, segments: Sequence[torch.Tensor], members_of: dict[int, list[int]],
                        s: int) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
        """Cuts the landed segments (one per source) into this position's piece ``(rows, cols * inner)`` of
        each member and its rows' state; members this position holds nothing of get no entry."""
        core = self.core
        updates, rows = {}, {}
        for source, segment in enumerate(segments):
            members = members_of[source]
            for i, piece in zip(members, segment.split([core.piece(i, s) + core.row_back(i, s) for i in members])):
                numel = core.piece(i, s)
                if numel:
                    info = core.infos[i]
                    updates[i] = piece[:numel].view(info.rows[s], info.pieces[s].cols * info.inner)
                    if core.row_elems:
                        rows[i] = core.decode(piece[numel:], info.rows[s])
        return updates, rows

    # ----------------------------------------------------- hop 2, direct route
    @ranged("returns.hop_2")
    def _rows_to_replicas(self, members: Sequence[int], updates: dict[int, torch.Tensor],
                          flags: torch.Tensor | None, rows: dict[int, torch.Tensor]) -> Pending:
        """Hop 2: my rows of the members owned in my replica go to my column of every other replica
        (with hop 1's flags, the maximum over my replica, and their row state)."""
        core = self.core
        topo = core.topo
        r, s = topo.position
        nflags = core.flag_elems(flags)
        from_replica = {q: [i for i in members if core.owner(i)[0] == q] for q in range(topo.replicate)}
        out_splits = [sum(core.piece(i, s) + core.row_back(i, s) for i in from_replica[q]) + nflags
                      for q in range(topo.replicate)]
        if sum(out_splits) == 0:
            return Pending([], lambda: updates, core.stats, rows=rows if core.row_elems else None)
        own = core.cat(core.with_flags([part for i in from_replica[r] if i in updates
                                        for part in self._update_parts(updates[i], rows.get(i))], flags))
        recv = core.empty(sum(out_splits))
        works = core.all_to_all("inter", recv, own.repeat(topo.replicate), out_splits,
                                [own.numel()] * topo.replicate, r, nflags)
        return self._landing(works, recv, out_splits, from_replica, s, nflags)

    # ---------------------------------------------------- hop 2, scatter route
    def _part(self, i: int, q: int, s: int) -> int:
        """Wire elements of part ``q`` of position ``s``'s piece of matrix ``i`` on the scatter route:
        the update's column slice ``q`` and the row state of row chunk ``q``."""
        core = self.core
        info, p = core.infos[i], core.infos[i].pieces[s]
        return (p.rows * info.replica_columns(s)[q] * info.inner
                + state_rows(p.rows, core.topo.replicate)[q] * core.row_elems)

    def _cut_part(self, i: int, q: int, s: int, update: torch.Tensor, rows: torch.Tensor | None) -> list[torch.Tensor]:
        """Part ``q`` of this position's piece ``update`` (``(rows, cols * inner)``) and of its rows' state."""
        core = self.core
        info, p = core.infos[i], core.infos[i].pieces[s]
        out = [update.reshape(p.rows, p.cols, info.inner).narrow(1, info.column_start(q, s), info.replica_columns(s)[q])
               .reshape(-1)]
        if core.row_elems:
            chunks = state_rows(p.rows, core.topo.replicate)
            out.append(core.encode(rows[sum(chunks[:q]):sum(chunks[:q + 1])]))
        return out

    def _read_part(self, i: int, q: int, s: int, flat: torch.Tensor) -> Part:
        """Part ``q`` of matrix ``i``'s piece on position ``s`` from its wire elements."""
        core = self.core
        info, p = core.infos[i], core.infos[i].pieces[s]
        numel = p.rows * info.replica_columns(s)[q] * info.inner
        columns = flat[:numel].view(p.rows, info.replica_columns(s)[q], info.inner)
        if not core.row_elems:
            return columns, None
        return columns, core.decode(flat[numel:], state_rows(p.rows, core.topo.replicate)[q])

    @ranged("returns.hop_2")
    def _slices_to_replicas(self, members: Sequence[int], updates: dict[int, torch.Tensor],
                            flags: torch.Tensor | None, rows: dict[int, torch.Tensor]) -> Pending:
        """Hop 2 on the scatter route, stage a: part ``q`` of my piece of each member owned in my replica to
        my position in replica ``q`` (with hop 1's flags, my replica's maximum, to every replica);
        then stage b (:meth:`_parts_to_replicas`)."""
        core = self.core
        topo = core.topo
        r, s = topo.position
        nflags = core.flag_elems(flags)
        owner = {i: core.owner(i)[0] for i in members}
        held = [i for i in members if core.piece(i, s)]
        ours = [i for i in held if owner[i] == r]
        in_splits = [(sum(self._part(i, q, s) for i in ours) if q != r else 0) + nflags
                     for q in range(topo.replicate)]
        out_splits = [(sum(self._part(i, r, s) for i in held if owner[i] == q) if q != r else 0) + nflags
                      for q in range(topo.replicate)]
        recv = core.empty(sum(out_splits))
        works: list = []
        # Every rank of this replicate group sees the same wave: all issue, or none (nothing moves here).
        if flags is not None or sum(core.piece(i, s) + core.row_back(i, s) - self._part(i, owner[i], s)
                                    for i in held):
            parts = []
            for q in range(topo.replicate):
                pieces = [] if q == r else [part for i in ours for part in
                                            self._cut_part(i, q, s, updates[i], rows.get(i))]
                parts += core.with_flags(pieces, flags)
            works = core.all_to_all("inter", recv, core.cat(parts), out_splits, in_splits, r, nflags)

        def then() -> Pending:
            segments, agreed = core.split_flags(recv.split(out_splits), nflags)
            mine: dict[int, Part] = {}
            for q, segment in enumerate(segments):
                if q == r:
                    continue
                theirs = [i for i in held if owner[i] == q]
                for i, flat in zip(theirs, segment.split([self._part(i, r, s) for i in theirs])):
                    mine[i] = self._read_part(i, r, s, flat)
            return self._parts_to_replicas(members, updates, rows, mine, agreed)

        return Pending(works, no_result, core.stats, then=then)

    @ranged("returns.hop_2")
    def _parts_to_replicas(self, members: Sequence[int], updates: dict[int, torch.Tensor],
                           rows: dict[int, torch.Tensor], mine: dict[int, Part],
                           flags: torch.Tensor | None) -> Pending:
        """Hop 2 on the scatter route, stage b (an all-gather): my part ``r`` of every member's piece to my
        position in every replica but mine and the member's owner's; ``wait()`` gives my piece of every
        member. ``updates``/``rows``: hop 1's, the members owned in my replica; ``mine``: stage a's, part
        ``r`` of the others; ``flags``: stage a's maximum, every rank's."""
        core = self.core
        R = core.topo.replicate
        r, s = core.topo.position
        owner = {i: core.owner(i)[0] for i in members}
        held = [i for i in members if core.piece(i, s)]
        others = [i for i in held if owner[i] != r]
        in_splits = [sum(self._part(i, r, s) for i in held if owner[i] != q) if q != r else 0 for q in range(R)]
        out_splits = [sum(self._part(i, q, s) for i in others) if q != r else 0 for q in range(R)]
        recv = core.empty(sum(out_splits))
        works: list = []
        if sum((R - 2) * (core.piece(i, s) + core.row_back(i, s)) + self._part(i, owner[i], s) for i in held):
            parts = []
            for q in range(R):
                if q == r:
                    continue
                for i in held:
                    if owner[i] == q:
                        continue
                    if owner[i] == r:
                        parts += self._cut_part(i, r, s, updates[i], rows.get(i))
                    else:
                        columns, state = mine[i]
                        parts += [columns.reshape(-1)] + ([core.encode(state)] if core.row_elems else [])
            works = core.all_to_all("inter", recv, core.cat(parts), out_splits, in_splits, r)
        pending = Pending(works, no_result, core.stats, flags=flags)

        def finish() -> dict[int, torch.Tensor]:
            got: dict[int, dict[int, Part]] = {i: {r: mine[i]} for i in others}
            for q, segment in enumerate(recv.split(out_splits)):
                if q != r:
                    for i, flat in zip(others, segment.split([self._part(i, q, s) for i in others])):
                        got[i][q] = self._read_part(i, q, s, flat)
            result, states = self._joined_pieces(held, others, owner, updates, rows, got)
            if core.row_elems:
                pending.rows = states
            return result

        pending.finish = finish
        return pending

    def _joined_pieces(self, held: list[int], others: list[int], owner: dict[int, int],
                       updates: dict[int, torch.Tensor], rows: dict[int, torch.Tensor],
                       got: dict[int, dict[int, Part]]) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
        """This position's piece ``(rows, cols * inner)`` of every member it holds, and its rows' state:
        hop 1's for the members owned in my replica, the R parts ``got`` joined for the others."""
        core = self.core
        R = core.topo.replicate
        r, s = core.topo.position
        result = {i: updates[i] for i in held if owner[i] == r}
        states = {i: rows[i] for i in held if owner[i] == r} if core.row_elems else {}
        for i in others:
            # The R parts side by side (columns) and one under the other (row state) are my piece.
            p, inner = core.infos[i].pieces[s], core.infos[i].inner
            result[i] = torch.cat([got[i][q][0] for q in range(R)], dim=1).view(p.rows, p.cols * inner)
            if core.row_elems:
                states[i] = torch.cat([got[i][q][1] for q in range(R)])
        return result, states
