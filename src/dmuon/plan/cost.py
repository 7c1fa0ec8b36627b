"""Analytical cost model for the owner-side update of one matrix.

Used to balance owners before anything has been measured. The unit is
floating-point operations; only ratios between matrices matter.
"""

from __future__ import annotations


def ns_flops(shape: tuple[int, int], steps: int = 5) -> float:
    """FLOPs of ``steps`` quintic Newton-Schulz iterations on a matrix.

    With ``m <= n`` after transposing, one iteration is ``X Xᵀ`` (2m²n),
    ``B = bA + cA²`` (2m³) and ``aX + BX`` (2m²n).
    """
    m, n = sorted(shape)
    return float(steps) * (4.0 * m * m * n + 2.0 * m**3)


def update_cost(shape: tuple[int, int], steps: int = 5) -> float:
    """Estimated cost of one owner's work for a matrix: NS plus a few elementwise passes
    (assembling the direction's pieces, splitting the update)."""
    m, n = shape
    elementwise = 12.0 * m * n
    return ns_flops(shape, steps) + elementwise
