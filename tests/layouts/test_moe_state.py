"""The MoE layout's state across a run (issue #62 item 5; tests/support/moe_state.py): torch's DCP checkpoints of
the expert-parallel layout resume on another ``ep``, another FSDP2 dim for the experts, FSDP2's own HSDP and
another world size, as the run that went on; a NaN in one expert's gradient on one rank skips (or raises on)
the same step on every rank; QK-clip on an MoE model with attention equals one process with torch.optim.Muon per
expert slice + AdamW and the clip written out.

Every 4-rank run in one process group and every 2-rank run in another (``run_each``); the 2-rank group resumes
the 4-rank group's checkpoints (world size 4 -> 2, the global batch kept: 2 rows a rank -> 4).
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

from support import moe_state as ms
from support.scenarios import run_each, succeeded
from support.spawn import run_distributed

SAVED_AT, MORE = 2, 2
EXPERTS = 4

SAVED = (2, EXPERTS, False, 1)
"""``(ep, experts, dim1, replicate)``: ep = 2, efsdp = 2 with FSDP2 on the local stacks' dim 0, E = 4."""
SAVED_HSDP = (2, 3, None, 2)
"""FSDP2's own HSDP (2 replicas of fsdp = 2; the experts: efsdp = 1, ep = 2, E = 3 split 2 + 1), clipped every
step (``opt.clip_grad_norm_``: the owners' momentum copies of ``clipped_overlap``) with
``apply_updates="next_forward"`` (updates still in flight when the state is taken)."""
HSDP_RUN = dict(execution={"apply_updates": "next_forward"}, clip=0.05)

RESUMED_4 = {
    # name: (checkpoint, layout); 4 ranks
    "same layout": ("ep2", SAVED),
    "experts on dim 1": ("ep2", (2, EXPERTS, True, 1)),   # ep and efsdp kept, FSDP2 on the stacks' dim 1
    "ep 4": ("ep2", (4, EXPERTS, None, 1)),               # efsdp 2 -> 1: one expert a rank
    "ep 1": ("ep2", (1, EXPERTS, None, 1)),               # efsdp 2 -> 4: every rank all experts' tokens
    "FSDP2's HSDP": ("ep2", (2, EXPERTS, None, 2)),       # 2 replicas outside, efsdp 1
    "hsdp same layout": ("hsdp", SAVED_HSDP),
    "hsdp to ep2 dim 1": ("hsdp", (2, 3, None, 1)),
    "hsdp to ep 1": ("hsdp", (1, 3, None, 1)),
}
RESUMED_2 = {
    "2 ranks ep 2": ("ep2", (2, EXPERTS, None, 1)),         # efsdp 1
    "2 ranks ep 1": ("ep2", (1, EXPERTS, None, 1)),         # efsdp 2
    "2 ranks hsdp to ep 2": ("hsdp", (2, 3, None, 1)),
}
SLOW_RESUMES = ("ep 1", "hsdp to ep2 dim 1", "2 ranks ep 1")
"""Resumes under -m slow, in 4-rank and 2-rank runs of their own after the default ones: by default ep 1
is resumed on from the HSDP checkpoint ("hsdp to ep 1"), the HSDP checkpoint on another layout ("hsdp to
ep 1", "2 ranks hsdp to ep 2"), efsdp 1 on world 2 ("2 ranks ep 2") and the stacks' dim 1 ("experts on dim 1")."""
BIT_FOR_BIT = ("same layout", "experts on dim 1", "hsdp same layout")
"""Resumes whose every sum adds the same terms in the same order as the run that went on: the same
ranks' tokens meet each expert (one GEMM over the same rows), the dense reductions are the same, and the
experts' reduce-scatter adds two ranks' values (a + b == b + a in floating point) wherever the pieces sit."""

NONFINITE = dict(layout=(2, 3, None), poisoned_rank=3, poisoned_step=1, steps=3, where=(1, "w1", (0, 0, 0)))
"""ep = 2, efsdp = 2, E = 3 (FSDP2 on dim 1): rank 3 (ep rank 1) holds expert 2 alone; the NaN goes into
row 0 of its local gradient, which FSDP2's reduce-scatter over efsdp {1, 3} hands to rank 1. So one rank of
the expert mesh sees it, and the dense ranks 0 and 2 never hold it."""
QK_LAYOUTS = {"ep2-dim1": (2, 3, None, 1), "ep2-native-hsdp": (2, 3, None, 2)}
QK_STEPS = 3


