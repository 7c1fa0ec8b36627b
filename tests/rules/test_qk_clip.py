"""QK-clip (MuonClip) inside the step (issue #31, part 2), against a single-process reference written
from the formula (``support.qk_clip``): torch.optim.Muon (or NorMuon's rule) + AdamW, then per key
head ``gamma = tau / S`` where ``S > tau``, query rows times ``gamma ** alpha``, key rows times
``gamma ** (1 - alpha)``, with ``S`` the maximum over every rank's reports.

One process and 4 gloo ranks (one spawn, every run in it): 1-D FSDP2 on the speculative step, a
skipped step, overlap=False with accumulation micro-batches, return waves with NS in backward,
NorMuon, a bf16 wire, FSDP2's native 2x2 HSDP and dmuon's replicate level, a (dp, tp) mesh with
TP-split heads, bf16 mixed precision against the gather-then-compute oracle (whose naive clip, an
all-reduce of its own, equals the formula in float32 too); GQA, a fused QKV as row groups and MLA;
maxima that differ per rank (the model's own and extra reports), a clip on some heads only,
NaN/inf/negative reports; 1e-5 with fp32 NS. The
agreed maxima are bit for bit the maximum of every rank's, on every rank, and the clip adds no
collective to the step.
"""

from __future__ import annotations

import functools

import pytest
import torch

import dmuon
from support.spawn import run_distributed

from support.qk_clip import (
    ADAMW, ALPHA, BETA2, MUON, SKIPPED, STEPS, TAU, QKNet, batch, extra_reports, layers_of, loss_of, reference,
    train,
)
from support.scenarios import run_each, succeeded

NAMES = ("gqa", "fused", "mla")


def _worst(got: dict, ref: dict) -> tuple[str, float]:
    assert got.keys() == ref.keys()
    name = max(ref, key=lambda n: (got[n] - ref[n]).abs().max().item())
    return name, (got[name] - ref[name]).abs().max().item()


@functools.lru_cache(maxsize=None)
def _reference(world: int, names=NAMES, skipped=(), rule="muon", clip=True, global_maxima=True, alpha=ALPHA):
    return reference(world, names, skipped=skipped, rule=rule, clip=clip, global_maxima=global_maxima, alpha=alpha)


# ------------------------------------------------------------------------------- one process
def _single(rule: str = "muon", nonfinite=None, skip: bool = False, **qk) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = QKNet()
    plan = dmuon.prepare(model, matrix_view={"fused.qkv.weight": "rows:8,8,8"},
                         ns=dmuon.NSConfig(method="standard", dtype=torch.float32))
    kw = dict(lr=MUON["lr"], weight_decay=MUON["weight_decay"], adamw=ADAMW,
              execution=dmuon.ExecutionConfig(nonfinite=nonfinite),
              qk_clip=dmuon.QKClip(layers_of(), **({"tau": TAU, "alpha": ALPHA} | qk)))
    if rule == "dion2":  # Dion2's own keywords, its weight decay the reference's (MUON's)
        from support.cases import DION2_KW
        opt = dmuon.Dion2(model, plan, **kw, fraction=DION2_KW["fraction"], ef_decay=DION2_KW["ef_decay"])
    else:
        opt = dmuon.DMuon(model, plan, **kw) if rule == "muon" else dmuon.NorMuon(model, plan, beta2=BETA2, **kw)
    for layer in model.attention():
        layer.report = opt.report_attention_logits
    for step in range(STEPS):
        loss = loss_of(model, batch(step, 0, 1))
        (loss * float("inf") if skip and step == SKIPPED else loss).backward()
        for key, values, first in extra_reports(step, 0, NAMES):
            opt.report_attention_logits(key, values, first)
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_the_reference_clips_some_heads_only_and_the_clip_matters():
    """Guards the reference itself: every layer has a step with a key head above tau and one below it,
    and the clipped training lands far from the unclipped one."""
    params, maxima = _reference(1)
    for key, heads in layers_of().items():
        groups = [step[key].view(heads.kv_heads, -1).amax(1) for step in maxima]
        assert any((g > TAU).any() and (g <= TAU).any() for g in groups), (key, groups)
    assert _worst(params, _reference(1, clip=False)[0])[1] > 0.1


@pytest.mark.parametrize("rule", ["muon", "normuon", "dion2"])
def test_one_process_equals_the_formula(rule):
    name, err = _worst(_single(rule), _reference(1, rule=rule)[0])
    assert err <= 1e-5, (rule, name, err)


