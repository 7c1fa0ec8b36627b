"""The ``vla`` workload: size presets, their checks, synthetic data and the CE + flow-matching loss.

The model and its dimensions are :class:`~dmuon.bench.models.vla_modules.VLAModel` and
:class:`~dmuon.bench.models.vla_modules.VLASize`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dmuon.bench.models.data import make_global_batch, seeded_generator
from dmuon.bench.models.vla_modules import VLAModel, VLASize
from dmuon.bench.models.workload import Batch, Workload, lm_cross_entropy, module_device

VLA_DATA_SALT = 0x56_4C_41  # distinct data streams for the two families

VLA_SIZES: dict[str, VLASize] = {
    "tiny": VLASize(image_size=32, patch=8, dv=48, vision_layers=2, vision_heads=4,
                    vision_mlp=192, dl=64, lm_layers=2, lm_heads=8, lm_kv_heads=2,
                    lm_head_dim=8, lm_mlp=192, vocab=256, text_len=16, da=32,
                    expert_layers=2, expert_heads=4, expert_kv_heads=2,
                    expert_head_dim=8, expert_mlp=96, action_horizon=8,
                    action_dim=7, state_dim=8, batch_size=2),
    # About the optimizer cost of qwen2 "small" (4.1M matrix params in 60 matrices). The
    # synthetic presets give the action expert 2 key/value heads so that --tp 2 splits them;
    # "large" keeps Pi0's one (multi-query attention: tp would have to replicate k/v).
    "small": VLASize(image_size=64, patch=8, dv=128, vision_layers=2, vision_heads=4,
                     vision_mlp=512, dl=256, lm_layers=3, lm_heads=8, lm_kv_heads=2,
                     lm_head_dim=32, lm_mlp=768, vocab=2048, text_len=64, da=192,
                     expert_layers=3, expert_heads=4, expert_kv_heads=2,
                     expert_head_dim=48, expert_mlp=512, action_horizon=16,
                     action_dim=14, state_dim=14, batch_size=2),
    "medium": VLASize(image_size=224, patch=14, dv=768, vision_layers=12, vision_heads=12,
                      vision_mlp=3072, dl=1024, lm_layers=12, lm_heads=16, lm_kv_heads=4,
                      lm_head_dim=64, lm_mlp=4096, vocab=32000, text_len=64, da=512,
                      expert_layers=12, expert_heads=8, expert_kv_heads=2,
                      expert_head_dim=64, expert_mlp=2048, action_horizon=50,
                      action_dim=32, state_dim=32, batch_size=4),
    # Pi0 geometry: SigLIP So400m/14 + Gemma-2B + Gemma-300M action expert.
    "large": VLASize(image_size=224, patch=14, dv=1152, vision_layers=27, vision_heads=16,
                     vision_mlp=4304, dl=2048, lm_layers=18, lm_heads=8, lm_kv_heads=1,
                     lm_head_dim=256, lm_mlp=16384, vocab=257152, text_len=48, da=1024,
                     expert_layers=18, expert_heads=8, expert_kv_heads=1,
                     expert_head_dim=256, expert_mlp=4096, action_horizon=50,
                     action_dim=32, state_dim=32, batch_size=4),
}
"""Size presets of the ``vla`` workload."""


def check_vla_size(size: VLASize) -> None:
    """Raises ``ValueError`` for inconsistent VLA dimensions."""
    if size.image_size % size.patch:
        raise ValueError(f"image_size {size.image_size} is not a multiple of patch {size.patch}")
    if size.dv % size.vision_heads:
        raise ValueError(f"dv {size.dv} is not divisible by vision_heads {size.vision_heads}")
    for name, heads, kv, hd in (("lm", size.lm_heads, size.lm_kv_heads, size.lm_head_dim),
                                ("expert", size.expert_heads, size.expert_kv_heads,
                                 size.expert_head_dim)):
        if heads % kv:
            raise ValueError(f"{name}_heads {heads} is not divisible by {name}_kv_heads {kv}")
        if hd % 2:
            raise ValueError(f"{name}_head_dim must be even, got {hd}")


def vla_workload(size_name: str, size: VLASize, seed: int, dtype: torch.dtype) -> Workload:
    """The ``vla`` workload at ``size`` (checked by :func:`check_vla_size`); call under a seeded RNG."""
    model = VLAModel(size).to(dtype=dtype)
    model.train()

    def make_batch(step: int, rank: int) -> Batch:
        gen = seeded_generator(seed, VLA_DATA_SALT, step, rank)
        b = size.batch_size
        shape_a = (b, size.action_horizon, size.action_dim)
        return {
            # Sampled in float32 so the data does not depend on ``dtype``.
            "images": torch.randn(b, 3, size.image_size, size.image_size,
                                  generator=gen).to(dtype),
            "input_ids": torch.randint(0, size.vocab, (b, size.text_len), generator=gen),
            "state": torch.randn(b, size.state_dim, generator=gen).to(dtype),
            "actions": torch.randn(shape_a, generator=gen).to(dtype),
            "noise": torch.randn(shape_a, generator=gen).to(dtype),
            "time": (torch.rand(b, generator=gen) * 0.999 + 0.001).to(dtype),
        }

    def loss_fn(model: nn.Module, batch: Batch) -> torch.Tensor:
        device = module_device(model)
        batch = {k: v.to(device) for k, v in batch.items()}
        t = batch["time"][:, None, None]
        noisy = t * batch["noise"] + (1 - t) * batch["actions"]
        target = batch["noise"] - batch["actions"]
        logits, velocity = model(batch["images"], batch["input_ids"], batch["state"],
                                 noisy, batch["time"])
        ce = lm_cross_entropy(logits, batch["input_ids"])
        mse = F.mse_loss(velocity.float(), target.float())
        return ce + mse

    non_muon = ("lm_head.", "state_proj.", "action_in_proj.", "action_out_proj.")
    muon = tuple(
        n for n, p in model.named_parameters()
        if p.ndim == 2 and n.endswith(".weight") and not n.startswith(non_muon)
        and isinstance(model.get_submodule(n.rsplit(".", 1)[0]), nn.Linear)
    )
    tokens = size.image_tokens + size.text_len + 1 + size.action_horizon
    return Workload(
        name="vla",
        model=model,
        blocks=model.blocks,
        loss_fn=loss_fn,
        make_batch=make_batch,
        global_batch=make_global_batch(make_batch),
        tokens_per_rank=size.batch_size * tokens,
        size=size_name,
        config=size,
        muon_param_names=muon,
    )
