"""A Triton SYRK kernel: ``C = alpha A Aᵀ + beta C0`` computing lower-triangle tiles only.

The launch grid enumerates only the ``T (T + 1) / 2`` tiles on or below the diagonal of
the ``T x T`` tile grid; each program accumulates its tile in float32 and writes it
twice — at ``(i, j)`` and transposed at ``(j, i)`` — so the full symmetric result comes
out of one pass with half the multiply-adds of a general matmul. On the diagonal tiles
only the lower triangle is written directly and mirrored, so the result is exactly
symmetric.

Importing this module never fails: without Triton, :func:`is_available` is ``False``
and :func:`syrk` raises ``RuntimeError``. With ``TRITON_INTERPRET=1`` the kernel runs on
CPU tensors through Triton's interpreter (used by the tests); CUDA launches go through
``triton.autotune`` over tile sizes.
"""

from __future__ import annotations

import contextlib
import os

import torch

try:
    import triton
    import triton.language as tl

    _HAVE_TRITON = True
except Exception:  # ImportError, or a broken install
    triton = None
    tl = None
    _HAVE_TRITON = False


def interpreting() -> bool:
    """Whether Triton runs in interpreter mode (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def is_available(device: torch.device | str | None = None) -> bool:
    """Whether :func:`syrk` can run on ``device`` (default: CUDA)."""
    if not _HAVE_TRITON:
        return False
    dev = torch.device(device) if device is not None else torch.device("cuda")
    if dev.type == "cpu":
        return interpreting()
    return dev.type == "cuda" and torch.cuda.is_available()


# (BLOCK, BLOCK_K, num_warps, num_stages). Tiles are square because the triangular
# enumeration needs row and column tiles to coincide.
TILE_CONFIGS = (
    (32, 32, 4, 2),
    (64, 32, 4, 3),
    (64, 64, 4, 3),
    (128, 32, 8, 3),
    (128, 64, 8, 3),
)
# Small enough for the interpreter, valid for every dtype.
INTERPRET_CONFIG = (32, 32, 4, 1)

if _HAVE_TRITON:

    @triton.jit
    def _syrk_kernel(
        a_ptr, c0_ptr, c_ptr,
        M, K,
        stride_ab, stride_am, stride_ak,
        stride_c0b, stride_c0m, stride_c0n,
        stride_cb, stride_cm, stride_cn,
        alpha, beta,
        HAS_C0: tl.constexpr,
        IEEE: tl.constexpr,
        UPCAST: tl.constexpr,
        BLOCK: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        pid = tl.program_id(0)
        # Map the linear id to the lower-triangle tile (ti, tj), tj <= ti. The float
        # root can be off by one for large ids, so correct it with integer checks.
        ti = ((tl.sqrt(8.0 * pid + 1.0) - 1.0) * 0.5).to(tl.int32)
        ti = tl.where((ti + 1) * (ti + 2) // 2 <= pid, ti + 1, ti)
        ti = tl.where(ti * (ti + 1) // 2 > pid, ti - 1, ti)
        tj = pid - ti * (ti + 1) // 2
        # Axis 1 is the matrix of a (B, M, K) stack. Offsets are 64-bit: row * stride
        # reaches 2**31 once M*K or M*M does (M >= 46341 for a square result).
        batch = tl.program_id(1).to(tl.int64)
        a_ptr += batch * stride_ab
        c0_ptr += batch * stride_c0b
        c_ptr += batch * stride_cb

        rows = ti.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        cols = tj.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ks = tl.arange(0, BLOCK_K)
        a_rows = a_ptr + rows[:, None] * stride_am + ks[None, :] * stride_ak
        a_cols = a_ptr + cols[None, :] * stride_am + ks[:, None] * stride_ak
        acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kmask = (k0 + ks) < K
            x = tl.load(a_rows, mask=(rows[:, None] < M) & kmask[None, :], other=0.0)
            y = tl.load(a_cols, mask=(cols[None, :] < M) & kmask[:, None], other=0.0)
            if UPCAST:
                # The interpreter's dot mishandles 16-bit floats; bf16 products are exact
                # in float32, so upcasting first gives the same math.
                x = x.to(tl.float32)
                y = y.to(tl.float32)
            if IEEE:
                acc += tl.dot(x, y, input_precision="ieee")
            else:
                acc += tl.dot(x, y)
            a_rows += BLOCK_K * stride_ak
            a_cols += BLOCK_K * stride_ak
        acc = acc * alpha
        inb = (rows[:, None] < M) & (cols[None, :] < M)
        if HAS_C0:
            c0 = tl.load(c0_ptr + rows[:, None] * stride_c0m + cols[None, :] * stride_c0n, mask=inb, other=0.0)
            acc += beta * c0.to(tl.float32)
        lower = rows[:, None] >= cols[None, :]
        tl.store(c_ptr + rows[:, None] * stride_cm + cols[None, :] * stride_cn, acc, mask=inb & lower)
        strict = rows[:, None] > cols[None, :]
        # Mirrored write: element (r, s) of the tile also lands at (s, r).
        tl.store(c_ptr + cols[None, :] * stride_cm + rows[:, None] * stride_cn, acc, mask=inb & strict)

    def _make_autotuned():
        configs = [
            triton.Config({"BLOCK": b, "BLOCK_K": bk}, num_warps=w, num_stages=s)
            for b, bk, w, s in TILE_CONFIGS
        ]
        # Keyed by dtype too: triton.autotune appends the argument dtypes to its cache key.
        return triton.autotune(configs=configs, key=["M", "K", "HAS_C0", "IEEE", "UPCAST"])(_syrk_kernel)

    _syrk_autotuned = None


def _tiles(m: int, block: int) -> int:
    t = -(-m // block)
    return t * (t + 1) // 2


def _flags(A: torch.Tensor, C: torch.Tensor | None, allow_tf32: bool) -> tuple[bool, bool, bool]:
    """(HAS_C0, IEEE, UPCAST) for a call: what the compiled kernel, and its tuning, depend on."""
    upcast = interpreting() and A.dtype != torch.float32
    ieee = (A.dtype == torch.float32 and not allow_tf32) or upcast
    return C is not None, ieee, upcast


# Reads better whole: one kernel launch, its checks and its pinned-or-autotuned tile choice side by side.
def syrk(
    A: torch.Tensor,
    alpha: float = 1.0,
    beta: float = 0.0,
    C: torch.Tensor | None = None,
    *,
    allow_tf32: bool = False,
    config: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """``alpha A Aᵀ + beta C`` for ``A`` of shape ``(m, k)`` or ``(B, m, k)``, as a new float32 tensor.

    Args:
        A: ``(m, k)`` or ``(B, m, k)`` tensor on CUDA (or CPU under ``TRITON_INTERPRET=1``);
            float32, bfloat16 or float16 (16-bit operands accumulate in float32).
        alpha: Scale of ``A Aᵀ``.
        beta: Scale of ``C``; ignored when ``C`` is ``None``.
        C: Optional symmetric ``(m, m)`` (``(B, m, m)``) addend; only its lower triangle is read.
        allow_tf32: Allow TF32 products for float32 ``A`` (faster, ~1e-3 relative error).
        config: A fixed ``(BLOCK, BLOCK_K, num_warps, num_stages)`` instead of autotuning.

    Returns:
        The exactly symmetric float32 result, ``(m, m)`` or ``(B, m, m)``.

    Raises:
        RuntimeError: If Triton cannot run on ``A``'s device.
        ValueError: For bad shapes.
    """
    if not is_available(A.device):
        raise RuntimeError("Triton SYRK is not available on this device")
    if A.ndim not in (2, 3):
        raise ValueError(f"A must be 2-D or 3-D, got shape {tuple(A.shape)}")
    batched = A.ndim == 3
    A3 = A if batched else A[None]
    nb, M, K = A3.shape
    if C is not None and tuple(C.shape) != (*A.shape[:-2], M, M):
        raise ValueError(f"C must be {(*A.shape[:-2], M, M)}, got {tuple(C.shape)}")
    out = torch.empty(nb, M, M, dtype=torch.float32, device=A.device)
    has_c0, ieee, upcast = _flags(A, C, allow_tf32)
    c0 = (C if batched else C[None]) if has_c0 else out
    args = (
        A3, c0, out, M, K,
        A3.stride(0), A3.stride(1), A3.stride(2), c0.stride(0), c0.stride(1), c0.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        float(alpha), float(beta),
    )
    if config is None:
        config = _pinned.get(_key(M, K, A.dtype, has_c0, ieee))
    if interpreting() or config is not None:
        block, block_k, warps, stages = config or INTERPRET_CONFIG
        with on_device(A.device):
            _syrk_kernel[(_tiles(M, block), nb)](
                *args, HAS_C0=has_c0, IEEE=ieee, UPCAST=upcast, BLOCK=block, BLOCK_K=block_k,
                num_warps=warps, num_stages=stages,
            )
    else:
        global _syrk_autotuned
        if _syrk_autotuned is None:
            _syrk_autotuned = _make_autotuned()
        with on_device(A.device):  # the autotuner's trial launches too
            _syrk_autotuned[lambda meta: (_tiles(M, meta["BLOCK"]), nb)](*args, HAS_C0=has_c0, IEEE=ieee,
                                                                         UPCAST=False)
    return out if batched else out[0]


def on_device(device: torch.device):
    """Where every Triton launch runs: the tensors' CUDA device.

    Triton launches on the calling thread's current CUDA device, not the arguments'. The NS worker
    enters the plan's device, but ``step()`` and the tuning at build run on the caller's thread: a
    script with ``model.to(rank)`` and no ``torch.cuda.set_device`` would launch rank k's kernels on
    cuda:0 (an illegal address, or another rank's device). A CPU tensor (Triton's interpreter) needs
    nothing.
    """
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()


# Tile configurations restored from the dmuon autotune cache, keyed like the tuning:
# (M, K, dtype, HAS_C0, IEEE) -> config.
_pinned: dict[tuple, tuple[int, int, int, int]] = {}


def _key(M: int, K: int, dtype: torch.dtype, has_c0: bool, ieee: bool) -> tuple:
    return (int(M), int(K), str(dtype).replace("torch.", ""), bool(has_c0), bool(ieee))


def pin_config(M: int, K: int, config: tuple[int, int, int, int], dtype: torch.dtype = torch.float32,
               has_c0: bool = False, ieee: bool = True) -> None:
    """Uses ``config`` for ``(M, K)`` problems of this dtype and flags instead of autotuning.

    The defaults describe the float32 Gram matrix ``X Xᵀ`` (no addend, IEEE products).
    """
    if len(config) != 4 or not all(isinstance(v, int) and v > 0 for v in config):
        raise ValueError(f"config must be four positive ints, got {config!r}")
    _pinned[_key(M, K, dtype, has_c0, ieee)] = tuple(config)


def best_config(M: int, K: int, dtype: torch.dtype = torch.float32, has_c0: bool = False,
                ieee: bool = True) -> tuple[int, int, int, int] | None:
    """The tile configuration in use for an ``(M, K)`` problem of this dtype and flags, if known.

    Either a pinned one or the one ``triton.autotune`` settled on in this process: a
    configuration tuned for another dtype or for the fused addend is not returned.
    """
    key = _key(M, K, dtype, has_c0, ieee)
    if key in _pinned:
        return _pinned[key]
    if not _HAVE_TRITON or _syrk_autotuned is None:
        return None
    # triton.autotune's cache key: the values of its key arguments (M, K, HAS_C0, IEEE,
    # UPCAST) followed by the dtypes of the tensor arguments (a first).
    for k, cfg in getattr(_syrk_autotuned, "cache", {}).items():
        k = tuple(k)
        if k[:4] == (M, K, has_c0, ieee) and len(k) > 5 and k[5] == str(dtype):
            kw = cfg.kwargs
            return (kw["BLOCK"], kw["BLOCK_K"], cfg.num_warps, cfg.num_stages)
    return None
