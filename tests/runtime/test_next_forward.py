"""``ExecutionConfig(apply_updates="next_forward")``: the Muon updates applied in the next forward.

The same training, bit for bit, as ``"in_step"`` once the last step's updates are flushed (the units
apply each matrix's own update, in the same arithmetic, only later), and the same as one process
running torch.optim.Muon + AdamW; nothing between ``step()`` and the next forward reads a stale weight
through a state dict, an evaluation forward or a second ``step()``; the collectives are the model's.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import dmuon
from support.cases import Case, full_params, run_cases, sharded_oddnet
from support.equivalence import SKIP, STEPS, max_diff, reference
from support.models import OddNet, lm_loss, odd_batch
from support.scenarios import succeeded
from support.spawn import run_distributed
from support.step_comm import check_counted_log, counted_step
from dmuon.costmodel.traffic import owner_exchange_collectives, step_collectives, with_weight_norms_per_wave

MODES = ("in_step", "next_forward")

_reference = functools.cache(reference)
"""The one-process reference per world size, trained once for every test here (read, never changed)."""


def _pairs(**kw) -> list[Case]:
    return [Case(apply_updates=mode, steps=STEPS, **kw) for mode in MODES]


def _trained(model, opt, rank: int, skip: dict = SKIP, after_step=None) -> dict:
    """``STEPS`` steps of OddNet's batches (``skip``: the blocks left out per step), ``after_step()`` after
    each, then the updates flushed; every parameter's full value."""
    for step in range(STEPS):
        model.skip = skip.get(step, set())
        lm_loss(model, odd_batch(step, rank)).backward()
        opt.step()
        opt.zero_grad()
        if after_step is not None:
            after_step()
    opt.flush_updates()
    return full_params(model)


def _assert_same_params(ins: dict, nfwd: dict, label) -> None:
    """The ``"in_step"`` run's parameters and the ``"next_forward"`` run's, bit for bit."""
    for name in ins:
        assert torch.equal(ins[name], nfwd[name]), f"{label}: {name} differs"


def _assert_same(results, k: int, label: str) -> None:
    """Case ``k`` (in_step) and ``k + 1`` (next_forward): the same parameters, bit for bit, and losses."""
    ins, nfwd = results[0][k], results[0][k + 1]
    _assert_same_params(ins["params"], nfwd["params"], label)
    assert [r[k]["losses"] for r in results] == [r[k + 1]["losses"] for r in results], label


BOTH_ZEROS = (3, 2)


@pytest.mark.parametrize("mesh_shape, world_size, hsdp, zeros", [
    (None, 2, "fsdp2", BOTH_ZEROS), (None, 1, "fsdp2", BOTH_ZEROS),
    # 1-D on 4 ranks under -m slow: test_muonh_next_forward_on_every_mesh[1-D-4-ranks] trains it bit for bit as
    # "in_step" by default, and [1-D] here against the one-process reference.
    pytest.param(None, 4, "fsdp2", BOTH_ZEROS, marks=pytest.mark.slow), ((2, 2), 4, "fsdp2", BOTH_ZEROS),
    ((2, 2), 4, "dmuon", BOTH_ZEROS),
    # Three replicas: the returns across replicas take the scatter route, a wave's all-gather coalesced with
    # the next wave's first hop; the next forward reads the coalesced copy-out on the compute stream. ZeRO-3
    # only by default (six processes): dmuon's exchange is the same under ZeRO-2 (reshard_after_forward changes
    # FSDP2's gathers only), which [replicate-level-2x2] runs on the replicate level; ZeRO-2 under -m slow.
    ((3, 2), 6, "dmuon", (3,)), pytest.param((3, 2), 6, "dmuon", (2,), marks=pytest.mark.slow),
    pytest.param((2, 4), 8, "dmuon", BOTH_ZEROS, marks=pytest.mark.slow)],  # eight processes on two cores (-m slow)
    ids=["1-D", "one-rank", "1-D-4-ranks", "native-2x2", "replicate-level-2x2", "replicate-level-3x2",
         "replicate-level-3x2-zero2", "replicate-level-2x4"])
