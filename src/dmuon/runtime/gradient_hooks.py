"""The gradient hooks of the launches: which unit's gradients have landed, and when a unit completes.

FSDP2 calls each sharded parameter's post-accumulate-grad hooks right after it has written the
block's reduced gradient shard (after its reduce-scatter and, on HSDP, its all-reduce, averaged and
cast to the parameter's dtype). A unit (what FSDP2 reduces in one post-backward) completes once
every parameter of it has landed, or the next unit starts landing; its completion is the launch
(:class:`~dmuon.runtime.backward.BackwardLaunches`). Hooks fire in FSDP2's post-backward order,
which FSDP2 itself requires to be the same on every rank.

Only the newest launches on a parameter act on it: a hook outlives nothing (once its launches are
gone, or newer launches hooked the same parameter, a new optimizer on resume, whether or not the
old one has been garbage-collected yet, which can differ between ranks, the hook does nothing),
and nothing is written onto torch's parameters.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from dmuon.comm.streams import Streams
from dmuon.plan.plan import Plan
from dmuon.runtime.replicate import ReplicateLevel
from dmuon.util.autocast import autocast_off
from dmuon.util.observe import ranged
from dmuon.util.torch_compat import in_backward, on_reduced_gradient, queue_end_of_backward

_NEWEST: dict[int, weakref.ref] = {}
"""Per hooked parameter (by id, while it lives), the newest hooks on it: only they act on its gradients."""


@dataclass
class Unit:
    """What lands together: FSDP2 reduces these parameters in one post-backward."""

    params: list[torch.Tensor]
    """The hooked parameters (trainable)."""
    block: int | None
    """Its Muon matrices' block (``Plan.blocks``), or None."""
    root: str = ""
    """Its outermost ``fully_shard``-ed module (``ReductionGroup.root``; replicate level only)."""


def hooked_units(plan: Plan, replicate: bool) -> list[Unit]:
    """The units whose landings the launches follow: without the replicate level the plan's blocks
    (only their trainable Muon matrices hooked), with it every FSDP2 group's trainable parameters."""
    if not replicate:
        units = [Unit(list({id(plan.infos[i].param): plan.infos[i].param for i in b.members
                            if plan.infos[i].param.requires_grad}.values()), b.index) for b in plan.blocks]
    else:
        units = [Unit(list(g.params), g.block, g.root) for g in plan.groups]
    return [u for u in units if u.params]


class Landings(Protocol):
    """What the hooks tell: :class:`~dmuon.runtime.backward.BackwardLaunches`."""

    def complete(self, unit: int, landed: set[int], first: bool) -> None:
        """Unit ``unit`` completed (``landed``: the ids of its parameters that landed; ``first``: its
        first completion since :meth:`GradientHooks.reset`)."""

    def backward_ended(self) -> None:
        """The end of a backward pass (replicate level only)."""

    def stage_reduced(self) -> None:
        """A pipeline stage's reduction by hand is over (replicate level only)."""


