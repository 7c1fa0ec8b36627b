"""The configurations the bench compares, each built the way its users would build it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import parallelize_module

import dmuon
from dmuon.baselines import GatherThenCompute
from dmuon.bench.models.tp_plan import block_tp_plan
from dmuon.plan.selection import select_matrices

CONFIGS = ("adamw", "torch_muon", "gather", "dmuon_z2", "dmuon_z3")
"""The default side-by-side set."""
EXTRA_CONFIGS = ("adamw_z2", "dmuon_z2_sync", "dmuon_z3_sync", "dmuon_z2_nsbwd", "dmuon_z3_nsbwd", "adamw_local",
                 "dmuon_z3_event", "dmuon_z2_native", "dmuon_z3_native", "adamw_clip", "dmuon_z2_clip",
                 "dmuon_z3_clip", "dmuon_z2_clip_refresh", "dmuon_z3_clip_refresh", "dmuon_z2_normuon",
                 "dmuon_z3_normuon", "dmuon_z2_muonh", "dmuon_z2_dion2", "dmuon_z2_rbwd", "dmuon_z3_rbwd",
                 "dmuon_z2_nfwd", "dmuon_z3_nfwd", "dmuon_z3_muonh_nfwd", "ddp_adamw", "ddp_torch_muon",
                 "ddp_dmuon")
"""``adamw_z2``: FSDP2 + torch.optim.AdamW with ``reshard_after_forward=False``,
the like-for-like reference for ``dmuon_z2``; dmuon with ``overlap=False``
(every collective inside ``step()``), with ``ns_in_backward=True`` (owners
start NS while backward runs) and, ``*_rbwd``, with ``returns_in_backward=True`` too (the updates
of the blocks launched first come back while backward runs; its ``hop_a_spread`` then defaults to 1,
the setting it is meant with); ``adamw_local``: FSDP2 + AdamW on each rank's
local shards, the kernel dmuon runs for its non-matrix parameters (``DMuon``
with no Muon matrices), a stricter AdamW reference than ``torch.optim.AdamW``'s
per-parameter DTensor dispatch; ``dmuon_z3_event``: ``post_optim_event=True`` (accelerators only:
the next forward's all-gathers wait on an event recorded after the last update).

On an HSDP mesh (``--hsdp R``) every dmuon configuration uses dmuon's replicate level
(FSDP2 over the shard dim, ``hsdp_mesh=``: dmuon reduces across replicas), except
``dmuon_z2_native``/``dmuon_z3_native``: FSDP2's native HSDP (its all-reduce) with dmuon on top.
On a 1-D mesh the ``_native`` configurations are the plain ones.

``adamw_clip``, ``dmuon_z2_clip``, ``dmuon_z3_clip``: ``torch.nn.utils.clip_grad_norm_`` on every
parameter between backward and ``step()`` (timed with the optimizer), with a ``max_norm``
(:data:`CLIP_MAX_NORM`) below every gradient norm of the bench's models, so it rescales on every step.
``dmuon_z2_clip_refresh``, ``dmuon_z3_clip_refresh``: the same with ``clipped_overlap=False`` (no owner
momentum copies: every clipped block is exchanged again in ``step()``), the reference for what the
copies buy.

``dmuon_z2_normuon``, ``dmuon_z3_normuon``: :class:`dmuon.NorMuon` (its default ``beta2``) in place of
``DMuon``, otherwise ``dmuon_z2``/``dmuon_z3``: what NorMuon's per-row state and owner-side
normalization cost.

``dmuon_z2_muonh``, ``dmuon_z2_dion2``: :class:`dmuon.MuonH` (no weight decay, its one weight-norm
all-gather a step) and :class:`dmuon.Dion2` (its defaults: a quarter of the rows orthogonalized) in
place of ``DMuon``, otherwise ``dmuon_z2``.

``dmuon_z2_nfwd``, ``dmuon_z3_nfwd``: ``apply_updates="next_forward"`` (the updates applied in the next
forward, unit by unit; the step is timed to its return, the applies fall in the next forward). Its gain
needs an accelerator whose streams overlap the publication with the forward, across nodes; on CPU ranks
it is a regression guard. ``dmuon_z3_muonh_nfwd``: the same with :class:`dmuon.MuonH` (its weight norms
added in ``step()`` behind each return).

``ddp_adamw``, ``ddp_torch_muon``, ``ddp_dmuon``: torch's ``DistributedDataParallel`` over every rank (no
FSDP2; the mesh is not used), with torch.optim.AdamW, with torch.optim.Muon + AdamW (every rank runs every
NS) and with :class:`dmuon.DMuon` given the DDP model (each matrix's NS on its owner, the updates
all-gathered: :mod:`dmuon.runtime.ddp`)."""
CLIP_MAX_NORM = 1e-3
"""The ``_clip`` configurations' ``max_norm``: the bench's gradient norms are far above it."""
ALL_CONFIGS = CONFIGS + EXTRA_CONFIGS
DDP_CONFIGS = ("ddp_adamw", "ddp_torch_muon", "ddp_dmuon", "dmuon_z2")
"""``dmuon bench --ddp``'s default set: torch's DDP three ways, and "DDP with dmuon" (``dmuon_z2`` on the
``(N, 1)`` mesh with ``hsdp_mesh``)."""
MUON_CONFIGS = ("torch_muon", "gather", "ddp_torch_muon", "ddp_dmuon") + tuple(c for c in ALL_CONFIGS
                                                                             if c.startswith("dmuon"))
SWEPT_BALANCERS = ("round_robin", "lpt", "milp")
"""What ``--balancer all`` runs each dmuon configuration with (as ``dmuon_z2@lpt`` etc.)."""


def clip_norm(config: str) -> float | None:
    """The ``max_norm`` ``config`` clips with before each step, or None."""
    base = config.partition("@")[0]
    return CLIP_MAX_NORM if base.endswith("_clip") or base.endswith("_clip_refresh") else None


def is_muon_config(config: str) -> bool:
    """Whether ``config`` (possibly ``dmuon_*@balancer``) runs a Muon update."""
    return config.partition("@")[0] in MUON_CONFIGS


def reshard_after_forward(config: str) -> bool:
    """The ``reshard_after_forward`` of ``config``'s blocks (the root: :func:`shard_root`).

    ZeRO-2 configurations (``adamw_z2``, ``dmuon_z2*``) keep the gathered weights
    from forward to backward (False); everything else keeps FSDP2's default
    (True: gathered again in backward, ZeRO-3 style).

    Raises:
        ValueError: For an unknown configuration name.
    """
    base = config.partition("@")[0]
    if base not in ALL_CONFIGS:
        raise ValueError(f"config must be one of {ALL_CONFIGS}, got {config!r}")
    return not (base == "adamw_z2" or base.startswith("dmuon_z2"))


@dataclass
class Hyper:
    """Optimizer settings shared by every configuration."""

    lr: float = 0.02
    """Muon learning rate."""
    adamw_lr: float = 3e-4
    """AdamW learning rate (AdamW-only config uses it for every parameter)."""
    ns_dtype: torch.dtype = torch.bfloat16
    """NS dtype for dmuon and gather (torch.optim.Muon always iterates in bf16)."""
    ns_method: str = "auto"
    """dmuon/gather NS method."""
    balancer: str = "greedy"
    """dmuon owner balancer (a ``dmuon_*@NAME`` config overrides it)."""
    profile: bool = False
    """dmuon: assign owners with measured, batch-aware costs (``prepare(profile=True)``)."""
    loopback: bool = False
    """dmuon: ``ExecutionConfig(loopback_collectives=True)``, one rank's exchanges as real collectives
    (``dmuon bench --gpu-check``)."""


class _Pair:
    """Steps two torch optimizers as one (what torch users write for Muon + AdamW)."""

    def __init__(self, *opts: torch.optim.Optimizer) -> None:
        self.opts = opts

    def step(self) -> None:
        for o in self.opts:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.opts:
            o.zero_grad(set_to_none=set_to_none)

    def last_step_stats(self) -> dict[str, Any]:
        return {}


def dp_mesh(mesh):
    """The data-parallel part of a mesh with a ``"tp"`` dim (the mesh itself without one)."""
    names = mesh.mesh_dim_names or ()
    if "tp" not in names:
        return mesh
    dp = tuple(n for n in names if n != "tp")
    return mesh[dp] if len(dp) > 1 else mesh[dp[0]]


def uses_replicate_level(config: str, mesh) -> bool:
    """Whether ``config`` on ``mesh`` runs dmuon's replicate level (an HSDP mesh, a dmuon configuration
    that is not ``_native``)."""
    base = config.partition("@")[0]
    return "replicate" in (mesh.mesh_dim_names or ()) and base.startswith("dmuon_z") and not base.endswith("_native")


def shard_workload(workload, mesh, reshard: bool, replicate_level: bool = False) -> None:
    """``fully_shard`` each block, then the root (:func:`shard_root`), as FSDP2 users do (the same for every
    optimizer).

    On a mesh with a ``"tp"`` dim, torch's ``parallelize_module`` first splits each
    block by the workload's TP plan; FSDP2 then shards over the other dims (with
    ``replicate_level``, over the shard dim only: dmuon reduces across the replicas).

    Raises:
        ValueError: A ``"tp"`` dim that does not divide a block's attention heads.
    """
    if "tp" in (mesh.mesh_dim_names or ()):
        tp = mesh["tp"]
        for block in workload.blocks:
            parallelize_module(block, tp, block_tp_plan(block, tp.size()))
    mesh = mesh["shard"] if replicate_level else dp_mesh(mesh)
    for block in workload.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    shard_root(workload.model, mesh, reshard)


def shard_root(model, mesh, reshard: bool) -> None:
    """``fully_shard`` of the root as FSDP2 users write it: ZeRO-3 leaves ``reshard_after_forward`` at
    FSDP2's default, ZeRO-2 passes False.

    Either way the root's own parameters (the embedding and the head, the largest unit) stay gathered
    from forward to backward: its backward runs first, right after forward, so resharding it would only
    gather it again. torch 2.13 keeps the root gathered only when the argument is left unset
    (``FSDPState._lazy_init`` clears the root's post-forward mesh when ``reshard_after_forward`` was not
    given); an explicit True reshards it and re-gathers it at the start of backward. The step model
    (:func:`dmuon.costmodel.collectives.step_collectives`: no backward all-gather of its ``root_block``)
    and the bench's byte count (:func:`dmuon.bench.runner._fsdp_bytes_per_step`) assume the former.
    """
    if reshard:
        fully_shard(model, mesh=mesh)
    else:
        fully_shard(model, mesh=mesh, reshard_after_forward=False)


def _pair_of(model, hyper: Hyper, names: set[str]) -> _Pair:
    """torch.optim.Muon on the 2-D Muon matrices ``names``, AdamW on the rest (conv kernels included: torch's
    Muon takes 2-D parameters only, what its users have to do)."""
    mats = [p for n, p in model.named_parameters() if n in names and p.ndim == 2]
    rest = [p for n, p in model.named_parameters() if not (n in names and p.ndim == 2)]
    return _Pair(torch.optim.Muon(mats, lr=hyper.lr, weight_decay=0.1),
                 torch.optim.AdamW(rest, lr=hyper.adamw_lr, weight_decay=0.01))


def _under_ddp(config: str, workload, hyper: Hyper):
    """``workload.model`` wrapped in torch's ``DistributedDataParallel`` (the workload then holds the wrapper:
    the forward goes through it) with ``config``'s optimizer; ``(optimizer, plan)``."""
    from torch.nn.parallel import DistributedDataParallel

    inner = workload.model
    workload.model = DistributedDataParallel(inner)
    if config == "ddp_adamw":
        return torch.optim.AdamW(inner.parameters(), lr=hyper.adamw_lr, weight_decay=0.01), None
    if config == "ddp_torch_muon":
        return _pair_of(inner, hyper, {n for n, _ in select_matrices(inner)}), None
    ns = dmuon.NSConfig(method=hyper.ns_method, dtype=hyper.ns_dtype)
    plan = dmuon.prepare(workload.model, balancer=hyper.balancer, profile=hyper.profile, ns=ns)
    return dmuon.DMuon(workload.model, plan, lr=hyper.lr, adamw=dmuon.AdamWConfig(lr=hyper.adamw_lr), ns=ns), plan


