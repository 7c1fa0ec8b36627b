"""Selection, balancing and the plan table (single process, no process group)."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

import dmuon
from dmuon.plan.balance import lpt, rank_loads, round_robin
from dmuon.plan.cost import ns_flops

from ._balancing import assign_owners, kinds_from_costs
from ._models import OddNet


class TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.proj = nn.Linear(6, 6)
        self.out = nn.Linear(6, 11, bias=False)
        self.out.weight = self.embed.weight  # tied head under a non-standard name
        self.lm_head = nn.Linear(6, 11)


def test_default_selection_excludes_embeddings_heads_and_vectors():
    torch.manual_seed(0)
    model = OddNet()
    names = [i.name for i in dmuon.prepare(model).infos]
    assert "embed.weight" not in names and "head.weight" not in names
    assert "conv.weight" in names and "gate.weight" in names and "lift.weight" in names
    assert all(not n.endswith(("bias", "norm.weight")) for n in names)
    assert len(names) == 12
    tied = dmuon.prepare(TiedLM())
    assert [i.name for i in tied.infos] == ["proj.weight"]


def test_select_override_and_errors():
    model = OddNet()
    plan = dmuon.prepare(model, select=lambda n, p: n == "head.weight")
    assert [i.name for i in plan.infos] == ["head.weight"]
    with pytest.raises(ValueError, match="layers.0.up.bias"):
        dmuon.prepare(OddNet(), select=lambda n, p: n == "layers.0.up.bias")
    with pytest.raises(ValueError, match="balancer"):
        dmuon.prepare(OddNet(), balancer="magic")


def test_complex_parameter_is_named():
    model = nn.Sequential(nn.Linear(3, 3))
    model[0].weight = nn.Parameter(torch.randn(3, 3, dtype=torch.complex64))
    with pytest.raises(ValueError, match="0.weight"):
        dmuon.prepare(model)


def test_single_process_plan_is_one_block_with_whole_rows():
    plan = dmuon.prepare(OddNet())
    assert [b.name for b in plan.blocks] == [""] and plan.world_size == 1
    assert all(i.block == 0 and i.rows == (i.shape[0],) for i in plan.infos)


def test_frozen_matrices_are_not_muon_matrices():
    model = OddNet()
    model.layers[1].requires_grad_(False)
    names = [i.name for i in dmuon.prepare(model).infos]
    assert len(names) == 9 and not any(n.startswith("layers.1.") for n in names)


@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
def test_lpt_is_close_to_brute_force(world_size):
    costs = [9.0, 7.0, 6.0, 5.0, 5.0, 4.0, 3.0, 1.0]
    best = min(
        max(rank_loads(costs, owners, world_size))
        for owners in itertools.product(range(world_size), repeat=len(costs))
    ) if world_size <= 3 else max(max(costs), sum(costs) / world_size)
    got = max(rank_loads(costs, lpt(costs, world_size), world_size))
    # Graham's bound for LPT: at most 4/3 - 1/(3m) of the optimum.
    assert got <= (4 / 3 - 1 / (3 * world_size)) * best + 1e-9
    assert got >= best - 1e-9


def test_assignment_is_deterministic_and_complete():
    costs = [ns_flops((m, n)) for m, n in [(37, 91), (91, 200), (200, 37), (1, 37), (37, 1)] * 3]
    for balancer in ("greedy", "round_robin"):
        owners = assign_owners(costs, 4, balancer)
        assert owners == assign_owners(list(costs), 4, balancer)
        assert len(owners) == len(costs) and set(owners) <= set(range(4))
    assert round_robin(costs, 4) == [i % 4 for i in range(len(costs))]


def test_plan_table_and_owner_lookup():
    plan = dmuon.prepare(OddNet())
    text = str(plan)
    assert "layers.1.mid.weight" in text and "200x91" in text and "imbalance" in text
    assert plan.owner("layers.1.mid.weight") == 0
    with pytest.raises(ValueError, match="embed.weight"):
        plan.owner("embed.weight")
    assert sum(plan.rank_costs()) == pytest.approx(sum(i.cost for i in plan.infos))
    assert plan.params == {i.param for i in plan.infos}


def test_owners_spread_over_replicas_keep_every_load():
    from dmuon.plan.balance import balance, spread_over_replicas

    costs = [9.0, 7.0, 6.0, 5.0, 5.0]  # fewer matrices than the 2 x 4 ranks
    kinds, items = kinds_from_costs(costs)
    plain = balance(kinds, items, 8, "lpt")
    spread = spread_over_replicas(balance(kinds, items, 8, "lpt"), replicate=2)
    assert sorted(spread.loads) == sorted(plain.loads)
    for before, after in zip(plain.owners, spread.owners):
        assert spread.loads[after] == plain.loads[before]
        assert spread.batches[after] == plain.batches[before]
    # Ranks r * 4 + s: the owners now sit in both replicas, not only in replica 0.
    assert {o // 4 for o in plain.owners} == {0, 1} or max(plain.owners) < 4
    assert {o // 4 for o in spread.owners} == {0, 1}
    assert spread_over_replicas(balance(kinds, items, 8, "lpt"), replicate=1).owners == plain.owners
