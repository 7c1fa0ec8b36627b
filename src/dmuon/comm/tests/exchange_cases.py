"""The matrices, layouts and data the exchange's tests share (:mod:`test_exchange`, :mod:`test_publication`).

Every rank holds its piece of known full tensors (piece ``s`` of shard position
``s`` and, on HSDP, its column slice ``r`` of replica ``r``), as FSDP2 and dmuon's
column-sliced momentum leave them. Two layouts: FSDP2's row chunks, and
tensor parallelism's (the shard positions as dp x tp with tp = 2: colwise
rows inside TP's chunks, rowwise boxes, and a matrix TP leaves whole, whose
copies only the first holder sends).
"""

from __future__ import annotations

import torch
from torch import nn

from dmuon.costmodel.traffic import owner_exchange_collectives, shard_rows
from dmuon.plan.plan import MatrixInfo, Piece, row_pieces

WORLD = 4
# Uneven rows (37 over 4 or 2 columns), a 1xn and an nx1 matrix (on 2x2 the nx1 one's
# second replica keeps no column), a conv kernel, shapes leaving trailing columns empty.
SHAPES = [(37, 91), (1, 50), (50, 1), (6, 3, 3, 3), (5, 7), (8, 16), (3, 5), (1, 50)]
BLOCKS = [0, 0, 0, 1, 1, 2, 2, 3]
# Block 0: the 1xn matrix's owner (rank 1: column 1 on 2x2) holds none of its rows.
# Block 2: owned by ranks 0 and 1 only, so on 2x2 replica 1 owns none of it.
# Block 3: one 1xn matrix, owned in replica 1 on 2x2; shard column 1 holds none of its rows.
OWNERS = [3, 1, 2, 0, 3, 0, 1, 2]
MESHES = {"1-D": (None, "rows"), "2x2": ((2, 2), "rows"), "1-D tp": (None, "tp"), "2x2 tp": ((2, 2), "tp")}
TP = 2
WIRE = torch.float32
ELEM = 4


def _grid(mesh: str) -> tuple[int, int]:
    mesh_shape = MESHES[mesh][0]
    return (1, WORLD) if mesh_shape is None else mesh_shape


def _starts(sizes: list[int]) -> list[int]:
    return [sum(sizes[:k]) for k in range(len(sizes))]


def _tp_pieces(k: int, shape, shard: int) -> tuple[Piece, ...]:
    """Position ``s = d * TP + t`` of a (dp, tp) grid: matrix ``k`` colwise, rowwise or left whole by TP."""
    m, n, dp = shape[0], shape[1], shard // TP
    out = []
    for s in range(shard):
        d, t = divmod(s, TP)
        if k % 3 == 0:  # colwise: TP's row chunk, FSDP2's rows inside it (_StridedShard)
            tp_rows = shard_rows(m, TP)
            rows = shard_rows(tp_rows[t], dp)
            out.append(Piece(_starts(tp_rows)[t] + _starts(rows)[d], rows[d], 0, n))
        elif k % 3 == 1:  # rowwise: FSDP2's rows x TP's columns
            rows, cols = shard_rows(m, dp), shard_rows(n, TP)
            out.append(Piece(_starts(rows)[d], rows[d], _starts(cols)[t], cols[t]))
        else:  # not split by TP: every tp position holds FSDP2's row chunk, the first sends it
            rows = shard_rows(m, dp)
            out.append(Piece(_starts(rows)[d], rows[d], 0, n, sends=t == 0))
    return tuple(out)


def _infos(mesh: str) -> list[MatrixInfo]:
    replicate, shard = _grid(mesh)
    layout = MESHES[mesh][1]
    return [MatrixInfo(index=k, name=f"m{k}", param=nn.Parameter(torch.zeros(0)), shape=shape, block=BLOCKS[k],
                       owner=OWNERS[k], replicate=replicate,
                       pieces=row_pieces(shape, shard) if layout == "rows" else _tp_pieces(k, shape, shard))
            for k, shape in enumerate(SHAPES)]


def _full(k: int, seed: int) -> torch.Tensor:
    return torch.randn(SHAPES[k], generator=torch.Generator().manual_seed(seed + k), dtype=WIRE)


