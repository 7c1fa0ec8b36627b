"""QK-clip's rule alone: the factors, which rows each layout scales, and the configuration's checks."""

from __future__ import annotations

import pytest
import torch

from dmuon.rules.qk_clip import AttentionHeads, QKClip, clip_factors, row_factors


def test_factors_clip_only_maxima_above_tau_and_never_make_nan():
    maxima = torch.tensor([250.0, 100.0, 99.0, 0.0, -3.0, float("nan"), 1e30, 100.00001])
    gamma = clip_factors(maxima, 100.0)
    assert not torch.isnan(gamma).any()
    assert torch.equal(gamma[:6], torch.tensor([0.4, 1.0, 1.0, 1.0, 1.0, 1.0]))
    assert gamma[6].item() == pytest.approx(1e-28) and gamma[7].item() < 1.0


def test_row_factors_take_each_rows_head_and_power_and_leave_the_rest():
    gamma = torch.tensor([0.25, 1.0, 0.5])
    heads = torch.tensor([0, 2, -1, 1, 2])
    powers = torch.tensor([0.5, 0.5, 0.0, 0.5, 1.0])
    assert torch.equal(row_factors(gamma, heads, powers), torch.tensor([0.5, 0.5 ** 0.5, 1.0, 1.0, 0.5]))


def _as_lists(scaled):
    return {k: tuple(t.tolist() for t in v) for k, v in scaled.items()}


def test_gqa_rows_each_query_head_takes_its_key_heads_factor():
    heads = AttentionHeads(query="q", key="k", num_heads=4, num_kv_heads=2, head_dim=2)
    got = _as_lists(heads.scaled_rows(0.25))
    assert got["query"] == (list(range(8)), [0, 0, 0, 0, 1, 1, 1, 1], [0.25] * 8)
    assert got["key"] == ([0, 1, 2, 3], [0, 0, 1, 1], [0.75] * 4)
    assert heads.query_rows == (0, 8) and heads.key_rows == (0, 4)


def test_fused_qkv_rows_start_where_given():
    heads = AttentionHeads(query="qkv", key="qkv", num_heads=2, head_dim=3, key_row=6)
    got = _as_lists(heads.scaled_rows(0.5))
    assert got["query"] == (list(range(6)), [0, 0, 0, 1, 1, 1], [0.5] * 6)
    assert got["key"] == (list(range(6, 12)), [0, 0, 0, 1, 1, 1], [0.5] * 6)


def test_mla_rope_rows_take_the_whole_factor_and_value_rows_none():
    heads = AttentionHeads(query="q", key="kv", num_heads=2, head_dim=2, rope_dim=1, value_dim=2)
    got = _as_lists(heads.scaled_rows(0.5))
    # Per query head: 2 rows without rope (gamma ** alpha), then 1 rope row (gamma).
    assert got["query"] == ([0, 1, 2, 3, 4, 5], [0, 0, 0, 1, 1, 1], [0.5, 0.5, 1.0, 0.5, 0.5, 1.0])
    # Per key head: 2 key rows, then 2 value rows (left out).
    assert got["key"] == ([0, 1, 4, 5], [0, 0, 1, 1], [0.5] * 4)
    assert heads.query_rows == (0, 6) and heads.key_rows == (0, 8)


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_heads=6, num_kv_heads=4, head_dim=2), "num_kv_heads=4 must divide num_heads=6"),
    (dict(num_heads=0, head_dim=2), "num_heads must be an int >= 1, got 0"),
    (dict(num_heads=2, head_dim=2.0), "head_dim must be an int >= 1, got 2.0"),
    (dict(num_heads=2, head_dim=2, key_row=-1), "key_row must be an int >= 0"),
    (dict(num_heads=4, num_kv_heads=2, head_dim=2, rope_dim=1), "MLA, whose key projection has one key head"),
])
def test_bad_layouts_are_refused_naming_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AttentionHeads(query="q", key="k", **kwargs)


def test_bad_settings_are_refused_naming_them():
    layers = {"l0": AttentionHeads(query="q", key="k", num_heads=2, head_dim=2)}
    with pytest.raises(ValueError, match="tau must be a finite number > 0, got 0"):
        QKClip(layers, tau=0)
    with pytest.raises(ValueError, match="tau must be a finite number > 0, got inf"):
        QKClip(layers, tau=float("inf"))
    with pytest.raises(ValueError, match=r"alpha must be a number in \[0, 1\], got 1.5"):
        QKClip(layers, alpha=1.5)
    with pytest.raises(ValueError, match="non-empty dict"):
        QKClip({})
    with pytest.raises(ValueError, match="layer 'l1': expected a dmuon.AttentionHeads"):
        QKClip({"l1": dict(query="q")})
    assert QKClip({"b": layers["l0"], "a": layers["l0"]}).order == ("a", "b")
