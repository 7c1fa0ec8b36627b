"""The ``moe`` workload: the Qwen2-style decoder with each MLP replaced by routed experts.

Each layer's MLP is 8 SwiGLU experts with top-2 routing, their weights in the
grouped-GEMM layout (one ``(E, out, in)`` parameter per projection), so dmuon
sees each expert as its own Muon matrix (``matrix_view="stack"``).
torch.optim.Muon takes 2-D parameters only: its users have to send such stacks
to AdamW, as the ``torch_muon`` configuration does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dmuon.bench.models.qwen2 import Qwen2Size, qwen2_workload
from dmuon.bench.models.workload import Workload


@dataclass(frozen=True)
class MoESize:
    """A :class:`Qwen2Size` decoder whose MLPs are routed experts."""

    decoder: Qwen2Size
    """Attention, width, layers, vocabulary and data (``intermediate`` is each expert's width)."""
    experts: int = 8
    """Experts per layer."""
    top_k: int = 2
    """Experts each token is routed to."""


MOE_SIZES: dict[str, MoESize] = {
    "tiny": MoESize(Qwen2Size(hidden=64, intermediate=64, layers=2, heads=4, kv_heads=2, vocab=256,
                              seq_len=32, batch_size=2)),
    "small": MoESize(Qwen2Size(hidden=128, intermediate=128, layers=4, heads=4, kv_heads=2, vocab=2048,
                               seq_len=128, batch_size=2)),
}
"""Size presets of the ``moe`` workload."""


class RoutedExperts(nn.Module):
    """Top-k routed SwiGLU experts, weights stacked per projection (grouped-GEMM layout)."""

    def __init__(self, hidden: int, inner: int, experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(hidden, experts, bias=False)
        scale_in, scale_out = hidden ** -0.5, inner ** -0.5
        self.gate_proj = nn.Parameter(torch.randn(experts, inner, hidden) * scale_in)
        self.up_proj = nn.Parameter(torch.randn(experts, inner, hidden) * scale_in)
        self.down_proj = nn.Parameter(torch.randn(experts, hidden, inner) * scale_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, chosen = torch.topk(F.softmax(self.router(flat), dim=-1), self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(flat)
        for e in range(self.gate_proj.shape[0]):
            token, slot = torch.nonzero(chosen == e, as_tuple=True)
            h = flat[token]
            h = F.silu(h @ self.gate_proj[e].T) * (h @ self.up_proj[e].T)
            out = out.index_add(0, token, (h @ self.down_proj[e].T) * weights[token, slot, None])
        return out.reshape(x.shape)


def moe_workload(size_name: str, size: MoESize, seed: int, dtype: torch.dtype) -> Workload:
    """The ``moe`` workload at ``size``; call under a seeded RNG."""
    workload = qwen2_workload("moe", size_name, size.decoder, seed, dtype)
    for layer in workload.model.model.layers:
        layer.mlp = RoutedExperts(size.decoder.hidden, size.decoder.intermediate, size.experts,
                                  size.top_k).to(dtype)
    workload.config = size
    workload.muon_param_names = tuple(n for n, p in workload.model.named_parameters()
                                      if p.ndim >= 2 and n.startswith("model.layers.") and "router" not in n)
    return workload