@pytest.mark.streams  # updates landing in the next forward: stream order
def test_next_forward_trains_as_in_step_and_as_one_process(mesh_shape, world_size, hsdp, zeros):
    """ZeRO-3 and ZeRO-2, a block unused at step 1: bit for bit ``"in_step"``, and within 1e-5 of
    torch.optim.Muon + AdamW in one process (fp32 NS)."""
    cases = [c for zero in zeros for c in _pairs(zero=zero, skip=SKIP, mesh_shape=mesh_shape, hsdp=hsdp)]
    results = run_distributed(run_cases, world_size, cases, timeout_s=300)
    ref, _ = _reference(world_size, torch.float32)
    for k in range(0, len(cases), 2):
        _assert_same(results, k, f"zero={cases[k].zero}")
        diff, worst = max_diff(results[0][k + 1]["params"], ref)
        assert diff <= 1e-5, worst


ZERO3_CLIPPED, ZERO2 = (3, 0.3), (2, None)


# ZeRO-2 on the 2x2 layouts under -m slow: dmuon's exchange is the same under ZeRO-2 (reshard_after_forward
# changes FSDP2's gathers only); by default [1-D-4-ranks] runs MuonH's ZeRO-2, and the ZeRO-2 of those layouts in
# "next_forward" runs in test_next_forward_trains_as_in_step_and_as_one_process[native-2x2, replicate-level-2x2].
@pytest.mark.parametrize("mesh_shape, hsdp, runs", [
    (None, "fsdp2", (ZERO3_CLIPPED, ZERO2)), ((2, 2), "fsdp2", (ZERO3_CLIPPED,)),
    pytest.param((2, 2), "fsdp2", (ZERO2,), marks=pytest.mark.slow), ((2, 2), "dmuon", (ZERO3_CLIPPED,)),
    pytest.param((2, 2), "dmuon", (ZERO2,), marks=pytest.mark.slow)],
    ids=["1-D-4-ranks", "native-2x2", "native-2x2-zero2", "replicate-level-2x2", "replicate-level-2x2-zero2"])
def test_muonh_next_forward_on_every_mesh(mesh_shape, hsdp, runs):
    """MuonH, whose projection needs sums over the updated weight from every shard: ``step()`` issues each
    return's totals behind it, so the next forward's applies issue no collective. ZeRO-3 with torch's
    clipping every step and ZeRO-2, a block unused at step 1, 4 ranks: bit for bit ``"in_step"``, every
    matrix on its sphere (``||W||_F = R``)."""
    cases = [c for zero, clip in runs
             for c in _pairs(rule="muonh", zero=zero, clip=clip, skip=SKIP, mesh_shape=mesh_shape, hsdp=hsdp)]
    results = run_distributed(run_cases, 4, cases, timeout_s=300)
    for k in range(0, len(cases), 2):
        _assert_same(results, k, f"zero={cases[k].zero}")
        params, radii = results[0][k + 1]["params"], results[0][k + 1]["rule_state"]
        assert radii, "no radius"
        for name, r in radii.items():
            assert abs(params[name].norm().item() - r.item()) <= 1e-5 * r.item(), name


EACH_SETTING_ALONE = {
    "bf16": dict(bf16=True, ns_dtype=torch.bfloat16),
    "frozen": dict(frozen=("layers.1.mid",)),
    "accumulation": dict(micro_batches=2),
    "clip": dict(clip=0.3),
    "checkpointing": dict(activation_checkpointing="full"),
    "compile": dict(compile=True),
    "normuon": dict(rule="normuon"),
    "dion2": dict(rule="dion2"),
    "muonh": dict(rule="muonh"),
    "muonh returns in backward": dict(rule="muonh", ns_in_backward=True, returns_in_backward=True),
}
SHARED_RUNS = {
    "bf16 frozen": EACH_SETTING_ALONE["bf16"] | EACH_SETTING_ALONE["frozen"],
    "accumulation checkpointing": EACH_SETTING_ALONE["accumulation"] | EACH_SETTING_ALONE["checkpointing"],
    "clip compile": EACH_SETTING_ALONE["clip"] | EACH_SETTING_ALONE["compile"],
    **{name: EACH_SETTING_ALONE[name] for name in ("normuon", "dion2", "muonh returns in backward")},
}
"""The settings of :data:`EACH_SETTING_ALONE` that act on different things share a run (mixed precision and a
frozen matrix, accumulation and activation checkpointing, clipping and compiled blocks); MuonH without the
returns in backward is test_muonh_next_forward_on_every_mesh's (4 ranks, clipping every step, ZeRO-2)."""


