"""FSDP2's layout APIs (torch 2.12+), as torchtitan 0.3.0 uses them, read by DMuon (tests/support/layout_apis.py).

* ``fully_shard(..., dp_mesh_dims=DataParallelMeshDims(shard=..., replicate=...))`` over parameters that are
  already DTensors on the full SPMD mesh: a dense model (OddNet) on one mesh, 1-D, two shard dims FSDP2
  flattens into one, HSDP with the replicate dim first and last; the MoE model (support.moe) with its dense
  parameters on ``(dp_replicate,) fsdp`` and its expert stacks on ``(dp_replicate,) efsdp, ep``.
* ``shard_placement_fn`` returning ``ShardPlacementResult``: the expert stacks on the efsdp mesh (1-D
  ``FSDPMeshInfo``, HSDP ``HSDPMeshInfo``) inside their block's FSDP group, beside the dense parameters on
  the block's own mesh.

Each equals one process with torch.optim.Muon (fp32 NS; expert stacks slice by slice) + AdamW on the global
batch, and each Muon matrix is orthogonalized once in the cluster. dmuon calls neither API: it reads the
parameters' meshes and placements these layouts leave.
"""

from __future__ import annotations

import functools

import pytest
import torch

from support import equivalence, layout_apis, moe
from support.scenarios import run_each, succeeded
from support.spawn import run_distributed

STEPS = 3


def _missing_layout_apis() -> list[str]:
    """The FSDP2 layout APIs these runs build with that this torch lacks: torch 2.11 has neither
    ``DataParallelMeshDims`` (``fully_shard(dp_mesh_dims=...)``) nor ``ShardPlacementResult``; 2.12+ have both."""
    missing = []
    for module, name in (("torch.distributed.fsdp", "DataParallelMeshDims"),
                         ("torch.distributed.fsdp._fully_shard._fsdp_common", "ShardPlacementResult")):
        try:
            layout_apis.layout_api(module, name)
        except RuntimeError:
            missing.append(f"{module}.{name}")
    return missing


# No model can be laid out so on a torch without these APIs: nothing of dmuon's to run there.
pytestmark = pytest.mark.skipif(bool(_missing_layout_apis()),
                                reason=f"torch {torch.__version__} has no {', '.join(_missing_layout_apis())} "
                                       "(FSDP2's layout APIs, torch 2.12+)")
DENSE = list(layout_apis.DENSE_LAYOUTS)
MOE = list(layout_apis.MOE_LAYOUTS)
NEXT_FORWARD = "placement-ep2-hsdp next forward"


def _four_ranks(rank: int, world: int) -> dict:
    """Every 4-rank run of this file in one process group, each with its own result or error."""
    runs = {name: functools.partial(layout_apis.dense, rank, world, name, STEPS) for name in DENSE}
    runs.update({name: functools.partial(layout_apis.experts, rank, world, name, STEPS) for name in MOE})
    runs[NEXT_FORWARD] = functools.partial(layout_apis.experts, rank, world, "placement-ep2-hsdp", STEPS,
                                           apply_updates="next_forward")
    return run_each(runs)


@functools.cache
def _runs() -> list[dict]:
    return run_distributed(_four_ranks, 4, timeout_s=300)


def _results(run: str) -> list[dict]:
    return [succeeded(r[run]) for r in _runs()]


def _worst(got: dict, ref: dict) -> tuple[str, float]:
    assert got.keys() == ref.keys()
    name = max(ref, key=lambda n: (got[n] - ref[n]).abs().max().item())
    return name, (got[name] - ref[name]).abs().max().item()


@functools.cache
def _dense_reference() -> dict:
    return equivalence.reference(4, torch.float32)[0]


