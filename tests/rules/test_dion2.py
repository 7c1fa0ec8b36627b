"""dmuon.Dion2 equals Dion2's rule with exact global row selection in one process, written here from its
formula, on any mesh: 1-4 ranks (3: the mesh divides no shape), FSDP2's HSDP and dmuon's replicate level
on 2x2, TP (dp2 x tp2), FSDP2's column shards, NS in backward, clipping (launches exchanged again); bf16
mixed precision near the fp32 formula; a checkpoint saved on 2 ranks resumes exactly on 3 and on 2x2;
the counted bytes are Muon's.

Each world size's runs (both MuonH's and Dion2's) share one process group (``support.more_rules.runs``).
"""

from __future__ import annotations

import pytest
import torch

import dmuon

from support.cases import DION2_KW
from support.equivalence import max_diff
from support.models import OddNet
from support.more_rules import (
    COUNTED, STEPS, check_oracle_runs, checked_mesh_runs, checkpoint_reference, counted_run, oddnet_reference,
    one_process_experts, one_process_oddnet, rule_reference, runs, tp_reference,
)
from support.step_comm import check_counted_log

# One xdist group: both files read the same launches (support.more_rules.runs).
pytestmark = pytest.mark.xdist_group("more_rules")

RULE = "dion2"


# ------------------------------------------------------------------------ errors

@pytest.mark.parametrize("kw,match", [({"fraction": 0.0}, "fraction"), ({"fraction": 1.5}, "fraction"),
                                      ({"fraction": True}, "fraction"), ({"ef_decay": -0.1}, "ef_decay"),
                                      ({"ef_decay": float("nan")}, "ef_decay"), ({"momentum": 0.9}, "momentum"),
                                      ({"adjust_lr_fn": "spectral"}, "adjust_lr_fn")])
def test_bad_settings_are_refused_naming_them(kw, match):
    with pytest.raises(ValueError, match=match):
        dmuon.Dion2(OddNet(), **kw)


def test_group_keys_are_the_matrix_groups_and_checked_naming_the_group():
    model = OddNet()
    opt = dmuon.Dion2([{"params": list(model.parameters()), "fraction": 0.5}], module=model)
    by = {g["algorithm"]: g for g in opt.param_groups}
    assert by["muon"]["fraction"] == 0.5 and by["muon"]["ef_decay"] == 0.95
    assert by["muon"]["adjust_lr_fn"] == "spectral_unclamped" and by["muon"]["weight_decay"] == 0.01
    assert "fraction" not in by["adamw"] and "ef_decay" not in by["adamw"]
    with pytest.raises(ValueError, match="param group 2: ef_decay"):
        opt.add_param_group({"params": [model.layers[0].mid.weight], "algorithm": "muon", "ef_decay": -1.0})
    with pytest.raises(ValueError, match="param group 2: fraction"):
        opt.add_param_group({"params": [model.layers[0].mid.weight], "algorithm": "muon", "fraction": 2})


# ------------------------------------------------------------------------ one process

def test_single_process_equals_the_formula():
    model, opt, losses = one_process_oddnet(lambda model: dmuon.Dion2(
        model, lr=0.02, adamw=dmuon.AdamWConfig(lr=3e-3), ns=dmuon.NSConfig(method="standard", dtype=torch.float32), **DION2_KW))
    ref, ref_losses, ref_buffers = oddnet_reference(RULE, 1)
    diff, worst = max_diff({n: p.detach() for n, p in model.named_parameters()}, ref)
    assert diff <= 1e-5, (worst, diff)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    named = dict(model.named_parameters())
    diff, worst = max_diff({n: opt.state[named[n]]["momentum_buffer"].reshape(-1) for n in ref_buffers}, ref_buffers)
    assert diff <= 1e-5, (worst, diff)


def test_expert_stacks_and_row_groups_select_per_matrix():
    model, opt, ref, _ = one_process_experts(
        lambda model, plan: dmuon.Dion2(model, plan, lr=0.02, adamw=dmuon.AdamWConfig(lr=3e-3), **DION2_KW),
        rule_reference(RULE, **DION2_KW))
    diff, worst = max_diff({n: p.detach() for n, p in model.named_parameters()}, ref)
    assert diff <= 1e-5, (worst, diff)


# ----------------------------------------------------------------------- on 2, 3, 4 ranks

@pytest.mark.parametrize("world_size,slow", [
    (2, False), (3, False), (4, False),
    # Under -m slow: the plain 1-D case on 4 ranks (more_rules.SLOW_CASES); [4] runs the column-sharded case, 1-D
    # on 4 ranks, by default, [2] and [3] the plain one.
    pytest.param(4, True, marks=pytest.mark.slow)], ids=["2", "3", "4", "4 plain 1-D"])
def test_equals_the_formula_on_every_mesh(world_size, slow):
    for label, case, out in checked_mesh_runs(RULE, world_size, slow):
        if case.clip is not None:  # not rescalable: clipped launches go again, none stands rescaled
            assert all(s["rescaled_launches"] == 0 for s in out["stats"]), label


def test_the_gather_oracle_equals_the_formula_and_dmuon_under_bf16_equals_the_oracle():
    check_oracle_runs(RULE)


def test_tp_equals_the_formula():
    got = runs(4)[0]["tp"][RULE]
    params, buffers = tp_reference(RULE, 2, STEPS)
    diff, worst = max_diff(got["params"], params)
    assert diff <= 1e-5, (worst, diff)
    diff, worst = max_diff({n: v.reshape(-1) for n, v in got["momentum"].items()}, buffers)
    assert diff <= 1e-5, (worst, diff)


@pytest.mark.parametrize("where", [3, 4], ids=["3 ranks", "replicate level 2x2"])
def test_checkpoint_saved_on_two_ranks_resumes_exactly(where):
    got = runs(where)[0]["resumed"][RULE]
    is_dtensor, dtype, _ = got["layout"]
    assert is_dtensor and dtype == torch.float32
    diff, worst = max_diff(got["params"], checkpoint_reference(RULE))
    assert diff <= 1e-5, (where, worst, diff)


@pytest.mark.parametrize("run", COUNTED)
def test_counted_bytes_are_muons(run):
    """Every collective dmuon issues in a steady step, per rank: Muon's exchange model's, nothing more (the
    update travels full-size, its unselected rows zero; no mask, no norm)."""
    counted = counted_run(RULE, run)
    check_counted_log(counted.modelled, counted.results, counted.replicate, COUNTED[run][3] == "dmuon")
    if run == "1-D bf16 NS, 4 waves":  # and the same as Muon's own run, collective by collective
        muon = [r["counted"][("muon", run)] for r in runs(4)]
        assert [r["log"] for r in counted.results] == [m["log"] for m in muon]
