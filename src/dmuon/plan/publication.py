"""How a return wave's updates cross the replicas on HSDP: two routes, and which one a wave takes.

After hop 1 every rank ``(r_o, s)`` of an owner's replica holds its piece ``s``
of the matrix's update (and, with a row state, the state of its rows); every
other replica ``q`` needs the same piece on ``(q, s)``. Each route is made of
uneven ``all_to_all``s on the replicate group of every shard position at once
(:mod:`dmuon.comm.exchange` issues them, :mod:`dmuon.costmodel.collectives`
prices them; both take their bytes from here):

* :data:`DIRECT`, one all-to-all: ``(r_o, s)`` sends its whole piece to
  ``(q, s)`` for every ``q != r_o``. It sends ``R - 1`` pieces per matrix its
  replica owns, so a wave whose owners crowd into a few replicas makes those
  ranks the step's slowest senders.
* :data:`SCATTER`, two: the **scatter**, ``(r_o, s)`` sends part ``q`` of its
  piece to ``(q, s)``; then the **all-gather**, every ``(q, s)`` sends the part
  ``q`` it now holds of every matrix to every replica that lacks it (all but
  itself and the owner's). Part ``q`` is the piece's column slice ``q``, the
  split the momentum uses (``shard_rows(cols, R)``,
  ``MatrixInfo.replica_columns``), plus the row state of the piece's row chunk
  ``q`` (``shard_rows(rows, R)``): every part moves the same way, so the row
  state is as balanced as the update. Each rank sends at most ``(R-1)/R`` of
  the pieces its replica owns in the scatter and ``(R-1)/R`` of the wave's
  pieces in the all-gather, near the floor whoever owns what; the bytes over
  all ranks are the same as the direct route's, ``(R - 1)`` pieces per matrix.

A collective's critical bytes are the most any one rank sends or receives in
it (the larger direction); :func:`choose_route` takes the route whose
collectives' critical bytes add up to less, the direct one on a tie and with
two replicas (one collective, fewer latencies: with ``R = 2`` the scatter
route's two collectives never move less than the direct one). It needs only
the wave's owners and pieces, which every rank knows alike, so every rank
picks the same route.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from dmuon.plan.layout import shard_rows

DIRECT = "direct"
"""Every rank of the owner's replica sends its piece to each other replica."""
SCATTER = "scatter"
"""Part ``q`` of each piece to replica ``q``, then every replica's part to every replica lacking it."""
ROUTES: tuple[str, ...] = (DIRECT, SCATTER)


@dataclass(frozen=True)
class Published:
    """One matrix of a return wave, as its publication across replicas sees it."""

    owner_replica: int
    """The replica of the matrix's owner, which holds every piece after hop 1."""
    boxes: tuple[tuple[int, int], ...]
    """Per shard position, ``(rows, cols)`` of the piece it holds (``Piece.rows``, ``Piece.cols``;
    ``(0, ...)`` where it holds none)."""
    inner: int = 1
    """Elements per column of ``shape[1]`` in a row (a conv kernel's ``prod(shape[2:])``)."""


def state_rows(rows: int, replicate: int) -> list[int]:
    """The row chunk of a piece's row state each replica carries on the scatter route (torch.chunk's rule)."""
    return shard_rows(rows, replicate)


@functools.lru_cache(maxsize=4096)  # a model repeats its few shapes layer after layer
def part_sizes(rows: int, cols: int, inner: int, replicate: int, elem: int, row: int) -> tuple[int, ...]:
    """Size of each replica's part of one piece on the scatter route: its column slice of the update
    (``rows x shard_rows(cols, R)[q] x inner`` elements of ``elem`` each) and its row chunk of the row
    state (``row`` per row). In bytes or wire elements, as ``elem`` and ``row`` are."""
    columns, chunks = shard_rows(cols, replicate), state_rows(rows, replicate)
    return tuple(rows * columns[q] * inner * elem + chunks[q] * row for q in range(replicate))


@dataclass
class Stage:
    """One all-to-all of a route, on every shard position's replicate group at once; per plan rank
    ``r * S + s``."""

    sent: list[int]
    """Bytes each rank sends (its own part not counted: it stays put)."""
    received: list[int]
    taking_part: list[bool]
    """Whether the rank's replicate group issues it: only where it moves bytes."""
    peers_out: list[set[int]] | None = None
    """Plan ranks each rank sends to (with ``peers=True``)."""
    peers_in: list[set[int]] | None = None

    @property
    def critical(self) -> int:
        """The most bytes one rank sends or receives in it."""
        return max((max(self.sent[k], self.received[k]) for k in range(len(self.sent)) if self.taking_part[k]),
                   default=0)


