"""Tests of the bench's configurations, runner figures and report (:mod:`dmuon.bench`)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dmuon.bench.memory import live_state_bytes
from dmuon.bench.models import build_workload
from dmuon.bench.report import cpu_features, format_table, ratios, timing_note
from dmuon.bench.setups import ALL_CONFIGS, CONFIGS, Hyper, _Pair, build, reshard_after_forward
from dmuon.plan.selection import select_matrices


def test_reshard_after_forward_per_config():
    """ZeRO-2 configurations keep the gathered weights; the rest keep FSDP2's default."""
    z2 = {c for c in ALL_CONFIGS if not reshard_after_forward(c)}
    assert z2 == {"adamw_z2", "dmuon_z2", "dmuon_z2_sync", "dmuon_z2_nsbwd", "dmuon_z2_native", "dmuon_z2_clip",
                  "dmuon_z2_clip_refresh", "dmuon_z2_normuon", "dmuon_z2_muonh", "dmuon_z2_dion2", "dmuon_z2_rbwd",
                  "dmuon_z2_nfwd"}
    assert reshard_after_forward("adamw") and reshard_after_forward("adamw_local")
    assert not reshard_after_forward("dmuon_z2_sync@lpt") and reshard_after_forward("dmuon_z3@milp")
    assert CONFIGS == ("adamw", "torch_muon", "gather", "dmuon_z2", "dmuon_z3")
    with pytest.raises(ValueError, match="config must be one of"):
        reshard_after_forward("dmuon_z1")


def test_dmuon_configs_use_the_replicate_level_on_an_hsdp_mesh():
    """On a mesh with a replicate dim every dmuon configuration but the ``_native`` ones shards over the
    shard dim and hands dmuon the mesh; nothing else changes how it is built."""
    from types import SimpleNamespace

    from dmuon.bench.setups import uses_replicate_level

    hsdp, flat = SimpleNamespace(mesh_dim_names=("replicate", "shard")), SimpleNamespace(mesh_dim_names=None)
    assert uses_replicate_level("dmuon_z3", hsdp) and uses_replicate_level("dmuon_z2_sync@lpt", hsdp)
    assert not uses_replicate_level("dmuon_z3_native", hsdp) and not uses_replicate_level("adamw", hsdp)
    assert not uses_replicate_level("adamw_local", hsdp) and not uses_replicate_level("gather", hsdp)
    assert not any(uses_replicate_level(c, flat) for c in ALL_CONFIGS)


def test_clipping_configs_compare_like_for_like():
    """``_clip`` configurations clip before every step, are compared with ``adamw_clip``, and their
    losses only with each other's."""
    from dmuon.bench.report import loss_agreement
    from dmuon.bench.setups import CLIP_MAX_NORM, clip_norm

    assert clip_norm("dmuon_z3_clip") == clip_norm("adamw_clip") == CLIP_MAX_NORM
    assert clip_norm("dmuon_z3") is None and clip_norm("dmuon_z2_clip@lpt") == CLIP_MAX_NORM
    assert clip_norm("dmuon_z3_clip_refresh") == CLIP_MAX_NORM
    row = dict(step_s=1.0, optimizer_s=0.1, fwd_bwd_s=0.9, final_loss=2.0)
    results = [dict(row, config="adamw_clip", step_s=0.5), dict(row, config="dmuon_z3_clip"),
               dict(row, config="dmuon_z3", final_loss=3.0), dict(row, config="dmuon_z2", final_loss=3.0)]
    out = ratios(results)
    assert out["dmuon_z3_clip_overhead_vs_adamw_clip_pct"] == pytest.approx(100.0)
    assert "dmuon_z3_clip_overhead_vs_adamw_pct" not in out and "dmuon_z3_overhead_vs_adamw_clip_pct" not in out
    ok, sentence = loss_agreement(results)
    assert ok and "dmuon_z3, dmuon_z2 agree" in sentence
    ok, _ = loss_agreement(results + [dict(row, config="dmuon_z2_clip", final_loss=2.5)])
    assert not ok


def test_build_rejects_unknown_and_misplaced_balancer():
    w = build_workload("tiny", size="tiny")
    with pytest.raises(ValueError, match="config must be one of"):
        build("nope", w, None, Hyper())
    with pytest.raises(ValueError, match="only dmuon configurations take a balancer"):
        build("adamw@lpt", w, None, Hyper())


