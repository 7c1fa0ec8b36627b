"""DMuon through torch's own optimizer test inputs: the optimizer inputs and error inputs that the installed
``torch.testing._internal.common_optimizers`` (``optim_db``) defines for torch.optim.Muon and torch.optim.AdamW,
each run against torch's pair (torch.optim.Muon on the 2-D weights, torch.optim.AdamW on the rest) bit for bit
in one process; and the generic behaviours torch's ``test/test_optim.py`` checks of every optimizer,
written for a two-rule one: deterministic state dicts, loading an older state dict, named state dicts, the
six hook kinds, zero grads and printing (copies and tensor learning rates: test_torch_optim_conventions.py).
What cannot apply to a two-rule optimizer is in the README, "torch.optim conventions"."""

from __future__ import annotations

import copy
import re
import warnings

import pytest
import torch
from torch import nn
from torch.testing._internal.common_optimizers import OptimizerErrorEnum, optim_db

import dmuon

INFOS = {info.optim_cls: info for info in optim_db if info.optim_cls in (torch.optim.Muon, torch.optim.AdamW)}
MUON_INPUTS = INFOS[torch.optim.Muon].optim_inputs_func("cpu", torch.float32)
ADAMW_INPUTS = INFOS[torch.optim.AdamW].optim_inputs_func("cpu", torch.float32)
ERROR_INPUTS = [(cls.__name__, e) for cls in (torch.optim.Muon, torch.optim.AdamW)
                for e in INFOS[cls].optim_error_inputs_func("cpu", torch.float32)]
STEPS = 3
ADAMW_PREFIXED = ("lr", "weight_decay", "eps")
"""AdamW keywords that a DMuon group takes as ``adamw_<key>`` (unprefixed, they are Muon's or both halves')."""

DIFFERENT_BY_DESIGN = {
    # desc of torch's error input -> (what DMuon does instead, and why: the README's "torch.optim conventions")
    "only support 2D parameters": "accepted: a weight of more than two dims is a Muon matrix as its "
                                  "(shape[0], prod(shape[1:])) view (conv kernels, Keller Jordan's rule)",
    "does not support complex parameters": "refused at construction, naming the parameter: the plan "
                                           "selects the matrices when the optimizer is built",
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.ReLU(), nn.Linear(8, 4))


def _batch(step: int):
    g = torch.Generator().manual_seed(7 + step)
    return torch.randn(5, 6, generator=g), torch.randn(5, 4, generator=g)


def _train(model: nn.Module, opts: list, steps=range(STEPS)) -> None:
    for step in steps:
        x, y = _batch(step)
        ((model(x) - y) ** 2).mean().backward()
        for o in opts:
            o.step()
        for o in opts:
            o.zero_grad()


def _assert_same(model: nn.Module, reference: nn.Module) -> None:
    for (name, a), b in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(a, b), f"{name}: max |diff| {(a - b).abs().max().item()}"


def _own(value):
    """A tensor hyperparameter as an optimizer's own (each of torch's pair gets its own tensor)."""
    return value.clone() if isinstance(value, torch.Tensor) else value


def _ns(kwargs: dict) -> dmuon.NSConfig:
    """torch.optim.Muon's iteration (bf16, as torch's) with the input's NS keywords."""
    base = dmuon.NSConfig(method="standard")
    return dmuon.NSConfig(method="standard", steps=kwargs.get("ns_steps", base.steps),
                          coefficients=tuple(kwargs.get("ns_coefficients", base.coefficients)))


@pytest.mark.parametrize("optim_input", MUON_INPUTS, ids=[i.desc for i in MUON_INPUTS])
def test_torch_muon_inputs_equal_torch_pair(optim_input):
    kwargs = optim_input.kwargs
    model, reference = _model(), _model()
    opt = dmuon.DMuon(model, ns=_ns(kwargs), **{k: _own(v) for k, v in kwargs.items()})
    mats = [p for p in reference.parameters() if p.ndim == 2]
    pair = [torch.optim.Muon(mats, **{k: _own(v) for k, v in kwargs.items()}),
            torch.optim.AdamW([p for p in reference.parameters() if p.ndim != 2], lr=_own(kwargs.get("lr", 1e-3)),
                              weight_decay=0.01)]
    _train(model, [opt])
    _train(reference, pair)
    _assert_same(model, reference)


