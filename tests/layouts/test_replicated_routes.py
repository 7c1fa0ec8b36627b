"""Data parallelism without sharding: the routes a model that fits one device takes with dmuon.

* "DDP with dmuon": FSDP2 (``fully_shard``, or torch's FSDP2-based ``replicate``) over the one-rank ``shard``
  dim of an ``(N, 1)`` mesh, ``hsdp_mesh=mesh`` (dmuon's replicate level reduces every gradient itself: the
  Muon matrices' by the momentum's column slices, reduce-scattered to where each slice's momentum lives);
  with TP, the other rules, accumulation, torch's clipping, DCP checkpoints across the routes.
* torch's ``replicate`` (``replicate_with_fsdp``) per block and root over every rank, and FSDP2's native
  HSDP on the ``(N, 1)`` mesh: FSDP2 all-reduces every gradient; dmuon reads the mesh as N replicas of one
  rank each.
* torch's ``DistributedDataParallel`` itself: ``tests/layouts/test_torch_ddp.py``; here its checkpoints resume on the
  other routes and theirs under it.
* ``dmuon plan --ddp`` (the route's bytes against DDP's, the simulated step) and ``dmuon bench --ddp``.

Bytes are counted per rank on gloo (dmuon's own collectives, plus FSDP2's all-reduce where FSDP2 issues
it) against DDP's all-reduce of every gradient (a ring's ``2 (N-1)/N`` of the fp32 gradients) and against
the step model; training against one process with torch.optim.Muon + AdamW (fp32 NS).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

import dmuon
from dmuon.costmodel.traffic import owner_exchange_collectives, step_collectives
from support import tp
from support.cases import Case, full_params, run_case
from support.equivalence import N_MATRICES, SKIP, STEPS, max_diff, reference
from support.models import OddNet, lm_loss, odd_batch
from support.scenarios import LaunchesByWorld, run_each, succeeded
from support.spawn import run_distributed
from support.step_comm import counted_step

RULES = ("normuon", "muonh", "dion2")
EVEN = 0.15
CLIP = 0.3  # below every step's gradient norm here: the clip acts on every step
SAVED_AT, MORE = 2, 2  # the checkpoint runs' steps before and after the save  # every rank's bytes within this fraction of the ranks' mean


def _ddp_bytes(world: int, blocks: int = 3) -> int:
    """What torch's DDP sends (and receives) per rank per step on OddNet: a ring all-reduce of every fp32
    gradient, ``2 (N-1)/N`` of them (the bus bytes of its buckets, whatever their split)."""
    total = sum(p.numel() * 4 for p in OddNet(blocks=blocks).parameters())
    return 2 * (world - 1) * total // world


def _replicated_oddnet(world: int, ns_dtype: torch.dtype, level: bool = False):
    """OddNet (seed 0) under torch's FSDP2-based ``replicate`` per block and root, with DMuon: over a 1-D mesh of
    every rank, or (``level``) over the one-rank shard dim of an ``(N, 1)`` mesh with ``hsdp_mesh=mesh``."""
    from torch.distributed._composable.replicate_with_fsdp import replicate
    from torch.distributed.device_mesh import init_device_mesh

    if level:
        mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
        over, hsdp_mesh = mesh["shard"], mesh
    else:
        over, hsdp_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("replicate",)), None
    torch.manual_seed(0)
    model = OddNet()
    for layer in model.layers:
        replicate(layer, mesh=over)
    replicate(model, mesh=over)
    opt = dmuon.DMuon(model, lr=0.02, adamw=dmuon.AdamWConfig(lr=3e-3), hsdp_mesh=hsdp_mesh,
                      ns=dmuon.NSConfig(method="standard", dtype=ns_dtype))
    return model, opt


def _replicate_trained(rank: int, world: int, level: bool = False) -> dict:
    """``replicate`` + DMuon, fp32 NS, the standard equivalence run (block 1 unused at step 1)."""
    model, opt = _replicated_oddnet(world, torch.float32, level)
    orthogonalized = []
    for step in range(STEPS):
        model.skip = SKIP.get(step, set())
        lm_loss(model, odd_batch(step, rank)).backward()
        opt.step()
        opt.zero_grad()
        orthogonalized.append(opt.last_step_stats()["orthogonalized"])
    momentum = {n: opt.state[p]["momentum_buffer"].to_local().numel() for n, p in model.named_parameters()
                if "momentum_buffer" in opt.state.get(p, {})}
    return {"params": full_params(model), "orthogonalized": orthogonalized, "momentum_numel": momentum,
            "shapes": {i.name: tuple(i.shape) for i in opt.plan.infos},
            "topology": (opt.runtime.topo.replicate, opt.runtime.topo.shard)}


def _replicate_counted(rank: int, world: int, level: bool = False) -> dict:
    """``replicate`` + DMuon with the default (bf16) wire: dmuon's counted collectives of the second step, the
    plan's matrices (shape, owner, block) and (``level``) per FSDP2 group the other parameters' gradient bytes,
    which dmuon all-reduces (as :func:`support.step_comm.counted_step`)."""
    model, opt = _replicated_oddnet(world, torch.bfloat16, level)
    for step in range(2):
        lm_loss(model, odd_batch(step, rank)).backward()
        opt.step()
        opt.zero_grad()
    plan = opt.plan
    matrices = {id(i.param) for i in plan.infos}
    return {"plan_rank": opt.runtime.topo.rank, "log": list(opt.runtime.stats.last_log),
            "infos": [(tuple(i.shape), i.owner, i.block) for i in plan.infos],
            "waves": opt.last_step_stats()["return_waves"],
            "other_bytes": [sum(p.to_local().numel() * 4 for p in g.params if id(p) not in matrices)
                            for g in plan.groups] if plan.replicate_level else []}


# The 4-rank runs of the default suite: TP (on 4 ranks only), the route's training and its bytes. Every other
# run on 4 ranks is -m slow: its 2-rank case runs the same code by default (see SLOW_ON_FOUR).
FOUR_RANKS_BY_DEFAULT = ("tp", "ddp_with_dmuon", "ddp_with_dmuon_bytes")


def _on_ranks(rank: int, world: int, part: str = "all") -> dict:
    """Every run of this file on ``world`` ranks in one process group, each with its own result or error
    (``part``: "all", or on 4 ranks "default", FOUR_RANKS_BY_DEFAULT, or "rest")."""
    mesh = (world, 1)
    with_tp = {"tp": lambda: tp.train(rank, world, STEPS, (world // 2, 1, 2), "dmuon", False, False, "dmuon")}
    rules = {rule: functools.partial(run_case, rank, world, Case(mesh_shape=mesh, hsdp="dmuon", rule=rule, steps=STEPS,
                                                                 skip=SKIP))
             for rule in RULES}
    # What DDP users rely on, on the route they are told to use: accumulation without sync, torch's clipping.
    usage = {"accumulate": lambda: run_case(rank, world, Case(mesh_shape=mesh, hsdp="dmuon", steps=STEPS,
                                                              micro_batches=2)),
             "clip": lambda: run_case(rank, world, Case(mesh_shape=mesh, hsdp="dmuon", steps=STEPS, clip=CLIP))}
    return _each_of(part, with_tp if world == 4 else rules | usage) | _each_of(part, {
        "ddp_with_dmuon": lambda: run_case(rank, world, Case(mesh_shape=mesh, hsdp="dmuon", ns_dtype=torch.float32,
                                                             steps=STEPS, skip=SKIP, zero=3)),
        "ddp_with_dmuon_bytes": lambda: counted_step(rank, world, mesh, torch.bfloat16, 3, 2, None, "dmuon"),
        # ExecutionConfig(ns_in_backward=True, returns_in_backward=True), seven blocks: returns during backward.
        "ddp_with_dmuon_rbwd_bytes": lambda: counted_step(rank, world, mesh, torch.bfloat16, 3, 2, None, "dmuon",
                                                          "muon", 1, None, True, 7),
        "replicate": lambda: _replicate_trained(rank, world),
        "replicate_bytes": lambda: _replicate_counted(rank, world),
        "replicate_level": lambda: _replicate_trained(rank, world, level=True),
        "replicate_level_bytes": lambda: _replicate_counted(rank, world, level=True),
        "native_bytes": lambda: counted_step(rank, world, mesh, torch.bfloat16, 3, 2, None, "fsdp2"),
    })


def _each_of(part: str, runs: dict) -> dict:
    return run_each(_run.keep(part, runs))


_run = LaunchesByWorld(_on_ranks, 4, FOUR_RANKS_BY_DEFAULT)


SLOW_ON_FOUR = pytest.mark.slow
"""A 4-rank case under -m slow: the same test's 2-rank case runs the same run by default, and 4 ranks train
and count bytes by default in test_ddp_with_dmuon_matches_single_process[4],
test_ddp_with_dmuon_bytes_are_at_most_ddps_and_equal_the_model[ddp_with_dmuon_bytes-4] and
test_tensor_parallel_then_ddp_with_dmuon."""


def _check_even(totals: list[int]) -> None:
    mean = sum(totals) / len(totals)
    assert all(abs(t - mean) <= EVEN * mean for t in totals), totals


def _check_momentum_split(momentum: list[dict], shapes: dict, world: int) -> None:
    """Each Muon matrix's momentum is held once over the ranks, split 1/N along its dim 1 (torch.chunk's
    split: a conv's ``(out, in, k)`` by its ``in``)."""
    for name, shape in shapes.items():
        numels = [m.get(name, 0) for m in momentum]
        per_column = shape[0] * torch.Size(shape[2:]).numel()
        widths = [c.numel() for c in torch.arange(shape[1]).chunk(world)] + [0] * world
        assert sorted(numels) == sorted(per_column * w for w in widths[:world]), (name, numels)


