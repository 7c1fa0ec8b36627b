"""dmuon.NorMuon equals NorMuon's rule in one process, written here from its formula, on any mesh:
1-4 ranks, FSDP2's HSDP and dmuon's replicate level on 2x2, TP (dp2 x tp2), FSDP2's column shards;
bf16 mixed precision equals the gather-then-compute oracle; a checkpoint saved on 2 ranks resumes
exactly on 3 and on 2x2; the counted bytes are the traffic model's with the second moment's row state.

Each world size's runs share one process group (``support.normuon.normuon_runs``).
"""

from __future__ import annotations

import functools
import tempfile

import pytest
import torch
from torch import nn

import dmuon
from dmuon.costmodel.traffic import owner_exchange_collectives
from dmuon.rules.normuon import normalize_rows
from support.spawn import run_distributed

from support.cases import MUON_KW, NORMUON_BETA2
from support.equivalence import N_MATRICES, max_diff
from support.models import OddNet
from support.normuon import (
    COUNTED, SKIP, STEPS, checkpoint_reference, equivalence_cases, normuon_runs, oddnet_reference, tp_reference,
)
from support.step_comm import check_counted_log

_DIRECTORY = tempfile.TemporaryDirectory()


@functools.cache
def _runs(world_size: int, slow: bool = False) -> list[dict]:
    if world_size != 2 and not slow:
        _runs(2)  # saves the checkpoint the other world sizes resume
    return run_distributed(normuon_runs, world_size, _DIRECTORY.name, slow, timeout_s=600)


# ------------------------------------------------------------------------ the rule alone

def test_normalize_rows_is_the_formula_per_matrix():
    """Batched, with a different beta2 per matrix, each result is the formula's on that matrix alone;
    the inputs are not written."""
    g = torch.Generator().manual_seed(0)
    orthos = [torch.randn(5, 3, generator=g) for _ in range(3)]
    seconds = [torch.rand(5, 1, generator=g) for _ in range(3)]
    before = [v.clone() for v in seconds]
    betas = [0.95, 0.5, 0.0]
    updates, new = normalize_rows(orthos, seconds, betas)
    for o, v, b, u, w, old in zip(orthos, seconds, betas, updates, new, before):
        assert torch.equal(v, old)
        o64, v64 = o.double(), v.double()
        v64 = v64 + (1 - b) * (o64.square().mean(dim=-1, keepdim=True) - v64)
        o2 = o64 / (v64.sqrt() + 1e-10)
        o2 = o2 * o64.norm() / (o2.norm() + 1e-10)
        assert torch.allclose(w.double(), v64, rtol=1e-6, atol=0)
        assert torch.allclose(u.double(), o2, rtol=1e-5, atol=1e-7)
        assert u.norm().item() == pytest.approx(o.norm().item(), rel=1e-6)


def test_bad_beta2_is_refused_naming_it():
    model = OddNet()
    with pytest.raises(ValueError, match="beta2"):
        dmuon.NorMuon(model, beta2=1.0)
    opt = dmuon.NorMuon(model, beta2=0.9)
    with pytest.raises(ValueError, match="param group 2: beta2"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(3, 3))], "algorithm": "muon", "beta2": -0.1})


def test_beta2_is_a_key_of_the_matrix_groups_only():
    model = OddNet()
    opt = dmuon.NorMuon([{"params": list(model.parameters()), "beta2": 0.8}], module=model)
    by_algorithm = {g["algorithm"]: g for g in opt.param_groups}
    assert by_algorithm["muon"]["beta2"] == 0.8
    assert "beta2" not in by_algorithm["adamw"]


