"""Mixture-of-Experts laid out as torchtitan trains it (tests/support/moe.py): dense parameters over every data
rank, routed experts split over ``ep`` and sharded over ``efsdp``, two views of one world mesh, every rank
reading its own batch. One DMuon steps both, equal to one process with torch.optim.Muon per expert slice +
AdamW on the global batch; each Muon matrix orthogonalized once in the cluster; its bytes the step model's."""

from __future__ import annotations

import functools

import pytest
import torch

from support import moe
from support.scenarios import run_each, succeeded
from support.spawn import run_distributed

STEPS = 3
FOUR = [name for name, layout in moe.LAYOUTS.items() if layout.world == 4]


def _four_ranks(rank: int, world: int) -> dict:
    """Every 4-rank run of this file in one process group, each with its own result or error."""
    runs = {name: functools.partial(moe.train, rank, world, name, STEPS) for name in FOUR}
    runs["no token for two experts"] = functools.partial(moe.train, rank, world, "ep2-dim1", STEPS, route_to=0)
    runs["clipped"] = functools.partial(moe.train, rank, world, "ep2-dim1", STEPS, clip=0.05)
    runs["routed experts idle"] = functools.partial(moe.train, rank, world, "ep2-dim1", STEPS,
                                                    routed_off_at=STEPS - 1)
    runs["frozen experts"] = functools.partial(moe.train, rank, world, "ep2-dim1", STEPS,
                                               frozen=("layers.1.experts.w1", "layers.1.experts.w2"))
    runs["clipped on the replicate level"] = functools.partial(moe.train, rank, world, "ep2-replicate-level", STEPS,
                                                               clip=0.05)
    runs["clipped on FSDP2's HSDP"] = functools.partial(moe.train, rank, world, "ep2-native-hsdp", STEPS, clip=0.05)
    for name in ("ep2-dim1", "ep2-native-hsdp", "ep2-replicate-level"):
        runs[f"counted {name}"] = functools.partial(moe.train, rank, world, name, 2, counted=True)
    return run_each(runs)


def _two_ranks(rank: int, world: int) -> dict:
    return run_each({"ep2-efsdp1": functools.partial(moe.train, rank, world, "ep2-efsdp1", STEPS)})


@functools.cache
def _runs(world: int) -> list[dict]:
    return run_distributed(_four_ranks if world == 4 else _two_ranks, world, timeout_s=300)


def _results(run: str) -> list[dict]:
    world = 4 if run in FOUR or not run.startswith("ep2-efsdp1") else 2
    return [succeeded(r[run]) for r in _runs(world)]


def _worst(got: dict, ref: dict) -> tuple[str, float]:
    name = max(ref, key=lambda n: (got[n] - ref[n]).abs().max().item())
    return name, (got[name] - ref[name]).abs().max().item()


