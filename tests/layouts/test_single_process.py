"""mesh=None: DMuon in one process equals torch.optim.Muon + AdamW, with schedulers and param groups."""

from __future__ import annotations

import copy

import torch

import dmuon

from support.cases import MUON_KW
from support.models import OddNet, lm_loss, odd_batch


def _batches(steps):
    return [odd_batch(s, 0, batch=4) for s in range(steps)]


FP32_STANDARD = dmuon.NSConfig(method="standard", dtype=torch.float32)


def test_lr_scheduler_and_state_dict_round_trip():
    steps = 4
    schedule = lambda step: 1.0 / (1 + step)  # noqa: E731

    torch.manual_seed(0)
    model = OddNet()
    plan = dmuon.prepare(model, ns=FP32_STANDARD)
    opt = dmuon.DMuon(model, plan, lr=0.02, adamw=dmuon.AdamWConfig(lr=3e-3))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    for batch in _batches(steps):
        lm_loss(model, batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        sched.step()
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())

    # Reference: torch's two optimizers, each with the same schedule.
    torch.manual_seed(0)
    ref_model = OddNet()
    names = [i.name for i in plan.infos]
    mats = [p for n, p in ref_model.named_parameters() if n in names]
    views = [torch.nn.Parameter(p.data.view(p.shape[0], -1)) if p.ndim > 2 else p for p in mats]
    muon = torch.optim.Muon(views, **MUON_KW)
    adamw = torch.optim.AdamW([p for n, p in ref_model.named_parameters() if n not in names], lr=3e-3,
                              weight_decay=0.01)
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, schedule) for o in (muon, adamw)]
    from support.reference import ns_precision

    for batch in _batches(steps):
        lm_loss(ref_model, batch).backward()
        for p, v in zip(mats, views):
            if v is not p:
                v.grad = p.grad.view(v.shape)
        with ns_precision(torch.float32):
            muon.step()
        adamw.step()
        ref_model.zero_grad()
        for v in views:
            v.grad = None
        for s in scheds:
            s.step()
    got = dict(model.named_parameters())
    for n, p in ref_model.named_parameters():
        assert torch.allclose(got[n], p, atol=1e-6), n

    # state_dict round trip: a fresh optimizer resumes identically. Copy it, as
    # saving to disk would: torch's state dicts hold references to live tensors.
    saved = copy.deepcopy(opt.state_dict())
    model2 = OddNet()
    model2.load_state_dict(model.state_dict())
    plan2 = dmuon.prepare(model2, ns=FP32_STANDARD)
    opt2 = dmuon.DMuon(model2, plan2, lr=0.02, adamw=dmuon.AdamWConfig(lr=3e-3))
    opt2.load_state_dict(saved)
    for m, o in ((model, opt), (model2, opt2)):
        lm_loss(m, odd_batch(9, 0, batch=4)).backward()
        o.step()
    for (n, a), b in zip(model.named_parameters(), model2.parameters()):
        assert torch.equal(a, b), n


def test_param_groups_override_per_group():
    torch.manual_seed(0)
    model = OddNet()
    plan = dmuon.prepare(model)
    frozen_lr = [p for n, p in model.named_parameters() if n.startswith("layers.0.")]
    rest = [p for n, p in model.named_parameters() if not n.startswith("layers.0.")]
    opt = dmuon.DMuon([
        {"params": frozen_lr, "lr": 0.0, "weight_decay": 0.0, "adamw_lr": 0.0, "adamw_weight_decay": 0.0},
        {"params": rest},
    ], plan, module=model, lr=0.02)
    assert [g["algorithm"] for g in opt.param_groups] == ["muon", "adamw", "muon", "adamw"]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    lm_loss(model, odd_batch(0, 0)).backward()
    opt.step()
    for n, p in model.named_parameters():
        if n.startswith("layers.0."):
            assert torch.equal(p, before[n]), n
        elif p.grad is not None:
            assert not torch.equal(p, before[n]), n


def test_parameter_added_after_prepare_is_named():
    import pytest

    model = OddNet()
    plan = dmuon.prepare(model)
    model.extra = torch.nn.Linear(3, 3)
    with pytest.raises(ValueError, match="extra.weight"):
        dmuon.DMuon(model, plan)


