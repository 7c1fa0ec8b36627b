"""The warm-up's peers (:mod:`dmuon.comm.warm_peers`) against counts made without it, and the warm-up itself.

Two independent counts of who sends to whom: pairs worked out by hand for small plans (the comments
say why each is there), and the step model's collectives (:func:`owner_exchange_collectives`) run on
each matrix alone, where every group of a collective has one sender or one receiver (or, on the
replicate level's gradient columns, every member sends to every other), so the ranks with bytes out
and in name the pairs.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dmuon.comm import topology as topology_module
from dmuon.comm.topology import Topology
from dmuon.comm.warm_peers import exchange_pairs, warm_splits
from dmuon.costmodel.collectives import owner_exchange_collectives
from dmuon.plan.plan import MatrixInfo, Piece, row_pieces

from support.spawn import run_distributed

# Its point is stream order (the warm-up's collectives on the exchange streams): every rank runs under the stream checker.
pytestmark = pytest.mark.streams


def _info(index: int, pieces: tuple[Piece, ...], owner: int, replicate: int = 1) -> MatrixInfo:
    return MatrixInfo(index, f"m{index}", torch.empty(0), (8, 4), 0, owner=owner, pieces=pieces, replicate=replicate)


def _one_d() -> list[MatrixInfo]:
    """4 shard positions. m0: FSDP2's row chunks on every position, owner 1. m1: an expert slice held by
    positions 2 and 3 only, owner 3. m2: a matrix tensor parallelism leaves whole on positions 0 and 1
    (1 holds a copy, which sends nothing), nothing on 2 and 3, owner 2."""
    none = Piece(0, 0, 0, 0)
    return [
        _info(0, row_pieces((8, 4), 4), 1),
        _info(1, (none, none, Piece(0, 4, 0, 4), Piece(4, 4, 0, 4)), 3),
        _info(2, (Piece(0, 8, 0, 4), Piece(0, 8, 0, 4, sends=False), none, none), 2),
    ]


def _hsdp() -> list[MatrixInfo]:
    """2 replicas x 2 positions (plan rank r * 2 + s). m0: row chunks on both positions, owner 1 = (0, 1).
    m1: held by position 1 only, owner 3 = (1, 1)."""
    none = Piece(0, 0, 0, 0)
    return [_info(0, row_pieces((8, 4), 2), 1, replicate=2),
            _info(1, (none, Piece(0, 8, 0, 4)), 3, replicate=2)]


def test_one_d_pairs_by_hand():
    pairs = exchange_pairs(_one_d(), 1, 4)
    # m0: hop B from 0, 2, 3 to its owner 1, hop 1 back; m1: 2 <-> 3; m2: 0 to 2 (1's copy does not
    # send), 2 back to 0 and 1. Positions 0 and 3 share no matrix with the other as owner: no pair.
    assert pairs == {("intra", 0): frozenset({(0, 1), (2, 1), (3, 1), (1, 0), (1, 2), (1, 3),
                                              (2, 3), (3, 2), (0, 2), (2, 0), (2, 1)})}
    assert warm_splits(pairs[("intra", 0)], 4, 0) == ([0, 1, 1, 0], [0, 1, 1, 0])
    assert warm_splits(pairs[("intra", 0)], 4, 3) == ([0, 1, 1, 0], [0, 1, 1, 0])
    # The agreement's flags riding the return go to every member: every pair.
    every = exchange_pairs(_one_d(), 1, 4, agreement_in_returns=True)[("intra", 0)]
    assert len(every) == 12


def test_hsdp_pairs_by_hand():
    pairs = exchange_pairs(_hsdp(), 2, 2)
    # Replica 0 owns m0: hop B 0 -> 1 and hop 1 back. Replica 1's owner of m1 is the only position
    # holding it: its shard group carries nothing. Both columns hold m0 (hop A 1 -> 0, the direct
    # route 0 -> 1); column 1 holds m1 too (hop A 0 -> 1, publication 1 -> 0).
    assert pairs == {("intra", 0): frozenset({(0, 1), (1, 0)}), ("intra", 1): frozenset(),
                     ("inter", 0): frozenset({(1, 0), (0, 1)}), ("inter", 1): frozenset({(0, 1), (1, 0)})}


def _modelled_pairs(infos: list[MatrixInfo], replicate: int, shard: int, gradient_bytes: int | None,
                    publication: str | None) -> dict[tuple[str, int], frozenset]:
    """The pairs the step model's collectives move bytes between, matrix by matrix."""
    out: dict[tuple[str, int], set] = {("intra", r): set() for r in range(replicate)}
    out.update({("inter", s): set() for s in range(shard)} if replicate > 1 else {})
    for info in infos:
        backward, step = owner_exchange_collectives([info.shape], [info.owner], [0], replicate, shard,
                                                    pieces=[info.pieces], gradient_bytes=gradient_bytes,
                                                    publication=publication)
        for c in backward + step:
            assert c.op == "all_to_all"
            for k, entry in enumerate(c.ranks):
                if entry is None:
                    continue
                r, s = divmod(k, shard)
                key, me = (("intra", r), s) if c.level == "intra" else (("inter", s), r)
                members = ([r * shard + t for t in range(shard)] if c.level == "intra"
                           else [q * shard + s for q in range(replicate)])
                if entry[0] == 0:
                    continue
                # This rank sends: to the group's members that receive in this collective.
                for m, other in enumerate(members):
                    if other != k and c.ranks[other] is not None and c.ranks[other][1] > 0:
                        out[key].add((me, m))
    return {k: frozenset(v) for k, v in out.items()}


