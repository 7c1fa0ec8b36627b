"""Overlap mode: reductions launched during backward, async publication, same bits as sync mode."""

from __future__ import annotations

import pytest
import torch

from dmuon.testing import faults, run_distributed
from dmuon.testing.cases import Case

from test_core_equivalence import SKIP, STEPS, _max_diff, _reference, _run_all


@pytest.mark.parametrize("mesh_shape", [None, (2, 2)])
def test_overlap_is_bit_identical_to_sync(mesh_shape):
    world_size = 3 if mesh_shape is None else 4
    cases = [
        Case(zero=zero, overlap=overlap, ns_dtype=torch.float32, steps=STEPS, skip=SKIP, mesh_shape=mesh_shape)
        for zero in (2, 3) for overlap in (True, False)
    ]
    results = run_distributed(_run_all, world_size, cases, timeout_s=180)
    ref, _ = _reference(world_size, torch.float32)
    for k in (0, 2):
        on, off = results[0][k]["params"], results[0][k + 1]["params"]
        for name in on:
            assert torch.equal(on[name], off[name]), f"zero={cases[k].zero}: {name} differs"
        diff, worst = _max_diff(on, ref)
        assert diff <= 1e-5, worst
        for step in range(STEPS):
            assert [r[k]["stats"][step]["orthogonalized"] for r in results] == \
                   [r[k + 1]["stats"][step]["orthogonalized"] for r in results]


def test_gradients_ready_in_different_orders_on_different_ranks():
    on = run_distributed(faults.rotated_branches, 3, True, timeout_s=60)
    off = run_distributed(faults.rotated_branches, 3, False, timeout_s=60)
    for name in on[0]:
        assert torch.equal(on[0][name], off[0][name]), name
        assert all(torch.equal(on[0][name], o[name]) for o in on), name
