"""Step 2 of a step: what every rank settles before the owners' work.

Which matrices have a gradient, whether a non-finite gradient skips the step, which
launches from backward still stand (bit for bit the directions ``commit`` gives now,
or, with ``clipped_overlap``, those of gradients since scaled by one factor), and
the rule's step maxima: one agreement (:mod:`dmuon.runtime.agreement`), the same on
every rank. The optimizer's ``commit`` advances its state here.

With ``nonfinite=None`` nothing can skip the step, so the state advances first and one
agreement settles everything; when every block was launched in backward the owners'
work on the launched directions runs while the agreement travels, its return carrying
the agreement's flags (the *speculative* step: kept only if the flags keep every launch).
With ``nonfinite=`` the step's fate is agreed before any state advances, then the
launches' verdicts.

The result is one :class:`Settled`: every later part of the step reads what it needs
from it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, NamedTuple

import torch

from dmuon.comm import Pending, ShardExchange
from dmuon.comm.agree import all_reduce_max, any_rank
from dmuon.comm.streams import Streams
from dmuon.comm.topology import Topology
from dmuon.plan.plan import Plan
from dmuon.runtime.agreement import Agreement, FlagLayout, agreement_flags
from dmuon.runtime.callbacks import CheckedGradients, RowState, StepCallbacks, StepMaxima
from dmuon.runtime.config import ExecutionConfig
from dmuon.runtime.gradients import GradientParts
from dmuon.runtime.launch import Launch
from dmuon.runtime.owner_momentum import OwnerMomentum
from dmuon.runtime.owner_work import OwnerWork
from dmuon.runtime.worker import EarlyWork, OwnerResults
from dmuon.util.bits import any_bits_differ
from dmuon.util.observe import ranged


@dataclasses.dataclass
class Settled:
    """What a step settled, identically on every rank (but the directions and row states, this rank's).
    Not changed once made: the block sets derived from it are computed once."""

    agreement: Agreement
    managed: list[int]
    """The matrices the rule steps now (``matrices()``, the same on every rank)."""
    launches: dict[int, Launch]
    """The launches from backward, by block (every hop issued)."""
    directions: dict[int, torch.Tensor]
    """This rank's part of each active matrix's direction (empty for a skipped step)."""
    rows: dict[int, torch.Tensor] | None
    """A :class:`RowState` rule's rows of each active matrix's row state on this rank (else None)."""
    independent_done: bool
    """``independent`` already ran (while the agreement travelled)."""
    early: EarlyWork
    """Per launched block, the owners' results computed ahead of the step: the NS worker's
    (``ns_in_backward``) or the speculative step's."""
    speculative_return: Pending | None = None
    """The speculative step's return of :attr:`early`, issued with the agreement's flags and kept
    (every launch stood, and the launches cover every active matrix)."""

    @property
    def skipped(self) -> bool:
        return self.agreement.skipped

    @functools.cached_property
    def kept(self) -> set[int]:
        """The blocks whose launch stands."""
        return {b for k, b in enumerate(sorted(self.launches)) if not self.agreement.stale[k]}

    @functools.cached_property
    def rescaled(self) -> set[int]:
        """The kept blocks whose launch stands for its gradients scaled since (clipping): the owners
        form their directions, so their early results do not stand."""
        return {b for k, b in enumerate(sorted(self.launches)) if self.agreement.rescaled[k]}

    @functools.cached_property
    def done(self) -> set[int]:
        """The blocks whose early owner results stand: kept, computed, not rescaled."""
        return (self.kept & self.early.keys()) - self.rescaled


class Gradients(NamedTuple):
    """What a step reads first, on every runtime: which matrices the rule steps and which have a gradient."""

    managed: list[int]
    """The matrices the rule steps now (``matrices()``, the same on every rank)."""
    here: list[int]
    """Those with a gradient on this rank (each checked: :meth:`GradientParts.check`)."""
    maxima: torch.Tensor | None
    """The rule's step maxima on this rank (:class:`StepMaxima`), or None."""


def read_gradients(plan: Plan, callbacks: StepCallbacks, gradients: GradientParts) -> Gradients:
    """The step's prelude: the managed matrices, those with a gradient here (refusing the kinds Muon cannot
    take), and the rule's step maxima."""
    managed = callbacks.matrices()
    here = [i for i in managed if plan.infos[i].param.grad is not None]
    for i in here:
        gradients.check(i)
    maxima = callbacks.step_maxima() if isinstance(callbacks, StepMaxima) else None
    return Gradients(managed, here, maxima)


def agree_before_commit(plan: Plan, topo: Topology, streams: Streams, callbacks: StepCallbacks,
                        nonfinite: str | None, seen: Gradients, pipeline_group) -> Agreement:
    """One agreement, waited for, on which matrices have a gradient, whether a gradient is non-finite
    (``nonfinite=``, every pipeline stage told) and the rule's step maxima; no launch verdicts."""
    checked = callbacks.checked_gradients() if nonfinite is not None and isinstance(callbacks, CheckedGradients) else []
    flags, layout = agreement_flags(plan.infos, topo.position[1], seen.managed, seen.here, nonfinite, checked, None,
                                    seen.maxima)
    agreed = all_reduce_max(flags, topo, streams, plan.device)().tolist()
    if nonfinite is None:
        return layout.decide(agreed)
    elsewhere = nonfinite_on_other_stages(agreed, layout, pipeline_group, plan.device)
    return with_other_stages(layout.decide(agreed), elsewhere, nonfinite)


def land_unused(launches: dict[int, Launch]) -> None:
    """Lands every exchange of ``launches`` unused, on every rank alike."""
    for launch in launches.values():
        launch.pending.wait()
        if launch.returned is not None:
            launch.returned.wait()


class StepSettler:
    """Settles each step of one runtime (module docstring).

    Args:
        plan: The ownership plan.
        topo: The runtime's topology (its groups; ``loopback`` included).
        callbacks: The rule.
        config: When things run.
        gradients: This rank's gradient parts.
        exchange: The runtime's exchange (the speculative step's return).
        work: The owners' batching (the speculative step's NS).
        streams: The runtime's streams.
        owner_momentum: With ``clipped_overlap``, the owners' momentum copies; else None.
        pipeline_group: The group spanning the pipeline stages, or None: with ``nonfinite=`` a NaN/Inf on
            any stage skips (or raises on) every stage.
    """

    def __init__(self, plan: Plan, topo: Topology, callbacks: StepCallbacks, config: ExecutionConfig,
                 gradients: GradientParts, exchange: ShardExchange, work: OwnerWork, streams: Streams,
                 owner_momentum: OwnerMomentum | None, pipeline_group=None) -> None:
        self.plan, self.topo, self.callbacks, self.config = plan, topo, callbacks, config
        self.pipeline_group = pipeline_group
        self.gradients, self.exchange, self.work, self.streams = gradients, exchange, work, streams
        self.owner_momentum = owner_momentum
        self.row_states = callbacks.row_states if isinstance(callbacks, RowState) else None
        self.last_scaled = False
        """The last step's launches stood for rescaled gradients (the same on every rank)."""

    @ranged("settle")
    def settle(self, launches: dict[int, Launch], early: EarlyWork) -> Settled:
        """The step's agreement and the rule's directions, from the launches and the worker's results."""
        managed, here, maxima = seen = read_gradients(self.plan, self.callbacks, self.gradients)
        if self.config.nonfinite is None:
            settled = self._unchecked(launches, early, managed, here, maxima)
        else:
            try:
                settled = self._checked(launches, early, seen)
            except FloatingPointError:
                # Every rank raises alike (nonfinite="raise"): what backward sent lands first, so
                # no exchange is left in flight, holding buffers, behind a caught error.
                land_unused(launches)
                raise
        self.last_scaled = any(settled.agreement.rescaled)
        return settled

    def _unchecked(self, launches: dict[int, Launch], early: EarlyWork, managed: list[int],
                   here: list[int], maxima: torch.Tensor | None) -> Settled:
        """``nonfinite=None``: the state advances first and one agreement settles the active set,
        the launches' verdicts and the rule's maxima."""
        directions = self.callbacks.commit(here, self.gradients.parts(here))
        rows = self._rows(here)
        flags, layout = agreement_flags(self.plan.infos, self.topo.position[1], managed, here, None, (),
                                        self._verdicts(launches, here, directions, rows), maxima)
        settle = self._with_scale(layout.decide, len(launches))
        # The owners' work on what landed from backward, returned with the agreement's flags (no
        # collective of its own: on shared cores each one issued costs the issuing rank its turn);
        # kept only if the flags keep every launch and the launches cover every active matrix
        # (else the batches would differ). Only with one return wave: several waves (or one per
        # unit, for the next forward) return each batch as soon as it is done instead. Not after a step whose launches stood for rescaled
        # gradients (clipping usually goes on): the owners' work would then run on directions the
        # agreement replaces.
        if launches and not early and self.work.max_waves == 1 and not self.work.waves_by_unit and not self.last_scaled:
            return self._speculate(launches, managed, directions, rows, flags, settle)
        decide = all_reduce_max(flags, self.topo, self.streams, self.plan.device)
        self.callbacks.independent()  # while the flags travel
        return Settled(settle(decide().tolist()), managed, launches, directions, rows, True, early)

    def _speculate(self, launches: dict[int, Launch], managed: list[int], directions: dict[int, torch.Tensor],
                   rows: dict[int, torch.Tensor] | None, flags: torch.Tensor,
                   settle: Callable[[list[int]], Agreement]) -> Settled:
        """The owners' work on every launched block before the agreement is known, returned with its flags."""
        speculative = self._owner_results(launches)
        members = sorted(i for launch in launches.values() for i in launch.members)
        owned = {i: o for w in speculative.values() for i, o in w.updates.items()}
        owned_rows = {i: o for w in speculative.values() for i, o in w.rows.items()}
        returned = self.exchange.return_updates(members, owned, flags, owned_rows if rows is not None else None)
        self.callbacks.independent()  # nothing can skip the step: it runs while updates and flags travel
        agreement = settle(returned.agreed().tolist())
        if not any(agreement.stale) and not any(agreement.rescaled) and \
                all(self.plan.infos[i].block in launches for i in agreement.active):
            return Settled(agreement, managed, launches, directions, rows, True, speculative, returned)
        return Settled(agreement, managed, launches, directions, rows, True, {})  # landed unused; every rank drops it alike

    def _checked(self, launches: dict[int, Launch], early: EarlyWork, seen: Gradients) -> Settled:
        """``nonfinite=`` set: agree on the step (skip or raise) and the rule's maxima before any
        state advances, then on the launches' verdicts."""
        agreement = agree_before_commit(self.plan, self.topo, self.streams, self.callbacks, self.config.nonfinite,
                                        seen, self.pipeline_group)
        if agreement.skipped:
            return Settled(agreement, seen.managed, launches, {}, None, False, early)
        directions = self.callbacks.commit(agreement.active, self.gradients.parts(agreement.active))
        rows = self._rows(agreement.active)
        verdicts = all_reduce_max(self._verdicts(launches, agreement.active, directions, rows), self.topo,
                                  self.streams, self.plan.device)().tolist()
        stale, scaled, scale = self._launch_verdict(verdicts, len(launches))
        return Settled(agreement._replace(stale=stale, rescaled=scaled, scale=scale), seen.managed, launches,
                       directions, rows, False, early)

    def _rows(self, members: list[int]) -> dict[int, torch.Tensor] | None:
        """A :class:`RowState` rule's rows of its state for ``members`` (what travels beside their directions)."""
        return self.row_states(members) if self.row_states is not None else None

    def _owner_results(self, launches: dict[int, Launch]) -> EarlyWork:
        """The owners' work on every launched block, before the step's agreement is known.

        Batched exactly as the step would batch them without launches (all of this rank's
        landed matrices at once), so the results are bit-identical to those of
        ``overlap=False`` when the agreement keeps every launch. Per block, as
        ``ns_in_backward``'s are (the time on the first block).
        """
        full: dict[int, torch.Tensor] = {}
        full_rows: dict[int, torch.Tensor] = {}
        for b in sorted(launches):
            full.update(launches[b].pending.wait())
            full_rows.update(launches[b].pending.row_states())
        with self.streams.interval() as spent:
            orthos, new_rows = self.work.run(self.callbacks.owner_work, sorted(full), full,
                                             full_rows if self.row_states is not None else None)
        infos = self.plan.infos
        return {b: OwnerResults({i: o for i, o in orthos.items() if infos[i].block == b},
                                {i: o for i, o in new_rows.items() if infos[i].block == b}, spent if k == 0 else None)
                for k, b in enumerate(sorted(launches))}

    def _stale(self, launches: dict[int, Launch], active: list[int], directions: dict[int, torch.Tensor],
               rows: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
        """Per launch (block order), 1 unless it sent exactly these matrices and, bit for bit, these
        directions (and row states). int32 on this rank's device, read by no one before the
        agreement lands (a comparison read on the host would wait for the device once per matrix)."""
        if not launches:
            return torch.zeros(0, dtype=torch.int32)
        by_block: dict[int, list[int]] = {}
        for i in active:
            by_block.setdefault(self.plan.infos[i].block, []).append(i)
        stale = []
        for b in sorted(launches):
            launch = launches[b]
            if launch.members != by_block.get(b, []):
                stale.append(torch.ones((), dtype=torch.bool, device=self.plan.device))
                continue
            pairs = [(launch.sent[i], directions[i]) for i in launch.members]
            if rows is not None:
                pairs.append(tuple(torch.cat([r[i].reshape(-1) for i in launch.members]) for r in (launch.rows, rows)))
            stale.append(any_bits_differ(pairs, self.plan.device))
        return torch.stack(stale).to(torch.int32)

    def _verdicts(self, launches: dict[int, Launch], active: list[int], directions: dict[int, torch.Tensor],
                  rows: dict[int, torch.Tensor] | None) -> torch.Tensor:
        """This rank's flags on the launches (block order): :meth:`_stale`'s, then with ``clipped_overlap``
        :meth:`OwnerMomentum.launch_flags`."""
        stale = self._stale(launches, active, directions, rows)
        if self.owner_momentum is None:
            return stale
        extra = self.owner_momentum.launch_flags(launches, active, rows, self.topo.position)
        return torch.cat([stale, torch.tensor(extra, dtype=torch.int32, device=stale.device)])

    def _launch_verdict(self, flags: list[int], launches: int) -> tuple[list[int], list[int], float | None]:
        """From the maxima of every rank's :meth:`_verdicts`: per launch 1 where it is stale, per launch
        1 where it stands for rescaled gradients, and their factor (:meth:`OwnerMomentum.verdict`)."""
        if self.owner_momentum is None:
            return flags, [0] * launches, None
        return self.owner_momentum.verdict(flags[:launches], flags[launches:], launches)

    def _with_scale(self, settle: Callable[[list[int]], Agreement], launches: int) -> Callable[[list[int]], Agreement]:
        """``settle`` whose agreement's stale flags, rescaled launches and factor come from
        :meth:`_launch_verdict` (of the flags :meth:`_verdicts` added, which ``settle`` returns as its
        stale flags)."""
        if self.owner_momentum is None:
            return settle

        def decide(flags: list[int]) -> Agreement:
            agreement = settle(flags)
            stale, scaled, scale = self._launch_verdict(list(agreement.stale), launches)
            return agreement._replace(stale=stale, rescaled=scaled, scale=scale)

        return decide


def nonfinite_on_other_stages(agreed: list[int], layout: FlagLayout, pipeline_group, device: torch.device) -> bool:
    """With a pipeline group: whether another stage saw a NaN/Inf, from one scalar all-reduce over the
    stages of whether this data-parallel group saw one (its agreed flags, read by ``layout``). Every
    stage's ranks call it before deciding anything from their own flags (a decision that raises first
    would leave the other stages waiting in this all-reduce). False, and no collective, without a
    pipeline group."""
    if pipeline_group is None:
        return False
    mine = layout.nonfinite_seen(agreed)
    return any_rank(mine, pipeline_group, device) and not mine


def with_other_stages(agreement: Agreement, elsewhere: bool, nonfinite: str | None) -> Agreement:
    """``agreement`` once another stage's NaN/Inf (``elsewhere``) is known: raised with ``nonfinite="raise"``,
    the step skipped with ``"skip"``."""
    if not elsewhere or agreement.skipped:
        return agreement
    if nonfinite == "raise":
        raise FloatingPointError("non-finite gradients on another pipeline stage")
    return agreement._replace(skipped=True)
