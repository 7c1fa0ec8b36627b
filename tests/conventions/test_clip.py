"""Clipping (torch's ``clip_grad_norm_`` on the FSDP2 model, or DMuon's) equals it on one process,
and the launches from backward survive it."""

from __future__ import annotations

import functools

import pytest
import torch

from support.spawn import run_distributed

from support.cases import MUON_KW, Case, run_cases
from support.clipping import resumed_clipping, state_dict_on_one_rank
from support.models import OddNet, lm_loss, odd_batch
from support.reference import reference_training

# Its point is stream order (launches from backward standing through clipping): every rank, its shared runs' included, runs under the
# stream checker.
pytestmark = pytest.mark.streams


CLIP = 0.3  # below the gradient norms of this model, so clipping acts every step
STEPS = 3
BLOCKS = 4  # OddNet: the root and three layers, each its own FSDP2 group
CASES = {
    "no overlap": Case(zero=3, overlap=False),
    "clipped_overlap=False": Case(zero=3, overlap=True, clipped_overlap=False),
    "overlap": Case(zero=3),
    "zero2 ns_in_backward 3 waves": Case(zero=2, ns_in_backward=True, return_waves=3),
    "DMuon.clip_grad_norm_": Case(zero=3, clip_with="dmuon"),
}


@functools.cache
def _runs(world_size: int, mesh_shape, hsdp: str) -> dict[str, list[dict]]:
    cases = [Case(**{**c.__dict__, "ns_dtype": torch.float32, "steps": STEPS, "clip": CLIP,
                     "mesh_shape": mesh_shape, "hsdp": hsdp}) for c in CASES.values()]
    results = run_distributed(run_cases, world_size, cases, timeout_s=300)
    return {name: [r[k] for r in results] for k, name in enumerate(CASES)}


@functools.cache
def _reference(world_size: int):
    torch.manual_seed(0)
    model = OddNet()
    batches = []
    for step in range(STEPS):
        parts = [odd_batch(step, r) for r in range(world_size)]
        batches.append((torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])))
    ref, _ = reference_training(model, batches, lm_loss, muon_kwargs=MUON_KW,
                                adamw_kwargs=dict(lr=3e-3, weight_decay=0.01), ns_dtype=torch.float32, clip=CLIP)
    return ref, list(reference_training.norms)


MESHES = [(3, None, "fsdp2"), (4, (2, 2), "fsdp2"), (4, (2, 2), "dmuon")]
IDS = ["3 ranks", "2x2 native HSDP", "2x2 replicate level"]


@pytest.mark.parametrize("world_size,mesh_shape,hsdp", MESHES, ids=IDS)
def test_clipped_training_matches_one_process(world_size, mesh_shape, hsdp):
    runs = _runs(world_size, mesh_shape, hsdp)
    ref, ref_norms = _reference(world_size)
    assert min(ref_norms) > CLIP
    for name, results in runs.items():
        for r in results:
            assert r["norms"] == pytest.approx(ref_norms, rel=1e-5), name
        got = results[0]["params"]
        worst = max(got, key=lambda n: (got[n] - ref[n]).abs().max().item())
        assert (got[worst] - ref[worst]).abs().max().item() <= 1e-5, (name, worst)


