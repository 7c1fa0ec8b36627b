import os
import subprocess
import sys

import pytest
import torch

from dmuon.ortho import symmetric as sym

BACKENDS = ["reference", "torch"] + (["blas"] if sym._np is not None else [])
# Sizes below and above the half-work threshold, and ones not divisible by the blocks.
SIZES = [5, 127, 130, 301, 390, 777]


def _commuting_pair(m, gen, batch=None):
    shape = (m, 3 * m) if batch is None else (batch, m, 3 * m)
    X = torch.randn(*shape, generator=gen, dtype=torch.float64)
    R = X @ X.mT / (3 * m)
    Z = 0.7 * R - 1.3 * R @ R
    Q = 2.0 * R + Z @ R  # polynomials in R: symmetric and commuting with Z
    return R, Z, Q


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("m", SIZES)
def test_half_work_products_match_reference(backend, m):
    gen = torch.Generator().manual_seed(m)
    X = torch.randn(m, 2 * m + 3, generator=gen)
    X64 = X.double()

    def check_sym(T, op="gram"):
        return torch.equal(T, T.mT) if sym.uses_half_work(op, backend, m) else True

    G = sym.gram(X, backend)
    assert G.dtype == torch.float32 and check_sym(G)
    torch.testing.assert_close(G.double(), X64 @ X64.T, rtol=1e-5, atol=1e-4 * (2 * m) ** 0.5)

    R, Z, Q = (t.float() for t in _commuting_pair(m, gen))
    R64, Z64, Q64 = R.double(), Z.double(), Q.double()
    S = sym.sym_square(R, backend)
    assert check_sym(S)
    torch.testing.assert_close(S.double(), R64 @ R64, rtol=1e-5, atol=1e-6)
    P = sym.sym_poly2(R, 1.5, -2.5, backend)
    assert check_sym(P, "sym_poly2")
    torch.testing.assert_close(P.double(), 1.5 * R64 - 2.5 * R64 @ R64, rtol=1e-5, atol=1e-6)
    QZ = sym.sym_product(Q, Z, backend)
    assert check_sym(QZ, "sym_product")
    torch.testing.assert_close(QZ.double(), Q64 @ Z64, rtol=1e-5, atol=1e-6)
    # The operands are not modified.
    assert torch.equal(R, R64.float())


