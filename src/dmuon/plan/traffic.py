"""Analytical per-rank traffic of dmuon, of gather-then-compute and of FSDP2's own collectives.

dmuon's figures follow the runtime's row-sharded data path message by message
(:func:`owner_traffic`), so they are exact, not estimates: FSDP2 keeps each
matrix sharded by rows (``Shard(0)``) over the shard dimension ``S`` of a
``(replicate R x shard S)`` mesh, and dmuon moves those row shards to and from
each matrix's single owner. FSDP2's own all-gathers and reduce-scatters are not
part of dmuon's traffic (the runtime leaves them to FSDP2, whatever
``reshard_after_forward`` is); :func:`fsdp2_traffic` models them separately so a
plan can put dmuon's exchange next to what FSDP2 moves anyway.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Sequence


@dataclass
class RankTraffic:
    """Bytes one rank moves per training step, split by network level."""

    intra_sent: int = 0
    """Sent on the shard (intra-node) level."""
    intra_received: int = 0
    """Received on the shard level."""
    inter_sent: int = 0
    """Sent on the replicate (inter-node) level."""
    inter_received: int = 0
    """Received on the replicate level."""

    @property
    def sent(self) -> int:
        return self.intra_sent + self.inter_sent

    @property
    def received(self) -> int:
        return self.intra_received + self.inter_received

    @property
    def busiest(self) -> int:
        """The larger direction: a full-duplex link is busy for this many bytes."""
        return max(self.sent, self.received)

    def as_dict(self) -> dict:
        return asdict(self)


def shard_rows(m: int, shard: int) -> list[int]:
    """Rows of an ``m``-row matrix on each of ``shard`` columns, by ``torch.chunk``'s rule.

    FSDP2's ``Shard(0)`` gives every column ``ceil(m / shard)`` rows until the
    rows run out, so trailing columns may hold fewer rows, or none.
    """
    if shard < 1:
        raise ValueError(f"shard must be >= 1, got {shard}")
    if m < 0:
        raise ValueError(f"rows must be >= 0, got {m}")
    chunk = -(-m // shard)
    return [max(0, min(m, (s + 1) * chunk) - s * chunk) for s in range(shard)]


def row_width(shape: Sequence[int]) -> int:
    """Elements per row, ``prod(shape[1:])``: a conv kernel's rows are flattened like a matrix's."""
    return math.prod(int(d) for d in shape[1:])


def critical_path(traffic: Sequence[RankTraffic]) -> int:
    """The most bytes any one rank sends or receives in a step.

    At scale the step waits for the busiest link, not for the average, so this
    (not the sum over ranks) is the figure to compare between strategies.
    """
    return max((t.busiest for t in traffic), default=0)


def _check_mesh(replicate: int, shard: int, elem_bytes: int) -> None:
    if replicate < 1 or shard < 1:
        raise ValueError(f"mesh must be at least 1 x 1, got {replicate} x {shard}")
    if elem_bytes < 1:
        raise ValueError(f"elem_bytes must be >= 1, got {elem_bytes}")


def _add_owner_exchange(out: list[RankTraffic], rows: list[int], width: int, owner: int,
                        replicate: int, shard: int) -> None:
    """Adds one matrix's three steps, in elements, to ``out``."""
    r_o, s_o = divmod(owner, shard)
    base = r_o * shard
    for s, count in enumerate(rows):
        moved = count * width
        if s != s_o:
            # 1: the owner's replica sends its row shards to the owner;
            # 2: the owner sends each shard's rows of the update back.
            peer, own = out[base + s], out[owner]
            peer.intra_sent += moved
            own.intra_received += moved
            own.intra_sent += moved
            peer.intra_received += moved
        # 3: every rank of the owner's replica (the owner too) forwards its rows
        # of the update to the same shard column of every other replica.
        out[base + s].inter_sent += (replicate - 1) * moved
        for r in range(replicate):
            if r != r_o:
                out[r * shard + s].inter_received += moved


