"""Tests of the benchmark workloads in :mod:`dmuon.bench.models`."""

from __future__ import annotations

import math

import pytest
import torch

from dmuon.bench.models.moe import MOE_SIZES
from dmuon.bench.models import DEFAULT_SIZES, QWEN2_SIZES, VLA_SIZES, build_workload

WORKLOADS = [("tiny", "tiny"), ("qwen2", "tiny"), ("vla", "tiny")]


def _build(name: str, size: str, **kwargs):
    return build_workload(name, size=size, **kwargs)


def _batches_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("name,size", WORKLOADS)
def test_forward_backward_finite(name, size):
    w = _build(name, size)
    loss = w.loss_fn(w.model, w.make_batch(0, 0))
    assert loss.ndim == 0 and torch.isfinite(loss)
    loss.backward()
    for pname, p in w.model.named_parameters():
        assert p.grad is not None, pname
        assert torch.isfinite(p.grad).all(), pname
    assert w.tokens_per_rank > 0


@pytest.mark.parametrize("name,size", WORKLOADS)
def test_loss_decreases_with_sgd(name, size):
    w = _build(name, size)
    batch = w.make_batch(0, 0)
    opt = torch.optim.SGD(w.model.parameters(), lr=0.05)
    losses = []
    for _ in range(6):
        loss = w.loss_fn(w.model, batch)
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0] - 0.2, losses


@pytest.mark.parametrize("name,size", WORKLOADS)
def test_seeded_init_is_deterministic(name, size):
    rng_before = torch.get_rng_state()
    a, b = _build(name, size, seed=3), _build(name, size, seed=3)
    c = _build(name, size, seed=4)
    assert torch.equal(torch.get_rng_state(), rng_before)  # global RNG untouched
    sa, sb, sc = a.model.state_dict(), b.model.state_dict(), c.model.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    assert any(not torch.equal(sa[k], sc[k]) for k in sa)


@pytest.mark.parametrize("name,size", WORKLOADS)
def test_batches_deterministic_and_distinct(name, size):
    w = _build(name, size)
    assert _batches_equal(w.make_batch(2, 1), w.make_batch(2, 1))
    assert _batches_equal(w.make_batch(2, 1), _build(name, size).make_batch(2, 1))
    ids = [w.make_batch(s, r)["input_ids"] for s in range(2) for r in range(3)]
    for i in range(len(ids)):
        for j in range(i + 1, len(ids)):
            assert not torch.equal(ids[i], ids[j]), (i, j)
    for v in w.make_batch(0, 0).values():
        assert v.shape[0] == w.config.batch_size


