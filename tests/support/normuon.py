"""NorMuon's single-process reference, written from the rule's formula, and the rank functions of
``tests/rules/test_normuon.py`` (each world size's runs in one process group: a spawn costs more than the work)."""

from __future__ import annotations

import functools
import math

import torch
from torch import nn

from dmuon.plan.selection import select_matrices
from dmuon.testing.reference import fp32_newton_schulz

from support.cases import MUON_KW, NORMUON_BETA2, Case, run_cases
from support.equivalence import SKIP, STEPS, all_ranks_batches  # block 1 unused at step 1: its matrices keep their state
from support.models import OddNet, lm_loss
from support.scenarios import run_grouped

KELLER = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's defaults, which the runs use: 5 steps, eps 1e-7
ADAMW_KW = dict(lr=3e-3, weight_decay=0.01)
SAVED_AT, MORE = 2, 2


def normuon_reference_training(model: nn.Module, matrices: list[tuple], batches: list,
                               loss_fn, *, lr: float, weight_decay: float, momentum: float, nesterov: bool,
                               beta2: float, adamw_kwargs: dict) -> tuple[dict, list[float], dict]:
    """One process: NorMuon on ``matrices`` (each as ``(shape[0], prod(shape[1:]))``), AdamW on the rest.

    ``matrices`` holds ``(name, param)`` pairs, or ``(name, param, part)`` where ``part`` takes the
    parameter (and its gradient) to the matrix the rule steps: an expert ``t[e]``, a row group.

    The rule, as the issue states it (fp32 throughout, fp32 NS)::

        M.lerp_(G, 1-mu); D = G.lerp(M, mu) if nesterov else M; O = NS(D)
        v.lerp_(O.square().mean(dim=-1, keepdim=True), 1-beta2)
        O2 = O / (v.sqrt() + 1e-10); O2 *= O.norm() / (O2.norm() + 1e-10)
        W.mul_(1 - lr*wd); W.add_(O2, alpha=-lr*sqrt(max(1, m/n)))

    A matrix without a gradient (an unused block) is left alone, state and weight.

    Returns:
        The final parameters, each step's loss and each matrix's second moment ``v`` (flat).
    """
    ids = {id(entry[1]) for entry in matrices}
    adamw = torch.optim.AdamW([p for p in model.parameters() if id(p) not in ids], **adamw_kwargs)
    momenta: dict[str, torch.Tensor] = {}
    seconds: dict[str, torch.Tensor] = {}
    losses = []
    for batch in batches:
        loss = loss_fn(model, batch)
        loss.backward()
        with torch.no_grad():
            for name, p, *part in matrices:
                if p.grad is None:
                    continue
                cut = part[0] if part else (lambda t: t)
                weight, grad = cut(p.data), cut(p.grad)
                m, n = weight.shape[0], weight[0].numel()
                g = grad.reshape(m, n).float()
                w = weight.view(m, n)
                buf = momenta.setdefault(name, torch.zeros(m, n))
                v = seconds.setdefault(name, torch.zeros(m, 1))
                buf.lerp_(g, 1 - momentum)
                d = g.lerp(buf, momentum) if nesterov else buf
                o = fp32_newton_schulz(d, KELLER, 5, 1e-7)
                v.lerp_(o.square().mean(dim=-1, keepdim=True), 1 - beta2)
                o2 = o / (v.sqrt() + 1e-10)
                o2 *= o.norm() / (o2.norm() + 1e-10)
                w.mul_(1 - lr * weight_decay)
                w.add_(o2, alpha=-lr * math.sqrt(max(1, m / n)))
        adamw.step()
        model.zero_grad(set_to_none=True)
        losses.append(loss.item())
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return params, losses, {n: v.reshape(-1).clone() for n, v in seconds.items()}


def oddnet_reference(world_size: int) -> tuple[dict, list[float], dict]:
    """OddNet (seed 0) on all ``world_size`` ranks' batches of ``STEPS`` steps, ``SKIP`` applied."""
    torch.manual_seed(0)
    model = OddNet()
    batches, loss_fn = all_ranks_batches(world_size)
    return normuon_reference_training(model, select_matrices(model), batches, loss_fn, **MUON_KW,
                                      beta2=NORMUON_BETA2, adamw_kwargs=ADAMW_KW)


def checkpoint_reference() -> dict:
    """OddNet trained without interruption on the checkpoint runs' global batches."""
    from support.checkpoint import global_batch

    torch.manual_seed(0)
    model = OddNet()
    batches = [global_batch(s) for s in range(SAVED_AT + MORE)]
    params, _, _ = normuon_reference_training(model, select_matrices(model), batches, lm_loss, **MUON_KW,
                                              beta2=NORMUON_BETA2, adamw_kwargs=ADAMW_KW)
    return params


def tp_reference(dp: int, steps: int) -> tuple[dict, dict]:
    """``support.tp``'s TPNet in one process under the formula: parameters and second moments."""
    from support.tp import ADAMW, MATRICES, MUON, TPNet, batch, loss_of

    torch.manual_seed(0)
    model = TPNet()
    named = dict(model.named_parameters())
    batches = [torch.cat([batch(step, d, dp) for d in range(dp)]) for step in range(steps)]
    params, _, seconds = normuon_reference_training(
        model, [(n, named[n]) for n in MATRICES], batches, loss_of, lr=MUON["lr"],
        weight_decay=MUON["weight_decay"], momentum=MUON["momentum"], nesterov=MUON["nesterov"],
        beta2=NORMUON_BETA2, adamw_kwargs=ADAMW)
    return params, seconds


# ----------------------------------------------------------------------------- rank functions

