"""The traffic model against hand-computed cases and a message-by-message simulation."""

from __future__ import annotations

import math
import random

import pytest
import torch

from dmuon.costmodel.traffic import (
    HSDP_DESIGNS,
    STEP_STRATEGIES,
    AlphaBeta,
    RankTraffic,
    compare_hsdp_designs,
    critical_path,
    fsdp2_traffic,
    gather_traffic,
    hsdp_design_traffic,
    level_figures,
    owner_exchange_collectives,
    owner_traffic,
    owner_traffic_column_reduce,
    replicate_all_reduce_traffic,
    step_collectives,
    step_comm,
    step_figures,
)
from dmuon.plan.plan import Piece
from dmuon.plan.publication import SCATTER, Published, choose_route


def _torch_rows(m: int, shard: int) -> list[int]:
    """Row counts as FSDP2 gets them: torch.chunk, padded with empty columns."""
    sizes = [len(c) for c in torch.arange(m).chunk(shard)] if m else []
    return sizes + [0] * (shard - len(sizes))


def _route(shapes, owners, replicate, shard, elem_bytes) -> str:
    """The route the runtime takes for one wave of every matrix (FSDP2's row chunks)."""
    return choose_route([Published(o // shard, tuple((n, shape[1] if len(shape) > 1 else 1)
                                                     for n in _torch_rows(shape[0], shard)), math.prod(shape[2:]))
                         for shape, o in zip(shapes, owners)], replicate, shard, elem_bytes)


