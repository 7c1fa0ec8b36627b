"""DCP checkpoints saved on one cluster resume exactly on another, though owners change."""

from __future__ import annotations

import pytest
import torch

from dmuon.testing import run_distributed
from dmuon.testing.cases import MUON_KW
from dmuon.testing.checkpoint import global_batch, resume_and_train, save_after
from dmuon.testing.models import OddNet, lm_loss
from dmuon.testing.reference import reference_training

SAVED_AT, MORE = 2, 2


@pytest.fixture(scope="module")
def checkpoint_on_4_ranks(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ckpt") / "step2")
    run_distributed(save_after, 4, path, SAVED_AT, 3, timeout_s=180)
    return path


def _uninterrupted():
    torch.manual_seed(0)
    model = OddNet()
    batches = [global_batch(s) for s in range(SAVED_AT + MORE)]
    params, _ = reference_training(model, batches, lm_loss, muon_kwargs=MUON_KW,
                                   adamw_kwargs=dict(lr=3e-3, weight_decay=0.01), ns_dtype=torch.float32)
    return params


@pytest.mark.parametrize("world_size,zero,mesh_shape", [(2, 3, None), (3, 2, None), (4, 3, (2, 2))])
def test_resume_on_another_cluster_continues_exactly(checkpoint_on_4_ranks, world_size, zero, mesh_shape):
    got = run_distributed(resume_and_train, world_size, checkpoint_on_4_ranks, SAVED_AT, MORE, zero,
                          mesh_shape, timeout_s=180)[0]
    ref = _uninterrupted()
    worst = max(ref, key=lambda n: (got[n] - ref[n]).abs().max().item())
    assert (got[worst] - ref[worst]).abs().max().item() <= 1e-5, worst


def test_model_state_dict_loads_into_a_plain_model():
    from dmuon.testing.checkpoint import full_model_state

    out = run_distributed(full_model_state, 3, 3, timeout_s=120)[0]
    plain = OddNet()
    plain.load_state_dict(out["state"])  # strict: every matrix and shard is there, full-size
    for name, p in plain.named_parameters():
        assert torch.equal(p, out["params"][name]), name
