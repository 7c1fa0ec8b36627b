"""Public entry points: orthogonalise one matrix (or stack), or many of mixed shapes."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .autotune import METHODS, Autotuner, get_autotuner, run_looped, run_method
from .coefficients import KELLER, CoefficientSpec, resolve_schedule
from .newton_schulz import check_dtype, check_input

_METHOD_CHOICES = METHODS + ("auto",)
_BATCHING_CHOICES = ("auto", "batched", "looped")


def _check_method(method: str) -> None:
    if method not in _METHOD_CHOICES:
        raise ValueError(f"unknown method {method!r}; choose from {_METHOD_CHOICES}")


def orthogonalize(
    G: torch.Tensor,
    *,
    method: str = "standard",
    coefficients: CoefficientSpec = KELLER,
    steps: int = 5,
    eps: float = 1e-7,
    dtype: torch.dtype = torch.bfloat16,
    autotuner: Autotuner | None = None,
) -> torch.Tensor:
    """Approximately orthogonalises a matrix or a stack of matrices (Muon's update).

    Args:
        G: ``(m, n)`` or ``(B, m, n)``; not modified.
        method: ``"standard"`` (Newton–Schulz, bit-identical to ``torch.optim.Muon`` for
            bfloat16 2-D input), ``"standard32"`` (the same iteration in float32,
            rounded to ``dtype``), ``"gram"`` (Gram Newton–Schulz), or ``"auto"`` (the
            fastest that passes the accuracy bar, from the autotune cache).
        coefficients: An ``(a, b, c)`` triple, a per-iteration schedule, or a schedule
            name (``"polar_express"``, ``"polar_express_5"``, ...: :func:`resolve_schedule`).
        steps: Number of iterations.
        eps: Lower clamp of each matrix's normalising norm.
        dtype: Compute dtype of the standard path; dtype of the result.
        autotuner: Tuner used by ``"auto"``; the process-wide one if ``None``.

    Returns:
        A contiguous tensor shaped like ``G`` in ``dtype``.

    Raises:
        ValueError: For malformed inputs or options.
    """
    check_input(G)
    check_dtype(dtype)
    _check_method(method)
    schedule = resolve_schedule(coefficients, steps)
    if method != "auto":
        problem = _Problem(schedule, eps, dtype)
        return run_method(method, G, problem).contiguous()
    tuner = autotuner or get_autotuner()
    problem = tuner.problem(G.shape[-2:], dtype, G.device, schedule, eps)
    batch = G.shape[0] if G.ndim == 3 else 1
    chosen, batched = tuner.plan(problem, batch, G.device)
    if G.ndim == 3 and batch > 1 and not batched:
        return torch.stack(run_looped(chosen, G, problem)).contiguous()
    return run_method(chosen, G, problem).contiguous()


class _Problem:
    """The fields :func:`run_method` reads, for calls that need no tuning."""

    def __init__(self, schedule, eps: float, dtype: torch.dtype):
        self.schedule = tuple(tuple(t) for t in schedule)
        self.steps = len(schedule)
        self.eps = eps
        self.dtype = dtype


def _same_kind_groups(matrices: Sequence[torch.Tensor]) -> dict[tuple, list[int]]:
    """``(shape, device, dtype)`` -> the indices of the matrices of that kind, in input order (each checked
    to be a 2-D matrix)."""
    groups: dict[tuple, list[int]] = {}
    for i, M in enumerate(matrices):
        check_input(M)
        if M.ndim != 2:
            raise ValueError(f"orthogonalize_many takes 2-D matrices; item {i} has shape {tuple(M.shape)}")
        groups.setdefault((tuple(M.shape), M.device, M.dtype), []).append(i)
    return groups


def _group_choice(tuner: Autotuner | None, problem, method: str, batching: str, size: int,
                  device: torch.device) -> tuple[str, bool]:
    """The method and whether to batch for a group of ``size`` same-kind matrices: the autotuner's
    measured choice for each ``"auto"`` option, the given one otherwise."""
    if batching == "auto":
        return tuner.plan(problem, size, device, None if method == "auto" else method)
    chosen = tuner.method(problem, device) if method == "auto" else method
    return chosen, batching == "batched" and size > 1


def orthogonalize_many(
    matrices: Sequence[torch.Tensor],
    *,
    method: str = "auto",
    coefficients: CoefficientSpec = KELLER,
    steps: int = 5,
    eps: float = 1e-7,
    dtype: torch.dtype = torch.bfloat16,
    batching: str = "auto",
    autotuner: Autotuner | None = None,
) -> list[torch.Tensor]:
    """Orthogonalises a list of 2-D matrices, batching same-shape ones when it pays.

    Matrices are grouped by (shape, device, dtype). Each group of two or more runs
    either as one batched call or as a loop of 2-D calls, whichever the autotuner
    measured faster for that group size (``batching="auto"``). With ``method="auto"``
    the method is tuned jointly with the batching for the group (among the methods
    that pass the accuracy bar).

    Args:
        matrices: 2-D tensors of any shapes; not modified.
        method: As in :func:`orthogonalize`.
        coefficients: As in :func:`orthogonalize`.
        steps: As in :func:`orthogonalize`.
        eps: As in :func:`orthogonalize`.
        dtype: As in :func:`orthogonalize`.
        batching: ``"auto"``, ``"batched"`` or ``"looped"``.
        autotuner: Tuner for the ``"auto"`` choices; the process-wide one if ``None``.

    Returns:
        Contiguous results in ``dtype``, in input order.

    Raises:
        ValueError: For malformed inputs or options.
    """
    _check_method(method)
    check_dtype(dtype)
    if batching not in _BATCHING_CHOICES:
        raise ValueError(f"unknown batching {batching!r}; choose from {_BATCHING_CHOICES}")
    schedule = resolve_schedule(coefficients, steps)
    groups = _same_kind_groups(matrices)
    tuner = None
    if method == "auto" or batching == "auto":
        tuner = autotuner or get_autotuner()
    out: list[torch.Tensor | None] = [None] * len(matrices)
    for (shape, device, _), idx in groups.items():
        if tuner is not None:
            problem = tuner.problem(shape, dtype, device, schedule, eps)
        else:
            problem = _Problem(schedule, eps, dtype)
        chosen, batched = _group_choice(tuner, problem, method, batching, len(idx), device)
        if batched:
            results = run_method(chosen, torch.stack([matrices[i] for i in idx]), problem)
        else:
            results = [run_method(chosen, matrices[i], problem) for i in idx]
        for i, r in zip(idx, results):
            out[i] = r.contiguous()
    return out  # type: ignore[return-value]
