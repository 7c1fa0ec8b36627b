"""DMuon on FSDP2 over 1-4 gloo ranks equals one process running torch.optim.Muon + AdamW,
and equals gather-then-compute on the same fully_shard setup however FSDP2 is configured."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dmuon.util.spawn import run_distributed

from support.cases import MUON_KW, Case, run_case
from support.models import OddNet, lm_loss, odd_batch
from support.reference import reference_training

STEPS = 3
SKIP = {1: {1}}  # block 1 is unused at step 1 on every rank
N_MATRICES = 12  # conv, 3 per block x 3 blocks, gate, lift


def _reference(world_size: int, ns_dtype: torch.dtype, frozen: tuple[str, ...] = ()):
    torch.manual_seed(0)
    model = OddNet()
    for name, p in model.named_parameters():
        if name.startswith(frozen):
            p.requires_grad_(False)
    batches = []
    for step in range(STEPS):
        parts = [odd_batch(step, r) for r in range(world_size)]
        batches.append((torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])))

    def loss_fn(m, batch, _step=[0]):
        m.skip = SKIP.get(_step[0], set())
        _step[0] += 1
        return lm_loss(m, batch)

    return reference_training(
        model, batches, loss_fn, muon_kwargs=MUON_KW,
        adamw_kwargs=dict(lr=3e-3, weight_decay=0.01), ns_dtype=ns_dtype,
    )


def _max_diff(a: dict, b: dict) -> tuple[float, str]:
    assert a.keys() == b.keys()
    worst = max(a, key=lambda n: (a[n] - b[n]).abs().max().item())
    return (a[worst] - b[worst]).abs().max().item(), worst


def _run_all(rank, world_size, cases):
    return [run_case(rank, world_size, c) for c in cases]


def _check_sharded_state(results, k, shapes) -> None:
    """Momentum lives beside the shards: each matrix's buffers over all ranks add up to it once."""
    for name, shape in shapes.items():
        total = sum(r[k]["momentum_numel"].get(name, 0) for r in results)
        assert total == torch.Size(shape).numel(), name


# bf16 NS: the distributed gradient differs from the single-process one by
# summation order (~1e-7 relative). Inside bf16 NS that can flip the rounding
# of an element (relative 2^-8), changing an NS output entry by a few bf16 ulps
# of its O(1) magnitude. Each step moves a weight by lr * sqrt(max(1, m/n)) *
# |NS entry| <= 0.02 * 5.4 * 1.2; a flip changes the step by at most 2^-6 of that
# with margin, so after STEPS steps the bound is STEPS * 0.02 * 5.4 * 1.2 / 64.
BF16_TOL = STEPS * 0.02 * 5.4 * 1.2 / 64


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_matches_single_process_reference(world_size):
    cases = [
        Case(zero=2, ns_dtype=torch.float32, steps=STEPS, skip=SKIP),
        Case(zero=3, ns_dtype=torch.float32, steps=STEPS, skip=SKIP),
        Case(zero=3, ns_dtype=torch.bfloat16, steps=STEPS, skip=SKIP),
        Case(kind="gather", ns_dtype=torch.float32, steps=STEPS, skip=SKIP),
    ]
    results = run_distributed(_run_all, world_size, cases)
    ref32, losses32 = _reference(world_size, torch.float32)
    ref16, _ = _reference(world_size, torch.bfloat16)
    per_step_active = [N_MATRICES - 3 * len(SKIP.get(s, ())) for s in range(STEPS)]
    for k, case in enumerate(cases):
        out = results[0][k]
        ref = ref16 if case.ns_dtype == torch.bfloat16 else ref32
        tol = BF16_TOL if case.ns_dtype == torch.bfloat16 else 1e-5
        diff, worst = _max_diff(out["params"], ref)
        assert diff <= tol, f"{case}: {worst} differs by {diff:.3g} (tol {tol:.3g})"
        if case.ns_dtype == torch.float32:
            assert out["losses"] == pytest.approx(losses32, rel=1e-5, abs=1e-6)
        if case.kind == "dmuon":
            for step in range(STEPS):
                # Each active matrix orthogonalized exactly once in the cluster.
                assert sum(r[k]["stats"][step]["orthogonalized"] for r in results) == per_step_active[step]
                # Every block with gradients was exchanged from backward (root + 3 layers, one skipped at step 1).
                assert out["stats"][step]["blocks_exchanged_in_backward"] == 4 - len(SKIP.get(step, ()))
            _check_sharded_state(results, k, out["shapes"])
            assert set(out["owners"].values()) == set(range(world_size))


FROZEN = ("layers.0.", "layers.2.mid.")  # a whole block and one matrix of another


def _oracle_pairs() -> list[tuple[str, Case]]:
    base = Case(ns_dtype=torch.float32, steps=STEPS, skip=SKIP)
    settings = {
        "bf16 mixed precision": dict(bf16=True),
        "bf16 mixed precision, ZeRO-2": dict(bf16=True, zero=2),
        "frozen parameters": dict(frozen=FROZEN),
        "activation checkpointing": dict(activation_checkpointing="early_stop"),
        "torch.compile per block": dict(compile=True, steps=2),
        "bf16 NS, ns_in_backward": dict(ns_dtype=torch.bfloat16, ns_in_backward=True),
    }
    return [(label, dataclasses.replace(base, **kw)) for label, kw in settings.items()]


def test_equals_gather_then_compute_under_fsdp2_settings():
    pairs = _oracle_pairs()
    cases = []
    for _, case in pairs:
        cases += [case, dataclasses.replace(case, kind="gather", ns_in_backward=False)]
    results = run_distributed(_run_all, 3, cases, timeout_s=300)
    torch.manual_seed(0)
    start = {n: p.detach().clone() for n, p in OddNet().named_parameters()}
    for k, (label, case) in enumerate(pairs):
        got, oracle = results[0][2 * k], results[0][2 * k + 1]
        diff, worst = _max_diff(got["params"], oracle["params"])
        assert diff <= 1e-5, f"{label}: {worst} differs from gather-then-compute by {diff:.3g}"
        assert got["losses"] == pytest.approx(oracle["losses"], rel=1e-5), label
        moved = [n for n in start if not torch.equal(got["params"][n], start[n])]
        if case.frozen:
            frozen = [n for n in start if n.startswith(case.frozen)]
            assert frozen and not set(frozen) & set(moved), label
            assert not set(frozen) & {n for r in results for n in r[2 * k]["state_keys"]}, label
            assert sum(r[2 * k]["stats"][0]["orthogonalized"] for r in results) == N_MATRICES - 4
        else:
            assert len(moved) == len(start), label
