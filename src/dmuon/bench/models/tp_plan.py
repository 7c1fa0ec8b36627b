"""The tensor-parallel split ``dmuon bench --tp`` applies to every workload's blocks (Megatron's)."""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "fc1")
"""Linears whose output features (heads, the MLP's hidden dim) split over tp."""
ROWWISE = ("o_proj", "down_proj", "fc2")
"""Linears whose input features split over tp (their outputs are summed across it)."""


def block_tp_plan(block: nn.Module, tp: int) -> dict[str, ParallelStyle]:
    """``parallelize_module``'s plan for one block: attention heads and MLP hidden dims over ``tp``.

    Found by module name (q/k/v/o projections, SwiGLU's gate/up/down, a ViT MLP's
    fc1/fc2, ``nn.Linear`` only), so other Linears (a projector, a stack of experts'
    router) stay whole on every tp rank.

    Raises:
        ValueError: Where ``tp`` does not divide an attention's query or key/value heads.
    """
    plan: dict[str, ParallelStyle] = {}
    for name, module in block.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, nn.Linear) and leaf in COLWISE:
            plan[name] = ColwiseParallel()
        elif isinstance(module, nn.Linear) and leaf in ROWWISE:
            plan[name] = RowwiseParallel()
        head_dim = getattr(module, "head_dim", None)
        if head_dim and isinstance(getattr(module, "q_proj", None), nn.Linear):
            for proj in ("q_proj", "k_proj"):
                heads = getattr(module, proj).out_features // head_dim
                if heads % tp:
                    raise ValueError(f"--tp {tp} does not divide the {heads} heads of {name}.{proj}")
    return plan
