"""When each block's direction slices cross the replicate level (HSDP, dmuon's replicate level).

On ``hsdp_mesh`` every rank ``(q, s)`` keeps column slice ``q`` of its piece of a
matrix's momentum, so before Newton-Schulz the direction's slices go to the same
shard position ``s`` of the owner's replica (hop A). That is ``(R-1)/R`` of the
matrix entering one replica, and a block has a few matrices of very different
sizes (an MLP's three are ~5x an attention projection): sent all at once with the
next block's gradient column reduce-scatter (the same replicate group, one
all_to_all, :mod:`dmuon.comm.coalesce`), the replica owning the block's largest
matrix receives its column share plus that whole matrix, and every collective is
as slow as its busiest rank (~14% above the others at 8 replicas on qwen2.5-7b;
the reduce-scatter alone is even).

:class:`HopASpreader` sends each block's hop A in row chunks over the following
collectives instead, choosing per collective how much of each pending matrix
goes so that no rank sends or receives more than a target: the busiest rank's
own share of the collective plus the average hop A a replica receives per block.
Oldest blocks go first, and a block's slices are all sent within ``max_delay``
collectives of its directions being ready (its Newton-Schulz waits for the last
chunk; ``max_delay=1`` is all at once). A chunk is a range of *units*, ``UNITS``
per matrix: position ``s`` sends rows ``[rows_s * a // UNITS, rows_s * b // UNITS)``
of its slice, so the R slices of a row always travel together.

The decisions depend only on the plan and on the sequence of collectives, never
on data, so every rank computes the same chunks; the runtime
(``dmuon.runtime.backward``) and the step model (``dmuon.costmodel.collectives``)
run the same spreader.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Sequence

from dmuon.plan.layout import shard_rows

UNITS = 1 << 12
"""A matrix's hop A in units: a chunk is a unit range (rows of each position pro rata)."""

SPREAD = 8
"""``ExecutionConfig.hop_a_spread``'s value without ``returns_in_backward``: a block's hop A over at most
8 later collectives across replicas, which keeps the busiest replica's bytes per collective near the mean."""
SPREAD_WITH_RETURNS = 1
"""Its value with ``returns_in_backward``: a block's direction slices all go with the next collective, so
its owners' NS and its return follow one landing later and more blocks return during backward (the step
model at 256 H100s, qwen2.5-7b: 1.018x FSDP2 + AdamW's step against 1.037x with 8)."""


def default_spread(returns_in_backward: bool) -> int:
    """``hop_a_spread``'s value when not given: :data:`SPREAD_WITH_RETURNS` with returns in backward, else
    :data:`SPREAD` (the runtime and the step model alike)."""
    return SPREAD_WITH_RETURNS if returns_in_backward else SPREAD


def resolve_spread(hop_a_spread: int | None, returns_in_backward: bool) -> int:
    """``hop_a_spread`` as given, or :func:`default_spread` for None."""
    return default_spread(returns_in_backward) if hop_a_spread is None else hop_a_spread


Loads = list[list[float]]
"""Per plan rank ``r * S + s``: ``[sent, received]`` bytes of one collective."""


