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
    world = replicate * shard
    spreader = HopASpreader({i: slice_shape(owners[i] // shard, tables[i], replicate, inner[i])
                             for i in range(len(blocks))}, replicate, shard, elem_bytes, hop_a_spread)
    launched: list[tuple[int, list[int]]] = []
    sent_units: dict[int, int] = {}
    completed: list[int] = []  # blocks whose last chunk went in the collective before
    out: list[Collective] = []

    def chunks(blocks_now: list[int]) -> tuple[Parts, list[int], list[int]]:
        """The chunks the spreader just chose, as one all_to_all's parts; the blocks riding, completing."""
        sent, received = [0] * world, [0] * world
        peers_out: list[set] = [set() for _ in range(world)]
        peers_in: list[set] = [set() for _ in range(world)]
        part = [False] * world
        riding, completing = [], []
        for blk in blocks_now:
            upto = spreader.upto(blk)
            for i, units in upto.items():
                start = sent_units.get(i, 0)
                sent_units[i] = units
                for s, src, dst, moved in spreader.shapes[i].moves(start, units, shard, elem_bytes):
                    if blk not in riding:
                        riding.append(blk)
                    for r in range(replicate):  # the position's whole replicate group takes part
                        part[r * shard + s] = True
                    if moved:
                        sent[src] += moved
                        received[dst] += moved
                        peers_out[src].add(dst)
                        peers_in[dst].add(src)
            if spreader.complete(blk):
                completing.append(blk)
        return (sent, received, peers_out, peers_in, part), riding, completing

    def hop_b_of(done: Sequence[int], at: int | None) -> None:
        for blk, members in launched:
            if blk in done:
                for c in hop_b(blk, members):
                    c.issued_at = at
                    out.append(c)

    # returns_in_backward: blocks whose hop B went at the last landing (their hop 1 goes at this one),
    # and per block returning, its hops across replicas still to go (route stages' parts, role).
    ready: list[int] = []
    in_flight: dict[int, list[tuple[Parts, str]]] = {}
    back: list[int] = []
    members_of = {blk: [i for i in range(len(blocks)) if blocks[i] == blk] for blk in set(blocks)}

    def hop_1(blk: int, at: int) -> None:
        hop1, in_flight[blk] = return_hops(blk, members_of[blk], world, *returns)
        if hop1 is not None:
            hop1.issued_at = at
            out.append(hop1)
        back.append(blk)

    for b in order:
        members = [i for i in range(len(blocks)) if blocks[i] == b]
        hop_b_of(completed, b)
        riding_returns = []
        if returns is not None:
            # BackwardLaunches._advance: every return in flight one hop across (joined below), then the due hop 1's.
            for blk, hops in in_flight.items():
                if hops:
                    riding_returns.append((blk, *hops.pop(0)))
            for blk in ready:
                hop_1(blk, b)
            ready = [blk for blk, _ in launched if blk in completed]
        columns = gradient_columns(members, tables, inner, replicate, shard, gradient_bytes) if members else None
        pending = spreader.pending()
        # The runtime's own loads of the column reduce-scatter: its decisions are the same.
        spreader.decide(column_reduce_loads([tables[i] for i in members], [inner[i] for i in members], replicate,
                                            shard, gradient_bytes))
        moving, riding, completed = chunks(pending)
        returning = [parts for _, parts, _ in riding_returns]
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
        if columns is not None or riding or returning:
            out[-1].carries_hop_a, out[-1].completes_hop_a = tuple(riding), tuple(completed)
            out[-1].carries_returns = tuple(blk for blk, _, _ in riding_returns)
            if riding_returns:
                out[-1].label += f" + updates of blocks {list(out[-1].carries_returns)} across replicas"
            out[-1].issued_at = b
        if members:
            spreader.add(b, members)
            launched.append((b, members))
    # step(): BackwardLaunches.take
    pending = spreader.pending()
    if pending:
        spreader.decide([[0, 0] for _ in range(world)], final=True)
        hop_b_of(completed, None)
        moving, riding, last = chunks(pending)
        if riding:
            out.append(a2a("inter", "backward", None, world, *moving,
                            f"dmuon direction slices of blocks {riding} left at the end of backward", "hop_a"))
            out[-1].carries_hop_a, out[-1].completes_hop_a = tuple(riding), tuple(last)
            out[-1].issued_at = None
        hop_b_of(last, None)
    else:
        hop_b_of(completed, None)
    for blk in back:  # take(): what is left of the returns, in launch order
        for parts, role in in_flight[blk]:
            out.append(across_collective(blk, world, parts, role))
            out[-1].issued_at = None
    return out, back
