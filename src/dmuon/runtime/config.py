"""How the runtime schedules a step: one validated record of the execution switches."""

from __future__ import annotations

from dataclasses import dataclass

from dmuon.plan.hop_a import resolve_spread

NONFINITE_MODES = (None, "skip", "raise")
"""Accepted ``ExecutionConfig.nonfinite`` values."""
APPLY_MODES = ("in_step", "next_forward")
"""Accepted ``ExecutionConfig.apply_updates`` values."""


@dataclass(frozen=True)
class ExecutionConfig:
    """When and how :class:`~dmuon.runtime.ShardRuntime` moves and computes; never what.

    Every combination gives the same parameters (``overlap`` and
    ``return_waves`` bit for bit; ``ns_in_backward`` and ``apply_updates="next_forward"``,
    which batch NS per FSDP2 unit, up to NS batching: a batched matmul may round otherwise
    than one matrix at a time), so
    these are performance switches, except ``nonfinite`` (what a NaN/Inf
    does) and ``post_optim_event`` (a promise about the user's code).
    """

    overlap: bool = True
    """Start each block's exchange with the owners in backward, as soon as FSDP2 has written the
    block's reduced gradients. ``step()`` checks that the final gradients still give the
    directions sent (an edited gradient does not, and its block is exchanged again; a clip is
    ``clipped_overlap``'s), so ``overlap=False`` (every exchange inside ``step()``) gives
    bit-identical results (with ``clipped_overlap=False`` under clipping too)."""
    clipped_overlap: bool = True
    """With ``overlap``: each owner keeps a float32 copy of its matrices' whole momentum
    (:mod:`dmuon.runtime.owner_momentum`), so that when every gradient was scaled by one factor
    after the launches (``torch.nn.utils.clip_grad_norm_``, ``DMuon.clip_grad_norm_``) the
    launches still stand: the owners form the clipped directions from the launched ones instead
    of a new exchange in ``step()``. While clipping goes on (from the first clipped step, which
    exchanges again, until 100 steps without one) owners keep that copy (about the Muon
    momentum's size per rank, on average) and make an elementwise pass over their matrices a
    step; the clipped directions
    then equal the ranks' up to rounding (README, "Clipping"). False: a clipped step exchanges
    every block again, bit-identical to ``overlap=False``. Only for rules that support it
    (a :class:`~dmuon.runtime.callbacks.Rescalable` rule: Muon, NorMuon, MuonH; Dion2 is not, its clipped steps exchange again)."""
    ns_in_backward: bool = False
    """Also run the owners' NS for each block on a worker thread during backward, as soon as its
    directions have arrived (needs ``overlap``). Blocks whose directions fail ``step()``'s check
    are recomputed there. NS then runs in per-block batches."""
    returns_in_backward: bool = False
    """With ``ns_in_backward``: also send each block's updates back to every holder during backward
    (its return, and on HSDP its publication to the other replicas), issued at the block landing
    after the one that issued the block's last direction hop (on HSDP the publication joined with a
    later landing's collective across replicas), so a step whose launches all stand only applies
    what has arrived. The returns are speculative, like the launches: a block whose launch does not stand
    (an edited gradient, or one rescaled by a clip: NS is not linear, so the owners' rescaled
    direction needs NS again) lands unused and is redone in ``step()``, which then costs what it
    costs without this switch plus the wasted transfers, made while backward ran. The blocks
    whose directions are still on their way when backward ends return in ``step()`` (1-D: the
    last one; on HSDP the last few, hop A being spread: ``hop_a_spread``'s default is 1 with it). The switch for runs that clip rarely
    (``clip_grad_norm_`` rescales only above ``max_norm``) or not at all."""
    nonfinite: str | None = None
    """What a NaN/Inf in any gradient does. ``None``: nothing is checked, as in torch.optim;
    ``"skip"``: every rank skips the whole step (parameters and optimizer state unchanged);
    ``"raise"``: every rank raises ``FloatingPointError`` naming the parameters. Checking reads
    every gradient once."""
    return_waves: int | None = None
    """The step's update returns go in up to this many waves, wave ``k`` right after every
    owner's ``k``-th NS batch, so the transfers overlap the owners' NS. None: 4 on an
    accelerator, 1 on CPU, where transfers and NS share the cores."""
    hop_a_spread: int | None = None
    """On dmuon's replicate level (``hsdp_mesh``): each block's direction slices cross to the owners'
    replicas in row chunks over at most this many of the following collectives across replicas
    (each also carrying a block's gradient columns), sized so that every replica receives about
    the same in each (:mod:`dmuon.plan.hop_a`); 1 sends them all with the next one, where the
    replica owning the block's largest matrix receives much more than the others. A block's NS
    waits for its last chunk. None: 8, or 1 with ``returns_in_backward`` (whose returns can then
    follow each block one landing later); :attr:`resolved_hop_a_spread` is the value used."""
    post_optim_event: bool = False
    """On an accelerator (CUDA), record an event after the step's last update and hand it to
    FSDP2's root (``FSDPModule.set_post_optim_event``), so the next forward's all-gathers wait
    for the updates only, not for work queued on the stream after ``step()``. Leave it False if
    you change parameters after ``step()`` (their all-gather would not wait for that). The CPU
    backend has no events: True there is an error."""

    apply_updates: str = "in_step"
    """When each rank applies the Muon matrices' updates. ``"in_step"``: inside ``step()``, every
    update landed and applied before it returns. ``"next_forward"``: ``step()`` issues every update
    return (all hops, the publication across replicas included) and returns; the next forward
    applies each FSDP2 unit's updates from a forward pre-hook, a unit ahead, and issues that unit's
    all-gather itself, so the returns travel behind the step's end and the forward's first units
    (:mod:`dmuon.runtime.next_forward`). AdamW's parameters are stepped inside ``step()`` either way.
    Nothing reads a parameter stale: :meth:`dmuon.DMuon.flush_updates` applies what is pending,
    and runs by itself before ``step()``, the optimizer's and the model's ``state_dict`` and
    ``load_state_dict`` (so torch's ``get_state_dict``/``set_state_dict`` and DCP); code that reads
    the weights directly between ``step()`` and the next forward (an EMA, a norm) calls it first.
    Not with ``post_optim_event`` (FSDP2 waits on it once, before any deferred update exists)."""

    loopback_collectives: bool = False
    """Where a level of the mesh has one rank (one process: every level), still issue dmuon's
    exchanges, update returns and agreement as collectives on its one-member groups (all-to-all and
    all-reduce of a rank with itself) instead of handing the tensors over locally. Same results, bit
    for bit; slower. It is for checking the collective paths (the communication library's buffers,
    the stream waits) on one device (``dmuon bench --gpu-check``). Needs a plan prepared with
    torch.distributed initialized."""

    def __post_init__(self) -> None:
        for name in ("overlap", "clipped_overlap", "ns_in_backward", "returns_in_backward", "post_optim_event",
                     "loopback_collectives"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.apply_updates not in APPLY_MODES:
            raise ValueError(f"apply_updates must be one of {APPLY_MODES}, got {self.apply_updates!r}")
        if self.apply_updates == "next_forward" and self.post_optim_event:
            raise ValueError("apply_updates='next_forward' cannot take post_optim_event=True: FSDP2 waits on the "
                             "event once, at the next forward's start, before the updates this mode applies "
                             "during that forward; leave post_optim_event=False")
        if self.nonfinite not in NONFINITE_MODES:
            raise ValueError(f"nonfinite must be one of {NONFINITE_MODES}, got {self.nonfinite!r}")
        waves = self.return_waves
        if waves is not None and (isinstance(waves, bool) or not isinstance(waves, int) or waves < 1):
            raise ValueError(f"return_waves must be an int >= 1 or None, got {waves!r}")
        spread = self.hop_a_spread
        if spread is not None and (isinstance(spread, bool) or not isinstance(spread, int) or spread < 1):
            raise ValueError(f"hop_a_spread must be an int >= 1 or None, got {spread!r}")
        if self.ns_in_backward and not self.overlap:
            raise ValueError("ns_in_backward=True needs overlap=True: directions reach their owners "
                             "during backward only with overlap")
        if self.returns_in_backward and not self.ns_in_backward:
            raise ValueError("returns_in_backward=True needs ns_in_backward=True: a block's updates exist "
                             "during backward only when its NS runs there")

    @property
    def resolved_hop_a_spread(self) -> int:
        """``hop_a_spread``, its None resolved (:func:`dmuon.plan.hop_a.default_spread`)."""
        return resolve_spread(self.hop_a_spread, self.returns_in_backward)
