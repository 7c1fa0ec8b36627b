"""The front door's own logic on one process: param groups split into Muon and AdamW halves, the
setup that waits for sharding, and the validation of DMuon's keywords and of AdamWConfig, each error
naming its parameter. (NS keywords against ns= and the plan, ExecutionConfig's fields:
tests/layouts/test_single_process.py; NSConfig's fields: ortho/tests/test_config.py.)"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dmuon
from dmuon.prepare.setup import waits_for_sharding


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
    opt = dmuon.DMuon(groups, module=model, lr=0.02, adamw=dmuon.AdamWConfig(lr=3e-3), weight_decay=0.1)
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


@pytest.mark.parametrize("name", ["lr", "weight_decay", "momentum"])
def test_a_negative_setting_is_named(name):
    with pytest.raises(ValueError, match=f"^{name} must be >= 0, got -0.5"):
        dmuon.DMuon(TwoBlocks(), **{name: -0.5})


@pytest.mark.parametrize("fields,message", [
    (dict(lr=-0.5), r"AdamWConfig.lr must be a number >= 0 or None, got -0.5"),
    (dict(lr="3e-4"), r"AdamWConfig.lr must be a number >= 0 or None, got '3e-4'"),
    (dict(eps=-1e-8), r"AdamWConfig.eps must be a number >= 0, got -1e-08"),
    (dict(eps=None), r"AdamWConfig.eps must be a number >= 0, got None"),
    (dict(weight_decay=-0.1), r"AdamWConfig.weight_decay must be a number >= 0, got -0.1"),
    (dict(weight_decay=True), r"AdamWConfig.weight_decay must be a number >= 0, got True"),
    (dict(betas=(0.9, 1.0)), r"AdamWConfig.betas must be two numbers in \[0, 1\), got \(0.9, 1.0\)"),
    (dict(betas=(-0.1, 0.9)), r"AdamWConfig.betas must be two numbers in \[0, 1\)"),
    (dict(betas=(0.9,)), r"AdamWConfig.betas must be two numbers in \[0, 1\)"),
    (dict(betas=0.9), r"AdamWConfig.betas must be two numbers in \[0, 1\)"),
])
def test_adamw_config_names_the_bad_field(fields, message):
    with pytest.raises(ValueError, match=f"^{message}"):
        dmuon.AdamWConfig(**fields)
    # The same check through DMuon, either form.
    with pytest.raises(ValueError, match=f"^{message}"):
        dmuon.DMuon(TwoBlocks(), adamw=fields)


def test_adamw_config_defaults_and_its_mapping_form():
    assert dmuon.AdamWConfig() == dmuon.AdamWConfig(lr=None, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    # A list (JSON, YAML) is kept as a tuple: the config stays hashable and equal to the tuple form.
    config = dmuon.AdamWConfig.from_mapping({"lr": 3e-4, "betas": [0.8, 0.95]})
    assert config == dmuon.AdamWConfig(lr=3e-4, betas=(0.8, 0.95)) and hash(config) == hash(config)
    assert dmuon.AdamWConfig.from_mapping(config) is config and dmuon.AdamWConfig.from_mapping(None) == dmuon.AdamWConfig()
    with pytest.raises(ValueError, match=r"^adamw: unknown keys 'beta', 'lrr' \(allowed: lr, betas, eps, weight_decay, amsgrad, maximize\)"):
        dmuon.DMuon(TwoBlocks(), adamw={"lrr": 1e-3, "beta": (0.9, 0.99), "eps": 1e-8})
    with pytest.raises(ValueError, match=r"^adamw: unknown key 'adamw_lr'"):
        dmuon.DMuon(TwoBlocks(), adamw={"adamw_lr": 1e-3})
    with pytest.raises(TypeError, match="adamw must be a dmuon.AdamWConfig or a dict of its fields, got float"):
        dmuon.DMuon(TwoBlocks(), adamw=3e-4)


@pytest.mark.parametrize("adamw", [dmuon.AdamWConfig(lr=3e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.05),
                                   {"lr": 3e-3, "betas": [0.8, 0.95], "eps": 1e-6, "weight_decay": 0.05}])
def test_adamw_settings_reach_the_adamw_groups_only(adamw):
    model = TwoBlocks()
    groups = [{"params": list(model.a.parameters())}, {"params": list(model.b.parameters()), "adamw_eps": 1e-5}]
    opt = dmuon.DMuon(groups, module=model, lr=0.02, weight_decay=0.1, adamw=adamw)
    assert opt.adamw == dmuon.AdamWConfig(lr=3e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.05)
    muon_a, adamw_a, muon_b, adamw_b = opt.param_groups
    for g in (adamw_a, adamw_b):
        assert (g["lr"], g["betas"], g["weight_decay"]) == (3e-3, (0.8, 0.95), 0.05)
    assert (adamw_a["eps"], adamw_b["eps"]) == (1e-6, 1e-5)  # a group's adamw_ key wins
    for g in (muon_a, muon_b):
        assert (g["lr"], g["weight_decay"], g["eps"]) == (0.02, 0.1, opt.ns.eps) and "betas" not in g
    # A group added later gets the same defaults.
    opt.add_param_group({"params": list(model.norm.parameters())})
    assert opt.param_groups[-1]["algorithm"] == "adamw"
    assert (opt.param_groups[-1]["lr"], opt.param_groups[-1]["betas"]) == (3e-3, (0.8, 0.95))


def test_adamw_lr_none_follows_muons_lr_and_a_groups_lr():
    model = TwoBlocks()
    groups = [{"params": list(model.a.parameters()), "lr": 0.05}, {"params": list(model.b.parameters())}]
    opt = dmuon.DMuon(groups, module=model, lr=0.02, adamw=dmuon.AdamWConfig(weight_decay=0.0))
    _, adamw_a, _, adamw_b = opt.param_groups
    assert (adamw_a["lr"], adamw_b["lr"]) == (0.05, 0.02)
    assert adamw_a["weight_decay"] == adamw_b["weight_decay"] == 0.0
    # With AdamW's own lr, a group's plain lr stays the Muon half's.
    opt = dmuon.DMuon(groups, module=model, lr=0.02, adamw={"lr": 1e-3})
    _, adamw_a, _, adamw_b = opt.param_groups
    assert (adamw_a["lr"], adamw_b["lr"]) == (1e-3, 1e-3)


@pytest.mark.parametrize("keyword,value,replacement", [
    ("adamw_lr", 3e-4, r"adamw=dmuon.AdamWConfig\(lr=...\)"),
    ("adamw_betas", (0.9, 0.95), r"adamw=dmuon.AdamWConfig\(betas=...\)"),
    ("adamw_eps", 1e-8, r"adamw=dmuon.AdamWConfig\(eps=...\)"),
    ("adamw_weight_decay", 0.0, r"adamw=dmuon.AdamWConfig\(weight_decay=...\)"),
    ("ns_method", "standard", r"ns=dmuon.NSConfig\(method=...\)"),
    ("ns_dtype", torch.float32, r"ns=dmuon.NSConfig\(dtype=...\)"),
    ("overlap", False, r"execution=dmuon.ExecutionConfig\(overlap=...\)"),
    ("nonfinite", "skip", r"execution=dmuon.ExecutionConfig\(nonfinite=...\)"),
    ("ns_in_backward", True, r"execution=dmuon.ExecutionConfig\(ns_in_backward=...\)"),
    ("post_optim_event", True, r"execution=dmuon.ExecutionConfig\(post_optim_event=...\)"),
    ("return_waves", 2, r"execution=dmuon.ExecutionConfig\(return_waves=...\)"),
    ("param_groups", [], r"the groups as the first argument, DMuon\(groups, module=model\)"),
])
@pytest.mark.parametrize("optimizer", ["DMuon", "NorMuon", "MuonH", "Dion2"])
def test_a_setting_of_a_typed_config_given_as_a_keyword_names_the_config(optimizer, keyword, value, replacement):
    with pytest.raises(TypeError, match=f"^{optimizer}\\(\\) got an unexpected keyword argument '{keyword}': "
                                        f"pass {replacement}"):
        getattr(dmuon, optimizer)(TwoBlocks(), **{keyword: value})
    with pytest.raises(TypeError, match="unexpected keyword argument 'adamw_learning_rate'"):
        getattr(dmuon, optimizer)(TwoBlocks(), adamw_learning_rate=1e-3)  # Python's own, for any other name


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


def test_execution_must_be_an_execution_config():
    assert dmuon.DMuon(TwoBlocks()).execution == dmuon.ExecutionConfig()
    with pytest.raises(ValueError, match="execution must be a dmuon.ExecutionConfig, got dict"):
        dmuon.DMuon(TwoBlocks(), execution={"overlap": False})


def test_setup_waits_for_sharding_only_under_a_process_group():
    model = TwoBlocks()
    # No process group: nothing will shard the model, so DMuon sets itself up at once.
    assert not waits_for_sharding(model)
    opt = dmuon.DMuon(model)
    assert opt.is_set_up and [g["algorithm"] for g in opt.param_groups] == ["muon", "adamw"]