def test_a_skipped_step_clips_nothing_and_drops_its_reports():
    """nonfinite="skip" with an infinite loss at one step: that step neither updates nor clips, and its
    reports (a spike on an MLA head) do not reach the next step."""
    got = _single(nonfinite="skip", skip=True)
    name, err = _worst(got, _reference(1, skipped=(SKIPPED,))[0])
    assert err <= 1e-5, (name, err)


@pytest.mark.parametrize("alpha", [0.0, 1.0])
def test_alpha_puts_the_factor_where_the_formula_says(alpha):
    """alpha = 0 scales the key rows only, 1 the query rows only (MLA's rope rows take the whole factor
    either way): the formula's result, not the default alpha's."""
    got = _single(alpha=alpha)
    name, err = _worst(got, _reference(1, alpha=alpha)[0])
    assert err <= 1e-5, (alpha, name, err)
    assert _worst(got, _reference(1)[0])[1] > 1e-2


def test_a_tau_above_every_maximum_clips_nothing():
    name, err = _worst(_single(tau=1e4), _reference(1, clip=False)[0])
    assert err <= 1e-5, (name, err)


def test_bad_registrations_and_reports_are_refused_naming_the_layer():
    model = QKNet()
    gqa = layers_of()["gqa"]
    clip = functools.partial(dmuon.QKClip, tau=TAU)
    with pytest.raises(ValueError, match="qk_clip layer 'x': the model has no parameter 'gqa.query.weight'"):
        dmuon.DMuon(model, qk_clip=clip({"x": dmuon.AttentionHeads("gqa.query.weight", "gqa.k.weight", 6, 3)}))
    with pytest.raises(ValueError, match=r"qk_clip layer 'x': query parameter 'gqa.q.weight' has 18 rows, but 6 "
                                         r"heads of 4 rows from row 0 need rows 0:24"):
        dmuon.DMuon(model, qk_clip=clip({"x": dmuon.AttentionHeads("gqa.q.weight", "gqa.k.weight", 6, 4,
                                                                    num_kv_heads=1)}))
    with pytest.raises(ValueError, match=r"qk_clip layer 'x': the query rows \(0, 8\) and key rows \(4, 12\) of "
                                         r"'fused.qkv.weight' overlap"):
        dmuon.DMuon(model, qk_clip=clip({"x": dmuon.AttentionHeads("fused.qkv.weight", "fused.qkv.weight", 4, 2,
                                                                    key_row=4)}))
    with pytest.raises(ValueError, match="qk_clip layer 'x': the key tensor .* is not a parameter of the model"):
        dmuon.DMuon(model, qk_clip=clip({"x": dmuon.AttentionHeads(model.gqa.q.weight, torch.zeros(6, 10), 6, 3,
                                                                    num_kv_heads=2)}))
    with pytest.raises(ValueError, match="qk_clip layer 'x': the key parameter 'head.weight' is not one of the "
                                         "optimizer's Muon matrices"):
        dmuon.DMuon(model, qk_clip=clip({"x": dmuon.AttentionHeads("gqa.q.weight", "head.weight", 6, 3,
                                                                    num_kv_heads=2)}))
    with pytest.raises(ValueError, match="qk_clip must be a dmuon.QKClip"):
        dmuon.DMuon(model, qk_clip={"gqa": gqa})
    opt = dmuon.DMuon(model, qk_clip=clip(layers_of()))
    with pytest.raises(ValueError, match="qk_clip has no layer 'attn0'"):
        opt.report_attention_logits("attn0", torch.zeros(6))
    with pytest.raises(ValueError, match="qk_clip layer 'gqa': 3 maxima from head 4 run past its 6 query heads"):
        opt.report_attention_logits("gqa", torch.zeros(3), first_head=4)
    with pytest.raises(ValueError, match="qk_clip layer 'gqa': expected a 1-D tensor"):
        opt.report_attention_logits("gqa", torch.zeros(2, 6))
    with pytest.raises(ValueError, match="needs QK-clip"):
        dmuon.DMuon(model).report_attention_logits("gqa", torch.zeros(6))


# --------------------------------------------------------------------------------- on 4 ranks
RUNS = {
    "1-D": dict(),
    "1-D skip": dict(skip=True, nonfinite="skip"),
    "1-D overlap=False, accumulation": dict(overlap=False, micro_batches=2),
    "1-D waves, NS in backward": dict(return_waves=3, ns_in_backward=True),
    "1-D NorMuon": dict(rule="normuon"),
    "bf16 wire": dict(ns_dtype=torch.bfloat16),
    "hsdp 2x2": dict(mesh_shape=(2, 2)),
    "hsdp 2x2 replicate level": dict(mesh_shape=(2, 2), hsdp="dmuon"),
    "tp": dict(tp=True, names=("gqa",)),
    "1-D gather oracle": dict(oracle=True),
    "bf16 mixed precision": dict(mixed_precision=True),
    "bf16 mixed precision, gather oracle": dict(mixed_precision=True, oracle=True),
}
AGAINST_THE_ORACLE = ("bf16 wire", "bf16 mixed precision", "bf16 mixed precision, gather oracle")
"""Runs a bf16 rounding keeps from the float32 formula: checked against the gather-then-compute oracle."""
COUNTED = ("1-D", "1-D skip", "hsdp 2x2 replicate level")
"""Runs repeated without the clip, to compare the collectives each step issues."""


