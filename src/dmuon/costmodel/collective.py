"""One collective of a modelled step (:class:`Collective`), the all_to_all parts the step model builds
them from, and its price under the alpha-beta model (:class:`AlphaBeta`, :func:`step_figures`);
:mod:`dmuon.costmodel.collectives` lists a step's, :mod:`dmuon.costmodel.backward_order` orders
dmuon's backward ones, :mod:`dmuon.costmodel.peer` the all-to-all peer's."""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass
from typing import Sequence

from dmuon.plan.layout import shard_rows as _shard_rows
from dmuon.plan.publication import Stage


@functools.lru_cache(maxsize=4096)
def _split(m: int, parts: int) -> tuple[int, ...]:
    return tuple(_shard_rows(m, parts))


def shard_rows(m: int, parts: int) -> tuple[int, ...]:
    """:func:`dmuon.plan.layout.shard_rows`, memoised (the models ask for the same splits per rank)."""
    return _split(int(m), int(parts))



ROLES: tuple[str, ...] = (
    "fsdp_all_gather", "fsdp_reduce_scatter", "fsdp_all_reduce", "replicate_all_reduce", "grad_columns",
    "hop_a", "hop_b", "return_shard", "return_replicas", "return_scatter", "return_gather", "gather", "a2a_out",
    "a2a_back", "weight_norms", "ddp_publish")
""":attr:`Collective.role` values (``"ddp_publish"``: under torch's DDP, a wave's updates to every rank, an
all-gather or one owner's broadcast); FSDP2's three collectives; dmuon's all-reduce of the non-Muon
gradients across replicas (the replicate level, with ``other_shapes``); the gradient's column reduce-scatter
(the replicate level), which also carries the previous block's hop A where :attr:`Collective.carries_hop_a`
names that block; hop A (the direction's column slices to the owner's replica; on the replicate level a
collective of its own only where no column reduce-scatter follows to carry it) and hop B (the rows
to the owner); the update's return to the shard columns (hop 1) and to the other replicas (hop 2):
on the direct route whole pieces, on the scatter route (:mod:`dmuon.plan.publication`) each
piece's part ``q`` to replica ``q``, then every replica's part to the others (the all-gather:
a collective of its own only for the last wave, else it rides in the next wave's hop 2, where
:attr:`Collective.carries_gather` names its wave); gather-then-compute's all-gather of one
direction; the peer's all-to-all to the batch's owner slice and back. ``"weight_norms"``: a rule's per-matrix sums over the weight (MuonH's norms), one
all-gather over the shard level after the step's last update, or one per return wave with the
updates applied in the next forward (:func:`weight_norm_collective`)."""


@dataclass
class Collective:
    """One collective of a training step, as every plan rank sees it."""

    op: str
    """``"all_gather"``, ``"reduce_scatter"``, ``"all_reduce"`` or ``"all_to_all"``."""
    level: str
    """``"intra"`` (the shard group, inside a node) or ``"inter"`` (the replicate group)."""
    phase: str
    """``"forward"``, ``"backward"`` or ``"step"``."""
    block: int | None
    """The block it belongs to (None for the step's all-matrix exchanges)."""
    ranks: list[tuple[int, int] | None]
    """Per plan rank ``r * S + s``: ``(sent, received)`` bytes, or None where the rank issues nothing."""
    messages: int
    """Latency terms of the alpha-beta model: ring steps, or the most peers one rank exchanges with."""
    label: str = ""
    role: str = ""
    """What it is in the step (:data:`ROLES`), for the timeline model (:mod:`dmuon.costmodel.simulate`)."""
    index: int | None = None
    """Which one of its role: the return wave, the gathered matrix, the all-to-all batch (None: per block)."""
    carries_hop_a: tuple[int, ...] = ()
    """The replicate level, a ``"grad_columns"`` or ``"hop_a"`` collective: the blocks whose direction slices
    (hop A chunks, :mod:`dmuon.plan.hop_a`) travel in it (the runtime sends them in the same
    all_to_all as the next unit's gradient columns: one collective on the replicate group, its
    bytes per rank the sum of both)."""
    completes_hop_a: tuple[int, ...] = ()
    """The replicate level: the blocks whose last hop A chunk is in it (their hop B goes at the next landing)."""
    issued_at: int | None = None
    """dmuon's exchange: the block whose landing in backward issues it (None: ``step()``); by
    default its own block."""
    carries_gather: int | None = None
    """A ``"return_replicas"`` or ``"return_scatter"`` collective: the return wave whose scatter
    route's all-gather travels in it (the runtime advances every return in flight by one hop at
    once, in one all_to_all on the replicate group), or None."""
    carries_returns: tuple[int, ...] = ()
    """``returns_in_backward`` on dmuon's replicate level: the blocks whose return's hop across
    replicas travels in this collective of a landing (joined with its gradient columns)."""

    def __post_init__(self) -> None:
        if self.issued_at is None and self.phase == "backward":
            self.issued_at = self.block

    @property
    def critical(self) -> int:
        """The most bytes one rank sends or receives in this collective."""
        return max((max(t) for t in self.ranks if t is not None), default=0)


