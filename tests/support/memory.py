"""Measured per-rank memory of FSDP2 + AdamW against FSDP2 + DMuon (run inside spawned ranks).

Everything is measured from the live tensors (:mod:`dmuon.bench.memory`), not
computed from shapes: parameters as the unique storages under the local shards,
gradients the same right after backward (before ``step()``), optimizer state as
the storages of every tensor in ``opt.state`` (local shards of DTensors).
"""

from __future__ import annotations

import gc

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import dmuon
from dmuon.bench.memory import live_bytes_of, state_tensors
from dmuon.util.dtensor import local_tensor

from support.cases import make_mesh


class MatrixBlock(nn.Module):
    """RMSNorm and a residual MLP: two large matrices, three small vectors."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class MatrixStack(nn.Module):
    """A stack of :class:`MatrixBlock`: the matrices dominate every byte count."""

    def __init__(self, dim: int, hidden: int, blocks: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MatrixBlock(dim, hidden) for _ in range(blocks))
        self.norm = nn.RMSNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


def _build(world_size: int, dim: int, hidden: int, blocks: int) -> nn.Module:
    mesh = make_mesh(world_size)
    torch.manual_seed(0)
    model = MatrixStack(dim, hidden, blocks)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def _measure(model: nn.Module, opt: torch.optim.Optimizer, rank: int, dim: int, steps: int) -> dict:
    """Trains ``steps`` steps; the largest byte counts seen, and the matrices' local gradient numel."""
    out = {"param_bytes": 0, "grad_bytes": 0, "state_bytes": 0, "grad_numel": {}}
    params = list(model.parameters())
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(2, 4, dim, generator=g)
        model(x).float().pow(2).mean().backward()
        grads = [p.grad for p in params if p.grad is not None]
        out["grad_bytes"] = max(out["grad_bytes"], live_bytes_of(grads))
        if step == steps - 1:
            out["grad_numel"] = {n: (local_tensor(p.grad).numel(), tuple(p.shape))
                                 for n, p in model.named_parameters() if p.ndim == 2}
        opt.step()
        opt.zero_grad()
        out["param_bytes"] = max(out["param_bytes"], live_bytes_of(params))
        out["state_bytes"] = max(out["state_bytes"], live_bytes_of(state_tensors(opt)))
    return out


def adamw_vs_dmuon(rank: int, world_size: int, dim: int = 256, hidden: int = 1024, blocks: int = 6,
                   steps: int = 2) -> dict:
    """The same bf16 FSDP2 model trained with torch.optim.AdamW, then (fresh) with DMuon.

    Returns (every rank): ``{"adamw": ..., "dmuon": ...}``, each with
    ``param_bytes``, ``grad_bytes``, ``state_bytes`` (this rank's) and
    ``grad_numel`` (matrix name -> (local gradient numel, full shape)).
    """
    model = _build(world_size, dim, hidden, blocks)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    adamw = _measure(model, opt, rank, dim, steps)
    del model, opt
    gc.collect()

    model = _build(world_size, dim, hidden, blocks)
    opt = dmuon.DMuon(model, lr=0.02, adamw=dmuon.AdamWConfig(lr=1e-3), ns=dmuon.NSConfig(method="standard", dtype=torch.float32))
    muon = _measure(model, opt, rank, dim, steps)
    muon["matrices"] = sorted(i.name for i in opt.plan.infos)
    return {"adamw": adamw, "dmuon": muon}
