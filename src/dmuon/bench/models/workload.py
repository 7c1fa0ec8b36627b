"""What a benchmark workload is (:class:`Workload`), and the loss pieces both families share."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

Batch = dict[str, torch.Tensor]
"""A batch is a dict of tensors whose first dimension is the sample index."""


@dataclass
class Workload:
    """A model together with its sharding units, loss and synthetic data.

    Batches are dicts of tensors whose first dimension indexes samples; every
    rank gets the same number of samples, so the mean loss over
    ``global_batch(step, world_size)`` equals the average of the per-rank mean
    losses.
    """

    name: str
    """Workload family: ``"qwen2"``, ``"vla"`` or ``"tiny"``."""

    model: nn.Module
    """The randomly initialised model (on the CPU, or the ambient default device)."""

    blocks: list[nn.Module]
    """Modules to ``fully_shard`` one by one, in forward order (transformer
    layers); the caller shards the root ``model`` last."""

    loss_fn: Callable[[nn.Module, Any], torch.Tensor]
    """``loss_fn(model, batch)`` returns the scalar mean loss of ``batch``."""

    make_batch: Callable[[int, int], Any]
    """``make_batch(step, rank)`` returns this rank's batch for ``step``:
    deterministic, and different for different ranks and steps."""

    global_batch: Callable[[int, int], Any]
    """``global_batch(step, world_size)`` returns the concatenation of
    ``make_batch(step, r)`` for ``r in range(world_size)`` (along the sample
    dimension), for a single-process reference run."""

    tokens_per_rank: int
    """Token positions one rank processes per step (for throughput numbers):
    ``batch_size * seq_len`` for ``qwen2``; ``batch_size * (image tokens +
    text tokens + state token + action tokens)`` for ``vla``."""

    size: str = ""
    """Size preset the workload was built with."""

    config: Any = None
    """The resolved size preset (a :class:`Qwen2Size` or :class:`VLASize`,
    after ``seq_len`` / ``batch_size`` overrides)."""

    muon_param_names: tuple[str, ...] | None = None
    """Suggested names (as in ``model.named_parameters()``) of the parameters
    for Muon: the 2-D weights of hidden ``nn.Linear`` layers.  Embeddings, the
    LM head, the action input/output and state projections, convolutions,
    biases and norm weights are left for an element-wise optimiser.  ``None``
    when not specified."""


def lm_cross_entropy(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of ``logits[:, :-1]`` against ``tokens[:, 1:]``."""
    vocab = logits.shape[-1]
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, vocab).float(), tokens[:, 1:].reshape(-1)
    )


def module_device(model: nn.Module) -> torch.device:
    """Device of the model's first parameter (CPU if it has none)."""
    for p in model.parameters():
        return p.device
    return torch.device("cpu")
