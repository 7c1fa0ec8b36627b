"""torchao's float8 training under FSDP2: the weights whose float8 scale a step precomputes.

``convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))``
makes each ``Float8Linear``'s weight a ``WeightWithDynamicFloat8CastTensor``; after ``fully_shard`` it is
the local tensor of the sharded DTensor, and FSDP2's all-gather sends it cast to float8
(``fsdp_pre_all_gather``). The cast's scale is either computed there, from the shard's amax reduced over
the mesh, or the one ``precompute_float8_dynamic_scale_for_fsdp(model)`` left on the local tensor
(``_precomputed_scale``: torchtitan's loop calls it after each ``optimizer.step()``, one all-reduce for every
weight). A precomputed scale is only right for the weights it was computed from.

torchao stays optional: nothing here imports it until a model holds its weights, and a model can only hold
them once torchao's float8 modules are imported (``sys.modules``), so a run without float8 pays a dict
lookup.
"""

from __future__ import annotations

import sys

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def float8_linears(root: nn.Module) -> dict[int, nn.Module]:
    """``id(weight) -> module`` for each of ``root``'s ``Float8Linear`` modules whose sharded weight FSDP2
    gathers in float8 (``enable_fsdp_float8_all_gather=True``): the modules torchao's
    ``precompute_float8_dynamic_scale_for_fsdp`` would set a scale on. Empty without torchao's float8."""
    linear = sys.modules.get("torchao.float8.float8_linear")
    fsdp_utils = sys.modules.get("torchao.float8.fsdp_utils")
    if linear is None or fsdp_utils is None:
        return {}
    out = {}
    for module in root.modules():
        weight = getattr(module, "weight", None)
        if (isinstance(module, linear.Float8Linear) and isinstance(weight, DTensor)
                and isinstance(weight._local_tensor, fsdp_utils.WeightWithDynamicFloat8CastTensor)):
            out[id(weight)] = module
    return out


def has_precomputed_scale(module: nn.Module) -> bool:
    """Whether the next all-gather of ``module``'s weight casts with a scale computed before it (by
    ``precompute_float8_dynamic_scale_for_fsdp``) rather than from the weight it sends."""
    return module.weight._local_tensor._precomputed_scale is not None


@torch.no_grad()
def recompute_scales(modules: list[nn.Module]) -> None:
    """torchao's ``precompute_float8_dynamic_scale_for_fsdp`` on ``modules`` alone: their scales from their
    weights as they are now, in one all-reduce over the weights' mesh (a collective: every rank of that
    mesh calls it with the same modules in the same order). The same arithmetic as the user's call, so the
    same bits as a precompute after the update, and as the cast FSDP2 would compute without one."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    # A container of these modules only: torchao walks ``module.modules()``, which on an FSDP2 unit would
    # reach the units nested in it, whose weights this call must not touch (they may still wait for theirs).
    precompute_float8_dynamic_scale_for_fsdp(nn.ModuleList(modules))