def _direction(k: int) -> torch.Tensor:
    """Matrix ``k``'s full direction, in its parameter shape."""
    return _full(k, 0)


def _update(info: MatrixInfo) -> torch.Tensor:
    """The matrix's full update, as its owner holds it: ``(shape[0], prod(shape[1:]))``."""
    return _full(info.index, 1000).reshape(info.matrix_shape)


def _rows(info: MatrixInfo, s: int, full: torch.Tensor) -> torch.Tensor:
    """Piece ``s`` of a full tensor (parameter-shaped or 2-D), as ``(rows, cols * inner)``."""
    p = info.pieces[s]
    box = full.reshape(info.shape)[p.row : p.row + p.rows, p.col : p.col + p.cols]
    return box.reshape(p.rows, p.cols * info.inner)


def _piece(info: MatrixInfo, r: int, s: int) -> torch.Tensor:
    """Rank ``(r, s)``'s part of the direction: piece ``s``'s column slice ``r``."""
    p = info.pieces[s]
    box = _direction(info.index)[p.row : p.row + p.rows, p.col : p.col + p.cols]
    start = info.column_start(r, s)
    return box[:, start : start + info.replica_columns(s)[r]]


def _members(block: int) -> list[int]:
    return [k for k in range(len(SHAPES)) if BLOCKS[k] == block]


ROW_STATE_RUNS = [(torch.float32, 2), (torch.bfloat16, 1)]
"""(wire dtype, row_width) of the row-state exchanges."""


FLOAT_FLAG_WIRES = [torch.float32, torch.bfloat16, torch.float64]


def _float_flags(rank: int) -> torch.Tensor:
    """Rank ``rank``'s non-negative float32 values sent as flags: the maximum of each is on another rank,
    none of them is exact in bf16, and one is a subnormal (its bit pattern a small integer)."""
    return torch.tensor([3.0 + rank / 3, 1e30 / (rank + 1), 2.0 ** 24 + 2 * rank + 1, 1e-40 * (rank + 1), 0.0],
                        dtype=torch.float32)


def _row_state(k: int, width: int, seed: int) -> torch.Tensor:
    """Matrix ``k``'s whole ``(m, width)`` float32 row state (values no 16-bit dtype holds exactly)."""
    return torch.randn(SHAPES[k][0], width, generator=torch.Generator().manual_seed(seed + 7 * k)) + 1 / 3


def _expected_log(members: list[int], rank: int, mesh: str) -> tuple[list, list]:
    """This rank's ``(level, sent, received)`` of each collective the traffic model has it take part in."""
    replicate, shard = _grid(mesh)
    infos = _infos(mesh)
    backward, step = owner_exchange_collectives([SHAPES[k] for k in members], [OWNERS[k] for k in members],
                                                [BLOCKS[k] for k in members], replicate, shard, elem_bytes=ELEM,
                                                pieces=[infos[k].pieces for k in members])

    def mine(collectives):
        return [(c.level, *c.ranks[rank]) for c in collectives if c.ranks[rank] is not None]

    return mine(backward), mine(step)


def _check_rows(got: dict, members: list[int], infos: list[MatrixInfo], s: int, where: str) -> None:
    """``got`` has this position's piece of every member's update, no entry for a member it holds
    nothing of, and nothing else."""
    assert set(got) <= set(members), f"{where}: unexpected matrices {sorted(set(got) - set(members))}"
    for k in members:
        info = infos[k]
        expected = _rows(info, s, _update(info))
        if info.piece_numel(s) == 0:
            assert k not in got, f"{where}: an entry for matrix {k}, of which this position holds nothing"
            continue
        assert k in got, f"{where}: no rows of matrix {k} {info.shape}"
        assert got[k].shape == expected.shape, f"{where}: matrix {k} rows {tuple(got[k].shape)}"
        assert torch.equal(got[k], expected), f"{where}: matrix {k} {info.shape} rows differ"


def _bytes_by_level(log) -> dict[str, tuple[int, int]]:
    out: dict[str, tuple[int, int]] = {}
    for level, sent, received in log:
        before = out.get(level, (0, 0))
        out[level] = (before[0] + sent, before[1] + received)
    return {level: v for level, v in out.items() if v != (0, 0)}

