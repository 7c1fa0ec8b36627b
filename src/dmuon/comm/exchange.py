"""Exchanges between the shards FSDP2 (and tensor parallelism) leave and each matrix's owner.

FSDP2 keeps every matrix split by rows (``Shard(0)``) over the shard level of a
(replicate R x shard S) mesh, and tensor parallelism splits it further (the
shard level is then FSDP2's and TP's dims together); each shard position
``s`` holds a box of the matrix, ``MatrixInfo.pieces[s]``. After FSDP2's
reduce-scatter (and, on HSDP, its all-reduce across replicas) every rank
holds its piece of the averaged gradient, identical in every replica. Muon's
momentum is kept once in the whole mesh: rank ``(r, s)`` keeps piece ``s``'s
column slice ``r`` (``MatrixInfo.replica_columns``). A piece several
positions hold (a matrix TP leaves whole) is sent by its first holder only
and comes back to all. dmuon moves only what Newton-Schulz consumes and
produces, in its wire dtype:

* **Directions, hop A** (replicate level, HSDP only): every rank sends its
  column slice of each matrix's direction to the same shard position of the
  owner's replica, which joins the R slices into its piece. Per matrix 1/R of
  it crosses the slow network once from each other replica, spread over the
  S positions.
* **Directions, hop B** (shard level, inside the owner's replica only): each
  rank of the owner's replica sends its piece of the direction; the owner
  pastes the pieces into the full matrix (``MatrixInfo.assemble``).
* **Updates back, hop 1** (shard level, inside the owner's replica): the owner
  sends each shard position its piece of the orthogonalized update
  (``MatrixInfo.cut``).
* **Updates back, hop 2** (replicate level, HSDP only): every position of the
  other replicas gets the same piece, by one of two routes per return wave
  (:mod:`dmuon.plan.publication`, :meth:`ShardExchange.route`: the one whose
  collectives' critical bytes add up to less). **Direct**: every rank of the
  owner's replica sends its piece to the same position of every other replica.
  **Scatter**: (a) it sends part ``q`` of its piece (the column slice ``q`` the
  momentum uses, ``MatrixInfo.replica_columns``) to replica ``q`` only; (b) an
  all-gather: every rank sends the part ``r`` it holds of each member to every
  replica but its own and the member's owner's, and joins the R parts into its
  piece. Either way the matrix crosses the slow network R-1 times in total,
  spread over S links; the direct route makes the owner's replica send all of
  it, the scatter route spreads it over every replica (a wave whose owners
  crowd into a few replicas is what it is for).

Each hop is one uneven ``all_to_all_single`` per block and level, which gloo
and NCCL both support (on dmuon's replicate level the runtime joins hop A with
the next block's gradient reduce-scatter, and a return wave's first hop across
replicas with the wave before's all-gather, :mod:`dmuon.comm.coalesce`); members
travel in plan-index order, so every destination's share is one contiguous slice. The speculative step's update
return also carries its agreement: a few int32 flags at the end of every
destination's share, maximised over the sources on landing (hop 2 forwards
hop 1's maximum, so every rank ends with the whole mesh's; on the scatter
route stage (a) carries them to every replica, even where no part moves, and
stage (b) none). The flags travel bit for bit whatever the wire dtype (an
int32 is two elements of a 16-bit wire, one of a 32- or 64-bit one) and are
maximised as integers after landing, so besides 0/1 they can carry
non-negative float32 values as their bit patterns (the agreement's logit
maxima, :mod:`dmuon.runtime.agreement`).

**Row state** (``row_width > 0``; none for Muon, whose exchange is unchanged): a
rule's small per-row state (NorMuon's second moment, ``row_width`` float32 values
per matrix row) rides with its matrix. Every holder of a row keeps a copy of the
row's state (replicated over TP's column split and over HSDP's replicas), so on
the way out it travels once per row, appended to the piece of the sending position
whose box starts at column 0, in hop B only (the owner's replica holds the same
copy, so hop A carries none); the owner gets the whole ``(m, row_width)`` state
beside the whole direction. On the way back every holder of a row receives the
owner's new state of its rows, appended to its piece of the update in hop 1 and
forwarded with it in hop 2: whole on the direct route; on the scatter route split
into R row chunks (``state_rows``, torch.chunk's rule), chunk ``q`` travelling with
part ``q``, so the state is spread over the replicas as the update is (and moves the
same R-1 copies in all). In a 16-bit wire dtype each float32 travels bit for
bit as two wire elements, so the state is exact whatever the NS dtype.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from dmuon.comm.coalesce import GroupAllToAll
from dmuon.comm.directions import DirectionSender
from dmuon.comm.exchange_core import ExchangeCore, row_state_ratio
from dmuon.comm.pending import Pending
from dmuon.comm.returns import UpdateReturns
from dmuon.comm.stats import CommStats
from dmuon.comm.topology import Topology
from dmuon.plan.plan import MatrixInfo

__all__ = ["Pending", "ShardExchange", "row_state_ratio"]


class ShardExchange:
    """Runs dmuon's collectives for one plan: the directions to the owners
    (:class:`dmuon.comm.directions.DirectionSender`) and the updates back
    (:class:`dmuon.comm.returns.UpdateReturns`), both on one wire
    (:class:`dmuon.comm.exchange_core.ExchangeCore`).

    Args:
        infos, topology, stats, wire_dtype, device, row_width: the wire's, as
            :class:`~dmuon.comm.exchange_core.ExchangeCore` takes them.
        publication: How hop 2 crosses the replicas: None picks per return wave
            (:func:`dmuon.plan.publication.choose_route`), ``"direct"`` or ``"scatter"``
            forces one route for every wave (tests; every rank must pass the same).
    """

    def __init__(self, infos: Sequence[MatrixInfo], topology: Topology, stats: CommStats,
                 wire_dtype: torch.dtype, device: torch.device, row_width: int = 0,
                 publication: str | None = None) -> None:
        self.core = ExchangeCore(infos, topology, stats, wire_dtype, device, row_width)
        """The sizes, wire and collectives both directions share."""
        self.directions = DirectionSender(self.core)
        self.returns = UpdateReturns(self.core, publication)

    @property
    def stats(self) -> CommStats:
        """The counters every collective of the exchange updates."""
        return self.core.stats

    @property
    def wire_dtype(self) -> torch.dtype:
        """Dtype of everything sent."""
        return self.core.wire_dtype

    @property
    def across(self) -> GroupAllToAll:
        """All-to-alls across replicas (:attr:`ExchangeCore.across`): the replicate level's
        reductions share them, and :meth:`GroupAllToAll.coalesced` joins theirs with hop A."""
        return self.core.across

    @property
    def publication(self) -> str | None:
        """The route hop 2 is forced to (:class:`~dmuon.comm.returns.UpdateReturns`); None: chosen per wave."""
        return self.returns.publication

    @publication.setter
    def publication(self, route: str | None) -> None:
        self.returns.publication = route

    def send_directions(self, members: Sequence[int], local: dict[int, torch.Tensor],
                        rows: dict[int, torch.Tensor] | None = None,
                        spread: Callable[[], dict[int, int]] | None = None) -> Pending:
        """This rank's piece of each member's direction to the member's owner
        (:meth:`DirectionSender.send_directions <dmuon.comm.directions.DirectionSender.send_directions>`)."""
        return self.directions.send_directions(members, local, rows, spread)

    def return_updates(self, members: Sequence[int], owned: dict[int, torch.Tensor],
                       flags: torch.Tensor | None = None, rows: dict[int, torch.Tensor] | None = None) -> Pending:
        """Each shard position's piece of the owners' updates, then across replicas
        (:meth:`UpdateReturns.return_updates <dmuon.comm.returns.UpdateReturns.return_updates>`)."""
        return self.returns.return_updates(members, owned, flags, rows)

    def route(self, members: Sequence[int]) -> str:
        """The route of hop 2 for a return of ``members``
        (:meth:`UpdateReturns.route <dmuon.comm.returns.UpdateReturns.route>`)."""
        return self.returns.route(members)
