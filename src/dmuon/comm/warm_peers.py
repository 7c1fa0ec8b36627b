"""Which peers each rank's all-to-alls talk to on each of dmuon's groups, from the plan alone.

:meth:`dmuon.comm.topology.Topology.warm_up` sends one element to exactly these peers (zero to the
others) on each group, so that the group's communicator, and the peer connections dmuon's
exchanges use, exist before the first backward. Every rank computes the same sets (they depend on
the plan's owners and pieces only), so the counts of every warm-up all-to-all match on both sides.

A pair ``(a, b)`` is in a group's set when some collective of the plan sends a non-empty segment
from member ``a`` to member ``b`` (members numbered in the group: shard position ``s`` in a
replica's shard group, replica ``r`` in a shard position's replicate group; a rank's segment to
itself is no peer). The collectives, as :mod:`dmuon.comm.directions`, :mod:`dmuon.comm.returns` and
:mod:`dmuon.comm.replicate` issue them:

* hop B (shard group of the owner's replica): every position whose piece it sends to the owner;
* hop 1 of the returns (the same group): the owner to every position holding rows of the matrix;
* hop A (replicate group of each position): every replica to the owner's, its column slice;
* the replicate level (``hsdp_mesh``): each position's gradient column slices to every other replica;
* hop 2 of the returns (replicate groups): the direct route, the owner's replica to every other; the
  scatter route, that too and every non-owner replica to every other non-owner replica. The route is
  chosen per return wave (:func:`dmuon.plan.publication.choose_route`), so both count unless forced;
* the step's agreement riding the return (``agreement_in_returns``: one return wave and launches
  from backward, :meth:`dmuon.runtime.settle.StepSettler._speculate`): its flags go to every member
  of every shard and replicate group, so those sets are every pair.
"""

from __future__ import annotations

from typing import Sequence

from dmuon.plan.layout import position
from dmuon.plan.plan import MatrixInfo
from dmuon.plan.publication import DIRECT, SCATTER

Pairs = frozenset[tuple[int, int]]
"""Directed ``(sender, receiver)`` pairs of members of one group."""


def exchange_pairs(infos: Sequence[MatrixInfo], replicate: int, shard: int, *, replicate_level: bool = False,
                   agreement_in_returns: bool = False, publication: str | None = None) -> dict[tuple[str, int], Pairs]:
    """The pairs each of dmuon's all-to-all groups carries traffic between (module docstring).

    Returns:
        ``{("intra", r): pairs of shard positions in replica r's shard group,
        ("inter", s): pairs of replicas in position s's replicate group}`` (the latter only with
        ``replicate > 1``); a group with one member has no pairs.
    """
    intra: dict[int, set[tuple[int, int]]] = {r: set() for r in range(replicate)}
    inter: dict[int, set[tuple[int, int]]] = {s: set() for s in range(shard)} if replicate > 1 else {}
    everyone_s = {(a, b) for a in range(shard) for b in range(shard) if a != b}
    everyone_r = {(a, b) for a in range(replicate) for b in range(replicate) if a != b}
    for info in infos:
        q, c = position(info.owner, shard)
        for s, piece in enumerate(info.pieces):
            if not piece.rows:
                continue
            if s != c:
                if piece.sends:
                    intra[q].add((s, c))  # hop B: the piece to its owner
                intra[q].add((c, s))  # hop 1: the owner's update rows back
            if replicate == 1:
                continue
            columns = info.replica_columns(s)
            if piece.sends:
                # Hop A: each other replica's column slice to the owner's replica (none where it keeps no column).
                inter[s].update((r, q) for r in range(replicate) if r != q and columns[r])
            if replicate_level:
                # The gradient's column slice q from every other replica to replica q (copies too).
                inter[s].update((r, d) for r in range(replicate) for d in range(replicate) if r != d and columns[d])
            if publication != SCATTER:  # direct: the owner replica's whole piece to every other
                inter[s].update((q, r) for r in range(replicate) if r != q)
            if publication != DIRECT:  # scatter: part r to replica r, then the parts among the non-owners
                inter[s].update((q, r) for r in range(replicate) if r != q)
                inter[s].update((a, b) for a in range(replicate) for b in range(replicate)
                                if a != b and q not in (a, b))
    if agreement_in_returns:
        intra = {r: everyone_s for r in intra}
        inter = {s: everyone_r for s in inter}
    out: dict[tuple[str, int], Pairs] = {("intra", r): frozenset(p) for r, p in intra.items()}
    out.update({("inter", s): frozenset(p) for s, p in inter.items()})
    return out


def warm_splits(pairs: Pairs, size: int, me: int) -> tuple[list[int], list[int]]:
    """Member ``me``'s ``(send, receive)`` split sizes of the warm-up all-to-all on a group of ``size``
    with ``pairs``: one element to each peer it sends to, one from each peer that sends to it (what
    every peer's own splits say, so both sides agree)."""
    send = [int((me, b) in pairs) for b in range(size)]
    receive = [int((a, me) in pairs) for a in range(size)]
    return send, receive
