"""FSDP2's row split (torch.chunk's rule) against hand-computed cases and torch itself."""

from __future__ import annotations

import pytest
import torch

from dmuon.plan.layout import shard_rows


def _torch_rows(m: int, shard: int) -> list[int]:
    """Row counts as FSDP2 gets them: torch.chunk, padded with empty columns."""
    sizes = [len(c) for c in torch.arange(m).chunk(shard)] if m else []
    return sizes + [0] * (shard - len(sizes))


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


def test_bad_input_is_rejected():
    with pytest.raises(ValueError, match="shard must be"):
        shard_rows(3, 0)
