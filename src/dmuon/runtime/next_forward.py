"""Updates applied in the next forward (``ExecutionConfig.apply_updates="next_forward"``).

``step()`` issues every update return, each hop of it (on HSDP the publication across
replicas too, chained on dmuon's own stream), and hands the returns here instead of
applying them. The next forward applies them unit by unit, from forward pre-hooks on
each FSDP2 unit that holds Muon matrices:

* a unit's **own** hook (before FSDP2's pre-forward, which all-gathers the unit) applies
  the unit's updates if nothing applied them yet, and then issues the unit's all-gather
  itself (``FSDPModule.unshard(async_op=True)``): torch issues an explicit unshard on the
  current stream, so the all-gather reads the updated shard; FSDP2's pre-forward then
  finds it issued and waits for it;
* a unit's **ahead** hook (after FSDP2's pre-forward, so the unit's own all-gather is
  already issued) does the same for the unit that followed it in the last forward, whose
  all-gather then runs beside this unit's compute.

A unit prefetched by its predecessor whose own forward then does not run (a block left out of
this forward) is gathered and resharded at the root's forward end (FSDP2 would otherwise wait
for that all-gather only at the end of backward), so no all-gather is left behind.

Each apply lands its returns on the compute stream (the rule's ``apply`` runs there, as
in ``step()``). The units are taken in the order their forwards ran last time; a unit
whose forward comes out of that order applies its own updates in its own hook. Whether a
rank unshards a unit depends only on which units got updates from the last step (the
step's agreement, the same on every rank) and whose all-gather the forward has issued since
(the order of the forward, the same on every rank, as FSDP2's own all-gathers need), never
on timing, nor on whether this rank already applied them (a flush on some ranks): every
rank issues the same all-gathers in the same order.

torchao's float8 training (``enable_fsdp_float8_all_gather=True``) casts each weight to float8 in its
all-gather, with a scale that ``precompute_float8_dynamic_scale_for_fsdp(model)`` may have set after
``step()``, from the weights before this mode's updates. When a unit's updates are applied, the scales of the
updated float8 weights that carry a precomputed scale are recomputed from the new weights, by torchao's own
function on those modules (one all-reduce per unit, on the compute stream, before the unit's all-gather):
whether to is decided from the step's matrices (every rank's list) and from whether the scale was
precomputed (the user's precompute is itself a collective, run on every rank), never from this rank's
pending updates, so every rank issues it, also a rank that flushed. The all-gather then casts the weights it
sends with their own scale, the bits of ``"in_step"`` with the precompute after ``step()``.

A rule that projects with sums over the updated weight (MuonH) gets them with its returns: ``step()``
issued each return's totals behind it (:class:`~dmuon.runtime.matrix_norms.TotalsBehind`), and a unit's
apply lands them, applies and projects, with no collective here.

:meth:`NextForwardUpdates.flush` applies whatever is pending on this rank (a unit whose forward did
not run, or before anything reads the weights outside the forward: ``step()``, state dicts, on all
ranks or some).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from dmuon.comm import Pending
from dmuon.plan.plan import Plan
from dmuon.util.autocast import autocast_off
from dmuon.util.float8 import float8_linears, has_precomputed_scale, recompute_scales
from dmuon.util.observe import ranged
from dmuon.util.torch_compat import fsdp_unit, gathered_or_gathering

Apply = Callable[[dict[int, torch.Tensor], "dict[int, torch.Tensor] | None"], None]
"""The rule's ``apply`` (its row states' argument given only to a row-state rule)."""
Project = Callable[[dict[int, torch.Tensor]], None]
"""A :class:`~dmuon.runtime.callbacks.WeightSums` rule's ``weight_totals(totals, applied=True)``."""