def test_single_process_equals_the_formula():
    """No process group: the plain model's matrices, owned by the one process."""
    from support.more_rules import one_process_oddnet

    model, opt, losses = one_process_oddnet(lambda model: dmuon.NorMuon(
        model, lr=0.02, adamw=dmuon.AdamWConfig(lr=3e-3), beta2=NORMUON_BETA2, ns=dmuon.NSConfig(method="standard", dtype=torch.float32)))
    ref, ref_losses, ref_seconds = oddnet_reference(1)
    diff, worst = max_diff({n: p.detach() for n, p in model.named_parameters()}, ref)
    assert diff <= 1e-5, (worst, diff)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    named = dict(model.named_parameters())
    seconds = {n: opt.state[named[n]]["second_momentum_buffer"].reshape(-1) for n in ref_seconds}
    diff, worst = max_diff(seconds, ref_seconds)
    assert diff <= 1e-6, (worst, diff)


def test_expert_stacks_and_row_groups_normalize_each_matrix_alone():
    """One process: a stack of 3 experts and a matrix viewed as 2 row groups; each expert and each
    group is its own matrix, with its own second moment rows (the stack's ``(E, m, 1)``)."""
    from support.more_rules import one_process_experts
    from support.normuon import normuon_reference_training

    model, opt, ref, ref_seconds = one_process_experts(
        lambda model, plan: dmuon.NorMuon(model, plan, lr=0.02, adamw=dmuon.AdamWConfig(lr=3e-3), beta2=NORMUON_BETA2),
        lambda model, matrices, batches, loss_fn: normuon_reference_training(
            model, matrices, batches, loss_fn, **MUON_KW, beta2=NORMUON_BETA2,
            adamw_kwargs=dict(lr=3e-3, weight_decay=0.01)))
    diff, worst = max_diff({n: p.detach() for n, p in model.named_parameters()}, ref)
    assert diff <= 1e-5, (worst, diff)
    experts, down = model.moe.experts, model.moe.down.weight
    half = down.shape[0] // 2
    stack = opt.state[experts]["second_momentum_buffer"]
    groups = opt.state[down]["second_momentum_buffer"]
    assert stack.shape == (3, experts.shape[1], 1) and groups.shape == (down.shape[0], 1)
    got = {f"expert{e}": stack[e].reshape(-1) for e in range(3)}
    got |= {f"group{g}": groups[g * half:(g + 1) * half].reshape(-1) for g in range(2)}
    diff, worst = max_diff(got, ref_seconds)
    assert diff <= 1e-6, (worst, diff)


# ----------------------------------------------------------------------- on 2, 3, 4 ranks

def _copies(case, name: str, world_size: int) -> int:
    """How many ranks keep each row's second moment: one per replica, and every column box of a row."""
    replicas = case.mesh_shape[0] if case.mesh_shape else 1
    shard = world_size // replicas
    return replicas * (shard if name in case.column_sharded else 1)


@pytest.mark.parametrize("world_size,slow", [
    (2, False), (3, False), (4, False),
    # Under -m slow: the plain 1-D case on 4 ranks; [4] runs the column-sharded case, 1-D on 4 ranks, by
    # default, [2] and [3] the plain one.
    pytest.param(4, True, marks=pytest.mark.slow)], ids=["2", "3", "4", "4 plain 1-D"])
def test_equals_the_formula_on_every_mesh(world_size, slow):
    results = _runs(world_size, slow)
    cases = equivalence_cases(world_size, slow)
    ref, ref_losses, ref_seconds = oddnet_reference(world_size)
    per_step_active = [N_MATRICES - 3 * len(SKIP.get(s, ())) for s in range(STEPS)]
    for label, case in cases.items():
        if case.bf16:
            continue
        out = results[0]["cases"][label]
        diff, worst = max_diff(out["params"], ref)
        assert diff <= 1e-5, f"{label}: {worst} differs by {diff:.3g}"
        assert out["losses"] == pytest.approx(ref_losses, rel=1e-5, abs=1e-6), label
        diff, worst = max_diff(out["second_moments"], ref_seconds)
        assert diff <= 1e-6, f"{label}: second moment of {worst} differs by {diff:.3g}"
        if case.kind != "dmuon":
            continue
        for step in range(STEPS):
            # Each active matrix normalized exactly once in the cluster, on its owner.
            assert sum(r["cases"][label]["stats"][step]["orthogonalized"] for r in results) == per_step_active[step]
        for name, shape in out["shapes"].items():
            held = sum(r["cases"][label]["second_moment_numel"][name] for r in results)
            assert held == shape[0] * _copies(case, name, world_size), (label, name, held)


