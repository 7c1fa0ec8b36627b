"""Pipeline parallelism: torch.distributed.pipelining's schedules, each stage ``fully_shard``-ed over its own
data-parallel ranks, one DMuon per model part (or one over a rank's parts), against one process training
the whole model with torch.optim.Muon + AdamW (fp32 NS) on the same global batch.

4 ranks as (pp=2, dp=2) in the default suite: GPipe, 1F1B, interleaved 1F1B and ZBV (split input/weight
backward), with the schedule's gradient scaling and without, ZeRO-2 and ZeRO-3, FSDP2's own HSDP and dmuon's
replicate level as (pp=2, replicate=2, shard=1); clipping by the whole model's norm, a stage without any
Muon matrix, a NaN on one stage skipping every stage, checkpoints, bad setups. Every training run's ranks
run under the stream checker (conftest.py). With -m slow: every schedule torch ships (looped BFS and interleaved zero
bubble too) on every level, and 8 ranks as (pp=2, replicate=2, shard=2); torch's clipping as torchtitan
calls it runs in the torchtitan recipe (pytest -m integrations).
"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dmuon
from dmuon.costmodel.traffic import owner_exchange_collectives

from support import pipeline
from support.scenarios import run_each, succeeded
from support.spawn import run_distributed

# The training runs' point is stream order (the schedule's reduction by hand, its launches and joins): their
# ranks run under the stream checker. The misuse and the checkpoints (whose point is what a setup is refused
# with and what a checkpoint holds) run in 4-rank and 2-rank runs of their own without it.
STREAMS = pytest.mark.streams

CLIP = 0.05  # below every step's norm here: the clip acts on every step

# name -> (schedule, train()'s keywords); each equals the single-process reference to 1e-5. The zero-bubble
# schedules run ZeRO-2 only: with reshard_after_forward=True torch 2.13's split weight backward gives FSDP2
# other gradients than one process, with no optimizer involved (see ZERO_BUBBLE).
RUNS = {
    # GPipe with four micro-batches under -m slow (test_every_schedule_on_every_level[gpipe]): by default
    # GPipe runs with three (and clipped with three) through every check.
    "gpipe, three micro-batches": ("gpipe", dict(microbatches=3)),  # a divisor that is no power of two
    "1f1b zero3 unscaled": ("1f1b", dict(zero=3, scale_grads=False)),
    "interleaved1f1b one optimizer": ("interleaved1f1b", dict(one_optimizer=True)),
    "zbv unscaled": ("zbv", dict(scale_grads=False)),
    "1f1b native hsdp": ("1f1b", dict(hsdp="fsdp2")),
    "1f1b replicate level": ("1f1b", dict(hsdp="dmuon")),
    "zbv replicate level unscaled": ("zbv", dict(hsdp="dmuon", scale_grads=False)),
    # Clipping by the whole model's norm; stage 1 holds only the norm and the head (no Muon matrix).
    "clip, a stage without matrices": ("1f1b", dict(clip=CLIP, split=(4, 0))),
    "clip on the replicate level": ("1f1b", dict(clip=CLIP, hsdp="dmuon")),
    # Clipping every step with a divisor that is no power of two, a step past the owners' first copies.
    "gpipe clip every step, three micro-batches": ("gpipe", dict(clip=CLIP, microbatches=3, steps=4)),
    "interleaved1f1b built before sharding": ("interleaved1f1b", dict(built_before_sharding=True, hsdp="dmuon")),
    # A NaN in stage 1's gradients at step 1: every stage skips that step.
    "nan on one stage": ("1f1b", dict(nonfinite="skip", poison=(1, 1))),
}


SAVED_AT, MORE = 2, 2


def _on_four_ranks(rank: int, world: int, directory: str, checked: bool) -> dict:
    """The 4-rank runs under the stream checker (``checked``: RUNS and the NaN's raise) or the others."""
    if not checked:
        return run_each({"misuse": lambda: _bad_setups(rank, world),
                         "checkpoint": lambda: pipeline.save_and_go_on(rank, world, f"{directory}/dp2", SAVED_AT,
                                                                       MORE)})
    runs = {name: functools.partial(pipeline.train, rank, world, schedule, **kw)
            for name, (schedule, kw) in RUNS.items()}
    runs["nan on one stage, raise"] = functools.partial(pipeline.train, rank, world, "1f1b", nonfinite="raise",
                                                         poison=(1, 1))
    return run_each(runs)


@functools.cache
def _checkpoints() -> str:
    directory = tempfile.mkdtemp(prefix="dmuon-pipeline-")
    atexit.register(shutil.rmtree, directory, ignore_errors=True)  # the checkpoints outlive no test run
    return directory


@functools.cache
def _four_runs(checked: bool = True) -> list[dict]:
    return run_distributed(_on_four_ranks, 4, _checkpoints(), checked, timeout_s=600)


@functools.cache
def _reference(clip: float | None, skipped: tuple[int, ...], microbatches: int = 4,
               steps: int = pipeline.STEPS) -> tuple[dict, list[float]]:
    params = pipeline.reference(2, microbatches, steps=steps, clip=clip, skipped=skipped)
    return params, pipeline.reference.norms


def _check(results: list[dict], clip: float | None = None, skipped: tuple[int, ...] = (), microbatches: int = 4,
           steps: int = pipeline.STEPS) -> None:
    ref, norms = _reference(clip, skipped, microbatches, steps)
    seen = set()
    for r in results:
        for name, p in r["params"].items():
            torch.testing.assert_close(p, ref[name], atol=1e-5, rtol=0, msg=lambda m: f"{name}: {m}")
            seen.add(name)
        if clip is not None:  # every part's optimizer (or torch's) clipped by the whole model's norm
            for step, step_norms in enumerate(r["norms"]):
                for norm in (step_norms if isinstance(step_norms, list) else [step_norms]):
                    assert norm == pytest.approx(norms[step], rel=1e-5), (step, norm, norms[step])
    assert seen == set(ref), "every parameter of the model sits on some stage"


@STREAMS
@pytest.mark.parametrize("run", list(RUNS))
def test_schedules_equal_one_process(run):
    kw = RUNS[run][1]
    results = [succeeded(r[run]) for r in _four_runs()]
    _check(results, kw.get("clip"), (kw["poison"][0],) if "poison" in kw else (), kw.get("microbatches", 4),
           kw.get("steps", pipeline.STEPS))


@STREAMS
def test_a_nan_on_one_stage_raises_on_every_stage():
    """nonfinite="raise" with pp_group: the stage that saw the NaN names it, every other stage raises too."""
    for r in _four_runs():
        text = r["nan on one stage, raise"]["error"]  # every rank's traceback
        assert "raised on 4 of 4 ranks" in text, text
        assert "FloatingPointError: non-finite gradients in ['layers.2." in text, text  # stage 1's ranks
        assert "FloatingPointError: non-finite gradients on another pipeline stage" in text, text  # stage 0's


@STREAMS
def test_launches_from_the_schedules_reduction_stand():
    """The hooks fire in the schedule's REDUCE_GRAD (outside autograd). The first step learns what the
    schedule divides the gradients by (its blocks exchanged in step(), no extra bytes); from the second
    on the blocks launch from there, divided alike, and stand as sent: none rescaled (no owner momentum
    copies), none exchanged again, with the schedule's scaling and without, on every level."""
    runs = [name for name, (_, kw) in RUNS.items() if "clip" not in kw and "poison" not in kw]
    for run in runs:
        for r in _four_runs():
            for step, step_reports in enumerate(succeeded(r[run])["reports"]):
                for report in step_reports:
                    launched = report.blocks_exchanged_in_backward
                    assert report.rescaled_launches == 0, (run, step, report)
                    if step == 0:
                        assert launched == 0, (run, report)
                    elif report.orthogonalized or report.traffic.collectives:
                        assert launched > 0 and report.traffic.collectives <= report.orthogonalized + 4, \
                            (run, step, report)


@STREAMS
def test_launches_from_the_schedules_reduction_stand_under_clipping_every_step():
    """DMuon's clip acting on every step (torchtitan clips every step): the schedule's divisor is learned
    in the first step's clip, before it scales (after it, reduced / n * c does not tell n), so from the
    second step on the blocks launch from the reduction; from the third (the owners' momentum copies made)
    every launch is kept, rescaled by the clip's factor, none exchanged again. The clip and the step
    read the device a fixed number of times per step from the second on (the first learns and sets up).
    Equal to one process: test_schedules_equal_one_process."""
    runs = [name for name, (_, kw) in RUNS.items() if "clip" in kw]
    assert len(runs) >= 3
    for run in runs:
        for r in _four_runs():
            result = succeeded(r[run])
            assert max(result["reads"][1:]) <= 4, (run, result["reads"])
            for step, step_reports in enumerate(result["reports"]):
                for report in step_reports:
                    launched = report.blocks_exchanged_in_backward
                    if step == 0:
                        assert launched == 0, (run, report)
                    elif step >= 2 and (report.orthogonalized or report.traffic.collectives):
                        assert launched > 0 and report.rescaled_launches == launched, (run, step, report)


@STREAMS
def test_the_replicate_level_joins_the_compute_stream_once_per_stage_reduction(request):
    """On the replicate level the schedule's reduction by hand lands each unit's reduction across replicas
    on dmuon's stream; the compute stream waits for dmuon's once per stage, after the stage's last unit
    (before the schedule's division reads the gradients), not once per unit: FSDP2's reduce-scatter
    stream waits for the compute stream before each unit, so a wait per unit would queue the next unit's
    reduce-scatter and the other stages' compute behind inter-node traffic. Counted by the stream
    checker on interleaved and V schedules (two stages per rank) and 1F1B; the stage's buffers stay
    ordered (the checker raises otherwise) and the runs equal one process (test_schedules_equal_one_process)."""
    if request.config.check_streams_choice == "0":
        pytest.skip("DMUON_CHECK_STREAMS=0: the joins are the stream checker's count, and no rank runs it")
    runs = ["interleaved1f1b built before sharding", "zbv replicate level unscaled", "1f1b replicate level"]
    for run in runs:
        for r in _four_runs():
            result = succeeded(r[run])
            assert None not in result["joins"], "the stream checker runs in every rank"
            assert result["joins"] == [result["stages"]] * len(result["joins"]), (run, result["joins"])


@STREAMS
@pytest.mark.parametrize("run", ["1f1b zero3 unscaled", "gpipe, three micro-batches", "interleaved1f1b one optimizer"])
def test_counted_bytes_per_stage_equal_the_step_model(run):
    """Each stage's dmuon collectives in a step (launched from the schedule's reduction), per rank, are the
    step model's for that stage's matrices on its data-parallel ranks, with the same bytes: the launches
    as a set (the schedule reduces FSDP2's units in its own order, not backward's), the step's in order."""
    for r in _four_runs():
        for counted in succeeded(r[run])["counted"]:
            shapes, owners, blocks = (list(x) for x in zip(*counted["infos"]))
            backward, step = owner_exchange_collectives(shapes, owners, blocks, 1, counted["shard"], 4,
                                                        waves=counted["waves"])
            k = counted["plan_rank"]
            launches = [(c.level, *c.ranks[k]) for c in backward if c.ranks[k] is not None]
            returns = [(c.level, *c.ranks[k]) for c in step if c.ranks[k] is not None]
            log = counted["log"]
            assert sorted(log[: len(launches)]) == sorted(launches) and log[len(launches):] == returns
            assert launches and returns, "the stage exchanged something"


def test_a_checkpoint_per_stage_resumes_bit_for_bit():
    """Every stage saves its part (torch's get_state_dict per part, one DCP checkpoint); a fresh pipeline
    resumes and takes the same steps, bit for bit, as the run that went on."""
    for r in _four_runs(checked=False):
        run = succeeded(r["checkpoint"])
        assert run["went_on"].keys() == run["resumed"].keys()
        for name, p in run["went_on"].items():
            assert torch.equal(p, run["resumed"][name]), name


def _resume_on_one_rank_per_stage(rank: int, world: int, path: str) -> dict:
    # The same global batch: one data-parallel rank takes all eight micro-batches.
    return pipeline.resume(rank, world, path, SAVED_AT, MORE, microbatches=8)


def test_a_checkpoint_per_stage_resumes_on_another_data_parallel_size():
    """Saved with two data-parallel ranks per stage, resumed with one: the whole run equals one process."""
    for r in _four_runs(checked=False):
        succeeded(r["checkpoint"])
    results = run_distributed(_resume_on_one_rank_per_stage, 2, f"{_checkpoints()}/dp2", timeout_s=600)
    ref = pipeline.reference(2, 4, steps=SAVED_AT + MORE)
    for params in results:
        for name, p in params.items():
            torch.testing.assert_close(p, ref[name], atol=1e-5, rtol=0, msg=lambda m: f"{name}: {m}")


def _bad_setups(rank: int, world: int) -> dict:
    """Each misuse on every rank: the error text (None: nothing raised)."""
    from torch.distributed.pipelining import PipelineStage  # noqa: F401  (the layout the misuse comes from)

    out = {}

    def attempt(name, build):
        try:
            build()
            out[name] = None
        except ValueError as e:
            out[name] = str(e)

    world3 = init_device_mesh("cpu", (2, 2, 1), mesh_dim_names=("pp", "replicate", "shard"))
    pp_rank = world3.get_local_rank("pp")

    def stage(mesh):
        torch.manual_seed(0)
        part = pipeline.part_of(pipeline.PipeNet(), pp_rank, 2)
        for layer in part.layers.values():
            fully_shard(layer, mesh=mesh)
        fully_shard(part, mesh=mesh)
        return part

    # hsdp_mesh over every stage's ranks, not the stage's (replicate, shard) ranks.
    attempt("hsdp_mesh spanning stages", lambda: dmuon.DMuon(stage(world3["shard"]), hsdp_mesh=world3))
    # A part whose blocks live on two different groups of ranks (its stage's and the pipeline's).
    world2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))

    def two_groups():
        torch.manual_seed(0)
        part = pipeline.part_of(pipeline.PipeNet(), pp_rank, 2)
        first, second = list(part.layers.values())
        fully_shard(first, mesh=world2["dp"])
        fully_shard(second, mesh=world2["pp"])
        fully_shard(part, mesh=world2["dp"])
        return dmuon.DMuon(part)

    attempt("two groups", two_groups)

    def two_parts_one_group():
        parts = [stage(world2["dp"]), stage(world2["dp"])]
        return [dmuon.DMuon(part, pp_group=world2["pp"]) for part in parts]

    attempt("two parts, one pp_group", two_parts_one_group)
    def tied_across_stages():
        # The first stage's embedding and, on the last, an output head tied to it but named otherwise: the
        # last stage's rule alone would send it to Muon, the first stage's copy goes to AdamW. Tied as a
        # framework ties them: the head starts as a copy of the embedding.
        torch.manual_seed(0)
        embedding = nn.Embedding(pipeline.VOCAB, pipeline.DIM)
        head = nn.Linear(pipeline.DIM, pipeline.VOCAB, bias=False)
        head.weight.data.copy_(embedding.weight.data)
        part = nn.Sequential(embedding if pp_rank == 0 else head)
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))  # a pp group no other DMuon holds
        fully_shard(part, mesh=mesh["dp"])
        dmuon.DMuon(part, pp_group=mesh["pp"]).step()

    attempt("tied across stages", tied_across_stages)

    def shaped_like_another_stages_embedding():
        # A vocabulary of 64 on the first stage, an MLP of 64 x 32 on the last: one shape, no tie. It trains.
        torch.manual_seed(0)
        embedding, mlp = nn.Embedding(64, 32), nn.Linear(32, 64, bias=False)
        part = nn.Sequential(embedding, nn.Linear(32, 16, bias=False)) if pp_rank == 0 else nn.Sequential(mlp)
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
        fully_shard(part, mesh=mesh["dp"])
        opt = dmuon.DMuon(part, lr=0.02, pp_group=mesh["pp"])
        before = {n: p.full_tensor().clone() for n, p in part.named_parameters()}
        x = torch.arange(4).reshape(2, 2) if pp_rank == 0 else torch.ones(2, 32)
        part(x).square().sum().backward()
        opt.step()
        moved = [n for n, p in part.named_parameters() if not torch.equal(p.full_tensor(), before[n])]
        if moved != list(before):
            raise AssertionError(f"not every parameter trained: {moved} of {list(before)}")

    attempt("shaped like another stage's embedding", shaped_like_another_stages_embedding)
    attempt("pp_group not a mesh or group", lambda: dmuon.DMuon(stage(world2["dp"]), pp_group=[0, 2]))
    attempt("pp_group of two dims", lambda: dmuon.DMuon(stage(world2["dp"]), pp_group=world2))
    return out