def _options(checkpoint: str) -> dict:
    return HSDP_RUN if checkpoint == "hsdp" else {}


def _resumes(rank: int, world: int, directory: str, resumed: dict, slow: bool) -> dict:
    """The runs resuming on the layouts of ``resumed`` that are (``slow``) or are not in SLOW_RESUMES."""
    return {name: functools.partial(ms.resume, rank, world, f"{directory}/{checkpoint}", layout, SAVED_AT, MORE,
                                    **_options(checkpoint))
            for name, (checkpoint, layout) in resumed.items() if (name in SLOW_RESUMES) == slow}


def _four_ranks(rank: int, world: int, directory: str) -> dict:
    """Every 4-rank run of this file in one process group (but SLOW_RESUMES): the saves come before the
    resumes that read them."""
    runs = {
        "saved ep2": functools.partial(ms.save_and_go_on, rank, world, f"{directory}/ep2", SAVED, SAVED_AT, MORE),
        "saved hsdp": functools.partial(ms.save_and_go_on, rank, world, f"{directory}/hsdp", SAVED_HSDP, SAVED_AT,
                                        MORE, **HSDP_RUN),
    }
    runs |= _resumes(rank, world, directory, RESUMED_4, slow=False)
    for mode in ("skip", "raise"):
        runs[f"nonfinite {mode}"] = functools.partial(ms.nonfinite_run, rank, world, mode, **NONFINITE)
    for name, layout in QK_LAYOUTS.items():
        runs[f"qk {name}"] = functools.partial(ms.qk_clip_run, rank, world, *layout, QK_STEPS)
    return run_each(runs)


def _resumed_on(rank: int, world: int, directory: str, slow: bool) -> dict:
    return run_each(_resumes(rank, world, directory, RESUMED_4 if world == 4 else RESUMED_2, slow))


@pytest.fixture(scope="module")
def directory(tmp_path_factory):
    return str(tmp_path_factory.mktemp("moe_checkpoints"))


@pytest.fixture(scope="module")
def four(directory):
    return run_distributed(_four_ranks, 4, directory, timeout_s=300)


@pytest.fixture(scope="module")
def two(four, directory):
    return run_distributed(_resumed_on, 2, directory, False, timeout_s=300)  # after the 4-rank group saved


@pytest.fixture(scope="module")
def slow_resumes(four, directory) -> dict:
    """SLOW_RESUMES' results by name (every rank's), from runs after the 4-rank group saved."""
    return {name: [r[name] for r in runs] for runs in (run_distributed(_resumed_on, world, directory, True,
                                                                       timeout_s=300) for world in (4, 2))
            for name in runs[0]}


def _worst(got: dict, ref: dict) -> tuple[str, float]:
    assert got.keys() == ref.keys()
    name = max(ref, key=lambda n: (got[n] - ref[n]).abs().max().item())
    return name, (got[name] - ref[name]).abs().max().item()


def _initial(experts: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)  # what ms.build starts from
    return {n: p.detach().clone() for n, p in ms.MoENet(experts).named_parameters()}


# --- 1. DCP checkpoints ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("checkpoint", ["ep2", "hsdp"])
def test_the_saved_state_is_torch_muons_and_adamws(four, directory, checkpoint):
    """What the checkpoint holds: each expert stack's momentum is torch.optim.Muon's on its slices (the
    stacks' scale included, which Muon's update alone cannot show: NS normalizes), written once in DCP's
    files whatever the replicas (HSDP keeps each momentum element on one rank)."""
    import torch.distributed.checkpoint as dcp

    saved = succeeded(four[0][f"saved {checkpoint}"])["saved"]
    layout = SAVED if checkpoint == "ep2" else SAVED_HSDP
    momenta: dict[str, torch.Tensor] = {}
    ms.reference(ms.MoENet(layout[1]), _initial(layout[1]), range(SAVED_AT), momenta=momenta,
                 max_norm=_options(checkpoint).get("clip"))
    assert len(momenta) == 12  # 4 stacks + 8 dense matrices
    for name, value in momenta.items():
        got = saved["optim"][name]["momentum_buffer"]
        assert got.shape == value.shape, name
        # Equal up to the order of fp32 sums (measured: under 1e-6 of the largest value); a wrong scale or a
        # slice on another expert is of the order of the values themselves.
        assert (got - value).abs().max().item() <= 1e-5 * value.abs().max().item(), name
    meta = dcp.FileSystemReader(f"{directory}/{checkpoint}").read_metadata().state_dict_metadata
    stacks = {k: v for k, v in meta.items() if k.endswith("momentum_buffer") and ".experts." in k}
    assert len(stacks) == 4
    for key, m in stacks.items():
        assert sum(math.prod(c.sizes) for c in m.chunks) == math.prod(m.size), key


