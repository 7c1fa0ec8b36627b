"""The two routes of an update wave across replicas, by hand, and the choice between them."""

from __future__ import annotations

import random

import pytest

from dmuon.plan.layout import shard_rows
from dmuon.plan.publication import DIRECT, SCATTER, Published, choose_route, part_sizes, route_stages


def _matrix(rows: int, cols: int, owner_replica: int, shard: int, inner: int = 1) -> Published:
    """FSDP2's full-width row chunks of a ``rows x cols`` matrix."""
    return Published(owner_replica, tuple((n, cols) for n in shard_rows(rows, shard)), inner)


def _per_rank(stage) -> list[tuple[int, int]]:
    return list(zip(stage.sent, stage.received))


def test_a_wave_owned_in_one_replica_takes_the_scatter_route():
    # R = 4 x S = 2, bf16: an 8 x 8 and a 4 x 8 matrix, both owned in replica 0. Per position the
    # pieces are 4 x 8 (64 bytes) and 2 x 8 (32); the column slices 2 wide: parts of 16 and 8 bytes.
    wave = [_matrix(8, 8, 0, 2), _matrix(4, 8, 0, 2)]
    direct, = route_stages(DIRECT, wave, 4, 2, 2, peers=True)
    # Direct: (0, s) sends both pieces to 3 replicas (3 * 96); every other rank receives 96.
    assert _per_rank(direct) == [(288, 0)] * 2 + [(0, 96)] * 6
    assert direct.critical == 288
    assert direct.peers_out[0] == {2, 4, 6} and direct.peers_in[2] == {0} and direct.peers_out[2] == set()
    scatter, gather = route_stages(SCATTER, wave, 4, 2, 2, peers=True)
    # Scatter: (0, s) sends parts 1-3 (3 * 24), (q, s) receives its part q (24).
    assert _per_rank(scatter) == [(72, 0)] * 2 + [(0, 24)] * 6
    # All-gather: (0, s) sends part 0 to 3 replicas (72) and needs nothing; (q, s) sends its part
    # to the 2 replicas that are neither it nor the owner's (48) and receives the 3 others (72).
    assert _per_rank(gather) == [(72, 0)] * 2 + [(48, 72)] * 6
    assert (scatter.critical, gather.critical) == (72, 72)
    assert scatter.peers_out[1] == {3, 5, 7} and scatter.peers_in[3] == {1} and scatter.peers_out[3] == set()
    assert gather.peers_out[2] == {4, 6} and gather.peers_in[2] == {0, 4, 6} and gather.peers_in[0] == set()
    # Every route moves each piece to R - 1 replicas: the same bytes in all.
    assert sum(direct.sent) == sum(scatter.sent) + sum(gather.sent) == sum(direct.received) == 3 * 2 * 96
    # 72 + 72 < 288.
    assert choose_route(wave, 4, 2, 2) == SCATTER


def test_three_replicas_and_a_row_state():
    # R = 3, S = 1, one 6 x 6 bf16 matrix owned in replica 2, 4 bytes of row state a row: each part
    # is a 6 x 2 column slice (24 bytes) and the state of a 2-row chunk (8).
    wave = [_matrix(6, 6, 2, 1)]
    assert part_sizes(6, 6, 1, 3, 2, 4) == (32, 32, 32)
    direct, = route_stages(DIRECT, wave, 3, 1, 2, row_bytes=4)
    assert _per_rank(direct) == [(0, 96), (0, 96), (192, 0)]
    scatter, gather = route_stages(SCATTER, wave, 3, 1, 2, row_bytes=4)
    assert _per_rank(scatter) == [(0, 32), (0, 32), (64, 0)]
    # Replica 0 sends its part to replica 1 and receives part 1 from it and part 2 from the owner's.
    assert _per_rank(gather) == [(32, 64), (32, 64), (64, 0)]
    assert choose_route(wave, 3, 1, 2, 4) == SCATTER  # 64 + 64 < 192


def test_balanced_ownership_ties_and_keeps_the_direct_route():
    # R = 4 x S = 2: four 8 x 8 bf16 matrices, one owned in each replica. Direct: every rank sends its
    # piece (64) to 3 replicas and receives 3 pieces: 192 each way. Scatter: 3 parts of 16 each way
    # (48), then its own part to 3 replicas and 3 others' to 2 each (48 + 96) and 9 parts back (144).
    wave = [_matrix(8, 8, q, 2) for q in range(4)]
    direct, = route_stages(DIRECT, wave, 4, 2, 2)
    scatter, gather = route_stages(SCATTER, wave, 4, 2, 2)
    assert set(_per_rank(direct)) == {(192, 192)}
    assert set(_per_rank(scatter)) == {(48, 48)} and set(_per_rank(gather)) == {(144, 144)}
    assert choose_route(wave, 4, 2, 2) == DIRECT  # 48 + 144 == 192: a tie, fewer latencies


def test_two_replicas_always_go_direct():
    wave = [_matrix(8, 8, 0, 2), _matrix(4, 8, 0, 2)]
    assert choose_route(wave, 2, 2, 2) == DIRECT
    # Two collectives never move less than one with two replicas.
    rng = random.Random(0)
    for _ in range(50):
        shard = rng.randint(1, 4)
        wave = [_matrix(rng.randint(1, 9), rng.randint(1, 9), rng.randrange(2), shard) for _ in range(3)]
        direct = sum(st.critical for st in route_stages(DIRECT, wave, 2, shard, 2, 4))
        assert sum(st.critical for st in route_stages(SCATTER, wave, 2, shard, 2, 4)) >= direct


def test_a_column_holding_nothing_takes_no_part():
    # A 1-row matrix over S = 2: position 1 holds none of it, so its replicate group issues nothing.
    wave = [_matrix(1, 6, 1, 2)]
    for route in (DIRECT, SCATTER):
        for stage in route_stages(route, wave, 3, 2, 4):
            assert stage.taking_part == [True, False] * 3
    # One column of 3: parts 1 and 2 are empty, so only the owner's replica has a part to gather,
    # and the scatter moves nothing (its column takes no part in it).
    scatter, gather = route_stages(SCATTER, [_matrix(2, 1, 0, 1)], 3, 1, 4)
    assert scatter.taking_part == [False] * 3 and _per_rank(gather) == [(16, 0), (0, 8), (0, 8)]


def test_bad_route_is_rejected():
    with pytest.raises(ValueError, match="route must be one of"):
        route_stages("ring", [], 2, 2, 2)
