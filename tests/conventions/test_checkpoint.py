"""Checkpoints through torch's own API: DCP saves on one cluster and resumes exactly on another.

The calls are what a user writes for FSDP2 + AdamW, with the default (strict)
options; only the owners of the matrices change between clusters, and they
keep no state.
"""

from __future__ import annotations

import functools

import pytest
import torch

from support.spawn import run_distributed, run_with_crashes

from support.cases import MUON_KW
from support.checkpoint import PlainMuonAdamW, global_batch, on_3_ranks, on_4_ranks_more, resume_and_train
from support.models import OddNet, lm_loss
from support.reference import reference_training

SAVED_AT, MORE = 2, 2
FROZEN = ("layers.1.",)


@pytest.fixture(scope="module")
def saved_on_4_ranks(tmp_path_factory):
    """One 4-rank run: an fp32 checkpoint after SAVED_AT steps (ZeRO-3 style) with rank 0's full
    model state, and the bf16 + frozen block save/continue/resume comparison."""
    directory = tmp_path_factory.mktemp("ckpt")
    out = run_distributed(on_4_ranks_more, 4, str(directory), SAVED_AT, MORE, FROZEN, timeout_s=120)[0]
    return str(directory / "fp32"), out


@functools.lru_cache(maxsize=1)
def _uninterrupted() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = OddNet()
    batches = [global_batch(s) for s in range(SAVED_AT + MORE)]
    params, _ = reference_training(model, batches, lm_loss, muon_kwargs=MUON_KW,
                                   adamw_kwargs=dict(lr=3e-3, weight_decay=0.01), ns_dtype=torch.float32)
    return params


@pytest.mark.parametrize("world_size,zero,mesh_shape", [
    (2, 3, None),
    # Under -m slow: test_hsdp_checkpoint_holds_each_momentum_once resumes on 3 ranks ZeRO-2 by default.
    pytest.param(3, 2, None, marks=pytest.mark.slow),
    # Under -m slow: test_replicate_level_checkpoint_resumes_on_other_layouts resumes on 2x2 native HSDP by default.
    pytest.param(4, 3, (2, 2), marks=pytest.mark.slow),
], ids=["2-ranks-zero3", "3-ranks-zero2", "hsdp-2x2"])
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
    from support.models import odd_batch

    torch.manual_seed(0)
    model = OddNet().to(torch.bfloat16)
    kw = dict(lr=0.02, ns=dmuon.NSConfig(method="standard", dtype=torch.float32))
    opt = dmuon.DMuon(model, **kw)
    lm_loss(model, odd_batch(0, 0)).backward()
    opt.step()
    resumed = dmuon.DMuon(model, **kw)
    resumed.load_state_dict(opt.state_dict())
    weight = model.layers[0].up.weight
    assert opt.state[weight]["momentum_buffer"].dtype == torch.float32
    assert resumed.state[weight]["momentum_buffer"].dtype == torch.float32
    assert torch.equal(resumed.state[weight]["momentum_buffer"], opt.state[weight]["momentum_buffer"])


def _worst(got, ref):
    assert set(got) == set(ref)
    worst = max(ref, key=lambda n: (got[n] - ref[n]).abs().max().item())
    return worst, (got[worst] - ref[worst]).abs().max().item()


def test_async_save_with_the_combined_api_resumes_under_another_balancer(saved_on_4_ranks):
    """get_state_dict + dcp.async_save (greedy owners), then get_state_dict + dcp.load + set_state_dict
    on 4 ranks with round-robin owners: the run continues as if never interrupted."""
    worst, err = _worst(saved_on_4_ranks[1]["async"], _uninterrupted())
    assert err <= 1e-5, (worst, err)


def test_save_and_load_stay_within_the_training_peak(saved_on_4_ranks):
    """On every rank: live state + the state-dict bytes that are not aliases of it, right after
    get_*_state_dict + dcp.save and right after get_state_dict + dcp.load, within 1.1x of the
    training peak (live bytes after backward)."""
    for rank, got in enumerate(saved_on_4_ranks[1]["memory"]):
        peak = got["memory"]["train_peak"]
        for when in (got["memory"]["save"], got["load_bytes"]):
            assert when["live"] + when["extra"] <= 1.1 * peak, (rank, when, peak)


@pytest.fixture(scope="module")
def on_3(tmp_path_factory):
    """A single-process torch.optim.Muon + AdamW run saved after SAVED_AT steps and continued MORE,
    and one 3-rank run (export, import, bad checkpoints)."""
    torch.manual_seed(0)
    model = OddNet()
    plain = PlainMuonAdamW(model)
    plain.train(range(SAVED_AT))
    saved = {"model": {k: v.detach().clone() for k, v in model.state_dict().items()}, "state": plain.full_state()}
    plain.train(range(SAVED_AT, SAVED_AT + MORE))
    continued = {n: p.detach().clone() for n, p in model.named_parameters()}
    directory = tmp_path_factory.mktemp("ckpt3")
    ranks = run_with_crashes(on_3_ranks, 3, str(directory), SAVED_AT, MORE, saved, timeout_s=60, deadline_s=90)
    return {"continued": continued, "ranks": ranks}


