"""The small model and data the integration recipes share (a byte LM's shape: embedding, blocks, norm, head).

Each recipe runs under ``torchrun`` as it is, or, launched plainly, on 2 local gloo CPU ranks
(:func:`launch`), and returns what its test compares (rank 0's full parameters, the losses).
"""

from __future__ import annotations

import os
import tempfile
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

VOCAB, DIM, SEQ = 64, 32, 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(DIM)
        self.up = nn.Linear(DIM, 4 * DIM)
        self.down = nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(layers))
        self.norm = nn.RMSNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None):
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        logits = self.lm_head(self.norm(x))
        if labels is None:
            return logits
        return {"loss": F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1)), "logits": logits}


def batch(step: int, rank: int, size: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, labels)`` of ``step`` on ``rank`` (deterministic)."""
    g = torch.Generator().manual_seed(7919 * step + rank)
    tokens = torch.randint(0, VOCAB, (size, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def fully_shard_tiny(model: nn.Module, mesh=None) -> nn.Module:
    """``fully_shard`` each block, then the root: what a training script does for AdamW."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's full value by canonical name (a collective for DTensors)."""
    from dmuon.optim.dmuon import canonical_name

    return {canonical_name(n): (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in model.named_parameters()}


def assert_runs_equal(out: dict, ref: str, *modes: str) -> None:
    """Each run in ``modes`` ended with run ``ref``'s parameters, bit for bit (the names that differ)."""
    want = out[ref]["params"]
    for mode in modes:
        differ = [n for n in want if not torch.equal(out[mode]["params"][n], want[n])]
        assert not differ, (mode, ref, differ)


def launch(fn: Callable[..., Any], *args: Any, world_size: int = 2) -> Any:
    """Under torchrun: ``fn(rank, world_size, *args)`` here; else on ``world_size`` spawned gloo ranks."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group()
        return fn(dist.get_rank(), dist.get_world_size(), *args)
    from dmuon.testing.spawn import run_distributed

    return run_distributed(fn, world_size, *args, timeout_s=300)[0]


def scratch_dir() -> str:
    return tempfile.mkdtemp(prefix="dmuon-recipe-")
