"""accelerate with FSDP2 and dmuon: the optimizer built before ``accelerator.prepare``, as for AdamW::

    accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["Block"]),
        gradient_accumulation_steps=2)
    model = TinyLM()
    optimizer = dmuon.DMuon(model, lr=0.02, adamw=dmuon.AdamWConfig(lr=3e-3))
    model, optimizer = accelerator.prepare(model, optimizer)

``prepare`` shards the model and swaps the sharded parameters into the optimizer's param groups;
dmuon sets itself up at the first forward (or at ``load_state``, whichever comes first).

Run: ``accelerate launch examples/integrations/accelerate_fsdp2.py`` on GPUs. accelerate turns FSDP2
on only with an accelerator; launched plainly (2 gloo CPU ranks, what the tests run) the script
sets accelerate's state to FSDP itself (:func:`cpu_fsdp2`), so ``prepare`` runs its real FSDP2 path.
It trains 4 steps (accumulation over 2 micro-batches, ``accelerator.clip_grad_norm_``), saves with
``save_state`` after step 2, resumes a fresh run with ``load_state``, and checks the resumed run and
one with the optimizer built after sharding end bit for bit where the first ends.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dmuon  # noqa: E402
from tiny import TinyLM, assert_runs_equal, batch, full_params, launch, scratch_dir  # noqa: E402

STEPS, SAVE_AT, MICRO = 4, 2, 2
KW = dict(lr=0.02, adamw=dmuon.AdamWConfig(lr=3e-3))


def cpu_fsdp2(accelerator, plugin) -> None:
    """Test-only: accelerate's FSDP2 path on CPU ranks (it enables FSDP only on accelerators)."""
    from accelerate.utils import DistributedType

    if accelerator.state.distributed_type != DistributedType.FSDP:
        accelerator.state.fsdp_plugin = plugin
        accelerator.state.distributed_type = DistributedType.FSDP


def train(rank: int, world_size: int, path: str, mode: str) -> dict:
    """``mode``: ``"before"`` (saves at SAVE_AT), ``"resume"`` (loads it) or ``"after"`` (DMuon after sharding)."""
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                            transformer_cls_names_to_wrap=["Block"])
    accelerator = Accelerator(fsdp_plugin=plugin, gradient_accumulation_steps=MICRO)
    cpu_fsdp2(accelerator, plugin)
    torch.manual_seed(0)
    model = TinyLM()
    if mode == "after":  # the reference: FSDP2 takes no optimizer alone, so a stand-in, then DMuon as it is
        model, _ = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.0))
        optimizer = dmuon.DMuon(model, **KW)
    else:
        optimizer = dmuon.DMuon(model, **KW)
        model, optimizer = accelerator.prepare(model, optimizer)
    cpu_fsdp2(accelerator, plugin)  # (on CPU, accelerate's state forgets it in prepare)
    start = 0
    if mode == "resume":
        accelerator.load_state(path)
        start = SAVE_AT
    losses = []
    for step in range(start, STEPS):
        for micro in range(MICRO):
            ids, labels = batch(MICRO * step + micro, rank)
            with accelerator.accumulate(model):
                loss = model(ids, labels)["loss"]
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                    optimizer.step()
                    optimizer.zero_grad()
        losses.append(loss.item())
        if mode == "before" and step + 1 == SAVE_AT:
            accelerator.save_state(path)
    return {"params": full_params(model), "losses": losses, "set_up": getattr(optimizer, "optimizer", optimizer).is_set_up}


def run(rank: int, world_size: int, directory: str) -> dict:
    path = os.path.join(directory, "accelerate-state")
    return {mode: train(rank, world_size, path, mode) for mode in ("before", "resume", "after")}


def check(out: dict) -> None:
    assert_runs_equal(out, "before", "resume", "after")


if __name__ == "__main__":
    result = launch(run, scratch_dir())
    check(result)
    print("losses", [round(v, 4) for v in result["before"]["losses"]], "- resumed and built-after runs equal: ok")
