"""``ExecutionConfig(loopback_collectives=True)``: one rank issues its exchanges, returns and agreement
as collectives on its one-member groups, with the same bits as the local hand-over."""

from __future__ import annotations

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


def _train(rank: int, world_size: int, setting: str, loopback: bool, clip: float | None) -> dict:
    """OddNet for :data:`STEPS` steps; dmuon's collectives on its own groups counted by kind."""
    # With a clip, both runs exchange the clipped blocks again: one process without loopback never takes
    # clipped_overlap's rescaled launches (nothing to save there), so the pair compares that path.
    rescale = {} if clip is None else {"clipped_overlap": False}
    execution = dmuon.ExecutionConfig(loopback_collectives=loopback, **SETTINGS[setting], **rescale)
    model, plan, opt = sharded_oddnet(world_size, execution=execution)
    ours = plan.topology.mesh_group
    counts = {"all_to_all_single": 0, "all_reduce": 0}
    originals = {name: getattr(dist, name) for name in counts}

    def counting(name):
        def call(*args, **kwargs):
            if kwargs.get("group") is ours:  # FSDP2's and the test's own collectives use other groups
                counts[name] += 1
            return originals[name](*args, **kwargs)
        return call

    stats = []
    for name in counts:
        setattr(dist, name, counting(name))
    try:
        for step in range(STEPS):
            loss = lm_loss(model, odd_batch(step, rank))
            loss.backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad()
            stats.append(opt.last_step_stats())
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
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