def test_misuse_is_refused_on_every_rank_naming_the_fix():
    """Each misuse raises on every rank (NCCL rule: a rank that raises alone leaves its peers in the
    next collective). A head tied across stages (a copy of another stage's embedding) is refused; a
    matrix that merely shares an embedding's shape trains: the stages compare fingerprints of the
    values, every rank of a stage computing the same ones in the same order (one collective path)."""
    expected = {
        "hsdp_mesh spanning stages": "not one that spans other stages",
        "two groups": "live on two different data-parallel groups",
        "two parts, one pp_group": "nn.ModuleList(parts)",
        "tied across stages": "'0.weight' (pipeline rank 1) goes to Muon but is a copy of the embedding "
                              "'0.weight' on pipeline rank 0 (the shape (50, 37)",
        "pp_group not a mesh or group": "pp_group must be a 1-D DeviceMesh or a ProcessGroup",
        "pp_group of two dims": "pp_group must be a 1-D DeviceMesh",
    }
    for r in _four_runs(checked=False):
        errors = succeeded(r["misuse"])
        for name, words in expected.items():
            assert errors[name] is not None and words in errors[name], (name, errors[name])
        # A shape shared with another stage's embedding ties nothing: that model trains.
        assert errors["shaped like another stage's embedding"] is None


