"""Analytical per-rank traffic of dmuon, of gather-then-compute and of FSDP2's own collectives.

dmuon's figures follow the runtime's row-sharded data path message by message
(:func:`owner_traffic`), so they are exact, not estimates: FSDP2 keeps each
matrix sharded by rows (``Shard(0)``) over the shard dimension ``S`` of a
``(replicate R x shard S)`` mesh, and dmuon moves those row shards to and from
each matrix's single owner. FSDP2's own all-gathers and reduce-scatters are not
part of dmuon's traffic (the runtime leaves them to FSDP2, whatever
``reshard_after_forward`` is); :func:`fsdp2_traffic` models them separately so a
plan can put dmuon's exchange next to what FSDP2 moves anyway
(:func:`replicate_all_reduce_traffic` is its inter-node part alone).

On HSDP two replicate-level designs are modelled (``docs/architecture.md``,
"HSDP: which replicate-level design"): design (a), the runtime's, keeps
FSDP2's gradient all-reduce across replicas and adds the update's publication
(:func:`owner_traffic`); design (b), not implemented, applies FSDP2 over the
shard sub-mesh only and reduces each Muon matrix's gradient to its owner's
replica instead (:func:`owner_traffic_replicate_reduce`).
:func:`hsdp_design_traffic` and :func:`compare_hsdp_designs` put the two next
to FSDP2 + AdamW, level by level.

These are whole-step totals per rank; :mod:`dmuon.costmodel.collectives` splits a
step into its collectives. Both are importable from :mod:`dmuon.costmodel.traffic`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Sequence

from dmuon.plan.layout import shard_rows


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


def row_width(shape: Sequence[int]) -> int:
    """Elements per row, ``prod(shape[1:])``: a conv kernel's rows are flattened like a matrix's."""
    return math.prod(int(d) for d in shape[1:])


def piece_table(shape: Sequence[int], shard: int, pieces: Sequence | None = None) -> list[tuple[int, int, bool]]:
    """Per shard position ``(rows, cols, sends)`` of a matrix: what it holds and whether it sends it.

    Default: FSDP2's row chunks (:func:`shard_rows`), full width, every position
    sending its own. ``pieces`` (one :class:`dmuon.plan.Piece` per position, or
    anything with ``rows``, ``cols`` and ``sends``) describes other layouts:
    tensor parallelism's boxes, and copies only the first holder sends.
    """
    cols = int(shape[1]) if len(shape) > 1 else 1
    if pieces is None:
        return [(rows, cols, True) for rows in shard_rows(int(shape[0]), shard)]
    if len(pieces) != shard:
        raise ValueError(f"{len(pieces)} pieces for {shard} shard positions")
    return [(p.rows, p.cols, p.sends) for p in pieces]


def critical_path(traffic: Sequence[RankTraffic]) -> int:
    """The most bytes any one rank sends or receives in a step.

    At scale the step waits for the busiest link, not for the average, so this
    (not the sum over ranks) is the figure to compare between strategies.
    """
    return max((t.busiest for t in traffic), default=0)


def check_mesh(replicate: int, shard: int, elem_bytes: int) -> None:
    """Raises ValueError unless the mesh is at least 1 x 1 and an element at least one byte."""
    if replicate < 1 or shard < 1:
        raise ValueError(f"mesh must be at least 1 x 1, got {replicate} x {shard}")
    if elem_bytes < 1:
        raise ValueError(f"elem_bytes must be >= 1, got {elem_bytes}")


def _add_owner_exchange(out: list[RankTraffic], shape: Sequence[int], owner: int, replicate: int, shard: int,
                        elem_bytes: int, column_slices: bool = True) -> None:
    """Adds one matrix's steps of :func:`owner_traffic`, in bytes, to ``out``.

    ``column_slices=False`` leaves out step 0 (design (b) reduces whole rows to
    the owner's replica instead).
    """
    r_o, s_o = divmod(owner, shard)
    base = r_o * shard
    rows, width = shard_rows(int(shape[0]), shard), row_width(shape)
    cols = int(shape[1]) if len(shape) > 1 else 1
    inner = width // cols if cols else 0
    columns = shard_rows(cols, replicate)
    for s, count in enumerate(rows):
        if column_slices:
            # 0: every other replica's rank (r, s) sends its column slice of the
            # direction to (r_o, s), which joins the R slices into its rows.
            for r in range(replicate):
                if r != r_o:
                    moved = count * columns[r] * inner * elem_bytes
                    out[r * shard + s].inter_sent += moved
                    out[base + s].inter_received += moved
        moved = count * width * elem_bytes
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


def check_owners(shapes: Sequence[Sequence[int]], owners: Sequence[int], replicate: int, shard: int) -> None:
    """Raises ValueError unless there is one owner per shape, each a rank of the mesh."""
    if len(shapes) != len(owners):
        raise ValueError(f"{len(shapes)} shapes but {len(owners)} owners")
    for owner in owners:
        if not 0 <= owner < replicate * shard:
            raise ValueError(f"owner {owner} outside the {replicate} x {shard} mesh")


def owner_traffic(
    shapes: Sequence[Sequence[int]],
    owners: Sequence[int],
    replicate: int,
    shard: int,
    elem_bytes: int = 2,
) -> list[RankTraffic]:
    """dmuon's traffic per plan rank ``r * shard + s`` for one step with every matrix active.

    Per matrix with owner ``o = r_o * shard + s_o``: with ``replicate > 1``
    every ``(r, s)``, ``r != r_o``, first sends the column slice of its rows
    that it keeps the momentum of (``shape[1]`` split over the R replicas) to
    ``(r_o, s)`` (step 0; FSDP2 has already all-reduced the gradient shards
    across replicas, and the momentum is held once in the mesh); the ranks
    ``(r_o, s)``, ``s != s_o``, send their rows to the owner; the owner sends
    each of them its rows of the update; with ``replicate > 1`` every
    ``(r_o, s)`` then sends its rows of the update to ``(r, s)`` for each
    ``r != r_o``. Steps 1-2 are counted on the intra (shard) level, steps 0 and
    3 on the inter (replicate) level; a rank's bytes to itself are not
    traffic. This is HSDP design (a), the runtime's.

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
    check_mesh(replicate, shard, elem_bytes)
    check_owners(shapes, owners, replicate, shard)
    out = [RankTraffic() for _ in range(replicate * shard)]
    for shape, owner in zip(shapes, owners):
        _add_owner_exchange(out, shape, owner, replicate, shard, elem_bytes)
    return out


def owner_traffic_replicate_reduce(
    shapes: Sequence[Sequence[int]],
    owners: Sequence[int],
    replicate: int,
    shard: int,
    elem_bytes: int = 2,
    grad_bytes: int = 4,
) -> list[RankTraffic]:
    """HSDP design (b)'s traffic of the Muon matrices per plan rank, one step, every matrix active.

    Not implemented in the runtime; modelled to compare with design (a)
    (:func:`owner_traffic`). FSDP2 is applied over the shard sub-mesh only, so
    each replica reduce-scatters its own gradients and nothing is all-reduced
    across replicas; dmuon owns the replicate level. Per matrix with owner
    ``o = r_o * shard + s_o``:

    1. every ``(r, s)``, ``r != r_o``, sends its replica's reduced gradient
       rows to ``(r_o, s)`` (inter level, ``grad_bytes`` per element), which
       sums the ``R`` copies: a direct reduce to the owner's replica, so
       ``(r_o, s)`` receives ``(R-1)`` copies of its rows;
    2. ``(r_o, s)``, ``s != s_o``, sends its rows of the direction to the owner
       (intra, ``elem_bytes``), as :func:`owner_traffic`'s step 1;
    3. the owner sends each of them its rows of the update (intra), step 2 there;
    4. every ``(r_o, s)`` sends its rows of the update to ``(r, s)``, ``r != r_o``
       (inter, ``elem_bytes``), step 3 there.

    The non-Muon parameters still need an all-reduce across replicas (FSDP2's
    or one of dmuon's), which this does not count:
    :func:`replicate_all_reduce_traffic` does. Arguments as :func:`owner_traffic`;
    ``grad_bytes`` is the gradient's element size (FSDP2's reduce dtype).

    Raises:
        ValueError: For mismatched lengths, an owner outside the mesh or a bad mesh.
    """
    check_mesh(replicate, shard, elem_bytes)
    if grad_bytes < 1:
        raise ValueError(f"grad_bytes must be >= 1, got {grad_bytes}")
    check_owners(shapes, owners, replicate, shard)
    out = [RankTraffic() for _ in range(replicate * shard)]
    for shape, owner in zip(shapes, owners):
        rows, width = shard_rows(int(shape[0]), shard), row_width(shape)
        r_o = owner // shard
        for s, count in enumerate(rows):
            moved = count * width * grad_bytes
            out[r_o * shard + s].inter_received += (replicate - 1) * moved
            for r in range(replicate):
                if r != r_o:
                    out[r * shard + s].inter_sent += moved
        _add_owner_exchange(out, shape, owner, replicate, shard, elem_bytes, column_slices=False)
    return out


def replicate_all_reduce_traffic(numels: Sequence[int], replicate: int, shard: int,
                                 elem_bytes: int = 4) -> RankTraffic:
    """HSDP's gradient all-reduce across replicas alone, per rank and step (inter level only).

    Each rank all-reduces its ``1/S`` gradient shard with the same shard column
    of the other ``R-1`` replicas; a ring all-reduce moves ``2 (R-1)/R`` of it
    each way per rank, so ``2 (R-1) * numel * elem_bytes`` over all ranks when
    everything divides. Uniform over ranks; uneven shards' padding is not counted.
    This is :func:`fsdp2_traffic`'s inter-node part.
    """
    check_mesh(replicate, shard, elem_bytes)
    inter = 2 * (sum(numels) // shard) * (replicate - 1) // replicate * elem_bytes
    return RankTraffic(0, 0, inter, inter)


def _ring_traffic(numels: Sequence[int], replicate: int, shard: int, elem_bytes: int, passes: int) -> RankTraffic:
    """``passes`` ring collectives over the shard level plus the HSDP gradient all-reduce.

    A ring all-gather or reduce-scatter moves ``(S-1)/S`` of the tensor each way
    per rank; the all-reduce is :func:`replicate_all_reduce_traffic`. Uniform over ranks.
    """
    check_mesh(replicate, shard, elem_bytes)
    intra = passes * sum(numels) * (shard - 1) // shard * elem_bytes
    inter = replicate_all_reduce_traffic(numels, replicate, shard, elem_bytes).inter_sent
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


HSDP_DESIGNS: tuple[str, ...] = ("fsdp2_adamw", "a", "b")
"""Keys of :func:`hsdp_design_traffic`: FSDP2 + AdamW, design (a) (the runtime's), design (b)."""


def _plus(t: Sequence[RankTraffic], u: RankTraffic) -> list[RankTraffic]:
    return [RankTraffic(*(x + y for x, y in zip(asdict(a).values(), asdict(u).values()))) for a in t]


def hsdp_design_traffic(
    shapes: Sequence[Sequence[int]],
    owners: Sequence[int],
    replicate: int,
    shard: int,
    elem_bytes: int = 2,
    grad_bytes: int = 4,
    reshard_after_forward: bool = True,
) -> dict[str, list[RankTraffic]]:
    """Everything the Muon matrices move per rank and step under each HSDP design, both levels.

    * ``"fsdp2_adamw"``: FSDP2's collectives alone (:func:`fsdp2_traffic`, in
      ``grad_bytes``), as with AdamW: the all-gathers and reduce-scatter inside
      each replica and the gradient all-reduce across replicas.
    * ``"a"``: the same plus dmuon's exchange (:func:`owner_traffic`).
    * ``"b"``: FSDP2 over the shard sub-mesh (its intra-level collectives, no
      all-reduce) plus :func:`owner_traffic_replicate_reduce`.

    The intra level of (a) and (b) is the same; only the inter level differs.
    The non-Muon parameters' all-reduce is the same under every design and not
    included (:func:`compare_hsdp_designs` adds it). Arguments as
    :func:`owner_traffic_replicate_reduce`; ``grad_bytes`` is also FSDP2's
    parameter element size here.
    """
    numels = [math.prod(int(d) for d in shape) for shape in shapes]
    fsdp2 = fsdp2_traffic(numels, replicate, shard, grad_bytes, reshard_after_forward)
    within = RankTraffic(fsdp2.intra_sent, fsdp2.intra_received, 0, 0)
    world = replicate * shard
    return {
        "fsdp2_adamw": [RankTraffic(**fsdp2.as_dict()) for _ in range(world)],
        "a": _plus(owner_traffic(shapes, owners, replicate, shard, elem_bytes), fsdp2),
        "b": _plus(owner_traffic_replicate_reduce(shapes, owners, replicate, shard, elem_bytes, grad_bytes), within),
    }


def level_figures(traffic: Sequence[RankTraffic], level: str) -> dict:
    """``total`` (bytes sent over all ranks, equal to bytes received) and ``critical``
    (the most bytes one rank sends or receives) on ``level``, ``"intra"`` or ``"inter"``."""
    if level not in ("intra", "inter"):
        raise ValueError(f"level must be 'intra' or 'inter', got {level!r}")
    sent = [getattr(t, f"{level}_sent") for t in traffic]
    received = [getattr(t, f"{level}_received") for t in traffic]
    return {"total": sum(sent), "critical": max(max(sent, default=0), max(received, default=0))}


def compare_hsdp_designs(
    shapes: Sequence[Sequence[int]],
    owners: Sequence[int],
    replicate: int,
    shard: int,
    elem_bytes: int = 2,
    grad_bytes: int = 4,
    reshard_after_forward: bool = True,
    other_numels: Sequence[int] = (),
) -> dict:
    """The per-level figures of :func:`hsdp_design_traffic`, JSON-ready.

    Returns:
        ``{design: {"inter": {...}, "intra": {...}, "inter_whole_model": {...}}}``
        for each of :data:`HSDP_DESIGNS`, each ``{...}`` being
        :func:`level_figures`' ``total`` and ``critical``: ``inter`` and
        ``intra`` for the Muon matrices, ``inter_whole_model`` with the
        all-reduce of ``other_numels`` (the non-Muon parameters, in
        ``grad_bytes``, the same under every design) added; plus
        ``"non_muon_all_reduce"``, that all-reduce's own inter figures.
    """
    designs = hsdp_design_traffic(shapes, owners, replicate, shard, elem_bytes, grad_bytes, reshard_after_forward)
    rest = replicate_all_reduce_traffic(other_numels, replicate, shard, grad_bytes)
    out: dict = {}
    for name, traffic in designs.items():
        out[name] = {"inter": level_figures(traffic, "inter"), "intra": level_figures(traffic, "intra"),
                     "inter_whole_model": level_figures(_plus(traffic, rest), "inter")}
    out["non_muon_all_reduce"] = level_figures([rest] * (replicate * shard), "inter")
    return out