@pytest.mark.parametrize("world", [2, 4])
def test_ddp_with_dmuon_matches_single_process(world):
    """FSDP2 over the one-rank shard dim of an (N, 1) mesh, ``hsdp_mesh=mesh``: one process's
    torch.optim.Muon + AdamW on the global batch, NS once per matrix, momentum split 1/N."""
    results = _run(world, "ddp_with_dmuon")
    diff, worst = max_diff(results[0]["params"], reference(world, torch.float32)[0])
    assert diff <= 1e-5, f"{worst} differs by {diff:.3g}"
    for step in range(STEPS):
        done = sum(r["stats"][step]["orthogonalized"] for r in results)
        assert done == N_MATRICES - 3 * len(SKIP.get(step, ())), step
    _check_momentum_split([r["momentum_numel"] for r in results], results[0]["shapes"], world)


@pytest.mark.parametrize("run,world", [
    pytest.param(run, world, marks=SLOW_ON_FOUR if world == 4 and run not in FOUR_RANKS_BY_DEFAULT else ())
    for run in ["ddp_with_dmuon_bytes", "replicate_level_bytes", "ddp_with_dmuon_rbwd_bytes"] for world in (2, 4)])
def test_ddp_with_dmuon_bytes_are_at_most_ddps_and_equal_the_model(world, run):
    """Every collective of the step is dmuon's (FSDP2 over one rank moves nothing, ``fully_shard`` or
    ``replicate`` there): per rank, the step model's (``step_collectives("dmuon")`` on an (N, 1) mesh: the Muon
    gradients' column reduce-scatter in fp32, the updates' all-gather in bf16) plus the other parameters'
    all-reduce, at most DDP's all-reduce bytes and even across ranks."""
    if run.endswith("rbwd_bytes"):
        results = _run(world, run)
        assert all(r["blocks_returned_in_backward"] > 0 for r in results)
        _check_ddp_with_dmuon_bytes(results, world, model_blocks=7, hop_a_spread=1, returns_in_backward=True)
    else:
        _check_ddp_with_dmuon_bytes(_run(world, run), world)


