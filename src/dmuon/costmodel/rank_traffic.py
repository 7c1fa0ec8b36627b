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
"HSDP: which replicate-level design"): native HSDP keeps FSDP2's native
gradient all-reduce across replicas and adds the direction's column slices
to the owner's replica and the update's publication (:func:`owner_traffic`);
the replicate level, the runtime's, applies FSDP2 over the shard sub-mesh only and
reduce-scatters each Muon matrix's gradient column slices across replicas
instead of the all-reduce, then exchanges as native HSDP does
(:func:`owner_traffic_column_reduce`). :func:`hsdp_design_traffic` and
:func:`compare_hsdp_designs` put the two next to FSDP2 + AdamW, level by
level.

These are whole-step totals per rank; :mod:`dmuon.costmodel.collectives` splits a
step into its collectives. Both are importable from :mod:`dmuon.costmodel.traffic`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Sequence

from dmuon.plan.layout import position, shard_rows
from dmuon.plan.publication import Published, choose_route, route_stages
from dmuon.plan.ddp import owner_shares, ddp_hops


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
                        elem_bytes: int, table: Sequence[tuple[int, int, bool]],
                        grad_bytes: int | None = None) -> None:
    """Adds one matrix's steps 0-2 of :func:`owner_traffic`, in bytes, to ``out`` (step 3 is per
    return wave: :func:`_add_publication`).

    ``table`` is :func:`piece_table`'s. ``grad_bytes`` adds the replicate level's step
    0b first (:func:`owner_traffic_column_reduce`): the gradient's column
    slices reduce-scattered across replicas.
    """
    r_o, s_o = position(owner, shard)
    base = r_o * shard
    inner = math.prod(int(d) for d in shape[2:])
    for s, (count, cols, sends) in enumerate(table):
        columns = shard_rows(cols, replicate)
        if grad_bytes is not None and replicate > 1:
            # 0b: every (r, s) sends column slice q of its piece of the gradient to (q, s),
            # q != r (copies too), and receives R - 1 copies of its own slice r.
            whole = count * cols * inner * grad_bytes
            for r in range(replicate):
                mine = count * columns[r] * inner * grad_bytes
                out[r * shard + s].inter_sent += whole - mine
                out[r * shard + s].inter_received += (replicate - 1) * mine
        if sends:
            # 0: every other replica's rank (r, s) sends its column slice of the
            # direction to (r_o, s), which joins the R slices into its piece.
            for r in range(replicate):
                if r != r_o:
                    moved = count * columns[r] * inner * elem_bytes
                    out[r * shard + s].inter_sent += moved
                    out[base + s].inter_received += moved
        moved = count * cols * inner * elem_bytes
        if s != s_o:
            # 1: the owner's replica sends its pieces to the owner (a copy does not);
            # 2: the owner sends each position its piece of the update.
            peer, own = out[base + s], out[owner]
            if sends:
                peer.intra_sent += moved
                own.intra_received += moved
            own.intra_sent += moved
            peer.intra_received += moved


