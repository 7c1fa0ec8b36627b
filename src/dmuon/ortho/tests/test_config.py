"""NSConfig: one validated NS configuration, with errors that name the field."""

from __future__ import annotations

import pytest
import torch

from dmuon.ortho import KELLER, NSConfig, orthogonalize_many


@pytest.mark.parametrize("kwargs,field", [
    (dict(method="magic"), "method"), (dict(dtype=torch.int32), "dtype"), (dict(steps=0), "steps"),
    (dict(steps=2.5), "steps"), (dict(steps=True), "steps"), (dict(eps=-1.0), "eps"),
    (dict(batching="sometimes"), "batching"), (dict(coefficients="nope"), "coefficients"),
    (dict(coefficients=(1.0, 2.0)), "coefficients"),
])
def test_bad_values_name_their_field(kwargs, field):
    with pytest.raises(ValueError, match=f"ns {field}"):
        NSConfig(**kwargs)


def test_from_mapping_rejects_unknown_keys_and_passes_configs_through():
    with pytest.raises(ValueError, match="ns_kwargs: unknown key 'stepz'"):
        NSConfig.from_mapping({"stepz": 3}, "ns_kwargs")
    cfg = NSConfig(steps=3)
    assert NSConfig.from_mapping(cfg) is cfg
    assert NSConfig.from_mapping(None) == NSConfig()
    assert NSConfig.from_mapping({"steps": 3}) == cfg


def test_frozen_hashable_and_a_list_schedule_becomes_tuples():
    schedule = [list(KELLER), [3.0, -3.2, 1.2]]
    cfg = NSConfig(coefficients=schedule, steps=2)
    assert cfg.coefficients == (tuple(KELLER), (3.0, -3.2, 1.2))
    assert hash(cfg) == hash(NSConfig(coefficients=[list(KELLER), [3.0, -3.2, 1.2]], steps=2))
    with pytest.raises(AttributeError):
        cfg.steps = 4  # type: ignore[misc]


def test_kwargs_run_orthogonalize_many_and_differences_are_named():
    cfg = NSConfig(method="standard", dtype=torch.float32, steps=3)
    g = torch.randn(8, 5, generator=torch.Generator().manual_seed(0))
    (a,) = orthogonalize_many([g], **cfg.kwargs())
    (b,) = orthogonalize_many([g], method="standard", dtype=torch.float32, steps=3)
    assert torch.equal(a, b) and a.dtype == torch.float32
    assert NSConfig().differences(cfg) == ["method: 'auto' != 'standard'", "steps: 5 != 3",
                                           "dtype: torch.bfloat16 != torch.float32"]


def test_cache_key_is_canonical():
    # The same schedule spelled two ways keys the same profile cache.
    assert NSConfig(coefficients=KELLER).cache_key() == NSConfig(coefficients=[KELLER] * 5).cache_key()
    assert NSConfig().cache_key() != NSConfig(coefficients="polar_express").cache_key()
    assert NSConfig().cache_key()["dtype"] == "bfloat16"


def test_owner_update_takes_a_groups_overrides():
    from dmuon.ortho.owner import owner_update

    cfg = NSConfig(method="standard", dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    mats = [torch.randn(6, 9, generator=gen), torch.randn(6, 9, generator=gen)]
    got = owner_update(mats, cfg, {"ns_steps": 3, "eps": 1e-5, "lr": 0.1})
    want = orthogonalize_many(mats, method="standard", dtype=torch.float32, steps=3, eps=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert not torch.equal(owner_update(mats, cfg)[0], got[0])  # 5 steps without the group
