"""MuonH's and Dion2's single-process references, written from the rules' formulas (torch's NS in
fp32, nothing of dmuon's), and the rank functions of ``tests/rules/test_muonh.py`` and ``tests/rules/test_dion2.py``:
each world size's runs of both rules in one process group (a spawn costs more than the work), cached
here so both test files share them."""

from __future__ import annotations

import functools
import math
import tempfile
from typing import NamedTuple

import pytest
import torch
from torch import nn

import dmuon

from dmuon.costmodel.traffic import owner_exchange_collectives
from dmuon.plan.selection import select_matrices
from dmuon.testing.reference import fp32_newton_schulz
from support.spawn import run_distributed

from support.cases import DION2_KW, MUON_KW, Case, run_cases
from support.equivalence import SKIP, STEPS, all_ranks_batches, max_diff
from support.models import OddNet, lm_loss
from support.scenarios import run_grouped

KELLER = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's defaults, which the runs use: 5 steps, eps 1e-7
EPS = 1e-7
ADAMW_KW = dict(lr=3e-3, weight_decay=0.01)
SAVED_AT, MORE = 2, 2
RULES = ("muonh", "dion2")


def _matrix(p: torch.Tensor, part) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight (a view) and gradient of one matrix as ``(m, n)``."""
    weight, grad = part(p.data), part(p.grad)
    m = weight.shape[0]
    return weight.view(m, -1), grad.reshape(m, -1).float()


def reference_training(rule: str, model: nn.Module, matrices: list[tuple], batches: list, loss_fn, *,
                       lr: float, adamw_kwargs: dict, momentum: float = 0.95, nesterov: bool = True,
                       fraction: float = 0.25, ef_decay: float = 0.95, weight_decay: float = 0.0,
                       clip: float | None = None) -> tuple[dict, list[float], dict]:
    """One process: ``rule`` on ``matrices`` (``(name, param)`` or ``(name, param, part)``), AdamW on the rest.

    MuonH (fp32, torch's Muon momentum, fp32 NS)::

        R = max(||W||_F, eps) at the matrix's first step
        M.lerp_(G, 1-mu); D = G.lerp(M, mu) if nesterov else M; u = NS(D)
        W -= lr * sqrt(max(1, m/n)) * R * u / max(||u||_F, eps);  W *= R / max(||W||_F, eps)

    Dion2::

        M += G; S = topk(||M[row]||_1, max(1, ceil(fraction m))) in row order; O = NS(M[S]); M[S] *= ef_decay
        W *= 1 - lr wd; W[S] -= lr * sqrt(m/n) * O

    A matrix without a gradient is left alone; ``clip``: ``clip_grad_norm_`` over every gradient first. Returns the final parameters, each step's loss and
    per matrix its state (MuonH: ``R``; Dion2: ``M``, flat).
    """
    ids = {id(entry[1]) for entry in matrices}
    adamw = torch.optim.AdamW([p for p in model.parameters() if id(p) not in ids], **adamw_kwargs)
    state: dict[str, torch.Tensor] = {}
    radii: dict[str, torch.Tensor] = {}
    losses = []
    for batch in batches:
        loss = loss_fn(model, batch)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        with torch.no_grad():
            for name, p, *part in matrices:
                if p.grad is None:
                    continue
                w, g = _matrix(p, part[0] if part else (lambda t: t))
                m, n = w.shape
                buf = state.setdefault(name, torch.zeros(m, n))
                if rule == "muonh":
                    r = radii.setdefault(name, w.norm().clamp_min(EPS))
                    buf.lerp_(g, 1 - momentum)
                    d = g.lerp(buf, momentum) if nesterov else buf
                    u = fp32_newton_schulz(d, KELLER, 5, EPS)
                    w.add_(u / u.norm().clamp_min(EPS) * r, alpha=-lr * math.sqrt(max(1, m / n)))
                    w.mul_(r / w.norm().clamp_min(EPS))
                else:
                    buf.add_(g)
                    k = max(1, math.ceil(fraction * m))
                    rows = torch.topk(buf.abs().sum(dim=-1), k).indices.sort().values
                    o = fp32_newton_schulz(buf[rows], KELLER, 5, EPS)
                    buf[rows] *= ef_decay
                    w.mul_(1 - lr * weight_decay)
                    w[rows] -= lr * math.sqrt(m / n) * o
        adamw.step()
        model.zero_grad(set_to_none=True)
        losses.append(loss.item())
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    kept = radii if rule == "muonh" else state
    return params, losses, {n: v.reshape(-1).clone() for n, v in kept.items()}


def rule_kwargs(rule: str) -> dict:
    """The settings the OddNet runs use (``support.cases.rule_optimizer``: lr 0.02, Muon's momentum)."""
    if rule == "muonh":
        return dict(lr=MUON_KW["lr"], momentum=MUON_KW["momentum"], nesterov=MUON_KW["nesterov"])
    return dict(lr=MUON_KW["lr"], **DION2_KW)


@functools.cache
def oddnet_reference(rule: str, world_size: int, clip: float | None = None) -> tuple[dict, list[float], dict]:
    """OddNet (seed 0) on all ``world_size`` ranks' batches of ``STEPS`` steps, ``SKIP`` applied."""
    torch.manual_seed(0)
    model = OddNet()
    batches, loss_fn = all_ranks_batches(world_size)
    return reference_training(rule, model, select_matrices(model), batches, loss_fn, adamw_kwargs=ADAMW_KW,
                              clip=clip, **rule_kwargs(rule))


def checkpoint_reference(rule: str) -> dict:
    """OddNet trained without interruption on the checkpoint runs' global batches."""
    from support.checkpoint import global_batch

    torch.manual_seed(0)
    model = OddNet()
    batches = [global_batch(s) for s in range(SAVED_AT + MORE)]
    return reference_training(rule, model, select_matrices(model), batches, lm_loss, adamw_kwargs=ADAMW_KW,
                              **rule_kwargs(rule))[0]


def tp_reference(rule: str, dp: int, steps: int) -> tuple[dict, dict]:
    """``support.tp``'s TPNet in one process under the formula (its settings: wd 0.1 for Dion2)."""
    from support.tp import ADAMW, MATRICES, MUON, TPNet, batch, loss_of

    torch.manual_seed(0)
    model = TPNet()
    named = dict(model.named_parameters())
    batches = [torch.cat([batch(step, d, dp) for d in range(dp)]) for step in range(steps)]
    kw = rule_kwargs(rule) | ({"weight_decay": MUON["weight_decay"]} if rule == "dion2" else {})
    params, _, state = reference_training(rule, model, [(n, named[n]) for n in MATRICES], batches, loss_of,
                                          adamw_kwargs=ADAMW, **kw)
    return params, state


# ----------------------------------------------------------------------------- rank functions

BF16_ORACLE_STEPS = {"muonh": 1, "dion2": STEPS}
"""Steps over which dmuon under bf16 mixed precision is compared with the oracle. Dion2's runs agree bit
for bit. MuonH's weight norms are sums over the shards on dmuon and over the whole matrix in the oracle,
so its first step's weights differ in the last float32 bit; from the second step such a bit can flip a
weight's bfloat16 rounding in the forward, and NS, which lifts a gradient's small singular directions
hundreds of times, makes that a different update (measured on 3 ranks: 1.2e-7 after one step, 3.3e-4
after two, with equal losses). So MuonH is compared after its first step; its longer bf16 run is held
to the sphere (tests/rules/test_muonh.py)."""


def bf16_oracle_pair(rule: str) -> tuple[str, str]:
    """The case labels of dmuon's and the oracle's bf16 runs compared over ``BF16_ORACLE_STEPS[rule]`` steps."""
    steps = BF16_ORACLE_STEPS[rule]
    label = f"{rule} bf16 mixed precision"
    return label + (f", {steps} steps" if steps != STEPS else ""), f"{label}, gather oracle"


SLOW_CASES = {4: ("muonh zero3", "dion2 zero3")}
"""World size -> the cases run under ``-m slow`` only: each rule's plain 1-D case on 4 ranks (its column-sharded
case is 1-D on 4 ranks by default, its plain case on 2 and 3)."""


def equivalence_cases(world_size: int, slow: bool = False) -> dict[str, Case]:
    """Per rule the OddNet runs compared with the single-process reference, spread over the world sizes
    (``slow``: :data:`SLOW_CASES` instead)."""
    cases = {}
    for rule in RULES:
        cases[f"{rule} zero3"] = Case(rule=rule, steps=STEPS, skip=SKIP)
    if world_size == 2:
        cases["muonh zero2, 4 return waves, no overlap"] = Case(rule="muonh", steps=STEPS, skip=SKIP, zero=2,
                                                                return_waves=4, overlap=False)
        cases["dion2 zero2, 4 return waves, ns_in_backward"] = Case(rule="dion2", steps=STEPS, skip=SKIP, zero=2,
                                                                    return_waves=4, ns_in_backward=True)
    if world_size == 3:
        for rule in RULES:
            cases[f"{rule} bf16 mixed precision"] = Case(rule=rule, steps=STEPS, skip=SKIP, bf16=True)
            # The gather-then-compute oracle running the same rule: against the formula in float32, and
            # against dmuon under bf16 mixed precision (where the formula's float32 run is no reference)
            # over BF16_ORACLE_STEPS[rule] steps.
            cases[f"{rule} gather oracle"] = Case(kind="gather", rule=rule, steps=STEPS, skip=SKIP)
            steps, (ours, oracle) = BF16_ORACLE_STEPS[rule], bf16_oracle_pair(rule)
            cases[ours] = Case(rule=rule, steps=steps, skip=SKIP, bf16=True)  # at STEPS: the run above
            cases[oracle] = Case(kind="gather", rule=rule, steps=steps, skip=SKIP, bf16=True)
            # Clipping every step: MuonH's launches stand rescaled (Muon's momentum), Dion2's go again.
            cases[f"{rule} clipped"] = Case(rule=rule, steps=STEPS, skip=SKIP, clip=0.05, clip_with="dmuon")
    if world_size == 4:
        for rule in RULES:
            cases[f"{rule} hsdp 2x2 (FSDP2's)"] = Case(rule=rule, steps=STEPS, skip=SKIP, mesh_shape=(2, 2))
            cases[f"{rule} hsdp 2x2 (replicate level)"] = Case(rule=rule, steps=STEPS, skip=SKIP, mesh_shape=(2, 2),
                                                                hsdp="dmuon")
        cases["dion2 column-sharded"] = Case(rule="dion2", steps=STEPS, skip=SKIP,
                                             column_sharded=("layers.1.down.weight", "layers.2.down.weight"))
        cases["muonh column-sharded, nonfinite skip"] = Case(
            rule="muonh", steps=STEPS, skip=SKIP, nonfinite="skip",
            column_sharded=("layers.1.down.weight", "layers.2.down.weight"))
    return {label: case for label, case in cases.items() if (label in SLOW_CASES.get(world_size, ())) == slow}


COUNTED = {"1-D bf16 NS, 4 waves": (None, torch.bfloat16, 4, "fsdp2"),
           "hsdp 2x2 fp32": ((2, 2), torch.float32, None, "fsdp2"),
           "replicate level 2x2 bf16 NS": ((2, 2), torch.bfloat16, None, "dmuon")}
"""The 4-rank runs whose counted bytes are compared with the model: (mesh, NS dtype, return waves, hsdp)."""


def save_rule(rank: int, world_size: int, path: str, rule: str) -> None:
    from support.cases import sharded_oddnet
    from support.checkpoint import _train, save

    model, _, opt = sharded_oddnet(world_size, rule=rule)
    _train(model, opt, rank, world_size, range(SAVED_AT))
    save(model, opt, path)


def resume_rule(rank: int, world_size: int, path: str, rule: str, mesh_shape=None, hsdp: str = "fsdp2") -> dict:
    """A fresh model on this cluster resumes ``rule`` from ``path`` and trains ``MORE`` steps: its full
    parameters (rank 0) and the layout its rule state came back in."""
    from torch.distributed.tensor import DTensor

    from support.cases import full_params, sharded_oddnet
    from support.checkpoint import _train, load

    model, _, opt = sharded_oddnet(world_size, mesh_shape=mesh_shape, hsdp=hsdp, rule=rule)
    load(model, opt, path)
    key = "initial_norm" if rule == "muonh" else "momentum_buffer"
    state = opt.state[model.layers[0].mid.weight][key]
    layout = (isinstance(state, DTensor), state.dtype, str(getattr(state, "placements", None)))
    _train(model, opt, rank, world_size, range(SAVED_AT, SAVED_AT + MORE))
    params = full_params(model)
    return {"params": params if rank == 0 else None, "layout": layout}


def rule_runs(rank: int, world_size: int, directory: str, slow: bool = False) -> dict:
    """Every run of both test files on ``world_size`` ranks, in one process group (``slow``: the
    :data:`SLOW_CASES` alone).

    2 ranks save each rule's checkpoint that 3 ranks and 4 (dmuon's replicate level on 2x2) resume;
    4 ranks also run TP (dp2 x tp2) and the counted-byte steps."""
    from support.step_comm import counted_step
    from support.tp import train

    cases = equivalence_cases(world_size, slow)
    out = {"cases": dict(zip(cases, run_cases(rank, world_size, list(cases.values())))), "resumed": {}}
    if slow:
        return out
    # Each run on its own (support.scenarios): a run that raises fails only the tests reading it.
    scenarios = {}
    for rule in RULES:
        path = f"{directory}/{rule}"
        if world_size == 2:
            scenarios[("saved", rule)] = functools.partial(save_rule, rank, world_size, path, rule)
        elif world_size == 3:
            scenarios[("resumed", rule)] = functools.partial(resume_rule, rank, world_size, path, rule)
        else:
            scenarios[("resumed", rule)] = functools.partial(resume_rule, rank, world_size, path, rule, (2, 2),
                                                             "dmuon")
    if world_size == 4:
        for rule in RULES:
            for name, (mesh, dtype, waves, hsdp) in COUNTED.items():
                scenarios[("counted", (rule, name))] = functools.partial(
                    counted_step, rank, world_size, mesh, dtype, 3, 2, waves, hsdp, rule)
        scenarios[("counted", ("muon", "1-D bf16 NS, 4 waves"))] = functools.partial(
            counted_step, rank, world_size, None, torch.bfloat16, 3, 2, 4, "fsdp2", "muon")
        for rule in RULES:
            scenarios[("tp", rule)] = functools.partial(train, rank, world_size, STEPS, (2, 2), rule=rule)
    return out | run_grouped(scenarios)


_DIRECTORY = tempfile.TemporaryDirectory()


@functools.cache
def runs(world_size: int, slow: bool = False) -> list[dict]:
    """:func:`rule_runs` on ``world_size`` ranks (2 first: it saves the checkpoints the others resume)."""
    if world_size != 2 and not slow:
        runs(2)
    return run_distributed(rule_runs, world_size, _DIRECTORY.name, slow, timeout_s=600)


def check_oracle_runs(rule: str) -> None:
    """The gather-then-compute oracle running ``rule`` equals its float32 formula on 3 ranks (parameters,
    losses, state), and dmuon under bf16 mixed precision (FSDP2's param_dtype: a float32 formula is no
    reference there, a 1-ulp difference in a bf16 gradient changes the step) equals the oracle over
    ``BF16_ORACLE_STEPS[rule]`` steps."""
    results = runs(3)[0]["cases"]
    out = results[f"{rule} gather oracle"]
    ref, ref_losses, ref_state = oddnet_reference(rule, 3)
    diff, worst = max_diff(out["params"], ref)
    assert diff <= 1e-5, ("oracle", worst, diff)
    assert out["losses"] == pytest.approx(ref_losses, rel=1e-5, abs=1e-6), "oracle losses"
    diff, worst = max_diff({n: v.reshape(-1) for n, v in out["rule_state"].items()}, ref_state)
    assert diff <= 1e-5, ("oracle state", worst, diff)
    ours, theirs = bf16_oracle_pair(rule)
    got, oracle = results[ours], results[theirs]
    assert len(got["losses"]) == len(oracle["losses"]) == BF16_ORACLE_STEPS[rule]
    for key in ("params", "rule_state"):
        diff, worst = max_diff(got[key], oracle[key])
        assert diff <= 1e-5, ("bf16", key, worst, diff)
    assert got["losses"] == pytest.approx(oracle["losses"], rel=1e-5), "bf16 losses"


def one_process_oddnet(make_optimizer) -> tuple[nn.Module, torch.optim.Optimizer, list[float]]:
    """OddNet (seed 0) trained in one process on rank 0's batches, ``SKIP`` applied, with
    ``make_optimizer(model)``: the model, the optimizer and the losses."""
    from support.models import OddNet, lm_loss, odd_batch

    torch.manual_seed(0)
    model = OddNet()
    opt = make_optimizer(model)
    losses = []
    for step in range(STEPS):
        model.skip = SKIP.get(step, set())
        loss = lm_loss(model, odd_batch(step, 0))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return model, opt, losses


def one_process_experts(make_optimizer, reference) -> tuple[nn.Module, torch.optim.Optimizer, dict, dict]:
    """ExpertNet (3 experts, seed 0) with ``moe.down.weight`` viewed as 2 row groups (five matrices),
    trained in one process with ``make_optimizer(model, plan)``, and ``reference(model, matrices, batches,
    loss_fn) -> (params, losses, state)`` run on a fresh copy with each expert and each group as a matrix
    of its own (``expert{e}``, ``group{g}``): the model, the optimizer, the reference's parameters and
    its state per matrix."""
    from support.experts import ExpertNet, batch, loss_of

    def build():
        torch.manual_seed(0)
        return ExpertNet(3)

    model = build()
    plan = dmuon.prepare(model, matrix_view={"moe.down.weight": "rows:2"},
                         ns=dmuon.NSConfig(method="standard", dtype=torch.float32))
    assert len(plan.infos) == 5  # three experts, two row groups
    opt = make_optimizer(model, plan)
    for step in range(STEPS):
        loss_of(model, batch(step, 0, 1)).backward()
        opt.step()
        opt.zero_grad()
    ref_model = build()
    experts, down = ref_model.moe.experts, ref_model.moe.down.weight
    half = down.shape[0] // 2
    matrices = [(f"expert{e}", experts, lambda t, e=e: t[e]) for e in range(3)] + [
        (f"group{g}", down, lambda t, g=g: t[g * half:(g + 1) * half]) for g in range(2)]
    ref, _, state = reference(ref_model, matrices, [batch(step, 0, 1) for step in range(STEPS)], loss_of)
    return model, opt, ref, state


def rule_reference(rule: str, **rule_kwargs):
    """:func:`reference_training` of ``rule`` at the one-process tests' settings, as
    :func:`one_process_experts` takes its ``reference``."""
    return lambda model, matrices, batches, loss_fn: reference_training(
        rule, model, matrices, batches, loss_fn, lr=0.02, adamw_kwargs=dict(lr=3e-3, weight_decay=0.01),
        **rule_kwargs)


def checked_mesh_runs(rule: str, world_size: int, slow: bool = False):
    """``rule``'s dmuon runs on ``world_size`` ranks (:func:`equivalence_cases`, bf16 left out; ``slow``: its
    slow cases), each
    checked against its float32 formula (parameters, losses, the rule's state) and for one NS per
    active matrix in the cluster; yields ``(label, case, out)`` for the rule's own checks."""
    from support.equivalence import N_MATRICES

    results = runs(world_size, slow)
    per_step_active = [N_MATRICES - 3 * len(SKIP.get(s, ())) for s in range(STEPS)]
    for label, case in equivalence_cases(world_size, slow).items():
        if case.rule != rule or case.bf16 or case.kind != "dmuon":
            continue
        out = results[0]["cases"][label]
        ref, ref_losses, ref_state = oddnet_reference(rule, world_size, case.clip)
        diff, worst = max_diff(out["params"], ref)
        assert diff <= 1e-5, f"{label}: {worst} differs by {diff:.3g}"
        assert out["losses"] == pytest.approx(ref_losses, rel=1e-5, abs=1e-6), label
        diff, worst = max_diff({n: v.reshape(-1) for n, v in out["rule_state"].items()}, ref_state)
        assert diff <= 1e-5, f"{label}: state of {worst} differs by {diff:.3g}"
        for step in range(STEPS):
            assert sum(r["cases"][label]["stats"][step]["orthogonalized"] for r in results) == per_step_active[step]
        yield label, case, out


class CountedRun(NamedTuple):
    """One of :data:`COUNTED`'s steady steps of a rule on 4 ranks and dmuon's exchange as the model
    prices it (what both rules' counted-bytes tests start from)."""

    results: list[dict]
    replicate: int
    shard: int
    shapes: list
    owners: list[int]
    blocks: list[int]
    waves: list
    modelled: list
    """:func:`owner_exchange_collectives`' backward and step lists, one after the other."""


def counted_run(rule: str, run: str) -> CountedRun:
    """``rule``'s counted step ``run`` (every block launched from backward) and its modelled exchange."""
    mesh_shape, ns_dtype, _, hsdp = COUNTED[run]
    results = [r["counted"][(rule, run)] for r in runs(4)]
    replicate, shard = mesh_shape or (1, 4)
    infos = results[0]["infos"]
    shapes, owners, blocks = [i[0] for i in infos], [i[1] for i in infos], [i[2] for i in infos]
    waves = results[0]["waves"]
    assert all(r["blocks_in_backward"] == r["blocks"] for r in results)
    backward, step = owner_exchange_collectives(shapes, owners, blocks, replicate, shard, ns_dtype.itemsize,
                                                waves=waves, gradient_bytes=4 if hsdp == "dmuon" else None)
    return CountedRun(results, replicate, shard, shapes, owners, blocks, waves, backward + step)
