"""Checkpoints through torch's own API: DCP saves on one cluster and resumes exactly on another.

The calls are what a user writes for FSDP2 + AdamW, with the default (strict)
options; only the owners of the matrices change between clusters, and they
keep no state.
"""

from __future__ import annotations

import functools

import pytest
import torch

from dmuon.testing import run_distributed
from dmuon.testing.cases import MUON_KW
from dmuon.testing.checkpoint import global_batch, on_4_ranks, resume_and_train
from dmuon.testing.models import OddNet, lm_loss
from dmuon.testing.reference import reference_training

SAVED_AT, MORE = 2, 2
FROZEN = ("layers.1.",)


@pytest.fixture(scope="module")
def saved_on_4_ranks(tmp_path_factory):
    """One 4-rank run: an fp32 checkpoint after SAVED_AT steps (ZeRO-3 style) with rank 0's full
    model state, and the bf16 + frozen block save/continue/resume comparison."""
    directory = tmp_path_factory.mktemp("ckpt")
    out = run_distributed(on_4_ranks, 4, str(directory), SAVED_AT, MORE, FROZEN, timeout_s=120)[0]
    return str(directory / "fp32"), out


@functools.lru_cache(maxsize=1)
def _uninterrupted() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = OddNet()
    batches = [global_batch(s) for s in range(SAVED_AT + MORE)]
    params, _ = reference_training(model, batches, lm_loss, muon_kwargs=MUON_KW,
                                   adamw_kwargs=dict(lr=3e-3, weight_decay=0.01), ns_dtype=torch.float32)
    return params


@pytest.mark.parametrize("world_size,zero,mesh_shape", [(2, 3, None), (3, 2, None), (4, 3, (2, 2))],
                         ids=["2-ranks-zero3", "3-ranks-zero2", "hsdp-2x2"])
def test_resume_on_another_cluster_continues_exactly(saved_on_4_ranks, world_size, zero, mesh_shape):
    path, _ = saved_on_4_ranks
    got = run_distributed(resume_and_train, world_size, path, SAVED_AT, MORE, zero, mesh_shape, timeout_s=120)[0]
    ref = _uninterrupted()
    assert set(got) == set(ref)
    worst = max(ref, key=lambda n: (got[n] - ref[n]).abs().max().item())
    assert (got[worst] - ref[worst]).abs().max().item() <= 1e-5, worst


def test_full_model_state_dict_loads_into_a_plain_model(saved_on_4_ranks):
    out = saved_on_4_ranks[1]["saved"]
    plain = OddNet()
    plain.load_state_dict(out["state"])  # strict: every parameter is there, full-size
    for name, p in plain.named_parameters():
        assert torch.equal(p, out["params"][name]), name


def test_bf16_frozen_block_resumes_as_if_never_saved(saved_on_4_ranks):
    """bf16 MixedPrecisionPolicy, a frozen block: resuming equals continuing without the save/load."""
    out = saved_on_4_ranks[1]["bf16"]
    continued, resumed = out["continued"], out["resumed"]
    worst = max(continued, key=lambda n: (continued[n] - resumed[n]).abs().max().item())
    assert (continued[worst] - resumed[worst]).abs().max().item() <= 1e-6, worst
    # The frozen block stayed put and has no optimizer state; everything else trained and has state.
    for name, value in continued.items():
        if name.startswith(FROZEN):
            assert torch.equal(value, out["initial"][name]), name
            assert name not in out["with_state"], name
        else:
            assert not torch.equal(value, out["initial"][name]), name
            assert name in out["with_state"], name


def test_bf16_parameters_keep_fp32_momentum_across_a_resume():
    import dmuon
    from dmuon.testing.models import odd_batch

    torch.manual_seed(0)
    model = OddNet().to(torch.bfloat16)
    kw = dict(lr=0.02, ns_method="standard", ns_dtype=torch.float32)
    opt = dmuon.DMuon(model, **kw)
    lm_loss(model, odd_batch(0, 0)).backward()
    opt.step()
    resumed = dmuon.DMuon(model, **kw)
    resumed.load_state_dict(opt.state_dict())
    weight = model.layers[0].up.weight
    assert opt.state[weight]["momentum_buffer"].dtype == torch.float32
    assert resumed.state[weight]["momentum_buffer"].dtype == torch.float32
    assert torch.equal(resumed.state[weight]["momentum_buffer"], opt.state[weight]["momentum_buffer"])