def _rank0(on_3):
    out = on_3["ranks"][0]
    assert "export" in out, on_3["ranks"]
    return out


def test_full_state_dicts_continue_in_torch_muon_and_adamw(on_3):
    """Rank 0's full model + optimizer state dicts of a 3-rank run, mapped by parameter name into a plain
    OddNet with torch.optim.Muon + AdamW: continuing there equals continuing the distributed run."""
    out = _rank0(on_3)
    model = OddNet()
    model.load_state_dict(out["export_state"]["model"])
    plain = PlainMuonAdamW(model)
    names = {n for n, _ in model.named_parameters()}
    assert set(out["export_state"]["optim"]["state"]) == names
    plain.load_full_state(out["export_state"]["optim"])
    plain.train(range(SAVED_AT, SAVED_AT + MORE))
    worst, err = _worst({n: p.detach() for n, p in model.named_parameters()}, out["export"])
    assert err <= 1e-5, (worst, err)


def test_dmuon_starts_from_a_torch_muon_and_adamw_checkpoint(on_3):
    """set_model/optimizer_state_dict(full_state_dict=True) from a single-process torch.optim.Muon + AdamW
    checkpoint: 3-rank DMuon continues as the single-process run does."""
    worst, err = _worst(_rank0(on_3)["import"], on_3["continued"])
    assert err <= 1e-5, (worst, err)


@pytest.mark.parametrize("label,key", [("blocks=2", "layers.2."), ("dim=40", "embed.weight")])
def test_a_checkpoint_of_another_model_fails_clearly_on_every_rank(on_3, label, key):
    for rank, out in enumerate(on_3["ranks"]):
        assert "hung" not in out and "raised" not in out, (rank, out)
        message = out["bad"][label]
        assert message is not None, (rank, label)
        assert key in message, (rank, message[:500])


def test_hsdp_checkpoint_holds_each_momentum_once(tmp_path):
    """On HSDP every momentum element lives on one rank (Shard(1) over the replicas); DCP writes it
    once, torch's full optimizer state dict assembles it, and a 3-rank FSDP run resumes from it exactly."""
    import math

    import torch.distributed.checkpoint as dcp

    from support.checkpoint import save_after

    path = str(tmp_path / "hsdp")
    saved = run_distributed(save_after, 4, path, SAVED_AT, 3, (2, 2), timeout_s=120)[0]
    meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    momenta = {k: v for k, v in meta.items() if k.endswith("momentum_buffer")}
    assert len(momenta) == 12  # every Muon matrix of OddNet, none twice
    for key, m in momenta.items():
        assert sum(math.prod(c.sizes) for c in m.chunks) == math.prod(m.size), key
    # The full state dict's momenta are torch.optim.Muon's after the same steps.
    torch.manual_seed(0)
    reference_training(OddNet(), [global_batch(s) for s in range(SAVED_AT)], lm_loss, muon_kwargs=MUON_KW,
                       adamw_kwargs=dict(lr=3e-3, weight_decay=0.01), ns_dtype=torch.float32)
    ref = reference_training.momenta
    assert set(saved["momenta"]) == set(ref) and len(ref) == 12
    for name, value in ref.items():
        assert saved["momenta"][name].shape == value.shape, name
        assert (saved["momenta"][name] - value).abs().max().item() <= 1e-5, name
    got = run_distributed(resume_and_train, 3, path, SAVED_AT, MORE, 2, None, timeout_s=120)[0]
    worst, err = _worst(_uninterrupted(), got)
    assert err <= 1e-5, (worst, err)

def test_replicate_level_checkpoint_resumes_on_other_layouts(tmp_path):
    """Saved with dmuon's replicate level on 2x2 (FSDP2 over the shard dim, ``hsdp_mesh``), resumed on
    4 ranks 1-D and on 2x2 native HSDP: as if never stopped. The momentum's layout is native
    HSDP's, so DCP reshards it like any other state."""
    from support.checkpoint import save_then_resume_elsewhere

    layouts = [(None, "fsdp2"), ((2, 2), "fsdp2")]
    got = run_distributed(save_then_resume_elsewhere, 4, str(tmp_path), SAVED_AT, MORE, ((2, 2), "dmuon"), layouts,
                          timeout_s=180)[0]
    ref = _uninterrupted()
    for layout, params in zip(layouts, got):
        worst = max(ref, key=lambda n: (params[n] - ref[n]).abs().max().item())
        assert (params[worst] - ref[worst]).abs().max().item() <= 1e-5, (layout, worst)
