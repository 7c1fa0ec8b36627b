"""Where each rank's shard of each Muon matrix sits: the gathered local boxes, each matrix's
piece per shard position, and the checks that the pieces tile the matrix."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from dmuon.comm.setup_collectives import gather_rows
from dmuon.comm.topology import Topology
from dmuon.plan.plan import MatrixInfo, Piece
from dmuon.prepare.mesh import momentum_layout
# Where a DTensor's local shard sits in the global tensor (the function DCP plans its chunks with).
from dmuon.util.torch_compat import local_shape_and_offset


def _local_box(p: torch.Tensor, width: int) -> list[int]:
    """``[ok, offsets..., sizes...]`` of this rank's local shard of ``p`` (``width`` dims, padded)."""
    if not isinstance(p, DTensor):
        shape, offset, ok = tuple(p.shape), (0,) * p.ndim, True
    else:
        shape, offset = local_shape_and_offset(p.shape, p.device_mesh, p.placements)
        local = p.to_local()
        ok = tuple(local.shape) == tuple(shape) and local.is_contiguous()
    pad = [0] * (width - len(shape))
    return [int(ok), *offset, *pad, *shape, *pad]


def momentum_ok(info: MatrixInfo, s: int, r: int, hsdp_mesh) -> bool:
    """HSDP: whether :func:`momentum_layout` gives rank ``(r, s)`` exactly its slice of the piece."""
    p, d, piece = info.param, info.param_dim, info.pieces[s]
    if not piece.rows:
        return True  # nothing of this matrix here
    shape, offset = local_shape_and_offset(p.shape, *momentum_layout(p, d, hsdp_mesh))
    return shape[d] == info.replica_columns(s)[r] and offset[d] == piece.col + info.column_start(r, s)


def gather_boxes(chosen: list[tuple[str, nn.Parameter]], topology: Topology, device) -> list[list[list[int]]]:
    """Every plan rank's local box of every chosen parameter: ``boxes[rank][k] = [ok, offsets, sizes]``.

    Each rank knows only its own shard's place (torch's
    ``compute_local_shape_and_global_offset``); one all-gather tells every rank all of them.
    """
    width = max((p.ndim for _, p in chosen), default=1)
    mine = [_local_box(p, width) for _, p in chosen]
    if topology.world_size == 1:
        return [mine]
    flat = torch.tensor(mine, dtype=torch.int64, device=device).reshape(-1)
    gathered = gather_rows(flat, topology.mesh_group, topology.world_size)
    # The group orders its members by global rank; plan ranks follow the mesh.
    by_global = gathered.cpu().view(topology.world_size, len(chosen), 1 + 2 * width).tolist()
    position = {g: k for k, g in enumerate(sorted(topology.global_ranks))}
    return [by_global[position[g]] for g in topology.global_ranks]


def matrix_pieces(name: str, p: torch.Tensor, boxes: list[list[int]], expert: int | None,
            shard: int, rows_of: tuple[int, int] | None = None) -> tuple[tuple[Piece, ...], tuple[int, ...]]:
    """The matrix's piece on each shard position from the gathered boxes (``[ok, offsets, sizes]``).

    ``expert`` picks one slice of a stack; ``rows_of = (first, count)`` one row group of a
    ``"rows:K"`` view. Also returns, per position, the stack's first local expert or the
    group's first local row.

    Raises:
        ValueError: A trailing dim is split, or the distinct pieces do not tile the matrix.
    """
    width = (len(boxes[0]) - 1) // 2
    lead = 0 if expert is None else 1  # a stack's dim 0 picks the expert
    shape = tuple(p.shape[lead:])
    if rows_of is not None:
        shape = (rows_of[1], *shape[1:])
    pieces, starts = [], []
    for box in boxes[:shard]:
        offset, size = box[1 : 1 + p.ndim], box[1 + width : 1 + width + p.ndim]
        for d in range(lead + 2, p.ndim):
            if offset[d] != 0 or size[d] != p.shape[d]:
                raise ValueError(f"parameter {name!r} is split on its dim {d}; dmuon needs a matrix's dims "
                                 f"after the first two whole on every rank")
        starts.append(offset[0])
        row, rows, cols = offset[lead], size[lead], (size[lead + 1] if len(shape) > 1 else 1)
        if expert is not None and not offset[0] <= expert < offset[0] + size[0]:
            rows = 0  # not this expert; its columns still say how the stack's momentum splits here
        if rows_of is not None:
            # This position's rows of the group: where its box and the group overlap.
            first, count = rows_of
            low, high = max(row, first), min(row + rows, first + count)
            overlap = max(0, high - low)
            starts[-1] = low - row if overlap else 0
            row, rows = (low - first if overlap else 0), overlap
        pieces.append(Piece(row, rows, offset[lead + 1] if len(shape) > 1 else 0, cols))
    seen: set[tuple[int, int, int, int]] = set()
    out = []
    for piece in pieces:
        key = (piece.row, piece.rows, piece.col, piece.cols)
        out.append(Piece(*key, sends=key not in seen))
        if piece.rows * piece.cols:
            seen.add(key)
    if not tiles(seen, shape[0], shape[1] if len(shape) > 1 else 1):
        placements = tuple(p.placements) if isinstance(p, DTensor) else ()
        raise ValueError(f"parameter {name!r}: its local shards (placements {placements}) are not contiguous "
                         "boxes of the matrix, a layout dmuon does not support")
    return tuple(out), tuple(starts)


def tiles(boxes, rows: int, cols: int) -> bool:
    """Whether the ``(row, rows, col, cols)`` boxes cover the ``rows x cols`` matrix exactly once.

    On the grid of the boxes' own edges (at most one cell per pair of edges),
    a 2-D difference array counts how often each cell is covered: linear in the
    boxes plus the grid, so thousands of ranks' pieces check in milliseconds.
    """
    boxes = np.array(sorted(boxes), dtype=np.int64).reshape(-1, 4)
    if rows * cols == 0:
        return len(boxes) == 0
    r0, r1, c0, c1 = boxes[:, 0], boxes[:, 0] + boxes[:, 1], boxes[:, 2], boxes[:, 2] + boxes[:, 3]
    if len(boxes) == 0 or r0.min() < 0 or c0.min() < 0 or r1.max() > rows or c1.max() > cols:
        return False
    row_edges = np.unique(np.concatenate([[0, rows], r0, r1]))
    col_edges = np.unique(np.concatenate([[0, cols], c0, c1]))
    a, b = np.searchsorted(row_edges, r0), np.searchsorted(row_edges, r1)
    c, d = np.searchsorted(col_edges, c0), np.searchsorted(col_edges, c1)
    diff = np.zeros((len(row_edges), len(col_edges)), dtype=np.int64)
    np.add.at(diff, (a, c), 1)
    np.add.at(diff, (b, c), -1)
    np.add.at(diff, (a, d), -1)
    np.add.at(diff, (b, d), 1)
    cover = diff.cumsum(0).cumsum(1)[:-1, :-1]
    return bool((cover == 1).all())
