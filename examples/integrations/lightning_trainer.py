"""The Lightning Trainer with FSDP2 (``ModelParallelStrategy``) and dmuon: the Trainer calls
``configure_optimizers`` after ``configure_model`` has sharded the model, so dmuon is built as
after any ``fully_shard``::

    class LitLM(L.LightningModule):
        def configure_model(self):
            fully_shard_tiny(self.model, self.device_mesh["data_parallel"])
        def configure_optimizers(self):
            return dmuon.DMuon(self.model, lr=0.02, adamw=dmuon.AdamWConfig(lr=3e-3))

    L.Trainer(strategy=ModelParallelStrategy(), accumulate_grad_batches=2, gradient_clip_val=1.0).fit(LitLM(), data)

Run: ``python examples/integrations/lightning_trainer.py`` (2 gloo CPU ranks) or under torchrun.
It trains 4 steps (accumulation over 2 micro-batches, clipping), checkpointing every 2 (Lightning's
``ModelCheckpoint``), resumes a fresh Trainer from the step-2 checkpoint (``fit(..., ckpt_path=)``)
and checks it ends bit for bit where the first run ends.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dmuon  # noqa: E402
from tiny import TinyLM, assert_runs_equal, batch, full_params, fully_shard_tiny, launch, scratch_dir  # noqa: E402

STEPS, SAVE_AT, MICRO = 4, 2, 2


def lit_class():
    import lightning as L

    class LitLM(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = TinyLM()
            self.losses: list[float] = []

        def configure_model(self) -> None:
            fully_shard_tiny(self.model, self.device_mesh["data_parallel"])

        def training_step(self, data, index):
            ids, labels = data
            loss = self.model(ids, labels)["loss"]
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return dmuon.DMuon(self.model, lr=0.02, adamw=dmuon.AdamWConfig(lr=3e-3))

    return LitLM


class Data(torch.utils.data.Dataset):
    """This rank's batches in order (Lightning's distributed sampler is off: each rank reads its own);
    one epoch is SAVE_AT steps, so the checkpoint falls on an epoch's end (the loader is not resumable)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def __len__(self) -> int:
        return SAVE_AT * MICRO

    def __getitem__(self, k: int):
        ids, labels = batch(k, self.rank, size=1)
        return ids[0], labels[0]


def train(rank: int, world_size: int, directory: str, resume: str | None = None) -> dict:
    """Trains STEPS steps, checkpointing every SAVE_AT (Lightning's ModelCheckpoint), or resumes ``resume``."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import ModelParallelStrategy

    every = ModelCheckpoint(dirpath=directory, every_n_train_steps=SAVE_AT, save_top_k=-1)
    trainer = L.Trainer(accelerator="cuda" if torch.cuda.is_available() else "cpu", devices=world_size,
                        strategy=ModelParallelStrategy(data_parallel_size=world_size, tensor_parallel_size=1),
                        max_steps=STEPS, accumulate_grad_batches=MICRO, gradient_clip_val=1.0,
                        use_distributed_sampler=False, logger=False, callbacks=[every] if resume is None else [],
                        enable_checkpointing=resume is None, enable_progress_bar=False, enable_model_summary=False)
    module = lit_class()()
    loader = torch.utils.data.DataLoader(Data(rank), batch_size=1)
    trainer.fit(module, loader, ckpt_path=resume)
    return {"params": full_params(module.model), "losses": module.losses}


def run(rank: int, world_size: int, directory: str) -> dict:
    whole = train(rank, world_size, directory)
    saved = os.path.join(directory, f"epoch=0-step={SAVE_AT}.ckpt")
    return {"whole": whole, "resume": train(rank, world_size, directory, resume=saved)}


def check(out: dict) -> None:
    assert_runs_equal(out, "whole", "resume")


if __name__ == "__main__":
    result = launch(run, scratch_dir())
    check(result)
    print("losses", [round(v, 4) for v in result["whole"]["losses"]], "- resumed run equal: ok")
