"""Per-rank memory, measured: DMuon on FSDP2 costs what AdamW on FSDP2 costs, less optimizer state.

Parameters and gradients are FSDP2's own shards under both optimizers;
Muon keeps one fp32 momentum buffer per matrix shard where AdamW keeps two.
"""

from __future__ import annotations

import math

import pytest

from support.spawn import run_distributed

from support.memory import adamw_vs_dmuon

WORLD = 4
DIM, HIDDEN, BLOCKS = 256, 1024, 6


@pytest.fixture(scope="module")
def measured():
    return run_distributed(adamw_vs_dmuon, WORLD, DIM, HIDDEN, BLOCKS, 2, timeout_s=120)


def _worst(measured, kind: str, key: str) -> int:
    return max(r[kind][key] for r in measured)


def test_parameter_and_gradient_bytes_match_adamw(measured):
    for key in ("param_bytes", "grad_bytes"):
        adamw, muon = _worst(measured, "adamw", key), _worst(measured, "dmuon", key)
        assert adamw > 0, key
        assert muon <= 1.10 * adamw, (key, muon, adamw)


def test_optimizer_state_is_no_more_than_adamw(measured):
    adamw, muon = _worst(measured, "adamw", "state_bytes"), _worst(measured, "dmuon", "state_bytes")
    assert 0 < muon <= adamw, (muon, adamw)
    # The matrices dominate, so one buffer per matrix instead of two is close to half.
    assert muon <= 0.6 * adamw, (muon, adamw)


def test_matrix_gradients_are_sharded(measured):
    matrices = measured[0]["dmuon"]["matrices"]
    assert len(matrices) == 2 * BLOCKS
    for name in matrices:
        rows, cols = measured[0]["dmuon"]["grad_numel"][name][1]
        local = [r["dmuon"]["grad_numel"][name][0] for r in measured]
        assert sum(local) == rows * cols, name
        assert max(local) <= math.ceil(rows / WORLD) * cols, (name, local)
