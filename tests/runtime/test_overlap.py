"""Overlap: exchanges launched from FSDP2's backward give the same bits as every exchange in step()."""

from __future__ import annotations

import functools

import pytest
import torch

import dmuon
from support.spawn import run_distributed

from support.cases import Case, run_cases
from support.equivalence import SKIP, STEPS, max_diff, reference

# Its point is stream order (exchanges launched from FSDP2's backward): every rank runs under the stream checker.
pytestmark = pytest.mark.streams

_reference = functools.cache(reference)
"""The one-process reference per world size, trained once for every test here (read, never changed)."""


def _overlap_cases(mesh_shape) -> list[Case]:
    """:func:`test_overlap_is_bit_identical_to_sync`'s runs: ZeRO-2 and ZeRO-3, each with and without overlap."""
    return [Case(zero=zero, overlap=overlap, ns_dtype=torch.float32, steps=STEPS, skip=SKIP, mesh_shape=mesh_shape)
            for zero in (2, 3) for overlap in (True, False)]


def _ns_in_backward_cases(mesh_shape) -> list[Case]:
    """:func:`test_ns_in_backward_matches_the_reference`'s runs."""
    return [Case(zero=3, ns_in_backward=eager, ns_dtype=torch.float32, steps=STEPS, skip=SKIP, mesh_shape=mesh_shape)
            for eager in (True, False)] + \
        [Case(zero=3, ns_in_backward=True, ns_dtype=torch.float32, steps=STEPS, clip=0.3, mesh_shape=mesh_shape,
              return_waves=4),  # recomputed in step(), returned in waves
         Case(kind="gather", zero=3, ns_dtype=torch.float32, steps=STEPS, clip=0.3, mesh_shape=mesh_shape)]


@functools.cache
def _launch(mesh_shape, world_size: int) -> tuple[list[Case], list]:
    """Both tests' runs on one layout in one launch (a launch costs more than a run), each distinct run once
    (ZeRO-3 with overlap is also NS after backward): ``(the runs, per rank their results)``."""
    wanted = _ns_in_backward_cases(mesh_shape) + (_overlap_cases(mesh_shape) if world_size > 1 else [])
    cases = [c for k, c in enumerate(wanted) if c not in wanted[:k]]
    return cases, run_distributed(run_cases, world_size, cases, timeout_s=240)


def _results(mesh_shape, world_size: int, cases: list[Case]) -> list[list]:
    """Per rank, the results of ``cases`` (a case that raised fails only the test reading it)."""
    launched, results = _launch(mesh_shape, world_size)
    return [[r[launched.index(c)] for c in cases] for r in results]


@pytest.mark.parametrize("mesh_shape", [None, (2, 2)])
def test_overlap_is_bit_identical_to_sync(mesh_shape):
    world_size = 3 if mesh_shape is None else 4
    cases = _overlap_cases(mesh_shape)
    results = _results(mesh_shape, world_size, cases)
    ref, _ = _reference(world_size, torch.float32)
    for k in (0, 2):
        on, off = results[0][k]["params"], results[0][k + 1]["params"]
        for name in on:
            assert torch.equal(on[name], off[name]), f"zero={cases[k].zero}: {name} differs"
        diff, worst = max_diff(on, ref)
        assert diff <= 1e-5, worst
        for step in range(STEPS):
            assert [r[k]["stats"][step]["orthogonalized"] for r in results] == \
                   [r[k + 1]["stats"][step]["orthogonalized"] for r in results]
            assert results[0][k]["stats"][step]["blocks_exchanged_in_backward"] == 4 - len(SKIP.get(step, ()))
            assert results[0][k + 1]["stats"][step]["blocks_exchanged_in_backward"] == 0
            # Every launch stood, so the owners' NS ran while the agreement travelled (one return wave).
            assert sum(r[k]["stats"][step]["orthogonalized_while_agreeing"] for r in results) == \
                   sum(r[k]["stats"][step]["orthogonalized"] for r in results) > 0
            assert all(r[k + 1]["stats"][step]["orthogonalized_while_agreeing"] == 0 for r in results)


