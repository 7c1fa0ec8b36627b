"""DMuon built where frameworks build torch.optim.AdamW (before ``fully_shard``) equals, bit for bit,
DMuon built after it; torch-style param groups map onto the Muon and AdamW halves as documented."""

from __future__ import annotations

import functools

import pytest
import torch

import dmuon

from support.lazy import before_and_after, unsharded_step
from support.models import OddNet, lm_loss, odd_batch
from support.scenarios import run_each, shared_runs


def _same(got: dict, ref: dict) -> None:
    for key in ("params", "momenta"):
        assert set(got[key]) == set(ref[key]), key
        differ = [n for n in ref[key] if not torch.equal(got[key][n], ref[key][n])]
        assert not differ, (key, differ)
    assert got["groups"] == ref["groups"]


def _on_two(rank: int, world: int) -> dict:
    """Every 2-rank run of this file in one process group (a spawn costs more than the work), each with its
    own result or its own error."""
    return run_each({"1d": lambda: before_and_after(rank, world, None, "fsdp2"),
                     "torch": lambda: before_and_after(rank, world, None, "fsdp2", 2, 1, None, "torch"),
                     "wrapped": lambda: before_and_after(rank, world, None, "fsdp2", 2, 1, None, "all", True),
                     "unsharded": lambda: unsharded_step(rank, world)})


def _on_four(rank: int, world: int) -> dict:
    return run_each({hsdp: functools.partial(before_and_after, rank, world, (2, 2), hsdp)
                     for hsdp in ("fsdp2", "dmuon")})


_two = shared_runs(_on_two, 2)  # each rank's result of a 2-rank run (its ranks' error when it raised)
_four = shared_runs(_on_four, 4)


@pytest.mark.parametrize("layout", ["1d-2-ranks", "hsdp-2x2-native", "hsdp-2x2-replicate-level"])
def test_built_before_sharding_equals_built_after_bit_for_bit(layout):
    """3 steps, 2 micro-batches under FSDP2's no-sync, torch's clip_grad_norm_, a frozen block: every
    parameter, every state tensor and the param groups are equal; the optimizer sets itself up at the
    first forward, so the first backward already runs its hooks."""
    out = _two("1d") if layout == "1d-2-ranks" else _four("fsdp2" if layout == "hsdp-2x2-native" else "dmuon")
    _same(out[0]["before"], out[0]["after"])
    for rank in out:
        assert rank["before"]["seen"] == [("built", False), ("after the first backward", True)]
        assert rank["after"]["seen"] == [("after the first backward", True)]


def test_torch_style_groups_built_before_sharding_equal_built_after():
    """The HF Trainer's grouping (weight decay off for biases and norms), given as groups with module=."""
    out = _two("torch")
    _same(out[0]["before"], out[0]["after"])
    by_kind = {(g["algorithm"], g["weight_decay"]) for g in out[0]["after"]["groups"]}
    assert by_kind == {("muon", 0.05), ("adamw", 0.05), ("adamw", 0.0)}


def test_blocks_wrapped_for_activation_checkpointing_after_the_optimizer_was_built():
    """accelerate wraps blocks in torch's checkpoint wrapper between building the optimizer and sharding:
    the parameters' names gain ``_checkpoint_wrapped_module``, and DMuon still finds them."""
    out = _two("wrapped")
    _same(out[0]["before"], out[0]["after"])


def test_a_step_on_a_model_never_sharded_names_the_fix():
    for message in _two("unsharded"):
        assert message is not None and "not sharded" in message and "fully_shard" in message, message


# ------------------------------------------------------------------- one process: inputs and groups
def test_parameters_without_the_model_raise_a_type_error_saying_what_to_pass():
    model = OddNet()
    for given in (model.parameters(), list(model.named_parameters()), [{"params": list(model.parameters())}]):
        with pytest.raises(TypeError, match=r"module=model"):
            dmuon.DMuon(given, lr=0.02)
    with pytest.raises(TypeError, match="two models"):
        dmuon.DMuon(model, module=OddNet())
    with pytest.raises(TypeError, match=r"'param_groups': pass the groups as the first argument"):
        dmuon.DMuon(model.parameters(), module=model, param_groups=[{"params": list(model.parameters())}])


def test_named_pairs_and_groups_equal_the_model_form():
    """DMuon(model), DMuon(model.named_parameters(), module=model) and DMuon(groups, module=model) train alike,
    and every group carries param_names (torchtitan's checkpointing keys on them)."""
    results = []
    for form in ("model", "pairs", "groups"):
        torch.manual_seed(0)
        model = OddNet()
        kw = dict(lr=0.02, adamw=dmuon.AdamWConfig(lr=3e-3),
                  ns=dmuon.NSConfig(method="standard", dtype=torch.float32))
        if form == "model":
            opt = dmuon.DMuon(model, **kw)
        elif form == "pairs":
            opt = dmuon.DMuon(model.named_parameters(), module=model, **kw)
        else:
            opt = dmuon.DMuon([{"params": list(model.parameters())}], module=model, **kw)
        for step in range(2):
            lm_loss(model, odd_batch(step, 0)).backward()
            opt.step()
            opt.zero_grad()
        names = {id(p): n for n, p in model.named_parameters()}
        for g in opt.param_groups:
            assert g["param_names"] == [names[id(p)] for p in g["params"]]
        results.append({n: p.detach().clone() for n, p in model.named_parameters()})
    for other in results[1:]:
        assert all(torch.equal(other[n], results[0][n]) for n in results[0])


def test_group_keys_map_onto_the_halves_as_documented():
    model = OddNet()
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("bias")]
    opt = dmuon.DMuon([{"params": rest, "weight_decay": 0.2, "lr": 0.05, "betas": (0.8, 0.9), "tag": "w"},
                       {"params": biases, "weight_decay": 0.0}], module=model, weight_decay=0.1,
                      adamw=dmuon.AdamWConfig(weight_decay=0.01), lr=0.02)
    muon, adamw, bias = opt.param_groups
    assert (muon["algorithm"], muon["weight_decay"], muon["lr"], muon["tag"]) == ("muon", 0.2, 0.05, "w")
    assert "betas" not in muon
    # No AdamW lr anywhere: AdamW follows the group's lr, as it follows DMuon's lr.
    assert (adamw["algorithm"], adamw["weight_decay"], adamw["lr"], adamw["betas"], adamw["tag"]) == \
        ("adamw", 0.2, 0.05, (0.8, 0.9), "w")
    assert (bias["algorithm"], bias["weight_decay"], bias["lr"]) == ("adamw", 0.0, 0.02)
    # DMuon's AdamW lr and a group's adamw_ keys win over the group's plain lr / weight_decay.
    opt = dmuon.DMuon([{"params": rest, "lr": 0.05, "weight_decay": 0.2, "adamw_weight_decay": 0.03}],
                      module=model, adamw=dmuon.AdamWConfig(lr=1e-3))
    _, adamw = opt.param_groups
    assert (adamw["lr"], adamw["weight_decay"]) == (1e-3, 0.03)


def test_add_param_group_splits_a_torch_style_group():
    model = OddNet()
    first = [p for n, p in model.named_parameters() if n.startswith("layers.0.")]
    opt = dmuon.DMuon([{"params": [p for p in model.parameters() if all(p is not q for q in first)]}],
                      module=model)
    opt.add_param_group({"params": first, "weight_decay": 0.0})
    added = opt.param_groups[-2:]
    assert [g["algorithm"] for g in added] == ["muon", "adamw"]
    assert all(g["weight_decay"] == 0.0 for g in added)
    assert all("param_names" in g for g in opt.param_groups)
