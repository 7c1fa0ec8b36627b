"""The Hugging Face Trainer with FSDP2 (``fsdp_config`` version 2) and dmuon::

    args = TrainingArguments(..., fsdp=True, fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["Block"]},
                             learning_rate=3e-3, weight_decay=0.1)
    trainer = Trainer(model=model, args=args, train_dataset=data,
                      optimizer_cls_and_kwargs=(dmuon.DMuon, {"module": model, "lr": 0.02,
                                                              "adamw": {"lr": args.learning_rate}}))

The Trainer builds the optimizer from its parameter groups before accelerate shards the model
(``module=`` names the model they belong to); its weight-decay grouping holds: ``weight_decay`` of
a group applies to its Muon and AdamW halves, so biases and norms (the Trainer's
``weight_decay=0.0`` group) are not decayed. ``optimizer_cls_and_kwargs`` passes no learning rate:
``adamw={"lr": args.learning_rate}`` gives the Trainer's to AdamW (or ``lr=args.learning_rate`` with
``adjust_lr_fn="match_rms_adamw"``: one rate for both).

Run: ``accelerate launch examples/integrations/hf_trainer.py`` on GPUs. The Trainer turns FSDP2 on
only with an accelerator; launched plainly (2 gloo CPU ranks, what the tests run) the script sets
accelerate's state to FSDP itself (:class:`CPUFSDP2Trainer`), so the Trainer runs its real FSDP2 path.
It trains 4 steps (accumulation over 2 micro-batches, clipping at 1.0), checkpoints every 2, resumes
a fresh Trainer from checkpoint-2 and checks that it ends bit for bit where the first run ends.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dmuon  # noqa: E402
from tiny import TinyLM, assert_runs_equal, batch, full_params, launch, scratch_dir  # noqa: E402

STEPS, SAVE_EVERY = 4, 2


def trainer_class():
    from transformers import Trainer

    class CPUFSDP2Trainer(Trainer):
        """Test-only on CPU ranks: accelerate's state set to FSDP2 (it enables FSDP only on accelerators)."""

        def create_accelerator_and_postprocess(self):
            super().create_accelerator_and_postprocess()
            if not torch.cuda.is_available():
                from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

                self.accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
                self.accelerator.state.distributed_type = DistributedType.FSDP
                self.is_fsdp_enabled = True

        def _wrap_model(self, model, training=True, dataloader=None):
            self._cpu_fsdp2()
            return super()._wrap_model(model, training, dataloader)

        def _save_checkpoint(self, model, trial):
            self._cpu_fsdp2()
            return super()._save_checkpoint(model, trial)

        def _load_from_checkpoint(self, *args, **kwargs):
            self._cpu_fsdp2()
            return super()._load_from_checkpoint(*args, **kwargs)

        def _load_optimizer_and_scheduler(self, checkpoint):
            self._cpu_fsdp2()
            return super()._load_optimizer_and_scheduler(checkpoint)

        def _cpu_fsdp2(self):
            from accelerate.utils import DistributedType

            if not torch.cuda.is_available():  # (accelerate's CPU state forgets it in prepare)
                self.accelerator.state.distributed_type = DistributedType.FSDP

    return CPUFSDP2Trainer


class Data(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, k: int) -> dict:
        ids, labels = batch(k, 0, size=1)
        return {"input_ids": ids[0], "labels": labels[0]}


def train(rank: int, world_size: int, out: str, resume: bool) -> dict:
    from transformers import TrainingArguments

    args = TrainingArguments(
        output_dir=out, max_steps=STEPS, per_device_train_batch_size=2, gradient_accumulation_steps=2,
        learning_rate=3e-3, weight_decay=0.1, max_grad_norm=1.0, lr_scheduler_type="linear",
        save_strategy="steps", save_steps=SAVE_EVERY, report_to=[], logging_steps=1, seed=0,
        use_cpu=not torch.cuda.is_available(), dataloader_num_workers=0,
        fsdp=True, fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["Block"]})
    torch.manual_seed(0)
    model = TinyLM()
    trainer = trainer_class()(model=model, args=args, train_dataset=Data(),
                              optimizer_cls_and_kwargs=(dmuon.DMuon, {"module": model, "lr": 0.02,
                                                                      "adamw": {"lr": args.learning_rate}}))
    trainer.train(resume_from_checkpoint=os.path.join(out, f"checkpoint-{SAVE_EVERY}") if resume else None)
    opt = trainer.optimizer.optimizer  # accelerate's wrapper around DMuon
    groups = [{"algorithm": g["algorithm"], "weight_decay": g["weight_decay"], "initial_lr": g["initial_lr"],
               "params": g["param_names"]} for g in opt.param_groups]
    return {"params": full_params(trainer.model), "groups": groups,
            "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e]}


def run(rank: int, world_size: int, directory: str) -> dict:
    out = os.path.join(directory, "hf-trainer")
    return {"first": train(rank, world_size, out, False), "resumed": train(rank, world_size, out, True)}


def check(out: dict) -> None:
    assert_runs_equal(out, "first", "resumed")


if __name__ == "__main__":
    result = launch(run, scratch_dir())
    check(result)
    for g in result["first"]["groups"]:
        print(g["algorithm"], "weight_decay", g["weight_decay"], "lr", g["initial_lr"], g["params"])
    print("losses", result["first"]["losses"], "- resumed run equal: ok")