# Each setting alone under -m slow: [shared-runs] runs every one of them by default (MuonH alone
# test_muonh_next_forward_on_every_mesh), each bit for bit its "in_step" run.
@pytest.mark.parametrize("variants", [SHARED_RUNS, pytest.param(EACH_SETTING_ALONE, marks=pytest.mark.slow)],
                         ids=["shared-runs", "each-setting-alone"])
@pytest.mark.streams  # updates landing in the next forward: stream order
def test_next_forward_as_people_train(variants):
    """bf16 mixed precision, frozen matrices, accumulation, torch's clipping every step, activation
    checkpointing, ``torch.compile`` of each block (dmuon's hooks run eagerly, as FSDP2's), NorMuon, Dion2
    and MuonH (also with the returns issued in backward, whose totals follow them from ``step()``): each bit
    for bit its ``"in_step"`` run (2 ranks)."""
    cases = [c for kw in variants.values() for c in _pairs(skip=SKIP, **kw)]
    results = run_distributed(run_cases, 2, cases, timeout_s=400)
    for k, label in enumerate(variants):
        _assert_same(results, 2 * k, label)


TP_AND_EXPERTS = {"tp": "muon", "experts": "muon", "tp-muonh": "muonh", "experts-muonh": "muonh"}
"""Each run of :func:`_tp_and_experts` and its rule."""


def _tp_and_experts(rank: int, world_size: int) -> dict:
    """TP on a (dp 2, tp 2) mesh and a stack of experts under FSDP2, each run in both modes, with Muon and
    with MuonH (its sums over the weight: TP's pieces and each expert its own matrix)."""
    from support import experts, tp
    from support.scenarios import run_each

    def run(kind: str, mode: str) -> dict:
        rule = TP_AND_EXPERTS[kind]
        if kind.startswith("tp"):
            return tp.train(rank, world_size, 3, (2, 2), rule=None if rule == "muon" else rule,
                            execution=dmuon.ExecutionConfig(apply_updates=mode))["params"]
        return experts.train(rank, world_size, 3, apply_updates=mode, rule=rule)["params"]

    return run_each({(kind, mode): functools.partial(run, kind, mode) for kind in TP_AND_EXPERTS for mode in MODES})


@pytest.mark.streams  # updates landing in the next forward: stream order
def test_next_forward_with_tensor_parallelism_and_experts():
    """Tensor parallelism (dp 2 x tp 2) and a stack of experts (4 ranks), under Muon and MuonH: bit for bit
    ``"in_step"``."""
    results = run_distributed(_tp_and_experts, 4, timeout_s=400)
    for kind in TP_AND_EXPERTS:
        ins, nfwd = results[0][(kind, "in_step")], results[0][(kind, "next_forward")]
        assert isinstance(ins, dict) and isinstance(nfwd, dict), (ins, nfwd)
        _assert_same_params(ins, nfwd, kind)


def _qk_clip(rank: int, world_size: int) -> dict:
    from support import qk_clip
    from support.scenarios import run_each

    return run_each({mode: (lambda mode=mode: qk_clip.train(world_size, apply_updates=mode)) for mode in MODES})


