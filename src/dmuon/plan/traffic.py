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

:func:`step_collectives` lists one training step collective by collective
(FSDP2's and dmuon's, in issue order, every rank's bytes in each) for dmuon,
FSDP2 + AdamW and gather-then-compute; :func:`step_comm` sums each collective's
critical bytes and its alpha-beta time (:class:`AlphaBeta`) over the step.
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


def _check_owners(shapes: Sequence[Sequence[int]], owners: Sequence[int], replicate: int, shard: int) -> None:
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
    _check_mesh(replicate, shard, elem_bytes)
    _check_owners(shapes, owners, replicate, shard)
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
    _check_mesh(replicate, shard, elem_bytes)
    if grad_bytes < 1:
        raise ValueError(f"grad_bytes must be >= 1, got {grad_bytes}")
    _check_owners(shapes, owners, replicate, shard)
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
    _check_mesh(replicate, shard, elem_bytes)
    inter = 2 * (sum(numels) // shard) * (replicate - 1) // replicate * elem_bytes
    return RankTraffic(0, 0, inter, inter)


def _ring_traffic(numels: Sequence[int], replicate: int, shard: int, elem_bytes: int, passes: int) -> RankTraffic:
    """``passes`` ring collectives over the shard level plus the HSDP gradient all-reduce.

    A ring all-gather or reduce-scatter moves ``(S-1)/S`` of the tensor each way
    per rank; the all-reduce is :func:`replicate_all_reduce_traffic`. Uniform over ranks.
    """
    _check_mesh(replicate, shard, elem_bytes)
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


# --------------------------------------------------------------------------
# One training step, collective by collective (issue 16).
#
# Each strategy's step is a list of :class:`Collective` in the order they are
# issued, each with every plan rank's (sent, received) bytes in it. A
# collective's critical bytes are the most any one rank sends or receives in it
# (the larger direction, not the sum); the step's are their sum. Under the
# alpha-beta model (:class:`AlphaBeta`) a collective takes ``messages`` latencies
# plus its critical bytes over the level's per-rank bandwidth; the step's
# seconds are the sum over its collectives (serialised: no overlap with compute
# or with each other, so an upper bound on exposed communication).

STEP_STRATEGIES: tuple[str, ...] = ("dmuon", "fsdp_adamw", "gather")
"""Keys of :func:`step_comm`."""


@dataclass
class Collective:
    """One collective of a training step, as every plan rank sees it."""

    op: str
    """``"all_gather"``, ``"reduce_scatter"``, ``"all_reduce"`` or ``"all_to_all"``."""
    level: str
    """``"intra"`` (the shard group, inside a node) or ``"inter"`` (the replicate group)."""
    phase: str
    """``"forward"``, ``"backward"`` or ``"step"``."""
    block: int | None
    """The block it belongs to (None for the step's all-matrix exchanges)."""
    ranks: list[tuple[int, int] | None]
    """Per plan rank ``r * S + s``: ``(sent, received)`` bytes, or None where the rank issues nothing."""
    messages: int
    """Latency terms of the alpha-beta model: ring steps, or the most peers one rank exchanges with."""
    label: str = ""

    @property
    def critical(self) -> int:
        """The most bytes one rank sends or receives in this collective."""
        return max((max(t) for t in self.ranks if t is not None), default=0)


def _padded_shard_bytes(shapes: Sequence[Sequence[int]], shard: int, elem_bytes: int) -> int:
    """Bytes of one rank's FSDP2 shard of ``shapes``: ``ceil(m / S)`` rows each (FSDP2 pads to that)."""
    return sum(-(-int(s[0]) // shard) * row_width(s) for s in shapes) * elem_bytes


def _uniform_collective(op: str, level: str, phase: str, block, world: int, each: int, messages: int,
                        label: str) -> Collective:
    return Collective(op, level, phase, block, [(each, each)] * world, messages, label)


def fsdp2_block_collectives(shapes: Sequence[Sequence[int]], replicate: int, shard: int, *, phase: str,
                            block: int | None, op: str, elem_bytes: int) -> list[Collective]:
    """FSDP2's collective(s) of one block: a ring ``all_gather`` or ``reduce_scatter`` over each
    replica's shard group (``S-1`` steps of one padded shard each way), or the HSDP ``all_reduce``
    of the reduce-scattered shard over each shard column's replicate group (a ring: ``2 (R-1)/R``
    of the shard each way, ``2 (R-1)`` steps). Empty where the group has one rank."""
    world = replicate * shard
    piece = _padded_shard_bytes(shapes, shard, elem_bytes)
    if op in ("all_gather", "reduce_scatter"):
        if shard == 1 or not shapes:
            return []
        return [_uniform_collective(op, "intra", phase, block, world, (shard - 1) * piece, shard - 1,
                                    f"fsdp2 {op} block {block}")]
    if op == "all_reduce":
        if replicate == 1 or not shapes:
            return []
        return [_uniform_collective(op, "inter", phase, block, world, 2 * (replicate - 1) * piece // replicate,
                                    2 * (replicate - 1), f"fsdp2 all_reduce block {block}")]
    raise ValueError(f"unknown FSDP2 collective {op!r}")


def _a2a(level: str, phase: str, block, world: int, sent: list[int], received: list[int],
         peers_out: list[set], peers_in: list[set], taking_part: list[bool], label: str) -> Collective:
    ranks = [(sent[k], received[k]) if taking_part[k] else None for k in range(world)]
    messages = max((max(len(peers_out[k]), len(peers_in[k])) for k in range(world) if taking_part[k]), default=0)
    return Collective("all_to_all", level, phase, block, ranks, messages, label)


def owner_exchange_collectives(
    shapes: Sequence[Sequence[int]],
    owners: Sequence[int],
    blocks: Sequence[int],
    replicate: int,
    shard: int,
    elem_bytes: int = 2,
    block_order: Sequence[int] | None = None,
    waves: Sequence[Sequence[int]] | None = None,
) -> tuple[list[Collective], list[Collective]]:
    """dmuon's exchange collective by collective, as ``src/dmuon/comm/exchange.py`` issues it.

    Per block (in ``block_order``; default: descending block index, FSDP2's
    post-backward order when blocks are numbered in model order, root first)
    with ``R > 1`` first one uneven ``all_to_all`` on each shard column's
    replicate group sends the direction's column slices to the owners'
    replicas (:func:`owner_traffic` step 0; a column with no rows of the
    block skips it), then one uneven ``all_to_all`` on each replica's shard group sends the
    directions of the block's matrices owned in that replica to their owners
    (step 1); a replica owning none of them issues
    nothing. Then, in ``step()``, per return wave (``waves``: the matrices of
    each, in order, as ``DMuon.last_step_stats()["return_waves"]``; default:
    all in one) one ``all_to_all`` on each replica's shard group returns the
    wave's update rows (step 2; replicas owning none of them skip it) and, with
    ``R > 1``, one on each shard column's replicate group forwards them to the
    other replicas (step 3; a column with no rows of them skips it). Nothing
    when the group has one rank. The concurrent per-replica (or per-column)
    collectives are one entry: they run at once.

    Returns:
        ``(backward, step)``: the per-block direction exchanges, in order, and
        the step's return exchanges, wave by wave.
    """
    _check_mesh(replicate, shard, elem_bytes)
    _check_owners(shapes, owners, replicate, shard)
    if len(blocks) != len(shapes):
        raise ValueError(f"{len(shapes)} shapes but {len(blocks)} blocks")
    world = replicate * shard
    rows = [shard_rows(int(s[0]), shard) for s in shapes]
    widths = [row_width(s) for s in shapes]

    def piece(i: int, s: int) -> int:
        return rows[i][s] * widths[i] * elem_bytes

    def fresh():
        return [0] * world, [0] * world, [set() for _ in range(world)], [set() for _ in range(world)]

    order = sorted(set(blocks), reverse=True) if block_order is None else list(block_order)
    cols = [int(s[1]) if len(s) > 1 else 1 for s in shapes]
    columns = [shard_rows(c, replicate) for c in cols]

    def column_piece(i: int, r: int, s: int) -> int:
        return rows[i][s] * columns[i][r] * (widths[i] // cols[i]) * elem_bytes if cols[i] else 0

    backward: list[Collective] = []
    for b in order:
        members = [i for i in range(len(shapes)) if blocks[i] == b]
        if not members:
            continue
        if replicate > 1:
            sent, received, out, inn = fresh()
            for i in members:
                r_o = owners[i] // shard
                for s in range(shard):
                    for r in range(replicate):
                        moved = column_piece(i, r, s)
                        if r != r_o and moved:
                            src, dst = r * shard + s, r_o * shard + s
                            sent[src] += moved
                            received[dst] += moved
                            out[src].add(dst)
                            inn[dst].add(src)
            part = [any(rows[i][k % shard] * widths[i] for i in members) for k in range(world)]
            backward.append(_a2a("inter", "backward", b, world, sent, received, out, inn, part,
                                 f"dmuon direction slices block {b}"))
        if shard > 1:
            sent, received, out, inn = fresh()
            owning = {owners[i] // shard for i in members}
            for i in members:
                r_o, s_o = divmod(owners[i], shard)
                for s in range(shard):
                    moved = piece(i, s)
                    if s != s_o and moved:
                        src = r_o * shard + s
                        sent[src] += moved
                        received[owners[i]] += moved
                        out[src].add(owners[i])
                        inn[owners[i]].add(src)
            part = [k // shard in owning for k in range(world)]
            backward.append(_a2a("intra", "backward", b, world, sent, received, out, inn, part,
                                 f"dmuon directions block {b}"))
    step: list[Collective] = []
    if world == 1 or not shapes:
        return backward, step
    chosen = [list(range(len(shapes)))] if waves is None else [list(w) for w in waves if w]
    for k, wave in enumerate(chosen):
        label = "" if waves is None else f" wave {k}"
        if shard > 1:
            sent, received, out, inn = fresh()
            for i in wave:
                r_o, s_o = divmod(owners[i], shard)
                for s in range(shard):
                    moved = piece(i, s)
                    if s != s_o and moved:
                        dst = r_o * shard + s
                        sent[owners[i]] += moved
                        received[dst] += moved
                        out[owners[i]].add(dst)
                        inn[dst].add(owners[i])
            owning = {owners[i] // shard for i in wave}
            step.append(_a2a("intra", "step", None, world, sent, received, out, inn,
                             [k // shard in owning for k in range(world)], "dmuon updates to the shard columns" + label))
        if replicate > 1:
            sent, received, out, inn = fresh()
            column_rows = [0] * shard
            for i in wave:
                r_o = owners[i] // shard
                for s in range(shard):
                    moved = piece(i, s)
                    column_rows[s] += moved
                    if not moved:
                        continue
                    src = r_o * shard + s
                    for r in range(replicate):
                        if r != r_o:
                            dst = r * shard + s
                            sent[src] += moved
                            received[dst] += moved
                            out[src].add(dst)
                            inn[dst].add(src)
            step.append(_a2a("inter", "step", None, world, sent, received, out, inn,
                             [column_rows[k % shard] > 0 for k in range(world)], "dmuon updates to the replicas" + label))
    return backward, step


def step_collectives(
    strategy: str,
    shapes: Sequence[Sequence[int]],
    owners: Sequence[int],
    blocks: Sequence[int],
    replicate: int,
    shard: int,
    *,
    wire_bytes: int = 2,
    param_bytes: int = 2,
    reduce_bytes: int = 4,
    zero: int = 3,
    root_block: int | None = 0,
    waves: Sequence[Sequence[int]] | None = None,
) -> list[Collective]:
    """Every collective the Muon matrices cause in one training step under ``strategy``, in issue order.

    Forward: FSDP2 all-gathers each block's weights (``param_bytes``), blocks
    in ascending index. Backward, blocks in descending index: with ``zero=3``
    the all-gather again (not for ``root_block``: FSDP2 keeps the root
    unsharded after forward), then the reduce-scatter (``reduce_bytes``), then
    on HSDP the replicate-level all-reduce of the reduced shard; under
    ``"dmuon"`` then the block's direction exchange (on HSDP two: the column
    slices across replicas, then the rows inside the owner's replica). Step: ``"dmuon"``'s two
    return exchanges (:func:`owner_exchange_collectives`), or ``"gather"``'s
    all-gather of every matrix's direction over the shard group
    (``wire_bytes``, one per matrix in plan order, as
    :class:`dmuon.baselines.GatherThenCompute` calls ``full_tensor()``).
    ``"fsdp_adamw"`` is FSDP2's collectives alone. The real order interleaves
    (FSDP2 prefetches the next all-gather; dmuon's exchanges run on their own
    groups), which changes no sum.

    Args:
        strategy: One of :data:`STEP_STRATEGIES`.
        shapes, owners: As :func:`owner_traffic`.
        blocks: Block index of each matrix (its FSDP2 module).
        replicate, shard: The mesh.
        wire_bytes: dmuon's (and gather's) element size, the NS dtype.
        param_bytes: FSDP2's all-gather element size (its ``param_dtype``).
        reduce_bytes: FSDP2's reduce-scatter and all-reduce element size (``reduce_dtype``).
        zero: 3 re-gathers in backward (``reshard_after_forward``), 2 does not.
        root_block: The root module's block (no backward all-gather), or None.
        waves: dmuon's return waves (:func:`owner_exchange_collectives`); None: one.
    """
    if strategy not in STEP_STRATEGIES:
        raise ValueError(f"strategy must be one of {STEP_STRATEGIES}, got {strategy!r}")
    if zero not in (2, 3):
        raise ValueError(f"zero must be 2 or 3, got {zero}")
    _check_mesh(replicate, shard, wire_bytes)
    if len(blocks) != len(shapes):
        raise ValueError(f"{len(shapes)} shapes but {len(blocks)} blocks")
    order = sorted(set(blocks))
    of = {b: [shapes[i] for i in range(len(shapes)) if blocks[i] == b] for b in order}
    exchange, returns = ([], [])
    if strategy == "dmuon":
        exchange, returns = owner_exchange_collectives(shapes, owners, blocks, replicate, shard, wire_bytes,
                                                       block_order=order[::-1], waves=waves)
    by_block: dict[int | None, list[Collective]] = {}
    for c in exchange:
        by_block.setdefault(c.block, []).append(c)
    out: list[Collective] = []
    for b in order:
        out += fsdp2_block_collectives(of[b], replicate, shard, phase="forward", block=b, op="all_gather",
                                       elem_bytes=param_bytes)
    for b in order[::-1]:
        if zero == 3 and b != root_block:
            out += fsdp2_block_collectives(of[b], replicate, shard, phase="backward", block=b, op="all_gather",
                                           elem_bytes=param_bytes)
        out += fsdp2_block_collectives(of[b], replicate, shard, phase="backward", block=b, op="reduce_scatter",
                                       elem_bytes=reduce_bytes)
        out += fsdp2_block_collectives(of[b], replicate, shard, phase="backward", block=b, op="all_reduce",
                                       elem_bytes=reduce_bytes)
        out += by_block.get(b, [])
    out += returns
    if strategy == "gather" and shard > 1:
        world = replicate * shard
        for i, shape in enumerate(shapes):
            out.append(_uniform_collective("all_gather", "intra", "step", blocks[i], world,
                                           (shard - 1) * _padded_shard_bytes([shape], shard, wire_bytes),
                                           shard - 1, f"gather direction {i}"))
    return out


@dataclass
class AlphaBeta:
    """The alpha-beta model: per-message latency and per-rank, per-direction bandwidth per level.

    Defaults are typical H100/H200 HGX figures (not measured here): NVLink 4
    gives each GPU 900 GB/s bidirectional, i.e. 450 GB/s each way (the figure
    that matters for the larger of sent and received); one 400 Gb/s
    InfiniBand/RoCE NIC per GPU gives 50 GB/s each way; NCCL-like latencies
    of about 10 us per message inside a node and 20 us across nodes.
    """

    intra_bandwidth: float = 450e9
    """Bytes per second one rank sends (or receives) inside a node."""
    inter_bandwidth: float = 50e9
    """Bytes per second one rank sends (or receives) across nodes."""
    intra_latency: float = 10e-6
    """Seconds per message inside a node."""
    inter_latency: float = 20e-6
    """Seconds per message across nodes."""

    def __post_init__(self) -> None:
        for name in ("intra_bandwidth", "inter_bandwidth"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("intra_latency", "inter_latency"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    def seconds(self, c: Collective) -> float:
        """``messages * latency + critical bytes / bandwidth`` on the collective's level."""
        if c.level == "intra":
            return c.messages * self.intra_latency + c.critical / self.intra_bandwidth
        return c.messages * self.inter_latency + c.critical / self.inter_bandwidth

    def as_dict(self) -> dict:
        return asdict(self)


def step_figures(collectives: Sequence[Collective], model: AlphaBeta | None = None) -> dict:
    """``critical_bytes``, ``seconds`` and ``collectives`` of a step, each ``{"total", "intra", "inter"}``."""
    model = AlphaBeta() if model is None else model
    out = {key: {"total": 0, "intra": 0, "inter": 0} for key in ("critical_bytes", "seconds", "collectives")}
    for c in collectives:
        for key, value in (("critical_bytes", c.critical), ("seconds", model.seconds(c)), ("collectives", 1)):
            out[key]["total"] += value
            out[key][c.level] += value
    return out


def step_comm(
    shapes: Sequence[Sequence[int]],
    owners: Sequence[int],
    blocks: Sequence[int],
    replicate: int,
    shard: int,
    *,
    wire_bytes: int = 2,
    param_bytes: int = 2,
    reduce_bytes: int = 4,
    zero: int = 3,
    root_block: int | None = 0,
    model: AlphaBeta | None = None,
    waves: Sequence[Sequence[int]] | None = None,
) -> dict:
    """:func:`step_figures` of :func:`step_collectives` for each of :data:`STEP_STRATEGIES`, JSON-ready."""
    return {s: step_figures(step_collectives(s, shapes, owners, blocks, replicate, shard, wire_bytes=wire_bytes,
                                             param_bytes=param_bytes, reduce_bytes=reduce_bytes, zero=zero,
                                             root_block=root_block, waves=waves), model)
            for s in STEP_STRATEGIES}
