"""Symmetric matrix products that compute only half of the result.

Gram Newton–Schulz spends its inner loop on products whose result is symmetric:

* ``gram(X) = X Xᵀ``,
* ``sym_square(A) = A A`` for symmetric ``A`` (the same as ``A Aᵀ``),
* ``sym_poly2(A, b, c) = b A + c A A`` (the polynomial step, fused),
* ``sym_product(A, B) = A B`` where ``A`` and ``B`` are symmetric *and commute*
  (both are polynomials in the same Gram matrix), so ``A B`` is symmetric too.

Each comes in a plain reference form (full matmul) and a half-work form that computes
one triangle and mirrors it. The half-work backends:

``"blas"`` (CPU, float32/float64; the CPU default)
    NumPy/OpenBLAS on zero-copy views: ``X @ X.T``, which NumPy itself routes to
    ``?syrk`` and mirrors, for the Gram matrix, squares and the polynomial step;
    a lower block-triangular schedule of matmuls for ``sym_product`` from m = 384
    (below that one plain product measured faster).
``"torch"`` (any device)
    The block-triangular schedule with ``torch.matmul`` for everything.
``"triton"`` (CUDA)
    The lower-triangle tile kernel in :mod:`dmuon.ortho.triton_syrk` for the Gram
    matrix and the polynomial step; ``sym_product`` uses the torch schedule.

Which backend is fastest was measured on the development CPU (see
:func:`default_backend`); :func:`uses_half_work` tells which calls actually halve
the work. Those results are exactly symmetric and equal the reference up to
floating-point summation order.

Low-precision inputs (bfloat16/float16) are computed with float32 accumulation and a
float32 result on every backend: on CPU a bfloat16 matmul is several times slower than
float32, and a bfloat16 Gram matrix would discard the small eigenvalues that the
Newton–Schulz polynomial needs to amplify.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator

import torch

try:  # NumPy is optional: without it the CPU falls back to the torch schedule.
    import numpy as _np
except ImportError:  # pragma: no cover - exercised only without numpy
    _np = None

BACKENDS = ("reference", "torch", "blas", "triton")

# Block count of the torch block-triangular schedule: k blocks cost (k+1)/(2k) of a
# full product in k matmuls. 4 blocks (62.5%) keep each matmul large enough to run
# near peak on the sizes Muon sees (m >= 256).
_BLOCKS = 4
# Below this size the torch schedule's extra calls cost more than they save.
_MIN_HALF = 128
# Tile edge for mirroring; transposing whole strips at once thrashes the cache.
_MIRROR_TILE = 256
# NumPy's strided copies prefer narrower strips (measured: 128 beat 32/64/256).
_MIRROR_TILE_NP = 128
# Crossover of the NumPy/BLAS path, measured single-threaded on the development CPU
# (python -m dmuon.bench.ortho_bench --kernels): the block-triangular product beats one
# full gemm from m ~ 384, and 8 blocks beat 4 from m ~ 1024.
_NP_HALF_PRODUCT_MIN = 384


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_square(A: torch.Tensor, name: str) -> None:
    if A.ndim not in (2, 3) or A.shape[-1] != A.shape[-2]:
        raise ValueError(f"{name} must be square (m, m) or (B, m, m), got {tuple(A.shape)}")


def _check_matrix(X: torch.Tensor, name: str) -> None:
    if not isinstance(X, torch.Tensor) or X.ndim not in (2, 3):
        raise ValueError(f"{name} must be a (m, n) or (B, m, n) tensor")


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose from {BACKENDS}")


@functools.lru_cache(maxsize=None)
def _triton_available(device_type: str = "cuda") -> bool:
    try:
        from . import triton_syrk

        return triton_syrk.is_available(device_type)
    except Exception:  # pragma: no cover - import problems mean "not available"
        return False


def default_backend(device: torch.device | str, dtype: torch.dtype = torch.float32) -> str:
    """The fastest half-work backend for a device, as measured during development.

    On the 2-core AMD EPYC development machine (torch 2.13 with MKL, NumPy with
    OpenBLAS 0.3.31) OpenBLAS ``ssyrk``/``sgemm`` through NumPy beat both the torch
    block schedule and the full torch matmul; see
    ``python -m dmuon.bench.ortho_bench --kernels``.

    Args:
        device: Where the operands live.
        dtype: Operand dtype.

    Returns:
        One of ``"blas"``, ``"triton"``, ``"torch"``.
    """
    dev = torch.device(device)
    if dev.type == "cpu" and _np is not None:
        return "blas"
    if dev.type == "cuda" and _triton_available():
        return "triton"
    return "torch"


def _resolve(backend: str | None, T: torch.Tensor) -> str:
    if backend is None:
        backend = default_backend(T.device, T.dtype)
    _check_backend(backend)
    if backend == "blas" and (T.device.type != "cpu" or _np is None):
        backend = "torch"
    # The kernel writes float32; float64 stays on the torch schedule. On CPU it only
    # runs under TRITON_INTERPRET=1 (tests).
    if backend == "triton" and (T.dtype == torch.float64 or not _triton_available(T.device.type)):
        backend = "torch"
    return backend


# ----------------------------------------------------------------------------- mirror


def mirror_lower_(C: torch.Tensor) -> torch.Tensor:
    """Copies the lower triangle of a square matrix onto its upper triangle in place.

    Args:
        C: A contiguous ``(m, m)`` tensor whose lower triangle (with diagonal) is valid.

    Returns:
        ``C``, now exactly symmetric.
    """
    m = C.shape[-1]
    t = _MIRROR_TILE
    for i in range(0, m, t):
        i1 = min(i + t, m)
        for j in range(i1, m, t):
            j1 = min(j + t, m)
            C[i:i1, j:j1] = C[j:j1, i:i1].mT
        blk = C[i:i1, i:i1]
        blk.copy_(torch.tril(blk) + torch.tril(blk, -1).mT)
    return C


# ----------------------------------------------------------------------- references


def gram_reference(X: torch.Tensor) -> torch.Tensor:
    """``X Xᵀ`` by a plain matmul, accumulated in float32 (or float64)."""
    _check_matrix(X, "X")
    X = X.to(_acc_dtype(X.dtype))
    return X @ X.mT


def sym_poly2_reference(A: torch.Tensor, b: float, c: float) -> torch.Tensor:
    """``b A + c A A`` by a fused plain matmul."""
    _check_square(A, "A")
    A = A.to(_acc_dtype(A.dtype))
    if A.ndim == 2:
        return torch.addmm(A, A, A, beta=b, alpha=c)
    return torch.baddbmm(A, A, A, beta=b, alpha=c)


def sym_product_reference(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """``A B`` by a plain matmul (no symmetry assumed)."""
    _check_square(A, "A")
    _check_square(B, "B")
    dt = _acc_dtype(A.dtype)
    return A.to(dt) @ B.to(dt)


# --------------------------------------------------------------------- torch blocks


def _tril_product_torch(A: torch.Tensor, B: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Writes the lower block triangle of ``A @ B`` (block rows times leading columns)."""
    m = A.shape[0]
    k = _BLOCKS
    edges = [round(i * m / k) for i in range(k + 1)]
    for i in range(k):
        r0, r1 = edges[i], edges[i + 1]
        out[r0:r1, :r1] = A[r0:r1] @ B[:, :r1]
    return out


