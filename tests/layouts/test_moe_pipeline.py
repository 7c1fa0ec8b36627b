"""Mixture-of-Experts in pipeline stages (tests/support/moe_pipeline.py): 4 gloo ranks as pp = 2 stages x 2 data
ranks, the dense and expert meshes unflattened from one world mesh as torchtitan does ((pp, fsdp) and
(pp, efsdp, ep), ep = 2, efsdp = 1), each stage's experts split over its own ep ranks, every data rank reading its
own micro-batches, torch.distributed.pipelining's schedules (GPipe, 1F1B, interleaved 1F1B, ZBV with its split
weight backward), one DMuon per rank's parts with pp_group. Each run equals one process on the global batch
(torch.optim.Muon per expert slice + AdamW, fp32 NS) to 1e-5; each Muon matrix is orthogonalized once in the
cluster; tokens cross only the stage's ep ranks; clipping by the whole model's norm across stages and meshes,
by dmuon and as torchtitan clips; a DMuon built before sharding; a DCP checkpoint per stage resumes bit for bit.

With -m slow: 8 ranks as pp = 2 stages x 4 data ranks: ep = 2 x efsdp = 2 inside each stage (FSDP2 on the
local stacks' dim 1), and dp_replicate = 2 outside each stage's (efsdp = 1) x ep = 2, FSDP2's own HSDP and dmuon's
replicate level (hsdp_mesh: the stage's dense and expert views), clipped too."""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile

import pytest
import torch

from support import moe, moe_pipeline
from support.scenarios import run_each, succeeded
from support.spawn import run_distributed

STEPS, DP, MICROBATCHES, EXPERTS = 3, 2, 4, 3
CLIP = 0.05  # below every step's norm here: the clip acts on every step

# name -> (schedule, train()'s keywords)
RUNS = {
    "gpipe": ("gpipe", {}),
    "1f1b": ("1f1b", {}),
    "interleaved1f1b": ("interleaved1f1b", {}),  # two stages per rank, one DMuon over both parts
    "zbv": ("zbv", {}),  # V-shaped stages, input and weight backward apart
    "1f1b, no token for two experts": ("1f1b", dict(route_to=0)),
    "1f1b zero3": ("1f1b", dict(reshard=True)),  # FSDP2 all-gathers again for every micro-batch's forward
    # A NaN in stage 1's expert gradient at the last step: every stage skips it (the result: one step less).
    "1f1b, a NaN in one stage's experts": ("1f1b", dict(nonfinite="skip", poison=(STEPS - 1, 1))),
    "1f1b clipped by dmuon": ("1f1b", dict(clip=CLIP)),
    "interleaved1f1b clipped by dmuon": ("interleaved1f1b", dict(clip=CLIP)),
    "1f1b clipped as torchtitan clips": ("1f1b", dict(clip=CLIP, clip_with="torchtitan")),
    # The DMuon built on the plain parts, before ExpertParallel and FSDP2 swap their parameters.
    "interleaved1f1b built before sharding": ("interleaved1f1b", dict(built_before_sharding=True)),
}
SAVED_AT, MORE = 2, 2


def _four_ranks(rank: int, world: int, directory: str) -> dict:
    """Every run of this file in one 4-rank process group, each with its own result or error."""
    runs = {name: functools.partial(moe_pipeline.train, rank, world, schedule, steps=STEPS, experts=EXPERTS,
                                    microbatches=MICROBATCHES, **kw) for name, (schedule, kw) in RUNS.items()}
    train = functools.partial(moe_pipeline.train, rank, world, "1f1b", steps=SAVED_AT + MORE, experts=EXPERTS,
                              microbatches=MICROBATCHES)
    runs["checkpoint"] = lambda: {"went_on": train(save_to=(directory, SAVED_AT))["params"],
                                  "resumed": train(resume_from=(directory, SAVED_AT))["params"]}
    return run_each(runs)


@functools.cache
def _runs() -> list[dict]:
    directory = tempfile.mkdtemp(prefix="dmuon-moe-pipeline-")
    atexit.register(shutil.rmtree, directory, ignore_errors=True)  # the checkpoint outlives no test run
    return run_distributed(_four_ranks, 4, directory, timeout_s=600)


def _results(run: str) -> list[dict]:
    return [succeeded(r[run]) for r in _runs()]