@pytest.mark.parametrize("backend", BACKENDS)
def test_float64_stays_float64_and_is_exactish(backend):
    gen = torch.Generator().manual_seed(0)
    R, Z, Q = _commuting_pair(200, gen)
    out = sym.sym_product(Q, Z, backend)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, Q @ Z, rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(sym.sym_poly2(R, 2.0, 3.0, backend), 2 * R + 3 * R @ R, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("backend", BACKENDS)
def test_batched_and_bf16_inputs(backend):
    gen = torch.Generator().manual_seed(1)
    X = torch.randn(3, 140, 300, generator=gen).bfloat16()
    G = sym.gram(X, backend)
    assert G.shape == (3, 140, 140) and G.dtype == torch.float32  # fp32 accumulation
    X64 = X.double()
    torch.testing.assert_close(G.double(), X64 @ X64.mT, rtol=1e-5, atol=1e-3)
    R, Z, Q = _commuting_pair(140, gen, batch=2)
    torch.testing.assert_close(sym.sym_product(Q.float(), Z.float(), backend).double(), Q @ Z, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sym.sym_poly2(R.float(), 1.0, 2.0, backend).double(), R + 2 * R @ R, rtol=1e-5, atol=1e-6)


def test_half_work_really_reads_one_triangle_only():
    # sym_product computes only the lower block triangle; non-commuting operands
    # give the symmetrised lower part, which proves the upper part is mirrored.
    gen = torch.Generator().manual_seed(2)
    A = torch.randn(520, 520, generator=gen, dtype=torch.float64)
    A = A + A.T
    B = torch.randn(520, 520, generator=gen, dtype=torch.float64)
    B = B + B.T
    for backend in BACKENDS[1:]:
        assert sym.uses_half_work("sym_product", backend, 520)
        out = sym.sym_product(A, B, backend)
        full = A @ B
        expected = torch.tril(full) + torch.tril(full, -1).T
        torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shape", [(1, 1), (7, 7), (256, 256), (300, 300), (513, 513), (3, 130, 130)])
def test_mirror_lower_is_one_operation(shape):
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        names: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    C = torch.randn(*shape)
    expected = torch.tril(C) + torch.tril(C, -1).mT
    sym.mirror_lower(C)  # builds the cached mask
    with Ops() as ops:
        out = sym.mirror_lower(C)
    assert torch.equal(out, expected)
    # The transpose is a view; the only kernel is the select.
    assert [n for n in ops.names if n not in ("transpose", "alias")] == ["where"]


def test_backend_selection_and_errors():
    assert sym.default_backend("cpu") in ("blas", "torch")
    with pytest.raises(ValueError):
        sym.gram(torch.randn(4, 4), "nope")
    with pytest.raises(ValueError):
        sym.sym_square(torch.randn(4, 5))
    with pytest.raises(ValueError):
        sym.sym_product(torch.randn(4, 4), torch.randn(5, 5))
    with pytest.raises(ValueError):
        sym.gram(torch.randn(4))


def _triton_installed() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def test_triton_module_imports_and_reports_availability():
    from dmuon.ortho import triton_syrk

    if not torch.cuda.is_available() and not triton_syrk.interpreting():
        assert not triton_syrk.is_available()
        with pytest.raises(RuntimeError):
            triton_syrk.syrk(torch.randn(4, 4))


def test_blas_threads_follow_torch_and_are_restored():
    threadpoolctl = pytest.importorskip("threadpoolctl")
    import numpy  # noqa: F401  (loads the BLAS threadpoolctl inspects)

    def blas_counts():
        return [i["num_threads"] for i in threadpoolctl.threadpool_info() if i["user_api"] == "blas"]

    if not blas_counts():
        pytest.skip("no BLAS library visible to threadpoolctl")
    before = blas_counts()
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with sym.blas_threads():
            inside = blas_counts()
    finally:
        torch.set_num_threads(old)
    assert inside and all(n == 1 for n in inside)
    assert blas_counts() == before


# The Triton interpreter's scripts: TRITON_INTERPRET must be set before the kernel is defined, hence a
# subprocess, one per test (an interpreter start imports torch, dmuon and Triton: seconds).

# syrk's config=None path (INTERPRET_CONFIG) on ragged shapes, and the Gram iteration wired to the kernel.
_DEFAULT_PATH = """
g = torch.Generator().manual_seed(1)
for M, K in [(1, 5), (33, 70), (64, 64), (100, 33)]:
    A = torch.randn(M, K, generator=g)
    C0 = torch.randn(M, M, generator=g)
    C0 = C0 + C0.T
    out = T.syrk(A, 2.0, -0.5, C0)
    A64 = A.double()
    ref = 2 * A64 @ A64.T - 0.5 * C0.double()
    assert out.dtype == torch.float32 and torch.equal(out, out.T)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-4)
    Ab = A.bfloat16()
    out = T.syrk(Ab)
    torch.testing.assert_close(out.double(), Ab.double() @ Ab.double().T, rtol=1e-5, atol=1e-4)
assert sym._resolve("triton", torch.zeros(2, 2)) == "triton"
calls = []
real = T.syrk
T.syrk = lambda *a, **k: calls.append(1) or real(*a, **k)
G = torch.randn(40, 96, generator=torch.Generator().manual_seed(0))
got = gram_newton_schulz(G, "polar_express", 5, dtype=torch.float32, backend="triton")
assert len(calls) >= 8, len(calls)  # every syrk of the iteration went through Triton
ref = newton_schulz(G.double(), "polar_express", 5, dtype=torch.float64)
assert float((got.double() - ref).norm() / ref.norm()) < 1e-4
T.syrk = real
"""

# Tile configurations given by CONFIGS: ragged shapes, M = 1, K = 1, 16-bit operands, the fused addend and
# a stack on each; M = 512 (a grid of 136 tiles: the triangular enumeration past a few rows) once, in
# float32 with the addend, where each call costs about a second in the interpreter on a 2-core CPU.
# Bound: float32 accumulation of K products (16-bit products are exact in float32),
# |error| <= K * 2**-24 * (|alpha| |A| |A|ᵀ + |beta| |C|) elementwise, doubled for the final scaling
# and addition. Then the tuning state's keys, and a stack through the Gram iteration on the kernel.
_TILES = """
g = torch.Generator().manual_seed(0)
shapes = [(1, 1), (1, 37), (37, 1), (70, 45), (129, 130), (512, 40)]
for cfg in CONFIGS:
    for M, K in shapes:
        for dt in (torch.float32, torch.bfloat16, torch.float16) if M < 512 else (torch.float32,):
            for stack in ((), (3,)) if M == 70 else ((),):
                A = torch.randn(*stack, M, K, generator=g).to(dt)
                C0 = torch.randn(*stack, M, M, generator=g)
                C0 = C0 + C0.mT
                for alpha, beta, C in ((1.0, 0.0, None), (-2.5, 1.5, C0)) if M < 512 else ((-2.5, 1.5, C0),):
                    out = T.syrk(A, alpha, beta, C, config=cfg)
                    A64 = A.double()
                    ref = alpha * A64 @ A64.mT
                    mag = abs(alpha) * A64.abs() @ A64.abs().mT
                    if C is not None:
                        ref = ref + beta * C.double()
                        mag = mag + abs(beta) * C.double().abs()
                    err = (out.double() - ref).abs()
                    bound = 2 * (K + 2) * 2.0 ** -24 * mag + 1e-30
                    assert out.dtype == torch.float32 and out.shape == ref.shape
                    assert torch.equal(out, out.mT), (cfg, M, K, dt)
                    assert bool((err <= bound).all()), (cfg, M, K, dt, stack, float((err / bound).max()))
# Tuning state is keyed by dtype and flags, not only (M, K).
T.pin_config(64, 32, (32, 32, 4, 2), torch.bfloat16, has_c0=True, ieee=False)
assert T.best_config(64, 32, torch.bfloat16, True, False) == (32, 32, 4, 2)
assert T.best_config(64, 32) is None and T.best_config(64, 32, torch.float16, True, False) is None
# A stack through the Gram iteration runs batched on the kernel, output in bf16.
calls = []
real = T.syrk
T.syrk = lambda *a, **k: calls.append(a[0].shape) or real(*a, **k)
G = torch.randn(3, 40, 96, generator=g)
got = gram_newton_schulz(G, "polar_express", 5, dtype=torch.bfloat16, backend="triton")
ref = gram_newton_schulz(G, "polar_express", 5, dtype=torch.bfloat16, backend="reference")
assert calls and all(len(s) == 3 for s in calls), calls
# Both round float32 results that agree to ~1e-6 to bf16: at most one bf16 ulp
# (2**-7 relative) apart per element.
assert got.dtype == torch.bfloat16 and float((got.double() - ref.double()).norm() / ref.double().norm()) < 2.0 ** -7
T.syrk = real
"""


def _run_under_interpreter(*parts: str) -> None:
    script = "\n".join([
        "import torch",
        "from dmuon.ortho import symmetric as sym, triton_syrk as T",
        "from dmuon.ortho.gram import gram_newton_schulz",
        "from dmuon.ortho.newton_schulz import newton_schulz",
        "assert T.is_available('cpu')",
        "sym._MIN_HALF = 16  # small test matrices take the kernel path",
        *parts,
        "print('ok')",
    ])
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(sys.path))
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip().endswith("ok")


@pytest.mark.skipif(not _triton_installed(), reason="triton is not installed")
def test_triton_syrk_under_interpreter():
    """The default path, the Gram wiring and the first tile configuration, in one interpreter process."""
    _run_under_interpreter(_DEFAULT_PATH, _TILES.replace("CONFIGS", "T.TILE_CONFIGS[:1]"))


@pytest.mark.slow  # the other tiles: test_triton_syrk_under_interpreter runs the first by default
@pytest.mark.skipif(not _triton_installed(), reason="triton is not installed")
def test_every_other_triton_tile_config_under_interpreter():
    """The interpreter runs a config's BLOCK and BLOCK_K and ignores num_warps and num_stages, so
    INTERPRET_CONFIG (32, 32, 4, 1) runs the same tiles as TILE_CONFIGS[0] (32, 32, 4, 2), which the
    default test runs; here the others and INTERPRET_CONFIG through the explicit-config path."""
    _run_under_interpreter(_TILES.replace("CONFIGS", "T.TILE_CONFIGS[1:] + (T.INTERPRET_CONFIG,)"))
