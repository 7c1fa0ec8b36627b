"""ShardExchange on its own, no model: 4 gloo ranks, a 1-D mesh and a 2x2 (replicate x shard) one.

Every rank holds its piece of known full tensors (piece ``s`` of shard position
``s`` and, on HSDP, its column slice ``r`` of replica ``r``), as FSDP2 and dmuon's
column-sliced momentum leave them. Two layouts: FSDP2's row chunks, and
tensor parallelism's (the shard positions as dp x tp with tp = 2: colwise
rows inside TP's chunks, rowwise boxes, and a matrix TP leaves whole, whose
copies only the first holder sends). The owners must get exactly the full
directions, every rank exactly its piece of every update, and the bytes counted
for each collective must be :func:`dmuon.costmodel.traffic.owner_exchange_collectives`'.
"""

from __future__ import annotations

import functools
import math
import threading
import time

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from dmuon.comm.exchange import ShardExchange
from dmuon.comm.stats import CommStats
from dmuon.comm.topology import from_mesh
from dmuon.plan.plan import MatrixInfo, Piece, row_pieces
from dmuon.plan.publication import ROUTES
from dmuon.costmodel.traffic import owner_exchange_collectives, shard_rows
from dmuon.plan.hop_a import UNITS
from support.spawn import run_distributed

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


def _landed_by_a_side_thread(stats: CommStats, issue) -> dict:
    """Issues a two-hop exchange, has a side thread ``wait(exposed=False)`` on it, and only then
    (after giving that thread time to misbehave) calls ``forward()`` on the main thread."""
    start = len(stats.log)
    pending = issue()
    events, landed = [], {}

    def side() -> None:
        landed["result"] = pending.wait(exposed=False)
        events.append("returned")

    thread = threading.Thread(target=side)
    thread.start()
    time.sleep(0.3)  # room for a side thread that does not wait for forward() to return early
    out = {"alive_before_forward": thread.is_alive(), "log_before_forward": stats.log[start:]}
    events.append("forward")
    pending.forward()
    thread.join(timeout=60)
    out.update(alive_after_join=thread.is_alive(), events=events, result=landed.get("result"),
               log_after_forward=stats.log[start:])
    return out


