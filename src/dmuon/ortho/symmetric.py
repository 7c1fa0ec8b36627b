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

Every function returns float32 (float64 for float64 input) and accumulates in it. The
``dtype`` argument sets the *operand* precision: ``None`` multiplies in the result dtype;
``torch.bfloat16``/``torch.float16`` round the operands to that dtype first so the
product runs on 16-bit matrix units (the GEMM accumulates in float32; torch's matmul
rounds its result to the operand dtype, the Triton kernel writes float32 directly).
NumPy has no 16-bit GEMM, so 16-bit operands take the torch schedule on CPU.
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


@functools.lru_cache(maxsize=8)
def _lower_mask(m: int, device: torch.device) -> torch.Tensor:
    # One bool per element (m² bytes, 16 MiB at m = 4096): built once per size and device
    # so a mirror costs one kernel launch. Few distinct sizes occur per model.
    return torch.ones(m, m, dtype=torch.bool, device=device).tril_()


def mirror_lower(C: torch.Tensor) -> torch.Tensor:
    """The symmetric matrix whose lower triangle (with diagonal) is ``C``'s, in one operation.

    Args:
        C: ``(m, m)`` or ``(B, m, m)``; only its lower triangle is read, so the upper
            one may hold anything (uninitialised memory included: ``where`` does not
            propagate the values it does not select).

    Returns:
        A new, exactly symmetric tensor.
    """
    return torch.where(_lower_mask(C.shape[-1], C.device), C, C.mT)


# ----------------------------------------------------------------------- references


def _operand_dtype(T: torch.Tensor, dtype: torch.dtype | None) -> tuple[torch.dtype, torch.dtype]:
    """(operand dtype, result dtype) of a product of ``T`` with operand precision ``dtype``."""
    acc = _acc_dtype(T.dtype)
    if dtype is None or acc == torch.float64:
        return acc, acc  # float64 state is the exact reference: never rounded to 16 bits
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"unsupported operand dtype {dtype}")
    return dtype, acc