def published_wave(wave: Sequence[int], owners: Sequence[int], shard: int,
                   tables: Sequence[Sequence[tuple[int, int, bool]]], inner: Sequence[int]) -> list[Published]:
    """A return wave's matrices as :mod:`dmuon.plan.publication` takes them, from :func:`piece_table`'s
    tables and each matrix's elements per column (``inner``)."""
    return [Published(owners[i] // shard, tuple((rows, cols) for rows, cols, _ in tables[i]), inner[i])
            for i in wave]


def _add_publication(out: list[RankTraffic], wave: Sequence[int], owners: Sequence[int], replicate: int,
                     shard: int, elem_bytes: int, tables, inner: Sequence[int]) -> None:
    """Adds step 3 of one return wave, by the route the runtime picks for it (inter level)."""
    published = published_wave(wave, owners, shard, tables, inner)
    route = choose_route(published, replicate, shard, elem_bytes)
    for stage in route_stages(route, published, replicate, shard, elem_bytes):
        for k, t in enumerate(out):
            t.inter_sent += stage.sent[k]
            t.inter_received += stage.received[k]


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
    pieces: Sequence[Sequence] | None = None,
    waves: Sequence[Sequence[int]] | None = None,
) -> list[RankTraffic]:
    """dmuon's traffic per plan rank ``r * shard + s`` for one step with every matrix active.

    Per matrix with owner ``o = r_o * shard + s_o``: with ``replicate > 1``
    every ``(r, s)``, ``r != r_o``, first sends the column slice of its rows
    that it keeps the momentum of (``shape[1]`` split over the R replicas) to
    ``(r_o, s)`` (step 0; the momentum is held once in the mesh, and the
    gradient's slice has been reduced across replicas: by FSDP2's all-reduce
    in native HSDP, by dmuon's column reduce-scatter in the replicate level,
    :func:`owner_traffic_column_reduce`); the ranks
    ``(r_o, s)``, ``s != s_o``, send their rows to the owner; the owner sends
    each of them its rows of the update; with ``replicate > 1`` the update's
    rows then reach the other replicas (step 3), per return wave by the route
    the runtime picks (:mod:`dmuon.plan.publication`): directly, every
    ``(r_o, s)`` sending its rows to ``(r, s)`` for each ``r != r_o``, or by
    a scatter of the parts and their all-gather (the same bytes over all
    ranks, spread more evenly). Steps 1-2 are counted on the intra (shard) level, steps 0 and
    3 on the inter (replicate) level; a rank's bytes to itself are not
    traffic. This is native HSDP's exchange, and the replicate level's after its
    column reduce-scatter; with one replica, dmuon's whole exchange.

    Args:
        shapes: Full parameter shapes; rows are ``shape[0]``, a row is
            ``prod(shape[1:])`` elements.
        owners: Plan rank owning each matrix.
        replicate: ``R``, replicas (1 for 1-D FSDP).
        shard: ``S``, ranks each matrix is row-sharded over.
        elem_bytes: Bytes per element on the wire (the NS dtype: 2 for bf16, 4 for fp32).
        pieces: Per matrix, one :class:`dmuon.plan.Piece` per shard position
            (``MatrixInfo.pieces``) for layouts other than FSDP2's full-width
            row chunks (:func:`piece_table`): then "rows" above are each
            position's piece, columns split over the replicas are the piece's,
            and a copy (``sends`` False) sends nothing towards the owner but
            gets the update. None: FSDP2's row chunks.
        waves: The return waves (matrix indices), as
            :func:`~dmuon.costmodel.collectives.owner_exchange_collectives`
            takes them; the route of step 3 is chosen per wave. None: one wave.

    Raises:
        ValueError: For mismatched lengths, an owner outside the mesh or a bad mesh.
    """
    return _owner_exchange(shapes, owners, replicate, shard, elem_bytes, None, pieces, waves)


def _owner_exchange(shapes, owners, replicate, shard, elem_bytes, grad_bytes, pieces, waves) -> list[RankTraffic]:
    check_mesh(replicate, shard, elem_bytes)
    check_owners(shapes, owners, replicate, shard)
    if pieces is not None and len(pieces) != len(shapes):
        raise ValueError(f"{len(shapes)} shapes but {len(pieces)} piece lists")
    out = [RankTraffic() for _ in range(replicate * shard)]
    tables = [piece_table(shape, shard, None if pieces is None else pieces[i]) for i, shape in enumerate(shapes)]
    for i, (shape, owner) in enumerate(zip(shapes, owners)):
        _add_owner_exchange(out, shape, owner, replicate, shard, elem_bytes, tables[i], grad_bytes)
    if replicate > 1:
        inner = [math.prod(int(d) for d in shape[2:]) for shape in shapes]
        for wave in [range(len(shapes))] if waves is None else waves:
            if wave:
                _add_publication(out, list(wave), owners, replicate, shard, elem_bytes, tables, inner)
    return out


