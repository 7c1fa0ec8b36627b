"""The ownership plan: which rank owns each Muon matrix, and how matrices travel."""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from dmuon.ortho.config import NSConfig
from dmuon.plan.balance import rank_loads
from dmuon.plan.batches import split_into_batches
from dmuon.plan.layout import position, shard_rows


@dataclass(frozen=True)
class Piece:
    """The part of one matrix a shard position holds: a box of ``shape[0]`` x ``shape[1]``
    (the trailing dims of a conv kernel whole), as its DTensor local shard lays it out."""

    row: int
    """First row."""
    rows: int
    """Rows held (0: this position holds none of the matrix)."""
    col: int = 0
    """First column of ``shape[1]``."""
    cols: int = 0
    """Columns of ``shape[1]`` held."""
    sends: bool = True
    """Whether this position sends the piece to the owner. A matrix not split over a
    tensor-parallel dimension has the same piece on several positions (its DTensor is
    ``Replicate`` there); only the first of them sends its direction, all receive the update."""


def row_pieces(shape: Sequence[int], shard: int) -> tuple[Piece, ...]:
    """FSDP2's plain ``Shard(0)`` layout over ``shard`` positions: full-width row chunks (torch.chunk's rule)."""
    cols = int(shape[1]) if len(shape) > 1 else 1
    rows = shard_rows(int(shape[0]), shard)
    return tuple(Piece(sum(rows[:s]), rows[s], 0, cols) for s in range(shard))


