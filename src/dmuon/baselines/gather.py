"""Gather-then-compute: the naive Muon port that dmuon exists to beat.

Every rank all-gathers every matrix's (sharded) update direction, runs
Newton-Schulz on all of them, and keeps its own shard of the result. The
math is the same as :class:`dmuon.DMuon`; only the work distribution differs.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from dmuon.util.dtensor import local_tensor
from dmuon.util.torch_compat import local_shape_and_offset

from dmuon.optim.groups import canonical_name
from dmuon.optim.qk_clip import AttentionClip
from dmuon.ortho import KELLER, NSConfig
from dmuon.ortho.owner import owner_update
from dmuon.plan.selection import SelectFn, ViewFn, matrix_views, row_sizes, select_matrices
from dmuon.rules import dion2, muonh
from dmuon.rules.adamw import adamw_group_step
from dmuon.rules.muon import adjusted_lr, apply_update, check_rule_settings, fill_rule_defaults, momentum_update
from dmuon.rules.normuon import normalize_rows
from dmuon.rules.qk_clip import QKClip


def _matrix_shape(shape) -> tuple[int, int]:
    return (shape[0], int(torch.Size(shape[1:]).numel()))


class GatherThenCompute(torch.optim.Optimizer):
    """Muon on an ordinary FSDP2 model by gathering every matrix everywhere.

    Takes the same keyword arguments as :class:`dmuon.DMuon` (minus the plan),
    plus ``select`` to override which parameters are Muon matrices and
    ``matrix_view`` (as :func:`dmuon.prepare`'s: stacks of experts are
    orthogonalized slice by slice, row groups, equal or not, group by group,
    each group's step scaled for its own shape). ``beta2`` runs NorMuon's rule
    instead (:class:`dmuon.NorMuon`'s): every rank keeps every matrix's whole
    per-row second moment and normalizes its whole update. ``rule="muonh"`` runs
    :class:`dmuon.MuonH`'s (every rank gathers each weight to take its norms, no weight decay),
    ``rule="dion2"`` :class:`dmuon.Dion2`'s (``fraction``, ``ef_decay``: every rank selects the
    rows on the whole gathered buffer and decays its own rows of it). ``qk_clip`` runs QK-clip after the
    update the naive way (:meth:`report_attention_logits` as :class:`dmuon.DMuon`'s; the maxima
    all-reduced over every rank in a collective of their own; each rank scales its rows of the
    query and key parameters), the oracle for dmuon's clip inside the step.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients=KELLER,
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
        extra_scale_factor: float = 1.0,
        cautious_weight_decay: bool = False,
        ns_method: str = "auto",
        ns_dtype: torch.dtype = torch.bfloat16,
        adamw_lr: float | None = None,
        adamw_betas: tuple[float, float] = (0.9, 0.999),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 0.01,
        select: SelectFn | None = None,
        matrix_view: ViewFn | dict[str, str] | None = None,
        beta2: float | None = None,
        qk_clip: QKClip | None = None,
        rule: str = "muon",
        fraction: float = 0.25,
        ef_decay: float = 0.95,
    ) -> None:
        check_rule_settings(adjust_lr_fn, extra_scale_factor, cautious_weight_decay)
        _check_gather_settings(rule, weight_decay, beta2, qk_clip)
        self.rule, self._fraction, self._ef_decay = rule, fraction, ef_decay
        self.qk_clip = qk_clip
        self._params_by_name = {canonical_name(n): p for n, p in model.named_parameters()}
        self._qk = None if qk_clip is None else AttentionClip(
            qk_clip, self._params_by_name, {id(p): n for n, p in self._params_by_name.items()})
        matrices = self._select(model, select, matrix_view)
        ids = {id(p) for p in matrices}
        others = [p for p in model.parameters() if id(p) not in ids]
        self.ns = NSConfig.from_keywords(ns_method=ns_method, ns_coefficients=ns_coefficients, ns_steps=ns_steps,
                                         eps=eps, ns_dtype=ns_dtype)
        groups = [
            dict(params=matrices, algorithm="muon", lr=lr, weight_decay=weight_decay, momentum=momentum,
                 nesterov=nesterov, ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps,
                 adjust_lr_fn=adjust_lr_fn, extra_scale_factor=extra_scale_factor,
                 cautious_weight_decay=cautious_weight_decay, beta2=beta2),
            dict(params=others, algorithm="adamw", lr=lr if adamw_lr is None else adamw_lr,
                 betas=adamw_betas, eps=adamw_eps, weight_decay=adamw_weight_decay, foreach=None),
        ]
        super().__init__([g for g in groups if g["params"]], defaults={})
        self._last_stats: dict[str, Any] = {}

    def _select(self, model: nn.Module, select: SelectFn | None, matrix_view) -> list[torch.Tensor]:
        """The Muon matrices, in the model's order; records which are stacks of experts and which row
        groups, each slice or group orthogonalized on its own, as DMuon does."""
        chosen = select_matrices(model, select)
        views = matrix_views(model, chosen, matrix_view)
        self._slices = {id(p): (p.shape[0], _matrix_shape(p.shape[1:])) for n, p in chosen if views[n] == "stack"}
        sizes = {id(p): row_sizes(views[n], p.shape[0]) for n, p in chosen}
        self._row_sizes = {k: v for k, v in sizes.items() if v is not None}
        return [p for _, p in chosen]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        start = time.perf_counter()
        totals = {"orthogonalized": 0, "bytes_sent": 0, "bytes_received": 0, "ns_seconds": 0.0}
        for group in self.param_groups:
            if group["algorithm"] == "adamw":
                adamw_group_step(group, self.state)
                continue
            for p in group["params"]:
                if p.grad is not None:
                    self._matrix_step(p, group, totals)
        if self._qk is not None:
            self._clip_qk()
        # orthogonalized: matrices (slices of a stack or row groups each count) this step ran NS for.
        self._last_stats = {**totals, "step_seconds": time.perf_counter() - start}
        return loss

    def _matrix_step(self, p: torch.Tensor, group: dict, totals: dict) -> None:
        """One matrix parameter's step: its direction gathered whole, NS on every slice or row group, the
        update applied to this rank's rows; adds the bytes, NS seconds and matrices to ``totals``."""
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p.grad, dtype=torch.float32)
        if self.rule == "dion2":
            direction = state["momentum_buffer"].add_(p.grad.to(torch.float32))  # M += G
        else:
            direction = momentum_update(p.grad, state["momentum_buffer"], group["momentum"], group["nesterov"])
        # NS takes its input in ns_dtype, so the gather moves that.
        full = self._gather(direction.to(self.ns.dtype), totals)
        sizes = self._row_sizes.get(id(p))
        if sizes is not None:
            mshape = _matrix_shape(p.shape)
            inputs = list(full.reshape(mshape).split(sizes))
        else:
            slices, mshape = self._slices.get(id(p), (1, _matrix_shape(p.shape)))
            inputs = list(full.reshape(slices, *mshape))
        t0 = time.perf_counter()
        orthos = self._orthogonalize(inputs, state, group, full.device)
        totals["ns_seconds"] += time.perf_counter() - t0
        totals["orthogonalized"] += len(inputs)
        if self.rule == "muonh":
            self._muonh_step(p, state, orthos, group, sizes)
        else:
            self._apply(p, state, torch.cat(orthos).reshape(p.shape).to(p.dtype), group, sizes, mshape)

    @staticmethod
    def _gather(direction: torch.Tensor, totals: dict) -> torch.Tensor:
        """``direction`` whole on this rank (an all-gather of a DTensor's shards); adds its bytes to ``totals``."""
        if not isinstance(direction, DTensor):
            return direction
        local = direction.to_local().numel()
        full = direction.full_tensor()
        world = direction.device_mesh.size()
        totals["bytes_sent"] += local * (world - 1) * full.element_size()
        totals["bytes_received"] += (full.numel() - local) * full.element_size()
        return full

    def _orthogonalize(self, inputs: list[torch.Tensor], state: dict, group: dict, device) -> list[torch.Tensor]:
        """NS on every slice or row group (Dion2: on its selected rows), then MuonH's normalization or
        NorMuon's per-row second moment where the rule has them."""
        if self.rule == "dion2":
            orthos = dion2.owner_updates(inputs, [self._fraction] * len(inputs),
                                         lambda subs: owner_update(subs, self.ns, group))
        else:
            orthos = owner_update(inputs, self.ns, group)
        if self.rule == "muonh":
            orthos = muonh.normalize(orthos, self.ns.eps)
        if group["beta2"] is None:
            return orthos
        # One second moment per row of the parameter: each slice's or group's rows in turn.
        heights = [o.shape[0] for o in orthos]
        if "second_momentum_buffer" not in state:
            state["second_momentum_buffer"] = torch.zeros(sum(heights), 1, device=device)
        normalized = []
        for ortho, second in zip(orthos, state["second_momentum_buffer"].split(heights)):
            (update,), (moment,) = normalize_rows([ortho], [second], [group["beta2"]])
            second.copy_(moment)
            normalized.append(update)
        return normalized

    def _apply(self, p: torch.Tensor, state: dict, ortho: torch.Tensor, group: dict,
               sizes: tuple[int, ...] | None, mshape: tuple[int, int]) -> None:
        """This rank's rows of the whole update ``ortho`` applied to ``p`` (Dion2: its selected rows of the
        buffer decayed first)."""
        if isinstance(p, DTensor):
            # Keep only this rank's rows; splitting locally needs no communication.
            ortho = distribute_tensor(ortho, p.device_mesh, p.placements, src_data_rank=None)
        rule = dict(lr=group["lr"], weight_decay=group["weight_decay"], adjust_lr_fn=group["adjust_lr_fn"],
                    extra_scale_factor=group["extra_scale_factor"],
                    cautious_weight_decay=group["cautious_weight_decay"])
        if self.rule == "dion2" and local_tensor(ortho).numel():
            # Each rank decays its rows of the buffer that were selected: the nonzero rows of its update.
            cols = mshape[1]
            dion2.decay_selected(local_tensor(state["momentum_buffer"]).view(-1, cols),
                                 dion2.selected_rows(local_tensor(ortho).reshape(-1, cols)), self._ef_decay)
        if sizes is not None:
            _apply_by_row_group(p, ortho, sizes, rule)
        else:
            apply_update(p, ortho, matrix_shape=mshape, **rule)

    def _muonh_step(self, p: torch.Tensor, state: dict, units: list[torch.Tensor], group: dict,
                    sizes: tuple[int, ...] | None) -> None:
        """MuonH on the whole gathered weight, every matrix of ``p`` (a slice of a stack, a row group) on
        its own sphere; each rank keeps its rows. ``units``: each matrix's ``u / ||u||``."""
        eps = self.ns.eps
        weight = (p.full_tensor() if isinstance(p, DTensor) else p.detach()).to(torch.float32)
        pieces = list(weight.reshape(_matrix_shape(p.shape)).split(sizes)) if sizes is not None else \
            list(weight.reshape(len(units), *units[0].shape))
        if "initial_norm" not in state:
            state["initial_norm"] = torch.stack([muonh.radius(muonh.sum_of_squares(w), eps) for w in pieces])
        for k, (w, u) in enumerate(zip(pieces, units)):
            r = state["initial_norm"][k]
            scaled = adjusted_lr(group["lr"], group["adjust_lr_fn"], tuple(w.shape)) * group["extra_scale_factor"]
            muonh.step(w, u, r, scaled)
            muonh.project(w, r, muonh.sum_of_squares(w), eps)
        updated = torch.cat([w.reshape(-1) for w in pieces]).view(p.shape).to(p.dtype)
        if isinstance(p, DTensor):
            updated = distribute_tensor(updated, p.device_mesh, p.placements, src_data_rank=None)
        local_tensor(p).copy_(local_tensor(updated))

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        fill_rule_defaults(self.__dict__.get("param_groups", []))

    def last_step_stats(self) -> dict[str, Any]:
        """Same keys as :meth:`dmuon.DMuon.last_step_stats` (bytes estimated from the gathers)."""
        return dict(self._last_stats)

    def report_attention_logits(self, layer: str, max_logits: torch.Tensor, first_head: int = 0) -> None:
        """As :meth:`dmuon.DMuon.report_attention_logits`."""
        if self._qk is None:
            raise ValueError("report_attention_logits needs QK-clip: build the optimizer with "
                             "qk_clip=dmuon.QKClip(layers={...})")
        self._qk.report(layer, max_logits, first_head)

    def last_attention_logits(self) -> dict[str, torch.Tensor]:
        """As :meth:`dmuon.DMuon.last_attention_logits`."""
        return {} if self._qk is None else dict(self._qk.last_maxima)

    @torch.no_grad()
    def _clip_qk(self) -> None:
        """QK-clip after the update: the maxima over every rank by an all-reduce of their own, then
        per parameter one factor per row, cut to each rank's box like the update (any placements)."""
        qk, config = self._qk, self.qk_clip
        maxima = qk.step_maxima()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(maxima, op=dist.ReduceOp.MAX)
        qk.reset()
        gamma = qk.agreed(maxima.cpu())
        factors: dict[str, torch.Tensor] = {}  # parameter name -> one float32 factor per row
        for key in config.order:
            scaled = config.layers[key].scaled_rows(config.alpha)
            for which, name in zip(("query", "key"), qk.param_names[key]):
                rows, heads, powers = scaled[which]
                factor = factors.setdefault(name, torch.ones(self._params_by_name[name].shape[0]))
                factor[rows] = gamma[heads + qk.kv_start[key]] ** powers
        for name, factor in factors.items():
            p = self._params_by_name[name]
            full = factor.view(-1, *[1] * (p.ndim - 1)).expand(p.shape).contiguous().to(p.device)
            if isinstance(p, DTensor):
                full = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
            local_tensor(p).mul_(local_tensor(full))