class _FiveHeads(torch.nn.Module):
    """Five same-shape matrices: one kind whose batching the balancer decides."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(32, 16, bias=False) for _ in range(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(layer(x) for layer in self.layers).square().mean()


def _train_recording_batches(monkeypatch, **prepare_kw):
    import dmuon.ortho.owner as dmuon_optim

    torch.manual_seed(0)
    model = _FiveHeads()
    plan = dmuon.prepare(model, ns=FP32_STANDARD, **prepare_kw)
    calls: list[int] = []
    real = dmuon_optim.orthogonalize_many

    def recording(matrices, **kw):
        calls.append(len(matrices))
        return real(matrices, **kw)

    opt = dmuon.DMuon(model, plan, lr=0.02)  # its setup runs the same batches once, to tune them
    monkeypatch.setattr(dmuon_optim, "orthogonalize_many", recording)
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        model(torch.randn(8, 32, generator=gen)).backward()
        opt.step()
        opt.zero_grad()
    return plan, calls, [layer.weight.detach().clone() for layer in model.layers]


def test_ns_runs_in_the_batches_the_balancer_priced(monkeypatch):
    from dmuon.plan.profile import table_from_records

    # Batches of 4 are cheap, of 2 not worth it: the cheapest split of 5 is 4 + 1.
    costs = table_from_records([
        {"shape": [16, 32], "batch": 1, "seconds": 1.0},
        {"shape": [16, 32], "batch": 2, "seconds": 1.9},
        {"shape": [16, 32], "batch": 4, "seconds": 2.0},
    ])
    plan, calls, weights = _train_recording_batches(monkeypatch, balancer="milp", cost_table=costs)
    assert plan.balance_result.batches[0] == {(16, 32): [4, 1]}
    assert calls == [4, 1, 4, 1]
    # Without batch costs (analytical model) the kind runs as one call and the NS
    # autotuner decides; the update is the same either way.
    _, calls_default, weights_default = _train_recording_batches(monkeypatch)
    assert calls_default == [5, 5]
    for a, b in zip(weights, weights_default):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_second_prepare_with_profile_reuses_the_cache(tmp_path, monkeypatch):
    import dmuon.plan.profile as profile

    # A fixed NS (method and batching): the profile's cache is the point here, and the NS autotuner would
    # measure its own choices first (seconds).
    ns = dmuon.NSConfig(method="standard", dtype=torch.float32, batching="batched")
    torch.manual_seed(0)
    first = dmuon.prepare(_FiveHeads(), profile=True, balancer="milp", cache_dir=tmp_path, ns=ns)
    assert list(tmp_path.iterdir()), "the profile was not cached"

    def no_measuring(*args, **kwargs):
        raise AssertionError("measured again despite a cached profile")

    monkeypatch.setattr(profile, "measure_update", no_measuring)
    second = dmuon.prepare(_FiveHeads(), profile=True, balancer="milp", cache_dir=tmp_path, ns=ns)
    assert [i.cost for i in second.infos] == [i.cost for i in first.infos]
    # The plan says what profiling cost: something measured the first time, nothing the second.
    first_note = [n for n in first.balance_result.notes if n.startswith("profile")]
    second_note = [n for n in second.balance_result.notes if n.startswith("profile")]
    assert first_note and " 0 entries measured" not in first_note[0]
    assert second_note and " 0 entries measured" in second_note[0]
    assert first_note[0] in str(first)
    assert second.balance_result.batches == first.balance_result.batches


def test_ns_keywords_come_from_the_plan_and_must_agree_with_it():
    import pytest

    model = OddNet()
    plan = dmuon.prepare(model, ns=dmuon.NSConfig(steps=3, dtype=torch.float32))
    opt = dmuon.DMuon(model, plan)
    assert opt.ns == plan.ns and opt.runtime.exchange.wire_dtype == torch.float32
    assert {g["ns_steps"] for g in opt.param_groups if g["algorithm"] == "muon"} == {3}
    # Saying the same again is fine; saying something else names what differs.
    dmuon.DMuon(model, plan, ns_steps=3)
    with pytest.raises(ValueError, match=r"steps: 4 != 3.*dmuon.prepare"):
        dmuon.DMuon(model, plan, ns_steps=4)
    # Without a plan the keywords build the one DMuon prepares.
    assert dmuon.DMuon(OddNet(), ns_steps=4).plan.ns == dmuon.NSConfig(steps=4)
    for kwargs, name in ((dict(ns_steps=0), "ns_steps"), (dict(ns_coefficients="x"), "ns_coefficients"),
                         (dict(eps=-1.0), "eps")):
        with pytest.raises(ValueError, match=f"^{name}: "):
            dmuon.DMuon(OddNet(), **kwargs)
    with pytest.raises(ValueError, match="ns must be a dmuon.NSConfig"):
        dmuon.prepare(OddNet(), ns={"steps": 3})


def test_post_optim_event_needs_a_device_with_events():
    import pytest

    with pytest.raises(ValueError, match="post_optim_event=True needs a device with events"):
        dmuon.DMuon(OddNet(), execution=dmuon.ExecutionConfig(post_optim_event=True))
    assert dmuon.DMuon(OddNet()).runtime._root is None  # off by default: nothing handed to FSDP2


def test_ns_config_and_execution_config_are_accepted_directly():
    import pytest

    ns = dmuon.NSConfig(method="standard", steps=4, dtype=torch.float32)
    opt = dmuon.DMuon(OddNet(), ns=ns)
    assert opt.ns == ns == opt.plan.ns
    # The torch.optim-style keywords may repeat ns=, never contradict it.
    assert dmuon.DMuon(OddNet(), ns=ns, ns_steps=4).ns == ns
    with pytest.raises(ValueError, match=r"contradict ns=.*steps: 5 != 4"):
        dmuon.DMuon(OddNet(), ns=ns, ns_steps=5)
    with pytest.raises(ValueError, match="ns must be a dmuon.NSConfig"):
        dmuon.DMuon(OddNet(), ns={"steps": 3})
    execution = dmuon.ExecutionConfig(overlap=False, nonfinite="skip", return_waves=2)
    opt = dmuon.DMuon(OddNet(), execution=execution)
    assert opt.execution == execution and opt.runtime.backward is None and opt.runtime.work.max_waves == 2
    # The switches are set in execution= only; a switch given as DMuon's keyword names it.
    with pytest.raises(TypeError, match=r"'overlap': pass execution=dmuon.ExecutionConfig\(overlap=...\)"):
        dmuon.DMuon(OddNet(), execution=execution, overlap=False)
    for kwargs, message in ((dict(overlap=1), "overlap must be True or False"),
                            (dict(nonfinite="ignore"), "nonfinite must be one of"),
                            (dict(return_waves=0), "return_waves must be an int >= 1"),
                            (dict(ns_in_backward=True, overlap=False), "ns_in_backward=True needs overlap=True")):
        with pytest.raises(ValueError, match=message):
            dmuon.ExecutionConfig(**kwargs)
    with pytest.raises(ValueError, match="execution must be a dmuon.ExecutionConfig"):
        dmuon.DMuon(OddNet(), execution={"overlap": False})
    # hop_a_spread: 8 by default, 1 by default with returns in backward, as given when given.
    assert dmuon.ExecutionConfig().resolved_hop_a_spread == 8
    returns = dict(ns_in_backward=True, returns_in_backward=True)
    assert dmuon.ExecutionConfig(**returns).resolved_hop_a_spread == 1
    assert dmuon.ExecutionConfig(**returns, hop_a_spread=4).resolved_hop_a_spread == 4
    assert dmuon.ExecutionConfig(hop_a_spread=2).resolved_hop_a_spread == 2
    with pytest.raises(ValueError, match="hop_a_spread must be an int >= 1 or None, got 0"):
        dmuon.ExecutionConfig(hop_a_spread=0)


def test_a_param_group_ns_setting_is_refused_naming_group_and_key():
    import pytest

    model = OddNet()
    plan = dmuon.prepare(model)
    first = [p for n, p in model.named_parameters() if n.startswith("layers.0.")]
    rest = [p for n, p in model.named_parameters() if not n.startswith("layers.0.")]
    # The plan's own values are fine (they are what a group gets by default).
    dmuon.DMuon([{"params": first, "ns_steps": plan.ns.steps}, {"params": rest}], plan, module=model)
    # Group 2 is the second Muon group (each user group splits into a Muon and an AdamW group).
    with pytest.raises(ValueError, match=r"param group 2: ns_steps=3 differs .*steps=5"):
        dmuon.DMuon([{"params": first}, {"params": rest, "ns_steps": 3}], plan, module=model)
    opt = dmuon.DMuon([{"params": first}, {"params": rest}], plan, module=model)
    with pytest.raises(ValueError, match=r"param group 4: eps=0.1 differs"):
        opt.add_param_group({"params": [], "algorithm": "muon", "eps": 0.1})
    # Changed after construction: refused before any collective (by the launch in backward, or
    # by step() without overlap).
    for overlap in (True, False):
        opt = dmuon.DMuon(model, plan, execution=dmuon.ExecutionConfig(overlap=overlap))
        opt.param_groups[0]["ns_coefficients"] = (3.0, -3.0, 1.0)
        with pytest.raises(ValueError, match=r"param group 0: ns_coefficients=\(3.0, -3.0, 1.0\) differs"):
            lm_loss(model, odd_batch(0, 0)).backward()
            opt.step()
        opt.zero_grad()
