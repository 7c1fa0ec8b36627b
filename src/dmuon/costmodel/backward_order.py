"""dmuon's backward collectives in the order the runtime issues them (:mod:`dmuon.runtime.backward`):
the replicate level's gradient-column all_to_alls carrying hop A's chunks as the spreader decides, and with
``returns_in_backward`` each block's return at the landings after its directions' last hop. Used by
:func:`dmuon.costmodel.collectives.owner_exchange_collectives`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from dmuon.costmodel.collective import Collective, Parts, a2a, merge_parts, shard_rows
from dmuon.plan.hop_a import HopASpreader, column_reduce_loads, slice_shape
from dmuon.plan.publication import DIRECT, SCATTER


def gradient_columns(members: Sequence[int], tables: Sequence[Sequence[tuple[int, int, bool]]],
                      inner: Sequence[int], replicate: int, shard: int, gradient_bytes: int) -> Parts:
    """The replicate level's reduce-scatter of one block's gradient column slices over each shard column's
    replicate group (:func:`owner_exchange_collectives`): one uneven ``all_to_all``'s parts.

    Every rank ``(r, s)`` of a column holds the same piece ``s``, so it sends slice ``q`` to
    ``(q, s)`` for each ``q != r`` and receives ``R - 1`` copies of slice ``r``. Its peers are
    the ranks of its column whose slice of some member is not empty (out), and, if its own
    slice of some member is not empty, the other ``R - 1`` ranks (in). A column holding no rows
    of the block takes no part.
    """
    world = replicate * shard
    sent, received = [0] * world, [0] * world
    out: list[set] = [set() for _ in range(world)]
    inn: list[set] = [set() for _ in range(world)]
    part = [False] * world
    for s in range(shard):
        if not any(tables[i][s][0] for i in members):
            continue  # this column holds no rows of the block: it skips the collective
        slices = [0] * replicate  # bytes of column slice q of the members' pieces on this column
        for i in members:
            rows, cols, _ = tables[i][s]
            for q, c in enumerate(shard_rows(cols, replicate)):
                slices[q] += rows * c * inner[i] * gradient_bytes
        whole = sum(slices)
        for r in range(replicate):
            k = r * shard + s
            part[k] = True
            sent[k], received[k] = whole - slices[r], (replicate - 1) * slices[r]
            out[k] = {q * shard + s for q in range(replicate) if q != r and slices[q]}
            inn[k] = {q * shard + s for q in range(replicate) if q != r} if slices[r] else set()
    return sent, received, out, inn, part


RETURN_ROLES = {(DIRECT, 0): "return_replicas", (SCATTER, 0): "return_scatter", (SCATTER, 1): "return_gather"}
"""The role of a return's hop across replicas, by its route and stage (:mod:`dmuon.plan.publication`)."""
_RETURN_NAMES = {"return_replicas": "to the replicas", "return_scatter": "slices to the replicas",
                 "return_gather": "slices' all-gather"}


def return_hops(block: int, members: list[int], world: int, return_shard, across
                ) -> tuple[Collective | None, list[tuple[Parts, str]]]:
    """A block's return as ``BackwardLaunches._return`` issues it in backward: hop 1 inside the owners'
    replicas (None where the runtime takes that hop without a collective: one shard position) and its
    hops across replicas still to go, as ``(parts, role)`` (``return_shard`` and ``across``: of
    :func:`~dmuon.costmodel.collectives.owner_exchange_collectives`)."""
    parts = return_shard(members)
    hop1 = None if parts is None else a2a("intra", "backward", block, world, *parts,
                                          f"dmuon updates of block {block} to the shard columns", "return_shard")
    route, stages = across(members)
    return hop1, [(st, RETURN_ROLES[route, k]) for k, st in enumerate(stages)]


def across_collective(block: int, world: int, parts: Parts, role: str) -> Collective:
    """One hop across replicas of block ``block``'s return, as a collective of its own."""
    return a2a("inter", "backward", block, world, *parts, f"dmuon updates of block {block}: {_RETURN_NAMES[role]}",
               role)


@dataclass
class _Launched:
    """A block launched in backward, as ``BackwardLaunches`` tracks it with ``returns_in_backward``."""

    block: int
    members: list[int]
    hops: list[Collective | None]
    """Its direction hops still to issue, one per landing (None: a hop without a collective)."""
    returns: list[Collective | None] | None = None
    """Its return's hops still to issue, one per landing; None until the return is issued."""
    ready: bool = False
    """Every direction hop was issued by the last landing: the return goes at this one."""