RULES = ("muon", "muonh", "dion2")
"""The matrix rules the oracle runs (NorMuon: ``rule="muon"`` with ``beta2``)."""


def _check_gather_settings(rule: str, weight_decay: float, beta2: float | None, qk_clip) -> None:
    """Refuses a rule the oracle lacks, MuonH with weight decay, NorMuon's ``beta2`` on another rule and a
    ``qk_clip`` that is not a :class:`dmuon.QKClip`."""
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
    if rule == "muonh" and weight_decay:
        raise ValueError(f"weight_decay must be 0 with rule='muonh' (the sphere replaces it), got {weight_decay!r}")
    if rule != "muon" and beta2 is not None:
        raise ValueError(f"beta2 is NorMuon's (rule='muon' with beta2), not rule={rule!r}'s")
    if qk_clip is not None and not isinstance(qk_clip, QKClip):
        raise ValueError(f"qk_clip must be a dmuon.QKClip, got {type(qk_clip).__name__}")


def _apply_by_row_group(param: torch.Tensor, ortho: torch.Tensor, sizes: tuple[int, ...], rule: dict) -> None:
    """The update of a row-group view, group by group on this rank's rows: each group's step is
    scaled for its own ``(rows, cols)`` (unequal groups get unequal steps), as separate parameters
    would be (dion's ``split_sizes`` too)."""
    local, update = local_tensor(param), local_tensor(ortho)
    if local.shape[0] == 0:
        return
    first = 0
    if isinstance(param, DTensor):
        # The box this rank holds (the layouts dmuon supports: a contiguous box; prepare checks it).
        first = local_shape_and_offset(param.shape, param.device_mesh, param.placements)[1][0]
    cols = _matrix_shape(param.shape)[1]
    for start, count in zip(itertools.accumulate((0, *sizes)), sizes):
        low, high = max(start, first), min(start + count, first + local.shape[0])
        if low < high:
            apply_update(local.narrow(0, low - first, high - low), update.narrow(0, low - first, high - low),
                         matrix_shape=(count, cols), **rule)
