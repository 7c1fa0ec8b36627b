"""Distributed training cases shared by the tests (run inside spawned ranks)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

import dmuon
from dmuon.baselines import GatherThenCompute

from support.models import OddNet, lm_loss, odd_batch
from support.scenarios import run_listed


@dataclass
class Case:
    """One distributed training run on :class:`OddNet`."""

    kind: str = "dmuon"
    """``"dmuon"`` or ``"gather"`` (gather-then-compute on the same FSDP2 model: the oracle)."""
    zero: int = 3
    """3: ``reshard_after_forward=True``; 2: ``False`` (every block; FSDP2's own switch)."""
    ns_dtype: torch.dtype = torch.float32
    """NS iteration dtype."""
    steps: int = 3
    """Optimizer steps."""
    skip: dict[int, set[int]] = field(default_factory=dict)
    """step -> blocks left out of that step's forward (on every rank)."""
    batch_sizes: dict[int, int] = field(default_factory=dict)
    """step -> samples per rank that step (default 2; the same on every rank)."""
    lr: float = 0.02
    adamw_lr: float = 3e-3
    balancer: str = "greedy"
    ns_method: str = "standard"
    overlap: bool = True
    """DMuon's overlap mode."""
    clipped_overlap: bool = True
    """``ExecutionConfig.clipped_overlap``: owners keep the momentum, launches survive clipping."""
    clip: float | None = None
    """``torch.nn.utils.clip_grad_norm_`` on all parameters before each step."""
    mesh_shape: tuple[int, int] | None = None
    """``(replicate, shard)`` for HSDP; None for a 1-D mesh over all ranks."""
    ns_in_backward: bool = False
    """DMuon's ``ns_in_backward``."""
    returns_in_backward: bool = False
    apply_updates: str = "in_step"
    """``ExecutionConfig.apply_updates``; the run flushes the updates before reading the parameters."""
    """``ExecutionConfig.returns_in_backward`` (with ``ns_in_backward``)."""
    hop_a_spread: int | None = 8
    """``ExecutionConfig.hop_a_spread`` (dmuon's replicate level; None: its default, 1 with returns in backward)."""
    return_waves: int | None = None
    """DMuon's ``return_waves`` (None: its default, 1 on CPU)."""
    activation_checkpointing: str | None = None
    """OddNet's ``checkpoint`` mode (``"early_stop"``, ``"full"``, ``"reentrant"``; None: off)."""
    bf16: bool = False
    """``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`` on every fully_shard."""
    frozen: tuple[str, ...] = ()
    """Parameter-name prefixes with ``requires_grad=False``."""
    micro_batches: int = 1
    """Gradient accumulation: earlier micro-batches under ``set_requires_gradient_sync(False)``."""
    micro_sync: bool = False
    """Accumulation with FSDP2 reducing every micro-batch (no ``set_requires_gradient_sync(False)``)."""
    compile: bool = False
    """``torch.compile`` each block after ``fully_shard`` (backend ``aot_eager``: no C++ toolchain needed)."""
    column_sharded: tuple[str, ...] = ()
    """Parameters FSDP2 shards by columns (``shard_placement_fn`` giving ``Shard(1)``)."""
    hsdp: str = "fsdp2"
    """On a ``mesh_shape``: ``"fsdp2"`` (fully_shard over the 2-D mesh: FSDP2's native HSDP) or
    ``"dmuon"`` (fully_shard over ``mesh["shard"]`` and ``hsdp_mesh=mesh``: dmuon's replicate level)."""
    clip_with: str = "torch"
    """``"torch"`` (``torch.nn.utils.clip_grad_norm_``), ``"dmuon"`` (``DMuon.clip_grad_norm_``) or
    ``"value"`` (``torch.nn.utils.clip_grad_value_`` at ``clip``: an edit that is no one factor)."""
    clip_steps: tuple[int, ...] | None = None
    """The steps that clip (None: every step)."""
    nonfinite: str | None = None
    """DMuon's ``nonfinite``."""
    rule: str = "muon"
    """The matrices' rule: ``"muon"`` (``DMuon``), ``"normuon"`` (``NorMuon`` with
    ``NORMUON_BETA2``; the gather oracle runs the same rule), ``"muonh"`` or ``"dion2"``
    (:func:`rule_optimizer`; no gather oracle)."""


MUON_KW = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True)
NORMUON_BETA2 = 0.9
"""Not NorMuon's default (0.95): a run that ignored the keyword would not match its reference."""
DION2_KW = dict(fraction=0.3, ef_decay=0.9, weight_decay=0.05)
"""Not Dion2's defaults (0.25, 0.95, 0.01): a run that ignored a keyword would not match its reference."""


