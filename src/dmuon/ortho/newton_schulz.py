"""The standard quintic Newton–Schulz iteration: the readable reference.

For a 2-D input in bfloat16 with a fixed triple this reproduces
``torch.optim._muon._zeropower_via_newtonschulz`` bit for bit: the operations, their
order, the transposition (as a view) and the fused ``addmm`` calls are the same.
"""

from __future__ import annotations

import torch

from .coefficients import CoefficientSpec, KELLER, Schedule, resolve_schedule


def check_input(G: torch.Tensor) -> None:
    """Validates an input for the orthogonalisation routines.

    Raises:
        ValueError: If ``G`` is not a 2-D or 3-D floating-point tensor with non-empty
            matrix dimensions.
    """
    if not isinstance(G, torch.Tensor):
        raise ValueError(f"expected a torch.Tensor, got {type(G).__name__}")
    if G.ndim not in (2, 3):
        raise ValueError(f"expected a matrix (m, n) or a stack (B, m, n), got shape {tuple(G.shape)}")
    if G.shape[-1] == 0 or G.shape[-2] == 0:
        raise ValueError(f"matrix dimensions must be non-empty, got shape {tuple(G.shape)}")
    if not (G.is_floating_point()):
        raise ValueError(f"expected a floating-point tensor, got {G.dtype}")


def check_dtype(dtype: torch.dtype) -> None:
    """Raises ValueError unless ``dtype`` is a supported compute dtype."""
    if dtype not in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        raise ValueError(f"unsupported compute dtype {dtype}")


def _ns_2d(X: torch.Tensor, schedule: Schedule, eps: float) -> torch.Tensor:
    transposed = X.size(0) > X.size(1)
    if transposed:
        X = X.T
    # X is a private copy here, so in-place division is safe; it keeps the exact
    # rounding and memory layout of the torch reference.
    X.div_(X.norm().clamp(min=eps))
    for a, b, c in schedule:
        A = X @ X.T
        B = torch.addmm(A, A, A, beta=b, alpha=c)
        X = torch.addmm(X, B, X, beta=a)
    if transposed:
        X = X.T
    return X


def _ns_batched(X: torch.Tensor, schedule: Schedule, eps: float) -> torch.Tensor:
    transposed = X.size(-2) > X.size(-1)
    if transposed:
        X = X.mT
    # Each matrix gets its own norm, exactly as if it had been processed alone.
    X.div_(torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True).clamp(min=eps))
    for a, b, c in schedule:
        A = X @ X.mT
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)
        X = torch.baddbmm(X, B, X, beta=a)
    if transposed:
        X = X.mT
    return X


def newton_schulz(
    G: torch.Tensor,
    schedule_or_coeffs: CoefficientSpec = KELLER,
    steps: int = 5,
    eps: float = 1e-7,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Approximately orthogonalises ``G`` with the quintic Newton–Schulz iteration.

    ``G`` is cast to ``dtype``, transposed if it has more rows than columns, divided by
    its Frobenius norm (clamped below at ``eps``), and then iterated
    ``X <- a X + (b A + c A²) X`` with ``A = X Xᵀ``.

    Args:
        G: A matrix ``(m, n)`` or a stack ``(B, m, n)``; a stack is processed with batched
            matmuls and each matrix is normalised by its own norm, so the result
            matches looping over the matrices (bit for bit in bfloat16 on CPU; to
            float32 rounding otherwise, as batched and single BLAS calls may differ).
            ``G`` is not modified.
        schedule_or_coeffs: An ``(a, b, c)`` triple, a per-iteration schedule, or a
            schedule name understood by :func:`resolve_schedule`.
        steps: Number of iterations.
        eps: Lower clamp of the normalising norm (keeps zero input finite).
        dtype: Compute dtype; the result is returned in it.

    Returns:
        A tensor shaped like ``G`` in ``dtype``. It may be a transposed view.

    Raises:
        ValueError: For malformed inputs or coefficients.
    """
    check_input(G)
    check_dtype(dtype)
    schedule = resolve_schedule(schedule_or_coeffs, steps)
    # Work on a copy: the torch reference divides in place, which would clobber a
    # caller's tensor that is already in the compute dtype.
    X = G.to(dtype=dtype, copy=True)
    if X.ndim == 2:
        return _ns_2d(X, schedule, eps)
    return _ns_batched(X, schedule, eps)