def backward_with_returns(order, blocks, replicate: int, world: int, hop_a_alone, hop_b, return_shard, across
                          ) -> tuple[list[Collective], list[int]]:
    """``returns_in_backward``'s backward list without dmuon's replicate level (1-D, FSDP2's native
    HSDP) and the blocks it returns, as ``BackwardLaunches`` issues them: at each landing of a block
    with Muon matrices every earlier launch's next direction hop and next return hop (launch order),
    then the return of every launch whose directions were all issued by the last landing, then the
    block's own first direction hop; in ``step()`` what is left of each, in launch order."""
    out: list[Collective] = []
    launches: list[_Launched] = []

    def issue(c: Collective | None, at) -> None:
        if c is not None:
            c.issued_at = at
            out.append(c)

    for b in order:
        members = [i for i in range(len(blocks)) if blocks[i] == b]
        if not members:
            continue  # no unit of the runtime's: it hooks only blocks with Muon matrices
        for launch in launches:
            if launch.hops:
                issue(launch.hops.pop(0), b)
            if launch.returns:
                issue(launch.returns.pop(0), b)
        for launch in launches:
            if launch.returns is None and launch.ready:
                hop1, rest = return_hops(launch.block, launch.members, world, return_shard, across)
                launch.returns = [across_collective(launch.block, world, parts, role) for parts, role in rest]
                issue(hop1, b)
            launch.ready = not launch.hops
        hops = [hop_a_alone(b, members), (hop_b(b, members) or [None])[0]] if replicate > 1 else hop_b(b, members)
        issue(hops.pop(0), b)
        launches.append(_Launched(b, members, hops, ready=not hops))
    for launch in launches:  # step(): BackwardLaunches.take
        for c in launch.hops + (launch.returns or []):
            issue(c, None)
    return out, [launch.block for launch in launches if launch.returns is not None]


def spread_backward(order: Sequence[int], blocks: Sequence[int], tables, inner: Sequence[int],
                     owners: Sequence[int], replicate: int, shard: int, elem_bytes: int, gradient_bytes: int,
                     hop_a_spread: int, hop_b, returns=None) -> tuple[list[Collective], list[int]]:
    """The replicate level's backward collectives as ``dmuon.runtime.backward.BackwardLaunches`` issues them, with
    the same :class:`~dmuon.plan.hop_a.HopASpreader` choosing each hop A chunk.

    When unit ``b`` lands (blocks in ``order``): hop B of every block whose last chunk went in the
    previous collective (launch order), then one all_to_all across replicas carrying ``b``'s
    gradient columns (role ``"grad_columns"``) and the chunks the spreader chose (a unit with no
    Muon matrix: the chunks alone, role ``"hop_a"``); ``b``'s directions can go from the next one.
    In ``step()``: what is left of every block in one last all_to_all (role ``"hop_a"``, block
    None), the hop B of blocks completed before it first, then the others', in launch order.

    ``returns``: ``(return_shard, across)`` of :func:`owner_exchange_collectives` for
    ``returns_in_backward``: at each landing, after the hop B's, the hop 1 of every block whose hop
    B went at an earlier landing, and the landing's all_to_all across replicas also carries the next
    hop of every return in flight (:attr:`Collective.carries_returns`); in ``step()`` the rest of
    each, after the hop B's.

    Returns:
        The collectives, and the blocks whose return went in backward.
    """
    walk = _SpreadWalk(blocks, tables, inner, owners, replicate, shard, elem_bytes, gradient_bytes, hop_a_spread,
                       hop_b, returns)
    for b in order:
        walk.landing(b)
    walk.take()
    return walk.out, walk.back


