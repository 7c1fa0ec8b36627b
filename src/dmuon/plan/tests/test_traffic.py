"""The traffic model against hand-computed cases and a message-by-message simulation."""

from __future__ import annotations

import math
import random

import pytest
import torch

from dmuon.plan.traffic import (
    RankTraffic,
    critical_path,
    fsdp2_traffic,
    gather_traffic,
    owner_traffic,
    shard_rows,
)


def _torch_rows(m: int, shard: int) -> list[int]:
    """Row counts as FSDP2 gets them: torch.chunk, padded with empty columns."""
    sizes = [len(c) for c in torch.arange(m).chunk(shard)] if m else []
    return sizes + [0] * (shard - len(sizes))


def _messages(shapes, owners, replicate, shard, elem_bytes):
    """Every (sender, receiver, bytes, level) message of the three steps, self-sends included."""
    for shape, owner in zip(shapes, owners):
        r_o, s_o = divmod(owner, shard)
        width = math.prod(shape[1:])
        rows = _torch_rows(shape[0], shard)
        for s in range(shard):
            if s != s_o:
                yield (r_o * shard + s, owner, rows[s] * width * elem_bytes, "intra")   # 1: to the owner
                yield (owner, r_o * shard + s, rows[s] * width * elem_bytes, "intra")   # 2: update back
        for s in range(shard):
            for r in range(replicate):
                if r != r_o:                                                         # 3: other replicas
                    yield (r_o * shard + s, r * shard + s, rows[s] * width * elem_bytes, "inter")


def _simulate(shapes, owners, replicate, shard, elem_bytes) -> list[RankTraffic]:
    out = [RankTraffic() for _ in range(replicate * shard)]
    for src, dst, size, level in _messages(shapes, owners, replicate, shard, elem_bytes):
        if src == dst:
            continue
        setattr(out[src], f"{level}_sent", getattr(out[src], f"{level}_sent") + size)
        setattr(out[dst], f"{level}_received", getattr(out[dst], f"{level}_received") + size)
    return out


@pytest.mark.parametrize("m,shard,rows", [
    (5, 3, [2, 2, 1]), (4, 3, [2, 2, 0]), (6, 4, [2, 2, 2, 0]), (1, 4, [1, 0, 0, 0]),
    (8, 1, [8]), (0, 2, [0, 0]), (7, 7, [1] * 7),
])
def test_shard_rows_by_hand(m, shard, rows):
    assert shard_rows(m, shard) == rows


def test_shard_rows_follow_torch_chunk():
    for m in range(0, 40):
        for shard in range(1, 12):
            assert shard_rows(m, shard) == _torch_rows(m, shard), (m, shard)


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
    # A: rows [2, 2] of 3, owner (0, 1). B: rows [2, 1] of 2, owner (1, 0).
    t = owner_traffic([(4, 3), (3, 2)], [1, 2], 2, 2)
    got = [(x.intra_sent, x.intra_received, x.inter_sent, x.inter_received) for x in t]
    assert got == [(12, 12, 12, 8), (12, 12, 12, 4), (4, 4, 8, 12), (4, 4, 4, 12)]


def test_rows_are_flattened_over_trailing_dimensions():
    # A (5, 2, 3) conv kernel moves like a 5 x 6 matrix.
    assert owner_traffic([(5, 2, 3)], [1], 2, 3) == owner_traffic([(5, 6)], [1], 2, 3)


def test_zero_traffic_on_a_rank_without_rows_or_matrices():
    # 4 rows over 3 columns leave column 2 empty; it owns nothing either.
    t = owner_traffic([(4, 5), (4, 9)], [0, 1], 1, 3)
    assert t[2] == RankTraffic()
    assert t[0].sent > 0 and t[1].sent > 0


def test_levels_conserve_bytes_and_match_the_simulation():
    rng = random.Random(0)
    for _ in range(200):
        replicate, shard = rng.randint(1, 4), rng.randint(1, 5)
        world = replicate * shard
        shapes = [tuple(rng.randint(1, 9) for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(1, 6))]
        owners = [rng.randrange(world) for _ in shapes]
        elem = rng.choice([2, 4])
        model = owner_traffic(shapes, owners, replicate, shard, elem)
        assert model == _simulate(shapes, owners, replicate, shard, elem), (shapes, owners, replicate, shard)
        assert sum(x.intra_sent for x in model) == sum(x.intra_received for x in model)
        assert sum(x.inter_sent for x in model) == sum(x.inter_received for x in model)
        # Every row reaches each other replica exactly once.
        numel = sum(math.prod(s) for s in shapes)
        assert sum(x.inter_sent for x in model) == (replicate - 1) * numel * elem


def test_critical_path_is_the_busiest_direction_of_any_rank():
    t = owner_traffic([(4, 3), (3, 2)], [1, 2], 2, 2)
    assert critical_path(t) == max(max(x.sent for x in t), max(x.received for x in t)) == 24
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


def test_bad_input_is_rejected():
    with pytest.raises(ValueError, match="owner 4 outside"):
        owner_traffic([(2, 2)], [4], 2, 2)
    with pytest.raises(ValueError, match="1 shapes but 2 owners"):
        owner_traffic([(2, 2)], [0, 1], 1, 2)
    with pytest.raises(ValueError, match="shard must be"):
        shard_rows(3, 0)
    with pytest.raises(ValueError, match="elem_bytes"):
        owner_traffic([(2, 2)], [0], 1, 2, elem_bytes=0)
