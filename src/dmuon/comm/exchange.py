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

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from dmuon.comm.coalesce import GroupAllToAll
from dmuon.comm.stats import CommStats
from dmuon.comm.topology import Topology
from dmuon.plan.hop_a import UNITS
from dmuon.plan.plan import MatrixInfo
from dmuon.plan.publication import DIRECT, ROUTES, Published, choose_route, state_rows


@dataclass
class Pending:
    """An exchange in flight; ``wait()`` lands it and returns its result (once computed, kept).

    A multi-hop exchange issued in backward has ``then``: the next hop can only
    start once the previous one has landed, and only the main thread issues
    collectives (every rank must issue them in the same order), so the runtime
    calls :meth:`forward` when it launches the next block and :meth:`issue_all`
    when it enters ``step()``.
    """

    works: list
    """Handles of the collectives issued so far."""
    finish: Callable[[], dict[int, torch.Tensor]] = field(repr=False)
    """Turns the landed buffers into the result (may issue a second hop)."""
    stats: CommStats = field(repr=False)
    then: Callable[[], "Pending"] | None = field(default=None, repr=False)
    """Issues the next hop from the landed buffers; its result is this exchange's."""
    result: dict[int, torch.Tensor] | None = field(default=None, repr=False)
    flags: torch.Tensor | None = field(default=None, repr=False)
    """What ``finish`` found of the flags that rode along (see :meth:`ShardExchange.return_updates`)."""
    rows: dict[int, torch.Tensor] | None = field(default=None, repr=False)
    """What ``finish`` found of the row state that rode along (see :meth:`row_states`)."""
    _next: "Pending | None" = field(default=None, repr=False)
    _forwarded: threading.Event = field(default_factory=threading.Event, repr=False)

    def _land(self, exposed: bool) -> None:
        start = time.perf_counter()
        for work in self.works:
            work.wait()
        self.works = []
        if exposed:
            self.stats.wait_seconds += time.perf_counter() - start

    def forward(self) -> None:
        """Main thread: advances the exchange by one hop: lands the latest issued hop and issues the
        one after it (nothing once every hop is issued)."""
        if self._next is not None:
            self._next.forward()
        elif self.then is not None:
            self._land(exposed=True)
            self._next = self.then()
            self._forwarded.set()

    def issued(self) -> bool:
        """Whether every hop has been issued."""
        return self.then is None or (self._next is not None and self._next.issued())

    def issue_all(self) -> None:
        """Main thread: issues every remaining hop (landing each one before it)."""
        while not self.issued():
            self.forward()

    def agreed(self) -> torch.Tensor | None:
        """Lands the exchange; the elementwise maximum over every rank of the flags sent with it
        (``None`` when none were)."""
        self.wait()
        return self._next.agreed() if self._next is not None else self.flags

    def row_states(self) -> dict[int, torch.Tensor]:
        """Lands the exchange; the ``(rows, row_width)`` float32 row state that travelled with each
        matrix of the result (empty without a row state)."""
        self.wait()
        if self._next is not None:
            return self._next.row_states()
        return {} if self.rows is None else self.rows

    def wait(self, exposed: bool = True) -> dict[int, torch.Tensor]:
        """Lands the exchange.

        Args:
            exposed: False when a side thread waits: its time is not counted as
                blocking, and it issues nothing (it waits for the main thread's
                :meth:`forward` instead).
        """
        if self.result is None:
            if self.then is not None:
                if exposed:
                    self.forward()
                else:
                    self._forwarded.wait()
                assert self._next is not None
                self.result = self._next.wait(exposed)
            else:
                self._land(exposed)
                self.result = self.finish()
        return self.result


def _no_result() -> dict[int, torch.Tensor]:
    return {}