def uniform_collective(op: str, level: str, phase: str, block, world: int, each: int, messages: int,
                       label: str, role: str, index: int | None = None) -> Collective:
    """A collective in which every one of ``world`` ranks sends and receives ``each`` bytes."""
    return Collective(op, level, phase, block, [(each, each)] * world, messages, label, role, index)


def a2a(level: str, phase: str, block, world: int, sent: list[int], received: list[int],
         peers_out: list[set], peers_in: list[set], taking_part: list[bool], label: str, role: str,
         index: int | None = None) -> Collective:
    ranks = [(sent[k], received[k]) if taking_part[k] else None for k in range(world)]
    messages = max((max(len(peers_out[k]), len(peers_in[k])) for k in range(world) if taking_part[k]), default=0)
    return Collective("all_to_all", level, phase, block, ranks, messages, label, role, index)


Parts = tuple[list[int], list[int], list[set], list[set], list[bool]]
"""One all_to_all's per-rank ``(sent, received, peers out, peers in, taking part)``, before :func:`_a2a`."""


def merge_parts(*parts: Parts) -> Parts:
    """Several all_to_alls' parts as one collective's: bytes summed, peers united, taking part in any."""
    world = len(parts[0][0])
    return ([sum(p[0][k] for p in parts) for k in range(world)], [sum(p[1][k] for p in parts) for k in range(world)],
            [set().union(*(p[2][k] for p in parts)) for k in range(world)],
            [set().union(*(p[3][k] for p in parts)) for k in range(world)],
            [any(p[4][k] for p in parts) for k in range(world)])


def stage_parts(stage: Stage) -> Parts:
    """One route stage of :mod:`dmuon.plan.publication` as an all_to_all's parts."""
    return stage.sent, stage.received, stage.peers_out, stage.peers_in, stage.taking_part


@dataclass
class AlphaBeta:
    """The alpha-beta model: per-message latency and per-rank, per-direction bandwidth per level.

    Defaults are typical H100/H200 HGX figures (not measured here): NVLink 4
    gives each GPU 900 GB/s bidirectional, i.e. 450 GB/s each way (the figure
    that matters for the larger of sent and received); one 400 Gb/s
    InfiniBand/RoCE NIC per GPU gives 50 GB/s each way; NCCL-like latencies
    of about 10 us per message inside a node and 20 us across nodes.
    """

    intra_bandwidth: float = 450e9
    """Bytes per second one rank sends (or receives) inside a node."""
    inter_bandwidth: float = 50e9
    """Bytes per second one rank sends (or receives) across nodes."""
    intra_latency: float = 10e-6
    """Seconds per message inside a node."""
    inter_latency: float = 20e-6
    """Seconds per message across nodes."""

    def __post_init__(self) -> None:
        for name in ("intra_bandwidth", "inter_bandwidth"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("intra_latency", "inter_latency"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    def seconds(self, c: Collective) -> float:
        """``messages * latency + critical bytes / bandwidth`` on the collective's level."""
        if c.level == "intra":
            return c.messages * self.intra_latency + c.critical / self.intra_bandwidth
        return c.messages * self.inter_latency + c.critical / self.inter_bandwidth

    def as_dict(self) -> dict:
        return asdict(self)


def step_figures(collectives: Sequence[Collective], model: AlphaBeta | None = None) -> dict:
    """``critical_bytes``, ``seconds`` and ``collectives`` of a step, each ``{"total", "intra", "inter"}``."""
    model = AlphaBeta() if model is None else model
    out = {key: {"total": 0, "intra": 0, "inter": 0} for key in ("critical_bytes", "seconds", "collectives")}
    for c in collectives:
        for key, value in (("critical_bytes", c.critical), ("seconds", model.seconds(c)), ("collectives", 1)):
            out[key]["total"] += value
            out[key][c.level] += value
    return out