def build(config: str, workload, mesh, hyper: Hyper):
    """Shards ``workload.model`` for ``config`` and returns ``(optimizer, plan)``.

    Every configuration shards the whole model with FSDP2 (Muon matrices
    included), with :func:`reshard_after_forward` of the configuration; dmuon
    plans from the sharded model (``dmuon.prepare`` after ``fully_shard``).

    Raises:
        ValueError: For an unknown configuration name.
    """
    model = workload.model
    reshard = reshard_after_forward(config)
    base, _, balancer = config.partition("@")
    if balancer and not base.startswith("dmuon_z"):
        raise ValueError(f"only dmuon configurations take a balancer (dmuon_*@NAME), got {config!r}")
    if base.startswith("ddp_"):
        return _under_ddp(base, workload, hyper)
    if config in ("adamw", "adamw_z2", "adamw_clip"):
        shard_workload(workload, mesh, reshard)
        return torch.optim.AdamW(model.parameters(), lr=hyper.adamw_lr, weight_decay=0.01), None
    if config == "torch_muon":
        # Selected before sharding (FSDP2 swaps the parameters for DTensors), the pair built after.
        names = {n for n, _ in select_matrices(model)}
        shard_workload(workload, mesh, reshard)
        return _pair_of(model, hyper, names), None
    ns = dmuon.NSConfig(method=hyper.ns_method, dtype=hyper.ns_dtype)
    kw = dict(lr=hyper.lr, adamw=dmuon.AdamWConfig(lr=hyper.adamw_lr))
    replicate_level = uses_replicate_level(config, mesh)
    shard_workload(workload, mesh, reshard, replicate_level)
    if config == "adamw_local":
        plan = dmuon.prepare(model, select=lambda name, param: False)
        # DMuon's AdamW defaults are the adamw config's (weight decay 0.01, betas, eps).
        return dmuon.DMuon(model, plan, ns=ns, **kw), plan
    if config == "gather":
        return GatherThenCompute(model, lr=hyper.lr, adamw_lr=hyper.adamw_lr, ns_dtype=hyper.ns_dtype,
                                 ns_method=hyper.ns_method), None
    # Planned (and with --profile measured) with the NS the optimizer runs.
    plan = dmuon.prepare(model, balancer=balancer or hyper.balancer, profile=hyper.profile, ns=ns,
                         hsdp_mesh=mesh if replicate_level else None)
    words = base.split("_")
    rule = next((r for word, r in (("normuon", dmuon.NorMuon), ("muonh", dmuon.MuonH), ("dion2", dmuon.Dion2))
                 if word in words), dmuon.DMuon)
    in_backward = base.endswith("_rbwd")
    execution = dmuon.ExecutionConfig(overlap=not base.endswith("_sync"),
                                      ns_in_backward=base.endswith("_nsbwd") or in_backward,
                                      returns_in_backward=in_backward,
                                      post_optim_event=base.endswith("_event"),
                                      apply_updates="next_forward" if "nfwd" in words else "in_step",
                                      clipped_overlap=not base.endswith("_refresh"),
                                      loopback_collectives=hyper.loopback)
    return rule(model, plan, execution=execution, **kw), plan
