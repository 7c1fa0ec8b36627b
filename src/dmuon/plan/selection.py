"""Which parameters Muon owns: the default rule and user overrides."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

SelectFn = Callable[[str, nn.Parameter], bool]

HEAD_NAMES = frozenset({"lm_head", "output", "head"})


def _embedding_weights(model: nn.Module) -> set[int]:
    return {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}


def default_is_matrix(model: nn.Module) -> SelectFn:
    """Builds the default selection rule for ``model``.

    A parameter is a Muon matrix when it has at least two dimensions and is
    neither an ``nn.Embedding`` weight nor the output head. The head is a
    Linear whose weight is tied to an embedding (caught by the embedding rule)
    or whose module is named ``lm_head``, ``output`` or ``head``.
    """
    embeddings = _embedding_weights(model)

    def is_matrix(name: str, param: nn.Parameter) -> bool:
        if param.ndim < 2 or id(param) in embeddings:
            return False
        module_name = name.rsplit(".", 1)[0] if "." in name else ""
        return module_name.rsplit(".", 1)[-1] not in HEAD_NAMES

    return is_matrix


def select_matrices(
    model: nn.Module, select: SelectFn | None = None
) -> list[tuple[str, nn.Parameter]]:
    """Returns ``(name, param)`` for every Muon matrix, in registration order.

    Args:
        model: The model, before ``fully_shard``.
        select: Optional ``select(name, param) -> bool`` replacing the default rule.

    Raises:
        ValueError: If a selected parameter is complex or has fewer than two dims.
    """
    rule = select if select is not None else default_is_matrix(model)
    chosen = []
    for name, param in model.named_parameters():
        if not rule(name, param):
            continue
        if torch.is_complex(param):
            raise ValueError(f"parameter {name!r}: complex parameters are not supported by Muon")
        if param.ndim < 2:
            raise ValueError(
                f"parameter {name!r}: select chose a {param.ndim}-D tensor; Muon needs >= 2 dims"
            )
        chosen.append((name, param))
    return chosen
