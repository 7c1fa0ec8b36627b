"""Small models with awkward shapes for correctness tests."""

from __future__ import annotations

import torch
import torch.utils.checkpoint
import torch.nn.functional as F
from torch import nn


class OddBlock(nn.Module):
    """A residual MLP block whose matrices divide by no world size (37x91, 200x91, 37x200)."""

    def __init__(self, dim: int = 37, hidden: int = 91, wide: int = 200) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.mid = nn.Linear(hidden, wide, bias=False)
        self.down = nn.Linear(wide, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.mid(F.gelu(self.up(self.norm(x))))))


class OddNet(nn.Module):
    """Embedding, a conv, odd-shaped blocks, 1xn and nx1 matrices, a norm and a head.

    ``skip`` holds block indices to leave out of the forward (an unused block);
    ``checkpoint`` runs each block under activation checkpointing, called
    through the module as Hugging Face models do, so its forward hooks fire
    again when backward recomputes it: ``"early_stop"`` (torch's default
    non-reentrant checkpoint, which stops the recomputation once it has what
    backward needs), ``"full"`` (non-reentrant, recomputes the whole block)
    or ``"reentrant"``; ``None`` for none.
    """

    def __init__(self, vocab: int = 50, dim: int = 37, blocks: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.conv = nn.Conv1d(dim, dim, kernel_size=3, padding=1)
        self.layers = nn.ModuleList(OddBlock(dim) for _ in range(blocks))
        self.gate = nn.Linear(dim, 1)                 # a 1 x n matrix
        self.lift = nn.Linear(1, dim, bias=False)     # an n x 1 matrix
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.skip: set[int] = set()
        self.checkpoint: str | None = None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        x = x + self.conv(x.transpose(1, 2)).transpose(1, 2)
        for k, layer in enumerate(self.layers):
            if k in self.skip:
                continue
            if self.checkpoint is None or not torch.is_grad_enabled():
                x = layer(x)
            elif self.checkpoint == "reentrant":
                x = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=True)
            else:
                with torch.utils.checkpoint.set_checkpoint_early_stop(self.checkpoint == "early_stop"):
                    x = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
        x = x + self.lift(torch.sigmoid(self.gate(x)))
        return self.head(self.norm(x))


def odd_batch(step: int, rank: int, batch: int = 2, seq: int = 7, vocab: int = 50):
    """Deterministic (tokens, targets) for a rank and step."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def lm_loss(model: nn.Module, batch) -> torch.Tensor:
    tokens, targets = batch
    logits = model(tokens)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def small_mlp() -> nn.Module:
    """Six layers (three Linear matrices, a LayerNorm) from seed 0: the one-process convention and rule-change tests'
    model, small enough to step torch's optimizers beside it in a blink."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))


def small_mlp_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`small_mlp`'s inputs and regression targets of ``step`` (five rows, seeded by the step)."""
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(5, 6, generator=g), torch.randn(5, 4, generator=g)
