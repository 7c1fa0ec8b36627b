"""DMuon built before ``fully_shard`` against DMuon built after it (run inside spawned ranks)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import dmuon
from dmuon.optim.groups import canonical_name

from support.cases import freeze, full_params, make_mesh, shard_oddnet
from support.models import OddNet, lm_loss, odd_batch

KW = dict(lr=0.02, adamw=dmuon.AdamWConfig(lr=3e-3), ns=dmuon.NSConfig(method="standard", dtype=torch.float32))


def _momenta(opt) -> dict[str, torch.Tensor]:
    """Every optimizer state tensor by parameter name and key, full (a collective for DTensors)."""
    names = {id(p): canonical_name(n) for n, p in opt.model.named_parameters()}
    out = {}
    for p, state in opt.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                out[f"{names[id(p)]}:{key}"] = (value.full_tensor() if isinstance(value, DTensor) else value).clone()
    return dict(sorted(out.items()))


def _groups(opt) -> list[dict]:
    """The param groups with the parameters as names (comparable across runs)."""
    names = {id(p): canonical_name(n) for n, p in opt.model.named_parameters()}
    return [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in g["params"]]}
            for g in opt.param_groups]


def train_built(rank: int, world_size: int, when: str, mesh_shape=None, hsdp: str = "fsdp2", steps: int = 3,
                micro_batches: int = 2, clip: float | None = 0.5, groups: str = "all", wrap: bool = False) -> dict:
    """OddNet (seed 0, a frozen block) with DMuon built ``when`` = ``"after"`` or ``"before"`` fully_shard,
    then ``steps`` steps with ``micro_batches`` (FSDP2's no-sync for all but the last) and clipping.

    ``groups="torch"``: torch-style groups (a weight-decay group of biases and norms, as the HF Trainer
    builds them) instead of all parameters. ``wrap``: each block put under torch's activation-checkpoint
    wrapper after the optimizer is built (as accelerate does before sharding; parameter names change). Returns (rank 0) the full parameters, momenta and param groups,
    and (every rank) when the optimizer was set up.
    """
    mesh = make_mesh(world_size, mesh_shape)
    torch.manual_seed(0)
    model = OddNet()
    freeze(model, ("layers.1.",))
    level = mesh_shape is not None and hsdp == "dmuon"
    kw = dict(KW, hsdp_mesh=mesh if level else None)

    def build():
        if groups == "all":
            return dmuon.DMuon(model, **kw)
        nodecay = [p for n, p in model.named_parameters() if p.requires_grad and (n.endswith("bias") or "norm" in n)]
        decay = [p for n, p in model.named_parameters() if p.requires_grad and not any(p is q for q in nodecay)]
        return dmuon.DMuon([{"params": decay, "weight_decay": 0.05}, {"params": nodecay, "weight_decay": 0.0}],
                           module=model, **kw)

    seen = []
    opt = build() if when == "before" else None
    if opt is not None:
        seen.append(("built", opt.is_set_up))
    if wrap:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for k, layer in enumerate(model.layers):
            model.layers[k] = checkpoint_wrapper(layer)
    shard_oddnet(model, mesh["shard"] if level else mesh)
    if opt is None:
        opt = build()
    for step in range(steps):
        tokens, targets = odd_batch(step, rank, batch=2 * micro_batches)
        for m in range(micro_batches):
            model.set_requires_gradient_sync(m == micro_batches - 1)
            part = (tokens[2 * m : 2 * m + 2], targets[2 * m : 2 * m + 2])
            (lm_loss(model, part) / micro_batches).backward()
            if step == 0 and m == 0:
                seen.append(("after the first backward", opt.is_set_up))
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    params, momenta, named_groups = full_params(model), _momenta(opt), _groups(opt)
    dist.barrier()
    return {"params": params, "momenta": momenta, "groups": named_groups, "seen": seen} if rank == 0 else \
        {"seen": seen}


def before_and_after(rank: int, world_size: int, mesh_shape=None, hsdp: str = "fsdp2", *rest) -> dict:
    """:func:`train_built` both ways in one process group (``rest``: its ``steps``, ``micro_batches``,
    ``clip``, ``groups``)."""
    return {when: train_built(rank, world_size, when, mesh_shape, hsdp, *rest) for when in ("after", "before")}


def unsharded_step(rank: int, world_size: int) -> str | None:
    """DMuon built before fully_shard, and a step without sharding: the error, on every rank."""
    torch.manual_seed(0)
    model = OddNet()
    opt = dmuon.DMuon(model, **KW)
    lm_loss(model, odd_batch(0, rank)).backward()
    try:
        opt.step()
    except ValueError as e:
        return str(e)
    return None