@pytest.mark.parametrize("world_size,mesh_shape,hsdp", MESHES, ids=IDS)
def test_launches_survive_clipping(world_size, mesh_shape, hsdp):
    runs = _runs(world_size, mesh_shape, hsdp)
    for name in ("overlap", "zero2 ns_in_backward 3 waves", "DMuon.clip_grad_norm_"):
        for r in runs[name]:
            # The first clip exchanges again and starts the owners' copies (the momentum sent once);
            # from then on every block's launch stands for its clipped gradients: no new exchange.
            assert [s["blocks_exchanged_in_backward"] for s in r["stats"]] == [0] + [BLOCKS] * (STEPS - 1), name
            assert [s["rescaled_launches"] for s in r["stats"]] == [0] + [BLOCKS] * (STEPS - 1), name
    for r in runs["clipped_overlap=False"]:
        # Without the owners' momenta the clipped gradients go stale: step() exchanges them again,
        # and the result is overlap=False's bit for bit.
        assert all(s["blocks_exchanged_in_backward"] == 0 and not s["rescaled_launches"] for s in r["stats"])
    same, other = runs["clipped_overlap=False"][0]["params"], runs["no overlap"][0]["params"]
    assert all(torch.equal(same[n], other[n]) for n in same)
    # The rescaled directions are the ranks' up to float32 rounding: not bit-identical, but close.
    rescaled = runs["overlap"][0]["params"]
    assert max((rescaled[n] - other[n]).abs().max().item() for n in other) <= 1e-6


@pytest.mark.parametrize("world_size,mesh_shape,hsdp", [(3, None, "fsdp2"), (4, (2, 2), "dmuon")],
                         ids=["3 ranks", "2x2 replicate level"])
def test_owners_momentum_after_a_state_load(world_size, mesh_shape, hsdp):
    """A state saved or loaded drops the owners' copies: the first clipped step after it exchanges the
    clipped gradients again and then sends the momentum to the owners (float32, once), after which the
    launches survive clipping again (as at the start of a run). The run resumed from the state and the
    one that went on after saving it take the same steps, bit for bit."""
    results = run_distributed(resumed_clipping, world_size, mesh_shape, hsdp, timeout_s=120)
    for r in results:
        for run in ("straight", "resumed"):
            stats = r[run]["stats"]
            assert [s["rescaled_launches"] for s in stats] == [0, BLOCKS, 0, BLOCKS], run
            assert [s["blocks_exchanged_in_backward"] for s in stats] == [0, BLOCKS, 0, BLOCKS], run
        # The step after the state: the clipped blocks again, then the momentum to the owners in float32.
        assert r["resumed"]["stats"][2]["bytes_sent"] > r["resumed"]["stats"][1]["bytes_sent"]
    straight, resumed = results[0]["straight"]["params"], results[0]["resumed"]["params"]
    assert all(torch.equal(straight[n], resumed[n]) for n in straight)


VARIANTS = {
    # name: (case fields, launches kept per step with overlap, of which rescaled)
    # Step 0 does not clip (launches stand as sent), step 1 clips (exchanged again, copies started),
    # step 2 clips (rescaled).
    "clipped on steps 1 and 2": (dict(clip_steps=(1, 2)), [BLOCKS, 0, BLOCKS], [0, 0, BLOCKS]),
    "accumulation": (dict(micro_batches=2), [0, BLOCKS, BLOCKS], [0, BLOCKS, BLOCKS]),
    "nonfinite=skip": (dict(nonfinite="skip"), [0, BLOCKS, BLOCKS], [0, BLOCKS, BLOCKS]),
    "clip_grad_value_": (dict(clip_with="value", clip=1e-3), [0] * STEPS, [0] * STEPS),
    # bf16 MixedPrecisionPolicy: two steps, so that step 1's forward ran on bit-identical parameters
    # (step 0 exchanged again) and only step 1's rescale separates the runs.
    "bf16 mixed precision": (dict(bf16=True, steps=2), [0, BLOCKS], [0, BLOCKS]),
    "activation checkpointing, a frozen matrix": (dict(activation_checkpointing="full", frozen=("layers.1.mid",)),
                                                  [0, BLOCKS, BLOCKS], [0, BLOCKS, BLOCKS]),
}


def _variants(hsdp: str) -> list[str]:
    # On the replicate level a Muon gradient is Partial("avg"): DTensor refuses clip_grad_value_ there.
    return [name for name in VARIANTS if not (hsdp == "dmuon" and name == "clip_grad_value_")]


