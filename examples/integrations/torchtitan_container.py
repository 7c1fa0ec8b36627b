"""torchtitan's optimizer container with dmuon: a subclass that knows ``"DMuon"``, and its config::

    config = DMuonOptimizersContainer.Config(param_groups=[
        ParamGroupConfig(pattern=r".*", optimizer_name="DMuon",
                         optimizer_kwargs={"lr": 0.02, "adamw_lr": 3e-3, "weight_decay": 0.1})])
    optimizers = config.build(model_parts=model_parts)     # after parallelize (fully_shard), as torchtitan does

torchtitan builds each optimizer from parameter groups (``params`` and ``param_names``, plus its
``fused``/``foreach``); the container passes the model part they belong to as ``module=``, and
torchtitan's flat, name-keyed checkpoint state works from the ``param_names`` every DMuon group
carries. Keys in ``optimizer_kwargs`` are param-group keys (``DMuon.split_group`` maps them onto
the Muon and AdamW halves: AdamW's epsilon is ``adamw_eps``, ``eps`` being Muon's NS epsilon);
DMuon's other keywords (``ns``, ``execution``, ``adamw``, ``hsdp_mesh``, ...) go in
``optimizer_factory_kwargs_by_name={"DMuon": {...}}``.

torchtitan's trainer needs CUDA; this script runs what runs on CPU: the container, torchtitan's LR
scheduler container, its gradient clipping and its state-dict code through DCP, on a plain FSDP2
model (2 gloo ranks plainly launched, or under torchrun). It trains 4 steps (2 micro-batches each),
saves after step 2, resumes fresh objects from the checkpoint and checks they end bit for bit where
the first run ends, and that the container without a scheduler equals ``DMuon(model)`` used directly.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dmuon  # noqa: E402
from tiny import TinyLM, assert_runs_equal, batch, full_params, fully_shard_tiny, launch, scratch_dir  # noqa: E402

STEPS, SAVE_AT, MICRO = 4, 2, 2
GROUP = {"lr": 0.02, "adamw_lr": 3e-3, "weight_decay": 0.1, "adamw_weight_decay": 0.01}
"""The param-group keys of the container's DMuon."""
DIRECT = dict(lr=0.02, weight_decay=0.1, adamw=dmuon.AdamWConfig(lr=3e-3, weight_decay=0.01))
""":data:`GROUP` as DMuon's keywords."""


def container_class():
    from torchtitan.components.optimizer import OptimizersContainer

    class DMuonOptimizersContainer(OptimizersContainer):
        """torchtitan's ``OptimizersContainer``, with ``optimizer_name="DMuon"`` available."""

        @dataclass(kw_only=True, slots=True)
        class Config(OptimizersContainer.Config):
            implementation: str = "for-loop"  # "fused" (torchtitan's default) is CUDA's; DMuon's AdamW ignores it

        def _resolve_optimizer_factory(self, name: str):
            if name != "DMuon":
                return OptimizersContainer._resolve_optimizer_factory(name)

            def build(param_groups, **kwargs):
                ids = {id(p) for g in param_groups for p in g["params"]}
                part = next(m for m in self.model_parts if any(id(p) in ids for p in m.parameters()))
                return dmuon.DMuon(param_groups, module=part, **kwargs)

            return build

    return DMuonOptimizersContainer


def optimizers_for(model, mode: str, steps: int):
    """``(optimizers, schedulers)`` for ``mode``: ``"direct"`` ``DMuon(model)``; otherwise torchtitan's
    container over ``[model]``, with its LR scheduler container for ``"container"`` and ``"resume"``."""
    from torchtitan.components.optimizer import LRSchedulersContainer, ParamGroupConfig

    if mode == "direct":
        return dmuon.DMuon(model, **DIRECT), None
    config = container_class().Config(param_groups=[
        ParamGroupConfig(pattern=r".*", optimizer_name="DMuon", optimizer_kwargs=dict(GROUP))])
    optimizers = config.build(model_parts=[model])
    if mode not in ("container", "resume"):
        return optimizers, None
    return optimizers, LRSchedulersContainer.Config(warmup_steps=1, decay_type="cosine").build(
        optimizers=optimizers, training_steps=steps)


def checkpoint(model, optimizers, schedulers, path: str, load: bool) -> None:
    """torchtitan's checkpoint of the model, the container and the schedulers through DCP: saved, or loaded."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    state = {"model": get_model_state_dict(model), "optimizer": optimizers, "lr_scheduler": schedulers}
    if not load:
        dcp.save(state, checkpoint_id=path)
        return
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])


def train(rank: int, world_size: int, path: str, mode: str) -> dict:
    """``mode``: ``"container"`` (saves at SAVE_AT), ``"resume"`` (loads it), ``"plain"`` (container,
    no scheduler) or ``"direct"`` (``DMuon(model)``, no scheduler)."""
    from torchtitan.distributed.utils import clip_grad_norm_

    torch.manual_seed(0)
    model = fully_shard_tiny(TinyLM())
    optimizers, schedulers = optimizers_for(model, mode, STEPS)
    start = 0
    if mode == "resume":
        checkpoint(model, optimizers, schedulers, path, load=True)
        start = SAVE_AT
    losses = []
    for step in range(start, STEPS):
        for micro in range(MICRO):
            model.set_requires_gradient_sync(micro == MICRO - 1)
            ids, labels = batch(MICRO * step + micro, rank)
            loss = model(ids, labels)["loss"] / MICRO
            loss.backward()
        clip_grad_norm_([p for p in model.parameters()], 1.0)
        optimizers.step()
        if schedulers is not None:
            schedulers.step()
        optimizers.zero_grad()
        losses.append(loss.item())
        if mode == "container" and step + 1 == SAVE_AT:
            checkpoint(model, optimizers, schedulers, path, load=False)
    return {"params": full_params(model), "losses": losses}


def run(rank: int, world_size: int, directory: str) -> dict:
    path = os.path.join(directory, "torchtitan-ckpt")
    return {mode: train(rank, world_size, path, mode) for mode in ("container", "resume", "plain", "direct")}


def check(out: dict) -> None:
    assert_runs_equal(out, "container", "resume")
    assert_runs_equal(out, "direct", "plain")


if __name__ == "__main__":
    result = launch(run, scratch_dir())
    check(result)
    print("losses", [round(v, 4) for v in result["container"]["losses"]],
          "- resumed run and container == DMuon(model): ok")
