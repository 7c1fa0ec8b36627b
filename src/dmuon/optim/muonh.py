"""MuonH (Muon Hyperball): Muon's direction, each matrix kept on the sphere of its initial norm, exactly
on FSDP2/HSDP/TP."""

from __future__ import annotations

from typing import Any

import torch

from dmuon.optim.callbacks import MuonCallbacks
from dmuon.optim.dmuon import DMuon
from dmuon.optim.momentum import MomentumLayout
from dmuon.ortho.owner import owner_update
from dmuon.rules import muonh
from dmuon.rules.muon import adjusted_lr, scalar_lr
from dmuon.runtime.callbacks import WeightSums
from dmuon.util.dtensor import local_tensor


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


class MuonH(DMuon):
    """MuonH (Wen et al., arXiv 2606.16899) on the matrices, AdamW for everything else; everything
    else as :class:`DMuon`.

    Per matrix, each step (:mod:`dmuon.rules.muonh`)::

        R = max(||W_0||_F, eps)                        # at the matrix's first applied step
        M.lerp_(G, 1 - momentum);  D = G.lerp(M, momentum) if nesterov else M
        u = NS(D)                                       # on the matrix's owner
        N = u / max(||u||_F, eps)                       # on the owner (the whole u)
        W = W - adjusted_lr(lr) * R * N                 # every rank, its rows
        W = R * W / max(||W||_F, eps)                   # ||W||: one all-gather per step

    ``eps`` is the NS epsilon (1e-7) and ``adjusted_lr`` Muon's shape scaling (``adjust_lr_fn``,
    torch's default ``sqrt(max(1, m/n))``; ``"unscaled"`` gives the paper's formula without it):
    the authors' reference implementation's conventions. No weight decay (the sphere replaces it):
    a nonzero ``weight_decay`` of a matrix group is refused, naming the group.

    ``||W||`` needs every rank's piece of the weight: each rank adds its piece's squares and the
    runtime sums them over the ranks that split the matrix (FSDP2's shards and TP; not across HSDP's
    replicas, which hold the same weights) in one float32 all-gather of one value per updated matrix,
    after the step's last update (:mod:`dmuon.runtime.matrix_norms`); a matrix's first step adds one
    more, before its update, for ``R``. With ``ExecutionConfig(apply_updates="next_forward")`` the
    sums after each update are computed in ``step()`` (the update applied to a copy) and all-gathered
    per return, so the next forward's projections need no collective. ``R`` is ``state["initial_norm"]`` (float32, one value per
    matrix of the parameter; a ``Replicate`` DTensor: DCP saves it, a resumed run keeps its sphere).
    A skipped step (``nonfinite="skip"``) updates nothing and renormalizes nothing (and sets no ``R``).

    Args:
        model, plan, module: As :class:`DMuon`.
        lr: Learning rate of the matrices (the step is ``adjusted_lr * R`` long).
        momentum: Momentum (``beta1``).
        nesterov: Nesterov momentum.
        weight_decay: Must be 0 (the matrices' groups too); the other parameters' is ``adamw``'s.
        **kwargs: :class:`DMuon`'s other keywords (``adjust_lr_fn``, ``extra_scale_factor``, the NS
            keywords and ``ns``, ``execution``, ``adamw``, ``hsdp_mesh``). Not ``qk_clip``: clipping scales
            rows off the sphere the next step would put them back on; refused.

    Raises:
        ValueError: A nonzero ``weight_decay`` (naming the group), or ``qk_clip``.
    """

    rule_callbacks = MuonHCallbacks
    matrix_state = {**DMuon.matrix_state, MuonHCallbacks.STATE: MomentumLayout.scalar_layout_for}

    def __init__(self, model=None, plan=None, *, lr: float = 1e-3, momentum: float = 0.95, nesterov: bool = True,
                 weight_decay: float = 0.0, **kwargs: Any) -> None:
        _check_no_decay("weight_decay", weight_decay)
        if kwargs.get("qk_clip") is not None:
            raise ValueError("MuonH does not support qk_clip: the clip scales query/key rows off the sphere "
                             "||W|| = R that MuonH keeps each matrix on; use DMuon or Dion2 for QK-clip")
        super().__init__(model, plan, lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                         **kwargs)

    def check_rule_keys(self, group: dict[str, Any]) -> None:
        """As :meth:`DMuon.check_rule_keys`; a matrix group's ``weight_decay`` must also be 0."""
        super().check_rule_keys(group)
        index = next((k for k, g in enumerate(self.__dict__.get("param_groups", [])) if g is group),
                     len(self.__dict__.get("param_groups", [])))
        _check_no_decay(f"param group {index}: weight_decay", group["weight_decay"])


def _check_no_decay(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != 0:
        raise ValueError(f"{name}={value!r}: MuonH keeps each matrix on the sphere of its initial norm, which "
                         "replaces weight decay; set it to 0 for the matrices (adamw=dmuon.AdamWConfig("
                         "weight_decay=...) sets the other parameters')")
