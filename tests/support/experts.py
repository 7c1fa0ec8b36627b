"""A small model with a stack of experts (grouped-GEMM layout) and its per-expert reference."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import dmuon

from support.cases import make_mesh
from support.reference import ns_precision

VOCAB, WIDTH, HIDDEN = 17, 6, 10


class Experts(nn.Module):
    """A stack of ``experts`` (E, HIDDEN, WIDTH), token ``t`` routed to expert ``t % E``, then a 2-D matrix."""

    def __init__(self, experts: int) -> None:
        super().__init__()
        self.experts = nn.Parameter(torch.randn(experts, HIDDEN, WIDTH) / WIDTH ** 0.5)
        self.down = nn.Linear(HIDDEN, WIDTH, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        stack = self.experts
        if isinstance(stack, DTensor):
            # Expert parallelism without a token all-to-all: every rank of the ep group reads the
            # same tokens and gathers the stack (backward hands each rank its experts' gradient).
            stack = stack.redistribute(stack.device_mesh, [Replicate()] * stack.device_mesh.ndim).to_local()
        route = torch.arange(x.shape[1]) % stack.shape[0]
        h = torch.stack([x[:, t] @ stack[int(e)].T for t, e in enumerate(route)], dim=1)
        return self.down(torch.tanh(h))


class ExpertNet(nn.Module):
    """Embedding -> :class:`Experts` (residual) -> head."""

    def __init__(self, experts: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.moe = Experts(experts)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)  # (B, T, WIDTH)
        return self.head(x + self.moe(x))


def batch(step: int, rank: int, world: int, per_rank: int = 2, seq: int = 5) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (world * per_rank, seq + 1), generator=g)
    return tokens[rank * per_rank:(rank + 1) * per_rank]


def loss_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


MUON = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True, ns_steps=5)
ADAMW = dict(lr=3e-3, weight_decay=0.01)


def _run(model: nn.Module, opt, data_rank: int, data_world: int, steps: int,
         clip: float | None = None) -> dict[str, torch.Tensor]:
    """``steps`` training steps on data-parallel rank ``data_rank``'s batches (``clip``: torch's
    ``clip_grad_norm_`` before each step); every parameter's full value."""
    for step in range(steps):
        loss_of(model, batch(step, data_rank, data_world)).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    if hasattr(opt, "flush_updates"):
        opt.flush_updates()  # apply_updates="next_forward": the last step's updates
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}


def _muon_on_slices(model: nn.Module, slices: list[nn.Parameter], slice_grads, matrices: list[nn.Parameter],
                    rest: list[nn.Parameter], world: int, steps: int) -> dict[str, torch.Tensor]:
    """torch.optim.Muon (fp32 NS) on ``slices`` (views sharing a parameter's storage, their gradients
    ``slice_grads()`` cut from its gradient each step) and ``matrices``, torch.optim.AdamW on ``rest``."""
    muon = torch.optim.Muon(slices + matrices, **MUON)
    adamw = torch.optim.AdamW(rest, **ADAMW)
    for step in range(steps):
        loss_of(model, torch.cat([batch(step, r, world) for r in range(world)])).backward()
        for part, grad in zip(slices, slice_grads()):
            part.grad = grad.clone()
        with ns_precision(torch.float32):
            muon.step()
        adamw.step()
        for p in [*slices, *model.parameters()]:
            p.grad = None
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def reference(world: int, steps: int, experts: int = 3, view: str = "stack") -> dict[str, torch.Tensor]:
    """One process: torch.optim.Muon on each expert's ``(HIDDEN, WIDTH)`` slice (``view="stack"``) or on
    the stack flattened to ``(E, HIDDEN * WIDTH)`` (``"flatten"``), plus torch.optim.AdamW."""
    torch.manual_seed(0)
    model = ExpertNet(experts)
    stack = model.moe.experts
    if view == "stack":
        mats = [nn.Parameter(stack.data[e]) for e in range(experts)]  # views sharing the storage
    else:
        mats = [nn.Parameter(stack.data.view(experts, -1))]
    rest = [p for n, p in model.named_parameters() if n not in ("moe.experts", "moe.down.weight")]

    def grads():
        return [stack.grad[e] for e in range(experts)] if view == "stack" else [stack.grad.view(experts, -1)]

    return _muon_on_slices(model, mats, grads, [model.moe.down.weight], rest, world, steps)


def train(rank: int, world: int, steps: int, experts: int = 3, mesh_shape=None, view: str | None = None,
          return_waves: int | None = None, hsdp: str = "fsdp2", clip: float | None = None,
          overlap: bool = True, apply_updates: str = "in_step", rule: str = "muon") -> dict:
    """FSDP2 (the MoE block, then the root) + DMuon with fp32 NS; every parameter's full value and the plan
    (``hsdp="dmuon"`` on a ``mesh_shape``: FSDP2 over the shard dim, dmuon's replicate level). ``rule``:
    another optimizer of :func:`support.cases.rule_optimizer`."""
    from support.cases import rule_optimizer

    torch.manual_seed(0)
    model = ExpertNet(experts)
    hsdp_mesh = None
    if world > 1:
        mesh = make_mesh(world, mesh_shape)
        if mesh_shape is not None and hsdp == "dmuon":
            mesh, hsdp_mesh = mesh["shard"], mesh
        fully_shard(model.moe, mesh=mesh)
        fully_shard(model, mesh=mesh)
    views = None if view is None else {"moe.experts": view}
    plan = dmuon.prepare(model, matrix_view=views, ns=dmuon.NSConfig(method="standard", dtype=torch.float32),
                         hsdp_mesh=hsdp_mesh)
    opt = rule_optimizer(rule, model, plan, lr=MUON["lr"], weight_decay=MUON["weight_decay"],
                         adamw=ADAMW | {"betas": (0.9, 0.999)},
                         execution=dmuon.ExecutionConfig(return_waves=return_waves, overlap=overlap,
                                                         apply_updates=apply_updates))
    params = _run(model, opt, rank, world, steps, clip)
    momentum = opt.state[model.moe.experts]["momentum_buffer"]
    return {"params": params, "names": [i.name for i in plan.infos], "owners": [i.owner for i in plan.infos],
            "momentum_numel": momentum.to_local().numel() if isinstance(momentum, DTensor) else momentum.numel(),
            "orthogonalized": opt.last_step_stats()["orthogonalized"],
            "launches": (opt.last_step_stats()["blocks_exchanged_in_backward"],
                         opt.last_step_stats()["rescaled_launches"])}


