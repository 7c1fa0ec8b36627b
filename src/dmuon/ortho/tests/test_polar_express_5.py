"""``"polar_express_5"``: modded-nanogpt's and dion's five-step Polar Express, against their formula."""

import math

import numpy as np
import pytest
import torch

from dmuon.ortho import NSConfig, orthogonalize
from dmuon.ortho.coefficients import (
    KELLER,
    POLAR_EXPRESS_5,
    polar_express_5_schedule,
    polar_express_schedule,
    resolve_schedule,
)
from dmuon.ortho.newton_schulz import newton_schulz

from ._helpers import rel

# Typed again from KellerJordan/modded-nanogpt train_gpt.py (commit f411b3d) so that a change to
# the library's copy is caught; microsoft/dion dion/polar_express.py holds the same numbers.
MODDED_NANOGPT = [
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
]


def modded_nanogpt_polar_express(G: torch.Tensor, safety: float = 1.02, eps: float = 1e-6) -> torch.Tensor:
    """Their iteration as they write it: divide by ``||G|| * 1.02 + eps``, then the five polynomials
    (the small Gram side: ``X Xᵀ`` for wide, ``Xᵀ X`` for tall matrices)."""
    X = G / (G.norm() * safety + eps)
    for a, b, c in MODDED_NANOGPT:
        if X.shape[0] > X.shape[1]:
            A = X.T @ X
            X = a * X + X @ (b * A + c * A @ A)
        else:
            A = X @ X.T
            X = a * X + (b * A + c * A @ A) @ X
    return X


def _compose(schedule, x):
    for a, b, c in schedule:
        x = a * x + b * x**3 + c * x**5
    return x


def test_the_table_is_modded_nanogpts_and_not_the_papers_eight_entries():
    assert list(POLAR_EXPRESS_5) == MODDED_NANOGPT
    eight = polar_express_schedule(8, safety=1.0)
    assert all(a != b for a, b in zip(POLAR_EXPRESS_5, eight))  # another polynomial at every step
    assert resolve_schedule("polar_express_8", 8) == resolve_schedule("polar_express", 8) == polar_express_schedule(8)
    assert resolve_schedule("Polar-Express-5", 5) == polar_express_5_schedule(5)


def test_normalisation_safety_folded_into_the_first_polynomial():
    s = 1.02
    schedule = polar_express_5_schedule()
    assert schedule[1:] == MODDED_NANOGPT[1:]
    assert polar_express_5_schedule(norm_safety=1.0) == MODDED_NANOGPT
    xs = np.linspace(0.0, 1.1, 101)
    # p1(x / s) for the first entry, as their normalisation by s * ||X|| does.
    np.testing.assert_allclose(_compose(schedule[:1], xs), _compose(MODDED_NANOGPT[:1], xs / s), rtol=1e-13, atol=1e-15)


def test_scalar_map_brings_the_spectrum_near_one():
    # Singular values in [1e-3, 1] (a little above 1 too: the 1.02 margin) end in [0.84, 1.15] after
    # five steps; Keller's triple leaves [0.47, 1.21].
    xs = np.logspace(-3, math.log10(1.02), 2001)
    out = _compose(polar_express_5_schedule(), xs)
    assert out.min() > 0.84 and out.max() < 1.15
    keller = _compose([KELLER] * 5, xs)
    assert np.abs(1 - out).max() < np.abs(1 - keller).max() / 3


@pytest.mark.parametrize("shape", [(24, 40), (40, 24), (32, 32)], ids=["wide", "tall", "square"])
def test_newton_schulz_equals_their_formula(shape):
    torch.manual_seed(0)
    G = torch.randn(*shape, dtype=torch.float64)
    ref = modded_nanogpt_polar_express(G, eps=0.0)
    got = newton_schulz(G, "polar_express_5", 5, eps=0.0, dtype=torch.float64)
    assert rel(got, ref) < 1e-12


@pytest.mark.parametrize("method", ["standard", "standard32", "gram"])
def test_every_method_agrees_in_fp32(method):
    torch.manual_seed(1)
    G = torch.randn(3, 20, 56)
    ref = torch.stack([modded_nanogpt_polar_express(g.double()) for g in G])
    got = orthogonalize(G, method=method, coefficients="polar_express_5", steps=5, dtype=torch.float32)
    assert rel(got.double(), ref) < 1e-5


def test_fewer_steps_take_a_prefix_more_are_refused():
    assert polar_express_5_schedule(3) == polar_express_5_schedule()[:3]
    with pytest.raises(ValueError, match="'polar_express_5' is a five-iteration schedule; steps=6"):
        resolve_schedule("polar_express_5", 6)
    with pytest.raises(ValueError, match="ns coefficients: 'polar_express_5' is a five-iteration schedule"):
        NSConfig(coefficients="polar_express_5", steps=7)
    with pytest.raises(ValueError, match="norm_safety"):
        polar_express_5_schedule(5, norm_safety=0.5)
    with pytest.raises(ValueError, match="unknown coefficient schedule 'polar_express_6'"):
        resolve_schedule("polar_express_6", 5)


def test_nanochats_1_01_normalisation_as_an_explicit_schedule():
    """nanochat divides by 1.01 ||X|| (not 1.02) before the same table: the schedule with norm_safety=1.01,
    passed as coefficients (an NSConfig keeps it as a hashable schedule)."""
    torch.manual_seed(2)
    G = torch.randn(16, 40, dtype=torch.float64)
    ns = NSConfig(coefficients=polar_express_5_schedule(norm_safety=1.01), steps=5, dtype=torch.float64,
                  method="standard")
    got = orthogonalize(G, **{k: v for k, v in ns.kwargs().items() if k != "batching"})
    assert rel(got, modded_nanogpt_polar_express(G, safety=1.01, eps=0.0)) < 1e-12
    assert rel(got, modded_nanogpt_polar_express(G, safety=1.02, eps=0.0)) > 1e-4