def gram_reference(X: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``X Xᵀ`` by a plain matmul with ``dtype`` operands, returned in float32 (or float64)."""
    _check_matrix(X, "X")
    op, acc = _operand_dtype(X, dtype)
    X = X.to(op)
    return (X @ X.mT).to(acc)


def sym_poly2_reference(A: torch.Tensor, b: float, c: float, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``b A + c A A`` by a plain matmul (fused when operands and result share a dtype)."""
    _check_square(A, "A")
    op, acc = _operand_dtype(A, dtype)
    A = A.to(acc)
    if op == acc:
        if A.ndim == 2:
            return torch.addmm(A, A, A, beta=b, alpha=c)
        return torch.baddbmm(A, A, A, beta=b, alpha=c)
    # The addend stays in the result dtype: rounding b A to 16 bits would cost more
    # accuracy than the product's operand rounding.
    A16 = A.to(op)
    return torch.add(A * b, (A16 @ A16).to(acc), alpha=c)


def sym_product_reference(A: torch.Tensor, B: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``A B`` by a plain matmul (no symmetry assumed)."""
    _check_square(A, "A")
    _check_square(B, "B")
    op, acc = _operand_dtype(A, dtype)
    return (A.to(op) @ B.to(op)).to(acc)


# --------------------------------------------------------------------- torch blocks


def _tril_product_torch(A: torch.Tensor, B: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """The lower triangle of ``A @ B`` (2-D or batched), mirrored onto the upper one.

    Block row ``i`` times the leading ``r1`` columns covers every element on or below
    the diagonal; the copy into ``C`` also converts a 16-bit product to ``acc``.
    """
    m = A.shape[-2]
    k = _BLOCKS
    edges = [round(i * m / k) for i in range(k + 1)]
    C = torch.empty(*A.shape[:-1], m, dtype=acc, device=A.device)
    for i in range(k):
        r0, r1 = edges[i], edges[i + 1]
        C[..., r0:r1, :r1] = A[..., r0:r1, :] @ B[..., :, :r1]
    return mirror_lower(C)


def _gram_torch(X: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    return _tril_product_torch(X, X.mT, acc)


def _sym_product_torch(A: torch.Tensor, B: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    return _tril_product_torch(A, B, acc)


# ----------------------------------------------------------------------- BLAS (CPU)


def np_mirror_lower_(C):
    """NumPy counterpart of :func:`mirror_lower`, in place (keeps the BLAS path free of torch ops).

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


def _sym_poly2_triton(A16: torch.Tensor, A: torch.Tensor, b: float, c: float) -> torch.Tensor:
    from .triton_syrk import syrk

    # The product reads the (possibly 16-bit) operands, the addend the float32 state.
    return syrk(A16, alpha=c, beta=b, C=A)


# ----------------------------------------------------------------------- dispatch


def _per_matrix(fn: Callable[..., torch.Tensor], *mats: torch.Tensor, **kw) -> torch.Tensor:
    # NumPy kernels take one matrix at a time.
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


def _resolve_for(backend: str | None, T: torch.Tensor, op: torch.dtype) -> str:
    backend = _resolve(backend, T)
    if backend == "blas" and op not in (torch.float32, torch.float64):
        backend = "torch"  # NumPy has no 16-bit GEMM
    return backend


def gram(X: torch.Tensor, backend: str | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``X Xᵀ`` computing one triangle only.

    Args:
        X: ``(m, n)`` or ``(B, m, n)``.
        backend: ``None`` for :func:`default_backend`, or one of :data:`BACKENDS`.
        dtype: Operand precision (see the module docstring); ``None`` for the result dtype.

    Returns:
        The exactly symmetric ``(m, m)`` (or ``(B, m, m)``) Gram matrix in float32
        (float64 for float64 input).
    """
    _check_matrix(X, "X")
    op, acc = _operand_dtype(X, dtype)
    X = X.to(op)
    backend = _resolve_for(backend, X, op)
    if not uses_half_work("gram", backend, X.shape[-2]):
        return gram_reference(X, op)
    if backend == "blas":
        return _per_matrix(_gram_blas, X)
    if backend == "triton":
        return _gram_triton(X)
    return _gram_torch(X, acc)


def sym_square(A: torch.Tensor, backend: str | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``A A`` for symmetric ``A`` (only ``A``'s symmetry is assumed, not checked)."""
    _check_square(A, "A")
    return gram(A, backend, dtype)


def sym_poly2(A: torch.Tensor, b: float, c: float, backend: str | None = None,
              dtype: torch.dtype | None = None) -> torch.Tensor:
    """``b A + c A A`` for symmetric ``A``: the quintic step's polynomial, fused.

    Args:
        A: Symmetric ``(m, m)`` or ``(B, m, m)``.
        b: Coefficient of ``A`` (the addend ``b A`` is formed in the result dtype).
        c: Coefficient of ``A A``.
        backend: As in :func:`gram`.
        dtype: Operand precision of ``A A``, as in :func:`gram`.
    """
    _check_square(A, "A")
    op, acc = _operand_dtype(A, dtype)
    A = A.to(acc)
    backend = _resolve_for(backend, A, op)
    if not uses_half_work("sym_poly2", backend, A.shape[-1]):
        return sym_poly2_reference(A, b, c, op)
    if backend == "torch":
        A16 = A.to(op)
        return torch.add(A * b, _gram_torch(A16, acc), alpha=c)
    if backend == "triton":
        return _sym_poly2_triton(A.to(op), A, b, c)
    return _per_matrix(_sym_poly2_blas, A, b=b, c=c)


def sym_product(A: torch.Tensor, B: torch.Tensor, backend: str | None = None,
                dtype: torch.dtype | None = None) -> torch.Tensor:
    """``A B`` for symmetric, commuting ``A`` and ``B`` (so the product is symmetric).

    Only the lower triangle is computed. If the operands do not commute the result is
    the symmetrisation ``tril(A B) + tril(A B, -1)ᵀ``, not ``A B``. ``dtype`` is the
    operand precision, as in :func:`gram`.
    """
    _check_square(A, "A")
    _check_square(B, "B")
    if A.shape != B.shape:
        raise ValueError(f"shape mismatch {tuple(A.shape)} vs {tuple(B.shape)}")
    op, acc = _operand_dtype(A, dtype)
    A, B = A.to(op), B.to(op)
    backend = _resolve_for(backend, A, op)
    if not uses_half_work("sym_product", backend, A.shape[-1]):
        return sym_product_reference(A, B, op)
    if backend == "blas":
        return _per_matrix(_sym_product_blas, A, B)
    return _sym_product_torch(A, B, acc)
