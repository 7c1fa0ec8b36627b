"""The settings ported from other Muon libraries (issue #31): a small model with a fused GQA QKV, a
single-process reference written from the formulas (not from dmuon's code), and the distributed runs.

``PortNet``'s fused ``qkv`` has q, k and v rows ``QKV = (14, 8, 8)`` (7 query heads of 2 and 4 kv
heads of 2, GQA); FSDP2's row shards of its 30 rows end at 15 (2 ranks), 10 and 20 (3), 8, 16 and
24 (4), never where a group ends (14, 22). ``mlp.up`` is tall (20 x 8), ``mlp.down`` wide (8 x 20):
the unclamped ``sqrt(m/n)`` differs from torch's ``max(1, .)`` there.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

import dmuon

VOCAB, WIDTH, HIDDEN = 16, 8, 20
QKV = (14, 8, 8)
VIEWS = {"attn.qkv.weight": "rows:14,8,8"}
LR, WEIGHT_DECAY, MOMENTUM = 0.02, 0.2, 0.95
ADAMW = dict(lr=3e-3, weight_decay=0.01)
STEPS = 3

PORTED = dict(adjust_lr_fn="spectral_unclamped", extra_scale_factor=0.6, cautious_weight_decay=True)
"""Every ported rule setting at once (with ``ns_coefficients="polar_express_5"`` and the GQA row groups)."""

# modded-nanogpt's train_gpt.py table (commit f411b3d), typed here so the reference does not read dmuon's copy.
POLAR_EXPRESS_5 = [
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
]


class Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(WIDTH, sum(QKV), bias=False)
        self.out = nn.Linear(WIDTH, WIDTH, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).split(QKV, dim=-1)
        return self.out(torch.tanh(q[..., :WIDTH] * k + v) + q[..., WIDTH:].sum(-1, keepdim=True))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, HIDDEN)
        self.down = nn.Linear(HIDDEN, WIDTH, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x)))


class PortNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.attn = Attn()
        self.mlp = MLP()
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        x = x + self.attn(x)
        return self.head(x + self.mlp(x))


MATRICES = ["attn.qkv.weight", "attn.out.weight", "mlp.up.weight", "mlp.down.weight"]


def batch(step: int, rank: int, world: int, per_rank: int = 2, seq: int = 5) -> torch.Tensor:
    g = torch.Generator().manual_seed(2000 + step)
    tokens = torch.randint(0, VOCAB, (world * per_rank, seq + 1), generator=g)
    return tokens[rank * per_rank:(rank + 1) * per_rank]


def loss_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


# ------------------------------------------------------------------ the reference, from the formulas
SCALES = {
    None: lambda m, n: max(1.0, m / n) ** 0.5,
    "original": lambda m, n: max(1.0, m / n) ** 0.5,
    "match_rms_adamw": lambda m, n: 0.2 * max(m, n) ** 0.5,
    "spectral_unclamped": lambda m, n: (m / n) ** 0.5,  # torchtitan's; dion's "spectral_norm"
    "unscaled": lambda m, n: 1.0,
}


def orthogonalize(G: torch.Tensor, coefficients) -> torch.Tensor:
    """fp32 NS from the formulas: Keller's triple five times as torch.optim.Muon (divide by the norm,
    floored at eps = 1e-7), or modded-nanogpt's Polar Express (divide by 1.02 times the norm, then its
    five polynomials). Their ``+ 1e-6`` beside the norm is dmuon's floor instead (as torch's NS): on
    this model's small gradients (norms ~1e-2) that alone moves the result by ~3e-5."""
    X = G.float()
    if X.shape[0] > X.shape[1]:
        X = X.T
    if coefficients == "polar_express_5":
        X = X / (X.norm().clamp(min=1e-7) * 1.02)
        schedule = POLAR_EXPRESS_5
    else:
        X = X / X.norm().clamp(min=1e-7)
        schedule = [coefficients] * 5
    for a, b, c in schedule:
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if G.shape[0] > G.shape[1] else X


