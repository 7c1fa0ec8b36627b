"""ShardExchange on its own, no model: 4 gloo ranks, a 1-D mesh and a 2x2 (replicate x shard) one.

Every rank holds its piece of known full tensors, in FSDP2's row chunks or tensor parallelism's
boxes (:mod:`dmuon.comm.tests.exchange_cases`). The owners must get exactly the full
directions, every rank exactly its piece of every update, and the bytes counted
for each collective must be :func:`dmuon.costmodel.traffic.owner_exchange_collectives`'.
Hop 2's two routes across replicas: :mod:`dmuon.comm.tests.test_publication`.
"""

from __future__ import annotations

import functools
import math
import threading
import time

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from dmuon.comm.exchange import ShardExchange
from dmuon.comm.stats import CommStats
from dmuon.comm.tests.exchange_cases import (
    BLOCKS, ELEM, FLOAT_FLAG_WIRES, MESHES, OWNERS, ROW_STATE_RUNS, SHAPES, WIRE, WORLD, _bytes_by_level,
    _check_rows, _direction, _expected_log, _float_flags, _grid, _infos, _members, _piece, _row_state, _rows,
    _update)
from dmuon.comm.tests.exchange_cases import _tp_pieces  # noqa: F401 (runtime/tests/test_schedule.py imports it here)
from dmuon.comm.topology import Topology, from_mesh
from dmuon.costmodel.traffic import owner_exchange_collectives
from dmuon.plan.hop_a import UNITS
from dmuon.plan.plan import MatrixInfo
from support.spawn import run_distributed

# Its point is stream order (exchanges issued and landed on dmuon's streams): every rank runs under the stream checker.
pytestmark = pytest.mark.streams


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


def _topology(mesh: str, world_size: int) -> Topology:
    mesh_shape = MESHES[mesh][0]
    if mesh_shape is None:
        device_mesh = init_device_mesh("cpu", (world_size,))
    else:
        device_mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard"))
    return from_mesh(device_mesh, replicated=mesh_shape is not None)


def _owned(infos: list[MatrixInfo], topo: Topology, members: list[int], wire: torch.dtype = WIRE) -> dict:
    """The full update of each member this rank owns, in the wire dtype."""
    return {k: _update(infos[k]).to(wire) for k in members if infos[k].owner == topo.rank}


def _flags(topo: Topology, world_size: int) -> torch.Tensor:
    """The agreement's flags riding on the return: rank k raises flag k, odd ranks the last one."""
    return torch.tensor([int(k == topo.rank) for k in range(world_size)] + [topo.rank % 2], dtype=torch.int32)


def exchange_on_ranks(rank: int, world_size: int, mesh: str) -> dict:
    """Worker: every block's directions to the owners and updates back, then all updates at once,
    with flags, with a row state, then (HSDP) hop A's variants and a two-hop exchange of each kind
    landed by a side thread; what arrived and the logs."""
    from support.scenarios import ScenarioFailed, run_each

    topo = _topology(mesh, world_size)
    infos = _infos(mesh)
    stats = CommStats()
    exchange = ShardExchange(infos, topo, stats, WIRE, torch.device("cpu"))
    flags = _flags(topo, world_size)
    # Each scenario with the keys it gives; one that raised gives its error under each of them, so only the
    # tests reading those fail, with the ranks' text.
    scenarios = {
        ("blocks", "all_rows", "all_return_log"): lambda: _each_block_and_all(exchange, infos, topo),
        ("flagged",): lambda: {"flagged": _flagged_returns(exchange, infos, topo, flags)},
        ("float_flags",): lambda: {"float_flags": _float_flag_returns(infos, topo, flags)},
        ("row_state",): lambda: {"row_state": _row_state_exchanges(infos, topo)},
    }
    if topo.replicate > 1:
        scenarios["joined", "chunked", "two_hop"] = lambda: _hop_a_variants(exchange, infos, topo)
    out: dict = {"plan_rank": topo.rank, "position": topo.position}
    for keys, result in run_each(scenarios).items():
        out.update({key: result if isinstance(result, ScenarioFailed) else result[key] for key in keys})
    return out


def _each_block_and_all(exchange: ShardExchange, infos: list[MatrixInfo], topo: Topology) -> dict:
    """Every block's directions to the owners and updates back, then all updates at once."""
    r, s = topo.position
    stats = exchange.stats
    out: dict = {"blocks": {}}
    for block in sorted(set(BLOCKS)):
        members = _members(block)
        start = len(stats.log)
        pending = exchange.send_directions(members, {k: _piece(infos[k], r, s) for k in members})
        pending.forward()
        directions = pending.wait()
        middle = len(stats.log)
        pending = exchange.return_updates(members, _owned(infos, topo, members))
        pending.forward()
        rows = pending.wait()
        out["blocks"][block] = {"directions": directions, "rows": rows,
                                "send_log": stats.log[start:middle], "return_log": stats.log[middle:]}
    everything = list(range(len(SHAPES)))
    start = len(stats.log)
    # no forward(): wait() does it
    out["all_rows"] = exchange.return_updates(everything, _owned(infos, topo, everything)).wait()
    out["all_return_log"] = stats.log[start:]
    return out


def _flagged_returns(exchange: ShardExchange, infos: list[MatrixInfo], topo: Topology, flags: torch.Tensor) -> dict:
    """Every block's return and all at once again, the agreement's flags riding on each."""
    stats = exchange.stats
    out = {}
    for block in [*sorted(set(BLOCKS)), "all"]:
        members = list(range(len(SHAPES))) if block == "all" else _members(block)
        start = len(stats.log)
        pending = exchange.return_updates(members, _owned(infos, topo, members), flags)
        out[block] = {"rows": pending.wait(), "agreed": pending.agreed().tolist(), "log": stats.log[start:]}
    return out


