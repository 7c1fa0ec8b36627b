"""Routed experts in the step model (:mod:`dmuon.costmodel.moe`): layout, bytes, owners, the CLI."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from dmuon.bench import plan_cli
from dmuon.bench.shapes import MatrixShape
from dmuon.costmodel.moe import ExpertLayout, expert_fsdp2_collective
from dmuon.plan.holders import prefer_holders
from dmuon.costmodel.offline import expand, plan_offline, step_inputs
from dmuon.costmodel.rank_traffic import owner_traffic
from dmuon.costmodel.sim_config import HARDWARE_PRESETS, SimOptions
from dmuon.costmodel.simulate import simulate


def test_uneven_experts_over_ep_split_rows_over_efsdp():
    # 4 ranks, ep 2, 3 experts: torch.chunk gives ep rank 0 experts 0-1 and ep rank 1 expert 2; efsdp 2 x ep 2 > 3,
    # so each expert's rows split over its ep rank's efsdp group (positions f * ep + j).
    layout = ExpertLayout(ep=2, shard=4)
    assert not layout.whole_experts(3)
    assert [layout.holders((4, 6), 3, e) for e in range(3)] == [[0, 2], [0, 2], [1, 3]]
    pieces = layout.slice_pieces((4, 6), 3, 0)
    assert [(p.row, p.rows) for p in pieces] == [(0, 2), (0, 0), (2, 2), (0, 0)]


def test_whole_experts_sit_on_one_rank_each():
    layout = ExpertLayout(ep=2, shard=8)  # efsdp 4 x ep 2 <= 8 experts: dim 0, one expert per rank
    assert layout.whole_experts(8)
    assert [layout.holders((4, 6), 8, e) for e in range(8)] == [[0], [2], [4], [6], [1], [3], [5], [7]]
    assert layout.slice_pieces((4, 6), 8, 5)[3].rows == 4


def test_bad_ep_names_the_option():
    with pytest.raises(ValueError, match="--ep"):
        ExpertLayout(ep=3, shard=4)


def test_expert_exchange_bytes_match_the_hand_count():
    # Slices (4, 6) of 3 experts on 4 ranks (ep 2): each holder has 2 rows x 6 columns, 24 bytes in bf16.
    # Expert 0 (held by 0 and 2) owned by rank 1, which holds none of it: both holders send their 24 bytes there
    # and get 24 back. Expert 1 (held by 0 and 2) owned by rank 0: only rank 2's rows move. Expert 2 (held by
    # 1 and 3) owned by rank 3: only rank 1's rows move.
    layout = ExpertLayout(ep=2, shard=4)
    shape, piece = (4, 6), 2 * 6 * 2
    pieces = [layout.slice_pieces(shape, 3, e) for e in range(3)]
    traffic = owner_traffic([shape] * 3, [1, 0, 3], 1, 4, 2, pieces=pieces)
    assert [(t.intra_sent, t.intra_received) for t in traffic] == [
        (2 * piece, 2 * piece),  # rank 0: its rows of expert 0 out and back; expert 1's from rank 2 in and out
        (2 * piece + piece, 2 * piece + piece),  # rank 1: owns expert 0 (two pieces), sends its rows of expert 2
        (2 * piece, 2 * piece),  # rank 2: its rows of experts 0 and 1
        (piece, piece),  # rank 3: owns expert 2, rank 1's rows in, their update out
    ]
    assert all(t.inter_sent == t.inter_received == 0 for t in traffic)


def test_expert_fsdp2_collective_is_a_ring_over_each_efsdp_group():
    # Same 4-rank layout, fp32: positions 0 and 2 hold 2 rows of experts 0 and 1 (24 elements), positions 1 and 3
    # 2 rows of expert 2 (12); one ring step of the group's padded shard each way.
    layout = ExpertLayout(ep=2, shard=4)
    pieces = [layout.slice_pieces((4, 6), 3, e) for e in range(3)]
    c = expert_fsdp2_collective("all_gather", pieces, layout, 1, phase="forward", block=1, elem_bytes=4)
    assert c.ranks == [(96, 96), (48, 48), (96, 96), (48, 48)] and c.messages == 1
    # Two replicas: the all-reduce moves 2 (R-1)/R of the same shard, across replicas.
    c = expert_fsdp2_collective("all_reduce", pieces, layout, 2, phase="backward", block=1, elem_bytes=4)
    assert c.level == "inter" and c.ranks[:4] == [(96, 96), (48, 48), (96, 96), (48, 48)] and c.messages == 2


def test_prefer_holders_keeps_every_ranks_count_per_kind():
    owners = [0, 0, 1, 1, 2, 3]
    kinds = [0, 0, 0, 0, 0, 1]
    holders = [[1], [1], [0], None, [2], None]
    moved = prefer_holders(owners, kinds, holders)
    assert Counter(zip(moved, kinds)) == Counter(zip(owners, kinds))
    # Every slice on its holder; the dense matrix 3 takes the place left on rank 0.
    assert moved == [1, 1, 0, 0, 2, 3]
    # Rank 1 given room for one of the two slices it holds: the other goes where there is room.
    moved = prefer_holders([0, 1, 2, 2], [0, 0, 0, 0], [[1], [1], None, None])
    assert sorted(moved) == [0, 1, 2, 2] and moved[0] == 1 and moved[1] != 1


def _tiny_moe(experts: int = 16) -> list[MatrixShape]:
    return [
        MatrixShape("embed", (64, 32), 1, muon=False),
        MatrixShape("layers.*.attn", (32, 32), 3),
        MatrixShape("layers.*.mlp", (64, 32), 1),
        MatrixShape("layers.*.experts.w1", (16, 32), 2, experts=experts, experts_per_token=2, first_layer=1),
        MatrixShape("layers.*.experts.w2", (32, 16), 2, experts=experts, experts_per_token=2, first_layer=1),
    ]


@pytest.mark.parametrize("ranks_per_node", [None, 4])
def test_every_expert_slice_owned_once_and_spread_over_every_rank(ranks_per_node):
    groups = _tiny_moe()
    plan = plan_offline(groups, 8, ep=2, ranks_per_node=ranks_per_node)
    owned = [name for r in plan["ranks"] for name in r["matrices"]]
    slices = [m.name for m in expand(groups) if m.expert is not None]
    assert len(slices) == 2 * 2 * 16
    assert Counter(owned) == Counter(m.name for m in expand(groups))
    x = plan["experts"]
    assert x["slices"] == len(slices) and min(x["slices_per_rank"]) > 0
    assert sum(x["slices_per_rank"]) + sum(x["dense_per_rank"]) == len(owned)


def test_expert_blocks_follow_first_layer():
    mats = expand(_tiny_moe())
    from dmuon.costmodel.offline import offline_blocks
    blocks = dict(zip((m.name for m in mats), offline_blocks(mats)))
    assert blocks["layers.*.mlp"] == blocks["layers.*.attn[0]"]
    assert blocks["layers.*.experts.w1[1][0]"] == blocks["layers.*.attn[1]"]
    assert blocks["layers.*.experts.w2[2][15]"] == blocks["layers.*.attn[2]"]


def test_forward_backward_counts_an_expert_at_its_token_share():
    groups = _tiny_moe()
    mats = expand(groups)
    inputs = step_inputs(groups, [0] * len(mats), {0: [list(range(len(mats)))]}, 1, 4, zero=2, ep=2)
    hw = HARDWARE_PRESETS["h100"]
    figures = simulate("fsdp_adamw", inputs, hw, SimOptions(tokens_per_gpu=1000))
    active = sum(m.numel * m.token_share for m in mats) + 64 * 32
    assert figures["compute_seconds"] == pytest.approx(6 * active * 1000 / hw.compute_flops)


def test_plan_cli_moe_presets(tmp_path, capsys):
    out = tmp_path / "plan.json"
    argv = ["--model", "deepseek-v2-lite", "--world-size", "16", "--ranks-per-node", "8", "--ep", "4",
            "--analytical", "--simulate", "--json", str(out)]
    assert plan_cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "routed experts: ep 4 x efsdp 2" in printed and "expert-slice owners: 4992 slices" in printed
    plan = json.loads(out.read_text())
    assert plan["experts"]["ep"] == 4 and "dmuon" in plan["simulation"] and "fsdp_adamw" in plan["simulation"]
    assert plan_cli.main(["--model", "deepseek-v3-12l", "--world-size", "64", "--ranks-per-node", "8", "--ep", "8",
                          "--analytical"]) == 0
    assert "expert-slice owners: 6912 slices over 64 of 64 ranks" in capsys.readouterr().out


@pytest.mark.parametrize("argv, says", [
    (["--model", "deepseek-v2-lite", "--world-size", "16", "--ranks-per-node", "8", "--ep", "3"], "--ep (3) must divide"),
    (["--model", "deepseek-v2-lite", "--world-size", "8", "--ep", "16"], "--ep (16) must divide"),
    (["--model", "qwen2.5-7b", "--world-size", "8", "--ep", "2"], "--ep 2: qwen2.5-7b has no routed experts"),
    (["--model", "deepseek-v2-lite", "--world-size", "16", "--pp", "2"], "--pp: pipeline stages of an MoE model"),
])
def test_plan_cli_bad_ep(argv, says, capsys):
    assert plan_cli.main(argv + ["--analytical"]) == 2
    assert says in capsys.readouterr().err
