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


def gram_ns_flops(shape: tuple[int, int], steps: int = 5, restart_every: int = 3, symmetric: bool = True) -> float:
    """FLOPs of Gram Newton-Schulz (:func:`dmuon.ortho.gram.gram_newton_schulz`) on a matrix.

    Counts the products of ``_gram_ns_core`` as it runs them, with ``m <= n``
    after transposing: the Gram matrix ``X Xᵀ`` (2m²n), per step the
    polynomial ``p(R)`` (one m x m product, 2m³), the accumulated factor
    ``Q p(R)`` (from the second step of each restart period), and, unless the
    step is the last or a restart follows, ``R p(R)²`` (a square and a
    product); every ``restart_every`` steps ``Q X`` (2m²n) and a new Gram
    matrix; at the end ``Q X``. ``symmetric``: every product with a symmetric
    result (all but ``Q X``) computes one triangle, half the work
    (:mod:`dmuon.ortho.symmetric`; the block-triangular schedules do 56-63%,
    counted as 50%). Five steps restarting every 3 (the bf16 default):
    ``6 m²n + 14 m³`` with symmetric products, against :func:`ns_flops`'
    ``20 m²n + 10 m³``: 0.39x for a 3584x18944 matrix, 0.67x for a square one.
    """
    m, n = sorted(shape)
    share = 0.5 if symmetric else 1.0
    gram, product = share * 2.0 * m * m * n, share * 2.0 * m**3
    flops = gram
    have_q = False
    for i in range(steps):
        if restart_every > 0 and i > 0 and i % restart_every == 0 and have_q:
            flops += 2.0 * m * m * n + gram  # fold Q into X, recompute R
            have_q = False
        flops += product  # P = a I + b R + c R²
        if have_q:
            flops += product  # Q <- Q P
        have_q = True
        if i != steps - 1 and not (restart_every > 0 and (i + 1) % restart_every == 0):
            flops += 2 * product  # R <- R P² (a square, then a product)
    return flops + 2.0 * m * m * n  # Q X
