"""``recommend``: every candidate's step is the simulation's (checked through ``plan_offline``, which plans and
simulates on its own), the recommendation is the fastest up to the tie rule, and its code and asks."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from dmuon.costmodel.collective import AlphaBeta
from dmuon.costmodel.offline import plan_offline
from dmuon.costmodel.recommend import ASKS, TIE, recommend, recommended_code
from dmuon.costmodel.sim_config import Hardware, SimOptions


@dataclass
class Group:
    name: str
    shape: tuple[int, int]
    count: int = 1
    muon: bool = True


GROUPS = [Group("embed", (64, 32), muon=False), Group("stack.0.attn", (32, 32), 3), Group("stack.0.mlp", (96, 32)),
          Group("stack.1.attn", (32, 32), 3), Group("stack.1.mlp", (96, 32)), Group("norm", (1, 32), muon=False)]
HW = Hardware("test", compute_flops=1e12, ns_flops=2e11, elementwise_bytes=1e11,
              links=AlphaBeta(intra_bandwidth=1e10, inter_bandwidth=1e9, intra_latency=1e-5, inter_latency=2e-5))
OPTIONS = SimOptions(tokens_per_gpu=512)


@pytest.mark.parametrize("world, per_node", [(8, 4), (4, 4)])
def test_every_candidate_is_the_simulated_step(world, per_node):
    rec = recommend(GROUPS, world, per_node, HW, OPTIONS, zero=3, balancers=("greedy", "round_robin"))
    layouts = {"replicate level": 3, "native HSDP": 1} if world > per_node else {"1-D FSDP2": 3}
    assert rec["mesh"] == [world // per_node, per_node]
    assert len(rec["candidates"]) == 2 * sum(layouts.values())
    assert {c["layout"] for c in rec["candidates"]} == set(layouts)
    for balancer in ("greedy", "round_robin"):
        plan = plan_offline(GROUPS, world, balancer, 3, ranks_per_node=per_node, hardware=HW, sim_options=OPTIONS)
        sim = plan["simulation"]
        assert rec["fsdp_adamw"]["step_seconds"] == pytest.approx(sim["fsdp_adamw"]["step_seconds"])
        for c in (c for c in rec["candidates"] if c["balancer"] == balancer):
            assert c["step_seconds"] == pytest.approx(sim[c["strategy"]]["step_seconds"]), c
            assert c["vs_fsdp_adamw"] == pytest.approx(c["step_seconds"] / sim["fsdp_adamw"]["step_seconds"])
            assert c["imbalance"] == pytest.approx(plan["imbalance"])
    steps = [c["step_seconds"] for c in rec["candidates"]]
    assert steps == sorted(steps)
    best = rec["recommended"]
    near = [c for c in rec["candidates"] if c["step_seconds"] <= steps[0] * (1 + TIE)]
    fewest = min(sum(bool(ASKS[(k, c[k])]) for k in ("layout", "execution", "balancer")) for c in near)
    assert best["step_seconds"] <= steps[0] * (1 + TIE)
    assert sum(bool(ASKS[(k, best[k])]) for k in ("layout", "execution", "balancer")) == fewest
    assert set(best["asks"]) == {k for k in ("layout", "execution", "balancer") if ASKS[(k, best[k])]}


def _rec(layout: str, execution: str, balancer: str) -> dict:
    return {"mesh": [4, 8], "zero": 2, "recommended": {"layout": layout, "execution": execution, "balancer": balancer}}


def test_the_code_asks_for_each_choice():
    code = "\n".join(recommended_code(_rec("replicate level", "next_forward", "greedy")))
    assert 'init_device_mesh("cuda", (4, 8), mesh_dim_names=("replicate", "shard"))' in code
    assert 'shard_over = mesh["shard"]' in code and "reshard_after_forward=False" in code
    assert 'dmuon.DMuon(model, hsdp_mesh=mesh, execution=dmuon.ExecutionConfig(apply_updates="next_forward")' in code
    assert "flush_updates()" in ASKS[("execution", "next_forward")]
    code = "\n".join(recommended_code(_rec("native HSDP", "in_step", "milp")))
    assert "shard_over = mesh\n" in code and 'plan = dmuon.prepare(model, balancer="milp")' in code
    assert "dmuon.DMuon(model, plan, lr=" in code and "execution" not in code
    code = "\n".join(recommended_code(_rec("1-D FSDP2", "returns_in_backward", "round_robin")))
    assert 'init_device_mesh("cuda", (32,))' in code  # every rank of the 4 x 8 cluster
    assert "ExecutionConfig(ns_in_backward=True, returns_in_backward=True)" in code


def test_the_code_lays_routed_experts_out_as_torchtitan_does():
    """With routed experts: the dense and expert views of one world mesh, the stacks split whole over ep and
    sharded over efsdp (dim 1 where efsdp * ep exceeds the experts), the experts' gradient divided by every
    data rank, and on the replicate level both views as hsdp_mesh."""
    experts = {"ep": 4, "efsdp": 2, "fsdp_dim": 1, "experts_per_ep_rank": [2, 2, 2, 2]}
    code = "\n".join(recommended_code(_rec("replicate level", "next_forward", "greedy") | {"experts": experts}))
    assert "dense = world._unflatten(0, (4, 8), ('replicate', 'shard'))" in code
    assert "experts = world._unflatten(0, (4, 2, 4), ('replicate', 'efsdp', 'ep'))" in code
    assert 'distribute_tensor(w.data, experts["ep"], [Shard(0)])' in code
    assert 'fully_shard(routed, mesh=experts["efsdp"], shard_placement_fn=lambda p: Shard(1)' in code
    assert "set_gradient_divide_factor(8)" in code and 'fully_shard(block, mesh=dense["shard"]' in code
    assert "dmuon.DMuon(model, hsdp_mesh=(dense, experts), execution=" in code
    code = "\n".join(recommended_code(_rec("native HSDP", "in_step", "milp") | {"experts": experts}))
    assert 'fully_shard(routed, mesh=experts["replicate", "efsdp"]' in code and "set_gradient_divide_factor(32)" in code
    assert "fully_shard(block, mesh=dense," in code and "hsdp_mesh" not in code
    code = "\n".join(recommended_code(_rec("1-D FSDP2", "in_step", "greedy") | {"experts": experts}))
    assert "experts = world._unflatten(0, (8, 4), ('efsdp', 'ep'))" in code and "set_gradient_divide_factor(32)" in code


def test_bad_cluster():
    with pytest.raises(ValueError, match=r"gpus_per_node \(3\) must divide world_size \(8\)"):
        recommend(GROUPS, 8, 3, HW, OPTIONS)