def _on_eight_ranks(rank: int, world: int) -> dict:
    runs = {}
    for schedule in ("1f1b", "interleaved1f1b", "zbv"):
        for hsdp in ("fsdp2", "dmuon"):
            for scale in (True, False):
                runs[(schedule, hsdp, scale)] = functools.partial(
                    pipeline.train, rank, world, schedule, hsdp=hsdp, scale_grads=scale,
                    zero=2 if schedule in ZERO_BUBBLE else 3,
                    clip=CLIP if hsdp == "dmuon" else None)
    return run_each(runs)


@STREAMS
@pytest.mark.slow
def test_eight_ranks_as_pp2_replicate2_shard2():
    results = run_distributed(_on_eight_ranks, 8, timeout_s=900)
    for key in results[0]:
        clip = CLIP if key[1] == "dmuon" else None
        ref = pipeline.reference(4, 4, clip=clip)  # 4 data-parallel ranks per stage: their global batch
        for r in results:
            for name, p in succeeded(r[key])["params"].items():
                torch.testing.assert_close(p, ref[name], atol=1e-5, rtol=0, msg=lambda m: f"{key} {name}: {m}")


ZERO_BUBBLE = ("zbv", "interleavedzb")
"""Schedules with split input/weight backward: ZeRO-2 only (see RUNS)."""


def _every_level(rank: int, world: int, schedule: str) -> dict:
    zeros = (2,) if schedule in ZERO_BUBBLE else (2, 3)
    return run_each({(level, scale, zero): functools.partial(pipeline.train, rank, world, schedule,
                                                             hsdp=level, scale_grads=scale, zero=zero)
                     for level in (None, "fsdp2", "dmuon") for scale in (True, False) for zero in zeros})


@STREAMS
@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved1f1b", "loopedbfs", "zbv", "interleavedzb"])
def test_every_schedule_on_every_level(schedule):
    """The whole matrix: both scalings, ZeRO-2 and -3, 1-D, FSDP2's HSDP and the replicate level."""
    results = run_distributed(_every_level, 4, schedule, timeout_s=900)
    for key in results[0]:
        _check([succeeded(r[key]) for r in results])
