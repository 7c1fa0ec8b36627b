"""HSDP with dmuon's replicate level (``hsdp_mesh=``): FSDP2 over the shard dim, dmuon reduces across replicas.

The model is ``fully_shard``-ed over ``mesh["shard"]``; dmuon all-reduces the
other parameters' gradients across replicas and reduce-scatters the Muon
matrices' by the momentum's column slices. Results must be single-process
torch.optim.Muon + AdamW's (fp32 NS), with everything people train with.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

from support.spawn import run_distributed

from support import experts, tp
from support.cases import MUON_KW, Case, full_params, run_cases, sharded_oddnet
from support.equivalence import N_MATRICES, SKIP, STEPS, check_sharded_state, max_diff, reference
from support.models import OddNet, lm_loss, odd_batch
from support.reference import reference_training
from support.scenarios import run_each, succeeded

# The training runs' point is stream order (the replicate level's reduction across replicas beside backward):
# their ranks run under the stream checker. The misuse and the bf16 comparison with FSDP2's HSDP (whose
# point is what the replicate level builds and computes) share a 4-rank run of their own without it.
STREAMS = pytest.mark.streams

CLIP = 0.3  # below every step's gradient norm here: the clip acts on every step
FROZEN = ("layers.1.mid",)


def _reference_with(world: int, *, micro: int = 1, clip: float | None = None, steps: int = STEPS,
                    skip: dict | None = None):
    """One process on every rank's batches (``micro`` micro-batches' worth each), torch's clip if given."""
    torch.manual_seed(0)
    model = OddNet()
    batches = []
    for step in range(steps):
        parts = [odd_batch(step, r, batch=2 * micro) for r in range(world)]
        batches.append((torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])))
    calls = iter(range(steps))

    def loss_fn(m, batch):
        m.skip = (skip or {}).get(next(calls), set())
        return lm_loss(m, batch)

    params, _ = reference_training(model, batches, loss_fn, muon_kwargs=MUON_KW,
                                   adamw_kwargs=dict(lr=3e-3, weight_decay=0.01), ns_dtype=torch.float32, clip=clip)
    return params, list(reference_training.norms)


def _reference_frozen(world: int):
    torch.manual_seed(0)
    model = OddNet()
    for name, p in model.named_parameters():
        if name.startswith(FROZEN):
            p.requires_grad_(False)
    batches = []
    for step in range(STEPS):
        parts = [odd_batch(step, r) for r in range(world)]
        batches.append((torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])))
    return reference_training(model, batches, lm_loss, muon_kwargs=MUON_KW,
                              adamw_kwargs=dict(lr=3e-3, weight_decay=0.01), ns_dtype=torch.float32)[0]


def _cases(mesh_shape, full: bool) -> list[Case]:
    base = dict(mesh_shape=mesh_shape, hsdp="dmuon", ns_dtype=torch.float32, steps=STEPS)
    cases = [Case(zero=3, skip=SKIP, **base),
             Case(zero=2, clip=CLIP, clip_with="dmuon", **base)]
    if full:
        cases += [
            Case(zero=2, skip=SKIP, overlap=False, return_waves=4, **base),
            Case(zero=3, skip=SKIP, ns_in_backward=True, **base),
            Case(zero=3, frozen=FROZEN, **base),
            Case(zero=3, micro_batches=2, **base),  # accumulation under set_requires_gradient_sync(False)
            Case(zero=2, micro_batches=2, micro_sync=True, clip=CLIP, **base),  # FSDP2 reducing every micro-batch
        ]
    return cases


# Eight processes on the 2-core CI machine cost 20 s a mesh: the (2, 4) and (4, 2) meshes (and TP's
# (2, 2, 2)) run with -m slow; the default suite keeps two replicas.
EIGHT_RANKS = pytest.mark.slow


BF16 = dict(mesh_shape=(2, 2), ns_dtype=torch.bfloat16, steps=STEPS, skip=SKIP, bf16=True, zero=3)
BF16_CASES = [Case(hsdp="dmuon", **BF16), Case(hsdp="fsdp2", **BF16), Case(kind="gather", **BF16)]


UNCHECKED = ("bf16", "misuse")
"""The 4-rank runs whose ranks run without the stream checker (see STREAMS)."""


