"""Which data parallelism dmuon steps a model under, decided once when the optimizer is built.

Three answers (:class:`Parallelism`): FSDP2 (the model ``fully_shard``-ed, or plain in one process: the
shard runtime), torch's ``DistributedDataParallel`` (every rank holds the whole model: the DDP runtime), or
not yet (a process group is up and nothing is sharded: a framework builds the optimizer first and shards or
wraps the model later). :class:`Setup` holds the answer and what it found (the model stepped, DDP's wrapper);
the optimizer reads it wherever it needs it, and a setup waiting for sharding is settled once, when the
optimizer sets itself up (:meth:`Setup.settled`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from dmuon.plan.plan import Plan
from dmuon.prepare.ddp import ddp_root, wrapping_ddp


class Parallelism(enum.Enum):
    """How the ranks split the model (:class:`Setup`)."""

    FSDP2 = "fsdp2"
    """``fully_shard``-ed (FSDP2, HSDP, with TP or expert dims), or plain tensors in one process."""
    DDP = "ddp"
    """torch's ``DistributedDataParallel``: every rank holds every parameter whole."""
    BEFORE_SHARDING = "before_sharding"
    """Built before the model is sharded or wrapped: settled at the model's first forward."""


def waits_for_sharding(model: nn.Module) -> bool:
    """A process group is up and no parameter is a DTensor yet (``fully_shard`` comes later).

    A model sharded in part (some blocks ``fully_shard``-ed, others not) is not waiting for
    a framework: it is the error :func:`dmuon.prepare` names at once.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return False
    params = list(model.parameters())
    return any(p.requires_grad for p in params) and not any(isinstance(p, DTensor) for p in params)


@dataclass(frozen=True)
class Setup:
    """The parallelism an optimizer steps its model under, and what it found deciding it.

    Attributes:
        parallelism: The answer.
        model: The model the optimizer steps (DDP's ``.module`` under DDP; the same object before and
            after ``fully_shard``).
        ddp: torch's ``DistributedDataParallel`` around ``model`` (None: none, or not found: a copy of the
            optimizer steps its own copy of the model, which no DDP wraps).
    """

    parallelism: Parallelism
    model: nn.Module
    ddp: nn.Module | None = None

    @classmethod
    def decide(cls, model: nn.Module, plan: Plan | None) -> Setup:
        """The setup of an optimizer built on ``model`` (what the user gave: the model, DDP's wrapper or its
        ``.module``) with ``plan`` (None: the optimizer makes its own).

        Under DDP (the wrapper given, or its ``.module`` once the wrapper exists) the plan is made over DDP's
        group; a model DDP wraps later is found when the setup settles. A plan given decides between FSDP2
        and DDP by what it was made over.

        Raises:
            ValueError: For a DDP dmuon cannot step (:func:`dmuon.prepare.ddp.ddp_root`).
        """
        ddp = ddp_root(model)
        if ddp is None and waits_for_sharding(model):
            ddp = wrapping_ddp(model)
        if ddp is not None:
            model = ddp.module
        if isinstance(plan, Plan):  # anything else given as a plan is refused next, naming it
            return cls.of_plan(model, plan, ddp)
        if ddp is not None:
            return cls(Parallelism.DDP, model, ddp)
        if waits_for_sharding(model):
            return cls(Parallelism.BEFORE_SHARDING, model)
        return cls(Parallelism.FSDP2, model)

    @classmethod
    def of_plan(cls, model: nn.Module, plan: Plan, ddp: nn.Module | None = None) -> Setup:
        """The setup ``plan`` was made for (``Plan.ddp``: over torch's DDP)."""
        return cls(Parallelism.DDP if plan.ddp else Parallelism.FSDP2, model, ddp)

    @property
    def waiting(self) -> bool:
        """Whether the model is still to be sharded or wrapped (:attr:`Parallelism.BEFORE_SHARDING`)."""
        return self.parallelism is Parallelism.BEFORE_SHARDING

    @property
    def ddp_runs(self) -> bool:
        """Whether torch's DDP reduces the gradients (:attr:`Parallelism.DDP`)."""
        return self.parallelism is Parallelism.DDP

    @property
    def planned(self) -> nn.Module:
        """What :func:`dmuon.prepare` reads: DDP's wrapper under DDP (the plan is made over its group), else
        the model."""
        return self.model if self.ddp is None else self.ddp

    def still_waiting(self) -> bool:
        """Whether a waiting setup cannot settle yet: nothing sharded and no DDP wraps the model. Local."""
        return self.waiting and waits_for_sharding(self.model) and wrapping_ddp(self.model) is None

    def settled(self) -> Setup:
        """A waiting setup decided now that the model is sharded (FSDP2) or wrapped (DDP); any other as it is.
        Local: no collective.

        Raises:
            ValueError: On several ranks, naming a parameter no ``fully_shard`` manages, when the model is
                neither sharded nor wrapped (every rank with the same model raises it).
        """
        if not self.waiting:
            return self
        # DDP(...) wrapped the model since (looked for only while nothing is sharded).
        ddp = wrapping_ddp(self.model) if waits_for_sharding(self.model) else None
        if ddp is not None:
            return Setup(Parallelism.DDP, self.model, ddp)
        if waits_for_sharding(self.model) and dist.get_world_size() > 1:
            bare = [n for n, p in self.model.named_parameters() if p.requires_grad and not isinstance(p, DTensor)]
            raise ValueError(
                f"DMuon was built before fully_shard and the model is still not sharded (parameter {bare[0]!r} "
                "is not managed by any fully_shard): shard the model (fully_shard on its blocks and root, or "
                "through your framework: accelerator.prepare, fabric.setup, Trainer) or wrap it in torch's "
                "DistributedDataParallel before the first step")
        return Setup(Parallelism.FSDP2, self.model)
