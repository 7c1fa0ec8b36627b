"""torch's ``DistributedDataParallel`` as people write it, stepped by dmuon (:mod:`dmuon.runtime.ddp`).

DDP keeps reducing every gradient; dmuon gives each Muon matrix one owner among DDP's ranks, which alone keeps
its momentum and runs its NS, and all-gathers the updates. Checked on 2 and 4 gloo ranks (4 by default: one
training run, the bytes, DDP over subgroups and pipeline stages; every case with -m slow), every rank under the
stream checker, against one process with torch.optim.Muon + AdamW on the global batch (fp32 NS):
``DMuon(ddp)``, ``DMuon(ddp.module)``, ``DMuon(ddp.parameters(), module=ddp)``, an optimizer built before
``DDP(...)``; ``find_unused_parameters`` (a block unused at step 1), ``static_graph``, ``no_sync()``
accumulation, torch's ``clip_grad_norm_``, bf16 autocast (against torch's pair on the same DDP gradients),
the other rules, per-rank ``state_dict`` resume and DCP; bytes counted per rank equal to the step model.
"""

from __future__ import annotations

import functools
import gc
import io

import pytest
import torch
import torch.distributed as dist

import dmuon
from dmuon.costmodel.traffic import ddp_collectives, scatter_parts
from support.cases import MUON_KW, NORMUON_BETA2
from support.equivalence import N_MATRICES, SKIP, STEPS, all_ranks_batches, max_diff, reference
from support.models import OddNet, lm_loss, odd_batch
from support.reference import reference_training
from support.scenarios import LaunchesByWorld, run_each
from support.spawn import run_distributed

# Its point is stream order (dmuon's exchange beside DDP's own reduction): every rank, its shared runs' included, runs under the
# stream checker.
pytestmark = pytest.mark.streams

CLIP = 0.3  # below every step's gradient norm here: the clip acts on every step
ADAMW_KW = dict(lr=3e-3, weight_decay=0.01)
FP32 = dmuon.NSConfig(method="standard", dtype=torch.float32)


def _ddp(**kwargs):
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    return DDP(OddNet(), **kwargs)


def _dmuon(target, **kwargs):
    return dmuon.DMuon(target, adamw=dmuon.AdamWConfig(**ADAMW_KW), ns=FP32, **{**MUON_KW, **kwargs})


def _trained(ddp, opt, rank: int, steps=range(STEPS), micro: int = 1, clip: float | None = None,
             autocast: bool = False, skip: dict = SKIP) -> dict:
    """Trains with the standard batches (``micro`` micro-batches per step under ``no_sync()``; ``skip``'s
    blocks left out); returns the parameters, the stats and each Muon parameter's momentum (or None)."""
    stats, norms = [], []
    for step in steps:
        ddp.module.skip = skip.get(step, set())
        for k in range(micro):
            batch = odd_batch(step, rank * micro + k)
            with (ddp.no_sync() if k < micro - 1 else torch.enable_grad()):
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                    loss = lm_loss(ddp, batch)
                (loss / micro).backward()
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(ddp.parameters(), clip).item())
        opt.step()
        opt.zero_grad()
        stats.append(opt.last_step_stats())
    ddp.module.skip = set()
    state = opt.state
    return {"params": {n: p.detach().clone() for n, p in ddp.module.named_parameters()},
            "stats": stats, "norms": norms,
            "momentum": {n: (state[p]["momentum_buffer"].clone() if "momentum_buffer" in state[p] else None)
                         for n, p in ddp.module.named_parameters()},
            "owners": {info.name: info.owner for info in opt.plan.infos}}


