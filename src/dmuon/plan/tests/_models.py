"""A model with awkward matrix shapes for the plan's selection tests.

The parameter layout of ``tests/support/models.OddNet`` (the integration tests'
model), kept here so this package's tests do not reach into the outer tests tree.
"""

from __future__ import annotations

import torch
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
    """Embedding, a conv, odd-shaped blocks, 1xn and nx1 matrices, a norm and a head."""

    def __init__(self, vocab: int = 50, dim: int = 37, blocks: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.conv = nn.Conv1d(dim, dim, kernel_size=3, padding=1)
        self.layers = nn.ModuleList(OddBlock(dim) for _ in range(blocks))
        self.gate = nn.Linear(dim, 1)                 # a 1 x n matrix
        self.lift = nn.Linear(1, dim, bias=False)     # an n x 1 matrix
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        x = x + self.conv(x.transpose(1, 2)).transpose(1, 2)
        for layer in self.layers:
            x = layer(x)
        x = x + self.lift(torch.sigmoid(self.gate(x)))
        return self.head(self.norm(x))
