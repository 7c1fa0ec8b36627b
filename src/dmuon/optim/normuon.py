"""NorMuon: Muon with each output row of the orthogonalized update normalized, exactly, on FSDP2/HSDP/TP."""

from __future__ import annotations

from typing import Any

import torch

from dmuon.optim.callbacks import MuonCallbacks, RuleHost
from dmuon.optim.dmuon import DMuon
from dmuon.optim.momentum import MomentumLayout
from dmuon.ortho.owner import owner_update
from dmuon.rules.normuon import normalize_rows
from dmuon.runtime.callbacks import RowState
from dmuon.util.dtensor import local_tensor


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


class NorMuon(DMuon):
    """NorMuon (zichongli5/NorMuon's ``SingleDeviceNorMuon``, in torch's conventions) on the matrices,
    AdamW for everything else; everything else as :class:`DMuon`.

    Per matrix, each step::

        M.lerp_(G, 1 - momentum);  D = G.lerp(M, momentum) if nesterov else M
        O = NS(D)                                            # on the matrix's owner
        v.lerp_(O.square().mean(dim=-1, keepdim=True), 1 - beta2)   # one value per output row
        O2 = O / (v.sqrt() + 1e-10);  O2 *= O.norm() / (O2.norm() + 1e-10)
        W.mul_(1 - lr * weight_decay);  W.add_(O2, alpha=-lr * sqrt(max(1, m / n)))

    The row statistics and both norms need the whole matrix, so they run on the owner
    with NS: the result is the single-process rule's on any mesh (no per-shard
    approximation). ``v`` (``state["second_momentum_buffer"]``, float32) is sharded
    with the parameter's rows as a DTensor (DCP saves and reshards it like the momentum;
    every holder of a row keeps its value: TP ranks splitting the row's columns, HSDP's
    replicas); it travels with the direction to the owner and back with the update,
    one float32 per row.

    Args:
        model, plan, module: As :class:`DMuon`.
        lr: Learning rate of the matrices.
        weight_decay: Decoupled weight decay of the matrices.
        momentum: Momentum (``beta1``).
        nesterov: Nesterov momentum.
        beta2: The per-row second moment's decay, in ``[0, 1)``; a param-group key too.
        **kwargs: :class:`DMuon`'s other keywords (``adjust_lr_fn``, ``extra_scale_factor``,
            ``cautious_weight_decay``, the NS keywords and ``ns``, ``execution``, ``adamw``, ``hsdp_mesh``,
            ``qk_clip``).
    """

    rule_callbacks = NorMuonCallbacks
    matrix_state = {**DMuon.matrix_state, NorMuonCallbacks.STATE: MomentumLayout.row_layout_for}

    def __init__(self, model=None, plan=None, *, lr: float = 0.02, weight_decay: float = 0.1,
                 momentum: float = 0.95, nesterov: bool = True, beta2: float = 0.95, **kwargs: Any) -> None:
        _check_beta2("beta2", beta2)
        self._beta2 = beta2
        super().__init__(model, plan, lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                         **kwargs)

    def _rule_defaults(self) -> dict[str, Any]:
        return {"beta2": self._beta2}

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As :meth:`DMuon.add_param_group`; a matrix group's ``beta2`` must be in ``[0, 1)``."""
        if param_group.get("algorithm") == "muon" and "beta2" in param_group:
            index = len(self.__dict__.get("param_groups", []))
            _check_beta2(f"param group {index}: beta2", param_group["beta2"])
        super().add_param_group(param_group)


def _check_beta2(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be a number in [0, 1), got {value!r}")