class NextForwardUpdates:
    """The update returns of the last ``step()``, applied unit by unit in the next forward.

    Args:
        plan: The ownership plan (its blocks: FSDP2's units with Muon matrices, and their modules).
        apply: The rule's ``apply``.
        row_width: The rule's row state per row (0: none; then ``apply`` gets no row states).
        root: FSDP2's root module (None: one process without FSDP2, nothing to gather).
        project: A :class:`~dmuon.runtime.callbacks.WeightSums` rule's ``weight_totals(..., applied=True)``,
            called with each return's totals right after its ``apply`` (None: another rule).
    """

    def __init__(self, plan: Plan, apply: Apply, row_width: int, root: nn.Module | None = None,
                 project: Project | None = None) -> None:
        self.plan = plan
        self._apply = apply
        self._project = project
        self.row_width = row_width
        self._returns: list[tuple[Pending, list[int]]] = []
        self._totals: list[Pending] = []
        self._finish: Callable[[list[int]], None] | None = None
        self._pending: dict[int, set[int]] = {}
        """Per unit (block index), the matrices whose update this rank has not applied yet (a flush on this
        rank alone empties it: nothing collective depends on it)."""
        self._ungathered: set[int] = set()
        """The units holding the last step's updates whose all-gather the forward has not issued yet: the same
        on every rank (only the forward's hooks, which run alike on every rank, take units out)."""
        self._order: list[int] = []
        """The units in the order their forwards ran last time."""
        self._seen: list[int] = []
        self._ran: set[int] = set()
        """The units whose forward ran since the root's forward began."""
        self._prefetched: dict[int, object] = {}
        """Units whose all-gather an ahead hook issued, their handles (until the root's forward ends)."""
        self._open = False
        """The hooks apply: from ``hold`` until the root's forward ends. Not in backward, whose
        recomputation (activation checkpointing) runs the pre-hooks again: a unit whose forward did not
        run keeps its updates until :meth:`flush`, and nothing is gathered in backward that FSDP2 did
        not ask for."""
        self._together = _gathered_together(plan)
        """Per unit, the units one unshard gathers with it (``fully_shard([a, b])``), itself included."""
        linears = float8_linears(root) if root is not None else {}
        self._float8 = {info.index: linears[id(info.param)] for info in plan.infos if id(info.param) in linears}
        """The matrices whose weight torchao's float8 training gathers in float8, their ``Float8Linear``."""
        self._rescale: dict[int, list[nn.Module]] = {}
        """Per unit holding the last step's updates, its float8 modules among them (the same on every rank:
        from the step's matrices, not from what this rank still holds), until the unit's all-gather."""
        self._hooks = []
        if root is not None:
            self._hooks.append(root.register_forward_hook(self._root_forward_end))
        for block in plan.blocks:
            module = block.module
            self._hooks.append(module.register_forward_pre_hook(self._own_hook(block.index), prepend=True))
            self._hooks.append(module.register_forward_pre_hook(self._ahead_hook(block.index)))

    @property
    def pending(self) -> bool:
        """Whether some update waits to be applied on this rank."""
        return bool(self._pending)

    def hold(self, returns: list[tuple[Pending, list[int]]],
             finish: Callable[[list[int]], None] | None = None, totals: list[Pending] | None = None) -> None:
        """Takes a step's returns, each with the matrices it carries (every rank's list: the same on
        every rank), every hop issued; ``finish`` (a :class:`~dmuon.runtime.callbacks.StepMaxima` rule's
        ``finish_step`` with the step's maxima) is called with each unit's matrices after their apply;
        ``totals`` (with ``project``: one per return, issued) are handed to ``project`` after it."""
        if (self._project is not None) != (totals is not None) or (totals is not None and len(totals) != len(returns)):
            raise ValueError("dmuon: a WeightSums rule's step must hold one set of totals per return")
        if self._pending:
            raise RuntimeError("dmuon: a step's updates were held while the last step's are pending; "
                               "flush() first")
        infos = self.plan.infos
        self._returns = returns
        self._totals = totals or []
        self._finish = finish
        for _, members in returns:
            for i in members:
                self._pending.setdefault(infos[i].block, set()).add(i)
        if self._seen:
            self._order, self._seen = self._seen, []
        self._ungathered = set(self._pending)
        self._rescale = {}
        for _, members in returns:
            for i in members:
                module = self._float8.get(i)
                if module is not None and module not in self._rescale.setdefault(infos[i].block, []):
                    self._rescale[infos[i].block].append(module)
        self._open = bool(self._ungathered)

    def flush(self) -> None:
        """Applies every update pending on this rank, unit by unit in plan order (no collective: the returns'
        hops were all issued in ``step()``). May run on some ranks only (a state dict taken on one): the
        next forward still issues the same all-gathers on every rank."""
        for block in sorted(self._pending):
            self._check_not_gathered(block)
        self._apply_units(sorted(self._pending))

    def _own_hook(self, block: int):
        @torch.compiler.disable  # eager, as FSDP2's own hooks: it writes weights and issues an all-gather
        def hook(module: nn.Module, args) -> None:
            if block not in self._seen:
                self._seen.append(block)  # a recomputation (activation checkpointing) runs it again
            if not self._open:
                return
            self._ran.add(block)
            if self._publish_unit(block):
                _unshard(module)

        return hook

    def _ahead_hook(self, block: int):
        @torch.compiler.disable
        def hook(module: nn.Module, args) -> None:
            order = self._order
            if self._open and block in order and order.index(block) + 1 < len(order):
                following = order[order.index(block) + 1]
                if self._publish_unit(following):
                    handle = _unshard(self.plan.blocks[following].module)
                    if handle is not None:
                        self._prefetched[following] = handle

        return hook

    @torch.compiler.disable
    def _root_forward_end(self, module: nn.Module, args, output) -> None:
        """The root's forward ended: a prefetched unit whose forward did not run is gathered and resharded
        (the same units on every rank: the forward is the same)."""
        for block, handle in self._prefetched.items():
            if block not in self._ran:
                handle.wait()
                self.plan.blocks[block].module.reshard()
        self._prefetched.clear()
        self._ran.clear()
        self._open = False

    def _publish_unit(self, block: int) -> bool:
        """Whether ``block``'s all-gather is to be issued now for the last step's updates (the same on every
        rank); if so, applies whatever this rank still holds of them and of the units gathered with it."""
        together = [b for b in self._together[block] if b in self._ungathered]
        if not together:
            return False
        self._check_not_gathered(block)
        self._ungathered.difference_update(together)
        self._apply_units(together)
        self._refresh_float8_scales(together)
        return True

    def _refresh_float8_scales(self, blocks: list[int]) -> None:
        """The float8 scales of ``blocks``' updated weights, recomputed from the weights their all-gather is
        about to send, where a scale was precomputed (after ``step()``, from the weights before the update);
        a collective, on every rank alike (see the module's docstring). A weight without one is cast with its
        own amax in the all-gather already."""
        modules = [m for b in blocks for m in self._rescale.pop(b, ())]
        stale = [m for m in modules if has_precomputed_scale(m)]
        if stale:
            with autocast_off(self.plan.device):
                recompute_scales(stale)

    def _check_not_gathered(self, block: int) -> None:
        module = self.plan.blocks[block].module
        if isinstance(module, FSDPModule) and gathered_or_gathering(module):
            # Its all-gather would publish the weights before this step's updates (every rank alike: the
            # same prefetch settings and hooks run on every rank).
            raise RuntimeError(
                f"dmuon: apply_updates='next_forward' found FSDP2 unit {self.plan.blocks[block].name or '<root>'!r} "
                "already gathered before its updates were applied (FSDPModule.set_modules_to_forward_prefetch, "
                "or an unshard() of yours in the forward); dmuon issues each unit's all-gather one unit ahead "
                "itself: drop the forward prefetch, or use apply_updates='in_step'")

    @torch.no_grad()
    @ranged("next_forward.apply")
    def _apply_units(self, blocks: list[int]) -> None:
        """Lands the returns carrying the updates this rank still holds of ``blocks`` and applies its rows."""
        with autocast_off(self.plan.device):  # inside the forward, under the caller's autocast: as configured
            for b in blocks:
                if b in self._pending:
                    self._apply_members(self._pending.pop(b))
        if not self._pending:
            self._returns, self._totals, self._finish = [], [], None  # every buffer of the step's returns can go

    def _apply_members(self, members: set[int]) -> None:
        """This rank's rows of ``members``' updates into their shards (then the rule's per-unit finish)."""
        for k, (pending, carried) in enumerate(self._returns):
            mine = [i for i in carried if i in members]
            if not mine:
                continue
            updates = pending.wait()
            # Landed before the apply writes the weights: step() read them on dmuon's stream for these totals.
            totals = self._totals[k].wait() if self._project is not None else None
            held = [i for i in mine if i in updates]  # a matrix of which this rank holds nothing has no entry
            if self.row_width:
                rows = pending.row_states()
                self._apply({i: updates[i] for i in held}, {i: rows[i] for i in held})
            else:
                self._apply({i: updates[i] for i in held})
            if totals is not None:
                self._project({i: totals[i] for i in mine})  # every rank's matrices: also an empty piece
        if self._finish is not None:
            self._finish(sorted(members))  # QK-clip: this unit's query and key rows, after their update

    def close(self) -> None:
        """Removes the forward hooks."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []


def _gathered_together(plan: Plan) -> dict[int, list[int]]:
    """Per block, the blocks whose modules share its FSDP2 state (one ``unshard`` gathers them all), in
    plan order; a block alone where FSDP2 does not manage the module."""
    units: dict[int, list[int]] = {}
    keys: dict[int, object] = {}
    for block in plan.blocks:
        module = block.module
        unit = fsdp_unit(module) if isinstance(module, FSDPModule) else module
        keys[block.index] = unit
        units.setdefault(id(unit), []).append(block.index)
    return {b: units[id(unit)] for b, unit in keys.items()}


def _unshard(module: nn.Module):
    """Issues ``module``'s all-gather on the current stream (after what was enqueued there), for FSDP2's
    pre-forward to wait for; its handle, or None for a module FSDP2 does not manage (one process:
    nothing to gather)."""
    if isinstance(module, FSDPModule):
        return module.unshard(async_op=True)
    return None