@functools.lru_cache(maxsize=None)
def _column_split(cols: int, replicate: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The widths of ``cols`` columns split over ``replicate`` slices (torch.chunk's rule) and where
    each slice starts. Cached: the replicate level's hooks and exchanges ask for them per matrix,
    slice and step, and a piece's columns never change."""
    widths = tuple(shard_rows(cols, replicate))
    return widths, tuple(itertools.accumulate(widths[:-1], initial=0))


@dataclass
class MatrixInfo:
    """One Muon matrix and where it lives."""

    index: int
    """Position in the plan; identical on every rank."""
    name: str
    """Fully qualified parameter name in the model."""
    param: nn.Parameter = field(repr=False)
    """The parameter: FSDP2's sharded DTensor (a plain tensor in a single process)."""
    shape: tuple[int, ...]
    """Global shape of the matrix: the parameter's, or one expert's (``param.shape[1:]``) for a stack."""
    block: int
    """Index of the block (see ``Plan.blocks``) whose FSDP2 group reduces its gradient."""
    owner: int = -1
    """Rank that gathers the matrix's direction and runs Newton-Schulz for it."""
    cost: float = 0.0
    """Estimated owner-side cost used by the balancer (arbitrary units)."""
    pieces: tuple[Piece, ...] = ()
    """Per shard position ``s`` (the plan rank ``r * S + s`` of any replica ``r``), the box of the
    matrix its local shard holds: FSDP2's row chunk, under tensor parallelism a row or column
    chunk of that, and for a stack of experts nothing on positions without this expert."""
    expert: int | None = None
    """For a stack of experts (``matrix_view="stack"``): which slice ``param[expert]`` this is."""
    stack_starts: tuple[int, ...] = ()
    """For a stack: the first expert of each shard position's local shard."""
    group: int | None = None
    """For one row group of a ``"rows:..."`` view: which group (its rows follow the earlier groups')."""
    group_starts: tuple[int, ...] = ()
    """For a row group: where its piece starts in each shard position's local rows."""
    replicate: int = 1
    """R, the replicas the momentum's columns are split over (``Shard(1)``, torch.chunk's rule
    on each piece's columns), so on HSDP no state is duplicated across replicas: rank
    ``(r, s)`` keeps piece ``s``'s rows x its ``r``-th slice of the piece's columns."""

    @property
    def matrix_shape(self) -> tuple[int, int]:
        """The 2-D view NS works on: ``(shape[0], prod(shape[1:]))``, as Keller Jordan's Muon."""
        return (self.shape[0], math.prod(self.shape[1:]))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def row_width(self) -> int:
        """Elements per row of the 2-D view."""
        return math.prod(self.shape[1:])

    @property
    def inner(self) -> int:
        """Elements per column of ``shape[1]`` in a row (a conv kernel's ``prod(shape[2:])``; 1 for a matrix)."""
        return math.prod(self.shape[2:])

    @property
    def rows(self) -> tuple[int, ...]:
        """Rows each shard position holds."""
        return tuple(p.rows for p in self.pieces)

    @property
    def param_dim(self) -> int:
        """The parameter dim of the matrix's dim 1 (the one the momentum splits over replicas)."""
        return 1 if self.expert is None else 2

    def piece_numel(self, s: int) -> int:
        """Elements of the matrix on shard position ``s`` (its rows of the update come back there)."""
        p = self.pieces[s]
        return p.rows * p.cols * self.inner

    def sent_numel(self, s: int) -> int:
        """Elements position ``s`` sends towards the owner (0 for a copy of another position's piece)."""
        return self.piece_numel(s) if self.pieces[s].sends else 0

    def replica_columns(self, s: int) -> tuple[int, ...]:
        """Piece ``s``'s columns each replica keeps the momentum of."""
        return _column_split(self.pieces[s].cols, self.replicate)[0]

    def column_start(self, r: int, s: int) -> int:
        """First column, within piece ``s``, of replica ``r``'s momentum slice."""
        return _column_split(self.pieces[s].cols, self.replicate)[1][r]

    def momentum_numel(self, r: int, s: int) -> int:
        """Elements of the momentum (and of the direction formed from it) on rank ``(r, s)``."""
        return self.pieces[s].rows * self.replica_columns(s)[r] * self.inner

    def slice_numel(self, r: int, s: int) -> int:
        """Elements of rank ``(r, s)``'s direction slice that travel to the owner's replica."""
        return self.momentum_numel(r, s) if self.pieces[s].sends else 0

    def local_view(self, local: "torch.Tensor", s: int) -> "torch.Tensor":
        """The matrix's part of shard position ``s``'s local tensor (the parameter's, a gradient's
        or the momentum's), shaped ``(rows, cols, *shape[2:])`` (the last dims as that tensor has them)."""
        if self.group is not None:
            return local.narrow(0, self.group_starts[s], self.pieces[s].rows)
        if self.expert is None:
            return local
        if self.pieces[s].rows:
            return local[self.expert - self.stack_starts[s]]
        return local.new_empty((0, *local.shape[2:]))

    def kept_view(self, local: "torch.Tensor", r: int, s: int) -> "torch.Tensor":
        """Rank ``(r, s)``'s part of the matrix in its local tensor: its piece (:meth:`local_view`),
        on HSDP narrowed to the columns whose state replica ``r`` keeps (what the rank sends
        towards the owner)."""
        view = self.local_view(local, s)
        if self.replicate == 1:
            return view
        return view.narrow(1, self.column_start(r, s), self.replica_columns(s)[r])

    def cut(self, full: "torch.Tensor", s: int) -> "torch.Tensor":
        """Piece ``s`` of a full ``(m, n)`` matrix, flattened (a copy unless it is whole rows)."""
        p = self.pieces[s]
        if p.cols == self.shape[1]:
            return full[p.row : p.row + p.rows].reshape(-1)
        box = full.view(self.shape[0], self.shape[1], self.inner)[p.row : p.row + p.rows, p.col : p.col + p.cols]
        return box.reshape(-1)

    def assemble(self, parts: "dict[int, torch.Tensor]") -> "torch.Tensor":
        """The full ``(m, n)`` matrix from the pieces of the sending positions ``{s: flat piece}``."""
        order = sorted(parts, key=lambda s: (self.pieces[s].row, self.pieces[s].col))
        if all(self.pieces[s].cols == self.shape[1] for s in order):
            return torch.cat([parts[s] for s in order]).view(self.matrix_shape)
        first = parts[order[0]]
        full = first.new_empty(self.shape[0], self.shape[1], self.inner)
        for s in order:
            p = self.pieces[s]
            full[p.row : p.row + p.rows, p.col : p.col + p.cols] = parts[s].view(p.rows, p.cols, self.inner)
        return full.view(self.matrix_shape)


@dataclass
class BlockInfo:
    """The matrices one FSDP2 module reduces together: the unit of exchange."""

    index: int
    """Position in the plan (model order, root first)."""
    name: str
    """Module name (``""`` for the root)."""
    module: nn.Module = field(repr=False)
    """The ``fully_shard``-ed module whose reduce-scatter produces the block's gradients."""
    members: list[int] = field(default_factory=list)
    """Plan indices of the block's Muon matrices."""


@dataclass
class ReductionGroup:
    """The parameters one FSDP2 module reduces together, every trainable one (Muon's or not)."""

    name: str
    """Module name (``""`` for the root)."""
    params: list = field(default_factory=list, repr=False)
    """Its trainable parameters (the ones it manages itself, not its FSDP children's)."""
    block: int | None = None
    """Its index in ``Plan.blocks`` when it holds Muon matrices, else None."""
    root: str = ""
    """Name of its outermost ``fully_shard``-ed ancestor (itself for a root): a pipeline stage's module,
    whose groups its schedule reduces by hand in one go."""


@dataclass
class Plan:
    """Ownership plan returned by :func:`dmuon.prepare` (and built by :class:`dmuon.DMuon`).

    Made after ``fully_shard`` from the model's DTensor parameters: which
    matrices Muon updates, which rank owns each one, and how they group into
    the FSDP2 modules whose gradients arrive together.
    """

    infos: list[MatrixInfo]
    """Every Muon matrix, in plan order."""
    blocks: list[BlockInfo]
    """FSDP2 modules holding Muon matrices, in model order (the root first)."""
    world_size: int
    """Ranks that own matrices: every rank of the mesh (R*S for HSDP; 1 without a mesh)."""
    rank: int
    """This process's plan rank ``r * shard + s``."""
    balancer: str
    """Name of the balancer that assigned the owners."""
    replicate: int = 1
    """R, the mesh's replicate dimension (1 for a 1-D mesh)."""
    mesh: object = field(default=None, repr=False)
    """The parameters' DeviceMesh (None in a single process)."""
    param_names: tuple[str, ...] = ()
    """Every parameter name of the model when the plan was made (to catch later changes)."""
    balance_result: object = field(default=None, repr=False)
    """The balancer's :class:`~dmuon.plan.balance.BalanceResult` (loads, batches, notes)."""
    topology: object = field(default=None, repr=False)
    """The :class:`~dmuon.comm.topology.Topology` (levels and dmuon's own process groups)."""
    device: object = field(default=None, repr=False)
    """Device of the exchange buffers (the mesh's)."""
    ns: NSConfig = field(default_factory=NSConfig)
    """The Newton-Schulz configuration the owners' costs were priced (or measured) with, and
    the one :class:`dmuon.DMuon` runs."""
    hsdp_mesh: object = field(default=None, repr=False)
    """HSDP with dmuon's replicate level: the ``(replicate, shard, ...)`` mesh whose non-replicate dims
    the model is sharded over; dmuon reduces every gradient across its dim 0. None otherwise."""
    groups: list = field(default_factory=list, repr=False)
    """Every FSDP2 module with trainable parameters (:class:`ReductionGroup`), in model order."""
    ddp: bool = False
    """Every rank holds every parameter whole and its mean gradient after backward (torch's
    ``DistributedDataParallel``): each matrix's owner keeps its momentum and runs its NS, and the
    updates are all-gathered (:mod:`dmuon.runtime.ddp`); no direction moves."""

    @property
    def replicate_level(self) -> bool:
        """Whether dmuon, not FSDP2, reduces the gradients across replicas (``hsdp_mesh``)."""
        return self.hsdp_mesh is not None and self.replicate > 1

    def __post_init__(self) -> None:
        self._by_name = {info.name: info for info in self.infos}

    @property
    def shard(self) -> int:
        """S, ranks per replica (the mesh's shard dimension)."""
        return self.world_size // self.replicate

    @property
    def position(self) -> tuple[int, int]:
        """This rank's ``(replica, shard position)`` in the mesh (:func:`~dmuon.plan.layout.position`)."""
        return position(self.rank, self.shard)

    @property
    def params(self) -> set[nn.Parameter]:
        """The Muon matrices' parameters."""
        return {info.param for info in self.infos}

    def owner(self, name: str) -> int:
        """Owner rank of the matrix called ``name``.

        Raises:
            ValueError: If ``name`` is not a Muon matrix of this plan.
        """
        if name not in self._by_name:
            raise ValueError(f"{name!r} is not a Muon matrix in this plan")
        return self._by_name[name].owner

    def info(self, name: str) -> MatrixInfo:
        """The :class:`MatrixInfo` of the matrix called ``name``."""
        self.owner(name)
        return self._by_name[name]

    def owned(self, rank: int | None = None) -> list[MatrixInfo]:
        """Matrices owned by ``rank`` (default: this rank), in plan order."""
        rank = self.rank if rank is None else rank
        return [info for info in self.infos if info.owner == rank]

    def ns_batches(self, indices: Sequence[int], rank: int | None = None) -> list[list[int]]:
        """Splits matrices owned by ``rank`` into the NS batches the balancer costed.

        Args:
            indices: Matrix indices (plan order) to orthogonalise now.
            rank: Owner rank (default: this rank).

        Returns:
            Batches of indices (see :func:`dmuon.plan.batches.split_into_batches`);
            one batch per kind where the plan has no batches larger than one.
        """
        rank = self.rank if rank is None else rank
        balance = self.balance_result
        if balance is None or not getattr(balance, "kind_keys", None):
            kind_of = [info.matrix_shape for info in self.infos]
            return split_into_batches(indices, kind_of, {})
        return balance.ns_batches(indices, rank)

    def rank_costs(self) -> list[float]:
        """Estimated owner-side cost per rank."""
        return rank_loads([i.cost for i in self.infos], [i.owner for i in self.infos], self.world_size)

    def imbalance(self) -> float:
        """Slowest rank's cost over the mean (1.0 is perfect)."""
        loads = self.rank_costs()
        mean = sum(loads) / len(loads)
        return max(loads) / mean if mean > 0 else 1.0

    def __str__(self) -> str:
        rows = [("matrix", "shape", "owner", "est. cost")]
        for info in self.infos:
            rows.append((info.name, "x".join(map(str, info.shape)), str(info.owner), f"{info.cost:.3g}"))
        widths = [max(len(r[c]) for r in rows) for c in range(4)]
        mesh = f"{self.replicate}x{self.world_size // self.replicate} (replicate x shard)" if self.replicate > 1 else str(self.world_size)
        lines = [f"dmuon plan: {len(self.infos)} matrices, {mesh} ranks, balancer={self.balancer}"]
        for k, row in enumerate(rows):
            lines.append("  ".join(v.ljust(w) for v, w in zip(row, widths)))
            if k == 0:
                lines.append("  ".join("-" * w for w in widths))
        loads = self.rank_costs()
        # What an owner holds while it runs NS: the full fp32 direction of each matrix.
        workspace = [0] * self.world_size
        for info in self.infos:
            workspace[info.owner] += info.numel * 4
        lines.append("")
        lines.append("rank  est. cost  matrices  owner workspace bytes")
        for r in range(self.world_size):
            count = sum(1 for i in self.infos if i.owner == r)
            lines.append(f"{r:<4}  {loads[r]:<9.3g}  {count:<8}  {workspace[r]}")
        lines.append(f"imbalance (max/mean): {self.imbalance():.3f}")
        for note in getattr(self.balance_result, "notes", None) or ():
            lines.append(f"note: {note}")
        return "\n".join(lines)
