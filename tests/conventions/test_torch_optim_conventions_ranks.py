"""DMuon's torch.optim conventions where they meet the ranks (2 gloo ranks, FSDP2): a tensor learning rate
with a momentum-cycling scheduler, a set-up optimizer's copy (refused by name: FSDP2 does not copy its
modules), and GradScaler's unscale (ShardedGradScaler with an inf on one rank: skipped on both), each against
torch's pair (torch.optim.Muon + AdamW, one scheduler each) in one process on all ranks' batches; and fp16
training as people write it (fp16 autocast or FSDP2's fp16 MixedPrecisionPolicy, a loss scale that overflows,
unscale_, torch's clip) with ShardedGradScaler on FSDP2 and torch's GradScaler on torch's DistributedDataParallel,
against torch's pair with torch's GradScaler in one process."""

from __future__ import annotations

import copy
import functools
import pickle

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

import dmuon
from support.cases import full_params, sharded_oddnet
from support.equivalence import max_diff
from support.models import OddNet, lm_loss, odd_batch
from support.reference import ns_precision, torch_pair
from support.scenarios import run_each, succeeded
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
    pair = torch_pair(model, dict(lr=torch.tensor(LR), weight_decay=0.1, momentum=0.95, nesterov=True),
                      dict(lr=torch.tensor(ADAMW_LR), weight_decay=0.01))
    schedulers = _schedulers([pair.muon, pair.adamw], [LR, ADAMW_LR])
    for step in range(STEPS):
        parts = [odd_batch(step, r) for r in range(WORLD)]
        lm_loss(model, (torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]))).backward()
        pair.hand_grads()
        if step != skipped:
            pair.step(torch.float32)
        pair.zero_grad()
        for s in schedulers:
            s.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


HOWS = ("plain", "grad scaler", "sharded grad scaler, inf on one rank", "deepcopy")


def _every_how(rank: int, world_size: int) -> dict:
    """:func:`_ranks` for each of :data:`HOWS` in one process group, each with its own result or error."""
    return run_each({how: functools.partial(_ranks, rank, world_size, how) for how in HOWS})


@functools.cache
def _tensor_lr_runs() -> dict:
    return run_distributed(_every_how, WORLD)[0]


@pytest.mark.parametrize("how", HOWS)
def test_tensor_lr_and_one_cycle_on_two_ranks_match_torch_pair(how):
    result = succeeded(_tensor_lr_runs()[how])
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


def _every_unfrozen(rank: int, world_size: int) -> dict:
    """:func:`_unfrozen_ranks` added before sharding and after 2 steps, in one process group."""
    return run_each({added: functools.partial(_unfrozen_ranks, rank, world_size, added) for added in (0, 2)})


@functools.cache
def _unfrozen_runs() -> dict:
    return run_distributed(_every_unfrozen, WORLD)[0]


@pytest.mark.parametrize("added", [0, 2], ids=["before sharding", "after 2 steps"])
def test_a_matrix_unfrozen_and_added_later_goes_to_muon_on_two_ranks(added):
    result = succeeded(_unfrozen_runs()[added])
    diff, where = max_diff(result["params"], _unfrozen_reference(added))
    assert diff <= 1e-5, f"{where} differs by {diff}"


FP16_STEPS = 7
FP16_SCALER = dict(init_scale=2.0 ** 18, growth_interval=2)
"""A loss scale at which the first step's fp16 backward overflows (its gradients reach inf: skipped, the scale
halved), doubled after every two good steps, which overflows again at step 3: each route sees an overflow at
the start and one after good steps, and good steps after each."""
FP16_OVERFLOWS = (0, 3)
"""The steps whose fp16 backward overflows at :data:`FP16_SCALER`'s scales (on both routes)."""
FP16_CLIP = 1.0  # below every good step's norm here: the clip acts on each
LAUNCHES = 4
"""OddNet's units with Muon matrices (three blocks and the root): the launches from each FSDP2 backward."""


