"""GatherThenCompute in a single process (no process group): what its step reports."""

from __future__ import annotations

import torch
from torch import nn

import dmuon
from dmuon.baselines import GatherThenCompute


class Mixed(nn.Module):
    """A plain matrix, a conv kernel, a stack of 3 experts, a fused projection seen as 3 row
    groups, a matrix that takes no part in the loss (no gradient) and a head (AdamW's)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 8, bias=False)                    # 1 matrix
        self.conv = nn.Conv1d(8, 8, kernel_size=3, padding=1)      # 1 matrix (flattened)
        self.experts = nn.Parameter(torch.randn(3, 8, 8) / 8)      # 3 matrices ("stack")
        self.qkv = nn.Linear(8, 12, bias=False)                    # 3 matrices ("rows:3")
        self.unused = nn.Linear(8, 8, bias=False)                  # no gradient
        self.head = nn.Linear(12, 5)                               # not a Muon matrix

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        h = h + self.conv(h.transpose(1, 2)).transpose(1, 2)
        h = torch.einsum("bti,eoi->bto", h, self.experts) / 3
        return self.head(self.qkv(h))


VIEW = {"qkv.weight": "rows:3"}
WITH_GRAD = 1 + 1 + 3 + 3
NS = dmuon.NSConfig(method="standard")


def _stepped(make_optimizer) -> dict:
    torch.manual_seed(0)
    model = Mixed()
    opt = make_optimizer(model)
    model(torch.randn(2, 5, 6)).square().mean().backward()
    assert model.unused.weight.grad is None
    opt.step()
    return opt.last_step_stats()


def test_orthogonalized_counts_every_matrix_with_a_gradient_as_dmuon_does():
    gather = _stepped(lambda m: GatherThenCompute(m, matrix_view=VIEW, ns_method=NS.method))
    owner = _stepped(lambda m: dmuon.DMuon(m, dmuon.prepare(m, matrix_view=VIEW, ns=NS)))
    assert gather["orthogonalized"] == WITH_GRAD
    assert owner["orthogonalized"] == WITH_GRAD