def _built_before_ddp(rank: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = OddNet()
    opt = _dmuon(model)
    assert not opt.is_set_up  # set up at the first forward, under DDP
    ddp = DDP(model, find_unused_parameters=True)
    return _trained(ddp, opt, rank)


def _torch_pair_on_ddp(rank: int, autocast: bool) -> dict:
    """torch.optim.Muon + AdamW on DDP's gradients (every rank runs every NS): the same DDP run's reference."""
    ddp = _ddp(find_unused_parameters=True)
    batches = [odd_batch(step, rank) for step in range(STEPS)]

    def loss_fn(m, batch, _step=[0]):
        ddp.module.skip = SKIP.get(_step[0], set())
        _step[0] += 1
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return lm_loss(m, batch)

    params, _ = reference_training(ddp, batches, loss_fn, muon_kwargs=MUON_KW, adamw_kwargs=ADAMW_KW,
                                   ns_dtype=torch.float32)
    return {n.removeprefix("module."): p for n, p in params.items()}


RULE_STATE = {"normuon": "second_momentum_buffer", "muonh": "initial_norm", "dion2": "momentum_buffer"}


def _rule(rank: int, rule: str) -> dict:
    """The other rules with the settings their formulas use (``support.more_rules``, ``support.normuon``)."""
    from support.more_rules import rule_kwargs

    ddp = _ddp(find_unused_parameters=True)
    adamw = dmuon.AdamWConfig(**ADAMW_KW)
    if rule == "normuon":
        opt = dmuon.NorMuon(ddp, adamw=adamw, ns=FP32, beta2=NORMUON_BETA2, **MUON_KW)
    else:
        opt = {"muonh": dmuon.MuonH, "dion2": dmuon.Dion2}[rule](ddp, adamw=adamw, ns=FP32, **rule_kwargs(rule))
    out = _trained(ddp, opt, rank)
    key = RULE_STATE[rule]
    out["rule_state"] = {n: opt.state[p][key].reshape(-1).clone() for n, p in ddp.module.named_parameters()
                         if key in opt.state[p]}
    return out


def _resumed(rank: int) -> dict:
    """Two steps, the optimizer's and the model's state dicts through torch.save, a fresh DDP + DMuon that
    loads them and trains the third step; beside three steps straight."""
    straight = _trained(*_pair(), rank)
    ddp, opt = _pair()
    _trained(ddp, opt, rank, steps=range(2))
    saved = io.BytesIO()
    torch.save({"model": ddp.module.state_dict(), "optim": opt.state_dict()}, saved)
    saved.seek(0)
    state = torch.load(saved, weights_only=True)
    ddp, opt = _pair()
    ddp.module.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])
    resumed = _trained(ddp, opt, rank, steps=range(2, STEPS))
    return {"straight": straight["params"], "resumed": resumed["params"]}


def _pair(**kwargs):
    ddp = _ddp(find_unused_parameters=True, **kwargs)
    return ddp, _dmuon(ddp)


def _counted(rank: int, world: int, waves: int | None = None) -> dict:
    """One step's dmuon collectives on this rank (bf16 wire, the default), beside the plan's model of them."""
    ddp = _ddp()
    opt = dmuon.DMuon(ddp, lr=0.02, ns=dmuon.NSConfig(method="standard"),
                      execution=dmuon.ExecutionConfig(return_waves=waves))
    lm_loss(ddp, odd_batch(0, rank)).backward()
    opt.step()
    stats = opt.last_step_stats()
    wire = torch.finfo(opt.plan.ns.dtype).bits // 8
    return {"log": list(opt.runtime.stats.last_log), "waves": stats["return_waves"],
            "model": ddp_collectives([i.shape for i in opt.plan.infos], [i.owner for i in opt.plan.infos],
                                         world, stats["return_waves"], wire, opt.plan.rank),
            "ddp_bytes": 2 * (world - 1) * sum(p.numel() * 4 for p in ddp.parameters()) // world,
            "shapes": [info.shape for info in opt.plan.infos], "owners": [info.owner for info in opt.plan.infos]}