def test_live_state_bytes_counts_unique_storages():
    """Parameters sharing one storage count once; grads and AdamW/Muon state are measured as held."""
    shared = torch.zeros(64)
    a = nn.Parameter(shared[:32].view(4, 8))
    b = nn.Parameter(shared[32:].view(8, 4))
    c = nn.Parameter(torch.zeros(5))
    model = nn.Module()
    model.a, model.b, model.c = a, b, c
    opt = _Pair(torch.optim.Muon([a, b], lr=0.02), torch.optim.AdamW([c], lr=1e-3))
    before = live_state_bytes(model, opt)
    assert before == {"params": 64 * 4 + 5 * 4, "grads": 0, "optimizer_state": 0, "total": 69 * 4}
    loss = (a.sum() * 2 + b.pow(2).sum() + c.sum())
    loss.backward()
    opt.step()
    live = live_state_bytes(model, opt)
    # Muon: one fp32 momentum per matrix; AdamW: exp_avg, exp_avg_sq and a 4-byte step.
    state = (32 + 32) * 4 + 2 * 5 * 4 + 4
    assert live == {"params": 69 * 4, "grads": 69 * 4, "optimizer_state": state, "total": 2 * 69 * 4 + state}
    # A gradient that is a view of a parameter's storage is counted once in the total.
    c.grad = c.detach()
    again = live_state_bytes(model, opt)
    assert again["grads"] == 64 * 4 + 5 * 4 and again["total"] == 69 * 4 + 64 * 4 + state


def _result(config, step, opt, fb=0.1, rounds=None):
    return {"config": config, "step_s": step, "optimizer_s": opt, "fwd_bwd_s": fb,
            "step_s_by_round": rounds or [step]}


def test_ratios_compare_zero2_dmuon_with_adamw_z2():
    results = [
        _result("adamw", 1.0, 0.1, rounds=[1.0, 1.0]),
        _result("adamw_z2", 0.8, 0.1, rounds=[0.8, 0.8]),
        _result("dmuon_z2", 0.88, 0.2, rounds=[0.88, 0.96]),
        _result("dmuon_z2@lpt", 1.2, 0.2),
        _result("dmuon_z3", 1.1, 0.2),
    ]
    r = ratios(results)
    assert r["dmuon_z2_overhead_vs_adamw_z2_pct"] == pytest.approx(10.0)
    assert r["dmuon_z2_overhead_vs_adamw_z2_by_round_pct"] == pytest.approx([10.0, 20.0])
    assert r["dmuon_z2_overhead_vs_adamw_pct"] == pytest.approx(-12.0)
    assert r["dmuon_z2@lpt_overhead_vs_adamw_z2_pct"] == pytest.approx(50.0)
    # ZeRO-3 dmuon is compared with ZeRO-3 AdamW only.
    assert r["dmuon_z3_overhead_vs_adamw_pct"] == pytest.approx(10.0)
    assert "dmuon_z3_overhead_vs_adamw_z2_pct" not in r
    assert not any("adamw_z2" in k for k in ratios([results[0], results[2]]))


def test_cpu_features_name_the_matrix_units():
    text = ("processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 fma\n\n"
            "processor\t: 1\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 fma\n")
    assert cpu_features(text) == ("AMD EPYC", ["avx512_bf16", "avx512f", "avx2"])
    assert cpu_features("flags : sse2 avx2\n") == (None, ["avx2"])


def test_table_shows_live_memory():
    row = {"config": "dmuon_z2", "step_s": 0.05, "step_s_min": 0.04, "step_s_max": 0.06, "fwd_bwd_s": 0.03,
           "optimizer_s": 0.02, "ns_s": 0.01, "bytes_per_step": 3 * 2**20, "peak_mem_bytes": 10 * 2**20,
           "final_loss": 5.5, "live_mem_bytes": {"params": 2**20, "grads": 2**20, "optimizer_state": 2**19,
                                                 "total": 5 * 2**19}}
    table = format_table([row])
    assert "live MB (params+grads+state)" in table.splitlines()[0]
    assert "2.50 (1.00+1.00+0.50)" in table.splitlines()[2]


