"""Which parameters Muon owns: the default rule and user overrides."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

SelectFn = Callable[[str, nn.Parameter], bool]
ViewFn = Callable[[str, nn.Parameter], "str | tuple[int, ...]"]
MATRIX_VIEWS = ("flatten", "stack", "rows:K", "rows:a,b,...")
"""How a parameter is seen: one ``(shape[0], prod(shape[1:]))`` matrix (``"flatten"``,
Keller Jordan's rule for conv kernels), ``shape[0]`` matrices of ``shape[1:]``
(``"stack"``: experts in the grouped-GEMM layout, each orthogonalized on its own),
``"rows:K"`` for any integer K dividing ``shape[0]``: K equal row groups of the flattened
matrix, each its own NS (a fused QKV projection per part or per head), or row groups of
the sizes given, ``"rows:a,b,..."`` (two or more) or a tuple of ints, summing to
``shape[0]``: a fused GQA QKV as ``(q_rows, k_rows, v_rows)`` (dion's ``split_sizes``)."""


def row_sizes(view: object, rows: int) -> tuple[int, ...] | None:
    """The row count of each group of a row-group view of a parameter with ``rows`` rows, in order
    (None for ``"flatten"`` and ``"stack"``).

    Raises:
        ValueError: A malformed view, K not dividing ``rows``, or sizes not summing to ``rows``
            (the message names the view, not the parameter: the caller prefixes that).
    """
    if isinstance(view, (tuple, list)):
        sizes = tuple(view)
        if len(sizes) < 2 or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in sizes):
            raise ValueError(f"matrix_view {view!r}: row group sizes must be two or more integers >= 1 "
                             "(one group of all rows is 'flatten')")
    elif isinstance(view, str) and view.startswith("rows:"):
        parts = view[len("rows:"):].split(",")
        if not all(p.strip().isdigit() and int(p) >= 1 for p in parts):
            raise ValueError(f"matrix_view must be one of {MATRIX_VIEWS} (K and the sizes integers >= 1), "
                             f"got {view!r}")
        if len(parts) == 1:
            groups = int(parts[0])
            if rows % groups:
                raise ValueError(f"matrix_view {view!r} needs K to divide its {rows} rows")
            return (rows // groups,) * groups
        sizes = tuple(int(p) for p in parts)
    else:
        return None
    if sum(sizes) != rows:
        raise ValueError(f"matrix_view {view!r}: row group sizes {' + '.join(map(str, sizes))} = {sum(sizes)} "
                         f"but it has {rows} rows")
    return sizes

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


def _conv_weights(model: nn.Module) -> set[int]:
    return {id(m.weight) for m in model.modules() if isinstance(m, nn.modules.conv._ConvNd)}


def default_matrix_view(model: nn.Module) -> ViewFn:
    """``"flatten"`` for ``nn.Conv*`` weights and 2-D parameters, ``"stack"`` for other parameters
    of three or more dims (a stack of experts)."""
    convs = _conv_weights(model)

    def view(name: str, param: nn.Parameter) -> str:
        return "flatten" if param.ndim < 3 or id(param) in convs else "stack"

    return view


def matrix_views(model: nn.Module, chosen: list[tuple[str, nn.Parameter]],
                 matrix_view: ViewFn | dict[str, str] | None = None) -> dict[str, str]:
    """The view of each chosen parameter: ``matrix_view`` (a function or a dict by name, falling
    back to the default rule) over :func:`default_matrix_view`.

    Raises:
        ValueError: Naming the parameter for a view not in :data:`MATRIX_VIEWS`.
    """
    default = default_matrix_view(model)
    out = {}
    for name, param in chosen:
        if callable(matrix_view):
            view = matrix_view(name, param)
        elif matrix_view is not None and name in matrix_view:
            view = matrix_view[name]
        else:
            view = default(name, param)
        try:
            sizes = row_sizes(view, param.shape[0])
        except ValueError as err:
            raise ValueError(f"parameter {name!r}: {err}") from None
        if sizes is None and view not in MATRIX_VIEWS[:2]:
            raise ValueError(f"parameter {name!r}: matrix_view must be one of {MATRIX_VIEWS}, got {view!r}")
        if isinstance(view, (tuple, list)):
            view = "rows:" + ",".join(map(str, view))  # one spelling: the plan fingerprint compares strings
        if view == "stack" and param.ndim < 3:
            raise ValueError(f"parameter {name!r}: matrix_view 'stack' needs >= 3 dims, got {param.ndim}")
        out[name] = view
    return out