# The 4-rank runs of the default suite: one training run, the bytes (only there owners are uneven enough for
# the scatter's two hops), two DDP groups side by side and two pipeline stages. Every other run on 4 ranks is -m slow: its 2-rank case runs the same code by
# default (see SLOW_ON_FOUR).
FOUR_RANKS_BY_DEFAULT = ("wrapper", "bytes", "bytes_waves", "subgroups", "stages")


def _on_ranks(rank: int, world: int, part: str = "all") -> dict:
    """The runs on ``world`` ranks: ``part`` "all", or on 4 ranks "default" (FOUR_RANKS_BY_DEFAULT) or "rest"."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    scenarios = {
        "wrapper": lambda: _trained(*_pair(), rank),
        "module": lambda: (lambda d: _trained(d, _dmuon(d.module), rank))(_ddp(find_unused_parameters=True)),
        "parameters": lambda: (lambda d: _trained(d, _dmuon(d.parameters(), module=d), rank))(
            _ddp(find_unused_parameters=True)),
        "built_before": lambda: _built_before_ddp(rank),
        "static_graph": lambda: (lambda d: _trained(d, _dmuon(d), rank, skip={}))(_ddp(static_graph=True)),
        "no_sync": lambda: _trained(*_pair(), rank, micro=2),
        "clip": lambda: _trained(*_pair(), rank, clip=CLIP),
        "autocast": lambda: _trained(*_pair(), rank, autocast=True),
        "autocast_torch": lambda: _torch_pair_on_ddp(rank, autocast=True),
        # Three return waves (the accelerator default is several): each wave's second hop behind the next's NS.
        "waves": lambda: (lambda d: _trained(d, _dmuon(d, execution=dmuon.ExecutionConfig(return_waves=3)), rank))(
            _ddp(find_unused_parameters=True)),
        "bytes_waves": lambda: _counted(rank, world, waves=3),
        "resume": lambda: _resumed(rank),
        # torch.compile(DDP(model)) given to DMuon (dynamo's eager backend: the wrapping, not the kernels).
        "compiled": lambda: (lambda c: _trained(c, _dmuon(c), rank))(
            torch.compile(_ddp(find_unused_parameters=True), backend="eager")),
        "bytes": lambda: _counted(rank, world),
    }
    if world == 2:
        scenarios |= {rule: functools.partial(_rule, rank, rule) for rule in ("normuon", "muonh", "dion2")}
    else:
        scenarios |= {"subgroups": lambda: _subgroups(rank, world), "stages": lambda: _stages(rank, world)}
    assert DDP
    return run_each(_run.keep(part, scenarios))


_run = LaunchesByWorld(_on_ranks, 4, FOUR_RANKS_BY_DEFAULT)


SLOW_ON_FOUR = pytest.mark.slow
"""A 4-rank case under -m slow: the same test's 2-rank case runs the same run by default, and 4 ranks train
by default in test_ddp_trains_as_one_process_ns_once_momentum_on_its_owner[wrapper-4] and count bytes in
test_bytes_are_the_models_and_the_route_the_cheaper[4]."""


def _worlds(default_on_four: bool = False) -> list:
    return [2, 4 if default_on_four else pytest.param(4, marks=SLOW_ON_FOUR)]


def _check_owners_only(results: list[dict]) -> None:
    """Each Muon matrix's momentum lives on its owner, whole, and nowhere else."""
    owners = results[0]["owners"]
    for name, owner in owners.items():
        held = [r for r, res in enumerate(results) if res["momentum"][name] is not None]
        assert held == [owner], (name, held, owner)


@pytest.mark.parametrize("how,world", [
    pytest.param(how, world, marks=SLOW_ON_FOUR if world == 4 and how != "wrapper" else ())
    for how in ["wrapper", "module", "parameters", "built_before", "compiled", "waves"] for world in (2, 4)])
