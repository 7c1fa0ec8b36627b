"""DMuon's torch.optim conventions where they meet the ranks (2 gloo ranks, FSDP2): a tensor learning rate
with a momentum-cycling scheduler, a set-up optimizer's copy (refused by name: FSDP2 does not copy its
modules), and GradScaler's unscale (ShardedGradScaler with an inf on one rank: skipped on both), each against
torch's pair (torch.optim.Muon + AdamW, one scheduler each) in one process on all ranks' batches."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

import dmuon
from support.cases import full_params, sharded_oddnet
from support.equivalence import max_diff
from support.models import OddNet, lm_loss, odd_batch
from support.reference import ns_precision
from support.spawn import run_distributed
from dmuon.plan.selection import select_matrices

WORLD = 2
STEPS = 4
LR, ADAMW_LR = 0.02, 3e-3
SKIPPED = 2
"""The step whose gradients hold an inf on rank 0 only (the sharded GradScaler case)."""


def _schedulers(opts: list, max_lrs: list) -> list:
    return [torch.optim.lr_scheduler.OneCycleLR(o, max_lr=m, total_steps=STEPS + 1) for o, m in zip(opts, max_lrs)]


def _ranks(rank: int, world_size: int, how: str) -> dict | None:
    model, _, opt = sharded_oddnet(world_size, lr=torch.tensor(LR), adamw=dmuon.AdamWConfig(lr=torch.tensor(ADAMW_LR)))
    # One value per DMuon group: its Muon half, then its AdamW half.
    scheduler = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[LR, ADAMW_LR], total_steps=STEPS + 1)
    scaler = None
    if how == "grad scaler":
        scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    elif how == "sharded grad scaler, inf on one rank":
        scaler = ShardedGradScaler("cpu", init_scale=256.0)
    for step in range(STEPS):
        loss = lm_loss(model, odd_batch(step, rank))
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            if step == SKIPPED and rank == 0 and isinstance(scaler, ShardedGradScaler):
                next(p for p in model.parameters() if p.grad is not None).grad.to_local().view(-1)[0] = float("inf")
            scaler.unscale_(opt)
            scaler.step(opt)  # skipped on every rank alike: ShardedGradScaler agrees on the infs
            scaler.update()
        opt.zero_grad()
        scheduler.step()
        if how == "deepcopy" and step == 1:
            # FSDP2 does not copy its modules, and a copy of DMuon steps a copy of its model: refused by
            # name, the original going on untouched.
            with pytest.raises(TypeError, match="DMuon on a sharded model cannot be copied or pickled.*state dicts"):
                copy.deepcopy(opt)
            with pytest.raises(TypeError, match="cannot be copied or pickled"):
                pickle.dumps(opt)
    dist.barrier()
    params = full_params(model)
    return {"params": params} if rank == 0 else None


def _reference(skipped: int | None = None) -> dict[str, torch.Tensor]:
    """torch's pair in one process on all ranks' batches, with a tensor lr and one OneCycleLR each."""
    torch.manual_seed(0)
    model = OddNet()
    matrices = select_matrices(model)
    ids = {id(p) for _, p in matrices}
    views = [(p, torch.nn.Parameter(p.data.view(p.shape[0], -1)) if p.ndim > 2 else p) for _, p in matrices]
    muon = torch.optim.Muon([v for _, v in views], lr=torch.tensor(LR), weight_decay=0.1, momentum=0.95,
                            nesterov=True)
    adamw = torch.optim.AdamW([p for p in model.parameters() if id(p) not in ids], lr=torch.tensor(ADAMW_LR),
                              weight_decay=0.01)
    schedulers = _schedulers([muon, adamw], [LR, ADAMW_LR])
    for step in range(STEPS):
        parts = [odd_batch(step, r) for r in range(WORLD)]
        lm_loss(model, (torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]))).backward()
        for p, v in views:
            if v is not p:
                v.grad = p.grad.view(v.shape)
        if step != skipped:
            with ns_precision(torch.float32):
                muon.step()
            adamw.step()
        model.zero_grad(set_to_none=True)
        for _, v in views:
            v.grad = None
        for s in schedulers:
            s.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("how", ["plain", "grad scaler", "sharded grad scaler, inf on one rank", "deepcopy"])
def test_tensor_lr_and_one_cycle_on_two_ranks_match_torch_pair(how):
    result = run_distributed(_ranks, WORLD, how)[0]
    diff, where = max_diff(result["params"], _reference(SKIPPED if "inf" in how else None))
    assert diff <= 1e-5, f"{how}: {where} differs by {diff}"


FROZEN = "layers.1.mid.weight"
"""A matrix frozen when the optimizer is built, unfrozen and added with add_param_group later."""


def _unfrozen_ranks(rank: int, world_size: int, added: int) -> dict | None:
    from support.cases import freeze, make_mesh, shard_oddnet

    mesh = make_mesh(world_size, None)
    torch.manual_seed(0)
    model = OddNet()
    freeze(model, (FROZEN,))
    if added != 0:
        shard_oddnet(model, mesh, zero=3)
    opt = dmuon.DMuon([p for p in model.parameters() if p.requires_grad], module=model, lr=LR,
                      adamw=dmuon.AdamWConfig(lr=ADAMW_LR), ns=dmuon.NSConfig(method="standard", dtype=torch.float32))
    if added == 0:
        # Built before fully_shard (as frameworks do), the weight added before the setup: the groups are
        # split again by the selection on the model as it is, and the plan follows on the sharded model.
        weight = dict(model.named_parameters())[FROZEN]
        weight.requires_grad_(True)
        opt.add_param_group({"params": [weight]})
        assert not opt.is_set_up and opt.param_groups[-1]["algorithm"] == "muon"
        shard_oddnet(model, mesh, zero=3)
    for step in range(STEPS):
        if step == added and step != 0:
            weight = dict(model.named_parameters())[FROZEN]
            weight.requires_grad_(True)
            opt.add_param_group({"params": [weight]})  # the plan is made again: on every rank
            assert opt.param_groups[-1]["algorithm"] == "muon"
        lm_loss(model, odd_batch(step, rank)).backward()
        opt.step()
        opt.zero_grad()
    params = full_params(model)
    return {"params": params} if rank == 0 else None


def _unfrozen_reference(added: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = OddNet()
    model.get_parameter(FROZEN).requires_grad_(False)
    matrices = [(n, p) for n, p in select_matrices(model) if p.requires_grad]
    views = {n: (p, torch.nn.Parameter(p.data.view(p.shape[0], -1)) if p.ndim > 2 else p) for n, p in
             list(matrices) + [(FROZEN, model.get_parameter(FROZEN))]}
    muon = torch.optim.Muon([views[n][1] for n, _ in matrices], lr=LR, weight_decay=0.1, momentum=0.95, nesterov=True)
    ids = {id(p) for _, p in matrices} | {id(model.get_parameter(FROZEN))}
    adamw = torch.optim.AdamW([p for p in model.parameters() if id(p) not in ids], lr=ADAMW_LR, weight_decay=0.01)
    for step in range(STEPS):
        if step == added:
            model.get_parameter(FROZEN).requires_grad_(True)
            muon.add_param_group({"params": [views[FROZEN][1]]})
        parts = [odd_batch(step, r) for r in range(WORLD)]
        lm_loss(model, (torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]))).backward()
        for p, v in views.values():
            if v is not p:
                v.grad = None if p.grad is None else p.grad.view(v.shape)
        with ns_precision(torch.float32):
            muon.step()
        adamw.step()
        model.zero_grad(set_to_none=True)
        for _, v in views.values():
            v.grad = None
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("added", [0, 2], ids=["before sharding", "after 2 steps"])
def test_a_matrix_unfrozen_and_added_later_goes_to_muon_on_two_ranks(added):
    result = run_distributed(_unfrozen_ranks, WORLD, added)[0]
    diff, where = max_diff(result["params"], _unfrozen_reference(added))
    assert diff <= 1e-5, f"{where} differs by {diff}"