def _gram_torch(X: torch.Tensor) -> torch.Tensor:
    C = torch.empty(X.shape[0], X.shape[0], dtype=X.dtype, device=X.device)
    return mirror_lower_(_tril_product_torch(X, X.mT, C))


def _sym_product_torch(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    C = torch.empty_like(A)
    return mirror_lower_(_tril_product_torch(A, B, C))


# ----------------------------------------------------------------------- BLAS (CPU)


def np_mirror_lower_(C):
    """NumPy twin of :func:`mirror_lower_` (keeps the BLAS path free of torch ops).

    Mixing torch's OpenMP pool and OpenBLAS's pthreads pool inside one loop made
    both spin against each other on a loaded 2-core machine; staying in NumPy
    between BLAS calls avoids the hand-offs.
    """
    m = C.shape[0]
    t = _MIRROR_TILE_NP
    for i in range(0, m, t):
        i1 = min(i + t, m)
        C[i:i1, i1:] = C[i1:, i:i1].T
        blk = C[i:i1, i:i1]
        blk[...] = _np.tril(blk) + _np.tril(blk, -1).T
    return C


def np_gram(X):
    """``X Xᵀ`` of a C-contiguous float32/float64 array.

    NumPy already recognises ``X @ X.T`` on one buffer and calls ?syrk, then mirrors
    in C; that measured as fast as or faster than ?syrk plus our own mirror at every
    size, so it is used as is.
    """
    return X @ X.T


def np_sym_poly2(A, b: float, c: float):
    """``b A + c A A`` for symmetric ``A``: NumPy's ?syrk for ``A Aᵀ``, then the axpy.

    A fused ``scipy.linalg.blas.ssyrk`` (``alpha A Aᵀ + beta C``) was up to ~1.2x
    faster single-threaded from m ~ 768, but SciPy and NumPy ship separate OpenBLAS
    builds: alternating between them put two 2-thread pools on two cores and made
    the multi-threaded loop several times slower. One pool wins.
    """
    S = A @ A.T
    S *= c
    S += b * A
    return S


def np_sym_product(A, B):
    """``A B`` for symmetric commuting ``A``, ``B``: lower block triangle, mirrored."""
    m = A.shape[0]
    if m < _NP_HALF_PRODUCT_MIN:
        return A @ B
    C = _np.empty_like(A)
    k = 8 if m >= 1024 else 4
    edges = [round(i * m / k) for i in range(k + 1)]
    for i in range(k):
        r0, r1 = edges[i], edges[i + 1]
        # Row slices of C-order arrays keep unit inner stride, so matmul writes
        # straight into C through BLAS without temporaries.
        _np.matmul(A[r0:r1], B[:, :r1], out=C[r0:r1, :r1])
    return np_mirror_lower_(C)


_BLAS_LOCK = threading.Lock()
_BLAS_CONTROLLER = None


def _blas_controller():
    global _BLAS_CONTROLLER
    with _BLAS_LOCK:
        if _BLAS_CONTROLLER is None:
            try:
                from threadpoolctl import ThreadpoolController
            except ImportError:  # pragma: no cover - threadpoolctl is a dependency
                _BLAS_CONTROLLER = False
            else:
                _BLAS_CONTROLLER = ThreadpoolController().select(user_api="blas")
        return _BLAS_CONTROLLER


@contextlib.contextmanager
def blas_threads() -> Iterator[None]:
    """Runs NumPy's BLAS with ``torch.get_num_threads()`` threads inside the block.

    NumPy's OpenBLAS sizes its pool from the environment, not from torch: ranks that
    each set ``torch.set_num_threads(k)`` would otherwise each run all cores' worth
    of spinning BLAS threads (measured: 4 gloo ranks on 2 cores spent ~18x longer in
    the Gram path). The previous limit is restored on exit.
    """
    controller = _blas_controller()
    if not controller:
        yield
        return
    with controller.limit(limits=torch.get_num_threads()):
        yield


def _as_np(T: torch.Tensor):
    return T.detach().contiguous().numpy()


def _gram_blas(X: torch.Tensor) -> torch.Tensor:
    with blas_threads():
        return torch.from_numpy(np_gram(_as_np(X)))


def _sym_poly2_blas(A: torch.Tensor, b: float, c: float) -> torch.Tensor:
    with blas_threads():
        return torch.from_numpy(np_sym_poly2(_as_np(A), b, c))


def _sym_product_blas(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    with blas_threads():
        return torch.from_numpy(np_sym_product(_as_np(A), _as_np(B)))


# -------------------------------------------------------------------------- triton


def _gram_triton(X: torch.Tensor) -> torch.Tensor:
    from .triton_syrk import syrk

    return syrk(X)


def _sym_poly2_triton(A: torch.Tensor, b: float, c: float) -> torch.Tensor:
    from .triton_syrk import syrk

    return syrk(A, alpha=c, beta=b, C=A)


# ----------------------------------------------------------------------- dispatch


def _per_matrix(fn: Callable[..., torch.Tensor], *mats: torch.Tensor, **kw) -> torch.Tensor:
    if mats[0].ndim == 2:
        return fn(*mats, **kw)
    return torch.stack([fn(*ms, **kw) for ms in zip(*mats)])


def uses_half_work(op: str, backend: str, m: int) -> bool:
    """Whether ``op`` (``"gram"``, ``"sym_poly2"``, ``"sym_product"``) on an ``m x m``
    result computes one triangle and mirrors it (so the result is exactly symmetric).
    """
    if backend == "reference":
        return False
    if backend == "blas":
        if op == "gram":
            return True  # NumPy's syrk path
        if op == "sym_poly2":
            return True  # syrk either way
        return m >= _NP_HALF_PRODUCT_MIN
    return m >= _MIN_HALF


def gram(X: torch.Tensor, backend: str | None = None) -> torch.Tensor:
    """``X Xᵀ`` computing one triangle only.

    Args:
        X: ``(m, n)`` or ``(B, m, n)``.
        backend: ``None`` for :func:`default_backend`, or one of :data:`BACKENDS`.

    Returns:
        The exactly symmetric ``(m, m)`` (or ``(B, m, m)``) Gram matrix in float32
        (float64 for float64 input).
    """
    _check_matrix(X, "X")
    X = X.to(_acc_dtype(X.dtype))
    backend = _resolve(backend, X)
    if not uses_half_work("gram", backend, X.shape[-2]):
        return gram_reference(X)
    fn = {"blas": _gram_blas, "torch": _gram_torch, "triton": _gram_triton}[backend]
    return _per_matrix(fn, X)


def sym_square(A: torch.Tensor, backend: str | None = None) -> torch.Tensor:
    """``A A`` for symmetric ``A`` (only ``A``'s symmetry is assumed, not checked)."""
    _check_square(A, "A")
    return gram(A, backend)


def sym_poly2(A: torch.Tensor, b: float, c: float, backend: str | None = None) -> torch.Tensor:
    """``b A + c A A`` for symmetric ``A``: the quintic step's polynomial, fused.

    Args:
        A: Symmetric ``(m, m)`` or ``(B, m, m)``.
        b: Coefficient of ``A``.
        c: Coefficient of ``A A``.
        backend: As in :func:`gram`.
    """
    _check_square(A, "A")
    A = A.to(_acc_dtype(A.dtype))
    backend = _resolve(backend, A)
    if not uses_half_work("sym_poly2", backend, A.shape[-1]):
        return sym_poly2_reference(A, b, c)
    if backend == "torch":
        return b * A + c * _per_matrix(_gram_torch, A)
    fn = {"blas": _sym_poly2_blas, "triton": _sym_poly2_triton}[backend]
    return _per_matrix(fn, A, b=b, c=c)


def sym_product(A: torch.Tensor, B: torch.Tensor, backend: str | None = None) -> torch.Tensor:
    """``A B`` for symmetric, commuting ``A`` and ``B`` (so the product is symmetric).

    Only the lower triangle is computed. If the operands do not commute the result is
    the symmetrisation ``tril(A B) + tril(A B, -1)ᵀ``, not ``A B``.
    """
    _check_square(A, "A")
    _check_square(B, "B")
    if A.shape != B.shape:
        raise ValueError(f"shape mismatch {tuple(A.shape)} vs {tuple(B.shape)}")
    dt = _acc_dtype(A.dtype)
    A, B = A.to(dt), B.to(dt)
    backend = _resolve(backend, A)
    if not uses_half_work("sym_product", backend, A.shape[-1]):
        return sym_product_reference(A, B)
    fn = _sym_product_blas if backend == "blas" else _sym_product_torch
    return _per_matrix(fn, A, B)
