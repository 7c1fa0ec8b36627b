import pytest
import torch
from torch.optim._muon import _zeropower_via_newtonschulz as torch_ns

from dmuon.ortho.coefficients import KELLER, polar_express_schedule
from dmuon.ortho.newton_schulz import newton_schulz

SHAPES = [(1, 64), (64, 1), (1, 1), (200, 48), (48, 200), (96, 96), (300, 700), (513, 129)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("steps", [1, 5])
def test_bit_identical_to_torch_muon(shape, steps):
    G = torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)))
    expected = torch_ns(G.clone(), KELLER, steps, 1e-7)
    got = newton_schulz(G, KELLER, steps, 1e-7, torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.shape == G.shape
    assert torch.equal(got, expected)


def test_bit_identical_for_bf16_input_and_input_untouched():
    G = torch.randn(40, 90).bfloat16()
    keep = G.clone()
    got = newton_schulz(G, KELLER, 5)
    assert torch.equal(G, keep)  # torch's version divides a bf16 input in place
    assert torch.equal(got, torch_ns(G.clone(), KELLER, 5, 1e-7))


def _plain_ns(G, schedule, eps, dtype):
    # Independent textbook form: p(X) = aX + b(XXᵀ)X + c(XXᵀ)²X, computed unfused.
    X = G.to(dtype)
    tall = X.shape[0] > X.shape[1]
    if tall:
        X = X.T
    X = X / max(float(X.norm()), eps)
    for a, b, c in schedule:
        A = X @ X.T
        X = a * X + b * (A @ X) + c * (A @ (A @ X))
    return X.T if tall else X


@pytest.mark.parametrize("shape", [(30, 70), (70, 30), (50, 50)])
def test_float_iteration_matches_textbook_form(shape):
    G = torch.randn(*shape, dtype=torch.float64)
    sched = polar_express_schedule(5)
    got = newton_schulz(G, sched, 5, dtype=torch.float64)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, _plain_ns(G, sched, 1e-7, torch.float64), rtol=1e-10, atol=1e-12)
    got32 = newton_schulz(G.float(), sched, 5, dtype=torch.float32)
    assert got32.dtype == torch.float32
    torch.testing.assert_close(got32.double(), got, rtol=0, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bshape", [(8, 32, 128), (5, 128, 32), (3, 64, 64), (4, 1, 20), (6, 20, 1)])
def test_batched_equals_looped(dtype, bshape):
    gen = torch.Generator().manual_seed(1)
    # Very different scales per matrix: each must be normalised by its own norm.
    G = torch.randn(*bshape, generator=gen) * torch.logspace(-3, 3, bshape[0]).view(-1, 1, 1)
    batched = newton_schulz(G, KELLER, 5, dtype=dtype)
    looped = torch.stack([newton_schulz(g, KELLER, 5, dtype=dtype) for g in G])
    assert batched.dtype == dtype
    if dtype == torch.bfloat16:
        assert torch.equal(batched, looped)
    else:
        # fp32 batched and single matmuls may take different BLAS kernels (e.g. for
        # vector-shaped operands), so only rounding-level agreement is guaranteed.
        torch.testing.assert_close(batched, looped, rtol=1e-5, atol=2e-6)


def test_zero_matrix_stays_finite():
    out = newton_schulz(torch.zeros(8, 16), KELLER, 5)
    assert torch.equal(out, torch.zeros(8, 16, dtype=torch.bfloat16))


def test_steps_zero_only_normalises():
    G = torch.randn(10, 20, dtype=torch.float64)
    out = newton_schulz(G, KELLER, 0, dtype=torch.float64)
    torch.testing.assert_close(out, G / G.norm())


@pytest.mark.parametrize(
    "bad",
    [
        lambda: newton_schulz(torch.randn(3), KELLER),
        lambda: newton_schulz(torch.randn(2, 3, 4, 5), KELLER),
        lambda: newton_schulz(torch.randn(0, 4), KELLER),
        lambda: newton_schulz(torch.ones(3, 4, dtype=torch.int64), KELLER),
        lambda: newton_schulz(torch.randn(3, 4), (1.0, 2.0)),
        lambda: newton_schulz(torch.randn(3, 4), KELLER, steps=-1),
        lambda: newton_schulz(torch.randn(3, 4), KELLER, dtype=torch.int32),
        lambda: newton_schulz([[1.0]], KELLER),
    ],
)
def test_user_errors_raise_value_error(bad):
    with pytest.raises(ValueError):
        bad()
