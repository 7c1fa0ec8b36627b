"""What every matrix rule's runtime callbacks share, on the optimizer's param groups and state: what they read
of the optimizer (:class:`RuleHost`), Muon's family (:class:`MuonFamily`: momentum, NS, the shape-scaled step,
AdamW for the rest, QK-clip's maxima) and torch.optim.Muon's rule (:class:`MuonCallbacks`), which NorMuon and
MuonH extend. Each other rule's callbacks sit beside its optimizer and settings: :mod:`dmuon.optim.normuon`,
:mod:`dmuon.optim.muonh`, :mod:`dmuon.optim.dion2`."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from dmuon.optim.momentum import MomentumLayout
from dmuon.optim.qk_clip import AttentionClip
from dmuon.ortho.config import NSConfig
from dmuon.ortho.owner import owner_update
from dmuon.rules.adamw import adamw_group_step
from dmuon.rules.muon import (HostAlphas, apply_update, momentum_after, momentum_update, peek_direction,
                              rescaled_direction, scalar_lr)
from dmuon.plan.plan import Plan
from dmuon.runtime.callbacks import CheckedGradients, Rescalable, StepCallbacks, StepMaxima
from dmuon.util.dtensor import local_tensor
from dmuon.util.observe import ranged


class RuleHost(Protocol):
    """What the callbacks read of their optimizer (:class:`dmuon.optim.dmuon.DMuon`), at each call:
    a state-dict load replaces its param groups and state."""

    plan: Plan
    ns: NSConfig
    momentum: MomentumLayout
    param_names: dict[int, str]
    """Parameter id -> its name in the model."""
    state: Any
    """torch.optim.Optimizer's per-parameter state."""
    param_groups: list[dict[str, Any]]

    @property
    def attention_clip(self) -> AttentionClip | None: ...

    def matrix_indices(self, param: torch.Tensor) -> list[int]: ...

    def check_ns_keys(self, group: dict[str, Any]) -> None: ...

    def check_rule_keys(self, group: dict[str, Any]) -> None: ...


class MuonFamily(StepCallbacks, StepMaxima, CheckedGradients):
    """What torch.optim.Muon's rule and the rules built on it share: Muon's momentum, NS and
    shape-scaled step for the matrices, AdamW for everything else (its gradients checked with
    ``nonfinite=``), QK-clip's maxima when the optimizer has one.

    Reads the optimizer's param groups and state at each call (a state-dict load
    replaces both), so it holds the optimizer, not its containers.
    """

    def __init__(self, optimizer: RuleHost) -> None:
        self.opt = optimizer
        self.plan = optimizer.plan
        self._column = self.plan.position[1]
        self._host_alphas = HostAlphas()
        self._held_settings: dict[int, dict] | None = None  # hold_settings
        self._shapes = {info.index: info.matrix_shape for info in self.plan.infos}

    # ----------------------------------------------------------------- helpers
    def _groups(self) -> dict[int, dict]:
        """Plan index -> its param group, for every matrix of the matrix rule (``"muon"`` groups)."""
        opt = self.opt
        return {i: g for g in opt.param_groups if g["algorithm"] == "muon" for p in g["params"]
                for i in opt.matrix_indices(p)}

    def hold_settings(self) -> None:
        """The settings the step just taken applies its updates with, kept for :meth:`apply`: under
        ``apply_updates="next_forward"`` the updates land in the next forward, after the caller's code
        between (an lr scheduler's ``step()``), and torch.optim.Muon applies a step's update with that
        step's ``lr`` and ``weight_decay``. A tensor ``lr`` is copied (a scheduler may change it in place)."""
        groups = self._groups()
        unique = {id(g): g for g in groups.values()}  # one copy per group, not per matrix
        copies = {key: {k: v.detach().clone() if isinstance(v, torch.Tensor) else v
                        for k, v in g.items() if k != "params"} for key, g in unique.items()}
        self._held_settings = {i: copies[id(g)] for i, g in groups.items()}

    def _apply_groups(self) -> dict[int, dict]:
        """Plan index -> the settings its update applies with: those :meth:`hold_settings` kept, else the
        param group's as it is."""
        return self._held_settings if self._held_settings is not None else self._groups()

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
    def apply(self, updates: dict[int, torch.Tensor], rows: dict[int, torch.Tensor] | None = None) -> None:
        # Muon keeps no row state (``rows`` is None).
        groups = self._apply_groups()
        alphas = self._host_alphas.get(groups, self._shapes)  # a tensor lr: one read for every matrix
        for i, update in updates.items():
            info, group = self.plan.infos[i], groups[i]
            apply_update(self._local(i, info.param), update, lr=scalar_lr(group["lr"]),
                         weight_decay=group["weight_decay"],
                         adjust_lr_fn=group["adjust_lr_fn"], matrix_shape=info.matrix_shape,
                         extra_scale_factor=group["extra_scale_factor"],
                         cautious_weight_decay=group["cautious_weight_decay"], alpha=alphas.get(i))

    @ranged("adamw")
    def independent(self) -> None:
        for group in self.opt.param_groups:
            if group["algorithm"] == "adamw":
                adamw_group_step(group, self.opt.state)

    def step_maxima(self) -> torch.Tensor | None:
        # QK-clip's per-key-head logit maxima, agreed over every rank with the step's flags.
        qk = self.opt.attention_clip
        return None if qk is None else qk.step_maxima()

    def finish_step(self, active: list[int], maxima: torch.Tensor) -> None:
        if self.opt.attention_clip is not None:
            self.opt.attention_clip.clip(self.plan, active, maxima)

    def checked_gradients(self) -> list[tuple[str, torch.Tensor | None]]:
        names = self.opt.param_names
        return [(names.get(id(p), "?"), p.grad) for g in self.opt.param_groups if g["algorithm"] == "adamw"
                for p in g["params"]]


class MuonCallbacks(MuonFamily, Rescalable):
    """torch.optim.Muon's rule (:class:`MuonFamily`), rescalable: with ``clipped_overlap`` a launch whose
    gradients were since clipped still stands, the owner forming the clipped direction from its copy
    of the momentum (:mod:`dmuon.runtime.owner_momentum`)."""

    def rescale_direction(self, index: int, launched: torch.Tensor, momentum: torch.Tensor,
                          scale: float) -> torch.Tensor:
        group = self._groups()[index]
        return rescaled_direction(launched, momentum, scale, group["momentum"], group["nesterov"])

    def advance_momentum(self, index: int, momentum: torch.Tensor, direction: torch.Tensor) -> None:
        group = self._groups()[index]
        momentum_after(momentum, direction, group["momentum"], group["nesterov"])

    def momentum_parts(self, members: list[int]) -> dict[int, torch.Tensor]:
        r = self.plan.position[0]
        out = {}
        for i in members:
            info = self.plan.infos[i]
            buf = self.opt.state[info.param].get("momentum_buffer")
            out[i] = (torch.zeros(info.momentum_numel(r, self._column), device=self.plan.device) if buf is None
                      else self._local(i, buf))
        return out