@pytest.mark.parametrize("mesh_shape, world_size", [(None, 3), ((2, 2), 4), (None, 1)])
def test_ns_in_backward_matches_the_reference(mesh_shape, world_size):
    """One rank too: every exchange is then local (no collective), so only events order the worker's
    read of what the hooks produced (the stream checker runs over every case)."""
    results = _results(mesh_shape, world_size, _ns_in_backward_cases(mesh_shape))
    ref, _ = _reference(world_size, torch.float32)
    eager, late = results[0][0]["params"], results[0][1]["params"]
    diff, worst = max_diff(eager, ref)
    assert diff <= 1e-5, worst
    # Same math; only the NS batches differ (per block instead of across blocks).
    diff, worst = max_diff(eager, late)
    assert diff <= 1e-6, worst
    for step in range(STEPS):
        done = sum(r[0]["stats"][step]["orthogonalized"] for r in results)
        early = sum(r[0]["stats"][step]["orthogonalized_in_backward"] for r in results)
        assert early == done > 0
        assert all(r[1]["stats"][step]["orthogonalized_in_backward"] == 0 for r in results)
    # Clipped gradients: the launches stand for them (the owners rescale the launched directions), but
    # the worker's NS ran on the unclipped ones and is redone in step(), so the result is exact.
    diff, worst = max_diff(results[0][2]["params"], results[0][3]["params"])
    assert diff <= 1e-6, worst
    assert all(s["orthogonalized_in_backward"] == 0 for r in results for s in r[2]["stats"])
    # The first clip exchanges again and starts the owners' copies; then every launch stands. In one
    # process the clipped blocks are exchanged again every step (nothing to save by rescaling there).
    rescaled = [0] * STEPS if world_size == 1 else [0] + [4] * (STEPS - 1)
    assert all([s["rescaled_launches"] for s in r[2]["stats"]] == rescaled for r in results)


def test_ns_in_backward_needs_overlap():
    import dmuon
    from support.models import OddNet

    model = OddNet()
    with pytest.raises(ValueError, match="overlap=True"):
        dmuon.DMuon(model, execution=dmuon.ExecutionConfig(ns_in_backward=True, overlap=False))


RETURN_VARIANTS = {"plain": dict(), "clip": dict(clip=0.3, return_waves=2), "normuon": dict(rule="normuon"),
                   "nonfinite": dict(nonfinite="skip"), "muonh": dict(rule="muonh"), "dion2": dict(rule="dion2"),
                   # Two micro-batches, FSDP2 reducing both: the first backward's launches and returns are stale.
                   "micro": dict(micro_batches=2, micro_sync=True)}
"""The runs of :func:`test_returns_in_backward_give_the_same_bits_as_returns_in_step`, each with the returns in
backward and in ``step()``."""
EVERY_VARIANT = tuple(RETURN_VARIANTS)
# By default each layout runs the plain returns, clipping and the stale micro-batch (the return path's own
# cases) and half of the rest: the replicate level NorMuon's row state riding its hops and MuonH's norms around
# its applies, 1-D the nonfinite check and Dion2's rows decayed where the updates land. Every variant on each
# layout runs under -m slow, native HSDP's too (the replicate level's 2x2 runs the same returns plus its own hops).
ON_1D = ("plain", "clip", "nonfinite", "dion2", "micro")
ON_THE_REPLICATE_LEVEL = ("plain", "clip", "normuon", "muonh", "micro")