@pytest.mark.parametrize("layout", [*FOUR, "ep2-efsdp1"])
def test_expert_parallel_layouts_equal_one_process(layout):
    """Experts on dim 0 and dim 1 of their local stacks, E = 3 not divisible by ep = 2, ep spanning the whole
    fsdp dim (efsdp = 1), FSDP2's own HSDP or dmuon's replicate level outside, context parallelism folded into
    the dense shard dim (each sequence split over two ranks, ep borrowing them), tensor parallelism on the
    dense parameters with ep borrowing the tp ranks (torchtitan's etp = 1) or with the experts split over tp
    too and ep borrowing data ranks (etp = tp): torch.optim.Muon per slice + AdamW in one process on the global
    batch."""
    results = _results(layout)
    shape = moe.LAYOUTS[layout]
    ref = moe.reference(results[0]["initial"], STEPS, shape.world // (shape.cp * shape.tp), shape.experts)
    name, err = _worst(results[0]["params"], ref)
    assert err <= 1e-5, (name, err)
    # Every rank holds the same model, and every Muon matrix ran NS exactly once in the cluster.
    for r in results[1:]:
        assert all(torch.equal(r["params"][n], results[0]["params"][n]) for n in ref)
    matrices = 2 * (4 + 2 * shape.experts)  # per layer: mix, router, the shared expert's two, w1 and w2 per expert
    assert sum(r["orthogonalized"] for r in results) == matrices == len(results[0]["owners"])


@pytest.mark.parametrize("layout", [*FOUR, "ep2-efsdp1"])
def test_owners_balanced_over_every_rank_and_momentum_beside_the_shards(layout):
    """One balancer over the expert slices and the dense matrices together: every rank owns some of each, the
    largest owner's cost within 5% of the mean; each stack's momentum is sharded as the stack is (no copy)."""
    results = _results(layout)
    owners = results[0]["owners"]
    world = len(results)
    for rank in range(world):
        mine = [n for n, o in owners.items() if o == rank]
        assert any(".experts." in n for n in mine) and any(".experts." not in n for n in mine), (rank, mine)
    loads = results[0]["loads"]
    assert max(loads) <= 1.05 * sum(loads) / len(loads), loads
    for name, value in results[0]["params"].items():
        if ".experts." in name:
            assert sum(r["momentum_numel"][name] for r in results) == value.numel(), name


def test_an_expert_without_tokens_and_heavy_imbalance_equal_one_process():
    """Every token routed to experts 0 and 1 (held by ep rank 0): expert 2's ranks receive nothing, its
    gradient is zero (a grouped GEMM over no rows), and Muon still steps it (momentum, weight decay) as
    torch.optim.Muon does."""
    results = _results("no token for two experts")
    ref = moe.reference(results[0]["initial"], STEPS, 4, 3, route_to=0)
    name, err = _worst(results[0]["params"], ref)
    assert err <= 1e-5, (name, err)


def test_experts_without_a_gradient_on_every_rank_are_not_stepped():
    """A step where the last layer's router and routed experts do not run (a framework that skips them): their
    gradients are None on every rank and, as torch.optim.Muon does, Muon leaves them (no momentum, no decay)."""
    results = _results("routed experts idle")
    ref = moe.reference(results[0]["initial"], STEPS, 4, 3, routed_off_at=STEPS - 1)
    name, err = _worst(results[0]["params"], ref)
    assert err <= 1e-5, (name, err)
    idle = 2 * 3 + 1  # the layer's expert slices and its router, at the last step
    busy = sum(r["orthogonalized"] for r in _results("ep2-dim1"))
    assert sum(r["orthogonalized"] for r in results) == busy - idle


@pytest.mark.parametrize("run", ["clipped", "clipped on the replicate level", "clipped on FSDP2's HSDP"])
def test_clipping_by_the_whole_models_norm_across_the_meshes(run):
    """``opt.clip_grad_norm_`` over dense and expert DTensors of different meshes (torch's own raises there):
    the one-process norm of every gradient, and the clipped result. The norm is what checks each layout's
    gradient scale (the experts' divide factor), which Muon's normalized update does not see."""
    results = _results(run)
    norms: list[float] = []
    ref = moe.reference(results[0]["initial"], STEPS, 4, 3, clip=0.05, norms=norms)
    assert results[0]["norms"] == pytest.approx(norms, rel=1e-6)
    assert all(n > 0.05 for n in norms)  # every step clipped
    name, err = _worst(results[0]["params"], ref)
    assert err <= 1e-5, (name, err)


def test_frozen_experts_while_the_rest_trains():
    frozen = ("layers.1.experts.w1", "layers.1.experts.w2")
    results = _results("frozen experts")
    ref = moe.reference(results[0]["initial"], STEPS, 4, 3, frozen=frozen)
    name, err = _worst(results[0]["params"], ref)
    assert err <= 1e-5, (name, err)
    assert all(torch.equal(results[0]["params"][n], results[0]["initial"][n]) for n in frozen)
    assert not any(n.startswith(frozen) for n in results[0]["owners"])


@pytest.mark.parametrize("layout", ["ep2-dim1", "ep2-native-hsdp", "ep2-replicate-level"])
def test_counted_collectives_equal_the_step_model(layout):
    """Each rank's collectives of the last step (bf16 wire), level by level, are the ones the step model
    prices from the plan's pieces: expert slices' rows come from the efsdp ranks holding them, wherever
    their owner is; on dmuon's replicate level the gradients' column reduce-scatter across replicas (fp32)
    and the other parameters' all-reduce too."""
    from dmuon.costmodel.traffic import owner_exchange_collectives
    from support.step_comm import check_counted_log

    results = _results(f"counted {layout}")
    first = results[0]
    shapes, owners, blocks = ([i[k] for i in first["infos"]] for k in range(3))
    assert all(r["blocks_in_backward"] == r["blocks"] for r in results)
    level = moe.LAYOUTS[layout].replicate_level
    # FSDP2's post-backward order: the units with Muon matrices last to first (each layer's experts, then its
    # dense unit), then the root unit (embedding, norm, head), whose landing carries the pending slices.
    order = [*sorted(set(blocks), reverse=True), len(set(blocks))]
    backward, step = owner_exchange_collectives(shapes, owners, blocks, first["replicate"], first["shard"], 2,
                                                waves=first["waves"], pieces=first["pieces"],
                                                block_order=order if level else None,
                                                gradient_bytes=4 if level else None, hop_a_spread=8 if level else None)
    check_counted_log(backward + step, results, first["replicate"], level)
    assert any(c.critical for c in backward) and all(c.critical for c in step)


@pytest.mark.parametrize("kind,message", [
    ("two roots", "live on DeviceMeshes with no common root"),
    ("ep along rows", "an expert stack split over the 'ep' mesh dim by Shard(dim=1), not along its expert dim"),
    ("rows claimed twice", "['layers.0.mix.weight']: a local shard is not where its DTensor placements put it"),
])
def test_layouts_dmuon_cannot_read_as_experts_raise_on_every_rank(kind, message):
    errors = run_distributed(moe.refused, 2, kind, timeout_s=120)
    assert all(message in e for e in errors), errors
