"""A small model under torch's tensor parallelism (``parallelize_module``) and FSDP2, and its references.

Each block has a colwise ``up`` (TP's row chunks, FSDP2's rows inside them:
``_StridedShard``), a rowwise ``down`` (FSDP2's rows x TP's columns) and a
``mix`` matrix TP leaves whole (a copy on every tp rank). TP's own splits are
even: torch's ColwiseParallel -> RowwiseParallel chain cannot split the hidden
dim unevenly (RowwiseParallel's ``DTensor.from_local`` infers the global size
from the local one, so 9 over 2 ranks becomes 10 and the matmul fails). FSDP2's
rows inside them are not: ``HIDDEN = 10`` is 5 + 5 over tp = 2, then 3 + 2 over
dp = 2, and ``WIDTH = 7`` rows are 4 + 3. The colwise head is AdamW's.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

import dmuon

from support.reference import ns_precision

VOCAB, WIDTH, HIDDEN, BLOCKS = 16, 7, 10, 2
MUON = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True, ns_steps=5)
ADAMW = dict(lr=3e-3, weight_decay=0.01)


class Block(nn.Module):
    """``x + down(tanh(up(norm(x))))``, then (unless ``sequence_parallel``) ``+ mix(x)``: under
    sequence parallelism every parameter between the norm and ``down`` must be TP's, so ``mix``,
    which TP leaves whole, is left out there."""

    def __init__(self, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(WIDTH)
        self.up = nn.Linear(WIDTH, HIDDEN)
        self.down = nn.Linear(HIDDEN, WIDTH, bias=False)
        self.mix = None if sequence_parallel else nn.Linear(WIDTH, WIDTH, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.down(torch.tanh(self.up(self.norm(x))))
        return x if self.mix is None else x + self.mix(x)


class TPNet(nn.Module):
    def __init__(self, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(Block(sequence_parallel) for _ in range(BLOCKS))
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


MATRICES = [f"layers.{b}.{m}.weight" for b in range(BLOCKS) for m in ("up", "down", "mix")]
SP_MATRICES = [n for n in MATRICES if ".mix." not in n]
SP_SEQ = 6
"""Tokens per sample under sequence parallelism: TP's ``Shard(1)`` of the sequence splits only evenly."""


def batch(step: int, dp_rank: int, dp: int, per_rank: int = 2, seq: int = 5) -> torch.Tensor:
    """Data-parallel rank ``dp_rank``'s tokens (every tp rank of it reads the same)."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (dp * per_rank, seq + 1), generator=g)
    return tokens[dp_rank * per_rank:(dp_rank + 1) * per_rank]


def loss_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def reference(dp: int, steps: int, sequence_parallel: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One process, no parallelism: torch.optim.Muon (fp32 NS) on the matrices, AdamW on the rest.
    Returns every parameter and each matrix's momentum."""
    torch.manual_seed(0)
    model = TPNet(sequence_parallel)
    named = dict(model.named_parameters())
    matrices = SP_MATRICES if sequence_parallel else MATRICES
    muon = torch.optim.Muon([named[n] for n in matrices], **MUON)
    adamw = torch.optim.AdamW([p for n, p in named.items() if n not in matrices], **ADAMW)
    seq = SP_SEQ if sequence_parallel else 5
    for step in range(steps):
        loss_of(model, torch.cat([batch(step, d, dp, seq=seq) for d in range(dp)])).backward()
        with ns_precision(torch.float32):
            muon.step()
        adamw.step()
        model.zero_grad()
    momenta = {n: muon.state[named[n]]["momentum_buffer"].clone() for n in matrices}
    return {n: full(p) for n, p in model.named_parameters()}, momenta