@pytest.mark.parametrize("case", ["one_d", "hsdp_native", "hsdp_replicate_level"])
def test_pairs_equal_the_step_models(case):
    if case == "one_d":
        infos, replicate, shard, gradient_bytes = _one_d(), 1, 4, None
    else:
        infos, replicate, shard = _hsdp(), 2, 2
        gradient_bytes = 4 if case == "hsdp_replicate_level" else None
    for publication in (["direct", "scatter"] if replicate > 1 else [None]):
        got = exchange_pairs(infos, replicate, shard, replicate_level=gradient_bytes is not None,
                             publication=publication)
        assert got == _modelled_pairs(infos, replicate, shard, gradient_bytes, publication), publication


def test_three_replicas_scatter_adds_the_non_owner_pairs():
    """With R = 3 the scatter route's all-gather runs between the two non-owner replicas; the direct
    route never does: the chosen route is per wave, so both are warmed unless one is forced."""
    infos = [_info(0, row_pieces((8, 6), 1), 0, replicate=3)]  # one position, owner replica 0
    direct = exchange_pairs(infos, 3, 1, publication="direct")[("inter", 0)]
    scatter = exchange_pairs(infos, 3, 1, publication="scatter")[("inter", 0)]
    assert direct == {(1, 0), (2, 0), (0, 1), (0, 2)}
    assert scatter == direct | {(1, 2), (2, 1)}
    assert exchange_pairs(infos, 3, 1)[("inter", 0)] == scatter
    assert scatter == _modelled_pairs(infos, 3, 1, None, "scatter")[("inter", 0)]


class _Group:
    def __init__(self, size: int):
        self.size = size


def test_warm_up_one_collective_per_group(monkeypatch):
    """Each group's op and splits, recorded by a stand-in for torch.distributed: the shard and
    replicate groups an all-to-all with the plan's splits, the mesh group (HSDP: no all-to-all on it)
    and an exchange group without pairs an all-reduce, one-member groups nothing."""
    calls = []
    monkeypatch.setattr(topology_module.dist, "get_world_size", lambda g: g.size)
    monkeypatch.setattr(topology_module.dist, "all_to_all_single",
                        lambda out, inp, out_splits, in_splits, group: calls.append(
                            ("all_to_all", group, list(in_splits), list(out_splits))))
    monkeypatch.setattr(topology_module.dist, "all_reduce", lambda t, group: calls.append(("all_reduce", group)))
    mesh, shard, replicate = _Group(4), _Group(2), _Group(2)
    pairs = exchange_pairs(_hsdp(), 2, 2)
    # Rank 3 = (1, 1): its replica's shard group carries nothing, its column's does.
    topo = Topology(2, 2, 3, shard, replicate, mesh, (0, 1, 2, 3), (mesh, shard, replicate))
    assert topo.warm_up("cpu", pairs) == {"all_to_all": 1, "all_reduce": 2}
    assert calls == [("all_reduce", mesh), ("all_reduce", shard), ("all_to_all", replicate, [1, 0], [1, 0])]
    calls.clear()
    # Without pairs (DDP's runtime): every pair of the exchange group.
    one_d = Topology(1, 4, 2, mesh, None, mesh, (0, 1, 2, 3), (mesh,))
    assert one_d.warm_up("cpu") == {"all_to_all": 1, "all_reduce": 0}
    assert calls == [("all_to_all", mesh, [1, 1, 0, 1], [1, 1, 0, 1])]
    calls.clear()
    assert Topology(1, 1, 0, _Group(1), None, _Group(1), (0,), (_Group(1),)).warm_up("cpu") == \
        {"all_to_all": 0, "all_reduce": 0}
    assert calls == []


def _warm_on_gloo(rank: int, world: int) -> dict:
    """The real collectives on 4 gloo ranks as a 2 x 2 mesh: uneven splits that disagreed between two
    ranks would raise (or hang until the spawn's timeout)."""
    rows = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    cols = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    mesh = dist.new_group([0, 1, 2, 3])
    r, s = divmod(rank, 2)
    topo = Topology(2, 2, rank, rows[r], cols[s], mesh, (0, 1, 2, 3), (mesh, rows[r], cols[s]))
    return topo.warm_up(torch.device("cpu"), exchange_pairs(_hsdp(), 2, 2))


def test_warm_up_runs_on_gloo():
    results = run_distributed(_warm_on_gloo, 4, timeout_s=120)
    # Replica 0's shard group and both columns exchange; replica 1's shard group and the mesh all-reduce.
    assert results == [{"all_to_all": 2, "all_reduce": 1}] * 2 + [{"all_to_all": 1, "all_reduce": 2}] * 2
