"""One training step, collective by collective: FSDP2's and dmuon's, in issue order.

Each strategy's step (:data:`STEP_STRATEGIES`: dmuon, which on HSDP is
the replicate level; dmuon_native_hsdp, dmuon on FSDP2's native HSDP all-reduce; FSDP2 + AdamW;
gather-then-compute) is a list of :class:`Collective` in the order they are
issued, each with every plan rank's (sent, received) bytes in it
(:func:`step_collectives`; dmuon's own exchange alone is
:func:`owner_exchange_collectives`). A collective's critical bytes are the most
any one rank sends or receives in it (the larger direction, not the sum); the
step's are their sum. Under the alpha-beta model (:class:`AlphaBeta`) a
collective takes ``messages`` latencies plus its critical bytes over the level's
per-rank bandwidth; the step's seconds are the sum over its collectives
(serialised: no overlap with compute or with each other, so an upper bound on
exposed communication). :func:`step_comm` gives those figures per strategy.

The per-rank whole-step totals are :mod:`dmuon.costmodel.rank_traffic`'s; both are
importable from :mod:`dmuon.costmodel.traffic`. :class:`AlphaBeta` and :func:`step_figures` live
with :class:`Collective` in :mod:`dmuon.costmodel.collective`, the all-to-all peer's collectives in
:mod:`dmuon.costmodel.peer`.
"""

from __future__ import annotations

from typing import Sequence

from dmuon.costmodel.collective import AlphaBeta, Collective, step_figures, uniform_collective
from dmuon.costmodel.ddp_collectives import ddp_publish_collectives
from dmuon.costmodel.exchange_model import ExchangeModel
from dmuon.costmodel.moe import ExpertLayout, expert_fsdp2_collective, expert_gather_collective, merged
from dmuon.costmodel.peer import PEER_STRATEGY, peer_collectives
from dmuon.costmodel.rank_traffic import check_mesh, check_owners, row_width
from dmuon.plan.publication import ROUTES


STEP_STRATEGIES: tuple[str, ...] = ("dmuon", "dmuon_native_hsdp", "fsdp_adamw", "gather")
"""Keys of :func:`step_comm`: ``"dmuon"`` (on the replicate level: FSDP2 over the shard sub-mesh,
dmuon reduce-scatters the gradients' column slices across replicas), ``"dmuon_native_hsdp"``
(native HSDP: FSDP2's own HSDP all-reduce, then dmuon's exchange; the same collectives as
``"dmuon"`` with one replica), ``"fsdp_adamw"`` and ``"gather"``."""
DDP_STRATEGY = "ddp_dmuon"
"""dmuon under torch's ``DistributedDataParallel`` (:mod:`dmuon.runtime.ddp`), one rank per replica: DDP's
all-reduce of every gradient (FSDP2's per unit on the ``(N, 1)`` mesh: the same bytes, its buckets being the
units), then each wave's updates to every rank (:func:`ddp_publish_collectives`)."""


