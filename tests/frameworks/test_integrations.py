"""The framework recipes of examples/integrations, run on 2 gloo CPU ranks with the installed frameworks.

Each recipe trains with clipping and accumulation, checkpoints through the framework's own API and
resumes; the test holds it to references that do not depend on the recipe: the resumed run ends bit
for bit where the uninterrupted one ends, and where the framework lets the optimizer be built after
sharding, that run is equal to the one whose optimizer was built first. Marked ``integrations``
(deselected by default; ``.ci/run`` installs the ``integrations`` extra and runs them). A framework
that is not installed skips its test, naming it; any other failure fails.
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest

from support.spawn import run_distributed

pytestmark = pytest.mark.integrations

RECIPES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples", "integrations")


def _recipe(name: str, *frameworks: str):
    for framework in frameworks:
        pytest.importorskip(framework, reason=f"{framework} is not installed (pip install -e '.[integrations]')")
    if RECIPES not in sys.path:
        sys.path.insert(0, RECIPES)  # the spawned ranks inherit it
    return importlib.import_module(name)


def test_lightning_fabric_one_call_setup(tmp_path):
    """fabric.setup(model, DMuon(model)) (built before ModelParallelStrategy shards): equal to
    setup_module + DMuon after sharding + setup_optimizers, and a fabric.load resume (before the first
    forward) continues exactly."""
    recipe = _recipe("lightning_fabric", "lightning")
    recipe.check(run_distributed(recipe.run, 2, str(tmp_path), timeout_s=300)[0])


def test_lightning_trainer_configure_optimizers(tmp_path):
    """DMuon from configure_optimizers under ModelParallelStrategy, accumulate_grad_batches and
    gradient_clip_val; resumed from a ModelCheckpoint (ckpt_path=) it continues exactly."""
    recipe = _recipe("lightning_trainer", "lightning")
    recipe.check(run_distributed(recipe.run, 2, str(tmp_path), timeout_s=300)[0])


def test_accelerate_prepare_with_the_optimizer_built_first(tmp_path):
    """accelerator.prepare(model, DMuon(model)): accelerate's own FSDP2 path (fully_shard, its
    placeholder swap and name mapping into the param groups), accumulate and clip_grad_norm_; equal
    to DMuon built on the sharded model, and save_state/load_state resume exactly."""
    recipe = _recipe("accelerate_fsdp2", "accelerate")
    out = run_distributed(recipe.run, 2, str(tmp_path), timeout_s=300)[0]
    recipe.check(out)
    assert all(out[mode]["set_up"] for mode in out)


def test_hf_trainer_optimizer_cls_and_kwargs(tmp_path):
    """Trainer(optimizer_cls_and_kwargs=(dmuon.DMuon, {"module": model, ...})) with fsdp_config version 2:
    the Trainer's weight-decay grouping holds (its own get_decay_parameter_names decides which
    parameters decay, in both halves), AdamW gets the Trainer's learning_rate, and a resume from
    checkpoint-2 continues exactly."""
    recipe = _recipe("hf_trainer", "transformers", "accelerate")
    from transformers import Trainer, TrainingArguments

    from tiny import TinyLM

    out = run_distributed(recipe.run, 2, str(tmp_path), timeout_s=300)[0]
    recipe.check(out)
    model = TinyLM()
    trainer = Trainer(model=model, args=TrainingArguments(output_dir=str(tmp_path / "probe"), report_to=[],
                                                          use_cpu=True))
    decay = set(trainer.get_decay_parameter_names(model))
    matrices = {n for n, p in model.named_parameters() if p.ndim >= 2 and n.startswith("layers.")}
    seen = set()
    for group in out["first"]["groups"]:
        names = set(group["params"])
        seen |= names
        assert group["weight_decay"] == (0.1 if names <= decay else 0.0), group
        assert names <= decay or not names & decay, group
        if group["algorithm"] == "muon":
            assert names == matrices and group["initial_lr"] == 0.02, group
        else:
            assert not names & matrices and group["initial_lr"] == 3e-3, group
    assert seen == {n for n, _ in model.named_parameters()}


def test_torchtitan_pipeline_parallel_parts(tmp_path):
    """torchtitan's layout under pipeline parallelism on 4 ranks as (pp=2, dp=2): its container builds one
    DMuon per model part, torch's 1F1B schedule, torchtitan's clipping over the pp mesh, its LR schedulers
    and its name-keyed state through DCP: the resumed run ends bit for bit where the first one ends, and
    the container equals DMuon(part) used directly, on every stage."""
    recipe = _recipe("torchtitan_pipeline", "torchtitan")
    for out in run_distributed(recipe.run, 4, str(tmp_path), timeout_s=600):
        recipe.check(out)


def test_torchtitan_optimizers_container(tmp_path):
    """A subclass of torchtitan's OptimizersContainer built from its Config with optimizer_name="DMuon":
    equal to DMuon(model) used directly; with torchtitan's LR scheduler container, its clip_grad_norm_
    and its flat state dict through DCP, a resume continues exactly."""
    recipe = _recipe("torchtitan_container", "torchtitan")
    recipe.check(run_distributed(recipe.run, 2, str(tmp_path), timeout_s=300)[0])


def test_torchtitan_moe_expert_parallel_equals_one_process():
    """torchtitan's own deepseek_v3 debugmodel (MLA, 8 routed experts x 5 MoE layers, a shared expert)
    sharded by its own parallelize_fn with ep=2 on 4 gloo ranks (dense over fsdp=4, experts Shard(0) over
    ep then fully_shard over efsdp=2), DMuon from torchtitan's optimizer container, torchtitan's
    load-balancing hook, loss and clip_grad_norm_(ep_enabled=True), 3 steps: equal at 1e-5 to one process
    (torch.optim.Muon with fp32 NS per expert slice and per dense matrix, AdamW on the rest, the global
    batch) from the sharded model's own initial weights; each of the 167 Muon matrices orthogonalized
    once in the cluster.

    One torchtitan detail is switched off in both runs: its routed experts' bf16 grouped GEMMs
    (support/titan_moe.py's ``fp32_experts``; each expert's weight gradient is a bf16 sum over its tokens,
    two partial sums here against one in one process, and Newton-Schulz amplifies that full-rank 2^-9
    difference to a tenth of the experts' update in one step). The gradient norms agree to 1e-4, not
    1e-6: torch's fp32 norm on CPU accumulates a 2M-element tensor to ~1e-4 (the float64 norm of the
    same gradient differs by that), in either run; clipping scales the whole gradient, which Muon's
    normalization and AdamW's ratio cancel within a step."""
    recipe = _recipe("torchtitan_moe", "torchtitan", "triton")
    import torch

    import dmuon
    from support import titan_moe

    ns = dmuon.NSConfig(method="standard", dtype=torch.float32)
    results = run_distributed(titan_moe.train_fp32_experts, 4, RECIPES, recipe.STEPS, ns, timeout_s=900)
    first = results[0]
    with titan_moe.fp32_experts():
        ref = titan_moe.reference(recipe, first["initial"], recipe.STEPS, 4)
    assert first["losses"] == pytest.approx(ref["losses"], rel=1e-5, abs=0)
    assert first["norms"] == pytest.approx(ref["norms"], rel=1e-4, abs=0)
    assert all(n > recipe.MAX_NORM for n in ref["norms"])  # every step clipped
    worst = max(ref["params"], key=lambda n: (first["params"][n] - ref["params"][n]).abs().max().item())
    err = (first["params"][worst] - ref["params"][worst]).abs().max().item()
    assert err <= 1e-5, (worst, err)
    moved = min((first["params"][n] - first["initial"][n]).abs().max().item() for n in ref["params"])
    assert moved > 1e-3  # every parameter trained: the comparison is not of untouched weights
    for r in results[1:]:
        assert all(torch.equal(r["params"][n], first["params"][n]) for n in ref["params"])
    assert sum(r["orthogonalized"] for r in results) == ref["muon_matrices"] == 167
