"""The traffic model against hand-computed cases and a message-by-message simulation."""

from __future__ import annotations

import math
import random

import pytest
import torch

from dmuon.costmodel.traffic import (
    RankTraffic,
    critical_path,
    fsdp2_traffic,
    gather_traffic,
    owner_exchange_collectives,
    owner_traffic,
    owner_traffic_column_reduce,
)
from dmuon.plan.plan import Piece
from dmuon.plan.publication import SCATTER, Published, choose_route

from ._helpers import summed_per_rank


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
    assert summed_per_rank(backward, 4) == summed_per_rank(apart + [first, first], 4) and len(backward) == len(apart) + 1
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
        assert summed_per_rank(backward + step, world) == owner_traffic_column_reduce(
            shapes, owners, replicate, shard, elem, grad, pieces=pieces), (shapes, owners)
        backward, step = owner_exchange_collectives(shapes, owners, blocks, replicate, shard, elem, pieces=pieces)
        assert summed_per_rank(backward + step, world) == owner_traffic(shapes, owners, replicate, shard, elem,
                                                                pieces=pieces), (shapes, owners)
        # In return waves, each with its own route across replicas (and the scatter route's all-gather
        # joined with the next wave's first collective): the same per-rank sums.
        cut = sorted(rng.sample(range(1, len(shapes)), 2))
        order = rng.sample(range(len(shapes)), len(shapes))
        waves = [order[:cut[0]], order[cut[0]:cut[1]], order[cut[1]:]]
        for publication in (None, "direct", "scatter"):
            backward, step = owner_exchange_collectives(shapes, owners, blocks, replicate, shard, elem, pieces=pieces,
                                                        gradient_bytes=grad, waves=waves, publication=publication)
            summed = summed_per_rank(backward + step, world)
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