@pytest.mark.parametrize("name,size", WORKLOADS)
def test_global_batch_matches_ranks(name, size):
    world = 3
    w = _build(name, size)
    step = 5
    glob = w.global_batch(step, world)
    parts = [w.make_batch(step, r) for r in range(world)]
    for key in glob:
        assert torch.equal(glob[key], torch.cat([p[key] for p in parts]))
    with torch.no_grad():
        per_rank = torch.stack([w.loss_fn(w.model, p) for p in parts])
        global_loss = w.loss_fn(w.model, glob)
    torch.testing.assert_close(global_loss, per_rank.mean(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name,size", WORKLOADS)
def test_blocks_are_forward_ordered_submodules(name, size):
    w = _build(name, size)
    submodules = {id(m) for m in w.model.modules()}
    assert len(w.blocks) == len({id(b) for b in w.blocks}) > 0
    assert all(id(b) in submodules and b is not w.model for b in w.blocks)
    # No block contains another: each is a separate FSDP2 unit.
    for b in w.blocks:
        inner = {id(m) for m in b.modules()} - {id(b)}
        assert not inner & {id(x) for x in w.blocks}
    order = []
    hooks = [b.register_forward_pre_hook(lambda m, _args, i=i: order.append(i))
             for i, b in enumerate(w.blocks)]
    with torch.no_grad():
        w.loss_fn(w.model, w.make_batch(0, 0))
    for h in hooks:
        h.remove()
    assert order == list(range(len(w.blocks)))


@pytest.mark.parametrize("name,size", WORKLOADS)
def test_muon_params_step_with_torch_muon(name, size):
    w = _build(name, size)
    params = dict(w.model.named_parameters())
    muon_names = set(w.muon_param_names)
    assert muon_names and muon_names <= params.keys()
    assert all(params[n].ndim == 2 for n in muon_names)
    for n in muon_names:  # embeddings and heads are never Muon parameters
        assert "embed" not in n and "lm_head" not in n and "vision_pos" not in n
    muon = torch.optim.Muon([params[n] for n in sorted(muon_names)], lr=0.02)
    adam = torch.optim.AdamW([p for n, p in params.items() if n not in muon_names], lr=1e-3)
    batch = w.make_batch(0, 0)
    before = w.loss_fn(w.model, batch)
    before.backward()
    muon.step()
    adam.step()
    with torch.no_grad():
        after = w.loss_fn(w.model, batch)
    assert torch.isfinite(after) and after < before


def test_vla_widths_are_heterogeneous():
    for cfg in VLA_SIZES.values():
        assert len({cfg.dv, cfg.dl, cfg.da}) == 3
    w = build_workload("vla", size="tiny")
    shapes = {tuple(p.shape) for p in w.model.parameters() if p.ndim == 2}
    assert len(shapes) >= 10
    assert len(w.blocks) == sum(
        getattr(w.config, f) for f in ("vision_layers", "lm_layers", "expert_layers"))


def test_tiny_is_tiny_qwen2():
    a, b = build_workload("tiny", size="large"), build_workload("qwen2", size="tiny")
    assert a.config == b.config == QWEN2_SIZES["tiny"]
    assert type(a.model).__name__ == "Qwen2ForCausalLM"
    assert a.model.config._attn_implementation in ("sdpa", "eager")
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_qwen2_structure():
    w = build_workload("qwen2", size="tiny")
    cfg = w.config
    attn = w.model.model.layers[0].self_attn
    head_dim = cfg.hidden // cfg.heads
    assert attn.q_proj.bias is not None and attn.o_proj.bias is None
    assert attn.k_proj.weight.shape == (cfg.kv_heads * head_dim, cfg.hidden)
    assert w.model.lm_head.weight.data_ptr() != w.model.model.embed_tokens.weight.data_ptr()
    assert len(w.blocks) == cfg.layers


@pytest.mark.parametrize("name", ["qwen2", "vla"])
def test_overrides(name):
    w = build_workload(name, size="tiny", seq_len=12, batch_size=3)
    batch = w.make_batch(0, 0)
    assert batch["input_ids"].shape == (3, 12)
    if name == "qwen2":
        assert w.tokens_per_rank == 36
    else:
        c = w.config
        assert w.tokens_per_rank == 3 * (c.image_tokens + 12 + 1 + c.action_horizon)
    assert torch.isfinite(w.loss_fn(w.model, batch))


def test_dtype():
    w = build_workload("vla", size="tiny", dtype=torch.float64)
    assert all(p.dtype == torch.float64 for p in w.model.parameters())
    assert w.make_batch(0, 0)["images"].dtype == torch.float64
    assert torch.isfinite(w.loss_fn(w.model, w.make_batch(0, 0)))


@pytest.mark.parametrize("kwargs,arg", [
    ({"name": "gpt"}, "name"),
    ({"name": "qwen2", "size": "huge"}, "size"),
    ({"name": "vla", "size": "mini"}, "size"),
    ({"name": "qwen2", "seq_len": 1}, "seq_len"),
    ({"name": "vla", "batch_size": 0}, "batch_size"),
    ({"name": "qwen2", "batch_size": 2.0}, "batch_size"),
    ({"name": "qwen2", "seed": -1}, "seed"),
    ({"name": "qwen2", "dtype": torch.int64}, "dtype"),
])
def test_build_errors(kwargs, arg):
    with pytest.raises(ValueError, match=arg):
        build_workload(**kwargs)


def test_batch_errors():
    w = build_workload("tiny")
    with pytest.raises(ValueError, match="step"):
        w.make_batch(-1, 0)
    with pytest.raises(ValueError, match="rank"):
        w.make_batch(0, -2)
    with pytest.raises(ValueError, match="world_size"):
        w.global_batch(0, 0)


def test_fsdp2_matches_single_process():
    """FSDP2 on 2 gloo ranks equals a single-process run on the global batch."""
    import torch.distributed as dist

    from . import _bench_fsdp_worker

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("gloo not available")
    result = _bench_fsdp_worker.run(world=2, names=("tiny", "vla"), steps=2)
    for name, (losses, diff) in result.items():
        for sharded, ref in losses:
            assert sharded == pytest.approx(ref, rel=1e-5), name
        assert diff < 1e-5, name


def test_default_sizes():
    """Without a size each family gets its default; the bench default is qwen2 "mini"."""
    with torch.device("meta"):
        for name, size in DEFAULT_SIZES.items():
            w = build_workload(name)
            assert w.size == size
            assert w.config == {"vla": VLA_SIZES, "moe": MOE_SIZES}.get(name, QWEN2_SIZES)[size]
        mini = build_workload("qwen2")
    cfg = QWEN2_SIZES["mini"]
    assert mini.tokens_per_rank == cfg.seq_len * cfg.batch_size == 512
    shapes = {tuple(p.shape) for n, p in mini.model.named_parameters() if n in mini.muon_param_names}
    assert shapes == {(128, 128), (64, 128), (384, 128), (128, 384)}
