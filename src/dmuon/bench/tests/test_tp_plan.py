"""``dmuon bench --tp``: Megatron's split of every workload's blocks, and a TP forward/backward that
equals the plain model's."""

from __future__ import annotations

import pytest
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from dmuon.bench.models.tp_plan import block_tp_plan
from support.spawn import run_distributed

from ._bench_tp_worker import BUILDERS, tp_worker


def test_plan_splits_attention_and_mlp_and_leaves_the_rest():
    import torch

    torch.manual_seed(0)
    block = BUILDERS["qwen2"]().blocks[0]
    plan = block_tp_plan(block, 2)
    assert {n: type(s) for n, s in plan.items()} == {
        "self_attn.q_proj": ColwiseParallel, "self_attn.k_proj": ColwiseParallel, "self_attn.v_proj": ColwiseParallel,
        "self_attn.o_proj": RowwiseParallel, "mlp.gate_proj": ColwiseParallel, "mlp.up_proj": ColwiseParallel,
        "mlp.down_proj": RowwiseParallel}
    # The moe workload's experts are stacked parameters, not Linears: only attention splits.
    moe_block = BUILDERS["moe"]().blocks[0]
    assert sorted(block_tp_plan(moe_block, 2)) == ["self_attn.k_proj", "self_attn.o_proj", "self_attn.q_proj",
                                                   "self_attn.v_proj"]
    with pytest.raises(ValueError, match="--tp 4 does not divide the 2 heads of self_attn.k_proj"):
        block_tp_plan(block, 4)
    assert block_tp_plan(nn.Sequential(nn.Linear(2, 2)), 2) == {}


def test_tp_forward_and_backward_equal_the_plain_model():
    results = run_distributed(tp_worker, 2, tuple(BUILDERS), timeout_s=240)
    for name, got in results[0].items():
        assert got["split"] > 0 and got["dtensors"] > 0, name
        assert abs(got["loss"] - got["ref_loss"]) <= 1e-5 * abs(got["ref_loss"]), (name, got)
        assert got["grad_diff"] <= 1e-5, (name, got)