def _messages(shapes, owners, replicate, shard, elem_bytes):
    """Every (sender, receiver, bytes, level) message of the four steps, self-sends included."""
    scatter = _route(shapes, owners, replicate, shard, elem_bytes) == SCATTER
    for shape, owner in zip(shapes, owners):
        r_o, s_o = divmod(owner, shard)
        width = math.prod(shape[1:])
        rows = _torch_rows(shape[0], shard)
        cols = shape[1] if len(shape) > 1 else 1
        columns = _torch_rows(cols, replicate)  # the momentum's Shard(1) over the replicas
        for s in range(shard):
            for r in range(replicate):                                               # 0: direction slices
                yield (r * shard + s, r_o * shard + s, rows[s] * columns[r] * (width // cols) * elem_bytes, "inter")
        for s in range(shard):
            if s != s_o:
                yield (r_o * shard + s, owner, rows[s] * width * elem_bytes, "intra")   # 1: to the owner
                yield (owner, r_o * shard + s, rows[s] * width * elem_bytes, "intra")   # 2: update back
        for s in range(shard):
            part = [rows[s] * columns[q] * (width // cols) * elem_bytes for q in range(replicate)]
            for r in range(replicate):
                if r == r_o:
                    continue
                if not scatter:                                                      # 3: other replicas
                    yield (r_o * shard + s, r * shard + s, rows[s] * width * elem_bytes, "inter")
                    continue
                yield (r_o * shard + s, r * shard + s, part[r], "inter")           # 3a: part r to replica r
                for q in range(replicate):                                           # 3b: the parts to r
                    yield (q * shard + s, r * shard + s, part[q], "inter")


def _simulate(shapes, owners, replicate, shard, elem_bytes) -> list[RankTraffic]:
    out = [RankTraffic() for _ in range(replicate * shard)]
    for src, dst, size, level in _messages(shapes, owners, replicate, shard, elem_bytes):
        if src == dst:
            continue
        setattr(out[src], f"{level}_sent", getattr(out[src], f"{level}_sent") + size)
        setattr(out[dst], f"{level}_received", getattr(out[dst], f"{level}_received") + size)
    return out


def test_five_by_three_on_three_ranks():
    # Rows [2, 2, 1], 3 elements a row, bf16 on the wire.
    t = owner_traffic([(5, 3)], [0], 1, 3)
    assert [(x.intra_sent, x.intra_received) for x in t] == [(18, 18), (12, 12), (6, 6)]
    assert all(x.inter_sent == x.inter_received == 0 for x in t)
    # Owned by the last column, whose single row stays put.
    t = owner_traffic([(5, 3)], [2], 1, 3, elem_bytes=4)
    assert [(x.sent, x.received) for x in t] == [(24, 24), (24, 24), (48, 48)]


def test_a_one_row_matrix_moves_only_between_its_row_holder_and_owner():
    t = owner_traffic([(1, 7)], [2], 1, 4, elem_bytes=4)
    assert [(x.sent, x.received) for x in t] == [(28, 28), (0, 0), (28, 28), (0, 0)]
    # Owned by the rank holding its only row: nothing moves at all.
    assert all(x == RankTraffic() for x in owner_traffic([(1, 7)], [0], 1, 4))


def test_two_by_two_mesh_with_owners_in_both_replicas():
    # A: rows [2, 2] of 3, columns [2, 1], owner (0, 1). B: rows [2, 1] of 2, columns [1, 1], owner (1, 0).
    # Step 0 (direction slices to the owner's replica, inter): A's column 2 from (1, s) to (0, s),
    # 4 and 4 bytes; B's column 0 from (0, s) to (1, s), 4 and 2 bytes.
    # Steps 1-3 (rows to the owner, updates back, updates to the other replica) as on one replica.
    t = owner_traffic([(4, 3), (3, 2)], [1, 2], 2, 2)
    got = [(x.intra_sent, x.intra_received, x.inter_sent, x.inter_received) for x in t]
    assert got == [(12, 12, 12 + 4, 8 + 4), (12, 12, 12 + 2, 4 + 4), (4, 4, 8 + 4, 12 + 4), (4, 4, 4 + 4, 12 + 2)]


def test_rows_are_flattened_over_trailing_dimensions():
    # A (5, 2, 3) conv kernel moves like a 5 x 6 matrix on one replica...
    assert owner_traffic([(5, 2, 3)], [1], 1, 3) == owner_traffic([(5, 6)], [1], 1, 3)
    # ... but its momentum is split over replicas by input channel (dim 1): 2 + 1 of 3
    # channels of 2 elements, 4 + 2 elements per row, where a 5 x 6 matrix splits 3 + 3.
    conv, flat = owner_traffic([(5, 3, 2)], [0], 2, 1), owner_traffic([(5, 6)], [0], 2, 1)
    assert conv[1].inter_sent == 5 * 2 * 2 + 5 * 6 * 0 and flat[1].inter_sent == 5 * 3 * 2
    assert conv[0].inter_sent == flat[0].inter_sent == 5 * 6 * 2  # the update, to replica 1


def test_zero_traffic_on_a_rank_without_rows_or_matrices():
    # 4 rows over 3 columns leave column 2 empty; it owns nothing either.
    t = owner_traffic([(4, 5), (4, 9)], [0, 1], 1, 3)
    assert t[2] == RankTraffic()
    assert t[0].sent > 0 and t[1].sent > 0


def _random_case(rng: random.Random, *, max_shard: int, max_dim: int, ndims: tuple[int, int], most: int):
    """A random (replicate, shard) mesh, up to ``most`` random shapes and an owner for each."""
    replicate, shard = rng.randint(1, 4), rng.randint(1, max_shard)
    shapes = [tuple(rng.randint(1, max_dim) for _ in range(rng.randint(*ndims))) for _ in range(rng.randint(1, most))]
    return replicate, shard, shapes, [rng.randrange(replicate * shard) for _ in shapes]


def test_levels_conserve_bytes_and_match_the_simulation():
    rng = random.Random(0)
    for _ in range(200):
        replicate, shard, shapes, owners = _random_case(rng, max_shard=5, max_dim=9, ndims=(1, 3), most=6)
        elem = rng.choice([2, 4])
        model = owner_traffic(shapes, owners, replicate, shard, elem)
        assert model == _simulate(shapes, owners, replicate, shard, elem), (shapes, owners, replicate, shard)
        assert sum(x.intra_sent for x in model) == sum(x.intra_received for x in model)
        assert sum(x.inter_sent for x in model) == sum(x.inter_received for x in model)
        # Every row of the update reaches each other replica exactly once, and every
        # column slice of the direction held outside the owner's replica reaches it once.
        numel = sum(math.prod(s) for s in shapes)
        kept = sum(math.prod(s) // (s[1] if len(s) > 1 else 1) * _torch_rows(s[1] if len(s) > 1 else 1, replicate)[o // shard]
                   for s, o in zip(shapes, owners))
        assert sum(x.inter_sent for x in model) == ((replicate - 1) * numel + numel - kept) * elem


def test_critical_path_is_the_busiest_direction_of_any_rank():
    t = owner_traffic([(4, 3), (3, 2)], [1, 2], 2, 2)
    assert critical_path(t) == max(max(x.sent for x in t), max(x.received for x in t)) == 12 + 16  # rank 0 sends
    assert critical_path([]) == 0


def test_fsdp2_and_gather_then_compute_ring_figures():
    numels = [64 * 256, 256 * 64]  # divisible by S and R below
    f3 = fsdp2_traffic(numels, 2, 4)
    f2 = fsdp2_traffic(numels, 2, 4, reshard_after_forward=False)
    pass_bytes = sum(numels) * 3 // 4 * 4
    assert (f3.intra_sent, f2.intra_sent) == (3 * pass_bytes, 2 * pass_bytes)
    assert f3.inter_sent == f3.inter_received == 2 * (sum(numels) // 4) // 2 * 4
    # Gather-then-compute is FSDP2's collectives plus one all-gather of the directions.
    for reshard in (True, False):
        g = gather_traffic(numels, 2, 4, reshard_after_forward=reshard)
        f = fsdp2_traffic(numels, 2, 4, reshard_after_forward=reshard)
        assert g.intra_sent - f.intra_sent == pass_bytes and g.inter_sent == f.inter_sent
        assert g.sent == g.received == g.busiest
    # One rank or one replica: nothing crosses that level.
    assert fsdp2_traffic(numels, 1, 1) == RankTraffic()
    assert gather_traffic(numels, 1, 4).inter_sent == 0


class _Wire:
    """Counts a message-level run's bytes per rank and level (a rank's bytes to itself are not traffic)."""

    def __init__(self, replicate: int, shard: int) -> None:
        self.shard = shard
        self.out = [RankTraffic() for _ in range(replicate * shard)]

    def send(self, src: tuple[int, int], dst: tuple[int, int], tensor: torch.Tensor, elem_bytes: int):
        if src != dst:
            level = "intra" if src[0] == dst[0] else "inter"
            assert level == "intra" or src[1] == dst[1], "the replicate level links one shard column"
            size = tensor.numel() * elem_bytes
            a, b = self.out[src[0] * self.shard + src[1]], self.out[dst[0] * self.shard + dst[1]]
            setattr(a, f"{level}_sent", getattr(a, f"{level}_sent") + size)
            setattr(b, f"{level}_received", getattr(b, f"{level}_received") + size)
        return tensor.clone()


def _run_design_b(shapes, owners, replicate, shard, elem_bytes, grad_bytes, seed=0) -> list[RankTraffic]:
    """The replicate level with tensors, message by message: checks that the column reduce-scatter leaves
    every rank its slice of the gradient summed over replicas, that the owner gets the whole
    summed matrix and every rank its rows of the update, and returns the bytes it took."""
    gen = torch.Generator().manual_seed(seed)
    wire = _Wire(replicate, shard)
    scatter = _route(shapes, owners, replicate, shard, elem_bytes) == SCATTER
    for shape, owner in zip(shapes, owners):
        r_o, s_o = divmod(owner, shard)
        rows = _torch_rows(shape[0], shard)
        starts = [sum(rows[:s]) for s in range(shard)]
        cols = shape[1]
        inner = math.prod(shape[2:])
        columns = _torch_rows(cols, replicate)
        first = [sum(columns[:q]) for q in range(replicate)]
        # FSDP2 over the shard sub-mesh: replica r's reduce-scatter leaves rows s of G_r on (r, s).
        grads = [torch.randn(shape[0], cols, inner, generator=gen, dtype=torch.float64) for _ in range(replicate)]
        total = sum(grads)

        def part(t, s, q):
            return t[starts[s]:starts[s] + rows[s], first[q]:first[q] + columns[q]]

        # 0b: (r, s) sends column slice q of its rows to (q, s), which sums the R copies.
        kept = {}
        for s in range(shard):
            for q in range(replicate):
                kept[(q, s)] = part(grads[q], s, q).clone()
                for r in range(replicate):
                    if r != q:
                        kept[(q, s)] += wire.send((r, s), (q, s), part(grads[r], s, q), grad_bytes)
                assert torch.allclose(kept[(q, s)], part(total, s, q))
        # 0: the slices (standing in for the direction formed from the momentum) go to the owner's replica.
        summed = {s: torch.cat([wire.send((q, s), (r_o, s), kept[(q, s)], elem_bytes) for q in range(replicate)], 1)
                  for s in range(shard)}
        # 1: the owner's replica sends its rows of the direction to the owner.
        full = torch.cat([wire.send((r_o, s), (r_o, s_o), summed[s], elem_bytes) for s in range(shard)])
        assert torch.allclose(full, total)
        update = torch.tanh(full)  # stands in for NS: any map of the whole matrix
        # 2: the owner sends each column its rows of the update; 3: they go on to the other replicas,
        # directly or (scatter route) column slice r to replica r, then every slice to every replica.
        back = {s: wire.send((r_o, s_o), (r_o, s), update[starts[s]:starts[s] + rows[s]], elem_bytes)
                for s in range(shard)}
        for s in range(shard):
            scattered = {q: wire.send((r_o, s), (q, s), back[s][:, first[q]:first[q] + columns[q]], elem_bytes)
                         for q in range(replicate)} if scatter else {}
            for r in range(replicate):
                if r == r_o:
                    got = back[s]
                elif not scatter:
                    got = wire.send((r_o, s), (r, s), back[s], elem_bytes)
                else:
                    got = torch.cat([wire.send((q, s), (r, s), scattered[q], elem_bytes) for q in range(replicate)], 1)
                assert torch.equal(got, update[starts[s]:starts[s] + rows[s]])
    return wire.out


def test_design_b_hand_case_on_a_two_by_two_mesh():
    # One 5 x 7 matrix, owner (0, 1); rows [3, 2] over the shard positions, columns [4, 3]
    # over the replicas; fp32 gradients, bf16 directions.
    t = owner_traffic_column_reduce([(5, 7)], [1], 2, 2)
    # Column reduce-scatter (inter, fp32): (0, 0) sends its 3 x 3 slice 1 (36 bytes) to (1, 0)
    # and receives (1, 0)'s 3 x 4 slice 0 (48); (0, 1) sends 2 x 3 (24), receives 2 x 4 (32);
    # replica 1 the other way round.
    gradient = [(36, 48), (24, 32), (48, 36), (32, 24)]
    # Hop A (inter, bf16): replica 1 sends its slices 1 of the direction to the owner's replica:
    # 3 x 3 x 2 = 18 bytes from (1, 0), 2 x 3 x 2 = 12 from (1, 1).
    hop_a = [(0, 18), (0, 12), (18, 0), (12, 0)]
    # Hop 2 (inter): (0, 0) forwards its 3 x 7 rows of the update (42 bytes) to (1, 0), (0, 1) its 2 x 7 (28).
    hop_2 = [(42, 0), (28, 0), (0, 42), (0, 28)]
    inter = [tuple(sum(x) for x in zip(*parts)) for parts in zip(gradient, hop_a, hop_2)]
    assert [(x.inter_sent, x.inter_received) for x in t] == inter == [(78, 66), (52, 44), (66, 78), (44, 52)]
    # Hop B and hop 1 (intra): (0, 0) sends its 42 bytes of the direction to the owner and gets 42 back.
    assert [(x.intra_sent, x.intra_received) for x in t] == [(42, 42), (42, 42), (0, 0), (0, 0)]
    assert _run_design_b([(5, 7)], [1], 2, 2, 2, 4) == t


def test_design_b_column_all_to_all_by_hand():
    # The same 5 x 7 matrix, collective by collective.
    backward, step = owner_exchange_collectives([(5, 7)], [1], [3], 2, 2, 2, gradient_bytes=4)
    columns, slices, directions = backward
    assert (columns.op, columns.level, columns.phase, columns.block) == ("all_to_all", "inter", "backward", 3)
    assert columns.label == "dmuon gradient columns block 3"
    assert columns.ranks == [(36, 48), (24, 32), (48, 36), (32, 24)]
    assert columns.messages == 1 and columns.critical == 48
    assert slices.ranks == [(0, 18), (0, 12), (18, 0), (12, 0)]
    assert directions.ranks == [(42, 0), (0, 42), None, None]
    back, forward = step
    assert back.ranks == [(0, 42), (42, 0), None, None]
    assert forward.ranks == [(42, 0), (28, 0), (0, 42), (0, 28)]
    # Without gradient_bytes (native HSDP) the column all_to_all is not issued; the rest is the same.
    a_backward, a_step = owner_exchange_collectives([(5, 7)], [1], [3], 2, 2, 2)
    assert [c.ranks for c in a_backward] == [slices.ranks, directions.ranks]
    assert [c.ranks for c in a_step] == [back.ranks, forward.ranks]
    # One replica: nothing crosses nodes, gradient_bytes or not.
    assert owner_exchange_collectives([(5, 7)], [1], [3], 1, 2, 2, gradient_bytes=4) == \
        owner_exchange_collectives([(5, 7)], [1], [3], 1, 2, 2)
    with pytest.raises(ValueError, match="gradient_bytes"):
        owner_exchange_collectives([(5, 7)], [1], [3], 2, 2, 2, gradient_bytes=0)


def test_design_b_hop_a_rides_with_the_next_blocks_columns():
    # Two 5 x 7 matrices on a 2 x 2 mesh: block 3's owned by (0, 1), block 2's by (1, 0); backward
    # lands block 3 first. Columns [4, 3] over the replicas, rows [3, 2] over the shard positions.
    # Hop A all at once (hop_a_spread=1).
    backward, _ = owner_exchange_collectives([(5, 7), (5, 7)], [1, 2], [3, 2], 2, 2, 2, gradient_bytes=4,
                                             hop_a_spread=1)
    assert [c.label for c in backward] == [
        "dmuon gradient columns block 3",                                  # block 3 lands: nothing to carry
        "dmuon gradient columns block 2 + direction slices of blocks [3]",  # block 2 lands: one all_to_all
        "dmuon directions block 3",                                        # step(): hop B of block 3,
        "dmuon direction slices of blocks [2] left at the end of backward",  # the last block's hop A alone,
        "dmuon directions block 2"]                                        # and its hop B
    first, merged, b3, a2, b2 = backward
    columns = [(36, 48), (24, 32), (48, 36), (32, 24)]  # as test_design_b_column_all_to_all_by_hand's
    assert first.ranks == columns and first.carries_hop_a == () and first.role == "grad_columns"
    # Block 3's hop A: replica 1 sends its slices 1 (3 x 3 and 2 x 3, bf16) to replica 0.
    hop_a_3 = [(0, 18), (0, 12), (18, 0), (12, 0)]
    assert merged.ranks == [(c[0] + a[0], c[1] + a[1]) for c, a in zip(columns, hop_a_3)]
    assert (merged.role, merged.block, merged.carries_hop_a, merged.completes_hop_a, merged.level) == (
        "grad_columns", 2, (3,), (3,), "inter")
    # The same peer (the other replica of the column) for both parts: one message.
    assert merged.messages == 1 and merged.critical == 66
    # Block 2's hop A to replica 1: replica 0 sends its slices 0 (3 x 4 and 2 x 4).
    assert (a2.role, a2.block, a2.ranks) == ("hop_a", None, [(24, 0), (16, 0), (0, 24), (0, 16)])
    assert b3.ranks == [(42, 0), (0, 42), None, None] and b2.ranks == [None, None, (0, 28), (28, 0)]
    # The same bytes per rank as two collectives of their own, one collective fewer.
    apart, _ = owner_exchange_collectives([(5, 7), (5, 7)], [1, 2], [3, 2], 2, 2, 2)
    assert _summed(backward, 4) == _summed(apart + [first, first], 4) and len(backward) == len(apart) + 1
    # A unit with no Muon matrix between them (block 9: another parameter's FSDP2 unit) carries
    # block 3's hop A alone; block 2's columns then have nothing to carry.
    backward, _ = owner_exchange_collectives([(5, 7), (5, 7)], [1, 2], [3, 2], 2, 2, 2, block_order=[3, 9, 2],
                                             gradient_bytes=4, hop_a_spread=1)
    assert [(c.role, c.block, c.carries_hop_a) for c in backward] == [
        ("grad_columns", 3, ()), ("hop_a", 9, (3,)), ("hop_b", 3, ()), ("grad_columns", 2, ()),
        ("hop_a", None, (2,)), ("hop_b", 2, ())]
    assert backward[1].ranks == hop_a_3 and backward[3].ranks == columns


def test_design_b_hop_a_spread_over_later_collectives_by_hand():
    # Three blocks, each one 8 x 4 matrix on a 2 x 1 mesh (R = 2, S = 1), all owned by replica 0:
    # every block's hop A (replica 1's 8 x 2 slice, 32 bf16 bytes) lands on replica 0. The column
    # reduce-scatter of a block (fp32) moves 8 x 2 x 4 = 64 bytes each way on both ranks.
    shapes, owners, blocks = [(8, 4)] * 3, [0, 0, 0], [3, 2, 1]
    backward, _ = owner_exchange_collectives(shapes, owners, blocks, 2, 1, 2, gradient_bytes=4, hop_a_spread=2)
    roles = [(c.role, c.block, c.carries_hop_a, c.completes_hop_a) for c in backward]
    # Block 2's collective may rise by the average hop A per rank and block so far (32 / 2 ranks = 16
    # bytes): block 3 sends half of its rows. Block 1's must carry the rest of block 3's (its last
    # chance), which already reaches that level (64 + 16): block 2's waits. The last collective carries
    # block 2's and block 1's whole. No hop B: one rank per replica.
    assert roles == [("grad_columns", 3, (), ()), ("grad_columns", 2, (3,), ()),
                     ("grad_columns", 1, (3,), (3,)), ("hop_a", None, (2, 1), (2, 1))]
    assert [c.ranks for c in backward] == [[(64, 64), (64, 64)], [(64, 80), (80, 64)], [(64, 80), (80, 64)],
                                           [(0, 64), (64, 0)]]
    # Every byte of hop A goes once: 3 x 32 in all.
    assert sum(c.ranks[0][1] for c in backward) - 3 * 64 == 3 * 32
    # hop_a_spread=1 sends each block's whole hop A with the next collective.
    once, _ = owner_exchange_collectives(shapes, owners, blocks, 2, 1, 2, gradient_bytes=4, hop_a_spread=1)
    assert [c.ranks for c in once] == [[(64, 64), (64, 64)], [(64, 96), (96, 64)], [(64, 96), (96, 64)],
                                       [(0, 32), (32, 0)]]


def test_design_b_hop_a_spread_defaults_to_the_runtimes():
    """No hop_a_spread given: 8 without returns in backward, 1 with them (ExecutionConfig's default)."""
    shapes, owners, blocks = [(8, 4)] * 3, [0, 0, 0], [3, 2, 1]

    def listed(spread, returns):
        backward, step = owner_exchange_collectives(shapes, owners, blocks, 2, 1, 2, gradient_bytes=4,
                                                    hop_a_spread=spread, returns_in_backward=returns)
        return [(c.role, c.block, c.ranks) for c in backward + step]

    assert listed(1, False) != listed(8, False)  # the case tells the two settings apart
    assert listed(None, False) == listed(8, False)
    assert listed(1, True) != listed(8, True)
    assert listed(None, True) == listed(1, True)


def test_design_b_column_all_to_all_with_an_empty_slice_and_an_empty_column():
    # 2 columns over 3 replicas: slices [1, 1, 0]; 1 row over 2 positions: position 1 holds nothing.
    backward, _ = owner_exchange_collectives([(1, 2)], [0], [0], 3, 2, 2, gradient_bytes=4)
    columns = backward[0]
    # (0, 0) sends slice 1 (4 bytes) to (1, 0) and gets slice 0 from (1, 0) and (2, 0); (2, 0)
    # keeps an empty slice: it sends both (8 bytes) and receives nothing. Column 1 skips it.
    assert columns.ranks == [(4, 8), None, (4, 8), None, (8, 0), None]
    # (2, 0) sends to 2 peers; (0, 0) hears from 2.
    assert columns.messages == 2
    # Every holder sends, a copy too (sends=False): both positions hold the whole 1 x 2 matrix here.
    copies = [[Piece(0, 1, 0, 2, True), Piece(0, 1, 0, 2, False)]]
    backward, _ = owner_exchange_collectives([(1, 2)], [0], [0], 3, 2, 2, pieces=copies, gradient_bytes=4)
    assert backward[0].ranks == [(4, 8), (4, 8), (4, 8), (4, 8), (8, 0), (8, 0)]
    # Hop A: only the first holder's column sends its direction slices.
    assert backward[1].ranks == [(0, 2), None, (2, 0), None, (0, 0), None]


def _tp_pieces(shape, shard, kind):
    """TP-style pieces on ``shard = fsdp x 2`` positions ``s = f * 2 + t``: ``"col"`` splits the
    columns over ``t`` (and rows over ``f``); ``"whole"`` leaves the matrix whole over ``t``
    (rows over ``f``), so position ``t = 1`` holds a copy that only ``t = 0`` sends."""
    fsdp = shard // 2
    rows = _torch_rows(shape[0], fsdp)
    cols = _torch_rows(shape[1], 2)
    out = []
    for s in range(shard):
        f, t = divmod(s, 2)
        if kind == "col":
            out.append(Piece(sum(rows[:f]), rows[f], sum(cols[:t]), cols[t]))
        else:
            out.append(Piece(sum(rows[:f]), rows[f], 0, shape[1], sends=t == 0))
    return out


def _summed(collectives, world: int) -> list[RankTraffic]:
    out = [RankTraffic() for _ in range(world)]
    for c in collectives:
        for k, t in enumerate(c.ranks):
            if t is not None:
                setattr(out[k], f"{c.level}_sent", getattr(out[k], f"{c.level}_sent") + t[0])
                setattr(out[k], f"{c.level}_received", getattr(out[k], f"{c.level}_received") + t[1])
    return out


@pytest.mark.parametrize("replicate,shard", [(2, 2), (3, 2), (2, 4), (4, 2), (1, 4)])
def test_per_rank_totals_are_the_sum_of_the_collectives(replicate, shard):
    rng = random.Random(replicate * 10 + shard)
    for trial in range(25):
        # Uneven shapes, a conv kernel, and two TP-style layouts.
        shapes = [(rng.randint(1, 11), rng.randint(1, 9)) for _ in range(3)]
        shapes += [(rng.randint(1, 7), rng.randint(1, 5), 3, 2), (rng.randint(2, 9), rng.randint(2, 9)),
                   (rng.randint(2, 9), rng.randint(2, 9))]
        pieces = [[Piece(sum(_torch_rows(shp[0], shard)[:s]), n, 0, shp[1])
                   for s, n in enumerate(_torch_rows(shp[0], shard))] for shp in shapes[:4]]
        pieces += [_tp_pieces(shapes[4], shard, "col"), _tp_pieces(shapes[5], shard, "whole")]
        owners = [rng.randrange(replicate * shard) for _ in shapes]
        blocks = [rng.randrange(3) for _ in shapes]
        elem, grad = rng.choice([2, 4]), rng.choice([2, 4])
        world = replicate * shard
        backward, step = owner_exchange_collectives(shapes, owners, blocks, replicate, shard, elem, pieces=pieces,
                                                    gradient_bytes=grad)
        assert _summed(backward + step, world) == owner_traffic_column_reduce(
            shapes, owners, replicate, shard, elem, grad, pieces=pieces), (shapes, owners)
        backward, step = owner_exchange_collectives(shapes, owners, blocks, replicate, shard, elem, pieces=pieces)
        assert _summed(backward + step, world) == owner_traffic(shapes, owners, replicate, shard, elem,
                                                                pieces=pieces), (shapes, owners)
        # In return waves, each with its own route across replicas (and the scatter route's all-gather
        # joined with the next wave's first collective): the same per-rank sums.
        cut = sorted(rng.sample(range(1, len(shapes)), 2))
        order = rng.sample(range(len(shapes)), len(shapes))
        waves = [order[:cut[0]], order[cut[0]:cut[1]], order[cut[1]:]]
        for publication in (None, "direct", "scatter"):
            backward, step = owner_exchange_collectives(shapes, owners, blocks, replicate, shard, elem, pieces=pieces,
                                                        gradient_bytes=grad, waves=waves, publication=publication)
            summed = _summed(backward + step, world)
            if publication is None:
                assert summed == owner_traffic_column_reduce(shapes, owners, replicate, shard, elem, grad,
                                                             pieces=pieces, waves=waves), (shapes, owners, waves)
            # Every route moves the same bytes over all ranks, only spread differently.
            assert sum(x.inter_sent for x in summed) == sum(x.inter_sent for x in owner_traffic_column_reduce(
                shapes, owners, replicate, shard, elem, grad, pieces=pieces))
        # Without pieces: FSDP2's row chunks, which the first four are.
        plain = owner_traffic_column_reduce(shapes[:4], owners[:4], replicate, shard, elem, grad)
        assert plain == owner_traffic_column_reduce(shapes[:4], owners[:4], replicate, shard, elem, grad,
                                                    pieces=pieces[:4])
        if replicate == 1:
            assert owner_traffic_column_reduce(shapes, owners, 1, shard, elem, grad, pieces=pieces) == \
                owner_traffic(shapes, owners, 1, shard, elem, pieces=pieces)


def test_design_b_matches_the_message_level_run_and_conserves_each_level():
    rng = random.Random(1)
    for trial in range(120):
        replicate, shard, shapes, owners = _random_case(rng, max_shard=4, max_dim=7, ndims=(2, 3), most=4)
        elem, grad = rng.choice([2, 4]), rng.choice([2, 4])
        model = owner_traffic_column_reduce(shapes, owners, replicate, shard, elem, grad)
        assert model == _run_design_b(shapes, owners, replicate, shard, elem, grad, seed=trial), (
            shapes, owners, replicate, shard)
        for level in ("intra", "inter"):
            assert (sum(getattr(x, f"{level}_sent") for x in model)
                    == sum(getattr(x, f"{level}_received") for x in model))
        # The shard level is native HSDP's; the replicate level is (R-1)/R of every gradient from each
        # rank (R-1 gradient copies in all), (a)'s direction slices and one update copy per other replica.
        a = owner_traffic(shapes, owners, replicate, shard, elem)
        assert [(x.intra_sent, x.intra_received) for x in model] == [(x.intra_sent, x.intra_received) for x in a]
        numel = sum(math.prod(s) for s in shapes)
        kept = sum(math.prod(s) // s[1] * _torch_rows(s[1], replicate)[o // shard] for s, o in zip(shapes, owners))
        assert sum(x.inter_sent for x in model) == (replicate - 1) * numel * (grad + elem) + (numel - kept) * elem


def _ring_all_reduce(replicate: int, shard: int, numel: int, elem_bytes: int) -> list[RankTraffic]:
    """A ring all-reduce of each rank's numel / S shard across the R ranks of its column,
    chunk by chunk: R-1 reduce-scatter steps, then R-1 all-gather steps."""
    out = [RankTraffic() for _ in range(replicate * shard)]
    chunk = numel // shard // replicate
    for s in range(shard):
        for _ in range(2 * (replicate - 1)):
            for r in range(replicate):
                out[r * shard + s].inter_sent += chunk * elem_bytes
                out[(r + 1) % replicate * shard + s].inter_received += chunk * elem_bytes
    return out


def test_replicate_all_reduce_is_fsdp2s_inter_level_and_a_ring():
    numels = [64 * 64, 32 * 64]
    for replicate, shard in [(2, 4), (4, 8), (8, 2), (1, 4)]:
        ar = replicate_all_reduce_traffic(numels, replicate, shard)
        f = fsdp2_traffic(numels, replicate, shard)
        assert (ar.inter_sent, ar.inter_received) == (f.inter_sent, f.inter_received)
        assert ar.intra_sent == ar.intra_received == 0
        assert [ar] * (replicate * shard) == _ring_all_reduce(replicate, shard, sum(numels), 4)


@pytest.mark.parametrize("replicate,shard", [(4, 8), (2, 4), (8, 8), (3, 2)])
def test_design_totals_for_one_evenly_divisible_matrix(replicate, shard):
    # M elements, divisible by S * R: every figure is exact.
    rows, cols = 8 * 3 * 8, 8 * 3 * 8
    m = rows * cols
    r1 = replicate - 1
    figs = compare_hsdp_designs([(rows, cols)], [shard + 1], replicate, shard)
    inter = {k: figs[k]["inter"] for k in HSDP_DESIGNS}
    # (i) each of the S columns ring-all-reduces M/S fp32 elements over R ranks.
    assert inter["fsdp2_adamw"]["total"] == 2 * r1 * m * 4
    # (ii) native HSDP: that, plus the bf16 update once to every other replica, plus the
    # direction's column slices (1/R of it per other replica) to the owner's replica.
    assert inter["a"]["total"] == 2 * r1 * m * 4 + r1 * m * 2 + r1 * (m // replicate) * 2
    # (iii) the replicate level: the fp32 gradient's column slices reduce-scattered across replicas ((R-1)/R
    # of each rank's M/S from each of the R S ranks), plus (a)'s direction slices and update.
    assert inter["b"]["total"] == r1 * m * 4 + r1 * m * 2 + r1 * (m // replicate) * 2
    # Per element 8, 10 + 2/R and 6 + 2/R bytes per other replica.
    assert [inter[k]["total"] / (r1 * m) for k in HSDP_DESIGNS] == [8, 10 + 2 / replicate, 6 + 2 / replicate]
    # Critical paths: the all-reduce is 2 (R-1)/R of a column's M/S each way on every rank;
    # (a) adds the publication, where the owner's replica sends most: with R = 2 directly its
    # M/S once; with R >= 3 by the scatter route (one matrix: its owner's replica would send it
    # R-1 times directly), (R-1)/R of M/S in the scatter and as much in the all-gather, which is
    # more than another rank's M/S received. (b)'s replaces the all-reduce by the reduce-scatter,
    # (R-1)/R of M/S each way.
    ar = 2 * r1 * (m // shard) // replicate * 4
    published = 2 * r1 * (m // shard) // replicate * 2
    assert inter["fsdp2_adamw"]["critical"] == ar
    assert inter["a"]["critical"] == ar + published
    assert inter["b"]["critical"] == ar // 2 + published
    # The shard level: (a) and (b) both add dmuon's exchange to FSDP2's within-replica collectives.
    assert figs["a"]["intra"] == figs["b"]["intra"]
    assert figs["a"]["intra"]["total"] - figs["fsdp2_adamw"]["intra"]["total"] == 2 * (m - m // shard) * 2
    # No non-Muon parameters: the whole model is the matrices.
    assert figs["non_muon_all_reduce"] == {"total": 0, "critical": 0}
    assert all(figs[k]["inter_whole_model"] == figs[k]["inter"] for k in HSDP_DESIGNS)


def test_design_hand_numbers():
    # One 64 x 64 matrix on a 4 x 8 mesh, owner (1, 1): M = 4096, M / S = 512.
    figs = compare_hsdp_designs([(64, 64)], [9], 4, 8, other_numels=[1024, 3072])
    assert figs["fsdp2_adamw"]["inter"] == {"total": 98304, "critical": 3072}
    # (a): FSDP2's 98304, the update to 3 replicas (3 * 4096 * 2) and the 3 other replicas'
    # column slices of the direction (3 * 1024 * 2). One matrix on 4 replicas takes the scatter
    # route: the owner's replica sends 3 of its 4 column slices (3 * 128 * 2 a rank) in the
    # scatter and its own slice to the 3 others (as much) in the all-gather, 3072 + 1536 in all.
    assert figs["a"]["inter"] == {"total": 98304 + 24576 + 6144, "critical": 3072 + 1536}
    # (b): the column reduce-scatter (3 * 4096 * 4), (a)'s update copies and direction slices.
    assert figs["b"]["inter"] == {"total": 49152 + 24576 + 6144, "critical": 1536 + 1536}
    # 4096 non-Muon elements all-reduced alike under every design: 2 * 3 * 4096 * 4 in all, 3072 a rank.
    assert figs["non_muon_all_reduce"] == {"total": 98304, "critical": 3072}
    assert figs["b"]["inter_whole_model"] == {"total": 79872 + 98304, "critical": 3072 + 3072}
    # Per rank, 512 elements of the matrix, 128 in each column slice: every rank sends its 3 other
    # slices of the fp32 gradient (3 * 128 * 4) and receives 3 copies of its own (1536 each way);
    # the owner's replica receives 3 bf16 direction slices (3 * 128 * 2) and sends 3 slices of the
    # update in the scatter and its own to 3 replicas in the all-gather (768 + 768); the other
    # replicas send one direction slice (256) and their update slice to the 2 replicas other than
    # the owner's (512), and receive their slice (256) and the 3 others (768).
    b = hsdp_design_traffic([(64, 64)], [9], 4, 8)["b"]
    assert {(x.inter_sent, x.inter_received) for x in b[8:16]} == {(1536 + 768 + 768, 1536 + 768)}
    assert {(x.inter_sent, x.inter_received) for x in b[:8] + b[16:]} == {(1536 + 256 + 512, 1536 + 256 + 768)}


def test_design_traffic_is_fsdp2_plus_the_exchange():
    rng = random.Random(2)
    for _ in range(40):
        replicate, shard = rng.randint(1, 4), rng.randint(1, 4)
        shapes = [(rng.randint(1, 20), rng.randint(1, 20)) for _ in range(rng.randint(1, 5))]
        owners = [rng.randrange(replicate * shard) for _ in shapes]
        reshard = rng.random() < 0.5
        d = hsdp_design_traffic(shapes, owners, replicate, shard, 2, 4, reshard)
        f = fsdp2_traffic([math.prod(s) for s in shapes], replicate, shard, 4, reshard)
        a = owner_traffic(shapes, owners, replicate, shard, 2)
        b = owner_traffic_column_reduce(shapes, owners, replicate, shard, 2, 4)
        assert d["fsdp2_adamw"] == [f] * (replicate * shard)
        for k, x in enumerate(d["a"]):
            assert x == RankTraffic(f.intra_sent + a[k].intra_sent, f.intra_received + a[k].intra_received,
                                    f.inter_sent + a[k].inter_sent, f.inter_received + a[k].inter_received)
        for k, x in enumerate(d["b"]):
            assert x == RankTraffic(f.intra_sent + b[k].intra_sent, f.intra_received + b[k].intra_received,
                                    b[k].inter_sent, b[k].inter_received)
        for name in HSDP_DESIGNS:
            for level in ("intra", "inter"):
                fig = level_figures(d[name], level)
                assert fig["total"] == sum(getattr(x, f"{level}_received") for x in d[name])
        # One replica: nothing crosses nodes under any design, and (a) and (b) coincide.
        if replicate == 1:
            assert d["a"] == d["b"]
            assert all(level_figures(d[n], "inter") == {"total": 0, "critical": 0} for n in HSDP_DESIGNS)


def test_bad_input_is_rejected():
    with pytest.raises(ValueError, match="owner 4 outside"):
        owner_traffic([(2, 2)], [4], 2, 2)
    with pytest.raises(ValueError, match="1 shapes but 2 owners"):
        owner_traffic([(2, 2)], [0, 1], 1, 2)
    with pytest.raises(ValueError, match="elem_bytes"):
        owner_traffic([(2, 2)], [0], 1, 2, elem_bytes=0)
    with pytest.raises(ValueError, match="owner 4 outside"):
        owner_traffic_column_reduce([(2, 2)], [4], 2, 2)
    with pytest.raises(ValueError, match="grad_bytes"):
        owner_traffic_column_reduce([(2, 2)], [0], 1, 2, grad_bytes=0)
    with pytest.raises(ValueError, match="piece lists"):
        owner_traffic([(2, 2)], [0], 1, 2, pieces=[])
    with pytest.raises(ValueError, match="level must be"):
        level_figures([RankTraffic()], "both")


# ------------------------------------------------------------ one step, per collective

def _per_collective(strategy, *args, **kw):
    return [(c.op, c.level, c.critical) for c in step_collectives(strategy, *args, **kw)]


def test_step_collectives_by_hand_on_two_ranks():
    # A (4x3) owned by rank 0 in block 1, B (3x2) by rank 1 in block 2; rows A [2, 2], B [2, 1].
    shapes, owners, blocks = [(4, 3), (3, 2)], [0, 1], [1, 2]
    args = (shapes, owners, blocks, 1, 2)
    # FSDP2 pads each shard to ceil(m/S) rows: A 6 elements, B 4; a ring over 2 ranks moves one shard each way.
    fsdp = [("all_gather", "intra", 12), ("all_gather", "intra", 8),        # forward, bf16
            ("all_gather", "intra", 8), ("reduce_scatter", "intra", 16),    # backward block 2 (fp32 reduce)
            ("all_gather", "intra", 12), ("reduce_scatter", "intra", 24)]   # backward block 1
    assert _per_collective("fsdp_adamw", *args, zero=3) == fsdp
    # dmuon: B's row shard of rank 0 (2 rows x 2 x 2 bytes) after block 2, A's of rank 1 (2 x 3 x 2) after
    # block 1, then one return of every matrix: the owner of A sends 12 bytes, the owner of B 8; max(12, 8).
    assert _per_collective("dmuon", *args, zero=3) == [
        *fsdp[:4], ("all_to_all", "intra", 8), *fsdp[4:], ("all_to_all", "intra", 12), ("all_to_all", "intra", 12)]
    # Gather-then-compute: one all-gather of each direction in the wire dtype.
    assert _per_collective("gather", *args, zero=3) == fsdp + [("all_gather", "intra", 12), ("all_gather", "intra", 8)]
    # ZeRO-2: no backward all-gather.
    assert _per_collective("fsdp_adamw", *args, zero=2) == [fsdp[k] for k in (0, 1, 3, 5)]
    # Per rank, the larger of sent and received (not their sum): the return sends 12 and receives 8 on rank 0.
    ret = step_collectives("dmuon", *args)[-1]
    assert ret.ranks == [(12, 8), (8, 12)] and ret.critical == 12
    figures = step_comm(*args, zero=3, model=AlphaBeta(intra_bandwidth=4, intra_latency=1))
    assert figures["fsdp_adamw"]["critical_bytes"] == {"total": 80, "intra": 80, "inter": 0}
    assert figures["dmuon"]["critical_bytes"] == {"total": 112, "intra": 112, "inter": 0}
    assert figures["gather"]["critical_bytes"] == {"total": 100, "intra": 100, "inter": 0}
    # One message per collective here: seconds = collectives x 1 + bytes / 4.
    assert figures["fsdp_adamw"]["seconds"]["total"] == pytest.approx(6 + 80 / 4)
    assert figures["dmuon"]["seconds"]["total"] == pytest.approx(9 + 112 / 4)
    assert figures["gather"]["seconds"]["total"] == pytest.approx(8 + 100 / 4)
    assert figures["dmuon"]["collectives"] == {"total": 9, "intra": 9, "inter": 0}
    # One replica: dmuon's two designs issue the same collectives.
    assert figures["dmuon_native_hsdp"] == figures["dmuon"]
    for zero in (2, 3):
        assert step_collectives("dmuon_native_hsdp", *args, zero=zero) == step_collectives("dmuon", *args, zero=zero)


def test_step_collectives_by_hand_on_a_two_by_two_mesh():
    # One 4x3 matrix owned by plan rank 3 = (replica 1, column 1); 2 rows (12 bf16 bytes) per column.
    args = ([(4, 3)], [3], [1], 2, 2)
    fsdp = [("all_gather", "intra", 12), ("reduce_scatter", "intra", 24),
            ("all_reduce", "inter", 24)]  # ring over 2 replicas: 2 (R-1)/R of the 24-byte fp32 shard
    assert _per_collective("fsdp_adamw", *args, zero=2) == fsdp
    # native HSDP: FSDP2's all-reduce, then dmuon's exchange.
    dm = step_collectives("dmuon_native_hsdp", *args, zero=2)
    assert [(c.op, c.level, c.critical) for c in dm] == [
        *fsdp, ("all_to_all", "inter", 8), ("all_to_all", "intra", 12), ("all_to_all", "intra", 12),
        ("all_to_all", "inter", 12)]
    slices, directions, back, forward = dm[3:]
    # Replica 0 keeps the momentum of columns [0, 2) of its rows: 2 rows x 2 columns, 8 bytes
    # per rank, go to the same column of replica 1; replica 1 keeps column 2 and sends nothing.
    assert slices.ranks == [(8, 0), (8, 0), (0, 8), (0, 8)]
    # Only the owner's replica takes part in the shard-level exchanges.
    assert directions.ranks == [None, None, (12, 0), (0, 12)]
    assert back.ranks == [None, None, (0, 12), (12, 0)]
    # Each column of replica 1 forwards its rows to the same column of replica 0.
    assert forward.ranks == [(0, 12), (0, 12), (12, 0), (12, 0)]
    assert _per_collective("gather", *args, zero=2) == fsdp + [("all_gather", "intra", 12)]
    model = AlphaBeta(intra_bandwidth=12, inter_bandwidth=6, intra_latency=0.5, inter_latency=2)
    figures = step_comm(*args, zero=2, model=model)
    assert figures["fsdp_adamw"]["critical_bytes"] == {"total": 60, "intra": 36, "inter": 24}
    assert figures["dmuon_native_hsdp"]["critical_bytes"] == {"total": 104, "intra": 60, "inter": 44}
    assert figures["gather"]["critical_bytes"] == {"total": 72, "intra": 48, "inter": 24}
    # AG 0.5 + 12/12, RS 0.5 + 24/12, AR 2 x 2 + 24/6.
    assert figures["fsdp_adamw"]["seconds"]["intra"] == pytest.approx(1.5 + 2.5)
    assert figures["fsdp_adamw"]["seconds"]["inter"] == pytest.approx(4 + 4)
    # dmuon adds two one-peer intra exchanges (0.5 + 1 each) and two inter (2 + 8/6, 2 + 2).
    assert figures["dmuon_native_hsdp"]["seconds"]["total"] == pytest.approx(12 + 3 + (2 + 8 / 6) + 4)
    # the replicate level: no all-reduce; the fp32 gradient's column slices cross instead. Each rank of
    # replica 0 holds 2 rows x 3 columns, keeps columns [0, 2) and sends column 2 (2 x 1 x 4 = 8
    # bytes) to replica 1, from which it receives 2 x 2 x 4 = 16; replica 1 the other way round.
    db = step_collectives("dmuon", *args, zero=2)
    assert [(c.op, c.level, c.critical) for c in db] == [
        *fsdp[:2], ("all_to_all", "inter", 16), ("all_to_all", "inter", 8), ("all_to_all", "intra", 12),
        ("all_to_all", "intra", 12), ("all_to_all", "inter", 12)]
    assert db[2].ranks == [(8, 16), (8, 16), (16, 8), (16, 8)] and db[2].messages == 1
    assert db[2].label == "dmuon gradient columns block 1"
    assert [c.ranks for c in db[3:]] == [c.ranks for c in dm[3:]]
    assert figures["dmuon"]["critical_bytes"] == {"total": 96, "intra": 60, "inter": 36}
    # Intra as (a); inter: the column all_to_all 2 + 16/6, the direction slices 2 + 8/6, the update 2 + 12/6.
    assert figures["dmuon"]["seconds"]["intra"] == pytest.approx(figures["dmuon_native_hsdp"]["seconds"]["intra"])
    assert figures["dmuon"]["seconds"]["inter"] == pytest.approx(6 + 36 / 6)


def test_ring_all_gather_counts_n_times_s_minus_one_over_s():
    (ag,) = step_collectives("fsdp_adamw", [(8, 5)], [0], [1], 1, 4, zero=2)[:1]
    assert ag.critical == 80 * 3 // 4 and ag.messages == 3
    # Uneven rows move FSDP2's padded shards: 5 rows over 4 ranks pad to 2 rows each.
    (ag,) = step_collectives("fsdp_adamw", [(5, 5)], [0], [1], 1, 4, zero=2)[:1]
    assert ag.critical == 3 * 2 * 5 * 2


def test_step_exchange_sums_to_owner_traffic():
    rng = random.Random(3)
    for replicate, shard in [(1, 3), (2, 3), (3, 2), (2, 2)]:
        shapes = [(rng.randint(1, 9), rng.randint(1, 5)) for _ in range(7)]
        owners = [rng.randrange(replicate * shard) for _ in shapes]
        blocks = [rng.randrange(3) for _ in shapes]
        for strategy, per_rank in (("dmuon_native_hsdp", owner_traffic(shapes, owners, replicate, shard, 2)),
                                   ("dmuon", owner_traffic_column_reduce(shapes, owners, replicate, shard, 2, 4))):
            collectives = [c for c in step_collectives(strategy, shapes, owners, blocks, replicate, shard,
                                                       reduce_bytes=4) if c.op == "all_to_all"]
            assert _summed(collectives, replicate * shard) == per_rank, (strategy, replicate, shard)
            # the replicate level has no replicate all-reduce; native HSDP one per block (FSDP2's).
            reduces = [c for c in step_collectives(strategy, shapes, owners, blocks, replicate, shard)
                       if c.op == "all_reduce"]
            assert len(reduces) == (0 if strategy == "dmuon" or replicate == 1 else len(set(blocks)))


def test_step_strategies_and_step_comm_keys():
    import json
    assert STEP_STRATEGIES == ("dmuon", "dmuon_native_hsdp", "fsdp_adamw", "gather")
    shapes, owners, blocks = [(5, 7), (6, 4, 3)], [1, 2], [1, 2]
    for replicate, shard in [(1, 4), (2, 2)]:
        comm = json.loads(json.dumps(step_comm(shapes, owners, blocks, replicate, shard)))
        assert set(comm) == set(STEP_STRATEGIES)
        assert all(set(comm[k]) == {"critical_bytes", "seconds", "collectives"} for k in comm)
        if replicate == 1:
            assert comm["dmuon"] == comm["dmuon_native_hsdp"]
        else:
            # the replicate level trades FSDP2's all-reduce (2 (R-1) ring steps a block) for one all_to_all a
            # block, which carries the block before's hop A: one collective fewer a block but the first.
            a, b = comm["dmuon_native_hsdp"], comm["dmuon"]
            assert b["collectives"]["total"] == a["collectives"]["total"] - (len(set(blocks)) - 1)
            assert b["critical_bytes"]["intra"] == a["critical_bytes"]["intra"]
            assert b["critical_bytes"]["inter"] < a["critical_bytes"]["inter"]


def test_step_model_rejects_bad_input():
    with pytest.raises(ValueError):
        step_collectives("adam", [(2, 2)], [0], [0], 1, 2)
    with pytest.raises(ValueError):
        step_collectives("dmuon", [(2, 2)], [0], [0, 1], 1, 2)
    with pytest.raises(ValueError):
        AlphaBeta(intra_bandwidth=0)
    assert step_figures([])["critical_bytes"]["total"] == 0


def test_ddp_hops_take_the_route_with_the_fewer_bytes_through_the_busiest_rank():
    """dmuon under torch's DDP: per wave, a padded all-gather ((N-1) x the largest share through every rank) or
    the scatter (an all-to-all evening the updates into ceil(total/N) chunks, then their all-gather), whichever
    moves less through the busiest rank; from shapes and owners, by formulas written here."""
    from dmuon.costmodel.traffic import ddp_collectives, ddp_hops, scatter_parts

    assert ddp_hops([5, 5, 5, 5], 1) == ("all_gather", [[(15, 15)] * 4])
    # 20 elements in chunks of 5: owner 0's 12 fill chunks 0, 1 and 2 of 3; owners 1 and 2 the rest.
    parts, chunk = scatter_parts([12, 4, 4, 0])
    assert chunk == 5 and parts == [[5, 5, 2, 0], [0, 0, 3, 1], [0, 0, 0, 4], [0, 0, 0, 0]]
    route, hops = ddp_hops([12, 4, 4, 0], 1)
    assert route == "scatter"  # padded: 3 x 12 = 36 through every rank; scattered: at most 7 + 15 = 22
    assert hops[0] == [(7, 0), (4, 5), (4, 5), (0, 5)] and hops[1] == [(15, 15)] * 4
    shapes, owners = [(4, 3), (4, 3), (2, 3), (2, 3)], [0, 1, 0, 1]  # shares 18 and 18 elements
    assert ddp_collectives(shapes, owners, 2, elem_bytes=2) == [(36, 36)]
    shapes, owners = [(8, 8), (2, 2), (1, 3)], [0, 1, 2]  # shares 64, 4, 3 on 3 ranks
    route, hops = ddp_hops([64, 4, 3], 2)
    assert route == "scatter"
    for rank in range(3):
        assert ddp_collectives(shapes, owners, 3, elem_bytes=2, rank=rank) == [h[rank] for h in hops]
        assert hops[1][rank] == (2 * 24 * 2, 2 * 24 * 2)  # chunks of ceil(71 / 3) = 24, from two peers
    assert ddp_collectives(shapes, owners, 1) == []