def _padded_shard_bytes(shapes: Sequence[Sequence[int]], shard: int, elem_bytes: int) -> int:
    """Bytes of one rank's FSDP2 shard of ``shapes``: ``ceil(m / S)`` rows each (FSDP2 pads to that)."""
    return sum(-(-int(s[0]) // shard) * row_width(s) for s in shapes) * elem_bytes


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
        return [uniform_collective(op, "intra", phase, block, world, (shard - 1) * piece, shard - 1,
                                   f"fsdp2 {op} block {block}", f"fsdp_{op}")]
    if op == "all_reduce":
        if replicate == 1 or not shapes:
            return []
        return [uniform_collective(op, "inter", phase, block, world, 2 * (replicate - 1) * piece // replicate,
                                   2 * (replicate - 1), f"fsdp2 all_reduce block {block}", "fsdp_all_reduce")]
    raise ValueError(f"unknown FSDP2 collective {op!r}")


# Reads better whole: the length is the public docstring (every argument and the issue order); the body is short.
def owner_exchange_collectives(
    shapes: Sequence[Sequence[int]],
    owners: Sequence[int],
    blocks: Sequence[int],
    replicate: int,
    shard: int,
    elem_bytes: int = 2,
    block_order: Sequence[int] | None = None,
    waves: Sequence[Sequence[int]] | None = None,
    pieces: Sequence[Sequence] | None = None,
    gradient_bytes: int | None = None,
    row_bytes: int = 0,
    hop_a_spread: int | None = None,
    publication: str | None = None,
    returns_in_backward: bool = False,
) -> tuple[list[Collective], list[Collective]]:
    """dmuon's exchange collective by collective, as ``src/dmuon/comm/exchange.py`` issues it.

    The exchange of a block's directions (blocks in ``block_order``; default:
    descending block index, FSDP2's post-backward order when blocks are
    numbered in model order, root first): with ``R > 1``, one uneven
    ``all_to_all`` on each shard column's replicate group sends the
    direction's column slices to the owners' replicas (hop A,
    :func:`owner_traffic` step 0; a column sending nothing of the block takes
    no part), then one uneven ``all_to_all`` on each replica's shard group
    sends the directions of the block's matrices owned in that replica to
    their owners (hop B, step 1; a replica owning none of them issues
    nothing). Without ``gradient_bytes`` (or with one replica) these are the
    backward's collectives, block by block: hop A, then hop B (issued when the
    next block launches), in the runtime's issue order.

    With ``R > 1`` and ``gradient_bytes`` given (the replicate level: FSDP2 over
    the shard sub-mesh, no replicate all-reduce) each block's gradient is
    first reduce-scattered by column slices across replicas, one uneven
    ``all_to_all`` on each shard column's replicate group: rank ``(r, s)``
    sends column slice ``q`` of its piece (``shard_rows(cols, R)``,
    ``MatrixInfo.replica_columns``) to ``(q, s)`` for every ``q != r``, in
    ``gradient_bytes`` per element, and sums what it receives into slice
    ``r``, where its momentum lives (every holder of a piece sends, copies
    too; a column with no rows of the block takes no part). The block's
    directions need that reduction landed, so its hop A goes out with the
    *next* block's column reduce-scatter: both go over the same replicate
    group (hop A's peers are among the columns'), and the runtime sends them
    in one ``all_to_all`` (role
    ``"grad_columns"`` with :attr:`Collective.carries_hop_a`; per rank the
    sum of both parts' bytes, peers the union of both parts', taking part
    where either does). ``block_order`` may name blocks with no Muon matrix
    (FSDP2 units of other parameters): such a block's landing carries the
    hop A pending then alone (role ``"hop_a"``). The backward list is in
    issue order: when block ``b_j`` lands, hop B of ``b_{j-2}`` (whose hop A
    went out when ``b_{j-1}`` landed), then the all_to_all of ``b_j``'s
    gradient columns carrying ``b_{j-1}``'s hop A (the first block's columns
    alone); then in ``step()`` hop B of the second-to-last block, the last
    block's hop A alone and its hop B.

    Then, in ``step()``, per return wave (``waves``: the matrices of each, in
    order, as ``DMuon.last_step_stats()["return_waves"]``; default: all in
    one) one ``all_to_all`` on each replica's shard group returns the wave's
    update rows (step 2; replicas owning none of them skip it) and, with
    ``R > 1``, the shard column's replicate group publishes them to the
    other replicas (step 3, :mod:`dmuon.plan.publication`; a column where
    the collective moves nothing skips it), by the wave's route
    (``publication``; None: :func:`~dmuon.plan.publication.choose_route`,
    as the runtime picks it): direct, one ``all_to_all`` sending each
    piece to every other replica (role ``"return_replicas"``); or scatter,
    one sending part ``q`` of each piece to replica ``q`` (role
    ``"return_scatter"``), then one all-gathering the parts (role
    ``"return_gather"``). The runtime advances every return in flight by
    one hop at once, so a wave's all-gather goes in the same ``all_to_all``
    as the next wave's first collective across replicas (bytes summed,
    peers united, :attr:`Collective.carries_gather`); the last wave's
    goes alone, after it. Nothing when the group has one rank. The
    concurrent per-replica (or per-column) collectives are one entry: they
    run at once.

    ``pieces`` (per matrix, one :class:`dmuon.plan.Piece` per shard position,
    as ``MatrixInfo.pieces``) gives layouts other than FSDP2's full-width row
    chunks: tensor parallelism's boxes, and copies of a piece, which only
    their first holder sends (all receive the update).

    ``gradient_bytes``: the gradient's element size (FSDP2's reduce dtype, 4
    for fp32) for the replicate level's column reduce-scatter; None (native HSDP:
    FSDP2 has all-reduced the gradients across replicas) issues none. Bytes
    per rank are what ``all_to_all_single`` moves less the rank's own
    segment: ``(r, s)`` sends every slice ``q != r`` of its piece and
    receives ``R - 1`` copies of slice ``r``.

    ``row_bytes``: a rule's per-row state on the wire, bytes per matrix row
    (NorMuon: one float32; 0 for Muon), as :class:`dmuon.comm.ShardExchange`
    moves it: in hop B each row's once, with the direction piece of the sending
    position whose box starts at column 0 (hop A carries none: every replica
    holds the same copy); in hops 1 and 2 with every position's piece of the
    update, for each row it holds (on the scatter route each part carries
    the state of its row chunk, ``state_rows(rows, R)``).

    ``publication``: ``"direct"`` or ``"scatter"`` forces that route for
    every wave (``ShardExchange(publication=)``); None chooses per wave.

    ``returns_in_backward`` (``ExecutionConfig.returns_in_backward``, every
    launch standing): each block's return goes in backward, as
    ``BackwardLaunches`` issues it: at the landing after the one that issued
    its directions' last hop, its hop 1 (role ``"return_shard"``, phase
    ``"backward"``); each later landing advances it by one hop across
    replicas (``"return_replicas"``, or ``"return_scatter"`` then
    ``"return_gather"``, by its route), on the replicate level in the same
    all_to_all as that landing's gradient columns
    (:attr:`Collective.carries_returns`); ``step()`` issues what is left of
    each launch's hops, in launch order. ``waves`` then covers the other
    blocks' matrices only (as the runtime reports them; default: those in one).

    Returns:
        ``(backward, step)``: the direction exchanges (and the replicate level's
        column reduce-scatters) in issue order, and the step's return
        exchanges, wave by wave.
    """
    check_mesh(replicate, shard, elem_bytes)
    if row_bytes < 0:
        raise ValueError(f"row_bytes must be >= 0, got {row_bytes}")
    if publication is not None and publication not in ROUTES:
        raise ValueError(f"publication must be None or one of {ROUTES}, got {publication!r}")
    if gradient_bytes is not None and gradient_bytes < 1:
        raise ValueError(f"gradient_bytes must be >= 1, got {gradient_bytes}")
    check_owners(shapes, owners, replicate, shard)
    if len(blocks) != len(shapes):
        raise ValueError(f"{len(shapes)} shapes but {len(blocks)} blocks")
    model = ExchangeModel(shapes, owners, replicate, shard, elem_bytes, pieces, row_bytes, publication)
    order = sorted(set(blocks), reverse=True) if block_order is None else list(block_order)
    backward, back = model.backward(order, blocks, gradient_bytes, hop_a_spread, returns_in_backward)
    if model.world == 1 or not shapes:
        return backward, []
    rest = [i for i in range(len(shapes)) if blocks[i] not in back]
    chosen = ([rest] if rest else []) if waves is None else [list(w) for w in waves if w]
    return backward, model.step(chosen, labelled=waves is not None)


def weight_norm_collective(matrices: int, replicate: int, shard: int, *, value_bytes: int = 4,
                           values: int = 1, index: int | None = None) -> list[Collective]:
    """The all-gather of a rule's per-matrix sums over the weight (:mod:`dmuon.runtime.matrix_norms`):
    ``values`` float32 per matrix for ``matrices`` matrices, one ring all-gather over each replica's
    shard group (FSDP2's shards and TP together; not across replicas, which hold the same weights),
    ``S-1`` times the rank's buffer each way. Empty with one shard position or no matrix. MuonH issues
    one per step after its last update, or with ``apply_updates="next_forward"`` one per return
    (``index``: the return's wave); and once more at a matrix's first step, for its radius, which this
    steady-state step leaves out."""
    if shard == 1 or matrices == 0:
        return []
    nbytes = matrices * values * value_bytes
    label = "dmuon weight norms" + ("" if index is None else f" wave {index}")
    return [uniform_collective("all_gather", "intra", "step", None, replicate * shard, (shard - 1) * nbytes,
                               shard - 1, label, "weight_norms", index)]


def with_weight_norms_per_wave(returns: list[Collective], waves: Sequence[Sequence[int]], replicate: int,
                               shard: int) -> list[Collective]:
    """``returns`` (:func:`owner_exchange_collectives`' step part, wave by wave) with each wave's
    weight-norm all-gather right after the collective that completes the wave (its last hop: the
    scatter route's all-gather rides in the next wave's first collective across replicas), as the
    runtime issues them with ``apply_updates="next_forward"``."""
    last: dict[int, int] = {}
    for k, c in enumerate(returns):
        for w in (c.index, c.carries_gather):
            if w is not None:
                last[w] = k
    out: list[Collective] = []
    for k, c in enumerate(returns):
        out.append(c)
        out += [n for w, at in sorted(last.items()) if at == k
                for n in weight_norm_collective(len(waves[w]), replicate, shard, index=w)]
    return out


def _check_step_args(strategy: str, shapes: Sequence[Sequence[int]], blocks: Sequence[int], replicate: int,
                     shard: int, wire_bytes: int, zero: int, apply_updates: str, weight_norms: bool,
                     returns_in_backward: bool, waves: Sequence[Sequence[int]] | None,
                     other_shapes: Sequence[Sequence[int]], other_blocks: Sequence[int], pieces: Sequence | None,
                     experts: ExpertLayout | None) -> None:
    """:func:`step_collectives`' arguments checked, a ValueError naming the one that is wrong."""
    known = STEP_STRATEGIES + (PEER_STRATEGY, DDP_STRATEGY)
    if strategy not in known:
        raise ValueError(f"strategy must be one of {known}, got {strategy!r}")
    if strategy == DDP_STRATEGY and shard != 1:
        raise ValueError(f"{DDP_STRATEGY} is one rank per replica (torch's DDP): shard must be 1, got {shard}")
    if zero not in (2, 3):
        raise ValueError(f"zero must be 2 or 3, got {zero}")
    check_mesh(replicate, shard, wire_bytes)
    if apply_updates not in ("in_step", "next_forward"):
        raise ValueError(f"apply_updates must be 'in_step' or 'next_forward', got {apply_updates!r}")
    per_wave = weight_norms and apply_updates == "next_forward"
    if per_wave and (returns_in_backward or waves is None):
        raise ValueError("weight_norms with apply_updates='next_forward' is modelled for the step's waves "
                         "(waves= given, returns_in_backward=False)")
    if len(blocks) != len(shapes):
        raise ValueError(f"{len(shapes)} shapes but {len(blocks)} blocks")
    if len(other_blocks) != len(other_shapes):
        raise ValueError(f"{len(other_shapes)} other shapes but {len(other_blocks)} other blocks")
    if (pieces is None) != (experts is None) or (pieces is not None and len(pieces) != len(shapes)):
        raise ValueError("pieces (one entry per matrix) and experts go together")
    if pieces is not None and strategy == PEER_STRATEGY:
        raise ValueError(f"{PEER_STRATEGY} is not modelled for routed experts")


def _gather_collectives(shapes: Sequence[Sequence[int]], blocks: Sequence[int], pieces: Sequence | None,
                        expert: Sequence[bool], replicate: int, shard: int, wire_bytes: int) -> list[Collective]:
    """Gather-then-compute's step: every matrix's direction all-gathered over its shard group, in plan order
    (an expert slice over the ranks holding it)."""
    out: list[Collective] = []
    world = replicate * shard
    for i, shape in enumerate(shapes):
        if expert[i]:
            gathered = expert_gather_collective(pieces[i], replicate, blocks[i], i, wire_bytes)
            out += [gathered] if gathered is not None else []
            continue
        out.append(uniform_collective("all_gather", "intra", "step", blocks[i], world,
                                      (shard - 1) * _padded_shard_bytes([shape], shard, wire_bytes),
                                      shard - 1, f"gather direction {i}", "gather", i))
    return out


# Reads better whole: the length is the public docstring and signature (every argument); checks and gathers are apart.
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
    other_shapes: Sequence[Sequence[int]] = (),
    other_blocks: Sequence[int] = (),
    max_concurrent: int = 3,
    row_bytes: int = 0,
    hop_a_spread: int | None = None,
    publication: str | None = None,
    weight_norms: bool = False,
    returns_in_backward: bool = False,
    root_regathered: bool = False,
    apply_updates: str = "in_step",
    pieces: Sequence | None = None,
    experts: ExpertLayout | None = None,
) -> list[Collective]:
    """Every collective the Muon matrices cause in one training step under ``strategy``, in issue order.

    Forward: FSDP2 all-gathers each block's weights (``param_bytes``), blocks
    in ascending index. Backward, blocks in descending index: with ``zero=3``
    the all-gather again (not for ``root_block``: FSDP2 keeps the root
    unsharded after forward), then the reduce-scatter (``reduce_bytes``), then
    on HSDP the replicate-level all-reduce of the reduced shard (not under
    ``"dmuon"``: the replicate level applies FSDP2 over the shard sub-mesh only); under
    ``"dmuon"`` and ``"dmuon_native_hsdp"`` then the block's exchange
    collectives (:func:`owner_exchange_collectives`, those whose
    :attr:`Collective.block` is the block): under ``"dmuon_native_hsdp"``
    (native HSDP) on HSDP two, the direction's column slices to the owner's
    replica (hop A) and the rows inside it (hop B); on HSDP under ``"dmuon"``
    the all_to_all reduce-scattering the gradient's column slices across
    replicas in ``reduce_bytes``, which carries the block before's hop A,
    and hop B, with the last block's hop A alone; with one replica hop B
    alone under both. Step: dmuon's return
    exchanges per wave (to the shard columns, then across replicas by the
    wave's route), or ``"gather"``'s all-gather of every matrix's
    direction over the shard group (``wire_bytes``, one per matrix in plan
    order, as :class:`dmuon.baselines.GatherThenCompute` calls
    ``full_tensor()``), or the peer's (:data:`PEER_STRATEGY`, FSDP2's native
    HSDP underneath) two all-to-alls per batch (:func:`all_to_all_batches`)
    in its runtime's order (:func:`async_runtime_order`). ``"fsdp_adamw"`` is
    FSDP2's collectives alone. The real order interleaves (FSDP2 prefetches
    the next all-gather; dmuon's exchanges run on their own groups, a
    block's hop B goes out when the next block lands, on the replicate level its hop
    A too: :func:`owner_exchange_collectives` lists dmuon's in issue order),
    which changes no sum; :mod:`dmuon.costmodel.simulate` times them as they
    would run. The non-Muon parameters are left out unless ``other_shapes``
    gives them: then FSDP2's collectives of each block carry them too, under
    the replicate level dmuon's all-reduce of their gradients across replicas comes
    right after each block's column all-to-all (the same bytes as FSDP2's under the other
    strategies), and a block of theirs alone (an FSDP2 unit with no Muon
    matrix) carries the hop A of the Muon block before it by itself.

    Args:
        strategy: One of :data:`STEP_STRATEGIES` or :data:`PEER_STRATEGY`.
        shapes, owners: As :func:`owner_traffic`.
        blocks: Block index of each matrix (its FSDP2 module).
        replicate, shard: The mesh.
        wire_bytes: dmuon's (and gather's, and the peer's) element size, the NS dtype.
        param_bytes: FSDP2's all-gather element size (its ``param_dtype``).
        reduce_bytes: FSDP2's reduce-scatter and all-reduce element size (``reduce_dtype``),
            also the gradient's in the replicate level's column reduce-scatter.
        zero: 3 re-gathers in backward (``reshard_after_forward``), 2 does not.
        root_block: The root module's block (no backward all-gather), or None.
        root_regathered: The root resharded after forward too, as torch 2.13 does when
            ``fully_shard(root, reshard_after_forward=True)`` is passed explicitly (left unset, the
            root stays gathered for backward): its all-gather again, first in backward (its
            pre-backward, before the head's backward), under every zero.
        waves: dmuon's return waves (:func:`owner_exchange_collectives`); None: one.
        other_shapes, other_blocks: The parameters Muon does not optimize and their blocks
            (default: none, the Muon matrices' collectives alone).
        max_concurrent: The peer's batches in flight (its ``AsyncRuntime``'s limit, 3).
        row_bytes: dmuon's per-row state on the wire (:func:`owner_exchange_collectives`; NorMuon's).
        hop_a_spread: the replicate level: the collectives a block's hop A may spread over
            (``ExecutionConfig.hop_a_spread``; :func:`owner_exchange_collectives`).
        publication: dmuon's route across replicas for every return wave
            (:func:`owner_exchange_collectives`); None: chosen per wave, as the runtime does.
        weight_norms: dmuon with a rule that needs each matrix's weight norm after the update
            (MuonH): its all-gather after the returns, or one per wave right behind the wave's last hop
            with ``apply_updates="next_forward"`` (:func:`weight_norm_collective`).
        returns_in_backward: dmuon's ``ExecutionConfig.returns_in_backward`` (every launch
            standing): the blocks' returns issued in backward (:func:`owner_exchange_collectives`).
        apply_updates: dmuon's ``ExecutionConfig.apply_updates``; it places ``weight_norms``' collectives
            (the returns are the same: pass ``waves`` one unit each, as the runtime makes them).
        pieces, experts: Routed experts (:mod:`dmuon.costmodel.moe`): per matrix its pieces per shard
            position for an expert slice (None for a dense matrix), and the :class:`ExpertLayout` they
            follow. FSDP2's collectives of a block then carry its expert unit's over the efsdp groups
            (:func:`~dmuon.costmodel.moe.expert_fsdp2_collective`, back to back with the dense unit's: one
            entry), dmuon's exchange moves each slice's pieces, and gather-then-compute gathers a slice over
            the ranks holding it (every one of them then runs its NS).
    """
    _check_step_args(strategy, shapes, blocks, replicate, shard, wire_bytes, zero, apply_updates, weight_norms,
                     returns_in_backward, waves, other_shapes, other_blocks, pieces, experts)
    per_wave = weight_norms and apply_updates == "next_forward"
    expert = [pieces is not None and pieces[i] is not None for i in range(len(shapes))]
    order = sorted(set(blocks) | set(other_blocks))
    of = {b: [shapes[i] for i in range(len(shapes)) if blocks[i] == b and not expert[i]] for b in order}
    stacks = {b: [pieces[i] for i in range(len(shapes)) if blocks[i] == b and expert[i]] for b in order}
    rest = {b: [other_shapes[i] for i in range(len(other_shapes)) if other_blocks[i] == b] for b in order}

    def fsdp2(dense: Sequence[Sequence[int]], b: int, phase: str, op: str, elem_bytes: int,
              with_experts: bool = True) -> list[Collective]:
        ours = fsdp2_block_collectives(dense, replicate, shard, phase=phase, block=b, op=op, elem_bytes=elem_bytes)
        if not with_experts or not stacks[b]:
            return ours
        theirs = expert_fsdp2_collective(op, stacks[b], experts, replicate, phase=phase, block=b,
                                         elem_bytes=elem_bytes)
        both = merged(ours[0] if ours else None, theirs)
        return [both] if both is not None else []
    exchange, returns = ([], [])
    design_b = strategy == "dmuon" and replicate > 1
    if strategy in ("dmuon", "dmuon_native_hsdp"):
        # Every FSDP2 unit in backward order: on the replicate level a unit's landing carries the hop A before it.
        exchange, returns = owner_exchange_collectives(shapes, owners, blocks, replicate, shard, wire_bytes,
                                                       block_order=order[::-1], waves=waves,
                                                       gradient_bytes=reduce_bytes if design_b else None,
                                                       row_bytes=row_bytes, hop_a_spread=hop_a_spread,
                                                       publication=publication, returns_in_backward=returns_in_backward,
                                                       pieces=pieces)
    by_block: dict[int | None, list[Collective]] = {}  # by the landing that issues them
    for c in exchange:
        by_block.setdefault(c.issued_at, []).append(c)
    out: list[Collective] = []
    for b in order:
        out += fsdp2(of[b] + rest[b], b, "forward", "all_gather", param_bytes)
    if root_regathered and root_block in of:
        out += fsdp2(of[root_block] + rest[root_block], root_block, "backward", "all_gather", param_bytes)
    for b in order[::-1]:
        every = of[b] + rest[b]
        if zero == 3 and b != root_block:
            out += fsdp2(every, b, "backward", "all_gather", param_bytes)
        out += fsdp2(every, b, "backward", "reduce_scatter", reduce_bytes)
        if not design_b:
            out += fsdp2(every, b, "backward", "all_reduce", reduce_bytes)
        else:
            for c in fsdp2(rest[b], b, "backward", "all_reduce", reduce_bytes, with_experts=False):
                c.label, c.role = f"dmuon all_reduce of the other parameters block {b}", "replicate_all_reduce"
                out.append(c)
        out += by_block.get(b, [])
    out += by_block.get(None, [])  # the replicate level: what step() issues of the exchange (hop A left, hop B)
    norms = weight_norms and strategy in ("dmuon", "dmuon_native_hsdp")
    if norms and per_wave:
        out += with_weight_norms_per_wave(returns, [w for w in waves if w], replicate, shard)
    else:
        out += returns + (weight_norm_collective(len(shapes), replicate, shard) if norms else [])
    if strategy == "gather" and shard > 1:
        out += _gather_collectives(shapes, blocks, pieces, expert, replicate, shard, wire_bytes)
    if strategy == PEER_STRATEGY:
        out += peer_collectives(shapes, replicate, shard, wire_bytes, max_concurrent)
    if strategy == DDP_STRATEGY:
        out += ddp_publish_collectives(shapes, owners, replicate, waves, wire_bytes)
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
    root_regathered: bool = False,
    other_shapes: Sequence[Sequence[int]] = (),
    other_blocks: Sequence[int] = (),
    pieces: Sequence | None = None,
    experts: ExpertLayout | None = None,
) -> dict:
    """:func:`step_figures` of :func:`step_collectives` for each of :data:`STEP_STRATEGIES`, JSON-ready."""
    return {s: step_figures(step_collectives(s, shapes, owners, blocks, replicate, shard, wire_bytes=wire_bytes,
                                             param_bytes=param_bytes, reduce_bytes=reduce_bytes, zero=zero,
                                             root_block=root_block, waves=waves, root_regathered=root_regathered,
                                             other_shapes=other_shapes, other_blocks=other_blocks,
                                             pieces=pieces, experts=experts),
                            model)
            for s in STEP_STRATEGIES}
