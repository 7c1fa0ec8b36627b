"""Building the optimizer before ``fully_shard``: what frameworks do (accelerate, the HF Trainer,
Lightning build the optimizer first, then shard the model).

:class:`DeferredSetup` is what :class:`dmuon.DMuon` holds while it waits: the param groups exist at
once, split by the default matrix selection on the model as it is; the plan, the runtime and its
backward hooks follow on the sharded model, at the model's first forward on every rank (the hook
:meth:`DeferredSetup.wait_for_forward` registers calls the optimizer back), or at the first ``step()``,
``clip_grad_norm_`` or state load, whichever comes first. Meanwhile every read of the optimizer's
``param_groups`` first puts the model's current parameter objects in them (:meth:`DeferredSetup.rebind`),
whatever a framework swapped in.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
from torch import nn

from dmuon.optim.groups import canonical_name
from dmuon.plan.selection import select_matrices
from dmuon.prepare.setup import waits_for_sharding
from dmuon.util.torch_compat import active_ddp_module


def default_matrices(model: nn.Module) -> set[str]:
    """The canonical names of the parameters the default selection makes Muon matrices, on the model as it
    is (what splits the groups until the plan, made on the sharded model, takes over). Frozen ones too: a
    matrix that trains later is Muon's then (:class:`~dmuon.optim.groups.MuonMatrices`)."""
    return {canonical_name(n) for n, p in select_matrices(model)}


class DeferredSetup:
    """The pre-sharding bookkeeping of an optimizer built on a model that ``fully_shard`` has not sharded
    yet: the parameter objects its groups were built with (by name) and the first-forward hook.

    Args:
        model: The model the optimizer steps (the same object before and after ``fully_shard``).
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._built: dict[int, tuple[weakref.ref, str]] = {}  # parameter id -> (the object, its name)
        self._hook = None

    def record(self, groups: list[dict[str, Any]], names: dict[int, str]) -> None:
        """Remembers the model's parameters in ``groups`` and their names (``names``: id -> canonical name)."""
        for group in groups:
            for p in group["params"]:
                if id(p) in names:
                    self._built[id(p)] = (weakref.ref(p), names[id(p)])

    def wait_for_forward(self, set_up: Callable[[], None]) -> None:
        """Calls ``set_up`` (a bound method of the optimizer, held weakly: a replaced optimizer, such as a
        new one on resume, neither stays alive nor sets itself up) at the model's first forward once the
        model is sharded, until :meth:`close`."""
        # A global forward pre-hook: it runs before the module's own, FSDP2's included (which
        # swap the unsharded parameters in), so the model still holds its sharded ones.
        callback, model = weakref.WeakMethod(set_up), weakref.ref(self.model)

        @torch.compiler.disable
        def hook(module: nn.Module, args: Any) -> None:
            target = callback()
            if target is None or module is not model():
                return
            active = active_ddp_module()  # DistributedDataParallel(...) wrapped it: set up over DDP's group
            if (active is not None and active.module is module) or not waits_for_sharding(module):
                target()

        self._hook = nn.modules.module.register_module_forward_pre_hook(hook)
        weakref.finalize(self, self._hook.remove)  # an optimizer dropped before its setup

    def close(self) -> None:
        """Removes the first-forward hook (the optimizer is set up)."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    @staticmethod
    def check_split(groups: list[dict[str, Any]], planned: Callable[[torch.Tensor], bool],
                    names: dict[int, str]) -> None:
        """Raises ``ValueError`` naming the first parameter whose group (split before sharding) disagrees
        with the plan made on the sharded model (``planned``: whether a parameter is the plan's, or a frozen
        matrix its selection takes once it trains)."""
        for k, g in enumerate(groups):
            for p in g["params"]:
                if planned(p) != (g["algorithm"] == "muon"):
                    raise ValueError(
                        f"parameter {names.get(id(p), '?')!r} sits in an {g['algorithm']!r} param group (group "
                        f"{k}), split when DMuon was built before fully_shard, but the plan made on the sharded "
                        "model says otherwise (was requires_grad changed in between?); change requires_grad "
                        "before building DMuon, or build it after sharding")

    def rebind(self, groups: list[dict[str, Any]], state: dict, strict: bool = False) -> None:
        """Puts the model's current parameter objects into ``groups`` (and moves their ``state``).

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
                        if state.get(p):
                            raise ValueError(
                                f"parameter {name!r} has optimizer state loaded before the model was sharded; "
                                "load optimizer checkpoints after sharding (after accelerator.prepare, "
                                "fabric.setup or fully_shard)")
                        state.pop(p, None)
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
