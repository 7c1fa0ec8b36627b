"""Building the optimizer before ``fully_shard``: what frameworks do (accelerate, the HF Trainer,
Lightning build the optimizer first, then shard the model).

:class:`DeferredSetup` is the part of :class:`dmuon.DMuon` that waits: the param groups exist
at once, split by the default matrix selection on the model as it is; the plan, the runtime and
its backward hooks follow on the sharded model (:meth:`DeferredSetup._ready`), at the model's
first forward on every rank, or at the first ``step()``, ``clip_grad_norm_`` or state load,
whichever comes first. Meanwhile every read of ``param_groups`` first puts the model's current
parameter objects in them (:meth:`DeferredSetup._rebind`), whatever a framework swapped in.

The optimizer that mixes it in provides ``model``, ``ns``, ``runtime`` (None until set up),
``state``, ``param_names``, ``_hsdp_mesh``, ``_index``, ``_lazy_muon`` (the Muon matrices'
names before setup, None after), ``_built`` (parameter id -> (weak reference, name) of the
objects the groups were built with), ``_forward_hook``, and the two setup steps
``_adopt_plan(plan)`` and ``_start_runtime()``.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from dmuon.optim.groups import canonical_name
from dmuon.prepare import prepare


def waits_for_sharding(model: nn.Module) -> bool:
    """A process group is up and no parameter is a DTensor yet (``fully_shard`` comes later).

    A model sharded in part (some blocks ``fully_shard``-ed, others not) is not waiting for
    a framework: it is the error :func:`dmuon.prepare` names at once.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return False
    params = list(model.parameters())
    return any(p.requires_grad for p in params) and not any(isinstance(p, DTensor) for p in params)


class DeferredSetup:
    """The setup of an optimizer built on a model that ``fully_shard`` has not sharded yet."""

    def _defer_setup(self) -> None:
        """Sets itself up at the model's first forward (or the first call that needs the plan)."""
        # A global forward pre-hook: it runs before the module's own, FSDP2's included (which
        # swap the unsharded parameters in), so the model still holds its sharded ones.
        self._forward_hook = nn.modules.module.register_module_forward_pre_hook(self._first_forward_hook())
        weakref.finalize(self, self._forward_hook.remove)  # an optimizer dropped before its setup

    def _first_forward_hook(self):
        # Weak: a replaced optimizer (a new one on resume) neither stays alive nor sets itself up.
        me = weakref.ref(self)

        @torch.compiler.disable
        def hook(module: nn.Module, args: Any) -> None:
            opt = me()
            if opt is None or module is not opt.model or opt.runtime is not None:
                return
            if not waits_for_sharding(opt.model):
                opt._ready()

        return hook

    @property
    def is_set_up(self) -> bool:
        """Whether the plan and the runtime exist (a DMuon built before ``fully_shard`` sets itself up at
        the model's first forward, or at the first ``step()``, ``clip_grad_norm_`` or state load)."""
        return self.runtime is not None

    def _me(self) -> DeferredSetup:
        """This optimizer, also when called through a wrapper that took DMuon's class and delegates
        attribute reads to it (Lightning Fabric's ``_FabricOptimizer``), where writes must not land."""
        return self if "param_groups" in self.__dict__ else self.optimizer

    def _ready(self) -> None:
        """Sets the optimizer up on the sharded model if it is not yet: on every rank alike (a collective)."""
        self = self._me()
        if self.runtime is not None:
            return
        if waits_for_sharding(self.model) and dist.get_world_size() > 1:
            bare = [n for n, p in self.model.named_parameters() if p.requires_grad and not isinstance(p, DTensor)]
            raise ValueError(
                f"DMuon was built before fully_shard and the model is still not sharded (parameter {bare[0]!r} "
                "is not managed by any fully_shard): shard the model (fully_shard on its blocks and root, or "
                "through your framework: accelerator.prepare, fabric.setup, Trainer) before the first step")
        self._rebind(strict=True)
        plan = prepare(self.model, ns=self.ns, hsdp_mesh=self._hsdp_mesh)
        self._adopt_plan(plan)
        wrong = []
        for k, g in enumerate(self.param_groups):
            for p in g["params"]:
                if (id(p) in self._index) != (g["algorithm"] == "muon"):
                    wrong.append((k, self.param_names.get(id(p), "?"), g["algorithm"]))
        if wrong:
            k, name, algorithm = wrong[0]
            raise ValueError(
                f"parameter {name!r} sits in an {algorithm!r} param group (group {k}), split when DMuon was "
                "built before fully_shard, but the plan made on the sharded model says otherwise (was "
                "requires_grad changed in between?); change requires_grad before building DMuon, or build it "
                "after sharding")
        self._lazy_muon = None
        self._start_runtime()
        if self._forward_hook is not None:
            self._forward_hook.remove()
            self._forward_hook = None

    def _rebind(self, strict: bool = False) -> None:
        """Puts the model's current parameter objects into the param groups (and moves their state).

        ``fully_shard`` replaces every parameter of the model with a DTensor one; a framework
        may swap its own objects into the groups meanwhile (accelerate's placeholders, then
        its sharded parameters). Each parameter the groups were built with and the model no
        longer holds is replaced by the model's parameter of the same name (wrappers'
        name parts aside: activation checkpointing, ``torch.compile``); objects a framework
        put there are left to it. Local: no collective.

        Raises:
            ValueError: With ``strict``, for any group entry that is not one of the model's
                parameters now, naming it and the fix.
        """
        groups = self.__dict__.get("param_groups", [])
        current = {id(p) for p in self.model.parameters()}
        by_name = None
        for k, group in enumerate(groups):
            params = group["params"]
            for j, p in enumerate(params):
                if id(p) in current:
                    continue
                built = self._built.get(id(p))
                name = built[1] if built is not None and built[0]() is p else None
                if name is not None:
                    if by_name is None:
                        by_name = {canonical_name(n): q for n, q in self.model.named_parameters()}
                    new = by_name.get(name)
                    if new is not None:
                        if self.state.get(p):
                            raise ValueError(
                                f"parameter {name!r} has optimizer state loaded before the model was sharded; "
                                "load optimizer checkpoints after sharding (after accelerator.prepare, "
                                "fabric.setup or fully_shard)")
                        self.state.pop(p, None)
                        params[j] = new
                        self._built[id(new)] = (weakref.ref(new), name)
                        continue
                if strict:
                    names = group.get("param_names")
                    label = repr(names[j]) if names else f"number {j}"
                    raise ValueError(
                        f"param group {k}: parameter {label} (shape {tuple(p.shape)}) is not one of the model's "
                        "parameters now and no parameter of the model has its name; build DMuon on the model "
                        "that is trained (and the same object that fully_shard shards), or after sharding")

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """torch.optim's param groups; before setup, every read first puts the model's current parameters
        in them (:meth:`_rebind`), so a framework's state-dict code sees the sharded parameters."""
        try:
            groups = self.__dict__["param_groups"]
        except KeyError:
            # A wrapper that took DMuon's class (Lightning's _FabricOptimizer) delegates through __getattr__.
            raise AttributeError("param_groups") from None
        if self.__dict__.get("_lazy_muon") is not None:
            self._rebind()
        return groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.__dict__["param_groups"] = value
