"""The ``qwen2`` workload: a scaled-down Qwen2.5-style causal LM from ``transformers``, with size presets."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dmuon.bench.models.data import make_global_batch, seeded_generator
from dmuon.bench.models.workload import Batch, Workload, lm_cross_entropy, module_device

TRANSFORMERS_MODULE = "transformers.models.qwen2.modeling_qwen2"
"""The transformers module every bench rank imports to build its model: the rank server imports it once
(:func:`dmuon.testing.spawn.preload`), as its import costs each rank seconds of CPU."""


QWEN2_DATA_SALT = 0x51_57_45_4E  # distinct data streams for the two families


@dataclass(frozen=True)
class Qwen2Size:
    """Dimensions of a Qwen2-style benchmark decoder."""

    hidden: int
    """Model width (``hidden_size``)."""

    intermediate: int
    """MLP width (``intermediate_size``)."""

    layers: int
    """Number of decoder layers."""

    heads: int
    """Number of query heads."""

    kv_heads: int
    """Number of key/value heads (grouped-query attention)."""

    vocab: int
    """Vocabulary size."""

    seq_len: int
    """Tokens per sample."""

    batch_size: int
    """Samples per rank per step."""


QWEN2_SIZES: dict[str, Qwen2Size] = {
    # Seconds for a couple of steps on 4 CPU processes.
    "tiny": Qwen2Size(hidden=64, intermediate=192, layers=2, heads=8, kv_heads=2,
                      vocab=256, seq_len=32, batch_size=2),
    # The default of `dmuon bench`: the workload the core-runtime issue specifies, a
    # small decoder with LLM-like proportions (vocabulary 64x the width, Qwen2.5-7B has
    # 42x, -0.5B 170x) and a few hundred tokens per rank, on which FSDP2 +
    # torch.optim.Muon's optimizer step costs about 4x the forward+backward on 4 gloo CPU
    # ranks (4.5-5.2x measured on a 2-core x86_64 CPU, docs/benchmarks/).
    "mini": Qwen2Size(hidden=128, intermediate=384, layers=4, heads=4, kv_heads=2,
                      vocab=8192, seq_len=256, batch_size=2),
    # Twice as wide with a 4x smaller vocabulary and half the tokens: an optimizer-heavy
    # workload, FSDP2 + torch.optim.Muon's optimizer ~19x its forward+backward on the
    # same machine; the default `dmuon bench` took ~100 s on it.
    "small": Qwen2Size(hidden=256, intermediate=768, layers=4, heads=8, kv_heads=2,
                       vocab=2048, seq_len=128, batch_size=2),
    # Qwen2.5-0.5B geometry (untied).
    "medium": Qwen2Size(hidden=896, intermediate=4864, layers=24, heads=14, kv_heads=2,
                        vocab=151936, seq_len=1024, batch_size=4),
    # Qwen2.5-1.5B geometry (untied).
    "large": Qwen2Size(hidden=1536, intermediate=8960, layers=28, heads=12, kv_heads=2,
                       vocab=151936, seq_len=2048, batch_size=4),
}
"""Size presets of the ``qwen2`` workload."""


def build_qwen2(size: Qwen2Size, dtype: torch.dtype) -> nn.Module:
    """Builds a randomly initialised ``Qwen2ForCausalLM`` (uses the global RNG)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    last_error: Exception | None = None
    for attn in ("sdpa", "eager"):
        config = Qwen2Config(
            vocab_size=size.vocab,
            hidden_size=size.hidden,
            intermediate_size=size.intermediate,
            num_hidden_layers=size.layers,
            num_attention_heads=size.heads,
            num_key_value_heads=size.kv_heads,
            max_position_embeddings=max(4096, size.seq_len),
            tie_word_embeddings=False,
            use_cache=False,
            attention_dropout=0.0,
        )
        config._attn_implementation = attn
        try:
            model = Qwen2ForCausalLM(config)
        except (ValueError, ImportError) as err:  # sdpa unavailable: fall back
            last_error = err
            continue
        return model.to(dtype=dtype)
    raise RuntimeError("could not build Qwen2ForCausalLM") from last_error


def qwen2_workload(name: str, size_name: str, size: Qwen2Size, seed: int,
                   dtype: torch.dtype) -> Workload:
    """The ``qwen2`` (or ``tiny``) workload at ``size``; call under a seeded RNG."""
    model = build_qwen2(size, dtype)
    model.train()
    blocks = list(model.model.layers)

    def make_batch(step: int, rank: int) -> Batch:
        gen = seeded_generator(seed, QWEN2_DATA_SALT, step, rank)
        ids = torch.randint(0, size.vocab, (size.batch_size, size.seq_len), generator=gen)
        return {"input_ids": ids}

    def loss_fn(model: nn.Module, batch: Batch) -> torch.Tensor:
        ids = batch["input_ids"]
        device = module_device(model)
        if ids.device != device:
            ids = ids.to(device)
        logits = model(input_ids=ids, use_cache=False).logits
        return lm_cross_entropy(logits, ids)

    muon = tuple(
        n for n, p in model.named_parameters()
        if p.ndim == 2 and n.startswith("model.layers.")
    )

    return Workload(
        name=name,
        model=model,
        blocks=blocks,
        loss_fn=loss_fn,
        make_batch=make_batch,
        global_batch=make_global_batch(make_batch),
        tokens_per_rank=size.batch_size * size.seq_len,
        size=size_name,
        config=size,
        muon_param_names=muon,
    )
