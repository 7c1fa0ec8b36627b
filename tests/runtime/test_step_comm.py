"""The step model's dmuon collectives against the runtime's counted bytes, collective by collective, per rank."""

from __future__ import annotations

import functools

import pytest
import torch

from dmuon.costmodel.traffic import owner_exchange_collectives, shard_rows, step_collectives
from dmuon.util.bits import bitwise_equal
from support.spawn import run_distributed

from support.step_comm import check_counted_log, counted_step, expected_log


RUNS = {"fsdp-fp32": (None, torch.float32, 3, None), "fsdp-bf16-waves": (None, torch.bfloat16, 3, 4),
        "hsdp2x2-fp32": ((2, 2), torch.float32, 3, None), "hsdp2x2-bf16-waves": ((2, 2), torch.bfloat16, 3, 4),
        "hsdp2x2-bf16-zero2-waves": ((2, 2), torch.bfloat16, 2, 4),
        "replicate-level-2x2": ((2, 2), torch.bfloat16, 3, None, "dmuon"),
        "replicate-level-2x2-spread1": ((2, 2), torch.bfloat16, 3, None, "dmuon", "muon", 1),
        # The updates across replicas by the scatter route, forced (two replicas choose the direct one).
        "hsdp2x2-fp32-scatter": ((2, 2), torch.float32, 3, None, "fsdp2", "muon", 8, "scatter"),
        "hsdp2x2-bf16-waves-scatter": ((2, 2), torch.bfloat16, 3, 4, "fsdp2", "muon", 8, "scatter"),
        "replicate-level-2x2-scatter": ((2, 2), torch.bfloat16, 3, 4, "dmuon", "muon", 8, "scatter"),
        # ExecutionConfig.returns_in_backward: the first blocks' updates come back during backward.
        "fsdp-fp32-rbwd": (None, torch.float32, 3, None, "fsdp2", "muon", 8, None, True),
        "hsdp2x2-bf16-rbwd": ((2, 2), torch.bfloat16, 3, None, "fsdp2", "muon", 8, None, True),
        "hsdp2x2-fp32-scatter-rbwd": ((2, 2), torch.float32, 3, None, "fsdp2", "muon", 8, "scatter", True),
        # Seven blocks: room for returns to travel across replicas inside the landings' all_to_alls.
        "replicate-level-2x2-rbwd": ((2, 2), torch.bfloat16, 3, None, "dmuon", "muon", 1, None, True, 7),
        "replicate-level-2x2-scatter-rbwd": ((2, 2), torch.bfloat16, 3, None, "dmuon", "muon", 1, "scatter", True, 7)}


def _every_run(rank: int, world: int) -> dict:
    """Each 4-rank run of this file in one process group (a spawn costs more than the work); a run that
    raised fails only the tests that read it (:func:`support.scenarios.run_each`)."""
    from support.scenarios import run_each

    return run_each({name: functools.partial(counted_step, rank, world, mesh, dtype, zero, 2, waves, *hsdp)
                     for name, (mesh, dtype, zero, waves, *hsdp) in RUNS.items()})


@functools.cache
def _runs() -> list[dict]:
    return run_distributed(_every_run, 4, timeout_s=300)


@pytest.mark.parametrize("run", [k for k in RUNS if not k.startswith("replicate") and not k.endswith("-rbwd")])
def test_counted_collectives_equal_the_model_per_rank(run):
    # dmuon's exchange is the same under ZeRO-2 and ZeRO-3 (reshard_after_forward changes FSDP2's gathers only).
    mesh_shape, ns_dtype, zero, waves, *forced = RUNS[run]
    publication = forced[3] if len(forced) > 3 else None
    results = [r[run] for r in _runs()]
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
                                                waves=waves, publication=publication)
    modelled = backward + step
    # The whole step's order, with FSDP2's collectives left out, is the same.
    strategy = "dmuon_native_hsdp" if replicate > 1 else "dmuon"
    in_step = [c for c in step_collectives(strategy, shapes, owners, blocks, replicate, shard,
                                           wire_bytes=ns_dtype.itemsize, waves=waves, publication=publication)
               if c.label.startswith("dmuon")]
    assert [c.label for c in in_step] == [c.label for c in modelled]
    # Per block one exchange, two on HSDP (column slices across replicas, then rows to the owner); per
    # wave as many back. Two replicas choose the direct route; the forced scatter route's all-gather
    # rides with the next wave's hop across replicas, the last wave's alone.
    hops = 2 if replicate > 1 else 1
    assert len(backward) == hops * len(set(blocks)) and len(step) == hops * len(waves) + (publication == "scatter")
    assert {c.role for c in step} == ({"return_shard"} if replicate == 1 else
                                      {"return_shard", "return_scatter", "return_gather"} if publication else
                                      {"return_shard", "return_replicas"})
    for r in results:
        k = r["plan_rank"]
        expected = [(c.level, *c.ranks[k]) for c in modelled if c.ranks[k] is not None]
        assert r["log"] == expected, f"plan rank {k}"
        assert r["collectives"] == len(expected)
    # Something was actually exchanged on both levels.
    assert any(c.critical for c in backward) and all(c.critical for c in step)