def _whole(results: list[dict], key: str) -> dict[str, torch.Tensor]:
    """The whole model from every rank's parts (the two data ranks of a stage hold the same, whole)."""
    out: dict[str, torch.Tensor] = {}
    for r in results:
        for name, value in r[key].items():
            if name in out:
                assert torch.equal(out[name], value), name
            out[name] = value
    return out


def _reference(results: list[dict], steps: int = STEPS, dp: int = DP, **kw) -> dict[str, torch.Tensor]:
    return moe.reference(_whole(results, "initial"), steps, moe_pipeline.reference_world(dp, MICROBATCHES),
                         EXPERTS, layers=results[0]["layers"], **kw)


@pytest.mark.parametrize("run", [n for n, (_, kw) in RUNS.items() if "clip" not in kw])
def test_schedules_equal_one_process(run):
    results = _results(run)
    kw = RUNS[run][1]
    skipped = [step == kw["poison"][0] for step in range(STEPS)] if "poison" in kw else [False] * STEPS
    assert all(r["skipped"] == skipped for r in results), [r["skipped"] for r in results]
    ref = _reference(results, STEPS - sum(skipped), route_to=kw.get("route_to"))
    got = _whole(results, "params")
    assert got.keys() == ref.keys(), "every parameter of the model sits on some stage"
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], atol=1e-5, rtol=0, msg=lambda m: f"{name}: {m}")
    # Every Muon matrix (per layer: mix, router, the shared expert's two, w1 and w2 per expert) orthogonalized
    # exactly once in the cluster, every step: once on one stage's ranks, never on the other stage's.
    matrices = results[0]["layers"] * (4 + 2 * EXPERTS)
    for step in range(STEPS):
        expected = 0 if skipped[step] else matrices
        assert sum(r["orthogonalized"][step] for r in results) == expected, \
            (step, [r["orthogonalized"] for r in results])


@pytest.mark.parametrize("run", ["1f1b", "interleaved1f1b"])
def test_owners_within_each_stage_and_momentum_beside_the_shards(run):
    """Each stage's matrices are owned by that stage's ranks only, every one of them owning some expert
    slices and some dense matrices; each expert stack's momentum is sharded as the stack is (no copy)."""
    results = _results(run)
    for stage_ranks in {r["stage_ranks"] for r in results}:
        stage = [r for r in results if r["stage_ranks"] == stage_ranks]
        owners = stage[0]["owners"]
        assert all(r["owners"] == owners for r in stage)
        assert sorted(r["plan_rank"] for r in stage) == list(range(len(stage)))
        for r in stage:
            mine = [n for n, o in owners.items() if o == r["plan_rank"]]
            assert any(".experts." in n for n in mine) and any(".experts." not in n for n in mine), \
                (r["plan_rank"], mine)
        whole = _whole(stage, "params")
        stacks = [n for n in whole if ".experts." in n]
        assert stacks
        for name in stacks:
            assert sum(r["momentum_numel"][name] for r in stage) == whole[name].numel(), name


@pytest.mark.parametrize("run", [n for n, (_, kw) in RUNS.items() if "clip" not in kw])
def test_tokens_cross_only_the_stages_ep_ranks(run):
    """Each token all-to-all runs on the ep group of the rank's own stage (ep spans the stage's data ranks
    here), never across stages."""
    for r in _results(run):
        assert r["token_all_to_alls"] > 0
        assert r["token_groups"] == [r["ep_ranks"]] and r["ep_ranks"] == r["stage_ranks"], \
            (r["stage_ranks"], r["ep_ranks"], r["token_groups"])


