"""Owners on ranks that already hold the matrix: the balancers' third objective.

Most Muon matrices have rows on every rank (FSDP2's row chunks of a matrix with at least as many rows as
shard positions), and where their owner sits changes no byte of the exchange. Some are held by fewer
ranks than the world: a routed expert's slice ``w[e]`` under torchtitan's expert parallelism lives only on
the efsdp ranks of one ep group (on one of them when FSDP2 shards the local stacks on dim 0, whole
experts per rank), and a matrix with fewer rows than shard positions sits on the first ones. A holder
that owns such a matrix sends its own rows nowhere and receives none of the update back: under whole
experts per rank the slice's whole exchange inside a replica disappears, under dim 1 ``1/efsdp`` of it
(the replicate level's column slices across replicas are the same wherever the owner is).

The pass runs after the balancer and the spreading (:func:`~dmuon.plan.spread.place_owners`) and only
exchanges owners between matrices of one kind (the balancer's shape/cost key): every rank keeps the
number of matrices of each kind it was given, hence its NS load, its batch plan and its state bytes.
Bytes are never bought with NS time. Lexicographic: makespan (the balancer's), then bytes per block
(the spreading), then bytes moved at all (this pass), which wins over the spreading where the two
disagree about a matrix some ranks hold: it saves that matrix's bytes outright, where the spreading
only moves them between ranks.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Sequence


def holder_ranks(pieces: Sequence[Sequence | None], replicate: int, shard: int) -> list[tuple[int, ...] | None]:
    """Per matrix, the plan ranks ``r * shard + s`` holding rows of it (``pieces[i][s].rows > 0``, every
    replica ``r`` alike), or None where every rank does (or its pieces are not known: ``None`` or
    empty), which :func:`prefer_holders` and :func:`spread_kinds` leave to the other passes."""
    out: list[tuple[int, ...] | None] = []
    for p in pieces:
        positions = [s for s, piece in enumerate(p or ()) if piece.rows]
        if not p or len(positions) == shard:
            out.append(None)
            continue
        if len(p) != shard:
            raise ValueError(f"{len(p)} pieces for {shard} shard positions")
        out.append(tuple(r * shard + s for r in range(replicate) for s in positions))
    return out


def spread_kinds(items: Sequence[int], holders: Sequence[tuple[int, ...] | None] | None) -> list[int]:
    """The kinds :func:`~dmuon.plan.spread.spread_blocks` swaps within: ``items``, with each matrix that
    some ranks do not hold a kind of its own. :func:`prefer_holders` places those afterwards, so swapping
    them first is wasted, and costly: the swaps grow with the square of a kind's matrices, and thousands of
    expert slices share a shape."""
    if holders is None:
        return list(items)
    top = max(items, default=-1) + 1
    return [k if h is None else top + i for i, (k, h) in enumerate(zip(items, holders))]


def _prefer_holders_of_kind(members: list[int], owners: list[int], holders: Sequence[Sequence[int] | None]) -> None:
    """:func:`prefer_holders`' two steps for the matrices ``members`` of one kind, ``owners`` updated in place."""
    held = [i for i in members if holders[i] is not None]
    if not held:
        return
    room: dict[int, int] = defaultdict(int)
    for i in members:
        room[owners[i]] += 1
    placed: dict[int, int] = {}
    groups: dict[tuple[int, ...], list[int]] = defaultdict(list)
    for i in held:
        groups[tuple(sorted(set(holders[i])))].append(i)
    for ranks in sorted(groups, key=lambda h: (len(h), h)):
        free = (r for r in ranks if room.get(r, 0) > 0)
        rank = next(free, None)
        for i in groups[ranks]:
            while rank is not None and room[rank] == 0:
                rank = next(free, None)
            if rank is None:
                break
            placed[i] = rank
            room[rank] -= 1
    for i in members:  # the rest keep their owner where it has room left (the spreading's choice)
        if i not in placed and room[owners[i]] > 0:
            placed[i] = owners[i]
            room[owners[i]] -= 1
    left = iter([r for r in sorted(room) for _ in range(room[r])])
    for i in members:
        owners[i] = placed[i] if i in placed else next(left)


def prefer_holders(owners: Sequence[int], kinds: Sequence[int],
                   holders: Sequence[Sequence[int] | None]) -> list[int]:
    """Owners with every matrix that some ranks do not hold moved, where the counts allow, to a rank that
    holds rows of it; every rank keeps the count of each kind it was given.

    Per kind, with ``room[r]`` the matrices of the kind rank ``r`` owns:

    1. the held matrices, grouped by holder set, fewest holders first, each group's in plan order to the
       lowest holder with room left (which a matrix's owner was makes no byte of difference: its holders
       are all alike to it; plan order, the earlier blocks first, is what the step model's figures
       were made with);
    2. every other matrix of the kind (held by all ranks, or with no holder left with room) keeps its
       owner where that has room left, and the rest fill the remaining room, lowest rank first.

    Smallest holder sets first is the most matrices on a holder the counts allow wherever the holder sets
    are nested or disjoint (a larger set's matrices can use any of its ranks, a smaller one's only its
    own): expert slices (one efsdp rank, or one ep group's, in every replica) and row chunks (the first
    ``rows`` positions). Either way, after the pass no matrix off its holders could change places with a
    same-kind matrix that a holder of it owns without taking that one off its own holders.

    Args:
        owners: Each matrix's owner (plan ranks).
        kinds: Each matrix's kind (same kind: same shape and cost table, the balancer's key).
        holders: Each matrix's holder ranks (:func:`holder_ranks`), None where every rank holds it.

    Returns:
        New owners; per rank, the count of each kind is unchanged, and a kind none of whose matrices
        has holders keeps its owners as given.
    """
    if not len(owners) == len(kinds) == len(holders):
        raise ValueError("owners, kinds and holders must have one entry per matrix")
    owners = list(owners)
    by_kind: dict[int, list[int]] = defaultdict(list)
    for i, k in enumerate(kinds):
        by_kind[k].append(i)
    for members in by_kind.values():
        _prefer_holders_of_kind(members, owners, holders)
    return owners


def owned_where_held(owners: Sequence[int], holders: Sequence[Sequence[int] | None]) -> tuple[int, int]:
    """``(on a holder, held by some ranks)``: how many of the matrices some ranks do not hold are owned on
    a rank holding rows of them, of how many."""
    partial = [(o, h) for o, h in zip(owners, holders) if h is not None]
    return sum(o in h for o, h in partial), len(partial)
