"""Lightning Fabric with FSDP2 (``ModelParallelStrategy``) and dmuon, in Fabric's one-call setup.

The optimizer is built on the model before Fabric shards it; dmuon sets itself up at the first
forward (or at a checkpoint load, whichever comes first)::

    fabric = L.Fabric(strategy=ModelParallelStrategy(parallelize), devices=8)
    model = TinyLM()
    model, optimizer = fabric.setup(model, dmuon.DMuon(model, lr=0.02, adamw=dmuon.AdamWConfig(lr=3e-3)))

Run: ``python examples/integrations/lightning_fabric.py`` (2 gloo CPU ranks) or under torchrun.
It trains 4 steps (2 micro-batches each, clipping), saves after step 2, resumes a fresh run from
that checkpoint, and checks the resumed run and a run with the optimizer built after sharding
(``fabric.setup_module``, then ``fabric.setup_optimizers``) end bit for bit where the first run ends.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dmuon  # noqa: E402
from tiny import TinyLM, assert_runs_equal, batch, full_params, fully_shard_tiny, launch, scratch_dir  # noqa: E402

STEPS, SAVE_AT, MICRO = 4, 2, 2
KW = dict(lr=0.02, adamw=dmuon.AdamWConfig(lr=3e-3))


def parallelize(model, device_mesh):
    """Fabric's parallelize_fn: FSDP2 over the data-parallel dim."""
    return fully_shard_tiny(model, device_mesh["data_parallel"])


def train(rank: int, world_size: int, path: str, mode: str) -> dict:
    """``mode``: ``"one-call"`` (saves at SAVE_AT), ``"resume"`` (loads it) or ``"after"`` (DMuon after sharding)."""
    import lightning as L
    from lightning.fabric.strategies import ModelParallelStrategy

    fabric = L.Fabric(accelerator="cuda" if torch.cuda.is_available() else "cpu", devices=world_size,
                      strategy=ModelParallelStrategy(parallelize, data_parallel_size=world_size,
                                                     tensor_parallel_size=1))
    fabric.launch()
    torch.manual_seed(0)
    model = TinyLM()
    if mode == "after":
        model = fabric.setup_module(model)
        optimizer = fabric.setup_optimizers(dmuon.DMuon(model.module, **KW))
    else:
        model, optimizer = fabric.setup(model, dmuon.DMuon(model, **KW))
    state = {"model": model, "optimizer": optimizer, "step": 0}
    if mode == "resume":
        fabric.load(path, state)
    losses = []
    for step in range(state["step"], STEPS):
        for micro in range(MICRO):
            ids, labels = batch(MICRO * step + micro, rank)
            with fabric.no_backward_sync(model, enabled=micro < MICRO - 1):
                loss = model(ids, labels)["loss"] / MICRO
                fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if mode == "one-call" and step + 1 == SAVE_AT:
            state["step"] = step + 1
            fabric.save(path, state)
    return {"params": full_params(model), "losses": losses}


def run(rank: int, world_size: int, directory: str) -> dict:
    path = os.path.join(directory, "fabric-ckpt")
    return {mode: train(rank, world_size, path, mode) for mode in ("one-call", "resume", "after")}


def check(out: dict) -> None:
    assert_runs_equal(out, "one-call", "resume", "after")


if __name__ == "__main__":
    result = launch(run, scratch_dir())
    check(result)
    print("losses", [round(v, 4) for v in result["one-call"]["losses"]], "- resumed and built-after runs equal: ok")