def owner_traffic(
    shapes: Sequence[Sequence[int]],
    owners: Sequence[int],
    replicate: int,
    shard: int,
    elem_bytes: int = 2,
) -> list[RankTraffic]:
    """dmuon's traffic per plan rank ``r * shard + s`` for one step with every matrix active.

    Per matrix with owner ``o = r_o * shard + s_o``: the ranks ``(r_o, s)``,
    ``s != s_o``, send their rows to the owner; the owner sends each of them its
    rows of the update; with ``replicate > 1`` every ``(r_o, s)`` then sends its
    rows of the update to ``(r, s)`` for each ``r != r_o``. Other replicas send
    nothing: FSDP2 has already all-reduced the gradient shards across them.
    Steps 1-2 are counted on the intra (shard) level, step 3 on the inter
    (replicate) level; a rank's bytes to itself are not traffic.

    Args:
        shapes: Full parameter shapes; rows are ``shape[0]``, a row is
            ``prod(shape[1:])`` elements.
        owners: Plan rank owning each matrix.
        replicate: ``R``, replicas (1 for 1-D FSDP).
        shard: ``S``, ranks each matrix is row-sharded over.
        elem_bytes: Bytes per element on the wire (the NS dtype: 2 for bf16, 4 for fp32).

    Raises:
        ValueError: For mismatched lengths, an owner outside the mesh or a bad mesh.
    """
    _check_mesh(replicate, shard, elem_bytes)
    if len(shapes) != len(owners):
        raise ValueError(f"{len(shapes)} shapes but {len(owners)} owners")
    world = replicate * shard
    out = [RankTraffic() for _ in range(world)]
    for shape, owner in zip(shapes, owners):
        if not 0 <= owner < world:
            raise ValueError(f"owner {owner} outside the {replicate} x {shard} mesh")
        _add_owner_exchange(out, shard_rows(int(shape[0]), shard), row_width(shape), owner, replicate, shard)
    return [RankTraffic(*(v * elem_bytes for v in asdict(t).values())) for t in out]


def _ring_traffic(numels: Sequence[int], replicate: int, shard: int, elem_bytes: int, passes: int) -> RankTraffic:
    """``passes`` ring collectives over the shard level plus the HSDP gradient all-reduce.

    A ring all-gather or reduce-scatter moves ``(S-1)/S`` of the tensor each way
    per rank; a ring all-reduce of the ``1/S`` gradient shard across ``R``
    replicas moves ``2 (R-1)/R`` of it each way. Uniform over ranks.
    """
    _check_mesh(replicate, shard, elem_bytes)
    total = sum(numels)
    intra = passes * total * (shard - 1) // shard * elem_bytes
    inter = 2 * (total // shard) * (replicate - 1) // replicate * elem_bytes
    return RankTraffic(intra, intra, inter, inter)


def fsdp2_traffic(
    numels: Sequence[int],
    replicate: int,
    shard: int,
    elem_bytes: int = 4,
    reshard_after_forward: bool = True,
) -> RankTraffic:
    """FSDP2's own collectives for the same matrices, per rank and step (paid with any optimizer).

    Weights are all-gathered for forward, and again for backward when
    ``reshard_after_forward`` (ZeRO-3 style), and gradients reduce-scattered;
    HSDP adds the gradient shard's all-reduce across replicas. Uneven shards'
    padding (under ``S`` rows per matrix) is not counted.
    """
    return _ring_traffic(numels, replicate, shard, elem_bytes, 3 if reshard_after_forward else 2)


def gather_traffic(
    numels: Sequence[int],
    replicate: int,
    shard: int,
    elem_bytes: int = 4,
    reshard_after_forward: bool = True,
) -> RankTraffic:
    """Gather-then-compute on FSDP2/HSDP for the same matrices, per rank and step.

    FSDP2's own collectives (:func:`fsdp2_traffic`) plus the all-gather of every
    update direction for NS, within a replica: with ``reshard_after_forward``
    four ring passes of (S-1)/S each. Across replicas only the gradient shard's
    all-reduce (the directions are already replicated there).
    """
    return _ring_traffic(numels, replicate, shard, elem_bytes, 4 if reshard_after_forward else 3)