class _SpreadWalk:
    """:func:`spread_backward`'s walk through backward: the spreader, what each block has sent, and the
    collectives in issue order."""

    def __init__(self, blocks, tables, inner, owners, replicate: int, shard: int, elem_bytes: int,
                 gradient_bytes: int, hop_a_spread: int, hop_b, returns) -> None:
        self.blocks, self.tables, self.inner = blocks, tables, inner
        self.replicate, self.shard, self.world = replicate, shard, replicate * shard
        self.elem_bytes, self.gradient_bytes = elem_bytes, gradient_bytes
        self.hop_b, self.returns = hop_b, returns
        self.spreader = HopASpreader({i: slice_shape(owners[i] // shard, tables[i], replicate, inner[i])
                                      for i in range(len(blocks))}, replicate, shard, elem_bytes, hop_a_spread)
        self.launched: list[tuple[int, list[int]]] = []
        self.sent_units: dict[int, int] = {}
        self.completed: list[int] = []  # blocks whose last chunk went in the collective before
        self.out: list[Collective] = []
        # returns_in_backward: blocks whose hop B went at the last landing (their hop 1 goes at this one),
        # and per block returning, its hops across replicas still to go (route stages' parts, role).
        self.ready: list[int] = []
        self.in_flight: dict[int, list[tuple[Parts, str]]] = {}
        self.back: list[int] = []
        self.members_of = {blk: [i for i in range(len(blocks)) if blocks[i] == blk] for blk in set(blocks)}

    def chunks(self, blocks_now: list[int]) -> tuple[Parts, list[int], list[int]]:
        """The chunks the spreader just chose, as one all_to_all's parts; the blocks riding, completing."""
        world, shard, spreader = self.world, self.shard, self.spreader
        sent, received = [0] * world, [0] * world
        peers_out: list[set] = [set() for _ in range(world)]
        peers_in: list[set] = [set() for _ in range(world)]
        part = [False] * world
        riding, completing = [], []
        for blk in blocks_now:
            upto = spreader.upto(blk)
            for i, units in upto.items():
                start = self.sent_units.get(i, 0)
                self.sent_units[i] = units
                for s, src, dst, moved in spreader.shapes[i].moves(start, units, shard, self.elem_bytes):
                    if blk not in riding:
                        riding.append(blk)
                    for r in range(self.replicate):  # the position's whole replicate group takes part
                        part[r * shard + s] = True
                    if moved:
                        sent[src] += moved
                        received[dst] += moved
                        peers_out[src].add(dst)
                        peers_in[dst].add(src)
            if spreader.complete(blk):
                completing.append(blk)
        return (sent, received, peers_out, peers_in, part), riding, completing

    def hop_b_of(self, done: Sequence[int], at: int | None) -> None:
        for blk, members in self.launched:
            if blk in done:
                for c in self.hop_b(blk, members):
                    c.issued_at = at
                    self.out.append(c)

    def hop_1(self, blk: int, at: int) -> None:
        hop1, self.in_flight[blk] = return_hops(blk, self.members_of[blk], self.world, *self.returns)
        if hop1 is not None:
            hop1.issued_at = at
            self.out.append(hop1)
        self.back.append(blk)

    def advance_returns(self, b: int) -> list:
        """``BackwardLaunches._advance``: every return in flight one hop across (joined with the landing's
        all_to_all), then the due hop 1's; the hops riding."""
        riding_returns = []
        for blk, hops in self.in_flight.items():
            if hops:
                riding_returns.append((blk, *hops.pop(0)))
        for blk in self.ready:
            self.hop_1(blk, b)
        self.ready = [blk for blk, _ in self.launched if blk in self.completed]
        return riding_returns

    def landing(self, b: int) -> None:
        """Unit ``b`` lands: the hop B's due, the returns' hops, one all_to_all across replicas."""
        members = [i for i in range(len(self.blocks)) if self.blocks[i] == b]
        self.hop_b_of(self.completed, b)
        riding_returns = self.advance_returns(b) if self.returns is not None else []
        tables, inner = self.tables, self.inner
        columns = gradient_columns(members, tables, inner, self.replicate, self.shard, self.gradient_bytes) \
            if members else None
        pending = self.spreader.pending()
        # The runtime's own loads of the column reduce-scatter: its decisions are the same.
        self.spreader.decide(column_reduce_loads([tables[i] for i in members], [inner[i] for i in members],
                                                 self.replicate, self.shard, self.gradient_bytes))
        moving, riding, self.completed = self.chunks(pending)
        self.append_across(b, columns, moving, riding, riding_returns)
        if members:
            self.spreader.add(b, members)
            self.launched.append((b, members))

    def append_across(self, b: int, columns, moving, riding: list[int], riding_returns: list) -> None:
        """The landing's all_to_all across replicas: ``b``'s gradient columns, the chunks riding, the returns'
        hops; none when nothing moves."""
        returning = [parts for _, parts, _ in riding_returns]
        world, out = self.world, self.out
        if columns is not None:
            label = f"dmuon gradient columns block {b}" + (f" + direction slices of blocks {riding}" if riding else "")
            parts = [columns] + ([moving] if riding else []) + returning
            out.append(a2a("inter", "backward", b, world, *merge_parts(*parts), label, "grad_columns"))
        elif riding or returning:
            parts = ([moving] if riding else []) + returning
            label = f"dmuon direction slices of blocks {riding}" if riding else \
                f"dmuon updates of blocks {[blk for blk, _, _ in riding_returns]} across replicas"
            out.append(a2a("inter", "backward", b, world, *merge_parts(*parts), label,
                           "hop_a" if riding else riding_returns[0][2]))
        else:
            return
        out[-1].carries_hop_a, out[-1].completes_hop_a = tuple(riding), tuple(self.completed)
        out[-1].carries_returns = tuple(blk for blk, _, _ in riding_returns)
        if riding_returns:
            out[-1].label += f" + updates of blocks {list(out[-1].carries_returns)} across replicas"
        out[-1].issued_at = b

    def take(self) -> None:
        """``step()``'s ``BackwardLaunches.take``: what is left of every block's slices in one last all_to_all,
        the hop B's, then what is left of the returns, in launch order."""
        pending = self.spreader.pending()
        if pending:
            self.spreader.decide([[0, 0] for _ in range(self.world)], final=True)
            self.hop_b_of(self.completed, None)
            moving, riding, last = self.chunks(pending)
            if riding:
                self.out.append(a2a("inter", "backward", None, self.world, *moving,
                                    f"dmuon direction slices of blocks {riding} left at the end of backward", "hop_a"))
                self.out[-1].carries_hop_a, self.out[-1].completes_hop_a = tuple(riding), tuple(last)
                self.out[-1].issued_at = None
            self.hop_b_of(last, None)
        else:
            self.hop_b_of(self.completed, None)
        for blk in self.back:
            for parts, role in self.in_flight[blk]:
                self.out.append(across_collective(blk, self.world, parts, role))
                self.out[-1].issued_at = None