def _check_ddp_with_dmuon_bytes(results: list[dict], world: int, model_blocks: int = 3, even: bool = True,
                                **execution) -> None:
    """Every rank's counted collectives are the step model's, and at most DDP's all-reduce bytes on OddNet of
    ``model_blocks`` blocks (``even``: every rank within :data:`EVEN` of the mean; ``execution``: the model's
    ``hop_a_spread``/``returns_in_backward`` when the run set them)."""
    infos = results[0]["infos"]
    shapes, owners, blocks = [i[0] for i in infos], [i[1] for i in infos], [i[2] for i in infos]
    waves = results[0]["waves"]
    assert all(r["waves"] == waves for r in results)
    backward, step = owner_exchange_collectives(shapes, owners, blocks, world, 1, 2, waves=waves, gradient_bytes=4,
                                                **execution)
    modelled = backward + step
    in_step = [c for c in step_collectives("dmuon", shapes, owners, blocks, world, 1, wire_bytes=2, waves=waves,
                                           **execution)
               if c.label.startswith("dmuon")]
    assert sorted(c.label for c in in_step) == sorted(c.label for c in modelled)
    # One reduce-scatter across the replicas per block, nothing inside a replica of one rank.
    assert {c.level for c in modelled} == {"inter"}
    assert len([c for c in backward if c.role == "grad_columns"]) == len(set(blocks))
    for r in results:
        k = r["plan_rank"]
        expected = [(c.level, *c.ranks[k]) for c in modelled if c.ranks[k] is not None]
        expected += [("inter", 2 * (world - 1) * b // world, 2 * (world - 1) * b // world)
                     for b in r["other_bytes"] if b]
        assert sorted(r["log"]) == sorted(expected), f"plan rank {k}"
    ddp = _ddp_bytes(world, model_blocks)
    sent = [sum(e[1] for e in r["log"]) for r in results]
    received = [sum(e[2] for e in r["log"]) for r in results]
    assert max(sent) <= ddp and max(received) <= ddp, (sent, received, ddp)
    if even:
        _check_even(sent)
        _check_even(received)


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=SLOW_ON_FOUR)])
@pytest.mark.parametrize("run", ["replicate", "replicate_level"])
def test_fsdp2_replicate_matches_single_process(world, run):
    """torch's FSDP2-based ``replicate`` over every rank: N replicas of one rank each (not N identical shards,
    where the first sent every direction and every rank kept every momentum); over the one-rank shard dim
    with ``hsdp_mesh``: dmuon's replicate level. Exact, NS once per matrix, momentum split 1/N."""
    results = _run(world, run)
    assert all(r["topology"] == (world, 1) for r in results)
    diff, worst = max_diff(results[0]["params"], reference(world, torch.float32)[0])
    assert diff <= 1e-5, f"{worst} differs by {diff:.3g}"
    for step in range(STEPS):
        assert sum(r["orthogonalized"][step] for r in results) == N_MATRICES - 3 * len(SKIP.get(step, ()))
    _check_momentum_split([r["momentum_numel"] for r in results], results[0]["shapes"], world)


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=SLOW_ON_FOUR)])
@pytest.mark.parametrize("run", ["replicate_bytes", "native_bytes"])
def test_fsdp2_replicate_and_native_bytes_equal_the_model(world, run):
    """``replicate``, and FSDP2's native HSDP on the (N, 1) mesh: FSDP2's all-reduce (DDP's bytes) and then
    dmuon's native-HSDP exchange with shards of one rank (each replica's direction slices to the owner, the
    updates back in bf16): per rank the step model's collectives, even across ranks; the total is DDP's
    bytes plus dmuon's (the README's figure)."""
    results = _run(world, run)
    infos = results[0]["infos"]
    shapes, owners, blocks = [i[0] for i in infos], [i[1] for i in infos], [i[2] for i in infos]
    waves = results[0]["waves"]
    assert all(r["waves"] == waves for r in results)
    backward, step = owner_exchange_collectives(shapes, owners, blocks, world, 1, 2, waves=waves)
    modelled = backward + step
    for r in results:
        k = r["plan_rank"]
        assert r["log"] == [(c.level, *c.ranks[k]) for c in modelled if c.ranks[k] is not None], f"plan rank {k}"
    ddp = _ddp_bytes(world)
    sent = [ddp + sum(e[1] for e in r["log"]) for r in results]
    received = [ddp + sum(e[2] for e in r["log"]) for r in results]
    _check_even(sent)
    _check_even(received)