def _float_flag_returns(infos: list[MatrixInfo], topo: Topology, flags: torch.Tensor) -> dict:
    """Flags that are float32 bit patterns (the agreement's logit maxima), in every wire dtype: they
    must travel bit for bit and be maximised as integers (a bf16 wire cannot hold them as values)."""
    everything = list(range(len(SHAPES)))
    out = {}
    for wire in FLOAT_FLAG_WIRES:
        flag_exchange = ShardExchange(infos, topo, CommStats(), wire, torch.device("cpu"))
        sent = torch.cat([flags, _float_flags(topo.rank).view(torch.int32)])
        pending = flag_exchange.return_updates(everything, _owned(infos, topo, everything, wire), sent)
        out[str(wire)] = {"rows": pending.wait(), "agreed": pending.agreed()}
    return out


def _row_state_exchanges(infos: list[MatrixInfo], topo: Topology) -> dict:
    """A per-row state riding along (NorMuon's): every member at once, in float32 and (bit for bit,
    two wire elements a value) in bfloat16; fresh counters, so the logs hold these alone."""
    r, s = topo.position
    everything = list(range(len(SHAPES)))
    out = {}
    for wire, width in ROW_STATE_RUNS:
        row_stats = CommStats()
        rows_exchange = ShardExchange(infos, topo, row_stats, wire, torch.device("cpu"), row_width=width)
        held = {k: _row_state(k, width, 0)[infos[k].pieces[s].row:][:infos[k].pieces[s].rows] for k in everything}
        pending = rows_exchange.send_directions(
            everything, {k: _piece(infos[k], r, s).to(wire) for k in everything}, held)
        got = {"directions": pending.wait(), "states": pending.row_states(), "send_log": list(row_stats.log)}
        middle = len(row_stats.log)
        mine = [k for k in everything if infos[k].owner == topo.rank]
        pending = rows_exchange.return_updates(everything, _owned(infos, topo, everything, wire),
                                               rows={k: _row_state(k, width, 1000) for k in mine})
        got.update(rows=pending.wait(), returned_states=pending.row_states(), return_log=row_stats.log[middle:])
        out[str(wire)] = got
    return out


def _hop_a_variants(exchange: ShardExchange, infos: list[MatrixInfo], topo: Topology) -> dict:
    """HSDP: block 0's hop A joined with another all-to-all, hop A in row chunks, and a two-hop
    exchange of each kind landed by a side thread."""
    r, s = topo.position
    stats = exchange.stats
    members = _members(0)

    def local() -> dict:
        return {k: _piece(infos[k], r, s) for k in members}

    # Hop A joined with another all-to-all of another dtype on the replicate group: one
    # collective, each part landing what it would alone.
    start = len(stats.log)
    mine = torch.arange(topo.replicate * 3, dtype=torch.bfloat16) + 10 * topo.rank  # exact in bf16
    theirs = torch.empty_like(mine)
    with exchange.across.coalesced():
        pending = exchange.send_directions(members, local())
        extra = exchange.across(theirs, mine, [3] * topo.replicate, [3] * topo.replicate, 7, 11)
        try:
            extra[0].wait()
            early = "returned"
        except RuntimeError as e:
            early = str(e)
    extra[0].wait()
    pending.forward()
    out = {"joined": {"directions": pending.wait(), "extra": theirs.float(), "early": early,
                      "log": stats.log[start:]}}
    # Hop A in row chunks: a third of the units, nothing more, two thirds and one, the rest.
    steps = [UNITS // 3, UNITS // 3, 2 * UNITS // 3 + 1, UNITS]
    schedule = iter([{k: units for k in members} for units in steps])
    start = len(stats.log)
    pending = exchange.send_directions(members, local(), spread=lambda: next(schedule))
    for _ in steps[1:]:
        pending.forward()
    out["chunked"] = {"directions": pending.wait(), "log": stats.log[start:], "steps": steps}
    out["two_hop"] = {
        "directions": _landed_by_a_side_thread(stats, lambda: exchange.send_directions(members, local())),
        "updates": _landed_by_a_side_thread(stats, lambda: exchange.return_updates(
            members, _owned(infos, topo, members))),
    }
    return out


@functools.cache
def _results(mesh: str) -> list[dict]:
    return run_distributed(exchange_on_ranks, WORLD, mesh, timeout_s=60)


@pytest.mark.parametrize("mesh", MESHES)
def test_owners_get_full_directions_and_every_rank_its_rows(mesh):
    infos = _infos(mesh)
    for res in _results(mesh):
        rank, s = res["plan_rank"], res["position"][1]
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
        rank, s = res["plan_rank"], res["position"][1]
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


@pytest.mark.parametrize("mesh", MESHES)
def test_flags_sent_with_the_return_reach_every_rank(mesh):
    """``return_updates(..., flags)``: every rank gets the elementwise maximum of all ranks' flags,
    also from blocks its replica or column has no rows of (the hops issue anyway), the rows are
    the same as without flags, and the flags are not counted as update bytes."""
    infos = _infos(mesh)
    results = _results(mesh)
    for res in results:
        rank, s = res["plan_rank"], res["position"][1]
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
        rank, s = res["plan_rank"], res["position"][1]
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
        r, s = res["position"]
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
        rank, (r, s) = res["plan_rank"], res["position"]
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
        r, s = res["position"]
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
        rank, s = res["plan_rank"], res["position"][1]
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