def _on_four_ranks(rank: int, world: int, checked: bool) -> dict:
    """Every 4-rank run of this file under the stream checker (``checked``) or not, in one process group (a
    spawn costs more than the work), each with its own result or its own error (each case of a list of
    cases too)."""
    runs = {"2x2": lambda: run_cases(rank, world, _cases((2, 2), full=True)),
            "bf16": lambda: run_cases(rank, world, BF16_CASES),
            "experts": lambda: experts.train(rank, world, STEPS, 3, (2, 2), None, 4, "dmuon"),
            "misuse": lambda: _bad_setups(rank, world), "by_hand": lambda: _grads_set_by_hand(rank, world)}
    return run_each({name: run for name, run in runs.items() if (name in UNCHECKED) != checked})


@functools.cache
def _four_runs(checked: bool) -> list[dict]:
    return run_distributed(_on_four_ranks, 4, checked, timeout_s=600)


def _four(run: str) -> list:
    """Each rank's result of the 4-rank run ``run`` (its ranks' error when it raised)."""
    return [succeeded(r[run]) for r in _four_runs(run not in UNCHECKED)]


# 3x2 under -m slow: [2x2] runs the same two cases (and five more) by default, and three replicas of FSDP2's
# own HSDP train by default in tests/layouts/test_hsdp.py::test_hsdp_matches_single_process_reference[mesh_shape1].
@STREAMS
@pytest.mark.parametrize("mesh_shape", [(2, 2), pytest.param((3, 2), marks=pytest.mark.slow),
                                        pytest.param((2, 4), marks=EIGHT_RANKS),
                                        pytest.param((4, 2), marks=EIGHT_RANKS)], ids=["2x2", "3x2", "2x4", "4x2"])
def test_replicate_level_matches_single_process_reference(mesh_shape):
    world = mesh_shape[0] * mesh_shape[1]
    full = mesh_shape == (2, 2)  # every variant on one mesh; the others run the two main ones (8 ranks cost)
    cases = _cases(mesh_shape, full)
    results = _four("2x2") if full else run_distributed(run_cases, world, cases, timeout_s=600)
    plain = reference(world, torch.float32)[0]
    clipped, norms = _reference_with(world, clip=CLIP)
    for k, case in enumerate(cases):
        if case.micro_batches > 1:
            ref, ref_norms = _reference_with(world, micro=2, clip=case.clip)
        elif case.clip is not None:
            ref, ref_norms = clipped, norms
        elif case.frozen:
            ref, ref_norms = _reference_frozen(world), []
        else:
            ref, ref_norms = plain, []
        diff, worst = max_diff(results[0][k]["params"], ref)
        assert diff <= 1e-5, f"{case}: {worst} differs by {diff:.3g}"
        for r in results:
            # The clip's norm is the single-process one on every rank, whichever clip was called.
            assert r[k]["norms"] == pytest.approx(ref_norms, rel=1e-5)
        for step in range(case.steps):
            # NS once per matrix in the whole cluster.
            done = sum(r[k]["stats"][step]["orthogonalized"] for r in results)
            skipped = 3 * len(case.skip.get(step, ()))
            assert done == N_MATRICES - skipped - (1 if case.frozen else 0), (case, step)
        if case.clip is None and case.overlap and case.micro_batches == 1 and not case.ns_in_backward:
            # Every block's directions went to the owners from backward, after the reduction.
            assert results[0][k]["stats"][0]["blocks_exchanged_in_backward"] == 4
    # Momentum lives once in the whole mesh (rows over the shard dim, columns over the replicas).
    check_sharded_state(results, 0, results[0][0]["shapes"])


def test_bf16_mixed_precision_equals_native_hsdp():
    """bf16 compute and NS: the same as FSDP2's native HSDP with dmuon and as gather-then-compute there.

    The gradients differ only in summation order across replicas (exact for these fp32 reductions
    over 2 replicas: a + b either way), so every bf16 rounding agrees.
    """
    results = _four("bf16")
    for other in (1, 2):
        diff, worst = max_diff(results[0][0]["params"], results[0][other]["params"])
        assert diff <= 1e-6, (other, worst, diff)