def formula_reference(model: nn.Module, batches: list[torch.Tensor], matrices: dict[str, tuple[int, ...] | None],
                      *, coefficients=(3.4445, -4.7750, 2.0315), adjust_lr_fn=None, extra_scale_factor=1.0,
                      cautious_weight_decay=False, lr=LR, weight_decay=WEIGHT_DECAY, momentum=MOMENTUM,
                      loss_fn=loss_of) -> dict[str, torch.Tensor]:
    """One process, one global batch per step: Muon written out on ``matrices`` (name -> row group sizes,
    None for one matrix), torch.optim.AdamW on the rest. Per group of rows: Nesterov momentum, NS, the
    shape scale of the group times ``extra_scale_factor``; then for the whole weight
    ``p - lr wd mask p - lr U`` with ``mask = [sign(p) sign(U) >= 0]`` (cautious) or 1."""
    named = dict(model.named_parameters())
    buffers = {n: torch.zeros_like(named[n]) for n in matrices}
    adamw = torch.optim.AdamW([p for n, p in named.items() if n not in matrices], **ADAMW)
    for tokens in batches:
        loss_fn(model, tokens).backward()
        with torch.no_grad():
            for name, sizes in matrices.items():
                p, grad, buf = named[name], named[name].grad, buffers[name]
                buf.mul_(momentum).add_(grad, alpha=1 - momentum)
                direction = (grad * (1 - momentum) + buf * momentum).reshape(p.shape[0], -1)
                parts = []
                for rows in direction.split(list(sizes or (p.shape[0],))):
                    scale = SCALES[adjust_lr_fn](*rows.shape) * extra_scale_factor
                    parts.append(orthogonalize(rows, coefficients) * scale)
                update = torch.cat(parts).view(p.shape)
                mask = (torch.sign(p) * torch.sign(update) >= 0).float() if cautious_weight_decay else 1.0
                p.sub_(lr * weight_decay * mask * p + lr * update)
        adamw.step()
        model.zero_grad(set_to_none=True)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def portnet_reference(world: int, steps: int = STEPS, *, rows: bool = True, **rule) -> dict[str, torch.Tensor]:
    """:func:`formula_reference` on PortNet (seed 0) over every rank's batch (``rows``: QKV's row groups)."""
    torch.manual_seed(0)
    model = PortNet()
    matrices = {n: (QKV if rows and n == "attn.qkv.weight" else None) for n in MATRICES}
    batches = [torch.cat([batch(s, r, world) for r in range(world)]) for s in range(steps)]
    return formula_reference(model, batches, matrices, **rule)


# ---------------------------------------------------------------------------------- the runs
def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def build(world: int, *, kind: str = "dmuon", mesh_shape=None, hsdp: str = "fsdp2", bf16: bool = False,
          coefficients="polar_express_5", views=VIEWS, **rule):
    """PortNet (seed 0) under FSDP2 (each block, then the root; HSDP on ``mesh_shape``) with DMuon or the
    gather oracle, fp32 NS. Returns ``(model, optimizer, plan)``."""
    mesh = init_device_mesh("cpu", (world,)) if mesh_shape is None else \
        init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard"))
    dmuon_level = mesh_shape is not None and hsdp == "dmuon"
    torch.manual_seed(0)
    model = PortNet()
    kw = dict(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)) if bf16 else {}
    for block in (model.attn, model.mlp):
        fully_shard(block, mesh=mesh["shard"] if dmuon_level else mesh, **kw)
    fully_shard(model, mesh=mesh["shard"] if dmuon_level else mesh, **kw)
    settings = dict(lr=LR, weight_decay=WEIGHT_DECAY, momentum=MOMENTUM, **rule)
    if kind == "dmuon":
        ns = dmuon.NSConfig(method="standard", dtype=torch.float32, coefficients=coefficients)
        plan = dmuon.prepare(model, matrix_view=views, ns=ns, hsdp_mesh=mesh if dmuon_level else None)
        return model, dmuon.DMuon(model, plan, adamw=ADAMW, **settings), plan
    from dmuon.baselines import GatherThenCompute

    opt = GatherThenCompute(model, ns_method="standard", ns_dtype=torch.float32, ns_coefficients=coefficients,
                            matrix_view=views, adamw_lr=ADAMW["lr"], adamw_weight_decay=ADAMW["weight_decay"],
                            **settings)
    return model, opt, None


