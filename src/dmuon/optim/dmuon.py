"""DMuon: the optimizer front door.

One ``torch.optim.Optimizer`` for the whole model. Muon matrices (from the
plan) are updated owner-centrically; every other parameter stays under FSDP2
and follows ``torch.optim.AdamW``.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch import nn

from dmuon.optim.adamw import adamw_group_step
from dmuon.optim.muon import ADJUST_LR_FNS, apply_update, momentum_update
from dmuon.ortho import orthogonalize_many
from dmuon.plan.plan import Plan

NS_METHODS = ("auto", "standard", "standard32", "gram")
NONFINITE_MODES = (None, "skip", "raise")
KELLER_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def _check_nonnegative(name: str, value: float) -> None:
    if not value >= 0.0:
        raise ValueError(f"{name} must be >= 0, got {value}")


class DMuon(torch.optim.Optimizer):
    """Muon on FSDP2 with one owner per matrix, AdamW for everything else.

    Args:
        model: The model (after ``fully_shard``).
        plan: The plan ``dmuon.prepare`` returned for this model.
        lr: Muon learning rate.
        weight_decay: Muon decoupled weight decay.
        momentum: Muon momentum.
        nesterov: Nesterov momentum for Muon.
        ns_coefficients: Quintic Newton-Schulz coefficients ``(a, b, c)``, or
            ``"polar_express"`` for per-iteration Polar Express coefficients.
        eps: Floor of the norm NS divides by.
        ns_steps: Newton-Schulz iterations.
        adjust_lr_fn: ``None``/``"original"`` (Keller's scaling) or ``"match_rms_adamw"``.
        ns_method: ``"standard"`` (torch's iteration), ``"standard32"`` (the same
            iteration computed in float32, rounded to ``ns_dtype``), ``"gram"``
            (Gram NS) or ``"auto"`` (fastest passing the accuracy bar per shape).
        ns_dtype: Dtype of the NS iteration (``torch.bfloat16`` as torch.optim.Muon).
        adamw_lr: AdamW learning rate (None: ``lr``).
        adamw_betas: AdamW betas.
        adamw_eps: AdamW epsilon.
        adamw_weight_decay: AdamW decoupled weight decay.
        param_groups: Optional list of dicts, each with ``"params"`` (a subset of
            the model's parameters) and overrides of the keywords above
            (``lr``, ``momentum``, ..., ``adamw_lr``, ...). Each is split into a
            Muon group and an AdamW group. Default: all parameters.
        overlap: Reduce each block's gradients to their owners during backward,
            as soon as the block is done, and publish new weights (ZeRO-2)
            asynchronously so each block's next forward waits only for its own.
            ``False`` runs every collective inside ``step()``. Both give
            bit-identical parameters.
        ns_in_backward: Start each block's momentum and NS on a worker thread
            as soon as its gradients have reached their owners, while backward
            goes on with earlier blocks (needs ``overlap=True``, a 1-D mesh and
            ``nonfinite=None``). The gradients must then not be changed
            between backward and ``step()``: :func:`dmuon.clip_grad_norm_` and
            :meth:`reduce_gradients` raise. NS runs in per-block batches
            (same math; batched differently from the default, which batches
            same-shape matrices across blocks), and every backward that
            reduces must be followed by ``step()``.
        nonfinite: What a NaN/Inf in any gradient does. ``None`` (default):
            nothing is checked, as in torch.optim; ``"skip"``: every rank skips
            the whole step (parameters and optimizer state unchanged);
            ``"raise"``: every rank raises ``FloatingPointError`` naming the
            parameters. Checking costs one small all-reduce per step.
    """

    def __init__(
        self,
        model: nn.Module,
        plan: Plan,
        *,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] | str = KELLER_COEFFICIENTS,
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
        ns_method: str = "auto",
        ns_dtype: torch.dtype = torch.bfloat16,
        adamw_lr: float | None = None,
        adamw_betas: tuple[float, float] = (0.9, 0.999),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 0.01,
        param_groups: list[dict[str, Any]] | None = None,
        overlap: bool = True,
        nonfinite: str | None = None,
        ns_in_backward: bool = False,
    ) -> None:
        if not isinstance(plan, Plan):
            raise ValueError(f"plan must be the Plan returned by dmuon.prepare, got {type(plan).__name__}")
        if plan.runtime is None:
            raise ValueError("plan has no runtime: build it with dmuon.prepare(model, mesh, ...)")
        if ns_method not in NS_METHODS:
            raise ValueError(f"ns_method must be one of {NS_METHODS}, got {ns_method!r}")
        if adjust_lr_fn not in ADJUST_LR_FNS:
            raise ValueError(f"adjust_lr_fn must be one of {ADJUST_LR_FNS}, got {adjust_lr_fn!r}")
        if nonfinite not in NONFINITE_MODES:
            raise ValueError(f"nonfinite must be one of {NONFINITE_MODES}, got {nonfinite!r}")
        if not 0 < ns_steps < 100:
            raise ValueError(f"ns_steps must be in [1, 99], got {ns_steps}")
        for name, value in (("lr", lr), ("weight_decay", weight_decay), ("momentum", momentum),
                            ("adamw_weight_decay", adamw_weight_decay), ("adamw_eps", adamw_eps)):
            _check_nonnegative(name, value)
        if ns_in_backward:
            if not overlap:
                raise ValueError("ns_in_backward=True needs overlap=True: gradients reach their owners "
                                 "during backward only with overlap")
            if nonfinite is not None:
                raise ValueError("ns_in_backward=True cannot be combined with nonfinite="
                                 f"{nonfinite!r}: momentum would advance before the check")
            if plan.replicate > 1:
                raise ValueError("ns_in_backward=True supports 1-D meshes only: on HSDP the second "
                                 "reduction hop is a collective, which must stay on the main thread")
        self.plan = plan
        self.runtime = plan.runtime
        self.ns_in_backward = ns_in_backward
        self._ns_worker: ThreadPoolExecutor | None = None
        self._early: dict[int, Future] = {}
        self.ns_method = ns_method
        self.ns_dtype = ns_dtype
        self.overlap = overlap
        self.nonfinite = nonfinite
        self._names = {id(p): n for n, p in model.named_parameters()}
        if overlap:
            plan.runtime.enable_overlap()
        if ns_in_backward:
            self._ns_worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dmuon-ns")
            plan.runtime.on_reduce_launched = self._start_block_ns
        self._index = {id(info.param): info.index for info in plan.infos}
        self._muon_defaults = dict(
            lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
            ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn,
        )
        self._adamw_defaults = dict(
            lr=lr if adamw_lr is None else adamw_lr, betas=adamw_betas, eps=adamw_eps,
            weight_decay=adamw_weight_decay, foreach=None,
        )
        names = [n for n, _ in model.named_parameters()]
        added = sorted(set(names) - set(plan.param_names))
        if added:
            raise ValueError(
                f"parameters {added[:5]} were added after dmuon.prepare; call prepare again on the final model"
            )
        model_params = list(model.parameters())
        known = {id(p) for p in model_params}
        missing = [info.name for info in plan.infos if id(info.param) not in known]
        if missing:
            raise ValueError(f"plan matrices not found in model: {missing[:5]}; was the plan made for this model?")
        user_groups = param_groups if param_groups is not None else [{"params": model_params}]
        groups = []
        for g in user_groups:
            groups.extend(self._split_group(g))
        self._last_stats: dict[str, Any] = {}
        self._reduced: tuple[dict[int, torch.Tensor], dict[int, dict]] | None = None
        super().__init__(groups, defaults=dict(self._muon_defaults))

    # -------------------------------------------------------------- param groups
    def _split_group(self, group: dict[str, Any]) -> list[dict[str, Any]]:
        if "params" not in group:
            raise ValueError("every param group needs a 'params' entry")
        params = group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        muon = [p for p in params if id(p) in self._index]
        other = [p for p in params if id(p) not in self._index]
        extra = {k: v for k, v in group.items() if k != "params"}
        out = []
        if muon:
            g = {k: v for k, v in extra.items() if not k.startswith("adamw_")}
            out.append({"params": muon, "algorithm": "muon", **g})
        if other:
            g = {k[len("adamw_"):]: v for k, v in extra.items() if k.startswith("adamw_")}
            out.append({"params": other, "algorithm": "adamw", **g})
        return out

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Adds a group; its ``algorithm`` is inferred from whether the params are plan matrices."""
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        if "algorithm" not in param_group:
            kinds = {id(p) in self._index for p in params}
            if len(kinds) > 1:
                raise ValueError("a param group mixes Muon matrices and other parameters; split it")
            param_group["algorithm"] = "muon" if kinds == {True} else "adamw"
        algorithm = param_group["algorithm"]
        if algorithm == "muon":
            for p in params:
                if id(p) not in self._index:
                    raise ValueError("a 'muon' param group holds a parameter that is not in the plan")
            defaults = self._muon_defaults
        elif algorithm == "adamw":
            defaults = self._adamw_defaults
        else:
            raise ValueError(f"param group algorithm must be 'muon' or 'adamw', got {algorithm!r}")
        for key, value in defaults.items():
            param_group.setdefault(key, value)
        saved, self.defaults = self.defaults, {}
        try:
            super().add_param_group(param_group)
        finally:
            self.defaults = saved

    # --------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, closure=None):
        """Performs one optimization step on every rank (a collective call)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        start = time.perf_counter()
        self.runtime.drain()
        skipped = self.nonfinite is not None and self._nonfinite_check()
        orthogonalized, ns_seconds, in_backward = 0, 0.0, 0
        if skipped:
            self._reduced = None
        else:
            for group in self.param_groups:
                if group["algorithm"] == "adamw":
                    adamw_group_step(group, self.state)
            orthogonalized, ns_seconds, in_backward = self._muon_step()
        stats = self.runtime.stats
        self._last_stats = {
            "orthogonalized": orthogonalized,
            **{k: v for k, v in stats.as_dict().items() if k != "wait_seconds"},
            "exposed_comm_seconds": stats.wait_seconds,
            "ns_seconds": ns_seconds,
            "orthogonalized_in_backward": in_backward,
            "step_seconds": time.perf_counter() - start,
            "skipped_nonfinite": skipped,
        }
        stats.reset()
        return loss

    def _active_matrices(self) -> dict[int, dict]:
        """Plan index -> param group of every matrix with a gradient on some rank."""
        group_of = self._muon_groups()
        has_grad = torch.zeros(len(self.plan.infos), dtype=torch.int32)
        for i in group_of:
            grad = self.plan.infos[i].param.grad
            if grad is None:
                continue
            if grad.is_sparse:
                raise ValueError(f"parameter {self.plan.infos[i].name!r}: sparse gradients are not supported by Muon")
            has_grad[i] = 1
        if self.plan.world_size > 1:
            # One tiny collective keeps every rank on the same collective path
            # even when a block was unused on some of them.
            dist.all_reduce(has_grad, group=self.runtime.exchanger.group)
        return {i: g for i, g in group_of.items() if has_grad[i] > 0}

    def _nonfinite_check(self) -> bool:
        """True when some gradient has a NaN/Inf on some rank; raises in ``"raise"`` mode."""
        reduced = self._reduce_gradients()
        others = [p for g in self.param_groups if g["algorithm"] == "adamw" for p in g["params"]]
        flags = torch.zeros(len(self.plan.infos) + len(others), dtype=torch.int32)
        for i, grad in reduced.items():
            flags[i] = int(not torch.isfinite(grad).all())
        for k, p in enumerate(others):
            if p.grad is not None:
                local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                flags[len(self.plan.infos) + k] = int(not torch.isfinite(local).all())
        if self.plan.world_size > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.runtime.exchanger.group)
        if not flags.any():
            return False
        if self.nonfinite == "raise":
            names = [self.plan.infos[i].name for i in range(len(self.plan.infos)) if flags[i]]
            names += [self._names.get(id(p), "?") for k, p in enumerate(others) if flags[len(self.plan.infos) + k]]
            raise FloatingPointError(f"non-finite gradients in {names}")
        return True

    @contextmanager
    def no_sync(self):
        """Backward passes inside accumulate gradients locally without reducing them.

        Use it for all but the last micro-batch of a gradient accumulation (as
        FSDP2's ``set_requires_gradient_sync(False)``); the last backward, run
        outside, reduces the accumulated sum once.
        """
        previous = self.runtime.defer_reduce
        self.runtime.defer_reduce = True
        try:
            yield
        finally:
            self.runtime.defer_reduce = previous

    @torch.no_grad()
    def reduce_gradients(self) -> dict[int, torch.Tensor]:
        """Finishes reducing every Muon gradient to its owner (a collective call).

        ``step()`` calls it; call it earlier to inspect or modify the reduced
        gradients (as :func:`dmuon.clip_grad_norm_` does). The result is kept
        for the coming ``step()``.

        Returns:
            ``{plan index: averaged gradient}`` for the matrices this rank owns
            that have a gradient this step.

        Raises:
            ValueError: With ``ns_in_backward=True``, where the owners have
                already used the gradients.
        """
        if self.ns_in_backward:
            raise ValueError("reduce_gradients()/clip_grad_norm_ cannot change what Muon uses with "
                             "ns_in_backward=True: the owners start NS during backward. Construct "
                             "DMuon with ns_in_backward=False to edit or clip gradients.")
        return self._reduce_gradients()

    def _reduce_gradients(self) -> dict[int, torch.Tensor]:
        if self._reduced is not None:
            return self._reduced[0]
        reduced: dict[int, torch.Tensor] = self.runtime.collect_reductions() if self.overlap else {}
        early = self.runtime.early_blocks if self.overlap else set()
        active = self._active_matrices()
        reduced = {i: g for i, g in reduced.items() if i in active}
        infos = self.plan.infos
        for bucket in self.plan.buckets:
            if bucket.block in early:
                continue
            members = [i for i in bucket.members if i in active]
            if members:
                grads = {i: infos[i].param.grad for i in members}
                reduced.update(self.runtime.exchanger.reduce_to_owners(bucket, members, grads))
        self._reduced = (reduced, active)
        return reduced

    def _muon_groups(self) -> dict[int, dict]:
        """Plan index -> param group, for every Muon matrix."""
        return {self._index[id(p)]: g for g in self.param_groups if g["algorithm"] == "muon" for p in g["params"]}

    def _orthogonalize(
        self, indices: list[int], reduced: dict[int, torch.Tensor], group_of: dict[int, dict]
    ) -> dict[int, torch.Tensor]:
        """Advances the momentum of ``indices`` and orthogonalizes their directions."""
        infos = self.plan.infos
        by_group: dict[int, list[int]] = {}
        for i in indices:
            by_group.setdefault(id(group_of[i]), []).append(i)
        out: dict[int, torch.Tensor] = {}
        for members in by_group.values():
            group = group_of[members[0]]
            # The batches the balancer priced this rank's load with (see Plan.ns_batches).
            for batch in self.plan.ns_batches(members):
                directions = []
                for i in batch:
                    state = self.state[infos[i].param]
                    if "momentum_buffer" not in state:
                        state["momentum_buffer"] = torch.zeros(
                            infos[i].shape, dtype=torch.float32, device=reduced[i].device)
                    d = momentum_update(reduced[i], state["momentum_buffer"], group["momentum"], group["nesterov"])
                    directions.append(d.reshape(infos[i].matrix_shape))
                orthos = orthogonalize_many(
                    directions,
                    method=self.ns_method,
                    coefficients=group["ns_coefficients"],
                    steps=group["ns_steps"],
                    eps=group["eps"],
                    dtype=self.ns_dtype,
                )
                out.update(zip(batch, orthos))
        return out

    # ------------------------------------------------------------ NS in backward
    def _start_block_ns(self, block: int, pending: list) -> None:
        """Runtime callback: ``block``'s reduction was just launched in backward."""
        assert self._ns_worker is not None
        self._early[block] = self._ns_worker.submit(self._block_ns, pending, self._muon_groups())

    @torch.no_grad()
    def _block_ns(self, pending: list, group_of: dict[int, dict]) -> tuple[dict[int, torch.Tensor], float]:
        # Worker thread: waits only on handles the main thread launched and issues
        # no collective itself (1-D mesh: summing the copies is local), so the
        # collective order every rank sees stays that of the main thread.
        reduced: dict[int, torch.Tensor] = {}
        for p in pending:
            reduced.update(p.wait(exposed=False))
        start = time.perf_counter()
        owned = sorted(i for i in reduced if i in group_of)
        return self._orthogonalize(owned, reduced, group_of), time.perf_counter() - start

    def _join_block_ns(self) -> tuple[dict[int, torch.Tensor], float]:
        orthos: dict[int, torch.Tensor] = {}
        seconds = 0.0
        for block in sorted(self._early):
            done, spent = self._early[block].result()
            orthos.update(done)
            seconds += spent
        self._early.clear()
        return orthos, seconds

    def _muon_step(self) -> tuple[int, float, int]:
        # Joined first: the worker must be done with the reductions before they are collected here.
        early, ns_seconds = self._join_block_ns() if self.ns_in_backward else ({}, 0.0)
        self._reduce_gradients()
        (reduced, active), self._reduced = self._reduced, None
        infos = self.plan.infos

        ns_start = time.perf_counter()
        rest = [i for i in sorted(reduced) if i not in early]
        if self.ns_in_backward:
            # Blocks the worker did not get to (reduced in step()) run per block too,
            # so the batches do not depend on how far backward got.
            units: dict[int, list[int]] = {}
            for i in rest:
                units.setdefault(infos[i].block, []).append(i)
            work = list(units.values())
        else:
            work = [rest]
        orthos = dict(early)
        for indices in work:
            orthos.update(self._orthogonalize(indices, reduced, active))
        for i in sorted(orthos):
            group = active[i]
            apply_update(
                infos[i].param, orthos[i], lr=group["lr"], weight_decay=group["weight_decay"],
                adjust_lr_fn=group["adjust_lr_fn"], matrix_shape=infos[i].matrix_shape,
            )
        ns_seconds += time.perf_counter() - ns_start

        if self.plan.zero == 2:
            publish = self.runtime.publish_async if self.overlap else self.runtime.publish
            for bucket in self.plan.buckets:
                publish(bucket, [i for i in bucket.members if i in active])
        return len(reduced), ns_seconds, len(early)

    def last_step_stats(self) -> dict[str, Any]:
        """This rank's figures for the last step and the forward/backward before it.

        Keys: ``orthogonalized`` (matrices this rank ran NS for), ``bytes_sent``
        and ``bytes_received`` (dmuon's own collectives), the same split into
        ``intra_bytes_*`` (shard level) and ``inter_bytes_*`` (replicate level,
        HSDP only), ``collectives``,
        ``exposed_comm_seconds`` (time blocked on dmuon collectives, i.e. not hidden
        behind compute), ``ns_seconds`` (momentum, NS and update on the
        owner, wherever they ran), ``orthogonalized_in_backward`` (of
        ``orthogonalized``, those started during backward with
        ``ns_in_backward=True``) and ``step_seconds``.
        """
        return dict(self._last_stats)