def _on_ranks(rank: int, world: int) -> dict:
    """Every run in one process group, each with its own result or its own error."""
    runs = {label: functools.partial(train, world, count=True, **kw) for label, kw in RUNS.items()}
    runs |= {f"{label} without clip": functools.partial(train, world, count=True, clip=False, **RUNS[label])
             for label in COUNTED}
    return run_each(runs)


@functools.cache
def _results() -> list[dict]:
    return run_distributed(_on_ranks, 4, timeout_s=300)


def _ranks(label: str) -> list[dict]:
    """Each rank's result of the run ``label`` (its ranks' error when it raised)."""
    return [succeeded(r[label]) for r in _results()]


def _expected(label: str) -> dict[str, torch.Tensor]:
    kw = RUNS[label]
    world = 2 if kw.get("tp") else 4  # TP: two data-parallel ranks, each tp pair reads the same tokens
    return _reference(world, kw.get("names", NAMES), skipped=(SKIPPED,) if kw.get("skip") else (),
                      rule=kw.get("rule", "muon"))[0]


@pytest.mark.parametrize("label", [label for label in RUNS if label not in AGAINST_THE_ORACLE])
def test_on_ranks_equals_the_formula(label):
    name, err = _worst(_ranks(label)[0]["params"], _expected(label))
    assert err <= 1e-5, (label, name, err)


def test_bf16_mixed_precision_equals_gather_then_compute_with_its_naive_clip():
    """bf16 parameters in forward (the maxima computed in bf16): the same parameters as the oracle, which
    all-reduces the maxima in a collective of its own and scales its rows after the update."""
    got, oracle = _ranks("bf16 mixed precision")[0], _ranks("bf16 mixed precision, gather oracle")[0]
    name, err = _worst(got["params"], oracle["params"])
    assert err <= 1e-5, (name, err)
    for step in range(STEPS):
        assert got["agreed"][step].keys() == oracle["agreed"][step].keys()
        for key in got["agreed"][step]:
            assert torch.equal(got["agreed"][step][key], oracle["agreed"][step][key]), (step, key)
    # The clip acted (some head over tau), or the comparison proves little about it.
    assert any((m > TAU).any() for step in oracle["agreed"] for m in step.values())


def test_each_ranks_own_maxima_would_diverge_from_the_formula():
    """The mistake the agreement prevents (ms-swift#9901): clipping with one rank's own maxima lands
    far from the formula's global ones; the 1-D run does not."""
    local = _reference(4, global_maxima=False)[0]
    assert _worst(local, _reference(4)[0])[1] > 1e-2
    assert _worst(_ranks("1-D")[0]["params"], local)[1] > 1e-2


@pytest.mark.parametrize("label", RUNS)
def test_every_rank_agrees_on_the_maximum_of_every_ranks_maxima_bit_for_bit(label):
    """Whatever the wire (bf16 included: the maxima ride as float32 bit patterns), every rank's agreed
    maxima are exactly the maximum of every rank's own, the same on every rank; a skipped step
    agrees nothing new."""
    results = _ranks(label)
    names = sorted(RUNS[label].get("names", NAMES))  # the order the maxima travel in
    for step in range(STEPS):
        if any(res["skipped"][step] for res in results):
            assert label == "1-D skip" and step == SKIPPED and all(res["skipped"][step] for res in results)
            continue
        expected = torch.stack([res["local"][step] for res in results]).amax(0)
        for rank, res in enumerate(results):
            got = torch.cat([res["agreed"][step][key] for key in names])
            assert torch.equal(got, expected), (label, step, rank, got, expected)
        # The ranks' own maxima differ (their tokens, the extra reports), or the check proves little.
        assert any(not torch.equal(res["local"][step], results[0]["local"][step]) for res in results), (label, step)


@pytest.mark.parametrize("label", COUNTED)
def test_the_clip_adds_no_collective_to_the_step(label):
    """Every torch.distributed collective of each step (backward and step(), FSDP2's and dmuon's), counted
    by name: the same with the clip as without it."""
    for res, without in zip(_ranks(label), _ranks(f"{label} without clip")):
        assert res["counts"] == without["counts"], label
        assert any(res["counts"]), label