def test_runner_on_fsdp2_ranks():
    """Each configuration as the runner builds and steps it on 2 gloo ranks (model "tiny").

    Checks FSDP2 shards every parameter with the configuration's resharding, the
    FSDP2 traffic counts two or three ring passes, the live memory is what the
    local shards and the optimizer state hold, and the Muon configurations train alike.
    """
    import torch.distributed as dist

    from . import _bench_runner_worker

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("gloo not available")
    world, steps = 2, 2
    configs = ("adamw", "adamw_z2", "adamw_local", "torch_muon", "gather", "dmuon_z2", "dmuon_z3_sync")
    results = _bench_runner_worker.run(world, configs, steps)

    model = build_workload("tiny", size="tiny").model
    muon = {n for n, _ in select_matrices(model)}
    params = dict(model.named_parameters())

    def shard_bytes(names):  # rank 0's rows: FSDP2 pads every rank's shard to ceil(rows / S)
        return sum(-(-params[n].shape[0] // world) * (params[n].numel() // params[n].shape[0]) * 4 for n in names)

    every = shard_bytes(params)
    numel = sum(p.numel() for p in params.values())
    others = [n for n in params if n not in muon]
    adamw_state = 2 * every + 4 * len(params)
    muon_state = shard_bytes(muon) + 2 * shard_bytes(others) + 4 * len(others)
    for config, r in results.items():
        z2 = config in ("adamw_z2", "dmuon_z2")
        assert r["all_dtensors"], config
        assert r["reshard_after_forward"] is (not z2)
        assert r["sharded_after_forward"] is (not z2), config
        # The root's own parameters stay gathered for backward under ZeRO-3 too (shard_root).
        assert r["root_sharded_after_forward"] is False, config
        root = r["root_numel"]
        assert 0 < root < numel
        # Elements through FSDP2's collectives: every parameter's forward all-gather and reduce-scatter,
        # and under ZeRO-3 the blocks' backward all-gather. S = 2: each moves half of a tensor each way
        # (sent plus received: the whole of it), fp32.
        passes = 2 * numel + (0 if z2 else numel - root)
        assert r["fsdp_bytes_per_step"] == passes * 4, config
        state = adamw_state if config.startswith("adamw") else muon_state
        live = {"params": every, "grads": every, "optimizer_state": state, "total": 2 * every + state}
        assert r["live_mem_bytes"] == live, config
        assert r["live_mem_bytes_by_point"]["after_step"] == live, config
        # Measured on the untimed step only (both points): nothing runs inside a timed phase.
        assert r["live_measurements"] == {False: 2, True: 0}, config
        assert len(r["losses"]) == steps + 1 and len(r["step_s_all"]) == steps
        assert r["optimizer_s"] > 0 and r["fwd_bwd_s"] > 0
    for config in ("dmuon_z2", "dmuon_z3_sync"):
        assert results[config]["losses"] == pytest.approx(results["gather"]["losses"], rel=1e-4)
        assert results[config]["optimizer_bytes_per_step"] > 0
        assert results[config]["imbalance"] is not None
    assert results["adamw_local"]["losses"] == pytest.approx(results["adamw"]["losses"], rel=1e-6)
    assert results["adamw_z2"]["losses"] == pytest.approx(results["adamw"]["losses"], rel=1e-6)


def test_optimizer_phase_starts_when_the_last_rank_enters_it():
    """The optimizer phase is timed on the host's clock from the last rank's entry into ``step()``:
    a rank that waits there for a late rank (here one sleeping 0.3 s after backward) is not charged
    for the wait, which its own duration, reported beside, includes."""
    from . import _bench_runner_worker

    late = 0.3
    results = _bench_runner_worker.run(2, ("adamw", "dmuon_z3_sync"), 2, late_s=late)
    for config, r in results.items():
        assert r["phases_on_one_clock"]
        assert r["optimizer_s"] < late / 2, config
    # dmuon's step() exchanges with the late rank, so the early one waits for it there.
    assert results["dmuon_z3_sync"]["optimizer_own_s"] > late
    assert results["adamw"]["optimizer_own_s"] < late / 2  # no collective in torch's AdamW step
    note = timing_note(list(results.values()))
    assert note.startswith("phases: from the last rank's entry")
    assert f"dmuon_z3_sync {1e3 * results['dmuon_z3_sync']['optimizer_own_s']:.1f}" in note


def test_post_optim_event_config_is_for_accelerators():
    """``dmuon_z3_event`` runs ``post_optim_event=True``: the GPU check adds it on CUDA only, and on
    CPU the bench refuses it with DMuon's own error."""
    import torch

    from . import _bench_runner_worker
    from dmuon.bench.gpu_check_base import bench_configs

    assert bench_configs(torch.device("cpu")) == [*CONFIGS, "dmuon_z3_sync"]
    assert bench_configs(torch.device("cuda")) == [*CONFIGS, "dmuon_z3_sync", "dmuon_z3_event"]
    assert reshard_after_forward("dmuon_z3_event")
    with pytest.raises(Exception, match="post_optim_event=True needs a device with events"):
        _bench_runner_worker.run(1, ("dmuon_z3_event",), 1)
