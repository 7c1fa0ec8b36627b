"""Gram Newton–Schulz: the quintic iteration carried out in the small Gram space.

For ``X`` of shape ``(m, n)`` with ``m <= n`` every Newton–Schulz step is
``X <- p(R) X`` with ``R = X Xᵀ`` and ``p(R) = a I + b R + c R²``. All the ``p(R_k)`` are
polynomials in the initial Gram matrix, so they are symmetric and commute. Hence the
iteration can run on ``m x m`` matrices only::

    Q <- p(R) Q                 (Q starts at I; Q is the accumulated left factor)
    R <- p(R) R p(R) = R p(R)²  (the Gram matrix of the new iterate)

and the result is ``Q X`` — one ``(m, m) x (m, n)`` product instead of two per step.
Every product above has a symmetric result, so the half-work kernels of
:mod:`dmuon.ortho.symmetric` apply to all of them.

In finite precision ``R`` and ``Q`` drift away from the Gram matrix of ``Q X``: the
error in ``R`` is absolute (about ``eps * |R|``), while the polynomial amplifies the
smallest eigenvalues by ``a`` per step. A *restart* every ``restart_every`` steps
folds ``Q`` into ``X`` and recomputes ``R`` from it, which bounds that drift.

Precision. The state (``X``, ``R``, ``P``, ``Q``) is float32 (float64 for float64
output); each product may round its operands to 16 bits so it runs on 16-bit matrix
units with float32 accumulation. Which products may, per output dtype, is
:func:`gram_precision`'s table, set by the accuracy bar against the standard iteration
and a float64 SVD (``tests/test_accuracy.py``). ``precision="float32"`` runs every
product in float32: the plain reference beside the mixed path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import symmetric as sym
from .coefficients import CoefficientSpec, KELLER, resolve_schedule
from .newton_schulz import check_dtype, check_input

# Restart cadence when the caller does not choose one. Measured against a float64
# reference (tests/test_gram.py, tests/test_accuracy.py): without restarts heavy-tailed
# spectra lose ~1e-3..1e-2 relative accuracy with Polar Express coefficients; one
# restart (every 3 steps) brings that to <1e-3, below bfloat16 output rounding, and
# every 2 steps matches the standard float32 path (~1e-4). So low-precision outputs
# restart every 3 steps and float32/float64 outputs every 2.
RESTART_EVERY_LOW_PRECISION = 3
RESTART_EVERY_FULL_PRECISION = 2
# With 16-bit operands in the m x m products the Gram matrix drifts faster: every 3
# steps missed the bar where every 2 did not (gram_precision).
RESTART_EVERY_16BIT_PRODUCTS = 2


# Below this many rows a (B, m, n) stack on CPU runs as batched torch ops.
_SMALL_STACK_M = 128
# Below this many rows a multi-threaded CPU runs the Gram loop on torch (see gram_newton_schulz).
_MULTITHREAD_BLAS_M = 512


def default_restart_every(dtype: torch.dtype, precision: str = "mixed") -> int:
    """The restart cadence used when ``restart_every`` is ``None``."""
    prec = gram_precision(dtype, precision)
    acc = _acc_dtype(dtype)
    if prec.inner != acc or prec.evolve != acc:
        return RESTART_EVERY_16BIT_PRODUCTS
    if dtype in (torch.bfloat16, torch.float16):
        return RESTART_EVERY_LOW_PRECISION
    return RESTART_EVERY_FULL_PRECISION


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


PRECISIONS = ("mixed", "float32")


@dataclass(frozen=True)
class GramPrecision:
    """Operand dtype of each kind of product; all accumulate into float32 (float64) state.

    Attributes:
        gram: ``X Xᵀ``, at the start and after each restart.
        restart: ``Q X``, folding the factor into the iterate at a restart.
        inner: The ``m x m`` products of the polynomial and the factor: ``R²``, ``Q P``.
        evolve: The ``m x m`` products that carry the Gram matrix to the next step:
            ``P²`` and ``R P²``.
        final: The result ``Q X``; its output dtype is the requested one.
    """

    gram: torch.dtype
    restart: torch.dtype
    inner: torch.dtype
    evolve: torch.dtype
    final: torch.dtype


def gram_precision(dtype: torch.dtype, precision: str = "mixed") -> GramPrecision:
    """The operand dtypes :func:`gram_newton_schulz` uses for output ``dtype``.

    The mixed table is what passes the accuracy bar (``tests/test_accuracy.py``: the
    Gram result no farther from the float32 standard iteration than the standard
    iteration in ``dtype`` is), measured over the bar's shapes and spectra with
    Keller's and Polar Express coefficients at the default restart cadence (worst
    case, in units of the bar):

    * bfloat16 output: the final ``Q X`` in bfloat16 passes (0.71, every check).
      Every mix with 16-bit ``m x m`` products fails some case of the bar: bfloat16
      operands by 1.9-4.2x (7 mantissa bits compound through ``Q``); float16 operands
      (the reference implementations' choice) in all four, or only in ``R²`` and
      ``Q P``, pass the distance (0.54-0.58 restarting every 2 steps, 0.76-1.38 every
      3) but fail the singular-value checks on one case each (Polar Express, 32x256
      Student-t or 256x1024 Gaussian/power law); 16-bit operands in ``X Xᵀ`` or the
      restart ``Q X`` fail or diverge with Polar Express (heavy-tailed ``X`` entries
      underflow float16; the restart exists to wash out that rounding).
    * float16 output: the final ``Q X`` in float16 passes (0.64); float16 ``m x m``
      products miss float16's ~8x tighter bar by 2-6x.
    * float32/float64 output, or ``precision="float32"``: every product in float32
      (float64 for float64 output).
    """
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose from {PRECISIONS}")
    acc = _acc_dtype(dtype)
    if precision == "float32" or dtype not in (torch.bfloat16, torch.float16):
        return GramPrecision(acc, acc, acc, acc, acc)
    return GramPrecision(acc, acc, acc, acc, dtype)


class _TorchOps:
    """Tensor kernels for the Gram loop (any device; 2-D or batched)."""

    def __init__(self, backend: str, prec: GramPrecision):
        self.backend = backend
        self.prec = prec

    def gram(self, X):
        return sym.gram(X, self.backend, self.prec.gram)

    def poly2(self, R, b, c):
        return sym.sym_poly2(R, b, c, self.backend, self.prec.inner)

    def square(self, P):
        return sym.sym_square(P, self.backend, self.prec.evolve)

    def product(self, A, B):
        return sym.sym_product(A, B, self.backend, self.prec.inner)

    def evolve(self, R, S):
        return sym.sym_product(R, S, self.backend, self.prec.evolve)

    def matmul(self, A, B):
        d = self.prec.restart
        return A.to(d) @ B.to(d)

    def final(self, A, B):
        return _final_product(A, B, self.prec)

    def add_identity_(self, Z, a):
        Z.diagonal(dim1=-2, dim2=-1).add_(a)
        return Z


class _NumpyOps:
    """NumPy/SciPy-BLAS kernels for one CPU matrix.

    The whole loop stays in NumPy so no torch op runs between BLAS calls (see
    :func:`dmuon.ortho.symmetric.np_mirror_lower_`). OpenBLAS sgemm was also ~1.1-1.3x
    faster than torch's MKL sgemm for the tall ``Q X`` products on the AMD
    development CPU.
    """

    gram = staticmethod(sym.np_gram)
    poly2 = staticmethod(sym.np_sym_poly2)
    square = staticmethod(sym.np_gram)  # A A == A Aᵀ for symmetric A
    product = staticmethod(sym.np_sym_product)
    evolve = staticmethod(sym.np_sym_product)

    @staticmethod
    def matmul(A, B):
        return A @ B

    @staticmethod
    def add_identity_(Z, a):
        Z.flat[:: Z.shape[0] + 1] += a
        return Z


def _final_product(Q: torch.Tensor, X: torch.Tensor, prec: GramPrecision) -> torch.Tensor:
    d = prec.final
    return Q.to(d) @ X.to(d)


def _gram_ns_core(X, schedule, restart_every: int, ops, final):
    """Runs the Gram iteration on a normalised, wide (m <= n) float32/64 iterate.

    Returns ``final(Q, X)``.
    """
    n_steps = len(schedule)
    if n_steps == 0:
        return X
    R = ops.gram(X)
    Q = None
    for i, (a, b, c) in enumerate(schedule):
        if restart_every > 0 and i > 0 and i % restart_every == 0 and Q is not None:
            X = ops.matmul(Q, X)
            R = ops.gram(X)
            Q = None
        P = ops.add_identity_(ops.poly2(R, b, c), a)
        Q = P if Q is None else ops.product(Q, P)
        last = i == n_steps - 1
        restart_next = restart_every > 0 and (i + 1) % restart_every == 0
        if not last and not restart_next:
            # p(R) R p(R) = R p(R)² because the factors commute; the square is a syrk.
            R = ops.evolve(R, ops.square(P))
    return final(Q, X)


def _checked_restart_every(restart_every: int | None, dtype: torch.dtype, precision: str) -> int:
    """``restart_every``, :func:`default_restart_every` for ``None``; refuses anything but a non-negative int."""
    if restart_every is None:
        restart_every = default_restart_every(dtype, precision)
    if isinstance(restart_every, bool) or not isinstance(restart_every, int) or restart_every < 0:
        raise ValueError(f"restart_every must be a non-negative int, got {restart_every!r}")
    return restart_every


def _pick_backend(backend: str | None, X: torch.Tensor, prec, acc: torch.dtype) -> str:
    """The symmetric products' backend for the normalised ``X``: ``backend`` if given, else the fastest
    for its device and size; ``"blas"`` only where every product's operands are in ``acc``."""
    if backend is None and X.ndim == 3 and X.device.type == "cpu" and X.shape[-2] < _SMALL_STACK_M:
        # Stacks of small matrices: one batched torch call per step beats a Python loop
        # over per-matrix BLAS calls (64 x 32x128: ~2.8x); from m ~ 128 the loop wins.
        backend = "reference"
    if (backend is None and X.device.type == "cpu" and X.shape[-2] < _MULTITHREAD_BLAS_M
            and torch.get_num_threads() > 1):
        # Multi-threaded OpenBLAS loses to torch's full products below this size
        # (2 threads, 256x1024: 18.6 ms vs 11.0 ms); single-threaded it wins at every size.
        backend = "reference"
    backend = sym._resolve(backend, X)
    if backend == "blas" and any(d != acc for d in (prec.gram, prec.restart, prec.inner, prec.evolve)):
        backend = "torch"  # NumPy has no 16-bit GEMM
    return backend


def _run_gram_ns(X: torch.Tensor, schedule, restart_every: int, backend: str, prec) -> torch.Tensor:
    """The iteration on the normalised, wide ``X`` (a matrix or a stack) with ``backend``'s kernels."""
    if backend == "blas":
        # Per matrix: these kernels are per matrix anyway, and one matrix's state stays
        # hot in cache through all steps. The final product may be 16-bit: torch's.
        def final(Q, Xn):
            return _final_product(torch.from_numpy(Q), torch.from_numpy(Xn), prec)

        mats = X.numpy() if X.ndim == 3 else X.numpy()[None]
        with sym.blas_threads():
            outs = [torch.as_tensor(_gram_ns_core(x, schedule, restart_every, _NumpyOps, final)) for x in mats]
        return torch.stack(outs) if X.ndim == 3 else outs[0]
    # Stacks run batched: every torch and Triton kernel here takes (B, m, n).
    ops = _TorchOps(backend, prec)
    return _gram_ns_core(X, schedule, restart_every, ops, ops.final)


def gram_newton_schulz(
    G: torch.Tensor,
    schedule_or_coeffs: CoefficientSpec = KELLER,
    steps: int = 5,
    eps: float = 1e-7,
    dtype: torch.dtype = torch.bfloat16,
    *,
    restart_every: int | None = None,
    backend: str | None = None,
    precision: str = "mixed",
) -> torch.Tensor:
    """Approximately orthogonalises ``G`` with Newton–Schulz run in the Gram space.

    Mathematically identical to :func:`dmuon.ortho.newton_schulz.newton_schulz`; the
    difference is cost (``O(m³)`` per step instead of ``O(m² n)``) and rounding.

    Args:
        G: A matrix ``(m, n)`` or a stack ``(B, m, n)``. ``G`` is not modified.
        schedule_or_coeffs: An ``(a, b, c)`` triple, a schedule, or a schedule name.
        steps: Number of iterations.
        eps: Lower clamp of each matrix's normalising Frobenius norm.
        dtype: Dtype of the result. The state is float32 (float64 if ``dtype`` is
            float64); for 16-bit ``dtype`` some products take 16-bit operands
            (:func:`gram_precision`).
        restart_every: Fold the accumulated factor into ``X`` and recompute the Gram
            matrix every this many steps; ``0`` never restarts; ``None`` picks
            :func:`default_restart_every` for ``dtype`` and ``precision``.
        backend: Kernel backend for the symmetric products: ``None`` picks the fastest
            for the device (:func:`dmuon.ortho.symmetric.default_backend`);
            ``"reference"`` uses plain full matmuls.
        precision: ``"mixed"`` for :func:`gram_precision`'s table, ``"float32"`` for
            float32 operands in every product (the reference for the mixed path).

    Returns:
        A tensor shaped like ``G`` in ``dtype``.

    Raises:
        ValueError: For malformed inputs, coefficients, or options.
    """
    check_input(G)
    check_dtype(dtype)
    schedule = resolve_schedule(schedule_or_coeffs, steps)
    restart_every = _checked_restart_every(restart_every, dtype, precision)
    if backend is not None:
        sym._check_backend(backend)
    prec = gram_precision(dtype, precision)
    acc = _acc_dtype(dtype)
    X = G.detach().to(acc)
    transposed = X.size(-2) > X.size(-1)
    if transposed:
        X = X.mT
    X = X / torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True).clamp(min=eps)
    X = X.contiguous()
    out = _run_gram_ns(X, schedule, restart_every, _pick_backend(backend, X, prec, acc), prec)
    if transposed:
        out = out.mT
    return out.to(dtype)