def _resumed(request, four, name):
    if name in SLOW_RESUMES:
        return [succeeded(r) for r in request.getfixturevalue("slow_resumes")[name]]
    return [succeeded(r[name]) for r in (four if name in RESUMED_4 else request.getfixturevalue("two"))]


@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.slow) if name in SLOW_RESUMES else name
                                  for name in [*RESUMED_4, *RESUMED_2]])
def test_a_checkpoint_resumes_on_another_ep_and_world_as_the_run_that_went_on(request, four, name):
    """A fresh model on another layout loads the checkpoint (``dcp.load`` + ``set_*_state_dict``, torch's own
    calls) and trains the same steps: its full model and optimizer state right after the load are the saved
    ones bit for bit, every rank ends with the same parameters, and those equal the run that went on: bit
    for bit where both runs add the same terms in the same order (:data:`BIT_FOR_BIT`), else within the
    rounding of the reordered sums (below)."""
    checkpoint = RESUMED_4.get(name, RESUMED_2.get(name))[0]
    went_on = succeeded(four[0][f"saved {checkpoint}"])
    ranks = _resumed(request, four, name)
    loaded, saved = ranks[0]["loaded"], went_on["saved"]
    assert loaded["model"].keys() == saved["model"].keys()
    for key, value in saved["model"].items():
        assert torch.equal(loaded["model"][key], value), key
    assert loaded["optim"].keys() == saved["optim"].keys() and len(saved["optim"]) == 15  # every parameter
    for key, state in saved["optim"].items():
        assert state.keys() == loaded["optim"][key].keys(), key
        for k, v in state.items():
            assert torch.equal(torch.as_tensor(loaded["optim"][key][k]), torch.as_tensor(v)), (key, k)
    for r in ranks[1:]:
        assert all(torch.equal(r["params"][n], ranks[0]["params"][n]) for n in ranks[0]["params"])
    got, ref = ranks[0]["params"], went_on["params"]
    worst, err = _worst(got, ref)
    if name in BIT_FOR_BIT:
        assert err == 0.0, (worst, err)
        return
    # Another ep, efsdp or world size changes only the order of fp32 sums: which ranks' tokens one expert's
    # GEMM adds together, the rank count FSDP2's reductions add, the rows a rank's mean loss adds (2 or 4).
    # Each such sum rounds within a few units of fp32's 2^-24 of its terms' size, and Muon's and AdamW's
    # steps are bounded by their lr (an orthogonalized direction, m / sqrt(v)), so two runs from bit-equal
    # states part only by the roundings the weights cross, step by step: we allow 8 units in the last place
    # of the largest weight per resumed step (measured: 1 to 4 in all, 2e-7 to 5e-7). A state lost or
    # misplaced in the load (a momentum restarted, AdamW's step count, a slice on another expert) moves the
    # weights by lr-sized amounts, 1e-3 and more.
    scale = max(v.abs().max().item() for v in ref.values())
    tolerance = 8 * MORE * torch.finfo(torch.float32).eps * scale
    assert err <= tolerance, (worst, err, tolerance)