def test_bf16_mixed_precision_equals_gather_then_compute():
    results = _runs(3)
    got = results[0]["cases"]["bf16 mixed precision"]
    oracle = results[0]["cases"]["bf16 mixed precision, gather oracle"]
    diff, worst = max_diff(got["params"], oracle["params"])
    assert diff <= 1e-5, (worst, diff)
    assert got["losses"] == pytest.approx(oracle["losses"], rel=1e-5)
    diff, worst = max_diff(got["second_moments"], oracle["second_moments"])
    assert diff <= 1e-6, (worst, diff)


def test_tp_equals_the_formula_and_the_oracle():
    results = _runs(4)
    params, seconds = tp_reference(2, STEPS)
    got, oracle = results[0]["tp"]["dmuon"], results[0]["tp"]["gather"]
    for label, run in (("dmuon", got), ("gather", oracle)):
        diff, worst = max_diff(run["params"], params)
        assert diff <= 1e-5, (label, worst, diff)
    diff, worst = max_diff({n: v.reshape(-1) for n, v in got["second_moments"].items()}, seconds)
    assert diff <= 1e-6, (worst, diff)
    for name, rows in ((n, v.numel()) for n, v in seconds.items()):
        held = sum(r["tp"]["dmuon"]["second_moment_numel"][name] for r in results)
        # colwise ``up``: TP splits the rows, each held once; rowwise ``down`` and ``mix`` (left whole
        # by TP): both tp ranks hold each row.
        assert held == rows * (1 if ".up." in name else 2), (name, held)


@pytest.mark.parametrize("where", ["3 ranks", "replicate level 2x2"])
def test_checkpoint_saved_on_two_ranks_resumes_exactly(where):
    world_size, key = (3, "1-D") if where == "3 ranks" else (4, "replicate level 2x2")
    got = _runs(world_size)[0]["resumed"][key]
    is_dtensor, dtype, _ = got["layout"]
    assert is_dtensor and dtype == torch.float32
    diff, worst = max_diff(got["params"], checkpoint_reference())
    assert diff <= 1e-5, (where, worst, diff)


@pytest.mark.parametrize("run", COUNTED)
def test_counted_bytes_equal_the_model_with_the_row_state(run):
    """Every collective dmuon issues, per rank: the model's with ``row_bytes=4`` (one float32 per row),
    and strictly more than the same exchange without it (the row state is counted)."""
    mesh_shape, ns_dtype, _, hsdp = COUNTED[run]
    results = [r["counted"][run] for r in _runs(4)]
    replicate, shard = mesh_shape or (1, 4)
    infos = results[0]["infos"]
    shapes, owners, blocks = [i[0] for i in infos], [i[1] for i in infos], [i[2] for i in infos]
    waves = results[0]["waves"]
    assert all(r["waves"] == waves for r in results)
    assert all(r["blocks_in_backward"] == r["blocks"] for r in results)
    model = owner_exchange_collectives(shapes, owners, blocks, replicate, shard, ns_dtype.itemsize, waves=waves,
                                       gradient_bytes=4 if hsdp == "dmuon" else None, row_bytes=4)
    bare = owner_exchange_collectives(shapes, owners, blocks, replicate, shard, ns_dtype.itemsize, waves=waves,
                                      gradient_bytes=4 if hsdp == "dmuon" else None)
    modelled, plain = model[0] + model[1], bare[0] + bare[1]
    check_counted_log(modelled, results, replicate, hsdp == "dmuon")
    assert sum(max(c.ranks[k]) for c in modelled for k in range(len(c.ranks)) if c.ranks[k]) > \
        sum(max(c.ranks[k]) for c in plain for k in range(len(c.ranks)) if c.ranks[k])
