"""The holders pass: matrices some ranks do not hold (expert slices) owned by a rank holding them, where the
balancer's per-rank counts of their kind allow; loads, batches and state bytes unchanged."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from torch import nn

from dmuon.plan.assign import assign, build_kinds
from dmuon.plan.balance import evaluate
from dmuon.plan.cost_table import CostTable
from dmuon.plan.holders import holder_ranks, owned_where_held, prefer_holders, spread_kinds
from dmuon.plan.plan import MatrixInfo, Piece, row_pieces


def _most_on_holders(owners, kinds, holders) -> int:
    """The oracle: the most matrices on a holder any owners with the same per-rank kind counts reach (a maximum
    bipartite b-matching of matrices to their kind's per-rank room, by augmenting paths)."""
    total = 0
    for kind in set(kinds):
        members = [i for i, k in enumerate(kinds) if k == kind and holders[i] is not None]
        slots = [r for i, k in enumerate(kinds) if k == kind for r in [owners[i]]]
        slot_of: dict[int, int] = {}  # slot index -> matrix

        def augment(i, seen):
            for x, r in enumerate(slots):
                if r in holders[i] and x not in seen:
                    seen.add(x)
                    if x not in slot_of or augment(slot_of[x], seen):
                        slot_of[x] = i
                        return True
            return False

        total += sum(augment(i, set()) for i in members)
    return total


def _check(owners, kinds, holders, moved):
    assert Counter(zip(moved, kinds)) == Counter(zip(owners, kinds))  # loads, batches, state: unchanged
    # No matrix off its holders could swap with a same-kind matrix a holder of it owns, that one staying on a
    # holder of its own: every same-kind matrix a holder of it owns is held by that holder.
    for i, h in enumerate(holders):
        if h is None or moved[i] in h:
            continue
        for j, k in enumerate(kinds):
            if k == kinds[i] and moved[j] in h:
                assert holders[j] is not None and moved[j] in holders[j], (i, j, moved)
    on, _ = owned_where_held(moved, holders)
    assert on == _most_on_holders(owners, kinds, holders)


def test_a_hand_made_case():
    # 4 ranks, one kind of 6 matrices, 2 on ranks 0 and 1, 1 on ranks 2 and 3. Slices 0, 1 held by rank 1;
    # 2 by rank 0; 3 by ranks 2 and 3 (dim 1: an ep group's efsdp ranks); 4 and 5 by every rank.
    owners = [0, 0, 1, 1, 2, 3]
    holders = [(1,), (1,), (0,), (2, 3), None, None]
    moved = prefer_holders(owners, [0] * 6, holders)
    # Rank 1 owns two: slices 0 and 1; rank 0 slice 2 and a dense one; slice 3 stays off its holders only if
    # both are full: rank 2 takes it, and the dense matrices fill ranks 0 and 3.
    assert moved == [1, 1, 0, 2, 0, 3]
    _check(owners, [0] * 6, holders, moved)


def test_a_full_holder_sends_the_rest_elsewhere_and_kinds_without_holders_keep_their_owners():
    # Rank 1 holds slices 0 and 1 but owns one matrix of the kind: the first in plan order takes it.
    moved = prefer_holders([0, 1, 2, 2], [0] * 4, [(1,), (1,), None, None])
    assert moved[0] == 1 and moved[1] != 1 and sorted(moved) == [0, 1, 2, 2]
    # A kind without holders keeps its owners exactly (the spreading's choice).
    assert prefer_holders([3, 0, 2, 1], [0, 0, 1, 1], [None, None, (0,), (1,)])[:2] == [3, 0]


def test_fewest_holders_first():
    # Matrix 0 held by ranks 0 and 1, matrix 1 by rank 0 only, one slot on each: 1 must get rank 0.
    moved = prefer_holders([2, 3, 0, 1], [0] * 4, [(0, 1), (0,), None, None])
    assert moved[:2] == [1, 0]


def test_holder_ranks_from_pieces():
    cols = 8
    empty, rows = Piece(0, 0, 0, cols), Piece(0, 4, 0, cols)
    # An expert slice on position 1 of 4, in 2 replicas: plan ranks 1 and 5. Row chunks of a 2-row matrix
    # over 4 positions: the first two. Pieces on every position, or none known: None.
    got = holder_ranks([(empty, rows, empty, empty), row_pieces((2, cols), 4), row_pieces((8, cols), 4), ()], 2, 4)
    assert got == [(1, 5), (0, 1, 4, 5), None, None]
    assert spread_kinds([0, 0, 1, 0], got) == [2, 3, 1, 0]
    with pytest.raises(ValueError, match="3 pieces for 4"):
        holder_ranks([(empty, rows, empty)], 1, 4)


def _holder_set(rng: random.Random, family: str, replicate: int, shard: int) -> tuple[int, ...] | None:
    """A holder set as the live layouts make them, in every replica: ``"experts"``: one position (whole
    experts per rank) or an ep group's positions (experts split by rows, ep 2); ``"rows"``: FSDP2's first
    positions (fewer rows than positions) or one position. Either family is laminar (nested or disjoint).
    None: every rank holds it."""
    pick = rng.randrange(3)
    if pick == 0:
        return None
    if pick == 1 or family == "experts" and shard % 2:
        positions = [rng.randrange(shard)]
    elif family == "experts":
        positions = list(range(rng.randrange(2), shard, 2))
    else:
        positions = list(range(rng.randint(1, shard - 1)))
    return tuple(r * shard + s for r in range(replicate) for s in positions)


@pytest.mark.parametrize("seed", range(12))
def test_random_cases_keep_counts_and_put_the_most_on_holders(seed):
    rng = random.Random(seed)
    replicate, shard = rng.choice([(1, 4), (2, 2), (1, 6), (2, 4), (1, 3)])
    world = replicate * shard
    n = rng.randint(4, 16)
    kinds = [rng.randrange(2) for _ in range(n)]
    family = {k: rng.choice(["experts", "rows"]) for k in range(2)}
    holders = [_holder_set(rng, family[k], replicate, shard) for k in kinds]
    owners = [rng.randrange(world) for _ in range(n)]
    _check(owners, kinds, holders, prefer_holders(owners, kinds, holders))


def _stack_infos(world: int) -> list[MatrixInfo]:
    """Two layers of a 4-rank torchtitan layout (tests/support/moe.py's "ep2-dim0"): stacks of E = 4 experts,
    ep 2 x efsdp 2, FSDP2 on dim 0: ep rank ``j = e // 2`` holds experts ``2j, 2j + 1``, its efsdp rank
    ``f = e % 2`` expert ``e`` whole, at position ``f * ep + j``; plus dense matrices on every position."""
    infos = []
    for layer in range(2):
        for name, shape in (("w1", (8, 4)), ("w2", (4, 8))):
            for e in range(4):
                held = (e % 2) * 2 + e // 2
                pieces = tuple(Piece(0, shape[0] if s == held else 0, 0, shape[1]) for s in range(world))
                infos.append(MatrixInfo(len(infos), f"layers.{layer}.{name}[{e}]", nn.Parameter(torch.zeros(4, *shape)),
                                        shape, layer, pieces=pieces, expert=e))
        for name in ("q", "k"):
            infos.append(MatrixInfo(len(infos), f"layers.{layer}.{name}", nn.Parameter(torch.zeros(8, 8)), (8, 8),
                                    layer, pieces=row_pieces((8, 8), world)))
    return infos


@pytest.mark.parametrize("balancer", ["lpt", "round_robin", "milp"])
def test_assign_owns_slices_on_holders_with_the_balancers_loads(balancer):
    world = 4
    infos = _stack_infos(world)
    shapes = [i.matrix_shape for i in infos]
    # Batches that pay (2 for 1.5x, 4 for 2.5x one's cost), so "milp" solves its program rather than taking LPT.
    table = CostTable({(s, b): c * float(s[0] * s[1]) for s in set(shapes) for b, c in ((1, 1.0), (2, 1.5), (4, 2.5))},
                      unit="seconds", source="file")
    kinds, items = build_kinds(shapes, table)
    result = assign(infos, world, balancer, costs=table, time_limit_s=5)
    assert result.method == balancer
    # The same matrices without pieces (every rank holds them): the balancer's owners, spread, no holders pass.
    bare = [MatrixInfo(i.index, i.name, i.param, i.shape, i.block) for i in infos]
    plain = assign(bare, world, balancer, costs=table, time_limit_s=5)
    for r in (result, plain):  # the figures the result reports are its owners'
        assert (r.loads, r.batches, r.state_bytes) == evaluate(kinds, items, r.owners, world)
    assert (result.loads, result.batches, result.state_bytes) == (plain.loads, plain.batches, plain.state_bytes)
    assert Counter(zip(result.owners, items)) == Counter(zip(plain.owners, items))
    assert [i.owner for i in infos] == result.owners
    holders = holder_ranks([i.pieces for i in infos], 1, world)
    slices = [k for k, h in enumerate(holders) if h is not None]
    assert len(slices) == 16 and all(len(holders[k]) == 1 for k in slices)
    # Each rank holds 2 slices of each kind (one per layer); wherever its count of that kind has room, it owns
    # them: the most on holders the counts allow, and all of them where the balancer gave every rank two.
    _check(plain.owners, items, holders, result.owners)
    per_kind = Counter(zip(plain.owners, items))
    if all(per_kind[(r, items[k])] == 2 for r in range(world) for k in slices):
        assert all(result.owners[k] in holders[k] for k in slices)
    assert any(n.startswith("holders: ") for n in result.notes)
