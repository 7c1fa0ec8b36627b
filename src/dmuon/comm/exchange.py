"""Exchanges between the shards FSDP2 (and tensor parallelism) leave and each matrix's owner.

FSDP2 keeps every matrix split by rows (``Shard(0)``) over the shard level of a
(replicate R x shard S) mesh, and tensor parallelism splits it further (the
shard level is then FSDP2's and TP's dims together); each shard position
``s`` holds a box of the matrix, ``MatrixInfo.pieces[s]``. After FSDP2's
reduce-scatter (and, on HSDP, its all-reduce across replicas) every rank
holds its piece of the averaged gradient, identical in every replica. Muon's
momentum is kept once in the whole mesh: rank ``(r, s)`` keeps piece ``s``'s
column slice ``r`` (``MatrixInfo.replica_columns``). A piece several
positions hold (a matrix TP leaves whole) is sent by its first holder only
and comes back to all. dmuon moves only what Newton-Schulz consumes and
produces, in its wire dtype:

* **Directions, hop A** (replicate level, HSDP only): every rank sends its
  column slice of each matrix's direction to the same shard position of the
  owner's replica, which joins the R slices into its piece. Per matrix 1/R of
  it crosses the slow network once from each other replica, spread over the
  S positions.
* **Directions, hop B** (shard level, inside the owner's replica only): each
  rank of the owner's replica sends its piece of the direction; the owner
  pastes the pieces into the full matrix (``MatrixInfo.assemble``).
* **Updates back, hop 1** (shard level, inside the owner's replica): the owner
  sends each shard position its piece of the orthogonalized update
  (``MatrixInfo.cut``).
* **Updates back, hop 2** (replicate level, HSDP only): every position of the
  other replicas gets the same piece, by one of two routes per return wave
  (:mod:`dmuon.plan.publication`, :meth:`ShardExchange.route`: the one whose
  collectives' critical bytes add up to less). **Direct**: every rank of the
  owner's replica sends its piece to the same position of every other replica.
  **Scatter**: (a) it sends part ``q`` of its piece (the column slice ``q`` the
  momentum uses, ``MatrixInfo.replica_columns``) to replica ``q`` only; (b) an
  all-gather: every rank sends the part ``r`` it holds of each member to every
  replica but its own and the member's owner's, and joins the R parts into its
  piece. Either way the matrix crosses the slow network R-1 times in total,
  spread over S links; the direct route makes the owner's replica send all of
  it, the scatter route spreads it over every replica (a wave whose owners
  crowd into a few replicas is what it is for).

Each hop is one uneven ``all_to_all_single`` per block and level, which gloo
and NCCL both support (on dmuon's replicate level the runtime joins hop A with
the next block's gradient reduce-scatter, and a return wave's first hop across
replicas with the wave before's all-gather, :mod:`dmuon.comm.coalesce`); members
travel in plan-index order, so every destination's share is one contiguous slice. The speculative step's update
return also carries its agreement: a few int32 flags at the end of every
destination's share, maximised over the sources on landing (hop 2 forwards
hop 1's maximum, so every rank ends with the whole mesh's; on the scatter
route stage (a) carries them to every replica, even where no part moves, and
stage (b) none). The flags travel bit for bit whatever the wire dtype (an
int32 is two elements of a 16-bit wire, one of a 32- or 64-bit one) and are
maximised as integers after landing, so besides 0/1 they can carry
non-negative float32 values as their bit patterns (the agreement's logit
maxima, :mod:`dmuon.runtime.agreement`).

**Row state** (``row_width > 0``; none for Muon, whose exchange is unchanged): a
rule's small per-row state (NorMuon's second moment, ``row_width`` float32 values
per matrix row) rides with its matrix. Every holder of a row keeps a copy of the
row's state (replicated over TP's column split and over HSDP's replicas), so on
the way out it travels once per row, appended to the piece of the sending position
whose box starts at column 0, in hop B only (the owner's replica holds the same
copy, so hop A carries none); the owner gets the whole ``(m, row_width)`` state
beside the whole direction. On the way back every holder of a row receives the
owner's new state of its rows, appended to its piece of the update in hop 1 and
forwarded with it in hop 2: whole on the direct route; on the scatter route split
into R row chunks (``state_rows``, torch.chunk's rule), chunk ``q`` travelling with
part ``q``, so the state is spread over the replicas as the update is (and moves the
same R-1 copies in all). In a 16-bit wire dtype each float32 travels bit for
bit as two wire elements, so the state is exact whatever the NS dtype.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from dmuon.comm.exchange_core import row_state_ratio
from dmuon.comm.pending import Pending, no_result
from dmuon.comm.returns import UpdateReturns
from dmuon.plan.hop_a import UNITS

__all__ = ["Pending", "ShardExchange", "row_state_ratio"]


class ShardExchange(UpdateReturns):
    """Runs dmuon's collectives for one plan: the directions to the owners (here), the updates back
    (:class:`dmuon.comm.returns.UpdateReturns`), on the wire both share
    (:class:`dmuon.comm.exchange_core.ExchangeCore`, whose constructor this is).
    """

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
        if self.topo.replicate == 1:
            return self._rows_to_owners(members, local, rows)
        return self._columns_to_owner_replica(members, local, rows, spread)

    def _columns_to_owner_replica(self, members: Sequence[int], local: dict[int, torch.Tensor],
                                  rows: dict[int, torch.Tensor] | None,
                                  spread: Callable[[], dict[int, int]] | None = None) -> Pending:
        """Hop A: column slices to the owner's replica, in one or several row chunks
        (:class:`_SlicesToOwnerReplica`); then hop B (:meth:`_rows_to_owners`) from there."""
        return _SlicesToOwnerReplica(self, members, local, rows, spread).issue()

    def _rows_to_owners(self, members: Sequence[int], local: dict[int, torch.Tensor],
                        rows: dict[int, torch.Tensor] | None = None) -> Pending:
        """Hop B: inside each replica, its ranks' pieces of the members it owns go to their owners
        (each followed by its row state, where it carries one).

        ``local`` needs only the members owned in this rank's replica that this position sends.
        """
        topo, infos = self.topo, self.infos
        r, s = topo.coords
        mine = [i for i in members if infos[i].owner == topo.rank]
        if topo.local:
            pending = Pending([], lambda: {i: local[i].reshape(infos[i].matrix_shape) for i in mine}, self.stats)
            if self.row_elems:
                pending.rows = {i: rows[i].reshape(infos[i].shape[0], self.row_width) for i in mine}
            return pending
        in_replica = [i for i in members if self._owner(i)[0] == r]
        if not in_replica:
            # No matrix of these members is owned in this replica: the whole shard group skips.
            return Pending([], no_result, self.stats)

        def size(i: int, src: int) -> int:
            return self._sent(i, src) + self._row_sent(i, src)

        by_column = sorted(in_replica, key=lambda i: (self._owner(i)[1], i))
        in_splits = [0] * topo.shard
        for i in in_replica:
            in_splits[self._owner(i)[1]] += size(i, s)
        out_splits = [sum(size(i, src) for i in mine) for src in range(topo.shard)]
        parts = []
        for i in by_column:
            if self._sent(i, s):
                parts.append(local[i].reshape(-1))
            if self._row_sent(i, s):
                parts.append(self._encode(rows[i]))
        send = self._cat(parts)
        recv = self._empty(sum(out_splits))
        works = self._all_to_all("intra", recv, send, out_splits, in_splits, s)
        pending = Pending(works, no_result, self.stats)

        def finish() -> dict[int, torch.Tensor]:
            pieces: dict[int, dict[int, torch.Tensor]] = {i: {} for i in mine}
            row_parts: dict[int, dict[int, torch.Tensor]] = {i: {} for i in mine}
            for src, segment in enumerate(recv.split(out_splits)):
                for i, piece in zip(mine, segment.split([size(i, src) for i in mine])):
                    sent = self._sent(i, src)
                    if sent:
                        pieces[i][src] = piece[:sent]
                    if self._row_sent(i, src):
                        row_parts[i][src] = self._decode(piece[sent:], infos[i].pieces[src].rows)
            if self.row_elems:
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
    and landed, hop B starts from the pieces.
    """

    def __init__(self, exchange: ShardExchange, members: Sequence[int], local: dict[int, torch.Tensor],
                 rows: dict[int, torch.Tensor] | None, spread: Callable[[], dict[int, int]] | None) -> None:
        self.ex = exchange
        self.members = list(members)
        self.local = local
        self.rows = rows
        self.spread = spread
        r, s = exchange.topo.coords
        infos = exchange.infos
        # Members owned in this replica, whose slices this position receives (where it sends its piece).
        self.ours = [i for i in self.members if exchange._owner(i)[0] == r and exchange._sent(i, s)]
        self.to_replica = sorted(self.members, key=lambda i: (exchange._owner(i)[0], i))
        self.sent = {i: 0 for i in self.members}
        self.pieces = {i: exchange._empty(exchange._sent(i, s)).view(infos[i].rows[s], -1) for i in self.ours}

    def _rows(self, i: int, a: int, b: int) -> tuple[int, int]:
        """The rows of this position's piece of member ``i`` in the unit range ``[a, b)`` (none from a copy)."""
        s = self.ex.topo.coords[1]
        held = self.ex.infos[i].rows[s] if self.ex._sent(i, s) else 0
        return held * a // UNITS, held * b // UNITS

    def issue(self) -> Pending:
        ex, infos = self.ex, self.ex.infos
        topo = ex.topo
        r, s = topo.coords
        upto = self.spread() if self.spread is not None else {i: UNITS for i in self.members}
        span = {i: self._rows(i, self.sent[i], upto[i]) for i in self.members}
        self.sent = {i: upto[i] for i in self.members}
        last = all(units == UNITS for units in self.sent.values())
        if all(stop == start for start, stop in span.values()):
            # No row of this position moves in this chunk (on any replica: they hold the same rows).
            return Pending([], no_result, ex.stats, then=self._hop_b if last else self.issue)

        def width(i: int, q: int) -> int:
            return infos[i].replica_columns(s)[q] * infos[i].inner

        in_splits = [0] * topo.replicate
        parts = []
        for i in self.to_replica:
            start, stop = span[i]
            if stop > start and width(i, r):
                in_splits[ex._owner(i)[0]] += (stop - start) * width(i, r)
                parts.append(self.local[i].reshape(infos[i].rows[s], -1)[start:stop].reshape(-1))
        out_splits = [sum((span[i][1] - span[i][0]) * width(i, q) for i in self.ours) for q in range(topo.replicate)]
        recv = ex._empty(sum(out_splits))
        works = ex._all_to_all("inter", recv, ex._cat(parts), out_splits, in_splits, r)

        def landed() -> Pending:
            for q, segment in enumerate(recv.split(out_splits)):
                sizes = [(span[i][1] - span[i][0]) * width(i, q) for i in self.ours]
                for i, chunk in zip(self.ours, segment.split(sizes)):
                    start, stop = span[i]
                    if stop > start and width(i, q):
                        column = infos[i].column_start(q, s) * infos[i].inner
                        self.pieces[i][start:stop, column:column + width(i, q)] = chunk.view(stop - start, -1)
            return self._hop_b() if last else self.issue()

        return Pending(works, no_result, ex.stats, then=landed)

    def _hop_b(self) -> Pending:
        # The R column slices side by side are this position's piece of the direction; the row
        # state does not cross replicas (this replica holds the same copy).
        return self.ex._rows_to_owners(self.members, {i: piece.reshape(-1) for i, piece in self.pieces.items()},
                                       self.rows)