def _fp16_trained(model, opt, scaler, rank: int, module, autocast: bool = True) -> dict:
    """fp16 training as people write it: the forward under fp16 autocast (``autocast``; else the model's own
    fp16 weights), the scaled loss's backward,
    ``unscale_``, torch's ``clip_grad_norm_``, ``scaler.step``, ``scaler.update``. Returns the weights each
    step started from and the last step's (``module``'s, whole on every rank), the scales, the clip's norms,
    the stats."""
    weights, scales, norms, stats = [full_params(module)], [], [], []
    for step in range(FP16_STEPS):
        with torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
            loss = lm_loss(model, odd_batch(step, rank))
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), FP16_CLIP).item())
        scaler.step(opt)  # skipped where a gradient is inf or NaN
        scaler.update()
        scales.append(scaler.get_scale())
        stats.append(opt.last_step_stats())  # a skipped step's are the last step's: read at good steps only
        opt.zero_grad()
        weights.append(full_params(module))
    return {"weights": weights, "scales": scales, "norms": norms, "stats": stats}


def _fp16_fsdp2(rank: int, world_size: int) -> dict:
    model, _, opt = sharded_oddnet(world_size)  # fp32 NS, clipped_overlap (the default)
    return _fp16_trained(model, opt, ShardedGradScaler("cpu", **FP16_SCALER), rank, model)


def _fp16_params_fsdp2(rank: int, world_size: int) -> dict:
    """FSDP2's own fp16: ``MixedPrecisionPolicy(param_dtype=float16, reduce_dtype=float32)`` (the root's
    output in float32, for the loss), no autocast."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from support.cases import make_mesh

    mesh = make_mesh(world_size)
    torch.manual_seed(0)
    model = OddNet()
    policy = dict(param_dtype=torch.float16, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=MixedPrecisionPolicy(**policy))
    fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(**policy, output_dtype=torch.float32))
    opt = dmuon.DMuon(model, lr=LR, adamw=dmuon.AdamWConfig(lr=ADAMW_LR),
                      ns=dmuon.NSConfig(method="standard", dtype=torch.float32))
    return _fp16_trained(model, opt, ShardedGradScaler("cpu", **FP16_SCALER), rank, model, autocast=False)


def _fp16_ddp(rank: int, world_size: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    ddp = DDP(OddNet())
    opt = dmuon.DMuon(ddp, lr=LR, adamw=dmuon.AdamWConfig(lr=ADAMW_LR),
                      ns=dmuon.NSConfig(method="standard", dtype=torch.float32))
    # DDP's gradients are the same on every rank: each rank's own GradScaler finds the same infs.
    return _fp16_trained(ddp, opt, torch.amp.GradScaler("cpu", **FP16_SCALER), rank, ddp.module)


class _Recorded(torch.optim.SGD):
    """SGD at lr 0 (no collective, no change) that records whether a scaler called its ``step()``."""

    def __init__(self, params) -> None:
        super().__init__(params, lr=0.0)
        self.stepped = False

    def step(self, closure=None):
        self.stepped = True
        return super().step(closure)


def _scalers_steps(rank: int, world_size: int) -> dict:
    """Whether each scaler steps on this rank when rank 0's gradient shards hold an inf (FSDP2, no DMuon)."""
    from support.cases import make_mesh, shard_oddnet

    torch.manual_seed(0)
    model = OddNet()
    shard_oddnet(model, make_mesh(world_size))
    stepped = {}
    scalers = {"GradScaler": torch.amp.GradScaler("cpu"), "ShardedGradScaler": ShardedGradScaler("cpu")}
    for name, scaler in scalers.items():
        opt = _Recorded(model.parameters())
        scaler.scale(lm_loss(model, odd_batch(0, rank))).backward()
        if rank == 0:
            next(p for p in model.parameters() if p.grad is not None).grad.to_local().view(-1)[0] = float("inf")
        scaler.step(opt)
        scaler.update()
        stepped[name] = opt.stepped
        opt.zero_grad()
    return stepped


def _fp16_on_ranks(rank: int, world_size: int) -> dict:
    return run_each({"fsdp2": lambda: _fp16_fsdp2(rank, world_size), "ddp": lambda: _fp16_ddp(rank, world_size),
                     "fsdp2 fp16 params": lambda: _fp16_params_fsdp2(rank, world_size),
                     "scalers": lambda: _scalers_steps(rank, world_size)})


