"""The parallelism an optimizer steps its model under, decided once (:mod:`dmuon.prepare.setup`): FSDP2 (or
one process), torch's DDP (the wrapper given, or its ``.module`` once it exists), or not sharded yet, settled
when the optimizer sets itself up, on two gloo ranks."""

from __future__ import annotations

import torch
from torch import nn

import dmuon
from dmuon.prepare.setup import Parallelism, Setup

from support.spawn import run_distributed


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 12), nn.Linear(12, 8))


def test_without_a_process_group_the_model_is_stepped_as_it_is():
    model = _model()
    setup = Setup.decide(model, None)
    assert setup.parallelism is Parallelism.FSDP2 and setup.planned is model and setup.ddp is None
    assert setup.settled() is setup and not setup.still_waiting()
    opt = dmuon.DMuon(model)
    assert opt._setup.parallelism is Parallelism.FSDP2
    # A plan given decides by what it was made over.
    assert Setup.decide(model, opt.plan).parallelism is Parallelism.FSDP2


def _decisions(rank: int, world: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    model = _model()
    out = {}
    waiting = Setup.decide(model, None)
    out["built before"] = (waiting.parallelism, waiting.still_waiting())
    try:
        waiting.settled()
    except ValueError as e:
        out["settled unsharded"] = str(e)
    ddp = DistributedDataParallel(model)
    settled = waiting.settled()
    out["settled after DDP"] = (settled.parallelism, settled.ddp is ddp, settled.planned is ddp,
                                waiting.still_waiting())
    for given, what in ((ddp, "wrapper"), (model, "module")):
        setup = Setup.decide(given, None)
        out[what] = (setup.parallelism, setup.model is model, setup.planned is ddp)
    opt = dmuon.DMuon(model)
    out["optimizer"] = opt._setup.parallelism
    out["plan given"] = Setup.decide(model, opt.plan).parallelism
    return out


def test_ddp_and_a_model_waiting_for_sharding_are_told_apart_once():
    for out in run_distributed(_decisions, 2):
        assert out["built before"] == (Parallelism.BEFORE_SHARDING, True)
        assert "is not managed by any fully_shard" in out["settled unsharded"]
        assert out["settled after DDP"] == (Parallelism.DDP, True, True, False)
        assert out["wrapper"] == out["module"] == (Parallelism.DDP, True, True)
        assert out["optimizer"] is Parallelism.DDP
        assert out["plan given"] is Parallelism.DDP