@pytest.mark.parametrize("optim_input", ADAMW_INPUTS, ids=[i.desc for i in ADAMW_INPUTS])
def test_torch_adamw_inputs_equal_torch_pair(optim_input):
    kwargs = optim_input.kwargs
    model, reference = _model(), _model()
    group = {("adamw_" + k if k in ADAMW_PREFIXED else k): _own(v) for k, v in kwargs.items()}
    opt = dmuon.DMuon([{"params": list(model.parameters()), **group}], module=model, ns=_ns({}))
    pair = [torch.optim.Muon([p for p in reference.parameters() if p.ndim == 2]),
            torch.optim.AdamW([p for p in reference.parameters() if p.ndim != 2], **kwargs)]
    _train(model, [opt])
    _train(reference, pair)
    _assert_same(model, reference)


class _Holder(nn.Module):
    """A model holding an error input's parameters (DMuon needs the model they belong to)."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        super().__init__()
        unique = list({id(p): p for p in params}.values())
        self.params = nn.ParameterList([p if isinstance(p, nn.Parameter) else nn.Parameter(p) for p in unique])


def _tensors(params) -> list[torch.Tensor]:
    if params is None:
        return []
    if isinstance(params, torch.Tensor):
        return [params]
    out = []
    for item in params:
        if isinstance(item, dict):
            out += _tensors(item["params"])
        elif isinstance(item, tuple):
            out.append(item[1])
        else:
            out.append(item)
    return out


def _replaced(params, held: dict):
    """``params`` (a tensor, a list of tensors, pairs or groups) with each tensor replaced by ``held[id]``."""
    if isinstance(params, torch.Tensor):
        return held[id(params)]
    out = []
    for item in params:
        if isinstance(item, dict):
            out.append(dict(item, params=_replaced(item["params"], held)))
        elif isinstance(item, tuple):
            out.append((item[0], held[id(item[1])]))
        else:
            out.append(held[id(item)])
    return out


def _build(optimizer: str, params, kwargs: dict):
    """DMuon on an error input: its parameters in a model (the input's own objects, so duplicates stay
    duplicates), its keywords where DMuon takes them (AdamW's as the group's keys)."""
    tensors = _tensors(params)
    model = _Holder(tensors) if tensors else _model()
    if tensors:  # the input's plain tensors as the model's parameters (same objects for duplicates)
        held = dict(zip(list({id(t): t for t in tensors}), model.params))
        params = _replaced(params, held)
    if params is None:
        params = list(model.parameters())
    if optimizer == "AdamW":
        group_keys = {("adamw_" + k if k in ADAMW_PREFIXED else k): v for k, v in kwargs.items()}
        groups = ([dict(g, **group_keys) for g in params] if isinstance(params, list) and params
                  and isinstance(params[0], dict) else [{"params": params, **group_keys}])
        if isinstance(params, torch.Tensor):
            return dmuon.DMuon(params, module=model, ns=_ns({}))
        return dmuon.DMuon(groups, module=model, ns=_ns({}))
    return dmuon.DMuon(params, module=model, ns=_ns({}), **kwargs)


@pytest.mark.parametrize("optimizer,error_input", ERROR_INPUTS,
                         ids=[f"{o}: {e.optimizer_error_input.desc}" for o, e in ERROR_INPUTS])
def test_torch_error_inputs_raise_torch_errors(optimizer, error_input):
    optim_input = error_input.optimizer_error_input
    desc = optim_input.desc
    if desc in DIFFERENT_BY_DESIGN:
        params = optim_input.params
        if desc == "only support 2D parameters":
            opt = _build(optimizer, params, optim_input.kwargs)
            assert [g["algorithm"] for g in opt.param_groups] == ["muon"]
        else:
            with pytest.raises(ValueError, match=r"params\.0.*complex|complex.*params\.0"):
                _build(optimizer, params, optim_input.kwargs)
        return
    if error_input.error_type is UserWarning:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _build(optimizer, optim_input.params, optim_input.kwargs)
        assert any(re.search(error_input.error_regex, str(w.message)) for w in caught), [str(w.message) for w in caught]
        return
    assert error_input.error_on == OptimizerErrorEnum.CONSTRUCTION_ERROR, desc
    with pytest.raises(error_input.error_type, match=error_input.error_regex):
        _build(optimizer, optim_input.params, optim_input.kwargs)


# ---------------------------------------------------------------------------------- generic behaviours
def _trained(steps: int = 2, named: bool = False):
    model = _model()
    params = list(model.named_parameters()) if named else list(model.parameters())
    opt = dmuon.DMuon(params, module=model, lr=0.02, ns=_ns({}))
    _train(model, [opt], range(steps))
    return model, opt


def _assert_state_dicts_equal(a: dict, b: dict) -> None:
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for k in a["state"]:
        assert a["state"][k].keys() == b["state"][k].keys()
        for name, value in a["state"][k].items():
            assert torch.equal(value, b["state"][k][name]), (k, name)


def test_state_dicts_are_deterministic_and_survive_a_load():
    (_, first), (_, second) = _trained(), _trained()
    _assert_state_dicts_equal(first.state_dict(), second.state_dict())
    model = _model()
    fresh = dmuon.DMuon(model, lr=0.02, ns=_ns({}))
    saved = copy.deepcopy(first.state_dict())
    fresh.load_state_dict(saved)
    _assert_state_dicts_equal(fresh.state_dict(), saved)


def test_an_older_state_dict_loads_with_the_defaults_of_later_keys():
    model, opt = _trained()
    reference_model, reference = copy.deepcopy((model, opt))
    saved = copy.deepcopy(opt.state_dict())
    for group in saved["param_groups"]:
        for key in ("amsgrad", "maximize", "foreach", "capturable", "differentiable", "fused",
                    "decoupled_weight_decay", "extra_scale_factor", "cautious_weight_decay"):
            group.pop(key, None)
    opt.load_state_dict(saved)
    _train(model, [opt], range(2, 4))
    _train(reference_model, [reference], range(2, 4))
    _assert_same(model, reference_model)


def test_named_state_dicts_name_every_group_and_resume():
    model, opt = _trained(named=True)
    saved = copy.deepcopy(opt.state_dict())
    names = [n for n, _ in model.named_parameters()]
    assert sorted(n for g in saved["param_groups"] for n in g["param_names"]) == sorted(names)
    model2 = _model()
    model2.load_state_dict(model.state_dict())
    opt2 = dmuon.DMuon(list(model2.named_parameters()), module=model2, lr=0.02, ns=_ns({}))
    opt2.load_state_dict(saved)
    _train(model, [opt], range(2, 4))
    _train(model2, [opt2], range(2, 4))
    _assert_same(model2, model)


def test_the_six_hook_kinds_run_with_torch_s_arguments():
    model = _model()
    opt = dmuon.DMuon(model, lr=0.02, ns=_ns({}))
    calls = []
    opt.register_step_pre_hook(lambda o, args, kwargs: calls.append(("step pre", o is opt)))
    opt.register_step_post_hook(lambda o, args, kwargs: calls.append(("step post", o is opt)))
    opt.register_state_dict_pre_hook(lambda o: calls.append(("state_dict pre", o is opt)))

    def state_dict_post(o, state_dict):
        calls.append(("state_dict post", o is opt))
        state_dict["marked"] = True
        return state_dict

    opt.register_state_dict_post_hook(state_dict_post)

    def load_pre(o, state_dict):
        calls.append(("load pre", o is opt and state_dict.pop("marked")))
        return state_dict

    opt.register_load_state_dict_pre_hook(load_pre)
    opt.register_load_state_dict_post_hook(lambda o: calls.append(("load post", o is opt)))
    _train(model, [opt], range(1))
    opt.load_state_dict(opt.state_dict())
    assert calls == [("step pre", True), ("step post", True), ("state_dict pre", True), ("state_dict post", True),
                     ("load pre", True), ("load post", True)]


def test_zero_grad_sets_none_or_zeros_as_torch():
    model = _model()
    opt = dmuon.DMuon(model, lr=0.02, ns=_ns({}))
    x, y = _batch(0)
    ((model(x) - y) ** 2).mean().backward()
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_printing_lists_every_group_as_torch_does():
    model = _model()
    opt = dmuon.DMuon(model, lr=0.02, ns=_ns({}))
    text = repr(opt)
    assert text.startswith("DMuon (") and text.endswith(")")
    assert "Parameter Group 0\n    adjust_lr_fn: None\n    algorithm: muon" in text
    assert "Parameter Group 1\n    algorithm: adamw\n    amsgrad: False" in text
    assert "momentum: 0.95" in text and "betas: (0.9, 0.999)" in text