@functools.cache
def _fp16_runs() -> list[dict]:
    return run_distributed(_fp16_on_ranks, WORLD, timeout_s=300)


def _fp16_reference(starts: list[dict[str, torch.Tensor]], params_in_fp16: bool = False) -> dict:
    """torch's pair with torch's GradScaler in one process, each step from the weights ``starts[step]``.

    The global batch goes through as the ranks' batches, each loss scaled and backpropagated as its rank
    does (fp16 autocast), the gradients summed and halved: FSDP2's and DDP's mean of two ranks, exact in
    fp32. An fp16 backward overflows on a rank's loss where it would not on the global batch's mean (its
    gradients inside backward are twice as large), so the scales agree only this way. torch's scaler
    steps each optimizer of the pair on its own infs; DMuon is one optimizer, so a step with an inf
    anywhere is skipped for both here, and the scaler's update halves the scale (checked).

    ``params_in_fp16``: FSDP2's ``MixedPrecisionPolicy(param_dtype=float16, reduce_dtype=float32)`` instead of
    autocast: the forward and backward on a float16 copy of the weights (the logits cast to float32, as the
    root's ``output_dtype`` does), each batch's gradients cast to float32 before they are summed."""
    torch.manual_seed(0)
    model = OddNet()
    pair = torch_pair(model, dict(lr=LR, weight_decay=0.1, momentum=0.95, nesterov=True),
                      dict(lr=ADAMW_LR, weight_decay=0.01))
    muon, adamw = pair.muon, pair.adamw
    scaler = torch.amp.GradScaler("cpu", **FP16_SCALER)
    half = copy.deepcopy(model).half() if params_in_fp16 else None
    assert max_diff(full_params(model), starts[0])[0] == 0  # the same initial weights, bit for bit
    ends, scales, norms, skipped = [], [], [], []
    for step in range(FP16_STEPS):
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(starts[step][name])  # the ranks' weights; the optimizers' states are the pair's own
                if half is not None:
                    half.get_parameter(name).copy_(p)
        for r in range(WORLD):
            if half is None:
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = lm_loss(model, odd_batch(step, r))
                scaler.scale(loss).backward()
                continue
            scaler.scale(lm_loss(lambda tokens: half(tokens).float(), odd_batch(step, r))).backward()
            for p, h in zip(model.parameters(), half.parameters()):
                p.grad = h.grad.float() if p.grad is None else p.grad.add_(h.grad.float())
                h.grad = None
        for p in model.parameters():
            p.grad.div_(WORLD)
        pair.hand_grads()
        scaler.unscale_(muon)
        scaler.unscale_(adamw)
        overflow = not all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), FP16_CLIP).item())
        scale = scaler.get_scale()
        if not overflow:
            with ns_precision(torch.float32):
                scaler.step(muon)
            scaler.step(adamw)
        scaler.update()
        assert overflow == (scaler.get_scale() == scale * 0.5), step  # torch's scaler halves at an inf only
        ends.append(full_params(model))
        scales.append(scaler.get_scale())
        skipped.append(overflow)
        pair.zero_grad()
    return {"ends": ends, "scales": scales, "norms": norms, "skipped": skipped}


