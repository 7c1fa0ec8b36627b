"""The bytes-per-block pass: same loads, fewer bytes each block's exchange waits for."""

from __future__ import annotations

import itertools
import random
from collections import Counter

import pytest

from dmuon.plan.spread import block_wait_bytes, spread_blocks


def test_two_blocks_of_two_big_matrices_end_on_different_ranks():
    # LPT-like owners: each block's two big matrices on one rank, so each exchange waits
    # for both (2 x 100 elements, 1/2 of them off the owner on a 2-rank shard level).
    owners, kinds, blocks, numels = [0, 0, 1, 1], [0, 0, 0, 0], [0, 0, 1, 1], [100] * 4
    assert block_wait_bytes(owners, blocks, numels, 1, 2) == 2 * 0.5 * 200
    new = spread_blocks(owners, kinds, blocks, numels, 1, 2)
    assert Counter(new) == Counter(owners)
    assert block_wait_bytes(new, blocks, numels, 1, 2) == 2 * 0.5 * 100
    assert new[0] != new[1] and new[2] != new[3]


def test_only_same_kind_matrices_swap():
    # The two block-0 matrices are of different kinds and the only partners are the other
    # kind's: nothing may move, even though spreading would help.
    owners, kinds, blocks, numels = [0, 0, 1], [0, 1, 2], [0, 0, 1], [100, 100, 100]
    assert spread_blocks(owners, kinds, blocks, numels, 1, 2) == owners


def test_replicas_count_on_hsdp():
    # 2 x 2 mesh; block 0's two matrices in replica 0 (ranks 0, 1), block 1's in replica 1.
    # Per rank nothing to gain, but each owner replica receives both matrices' column slices.
    owners, kinds, blocks, numels = [0, 1, 2, 3], [0] * 4, [0, 0, 1, 1], [64] * 4
    before = block_wait_bytes(owners, blocks, numels, 2, 2)
    new = spread_blocks(owners, kinds, blocks, numels, 2, 2)
    after = block_wait_bytes(new, blocks, numels, 2, 2)
    assert Counter(new) == Counter(owners) and after < before
    assert {new[0] // 2, new[1] // 2} == {0, 1} and {new[2] // 2, new[3] // 2} == {0, 1}


@pytest.mark.parametrize("seed", range(6))
def test_random_cases_keep_every_rank_kind_count_and_end_in_a_swap_optimum(seed):
    rng = random.Random(seed)
    replicate, shard = rng.choice([(1, 3), (1, 4), (2, 2), (2, 3)])
    world = replicate * shard
    n = rng.randint(4, 14)
    kinds = [rng.randrange(3) for _ in range(n)]
    size = {k: rng.choice([10, 40, 160]) for k in range(3)}
    numels = [size[k] for k in kinds]
    blocks = [rng.randrange(4) for _ in range(n)]
    owners = [rng.randrange(world) for _ in range(n)]
    new = spread_blocks(owners, kinds, blocks, numels, replicate, shard, max_passes=50)
    assert Counter(zip(owners, kinds)) == Counter(zip(new, kinds))  # loads, batches, state: unchanged
    best = block_wait_bytes(new, blocks, numels, replicate, shard)
    assert best <= block_wait_bytes(owners, blocks, numels, replicate, shard)
    # No single swap of two same-kind owners lowers it further.
    for i, j in itertools.combinations(range(n), 2):
        if kinds[i] == kinds[j]:
            swapped = list(new)
            swapped[i], swapped[j] = swapped[j], swapped[i]
            assert block_wait_bytes(swapped, blocks, numels, replicate, shard) >= best * (1 - 1e-9), (i, j)
    assert spread_blocks(owners, kinds, blocks, numels, replicate, shard, max_passes=50) == new  # deterministic


def test_length_mismatch_is_an_error():
    with pytest.raises(ValueError, match="one entry per matrix"):
        spread_blocks([0, 1], [0], [0, 0], [1, 1], 1, 2)
