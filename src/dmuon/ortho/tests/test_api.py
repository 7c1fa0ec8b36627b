import pytest
import torch
from torch.optim._muon import _zeropower_via_newtonschulz as torch_ns

import dmuon.ortho as ortho
from dmuon.ortho import Autotuner, orthogonalize, orthogonalize_many
from dmuon.ortho.coefficients import KELLER

from ._helpers import rel


class CountingTuner(Autotuner):
    """A tuner with fixed answers that records what it was asked."""

    def __init__(self, method="standard", batched=True):
        super().__init__(persist=False)
        self.fixed_method, self.fixed_batched = method, batched
        self.asked = []

    def method(self, problem, device):
        self.asked.append(("method", problem.shape))
        return self.fixed_method

    def batching(self, problem, batch, method, device):
        self.asked.append(("batching", problem.shape, batch, method))
        return self.fixed_batched

    def plan(self, problem, batch, device, method=None):
        self.asked.append(("plan", problem.shape, batch, method))
        if batch <= 1:
            return method or self.fixed_method, False
        return method or self.fixed_method, self.fixed_batched


def test_public_api_exports():
    for name in ("orthogonalize", "orthogonalize_many", "newton_schulz", "gram_newton_schulz", "KELLER",
                 "fixed_schedule", "polar_express_schedule", "Autotuner"):
        assert hasattr(ortho, name)


def test_standard_matches_torch_and_is_contiguous():
    G = torch.randn(96, 40)  # tall: the iteration returns a transposed view internally
    out = orthogonalize(G)
    assert out.is_contiguous() and out.dtype == torch.bfloat16
    assert torch.equal(out, torch_ns(G.clone(), KELLER, 5, 1e-7))


@pytest.mark.parametrize("method", ["standard", "gram"])
def test_methods_and_3d(method):
    G = torch.randn(3, 24, 64)
    out = orthogonalize(G, method=method, dtype=torch.float32, coefficients="polar_express", steps=6)
    assert out.shape == G.shape and out.is_contiguous()
    ref = torch.stack([ortho.newton_schulz(g.double(), "polar_express", 6, dtype=torch.float64) for g in G])
    assert rel(out, ref) < 1e-4


def test_auto_uses_tuner_decisions():
    G = torch.randn(4, 16, 48)
    tuner = CountingTuner(method="gram", batched=False)
    out = orthogonalize(G, method="auto", dtype=torch.float32, autotuner=tuner)
    assert ("plan", (16, 48), 4, None) in tuner.asked
    looped = torch.stack([ortho.gram_newton_schulz(g, KELLER, 5, dtype=torch.float32) for g in G])
    assert torch.equal(out, looped)


def test_auto_with_real_tuner(tmp_path):
    tuner = Autotuner(tmp_path, repeats=1)
    G = torch.randn(20, 60)
    out = orthogonalize(G, method="auto", dtype=torch.float32, autotuner=tuner)
    assert rel(out, ortho.newton_schulz(G, KELLER, 5, dtype=torch.float32)) < 1e-4
    assert tuner.measurements == 1


def _mixed_inputs():
    gen = torch.Generator().manual_seed(0)
    shapes = [(32, 128), (128, 32), (32, 128), (7, 7), (32, 128), (1, 10), (128, 32)]
    mats = [torch.randn(*s, generator=gen) for s in shapes]
    mats.append(torch.randn(32, 128, generator=gen).bfloat16())  # same shape, other dtype
    return mats


@pytest.mark.parametrize("batching", ["batched", "looped", "auto"])
def test_many_preserves_order_and_matches_single_calls(batching, tmp_path):
    mats = _mixed_inputs()
    tuner = Autotuner(tmp_path, repeats=1)
    outs = orthogonalize_many(mats, method="standard", batching=batching, autotuner=tuner)
    assert len(outs) == len(mats)
    for M, out in zip(mats, outs):
        assert out.shape == M.shape and out.is_contiguous() and out.dtype == torch.bfloat16
        # Standard NS batched == looped bit for bit in bf16, so every path equals torch's.
        assert torch.equal(out, torch_ns(M.clone(), KELLER, 5, 1e-7))


def test_many_groups_by_shape_and_follows_batching_decision():
    mats = _mixed_inputs()
    tuner = CountingTuner(method="standard", batched=True)
    orthogonalize_many(mats, autotuner=tuner)
    batch_questions = sorted(q[1:3] for q in tuner.asked if q[0] == "plan" and q[2] > 1)
    # (32,128) fp32 x3, (128,32) x2; singletons and the bf16 one run unbatched.
    assert batch_questions == [((32, 128), 3), ((128, 32), 2)]


def test_many_auto_method_gram(tmp_path):
    mats = _mixed_inputs()
    outs = orthogonalize_many(mats, autotuner=CountingTuner(method="gram", batched=True), dtype=torch.float32)
    for M, out in zip(mats, outs):
        ref = ortho.newton_schulz(M.double(), KELLER, 5, dtype=torch.float64)
        assert rel(out, ref) < 1e-4


def test_many_empty_and_errors():
    assert orthogonalize_many([]) == []
    with pytest.raises(ValueError):
        orthogonalize_many([torch.randn(2, 3, 4)], method="standard", batching="looped")
    with pytest.raises(ValueError):
        orthogonalize_many([torch.randn(2, 3)], method="magic")
    with pytest.raises(ValueError):
        orthogonalize_many([torch.randn(2, 3)], batching="sometimes")
    with pytest.raises(ValueError):
        orthogonalize(torch.randn(3, 4), method="fast")
    with pytest.raises(ValueError):
        orthogonalize(torch.randn(3, 4), coefficients="nope")
