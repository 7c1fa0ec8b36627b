"""dmuon.MuonH equals MuonH's rule in one process, written here from its formula, on any mesh: 1-4 ranks
(3: the mesh divides no shape), FSDP2's HSDP and dmuon's replicate level on 2x2, TP (dp2 x tp2), FSDP2's
column shards, a skipped step, clipping (launches rescaled); bf16 mixed precision stays on the sphere
and near the fp32 formula; a checkpoint saved on 2 ranks resumes exactly on 3 and on 2x2; the counted
bytes are the traffic model's plus the one weight-norm all-gather.

Each world size's runs (both MuonH's and Dion2's) share one process group (``support.more_rules.runs``).
"""

from __future__ import annotations

import pytest
import torch

import dmuon
from dmuon.costmodel.traffic import step_collectives, weight_norm_collective

from support.equivalence import N_MATRICES, max_diff
from support.models import OddNet
from support.more_rules import (
    COUNTED, STEPS, check_oracle_runs, checked_mesh_runs, checkpoint_reference, counted_run, oddnet_reference,
    one_process_experts, one_process_oddnet, rule_reference, runs, tp_reference,
)
from support.step_comm import check_counted_log, expected_log

# One xdist group: both files read the same launches (support.more_rules.runs).
pytestmark = pytest.mark.xdist_group("more_rules")

RULE = "muonh"


def _on_sphere(params: dict, radii: dict, where: str) -> None:
    """Every MuonH matrix's Frobenius norm is its radius R."""
    for name, r in radii.items():
        assert abs(params[name].norm().item() - r.item()) <= 1e-5 * r.item(), (where, name)


# ------------------------------------------------------------------------ errors

def test_weight_decay_is_refused_naming_the_group():
    model = OddNet()
    with pytest.raises(ValueError, match=r"weight_decay=0.1: MuonH"):
        dmuon.MuonH(model, weight_decay=0.1)
    with pytest.raises(ValueError, match=r"param group 0: weight_decay=0.1"):
        dmuon.MuonH([{"params": list(model.parameters()), "weight_decay": 0.1}], module=model)
    # The other parameters' decay is AdamW's.
    opt = dmuon.MuonH([{"params": list(model.parameters()), "adamw_weight_decay": 0.1}], module=model)
    assert {g["algorithm"]: g["weight_decay"] for g in opt.param_groups} == {"muon": 0.0, "adamw": 0.1}
    with pytest.raises(ValueError, match="param group 2: weight_decay"):
        opt.add_param_group({"params": [model.layers[0].mid.weight], "algorithm": "muon", "weight_decay": 1e-3})
    with pytest.raises(ValueError, match="qk_clip"):
        dmuon.MuonH(model, qk_clip=dmuon.QKClip(layers={}))


# ------------------------------------------------------------------------ one process

def test_single_process_equals_the_formula_and_stays_on_the_sphere():
    initial = {}

    def make(model):
        initial.update({n: p.detach().norm() for n, p in model.named_parameters()})
        return dmuon.MuonH(model, lr=0.02, adamw=dmuon.AdamWConfig(lr=3e-3), ns=dmuon.NSConfig(method="standard", dtype=torch.float32))

    model, opt, losses = one_process_oddnet(make)
    ref, ref_losses, ref_radii = oddnet_reference(RULE, 1)
    diff, worst = max_diff({n: p.detach() for n, p in model.named_parameters()}, ref)
    assert diff <= 1e-5, (worst, diff)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    named = dict(model.named_parameters())
    radii = {n: opt.state[named[n]]["initial_norm"] for n in ref_radii}
    assert len(radii) == N_MATRICES
    for n, r in radii.items():
        assert r.dtype == torch.float32 and r.shape == (1,)
        assert r.item() == pytest.approx(initial[n].item(), rel=1e-6) == pytest.approx(ref_radii[n].item(), rel=1e-6)
    _on_sphere({n: p.detach() for n, p in named.items()}, radii, "one process")


def test_updates_applied_in_the_next_forward_are_in_steps_bit_for_bit_on_bf16_weights():
    """One process, the weights themselves in bf16: with ``apply_updates="next_forward"`` the norms after
    each update come from ``weight_sums_after`` (the apply's step on a copy, in ``step()``), with
    ``"in_step"`` from the updated weights; the same bits, and on the sphere."""
    def trained(mode: str) -> tuple[dict, dict]:
        def make(model):
            model.to(torch.bfloat16)
            return dmuon.MuonH(model, lr=0.02, adamw=dmuon.AdamWConfig(lr=3e-3),
                               ns=dmuon.NSConfig(method="standard", dtype=torch.float32),
                               execution=dmuon.ExecutionConfig(apply_updates=mode))

        model, opt, _ = one_process_oddnet(make)
        opt.flush_updates()
        named = dict(model.named_parameters())
        return ({n: p.detach().clone() for n, p in named.items()},
                {n: opt.state[p]["initial_norm"] for n, p in named.items() if "initial_norm" in opt.state[p]})

    (ins, radii), (nfwd, _) = trained("in_step"), trained("next_forward")
    assert all(p.dtype == torch.bfloat16 for p in ins.values()) and len(radii) == N_MATRICES
    for name in ins:
        assert torch.equal(ins[name], nfwd[name]), name
    for name, r in radii.items():  # each element rounded to bf16 (unit roundoff 2^-8) after the projection
        assert abs(nfwd[name].float().norm().item() - r.item()) <= (2 ** -8 + 1e-6) * r.item(), name


