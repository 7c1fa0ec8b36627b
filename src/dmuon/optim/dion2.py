"""Dion2: Muon on the rows of largest L1 norm only, with error feedback, exactly on FSDP2/HSDP/TP."""

from __future__ import annotations

import math
from typing import Any

import torch

from dmuon.optim.callbacks import MuonFamily
from dmuon.optim.dmuon import DMuon
from dmuon.ortho.owner import owner_update
from dmuon.rules import dion2


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


class Dion2(DMuon):
    """Dion2 (Ahn et al., arXiv 2512.16928; microsoft/dion's ``Dion2``) on the matrices, AdamW for
    everything else; everything else as :class:`DMuon`.

    Per matrix ``(m, n)`` (a conv kernel as ``(out, in * kernel)``, each expert of a stack alone), each
    step (:mod:`dmuon.rules.dion2`)::

        M += G                                          # every rank, its part (no momentum coefficient)
        S = the k rows of largest ||M[row]||_1, k = max(1, ceil(fraction * m))   # on the owner
        O = NS(M[S])                                    # the k x n submatrix, on the owner
        M[S] *= ef_decay                                # every rank, its rows
        W *= 1 - lr * weight_decay;  W[S] -= adjusted_lr(lr) * O

    The selection is exact and global (the owner holds the whole ``M``: dion's
    ``selection_scope="global"``), always over rows, so the result is the single-process rule's on
    any mesh. ``adjusted_lr`` is ``adjust_lr_fn`` (default ``"spectral_unclamped"``,
    ``lr * sqrt(m / n)``: dion's ``adjust_lr="spectral_norm"``). ``M`` is ``state["momentum_buffer"]``
    (float32, Muon's layout). The update travels as Muon's does (full size, zero rows outside ``S``):
    the same bytes as Muon; each rank finds ``S`` as its nonzero rows of the update.

    Args:
        model, plan, module: As :class:`DMuon`.
        lr: Learning rate of the matrices.
        fraction: The share of rows orthogonalized each step, in ``(0, 1]``; a param-group key too.
        ef_decay: The error-feedback decay of the selected rows, ``>= 0``; a param-group key too.
        weight_decay: Decoupled weight decay of the matrices (with the base ``lr``).
        adjust_lr_fn: The step's shape scaling (:data:`dmuon.rules.muon.ADJUST_LR_FNS`).
        **kwargs: :class:`DMuon`'s other keywords (the NS keywords and ``ns``, ``execution``, ``adamw``,
            ``hsdp_mesh``, ``qk_clip``, ``extra_scale_factor``, ``cautious_weight_decay``). ``momentum`` and
            ``nesterov`` are not Dion2's (its ``M`` is a plain sum): refused.
    """

    rule_callbacks = Dion2Callbacks

    def __init__(self, model=None, plan=None, *, lr: float = 0.01, fraction: float = 0.25, ef_decay: float = 0.95,
                 weight_decay: float = 0.01, adjust_lr_fn: str | None = "spectral_unclamped", **kwargs: Any) -> None:
        for key in ("momentum", "nesterov"):
            if key in kwargs:
                raise ValueError(f"Dion2 has no {key}: its buffer is the plain sum M += G, decayed by ef_decay "
                                 "where orthogonalized")
        _check_fraction("fraction", fraction)
        _check_ef_decay("ef_decay", ef_decay)
        self._dion2 = {"fraction": float(fraction), "ef_decay": float(ef_decay)}
        super().__init__(model, plan, lr=lr, weight_decay=weight_decay, adjust_lr_fn=adjust_lr_fn, **kwargs)

    def _rule_defaults(self) -> dict[str, Any]:
        return dict(self._dion2)

    def check_rule_keys(self, group: dict[str, Any]) -> None:
        """As :meth:`DMuon.check_rule_keys`; a matrix group's ``fraction`` must be in ``(0, 1]`` and its
        ``ef_decay`` a finite number ``>= 0``."""
        super().check_rule_keys(group)
        index = next((k for k, g in enumerate(self.__dict__.get("param_groups", [])) if g is group),
                     len(self.__dict__.get("param_groups", [])))
        _check_fraction(f"param group {index}: fraction", group["fraction"])
        _check_ef_decay(f"param group {index}: ef_decay", group["ef_decay"])


def _number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def _check_fraction(name: str, value: Any) -> None:
    if not _number(value) or not 0.0 < value <= 1.0:
        raise ValueError(f"{name} must be a number in (0, 1], got {value!r}")


def _check_ef_decay(name: str, value: Any) -> None:
    if not _number(value) or value < 0.0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