@pytest.mark.parametrize("route", ["fsdp2", "ddp", "fsdp2 fp16 params"])
def test_fp16_autocast_with_a_grad_scaler_on_two_ranks_steps_as_torch_pair(route):
    """fp16 autocast (or FSDP2's fp16 ``MixedPrecisionPolicy``), a loss scale that overflows at the start and after
    good steps, ``unscale_``, torch's clip: FSDP2 with ShardedGradScaler, DDP with torch's GradScaler. Every rank
    skips the overflowing steps (its weights unchanged, bit for bit), the scales are torch's scaler's in one
    process on the same steps, and each good step gives torch's pair's weights.

    Each step is compared from the same weights: the ranks' weights before it are loaded into the reference.
    Both then run the same fp16 forward and backward on the same values (a rank's batch is one of the
    reference's, the mean over two ranks is its halved sum, exact), so the gradients agree up to the clip's
    coefficient, whose norm the ranks sum in another order (its last bit); what is left is fp32 NS across
    ranks: the project's 1e-5. Both optimizers' states stay their own, so a momentum gone wrong shows at the
    next steps. Run freely instead, the two part after the first good step by as much as torch's pair does
    from itself with each weight moved by one fp32 ulp (about 1e-4 after one more step, measured on this
    model: the next fp16 forward rounds a few weights the other way and NS magnifies the gradient's smallest
    directions), where no tolerance could tell a bug from rounding."""
    results = [succeeded(r[route]) for r in _fp16_runs()]
    ref = _fp16_reference(results[0]["weights"], params_in_fp16=route == "fsdp2 fp16 params")
    assert ref["skipped"] == [step in FP16_OVERFLOWS for step in range(FP16_STEPS)], ref["skipped"]
    for rank, result in enumerate(results):
        assert result["scales"] == ref["scales"], rank
        weights = result["weights"]
        assert all(max_diff(w, v)[0] == 0 for w, v in zip(weights, results[0]["weights"])), rank
        for step, skipped in enumerate(ref["skipped"]):
            if skipped:
                assert max_diff(weights[step + 1], weights[step])[0] == 0, (rank, step)
                continue
            diff, where = max_diff(weights[step + 1], ref["ends"][step])
            assert diff <= 1e-5, f"{route}, step {step}: {where} differs by {diff}"
            assert result["norms"][step] == pytest.approx(ref["norms"][step], rel=1e-6), (rank, step)


@pytest.mark.parametrize("route", ["fsdp2", "fsdp2 fp16 params"])
def test_fp16_grad_scalers_unscale_on_fsdp2_is_kept_as_a_clip(route):
    """``unscale_`` (and the clip) scale every gradient by one factor after backward sent its directions: with
    ``clipped_overlap`` the owners form the directions from the launched ones, from the second good step that
    follows a good one (the first such step exchanges again and sends the owners the momentum, as a first
    clip does). A step after a skipped one exchanges again: its backward launched nothing (the skipped
    step's launches, never stepped, stand for its discarded gradients)."""
    results = [succeeded(r[route]) for r in _fp16_runs()]
    # Steps: 0 skipped, 1 after a skip, 2 the first good after a good one, 3 skipped, 4 after a skip, 5, 6.
    assert FP16_OVERFLOWS == (0, 3)
    for result in results:
        kept = [(s["blocks_exchanged_in_backward"], s["rescaled_launches"]) for s in result["stats"]]
        assert [kept[k] for k in (1, 2, 4)] == [(0, 0)] * 3, kept
        assert [kept[k] for k in (5, 6)] == [(LAUNCHES, LAUNCHES)] * 2, kept


def test_fp16_grad_scalers_unscale_under_ddp_costs_nothing():
    """Under DDP nothing is launched in backward: every good step, the first, those after a skip and those
    after ``unscale_`` alike, sends the same bytes and keeps no launch."""
    for result in (succeeded(r["ddp"]) for r in _fp16_runs()):
        good = [s for k, s in enumerate(result["stats"]) if k not in FP16_OVERFLOWS]
        assert {(s["blocks_exchanged_in_backward"], s["rescaled_launches"]) for s in good} == {(0, 0)}
        assert len({s["bytes_sent"] for s in good}) == 1 and good[0]["bytes_sent"] > 0


def test_on_fsdp2_both_grad_scalers_skip_on_every_rank():
    """An inf in rank 0's gradient shards only: torch's GradScaler skips ``step()`` on both ranks too, as
    ShardedGradScaler (which all-reduces what it found) does: DTensor's dispatch of the scaler's inf check
    (``_amp_foreach_non_finite_check_and_unscale_``) reduces its ``found_inf`` over the gradients' mesh. Were
    it the rank's own, rank 1 would call ``step()`` alone and wait there in DMuon's collectives."""
    stepped = [succeeded(r["scalers"]) for r in _fp16_runs()]
    assert [s["GradScaler"] for s in stepped] == [False, False]
    assert [s["ShardedGradScaler"] for s in stepped] == [False, False]
