"""The whole step's figures: the replicate all-reduce, the HSDP designs and the step's collectives, by hand
and against the exchange's own figures."""

from __future__ import annotations

import math
import random

import pytest

from dmuon.costmodel.traffic import (
    HSDP_DESIGNS,
    STEP_STRATEGIES,
    AlphaBeta,
    RankTraffic,
    compare_hsdp_designs,
    fsdp2_traffic,
    hsdp_design_traffic,
    level_figures,
    owner_traffic,
    owner_traffic_column_reduce,
    replicate_all_reduce_traffic,
    step_collectives,
    step_comm,
    step_figures,
)

from ._helpers import summed_per_rank


def _ring_all_reduce(replicate: int, shard: int, numel: int, elem_bytes: int) -> list[RankTraffic]:
    """A ring all-reduce of each rank's numel / S shard across the R ranks of its column,
    chunk by chunk: R-1 reduce-scatter steps, then R-1 all-gather steps."""
    out = [RankTraffic() for _ in range(replicate * shard)]
    chunk = numel // shard // replicate
    for s in range(shard):
        for _ in range(2 * (replicate - 1)):
            for r in range(replicate):
                out[r * shard + s].inter_sent += chunk * elem_bytes
                out[(r + 1) % replicate * shard + s].inter_received += chunk * elem_bytes
    return out


def test_replicate_all_reduce_is_fsdp2s_inter_level_and_a_ring():
    numels = [64 * 64, 32 * 64]
    for replicate, shard in [(2, 4), (4, 8), (8, 2), (1, 4)]:
        ar = replicate_all_reduce_traffic(numels, replicate, shard)
        f = fsdp2_traffic(numels, replicate, shard)
        assert (ar.inter_sent, ar.inter_received) == (f.inter_sent, f.inter_received)
        assert ar.intra_sent == ar.intra_received == 0
        assert [ar] * (replicate * shard) == _ring_all_reduce(replicate, shard, sum(numels), 4)


