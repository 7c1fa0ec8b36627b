"""The step model's dmuon collectives against the runtime's counted bytes, collective by collective, per rank."""

from __future__ import annotations

import pytest
import torch

from dmuon.costmodel.traffic import owner_exchange_collectives, shard_rows, step_collectives
from dmuon.util.spawn import run_distributed

from support.step_comm import counted_step


@pytest.mark.parametrize("mesh_shape,ns_dtype,zero,waves", [
    (None, torch.float32, 3, None), (None, torch.bfloat16, 3, 4), ((2, 2), torch.float32, 3, None),
    ((2, 2), torch.bfloat16, 3, 4), ((2, 2), torch.bfloat16, 2, 4),
], ids=["fsdp-fp32", "fsdp-bf16-waves", "hsdp2x2-fp32", "hsdp2x2-bf16-waves", "hsdp2x2-bf16-zero2-waves"])
def test_counted_collectives_equal_the_model_per_rank(mesh_shape, ns_dtype, zero, waves):
    # dmuon's exchange is the same under ZeRO-2 and ZeRO-3 (reshard_after_forward changes FSDP2's gathers only).
    results = run_distributed(counted_step, 4, mesh_shape, ns_dtype, zero, 2, waves, timeout_s=240)
    replicate, shard = mesh_shape or (1, 4)
    infos = results[0]["infos"]
    assert all(r["infos"] == infos for r in results)
    shapes = [i[0] for i in infos]
    owners = [i[1] for i in infos]
    blocks = [i[2] for i in infos]
    # The plan's row split is the model's (torch.chunk).
    assert all(list(i[3]) == shard_rows(i[0][0], shard) for i in infos)
    # Steady state: every block went to its owners from backward.
    assert all(r["blocks_in_backward"] == r["blocks"] for r in results)
    # The update returns are pipelined with the owners' NS batches, in waves every rank agrees on.
    expected_waves = waves
    waves = results[0]["waves"]
    assert all(r["waves"] == waves for r in results) and sorted(sum(waves, [])) == list(range(len(infos)))
    assert len(waves) == 1 if expected_waves is None else 1 < len(waves) <= expected_waves
    backward, step = owner_exchange_collectives(shapes, owners, blocks, replicate, shard, ns_dtype.itemsize,
                                                waves=waves)
    modelled = backward + step
    # The whole step's order, with FSDP2's collectives left out, is the same.
    in_step = [c for c in step_collectives("dmuon", shapes, owners, blocks, replicate, shard,
                                           wire_bytes=ns_dtype.itemsize, waves=waves) if c.label.startswith("dmuon")]
    assert [c.label for c in in_step] == [c.label for c in modelled]
    # Per block one exchange, two on HSDP (column slices across replicas, then rows to the owner).
    hops = 2 if replicate > 1 else 1
    assert len(backward) == hops * len(set(blocks)) and len(step) == hops * len(waves)
    for r in results:
        k = r["plan_rank"]
        expected = [(c.level, *c.ranks[k]) for c in modelled if c.ranks[k] is not None]
        assert r["log"] == expected, f"plan rank {k}"
        assert r["collectives"] == len(expected)
    # Something was actually exchanged on both levels.
    assert any(c.critical for c in backward) and all(c.critical for c in step)