@pytest.mark.parametrize("scatter,direct", [("hsdp2x2-fp32-scatter", "hsdp2x2-fp32"),
                                            ("hsdp2x2-bf16-waves-scatter", "hsdp2x2-bf16-waves"),
                                            ("replicate-level-2x2-scatter", "replicate-level-2x2")])
def test_the_scatter_route_trains_bit_for_bit_as_the_direct_one(scatter, direct):
    """The route across replicas moves the same update rows, so training ends bit for bit the same (the
    replicate level's scatter run also returns in waves, which change nothing either)."""
    for r in _runs():
        assert r[scatter]["params"].keys() == r[direct]["params"].keys()
        for name, value in r[scatter]["params"].items():
            assert bitwise_equal(value, r[direct]["params"][name]), f"plan rank {r[direct]['plan_rank']}: {name}"


@pytest.mark.parametrize("mesh_shape,spread", [((2, 2), 8), ((2, 2), 1), pytest.param((2, 4), 8, marks=pytest.mark.slow)],
                         ids=["2x2", "2x2-spread1", "2x4"])  # 2x4: eight processes on two cores (-m slow)
def test_replicate_level_counted_bytes_equal_the_model(mesh_shape, spread):
    """dmuon's replicate level (``hsdp_mesh``): every collective dmuon issues, per rank and level, is one
    the model prices (``step_collectives("dmuon")``: FSDP2's all-reduce replaced by dmuon's column
    reduce-scatter, in the gradient's 4 bytes, carrying the hop A chunks the spreader chose), plus the
    other parameters' all-reduce (a ring's bytes)."""
    replicate, shard = mesh_shape
    world = replicate * shard
    run = "replicate-level-2x2" + ("" if spread == 8 else f"-spread{spread}")
    results = [r[run] for r in _runs()] if world == 4 else \
        run_distributed(counted_step, world, mesh_shape, torch.bfloat16, 3, 2, None, "dmuon", timeout_s=300)
    _check_replicate_level(results, replicate, shard, spread=spread)


@pytest.mark.parametrize("mesh_shape", [(2, 2), pytest.param((2, 4), marks=pytest.mark.slow)],
                         ids=["2x2", "2x4"])  # 2x4: eight processes on two cores (-m slow)
def test_replicate_level_scatter_route_counted_bytes_equal_the_model(mesh_shape):
    """The same with the updates across replicas forced onto the scatter route, in waves (each wave's
    all-gather in one all_to_all with the next wave's scatter): per rank, the model's collectives."""
    replicate, shard = mesh_shape
    world = replicate * shard
    results = [r["replicate-level-2x2-scatter"] for r in _runs()] if world == 4 else \
        run_distributed(counted_step, world, mesh_shape, torch.bfloat16, 3, 2, 4, "dmuon", "muon", 8, "scatter",
                        timeout_s=300)
    step = _check_replicate_level(results, replicate, shard, "scatter")
    assert len(results[0]["waves"]) > 1
    assert [c.role for c in step if c.level == "inter"] == ["return_scatter"] * len(results[0]["waves"]) + \
        ["return_gather"]
    assert [c.carries_gather for c in step if c.level == "inter"][1:-1] == list(range(len(results[0]["waves"]) - 1))