def test_tensor_parallel_then_ddp_with_dmuon():
    """DDP + TP: ``parallelize_module`` over ``tp``, then "DDP with dmuon" over the data-parallel ranks: the
    ``(replicate, shard, tp) = (2, 1, 2)`` mesh, FSDP2 over the one-rank shard dim, ``hsdp_mesh=mesh``.
    One process's result (fp32 NS), NS once per matrix, each momentum held once over the mesh."""
    results = _run(4, "tp")
    _, momenta = tp.check_equals_reference(results, 2, STEPS)
    for n in momenta:
        # TP leaves ``mix`` whole: each tp rank keeps a copy (as it does of the weight and of AdamW's state).
        held = sum(r["momentum_numel"][n] for r in results)
        assert held == momenta[n].numel() * (2 if ".mix." in n else 1), (n, held)


@pytest.mark.parametrize("rule", RULES)
def test_the_other_rules_on_ddp_with_dmuon_equal_their_formulas(rule):
    """NorMuon, MuonH and Dion2 on the (2, 1) mesh with ``hsdp_mesh``: one process's formula (fp32 NS),
    parameters and the rule's state."""
    from support import more_rules, normuon

    results = _run(2, rule)
    ref, _, state = normuon.oddnet_reference(2) if rule == "normuon" else more_rules.oddnet_reference(rule, 2)
    diff, worst = max_diff(results[0]["params"], ref)
    assert diff <= 1e-5, f"{worst} differs by {diff:.3g}"
    if rule == "normuon":
        got = {n: v.reshape(-1) for n, v in results[0]["second_moments"].items()}
    else:
        got = {n: v.reshape(-1) for n, v in results[0]["rule_state"].items()}
    diff, worst = max_diff(got, state)
    assert diff <= 1e-5, f"state of {worst} differs by {diff:.3g}"