@pytest.mark.parametrize("run", [n for n, (_, kw) in RUNS.items() if "clip" in kw])
def test_clipping_by_the_whole_models_norm_across_stages_and_meshes(run):
    """dmuon's ``clip_grad_norm_`` with ``pp_group`` (dense and expert DTensors of different meshes on each
    stage, summed over the stages), and torchtitan's ep-aware clipping: the one-process norm of every gradient
    on every rank, and the clipped training equal to one process.

    The norms are also what pins the gradients' scale: Muon's update does not change with it (nor, but for
    eps, AdamW's), so an expert gradient divided by other than the stage's data ranks (tried: 1 instead of
    2) still trains equal to one process unclipped, but fails here."""
    results = _results(run)
    norms: list[float] = []
    ref = _reference(results, clip=CLIP, norms=norms)
    assert all(n > CLIP for n in norms)  # every step clipped
    for r in results:
        assert r["norms"] == pytest.approx(norms, rel=1e-5), (r["stages"], r["norms"], norms)
    got = _whole(results, "params")
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], atol=1e-5, rtol=0, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("run", ["gpipe", "1f1b zero3", "interleaved1f1b"])
def test_counted_bytes_per_stage_equal_the_step_model(run):
    """Each stage's dmuon collectives in the last step, per rank, are the step model's for that stage's
    matrices on its data ranks, expert slices' rows from the ranks holding them (the plan's pieces), in fp32
    (the NS dtype here): the launches as a set (the schedule reduces FSDP2's units in its own order), the
    step's in order."""
    from dmuon.costmodel.traffic import owner_exchange_collectives

    for r in _results(run):
        counted = r["counted"]
        shapes, owners, blocks = (list(x) for x in zip(*counted["infos"]))
        backward, step = owner_exchange_collectives(shapes, owners, blocks, 1, counted["shard"], 4,
                                                    waves=counted["waves"], pieces=counted["pieces"])
        k = r["plan_rank"]
        launches = [(c.level, *c.ranks[k]) for c in backward if c.ranks[k] is not None]
        returns = [(c.level, *c.ranks[k]) for c in step if c.ranks[k] is not None]
        log = counted["log"]
        assert sorted(log[: len(launches)]) == sorted(launches) and log[len(launches):] == returns, \
            (r["stages"], log, launches, returns)
        assert launches and returns, "the stage exchanged something"


def test_a_checkpoint_per_stage_resumes_bit_for_bit():
    """Every stage saves its part's model and DMuon state (expert stacks and their momentum on the stage's
    (efsdp, ep) mesh) in one DCP checkpoint; fresh stages resume and take the same steps, bit for bit, as the
    run that went on."""
    for r in _runs():
        run = succeeded(r["checkpoint"])
        assert run["went_on"].keys() == run["resumed"].keys() and any(".experts." in n for n in run["resumed"])
        for name, p in run["went_on"].items():
            assert torch.equal(p, run["resumed"][name]), name


EIGHT = {
    # pp = 2 x (efsdp = 2 x ep = 2): efsdp * ep = 4 > E = 3, so FSDP2 shards the local stacks on dim 1.
    "1f1b, efsdp 2": ("1f1b", {}),
    # pp = 2 x dp_replicate = 2 x (efsdp = 1 x ep = 2)
    "1f1b, native hsdp": ("1f1b", dict(replicate=2)),
    "1f1b, replicate level": ("1f1b", dict(replicate=2, level=True)),
    "interleaved1f1b, replicate level, clipped": ("interleaved1f1b", dict(replicate=2, level=True, clip=CLIP)),
}


def _eight_ranks(rank: int, world: int) -> dict:
    return run_each({name: functools.partial(moe_pipeline.train, rank, world, schedule, steps=STEPS,
                                             experts=EXPERTS, microbatches=MICROBATCHES, **kw)
                     for name, (schedule, kw) in EIGHT.items()})


@pytest.mark.slow
def test_eight_ranks_efsdp_and_replicas_inside_each_stage():
    """Each run equals one process on its global batch (4 data ranks per stage); NS once per matrix; tokens
    only on the rank's own ep group inside its stage; clipped: the one-process norms."""
    runs = run_distributed(_eight_ranks, 8, timeout_s=600)
    for name, (_, kw) in EIGHT.items():
        results = [succeeded(r[name]) for r in runs]
        norms: list[float] = []
        ref = _reference(results, dp=4, clip=kw.get("clip"), norms=norms)
        got = _whole(results, "params")
        assert got.keys() == ref.keys()
        for p in ref:
            torch.testing.assert_close(got[p], ref[p], atol=1e-5, rtol=0, msg=lambda m: f"{name} {p}: {m}")
        matrices = results[0]["layers"] * (4 + 2 * EXPERTS)
        assert all(sum(r["orthogonalized"][step] for r in results) == matrices for step in range(STEPS)), name
        for r in results:
            assert r["token_groups"] == [r["ep_ranks"]] and set(r["ep_ranks"]) < set(r["stage_ranks"]), \
                (name, r["stage_ranks"], r["ep_ranks"], r["token_groups"])
            if "clip" in kw:
                assert r["norms"] == pytest.approx(norms, rel=1e-5), (name, r["norms"], norms)