@pytest.mark.parametrize("replicate,shard", [(4, 8), (2, 4), (8, 8), (3, 2)])
def test_design_totals_for_one_evenly_divisible_matrix(replicate, shard):
    # M elements, divisible by S * R: every figure is exact.
    rows, cols = 8 * 3 * 8, 8 * 3 * 8
    m = rows * cols
    r1 = replicate - 1
    figs = compare_hsdp_designs([(rows, cols)], [shard + 1], replicate, shard)
    inter = {k: figs[k]["inter"] for k in HSDP_DESIGNS}
    # (i) each of the S columns ring-all-reduces M/S fp32 elements over R ranks.
    assert inter["fsdp2_adamw"]["total"] == 2 * r1 * m * 4
    # (ii) native HSDP: that, plus the bf16 update once to every other replica, plus the
    # direction's column slices (1/R of it per other replica) to the owner's replica.
    assert inter["a"]["total"] == 2 * r1 * m * 4 + r1 * m * 2 + r1 * (m // replicate) * 2
    # (iii) the replicate level: the fp32 gradient's column slices reduce-scattered across replicas ((R-1)/R
    # of each rank's M/S from each of the R S ranks), plus (a)'s direction slices and update.
    assert inter["b"]["total"] == r1 * m * 4 + r1 * m * 2 + r1 * (m // replicate) * 2
    # Per element 8, 10 + 2/R and 6 + 2/R bytes per other replica.
    assert [inter[k]["total"] / (r1 * m) for k in HSDP_DESIGNS] == [8, 10 + 2 / replicate, 6 + 2 / replicate]
    # Critical paths: the all-reduce is 2 (R-1)/R of a column's M/S each way on every rank;
    # (a) adds the publication, where the owner's replica sends most: with R = 2 directly its
    # M/S once; with R >= 3 by the scatter route (one matrix: its owner's replica would send it
    # R-1 times directly), (R-1)/R of M/S in the scatter and as much in the all-gather, which is
    # more than another rank's M/S received. (b)'s replaces the all-reduce by the reduce-scatter,
    # (R-1)/R of M/S each way.
    ar = 2 * r1 * (m // shard) // replicate * 4
    published = 2 * r1 * (m // shard) // replicate * 2
    assert inter["fsdp2_adamw"]["critical"] == ar
    assert inter["a"]["critical"] == ar + published
    assert inter["b"]["critical"] == ar // 2 + published
    # The shard level: (a) and (b) both add dmuon's exchange to FSDP2's within-replica collectives.
    assert figs["a"]["intra"] == figs["b"]["intra"]
    assert figs["a"]["intra"]["total"] - figs["fsdp2_adamw"]["intra"]["total"] == 2 * (m - m // shard) * 2
    # No non-Muon parameters: the whole model is the matrices.
    assert figs["non_muon_all_reduce"] == {"total": 0, "critical": 0}
    assert all(figs[k]["inter_whole_model"] == figs[k]["inter"] for k in HSDP_DESIGNS)


def test_design_hand_numbers():
    # One 64 x 64 matrix on a 4 x 8 mesh, owner (1, 1): M = 4096, M / S = 512.
    figs = compare_hsdp_designs([(64, 64)], [9], 4, 8, other_numels=[1024, 3072])
    assert figs["fsdp2_adamw"]["inter"] == {"total": 98304, "critical": 3072}
    # (a): FSDP2's 98304, the update to 3 replicas (3 * 4096 * 2) and the 3 other replicas'
    # column slices of the direction (3 * 1024 * 2). One matrix on 4 replicas takes the scatter
    # route: the owner's replica sends 3 of its 4 column slices (3 * 128 * 2 a rank) in the
    # scatter and its own slice to the 3 others (as much) in the all-gather, 3072 + 1536 in all.
    assert figs["a"]["inter"] == {"total": 98304 + 24576 + 6144, "critical": 3072 + 1536}
    # (b): the column reduce-scatter (3 * 4096 * 4), (a)'s update copies and direction slices.
    assert figs["b"]["inter"] == {"total": 49152 + 24576 + 6144, "critical": 1536 + 1536}
    # 4096 non-Muon elements all-reduced alike under every design: 2 * 3 * 4096 * 4 in all, 3072 a rank.
    assert figs["non_muon_all_reduce"] == {"total": 98304, "critical": 3072}
    assert figs["b"]["inter_whole_model"] == {"total": 79872 + 98304, "critical": 3072 + 3072}
    # Per rank, 512 elements of the matrix, 128 in each column slice: every rank sends its 3 other
    # slices of the fp32 gradient (3 * 128 * 4) and receives 3 copies of its own (1536 each way);
    # the owner's replica receives 3 bf16 direction slices (3 * 128 * 2) and sends 3 slices of the
    # update in the scatter and its own to 3 replicas in the all-gather (768 + 768); the other
    # replicas send one direction slice (256) and their update slice to the 2 replicas other than
    # the owner's (512), and receive their slice (256) and the 3 others (768).
    b = hsdp_design_traffic([(64, 64)], [9], 4, 8)["b"]
    assert {(x.inter_sent, x.inter_received) for x in b[8:16]} == {(1536 + 768 + 768, 1536 + 768)}
    assert {(x.inter_sent, x.inter_received) for x in b[:8] + b[16:]} == {(1536 + 256 + 512, 1536 + 256 + 768)}


def test_design_traffic_is_fsdp2_plus_the_exchange():
    rng = random.Random(2)
    for _ in range(40):
        replicate, shard = rng.randint(1, 4), rng.randint(1, 4)
        shapes = [(rng.randint(1, 20), rng.randint(1, 20)) for _ in range(rng.randint(1, 5))]
        owners = [rng.randrange(replicate * shard) for _ in shapes]
        reshard = rng.random() < 0.5
        d = hsdp_design_traffic(shapes, owners, replicate, shard, 2, 4, reshard)
        f = fsdp2_traffic([math.prod(s) for s in shapes], replicate, shard, 4, reshard)
        a = owner_traffic(shapes, owners, replicate, shard, 2)
        b = owner_traffic_column_reduce(shapes, owners, replicate, shard, 2, 4)
        assert d["fsdp2_adamw"] == [f] * (replicate * shard)
        for k, x in enumerate(d["a"]):
            assert x == RankTraffic(f.intra_sent + a[k].intra_sent, f.intra_received + a[k].intra_received,
                                    f.inter_sent + a[k].inter_sent, f.inter_received + a[k].inter_received)
        for k, x in enumerate(d["b"]):
            assert x == RankTraffic(f.intra_sent + b[k].intra_sent, f.intra_received + b[k].intra_received,
                                    b[k].inter_sent, b[k].inter_received)
        for name in HSDP_DESIGNS:
            for level in ("intra", "inter"):
                fig = level_figures(d[name], level)
                assert fig["total"] == sum(getattr(x, f"{level}_received") for x in d[name])
        # One replica: nothing crosses nodes under any design, and (a) and (b) coincide.
        if replicate == 1:
            assert d["a"] == d["b"]
            assert all(level_figures(d[n], "inter") == {"total": 0, "critical": 0} for n in HSDP_DESIGNS)


def test_bad_input_is_rejected():
    with pytest.raises(ValueError, match="owner 4 outside"):
        owner_traffic([(2, 2)], [4], 2, 2)
    with pytest.raises(ValueError, match="1 shapes but 2 owners"):
        owner_traffic([(2, 2)], [0, 1], 1, 2)
    with pytest.raises(ValueError, match="elem_bytes"):
        owner_traffic([(2, 2)], [0], 1, 2, elem_bytes=0)
    with pytest.raises(ValueError, match="owner 4 outside"):
        owner_traffic_column_reduce([(2, 2)], [4], 2, 2)
    with pytest.raises(ValueError, match="grad_bytes"):
        owner_traffic_column_reduce([(2, 2)], [0], 1, 2, grad_bytes=0)
    with pytest.raises(ValueError, match="piece lists"):
        owner_traffic([(2, 2)], [0], 1, 2, pieces=[])
    with pytest.raises(ValueError, match="level must be"):
        level_figures([RankTraffic()], "both")


# ------------------------------------------------------------ one step, per collective

def _per_collective(strategy, *args, **kw):
    return [(c.op, c.level, c.critical) for c in step_collectives(strategy, *args, **kw)]


def test_step_collectives_by_hand_on_two_ranks():
    # A (4x3) owned by rank 0 in block 1, B (3x2) by rank 1 in block 2; rows A [2, 2], B [2, 1].
    shapes, owners, blocks = [(4, 3), (3, 2)], [0, 1], [1, 2]
    args = (shapes, owners, blocks, 1, 2)
    # FSDP2 pads each shard to ceil(m/S) rows: A 6 elements, B 4; a ring over 2 ranks moves one shard each way.
    fsdp = [("all_gather", "intra", 12), ("all_gather", "intra", 8),        # forward, bf16
            ("all_gather", "intra", 8), ("reduce_scatter", "intra", 16),    # backward block 2 (fp32 reduce)
            ("all_gather", "intra", 12), ("reduce_scatter", "intra", 24)]   # backward block 1
    assert _per_collective("fsdp_adamw", *args, zero=3) == fsdp
    # dmuon: B's row shard of rank 0 (2 rows x 2 x 2 bytes) after block 2, A's of rank 1 (2 x 3 x 2) after
    # block 1, then one return of every matrix: the owner of A sends 12 bytes, the owner of B 8; max(12, 8).
    assert _per_collective("dmuon", *args, zero=3) == [
        *fsdp[:4], ("all_to_all", "intra", 8), *fsdp[4:], ("all_to_all", "intra", 12), ("all_to_all", "intra", 12)]
    # Gather-then-compute: one all-gather of each direction in the wire dtype.
    assert _per_collective("gather", *args, zero=3) == fsdp + [("all_gather", "intra", 12), ("all_gather", "intra", 8)]
    # ZeRO-2: no backward all-gather.
    assert _per_collective("fsdp_adamw", *args, zero=2) == [fsdp[k] for k in (0, 1, 3, 5)]
    # Per rank, the larger of sent and received (not their sum): the return sends 12 and receives 8 on rank 0.
    ret = step_collectives("dmuon", *args)[-1]
    assert ret.ranks == [(12, 8), (8, 12)] and ret.critical == 12
    figures = step_comm(*args, zero=3, model=AlphaBeta(intra_bandwidth=4, intra_latency=1))
    assert figures["fsdp_adamw"]["critical_bytes"] == {"total": 80, "intra": 80, "inter": 0}
    assert figures["dmuon"]["critical_bytes"] == {"total": 112, "intra": 112, "inter": 0}
    assert figures["gather"]["critical_bytes"] == {"total": 100, "intra": 100, "inter": 0}
    # One message per collective here: seconds = collectives x 1 + bytes / 4.
    assert figures["fsdp_adamw"]["seconds"]["total"] == pytest.approx(6 + 80 / 4)
    assert figures["dmuon"]["seconds"]["total"] == pytest.approx(9 + 112 / 4)
    assert figures["gather"]["seconds"]["total"] == pytest.approx(8 + 100 / 4)
    assert figures["dmuon"]["collectives"] == {"total": 9, "intra": 9, "inter": 0}
    # One replica: dmuon's two designs issue the same collectives.
    assert figures["dmuon_native_hsdp"] == figures["dmuon"]
    for zero in (2, 3):
        assert step_collectives("dmuon_native_hsdp", *args, zero=zero) == step_collectives("dmuon", *args, zero=zero)


def test_step_collectives_by_hand_on_a_two_by_two_mesh():
    # One 4x3 matrix owned by plan rank 3 = (replica 1, column 1); 2 rows (12 bf16 bytes) per column.
    args = ([(4, 3)], [3], [1], 2, 2)
    fsdp = [("all_gather", "intra", 12), ("reduce_scatter", "intra", 24),
            ("all_reduce", "inter", 24)]  # ring over 2 replicas: 2 (R-1)/R of the 24-byte fp32 shard
    assert _per_collective("fsdp_adamw", *args, zero=2) == fsdp
    # native HSDP: FSDP2's all-reduce, then dmuon's exchange.
    dm = step_collectives("dmuon_native_hsdp", *args, zero=2)
    assert [(c.op, c.level, c.critical) for c in dm] == [
        *fsdp, ("all_to_all", "inter", 8), ("all_to_all", "intra", 12), ("all_to_all", "intra", 12),
        ("all_to_all", "inter", 12)]
    slices, directions, back, forward = dm[3:]
    # Replica 0 keeps the momentum of columns [0, 2) of its rows: 2 rows x 2 columns, 8 bytes
    # per rank, go to the same column of replica 1; replica 1 keeps column 2 and sends nothing.
    assert slices.ranks == [(8, 0), (8, 0), (0, 8), (0, 8)]
    # Only the owner's replica takes part in the shard-level exchanges.
    assert directions.ranks == [None, None, (12, 0), (0, 12)]
    assert back.ranks == [None, None, (0, 12), (12, 0)]
    # Each column of replica 1 forwards its rows to the same column of replica 0.
    assert forward.ranks == [(0, 12), (0, 12), (12, 0), (12, 0)]
    assert _per_collective("gather", *args, zero=2) == fsdp + [("all_gather", "intra", 12)]
    model = AlphaBeta(intra_bandwidth=12, inter_bandwidth=6, intra_latency=0.5, inter_latency=2)
    figures = step_comm(*args, zero=2, model=model)
    assert figures["fsdp_adamw"]["critical_bytes"] == {"total": 60, "intra": 36, "inter": 24}
    assert figures["dmuon_native_hsdp"]["critical_bytes"] == {"total": 104, "intra": 60, "inter": 44}
    assert figures["gather"]["critical_bytes"] == {"total": 72, "intra": 48, "inter": 24}
    # AG 0.5 + 12/12, RS 0.5 + 24/12, AR 2 x 2 + 24/6.
    assert figures["fsdp_adamw"]["seconds"]["intra"] == pytest.approx(1.5 + 2.5)
    assert figures["fsdp_adamw"]["seconds"]["inter"] == pytest.approx(4 + 4)
    # dmuon adds two one-peer intra exchanges (0.5 + 1 each) and two inter (2 + 8/6, 2 + 2).
    assert figures["dmuon_native_hsdp"]["seconds"]["total"] == pytest.approx(12 + 3 + (2 + 8 / 6) + 4)
    # the replicate level: no all-reduce; the fp32 gradient's column slices cross instead. Each rank of
    # replica 0 holds 2 rows x 3 columns, keeps columns [0, 2) and sends column 2 (2 x 1 x 4 = 8
    # bytes) to replica 1, from which it receives 2 x 2 x 4 = 16; replica 1 the other way round.
    db = step_collectives("dmuon", *args, zero=2)
    assert [(c.op, c.level, c.critical) for c in db] == [
        *fsdp[:2], ("all_to_all", "inter", 16), ("all_to_all", "inter", 8), ("all_to_all", "intra", 12),
        ("all_to_all", "intra", 12), ("all_to_all", "inter", 12)]
    assert db[2].ranks == [(8, 16), (8, 16), (16, 8), (16, 8)] and db[2].messages == 1
    assert db[2].label == "dmuon gradient columns block 1"
    assert [c.ranks for c in db[3:]] == [c.ranks for c in dm[3:]]
    assert figures["dmuon"]["critical_bytes"] == {"total": 96, "intra": 60, "inter": 36}
    # Intra as (a); inter: the column all_to_all 2 + 16/6, the direction slices 2 + 8/6, the update 2 + 12/6.
    assert figures["dmuon"]["seconds"]["intra"] == pytest.approx(figures["dmuon_native_hsdp"]["seconds"]["intra"])
    assert figures["dmuon"]["seconds"]["inter"] == pytest.approx(6 + 36 / 6)


def test_ring_all_gather_counts_n_times_s_minus_one_over_s():
    (ag,) = step_collectives("fsdp_adamw", [(8, 5)], [0], [1], 1, 4, zero=2)[:1]
    assert ag.critical == 80 * 3 // 4 and ag.messages == 3
    # Uneven rows move FSDP2's padded shards: 5 rows over 4 ranks pad to 2 rows each.
    (ag,) = step_collectives("fsdp_adamw", [(5, 5)], [0], [1], 1, 4, zero=2)[:1]
    assert ag.critical == 3 * 2 * 5 * 2


def test_step_exchange_sums_to_owner_traffic():
    rng = random.Random(3)
    for replicate, shard in [(1, 3), (2, 3), (3, 2), (2, 2)]:
        shapes = [(rng.randint(1, 9), rng.randint(1, 5)) for _ in range(7)]
        owners = [rng.randrange(replicate * shard) for _ in shapes]
        blocks = [rng.randrange(3) for _ in shapes]
        for strategy, per_rank in (("dmuon_native_hsdp", owner_traffic(shapes, owners, replicate, shard, 2)),
                                   ("dmuon", owner_traffic_column_reduce(shapes, owners, replicate, shard, 2, 4))):
            collectives = [c for c in step_collectives(strategy, shapes, owners, blocks, replicate, shard,
                                                       reduce_bytes=4) if c.op == "all_to_all"]
            assert summed_per_rank(collectives, replicate * shard) == per_rank, (strategy, replicate, shard)
            # the replicate level has no replicate all-reduce; native HSDP one per block (FSDP2's).
            reduces = [c for c in step_collectives(strategy, shapes, owners, blocks, replicate, shard)
                       if c.op == "all_reduce"]
            assert len(reduces) == (0 if strategy == "dmuon" or replicate == 1 else len(set(blocks)))


def test_step_strategies_and_step_comm_keys():
    import json
    assert STEP_STRATEGIES == ("dmuon", "dmuon_native_hsdp", "fsdp_adamw", "gather")
    shapes, owners, blocks = [(5, 7), (6, 4, 3)], [1, 2], [1, 2]
    for replicate, shard in [(1, 4), (2, 2)]:
        comm = json.loads(json.dumps(step_comm(shapes, owners, blocks, replicate, shard)))
        assert set(comm) == set(STEP_STRATEGIES)
        assert all(set(comm[k]) == {"critical_bytes", "seconds", "collectives"} for k in comm)
        if replicate == 1:
            assert comm["dmuon"] == comm["dmuon_native_hsdp"]
        else:
            # the replicate level trades FSDP2's all-reduce (2 (R-1) ring steps a block) for one all_to_all a
            # block, which carries the block before's hop A: one collective fewer a block but the first.
            a, b = comm["dmuon_native_hsdp"], comm["dmuon"]
            assert b["collectives"]["total"] == a["collectives"]["total"] - (len(set(blocks)) - 1)
            assert b["critical_bytes"]["intra"] == a["critical_bytes"]["intra"]
            assert b["critical_bytes"]["inter"] < a["critical_bytes"]["inter"]


def test_step_model_rejects_bad_input():
    with pytest.raises(ValueError):
        step_collectives("adam", [(2, 2)], [0], [0], 1, 2)
    with pytest.raises(ValueError):
        step_collectives("dmuon", [(2, 2)], [0], [0, 1], 1, 2)
    with pytest.raises(ValueError):
        AlphaBeta(intra_bandwidth=0)
    assert step_figures([])["critical_bytes"]["total"] == 0


def test_ddp_hops_take_the_route_with_the_fewer_bytes_through_the_busiest_rank():
    """dmuon under torch's DDP: per wave, a padded all-gather ((N-1) x the largest share through every rank) or
    the scatter (an all-to-all evening the updates into ceil(total/N) chunks, then their all-gather), whichever
    moves less through the busiest rank; from shapes and owners, by formulas written here."""
    from dmuon.costmodel.traffic import ddp_collectives, ddp_hops, scatter_parts

    assert ddp_hops([5, 5, 5, 5], 1) == ("all_gather", [[(15, 15)] * 4])
    # 20 elements in chunks of 5: owner 0's 12 fill chunks 0, 1 and 2 of 3; owners 1 and 2 the rest.
    parts, chunk = scatter_parts([12, 4, 4, 0])
    assert chunk == 5 and parts == [[5, 5, 2, 0], [0, 0, 3, 1], [0, 0, 0, 4], [0, 0, 0, 0]]
    route, hops = ddp_hops([12, 4, 4, 0], 1)
    assert route == "scatter"  # padded: 3 x 12 = 36 through every rank; scattered: at most 7 + 15 = 22
    assert hops[0] == [(7, 0), (4, 5), (4, 5), (0, 5)] and hops[1] == [(15, 15)] * 4
    shapes, owners = [(4, 3), (4, 3), (2, 3), (2, 3)], [0, 1, 0, 1]  # shares 18 and 18 elements
    assert ddp_collectives(shapes, owners, 2, elem_bytes=2) == [(36, 36)]
    shapes, owners = [(8, 8), (2, 2), (1, 3)], [0, 1, 2]  # shares 64, 4, 3 on 3 ranks
    route, hops = ddp_hops([64, 4, 3], 2)
    assert route == "scatter"
    for rank in range(3):
        assert ddp_collectives(shapes, owners, 3, elem_bytes=2, rank=rank) == [h[rank] for h in hops]
        assert hops[1][rank] == (2 * 24 * 2, 2 * 24 * 2)  # chunks of ceil(71 / 3) = 24, from two peers
    assert ddp_collectives(shapes, owners, 1) == []
