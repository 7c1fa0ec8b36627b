"""The matrix rules as the runtime's callbacks, on the optimizer's param groups and state:
torch.optim.Muon's (:class:`MuonCallbacks`), NorMuon's (:class:`NorMuonCallbacks`), MuonH's
(:class:`MuonHCallbacks`) and Dion2's (:class:`Dion2Callbacks`)."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from dmuon.optim.momentum import MomentumLayout
from dmuon.optim.qk_clip import AttentionClip
from dmuon.ortho.config import NSConfig
from dmuon.ortho.owner import owner_update
from dmuon.rules import dion2, muonh
from dmuon.rules.adamw import adamw_group_step
from dmuon.rules.muon import (HostAlphas, adjusted_lr, apply_update, momentum_after, momentum_update, peek_direction,
                              rescaled_direction, scalar_lr)
from dmuon.rules.normuon import normalize_rows
from dmuon.plan.plan import Plan
from dmuon.runtime.callbacks import CheckedGradients, Rescalable, RowState, StepCallbacks, StepMaxima, WeightSums
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


class NorMuonCallbacks(MuonCallbacks, RowState):
    """NorMuon: Muon's momentum and step, with the owner normalizing each output row
    (:mod:`dmuon.rules.normuon`) by a per-row second moment that travels as the row state.

    The second moment (``state["second_momentum_buffer"]``, float32, one value per output
    row: ``(*param.shape[:param_dim], 1)``) is sharded with the parameter's rows and kept by
    every holder of a row (:meth:`dmuon.optim.momentum.MomentumLayout.row_layout_for`).
    """

    row_width = 1
    STATE = "second_momentum_buffer"

    def __init__(self, optimizer: RuleHost) -> None:
        super().__init__(optimizer)
        self._views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _state_rows(self, index: int, buffer: torch.Tensor) -> torch.Tensor:
        """Matrix ``index``'s rows of this rank's shard of a second-moment buffer, ``(rows, 1)``.

        Kept per buffer object (a DTensor's ``to_local`` costs more than the rest of a row's work;
        a state load puts in new buffers, which get new views)."""
        cached = self._views.get(index)
        if cached is not None and cached[0] is buffer:
            return cached[1]
        view = self.plan.infos[index].local_view(local_tensor(buffer), self._column)
        self._views[index] = (buffer, view)
        return view

    def row_states(self, members: list[int]) -> dict[int, torch.Tensor]:
        out = {}
        for i in members:
            info = self.plan.infos[i]
            buf = self.opt.state[info.param].get(self.STATE)
            # A matrix not stepped yet: the zeros its buffer will start from.
            out[i] = (torch.zeros(info.pieces[self._column].rows, 1, device=self.plan.device) if buf is None
                      else self._state_rows(i, buf))
        return out

    @torch.no_grad()
    def commit(self, members: list[int], grads: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        for i in members:
            info = self.plan.infos[i]
            state = self.opt.state[info.param]
            if self.STATE not in state:
                state[self.STATE] = self.opt.momentum.new_row_buffer(info, self.row_width)
        return super().commit(members, grads)

    def owner_work(self, batch: list[int], directions: list[torch.Tensor],
                   rows: list[torch.Tensor] | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        groups = self._groups()
        return normalize_rows(owner_update(directions, self.opt.ns), rows, [groups[i]["beta2"] for i in batch])

    @torch.no_grad()
    def apply(self, updates: dict[int, torch.Tensor], rows: dict[int, torch.Tensor] | None = None) -> None:
        super().apply(updates)
        for i, new in rows.items():
            self._state_rows(i, self.opt.state[self.plan.infos[i].param][self.STATE]).copy_(new)


class MuonHCallbacks(MuonCallbacks, WeightSums):
    """MuonH (:mod:`dmuon.rules.muonh`): Muon's momentum and NS, the owner dividing each update by its
    Frobenius norm, every rank stepping its rows by ``adjusted_lr * R`` and then putting its piece
    back on the sphere with the whole matrix's norm (the runtime's sums over the weight).

    ``R`` (``state["initial_norm"]``: float32, one value per matrix of the parameter, ``(1,)`` for a
    matrix, ``(E,)`` for a stack of ``E`` experts or row groups) is the weight's norm before the
    matrix's first applied step, kept on every rank (a ``Replicate`` DTensor on the parameter's
    mesh: DCP saves and reshards it). Momentum, Nesterov and the clipping rescale are Muon's.
    """

    STATE = "initial_norm"

    def _radius(self, index: int) -> torch.Tensor:
        info = self.plan.infos[index]
        state = local_tensor(self.opt.state[info.param][self.STATE])
        return state[self.opt.matrix_indices(info.param).index(index)]

    def owner_work(self, batch: list[int], directions: list[torch.Tensor]) -> list[torch.Tensor]:
        return muonh.normalize(owner_update(directions, self.opt.ns), self.opt.ns.eps)

    def weight_sums(self, active: list[int], applied: bool) -> dict[int, torch.Tensor]:
        infos, state = self.plan.infos, self.opt.state
        wanted = active if applied else [i for i in active if self.STATE not in state[infos[i].param]]
        return {i: muonh.sum_of_squares(self._local(i, infos[i].param)) for i in wanted}

    @torch.no_grad()
    def weight_sums_after(self, members: list[int], updates: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        infos, groups, out = self.plan.infos, self._groups(), {}
        for i in members:
            part = self._local(i, infos[i].param)
            if i in updates:
                part = part.clone(memory_format=torch.contiguous_format)  # apply's own step, on a copy
                muonh.step(part, updates[i], self._radius(i), self._scaled_lr(i, groups[i]))
            out[i] = muonh.sum_of_squares(part)
        return out

    @torch.no_grad()
    def weight_totals(self, totals: dict[int, torch.Tensor], applied: bool) -> None:
        infos, eps = self.plan.infos, self.opt.ns.eps
        for i, total in totals.items():
            info = infos[i]
            if applied:
                muonh.project(self._local(i, info.param), self._radius(i), total, eps)
                continue
            state = self.opt.state[info.param]
            if self.STATE not in state:
                state[self.STATE] = self.opt.momentum.new_scalar_buffer(info, len(self.opt.matrix_indices(info.param)))
            local_tensor(state[self.STATE])[self.opt.matrix_indices(info.param).index(i)] = muonh.radius(total, eps)

    @torch.no_grad()
    def apply(self, updates: dict[int, torch.Tensor], rows: dict[int, torch.Tensor] | None = None) -> None:
        groups = self._apply_groups()
        for i, update in updates.items():
            muonh.step(self._local(i, self.plan.infos[i].param), update, self._radius(i), self._scaled_lr(i, groups[i]))

    def _scaled_lr(self, index: int, group: dict) -> float:
        """Matrix ``index``'s step length before ``R``: Muon's shape-adjusted learning rate."""
        return (adjusted_lr(scalar_lr(group["lr"]), group["adjust_lr_fn"], self.plan.infos[index].matrix_shape)
                * group["extra_scale_factor"])


class Dion2Callbacks(MuonFamily):
    """Dion2 (:mod:`dmuon.rules.dion2`): ``M += G`` on every rank (``state["momentum_buffer"]``, Muon's
    layout), the owner selecting the top rows of the whole ``M`` and orthogonalizing them, every rank
    decaying the selected rows of its part of ``M`` (the nonzero rows of its returned update) and
    applying Muon's decoupled decay and step (``adjust_lr_fn``, default ``"spectral_unclamped"``).

    Not :class:`~dmuon.runtime.callbacks.Rescalable`: the owners' momentum copies of ``clipped_overlap``
    would have to follow the owners' selection; a launch whose gradients were since scaled is exchanged
    again instead.
    """

    @torch.no_grad()
    def peek(self, members: list[int], grads: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        out = {}
        for i in members:
            buf = self.opt.state[self.plan.infos[i].param].get("momentum_buffer")
            g = grads[i].to(torch.float32)
            # The same kernel as commit's add_ on the same numbers (a fresh buffer is zeros): bit-identical.
            out[i] = self._wire((torch.zeros_like(g) if buf is None else self._local(i, buf)).add(g))
        return out

    @torch.no_grad()
    def commit(self, members: list[int], grads: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        out = {}
        for i in members:
            info = self.plan.infos[i]
            state = self.opt.state[info.param]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = self.opt.momentum.new_buffer(info)
            buf = self._local(i, state["momentum_buffer"])
            out[i] = self._wire(buf.add_(grads[i].to(torch.float32)))
        return out

    def owner_work(self, batch: list[int], directions: list[torch.Tensor]) -> list[torch.Tensor]:
        groups = self._groups()
        return dion2.owner_updates(directions, [groups[i]["fraction"] for i in batch],
                                   lambda subs: owner_update(subs, self.opt.ns))

    @torch.no_grad()
    def apply(self, updates: dict[int, torch.Tensor], rows: dict[int, torch.Tensor] | None = None) -> None:
        groups = self._apply_groups()
        for i, update in updates.items():
            info = self.plan.infos[i]
            buf = self.opt.state[info.param].get("momentum_buffer")
            if buf is not None:  # under DDP only the owner keeps the momentum
                dion2.decay_selected(self._local(i, buf), dion2.selected_rows(update), groups[i]["ef_decay"])
        super().apply(updates)
