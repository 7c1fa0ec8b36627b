"""``ExecutionConfig(loopback_collectives=True)``: one rank issues its exchanges, returns and agreement
as collectives on its one-member groups, with the same bits as the local hand-over."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

import dmuon

from support.cases import full_params, sharded_oddnet
from support.models import lm_loss, odd_batch
from support.spawn import run_distributed

STEPS = 3
SETTINGS = {
    "overlap": dict(),
    "sync": dict(overlap=False),
    "ns_in_backward": dict(ns_in_backward=True),
    "returns_in_backward": dict(ns_in_backward=True, returns_in_backward=True),
    "waves": dict(return_waves=4),
}


@contextlib.contextmanager
def _counted(group, names: list[str]):
    """Counts the calls of torch.distributed's ``names`` on ``group`` (dmuon's: FSDP2's, DDP's and the
    test's own collectives pass other groups or none)."""
    counts = dict.fromkeys(names, 0)
    originals = {name: getattr(dist, name) for name in names}

    def counting(name):
        def call(*args, **kwargs):
            if kwargs.get("group") is group:
                counts[name] += 1
            return originals[name](*args, **kwargs)
        return call

    for name in names:
        setattr(dist, name, counting(name))
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def _train(rank: int, world_size: int, setting: str, loopback: bool, clip: float | None) -> dict:
    """OddNet for :data:`STEPS` steps; dmuon's collectives on its own groups counted by kind."""
    # With a clip, both runs exchange the clipped blocks again: one process without loopback never takes
    # clipped_overlap's rescaled launches (nothing to save there), so the pair compares that path.
    rescale = {} if clip is None else {"clipped_overlap": False}
    execution = dmuon.ExecutionConfig(loopback_collectives=loopback, **SETTINGS[setting], **rescale)
    model, plan, opt = sharded_oddnet(world_size, execution=execution)
    stats = []
    with _counted(plan.topology.mesh_group, ["all_to_all_single", "all_reduce"]) as counts:
        for step in range(STEPS):
            loss = lm_loss(model, odd_batch(step, rank))
            loss.backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad()
            stats.append(opt.last_step_stats())
    return {"params": full_params(model), "counts": counts, "stats": stats, "blocks": len(plan.blocks)}


def _pairs(rank: int, world_size: int, settings: list[str], clip: float | None) -> dict[str, dict]:
    """Per setting, ``{"local": ..., "looped": ...}``; a setting that raised fails only its own assertions."""
    from support.scenarios import run_each

    def pair(setting: str) -> dict:
        return {"local": _train(rank, world_size, setting, False, clip),
                "looped": _train(rank, world_size, setting, True, clip)}

    return run_each({s: (lambda s=s: pair(s)) for s in settings})


@pytest.mark.parametrize("clip", [None, 0.3])
def test_loopback_gives_the_same_bits_and_issues_the_collectives(clip):
    settings = list(SETTINGS)
    (results,) = run_distributed(_pairs, 1, settings, clip, timeout_s=300)
    for setting in settings:
        local, looped = results[setting]["local"], results[setting]["looped"]
        for name, value in local["params"].items():
            assert torch.equal(value, looped["params"][name]), f"{setting}: {name} differs with loopback"
        # One rank hands everything over locally: dmuon issues nothing on its groups.
        assert local["counts"] == {"all_to_all_single": 0, "all_reduce": 0}, setting
        # Loopback: every step agrees (one all-reduce, or its flags ride a return) and moves every
        # matrix to its owner and back (at least one all-to-all each way).
        assert looped["counts"]["all_to_all_single"] >= 2 * STEPS, (setting, looped["counts"])
        assert looped["counts"]["all_to_all_single"] + looped["counts"]["all_reduce"] >= 3 * STEPS, setting
        assert [s["orthogonalized"] for s in local["stats"]] == [s["orthogonalized"] for s in looped["stats"]]
        assert [s["blocks_exchanged_in_backward"] for s in local["stats"]] == \
               [s["blocks_exchanged_in_backward"] for s in looped["stats"]], setting
        if setting == "sync":
            continue
        blocks = looped["blocks"]
        if clip is None:
            # The launches from backward went through the self all-to-all and stood.
            assert [s["blocks_exchanged_in_backward"] for s in looped["stats"]] == [blocks] * STEPS, setting
        else:
            # Every launch through the self all-to-all went stale (the clip changed its gradients), none
            # stood rescaled, and step() exchanged every block again.
            assert [s["rescaled_launches"] for s in looped["stats"]] == [0] * STEPS, setting
            assert [s["blocks_exchanged_in_backward"] for s in looped["stats"]] == [0] * STEPS, setting
    if clip is None:
        # 1-D: every block's updates but the last one's came back during backward.
        rbwd = results["returns_in_backward"]["looped"]
        assert [s["blocks_returned_in_backward"] for s in rbwd["stats"]] == [rbwd["blocks"] - 1] * STEPS