def route_stages(route: str, wave: Sequence[Published], replicate: int, shard: int, elem_bytes: int,
                 row_bytes: int = 0, peers: bool = False) -> list[Stage]:
    """The collectives of ``route`` for one wave: one for :data:`DIRECT`, the scatter and the
    all-gather for :data:`SCATTER`.

    Args:
        route: One of :data:`ROUTES`.
        wave: The wave's matrices.
        replicate, shard: The mesh (R x S).
        elem_bytes: Bytes per element of the update on the wire.
        row_bytes: Bytes of row state per matrix row on the wire (0: none).
        peers: Also list each rank's peers (the alpha-beta model's message counts).
    """
    if route not in ROUTES:
        raise ValueError(f"route must be one of {ROUTES}, got {route!r}")
    world = replicate * shard
    stages = [Stage([0] * world, [0] * world, [False] * world) for _ in range(1 if route == DIRECT else 2)]
    if peers:
        for stage in stages:
            stage.peers_out, stage.peers_in = [set() for _ in range(world)], [set() for _ in range(world)]
    for s in range(shard):
        # parts[o][q]: bytes of part q of the pieces on position s of the matrices owned in replica o.
        parts: dict[int, list[int]] = {}
        for m in wave:
            rows, cols = m.boxes[s]
            if rows:
                sizes = part_sizes(rows, cols, m.inner, replicate, elem_bytes, row_bytes)
                mine = parts.setdefault(m.owner_replica, [0] * replicate)
                for q in range(replicate):
                    mine[q] += sizes[q]
        if parts:
            _column(route, stages, parts, replicate, shard, s, peers)
    return stages


def _column(route: str, stages: list[Stage], parts: dict[int, list[int]], replicate: int, shard: int, s: int,
            peers: bool) -> None:
    """Fills in shard position ``s``'s replicate group: rank ``(q, s)`` is plan rank ``q * shard + s``."""
    R = replicate
    own = {o: sum(p) for o, p in parts.items()}  # every piece of the matrices replica o owns
    column = [sum(p[q] for p in parts.values()) for q in range(R)]  # part q of every piece
    whole = sum(own.values())
    kept = {o: p[o] for o, p in parts.items()}  # the owner replica's own part: it stays put
    if route == DIRECT:
        stage, = stages
        moved = whole > 0
        for r in range(R):
            k = r * shard + s
            stage.sent[k], stage.received[k] = (R - 1) * own.get(r, 0), whole - own.get(r, 0)
            stage.taking_part[k] = moved
            if peers and moved:
                stage.peers_out[k] = {q * shard + s for q in range(R) if q != r} if own.get(r, 0) else set()
                stage.peers_in[k] = {o * shard + s for o in own if o != r and own[o]}
        return
    scatter, gather = stages
    # holding[q]: the replicas owning a matrix whose part q on this position is not empty.
    holding = [{o for o, p in parts.items() if p[q]} for q in range(R)] if peers else []
    scatter_moves = whole - sum(kept.values()) > 0
    gather_moves = (R - 2) * whole + sum(kept.values()) > 0
    for r in range(R):
        k = r * shard + s
        mine = parts.get(r)
        # The scatter: every part but its own replica's from the owner's replica to that replica.
        scatter.sent[k] = own.get(r, 0) - kept.get(r, 0)
        scatter.received[k] = column[r] - kept.get(r, 0)
        scatter.taking_part[k] = scatter_moves
        # The all-gather: part r of a matrix to every replica but r and the owner's (which has it all).
        gather.sent[k] = (R - 2) * column[r] + kept.get(r, 0)
        gather.received[k] = (whole - own.get(r, 0)) - (column[r] - kept.get(r, 0))
        gather.taking_part[k] = gather_moves
        if not peers:
            continue
        if scatter_moves:
            scatter.peers_out[k] = {q * shard + s for q in range(R) if q != r and mine is not None and mine[q]}
            scatter.peers_in[k] = {o * shard + s for o, p in parts.items() if o != r and p[r]}
        if gather_moves:
            # Part r of a matrix goes to every replica but the owner's; part q comes from (q, s) unless
            # this replica owns every matrix with a non-empty part q.
            gather.peers_out[k] = {q * shard + s for q in range(R) if q != r and holding[r] - {q}}
            gather.peers_in[k] = {q * shard + s for q in range(R) if q != r and holding[q] - {r}}


def choose_route(wave: Sequence[Published], replicate: int, shard: int, elem_bytes: int, row_bytes: int = 0) -> str:
    """The route whose collectives' critical bytes add up to less for this wave: :data:`SCATTER`
    only where it moves strictly less than :data:`DIRECT` with three replicas or more.

    Pure and deterministic: every rank computes the same route from the same plan.
    """
    if replicate <= 2 or not wave:
        return DIRECT
    direct = sum(st.critical for st in route_stages(DIRECT, wave, replicate, shard, elem_bytes, row_bytes))
    scatter = sum(st.critical for st in route_stages(SCATTER, wave, replicate, shard, elem_bytes, row_bytes))
    return SCATTER if scatter < direct else DIRECT