def equivalence_cases(world_size: int, slow: bool = False) -> dict[str, Case]:
    """The OddNet runs compared with the single-process reference (and the bf16 pair with each other),
    spread over the world sizes: each size runs the plain case, and one of them each other setting.
    The plain case on 4 ranks runs under ``-m slow`` only (``slow``: that case alone): the column-sharded
    case is 1-D on 4 ranks by default, the plain one on 2 and 3."""
    if slow:
        assert world_size == 4, world_size
        return {"zero3": Case(rule="normuon", steps=STEPS, skip=SKIP)}
    cases = {} if world_size == 4 else {"zero3": Case(rule="normuon", steps=STEPS, skip=SKIP)}
    if world_size == 2:
        cases["zero2, 4 return waves, no overlap"] = Case(rule="normuon", steps=STEPS, skip=SKIP, zero=2,
                                                          return_waves=4, overlap=False)
    if world_size == 3:
        cases["ns_in_backward"] = Case(rule="normuon", steps=STEPS, skip=SKIP, ns_in_backward=True)
        cases["gather oracle"] = Case(kind="gather", rule="normuon", steps=STEPS, skip=SKIP)
        cases["bf16 mixed precision"] = Case(rule="normuon", steps=STEPS, skip=SKIP, bf16=True)
        cases["bf16 mixed precision, gather oracle"] = Case(kind="gather", rule="normuon", steps=STEPS, skip=SKIP,
                                                            bf16=True)
    if world_size in (2, 4):
        # FSDP2 sharding two matrices by columns: every position holds all rows of them (a column box).
        cases["column-sharded"] = Case(rule="normuon", steps=STEPS, skip=SKIP,
                                       column_sharded=("layers.1.down.weight", "layers.2.down.weight"))
    if world_size == 4:
        cases["hsdp 2x2 (FSDP2's)"] = Case(rule="normuon", steps=STEPS, skip=SKIP, mesh_shape=(2, 2))
        cases["hsdp 2x2 (dmuon's replicate level)"] = Case(rule="normuon", steps=STEPS, skip=SKIP, mesh_shape=(2, 2),
                                                           hsdp="dmuon")
    return cases


COUNTED = {"1-D bf16 NS, 4 waves": (None, torch.bfloat16, 4, "fsdp2"),
           "hsdp 2x2 fp32": ((2, 2), torch.float32, None, "fsdp2"),
           "replicate level 2x2 bf16 NS": ((2, 2), torch.bfloat16, None, "dmuon")}
"""The 4-rank runs whose counted bytes are compared with the model: (mesh, NS dtype, return waves, hsdp)."""


def save_normuon(rank: int, world_size: int, path: str) -> None:
    """Trains NorMuon ``SAVED_AT`` steps on ``world_size`` ranks and saves a DCP checkpoint (torch's calls)."""
    from support.cases import sharded_oddnet
    from support.checkpoint import _train, save

    model, _, opt = sharded_oddnet(world_size, rule="normuon")
    _train(model, opt, rank, world_size, range(SAVED_AT))
    save(model, opt, path)


def resume_normuon(rank: int, world_size: int, path: str, mesh_shape=None, hsdp: str = "fsdp2") -> dict:
    """A fresh NorMuon model on this cluster resumes from ``path`` and trains ``MORE`` steps: its full
    parameters (rank 0) and the layout its second moments came back in."""
    from torch.distributed.tensor import DTensor

    from support.cases import full_params, sharded_oddnet
    from support.checkpoint import _train, load

    model, _, opt = sharded_oddnet(world_size, mesh_shape=mesh_shape, hsdp=hsdp, rule="normuon")
    load(model, opt, path)
    second = opt.state[model.layers[0].mid.weight]["second_momentum_buffer"]
    layout = (isinstance(second, DTensor), second.dtype, str(getattr(second, "placements", None)))
    _train(model, opt, rank, world_size, range(SAVED_AT, SAVED_AT + MORE))
    params = full_params(model)
    return {"params": params if rank == 0 else None, "layout": layout}


def normuon_runs(rank: int, world_size: int, directory: str, slow: bool = False) -> dict:
    """Every run of ``tests/rules/test_normuon.py`` on ``world_size`` ranks, in one process group
    (``slow``: the slow equivalence case alone).

    2 ranks save the checkpoint (``directory``) that 3 ranks (1-D) and 4 (dmuon's replicate level
    on 2x2) resume; 4 ranks also run TP (dp2 x tp2) against the reference and the oracle, and
    the counted-byte steps.
    """
    from support.step_comm import counted_step
    from support.tp import train

    cases = equivalence_cases(world_size, slow)
    out = {"cases": dict(zip(cases, run_cases(rank, world_size, list(cases.values()))))}
    if slow:
        return out
    # Each run on its own (support.scenarios): a run that raises fails only the tests reading it.
    path = f"{directory}/saved"
    if world_size == 2:
        scenarios = {("saved", "1-D"): functools.partial(save_normuon, rank, world_size, path)}
    elif world_size == 3:
        scenarios = {("resumed", "1-D"): functools.partial(resume_normuon, rank, world_size, path)}
    else:
        scenarios = {("resumed", "replicate level 2x2"): functools.partial(
            resume_normuon, rank, world_size, path, (2, 2), "dmuon")}
    if world_size == 4:
        for name, (mesh, dtype, waves, hsdp) in COUNTED.items():
            scenarios[("counted", name)] = functools.partial(counted_step, rank, world_size, mesh, dtype, 3, 2,
                                                             waves, hsdp, "normuon")
        for what in ("dmuon", "gather"):
            scenarios[("tp", what)] = functools.partial(train, rank, world_size, STEPS, (2, 2), what,
                                                        beta2=NORMUON_BETA2)
    return out | run_grouped(scenarios)