class ShardExchange:
    """Runs dmuon's collectives for one plan.

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

    # ----------------------------------------------------------- to the owner
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
        if topo.shard == 1:
            pending = Pending([], lambda: {i: local[i].reshape(infos[i].matrix_shape) for i in mine}, self.stats)
            if self.row_elems:
                pending.rows = {i: rows[i].reshape(infos[i].shape[0], self.row_width) for i in mine}
            return pending
        in_replica = [i for i in members if self._owner(i)[0] == r]
        if not in_replica:
            # No matrix of these members is owned in this replica: the whole shard group skips.
            return Pending([], _no_result, self.stats)

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
        pending = Pending(works, _no_result, self.stats)

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

    # ------------------------------------------------------------- back again
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
        topo = self.topo
        if topo.world_size == 1:
            return Pending([], lambda: dict(owned), self.stats, flags=flags,
                           rows=dict(rows) if self.row_elems else None)
        hop1 = self._updates_to_columns(members, owned, flags, rows)
        if topo.replicate == 1:
            return hop1
        publish = self._rows_to_replicas if self.route(members) == DIRECT else self._slices_to_replicas
        return Pending([], _no_result, self.stats,
                       then=lambda: publish(members, hop1.wait(), hop1.flags, hop1.row_states()))

    def route(self, members: Sequence[int]) -> str:
        """The route of hop 2 for a return of ``members`` (:mod:`dmuon.plan.publication`): the forced
        one, else the one whose collectives' critical bytes add up to less (the same on every rank)."""
        if self.publication is not None:
            return self.publication
        key = tuple(members)
        route = self._routes.get(key)
        if route is None:
            wave = [Published(self._owner(i)[0], tuple((p.rows, p.cols) for p in self.infos[i].pieces),
                              self.infos[i].inner) for i in members]
            elem = self.wire_dtype.itemsize
            route = choose_route(wave, self.topo.replicate, self.topo.shard, elem, self.row_elems * elem)
            if len(self._routes) >= 64:  # the waves repeat step after step; a changing active set would not
                self._routes.clear()
            self._routes[key] = route
        return route

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

    def _update_parts(self, i: int, update: torch.Tensor, rows: torch.Tensor | None) -> list[torch.Tensor]:
        """What travels back of one member's piece: its update, then (with a row state) its rows' state."""
        return [update.reshape(-1)] if not self.row_elems else [update.reshape(-1), self._encode(rows)]

    def _updates_to_columns(self, members: Sequence[int], owned: dict[int, torch.Tensor],
                            flags: torch.Tensor | None, rows: dict[int, torch.Tensor] | None) -> Pending:
        """Hop 1: inside each replica, the owners send every shard position its piece of the members
        the replica owns; ``wait()`` gives this rank's rows of those."""
        topo, infos = self.topo, self.infos
        r, s = topo.coords
        in_replica = [i for i in members if self._owner(i)[0] == r]
        if topo.shard == 1 or (not in_replica and flags is None):
            return Pending([], lambda: {i: owned[i] for i in in_replica}, self.stats, flags=flags,
                           rows={i: rows[i] for i in in_replica} if self.row_elems else None)

        nflags = self._flag_elems(flags)
        mine = [i for i in members if infos[i].owner == topo.rank]
        from_column = {c: [i for i in in_replica if self._owner(i)[1] == c] for c in range(topo.shard)}
        in_splits = [sum(self._piece(i, dst) + self._row_back(i, dst) for i in mine) + nflags
                     for dst in range(topo.shard)]
        out_splits = [sum(self._piece(i, s) + self._row_back(i, s) for i in from_column[c]) + nflags
                      for c in range(topo.shard)]
        parts = []
        for dst in range(topo.shard):
            box = {i: infos[i].pieces[dst] for i in mine}
            pieces = [part for i in mine for part in self._update_parts(
                i, infos[i].cut(owned[i], dst),
                rows[i][box[i].row : box[i].row + box[i].rows] if self.row_elems else None)]
            parts += self._with_flags(pieces, flags)
        send = self._cat(parts)
        recv = self._empty(sum(out_splits))
        works = self._all_to_all("intra", recv, send, out_splits, in_splits, s, nflags)
        return self._landing(works, recv, out_splits, from_column, s, nflags)

    def _rows_to_replicas(self, members: Sequence[int], updates: dict[int, torch.Tensor],
                          flags: torch.Tensor | None, rows: dict[int, torch.Tensor]) -> Pending:
        """Hop 2: my rows of the members owned in my replica go to my column of every other replica
        (with hop 1's flags, the maximum over my replica, and their row state)."""
        topo = self.topo
        r, s = topo.coords
        nflags = self._flag_elems(flags)
        from_replica = {q: [i for i in members if self._owner(i)[0] == q] for q in range(topo.replicate)}
        out_splits = [sum(self._piece(i, s) + self._row_back(i, s) for i in from_replica[q]) + nflags
                      for q in range(topo.replicate)]
        if sum(out_splits) == 0:
            return Pending([], lambda: updates, self.stats, rows=rows if self.row_elems else None)
        own = self._cat(self._with_flags([part for i in from_replica[r] if i in updates
                                          for part in self._update_parts(i, updates[i], rows.get(i))], flags))
        recv = self._empty(sum(out_splits))
        works = self._all_to_all("inter", recv, own.repeat(topo.replicate), out_splits,
                                 [own.numel()] * topo.replicate, r, nflags)
        return self._landing(works, recv, out_splits, from_replica, s, nflags)

    # ---------------------------------------------------- hop 2, scatter route
    def _part(self, i: int, q: int, s: int) -> int:
        """Wire elements of part ``q`` of position ``s``'s piece of matrix ``i`` on the scatter route:
        the update's column slice ``q`` and the row state of row chunk ``q``."""
        info, p = self.infos[i], self.infos[i].pieces[s]
        return (p.rows * info.replica_columns(s)[q] * info.inner
                + state_rows(p.rows, self.topo.replicate)[q] * self.row_elems)

    def _cut_part(self, i: int, q: int, s: int, update: torch.Tensor, rows: torch.Tensor | None) -> list[torch.Tensor]:
        """Part ``q`` of this position's piece ``update`` (``(rows, cols * inner)``) and of its rows' state."""
        info, p = self.infos[i], self.infos[i].pieces[s]
        out = [update.reshape(p.rows, p.cols, info.inner).narrow(1, info.column_start(q, s), info.replica_columns(s)[q])
               .reshape(-1)]
        if self.row_elems:
            chunks = state_rows(p.rows, self.topo.replicate)
            out.append(self._encode(rows[sum(chunks[:q]):sum(chunks[:q + 1])]))
        return out

    def _read_part(self, i: int, q: int, s: int, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Part ``q`` of matrix ``i``'s piece on position ``s`` from its wire elements: the column slice
        ``(rows, cols_q, inner)`` and the row chunk's state ``(rows_q, row_width)`` (None without one)."""
        info, p = self.infos[i], self.infos[i].pieces[s]
        numel = p.rows * info.replica_columns(s)[q] * info.inner
        columns = flat[:numel].view(p.rows, info.replica_columns(s)[q], info.inner)
        if not self.row_elems:
            return columns, None
        return columns, self._decode(flat[numel:], state_rows(p.rows, self.topo.replicate)[q])

    def _slices_to_replicas(self, members: Sequence[int], updates: dict[int, torch.Tensor],
                            flags: torch.Tensor | None, rows: dict[int, torch.Tensor]) -> Pending:
        """Hop 2 on the scatter route, stage a: part ``q`` of my piece of each member owned in my replica to
        my position in replica ``q`` (with hop 1's flags, my replica's maximum, to every replica);
        then stage b (:meth:`_parts_to_replicas`)."""
        topo = self.topo
        r, s = topo.coords
        nflags = self._flag_elems(flags)
        owner = {i: self._owner(i)[0] for i in members}
        held = [i for i in members if self._piece(i, s)]
        ours = [i for i in held if owner[i] == r]
        in_splits = [(sum(self._part(i, q, s) for i in ours) if q != r else 0) + nflags
                     for q in range(topo.replicate)]
        out_splits = [(sum(self._part(i, r, s) for i in held if owner[i] == q) if q != r else 0) + nflags
                      for q in range(topo.replicate)]
        recv = self._empty(sum(out_splits))
        works: list = []
        # Every rank of this replicate group sees the same wave: all issue, or none (nothing moves here).
        if flags is not None or sum(self._piece(i, s) + self._row_back(i, s) - self._part(i, owner[i], s)
                                    for i in held):
            parts = []
            for q in range(topo.replicate):
                pieces = [] if q == r else [part for i in ours for part in
                                            self._cut_part(i, q, s, updates[i], rows.get(i))]
                parts += self._with_flags(pieces, flags)
            works = self._all_to_all("inter", recv, self._cat(parts), out_splits, in_splits, r, nflags)

        def then() -> Pending:
            segments = recv.split(out_splits)
            agreed = None
            if nflags:
                agreed = torch.stack([self._flags_landed(seg[seg.numel() - nflags:])
                                      for seg in segments]).amax(0).cpu()
                segments = [seg[: seg.numel() - nflags] for seg in segments]
            mine: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
            for q, segment in enumerate(segments):
                if q == r:
                    continue
                theirs = [i for i in held if owner[i] == q]
                for i, flat in zip(theirs, segment.split([self._part(i, r, s) for i in theirs])):
                    mine[i] = self._read_part(i, r, s, flat)
            return self._parts_to_replicas(members, updates, rows, mine, agreed)

        return Pending(works, _no_result, self.stats, then=then)

    def _parts_to_replicas(self, members: Sequence[int], updates: dict[int, torch.Tensor],
                           rows: dict[int, torch.Tensor], mine: dict[int, tuple[torch.Tensor, torch.Tensor | None]],
                           flags: torch.Tensor | None) -> Pending:
        """Hop 2 on the scatter route, stage b (an all-gather): my part ``r`` of every member's piece to my
        position in every replica but mine and the member's owner's; ``wait()`` gives my piece of every
        member. ``updates``/``rows``: hop 1's, the members owned in my replica; ``mine``: stage a's, part
        ``r`` of the others; ``flags``: stage a's maximum, every rank's."""
        topo, infos = self.topo, self.infos
        R = topo.replicate
        r, s = topo.coords
        owner = {i: self._owner(i)[0] for i in members}
        held = [i for i in members if self._piece(i, s)]
        others = [i for i in held if owner[i] != r]
        in_splits = [sum(self._part(i, r, s) for i in held if owner[i] != q) if q != r else 0 for q in range(R)]
        out_splits = [sum(self._part(i, q, s) for i in others) if q != r else 0 for q in range(R)]
        recv = self._empty(sum(out_splits))
        works: list = []
        if sum((R - 2) * (self._piece(i, s) + self._row_back(i, s)) + self._part(i, owner[i], s) for i in held):
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
                        parts += [columns.reshape(-1)] + ([self._encode(state)] if self.row_elems else [])
            works = self._all_to_all("inter", recv, self._cat(parts), out_splits, in_splits, r)
        pending = Pending(works, _no_result, self.stats, flags=flags)

        def finish() -> dict[int, torch.Tensor]:
            got: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor | None]]] = {i: {r: mine[i]} for i in others}
            for q, segment in enumerate(recv.split(out_splits)):
                if q != r:
                    for i, flat in zip(others, segment.split([self._part(i, q, s) for i in others])):
                        got[i][q] = self._read_part(i, q, s, flat)
            result = {i: updates[i] for i in held if owner[i] == r}
            states = {i: rows[i] for i in held if owner[i] == r} if self.row_elems else {}
            for i in others:
                # The R parts side by side (columns) and one under the other (row state) are my piece.
                p = infos[i].pieces[s]
                result[i] = torch.cat([got[i][q][0] for q in range(R)], dim=1).view(p.rows, p.cols * infos[i].inner)
                if self.row_elems:
                    states[i] = torch.cat([got[i][q][1] for q in range(R)])
            if self.row_elems:
                pending.rows = states
            return result

        pending.finish = finish
        return pending

    def _landing(self, works: list, recv: torch.Tensor, splits: list[int], members_of: dict[int, list[int]], s: int,
                 nflags: int) -> Pending:
        """The Pending of a return hop: rows by source, and the maximum of the flags every source appended."""
        pending = Pending(works, _no_result, self.stats)

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
            return Pending([], _no_result, ex.stats, then=self._hop_b if last else self.issue)

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

        return Pending(works, _no_result, ex.stats, then=landed)

    def _hop_b(self) -> Pending:
        # The R column slices side by side are this position's piece of the direction; the row
        # state does not cross replicas (this replica holds the same copy).
        return self.ex._rows_to_owners(self.members, {i: piece.reshape(-1) for i, piece in self.pieces.items()},
                                       self.rows)


_INT_OF_SIZE = {8: torch.int64}
"""The integer dtype a flag widens to in a wire dtype wider than int32 (one element per flag)."""


def row_state_ratio(wire_dtype: torch.dtype) -> int:
    """Wire elements per float32 value of row state: 1 in a wire dtype of 4 bytes or more (converted
    exactly), else ``4 // itemsize`` (the float32's bits reinterpreted)."""
    return 1 if wire_dtype.itemsize >= 4 else 4 // wire_dtype.itemsize