def owner_traffic_column_reduce(
    shapes: Sequence[Sequence[int]],
    owners: Sequence[int],
    replicate: int,
    shard: int,
    elem_bytes: int = 2,
    grad_bytes: int = 4,
    pieces: Sequence[Sequence] | None = None,
    waves: Sequence[Sequence[int]] | None = None,
) -> list[RankTraffic]:
    """The replicate level's traffic of the Muon matrices per plan rank, one step, every matrix active.

    The runtime's design on HSDP: FSDP2 is applied over the shard sub-mesh
    only, so each replica reduce-scatters its own gradients and FSDP2
    all-reduces nothing across replicas; dmuon owns the replicate level. Per
    matrix with owner ``o = r_o * shard + s_o``, :func:`owner_traffic`'s
    steps preceded by one:

    0b. every ``(r, s)`` splits the columns of its piece of the gradient into
        ``R`` slices (``shard_rows(cols, R)``, ``MatrixInfo.replica_columns``)
        and sends slice ``q`` to ``(q, s)`` for every ``q != r`` (inter level,
        ``grad_bytes`` per element; every holder of the piece sends, TP copies
        too); ``(r, s)`` sums the ``R - 1`` copies of slice ``r`` it receives
        into its own: a reduce-scatter of the column slices, after which it
        holds the replica-reduced slice ``r``, where its momentum lives;
    0.  hop A: every ``(r, s)``, ``r != r_o``, sends its column slice of the
        direction to ``(r_o, s)`` (inter, ``elem_bytes``);
    1.  hop B: ``(r_o, s)``, ``s != s_o``, sends its piece of the direction to
        the owner (intra);
    2.  the owner sends each of them its piece of the update (intra);
    3.  the update's pieces reach the other replicas (inter), per return wave
        by the route the runtime picks (:func:`owner_traffic`).

    Step 0b moves ``(R-1)/R`` of each rank's piece each way (exactly: it sends
    its piece less slice ``r`` and receives ``R-1`` slices ``r``), half the
    ring all-reduce's ``2 (R-1)/R``. The non-Muon parameters still need an
    all-reduce across replicas (issued by dmuon under this design, the same
    bytes as FSDP2's), which this does not count:
    :func:`replicate_all_reduce_traffic` does. Arguments as
    :func:`owner_traffic`; ``grad_bytes`` is the gradient's element size
    (FSDP2's reduce dtype). With one replica this is :func:`owner_traffic`.

    Raises:
        ValueError: For mismatched lengths, an owner outside the mesh or a bad mesh.
    """
    if grad_bytes < 1:
        raise ValueError(f"grad_bytes must be >= 1, got {grad_bytes}")
    return _owner_exchange(shapes, owners, replicate, shard, elem_bytes, grad_bytes, pieces, waves)


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
"""Keys of :func:`hsdp_design_traffic`: FSDP2 + AdamW, native HSDP (FSDP2's native HSDP
all-reduce: ``step_comm``'s ``"dmuon_native_hsdp"``), the replicate level (the runtime's on HSDP:
``step_comm``'s ``"dmuon"``); with one rank per replica also ``"ddp"``, torch's DistributedDataParallel
with dmuon (:func:`ddp_collectives` after DDP's all-reduce)."""