def test_ddp_trains_as_one_process_ns_once_momentum_on_its_owner(world, how):
    """``DDP(model, find_unused_parameters=True)`` with a block unused at step 1: one process's result on the
    global batch (fp32 NS), each matrix orthogonalized once across the ranks, its momentum on its owner only."""
    results = _run(world, how)
    diff, worst = max_diff(results[0]["params"], reference(world, torch.float32)[0])
    assert diff <= 1e-5, f"{worst} differs by {diff:.3g}"
    for r in results[1:]:
        assert max_diff(r["params"], results[0]["params"])[0] == 0  # the ranks' weights stay bit-equal
    for step in range(STEPS):
        done = sum(r["stats"][step]["orthogonalized"] for r in results)
        assert done == N_MATRICES - 3 * len(SKIP.get(step, ())), step
    _check_owners_only(results)


def _reference_on(world: int, micro: int = 1, clip: float | None = None, skip: dict = SKIP):
    torch.manual_seed(0)
    model = OddNet()
    batches = []
    for step in range(STEPS):
        parts = [odd_batch(step, r) for r in range(world * micro)]
        batches.append((torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])))

    def loss_fn(m, batch, _step=[0]):
        m.skip = skip.get(_step[0], set())
        _step[0] += 1
        return lm_loss(m, batch)

    return reference_training(model, batches, loss_fn, muon_kwargs=MUON_KW, adamw_kwargs=ADAMW_KW,
                              ns_dtype=torch.float32, clip=clip)[0]


@pytest.mark.parametrize("world", _worlds())
@pytest.mark.parametrize("case", ["static_graph", "no_sync", "clip"])
def test_ddps_own_features_train_as_one_process(world, case):
    """``static_graph=True``, ``no_sync()`` accumulation over two micro-batches, torch's ``clip_grad_norm_`` on
    DDP's parameters every step: one process's result on the global batch; the clip's norm is the
    single-process one on every rank."""
    results = _run(world, case)
    ref = _reference_on(world, micro=2 if case == "no_sync" else 1, clip=CLIP if case == "clip" else None,
                        skip={} if case == "static_graph" else SKIP)
    diff, worst = max_diff(results[0]["params"], ref)
    assert diff <= 1e-5, f"{worst} differs by {diff:.3g}"
    if case == "clip":
        for r in results:
            assert r["norms"] == pytest.approx(list(reference_training.norms), rel=1e-5)


@pytest.mark.parametrize("world", _worlds())
def test_bf16_autocast_equals_torchs_pair_on_the_same_ddp_gradients(world):
    """bf16 autocast: DDP's gradients are the same bits under either optimizer, so DMuon equals torch's
    Muon + AdamW run on every rank of the same DDP setup (fp32 NS) after three steps."""
    ours, torchs = _run(world, "autocast"), _run(world, "autocast_torch")
    diff, worst = max_diff(ours[0]["params"], torchs[0])
    assert diff <= 1e-5, f"{worst} differs by {diff:.3g}"


@pytest.mark.parametrize("rule", ["normuon", "muonh", "dion2"])
def test_the_other_rules_under_ddp_equal_their_formulas(rule):
    """NorMuon, MuonH and Dion2 under DDP: one process's formula (fp32 NS), parameters and the rule's state;
    the momentum on the owner only (NorMuon's second moment too)."""
    from support import more_rules, normuon

    results = _run(2, rule)
    ref, _, state = normuon.oddnet_reference(2) if rule == "normuon" else more_rules.oddnet_reference(rule, 2)
    diff, worst = max_diff(results[0]["params"], ref)
    assert diff <= 1e-5, f"{worst} differs by {diff:.3g}"
    _check_owners_only(results)
    held = {}
    for r in results:
        for name, value in r["rule_state"].items():
            held.setdefault(name, value)
    diff, worst = max_diff({n: held[n] for n in state}, state)
    assert diff <= 1e-5, f"state of {worst} differs by {diff:.3g}"
    if rule == "normuon":  # the second moment lives with the momentum, on the owner only
        owners = results[0]["owners"]
        for name in state:
            assert [k for k, r in enumerate(results) if name in r["rule_state"]] == [owners[name]], name