# --- 2. nonfinite across the meshes ----------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["skip", "raise"])
def test_a_nan_in_one_experts_gradient_on_one_rank_stops_the_step_on_every_rank(four, mode):
    """``ExecutionConfig(nonfinite=...)``: the NaN reaches one rank's expert shard only (the dense ranks never
    hold it), yet every rank skips the step (``"skip"``) or raises the same FloatingPointError naming the
    expert (``"raise"``): no rank waits for another, parameters and every rank's optimizer state unchanged
    by that step. The run goes on (after ``"raise"``, from ``zero_grad``) and equals one process that skips
    that step."""
    ranks = [succeeded(r[f"nonfinite {mode}"]) for r in four]
    step = NONFINITE["poisoned_step"]
    assert [r["steps"][step]["nonfinite_here"] for r in ranks] == [False, True, False, False]
    for rank, r in enumerate(ranks):
        for k, record in enumerate(r["steps"]):
            stopped = k == step
            assert record["skipped"] == (stopped and mode == "skip"), (rank, k, record)
            assert (record["error"] is not None) == (stopped and mode == "raise"), (rank, k, record)
            # A step that runs changes the weights and the state; the stopped one changes neither.
            assert record["params_kept"] == stopped and record["state_kept"] == stopped, (rank, k, record)
    if mode == "raise":
        errors = {r["steps"][step]["error"] for r in ranks}
        assert errors == {"non-finite gradients in ['layers.1.experts.w1[2]']"}, errors
    for r in ranks[1:]:
        assert all(torch.equal(r["params"][n], ranks[0]["params"][n]) for n in ranks[0]["params"])
    ref = ms.reference(ms.MoENet(3), ranks[0]["initial"], range(NONFINITE["steps"]), skipped=(step,))
    worst, err = _worst(ranks[0]["params"], ref)
    assert err <= 1e-5, (worst, err)


# --- 3. QK-clip on an MoE model --------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _qk_reference(clip: bool = True):
    """The one-process reference from seed 0's weights (the distributed runs' initial ones, checked)."""
    torch.manual_seed(0)
    initial = {n: p.detach().clone() for n, p in ms.AttnMoENet(3).named_parameters()}
    maxima: list = []
    params = ms.reference(ms.AttnMoENet(3), initial, range(QK_STEPS), qk_clip=clip, maxima=maxima)
    return initial, params, maxima


def test_the_qk_reference_clips_some_heads_only_and_the_clip_matters():
    """Guards the reference: some heads pass tau and some do not, and clipping changes the training."""
    _, params, maxima = _qk_reference()
    values = torch.stack([torch.cat([step[k] for k in sorted(step)]) for step in maxima])
    assert (values > ms.TAU).any() and (values <= ms.TAU).any(), values
    assert (values > ms.TAU).sum() < values.numel() // 2, values
    _, unclipped, _ = _qk_reference(clip=False)
    assert _worst(params, unclipped)[1] > 0.1


@pytest.mark.parametrize("layout", list(QK_LAYOUTS))
def test_qk_clip_on_the_expert_parallel_layout_equals_one_process(four, layout):
    """MuonClip as Kimi K2 trains it, on an MoE model: dense attention (q, k on the fsdp mesh, FSDP2's chunks
    of 2 rows cutting each 4-row head over two ranks) beside routed experts on (efsdp, ep). Every rank's
    agreed maxima are the maximum over every rank's tokens (ranks' own maxima differ, so rank 0's alone
    would clip otherwise), and the weights equal the one-process reference: torch.optim.Muon per expert
    slice and dense matrix, AdamW, then the clip written out from the formula (1e-5, fp32 NS)."""
    ranks = [succeeded(r[f"qk {layout}"]) for r in four]
    initial, ref, maxima = _qk_reference()
    assert all(torch.equal(ranks[0]["initial"][n], initial[n]) for n in initial)
    for step in range(QK_STEPS):
        local = torch.stack([r["local"][step] for r in ranks])
        agreed = torch.cat([ranks[0]["agreed"][step][k] for k in sorted(maxima[step])])
        assert torch.equal(agreed, local.amax(0)), step
        assert all(torch.equal(torch.cat([r["agreed"][step][k] for k in sorted(maxima[step])]), agreed)
                   for r in ranks)
        expected = torch.cat([maxima[step][k] for k in sorted(maxima[step])])
        assert torch.allclose(agreed, expected, rtol=1e-6, atol=0), (step, agreed, expected)
    local = torch.stack([torch.stack(r["local"]) for r in ranks])  # (rank, step, head)
    assert (local.amax(0) > local[0]).any()  # some step's maximum is not rank 0's
    for r in ranks[1:]:
        assert all(torch.equal(r["params"][n], ranks[0]["params"][n]) for n in ref)
    worst, err = _worst(ranks[0]["params"], ref)
    assert err <= 1e-5, (worst, err)