def _check_replicate_level(results: list[dict], replicate: int, shard: int, publication: str | None = None,
                           spread: int = 8) -> list:
    """Every rank's collectives against ``step_collectives("dmuon")``'s (the replicate level); the model's step part."""
    infos = results[0]["infos"]
    shapes, owners, blocks = [i[0] for i in infos], [i[1] for i in infos], [i[2] for i in infos]
    waves = results[0]["waves"]
    assert all(r["waves"] == waves for r in results)
    backward, step = owner_exchange_collectives(shapes, owners, blocks, replicate, shard, 2, waves=waves,
                                                gradient_bytes=4, hop_a_spread=spread, publication=publication)
    modelled = backward + step
    in_step = [c for c in step_collectives("dmuon", shapes, owners, blocks, replicate, shard, wire_bytes=2,
                                           waves=waves, hop_a_spread=spread, publication=publication)
               if c.label.startswith("dmuon")]
    assert sorted(c.label for c in in_step) == sorted(c.label for c in modelled)
    # Per block two exchanges: across replicas its gradient column slices, carrying direction slices
    # of earlier blocks (one all_to_all), and rows inside one replica; what is left of the slices at
    # the end of backward goes alone.
    assert len(backward) == 2 * len(set(blocks)) + 1
    rides = [b for c in backward for b in c.carries_hop_a]
    assert sorted(set(rides)) == sorted(set(blocks))
    if spread == 1:  # each block's slices all in one collective
        assert len(rides) == len(set(blocks))
    else:  # some block's slices spread over several collectives
        assert len(rides) > len(set(blocks))
    assert all(r["blocks_in_backward"] == r["blocks"] for r in results)
    check_counted_log(modelled, results, replicate, True)
    for r in results:
        expected = expected_log(modelled, r, replicate, True)
        for level in ("intra", "inter"):
            assert sum(e[1] for e in r["log"] if e[0] == level) == sum(e[1] for e in expected if e[0] == level)
    assert any(c.critical for c in backward if c.label.startswith("dmuon gradient columns"))
    return step


@pytest.mark.parametrize("run", [k for k in RUNS if k.endswith("-rbwd")])
def test_returns_in_backward_counted_collectives_equal_the_model(run):
    """``returns_in_backward``: each block's return issued at the landing after its directions' last hop,
    its hops across replicas one landing apart (on the replicate level inside that landing's all_to_all),
    the rest in ``step()``: per rank, the model's collectives (1-D and native HSDP in issue order)."""
    mesh_shape, ns_dtype, zero, _, hsdp, _, spread, publication, *_ = RUNS[run]
    results = [r[run] for r in _runs()]
    replicate, shard = mesh_shape or (1, 4)
    infos = results[0]["infos"]
    shapes, owners, blocks = [i[0] for i in infos], [i[1] for i in infos], [i[2] for i in infos]
    waves = results[0]["waves"]
    assert all(r["waves"] == waves for r in results)
    design_b = hsdp == "dmuon"
    backward, step = owner_exchange_collectives(shapes, owners, blocks, replicate, shard, ns_dtype.itemsize,
                                                waves=waves, gradient_bytes=4 if design_b else None,
                                                hop_a_spread=spread, publication=publication, returns_in_backward=True)
    returned = sorted({c.block for c in backward if c.role == "return_shard"})
    # Some blocks came back in backward, the others in step()'s waves, each matrix once.
    assert returned and all(r["blocks_returned_in_backward"] == len(returned) for r in results)
    assert sorted(sum(waves, [])) == [i for i, b in enumerate(blocks) if b not in returned]
    assert all(r["blocks_in_backward"] == r["blocks"] for r in results)
    in_step = [c for c in step_collectives("dmuon" if design_b or replicate == 1 else "dmuon_native_hsdp", shapes,
                                           owners, blocks, replicate, shard, wire_bytes=ns_dtype.itemsize,
                                           waves=waves, hop_a_spread=spread, publication=publication,
                                           returns_in_backward=True)
               if c.label.startswith("dmuon")]
    assert sorted(c.label for c in in_step) == sorted(c.label for c in backward + step)
    if publication == "scatter":
        assert {"return_scatter", "return_gather"} <= {c.role for c in backward}
    if design_b:
        assert any(c.carries_returns for c in backward)
    check_counted_log(backward + step, results, replicate, design_b)

