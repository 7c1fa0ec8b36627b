"""Overlap mode: reductions launched during backward, async publication, same bits as sync mode."""

from __future__ import annotations

import time

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


def test_ns_in_backward_matches_the_reference_and_starts_in_backward():
    world_size = 3
    cases = [
        Case(zero=zero, ns_in_backward=eager, ns_dtype=torch.float32, steps=STEPS, skip=SKIP)
        for zero in (2, 3) for eager in (True, False)
    ]
    results = run_distributed(_run_all, world_size, cases, timeout_s=180)
    ref, _ = _reference(world_size, torch.float32)
    for k in (0, 2):
        eager, late = results[0][k]["params"], results[0][k + 1]["params"]
        diff, worst = _max_diff(eager, ref)
        assert diff <= 1e-5, worst
        # Same math; only the NS batches differ (per block instead of across blocks).
        diff, worst = _max_diff(eager, late)
        assert diff <= 1e-6, worst
        stats = [[r[k]["stats"][step] for r in results] for step in range(STEPS)]
        for step, per_rank in enumerate(stats):
            done = sum(s["orthogonalized"] for s in per_rank)
            early = sum(s["orthogonalized_in_backward"] for s in per_rank)
            assert done == sum(s["orthogonalized"] for s in (r[k + 1]["stats"][step] for r in results))
            if step in SKIP:
                # The unused block stops the early launches: it and the blocks after it
                # in reduction order go in step().
                assert 0 < early < done
            else:
                assert early == done
        # Without the option nothing starts in backward.
        assert all(s["orthogonalized_in_backward"] == 0 for r in results for s in r[k + 1]["stats"])


def _hsdp_rejects_ns_in_backward(rank, world_size):
    from dmuon.testing.cases import sharded_oddnet

    with pytest.raises(ValueError, match="1-D meshes"):
        sharded_oddnet(world_size, zero=2, mesh_shape=(2, 2), ns_in_backward=True)
    return True


def test_ns_in_backward_rejects_what_it_cannot_honour():
    import dmuon
    from dmuon.testing.models import OddNet, lm_loss, odd_batch

    model = OddNet()
    plan = dmuon.prepare(model, None)
    with pytest.raises(ValueError, match="overlap=True"):
        dmuon.DMuon(model, plan, ns_in_backward=True, overlap=False)
    with pytest.raises(ValueError, match="nonfinite"):
        dmuon.DMuon(model, plan, ns_in_backward=True, nonfinite="skip")
    opt = dmuon.DMuon(model, plan, ns_in_backward=True, ns_dtype=torch.float32)
    lm_loss(model, odd_batch(0, 0)).backward()
    # The owner's momentum advances on the worker before step() is called.
    deadline = time.monotonic() + 30
    while not all("momentum_buffer" in opt.state[i.param] for i in plan.infos):
        assert time.monotonic() < deadline, "NS did not start in backward"
        time.sleep(0.01)
    with pytest.raises(ValueError, match="ns_in_backward"):
        dmuon.clip_grad_norm_(model, 1.0, opt)
    opt.step()
    assert opt.last_step_stats()["orthogonalized_in_backward"] == len(plan.infos)
    assert all(run_distributed(_hsdp_rejects_ns_in_backward, 4, timeout_s=60))