def check_equals_reference(results: list[dict], dp: int, steps: int,
                           sequence_parallel: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Rank 0's parameters and momenta are one process's (:func:`reference`, ``dp`` data-parallel batches) to
    1e-5, and each matrix was orthogonalized once over the whole mesh. Returns the reference."""
    params, momenta = reference(dp, steps, sequence_parallel)
    for what, got, want in (("params", results[0]["params"], params), ("momentum", results[0]["momentum"], momenta)):
        worst = max(want, key=lambda n: (got[n] - want[n]).abs().max().item())
        err = (got[worst] - want[worst]).abs().max().item()
        assert err <= 1e-5, (what, worst, err)
    assert sum(r["orthogonalized"] for r in results) == len(SP_MATRICES if sequence_parallel else MATRICES)
    return params, momenta

def tp_mesh(world: int, mesh_shape: tuple[int, ...], hsdp: str = "fsdp2"):
    """``(dp, tp)`` or ``(replicate, shard, tp)``; returns the mesh, its dp part (FSDP2's mesh: with
    ``hsdp="dmuon"`` only the shard dim, dmuon reducing across replicas) and this rank's dp index."""
    names = ("dp", "tp") if len(mesh_shape) == 2 else ("replicate", "shard", "tp")
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    dp_mesh = mesh["dp"] if len(mesh_shape) == 2 else mesh["shard"] if hsdp == "dmuon" else mesh["replicate", "shard"]
    coord = mesh.get_coordinate()
    dp_rank = coord[0] if len(mesh_shape) == 2 else coord[0] * mesh_shape[1] + coord[1]
    return mesh, dp_mesh, dp_rank


def parallelize(model: TPNet, mesh, dp_mesh, sequence_parallel: bool = False, bf16: bool = False) -> None:
    """TP on ``mesh["tp"]`` (torch's plans; with ``sequence_parallel`` the residual stream split
    over the sequence, the norms ``SequenceParallel``), then FSDP2 over the dp mesh, each block and the root."""
    tp = mesh["tp"]
    if sequence_parallel:
        for layer in model.layers:
            parallelize_module(layer, tp, {"norm": SequenceParallel(), "up": ColwiseParallel(input_layouts=Shard(1)),
                                           "down": RowwiseParallel(output_layouts=Shard(1))})
        parallelize_module(model, tp, {
            "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())})
    else:
        for layer in model.layers:
            parallelize_module(layer, tp, {"up": ColwiseParallel(), "down": RowwiseParallel()})
        parallelize_module(model, tp, {"head": ColwiseParallel(output_layouts=Replicate())})
    # bf16: torchtitan's default mixed precision (bf16 compute and all-gathers, fp32 reductions).
    mp = dict(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)) if bf16 else {}
    for layer in model.layers:
        fully_shard(layer, mesh=dp_mesh, **mp)
    fully_shard(model, mesh=dp_mesh, **mp)


def train(rank: int, world: int, steps: int, mesh_shape: tuple[int, ...], optimizer: str = "dmuon",
          sequence_parallel: bool = False, bf16: bool = False, hsdp: str = "fsdp2", beta2: float | None = None,
          clip: float | None = None, overlap: bool = True, rule: str | None = None,
          execution: dmuon.ExecutionConfig | None = None) -> dict:
    """TP + FSDP2 under DMuon (or the gather-then-compute oracle), fp32 NS: every parameter's full
    value, the plan and each matrix's momentum bytes on this rank (``hsdp``: as ``tp_mesh``).
    ``beta2``: NorMuon (``dmuon.NorMuon``, the oracle's NorMuon rule) instead of Muon, and each
    matrix's whole second moment and this rank's share of it. ``rule``: ``"muonh"`` or ``"dion2"``
    (``support.cases.rule_optimizer``; MuonH's radii too). ``clip``: ``DMuon.clip_grad_norm_`` before
    each step (torch's refuses parameters on different meshes), the launches kept and rescaled per step
    reported. ``execution``: the runtime's other switches (DMuon only; ``overlap`` the given one)."""
    mesh, dp_mesh, dp_rank = tp_mesh(world, mesh_shape, hsdp)
    torch.manual_seed(0)
    model = TPNet(sequence_parallel)
    parallelize(model, mesh, dp_mesh, sequence_parallel, bf16)
    seq = SP_SEQ if sequence_parallel else 5
    matrices = SP_MATRICES if sequence_parallel else MATRICES
    dp = world // mesh_shape[-1]
    if optimizer == "dmuon":
        plan = dmuon.prepare(model, ns=dmuon.NSConfig(method="standard", dtype=torch.float32),
                             hsdp_mesh=mesh if hsdp == "dmuon" else None)
        from support.cases import rule_optimizer

        rule = (dmuon.DMuon if beta2 is None else functools.partial(dmuon.NorMuon, beta2=beta2)) if rule is None \
            else functools.partial(rule_optimizer, rule)
        opt = rule(model, plan, lr=MUON["lr"], weight_decay=MUON["weight_decay"], adamw=ADAMW,
                   execution=dataclasses.replace(execution or dmuon.ExecutionConfig(), overlap=overlap))
    else:
        from dmuon.baselines import GatherThenCompute

        plan = None
        opt = GatherThenCompute(model, lr=MUON["lr"], weight_decay=MUON["weight_decay"], ns_method="standard",
                                ns_dtype=torch.float32, adamw_lr=ADAMW["lr"], adamw_weight_decay=ADAMW["weight_decay"],
                                beta2=beta2)
    orthogonalized, launches = 0, []
    for step in range(steps):
        loss_of(model, batch(step, dp_rank, dp, seq=seq)).backward()
        if clip is not None:
            opt.clip_grad_norm_(clip)
        opt.step()
        stats = opt.last_step_stats()
        orthogonalized = stats["orthogonalized"]
        launches.append((stats.get("blocks_exchanged_in_backward"), stats.get("rescaled_launches"),
                         stats.get("blocks_returned_in_backward")))
        opt.zero_grad()
    if optimizer == "dmuon":
        opt.flush_updates()  # apply_updates="next_forward": the last step's updates
    named = dict(model.named_parameters())
    out = {"params": {n: full(p) for n, p in named.items()}, "orthogonalized": orthogonalized,
           "launches": launches}
    if plan is not None:
        out["owners"] = {i.name: i.owner for i in plan.infos}
        out["pieces"] = {i.name: i.pieces for i in plan.infos}
        out["momentum_numel"] = {n: opt.state[named[n]]["momentum_buffer"].to_local().numel() for n in matrices}
        out["momentum"] = {n: full(opt.state[named[n]]["momentum_buffer"]) for n in matrices}
        if "initial_norm" in opt.state[named[matrices[0]]]:  # MuonH
            out["radii"] = {n: full(opt.state[named[n]]["initial_norm"]) for n in matrices}
        if beta2 is not None:
            out["second_moments"] = {n: full(opt.state[named[n]]["second_momentum_buffer"]) for n in matrices}
            out["second_moment_numel"] = {n: opt.state[named[n]]["second_momentum_buffer"].to_local().numel()
                                          for n in matrices}
    return out


def counted_tp_step(rank: int, world: int, mesh_shape: tuple[int, ...], steps: int = 2) -> dict:
    """TP + FSDP2 + DMuon (bf16 wire, 4 return waves): the last step's counted collectives and the plan."""
    mesh, dp_mesh, dp_rank = tp_mesh(world, mesh_shape)
    torch.manual_seed(0)
    model = TPNet()
    parallelize(model, mesh, dp_mesh)
    plan = dmuon.prepare(model, ns=dmuon.NSConfig(method="standard", dtype=torch.bfloat16))
    opt = dmuon.DMuon(model, plan, lr=MUON["lr"], adamw=dmuon.AdamWConfig(lr=ADAMW["lr"]),
                      execution=dmuon.ExecutionConfig(return_waves=4))
    stats = {}
    for step in range(steps):
        loss_of(model, batch(step, dp_rank, dp_mesh.size())).backward()
        opt.step()
        opt.zero_grad()
        stats = opt.last_step_stats()
    return {"plan_rank": opt.runtime.topo.rank, "log": list(opt.runtime.stats.last_log),
            "infos": [(tuple(i.shape), i.owner, i.block) for i in plan.infos],
            "pieces": [i.pieces for i in plan.infos], "replicate": plan.replicate, "shard": plan.shard,
            "waves": stats["return_waves"], "blocks_in_backward": stats["blocks_exchanged_in_backward"]}


def resume_matches_continuing(rank: int, world: int, mesh_shape: tuple[int, ...], path: str,
                              saved_at: int = 2, more: int = 2) -> dict | None:
    """torch's own DCP calls on a TP model: train, save, train on; a fresh model resumes and trains the
    same steps. Rank 0 returns both runs' full parameters."""
    from torch.distributed import checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict, get_optimizer_state_dict, set_model_state_dict, set_optimizer_state_dict,
    )

    def build():
        mesh, dp_mesh, dp_rank = tp_mesh(world, mesh_shape)
        torch.manual_seed(0)
        model = TPNet()
        parallelize(model, mesh, dp_mesh)
        opt = dmuon.DMuon(model, lr=MUON["lr"], adamw=dmuon.AdamWConfig(lr=ADAMW["lr"]),
                          ns=dmuon.NSConfig(method="standard", dtype=torch.float32))
        return model, opt, dp_rank, dp_mesh.size()

    def train_steps(model, opt, dp_rank, dp, steps):
        for step in steps:
            loss_of(model, batch(step, dp_rank, dp)).backward()
            opt.step()
            opt.zero_grad()

    model, opt, dp_rank, dp = build()
    train_steps(model, opt, dp_rank, dp, range(saved_at))
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=path)
    train_steps(model, opt, dp_rank, dp, range(saved_at, saved_at + more))
    continued = {n: full(p) for n, p in model.named_parameters()}
    del model, opt
    model, opt, dp_rank, dp = build()
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    placements = str(opt.state[model.layers[0].down.weight]["momentum_buffer"].placements)
    train_steps(model, opt, dp_rank, dp, range(saved_at, saved_at + more))
    resumed = {n: full(p) for n, p in model.named_parameters()}
    return {"continued": continued, "resumed": resumed, "placements": placements} if rank == 0 else None
