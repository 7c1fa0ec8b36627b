import pytest
import torch

from dmuon.ortho import symmetric as sym
from dmuon.ortho.coefficients import KELLER, polar_express_schedule
from dmuon.ortho.gram import gram_newton_schulz
from dmuon.ortho.newton_schulz import newton_schulz

from ._helpers import gradient_like, rel

BACKENDS = ["reference", "torch"] + (["blas"] if sym._np is not None else [])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [(1, 50), (50, 1), (3, 3), (40, 130), (130, 40), (160, 400)])
@pytest.mark.parametrize("restart_every", [0, 1, 2, 3])
def test_float64_gram_equals_standard(backend, shape, restart_every):
    # In float64 rounding is negligible, so any algebra mistake (wrong R update,
    # wrong restart bookkeeping, missing transpose) shows up as a large difference.
    G = torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    for sched in (KELLER, polar_express_schedule(6)):
        steps = 6
        std = newton_schulz(G, sched, steps, dtype=torch.float64)
        gr = gram_newton_schulz(G, sched, steps, dtype=torch.float64, restart_every=restart_every, backend=backend)
        assert gr.dtype == torch.float64 and gr.shape == G.shape
        assert rel(gr, std) < 1e-10


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_output_dtype_and_no_input_mutation(dtype):
    G = torch.randn(64, 200)
    keep = G.clone()
    out = gram_newton_schulz(G, KELLER, 5, dtype=dtype)
    assert out.dtype == dtype and out.shape == G.shape
    assert torch.equal(G, keep)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bshape", [(6, 32, 128), (3, 200, 150), (4, 1, 9)])
def test_batched_equals_looped(backend, bshape):
    G = torch.randn(*bshape, generator=torch.Generator().manual_seed(2))
    G = G * torch.logspace(-2, 2, bshape[0]).view(-1, 1, 1)
    batched = gram_newton_schulz(G, KELLER, 5, dtype=torch.float32, backend=backend)
    looped = torch.stack([gram_newton_schulz(g, KELLER, 5, dtype=torch.float32, backend=backend) for g in G])
    torch.testing.assert_close(batched, looped, rtol=1e-5, atol=2e-6)


def test_steps_zero_and_zero_input():
    G = torch.randn(10, 30, dtype=torch.float64)
    torch.testing.assert_close(gram_newton_schulz(G, KELLER, 0, dtype=torch.float64), G / G.norm())
    out = gram_newton_schulz(torch.zeros(20, 40), KELLER, 5)
    assert torch.equal(out, torch.zeros(20, 40, dtype=torch.bfloat16))


@pytest.mark.parametrize("kind", ["gauss", "lowrank", "logspec"])
def test_float32_close_to_standard_float32(kind):
    G = gradient_like(kind, 192, 768, seed=4)
    std = newton_schulz(G, KELLER, 5, dtype=torch.float32)
    for backend in BACKENDS:
        gr = gram_newton_schulz(G, KELLER, 5, dtype=torch.float32, backend=backend)
        assert rel(gr, std) < 2e-4, backend


def test_restarts_help_on_heavy_tailed_spectrum():
    # Without restarts the Gram state loses the smallest eigenvalues to rounding; the
    # default restart schedule keeps the error near the standard float32 path's.
    G = gradient_like("powerlaw", 256, 1024, seed=5)
    ref = newton_schulz(G.double(), "polar_express", 5, dtype=torch.float64)
    std = rel(newton_schulz(G, "polar_express", 5, dtype=torch.float32), ref)
    never = rel(gram_newton_schulz(G, "polar_express", 5, dtype=torch.float32, restart_every=0), ref)
    default = rel(gram_newton_schulz(G, "polar_express", 5, dtype=torch.float32), ref)
    assert default < 3 * std
    assert never > 5 * default


@pytest.mark.parametrize(
    "kwargs",
    [{"restart_every": -1}, {"restart_every": 1.5}, {"backend": "cuda-magic"}, {"steps": -2}, {"dtype": torch.int8}],
)
def test_user_errors(kwargs):
    with pytest.raises(ValueError):
        gram_newton_schulz(torch.randn(4, 8), KELLER, **kwargs)