CHECKPOINT_ROUTES = ("ddp_with_dmuon", "replicate", "torch_ddp", "fsdp")


def _checkpoints_across_routes(rank: int, world: int, directory: str) -> dict | None:
    """Saved (DCP, torch's state-dict API) under DDP with dmuon and under ``replicate``, each resumed under the
    two other routes of :data:`CHECKPOINT_ROUTES` (``fsdp``: 1-D FSDP2 over every rank) and trained on:
    rank 0 gets each resumed run's full parameters, keyed ``(saved, resumed)``."""
    from support.cases import sharded_oddnet
    from support.checkpoint import _train, load, save

    def build(route):
        if route == "replicate":
            return _replicated_oddnet(world, torch.float32)
        if route == "torch_ddp":  # torch's DistributedDataParallel: the owners keep the momenta, whole
            from torch.nn.parallel import DistributedDataParallel as DDP

            torch.manual_seed(0)
            ddp = DDP(OddNet())
            return ddp, dmuon.DMuon(ddp, lr=0.02, adamw=dmuon.AdamWConfig(lr=3e-3),
                                    ns=dmuon.NSConfig(method="standard", dtype=torch.float32))
        model, _, opt = sharded_oddnet(world, mesh_shape=(world, 1) if route == "ddp_with_dmuon" else None,
                                       hsdp="dmuon")
        return model, opt

    out = {}
    for saved in CHECKPOINT_ROUTES[:3]:
        path = f"{directory}/{saved}"
        model, opt = build(saved)
        _train(model, opt, rank, world, range(SAVED_AT))
        save(model, opt, path)
        for resumed in CHECKPOINT_ROUTES:
            if resumed != saved:
                model, opt = build(resumed)
                load(model, opt, path)
                _train(model, opt, rank, world, range(SAVED_AT, SAVED_AT + MORE))
                out[(saved, resumed)] = full_params(getattr(model, "module", model))
    return out if rank == 0 else None