@pytest.mark.parametrize("world", _worlds())
def test_per_rank_state_dicts_resume_bit_for_bit(world):
    """Each rank's ``opt.state_dict()`` (its owned momenta and AdamW's state) through torch.save and
    ``torch.load(weights_only=True)``: the resumed run equals the straight one, bit for bit."""
    for r in _run(world, "resume"):
        assert max_diff(r["resumed"], r["straight"])[0] == 0


@pytest.mark.parametrize("world", [2, 4])
def test_bytes_are_the_models_and_the_route_the_cheaper(world):
    """One step's collectives on every rank equal :func:`ddp_collectives` (per wave, a padded all-gather or the
    scatter's all-to-all and even all-gather, whichever moves less through the busiest rank; DDP's all-reduce
    comes on top: README "DDP")."""
    for r in _run(world, "bytes_waves"):  # three waves, each by its own route
        assert len(r["waves"]) == 3
        assert len(r["log"]) > 3 or world == 2  # on 4 ranks a wave takes the scatter's two hops
        assert [("intra", s, g) for s, g in r["model"]] == [tuple(e) for e in r["log"]]
    results = _run(world, "bytes")
    for r in results:
        assert [("intra", s, g) for s, g in r["model"]] == [tuple(e) for e in r["log"]]
    # Every update reaches every rank: the route moves no more through the busiest rank than the other one.
    shares = [0] * world
    for shape, owner in zip(results[0]["shapes"], results[0]["owners"]):
        shares[owner] += torch.Size(shape).numel()
    padded = (world - 1) * max(shares) * 2
    parts, chunk = scatter_parts(shares)
    scattered = max(max(sum(parts[k]) - parts[k][k], sum(p[k] for p in parts) - parts[k][k]) * 2
                    + (world - 1) * chunk * 2 for k in range(world))
    busiest = max(max(sum(e[1] for e in r["log"]), sum(e[2] for e in r["log"])) for r in results)
    assert busiest == min(padded, scattered)
    # OddNet's owners: even enough on 2 ranks for the all-gather, not on 4 (the scatter's two hops).
    assert len(results[0]["log"]) == (1 if world == 2 else 2)