@pytest.mark.streams  # updates landing in the next forward: stream order
def test_next_forward_with_qk_clip():
    """QK-clip (GQA, fused QKV and MLA layers; some heads clipped): each unit's query and key rows are
    scaled right after its update in the next forward, bit for bit as ``"in_step"`` scales them."""
    results = run_distributed(_qk_clip, 4, timeout_s=300)
    for r in results:
        ins, nfwd = r["in_step"], r["next_forward"]
        assert isinstance(ins, dict) and isinstance(nfwd, dict), (ins, nfwd)
        assert [sorted(a) for a in ins["agreed"]] == [sorted(a) for a in nfwd["agreed"]]
        for step, (a, b) in enumerate(zip(ins["agreed"], nfwd["agreed"])):
            assert all(torch.equal(a[k], b[k]) for k in a), step
    for name, value in results[0]["in_step"]["params"].items():
        assert torch.equal(value, results[0]["next_forward"]["params"][name]), name


def _reads(rank: int, world_size: int, checkpoint_dir: str) -> dict:
    """Two optimizers side by side, ``"in_step"`` and ``"next_forward"``; after each ``step()`` something
    reads the weights before any training forward, and must see what ``"in_step"`` holds."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    runs = {mode: sharded_oddnet(world_size, execution=dmuon.ExecutionConfig(apply_updates=mode)) for mode in MODES}

    def train(step: int) -> None:
        for model, _, opt in runs.values():
            lm_loss(model, odd_batch(step, rank)).backward()
            opt.step()

    def same(values: dict) -> bool:
        a, b = (values[m] for m in MODES)
        return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    def whole(state: dict) -> dict:
        return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
                for k, v in state.items() if isinstance(v, torch.Tensor)}

    seen = {}
    train(0)
    seen["model.state_dict"] = same({m: whole(r[0].state_dict()) for m, r in runs.items()})
    train(1)
    with torch.no_grad():  # an evaluation forward applies the updates as a training forward does
        seen["eval forward"] = same({m: {"out": r[0].eval()(odd_batch(5, rank)[0]).float()} for m, r in runs.items()})
    for model, _, _ in runs.values():
        model.train()
    train(2)
    for _, _, opt in runs.values():
        opt.zero_grad()
        opt.step()  # a second step() without a forward between: no gradients, the last updates applied first
    seen["second step()"] = same({m: full_params(r[0]) for m, r in runs.items()})
    train(3)
    seen["optimizer.state_dict"] = same({m: {str(k): v["momentum_buffer"].full_tensor()
                                             for k, v in r[2].state_dict()["state"].items() if "momentum_buffer" in v}
                                         for m, r in runs.items()})
    seen["params after optimizer.state_dict"] = same({m: full_params(r[0]) for m, r in runs.items()})
    train(4)
    states = {m: get_state_dict(r[0], r[2]) for m, r in runs.items()}
    seen["get_state_dict"] = same({m: whole(s[0]) for m, s in states.items()})
    for mode, (model_state, optim_state) in states.items():
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=f"{checkpoint_dir}/{mode}")
    dist.barrier()
    return seen


def _resumed(rank: int, world_size: int, checkpoint_dir: str) -> dict:
    """Both checkpoints loaded on another world size (``"in_step"``), then one more step each: the same."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    out = {}
    for mode in MODES:
        model, _, opt = sharded_oddnet(world_size)
        model_state, optim_state = get_state_dict(model, opt)
        dcp.load({"model": model_state, "optim": optim_state}, checkpoint_id=f"{checkpoint_dir}/{mode}")
        set_state_dict(model, opt, model_state_dict=model_state, optim_state_dict=optim_state)
        lm_loss(model, odd_batch(9, rank)).backward()
        opt.step()
        out[mode] = full_params(model)
    return out if rank == 0 else {}


@pytest.mark.streams  # updates landing in the next forward: stream order
def test_reads_between_step_and_the_next_forward_see_every_update(tmp_path):
    results = run_distributed(_reads, 2, str(tmp_path / "ckpt"), timeout_s=300)
    for seen in results:
        assert all(seen.values()), {k: v for k, v in seen.items() if not v}
    resumed = run_distributed(_resumed, 4, str(tmp_path / "ckpt"), timeout_s=300)[0]
    for name, value in resumed["in_step"].items():
        assert torch.equal(value, resumed["next_forward"][name]), f"resumed on 4 ranks: {name} differs"