def rule_optimizer(rule: str, model, plan, **kw):
    """The optimizer of ``rule`` (:attr:`Case.rule`) with the tests' settings, ``kw`` DMuon's keywords
    (MuonH: ``weight_decay`` dropped, it has none; Dion2: :data:`DION2_KW` under ``kw``)."""
    if rule == "normuon":
        return dmuon.NorMuon(model, plan, **({"beta2": NORMUON_BETA2} | kw))
    if rule == "muonh":
        kw.pop("weight_decay", None)
        return dmuon.MuonH(model, plan, **kw)
    if rule == "dion2":
        return dmuon.Dion2(model, plan, **(DION2_KW | kw))
    assert rule == "muon", rule
    return dmuon.DMuon(model, plan, **kw)


def oracle_rule(rule: str) -> dict:
    """The gather-then-compute oracle's keywords for the rule :func:`rule_optimizer` builds."""
    if rule == "normuon":
        return {"beta2": NORMUON_BETA2}
    if rule == "muonh":
        return {"rule": "muonh", "weight_decay": 0.0}
    if rule == "dion2":
        return {"rule": "dion2", "adjust_lr_fn": "spectral_unclamped", **DION2_KW}
    assert rule == "muon", rule
    return {}


def make_mesh(world_size: int, mesh_shape: tuple[int, int] | None = None):
    """A 1-D CPU mesh over every rank, or a ``(replicate, shard)`` HSDP mesh."""
    if mesh_shape is None:
        return init_device_mesh("cpu", (world_size,))
    return init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard"))


def freeze(model: torch.nn.Module, prefixes: tuple[str, ...]) -> None:
    """``requires_grad=False`` on every parameter whose name starts with one of ``prefixes``."""
    for name, p in model.named_parameters():
        if name.startswith(prefixes):
            p.requires_grad_(False)


def shard_oddnet(model: OddNet, mesh, *, zero: int = 3, bf16: bool = False, compile: bool = False,
                 column_sharded: tuple[str, ...] = ()) -> None:
    """``fully_shard`` each block, then the root, as a training script does for AdamW
    (``column_sharded``: these parameters by columns, through FSDP2's ``shard_placement_fn``)."""
    kw = {"reshard_after_forward": zero == 3}
    if column_sharded:
        by_columns = {id(p) for n, p in model.named_parameters() if n in column_sharded}
        kw["shard_placement_fn"] = lambda p: Shard(1) if id(p) in by_columns else None
    if bf16:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, **kw)
        if compile:
            layer.compile(backend="aot_eager")
    fully_shard(model, mesh=mesh, **kw)


def sharded_oddnet(world_size: int, *, zero: int = 3, mesh_shape=None, balancer: str = "greedy",
                   bf16: bool = False, frozen: tuple[str, ...] = (), compile: bool = False,
                   column_sharded: tuple[str, ...] = (), hsdp: str = "fsdp2", rule: str = "muon", blocks: int = 3,
                   ns_method: str = "standard", ns_dtype: torch.dtype = torch.float32, **dmuon_kwargs):
    """OddNet (seed 0) under FSDP2 + dmuon; the plan's NS ``ns_method`` in ``ns_dtype``; ``dmuon_kwargs``
    the optimizer's keywords over ``lr=0.02, adamw=AdamWConfig(lr=3e-3)`` (``hsdp``, ``rule``: as
    :attr:`Case.hsdp`, :attr:`Case.rule`; ``blocks``: OddNet's).

    Returns:
        ``(model, plan, optimizer)``.
    """
    mesh = make_mesh(world_size, mesh_shape)
    torch.manual_seed(0)
    model = OddNet(blocks=blocks)
    freeze(model, frozen)
    dmuon_level = mesh_shape is not None and hsdp == "dmuon"
    shard_oddnet(model, mesh["shard"] if dmuon_level else mesh, zero=zero, bf16=bf16, compile=compile,
                 column_sharded=column_sharded)
    kw = dict(lr=0.02, adamw=dmuon.AdamWConfig(lr=3e-3)) | dmuon_kwargs
    plan = dmuon.prepare(model, balancer=balancer, hsdp_mesh=mesh if dmuon_level else None,
                         ns=dmuon.NSConfig(method=ns_method, dtype=ns_dtype))
    return model, plan, rule_optimizer(rule, model, plan, **kw)


def full_params(model) -> dict[str, torch.Tensor]:
    """Every parameter's full value, on every rank (a collective for DTensors)."""
    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for name, p in model.named_parameters()}