@dataclass(frozen=True)
class SliceShape:
    """What one matrix's hop A moves, per shard position."""

    owner_replica: int
    """The replica the slices go to."""
    rows: tuple[int, ...]
    """Per shard position, the rows its piece sends (0 where it sends none: a copy, or no rows)."""
    widths: tuple[tuple[int, ...], ...]
    """Per shard position, per replica ``q``: elements per row of column slice ``q`` of the piece."""

    def moved_rows(self, s: int, a: int, b: int) -> int:
        """Rows position ``s`` sends for the unit range ``[a, b)``."""
        rows = self.rows[s]
        return rows * b // UNITS - rows * a // UNITS

    def moves(self, a: int, b: int, shard: int, wire_bytes: int) -> Iterator[tuple[int, int, int, int]]:
        """The transfers of the unit range ``[a, b)``: ``(position, sending rank, receiving rank, bytes)``,
        ranks as plan ranks ``r * shard + s``; a position moving rows but no bytes (an empty column
        slice) yields ``(s, -1, -1, 0)`` once, since it takes part all the same."""
        r_o = self.owner_replica
        for s, widths in enumerate(self.widths):
            rows = self.moved_rows(s, a, b)
            if not rows:
                continue
            moving = [(q, rows * width * wire_bytes) for q, width in enumerate(widths) if q != r_o and width]
            if not moving:
                yield s, -1, -1, 0
            for q, moved in moving:
                yield s, q * shard + s, r_o * shard + s, moved

    def add_bytes(self, loads: Loads, a: int, b: int, shard: int, wire_bytes: int) -> None:
        """Adds the exact bytes of the unit range ``[a, b)`` to every rank's ``[sent, received]``."""
        for _, src, dst, moved in self.moves(a, b, shard, wire_bytes):
            if moved:
                loads[src][0] += moved
                loads[dst][1] += moved

    def unit_rates(self, shard: int, wire_bytes: int) -> dict[tuple[int, int], float]:
        """Bytes per unit on each ``(rank, direction)`` it loads (direction 0 sent, 1 received)."""
        rates: dict[tuple[int, int], float] = {}
        r_o = self.owner_replica
        for s, widths in enumerate(self.widths):
            if not self.rows[s]:
                continue
            per_row = self.rows[s] * wire_bytes / UNITS
            into = 0.0
            for q, width in enumerate(widths):
                if q != r_o and width:
                    rates[(q * shard + s, 0)] = per_row * width
                    into += per_row * width
            if into:
                rates[(r_o * shard + s, 1)] = into
        return rates

    def received_bytes(self, shard: int, wire_bytes: int) -> int:
        """Bytes the whole hop A brings into the owner's replica (every position)."""
        loads = [[0, 0] for _ in range(len(self.widths[0]) * shard)] if self.widths else []
        self.add_bytes(loads, 0, UNITS, shard, wire_bytes)
        return sum(received for _, received in loads)


@dataclass
class _Block:
    members: list[int]
    upto: dict[int, int]
    """Units sent once the current collective has gone, per member."""
    age: int = 0
    """Collectives decided since the block's directions became ready to go."""


