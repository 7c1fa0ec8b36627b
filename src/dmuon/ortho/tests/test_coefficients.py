import math

import numpy as np
import pytest
import torch

from dmuon.ortho.coefficients import (
    KELLER,
    POLAR_EXPRESS_RAW,
    fixed_schedule,
    polar_express_schedule,
    resolve_schedule,
    schedule_key,
)
from dmuon.ortho.newton_schulz import newton_schulz

from ._helpers import polar_factor, rel, with_spectrum


def _compose(schedule, x):
    for a, b, c in schedule:
        x = a * x + b * x**3 + c * x**5
    return x


def test_keller_and_fixed_schedule():
    assert KELLER == (3.4445, -4.7750, 2.0315)
    assert fixed_schedule(KELLER, 3) == [KELLER] * 3
    assert fixed_schedule([1, 2, 3], 0) == []
    with pytest.raises(ValueError):
        fixed_schedule((1.0, 2.0), 3)
    with pytest.raises(ValueError):
        fixed_schedule(KELLER, -1)
    with pytest.raises(ValueError):
        fixed_schedule((1.0, float("nan"), 2.0), 2)


def test_polar_express_safety_scaling_and_tail():
    raw = polar_express_schedule(10, safety=1.0)
    assert raw[:8] == list(POLAR_EXPRESS_RAW)
    assert raw[8:] == [POLAR_EXPRESS_RAW[-1]] * 2
    s = 1.01
    safe = polar_express_schedule(10)
    for i in range(7):
        a, b, c = POLAR_EXPRESS_RAW[i]
        assert safe[i] == pytest.approx((a / s, b / s**3, c / s**5), rel=1e-15)
        # p(x / s): the safeguarded polynomial is the raw one evaluated at x / s.
        x = 0.3
        assert _compose([safe[i]], x) == pytest.approx(_compose([POLAR_EXPRESS_RAW[i]], x / s), rel=1e-12)
    assert safe[7:] == [(1.875, -1.25, 0.375)] * 3
    with pytest.raises(ValueError):
        polar_express_schedule(5, safety=0.9)


def test_polar_express_table_is_minimax():
    """Each raw polynomial equioscillates on the interval its predecessors produce.

    Independent of the table's source: a transcription error in any coefficient
    breaks the equal-ripple property (Amsel et al., Theorem 4.1).
    """
    lo, hi = 1e-3, 1.0
    for k, (a, b, c) in enumerate(POLAR_EXPRESS_RAW[:7]):
        p = lambda x: a * x + b * x**3 + c * x**5  # noqa: E731
        roots = np.roots([5 * c, 0, 3 * b, 0, a])
        crit = np.sort(roots[np.isreal(roots)].real)
        crit = crit[(crit > lo) & (crit < hi)]
        err = 1 - p(lo)
        assert err > 0
        assert 1 - p(hi) == pytest.approx(-err, rel=1e-5, abs=1e-9), k
        assert 1 - p(crit[0]) == pytest.approx(-err, rel=1e-5, abs=1e-9), k
        if k >= 3:  # the paper's cushioning relaxes the second interior point early on
            assert 1 - p(crit[1]) == pytest.approx(err, rel=1e-5, abs=1e-9), k
        lo, hi = p(lo), 1 + err


def test_polar_express_scalar_convergence_beats_keller():
    xs = np.logspace(-3, 0, 5001)
    for steps in (5, 6, 7):
        pe = np.abs(1 - _compose(polar_express_schedule(steps), xs)).max()
        ke = np.abs(1 - _compose([KELLER] * steps, xs)).max()
        assert pe < ke
    assert np.abs(1 - _compose(polar_express_schedule(8), xs)).max() < 1e-3
    # Keller's triple stalls in its band instead of converging.
    assert np.abs(1 - _compose([KELLER] * 12, xs)).max() > 0.25


@pytest.mark.parametrize("steps", [5, 6])
def test_polar_express_matrix_closer_to_polar_factor(steps):
    gen = torch.Generator().manual_seed(3)
    G = with_spectrum(96, 256, torch.logspace(0, -2.5, 96, dtype=torch.float64), gen)
    target = polar_factor(G)
    pe = newton_schulz(G, "polar_express", steps, dtype=torch.float32)
    ke = newton_schulz(G, KELLER, steps, dtype=torch.float32)
    assert rel(pe, target) < 0.5 * rel(ke, target)


def test_resolve_schedule_forms():
    assert resolve_schedule(KELLER, 2) == [KELLER] * 2
    assert resolve_schedule([1, 2, 3], 1) == [(1.0, 2.0, 3.0)]
    assert resolve_schedule("polar_express", 4) == polar_express_schedule(4)
    assert resolve_schedule("Polar-Express", 4) == polar_express_schedule(4)
    assert resolve_schedule("keller", 3) == [KELLER] * 3
    sched = [(1, 2, 3), (4, 5, 6), (7, 8, 9)]
    assert resolve_schedule(sched, 2) == [(1.0, 2.0, 3.0), (4.0, 5.0, 6.0)]
    with pytest.raises(ValueError):
        resolve_schedule(sched, 4)
    with pytest.raises(ValueError):
        resolve_schedule("nope", 2)
    with pytest.raises(ValueError):
        resolve_schedule([], 2)
    with pytest.raises(ValueError):
        resolve_schedule([(1, 2)], 1)
    with pytest.raises(ValueError):
        resolve_schedule(KELLER, 1.5)


def test_schedule_key_distinguishes():
    assert schedule_key([KELLER] * 5) == schedule_key(resolve_schedule(KELLER, 5))
    assert schedule_key([KELLER] * 5) != schedule_key([KELLER] * 4)
    assert schedule_key(polar_express_schedule(5)) != schedule_key(polar_express_schedule(5, 1.05))
    assert math.isfinite(len(schedule_key([])))