def test_loopback_needs_process_groups():
    from support.models import OddNet

    with pytest.raises(ValueError, match="loopback_collectives=True needs"):
        dmuon.DMuon(OddNet(), execution=dmuon.ExecutionConfig(loopback_collectives=True))
    with pytest.raises(ValueError, match="loopback_collectives must be True or False"):
        dmuon.ExecutionConfig(loopback_collectives=1)


def _ddp_train(rank: int, world_size: int, loopback: bool, rule: str) -> dict:
    """torch's DDP around OddNet, stepped by ``rule`` for :data:`STEPS` steps (a block unused at one step);
    dmuon's collectives on DDP's group counted by kind."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from support.cases import MUON_KW, NORMUON_BETA2
    from support.equivalence import SKIP
    from support.models import OddNet

    torch.manual_seed(0)
    ddp = DDP(OddNet(), find_unused_parameters=True)
    execution = dmuon.ExecutionConfig(loopback_collectives=loopback, nonfinite="skip" if rule == "muon" else None)
    ns = dmuon.NSConfig(method="standard", dtype=torch.float32)
    if rule == "normuon":  # a row state: the owner's rows handed back beside the gathered updates
        opt = dmuon.NorMuon(ddp, ns=ns, beta2=NORMUON_BETA2, execution=execution, **MUON_KW)
    else:
        opt = dmuon.DMuon(ddp, ns=ns, execution=execution, **MUON_KW)
    names = [n for n in ("all_reduce", "all_to_all_single", "all_gather_single", "all_gather_into_tensor")
             if hasattr(dist, n)]
    stats = []
    with _counted(opt.plan.topology.mesh_group, names) as counts:
        for step in range(STEPS):
            ddp.module.skip = SKIP.get(step, set())
            lm_loss(ddp, odd_batch(step, rank)).backward()
            opt.step()
            opt.zero_grad()
            stats.append(opt.last_step_stats())
    gathers = counts.pop("all_gather_single", 0) + counts.pop("all_gather_into_tensor")
    return {"params": {n: p.detach().clone() for n, p in ddp.module.named_parameters()},
            "counts": {**counts, "all_gather": gathers}, "stats": stats}


def _ddp_pairs(rank: int, world_size: int, rules: list[str]) -> dict[str, dict]:
    return {rule: {"local": _ddp_train(rank, world_size, False, rule), "looped": _ddp_train(rank, world_size, True, rule)}
            for rule in rules}


def test_ddp_with_loopback_gives_the_same_bits_and_issues_the_collectives():
    """torch's DDP runtime on one rank with ``loopback_collectives``: the agreement's all-reduce and each
    wave's all-gather issued on DDP's one-rank group, every parameter bit for bit the local hand-over's
    (the one-GPU check's row for the DDP runtime, ``scripts/gpu_check.sh``)."""
    rules = ["muon", "normuon"]
    (results,) = run_distributed(_ddp_pairs, 1, rules, timeout_s=300)
    for rule in rules:
        local, looped = results[rule]["local"], results[rule]["looped"]
        for name, value in local["params"].items():
            assert torch.equal(value, looped["params"][name]), f"{rule}: {name} differs with loopback"
        assert local["counts"] == dict.fromkeys(local["counts"], 0), (rule, local["counts"])
        waves = sum(len(s["return_waves"]) for s in looped["stats"])
        assert waves >= STEPS
        # One agreement per step, one all-gather per wave (one rank: the all-gather route, even shares).
        assert looped["counts"] == {"all_reduce": STEPS, "all_to_all_single": 0, "all_gather": waves}, \
            (rule, looped["counts"])
        assert [s["orthogonalized"] for s in local["stats"]] == [s["orthogonalized"] for s in looped["stats"]]
        assert [s["return_waves"] for s in local["stats"]] == [s["return_waves"] for s in looped["stats"]]