@pytest.mark.parametrize("mesh_shape, hsdp, variants", [
    (None, "fsdp2", ON_1D), pytest.param(None, "fsdp2", EVERY_VARIANT, marks=pytest.mark.slow),
    pytest.param((2, 2), "fsdp2", EVERY_VARIANT, marks=pytest.mark.slow),
    ((2, 2), "dmuon", ON_THE_REPLICATE_LEVEL), pytest.param((2, 2), "dmuon", EVERY_VARIANT, marks=pytest.mark.slow)],
    # The default two keep their ids: tests/support/compat.py lists them.
    ids=["None-fsdp2", "1-D-every-variant", "native-2x2-every-variant", "mesh_shape2-dmuon",
         "replicate-level-2x2-every-variant"])
def test_returns_in_backward_give_the_same_bits_as_returns_in_step(mesh_shape, hsdp, variants):
    """``returns_in_backward``: the blocks whose launches stand apply updates that came back during backward;
    the parameters are those of ``ns_in_backward`` alone bit for bit (the same per-block NS), with an unused
    block, with clipping (every launch then stands for rescaled gradients: the returns from backward land
    unused and the step redoes NS), with NorMuon's row state riding the returns, a nonfinite check, MuonH
    (its norms taken around the applies) and Dion2 (its selected rows decayed where the updates land)."""
    world_size = 3 if mesh_shape is None else 4
    # hop_a_spread's default: on the replicate level 1 with returns in backward (hop A in one chunk, the
    # late-block count below), 8 without (the same bits: spreading moves when slices go, not what they are).
    base = dict(zero=3, ns_in_backward=True, ns_dtype=torch.float32, steps=STEPS, skip=SKIP, mesh_shape=mesh_shape,
                hsdp=hsdp, hop_a_spread=None)
    variants = [RETURN_VARIANTS[name] for name in variants]
    cases = [Case(returns_in_backward=back, **base, **v) for v in variants for back in (True, False)]
    results = run_distributed(run_cases, world_size, cases, timeout_s=240)
    ref, _ = _reference(world_size, torch.float32)
    for k in range(0, len(cases), 2):
        back, step_only = results[0][k]["params"], results[0][k + 1]["params"]
        for name in back:
            assert torch.equal(back[name], step_only[name]), (variants[k // 2], name)
        for step in range(STEPS):
            returned = [r[k]["stats"][step]["blocks_returned_in_backward"] for r in results]
            assert len(set(returned)) == 1  # every rank applied the same blocks from backward
            assert all(r[k + 1]["stats"][step]["blocks_returned_in_backward"] == 0 for r in results)
            assert [r[k]["stats"][step]["orthogonalized"] for r in results] == \
                   [r[k + 1]["stats"][step]["orthogonalized"] for r in results]
            if "clip" in variants[k // 2] or "micro_sync" in variants[k // 2]:
                # Rescaled (or, the first clip, stale) or stale (accumulated after the launch): every
                # return from backward landed unused and was redone in step().
                assert returned[0] == 0
            else:
                # Every launched block (one fewer with block 1 unused) but the last few came back in backward:
                # 1-D the last (one direction hop), native HSDP the last two (hops A and B), the replicate
                # level the last three (its hop A goes with the next unit's reduction, then hop B).
                launched = results[0][k]["stats"][step]["blocks_exchanged_in_backward"]
                late = 1 if mesh_shape is None else 2 if hsdp == "fsdp2" else 3
                assert returned[0] == max(launched - late, 0), (step, returned, launched)
        if "clip" not in variants[k // 2] and "micro_sync" not in variants[k // 2]:
            assert sum(results[0][k]["stats"][step]["blocks_returned_in_backward"] for step in range(STEPS)) > 0
    diff, worst = max_diff(results[0][0]["params"], ref)
    assert diff <= 1e-5, worst


def test_returns_in_backward_need_ns_in_backward():
    with pytest.raises(ValueError, match="returns_in_backward=True needs ns_in_backward=True"):
        dmuon.ExecutionConfig(returns_in_backward=True)
    with pytest.raises(ValueError, match="returns_in_backward must be True or False"):
        dmuon.ExecutionConfig(ns_in_backward=True, returns_in_backward=1)