def test_checkpoints_resume_across_routes(tmp_path):
    """A DCP checkpoint (torch's ``get_state_dict``) saved under DDP with dmuon, under ``replicate`` or under torch's
    ``DistributedDataParallel`` resumes under each other route and under 1-D FSDP2: as if never stopped (one
    process, fp32 NS). The momentum is a DTensor split by columns on the first two routes, a whole tensor on its
    owner only under torch's DDP, a DTensor split by rows under FSDP2; DCP reshards it."""
    from support.cases import MUON_KW
    from support.checkpoint import global_batch
    from support.reference import reference_training

    got = run_distributed(_checkpoints_across_routes, 2, str(tmp_path), timeout_s=300)[0]
    torch.manual_seed(0)
    model = OddNet()
    ref, _ = reference_training(model, [global_batch(s) for s in range(SAVED_AT + MORE)], lm_loss,
                                muon_kwargs=MUON_KW, adamw_kwargs=dict(lr=3e-3, weight_decay=0.01),
                                ns_dtype=torch.float32)
    assert len(got) == 9
    for key, params in got.items():
        diff, worst = max_diff(params, ref)
        assert diff <= 1e-5, (key, worst, diff)


def _on_eight(rank: int, world: int) -> dict:
    return run_each({
        "exact": lambda: run_case(rank, world, Case(mesh_shape=(world, 1), hsdp="dmuon", steps=STEPS, skip=SKIP)),
        # One block: six matrices on eight ranks, two owning none.
        "bytes": lambda: counted_step(rank, world, (world, 1), torch.bfloat16, 3, 2, None, "dmuon", "muon", 8, None,
                                      False, 1),
    })


@pytest.mark.slow  # eight processes on two cores
def test_ddp_with_dmuon_on_eight_ranks_more_ranks_than_matrices():
    """(8, 1): exact against one process; with one block (six matrices, two ranks owning none) every rank's
    collectives are the model's and at most DDP's bytes (the ranks owning nothing send no updates, so the
    ranks are not even here)."""
    runs = run_distributed(_on_eight, 8, timeout_s=600)
    results = [succeeded(r["exact"]) for r in runs]
    diff, worst = max_diff(results[0]["params"], reference(8, torch.float32)[0])
    assert diff <= 1e-5, f"{worst} differs by {diff:.3g}"
    counted = [succeeded(r["bytes"]) for r in runs]
    assert len({i[1] for i in counted[0]["infos"]}) < 8  # some rank owns nothing
    _check_ddp_with_dmuon_bytes(counted, 8, model_blocks=1, even=False)


def _global_batches(world: int, micro: int = 1) -> list:
    """Every rank's batches (``micro`` micro-batches' worth each) of ``STEPS`` steps, joined per step."""
    batches = []
    for step in range(STEPS):
        parts = [odd_batch(step, r, batch=2 * micro) for r in range(world)]
        batches.append((torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])))
    return batches


@pytest.mark.parametrize("case", ["accumulate", "clip"])
def test_accumulation_and_torchs_clipping_on_ddp_with_dmuon(case):
    """DDP's ``no_sync()`` accumulation is FSDP2's ``set_requires_gradient_sync(False)`` on the earlier
    micro-batches; torch's ``clip_grad_norm_`` clips the mean gradient: one process's result on the global
    batch, and the clip's norm is the single-process one on every rank."""
    from support.cases import MUON_KW
    from support.reference import reference_training

    results = _run(2, case)
    torch.manual_seed(0)
    model = OddNet()
    ref, _ = reference_training(model, _global_batches(2, micro=2 if case == "accumulate" else 1), lm_loss,
                                muon_kwargs=MUON_KW, adamw_kwargs=dict(lr=3e-3, weight_decay=0.01),
                                ns_dtype=torch.float32, clip=CLIP if case == "clip" else None)
    diff, worst = max_diff(results[0]["params"], ref)
    assert diff <= 1e-5, f"{worst} differs by {diff:.3g}"
    if case == "clip":
        assert len(reference_training.norms) == STEPS
        for r in results:
            assert r["norms"] == pytest.approx(list(reference_training.norms), rel=1e-5)


