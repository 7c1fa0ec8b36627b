"""Hop 2 of the update return on its own, no model: the direct and the scatter route across replicas.

On 2x2, 3x2 and 2x4 (tensor parallelism's boxes) meshes of gloo ranks, each route forced and the
route the exchange chooses, in a float32 and a bfloat16 wire, with and without a row state and flags:
every rank must get exactly its piece of every update, its rows' state and the flags' maximum, and
the bytes counted for each collective must be
:func:`dmuon.costmodel.traffic.owner_exchange_collectives`' with the same route.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from dmuon.comm.exchange import ShardExchange
from dmuon.comm.stats import CommStats
from dmuon.comm.tests.exchange_cases import (
    BLOCKS, OWNERS, SHAPES, _bytes_by_level, _members, _row_state, _rows, _tp_pieces, _update)
from dmuon.comm.topology import from_mesh
from dmuon.costmodel.traffic import owner_exchange_collectives
from dmuon.plan.plan import MatrixInfo, row_pieces
from dmuon.plan.publication import ROUTES
from support.spawn import run_distributed

# Its point is stream order (the update return's hops on dmuon's streams): every rank runs under the stream checker.
pytestmark = pytest.mark.streams

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
    out: dict = {"plan_rank": topo.rank, "position": topo.position, "runs": {}}
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
        rank, s = res["plan_rank"], res["position"][1]
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
