"""DMuon: the optimizer front door.

One ``torch.optim.Optimizer`` for a ``fully_shard``-ed model. Muon matrices
keep their momentum beside FSDP2's (and TP's) shards; every other parameter
follows ``torch.optim.AdamW``. The optimizer holds the param groups and the
state and supplies torch.optim.Muon's rule as callbacks
(:mod:`dmuon.optim.callbacks`); the runtime (:mod:`dmuon.runtime`) runs the
step: which rank owns which matrix's NS, every collective, and when.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from dmuon.optim.callbacks import MuonCallbacks
from dmuon.optim.momentum import MomentumLayout
from dmuon.ortho.config import NSConfig
from dmuon.ortho.owner import GROUP_KEYS
from dmuon.plan.plan import Plan
from dmuon.prepare import prepare
from dmuon.rules.muon import ADJUST_LR_FNS
from dmuon.runtime import ExecutionConfig, ShardRuntime, StepReport


def _as_tuples(value: Any) -> Any:
    """Lists as tuples, recursively: a state dict's round trip (DCP, JSON) turns tuples into lists."""
    return tuple(_as_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value


def _check_nonnegative(name: str, value: float) -> None:
    if not value >= 0.0:
        raise ValueError(f"{name} must be >= 0, got {value}")


class DMuon(torch.optim.Optimizer):
    """Muon on FSDP2 with one owner per matrix, AdamW for everything else.

    Build the model exactly as for AdamW (``fully_shard`` each block, then the
    root, any ``reshard_after_forward``, any ``MixedPrecisionPolicy``, a 1-D
    mesh or a 2-D HSDP mesh), then ``DMuon(model, lr=..., adamw_lr=...)``.

    Args:
        model: The model (after ``fully_shard``; plain in a single process).
        plan: A plan from :func:`dmuon.prepare` for this model (balancer,
            profiling and selection options); None builds one with the defaults.
        lr: Muon learning rate.
        weight_decay: Muon decoupled weight decay.
        momentum: Muon momentum.
        nesterov: Nesterov momentum for Muon.
        adjust_lr_fn: ``None``/``"original"`` (Keller's scaling) or ``"match_rms_adamw"``.
        ns: How the owners run Newton-Schulz (:class:`~dmuon.ortho.config.NSConfig`):
            method (``"auto"``: the fastest passing the accuracy bar per shape),
            coefficients, steps, eps, dtype (directions and updates travel in it).
            Default: the plan's (``prepare(ns=...)``), else ``NSConfig()``; given
            with a plan it must equal the plan's, which was priced with it.
        ns_coefficients, eps, ns_steps, ns_method, ns_dtype: torch.optim.Muon-style
            keywords for the fields of ``ns`` (``coefficients``, ``eps``, ``steps``,
            ``method``, ``dtype``); given with ``ns`` or a plan they must agree with it.
        adamw_lr: AdamW learning rate (None: ``lr``).
        adamw_betas: AdamW betas.
        adamw_eps: AdamW epsilon.
        adamw_weight_decay: AdamW decoupled weight decay.
        param_groups: Optional list of dicts, each with ``"params"`` (a subset of
            the model's parameters) and overrides of ``lr``, ``weight_decay``,
            ``momentum``, ``nesterov``, ``adjust_lr_fn`` and the ``adamw_``
            keywords. Each is split into a Muon group and an AdamW group.
            Default: all parameters. NS settings are the plan's for every group:
            a group's ``ns_steps``, ``ns_coefficients`` or ``eps`` that differs is
            an error naming it.
        execution: When the runtime moves and computes
            (:class:`~dmuon.runtime.config.ExecutionConfig`: ``overlap``,
            ``ns_in_backward``, ``nonfinite``, ``return_waves``, ``post_optim_event``;
            its docstrings say what each does). Default: ``ExecutionConfig()``.
        overlap, nonfinite, ns_in_backward, post_optim_event, return_waves: Keywords
            for the fields of ``execution``; given with it they must agree with it.
        hsdp_mesh: HSDP with dmuon's replicate level: the ``(replicate, shard[, tp])`` mesh
            whose shard dims the model is ``fully_shard``-ed over (``mesh=hsdp_mesh["shard"]``);
            dmuon then reduces every gradient across replicas itself, each Muon matrix only as
            far as its owner needs (:func:`dmuon.prepare`). With a plan, the plan's.
    """

    def __init__(
        self,
        model: nn.Module,
        plan: Plan | None = None,
        *,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        adjust_lr_fn: str | None = None,
        ns: NSConfig | None = None,
        ns_coefficients: tuple[float, float, float] | str | None = None,
        eps: float | None = None,
        ns_steps: int | None = None,
        ns_method: str | None = None,
        ns_dtype: torch.dtype | None = None,
        adamw_lr: float | None = None,
        adamw_betas: tuple[float, float] = (0.9, 0.999),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 0.01,
        param_groups: list[dict[str, Any]] | None = None,
        execution: ExecutionConfig | None = None,
        overlap: bool | None = None,
        nonfinite: str | None = None,
        ns_in_backward: bool | None = None,
        post_optim_event: bool | None = None,
        return_waves: int | None = None,
        hsdp_mesh=None,
    ) -> None:
        if plan is not None and not isinstance(plan, Plan):
            raise ValueError(f"plan must be the Plan returned by dmuon.prepare, got {type(plan).__name__}")
        ns = self._resolve_ns(plan, ns, dict(ns_method=ns_method, eps=eps, ns_coefficients=ns_coefficients,
                                             ns_steps=ns_steps, ns_dtype=ns_dtype))
        execution = ExecutionConfig.from_keywords(
            execution, overlap=overlap, nonfinite=nonfinite, ns_in_backward=ns_in_backward,
            post_optim_event=post_optim_event, return_waves=return_waves)
        if adjust_lr_fn not in ADJUST_LR_FNS:
            raise ValueError(f"adjust_lr_fn must be one of {ADJUST_LR_FNS}, got {adjust_lr_fn!r}")
        for name, value in (("lr", lr), ("weight_decay", weight_decay), ("momentum", momentum),
                            ("adamw_weight_decay", adamw_weight_decay), ("adamw_eps", adamw_eps)):
            _check_nonnegative(name, value)
        if plan is None:
            plan = prepare(model, ns=ns, hsdp_mesh=hsdp_mesh)
        elif hsdp_mesh is not None and hsdp_mesh != plan.hsdp_mesh:
            raise ValueError("hsdp_mesh differs from the plan's; pass it to dmuon.prepare(hsdp_mesh=...)")
        names = [n for n, _ in model.named_parameters()]
        if tuple(names) != plan.param_names:
            added = sorted(set(names) - set(plan.param_names))
            raise ValueError(
                f"the model's parameters differ from the plan's (new: {added[:5]}); "
                "was the plan made for this model? Call dmuon.prepare again on the final model"
            )
        model_params = list(model.parameters())
        known = {id(p) for p in model_params}
        missing = [info.name for info in plan.infos if id(info.param) not in known]
        if missing:
            raise ValueError(f"plan matrices not found in model: {missing[:5]}; was the plan made for this model?")
        self.plan = plan
        self.ns = ns
        """The Newton-Schulz configuration the owners run (the plan's)."""
        self.execution = execution
        """When the runtime moves and computes."""
        self.momentum = MomentumLayout(plan)
        self.param_names = {id(p): n for n, p in model.named_parameters()}
        """Parameter (by id) -> its name in the model."""
        self._index: dict[int, list[int]] = {}  # parameter -> its matrices (several for a stack of experts)
        for info in plan.infos:
            self._index.setdefault(id(info.param), []).append(info.index)
        self._muon_defaults = dict(
            lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
            ns_coefficients=ns.coefficients, eps=ns.eps, ns_steps=ns.steps, adjust_lr_fn=adjust_lr_fn,
        )
        self._adamw_defaults = dict(
            lr=lr if adamw_lr is None else adamw_lr, betas=adamw_betas, eps=adamw_eps,
            weight_decay=adamw_weight_decay, foreach=None,
        )
        user_groups = param_groups if param_groups is not None else [{"params": model_params}]
        groups = []
        for g in user_groups:
            groups.extend(self._split_group(g))
        self._last_report = StepReport()
        super().__init__(groups, defaults=dict(self._muon_defaults))
        self.runtime = ShardRuntime(plan, MuonCallbacks(self), execution,
                                    root=model if isinstance(model, FSDPModule) else None)

    @staticmethod
    def _resolve_ns(plan: Plan | None, ns: NSConfig | None, keywords: dict[str, Any]) -> NSConfig:
        """The one NS configuration from ``ns=``, the keywords and the plan; errors name what differs."""
        if ns is not None and not isinstance(ns, NSConfig):
            raise ValueError(f"ns must be a dmuon.NSConfig, got {type(ns).__name__}")
        base = ns if ns is not None else None if plan is None else plan.ns
        resolved = NSConfig.from_keywords(base, **keywords)
        if ns is not None and resolved != ns:
            raise ValueError("the NS keywords contradict ns= (" + "; ".join(resolved.differences(ns))
                             + "); set each NS field in one place")
        if plan is not None and resolved != plan.ns:
            raise ValueError(
                "the NS keywords differ from the plan's NS configuration, which its costs were priced with ("
                + "; ".join(resolved.differences(plan.ns)) + "); pass ns=dmuon.NSConfig(...) to dmuon.prepare instead")
        return resolved

    def matrix_indices(self, param: torch.Tensor) -> list[int]:
        """The plan indices of ``param``'s matrices (several for a stack of experts or row groups)."""
        return self._index[id(param)]

    def check_ns_keys(self, group: dict[str, Any]) -> None:
        """Raises ``ValueError`` naming the group and key when a Muon group's NS setting differs from ``self.ns``.

        The plan priced (or measured) every owner's work with one NS configuration, and
        the owners batch matrices across groups, so a per-group NS setting is refused.
        """
        for key, field in GROUP_KEYS.items():
            if key in group and _as_tuples(group[key]) != getattr(self.ns, field):
                # A group being added gets the next index.
                index = next((k for k, g in enumerate(self.param_groups) if g is group), len(self.param_groups))
                raise ValueError(
                    f"param group {index}: {key}={group[key]!r} differs from the NS configuration the plan was "
                    f"priced with ({field}={getattr(self.ns, field)!r}); NS settings apply to every matrix: "
                    "set them with DMuon(ns=dmuon.NSConfig(...)) or dmuon.prepare(ns=...)")

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
        if algorithm == "muon":
            self.check_ns_keys(param_group)
        saved, self.defaults = self.defaults, {}
        try:
            super().add_param_group(param_group)
        finally:
            self.defaults = saved

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As ``torch.optim.Optimizer.load_state_dict``, keeping Muon's momentum in float32 and in its layout.

        torch casts floating-point state to its parameter's dtype on load; Muon's
        momentum is fp32 whatever the parameter's dtype (as torch.optim.Muon's would
        be for fp32 parameters), so it is taken again from the incoming values. A
        momentum DTensor laid out otherwise (a state dict built by hand for
        another mesh) is redistributed to the runtime's layout, on every rank in
        the same order.
        """
        order = [k for g in state_dict["param_groups"] for k in g["params"]]
        momenta = {k: v["momentum_buffer"] for k, v in state_dict["state"].items()
                   if isinstance(v, dict) and "momentum_buffer" in v}
        super().load_state_dict(state_dict)
        params = [p for g in self.param_groups for p in g["params"]]
        for key, value in sorted(momenta.items(), key=lambda kv: order.index(kv[0])):
            param = params[order.index(key)]
            mesh, placements = self.momentum.layout_for(self.plan.infos[self._index[id(param)][0]])
            if isinstance(value, DTensor) and value.device_mesh == mesh and tuple(value.placements) != placements:
                value = value.redistribute(mesh, placements)
            self.state[param]["momentum_buffer"] = value.to(device=param.device, dtype=torch.float32)

    # --------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, closure=None):
        """Performs one optimization step on every rank (a collective call).

        The runtime runs it (:meth:`dmuon.runtime.ShardRuntime.step`): the
        agreement, the momentum (:meth:`MuonCallbacks.commit`), the owners' NS,
        the update returns, AdamW while they travel, and the updates' apply.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._last_report = self.runtime.step()
        return loss

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over every parameter of this optimizer, on every rank alike.

        The total norm counts each gradient element once over the whole mesh (a shard held by
        several ranks, e.g. replicated over HSDP's replicas or a tensor-parallel dim, once), with
        one scalar all-reduce, whatever meshes the parameters live on (torch's own raises for
        parameters on different meshes, as with tensor parallelism). With ``hsdp_mesh`` the
        gradients are first reduced across replicas (what ``step()`` does anyway), and no Muon
        gradient crosses the replicas for the norm.

        Returns:
            The total norm before clipping (a float32 tensor, the same on every rank).
        """
        params = [p for g in self.param_groups for p in g["params"]]
        return self.runtime.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite)

    def last_step_report(self) -> StepReport:
        """This rank's :class:`~dmuon.runtime.report.StepReport` of the last step (and the backward before it)."""
        return self._last_report

    def last_step_stats(self) -> dict[str, Any]:
        """:meth:`last_step_report` as a dict.

        Keys: ``orthogonalized`` (matrices this rank ran NS for), ``bytes_sent``
        and ``bytes_received`` (dmuon's own collectives; FSDP2's are not
        counted), the same split into ``intra_bytes_*`` (shard level) and
        ``inter_bytes_*`` (replicate level, HSDP only), ``collectives``,
        ``exposed_comm_seconds`` (time blocked on dmuon collectives, i.e. not
        hidden behind compute), ``ns_seconds`` (NS and the exchange's
        bookkeeping on the owner, wherever it ran), ``blocks_exchanged_in_backward``
        (launches from backward that ``step()`` kept), ``orthogonalized_in_backward``
        (matrices whose NS ran on the worker with ``ns_in_backward=True`` and was
        kept), ``orthogonalized_while_agreeing`` (matrices whose NS ran before the
        step's agreement was known, its flags travelling with their return, and
        was kept: with one return wave, whenever every block was launched in
        backward and none went stale), ``step_seconds``, ``skipped_nonfinite`` and
        ``return_waves`` (the matrices of each pipelined update return, in order;
        see :meth:`dmuon.runtime.owner_work.OwnerWork.return_waves`).
        """
        return self._last_report.as_dict()
