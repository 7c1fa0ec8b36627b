"""DMuon's plan and runtime, made and made again (:class:`PlanLifecycle`): a plan taken for the model, the
runtime started on it under the parallelism decided at construction (:class:`~dmuon.prepare.setup.Setup`),
the setup that waited for sharding completed at the model's first forward, and the plan made again when a
matrix left out of it (frozen when it was made) trains."""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule

from dmuon.optim.deferred import DeferredSetup
from dmuon.optim.groups import canonical_name
from dmuon.optim.momentum import MomentumLayout
from dmuon.plan.plan import Plan
from dmuon.plan.selection import select_matrices
from dmuon.prepare import prepare
from dmuon.prepare.setup import Parallelism, Setup
from dmuon.runtime import ExecutionConfig, ShardRuntime
from dmuon.runtime.ddp import DdpRuntime
from dmuon.runtime.settle import land_unused


class PlanLifecycle:
    """The plan and runtime methods of :class:`dmuon.optim.dmuon.DMuon` (a mixin: it sets the optimizer's
    ``plan``, ``momentum``, ``param_names`` and ``runtime``)."""

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
        if self._setup.ddp_runs:  # torch's DDP: every rank holds the whole model and its mean gradient
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
        plan = prepare(self._setup.planned, ns=self.ns, hsdp_mesh=self._hsdp_mesh)  # over DDP's group under DDP
        runtime.close()
        self.runtime = None
        self._adopt_plan(plan)
        DeferredSetup.check_split(self.param_groups, lambda p: self._matrices.holds(p, None), self.param_names)
        self._start_runtime()

    def _me(self) -> Any:
        """This optimizer, also when called through a wrapper that took DMuon's class and delegates
        attribute reads to it (Lightning Fabric's ``_FabricOptimizer``), where writes must not land."""
        return self if "param_groups" in self.__dict__ else self.optimizer

    def _ready(self) -> None:
        """Sets the optimizer up on the sharded model if it is not yet: on every rank alike (a collective)."""
        self = self._me()
        if self.runtime is not None:
            return
        deferred = self._deferred
        setup = self._setup.settled()  # sharded by now, or wrapped in DDP since DMuon was built
        deferred.rebind(self.__dict__["param_groups"], self.state, strict=True)
        self._adopt_plan(prepare(setup.planned, ns=self.ns, hsdp_mesh=self._hsdp_mesh))
        self._setup = setup
        deferred.check_split(self.param_groups, lambda p: self._matrices.holds(p, None), self.param_names)
        self._start_runtime()
        self._deferred = None
        deferred.close()

    @property
    def is_set_up(self) -> bool:
        """Whether the plan and the runtime exist (a DMuon built before ``fully_shard`` sets itself up at
        the model's first forward, or at the first ``step()``, ``clip_grad_norm_`` or state load)."""
        return self.runtime is not None

    def _restart_copy(self, set_up: bool) -> None:
        """A copy (``copy.deepcopy``, pickle) sets itself up again on its own model, which no DDP wraps: at
        once when the original was set up (on the copied plan), else at its model's first forward."""
        self.runtime, self._deferred = None, None
        if set_up:
            self._setup = Setup.of_plan(self.model, self.plan)
            self._adopt_plan(self.plan)
            self._start_runtime()
        else:
            self._setup = Setup(Parallelism.BEFORE_SHARDING, self.model)
            self._deferred = DeferredSetup(self.model)
            self._deferred.record(self.__dict__["param_groups"], self._splitter.names())
            self._deferred.wait_for_forward(self._ready)

    def _device(self) -> torch.device | None:
        """The plan's device (None before setup: the first parameter's, where the setup will run)."""
        if self.plan is not None:
            return self.plan.device
        return next((p.device for p in self.model.parameters()), None)

