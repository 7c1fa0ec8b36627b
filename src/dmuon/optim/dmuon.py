"""DMuon: the optimizer front door.

One ``torch.optim.Optimizer`` for a ``fully_shard``-ed model. Muon matrices
keep their momentum beside FSDP2's (and TP's) shards; each matrix's direction goes
to its one owner, which runs Newton-Schulz, and the update comes back to the
shards (:mod:`dmuon.runtime`). Every other parameter follows ``torch.optim.AdamW``.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from dmuon.rules.adamw import adamw_group_step, local_tensor
from dmuon.rules.muon import ADJUST_LR_FNS, apply_update, momentum_update, peek_direction
from dmuon.optim.agreement import Agreement, agreement_flags, start_agreement
from dmuon.optim.momentum import MomentumLayout
from dmuon.optim.owner_work import OwnerWork
from dmuon.plan.batches import default_return_waves
from dmuon.ortho.config import NSConfig
from dmuon.plan.plan import Plan
from dmuon.prepare import prepare
from dmuon.comm import Pending
from dmuon.runtime.runtime import Launch, ShardRuntime
from dmuon.util.bits import bitwise_equal

NONFINITE_MODES = (None, "skip", "raise")


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
        ns_coefficients: Quintic Newton-Schulz coefficients ``(a, b, c)`` (default:
            Keller Jordan's), or ``"polar_express"`` for per-iteration Polar Express
            coefficients.
        eps: Floor of the norm NS divides by (default 1e-7).
        ns_steps: Newton-Schulz iterations (default 5).
        adjust_lr_fn: ``None``/``"original"`` (Keller's scaling) or ``"match_rms_adamw"``.
        ns_method: ``"standard"`` (torch's iteration), ``"standard32"`` (the same
            iteration computed in float32, rounded to ``ns_dtype``), ``"gram"``
            (Gram NS) or ``"auto"`` (default: fastest passing the accuracy bar per shape).
        ns_dtype: Dtype NS takes its input in and returns (default ``torch.bfloat16``,
            as torch.optim.Muon); directions and updates also travel in it.

            The five NS keywords build one :class:`~dmuon.ortho.config.NSConfig`
            (``self.ns``). Left as None they take the plan's (``prepare(ns=...)``),
            else the defaults above; given with a plan they must agree with
            the plan's, which was priced with it.
        adamw_lr: AdamW learning rate (None: ``lr``).
        adamw_betas: AdamW betas.
        adamw_eps: AdamW epsilon.
        adamw_weight_decay: AdamW decoupled weight decay.
        param_groups: Optional list of dicts, each with ``"params"`` (a subset of
            the model's parameters) and overrides of the keywords above
            (``lr``, ``momentum``, ..., ``adamw_lr``, ...). Each is split into a
            Muon group and an AdamW group. Default: all parameters.
        overlap: Start each block's exchange with the owners in backward, as soon
            as FSDP2 has written the block's reduced gradients. ``step()`` checks
            that the gradients still give the directions sent (a clipped or
            edited gradient does not, and its block is exchanged again), so
            ``overlap=False`` (every exchange inside ``step()``) gives
            bit-identical results.
        ns_in_backward: Also run the owners' NS for each block on a worker thread
            during backward, as soon as its directions have arrived (needs
            ``overlap=True``). Blocks whose directions fail ``step()``'s check are
            recomputed there. NS runs in per-block batches.
        nonfinite: What a NaN/Inf in any gradient does. ``None`` (default):
            nothing is checked, as in torch.optim; ``"skip"``: every rank skips
            the whole step (parameters and optimizer state unchanged);
            ``"raise"``: every rank raises ``FloatingPointError`` naming the
            parameters. Checking reads every gradient once.
        post_optim_event: On an accelerator (CUDA), record an event after the
            step's last update and hand it to FSDP2's root
            (``FSDPModule.set_post_optim_event``), so the next forward's
            all-gathers wait for the updates only, not for work queued on the
            stream after ``step()``. Leave it False if you change parameters
            after ``step()`` (their all-gather would not wait for that). The CPU
            backend has no events: True there is an error.
        return_waves: The step's update returns go in up to this many waves,
            wave ``k`` right after every owner's ``k``-th NS batch, so the
            transfers overlap the owners' NS. None: 4 on an accelerator, 1 on
            CPU, where transfers and NS share the cores. Results do not depend on it.
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
        ns_coefficients: tuple[float, float, float] | str | None = None,
        eps: float | None = None,
        ns_steps: int | None = None,
        adjust_lr_fn: str | None = None,
        ns_method: str | None = None,
        ns_dtype: torch.dtype | None = None,
        adamw_lr: float | None = None,
        adamw_betas: tuple[float, float] = (0.9, 0.999),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 0.01,
        param_groups: list[dict[str, Any]] | None = None,
        overlap: bool = True,
        nonfinite: str | None = None,
        ns_in_backward: bool = False,
        post_optim_event: bool = False,
        return_waves: int | None = None,
    ) -> None:
        if plan is not None and not isinstance(plan, Plan):
            raise ValueError(f"plan must be the Plan returned by dmuon.prepare, got {type(plan).__name__}")
        ns = NSConfig.from_keywords(None if plan is None else plan.ns, ns_method=ns_method, eps=eps,
                                    ns_coefficients=ns_coefficients, ns_steps=ns_steps, ns_dtype=ns_dtype)
        if plan is not None and ns != plan.ns:
            raise ValueError(
                "the NS keywords differ from the plan's NS configuration, which its costs were priced with ("
                + "; ".join(ns.differences(plan.ns)) + "); pass ns=dmuon.NSConfig(...) to dmuon.prepare instead")
        if adjust_lr_fn not in ADJUST_LR_FNS:
            raise ValueError(f"adjust_lr_fn must be one of {ADJUST_LR_FNS}, got {adjust_lr_fn!r}")
        if nonfinite not in NONFINITE_MODES:
            raise ValueError(f"nonfinite must be one of {NONFINITE_MODES}, got {nonfinite!r}")
        for name, value in (("lr", lr), ("weight_decay", weight_decay), ("momentum", momentum),
                            ("adamw_weight_decay", adamw_weight_decay), ("adamw_eps", adamw_eps)):
            _check_nonnegative(name, value)
        if ns_in_backward and not overlap:
            raise ValueError("ns_in_backward=True needs overlap=True: directions reach their owners "
                             "during backward only with overlap")
        if plan is None:
            plan = prepare(model, ns=ns)
        if post_optim_event and plan.device.type == "cpu":
            raise ValueError("post_optim_event=True needs a device with events (CUDA); the CPU backend has none")
        self._root = model if post_optim_event and isinstance(model, FSDPModule) else None
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
        self.runtime = ShardRuntime(plan, plan.topology, ns.dtype, plan.device)
        self.momentum = MomentumLayout(plan.topology)
        if return_waves is None:
            return_waves = default_return_waves(plan.device.type)
        if isinstance(return_waves, bool) or not isinstance(return_waves, int) or return_waves < 1:
            raise ValueError(f"return_waves must be an int >= 1 or None, got {return_waves!r}")
        self.work = OwnerWork(plan, ns, per_block=ns_in_backward, max_waves=return_waves)
        self.overlap = overlap
        self.nonfinite = nonfinite
        self.ns_in_backward = ns_in_backward
        self._names = {id(p): n for n, p in model.named_parameters()}
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
        self._last_stats: dict[str, Any] = {}
        self._ns_worker: ThreadPoolExecutor | None = None
        self._early: dict[int, Future] = {}
        self._kept: set[int] = set()
        self._waves: list[list[int]] = []
        super().__init__(groups, defaults=dict(self._muon_defaults))
        if overlap:
            self.runtime.enable_overlap(self._peek_directions)
        if ns_in_backward:
            self._ns_worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dmuon-ns")
            self.runtime.on_launch = self._start_block_ns

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
            placements = self.momentum.placements_for(self.plan.infos[self._index[id(param)][0]])
            if isinstance(value, DTensor) and tuple(value.placements) != placements:
                value = value.redistribute(value.device_mesh, placements)
            self.state[param]["momentum_buffer"] = value.to(device=param.device, dtype=torch.float32)

    # --------------------------------------------------------------------- step
    def _muon_groups(self) -> dict[int, dict]:
        """Plan index -> param group, for every Muon matrix."""
        return {i: g for g in self.param_groups if g["algorithm"] == "muon" for p in g["params"]
                for i in self._index[id(p)]}

    def _wire(self, direction: torch.Tensor) -> torch.Tensor:
        return direction.to(self.ns.dtype).reshape(-1)

    def _local(self, index: int, tensor: torch.Tensor) -> torch.Tensor:
        """Matrix ``index``'s part of this rank's shard of ``tensor`` (its parameter, gradient or momentum)."""
        return self.plan.infos[index].local_view(local_tensor(tensor), self.runtime.topo.coords[1])

    def _check_grad(self, index: int) -> None:
        grad = self.plan.infos[index].param.grad
        if grad.is_sparse or torch.is_complex(grad):
            raise ValueError(f"parameter {self.plan.infos[index].name!r}: sparse and complex gradients are "
                             "not supported by Muon")

    @torch.no_grad()
    def _peek_directions(self, members: list[int]) -> dict[int, torch.Tensor]:
        """Runtime callback in backward: this rank's rows of each member's direction, state untouched."""
        group_of = self._muon_groups()
        out = {}
        for i in members:
            param, group = self.plan.infos[i].param, group_of[i]
            self._check_grad(i)
            buf = self.state[param].get("momentum_buffer")
            d = peek_direction(self.momentum.kept_slice(self.plan.infos[i], self._local(i, param.grad)),
                               None if buf is None else self._local(i, buf), group["momentum"], group["nesterov"])
            out[i] = self._wire(d)
        return out

    def _commit_directions(self, active: list[int], group_of: dict[int, dict]) -> dict[int, torch.Tensor]:
        """Advances the momentum of every active matrix's local rows; their directions (wire dtype)."""
        out = {}
        for i in active:
            param, group = self.plan.infos[i].param, group_of[i]
            state = self.state[param]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = self.momentum.new_buffer(self.plan.infos[i])
            d = momentum_update(self.momentum.kept_slice(self.plan.infos[i], self._local(i, param.grad)),
                                self._local(i, state["momentum_buffer"]), group["momentum"], group["nesterov"])
            out[i] = self._wire(d)
        return out

    def _agree(self, group_of: dict[int, dict], here: list[int], stale: torch.Tensor | None) -> Agreement:
        """One small all-reduce puts every rank on the same path for this step (see :func:`~dmuon.optim.agreement.start_agreement`)."""
        return self._start_agreement(group_of, here, stale)()

    def _start_agreement(self, group_of: dict[int, dict], here: list[int],
                         stale: torch.Tensor | None) -> Callable[[], Agreement]:
        """:meth:`_agree` with its all-reduce issued now and waited for by the returned function."""
        others, names = self._adamw_params()
        return start_agreement(self.runtime, self.plan.infos, group_of, here, others, self.nonfinite, stale, names)

    def _agreement_flags(self, group_of: dict[int, dict], here: list[int],
                         stale: torch.Tensor) -> tuple[torch.Tensor, Callable[[list[int]], Agreement]]:
        """This rank's agreement flags and the decision from their maximum (the caller sends them)."""
        others, names = self._adamw_params()
        return agreement_flags(self.runtime, self.plan.infos, group_of, here, others, self.nonfinite, stale, names)

    def _adamw_params(self) -> tuple[list[torch.Tensor], list[str]]:
        """The AdamW parameters (the agreement checks them with ``nonfinite=``) and their names."""
        others = [p for g in self.param_groups if g["algorithm"] == "adamw" for p in g["params"]]
        return others, [self._names.get(id(p), "?") for p in others]

    def _speculate(self, launches: dict[int, Launch],
                   group_of: dict[int, dict]) -> dict[int, tuple[dict[int, torch.Tensor], float]]:
        """The owners' NS of every launched block, run before the step's agreement is known.

        Batched exactly as ``step()`` would batch them without launches (all of
        this rank's landed matrices at once), so the results are bit-identical
        to those of ``overlap=False`` when the agreement keeps every launch;
        otherwise the caller drops them. Returns them per block, as
        ``ns_in_backward``'s are (the time on the first block).
        """
        full: dict[int, torch.Tensor] = {}
        for b in sorted(launches):
            full.update(launches[b].pending.wait())
        start = time.perf_counter()
        orthos = self.work.orthogonalize(sorted(full), full, group_of)
        spent = time.perf_counter() - start
        out: dict[int, tuple[dict[int, torch.Tensor], float]] = {}
        for k, b in enumerate(sorted(launches)):
            out[b] = ({i: o for i, o in orthos.items() if self.plan.infos[i].block == b}, spent if k == 0 else 0.0)
        return out

    def _stale(self, launches: dict[int, Launch], active: list[int],
               directions: dict[int, torch.Tensor]) -> torch.Tensor:
        """Per launch (block order), 1 unless it sent exactly these matrices and, bit for bit, these directions."""
        by_block: dict[int, list[int]] = {}
        for i in active:
            by_block.setdefault(self.plan.infos[i].block, []).append(i)
        stale = []
        for b in sorted(launches):
            launch = launches[b]
            same = launch.members == by_block.get(b, []) and all(
                bitwise_equal(launch.sent[i], directions[i]) for i in launch.members)
            stale.append(int(not same))
        return torch.tensor(stale, dtype=torch.int32)

    @torch.no_grad()
    def step(self, closure=None):
        """Performs one optimization step on every rank (a collective call)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        start = time.perf_counter()
        launches = self.runtime.take_launches() if self.overlap else {}
        early = self._join_block_ns()
        while_agreeing = 0
        adamw_done = False
        returned: Pending | None = None
        group_of = self._muon_groups()
        here = [i for i in sorted(group_of) if self.plan.infos[i].param.grad is not None]
        for i in here:
            self._check_grad(i)
        if self.nonfinite is None:
            # Nothing can skip the step, so the momentum advances first and one
            # agreement settles both the active set and the launches' verdicts.
            directions = self._commit_directions(here, group_of)
            stale_here = self._stale(launches, here, directions)
            # The owners orthogonalize what landed from backward and send the updates back
            # with the agreement's flags (no collective of its own: on shared cores each one
            # issued costs the issuing rank its turn); the updates are kept only if the
            # flags keep every launch and the launches cover every active matrix (else the
            # batches would differ). Only with one return wave: several waves return each
            # batch as soon as it is done instead.
            speculate = launches and not early and self.work.max_waves == 1
            if speculate:
                speculative = self._speculate(launches, group_of)
                flags, settle = self._agreement_flags(group_of, here, stale_here)
                speculative_return = self._return_speculative(launches, speculative, flags)
                # AdamW does not wait for the verdict (nothing skips): it runs while the
                # updates and flags travel.
                self._adamw_step()
                active, skipped, stale = settle(speculative_return.agreed().tolist())
                if not any(stale) and all(self.plan.infos[i].block in launches for i in active):
                    early = speculative
                    returned = speculative_return
                    while_agreeing = sum(len(o) for o, _ in speculative.values())
                # else: landed unused; every rank drops it alike
            else:
                decide = self._start_agreement(group_of, here, stale_here)
                self._adamw_step()  # while the flags travel
                active, skipped, stale = decide()
            adamw_done = True
        else:
            active, skipped, _ = self._agree(group_of, here, None)
            if not skipped:
                directions = self._commit_directions(active, group_of)
                stale = self.runtime.agree(self._stale(launches, active, directions)).tolist()
        orthogonalized, ns_seconds = 0, 0.0
        self._kept = set()
        self._waves = []
        if skipped:
            for launch in launches.values():
                launch.pending.wait()
        else:
            self._kept = {b for k, b in enumerate(sorted(launches)) if not stale[k]}
            orthogonalized, ns_seconds = self._muon_step(active, group_of, launches, early, directions,
                                                         adamw_done, returned)
            if self._root is not None:
                event = torch.Event(device=self.plan.device)
                event.record()  # after every update of this step, on the current stream
                self._root.set_post_optim_event(event)
        stats = self.runtime.stats
        self._last_stats = {
            "orthogonalized": orthogonalized,
            **{k: v for k, v in stats.as_dict().items() if k != "wait_seconds"},
            "exposed_comm_seconds": stats.wait_seconds,
            "ns_seconds": ns_seconds,
            "blocks_exchanged_in_backward": len(self._kept),
            "orthogonalized_in_backward": sum(len(o) for b, (o, _) in early.items() if b in self._kept)
            if self.ns_in_backward else 0,
            "orthogonalized_while_agreeing": while_agreeing,
            "step_seconds": time.perf_counter() - start,
            "skipped_nonfinite": skipped,
            "return_waves": [list(w) for w in self._waves],
        }
        stats.reset()
        return loss

    def _adamw_step(self) -> None:
        for group in self.param_groups:
            if group["algorithm"] == "adamw":
                adamw_group_step(group, self.state)

    def _return_speculative(self, launches: dict[int, Launch],
                            speculative: dict[int, tuple[dict[int, torch.Tensor], float]],
                            flags: torch.Tensor) -> Pending:
        """Issues the one return wave of every launched matrix with :meth:`_speculate`'s updates,
        and the agreement's ``flags`` with it.

        The members are the launches' (the same on every rank), which are the
        step's active matrices whenever the speculation is kept, so the wave is
        the one ``_muon_step`` would issue.
        """
        members = sorted(i for launch in launches.values() for i in launch.members)
        owned = {i: o for orthos, _ in speculative.values() for i, o in orthos.items()}
        return self.runtime.exchange.return_updates(members, owned, flags)

    def _muon_step(self, active: list[int], group_of: dict[int, dict], launches: dict[int, Launch],
                   early: dict[int, tuple[dict[int, torch.Tensor], float]],
                   directions: dict[int, torch.Tensor], adamw_done: bool,
                   returned: Pending | None) -> tuple[int, float]:
        """The Muon half of the step (and AdamW's, unless ``adamw_done``), once the agreement is in.

        ``returned``: the speculative return wave of ``early``'s updates, kept (every
        block was launched and orthogonalized before the agreement); otherwise the
        exchanges, NS batches and return waves run here.
        """
        infos, kept = self.plan.infos, self._kept
        for b in launches:
            if b not in kept:
                launches[b].pending.wait()  # stale: lands unused
        ns_seconds = sum(spent for b, (_, spent) in early.items() if b in kept)
        done = kept & early.keys()
        orthos: dict[int, torch.Tensor] = {}
        for b in done:
            orthos.update(early[b][0])  # this rank's own
        if returned is not None:
            returns = [returned]
            self._waves = [list(active)]
        else:
            # Everything not kept from backward goes to the owners in one exchange.
            rest = [i for i in active if infos[i].block not in kept]
            pending = [launches[b].pending for b in sorted(kept) if b not in early]
            pending.append(self.runtime.exchange.send_directions(rest, directions))
            ns_start = time.perf_counter()
            full: dict[int, torch.Tensor] = {}
            for p in pending:
                full.update(p.wait())
            # Every rank's matrices whose NS ran in backward (not only this rank's): the waves must agree.
            waves = self.work.return_waves(active, {i for i in active if infos[i].block in done}, group_of)
            self._waves = [members for members, _ in waves]
            returns = []
            for members, batches in waves:
                for batch in batches:
                    orthos.update(self.work.orthogonalize_batch(batch, [full.pop(i) for i in batch], group_of))
                for earlier in returns:
                    earlier.forward()  # HSDP: hop 2 of the earlier waves, behind this wave's NS
                returns.append(self.runtime.exchange.return_updates(members, {i: orthos[i] for i in members if i in orthos}))
            ns_seconds += time.perf_counter() - ns_start
        if not adamw_done:
            self._adamw_step()  # while the last wave travels
        column = self.runtime.topo.coords[1]
        for returned_wave in returns:
            for i, rows in returned_wave.wait().items():
                info, group = infos[i], group_of[i]
                if info.piece_numel(column):
                    apply_update(self._local(i, info.param), rows, lr=group["lr"], weight_decay=group["weight_decay"],
                                 adjust_lr_fn=group["adjust_lr_fn"], matrix_shape=info.matrix_shape)
        return len(orthos), ns_seconds

    # ------------------------------------------------------------ NS in backward
    def _start_block_ns(self, launch: Launch) -> None:
        """Runtime callback: ``launch`` was just issued in backward."""
        assert self._ns_worker is not None
        self._early[launch.block] = self._ns_worker.submit(self._block_ns, launch, self._muon_groups())

    @torch.no_grad()
    def _block_ns(self, launch: Launch, group_of: dict[int, dict]) -> tuple[dict[int, torch.Tensor], float]:
        # Worker thread: waits only on an exchange the main thread launched and issues
        # no collective itself, so every rank's collective order stays the main thread's.
        full = launch.pending.wait(exposed=False)
        start = time.perf_counter()
        return self.work.orthogonalize(sorted(full), full, group_of), time.perf_counter() - start

    def _join_block_ns(self) -> dict[int, tuple[dict[int, torch.Tensor], float]]:
        done = {b: f.result() for b, f in sorted(self._early.items())}
        self._early.clear()
        return done

    def last_step_stats(self) -> dict[str, Any]:
        """This rank's figures for the last step and the backward before it.

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
        backward and none went stale), ``step_seconds``, ``skipped_nonfinite`` and ``return_waves`` (the
        matrices of each pipelined update return, in order; see
        :meth:`dmuon.optim.owner_work.OwnerWork.return_waves`).
        """
        return dict(self._last_stats)