# The layout FSDP2 leaves each dense parameter in: (its mesh's dim names, its placements).
_DENSE_PLACED = {
    "dims-1d": ("('fsdp',)", "(Shard(dim=0),)"),
    "dims-1d-two-dims": ("('dp_shard_cp',)", "(Shard(dim=0),)"),  # FSDP2's flattened dim
    "dims-hsdp": ("('dp_replicate', 'fsdp')", "(Replicate(), Shard(dim=0))"),
    "dims-hsdp-replicate-last": ("('fsdp', 'dp_replicate')", "(Shard(dim=0), Replicate())"),
}


@pytest.mark.parametrize("layout", DENSE)
def test_dense_model_under_dp_mesh_dims_equals_one_process(layout):
    """OddNet as ``distribute_module`` + ``fully_shard(dp_mesh_dims=...)`` (block 1 unused at step 1):
    the one-process result within 1e-5, the same model on every rank, NS once per matrix."""
    results = _results(layout)
    assert set(results[0]["placements"].values()) == {_DENSE_PLACED[layout]}
    name, err = _worst(results[0]["params"], _dense_reference())
    assert err <= 1e-5, (name, err)
    for r in results[1:]:
        assert all(torch.equal(r["params"][n], results[0]["params"][n]) for n in results[0]["params"])
    assert sum(r["orthogonalized"] for r in results) == equivalence.N_MATRICES == len(results[0]["owners"])


@pytest.mark.parametrize("layout", ["dims-1d", "dims-1d-two-dims", "dims-hsdp"])
def test_dense_momentum_is_held_once_across_the_cluster(layout):
    """The momentum lives beside the shards, split over the replicas too (HSDP): each matrix's buffers over
    all ranks add up to it once. (With the replicate dim last, dmuon reads the mesh as one shard level and
    each replica keeps its own copy: right, but twice the momentum.)"""
    results = _results(layout)
    for name in results[0]["owners"]:
        held = sum(r["momentum_numel"][name] for r in results)
        assert held == results[0]["params"][name].numel(), (name, held)


@pytest.mark.parametrize("layout", [*MOE, NEXT_FORWARD])
def test_moe_under_dp_mesh_dims_and_per_parameter_meshes_equals_one_process(layout):
    """The MoE model with its stacks on ``(dp_replicate,) efsdp, ep``, laid out by ``dp_mesh_dims`` (their own
    FSDP unit) or by ``ShardPlacementResult`` (inside the block's unit): torch.optim.Muon per expert slice +
    AdamW in one process within 1e-5; NS once per matrix; each stack's momentum sharded as the stack is.
    ``next forward``: the updates applied in the next forward (dmuon asks whether a unit is gathered, of both
    of the block's FSDP groups)."""
    results = _results(layout)
    world, _, experts, _, replicate, *_ = moe.LAYOUTS[layout_apis.MOE_LAYOUTS[layout.split()[0]]]
    placed = results[0]["placements"]
    dense_dims = "('dp_replicate', 'fsdp')" if replicate > 1 else "('fsdp',)"
    expert_dims = "('dp_replicate', 'efsdp', 'ep')" if replicate > 1 else "('efsdp', 'ep')"
    assert {d for n, (d, _) in placed.items() if ".experts." not in n} == {dense_dims}
    assert {d for n, (d, _) in placed.items() if ".experts." in n} == {expert_dims}
    assert results[0]["experts_own_unit"] == [layout.startswith("dims-")] * 2
    ref = moe.reference(results[0]["initial"], STEPS, world, experts)
    name, err = _worst(results[0]["params"], ref)
    assert err <= 1e-5, (name, err)
    for r in results[1:]:
        assert all(torch.equal(r["params"][n], results[0]["params"][n]) for n in ref)
    matrices = 2 * (4 + 2 * experts)  # per layer: mix, router, the shared expert's two, w1 and w2 per expert
    assert sum(r["orthogonalized"] for r in results) == matrices == len(results[0]["owners"])
    for stack in moe.stacks(moe.MoENet(experts)):
        assert sum(r["momentum_numel"][stack] for r in results) == ref[stack].numel(), stack
