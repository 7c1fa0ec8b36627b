"""HSDP: one global owner per matrix over a (replicate x shard) mesh, two-level routing."""

from __future__ import annotations

import pytest
import torch

from dmuon.costmodel.traffic import owner_traffic, shard_rows
from dmuon.plan.batches import default_return_waves

from support import faults
from support.cases import Case, run_cases
from support.equivalence import N_MATRICES, SKIP, STEPS, check_sharded_state, max_diff, reference
from support.spawn import run_distributed


@pytest.mark.parametrize("mesh_shape", [(2, 2), (3, 2)])
def test_hsdp_matches_single_process_reference(mesh_shape):
    world_size = mesh_shape[0] * mesh_shape[1]
    cases = [
        Case(zero=2, ns_dtype=torch.float32, steps=STEPS, skip=SKIP, mesh_shape=mesh_shape),
        Case(zero=3, ns_dtype=torch.float32, steps=STEPS, skip=SKIP, mesh_shape=mesh_shape, overlap=False,
             return_waves=4),  # both hops of the returns pipelined in waves
        # With an accelerator's default return waves (no speculation), against gather-then-compute.
        Case(zero=3, ns_dtype=torch.bfloat16, steps=STEPS, skip=SKIP, mesh_shape=mesh_shape, bf16=True,
             return_waves=default_return_waves("cuda")),
        Case(kind="gather", zero=3, ns_dtype=torch.bfloat16, steps=STEPS, skip=SKIP, mesh_shape=mesh_shape, bf16=True),
    ]
    results = run_distributed(run_cases, world_size, cases, timeout_s=240)
    ref = reference(world_size, torch.float32)[0]
    for k, case in enumerate(cases[:2]):
        out = results[0][k]
        diff, worst = max_diff(out["params"], ref)
        assert diff <= 1e-5, f"{case}: {worst} differs by {diff:.3g}"
        for step in range(STEPS):
            # NS once per matrix in the whole cluster, not once per replica.
            done = sum(r[k]["stats"][step]["orthogonalized"] for r in results)
            assert done == N_MATRICES - 3 * len(SKIP.get(step, ()))
        # Owners are global: they spread over the replicas, not one replica's ranks.
        owners = set(out["owners"].values())
        assert len(owners) > mesh_shape[1] and owners <= set(range(world_size))
    # Under bf16 mixed precision and bf16 NS, the same as gather-then-compute on the same HSDP model.
    diff, worst = max_diff(results[0][2]["params"], results[0][3]["params"])
    assert diff <= 1e-5, worst
    # No Muon state is duplicated across replicas: rank (r, s) keeps the momentum of its rows
    # (FSDP2's row shard s) x its replica's columns, so over the mesh every element is held once.
    check_sharded_state(results, 0, results[0][0]["shapes"])
    replicate, shard = mesh_shape
    for name, shape in results[0][0]["shapes"].items():
        inner = torch.Size(shape[2:]).numel()
        for rank, out in enumerate(results):
            r, s = divmod(rank, shard)
            expected = shard_rows(shape[0], shard)[s] * shard_rows(shape[1], replicate)[r] * inner
            assert out[0]["momentum_numel"][name] == expected, (name, rank)


@pytest.mark.parametrize("mesh_shape,ns_dtype", [(None, torch.float32), (None, torch.bfloat16),
                                                 ((2, 2), torch.bfloat16), ((3, 2), torch.float32)])
def test_counted_bytes_match_the_traffic_model(mesh_shape, ns_dtype):
    world_size = 3 if mesh_shape is None else mesh_shape[0] * mesh_shape[1]
    out = run_distributed(faults.traffic, world_size, mesh_shape, ns_dtype, timeout_s=120)
    replicate, shard = mesh_shape or (1, world_size)
    elem = torch.empty((), dtype=ns_dtype).element_size()
    model = owner_traffic(out[0]["shapes"], out[0]["owners"], replicate, shard, elem)
    for rank, o in enumerate(out):
        st, m = o["stats"], model[rank]
        counted = (st["intra_bytes_sent"], st["intra_bytes_received"], st["inter_bytes_sent"], st["inter_bytes_received"])
        assert counted == (m.intra_sent, m.intra_received, m.inter_sent, m.inter_received), rank
    if replicate > 1:
        # Each matrix's update crosses the slow level R-1 times in all; its direction's
        # column slices reach the owner's replica from the R-1 others, (R-1)/R of it.
        inter = 0
        for shape, owner in zip(out[0]["shapes"], out[0]["owners"]):
            numel, kept = torch.Size(shape).numel(), shard_rows(shape[1], replicate)[owner // shard]
            inter += (replicate - 1) * numel + numel - numel // shape[1] * kept
        assert sum(o["stats"]["inter_bytes_sent"] for o in out) == inter * elem
    assert sum(o["stats"]["orthogonalized"] for o in out) == N_MATRICES