def _read_on_one_rank(rank: int, world_size: int) -> dict:
    """Muon and MuonH, both modes: after each ``step()`` rank 0 alone reads the optimizer's state dict, a
    flush on one rank. The next forward must issue the same all-gathers on every rank all the same, and
    MuonH's totals must already be in (no collective left to issue)."""
    out = {}
    for rule in ("muon", "muonh"):
        for mode in MODES:
            model, _, opt = sharded_oddnet(world_size, rule=rule, execution=dmuon.ExecutionConfig(apply_updates=mode))
            read = []

            def read_on_rank_0() -> None:
                if rank == 0:
                    read.append({f"{k}.{name}": v.to_local().clone()
                                 for k, state in opt.state_dict()["state"].items()
                                 for name, v in state.items() if isinstance(v, DTensor)})

            out[rule, mode] = {"params": _trained(model, opt, rank, after_step=read_on_rank_0), "read": read}
    return out


@pytest.mark.streams  # updates landing in the next forward: stream order
def test_a_read_on_one_rank_between_step_and_the_next_forward():
    """A flush on one rank only (its optimizer state dict, under Muon and MuonH): no hang, what it reads is
    ``"in_step"``'s, and both ranks go on bit for bit as ``"in_step"``."""
    results = run_distributed(_read_on_one_rank, 2, timeout_s=300)
    for rule in ("muon", "muonh"):
        ins, nfwd = results[0][rule, "in_step"], results[0][rule, "next_forward"]
        _assert_same_params(ins["params"], nfwd["params"], rule)
        assert len(ins["read"]) == STEPS and all(ins["read"]), rule
        for a, b in zip(ins["read"], nfwd["read"]):
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), rule


COUNTED_MESHES = {"1-D": (None, "fsdp2"), "native-2x2": ((2, 2), "fsdp2"), "replicate-level-2x2": ((2, 2), "dmuon")}
"""The layouts of :func:`test_next_forward_counted_collectives_equal_the_model`: ``(mesh_shape, hsdp)``."""


def _every_counted_step(rank: int, world_size: int) -> dict:
    """:func:`counted_step` in ``"next_forward"`` on each layout under each rule, in one process group (a launch
    costs more than the run); a run that raised fails only its own test (:func:`support.scenarios.run_each`)."""
    from support.scenarios import run_each

    return run_each({(layout, rule): functools.partial(counted_step, rank, world_size, mesh_shape, torch.bfloat16, 3,
                                                        2, None, hsdp, rule, 8, None, False, 3, "next_forward")
                     for layout, (mesh_shape, hsdp) in COUNTED_MESHES.items() for rule in ("muon", "muonh")})


@functools.cache
def _counted_steps() -> list[dict]:
    return run_distributed(_every_counted_step, 4, timeout_s=300)


@pytest.mark.parametrize("rule", ["muon", "muonh"])
@pytest.mark.parametrize("layout", COUNTED_MESHES)
def test_next_forward_counted_collectives_equal_the_model(layout, rule):
    """One return per unit in plan order, every hop issued in ``step()``: per rank the model's collectives
    for those waves (in issue order; on the replicate level, whose reductions interleave, as a multiset);
    MuonH's weight-norm all-gather of each wave right behind the wave's last hop, as the step model places
    it (``step_collectives(weight_norms=True, apply_updates="next_forward")``)."""
    mesh_shape, hsdp = COUNTED_MESHES[layout]
    results = [succeeded(r[layout, rule]) for r in _counted_steps()]
    infos = results[0]["infos"]
    shapes, owners, blocks = [i[0] for i in infos], [i[1] for i in infos], [i[2] for i in infos]
    waves = results[0]["waves"]
    assert all(r["waves"] == waves for r in results)
    assert waves == [[i for i, b in enumerate(blocks) if b == block] for block in sorted(set(blocks))]
    replicate, shard = mesh_shape or (1, 4)
    replicate_level = hsdp == "dmuon"
    backward, step = owner_exchange_collectives(shapes, owners, blocks, replicate, shard, 2, waves=waves,
                                                gradient_bytes=4 if replicate_level else None)
    if rule == "muonh":
        step = with_weight_norms_per_wave(step, waves, replicate, shard)
        assert [c.label for c in step if c.role == "weight_norms"] == [f"dmuon weight norms wave {w}"
                                                                        for w in range(len(waves))]
        modelled = step_collectives("dmuon" if replicate_level or replicate == 1 else "dmuon_native_hsdp", shapes,
                                    owners, blocks, replicate, shard, waves=waves, weight_norms=True,
                                    apply_updates="next_forward")
        assert [c.label for c in modelled if c.phase == "step"] == [c.label for c in step]
    check_counted_log(backward + step, results, replicate, replicate_level=replicate_level)


