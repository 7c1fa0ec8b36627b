"""DMuon's state as torch.optim's: copies (``copy.deepcopy``, pickle), state dicts and their loads.

torch.optim's own code does the rest; what differs is kept here: a copy takes its model and plan along and
leaves the runtime and DDP's wrapper behind; a load keeps the matrix rules' state in float32 and in the
runtime's layout (torch casts it to the parameter's dtype); under DDP every stepped matrix has a state entry
on every rank.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from dmuon.optim.groups import as_adamw_groups
from dmuon.rules.adamw import ADAMW_GROUP_DEFAULTS
from dmuon.rules.muon import fill_rule_defaults

NOT_COPIED = ("runtime", "_deferred", "_setup", "_optimizer_step_pre_hooks", "_optimizer_step_post_hooks",
              "_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks",
              "_optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks")
"""What a copy leaves out: the runtime, which the copy builds again on its own model, the setup (DDP's
wrapper, which does not wrap the copy's model), and the hooks, which torch.optim's copies leave out too."""


def copied_state(opt: Any) -> dict[str, Any]:
    """``opt.__getstate__()``: the optimizer with its model, plan and settings, the pending updates applied,
    and whether it was set up (``"_set_up"``, what tells a copy from torch's own ``__setstate__`` calls).

    Raises:
        TypeError: On a sharded model, naming what to do instead.
    """
    if any(isinstance(p, DTensor) for p in opt.model.parameters()):
        raise TypeError("DMuon on a sharded model cannot be copied or pickled: a copy steps its own copy of "
                        "the model, and FSDP2 does not copy its modules (copy.deepcopy of a fully_shard-ed "
                        "model raises); duplicate the training state with state dicts instead "
                        "(torch.distributed.checkpoint, or model and optimizer state_dict()/load_state_dict())")
    opt.flush_updates()
    state = {k: v for k, v in opt.__dict__.items() if k not in NOT_COPIED}
    state["_set_up"] = opt.runtime is not None
    return state


def complete_groups(groups: list[dict[str, Any]]) -> None:
    """Fills in the keys a saved state's groups may lack (torch's rule: the defaults), and makes each AdamW
    group the runtime's :class:`~dmuon.optim.groups.AdamWGroup` again."""
    fill_rule_defaults(groups)
    for group in groups:
        if group.get("algorithm") == "adamw":
            for key, value in ADAMW_GROUP_DEFAULTS.items():
                group.setdefault(key, value)
    as_adamw_groups(groups)


def refuse_momenta_before_sharding(state_dict: dict[str, Any], keys: dict[str, Any]) -> None:
    """Raises ``ValueError`` for a state holding matrix state (``keys``: the rule's) loaded before the model
    is sharded: it would be laid out for parameters that sharding replaces."""
    if any(isinstance(v, dict) and set(keys) & v.keys() for v in state_dict["state"].values()):
        raise ValueError("DMuon was built before fully_shard and the model is not sharded yet: load "
                         "optimizer checkpoints after sharding (after accelerator.prepare, fabric.setup "
                         "or fully_shard)")


def matrix_state_in(state_dict: dict[str, Any], keys: dict[str, Any]) -> list[tuple[int, str, torch.Tensor]]:
    """The matrix rule's state in ``state_dict`` as loaded, before torch casts it: ``(position of its parameter
    in the groups' order, key, value)``, in that order (every rank redistributes in the same one)."""
    order = [k for g in state_dict["param_groups"] for k in g["params"]]
    kept = [(order.index(k), name, v[name]) for k, v in state_dict["state"].items() if isinstance(v, dict)
            for name in keys if name in v]
    return sorted(kept, key=lambda kept_one: kept_one[:2])


def restore_matrix_state(opt: Any, kept: list[tuple[int, str, torch.Tensor]]) -> None:
    """Puts ``kept`` (:func:`matrix_state_in`) back in ``opt.state`` in float32, a DTensor laid out otherwise
    on the runtime's mesh redistributed to the runtime's layout, and marks the owners' momentum copies stale."""
    params = [p for g in opt.param_groups for p in g["params"]]
    for position, name, value in kept:
        param = params[position]
        info = opt.plan.infos[opt.matrix_indices(param)[0]]
        mesh, placements = opt.matrix_state[name](opt.momentum, info)
        if isinstance(value, DTensor) and value.device_mesh == mesh and tuple(value.placements) != placements:
            value = value.redistribute(mesh, placements)
        opt.state[param][name] = value.to(device=param.device, dtype=torch.float32)
    if opt.runtime.owner_momentum is not None:
        opt.runtime.owner_momentum.invalidate()  # the owners' copies follow the old momentum


def mark_stepped(opt: Any) -> None:
    """Under DDP: an (empty) state entry for each stepped matrix this rank does not own, so that the
    state dict names every stepped parameter on every rank, as torch's optimizers' do (torch's
    ``set_optimizer_state_dict`` requires it; DCP then loads each owner's momentum where it lives now)."""
    if not opt.last_step_report().skipped_nonfinite:
        for info in opt.plan.infos:
            if info.param.grad is not None:
                opt.state[info.param]  # noqa: B018 (the defaultdict's entry)