class GradientHooks:
    """A hook on every parameter of ``units``, and the bookkeeping of their landings.

    Args:
        plan: The ownership plan (its device).
        units: The units (:func:`hooked_units`).
        streams: The runtime's streams (the hooks run under FSDP2's hook stream).
        landings: Told of each unit's completion; held weakly (the hooks never keep it alive).
        replicate: dmuon's replicate level: each parameter's arrival marks its gradient
            (:meth:`~dmuon.runtime.replicate.ReplicateLevel.arrived`), and the end of each backward
            pass is hooked. None without it.
    """

    def __init__(self, plan: Plan, units: list[Unit], streams: Streams, landings: Landings,
                 replicate: ReplicateLevel | None) -> None:
        self.plan = plan
        self.units = units
        self.streams = streams
        self.replicate = replicate
        self._landings = weakref.ref(landings)
        # Per fully_shard root (a pipeline stage's module), its units: the schedule reduces them by hand in one go.
        self._stage_units: dict[str, set[int]] = {}
        for k, u in enumerate(units):
            self._stage_units.setdefault(u.root, set()).add(k)
        self._unit_of = {id(p): k for k, u in enumerate(units) for p in u.params}
        self._landed: dict[int, list[torch.Tensor]] = {}
        self.current: int | None = None
        """The unit landing now (partly landed), or None."""
        self.fired: set[int] = set()
        """The units completed since :meth:`reset`."""
        self._in_backward = False
        self.by_hand = False
        """The latest hook ran in FSDP2's reduction called by hand (a pipeline schedule's), not in a backward pass."""
        ref = weakref.ref(self)
        for u in units:
            for p in u.params:
                if id(p) not in _NEWEST:
                    weakref.finalize(p, _NEWEST.pop, id(p), None)
                _NEWEST[id(p)] = ref  # the newest hooks on a parameter act on it
        self._handles: list[Any] = [on_reduced_gradient(p, _hook(ref)) for u in units for p in u.params]

    def landed(self, param: torch.Tensor) -> None:
        """A parameter's reduced gradient has landed (the hook)."""
        # FSDP2's reduction called by hand, outside autograd: torch's pipeline schedules reduce a
        # stage's gradients once after its last micro-batch (REDUCE_GRAD), then scale them in place
        # on the compute stream (what the launches divide by: ScheduleDivisor). No end of a backward
        # pass follows to hook into, so on the replicate level each unit's reductions land as soon
        # as the unit completes.
        self.by_hand = by_hand = not self._in_backward and not in_backward()
        if self.replicate is not None and not self._in_backward and not by_hand:
            # Every reduction across replicas lands before this backward returns, and the compute
            # stream waits for dmuon's, so user code before step() (clipping) never races one in
            # flight. An autograd final callback runs after FSDP2's own (which reduces the root):
            # the only hook into the end of a backward pass; FSDP2, DDP and FSDP1 install theirs the
            # same way.
            self._in_backward = True
            landings = self._tell()  # held by the callback: the pass's launches complete whatever happens meanwhile
            queue_end_of_backward(lambda: self._end_of_backward(landings))
        if self.replicate is not None:
            self.replicate.arrived(param)
        unit = self._unit_of[id(param)]
        if self.current is not None and self.current != unit:
            self.complete(self.current)
        self.current = unit
        landed = self._landed.setdefault(unit, [])
        landed.append(param)
        if len(landed) == len(self.units[unit].params):
            self.complete(unit)
        if by_hand and self.replicate is not None and self.current is None and self._stage_done(unit):
            self._tell().stage_reduced()

    def _stage_done(self, unit: int) -> bool:
        """Whether every unit of ``unit``'s stage (its ``fully_shard`` root) has completed this step: the
        schedule's reduction by hand of that stage is over, and what it does next (its division) reads
        the gradients on the compute stream."""
        return self._stage_units[self.units[unit].root] <= self.fired

    @torch.no_grad()
    @ranged("launch")
    def complete(self, unit: int) -> None:
        """A unit's gradients have landed (all of them, or the next unit started landing)."""
        landed = {id(p) for p in self._landed.pop(unit)}
        if self.current == unit:
            self.current = None
        first = unit not in self.fired
        self.fired.add(unit)
        self._tell().complete(unit, landed, first)

    def complete_current(self) -> None:
        """The partly landed unit, if any, completes now."""
        if self.current is not None:
            self.complete(self.current)

    def _end_of_backward(self, landings: Landings) -> None:
        """Autograd final callback, on the compute stream after FSDP2's: the last unit completes."""
        self._in_backward = False
        if self.current is not None:
            with autocast_off(self.plan.device):  # the last launch, as the hooks' (under the caller's autocast)
                self.complete(self.current)
        landings.backward_ended()

    def _tell(self) -> Landings:
        landings = self._landings()
        assert landings is not None, "the hooks outlived their launches"
        return landings

    def reset(self) -> None:
        """A new step: nothing landed, nothing completed."""
        self._landed.clear()
        self.fired.clear()

    def close(self) -> None:
        """Removes the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _hook(ref: weakref.ref):
    @torch.compiler.disable  # eager, as FSDP2's own hooks: host bookkeeping, collectives, a worker thread
    def hook(param: torch.Tensor) -> None:
        me = ref()
        if me is not None and me._landings() is not None and _NEWEST.get(id(param)) is ref:
            # A backward under the caller's autocast (its state travels into autograd's hooks): the
            # launch's directions as configured, as the step's (dmuon.util.autocast).
            with me.streams.fsdp2_hook(), autocast_off(me.plan.device):
                me.landed(param)

    return hook
