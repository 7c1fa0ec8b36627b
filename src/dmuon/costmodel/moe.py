"""Mixture-of-experts layouts in the step model: routed experts split over an expert-parallel dim.

The layout is torchtitan's expert parallelism on FSDP2 (or HSDP): every rank reads its own batch;
the dense parameters are sharded over all ``S`` ranks of the shard dim (a node under HSDP, the
replicas holding copies); each routed-expert stack ``(E, m, n)`` is split over an ``ep`` dim with
``Shard(0)`` (torch.chunk's rule: ep rank ``j`` holds the ``j``-th chunk of whole experts), then
``fully_shard``-ed over the other ``efsdp = S / ep`` ranks: on dim 0 of the local stack (whole experts
per rank), or on dim 1 (each expert's rows split) when ``efsdp * ep > E``, as torchtitan's
``parallelize`` chooses. Inside the shard dim the ep ranks are the inner, contiguous ones (torchtitan's
``dp_shard_in_ep``): position ``s`` is ep rank ``s % ep`` and efsdp rank ``s // ep``.

Each expert slice ``(m, n)`` is its own Muon matrix with one owner in the cluster. In the step model a
slice is a matrix whose :class:`~dmuon.plan.plan.Piece` list (one per shard position, as
``MatrixInfo.pieces``) is empty outside the efsdp ranks of its ep group: dmuon's exchange
(:func:`~dmuon.costmodel.rank_traffic.owner_traffic`, the exchange collectives) then moves the slice's
rows from those ranks to the owner and the update back, wherever the owner is. FSDP2's all-gathers and
reduce-scatters of a block's experts run over the efsdp groups (:func:`expert_fsdp2_collective`);
the tokens' all-to-all to the experts and back is the same under every optimizer and is left out of
every strategy alike.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

from dmuon.costmodel.collective import Collective
from dmuon.costmodel.rank_traffic import RankTraffic
from dmuon.plan.layout import shard_rows
from dmuon.plan.plan import Piece


@dataclass(frozen=True)
class ExpertLayout:
    """Routed experts over ``ep`` expert-parallel ranks inside a shard dim of ``shard`` ranks."""

    ep: int
    """Expert-parallel size: ranks the experts of a stack are split over (whole experts each)."""
    shard: int
    """Ranks of the shard dim (FSDP2's, a node under HSDP); ``ep`` divides it."""

    def __post_init__(self) -> None:
        if self.ep < 1 or self.shard < 1 or self.shard % self.ep:
            raise ValueError(f"--ep ({self.ep}) must divide the ranks each parameter is sharded over ({self.shard}: "
                             "--ranks-per-node under HSDP, else --world-size)")

    @property
    def efsdp(self) -> int:
        """Ranks each ep rank's experts are ``fully_shard``-ed over."""
        return self.shard // self.ep

    def whole_experts(self, experts: int) -> bool:
        """Whether FSDP2 shards the local stacks on dim 0 (whole experts per rank): ``efsdp * ep <= E``."""
        return self.efsdp * self.ep <= experts

    def positions(self, ep_rank: int) -> list[int]:
        """The shard positions of ep rank ``ep_rank``'s efsdp group, in efsdp order."""
        return [f * self.ep + ep_rank for f in range(self.efsdp)]

    def slice_pieces(self, shape: Sequence[int], experts: int, expert: int) -> tuple[Piece, ...]:
        """Expert ``expert``'s slice of an ``(experts, *shape)`` stack: what each shard position holds."""
        return _slice_pieces(self.ep, self.shard, int(shape[0]), int(shape[1]), experts, expert)

    def holders(self, shape: Sequence[int], experts: int, expert: int) -> list[int]:
        """The shard positions holding rows of the slice."""
        return [s for s, p in enumerate(self.slice_pieces(shape, experts, expert)) if p.rows]

    def as_dict(self, experts: int) -> dict:
        return {"ep": self.ep, "efsdp": self.efsdp,
                "fsdp_dim": 0 if self.whole_experts(experts) else 1,
                "experts_per_ep_rank": shard_rows(experts, self.ep)}


@functools.lru_cache(maxsize=65536)
def _slice_pieces(ep: int, shard: int, rows: int, cols: int, experts: int, expert: int) -> tuple[Piece, ...]:
    if not 0 <= expert < experts:
        raise ValueError(f"expert {expert} outside a stack of {experts}")
    per_ep = shard_rows(experts, ep)
    ep_rank = next(j for j in range(ep) if sum(per_ep[:j + 1]) > expert)
    local = expert - sum(per_ep[:ep_rank])
    efsdp = shard // ep
    held = {}
    if efsdp * ep <= experts:  # dim 0 of the local stack: whole experts, torch.chunk's rule
        per_rank = shard_rows(per_ep[ep_rank], efsdp)
        f = next(f for f in range(efsdp) if sum(per_rank[:f + 1]) > local)
        held[f * ep + ep_rank] = Piece(0, rows, 0, cols)
    else:  # dim 1: every efsdp rank a chunk of each expert's rows
        for f, count in enumerate(shard_rows(rows, efsdp)):
            held[f * ep + ep_rank] = Piece(sum(shard_rows(rows, efsdp)[:f]), count, 0, cols)
    return tuple(held.get(s, Piece(0, 0, 0, cols)) for s in range(shard))


def expert_fsdp2_collective(op: str, pieces: Sequence[Sequence[Piece]], layout: ExpertLayout, replicate: int, *,
                            phase: str, block: int | None, elem_bytes: int) -> Collective | None:
    """FSDP2's collective of one block's expert unit (its stacks, given as their slices' ``pieces``):

    * ``all_gather`` / ``reduce_scatter``: a ring over each efsdp group (``efsdp - 1`` steps, every step
      one padded shard each way: the largest local shard of the group, FSDP2 pads to it), intra level;
    * ``all_reduce`` (HSDP): each rank's shard with the same position of the other replicas, a ring
      (``2 (R-1)/R`` of it each way, ``2 (R-1)`` steps), inter level.

    None where the group has one rank (``efsdp == 1``: no all-gather or reduce-scatter; one replica: no
    all-reduce) or the block has no expert.
    """
    if not pieces:
        return None
    shard = layout.shard
    local = [sum(p[s].rows * p[s].cols for p in pieces) * elem_bytes for s in range(shard)]
    padded = [max(local[s] for s in layout.positions(s % layout.ep)) for s in range(shard)]
    if op in ("all_gather", "reduce_scatter"):
        steps = layout.efsdp - 1
        if steps == 0:
            return None
        each = [steps * padded[s] for s in range(shard)]
        return Collective(op, "intra", phase, block, [(each[s], each[s]) for _ in range(replicate) for s in range(shard)],
                          steps, f"fsdp2 {op} block {block} experts", f"fsdp_{op}")
    if op == "all_reduce":
        if replicate == 1:
            return None
        each = [2 * (replicate - 1) * padded[s] // replicate for s in range(shard)]
        return Collective(op, "inter", phase, block, [(each[s], each[s]) for _ in range(replicate) for s in range(shard)],
                          2 * (replicate - 1), f"fsdp2 all_reduce block {block} experts", "fsdp_all_reduce")
    raise ValueError(f"unknown FSDP2 collective {op!r}")


def expert_gather_collective(pieces: Sequence[Piece], replicate: int, block: int | None, index: int,
                             elem_bytes: int) -> Collective | None:
    """Gather-then-compute's all-gather of one expert slice's direction over the ranks holding its rows
    (its efsdp group in each replica; a ring of ``holders - 1`` steps of the largest piece, intra level),
    after which each of them runs its NS. None where one rank holds it whole (nothing to gather)."""
    holders = [s for s, p in enumerate(pieces) if p.rows]
    if len(holders) < 2:
        return None
    largest = max(pieces[s].rows * pieces[s].cols for s in holders) * elem_bytes
    each = (len(holders) - 1) * largest
    part = [(each, each) if p.rows else None for p in pieces]
    return Collective("all_gather", "intra", "step", block, part * replicate, len(holders) - 1,
                      f"gather direction {index} (expert)", "gather", index)


def merged(first: Collective | None, second: Collective | None) -> Collective | None:
    """Two collectives one after the other on the same stream as one entry: bytes per rank summed, latency
    steps added (the block's dense unit's and its expert unit's, which FSDP2 issues back to back)."""
    if first is None or second is None:
        return first if second is None else second
    ranks = [None if a is None and b is None else tuple(x + y for x, y in zip(a or (0, 0), b or (0, 0)))
             for a, b in zip(first.ranks, second.ranks)]
    return Collective(first.op, first.level, first.phase, first.block, ranks, first.messages + second.messages,
                      f"{first.label} + experts", first.role, first.index)


def expert_ring_traffic(stacks: Sequence[Sequence[Piece]], layout: ExpertLayout, replicate: int, elem_bytes: int,
                        passes: int) -> RankTraffic:
    """The busiest rank's bytes per step of ``passes`` ring collectives (all-gathers, reduce-scatters) over the
    efsdp groups of the expert slices' pieces (``stacks``), plus HSDP's all-reduce of its shard across
    replicas: :func:`expert_fsdp2_collective`'s bytes summed over one unit holding every stack (the
    per-block padding aside)."""
    shard = layout.shard
    local = [sum(p[s].rows * p[s].cols for p in stacks) * elem_bytes for s in range(shard)]
    padded = max(local, default=0)
    intra = passes * (layout.efsdp - 1) * padded
    inter = 2 * (replicate - 1) * padded // replicate
    return RankTraffic(intra, intra, inter, inter)