@dataclass
class HopASpreader:
    """Decides, collective by collective, which rows of each pending block's direction slices go.

    Use per step: :meth:`add` when a block's gradient columns are issued (its
    directions can go from the next collective on), :meth:`decide` before each
    collective on the replicate group that can carry hop A (the next unit's
    column reduce-scatter, or the last one at the end of backward with
    ``final=True``), then :meth:`upto` tells each block's exchange what to have
    sent. :meth:`reset` between steps.

    Args:
        shapes: Per matrix index, its :class:`SliceShape`.
        replicate, shard: The mesh.
        wire_bytes: The directions' element size.
        max_delay: Collectives a block's slices may spread over (1: all in the next one).
    """

    shapes: dict[int, SliceShape]
    replicate: int
    shard: int
    wire_bytes: int
    max_delay: int = SPREAD
    _blocks: dict[int, _Block] = field(default_factory=dict, repr=False)
    _received: float = field(default=0.0, repr=False)
    _launched: int = field(default=0, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.max_delay, bool) or not isinstance(self.max_delay, int) or self.max_delay < 1:
            raise ValueError(f"max_delay must be an int >= 1, got {self.max_delay!r}")
        self._rates = {i: shape.unit_rates(self.shard, self.wire_bytes) for i, shape in self.shapes.items()}

    def reset(self) -> None:
        """Forgets every block (a new step)."""
        self._blocks.clear()
        self._received = 0.0
        self._launched = 0

    def add(self, block: int, members: Sequence[int]) -> None:
        """Block ``block``'s directions will be ready to go at the next :meth:`decide`."""
        members = list(members)
        self._blocks[block] = _Block(members, {i: 0 for i in members})
        self._received += sum(self.shapes[i].received_bytes(self.shard, self.wire_bytes) for i in members)
        self._launched += 1

    def pending(self) -> list[int]:
        """Blocks whose slices are not all decided yet, oldest first."""
        return [b for b, blk in self._blocks.items() if any(blk.upto[i] < UNITS for i in blk.members)]

    def decide(self, base: Loads, final: bool = False) -> Loads:
        """Chooses what every pending block sends in the next collective, whose other parts load
        the ranks with ``base``; ``final``: the last chance (everything left goes).

        Returns:
            The collective's loads with the chosen chunks (exact bytes).
        """
        loads = [list(x) for x in base]
        pending = [self._blocks[b] for b in self.pending()]
        for blk in pending:
            blk.age += 1
        if not pending:
            return loads
        # What must go now: everything at the end, and every block at its last chance.
        for blk in pending:
            if final or blk.age >= self.max_delay:
                for i in blk.members:
                    self._send(loads, blk, i, UNITS)
        world = self.replicate * self.shard
        # The target: the busiest rank's share of the collective, plus what a replica's rank receives
        # of hop A per block on average; what must go may set it higher.
        fair = self._received / max(self._launched, 1) / world
        level = max(max(max(x) for x in loads), max(max(x) for x in base) + fair)
        for blk in pending:
            for i in blk.members:
                left = UNITS - blk.upto[i]
                if not left:
                    continue
                room = left
                for (rank, way), rate in self._rates[i].items():
                    room = min(room, int(max(0.0, level - loads[rank][way]) / rate))
                if room:
                    self._send(loads, blk, i, blk.upto[i] + room)
        return loads

    def _send(self, loads: Loads, blk: _Block, i: int, upto: int) -> None:
        self.shapes[i].add_bytes(loads, blk.upto[i], upto, self.shard, self.wire_bytes)
        blk.upto[i] = upto

    def upto(self, block: int) -> dict[int, int]:
        """Units of each member of ``block`` to have sent once the decided collective has gone."""
        return dict(self._blocks[block].upto)

    def complete(self, block: int) -> bool:
        """Whether every slice of ``block`` is decided (sent by the decided collective at the latest)."""
        blk = self._blocks[block]
        return all(blk.upto[i] == UNITS for i in blk.members)


def slice_shape(owner_replica: int, pieces: Sequence[tuple[int, int, bool]], replicate: int,
                inner: int) -> SliceShape:
    """A :class:`SliceShape` from per-position ``(rows, cols, sends)``, the columns split over the
    replicas by torch.chunk's rule (as ``MatrixInfo.replica_columns``)."""
    rows = tuple(r if sends and r and c else 0 for r, c, sends in pieces)
    widths = tuple(tuple(w * inner for w in shard_rows(c, replicate)) for _, c, _ in pieces)
    return SliceShape(owner_replica, rows, widths)


def column_reduce_loads(pieces: Sequence[Sequence[tuple[int, int, bool]]], inners: Sequence[int], replicate: int,
                        shard: int, gradient_bytes: int) -> Loads:
    """Every rank's ``[sent, received]`` bytes in one block's gradient column reduce-scatter across
    replicas (``dmuon.comm.replicate.ReplicateReduce.reduce_columns``): rank ``(r, s)`` sends column
    slice ``q`` of its pieces to ``(q, s)`` and receives ``R - 1`` copies of slice ``r``.

    Args:
        pieces: Per member, per shard position ``(rows, cols, sends)``.
        inners: Per member, elements per column (a conv kernel's; 1 for a matrix).
        gradient_bytes: The gradient's element size on the wire.
    """
    loads: Loads = [[0, 0] for _ in range(replicate * shard)]
    for s in range(shard):
        slices = [0] * replicate
        for member, inner in zip(pieces, inners):
            rows, cols, _ = member[s]
            for q, c in enumerate(shard_rows(cols, replicate)):
                slices[q] += rows * c * inner * gradient_bytes
        whole = sum(slices)
        if not whole:
            continue
        for r in range(replicate):
            loads[r * shard + s] = [whole - slices[r], (replicate - 1) * slices[r]]
    return loads