def _misuse(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    def raised(build):
        try:
            build()
        except ValueError as err:
            return str(err)
        return None

    def mixed_inside():
        torch.manual_seed(0)
        model = OddNet()
        mesh = init_device_mesh("cpu", (world,))
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        model.gate = DDP(model.gate)
        dmuon.DMuon(model, lr=0.02)

    def next_forward():
        dmuon.DMuon(_ddp(), lr=0.02, execution=dmuon.ExecutionConfig(apply_updates="next_forward"))

    def hsdp_mesh():
        dmuon.DMuon(_ddp(), lr=0.02, hsdp_mesh=init_device_mesh("cpu", (world, 1), mesh_dim_names=("r", "s")))

    return {"DDP inside the model": raised(mixed_inside), "next_forward": raised(next_forward),
            "hsdp_mesh": raised(hsdp_mesh)}


@functools.cache
def _misuses() -> list[dict]:
    return run_distributed(_misuse, 2, timeout_s=300)


@pytest.mark.parametrize("case,says", [
    ("DDP inside the model", "submodule 'gate' is a torch DistributedDataParallel inside the model"),
    ("next_forward", "apply_updates=\"next_forward\") does not apply to a DistributedDataParallel model"),
    ("hsdp_mesh", "drop hsdp_mesh"),
])
def test_ddp_misuse_gets_the_same_error_on_every_rank(case, says):
    """What dmuon cannot step under DDP: the same error on every rank at construction, naming what to change."""
    errors = [r[case] for r in _misuses()]
    assert errors[0] is not None and all(e == errors[0] for e in errors), errors
    assert says in errors[0], errors[0]


def _subgroups(rank: int, world: int) -> dict:
    """Two DDP groups of two ranks each (as pipeline stages or two models side by side), each its own."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = groups[rank // 2]
    torch.manual_seed(0)
    ddp = DDP(OddNet(), process_group=mine, find_unused_parameters=True)
    opt = _dmuon(ddp)
    out = _trained(ddp, opt, rank % 2)
    out["plan_world"] = opt.plan.world_size
    return out


def test_ddp_over_a_subgroup_steps_that_group():
    """DDP over a process group of part of the world (a pipeline stage's data-parallel ranks): dmuon's plan,
    groups and collectives are that group's; each group trains as one process on its own batches."""
    results = _run(4, "subgroups")
    ref = reference(2, torch.float32)[0]
    for r in results:
        assert r["plan_world"] == 2
        diff, worst = max_diff(r["params"], ref)
        assert diff <= 1e-5, f"{worst} differs by {diff:.3g}"
    _check_owners_only(results[:2])
    _check_owners_only(results[2:])


def _stages(rank: int, world: int) -> dict:
    """Two pipeline stages, each a DDP over its two ranks (a (pp=2, dp=2) mesh), ``pp_group`` across them; a NaN
    in stage 0's gradients at step 1: with ``nonfinite="raise"`` every rank raises (none waits for the
    others), with ``"skip"`` every rank skips that step."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel as DDP

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    stage = rank // 2
    out = {}
    for nonfinite in ("raise", "skip"):
        torch.manual_seed(0)
        ddp = DDP(OddNet(), process_group=mesh["dp"].get_group())
        opt = _dmuon(ddp, pp_group=mesh["pp"], execution=dmuon.ExecutionConfig(nonfinite=nonfinite))
        before = {n: p.detach().clone() for n, p in ddp.module.named_parameters()}
        lm_loss(ddp, odd_batch(0, rank % 2)).backward()
        if stage == 0:
            ddp.module.layers[0].mid.weight.grad[0, 0] = float("nan")
        try:
            opt.step()
            out[nonfinite] = max_diff({n: p.detach() for n, p in ddp.module.named_parameters()}, before)[0]
        except FloatingPointError as err:
            out[nonfinite] = str(err)
        del ddp, opt  # one DMuon per rank on a pp group: the next run's takes it over
        gc.collect()
        dist.barrier()
    return out


def test_a_nan_on_one_stage_raises_or_skips_on_every_stage_under_ddp():
    """DDP per pipeline stage with ``pp_group``: the stages agree on a NaN before any of them decides (a stage
    whose own NaN raised first would leave the others waiting in the stages' all-reduce)."""
    results = _run(4, "stages")
    for rank, r in enumerate(results):
        expected = "non-finite gradients in" if rank < 2 else "non-finite gradients on another pipeline stage"
        assert isinstance(r["raise"], str) and expected in r["raise"], (rank, r["raise"])
        assert r["skip"] == 0, (rank, r["skip"])  # skipped: the weights as they were


def _eight(rank: int, world: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    ddp = DDP(OddNet(blocks=1))
    opt = _dmuon(ddp)
    out = _trained(ddp, opt, rank, skip={})
    return out


@pytest.mark.slow  # eight processes on two cores
def test_ddp_on_eight_ranks_more_ranks_than_matrices():
    """Eight ranks, six matrices (two ranks own none): one process's result, NS once per matrix."""
    results = run_distributed(_eight, 8, timeout_s=600)
    torch.manual_seed(0)
    model = OddNet(blocks=1)
    batches, _ = all_ranks_batches(8)
    ref, _ = reference_training(model, batches, lm_loss, muon_kwargs=MUON_KW, adamw_kwargs=ADAMW_KW,
                                ns_dtype=torch.float32)
    diff, worst = max_diff(results[0]["params"], ref)
    assert diff <= 1e-5, f"{worst} differs by {diff:.3g}"
    assert sum(r["stats"][0]["orthogonalized"] for r in results) == 6
    assert sum(1 for r in results if r["stats"][0]["orthogonalized"] == 0) >= 2
    _check_owners_only(results)
