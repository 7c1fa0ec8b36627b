"""Accuracy bar of the Gram path against the standard path and the exact polar factor.

For each input, the standard path's own outputs define what is acceptable:

* distance: ``|gram - std_fp32| <= |std_d - std_fp32|`` (Frobenius), i.e. the Gram
  path with output dtype ``d`` deviates from the fp32 standard iteration no more than
  the standard iteration in ``d`` does (bf16 is what torch.optim.Muon runs; float16
  has its own, ~8x tighter, bar; fp32 output is held to the bf16 bar here and to
  2e-4 in test_gram.py);
* singular-value band: every singular value of the Gram output lies in
  ``[lo - 0.02, hi + 0.02]`` where ``[lo, hi]`` spans the singular values of the bf16
  and fp32 standard outputs (for Keller's triple roughly [0.68, 1.13], lower for
  directions the five steps cannot lift), and the sorted singular values are as
  close to the fp32 standard's as the bf16 standard's are (plus 1e-3);
* polar factor: its distance to ``U Vᵀ`` from a float64 SVD is no worse than the
  standard path's (2% + 1e-3 slack).
"""

import pytest
import torch

from dmuon.ortho.coefficients import KELLER
from dmuon.ortho.gram import gram_newton_schulz
from dmuon.ortho.newton_schulz import newton_schulz

from ._helpers import emulated_bf16_newton_schulz, gradient_like, rel

KINDS = ["gauss", "lowrank", "powerlaw", "logspec", "student"]


def _svals(T: torch.Tensor) -> torch.Tensor:
    return torch.linalg.svdvals(T.double())


DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_accuracy_bar(G: torch.Tensor, coefficients, steps: int = 5, emulate_bf16: bool = False,
                       dtypes=DTYPES, precision: str = "mixed") -> dict:
    """Asserts the bar for each output dtype; returns each gap in units of its bar."""
    std32 = newton_schulz(G, coefficients, steps, dtype=torch.float32)
    U, _, Vh = torch.linalg.svd(G.double(), full_matrices=False)
    polar = U @ Vh
    s32 = _svals(std32)
    report = {}
    for dtype in dtypes:
        # fp32 output is held to the bf16 standard's bar (the tighter 2e-4 is test_gram's).
        ref_dtype = torch.bfloat16 if dtype == torch.float32 else dtype
        if emulate_bf16:
            std16 = emulated_bf16_newton_schulz(G, coefficients, steps, dtype=ref_dtype)
        else:
            std16 = newton_schulz(G, coefficients, steps, dtype=ref_dtype)
        bar = rel(std16, std32)
        s16 = _svals(std16)
        lo = min(s32.min(), s16.min()).item() - 0.02
        hi = max(s32.max(), s16.max()).item() + 0.02
        sv_gap = (s16 - s32).abs().max().item()
        std_polar = max(rel(std16, polar), rel(std32, polar))
        gram = gram_newton_schulz(G, coefficients, steps, dtype=dtype, precision=precision)
        assert gram.dtype == dtype and gram.shape == G.shape
        gap = rel(gram, std32)
        assert gap <= bar, (dtype, gap, bar)
        sg = _svals(gram)
        assert lo <= sg.min().item() and sg.max().item() <= hi, (dtype, sg.min().item(), sg.max().item(), lo, hi)
        assert (sg - s32).abs().max().item() <= sv_gap + 1e-3, dtype
        assert rel(gram, polar) <= 1.02 * std_polar + 1e-3, dtype
        report[str(dtype)] = gap / bar
    return report


COEFFICIENTS = {"keller": KELLER, "pe": "polar_express"}
# 256 x 1024 is the one shape whose 256 x 256 Gram state takes the half-work products
# (symmetric._MIN_HALF = 128) and costs about 1.2 s a point. The default run keeps one point
# per precision and coefficient set there, each with another spectrum (every spectrum already
# meets the bar by default at the smaller shapes, which take the full products); the other 16
# points run under -m slow.
HALF_WORK_DEFAULT = {("mixed", "keller", "lowrank"), ("mixed", "pe", "powerlaw"),
                     ("float32", "keller", "gauss"), ("float32", "pe", "student")}


def _accuracy_points():
    for precision in ("mixed", "float32"):
        for shape in [(1, 64), (64, 1), (48, 48), (64, 256), (32, 256), (384, 96), (256, 1024)]:
            for name, coefficients in COEFFICIENTS.items():
                for kind in KINDS:
                    slow = shape == (256, 1024) and (precision, name, kind) not in HALF_WORK_DEFAULT
                    yield pytest.param(shape, coefficients, kind, precision,
                                       id=f"{precision}-{shape[0]}x{shape[1]}-{name}-{kind}",
                                       marks=[pytest.mark.slow] if slow else [])


