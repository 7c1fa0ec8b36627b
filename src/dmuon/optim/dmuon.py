"""DMuon: the optimizer front door.

One ``torch.optim.Optimizer`` for a ``fully_shard``-ed model. Muon matrices
keep their momentum beside FSDP2's (and TP's) shards; every other parameter
follows ``torch.optim.AdamW``. The optimizer holds the param groups and the
state and supplies torch.optim.Muon's rule as callbacks
(:mod:`dmuon.optim.callbacks`); the runtime (:mod:`dmuon.runtime`) runs the
step: which rank owns which matrix's NS, every collective, and when.

Built on a model that is not sharded yet (what frameworks do: the optimizer
first, then ``fully_shard``), it holds its param groups at once and sets the
rest up (:func:`dmuon.prepare`, the runtime and its backward hooks) at the
model's first forward, on every rank, or at the first ``step()``,
``clip_grad_norm_`` or state load, whichever comes first; the param groups then
hold the sharded parameters, whatever parameter objects a framework swapped into
them in between (:mod:`dmuon.optim.deferred`).
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Iterable, Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from dmuon.optim.callbacks import MuonCallbacks
from dmuon.optim.deferred import DeferredSetup, default_matrices, waits_for_sharding
from dmuon.optim.groups import (AdamWGroup, GroupSplitter, MuonMatrices, as_adamw_groups, canonical_name,
                               check_named_alike, check_ns_keys, group_index, named_group)
from dmuon.optim.momentum import MomentumLayout
from dmuon.optim.qk_clip import AttentionClip
from dmuon.optim.settings import (AdamWConfig, check_execution, check_nonnegative, check_plan_inputs,
                                  check_tensor_lr, model_and_groups, pipeline_group, refuse_settings_elsewhere,
                                  resolve_ns)
from dmuon.optim.stages import check_ties_across_stages
from dmuon.ortho.config import NSConfig
from dmuon.plan.plan import Plan
from dmuon.plan.selection import select_matrices
from dmuon.prepare import prepare
from dmuon.prepare.ddp import ddp_root, wrapping_ddp
from dmuon.rules.adamw import ADAMW_GROUP_DEFAULTS, check_adamw_group
from dmuon.rules.muon import check_rule_settings, fill_rule_defaults
from dmuon.rules.qk_clip import QKClip
from dmuon.runtime import ExecutionConfig, ShardRuntime, StepReport
from dmuon.runtime.ddp import DdpRuntime
from dmuon.runtime.settle import land_unused
from dmuon.util.autocast import autocast_off


_PIPELINE_MODELS: dict[int, tuple[Any, list[weakref.ref]]] = {}
"""Per pipeline group (by id; the group kept, so that its id is never another's), the models of this
rank's optimizers given it (weakly)."""


def _claim_pipeline_group(group: Any, model: nn.Module) -> None:
    """Raises when another live optimizer of this rank steps another model part with the same
    ``pp_group``: each would agree with the other stages on its part's norm and NaNs alone, pairing
    with the wrong parts of the other ranks. A new optimizer for the same model (resume) is fine."""
    if group is None:
        return
    models = [m for m in (ref() for ref in _PIPELINE_MODELS.get(id(group), (group, []))[1]) if m is not None]
    if any(m is not model for m in models):
        raise ValueError("pp_group: another DMuon on this rank already steps another model part with this "
                         "pipeline group; with several parts per rank (interleaved or V schedules) build one "
                         "DMuon over all of them: dmuon.DMuon(torch.nn.ModuleList(parts), ..., pp_group=...)")
    _PIPELINE_MODELS[id(group)] = (group, [weakref.ref(m) for m in models] + [weakref.ref(model)])


class DMuon(torch.optim.Optimizer):
    """Muon on FSDP2 with one owner per matrix, AdamW for everything else.

    Build the model exactly as for AdamW (``fully_shard`` each block, then the
    root, any ``reshard_after_forward``, any ``MixedPrecisionPolicy``, a 1-D
    mesh or a 2-D HSDP mesh), then ``DMuon(model, lr=..., adamw=dmuon.AdamWConfig(lr=...))``.
    Or build it where a framework builds ``torch.optim.AdamW``, before sharding:
    it sets itself up at the model's first forward (see the module docstring).

    Args:
        model: The model (after ``fully_shard``, or before it with a process group
            up; plain in a single process). Or what torch optimizers take (the
            parameters, param groups, ``(name, param)`` pairs) with ``module=``
            the model they belong to. Each param group (a dict with ``"params"`` and
            torch.optim-style overrides) is split into a Muon group and an AdamW group
            (:meth:`split_group` says which key goes where); NS settings are the plan's
            for every group: a group's ``ns_steps``, ``ns_coefficients`` or ``eps`` that
            differs is an error naming it.
        plan: A plan from :func:`dmuon.prepare` for this model (balancer,
            profiling and selection options); None builds one with the defaults.
        module: The model, when ``model`` holds parameters or groups (what the HF
            Trainer and torchtitan's optimizer container pass).
        lr: Muon learning rate: a float or a 1-element tensor (as torch.optim's; each AdamW half gets its own
            tensor when ``adamw`` gives no ``lr``).
        weight_decay: Muon decoupled weight decay.
        momentum: Muon momentum.
        nesterov: Nesterov momentum for Muon.
        ns_coefficients, eps, ns_steps: torch.optim.Muon's keywords for the fields of ``ns``
            (``coefficients``, ``eps``, ``steps``); given with ``ns`` or a plan they must agree with it.
        adjust_lr_fn: The step's shape scaling for an ``(m, n)`` matrix: ``None``/``"original"``
            (``sqrt(max(1, m/n))``, Keller's), ``"match_rms_adamw"`` (``0.2 sqrt(max(m, n))``),
            ``"spectral_unclamped"`` (``sqrt(m/n)``: torchtitan's name, dion's ``"spectral_norm"``)
            or ``"unscaled"`` (1: dion's ``None``). See README, "Settings from other Muon libraries".
        extra_scale_factor: Multiplies the step (not the weight decay), as NVIDIA
            Emerging-Optimizers' ``extra_scale_factor``.
        cautious_weight_decay: Decay only the entries where the update and the weight share a sign
            (or one is zero), as dion's ``cautious_wd=True``.
        ns: How the owners run Newton-Schulz (:class:`~dmuon.ortho.config.NSConfig`):
            method (``"auto"``: the fastest passing the accuracy bar per shape),
            coefficients, steps, eps, dtype (directions and updates travel in it).
            Default: the plan's (``prepare(ns=...)``), else ``NSConfig()``; given
            with a plan it must equal the plan's, which was priced with it.
        execution: When the runtime moves and computes
            (:class:`~dmuon.runtime.config.ExecutionConfig`: ``overlap``,
            ``ns_in_backward``, ``nonfinite``, ``return_waves``, ``post_optim_event``;
            its docstrings say what each does). Default: ``ExecutionConfig()``.
        adamw: AdamW's settings for every other parameter (:class:`~dmuon.optim.settings.AdamWConfig`:
            ``lr`` (None: ``lr``), ``betas``, ``eps``, ``weight_decay``, ``amsgrad``, ``maximize``), or a dict of
            those keys. A group's torch.optim.AdamW keys (``amsgrad``, ``maximize``, ``foreach``, ``fused``,
            ``capturable``) reach its AdamW half and run as there; ``differentiable=True`` and
            ``decoupled_weight_decay=False`` are refused by name.
        hsdp_mesh: HSDP with dmuon's replicate level: the ``(replicate, shard[, tp])`` mesh
            whose shard dims the model is ``fully_shard``-ed over (``mesh=hsdp_mesh["shard"]``);
            dmuon then reduces every gradient across replicas itself, each Muon matrix only as
            far as its owner needs (:func:`dmuon.prepare`). Expert parallelism: a tuple of views of
            one root sharing the replicate dim (``(dense_mesh, expert_mesh)``, e.g. ``(replicate, fsdp)``
            and ``(replicate, efsdp, ep)``). With a plan, the plan's.
        qk_clip: QK-clip (MuonClip) inside the step (:class:`~dmuon.rules.qk_clip.QKClip`: the
            attention layers, ``tau``, ``alpha``): after each applied step's update, the query and
            key rows of every head whose largest pre-softmax logit (over every rank's tokens, as
            :meth:`report_attention_logits` reported them) exceeds ``tau`` are scaled back to it.
            None: no clip.
        pp_group: Pipeline parallelism: the ranks holding the other stages of the model
            (``world_mesh["pp"]``, a 1-D DeviceMesh, or a process group). :meth:`clip_grad_norm_` then
            clips by the whole model's norm and ``nonfinite=`` skips (or raises on) every stage
            alike, one scalar all-reduce over it each. None: this optimizer's parameters are the
            whole model (or the caller combines the stages, as torchtitan's clipping does).

    torch.optim's conventions (README, "torch.optim conventions"): in one process every step equals
    torch.optim.Muon + torch.optim.AdamW's bit for bit whatever is done to the gradients before ``step()``
    (:meth:`_runtime_execution`); ``copy.deepcopy`` and pickle give an optimizer stepping its own copy of the
    model (not on a sharded model); a param group of yours is a Muon and an AdamW half (:meth:`per_group`).

    Raises:
        TypeError: Parameters or groups without ``module=`` (the message says what to pass), or a keyword
            whose setting belongs in ``ns=``, ``execution=`` or ``adamw=`` (the message names which).
    """

    rule_callbacks = MuonCallbacks
    """The matrix rule the runtime runs (:class:`~dmuon.runtime.StepCallbacks`), built on this optimizer."""
    matrix_state = {"momentum_buffer": MomentumLayout.layout_for}
    """The matrix rule's float32 state: key -> its ``(mesh, placements)`` for a matrix
    (``layout(momentum_layout, info)``); kept in float32 and in that layout on load."""

    def __new__(cls, *args: Any, **kwargs: Any) -> DMuon:
        # Before the signature binds: a keyword whose setting lives in a typed config gets a TypeError
        # naming that config, not Python's bare "unexpected keyword argument".
        refuse_settings_elsewhere(cls.__name__, kwargs)
        return super().__new__(cls)

    def _rule_defaults(self) -> dict[str, Any]:
        """The matrix rule's own param-group keys and their defaults (none for Muon)."""
        return {}

    def __init__(self, model: nn.Module | Iterable[Any] | None = None, plan: Plan | None = None, *,
                 module: nn.Module | None = None,
                 lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95, nesterov: bool = True,
                 ns_coefficients: tuple[float, float, float] | str | None = None, eps: float | None = None,
                 ns_steps: int | None = None, adjust_lr_fn: str | None = None,
                 extra_scale_factor: float = 1.0, cautious_weight_decay: bool = False,
                 ns: NSConfig | None = None, execution: ExecutionConfig | None = None,
                 adamw: AdamWConfig | Mapping[str, Any] | None = None,
                 hsdp_mesh: DeviceMesh | tuple[DeviceMesh, ...] | None = None, qk_clip: QKClip | None = None,
                 pp_group: DeviceMesh | dist.ProcessGroup | None = None) -> None:
        model, user_groups = model_and_groups(model, module)
        # Under torch's DistributedDataParallel (given the wrapper, or its .module or parameters once it
        # exists) the plan is made over DDP's group; a model DDP wraps later is found at its first forward.
        ddp = ddp_root(model)
        if ddp is None and waits_for_sharding(model):
            ddp = wrapping_ddp(model)
        if ddp is not None:
            model = ddp.module
        self._ddp = ddp
        """torch's DistributedDataParallel around the model (None: none, or not found yet): what a plan made
        again is made over."""
        self._pp_group = pipeline_group(pp_group)
        _claim_pipeline_group(self._pp_group, model)
        self._stages_checked = False
        check_plan_inputs(plan, hsdp_mesh, qk_clip)
        self.ns = resolve_ns(plan, ns, eps=eps, ns_coefficients=ns_coefficients, ns_steps=ns_steps)
        """The Newton-Schulz configuration the owners run (the plan's)."""
        self.execution = check_execution(execution)
        """When the runtime moves and computes."""
        self.adamw = AdamWConfig.from_mapping(adamw)
        """AdamW's settings, for the parameters Muon does not update."""
        check_rule_settings(adjust_lr_fn, extra_scale_factor, cautious_weight_decay)
        check_tensor_lr(lr)
        check_nonnegative(lr=lr, weight_decay=weight_decay, momentum=momentum)
        self.model = model
        """The model this optimizer steps (the same object before and after ``fully_shard``)."""
        self.plan: Plan | None = None
        """The ownership plan (None until set up: see the module docstring)."""
        self.runtime: ShardRuntime | None = None
        self.param_names: dict[int, str] = {}
        """Parameter (by id) -> its name in the model (once set up)."""
        self.qk_clip = qk_clip
        """QK-clip's configuration (None: no clip)."""
        self._hsdp_mesh = hsdp_mesh
        self._last_report = StepReport()
        self._own_plan = plan is None  # a plan DMuon made may be made again (add_param_group, a matrix thawed)
        self._thawing: list[tuple[str, torch.Tensor]] | None = None  # see _thawed
        self._user_named = bool(user_groups) and named_group(user_groups[0])
        for group in user_groups or ():
            check_named_alike(named_group(group), self._user_named)
        muon_defaults = dict(
            lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
            ns_coefficients=self.ns.coefficients, eps=self.ns.eps, ns_steps=self.ns.steps, adjust_lr_fn=adjust_lr_fn,
            extra_scale_factor=extra_scale_factor, cautious_weight_decay=cautious_weight_decay,
            **self._rule_defaults(),
        )
        waiting = plan is None and ddp is None and waits_for_sharding(model)
        # Before fully_shard the default selection, on the model as it is, splits the groups; the plan
        # follows on the sharded model (_ready).
        self._matrices = MuonMatrices(default_matrices(model) if waiting else None)
        self._deferred = DeferredSetup(model) if waiting else None
        if not waiting:
            self._adopt_plan(plan if plan is not None else
                             prepare(model if ddp is None else ddp, ns=self.ns, hsdp_mesh=hsdp_mesh))
        self._splitter = GroupSplitter(model, self._matrices, muon_defaults, self.adamw.group_defaults(lr),
                                       adamw_lr_given=self.adamw.lr is not None)
        named = self._splitter.names()
        self._qk: AttentionClip | None = None if qk_clip is None else AttentionClip(
            qk_clip, {canonical_name(n): p for n, p in model.named_parameters()}, named)
        groups = self._split_groups(user_groups, named)
        super().__init__(groups, defaults=dict(muon_defaults))
        if self._deferred is None:
            self._start_runtime()
        else:
            self._deferred.wait_for_forward(self._ready)

    # ------------------------------------------------------------------- setup
    def _split_groups(self, user_groups: list[dict[str, Any]] | None, named: dict[int, str]) -> list[dict[str, Any]]:
        """The user's groups (None: every parameter in one) as DMuon's, each split in its Muon and AdamW halves."""
        if user_groups is None:
            user_groups = [{"params": list(self.model.parameters())}]
        halves = [(k, half) for k, g in enumerate(user_groups)
                  for half in self._splitter.split(g, index=k, names=named)]
        groups = [half for _, half in halves]
        self._user_group_of = [k for k, _ in halves]  # DMuon's group -> the user's group it came from
        if any("param_names" not in g for g in groups):
            for g in groups:
                g.pop("param_names", None)  # torch's rule: every group named, or none
        if self._deferred is not None:
            self._deferred.record(groups, named)
        return groups

    def _adopt_plan(self, plan: Plan) -> None:
        """Takes ``plan`` for this model: the checks, the momentum layout and the matrices' index."""
        model = self.model
        names = [n for n, _ in model.named_parameters()]
        if tuple(names) != plan.param_names:
            added = sorted(set(names) - set(plan.param_names))
            raise ValueError(
                f"the model's parameters differ from the plan's (new: {added[:5]}); "
                "was the plan made for this model? Call dmuon.prepare again on the final model"
            )
        known = {id(p) for p in model.parameters()}
        missing = [info.name for info in plan.infos if id(info.param) not in known]
        if missing:
            raise ValueError(f"plan matrices not found in model: {missing[:5]}; was the plan made for this model?")
        self.plan = plan
        self.momentum = MomentumLayout(plan)
        self.param_names = {id(p): n for n, p in model.named_parameters()}
        planned = {id(info.param) for info in plan.infos}
        # The default selection's matrices the plan left out because they were frozen (a vision tower or
        # backbone thawed after warm-up): Muon's once they train. A plan of the user's was made with a
        # selection DMuon does not know: only its own matrices are Muon's (a frozen one thawed raises at step()).
        default = [p for _, p in select_matrices(model)]
        frozen = {id(p) for p in default if not p.requires_grad and id(p) not in planned}
        self._matrices.adopt(plan, {id(p) for p in default} if self._own_plan else planned, frozen)
        self._thawing = None

    def _start_runtime(self) -> None:
        model = self.model
        if self._qk is not None:
            self._qk.bind(self.plan, self.matrix_indices,
                          {canonical_name(n): p for n, p in model.named_parameters()})
        if self.plan.ddp:  # torch's DDP: every rank holds the whole model and its mean gradient
            self.runtime = DdpRuntime(self.plan, self.rule_callbacks(self), self._runtime_execution(),
                                          pipeline_group=self._pp_group)
        else:
            self.runtime = ShardRuntime(self.plan, self.rule_callbacks(self), self._runtime_execution(),
                                        root=model if isinstance(model, FSDPModule) else None,
                                        pipeline_group=self._pp_group)
        if self.execution.apply_updates == "next_forward":
            # Whatever reads or replaces the model's weights through its state dict sees every update
            # applied (torch's get_state_dict/set_state_dict and DCP go through these).
            me = weakref.ref(self)  # the model does not keep the optimizer alive

            def flush(*_: Any) -> None:
                if me() is not None:
                    me().flush_updates()

            model.register_state_dict_pre_hook(flush)
            model.register_load_state_dict_pre_hook(flush)

    def _runtime_execution(self) -> ExecutionConfig:
        """:attr:`execution` as the runtime runs it: in one process (one rank, no loopback collectives)
        without ``clipped_overlap``. There the owners' rescaled directions would save no transfer (a
        launch is handed over locally) and cost the bits: a step whose gradients were scaled after
        backward (a clip, ``GradScaler.unscale_``, a step pre-hook) forms its directions again from
        the gradients, as torch.optim.Muon does, bit for bit."""
        execution = self.execution
        if self.plan.world_size == 1 and not execution.loopback_collectives and execution.clipped_overlap:
            return dataclasses.replace(execution, clipped_overlap=False)
        return execution

    def flush_updates(self) -> None:
        """Applies every Muon update a step left for the next forward (``ExecutionConfig(apply_updates=
        "next_forward")``): call it before reading the weights directly between ``step()`` and the next
        forward (an EMA of the weights, their norms, a copy). It runs by itself before ``step()``, this
        optimizer's ``state_dict``/``load_state_dict`` and the model's (so before torch's
        ``get_state_dict``/``set_state_dict`` and DCP). Idempotent; nothing when nothing is pending;
        no collective (every return was issued in ``step()``): it may be called on some ranks only."""
        me = self._me()
        if me.runtime is not None:
            me.runtime.flush_updates()

    def _thawed(self) -> list[tuple[str, torch.Tensor]]:
        """The matrices the plan left out because they were frozen and that train now (``requires_grad``),
        in the optimizer's groups; the same on every rank (the model is). One flag read per such matrix."""
        if self._thawing is None:
            frozen = self._matrices.frozen
            self._thawing = [(self.param_names.get(id(p), "?"), p) for g in self.param_groups for p in g["params"]
                             if id(p) in frozen]
        return [(name, p) for name, p in self._thawing if p.requires_grad]

    def follow_requires_grad(self) -> None:
        """Makes the plan follow the parameters' ``requires_grad`` now: a matrix frozen when the plan was made
        (``requires_grad_(False)``: a backbone thawed after warm-up) is stepped by Muon once it trains, as in
        ``torch.optim.Muon`` + ``AdamW`` holding it from the start. A collective, on every rank alike (the plan
        is made again over the model as it is: :func:`dmuon.prepare`, and the runtime restarted on it).

        ``step()`` calls it by itself at the first step where such a matrix trains. Call it yourself (after
        ``requires_grad_(True)``, before the next forward) with ``hsdp_mesh``, where the backward's reductions
        across replicas follow the plan and would leave the matrix's gradient out. Nothing when no matrix left
        out of the plan trains.

        Raises:
            ValueError: For a plan given to DMuon (made with a selection DMuon cannot make again), naming the
                matrix and the fix; with ``hsdp_mesh`` at a step whose backward ran on the old plan. Raised on
                every rank alike, before anything changes.
        """
        me = self._me()
        me._ready()
        thawed = me._thawed()
        if not thawed:
            return
        name, param = thawed[0]
        if not me._own_plan:
            raise ValueError(
                f"parameter {name!r} trains now (requires_grad=True) but was frozen when the plan given to DMuon "
                "was made, which does not hold it, so Muon cannot step it and AdamW would step a Muon matrix: "
                "call dmuon.prepare again on the model as it is now and build DMuon with that plan (or build DMuon "
                "without a plan, which makes the plan again by itself); to train it with AdamW, give it to DMuon "
                "in a group {'params': [...], 'algorithm': 'adamw'} when building it")
        if me.plan.replicate_level and any(p.grad is not None for _, p in thawed):
            raise ValueError(
                f"parameter {name!r} started training (requires_grad=True) after DMuon's plan was made, and this "
                "backward ran on that plan: with hsdp_mesh dmuon reduces the gradients across replicas in backward "
                "by the plan, which left this one out. Call opt.follow_requires_grad() on every rank after "
                "requires_grad_(True) and before the next forward")
        me._replan()

    def _replan(self) -> None:
        """Makes the plan again on the model as it is and restarts the runtime on it (a collective, on every
        rank alike). The old runtime is emptied first: the last step's updates held for the next forward
        applied (:meth:`flush_updates`: dropped with the runtime otherwise, a lost step), the exchanges
        backward launched landed unused (the new runtime exchanges every direction in ``step()`` from the
        gradients, which the launches only read) and the NS worker's results taken. The new plan is made
        before the old runtime is closed, so an error there (raised on every rank by :func:`dmuon.prepare`)
        leaves the optimizer stepping on the old one."""
        runtime = self.runtime
        runtime.flush_updates()
        backward = getattr(runtime, "backward", None)
        if backward is not None:
            launches, _ = backward.take()
            land_unused(launches)
        # Under torch's DDP the plan is made over DDP's group: prepare() is given the wrapper, as at setup.
        plan = prepare(self.model if self._ddp is None else self._ddp, ns=self.ns, hsdp_mesh=self._hsdp_mesh)
        runtime.close()
        self.runtime = None
        self._adopt_plan(plan)
        DeferredSetup.check_split(self.param_groups, lambda p: self._matrices.holds(p, None), self.param_names)
        self._start_runtime()

    def _me(self) -> DMuon:
        """This optimizer, also when called through a wrapper that took DMuon's class and delegates
        attribute reads to it (Lightning Fabric's ``_FabricOptimizer``), where writes must not land."""
        return self if "param_groups" in self.__dict__ else self.optimizer

    def _ready(self) -> None:
        """Sets the optimizer up on the sharded model if it is not yet: on every rank alike (a collective)."""
        self = self._me()
        if self.runtime is not None:
            return
        deferred = self._deferred
        # DDP(...) wrapped the model after DMuon was built (looked for only while nothing is sharded).
        ddp = wrapping_ddp(self.model) if waits_for_sharding(self.model) else None
        if ddp is None:
            deferred.check_sharded()
        self._ddp = ddp
        deferred.rebind(self.__dict__["param_groups"], self.state, strict=True)
        self._adopt_plan(prepare(self.model if ddp is None else ddp, ns=self.ns, hsdp_mesh=self._hsdp_mesh))
        deferred.check_split(self.param_groups, lambda p: self._matrices.holds(p, None), self.param_names)
        self._start_runtime()
        self._deferred = None
        deferred.close()

    @property
    def is_set_up(self) -> bool:
        """Whether the plan and the runtime exist (a DMuon built before ``fully_shard`` sets itself up at
        the model's first forward, or at the first ``step()``, ``clip_grad_norm_`` or state load)."""
        return self.runtime is not None

    # ------------------------------------------------------------------- groups
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """torch.optim's param groups; before setup, every read first puts the model's current parameters
        in them (:meth:`DeferredSetup.rebind`), so a framework's state-dict code sees the sharded parameters."""
        try:
            groups = self.__dict__["param_groups"]
        except KeyError:
            # A wrapper that took DMuon's class (Lightning's _FabricOptimizer) delegates through __getattr__.
            raise AttributeError("param_groups") from None
        deferred = self.__dict__.get("_deferred")
        if deferred is not None:
            deferred.rebind(groups, self.state)
        return groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.__dict__["param_groups"] = value

    def matrix_indices(self, param: torch.Tensor) -> list[int]:
        """The plan indices of ``param``'s matrices (several for a stack of experts or row groups)."""
        return self._matrices.indices(param)

    def split_group(self, group: dict[str, Any], index: int = 0,
                    names: dict[int, str] | None = None) -> list[dict[str, Any]]:
        """A torch.optim-style param group as DMuon's: a Muon group and an AdamW group (either may be absent);
        :meth:`GroupSplitter.split <dmuon.optim.groups.GroupSplitter.split>` says which key goes where."""
        return self._splitter.split(group, index=index, names=names)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Adds a group, as torch.optim does: a torch.optim-style group is split as the constructor splits
        them (:meth:`split_group`: a Muon half, an AdamW half); one with DMuon's ``algorithm`` key is added
        as it is, after checking its parameters are of that kind."""
        if "algorithm" not in param_group:
            check_named_alike(named_group(param_group), self._user_named)
            self._check_not_held(param_group)
            self._plan_new_matrices(param_group)
            named = all("param_names" in g for g in self.param_groups)
            user_index = max(self._user_group_of, default=-1) + 1
            for half in self.split_group(param_group, index=len(self.param_groups)):
                if not named:
                    half.pop("param_names", None)
                self._user_group_of.append(user_index)
                self.add_param_group(half)
            return
        if len(self._user_group_of) == len(self.param_groups):  # one of DMuon's groups, added by the user
            self._user_group_of.append(max(self._user_group_of, default=-1) + 1)
        self._splitter.complete(param_group)
        if param_group["algorithm"] == "muon":
            self.check_ns_keys(param_group)
            self.check_rule_keys(param_group)
        else:
            check_adamw_group(param_group, f"param group {group_index(self.param_groups, param_group)}: ")
            param_group = AdamWGroup(param_group)
        saved, self.defaults = self.defaults, {}
        try:
            super().add_param_group(param_group)
        finally:
            self.defaults = saved
        if self.__dict__.get("_deferred") is not None:
            self._deferred.record([param_group], self._splitter.names())  # swapped for the sharded one at setup
        self._thawing = None  # the group may hold a frozen matrix (_thawed)

    def _check_not_held(self, group: dict[str, Any]) -> None:
        """torch.optim's ``ValueError`` for a parameter already in a group, raised before anything changes
        and saying why it is there (a frozen matrix ``DMuon(model)`` holds is Muon's once it trains)."""
        params = group.get("params", ())
        params = [params] if isinstance(params, torch.Tensor) else params
        if not isinstance(params, (list, tuple)):
            return  # refused by the split, as torch.optim refuses it
        held = {id(p): k for k, g in enumerate(self.param_groups) for p in g["params"]}
        for item in params:
            p = item[1] if isinstance(item, tuple) else item
            if id(p) in held:
                name = self.param_names.get(id(p)) or self._splitter.names().get(id(p), "?")
                raise ValueError(
                    f"some parameters appear in more than one parameter group: {name!r} is in param group "
                    f"{held[id(p)]} already ({self.param_groups[held[id(p)]]['algorithm']!r}). DMuon(model) holds "
                    "every parameter of the model, frozen ones too, and a frozen matrix is stepped by Muon once "
                    "it trains (requires_grad_(True) is enough, no add_param_group)")

    def per_group(self, values: Iterable[Any]) -> list[Any]:
        """One value per user param group (the constructor's groups, then each ``add_param_group``) as one
        per DMuon param group: each user group is split in a Muon and an AdamW half (either may be
        absent), and each half takes its user group's value.

        What torch's schedulers with one value per group take: ``OneCycleLR(opt,
        max_lr=opt.per_group([3e-3, 1e-3]))`` (a list of the user's length raises torch's "max_lr has 2
        values, param_groups has 4"); a value per DMuon group may also be given directly.

        Raises:
            ValueError: For a length other than the number of user groups, naming both.
        """
        values = list(values)
        users = max(self._user_group_of, default=-1) + 1
        if len(values) != users:
            raise ValueError(f"per_group got {len(values)} values for {users} user param groups (DMuon holds "
                             f"{len(self.param_groups)} groups: a Muon and an AdamW half per user group)")
        return [values[k] for k in self._user_group_of]

    def _plan_new_matrices(self, group: dict[str, Any]) -> None:
        """Makes the matrices of ``group`` (a torch.optim-style group being added) that the default selection
        takes now, and the plan does not hold (weights frozen when the plan was made, unfrozen since), Muon
        matrices: before setup by selecting again on the model as it is; after it by making the plan again
        (a collective, as ``dmuon.prepare``: add the group on every rank alike) and restarting the runtime
        on it (:meth:`_replan`: the updates held for the next forward applied first). With a plan of the user's,
        ``ValueError`` naming the first such weight."""
        if self._deferred is not None:
            self._matrices.reselect(default_matrices(self.model))
            return
        params = group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        tensors = {id(p[1] if isinstance(p, tuple) else p) for p in params}
        new = [n for n, p in select_matrices(self.model)
               if p.requires_grad and id(p) in tensors and not self._matrices.planned(p)]
        if not new:
            return
        if not self._own_plan:
            raise ValueError(
                f"parameter {new[0]!r} is a matrix Muon updates, but the plan given to DMuon was made while it was "
                "frozen (requires_grad=False) and does not hold it: call dmuon.prepare again on the model as it is "
                "now and build DMuon with that plan, or build DMuon without a plan")
        self._replan()

    def check_ns_keys(self, group: dict[str, Any]) -> None:
        """Raises ``ValueError`` naming the group and key when a Muon group's NS setting differs from
        :attr:`ns` (the plan priced every owner's work with one NS configuration, and the owners batch
        matrices across groups)."""
        check_ns_keys(group, group_index(self.param_groups, group), self.ns)

    def check_rule_keys(self, group: dict[str, Any]) -> None:
        """Raises ``ValueError`` naming the group and key for a Muon group's bad ``adjust_lr_fn``,
        ``extra_scale_factor`` or ``cautious_weight_decay``."""
        check_rule_settings(group["adjust_lr_fn"], group["extra_scale_factor"], group["cautious_weight_decay"],
                            f"param group {group_index(self.param_groups, group)}: ")

    # -------------------------------------------------------------------- state
    _NOT_COPIED = ("runtime", "_deferred", "_ddp", "_optimizer_step_pre_hooks", "_optimizer_step_post_hooks",
                   "_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks",
                   "_optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks")
    """What a copy (``copy.deepcopy``, pickle) leaves out: the runtime, which the copy builds again on its
    own model, and the hooks, which torch.optim's copies leave out too."""

    def __getstate__(self) -> dict[str, Any]:
        """The optimizer with its model, plan and settings (torch.optim keeps only the defaults, state and
        groups; DMuon needs its model to step): ``copy.deepcopy((model, opt))`` gives a copy stepping the
        copied model, ``copy.deepcopy(opt)`` a copy with a copy of the model, pickle both."""
        if any(isinstance(p, DTensor) for p in self.model.parameters()):
            raise TypeError("DMuon on a sharded model cannot be copied or pickled: a copy steps its own copy of "
                            "the model, and FSDP2 does not copy its modules (copy.deepcopy of a fully_shard-ed "
                            "model raises); duplicate the training state with state dicts instead "
                            "(torch.distributed.checkpoint, or model and optimizer state_dict()/load_state_dict())")
        self.flush_updates()
        state = {k: v for k, v in self.__dict__.items() if k not in self._NOT_COPIED}
        state["_set_up"] = self.runtime is not None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        copied = "_set_up" in state
        set_up = state.pop("_set_up", False)
        super().__setstate__(state)
        groups = self.__dict__.get("param_groups", [])
        fill_rule_defaults(groups)
        for group in groups:
            if group.get("algorithm") == "adamw":
                for key, value in ADAMW_GROUP_DEFAULTS.items():
                    group.setdefault(key, value)  # torch's rule for keys a saved state may lack
        as_adamw_groups(groups)
        if not copied:
            return  # torch.optim.Optimizer.load_state_dict's call: the groups and state only
        self.runtime, self._deferred, self._ddp = None, None, None
        if set_up:
            self._adopt_plan(self.plan)
            self._start_runtime()
        else:
            self._deferred = DeferredSetup(self.model)
            self._deferred.record(groups, self._splitter.names())
            self._deferred.wait_for_forward(self._ready)

    def state_dict(self) -> dict[str, Any]:
        """As ``torch.optim.Optimizer.state_dict``. With ``ExecutionConfig.clipped_overlap`` it also marks
        the owners' momentum copies stale: a run resumed from this state starts them from the exact
        momentum, so the run that goes on does too (the next step exchanges clipped blocks again and
        sends the momentum to the owners once), and both take the same steps bit for bit. No
        collective: it may be taken on some ranks only. Pending updates are applied first (:meth:`flush_updates`)."""
        self.flush_updates()
        out = super().state_dict()
        if self.runtime is not None and self.runtime.owner_momentum is not None:
            self.runtime.owner_momentum.invalidate()
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As ``torch.optim.Optimizer.load_state_dict``, keeping Muon's momentum in float32 and in its layout.

        torch casts floating-point state to its parameter's dtype on load; Muon's
        momentum is fp32 whatever the parameter's dtype (as torch.optim.Muon's would
        be for fp32 parameters), so it is taken again from the incoming values (so is
        the rest of :attr:`matrix_state`: NorMuon's second moment). A
        momentum DTensor laid out otherwise (a state dict built by hand for
        another mesh) is redistributed to the runtime's layout, on every rank in
        the same order. Built before sharding, DMuon sets itself up first (a
        collective, as loading a sharded checkpoint is) once the model is sharded;
        before that, only a state without momenta loads (what accelerate's
        ``prepare`` does with a fresh optimizer). Pending updates are applied first (:meth:`flush_updates`).
        """
        self.flush_updates()
        if not self.is_set_up:
            if waits_for_sharding(self.model) and wrapping_ddp(self.model) is None:
                if any(isinstance(v, dict) and set(self.matrix_state) & v.keys() for v in state_dict["state"].values()):
                    raise ValueError("DMuon was built before fully_shard and the model is not sharded yet: load "
                                     "optimizer checkpoints after sharding (after accelerator.prepare, fabric.setup "
                                     "or fully_shard)")
                super().load_state_dict(state_dict)
                return
            self._ready()
        order = [k for g in state_dict["param_groups"] for k in g["params"]]
        kept = [(k, name, v[name]) for k, v in state_dict["state"].items() if isinstance(v, dict)
                for name in self.matrix_state if name in v]
        super().load_state_dict(state_dict)
        params = [p for g in self.param_groups for p in g["params"]]
        for key, name, value in sorted(kept, key=lambda kv: (order.index(kv[0]), kv[1])):
            param = params[order.index(key)]
            info = self.plan.infos[self.matrix_indices(param)[0]]
            mesh, placements = self.matrix_state[name](self.momentum, info)
            if isinstance(value, DTensor) and value.device_mesh == mesh and tuple(value.placements) != placements:
                value = value.redistribute(mesh, placements)
            self.state[param][name] = value.to(device=param.device, dtype=torch.float32)
        if self.runtime.owner_momentum is not None:
            self.runtime.owner_momentum.invalidate()  # the owners' copies follow the old momentum

    # --------------------------------------------------------------------- step
    @torch.compiler.disable  # a declared graph break: collectives, host bookkeeping, a worker thread
    @torch.no_grad()
    def step(self, closure=None):
        """Performs one optimization step on every rank (a collective call).

        Under ``torch.compile`` (a compiled function that calls it, torch's compiled-optimizer recipe)
        it runs eagerly, a declared graph break: the step's agreement, exchanges and NS autotuning are
        host work and collectives that a graph cannot hold; what is around it compiles as usual.

        The runtime runs it (:meth:`dmuon.runtime.ShardRuntime.step`): the
        agreement, the momentum (:meth:`MuonCallbacks.commit`), the owners' NS,
        the update returns, AdamW while they travel, and the updates' apply.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # Under the caller's autocast (a loop written wholly inside torch.autocast) the owners' NS on this
        # thread would drop to the autocast dtype while the NS worker's runs as configured: the step runs
        # as configured wherever its work runs (dmuon.util.autocast).
        with autocast_off(self._device()):
            self._ready()
            if self._thawed():
                self.follow_requires_grad()
            if self._pp_group is not None and not self._stages_checked:
                check_ties_across_stages(self.model, self.plan, self._pp_group)  # every stage's first step
                self._stages_checked = True
            try:
                self._last_report = self.runtime.step()
                if self.execution.apply_updates == "next_forward":
                    self.runtime.callbacks.hold_settings()  # the updates land after a scheduler's step()
                if self.plan.ddp:
                    self._mark_stepped()
            finally:
                if self._qk is not None:
                    self._qk.reset()  # a step's reports are its own, applied or skipped
        return loss

    def _device(self) -> torch.device | None:
        """The plan's device (None before setup: the first parameter's, where the setup will run)."""
        if self.plan is not None:
            return self.plan.device
        return next((p.device for p in self.model.parameters()), None)

    def _mark_stepped(self) -> None:
        """Under DDP: an (empty) state entry for each stepped matrix this rank does not own, so that the
        state dict names every stepped parameter on every rank, as torch's optimizers' do (torch's
        ``set_optimizer_state_dict`` requires it; DCP then loads each owner's momentum where it lives now)."""
        if not self._last_report.skipped_nonfinite:
            for info in self.plan.infos:
                if info.param.grad is not None:
                    self.state[info.param]  # noqa: B018 (the defaultdict's entry)

    @torch.compiler.disable  # bookkeeping on a buffer outside the graph; a compiled forward breaks here
    def report_attention_logits(self, layer: str, max_logits: torch.Tensor, first_head: int = 0) -> None:
        """QK-clip: this rank's largest pre-softmax attention logit per query head of ``layer``.

        Call it from the layer's forward (or anywhere before ``step()``) with the maximum over
        this rank's tokens of ``q . k * softmax_scale`` (masked positions left out): an eager
        ``scores.amax((0, 2, 3))``, or FlexAttention's ``max_scores`` (accelerators only) reduced
        over batch and positions once checked to be on that scale.
        Every call between two ``step()`` calls counts (accumulation micro-batches,
        recomputation): the step takes their maximum, and then the maximum over every rank,
        carried with the step's agreement (no collective of its own). It issues no collective and
        does not synchronize the device.

        Args:
            layer: The layer's key in ``qk_clip.layers``.
            max_logits: 1-D, one value per query head, heads ``first_head, first_head + 1, ...``;
                any float dtype and device, detached here.
            first_head: The first head ``max_logits`` covers (tensor parallelism: this rank's first
                local head), so a rank may report only the heads it computes.

        What is left out, by design: a NaN or infinite value (the forward already overflowed, and
        ``tau / inf`` would zero the head for good), a value ``<= tau`` (nothing to clip), a head
        nobody reported, a layer with no report this step: those heads are not clipped. A skipped
        step (``nonfinite="skip"``) clips nothing and its reports are dropped.

        Raises:
            ValueError: Without ``qk_clip``, for an unknown layer or heads past its ``num_heads``
                (naming the layer); TypeError for a DTensor (pass ``to_local()`` and ``first_head``).
        """
        me = self._me()
        if me._qk is None:
            raise ValueError("report_attention_logits needs QK-clip: build the optimizer with "
                             "qk_clip=dmuon.QKClip(layers={...})")
        me._qk.report(layer, max_logits, first_head)

    @property
    def attention_clip(self) -> AttentionClip | None:
        """QK-clip's runtime part (the logits reported this step, the clip after it); None without ``qk_clip``."""
        return self._qk

    def last_attention_logits(self) -> dict[str, torch.Tensor]:
        """QK-clip: per layer, the last applied step's largest logit per key head over every rank
        (what its factors came from; float32, on the CPU). Empty before the first applied step."""
        me = self._me()
        return {} if me._qk is None else dict(me._qk.last_maxima)

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
            The total norm before clipping (a float32 tensor on the model's device, the same on every
            rank; nothing is read to the host, as with torch's).
        """
        me = self._me()
        me._ready()
        params = [p for g in me.param_groups for p in g["params"]]
        return me.runtime.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite)

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