def _grouped(rank: int, world_size: int) -> dict:
    """OddNet with its first two blocks in one ``fully_shard([a, b])`` (one unshard gathers both), both modes."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    out = {}
    for mode in MODES:
        mesh = init_device_mesh("cpu", (world_size,))
        torch.manual_seed(0)
        model = OddNet()
        fully_shard([model.layers[0], model.layers[1]], mesh=mesh)
        fully_shard(model.layers[2], mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = dmuon.DMuon(model, dmuon.prepare(model, ns=dmuon.NSConfig(method="standard", dtype=torch.float32)),
                          lr=0.02, adamw=dmuon.AdamWConfig(lr=3e-3),
                          execution=dmuon.ExecutionConfig(apply_updates=mode))
        out[mode] = _trained(model, opt, rank)
    return out


@pytest.mark.streams  # updates landing in the next forward: stream order
def test_units_sharded_together_are_applied_together():
    """``fully_shard([a, b])``: one unshard gathers both, so both units' updates are applied before it; bit
    for bit ``"in_step"``, a block unused at step 1 included."""
    results = run_distributed(_grouped, 2, timeout_s=300)
    _assert_same_params(results[0]["in_step"], results[0]["next_forward"], "grouped")


def _whole_model_compiled(rank: int, world_size: int) -> dict:
    """OddNet with the whole model compiled (``model.compile``, ``aot_eager``) after ``fully_shard``, both modes:
    dmuon's hooks sit inside the compiled module's call and run eagerly (``torch.compiler.disable``)."""
    out = {}
    for mode in MODES:
        model, _, opt = sharded_oddnet(world_size, execution=dmuon.ExecutionConfig(apply_updates=mode))
        model.compile(backend="aot_eager")
        out[mode] = _trained(model, opt, rank, skip={})
    return out


@pytest.mark.streams  # updates landing in the next forward: stream order
def test_next_forward_with_the_whole_model_compiled():
    results = run_distributed(_whole_model_compiled, 2, timeout_s=300)
    _assert_same_params(results[0]["in_step"], results[0]["next_forward"], "whole model compiled")


def _forward_prefetch(rank: int, world_size: int) -> str:
    """FSDP2's explicit forward prefetch gathers the next unit in this unit's pre-forward, before dmuon's ahead
    hook could apply its updates: refused on every rank, naming the fix."""
    model, _, opt = sharded_oddnet(world_size, execution=dmuon.ExecutionConfig(apply_updates="next_forward"))
    layers = list(model.layers)
    for layer, following in zip(layers, layers[1:]):
        layer.set_modules_to_forward_prefetch([following])
    lm_loss(model, odd_batch(0, rank)).backward()
    opt.step()
    try:
        lm_loss(model, odd_batch(1, rank))
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_a_forward_prefetch_is_refused_on_every_rank():
    messages = run_distributed(_forward_prefetch, 2, timeout_s=120)
    assert all("set_modules_to_forward_prefetch" in m and "apply_updates='in_step'" in m for m in messages), messages


def test_bad_input_names_the_fix():
    model = OddNet()
    nfwd = dmuon.ExecutionConfig(apply_updates="next_forward")
    with pytest.raises(ValueError, match="post_optim_event"):
        dmuon.ExecutionConfig(apply_updates="next_forward", post_optim_event=True)
    with pytest.raises(ValueError, match="apply_updates must be one of"):
        dmuon.ExecutionConfig(apply_updates="later")
    dmuon.MuonH(model, execution=nfwd)  # its sums over the weight follow each return from step()