def train(model, opt, rank: int, world: int, steps=range(STEPS)) -> dict:
    stats = {}
    for step in steps:
        loss_of(model, batch(step, rank, world)).backward()
        opt.step()
        opt.zero_grad()
        stats = opt.last_step_stats()
    return {"params": {n: full(p) for n, p in model.named_parameters()}, "stats": stats}


def run(rank: int, world: int, **kw) -> dict:
    model, opt, plan = build(world, **kw)
    out = train(model, opt, rank, world)
    if plan is not None:
        out["plan"] = [(i.name, tuple(i.shape), i.owner, i.pieces) for i in plan.infos]
    return out


def resume(rank: int, world: int, path: str) -> dict:
    """torch's DCP calls: train 2 steps with :data:`PORTED`, save, train 1 more; a fresh optimizer built
    with the default rule settings loads the checkpoint (its groups then hold the saved ones) and trains
    the same step."""
    from torch.distributed import checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict, get_optimizer_state_dict, set_model_state_dict, set_optimizer_state_dict,
    )

    model, opt, _ = build(world, **PORTED)
    train(model, opt, rank, world, range(2))
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=path)
    continued = train(model, opt, rank, world, range(2, 3))["params"]
    model, opt, _ = build(world)
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    loaded = [{k: g[k] for k in PORTED} for g in opt.param_groups if g["algorithm"] == "muon"]
    resumed = train(model, opt, rank, world, range(2, 3))["params"]
    return {"continued": continued, "resumed": resumed, "loaded": loaded}


TP_VIEWS = {"layers.0.up.weight": "rows:4,6"}
"""support.tp's colwise ``up`` (10 rows: TP's 5 + 5, FSDP2's 3 + 2 inside each) in two groups cut inside a shard."""


def run_tp(rank: int, world: int) -> dict:
    """support.tp's TPNet on a (dp, tp) = (2, 2) mesh with :data:`PORTED`, Polar Express 5 and :data:`TP_VIEWS`."""
    from support import tp

    mesh, dp_mesh, dp_rank = tp.tp_mesh(world, (2, 2))
    torch.manual_seed(0)
    model = tp.TPNet()
    tp.parallelize(model, mesh, dp_mesh)
    ns = dmuon.NSConfig(method="standard", dtype=torch.float32, coefficients="polar_express_5")
    plan = dmuon.prepare(model, matrix_view=TP_VIEWS, ns=ns)
    opt = dmuon.DMuon(model, plan, lr=LR, weight_decay=WEIGHT_DECAY, momentum=MOMENTUM, adamw=ADAMW, **PORTED)
    for step in range(STEPS):
        tp.loss_of(model, tp.batch(step, dp_rank, 2)).backward()
        opt.step()
        opt.zero_grad()
    return {"params": {n: full(p) for n, p in model.named_parameters()},
            "plan": [(i.name, tuple(i.shape), i.pieces) for i in plan.infos]}


def tp_reference() -> dict[str, torch.Tensor]:
    from support import tp

    torch.manual_seed(0)
    model = tp.TPNet()
    matrices = {n: ((4, 6) if n in TP_VIEWS else None) for n in tp.MATRICES}
    batches = [torch.cat([tp.batch(s, d, 2) for d in range(2)]) for s in range(STEPS)]
    return formula_reference(model, batches, matrices, coefficients="polar_express_5", loss_fn=tp.loss_of, **PORTED)
