"""The front door's own logic on one process: param groups split into Muon and AdamW halves, the
setup that waits for sharding, and the validation of DMuon's keywords, each error naming its parameter.
(NS keywords against ns= and the plan, ExecutionConfig's fields: tests/test_single_process.py;
NSConfig's fields: ortho/tests/test_config.py.)"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dmuon
from dmuon.optim.deferred import waits_for_sharding


class TwoBlocks(nn.Module):
    """Two linear blocks (matrices: Muon) with biases and a norm (vectors: AdamW)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 12)
        self.b = nn.Linear(12, 8)
        self.norm = nn.LayerNorm(8)


def _names(opt, algorithm: str) -> list[list[str]]:
    return [g["param_names"] for g in opt.param_groups if g["algorithm"] == algorithm]


def test_each_group_splits_into_a_muon_and_an_adamw_half_with_its_own_keys():
    model = TwoBlocks()
    groups = [{"params": list(model.a.parameters()), "lr": 0.05, "weight_decay": 0.2, "adamw_lr": 1e-4},
              {"params": list(model.b.parameters()) + list(model.norm.parameters())}]
    opt = dmuon.DMuon(groups, module=model, lr=0.02, adamw_lr=3e-3, weight_decay=0.1)
    assert [g["algorithm"] for g in opt.param_groups] == ["muon", "adamw", "muon", "adamw"]
    assert _names(opt, "muon") == [["a.weight"], ["b.weight"]]
    assert _names(opt, "adamw") == [["a.bias"], ["b.bias", "norm.weight", "norm.bias"]]
    muon_a, adamw_a, muon_b, adamw_b = opt.param_groups
    # A group's lr and weight_decay are the Muon half's; its adamw_ keys the AdamW half's, without the prefix.
    assert (muon_a["lr"], muon_a["weight_decay"]) == (0.05, 0.2)
    assert (adamw_a["lr"], adamw_a["weight_decay"]) == (1e-4, 0.2)
    # Keys a group leaves out come from DMuon's keywords.
    assert (muon_b["lr"], muon_b["weight_decay"], adamw_b["lr"]) == (0.02, 0.1, 3e-3)


def test_add_param_group_splits_a_torch_style_group_and_checks_a_dmuon_one():
    model = TwoBlocks()
    opt = dmuon.DMuon([{"params": list(model.a.parameters())}], module=model)
    opt.add_param_group({"params": list(model.b.parameters())})
    assert [g["algorithm"] for g in opt.param_groups] == ["muon", "adamw", "muon", "adamw"]
    assert opt.param_groups[2]["params"][0] is model.b.weight
    with pytest.raises(ValueError, match="a 'muon' param group holds a parameter that is not in the plan"):
        opt.add_param_group({"params": [model.norm.weight], "algorithm": "muon"})
    with pytest.raises(ValueError, match="param group algorithm must be 'muon' or 'adamw', got 'sgd'"):
        opt.add_param_group({"params": [model.norm.weight], "algorithm": "sgd"})


@pytest.mark.parametrize("groups,error,message", [
    ([{"lr": 0.1}], ValueError, "every param group needs a 'params' entry"),
    ([{"params": "set"}], TypeError, "ordered collections"),
    ([{"params": "list", "param_names": ["only one"]}], ValueError, r"param group 0: 1 param_names for 6 params"),
    ([{"params": "list"}, {"params": [1.0]}], TypeError, "param group 1: DMuon can only optimize tensors, got float"),
])
def test_bad_groups_are_named(groups, error, message):
    model = TwoBlocks()
    params = list(model.parameters())
    for g in groups:
        if g.get("params") == "set":
            g["params"] = set(params)
        elif g.get("params") == "list":
            g["params"] = params
    with pytest.raises(error, match=message):
        dmuon.DMuon(groups, module=model)


@pytest.mark.parametrize("name", ["lr", "weight_decay", "momentum", "adamw_lr", "adamw_weight_decay", "adamw_eps"])
def test_a_negative_setting_is_named(name):
    with pytest.raises(ValueError, match=f"^{name} must be >= 0, got -0.5"):
        dmuon.DMuon(TwoBlocks(), **{name: -0.5})


def test_the_first_argument_is_checked():
    model = TwoBlocks()
    with pytest.raises(TypeError, match="module= must be the model"):
        dmuon.DMuon(list(model.parameters()), module="model")
    with pytest.raises(TypeError, match="not a set"):
        dmuon.DMuon(set(model.parameters()), module=model)
    with pytest.raises(TypeError, match="DMuon needs the model"):
        dmuon.DMuon(list(model.parameters()))
    with pytest.raises(ValueError, match="empty parameter list"):
        dmuon.DMuon([], module=model)
    with pytest.raises(ValueError, match="plan must be the Plan returned by dmuon.prepare, got dict"):
        dmuon.DMuon(model, {})


def test_execution_keywords_unknown_or_contradicting_are_named():
    with pytest.raises(ValueError, match="unknown execution keyword 'overlapp'"):
        dmuon.ExecutionConfig.from_keywords(overlapp=True)
    base = dmuon.ExecutionConfig(return_waves=2)
    # None leaves the base's value; the same value again is fine.
    assert dmuon.ExecutionConfig.from_keywords(base, return_waves=None) == base
    assert dmuon.ExecutionConfig.from_keywords(base, return_waves=2) == base
    with pytest.raises(ValueError, match="return_waves=3 but execution.return_waves=2"):
        dmuon.ExecutionConfig.from_keywords(base, return_waves=3)


def test_setup_waits_for_sharding_only_under_a_process_group():
    model = TwoBlocks()
    # No process group: nothing will shard the model, so DMuon sets itself up at once.
    assert not waits_for_sharding(model)
    opt = dmuon.DMuon(model)
    assert opt.is_set_up and [g["algorithm"] for g in opt.param_groups] == ["muon", "adamw"]
