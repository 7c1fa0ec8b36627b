"""Expert stacks: a (E, m, n) parameter is E Muon matrices, each orthogonalized on its own, as
torch.optim.Muon applied per slice; a conv kernel keeps its flattened view; the view is overridable."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import dmuon

from support.experts import ExpertNet, reference, train
from support.scenarios import run_each, shared_runs

STEPS = 3


def _worst(got: dict, ref: dict) -> tuple[str, float]:
    name = max(ref, key=lambda n: (got[n] - ref[n]).abs().max().item())
    return name, (got[name] - ref[name]).abs().max().item()


def test_default_views_and_plan_entries():
    conv = nn.Conv2d(3, 4, 3)
    model = nn.ModuleDict({"conv": conv, "net": ExpertNet(experts=3)})
    names = [i.name for i in dmuon.prepare(model).infos]
    assert names == ["conv.weight", "net.moe.experts[0]", "net.moe.experts[1]", "net.moe.experts[2]",
                     "net.moe.down.weight"]
    infos = {i.name: i for i in dmuon.prepare(model).infos}
    assert infos["conv.weight"].matrix_shape == (4, 27) and infos["net.moe.experts[1]"].matrix_shape == (10, 6)
    flat = dmuon.prepare(model, matrix_view={"net.moe.experts": "flatten"})
    assert [i.name for i in flat.infos][1] == "net.moe.experts" and flat.infos[1].matrix_shape == (3, 60)
    with pytest.raises(ValueError, match="'net.moe.down.weight': matrix_view 'stack' needs >= 3 dims"):
        dmuon.prepare(model, matrix_view=lambda n, p: "stack")
    with pytest.raises(ValueError, match="'conv.weight': matrix_view must be one of"):
        dmuon.prepare(model, matrix_view={"conv.weight": "rows"})


@pytest.mark.parametrize("view", ["stack", "flatten"])
def test_one_process_equals_torch_muon_per_slice(view):
    got = train(0, 1, STEPS, view=view)
    assert got["orthogonalized"] == (4 if view == "stack" else 2)
    name, err = _worst(got["params"], reference(1, STEPS, view=view))
    assert err <= 1e-5, (name, err)


def _on_two(rank: int, world: int) -> dict:
    """Every 2-rank run of this file in one process group (a spawn costs more than the work), each with its
    own result or its own error."""
    from support.experts import train_gather, train_qkv

    return run_each({"stacks": lambda: train(rank, world, STEPS, 3, None, None, None),
                     "gather": lambda: train_gather(rank, world, STEPS),
                     **{f"qkv gather {g}": functools.partial(train_qkv, rank, world, STEPS, g, "gather")
                        for g in (3, 6)}})


def _on_four(rank: int, world: int) -> dict:
    """Every 4-rank run of this file in one process group."""
    from support.experts import train_expert_parallel, train_qkv

    return run_each({
        "stacks 4-ranks-waves": lambda: train(rank, world, STEPS, 3, None, None, 4),
        "stacks hsdp-2x2-waves": lambda: train(rank, world, STEPS, 3, (2, 2), None, 4),
        "expert parallel": lambda: train_expert_parallel(rank, world, STEPS),
        "qkv 3": lambda: train_qkv(rank, world, STEPS, 3, "dmuon", None),
        "qkv 6": lambda: train_qkv(rank, world, STEPS, 6, "dmuon", (2, 2)),
        "stacks clipped": lambda: train(rank, world, STEPS, 3, None, None, None, clip=CLIP),
        "stacks clipped, overlap off": lambda: train(rank, world, STEPS, 3, None, None, None, clip=CLIP,
                                                     overlap=False)})


_two = shared_runs(_on_two, 2)  # each rank's result of a 2-rank run (its ranks' error when it raised)
_four = shared_runs(_on_four, 4)


@pytest.mark.parametrize("world,run", [(2, "stacks"), (4, "stacks 4-ranks-waves"), (4, "stacks hsdp-2x2-waves")],
                         ids=["2-ranks", "4-ranks-waves", "hsdp-2x2-waves"])
def test_sharded_stacks_equal_torch_muon_per_slice(world, run):
    # 3 experts divide neither 2 nor 4 shard columns: on 4 ranks one column holds none.
    results = (_two if world == 2 else _four)(run)
    name, err = _worst(results[0]["params"], reference(world, STEPS))
    assert err <= 1e-5, (name, err)
    # Each expert has its own owner; over the mesh each is orthogonalized once.
    assert results[0]["names"][:3] == ["moe.experts[0]", "moe.experts[1]", "moe.experts[2]"]
    assert sum(r["orthogonalized"] for r in results) == 4
    assert len(set(results[0]["owners"][:3])) == min(3, world)
    # The stack's momentum is held once over the whole mesh (HSDP: split over the replicas too).
    assert sum(r["momentum_numel"] for r in results) == 3 * 10 * 6


def test_gather_then_compute_orthogonalizes_stacks_per_slice_too():
    got = _two("gather")[0]
    name, err = _worst(got, reference(2, STEPS))
    assert err <= 1e-5, (name, err)


def test_expert_parallel_stacks_equal_torch_muon_per_slice():
    """Experts split over an ``ep`` mesh dim (3 experts over 2: uneven), FSDP2 over ``dp`` inside it."""
    results = _four("expert parallel")
    name, err = _worst(results[0]["params"], reference(2, STEPS))
    assert err <= 1e-5, (name, err)
    assert "_StridedShard(dim=0" in results[0]["placements"]
    # ep rank 0 holds experts 0-1 (dp ranks 0 and 1 one each), ep rank 1 expert 2 (dp rank 1 none):
    # positions s = dp * 2 + ep; each expert lives whole on one position.
    pieces = results[0]["pieces"]
    assert [[rows for _, rows in pieces[f"moe.experts[{e}]"]] for e in range(3)] == \
        [[10, 0, 0, 0], [0, 0, 10, 0], [0, 10, 0, 0]]
    assert sum(r["orthogonalized"] for r in results) == 4
    assert sum(r["momentum_numel"] for r in results) == 3 * 10 * 6


@pytest.mark.parametrize("groups,mesh_shape", [(3, None), (6, (2, 2))], ids=["qkv-4-ranks", "heads-hsdp-2x2"])
def test_row_groups_of_a_fused_qkv_equal_torch_muon_per_group(groups, mesh_shape):
    """``matrix_view="rows:K"``: q, k and v (or each of 6 heads) orthogonalized on their own; 30 rows
    over 4 (8, 8, 8, 6) or 2 shard ranks cut the groups at rank boundaries that are not group boundaries."""
    from support.experts import qkv_reference

    results = _four(f"qkv {groups}")
    ref = qkv_reference(4, STEPS, groups)
    name, err = _worst(results[0]["params"], ref)
    assert err <= 1e-5, (name, err)
    height = 30 // groups
    assert results[0]["names"][:groups] == [f"qkv.weight[rows {g * height}:{(g + 1) * height}]" for g in range(groups)]
    assert sum(r["orthogonalized"] for r in results) == groups + 1
    oracle = _two(f"qkv gather {groups}")[0]
    name, err = _worst(oracle["params"], qkv_reference(2, STEPS, groups))
    assert err <= 1e-5, ("gather", name, err)


def test_row_groups_must_divide_the_rows():
    model = nn.ModuleDict({"qkv": nn.Linear(4, 30, bias=False)})
    with pytest.raises(ValueError, match="'qkv.weight': matrix_view 'rows:4' needs K to divide its 30 rows"):
        dmuon.prepare(model, matrix_view={"qkv.weight": "rows:4"})
    with pytest.raises(ValueError, match="'qkv.weight': matrix_view must be one of"):
        dmuon.prepare(model, matrix_view={"qkv.weight": "rows:x"})


CLIP = 1e-3  # below every gradient norm here: every step clips


def test_launches_of_expert_stacks_survive_clipping():
    """Each expert its own matrix and owner: after torch's clip_grad_norm_ every launch stands for the
    clipped gradients (the owners rescale), within float32 rounding of ``overlap=False``."""
    clipped, overlap_off = _four("stacks clipped"), _four("stacks clipped, overlap off")
    for r, off in zip(clipped, overlap_off):
        kept, rescaled = r["launches"]
        assert kept == rescaled > 0
        assert off["launches"] == (0, 0)
    got, want = clipped[0]["params"], overlap_off[0]["params"]
    assert max((got[n] - want[n]).abs().max().item() for n in want) <= 1e-6
