"""How each return wave's updates reach every rank under torch's ``DistributedDataParallel``
(:mod:`dmuon.runtime.ddp`): every rank holds every matrix whole, so each owner's updates go to all of
them. Pure functions of the owners' shares, so every rank decides alike; the runtime issues the route's hops,
:mod:`dmuon.costmodel` prices them.
"""

from __future__ import annotations

from typing import Sequence


def owner_shares(numels: Sequence[int], owners: Sequence[int], world: int, members) -> list[int]:
    """Each rank's elements among the matrices ``members`` (``numels[i]`` elements, owned by ``owners[i]``): the
    updates it sends in the wave."""
    share = [0] * world
    for i in members:
        share[owners[i]] += numels[i]
    return share


def scatter_parts(shares: Sequence[int]) -> tuple[list[list[int]], int]:
    """The scatter route's first hop under torch's DDP (:mod:`dmuon.runtime.ddp`): the wave's updates laid
    end to end, owner after owner in rank order (``shares[r]`` elements each), cut in ``N`` chunks of
    ``ceil(total / N)``; ``parts[a][b]`` is how much of owner ``a``'s updates falls in chunk ``b`` (what rank ``a``
    sends rank ``b``). Returns ``(parts, chunk)``."""
    world, total = len(shares), sum(shares)
    chunk = -(-total // world) if world else 0
    parts = [[0] * world for _ in range(world)]
    start = 0
    for a, share in enumerate(shares):
        for b in range(world):
            low, high = max(start, b * chunk), min(start + share, (b + 1) * chunk)
            parts[a][b] = max(0, high - low)
        start += share
    return parts, chunk


def ddp_hops(shares: Sequence[int], elem_bytes: int = 2) -> tuple[str, list[list[tuple[int, int]]]]:
    """How one wave of owners' updates reaches every rank under torch's DDP, from each rank's share of the
    wave's elements (every rank decides alike, from the plan), and each hop's ``(sent, received)`` bytes per rank:

    * ``"all_gather"``: one all-gather, each share padded to the largest: ``(N-1) * max(shares)`` each way;
    * ``"scatter"``: an all-to-all evening the updates out over the ranks (:func:`scatter_parts`), then an
      all-gather of the even chunks: about ``(N-1)/N * (share + total)`` through the busiest rank.

    The all-gather where it moves no more through the busiest rank (even shares), the scatter where padding
    would cost more (uneven owners; more ranks than matrices, where the largest matrix would be padded ``N - 1``
    times). Either route is at most two collectives, whatever ``N``.
    """
    world = len(shares)
    gather = (world - 1) * max(shares, default=0) * elem_bytes
    direct = [[(gather, gather)] * world]
    parts, chunk = scatter_parts(shares)
    spread = [(sum(parts[k]) - parts[k][k]) * elem_bytes for k in range(world)]
    taken = [(sum(parts[a][k] for a in range(world)) - parts[k][k]) * elem_bytes for k in range(world)]
    even = (world - 1) * chunk * elem_bytes
    scattered = [list(zip(spread, taken)), [(even, even)] * world]

    def busiest(hops):
        return max(max(sum(h[k][0] for h in hops), sum(h[k][1] for h in hops)) for k in range(world))

    return ("all_gather", direct) if busiest(direct) <= busiest(scattered) else ("scatter", scattered)


def ddp_route(shares: Sequence[int]) -> str:
    """:func:`ddp_hops`' route for a wave with these owner shares."""
    return ddp_hops(shares)[0]
