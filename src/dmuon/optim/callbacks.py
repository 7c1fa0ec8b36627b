"""torch.optim.Muon's rule as the runtime's callbacks, on DMuon's param groups and state."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dmuon.ortho.owner import owner_update
from dmuon.rules.adamw import adamw_group_step, local_tensor
from dmuon.rules.muon import apply_update, momentum_update, peek_direction
from dmuon.runtime.callbacks import StepCallbacks

if TYPE_CHECKING:
    from dmuon.optim.dmuon import DMuon


class MuonCallbacks(StepCallbacks):
    """Muon (momentum, NS, shape-scaled step) for the matrices, AdamW for everything else.

    Reads the optimizer's param groups and state at each call (a state-dict load
    replaces both), so it holds the optimizer, not its containers.
    """

    def __init__(self, optimizer: DMuon) -> None:
        self.opt = optimizer
        self.plan = optimizer.plan
        self._column = divmod(self.plan.rank, self.plan.shard)[1]

    # ----------------------------------------------------------------- helpers
    def _groups(self) -> dict[int, dict]:
        """Plan index -> its param group, for every Muon matrix."""
        opt = self.opt
        return {i: g for g in opt.param_groups if g["algorithm"] == "muon" for p in g["params"]
                for i in opt.matrix_indices(p)}

    def _local(self, index: int, tensor: torch.Tensor) -> torch.Tensor:
        """Matrix ``index``'s part of this rank's shard of ``tensor`` (its parameter or momentum: the
        momentum holds, on HSDP, only the columns this replica keeps)."""
        return self.plan.infos[index].local_view(local_tensor(tensor), self._column)

    def _wire(self, direction: torch.Tensor) -> torch.Tensor:
        return direction.to(self.opt.ns.dtype).reshape(-1)

    # --------------------------------------------------------------- callbacks
    def matrices(self) -> list[int]:
        groups = self._groups()
        for group in {id(g): g for g in groups.values()}.values():
            self.opt.check_ns_keys(group)
            self.opt.check_rule_keys(group)
        return sorted(groups)

    @torch.no_grad()
    def peek(self, members: list[int], grads: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        groups = self._groups()
        out = {}
        for i in members:
            info, group = self.plan.infos[i], groups[i]
            buf = self.opt.state[info.param].get("momentum_buffer")
            d = peek_direction(grads[i], None if buf is None else self._local(i, buf), group["momentum"],
                               group["nesterov"])
            out[i] = self._wire(d)
        return out

    @torch.no_grad()
    def commit(self, members: list[int], grads: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        groups, momentum = self._groups(), self.opt.momentum
        out = {}
        for i in members:
            info, group = self.plan.infos[i], groups[i]
            state = self.opt.state[info.param]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = momentum.new_buffer(info)
            d = momentum_update(grads[i], self._local(i, state["momentum_buffer"]), group["momentum"],
                                group["nesterov"])
            out[i] = self._wire(d)
        return out

    def owner_work(self, batch: list[int], directions: list[torch.Tensor]) -> list[torch.Tensor]:
        return owner_update(directions, self.opt.ns)

    @torch.no_grad()
    def apply(self, updates: dict[int, torch.Tensor]) -> None:
        groups = self._groups()
        for i, rows in updates.items():
            info, group = self.plan.infos[i], groups[i]
            apply_update(self._local(i, info.param), rows, lr=group["lr"], weight_decay=group["weight_decay"],
                         adjust_lr_fn=group["adjust_lr_fn"], matrix_shape=info.matrix_shape,
                         extra_scale_factor=group["extra_scale_factor"],
                         cautious_weight_decay=group["cautious_weight_decay"])

    def independent(self) -> None:
        for group in self.opt.param_groups:
            if group["algorithm"] == "adamw":
                adamw_group_step(group, self.opt.state)

    def checked_gradients(self) -> list[tuple[str, torch.Tensor | None]]:
        names = self.opt.param_names
        return [(names.get(id(p), "?"), p.grad) for g in self.opt.param_groups if g["algorithm"] == "adamw"
                for p in g["params"]]