@STREAMS
@EIGHT_RANKS
def test_tensor_parallel_on_a_3d_mesh():
    """(replicate, shard, tp) = (2, 2, 2): TP over tp, FSDP2 over shard, dmuon across replicas."""
    results = run_distributed(tp.train, 8, STEPS, (2, 2, 2), "dmuon", False, False, "dmuon", timeout_s=300)
    tp.check_equals_reference(results, 4, STEPS)


@STREAMS
def test_expert_stacks():
    results = _four("experts")
    ref = experts.reference(4, STEPS)
    diff = max((results[0]["params"][n] - ref[n]).abs().max().item() for n in ref)
    assert diff <= 1e-5
    # The stack's momentum is held once over the whole mesh.
    assert sum(r["momentum_numel"] for r in results) == 3 * 10 * 6


def _bad_setups(rank: int, world: int) -> dict:
    """Each misuse on every rank: the error each rank raised (or None)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dmuon

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    out = {}

    def attempt(name, build, **kwargs):
        torch.manual_seed(0)
        model = OddNet()
        build(model)
        try:
            dmuon.DMuon(model, **kwargs)
            out[name] = None
        except ValueError as err:
            out[name] = str(err)
        dist.barrier()

    def shard_over(target):
        def build(model):
            for layer in model.layers:
                fully_shard(layer, mesh=target)
            fully_shard(model, mesh=target)
        return build

    attempt("native model, hsdp_mesh", shard_over(mesh), hsdp_mesh=mesh)
    attempt("shard sub-mesh, no hsdp_mesh", shard_over(mesh["shard"]))
    other = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "shd"))
    attempt("another mesh", shard_over(mesh["shard"]), hsdp_mesh=other)
    attempt("1-D hsdp_mesh", shard_over(mesh["shard"]), hsdp_mesh=mesh["shard"])

    def with_hook(model):
        shard_over(mesh["shard"])(model)
        model.set_all_reduce_hook(lambda t: None)

    attempt("all-reduce hook", with_hook, hsdp_mesh=mesh)
    return out


def test_misuse_is_refused_on_every_rank_naming_the_fix():
    results = _four("misuse")
    expected = {
        "native model, hsdp_mesh": "fully_shard-ed over the whole hsdp_mesh",
        "shard sub-mesh, no hsdp_mesh": "pass hsdp_mesh=",
        "another mesh": "not on hsdp_mesh's non-replicate dims",
        "1-D hsdp_mesh": "hsdp_mesh must be a DeviceMesh with named dims",
        "all-reduce hook": "set_all_reduce_hook",
    }
    for r in results:
        for name, words in expected.items():
            assert r[name] is not None and words in r[name], (name, r[name])



def _grads_set_by_hand(rank: int, world: int) -> dict:
    """Gradients set by hand (no FSDP2 hook saw them): replica ``r`` sets ``G + (r - 1/2) N``, whose
    mean over the two replicas is ``G``, the single-process gradient of step 0's batches. ``step()``
    reduces them itself."""
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    single = OddNet()
    parts = [odd_batch(0, r) for r in range(world)]
    lm_loss(single, (torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]))).backward()
    model, plan, opt = sharded_oddnet(world, zero=3, mesh_shape=(2, 2), hsdp="dmuon")
    replica, shard = divmod(rank, 2)
    handed, copies = {}, {}
    for k, ((name, p), (_, q)) in enumerate(zip(model.named_parameters(), single.named_parameters())):
        noise = torch.randn(q.shape, generator=torch.Generator().manual_seed(k))
        rows = torch.chunk(q.grad + (replica - 0.5) * noise, 2, dim=0)
        handed[name] = rows[shard].clone() if shard < len(rows) else q.grad.new_zeros((0, *q.shape[1:]))
        copies[name] = handed[name].clone()
        p.grad = DTensor.from_local(handed[name], p.device_mesh, p.placements, run_check=False,
                                    shape=p.shape, stride=p.stride())
    opt.step()
    return {"params": full_params(model),
            "changed": [name for name in handed if not torch.equal(handed[name], copies[name])]}


@STREAMS
def test_gradients_set_by_hand_are_reduced_in_step_into_a_copy():
    """No hook fired: step() reduces the replicas' gradients itself, into tensors of its own."""
    results = _four("by_hand")
    ref = _reference_with(4, steps=1)[0]
    diff, worst = max_diff(results[0]["params"], ref)
    assert diff <= 1e-5, (worst, diff)
    for r in results:
        assert r["changed"] == []