def ddp_collectives(shapes: Sequence[Sequence[int]], owners: Sequence[int], world: int,
                        waves: Sequence[Sequence[int]] | None = None, elem_bytes: int = 2,
                        rank: int = 0) -> list[tuple[int, int]]:
    """dmuon under torch's ``DistributedDataParallel`` (:mod:`dmuon.runtime.ddp`): ``(sent, received)``
    bytes of ``rank`` in each collective of a step, wave by wave (``waves``: matrix indices; None: one wave
    of every matrix), each wave's hops by :func:`ddp_hops`, in order."""
    if world == 1:
        return []
    numels = [math.prod(int(d) for d in shape) for shape in shapes]
    out = []
    for wave in (waves if waves is not None else [range(len(shapes))]):
        out.extend(hop[rank] for hop in ddp_hops(owner_shares(numels, owners, world, wave), elem_bytes)[1])
    return out


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
    waves: Sequence[Sequence[int]] | None = None,
) -> dict[str, list[RankTraffic]]:
    """Everything the Muon matrices move per rank and step under each HSDP design, both levels.

    * ``"fsdp2_adamw"``: FSDP2's collectives alone (:func:`fsdp2_traffic`, in
      ``grad_bytes``), as with AdamW: the all-gathers and reduce-scatter inside
      each replica and the gradient all-reduce across replicas.
    * ``"a"``: the same plus dmuon's exchange (:func:`owner_traffic`).
    * ``"b"``: FSDP2 over the shard sub-mesh (its intra-level collectives, no
      all-reduce) plus :func:`owner_traffic_column_reduce` (the gradient's
      column slices reduce-scattered across replicas, then (a)'s exchange).

    The intra level of (a) and (b) is the same; only the inter level differs.
    The non-Muon parameters' all-reduce is the same under every design
    (FSDP2's under (a), dmuon's under (b)) and not included
    (:func:`compare_hsdp_designs` adds it). Arguments as
    :func:`owner_traffic_column_reduce` (``waves``: dmuon's return waves, whose
    routes across replicas it picks per wave); ``grad_bytes`` is also FSDP2's
    parameter element size here.
    """
    numels = [math.prod(int(d) for d in shape) for shape in shapes]
    fsdp2 = fsdp2_traffic(numels, replicate, shard, grad_bytes, reshard_after_forward)
    within = RankTraffic(fsdp2.intra_sent, fsdp2.intra_received, 0, 0)
    world = replicate * shard
    out = {
        "fsdp2_adamw": [RankTraffic(**fsdp2.as_dict()) for _ in range(world)],
        "a": _plus(owner_traffic(shapes, owners, replicate, shard, elem_bytes, waves=waves), fsdp2),
        "b": _plus(owner_traffic_column_reduce(shapes, owners, replicate, shard, elem_bytes, grad_bytes, waves=waves),
                   within),
    }
    if shard == 1:  # one rank per replica: torch's DDP, its all-reduce, then dmuon's updates to every rank
        published = [[sum(c) for c in zip(*ddp_collectives(shapes, owners, world, waves, elem_bytes, r))]
                     or [0, 0] for r in range(world)]
        out["ddp"] = [_plus([RankTraffic(0, 0, *p)], fsdp2)[0] for p in published]
    return out


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
    waves: Sequence[Sequence[int]] | None = None,
) -> dict:
    """The per-level figures of :func:`hsdp_design_traffic` (the same arguments), JSON-ready.

    Returns:
        ``{design: {"inter": {...}, "intra": {...}, "inter_whole_model": {...}}}``
        for each of :data:`HSDP_DESIGNS`, each ``{...}`` being
        :func:`level_figures`' ``total`` and ``critical``: ``inter`` and
        ``intra`` for the Muon matrices, ``inter_whole_model`` with the
        all-reduce of ``other_numels`` (the non-Muon parameters, in
        ``grad_bytes``, the same under every design: FSDP2 issues it under
        (a), dmuon under (b)) added; plus
        ``"non_muon_all_reduce"``, that all-reduce's own inter figures.
    """
    designs = hsdp_design_traffic(shapes, owners, replicate, shard, elem_bytes, grad_bytes, reshard_after_forward,
                                  waves)
    rest = replicate_all_reduce_traffic(other_numels, replicate, shard, grad_bytes)
    out: dict = {}
    for name, traffic in designs.items():
        out[name] = {"inter": level_figures(traffic, "inter"), "intra": level_figures(traffic, "intra"),
                     "inter_whole_model": level_figures(_plus(traffic, rest), "inter")}
    out["non_muon_all_reduce"] = level_figures([rest] * (replicate * shard), "inter")
    return out