@pytest.mark.parametrize("shape,coefficients,kind,precision", list(_accuracy_points()))
def test_gram_meets_accuracy_bar(shape, coefficients, kind, precision):
    # Both precision paths: the mixed one (16-bit operands where gram_precision allows)
    # and the float32 reference.
    if shape in ((1, 64), (64, 1)) and kind in ("powerlaw", "logspec"):
        pytest.skip("a single singular value has no spectrum to shape")
    G = gradient_like(kind, *shape, seed=sum(shape) + KINDS.index(kind))
    check_accuracy_bar(G, coefficients, precision=precision)


def test_bar_detects_a_broken_gram_path(monkeypatch):
    # The bar must be able to fail: corrupt the R update and expect a violation.
    from dmuon.ortho import gram as gram_mod

    real_np, real_torch = gram_mod._NumpyOps.square, gram_mod._TorchOps.square
    monkeypatch.setattr(gram_mod._NumpyOps, "square", staticmethod(lambda P: real_np(P) * 1.05))
    monkeypatch.setattr(gram_mod._TorchOps, "square", lambda self, P: real_torch(self, P) * 1.05)
    G = gradient_like("lowrank", 128, 512, seed=1)
    with pytest.raises(AssertionError):
        check_accuracy_bar(G, KELLER)


@pytest.mark.parametrize("kind", ["gauss", "lowrank", "powerlaw"])
def test_emulated_bf16_path_matches_real_one(kind):
    # The large tests use the emulation for the bf16 standard path; its deviation
    # from fp32 must be the same size as the real path's.
    G = gradient_like(kind, 96, 384, seed=3)
    std32 = newton_schulz(G, KELLER, 5, dtype=torch.float32)
    real = rel(newton_schulz(G, KELLER, 5, dtype=torch.bfloat16), std32)
    emulated = rel(emulated_bf16_newton_schulz(G, KELLER, 5), std32)
    assert 0.5 * real <= emulated <= 2.0 * real


@pytest.mark.slow
@pytest.mark.parametrize(
    "shape,kind",
    [((1024, 4096), "lowrank"), ((1024, 4096), "powerlaw"), ((1024, 8192), "student"), ((2048, 2048), "logspec"),
     ((4096, 1024), "gauss"), ((4096, 16384), "lowrank")],
    ids=lambda v: f"{v[0]}x{v[1]}" if isinstance(v, tuple) else v,
)
def test_gram_meets_accuracy_bar_large(shape, kind):
    # The real bf16 standard path needs minutes to hours at these sizes on CPU.
    torch.set_num_threads(2)
    G = gradient_like(kind, *shape, seed=11)
    check_accuracy_bar(G, KELLER, emulate_bf16=True)
    if max(shape) <= 4096:
        check_accuracy_bar(G, "polar_express", emulate_bf16=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(64, 256), (3, 96, 200), (300, 120)], ids=lambda s: "x".join(map(str, s)))
def test_mixed_precision_agrees_with_float32_reference(shape, dtype):
    # The mixed path differs from the float32 path only by 16-bit operands where
    # gram_precision allows them; the standard iteration's own distance between dtype and
    # float32 bounds what that rounding may cost (the same bar as above).
    G = gradient_like("lowrank", *shape[-2:], seed=5)
    if len(shape) == 3:
        G = torch.stack([G * s for s in (1.0, 1e-3, 1e3)])
    mixed = gram_newton_schulz(G, "polar_express", 5, dtype=dtype)
    ref = gram_newton_schulz(G, "polar_express", 5, dtype=dtype, precision="float32")
    tol = rel(newton_schulz(G, "polar_express", 5, dtype=dtype), newton_schulz(G, "polar_express", 5, dtype=torch.float32))
    assert mixed.dtype == ref.dtype == dtype
    assert rel(mixed, ref) <= tol


def test_bar_rejects_bfloat16_products_in_the_gram_state(monkeypatch):
    # The precision table is the bar's verdict; putting bfloat16 operands into the m x m
    # products (measured 1.9-4.2x over the bar) must fail it.
    from dmuon.ortho import gram as gram_mod

    real = gram_mod.gram_precision

    def corrupted(dtype, precision="mixed"):
        p = real(dtype, precision)
        if dtype == torch.bfloat16 and precision == "mixed":
            p = gram_mod.GramPrecision(p.gram, p.restart, torch.bfloat16, torch.bfloat16, p.final)
        return p

    monkeypatch.setattr(gram_mod, "gram_precision", corrupted)
    G = gradient_like("gauss", 48, 48, seed=96)
    with pytest.raises(AssertionError):
        check_accuracy_bar(G, KELLER, dtypes=(torch.bfloat16,))
