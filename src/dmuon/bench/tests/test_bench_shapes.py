"""Tests of the weight-free shape lists in :mod:`dmuon.bench.shapes`."""

from __future__ import annotations

import json

import pytest
import torch

from dmuon.bench.models import build_workload
from dmuon.bench.shapes import (
    MatrixShape,
    full_size_shapes,
    load_shapes_json,
    total_params,
)


def test_qwen25_7b_totals():
    shapes = full_size_shapes("qwen2.5-7b")
    by_name = {s.name: s for s in shapes}
    assert by_name["layers.*.self_attn.q_proj"].shape == (3584, 3584)
    assert by_name["layers.*.self_attn.k_proj"].shape == (512, 3584)
    assert by_name["layers.*.self_attn.v_proj"].shape == (512, 3584)
    assert by_name["layers.*.self_attn.o_proj"].shape == (3584, 3584)
    assert by_name["layers.*.mlp.gate_proj"].shape == (18944, 3584)
    assert by_name["layers.*.mlp.up_proj"].shape == (18944, 3584)
    assert by_name["layers.*.mlp.down_proj"].shape == (3584, 18944)
    assert all(s.count == 28 for s in shapes if s.muon)
    assert {s.name for s in shapes if not s.muon} == {"embed_tokens", "lm_head"}
    non_embedding = total_params(shapes, muon=True)
    embedding = by_name["embed_tokens"].numel
    assert non_embedding + embedding == pytest.approx(7.07e9, rel=0.03)
    assert non_embedding == pytest.approx(6.53e9, rel=0.01)  # Qwen's model card
    assert total_params(shapes) == pytest.approx(7.61e9, rel=0.01)


def test_pi0_totals():
    shapes = full_size_shapes("pi0")
    backbone = total_params(shapes, prefix="paligemma.")
    expert = total_params(shapes, prefix="expert.")
    small = total_params(shapes, prefix="proj.")
    assert backbone == pytest.approx(3e9, rel=0.05)
    assert total_params(shapes, prefix="paligemma.vision.") == pytest.approx(0.4e9, rel=0.05)
    assert expert == pytest.approx(300e6, rel=0.05)
    assert small < 10e6
    assert backbone + expert + small == total_params(shapes)
    non_muon = {s.name for s in shapes if not s.muon}
    assert "paligemma.llm.embed_tokens" in non_muon
    assert "proj.action_out_proj" in non_muon
    assert all(s.muon for s in shapes if s.name.startswith("expert."))
    assert all(s.count >= 1 and min(s.shape) >= 1 for s in shapes)


@pytest.mark.parametrize("name", ["qwen2", "vla", "tiny"])
def test_bench_shapes_match_model(name):
    shapes = full_size_shapes(name, size="tiny")
    w = build_workload(name, size="tiny")
    params = [p for p in w.model.parameters() if p.ndim >= 2]
    assert total_params(shapes) == sum(p.numel() for p in params)
    assert sum(s.count for s in shapes) == len(params)
    muon_numel = sum(p.numel() for n, p in w.model.named_parameters()
                     if n in set(w.muon_param_names))
    assert total_params(shapes, muon=True) == muon_numel
    keys = [(s.name, s.shape, s.muon) for s in shapes]
    assert len(keys) == len(set(keys))  # identical shapes are grouped
    layers = w.config.layers if name != "vla" else w.config.lm_layers
    q = [s for s in shapes if s.name.endswith("self_attn.q_proj")]
    assert q and q[0].count == layers


@pytest.mark.parametrize("name", ["qwen2", "vla"])
@pytest.mark.parametrize("size", ["small", "medium", "large"])
def test_bench_shapes_all_sizes(name, size):
    before = torch.get_default_device()
    shapes = full_size_shapes(name, size=size)
    assert torch.get_default_device() == before
    assert shapes and all(s.count >= 1 and min(s.shape) >= 1 for s in shapes)
    assert any(s.muon for s in shapes) and any(not s.muon for s in shapes)


def test_full_size_shapes_unknown():
    with pytest.raises(ValueError, match="name"):
        full_size_shapes("llama-70b")
    with pytest.raises(ValueError, match="size"):
        full_size_shapes("qwen2", size="xl")


def _write(tmp_path, data) -> str:
    path = tmp_path / "shapes.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


def test_load_shapes_json_roundtrip(tmp_path):
    data = [
        {"name": "q", "shape": [128, 64], "count": 4},
        {"name": "embed", "shape": [1000, 64], "count": 1, "muon": False},
    ]
    shapes = load_shapes_json(_write(tmp_path, data))
    assert shapes == [MatrixShape("q", (128, 64), 4),
                      MatrixShape("embed", (1000, 64), 1, muon=False)]
    assert load_shapes_json(_write(tmp_path, [])) == []


GOOD = {"name": "w", "shape": [8, 4], "count": 2}


@pytest.mark.parametrize("bad,match", [
    ("not json", "invalid JSON"),
    ({"name": "w"}, "JSON list"),
    ([GOOD, 3], "entry 1: expected an object"),
    ([GOOD, {"shape": [1, 2], "count": 1}], "entry 1: missing field 'name'"),
    ([GOOD, {"name": "x", "count": 1}], "entry 1: missing field 'shape'"),
    ([{"name": "x", "shape": [1, 2]}], "entry 0: missing field 'count'"),
    ([{"name": "", "shape": [1, 2], "count": 1}], "entry 0: field 'name'"),
    ([{"name": 5, "shape": [1, 2], "count": 1}], "entry 0: field 'name'"),
    ([GOOD, {"name": "x", "shape": [1, 2, 3], "count": 1}], r"entry 1 \('x'\): field 'shape'"),
    ([{"name": "x", "shape": [0, 2], "count": 1}], "field 'shape'"),
    ([{"name": "x", "shape": [1.5, 2], "count": 1}], "field 'shape'"),
    ([{"name": "x", "shape": [True, 2], "count": 1}], "field 'shape'"),
    ([{"name": "x", "shape": "1x2", "count": 1}], "field 'shape'"),
    ([{"name": "x", "shape": [1, 2], "count": 0}], "entry 0 \\('x'\\): field 'count'"),
    ([{"name": "x", "shape": [1, 2], "count": "3"}], "field 'count'"),
    ([{"name": "x", "shape": [1, 2], "count": 1, "muon": "no"}], "field 'muon'"),
    ([{"name": "x", "shape": [1, 2], "count": 1, "cout": 1}], "entry 0: unknown field 'cout'"),
])
def test_load_shapes_json_errors(tmp_path, bad, match):
    with pytest.raises(ValueError, match=match):
        load_shapes_json(_write(tmp_path, bad))


def test_load_shapes_json_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_shapes_json(tmp_path / "absent.json")