def train_gather(rank: int, world: int, steps: int, experts: int = 3, mesh_shape=None) -> dict:
    """The same FSDP2 model under gather-then-compute (the oracle), fp32 NS."""
    from dmuon.baselines import GatherThenCompute

    torch.manual_seed(0)
    model = ExpertNet(experts)
    mesh = make_mesh(world, mesh_shape)
    fully_shard(model.moe, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = GatherThenCompute(model, lr=MUON["lr"], weight_decay=MUON["weight_decay"], ns_method="standard",
                            ns_dtype=torch.float32, adamw_lr=ADAMW["lr"], adamw_weight_decay=ADAMW["weight_decay"])
    return _run(model, opt, rank, world, steps)


def train_expert_parallel(rank: int, world: int, steps: int, experts: int = 3, ep: int = 2) -> dict:
    """The stack split over an ``ep`` mesh dim (``Shard(0)``: whole experts), FSDP2 over ``dp``
    (``_StridedShard(0)`` inside the ep split) + DMuon with fp32 NS; the ep ranks of one dp rank
    read the same batch. Every parameter's full value, the stack's pieces and the plan."""
    mesh = init_device_mesh("cpu", (world // ep, ep), mesh_dim_names=("dp", "ep"))
    torch.manual_seed(0)
    model = ExpertNet(experts)
    model.moe.experts = nn.Parameter(distribute_tensor(model.moe.experts.data, mesh["ep"], [Shard(0)]))
    fully_shard(model.moe, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    plan = dmuon.prepare(model, ns=dmuon.NSConfig(method="standard", dtype=torch.float32))
    opt = dmuon.DMuon(model, plan, lr=MUON["lr"], weight_decay=MUON["weight_decay"],
                      adamw=ADAMW | {"betas": (0.9, 0.999)})
    params = _run(model, opt, mesh.get_coordinate()[0], world // ep, steps)
    momentum = opt.state[model.moe.experts]["momentum_buffer"]
    return {"params": params, "placements": str(model.moe.experts.placements),
            "pieces": {i.name: [(p.row, p.rows) for p in i.pieces] for i in plan.infos if i.expert is not None},
            "owners": [i.owner for i in plan.infos], "momentum_numel": momentum.to_local().numel(),
            "orthogonalized": opt.last_step_stats()["orthogonalized"],
            "launches": (opt.last_step_stats()["blocks_exchanged_in_backward"],
                         opt.last_step_stats()["rescaled_launches"])}


class FusedQKV(nn.Module):
    """A fused (3 * HIDDEN, WIDTH) projection whose row groups are q, k and v."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * HIDDEN, bias=False)
        self.out = nn.Linear(HIDDEN, WIDTH, bias=False)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return self.head(x + self.out(torch.tanh(q * k) + v))


def qkv_reference(world: int, steps: int, groups: int) -> dict[str, torch.Tensor]:
    """One process: torch.optim.Muon on each of the ``groups`` row groups of ``qkv.weight``."""
    torch.manual_seed(0)
    model = FusedQKV()
    weight = model.qkv.weight
    height = weight.shape[0] // groups
    parts = [nn.Parameter(weight.data[g * height:(g + 1) * height]) for g in range(groups)]  # share storage

    def grads():
        return [weight.grad[g * height:(g + 1) * height] for g in range(groups)]

    return _muon_on_slices(model, parts, grads, [model.out.weight], [model.embed.weight, *model.head.parameters()],
                           world, steps)


def train_qkv(rank: int, world: int, steps: int, groups: int, optimizer: str = "dmuon", mesh_shape=None) -> dict:
    """FSDP2 (HSDP with ``mesh_shape``), ``qkv.weight`` seen as ``rows:groups``; DMuon or the gather
    oracle, fp32 NS."""
    torch.manual_seed(0)
    model = FusedQKV()
    mesh = make_mesh(world, mesh_shape)
    fully_shard(model, mesh=mesh)
    views = {"qkv.weight": f"rows:{groups}"}
    if optimizer == "dmuon":
        plan = dmuon.prepare(model, matrix_view=views, ns=dmuon.NSConfig(method="standard", dtype=torch.float32))
        opt = dmuon.DMuon(model, plan, lr=MUON["lr"], weight_decay=MUON["weight_decay"], adamw=ADAMW)
        names = [i.name for i in plan.infos]
    else:
        from dmuon.baselines import GatherThenCompute

        opt = GatherThenCompute(model, lr=MUON["lr"], weight_decay=MUON["weight_decay"], ns_method="standard",
                                ns_dtype=torch.float32, adamw_lr=ADAMW["lr"], adamw_weight_decay=ADAMW["weight_decay"],
                                matrix_view=views)
        names = []
    params = _run(model, opt, rank, world, steps)
    return {"params": params, "names": names, "orthogonalized": opt.last_step_stats()["orthogonalized"]}
