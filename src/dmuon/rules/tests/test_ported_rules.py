"""The settings ported from other Muon libraries, against their formulas written out here."""

from __future__ import annotations

import math

import pytest
import torch

from dmuon.rules.muon import adjusted_lr, apply_update, check_rule_settings

WIDE, TALL = (24, 96), (96, 24)


@pytest.mark.parametrize("shape", [WIDE, TALL, (40, 40)], ids=["wide", "tall", "square"])
def test_shape_scalings(shape):
    m, n = shape
    lr = 0.02
    assert adjusted_lr(lr, "spectral_unclamped", shape) == pytest.approx(lr * (m / n) ** 0.5, rel=1e-15)
    assert adjusted_lr(lr, "unscaled", shape) == lr
    assert adjusted_lr(lr, "original", shape) == adjusted_lr(lr, None, shape) == pytest.approx(
        lr * max(1.0, m / n) ** 0.5, rel=1e-15)
    assert adjusted_lr(lr, "match_rms_adamw", shape) == pytest.approx(lr * 0.2 * max(m, n) ** 0.5, rel=1e-15)


def test_unclamped_differs_from_torchs_only_on_wide_matrices():
    assert adjusted_lr(1.0, "spectral_unclamped", WIDE) == pytest.approx(0.5)  # sqrt(24 / 96)
    assert adjusted_lr(1.0, "original", WIDE) == 1.0  # max(1, .) clamps it
    assert adjusted_lr(1.0, "spectral_unclamped", TALL) == adjusted_lr(1.0, "original", TALL) == 2.0


def _formula(param, ortho, lr, wd, scale, extra, cautious):
    """``p - lr wd [sign(p) sign(u) >= 0] p - lr scale extra u`` in float64, from the definition."""
    p, u = param.double(), ortho.double()
    mask = (torch.sign(p) * torch.sign(u) >= 0).double() if cautious else torch.ones_like(p)
    return p - lr * wd * mask * p - lr * scale * extra * u


@pytest.mark.parametrize("cautious", [False, True])
@pytest.mark.parametrize("extra", [1.0, 0.37])
@pytest.mark.parametrize("ortho_dtype", [torch.float32, torch.bfloat16])
def test_apply_update_equals_the_formula(cautious, extra, ortho_dtype):
    gen = torch.Generator().manual_seed(3)
    param = torch.randn(*WIDE, generator=gen)
    param[0, :5] = 0.0  # zeros: sign 0, the mask keeps decaying them (nothing to decay)
    ortho = torch.randn(*WIDE, generator=gen).to(ortho_dtype)
    ortho[1, :5] = 0.0  # a zero update: dion's sign(p * u) = 0 -> mask 1, the weight decays
    lr, wd = 0.02, 0.3
    want = _formula(param, ortho, lr, wd, (24 / 96) ** 0.5, extra, cautious)
    got = param.clone()
    apply_update(got, ortho.reshape(-1), lr=lr, weight_decay=wd, adjust_lr_fn="spectral_unclamped",
                 matrix_shape=WIDE, extra_scale_factor=extra, cautious_weight_decay=cautious)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-8)
    # The same kernel without decay: bit-equal exactly where no decay applied.
    step_only = param.clone().add_(ortho.float(), alpha=-adjusted_lr(lr, "spectral_unclamped", WIDE) * extra)
    decayed = got.ne(step_only)
    if cautious:
        # Exactly where the signs disagree the weight keeps its value but for the step.
        opposite = (param.sign() * ortho.float().sign()) < 0
        assert not decayed[opposite].any() and decayed[~opposite & (param != 0)].all()
        assert 0 < opposite.sum() < param.numel()
    else:
        assert decayed[param != 0].all()


def test_cautious_without_decay_and_unit_extra_scale_are_torchs_step_bit_for_bit():
    gen = torch.Generator().manual_seed(4)
    param, ortho = torch.randn(*TALL, generator=gen), torch.randn(*TALL, generator=gen).bfloat16()
    plain, cautious = param.clone(), param.clone()
    apply_update(plain, ortho, lr=0.02, weight_decay=0.0, adjust_lr_fn=None, matrix_shape=TALL)
    apply_update(cautious, ortho, lr=0.02, weight_decay=0.0, adjust_lr_fn=None, matrix_shape=TALL,
                 extra_scale_factor=1.0, cautious_weight_decay=True)
    ref = param.clone()
    ref.mul_(1 - 0.02 * 0.0).add_(ortho, alpha=-0.02 * math.sqrt(96 / 24))
    assert torch.equal(plain, ref) and torch.equal(cautious, ref)


def test_bad_settings_name_themselves():
    with pytest.raises(ValueError, match="adjust_lr_fn must be one of"):
        check_rule_settings("spectral", 1.0, False)
    with pytest.raises(ValueError, match="param group 2: extra_scale_factor must be a finite number >= 0"):
        check_rule_settings(None, -1.0, False, "param group 2: ")
    with pytest.raises(ValueError, match="extra_scale_factor"):
        check_rule_settings(None, float("nan"), False)
    with pytest.raises(ValueError, match="cautious_weight_decay must be True or False, got 'yes'"):
        check_rule_settings(None, 1.0, "yes")
    with pytest.raises(ValueError, match="adjust_lr_fn must be one of"):
        adjusted_lr(0.1, "rms_norm", WIDE)


# torchtitan comes with the integrations extra (pinned there), so this runs in .ci/run's integrations step
# (pytest -m integrations), not in the default run, which has no torchtitan.
@pytest.mark.integrations
@pytest.mark.parametrize("adjust_lr_fn", [None, "original", "match_rms_adamw", "spectral_unclamped"])
@pytest.mark.parametrize("shape", [WIDE, TALL], ids=["wide", "tall"])
def test_torchtitans_distmuon_step_bit_for_bit(adjust_lr_fn, shape):
    """torchtitan's DistMuon (its names are torch's plus "spectral_unclamped") against ours, bit for bit."""
    titan = pytest.importorskip("torchtitan.distributed.flex_shard.dist_muon",
                                reason="torchtitan is not installed (pip install -e '.[integrations]')")
    # The pinned torchtitan has it; a release without it must fail here, not skip unseen.
    theirs_apply = titan._apply_muon_update
    gen = torch.Generator().manual_seed(5)
    param, ortho = torch.randn(*shape, generator=gen), torch.randn(*shape, generator=gen).bfloat16()
    theirs, mine = param.clone(), param.clone()
    theirs_apply(theirs, ortho, lr=0.02, weight_decay=0.1, adjust_lr_fn=adjust_lr_fn, compute_matrix_shape=shape)
    apply_update(mine, ortho, lr=0.02, weight_decay=0.1, adjust_lr_fn=adjust_lr_fn, matrix_shape=shape)
    assert torch.equal(mine, theirs)
