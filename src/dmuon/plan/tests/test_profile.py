"""Profiling: what is measured, the on-disk cache, and the cost tables balancers read."""

from __future__ import annotations

import json

import pytest
import torch

from dmuon.plan import profile
from dmuon.plan.profile_cache import cache_header
from dmuon.plan.profile import (
    CostTable,
    analytical_table,
    cache_path,
    cached_costs,
    ns_settings,
    profile_costs,
    table_from_records,
)

SHAPES = {(8, 16): 3, (16, 4): 2}
# "standard" with fixed batching keeps the autotuner out of these small, fast runs.
NS = {"method": "standard", "batching": "batched", "steps": 2}


@pytest.fixture
def counted(monkeypatch):
    calls = []
    real = profile.measure_update

    def spy(shape, batch, **kwargs):
        calls.append((shape, batch))
        return real(shape, batch, **kwargs)

    monkeypatch.setattr(profile, "measure_update", spy)
    return calls


def _profile(tmp_path, **kw):
    args = dict(dtype=torch.float32, ns_kwargs=NS, cache_dir=tmp_path, device="cpu", repeats=1)
    return profile_costs(SHAPES, **(args | kw))


def test_every_shape_and_batch_is_measured_then_cached(tmp_path, counted):
    first = _profile(tmp_path)
    wanted = {((8, 16), b) for b in (1, 2, 3)} | {((16, 4), b) for b in (1, 2)}
    assert set(first.entries) == wanted and sorted(counted) == sorted(wanted)
    assert first.measured == 5 and first.source == "measured" and first.unit == "seconds"
    assert all(v > 0 for v in first.entries.values())
    assert first.profile_seconds > 0 and first.device.startswith("cpu:")
    files = list(tmp_path.glob("plan-profile-*.json"))
    assert len(files) == 1 and not list(tmp_path.glob("*.tmp"))

    second = _profile(tmp_path)
    assert len(counted) == 5  # nothing measured again
    assert second.entries == first.entries and second.measured == 0 and second.source == "cache"
    assert cached_costs(SHAPES, dtype=torch.float32, ns_kwargs=NS, cache_dir=tmp_path, device="cpu").entries \
        == first.entries

    # A shape list that grows only measures what is new.
    profile_costs({**SHAPES, (4, 4): 1}, dtype=torch.float32, ns_kwargs=NS, cache_dir=tmp_path, device="cpu",
                  repeats=1)
    assert counted[5:] == [((4, 4), 1)]


def test_cache_key_separates_settings_and_ignores_bad_files(tmp_path, counted):
    base = _profile(tmp_path, max_batch=1)
    assert set(base.entries) == {((8, 16), 1), ((16, 4), 1)}
    _profile(tmp_path, max_batch=1, ns_kwargs={**NS, "steps": 3})
    _profile(tmp_path, max_batch=1, dtype=torch.float64)
    assert len(counted) == 6 and len(list(tmp_path.glob("plan-profile-*.json"))) == 3

    _, key = ns_settings(NS)
    path = cache_path(tmp_path, cache_header(base.device, torch.float32, key))
    assert path.exists()
    path.write_text("{not json")
    again = _profile(tmp_path, max_batch=1)
    assert again.measured == 2 and json.loads(path.read_text())["entries"]

    data = json.loads(path.read_text())
    data["header"]["device"] = "cuda:Some Other GPU"
    data["entries"] = {"8x16|1": -1.0, "16x4|1": "fast", "garbage": 1.0}
    path.write_text(json.dumps(data))
    assert _profile(tmp_path, max_batch=1).measured == 2  # foreign header: ignored
    data = json.loads(path.read_text())
    data["entries"]["8x16|1"] = float("nan")
    path.write_text(json.dumps(data))
    assert _profile(tmp_path, max_batch=1).measured == 1  # the one bad entry


def test_budget_keeps_batch_one(tmp_path, counted):
    table = _profile(tmp_path, budget_s=0.0)
    assert set(table.entries) == {((8, 16), 1), ((16, 4), 1)}


def test_argument_errors(tmp_path):
    with pytest.raises(ValueError, match="ns_kwargs"):
        _profile(tmp_path, ns_kwargs={"stepz": 3})
    with pytest.raises(ValueError, match="shapes_with_counts"):
        profile_costs([((8,), 1)], device="cpu", cache_dir=tmp_path)
    with pytest.raises(ValueError, match="shapes_with_counts"):
        profile_costs({(8, 8): 0}, device="cpu", cache_dir=tmp_path)
    with pytest.raises(ValueError, match="dtype"):
        _profile(tmp_path, dtype=torch.int32)
    with pytest.raises(ValueError, match="repeats"):
        _profile(tmp_path, repeats=0)
    with pytest.raises(ValueError, match="max_batch"):
        _profile(tmp_path, max_batch=0)


def test_unwritable_cache_still_returns_the_table(tmp_path, counted):
    blocker = tmp_path / "file"
    blocker.write_text("")
    table = profile_costs({(4, 4): 1}, ns_kwargs=NS, cache_dir=blocker / "sub", device="cpu", repeats=1)
    assert set(table.entries) == {((4, 4), 1)}


def test_cost_tables():
    t = analytical_table([((8, 16), 2), ((8, 16), 1), ((4, 4), 1)], ns_steps=5)
    assert t.unit == "flops" and set(t.entries) == {((8, 16), 1), ((4, 4), 1)}
    assert t[(8, 16), 1] == t[[8, 16], 1] and ((4, 4), 1) in t and ((4, 4), 2) not in t
    assert t.missing([(8, 16), (2, 2)]) == [(2, 2)]
    recs = [{"shape": [8, 16], "batch": 1, "seconds": 0.5}, {"shape": [8, 16], "batch": 2, "seconds": 0.75}]
    table = table_from_records(recs)
    assert table.batch_costs((8, 16)) == {1: 0.5, 2: 0.75} and table.to_records() == recs
    assert isinstance(table, CostTable) and table.source == "file"