def run_case(rank: int, world_size: int, case: Case) -> dict:
    """Trains OddNet under FSDP2 with dmuon (or the gather oracle) and reports everything."""
    if case.kind == "dmuon":
        model, plan, opt = sharded_oddnet(world_size, zero=case.zero, mesh_shape=case.mesh_shape,
                                          balancer=case.balancer, bf16=case.bf16, frozen=case.frozen,
                                          compile=case.compile, column_sharded=case.column_sharded,
                                          hsdp=case.hsdp, rule=case.rule,
                                          execution=dmuon.ExecutionConfig(
                                              overlap=case.overlap, clipped_overlap=case.clipped_overlap,
                                              ns_in_backward=case.ns_in_backward, return_waves=case.return_waves,
                                              returns_in_backward=case.returns_in_backward,
                                              hop_a_spread=case.hop_a_spread,
                                              nonfinite=case.nonfinite, apply_updates=case.apply_updates),
                                          lr=case.lr, adamw=dmuon.AdamWConfig(lr=case.adamw_lr),
                                          ns_dtype=case.ns_dtype, ns_method=case.ns_method)
    else:
        mesh = make_mesh(world_size, case.mesh_shape)
        torch.manual_seed(0)
        model, plan = OddNet(), None
        freeze(model, case.frozen)
        shard_oddnet(model, mesh, zero=case.zero, bf16=case.bf16, compile=case.compile,
                     column_sharded=case.column_sharded)
        opt = GatherThenCompute(model, lr=case.lr, adamw_lr=case.adamw_lr, ns_dtype=case.ns_dtype,
                                ns_method=case.ns_method, **oracle_rule(case.rule))
    model.checkpoint = case.activation_checkpointing
    losses, stats, norms = [], [], []
    for step in range(case.steps):
        model.skip = case.skip.get(step, set())
        tokens, targets = odd_batch(step, rank, batch=case.batch_sizes.get(step, 2) * case.micro_batches)
        per = tokens.shape[0] // case.micro_batches
        total = torch.zeros(())
        for m in range(case.micro_batches):
            model.set_requires_gradient_sync(case.micro_sync or m == case.micro_batches - 1)
            part = (tokens[m * per : (m + 1) * per], targets[m * per : (m + 1) * per])
            loss = lm_loss(model, part) / case.micro_batches
            loss.backward()
            total += loss.detach().float()
        if case.clip is not None and (case.clip_steps is None or step in case.clip_steps):
            if case.clip_with == "value":
                torch.nn.utils.clip_grad_value_(model.parameters(), case.clip)
                norms.append(float("nan"))
            elif case.clip_with == "dmuon":
                norms.append(opt.clip_grad_norm_(case.clip).item())
            else:
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), case.clip)
                norms.append((norm.full_tensor() if isinstance(norm, DTensor) else norm).item())
        opt.step()
        opt.zero_grad()
        dist.all_reduce(total)
        losses.append(total.item() / world_size)
        stats.append(opt.last_step_stats())
    if case.kind == "dmuon":
        opt.flush_updates()  # apply_updates="next_forward": the last step's updates, no forward after it
    params = full_params(model)
    state_numel = {n: (opt.state[p]["momentum_buffer"].to_local().numel() if "momentum_buffer" in opt.state[p] else 0)
                   for n, p in model.named_parameters() if p in opt.state}
    # NorMuon: each matrix's second moment, whole (a collective for DTensors), and this rank's share.
    seconds = {n: opt.state[p]["second_momentum_buffer"] for n, p in model.named_parameters()
               if p in opt.state and "second_momentum_buffer" in opt.state[p]}
    second_moments = {n: (v.full_tensor() if isinstance(v, DTensor) else v).reshape(-1).clone()
                      for n, v in seconds.items()}
    # MuonH: each matrix parameter's radii; Dion2: its error-feedback buffer, whole (collectives).
    rule_state = {}
    if case.rule in ("muonh", "dion2"):
        key = "initial_norm" if case.rule == "muonh" else "momentum_buffer"
        for n, p in model.named_parameters():
            if p in opt.state and key in opt.state[p]:
                v = opt.state[p][key]
                rule_state[n] = (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
    return {
        "params": params if rank == 0 else None,
        "rule_state": rule_state if rank == 0 else None,
        "losses": losses,
        "norms": norms,
        "stats": stats,
        "owners": {i.name: i.owner for i in plan.infos} if plan else None,
        "shapes": {i.name: i.shape for i in plan.infos} if plan else None,
        "momentum_numel": state_numel,
        "second_moments": second_moments if rank == 0 else None,
        "second_moment_numel": {n: (v.to_local() if isinstance(v, DTensor) else v).numel()
                                for n, v in seconds.items()},
        "state_keys": sorted(n for n, p in model.named_parameters() if p in opt.state and "momentum_buffer" in opt.state[p]),
    }


def run_cases(rank: int, world_size: int, cases: list[Case]) -> list[dict]:
    """:func:`run_case` for each of ``cases`` in turn, in one spawned run; a case that raised gives a
    :class:`~support.scenarios.ScenarioFailed` (its error text), which fails only the test reading it."""
    return run_listed([functools.partial(run_case, rank, world_size, c) for c in cases])
