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

The class reads as the front door: construction, ``step()``, the state dict hooks and the reports; what they
delegate to sits beside it: the param groups (:mod:`dmuon.optim.param_groups`), the plan and runtime made and
made again (:mod:`dmuon.optim.lifecycle`) under the parallelism decided once at construction
(:mod:`dmuon.prepare.setup`), state dicts and copies (:mod:`dmuon.optim.state`), QK-clip
(:mod:`dmuon.optim.qk_clip`) and the pipeline stages' checks (:mod:`dmuon.optim.stages`, one optimizer per
rank and group; :mod:`dmuon.prepare.ties`, no weight tied across stages split between the rules).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from dmuon.optim import state as saved
from dmuon.optim.callbacks import MuonCallbacks
from dmuon.optim.deferred import DeferredSetup, default_matrices
from dmuon.optim.groups import GroupSplitter, MuonMatrices, canonical_name, check_named_alike, named_group
from dmuon.optim.lifecycle import PlanLifecycle
from dmuon.optim.momentum import MomentumLayout
from dmuon.optim.param_groups import ParamGroups
from dmuon.optim.qk_clip import AttentionClip, AttentionClipMethods
from dmuon.optim.settings import (AdamWConfig, check_execution, check_nonnegative, check_plan_inputs,
                                  check_tensor_lr, model_and_groups, pipeline_group, refuse_settings_elsewhere,
                                  resolve_ns)
from dmuon.optim.stages import claim_pipeline_group
from dmuon.ortho.config import NSConfig
from dmuon.plan.plan import Plan
from dmuon.prepare import prepare
from dmuon.prepare.setup import Setup
from dmuon.prepare.ties import check_ties_across_stages
from dmuon.rules.muon import check_rule_settings
from dmuon.rules.qk_clip import QKClip
from dmuon.runtime import ExecutionConfig, StepReport
from dmuon.util.autocast import autocast_off


class DMuon(ParamGroups, PlanLifecycle, AttentionClipMethods, torch.optim.Optimizer):
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

    # ------------------------------------------------------------ construction
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
        self._setup = Setup.decide(model, plan)
        """FSDP2, torch's DDP or not sharded yet (settled at setup), decided once: read wherever it matters."""
        model = self._setup.model
        self._pp_group = pipeline_group(pp_group)
        claim_pipeline_group(self._pp_group, model)
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
        self.runtime = None
        self.param_names: dict[int, str] = {}
        """Parameter (by id) -> its name in the model (once set up)."""
        self.qk_clip = qk_clip
        """QK-clip's configuration (None: no clip)."""
        self._hsdp_mesh = hsdp_mesh
        self._last_report = StepReport()
        self._own_plan = plan is None  # a plan DMuon made may be made again (add_param_group, a matrix thawed)
        self._thawing: list[tuple[str, torch.Tensor]] | None = None  # see _thawed
        muon_defaults = dict(
            lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
            ns_coefficients=self.ns.coefficients, eps=self.ns.eps, ns_steps=self.ns.steps, adjust_lr_fn=adjust_lr_fn,
            extra_scale_factor=extra_scale_factor, cautious_weight_decay=cautious_weight_decay,
            **self._rule_defaults(),
        )
        groups = self._plan_and_split(user_groups, plan, muon_defaults)
        super().__init__(groups, defaults=dict(muon_defaults))
        if self._deferred is None:
            self._start_runtime()
        else:
            self._deferred.wait_for_forward(self._ready)

    def _plan_and_split(self, user_groups: list[dict[str, Any]] | None, plan: Plan | None,
                        muon_defaults: dict[str, Any]) -> list[dict[str, Any]]:
        """The plan taken (made now, or after sharding when the setup waits for it) and the user's groups
        split by its matrices (before sharding: by the default selection on the model as it is)."""
        model = self.model
        self._user_named = bool(user_groups) and named_group(user_groups[0])
        for group in user_groups or ():
            check_named_alike(named_group(group), self._user_named)
        waiting = self._setup.waiting
        self._matrices = MuonMatrices(default_matrices(model) if waiting else None)
        self._deferred = DeferredSetup(model) if waiting else None
        if not waiting:
            self._adopt_plan(plan if plan is not None else
                             prepare(self._setup.planned, ns=self.ns, hsdp_mesh=self._hsdp_mesh))
        self._splitter = GroupSplitter(model, self._matrices, muon_defaults,
                                       self.adamw.group_defaults(muon_defaults["lr"]),
                                       adamw_lr_given=self.adamw.lr is not None)
        named = self._splitter.names()
        self._qk: AttentionClip | None = None if self.qk_clip is None else AttentionClip(
            self.qk_clip, {canonical_name(n): p for n, p in model.named_parameters()}, named)
        return self._split_groups(user_groups, named)

    # -------------------------------------------------------------------- state
    def __getstate__(self) -> dict[str, Any]:
        """The optimizer with its model, plan and settings (torch.optim keeps only the defaults, state and
        groups; DMuon needs its model to step): ``copy.deepcopy((model, opt))`` gives a copy stepping the
        copied model, ``copy.deepcopy(opt)`` a copy with a copy of the model, pickle both."""
        return saved.copied_state(self)

    def __setstate__(self, state: dict[str, Any]) -> None:
        copied = "_set_up" in state
        set_up = state.pop("_set_up", False)
        super().__setstate__(state)
        saved.complete_groups(self.__dict__.get("param_groups", []))
        if copied:  # else torch.optim.Optimizer.load_state_dict's call: the groups and state only
            self._restart_copy(set_up)

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
            if self._setup.still_waiting():
                saved.refuse_momenta_before_sharding(state_dict, self.matrix_state)
                super().load_state_dict(state_dict)
                return
            self._ready()
        kept = saved.matrix_state_in(state_dict, self.matrix_state)
        super().load_state_dict(state_dict)
        saved.restore_matrix_state(self, kept)

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
                # At the first step, not at setup: what ties two stages' weights is their values, which a
                # framework may still set after building the optimizer (torchtitan loads its checkpoint then),
                # and a setup at the model's first forward (built before sharding) runs while the other
                # stages wait in the schedule's send and receive, where a collective over them would hang.
                check_ties_across_stages(self.model, self.plan, self._pp_group)
                self._stages_checked = True
            try:
                self._last_report = self.runtime.step()
                if self.execution.apply_updates == "next_forward":
                    self.runtime.callbacks.hold_settings()  # the updates land after a scheduler's step()
                if self._setup.ddp_runs:
                    saved.mark_stepped(self)
            finally:
                if self._qk is not None:
                    self._qk.reset()  # a step's reports are its own, applied or skipped
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