@functools.cache
def _variant_runs(world_size: int, mesh_shape, hsdp: str, names: tuple[str, ...]) -> dict[str, list[list[dict]]]:
    """The variants ``names`` on one mesh, each with overlap and without, in one launch."""
    cases = []
    for fields, _, _ in (VARIANTS[name] for name in names):
        for overlap in (True, False):
            cases.append(Case(**{"ns_dtype": torch.float32, "steps": STEPS, "clip": CLIP, "mesh_shape": mesh_shape,
                                 "hsdp": hsdp, "overlap": overlap, **fields}))
    results = run_distributed(run_cases, world_size, cases, timeout_s=300)
    return {name: [[r[2 * k] for r in results], [r[2 * k + 1] for r in results]] for k, name in enumerate(names)}


VARIANT_MESHES = {"3 ranks": (3, None, "fsdp2"), "2x2 replicate level": (4, (2, 2), "dmuon")}
DEFAULT_VARIANTS = {
    "3 ranks": ("clipped on steps 1 and 2", "clip_grad_value_", "bf16 mixed precision"),
    "2x2 replicate level": ("accumulation", "nonfinite=skip", "activation checkpointing, a frozen matrix"),
}
"""Each variant runs by default on one of the meshes: the one-process equivalence of clipped training on
both meshes is test_clipped_training_matches_one_process's, and a variant's launches depend on its own
fields, not on the mesh. The other mesh's run of each variant is under ``-m slow``."""


def _variant_params() -> list:
    params = []
    for mesh, (_, _, hsdp) in VARIANT_MESHES.items():
        for variant in _variants(hsdp):
            if variant in DEFAULT_VARIANTS[mesh]:
                params.append(pytest.param(mesh, variant))
            else:
                # Under -m slow: test_clipping_variants_against_overlap_false[<other mesh>-<variant>] runs the
                # variant by default, test_clipped_training_matches_one_process[<mesh>] clipping on this mesh.
                params.append(pytest.param(mesh, variant, marks=pytest.mark.slow))
    return params


@pytest.mark.parametrize("mesh,variant", _variant_params())
def test_clipping_variants_against_overlap_false(mesh, variant):
    """Clipping on some steps only, with accumulation (FSDP2's no-sync micro-batches), with
    ``nonfinite="skip"`` (the verdicts in the second all-reduce), an edit that is no one factor
    (``clip_grad_value_``, exchanged again), bf16 mixed precision, activation checkpointing with a frozen
    matrix: the launches kept are the ones expected, and the result is ``overlap=False``'s, bit for bit
    where nothing was rescaled, within float32 rounding where it was."""
    # The default variants of a mesh share one launch, the slow ones another.
    slow = tuple(v for v in _variants(VARIANT_MESHES[mesh][2]) if v not in DEFAULT_VARIANTS[mesh])
    names = DEFAULT_VARIANTS[mesh] if variant in DEFAULT_VARIANTS[mesh] else slow
    on, off = _variant_runs(*VARIANT_MESHES[mesh], names)[variant]
    _, kept, rescaled = VARIANTS[variant]
    for r in on:
        assert [s["blocks_exchanged_in_backward"] for s in r["stats"]] == kept, variant
        assert [s["rescaled_launches"] for s in r["stats"]] == rescaled, variant
    got, want = on[0]["params"], off[0]["params"]
    worst = max((got[n] - want[n]).abs().max().item() for n in want)
    if any(rescaled):
        assert worst <= 1e-6, variant
    else:
        assert worst == 0.0, variant


def test_a_state_dict_taken_on_one_rank_only():
    """``state_dict()`` issues no collective and may run on rank 0 alone: the next step's agreement
    tells every rank that the owners' copies must be sent again, and every rank does so."""
    results = run_distributed(state_dict_on_one_rank, 3, timeout_s=120)
    for stats in results:
        assert [s["rescaled_launches"] for s in stats] == [0, BLOCKS, 0, BLOCKS]
        # Every rank sent its momentum to the owners after step 2 (more collectives than step 1's).
        assert stats[2]["collectives"] > stats[1]["collectives"]