def test_expert_stacks_and_row_groups_each_on_their_own_sphere():
    """One process: a stack of 3 experts and a matrix viewed as 2 row groups, each its own matrix with
    its own radius (the stack's ``(3,)``, the groups' ``(2,)``)."""
    model, opt, ref, ref_radii = one_process_experts(
        lambda model, plan: dmuon.MuonH(model, plan, lr=0.02, adamw=dmuon.AdamWConfig(lr=3e-3)), rule_reference(RULE))
    diff, worst = max_diff({n: p.detach() for n, p in model.named_parameters()}, ref)
    assert diff <= 1e-5, (worst, diff)
    stack = opt.state[model.moe.experts]["initial_norm"]
    groups = opt.state[model.moe.down.weight]["initial_norm"]
    assert stack.shape == (3,) and groups.shape == (2,)
    got = {f"expert{e}": stack[e:e + 1] for e in range(3)} | {f"group{g}": groups[g:g + 1] for g in range(2)}
    diff, worst = max_diff(got, ref_radii)
    assert diff <= 1e-6, (worst, diff)
    for e in range(3):
        assert model.moe.experts[e].norm().item() == pytest.approx(stack[e].item(), rel=1e-5)


# ----------------------------------------------------------------------- on 2, 3, 4 ranks

@pytest.mark.parametrize("world_size,slow", [
    (2, False), (3, False), (4, False),
    # Under -m slow: the plain 1-D case on 4 ranks (more_rules.SLOW_CASES); [4] runs the column-sharded case, 1-D
    # on 4 ranks, by default, [2] and [3] the plain one.
    pytest.param(4, True, marks=pytest.mark.slow)], ids=["2", "3", "4", "4 plain 1-D"])
def test_equals_the_formula_on_every_mesh(world_size, slow):
    for label, case, out in checked_mesh_runs(RULE, world_size, slow):
        _on_sphere(out["params"], out["rule_state"], label)
        if case.clip is not None:  # MuonH keeps Muon's momentum: clipped launches stand, rescaled
            assert sum(s["rescaled_launches"] for s in out["stats"]) > 0, label


def test_the_gather_oracle_equals_the_formula_and_dmuon_under_bf16_equals_the_oracle():
    check_oracle_runs(RULE)
    _on_sphere(runs(3)[0]["cases"][f"{RULE} bf16 mixed precision"]["params"],
               runs(3)[0]["cases"][f"{RULE} bf16 mixed precision"]["rule_state"], "bf16")


def test_tp_equals_the_formula():
    got = runs(4)[0]["tp"][RULE]
    params, radii = tp_reference(RULE, 2, STEPS)
    diff, worst = max_diff(got["params"], params)
    assert diff <= 1e-5, (worst, diff)
    diff, worst = max_diff({n: v.reshape(-1) for n, v in got["radii"].items()}, radii)
    assert diff <= 1e-6, (worst, diff)
    _on_sphere(got["params"], radii, "tp")


@pytest.mark.parametrize("where", [3, 4], ids=["3 ranks", "replicate level 2x2"])
def test_checkpoint_saved_on_two_ranks_resumes_exactly(where):
    got = runs(where)[0]["resumed"][RULE]
    is_dtensor, dtype, placements = got["layout"]
    assert is_dtensor and dtype == torch.float32 and "Shard" not in placements
    diff, worst = max_diff(got["params"], checkpoint_reference(RULE))
    assert diff <= 1e-5, (where, worst, diff)


@pytest.mark.parametrize("run", COUNTED)
def test_counted_bytes_are_muons_plus_one_weight_norm_all_gather(run):
    """Every collective dmuon issues in a steady step, per rank: the exchange model's, then one float32
    all-gather of one value per matrix over the shard level (the step model's ``weight_norms``)."""
    _, ns_dtype, _, hsdp = COUNTED[run]
    results, replicate, shard, shapes, owners, blocks, waves, exchange = counted_run(RULE, run)
    norms = weight_norm_collective(len(shapes), replicate, shard)
    assert len(norms) == 1 and norms[0].ranks[0] == ((shard - 1) * 4 * len(shapes),) * 2
    strategy = "dmuon" if hsdp == "dmuon" or replicate == 1 else "dmuon_native_hsdp"
    modelled = [c for c in step_collectives(strategy, shapes, owners, blocks, replicate, shard,
                                            wire_bytes=ns_dtype.itemsize, waves=waves, weight_norms=True)
                if c.label.startswith("dmuon") and c.role != "replicate_all_reduce"]
    assert modelled[-1].label == "dmuon weight norms"
    assert sorted(c.label for c in modelled) == sorted(c.label for c in exchange + norms)
    for r in results:
        expected = expected_log(exchange + norms, r, replicate, False)
        assert r["log"][-1] == expected[-1], f"plan rank {r['plan_rank']}: the norms' all-gather comes last"
    check_counted_log(exchange + norms, results, replicate, hsdp == "dmuon")