def exchange_on_ranks(rank: int, world_size: int, mesh: str) -> dict:
    """Worker: every block's directions to the owners and updates back, then all updates at once,
    then (HSDP) a two-hop exchange of each kind landed by a side thread; what arrived and the logs."""
    mesh_shape = MESHES[mesh][0]
    if mesh_shape is None:
        device_mesh = init_device_mesh("cpu", (world_size,))
    else:
        device_mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard"))
    topo = from_mesh(device_mesh, replicated=mesh_shape is not None)
    r, s = topo.coords
    infos = _infos(mesh)
    stats = CommStats()
    exchange = ShardExchange(infos, topo, stats, WIRE, torch.device("cpu"))
    out: dict = {"plan_rank": topo.rank, "coords": (r, s), "blocks": {}}

    def owned(members):
        return {k: _update(infos[k]) for k in members if infos[k].owner == topo.rank}

    for block in sorted(set(BLOCKS)):
        members = _members(block)
        start = len(stats.log)
        pending = exchange.send_directions(members, {k: _piece(infos[k], r, s) for k in members})
        pending.forward()
        directions = pending.wait()
        middle = len(stats.log)
        pending = exchange.return_updates(members, owned(members))
        pending.forward()
        rows = pending.wait()
        out["blocks"][block] = {"directions": directions, "rows": rows,
                                "send_log": stats.log[start:middle], "return_log": stats.log[middle:]}
    everything = list(range(len(SHAPES)))
    start = len(stats.log)
    out["all_rows"] = exchange.return_updates(everything, owned(everything)).wait()  # no forward(): wait() does it
    out["all_return_log"] = stats.log[start:]

    # The agreement's flags riding on the return: rank k raises flag k, odd ranks the last one.
    flags = torch.tensor([int(k == topo.rank) for k in range(world_size)] + [topo.rank % 2], dtype=torch.int32)
    out["flagged"] = {}
    for block in [*sorted(set(BLOCKS)), "all"]:
        members = everything if block == "all" else _members(block)
        start = len(stats.log)
        pending = exchange.return_updates(members, owned(members), flags)
        out["flagged"][block] = {"rows": pending.wait(), "agreed": pending.agreed().tolist(),
                                 "log": stats.log[start:]}

    # Flags that are float32 bit patterns (the agreement's logit maxima), in every wire dtype: they
    # must travel bit for bit and be maximised as integers (a bf16 wire cannot hold them as values).
    out["float_flags"] = {}
    for wire in FLOAT_FLAG_WIRES:
        flag_exchange = ShardExchange(infos, topo, CommStats(), wire, torch.device("cpu"))
        mine = [k for k in everything if infos[k].owner == topo.rank]
        sent = torch.cat([flags, _float_flags(topo.rank).view(torch.int32)])
        pending = flag_exchange.return_updates(everything, {k: _update(infos[k]).to(wire) for k in mine}, sent)
        out["float_flags"][str(wire)] = {"rows": pending.wait(), "agreed": pending.agreed()}

    # A per-row state riding along (NorMuon's): every member at once, in float32 and (bit for bit,
    # two wire elements a value) in bfloat16; fresh counters, so the logs hold these alone.
    out["row_state"] = {}
    for wire, width in ROW_STATE_RUNS:
        row_stats = CommStats()
        rows_exchange = ShardExchange(infos, topo, row_stats, wire, torch.device("cpu"), row_width=width)
        held = {k: _row_state(k, width, 0)[infos[k].pieces[s].row:][:infos[k].pieces[s].rows] for k in everything}
        pending = rows_exchange.send_directions(
            everything, {k: _piece(infos[k], r, s).to(wire) for k in everything}, held)
        got = {"directions": pending.wait(), "states": pending.row_states(), "send_log": list(row_stats.log)}
        middle = len(row_stats.log)
        mine = [k for k in everything if infos[k].owner == topo.rank]
        pending = rows_exchange.return_updates(everything, {k: _update(infos[k]).to(wire) for k in mine},
                                               rows={k: _row_state(k, width, 1000) for k in mine})
        got.update(rows=pending.wait(), returned_states=pending.row_states(), return_log=row_stats.log[middle:])
        out["row_state"][str(wire)] = got

    if topo.replicate > 1:
        members = _members(0)
        # Hop A joined with another all-to-all of another dtype on the replicate group: one
        # collective, each part landing what it would alone.
        start = len(stats.log)
        mine = torch.arange(topo.replicate * 3, dtype=torch.bfloat16) + 10 * topo.rank  # exact in bf16
        theirs = torch.empty_like(mine)
        with exchange.across.coalesced():
            pending = exchange.send_directions(members, {k: _piece(infos[k], r, s) for k in members})
            extra = exchange.across(theirs, mine, [3] * topo.replicate, [3] * topo.replicate, 7, 11)
            try:
                extra[0].wait()
                early = "returned"
            except RuntimeError as e:
                early = str(e)
        extra[0].wait()
        pending.forward()
        out["joined"] = {"directions": pending.wait(), "extra": theirs.float(), "early": early,
                         "log": stats.log[start:]}
        # Hop A in row chunks: a third of the units, nothing more, two thirds and one, the rest.
        steps = [UNITS // 3, UNITS // 3, 2 * UNITS // 3 + 1, UNITS]
        schedule = iter([{k: units for k in members} for units in steps])
        start = len(stats.log)
        pending = exchange.send_directions(members, {k: _piece(infos[k], r, s) for k in members},
                                           spread=lambda: next(schedule))
        for _ in steps[1:]:
            pending.forward()
        out["chunked"] = {"directions": pending.wait(), "log": stats.log[start:], "steps": steps}
        out["two_hop"] = {
            "directions": _landed_by_a_side_thread(
                stats, lambda: exchange.send_directions(members, {k: _piece(infos[k], r, s) for k in members})),
            "updates": _landed_by_a_side_thread(stats, lambda: exchange.return_updates(members, owned(members))),
        }
    return out


@functools.cache
def _results(mesh: str) -> list[dict]:
    return run_distributed(exchange_on_ranks, WORLD, mesh, timeout_s=60)


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


@pytest.mark.parametrize("mesh", MESHES)
def test_owners_get_full_directions_and_every_rank_its_rows(mesh):
    infos = _infos(mesh)
    for res in _results(mesh):
        rank, s = res["plan_rank"], res["coords"][1]
        for block, got in res["blocks"].items():
            members = _members(block)
            where = f"{mesh} rank {rank} block {block}"
            mine = [k for k in members if OWNERS[k] == rank]
            assert sorted(got["directions"]) == mine, where
            for k in mine:
                full = got["directions"][k]
                assert full.shape == infos[k].matrix_shape == (SHAPES[k][0], math.prod(SHAPES[k][1:])), where
                assert torch.equal(full, _direction(k).reshape(infos[k].matrix_shape)), f"{where}: matrix {k}"
            _check_rows(got["rows"], members, infos, s, where)
        _check_rows(res["all_rows"], list(range(len(SHAPES))), infos, s, f"{mesh} rank {rank}, all at once")


@pytest.mark.parametrize("mesh", MESHES)
def test_counted_bytes_are_the_traffic_models(mesh):
    for res in _results(mesh):
        rank = res["plan_rank"]
        for block, got in res["blocks"].items():
            send, back = _expected_log(_members(block), rank, mesh)
            assert got["send_log"] == send, f"{mesh} rank {rank} block {block}: directions"
            assert got["return_log"] == back, f"{mesh} rank {rank} block {block}: updates"
        _, back = _expected_log(list(range(len(SHAPES))), rank, mesh)
        assert res["all_return_log"] == back, f"{mesh} rank {rank}: all updates at once"
        assert any(sent or received for _, sent, received in res["all_return_log"]), f"{mesh} rank {rank}"


@pytest.mark.parametrize("mesh", MESHES)
def test_row_state_travels_with_the_matrices_exactly(mesh):
    """With ``row_width``: each owner gets the whole row state of what it owns beside the whole
    direction, every holder of a row (TP's column boxes, copies, every replica) gets the owner's new
    state of its rows, bit for bit in a 16-bit wire too, and the bytes counted per collective are
    the model's with ``row_bytes``."""
    infos = _infos(mesh)
    replicate, shard = _grid(mesh)
    everything = list(range(len(SHAPES)))
    for res in _results(mesh):
        rank, s = res["plan_rank"], res["coords"][1]
        for wire, width in ROW_STATE_RUNS:
            got = res["row_state"][str(wire)]
            where = f"{mesh} rank {rank} wire {wire}"
            mine = [k for k in everything if OWNERS[k] == rank]
            assert sorted(got["directions"]) == sorted(got["states"]) == mine, where
            for k in mine:
                assert torch.equal(got["directions"][k], _direction(k).reshape(infos[k].matrix_shape).to(wire)), where
                assert torch.equal(got["states"][k], _row_state(k, width, 0)), f"{where}: matrix {k}'s state"
            assert set(got["returned_states"]) == set(got["rows"]), where
            for k in everything:
                p = infos[k].pieces[s]
                if p.rows:
                    expected = _row_state(k, width, 1000)[p.row : p.row + p.rows]
                    assert torch.equal(got["returned_states"][k], expected), f"{where}: matrix {k}'s rows"
                    assert torch.equal(got["rows"][k], _rows(infos[k], s, _update(infos[k])).to(wire)), where
            backward, step = owner_exchange_collectives(
                SHAPES, OWNERS, BLOCKS, replicate, shard, elem_bytes=wire.itemsize,
                pieces=[i.pieces for i in infos], row_bytes=4 * width)
            # All blocks at once: one direction exchange of the model's per block, summed.
            send = [(c.level, *c.ranks[rank]) for c in backward if c.ranks[rank] is not None]
            assert _bytes_by_level(got["send_log"]) == _bytes_by_level(send), where
            assert got["return_log"] == [(c.level, *c.ranks[rank]) for c in step if c.ranks[rank] is not None], where


def _bytes_by_level(log) -> dict[str, tuple[int, int]]:
    out: dict[str, tuple[int, int]] = {}
    for level, sent, received in log:
        before = out.get(level, (0, 0))
        out[level] = (before[0] + sent, before[1] + received)
    return {level: v for level, v in out.items() if v != (0, 0)}


@pytest.mark.parametrize("mesh", MESHES)
def test_flags_sent_with_the_return_reach_every_rank(mesh):
    """``return_updates(..., flags)``: every rank gets the elementwise maximum of all ranks' flags,
    also from blocks its replica or column has no rows of (the hops issue anyway), the rows are
    the same as without flags, and the flags are not counted as update bytes."""
    infos = _infos(mesh)
    results = _results(mesh)
    for res in results:
        rank, s = res["plan_rank"], res["coords"][1]
        for block, got in res["flagged"].items():
            where = f"{mesh} rank {rank} block {block}"
            assert got["agreed"] == [1] * len(results) + [1], where
            members = list(range(len(SHAPES))) if block == "all" else _members(block)
            _check_rows(got["rows"], members, infos, s, where)
            plain = res["all_return_log"] if block == "all" else res["blocks"][block]["return_log"]
            assert _bytes_by_level(got["log"]) == _bytes_by_level(plain), where


@pytest.mark.parametrize("mesh", MESHES)
def test_float32_bit_patterns_ride_as_flags_exactly_in_every_wire_dtype(mesh):
    """Flags holding float32 bit patterns come back as the bit pattern of the elementwise maximum of the
    floats over every rank, in a float32, bfloat16 and float64 wire alike, beside the 0/1 flags."""
    infos = _infos(mesh)
    results = _results(mesh)
    expected = torch.stack([_float_flags(k) for k in range(len(results))]).amax(0)
    for res in results:
        rank, s = res["plan_rank"], res["coords"][1]
        for wire in FLOAT_FLAG_WIRES:
            got = res["float_flags"][str(wire)]
            where = f"{mesh} rank {rank} wire {wire}"
            assert got["agreed"].dtype == torch.int32, where
            assert got["agreed"][: len(results) + 1].tolist() == [1] * (len(results) + 1), where
            assert torch.equal(got["agreed"][len(results) + 1:].view(torch.float32), expected), where
            for k in range(len(SHAPES)):
                if infos[k].pieces[s].rows:
                    assert torch.equal(got["rows"][k], _rows(infos[k], s, _update(infos[k])).to(wire)), where


def test_hop_a_joined_with_another_all_to_all_lands_both_in_one_collective():
    """``GroupAllToAll.coalesced``: hop A and a bf16 all-to-all on the replicate group go out as one
    collective counted once with both parts' bytes; each part lands what it would alone; waiting on a
    queued part before the block issued it raises instead of reading an empty buffer."""
    results = _results("2x2")
    separate = {res["plan_rank"]: res["blocks"][0] for res in results}
    for res in results:
        r, s = res["coords"]
        joined = res["joined"]
        assert "waited on before the block ended" in joined["early"]
        assert set(joined["directions"]) == set(separate[res["plan_rank"]]["directions"])
        for k, full in joined["directions"].items():
            assert torch.equal(full, separate[res["plan_rank"]]["directions"][k])
        # Every replica q sent this rank its segment r of arange(6) + 10 * (its plan rank).
        expected = torch.cat([torch.arange(3 * r, 3 * r + 3) + 10 * (q * 2 + s) for q in range(2)]).float()
        assert torch.equal(joined["extra"], expected)
        hop_a = [entry for entry in separate[res["plan_rank"]]["send_log"] if entry[0] == "inter"]
        inter = [entry for entry in joined["log"] if entry[0] == "inter"]
        assert len(inter) == 1
        assert inter[0] == ("inter", sum(e[1] for e in hop_a) + 7, sum(e[2] for e in hop_a) + 11)


def test_hop_a_in_row_chunks_lands_the_same_directions():
    """``send_directions(spread=)``: hop A in unit ranges (rows pro rata on every position), one
    all_to_all per chunk that moves a row of this position, hop B once all have landed."""
    mesh = "2x2"
    infos = _infos(mesh)
    replicate, shard = _grid(mesh)
    members = _members(0)
    for res in _results(mesh):
        rank, (r, s) = res["plan_rank"], res["coords"]
        got = res["chunked"]
        mine = [k for k in members if OWNERS[k] == rank]
        assert sorted(got["directions"]) == mine
        for k in mine:
            assert torch.equal(got["directions"][k], _direction(k).reshape(infos[k].matrix_shape)), f"rank {rank}"
        # Each chunk's bytes, from the unit ranges (written here from the rows each range moves).
        steps, expected, before = got["steps"], [], 0
        for units in steps:
            sent = received = 0
            for k in members:
                info, r_o = infos[k], OWNERS[k] // shard
                rows = info.rows[s] if info.sent_numel(s) else 0
                moved = rows * units // UNITS - rows * before // UNITS
                widths = [c * info.inner * ELEM for c in info.replica_columns(s)]
                sent += moved * widths[r] if r != r_o else 0
                received += moved * sum(w for q, w in enumerate(widths) if q != r_o) if r == r_o else 0
            moves = any((infos[k].rows[s] if infos[k].sent_numel(s) else 0) * units // UNITS
                        != (infos[k].rows[s] if infos[k].sent_numel(s) else 0) * before // UNITS for k in members)
            if moves:
                expected.append(("inter", sent, received))
            before = units
        assert [e for e in got["log"] if e[0] == "inter"] == expected, f"rank {rank}"
        # The chunks move what hop A moves at once (the same rank's log in the per-block run).
        at_once = [e for e in res["blocks"][0]["send_log"] if e[0] == "inter"]
        assert [sum(e[1] for e in expected), sum(e[2] for e in expected)] == \
            [sum(e[1] for e in at_once), sum(e[2] for e in at_once)]
        assert [e for e in got["log"] if e[0] == "intra"] == [e for e in res["blocks"][0]["send_log"]
                                                             if e[0] == "intra"]
    # The empty second chunk moved no row anywhere, the others did somewhere.
    assert max(len([e for e in res["chunked"]["log"] if e[0] == "inter"]) for res in _results(mesh)) == 3


def test_a_replica_owning_none_of_a_block_skips_its_collectives():
    for res in _results("2x2"):
        r, s = res["coords"]
        got = res["blocks"][2]  # owned by ranks 0 and 1, replica 0
        levels = [level for level, _, _ in got["send_log"]]
        # The column slices still cross to replica 0; only replica 0's ranks gather the rows.
        assert levels == (["inter", "intra"] if r == 0 else ["inter"]), (r, s, got["send_log"])
        assert got["directions"].keys() == {k for k in _members(2) if OWNERS[k] == res["plan_rank"]}
        # Back: replica 1 issues no shard-level collective, but gets its rows from replica 0.
        levels = [level for level, _, _ in got["return_log"]]
        assert levels == (["intra", "inter"] if r == 0 else ["inter"]), (r, s, got["return_log"])
        got = res["blocks"][3]  # one 1xn matrix owned by rank 2 = (1, 0); column 1 holds none of its rows
        levels = [level for level, _, _ in got["send_log"]]
        # Column 1 skips the slices across replicas; replica 0 skips the rows to the owner.
        expected = {(0, 0): ["inter"], (0, 1): [], (1, 0): ["inter", "intra"], (1, 1): ["intra"]}[(r, s)]
        assert levels == expected, (r, s, got["send_log"])
    # The same block on the 1-D mesh: ranks 2 and 3 own none of block 2 but are in the owners' replica.
    for res in _results("1-D"):
        assert [level for level, _, _ in res["blocks"][2]["send_log"]] == ["intra"]


@pytest.mark.parametrize("what", ["directions", "updates"])
def test_two_hop_exchange_waits_for_the_main_threads_forward(what):
    """On HSDP the second hop (directions: rows to the owner; updates: rows to the other replicas)
    is issued only by the main thread's ``forward()``: a side thread's ``wait(exposed=False)``
    issues nothing and returns only after it."""
    infos = _infos("2x2")
    members = _members(0)
    for res in _results("2x2"):
        rank, s = res["plan_rank"], res["coords"][1]
        got = res["two_hop"][what]
        send, back = _expected_log(members, rank, "2x2")
        expected = send if what == "directions" else back
        assert [level for level, _, _ in expected] == (["inter", "intra"] if what == "directions"
                                                       else ["intra", "inter"]), expected
        assert got["alive_before_forward"], f"rank {rank}: the side thread returned before forward()"
        assert got["log_before_forward"] == expected[:1], f"rank {rank}: only the first hop before forward()"
        assert not got["alive_after_join"], f"rank {rank}: the side thread never returned"
        assert got["events"] == ["forward", "returned"], rank
        assert got["log_after_forward"] == expected, rank
        if what == "updates":
            _check_rows(got["result"], members, infos, s, f"rank {rank}, side thread")
            continue
        mine = [k for k in members if OWNERS[k] == rank]
        assert sorted(got["result"]) == mine
        for k in mine:
            assert torch.equal(got["result"][k], _direction(k).reshape(infos[k].matrix_shape))


# ------------------------------------------------- hop 2's two routes across replicas
PUBLICATION_LAYOUTS = {
    "2x2": ((2, 2), "rows", OWNERS),
    # Block 0 owned in replica 0 alone (the scatter route's case), block 1 in replicas 1 and 2,
    # block 2 by one rank, block 3 by (1, 1), which holds none of its one row.
    "3x2": ((3, 2), "rows", [1, 0, 1, 2, 5, 0, 0, 3]),
    "2x4 tp": ((2, 4), "tp", [7, 2, 5, 0, 6, 1, 3, 4]),
}
"""Layout name: ((replicate, shard), pieces, owners) of the publication tests (one spawn each)."""
PUBLICATION_RUNS = [(torch.float32, 0, True), (torch.bfloat16, 1, True), (torch.float32, 2, False)]
"""(wire dtype, row_width, flags sent along) of each publication run."""


def _publication_infos(layout: str) -> list[MatrixInfo]:
    (replicate, shard), kind, owners = PUBLICATION_LAYOUTS[layout]
    return [MatrixInfo(index=k, name=f"m{k}", param=nn.Parameter(torch.zeros(0)), shape=shape, block=BLOCKS[k],
                       owner=owners[k], replicate=replicate,
                       pieces=row_pieces(shape, shard) if kind == "rows" else _tp_pieces(k, shape, shard))
            for k, shape in enumerate(SHAPES)]


def _publication_returns() -> list[tuple[str, list[int]]]:
    """(name, members) of each return: every block alone, then all matrices in one wave."""
    return [*((f"block {b}", _members(b)) for b in sorted(set(BLOCKS))), ("all", list(range(len(SHAPES))))]


def publication_on_ranks(rank: int, world_size: int, layout: str) -> dict:
    """Worker: each route (forced, or None: the exchange's choice), wire and row state: every block's
    return, all matrices at once, and the blocks as return waves pipelined as the runtime does; what
    landed, each one's log and the route chosen for each."""
    mesh_shape = PUBLICATION_LAYOUTS[layout][0]
    topo = from_mesh(init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard")), replicated=True)
    infos = _publication_infos(layout)
    flags = torch.tensor([int(k == topo.rank) for k in range(world_size)] + [topo.rank % 2], dtype=torch.int32)
    out: dict = {"plan_rank": topo.rank, "coords": topo.coords, "runs": {}}
    for route in (*ROUTES, None):
        for wire, width, flagged in PUBLICATION_RUNS:
            stats = CommStats()
            exchange = ShardExchange(infos, topo, stats, wire, torch.device("cpu"), row_width=width,
                                     publication=route)

            def start(members, flagged=flagged):
                mine = [k for k in members if infos[k].owner == topo.rank]
                return exchange.return_updates(members, {k: _update(infos[k]).to(wire) for k in mine},
                                               flags if flagged else None,
                                               {k: _row_state(k, width, 1000) for k in mine} if width else None)

            got = {}
            for name, members in _publication_returns():
                begin = len(stats.log)
                pending = start(members)
                agreed = pending.agreed()
                got[name] = {"rows": pending.wait(), "states": pending.row_states(),
                             "agreed": None if agreed is None else agreed.tolist(), "log": stats.log[begin:],
                             "route": exchange.route(members)}
            # The blocks as return waves, as ShardRuntime pipelines them (no flags: several waves are
            # never speculative): before each new wave, every return in flight advances one hop, the
            # round's hops across replicas in one all-to-all.
            begin, returns = len(stats.log), []
            for b in sorted(set(BLOCKS)):
                with exchange.across.coalesced():
                    for earlier in returns:
                        earlier.forward()
                returns.append(start(_members(b), False))
            rows, states = {}, {}
            for k, pending in enumerate(returns):
                while not pending.issued():
                    with exchange.across.coalesced():
                        for later in returns[k:]:
                            later.forward()
                rows.update(pending.wait())
                states.update(pending.row_states())
            got["waves"] = {"rows": rows, "states": states, "log": stats.log[begin:]}
            out["runs"][(route, str(wire), width, flagged)] = got
    return out


@functools.cache
def _publication_results(layout: str) -> list[dict]:
    replicate, shard = PUBLICATION_LAYOUTS[layout][0]
    return run_distributed(publication_on_ranks, replicate * shard, layout, timeout_s=120)


@pytest.mark.parametrize("layout", PUBLICATION_LAYOUTS)
def test_both_publication_routes_give_every_holder_its_rows_state_and_the_flags(layout):
    """Forced either way or chosen, hop 2 leaves every rank exactly its piece of every member's update (the
    owner's, in the wire dtype), its rows' state (bit for bit, in a 16-bit wire too) and the
    maximum of every rank's flags, whichever replica owns what."""
    infos = _publication_infos(layout)
    results = _publication_results(layout)
    for res in results:
        rank, s = res["plan_rank"], res["coords"][1]
        for (route, wire, width, flagged), got in res["runs"].items():
            dtype = getattr(torch, wire.removeprefix("torch."))
            for name, members in [*_publication_returns(), ("waves", list(range(len(SHAPES))))]:
                where = f"{layout} rank {rank} {route} {wire} row_width {width} {name}"
                landed = got[name]
                held = [k for k in members if infos[k].piece_numel(s)]
                assert sorted(landed["rows"]) == held, where
                for k in held:
                    expected = _rows(infos[k], s, _update(infos[k])).to(dtype)
                    assert landed["rows"][k].shape == expected.shape, f"{where}: matrix {k}"
                    assert torch.equal(landed["rows"][k], expected), f"{where}: matrix {k}'s rows"
                assert sorted(landed["states"]) == (held if width else []), where
                for k in held if width else []:
                    p = infos[k].pieces[s]
                    expected = _row_state(k, width, 1000)[p.row : p.row + p.rows]
                    assert torch.equal(landed["states"][k], expected), f"{where}: matrix {k}'s row state"
                if name != "waves":
                    assert landed["agreed"] == ([1] * len(results) + [1] if flagged else None), where


@pytest.mark.parametrize("layout", PUBLICATION_LAYOUTS)
def test_both_publication_routes_count_the_models_bytes_per_collective(layout):
    """Per rank, each collective of the return is one of ``owner_exchange_collectives(publication=)``
    with the same bytes, in order: hop 1, then the direct route's one all-to-all across replicas or the
    scatter and the all-gather; pipelined waves join a wave's all-gather with the next wave's first
    hop across replicas. The flags are not counted (a flags-only collective aside, the same bytes).
    Left to choose, the exchange (from its plan's pieces) and the model (from its tables) pick the
    same route: the scatter one where a replica owns a whole block of three replicas' wave."""
    infos = _publication_infos(layout)
    (replicate, shard), _, owners = PUBLICATION_LAYOUTS[layout]
    waves = [_members(b) for b in sorted(set(BLOCKS))]
    for res in _publication_results(layout):
        rank = res["plan_rank"]
        for (route, wire, width, flagged), got in res["runs"].items():
            elem = getattr(torch, wire.removeprefix("torch.")).itemsize
            for name, members in [*_publication_returns(), ("waves", list(range(len(SHAPES))))]:
                where = f"{layout} rank {rank} {route} {wire} row_width {width} {name}"
                _, step = owner_exchange_collectives(
                    [SHAPES[k] for k in members], [owners[k] for k in members], [BLOCKS[k] for k in members],
                    replicate, shard, elem_bytes=elem, pieces=[infos[k].pieces for k in members],
                    row_bytes=4 * width, publication=route, waves=waves if name == "waves" else None)
                expected = [(c.level, *c.ranks[rank]) for c in step if c.ranks[rank] is not None]
                if flagged and name != "waves":
                    assert _bytes_by_level(got[name]["log"]) == _bytes_by_level(expected), where
                else:
                    assert got[name]["log"] == expected, where
                roles = {c.role for c in step}
                chosen = route or got[name].get("route", route)
                if chosen is not None:
                    assert roles == ({"return_shard", "return_replicas"} if chosen == "direct" else
                                     {"return_shard", "return_scatter", "return_gather"}), where
            if route is None:
                assert got["block 0"]["route"] == ("scatter" if replicate > 2 else "direct"), layout