def test_dmuon_plan_ddp_models_the_route_against_ddps_all_reduce(tmp_path, capsys):
    """``dmuon plan --ddp``: the (N, 1) layout; the Muon matrices' bytes of DDP with dmuon against DDP's all-reduce
    (FSDP2 + AdamW's on that layout) are per rank ``(N-1)/N·P`` times 4 (the gradient's column slices) + 2/N (the
    direction slices to the owner) + 2 (the update back), over DDP's 8: ``0.75 + 0.25/N``; native HSDP (FSDP2's
    all-reduce, then dmuon's) costs more than DDP."""
    from dmuon.bench import plan_cli

    world = 8
    out = tmp_path / "plan.json"
    assert plan_cli.main(["--model", "qwen2", "--world-size", str(world), "--ddp", "--analytical",
                          "--json", str(out)]) == 0
    import json

    plan = json.loads(out.read_text())
    assert plan["mesh"] == [world, 1]
    designs = plan["hsdp_designs"]
    ddp = designs["fsdp2_adamw"]["inter"]["total"]
    assert designs["b"]["inter"]["total"] / ddp == pytest.approx(0.75 + 0.25 / world, rel=1e-9)
    assert designs["a"]["inter"]["total"] > ddp
    assert plan_cli.main(["--model", "qwen2", "--world-size", "8", "--ddp", "--ranks-per-node", "2"]) == 2
    assert "--ddp is the (N, 1) layout" in capsys.readouterr().err


def test_dmuon_plan_ddp_simulates_returns_in_backward(tmp_path):
    """``dmuon plan --ddp --simulate``: on one shard position a return's hop 1 is no collective and its first hop
    across replicas rides in a landing's all_to_all; the timeline's blocks returning in backward are still the
    step model's (the simulation checks it block by block and raised here before), and every strategy runs."""
    import json

    from dmuon.bench import plan_cli

    out = tmp_path / "plan.json"
    assert plan_cli.main(["--model", "qwen2.5-7b", "--world-size", "8", "--ddp", "--analytical", "--simulate",
                          "--json", str(out)]) == 0
    simulation = json.loads(out.read_text())["simulation"]
    assert {"fsdp_adamw", "dmuon", "dmuon_rbwd", "dmuon_nfwd"} <= set(simulation)
    assert all(s["step_seconds"] > 0 for s in simulation.values())


def test_dmuon_bench_ddp_runs_torchs_ddp_and_the_route_side_by_side(tmp_path):
    """``dmuon bench --ddp``: torch's DDP with AdamW, with torch.optim.Muon and with dmuon, and "DDP with dmuon"
    (``dmuon_z2`` on the (N, 1) mesh). DDP's bytes are its all-reduce for the first two; dmuon under DDP adds its
    updates' all-gather (the plan's model of it); the route moves fewer than DDP (a regression guard on the
    bytes, not on the CPU's seconds); the Muon runs train the same model to the same loss."""
    import json

    from dmuon.bench import cli as bench_cli

    out = tmp_path / "ddp.json"
    assert bench_cli.main(["--model", "tiny", "--world-size", "2", "--ddp", "--steps", "1", "--warmup", "1",
                           "--json", str(out), "--quiet"]) == 0
    payload = json.loads(out.read_text())
    assert payload["mesh"] == [2, 1]
    by_config = {r["config"]: r for r in payload["results"]}
    assert set(by_config) == {"ddp_adamw", "ddp_torch_muon", "ddp_dmuon", "dmuon_z2"}
    ddp = by_config["ddp_adamw"]["bytes_per_step"]
    assert by_config["ddp_torch_muon"]["bytes_per_step"] == ddp
    assert ddp < by_config["ddp_dmuon"]["bytes_per_step"] < 1.5 * ddp
    assert by_config["dmuon_z2"]["bytes_per_step"] < ddp
    with pytest.raises(SystemExit, match="--ddp is the"):
        bench_cli.main(["--model", "tiny", "--world-size", "2", "--ddp", "--hsdp", "2", "--quiet"])
