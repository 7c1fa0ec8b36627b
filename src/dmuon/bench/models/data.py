"""Deterministic synthetic data: one seeded stream per (seed, family, step, rank)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from dmuon.bench.models.workload import Batch


def check_int(name: str, value: object, low: int) -> None:
    """Raises ``ValueError`` unless ``value`` is an int (not a bool) ``>= low`` (0 or 1)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        kind = "non-negative" if low == 0 else "positive"
        raise ValueError(f"{name} must be a {kind} int, got {value!r}")


def seeded_generator(seed: int, salt: int, step: int, rank: int) -> torch.Generator:
    """Returns a CPU generator seeded from ``(seed, salt, step, rank)``."""
    check_int("step", step, 0)
    check_int("rank", rank, 0)
    state = np.random.SeedSequence([seed, salt, step, rank]).generate_state(2, np.uint32)
    gen = torch.Generator(device="cpu")
    gen.manual_seed(int(state[0]) << 31 | int(state[1]) >> 1)
    return gen


def _concat_batches(batches: Sequence[Batch]) -> Batch:
    """Concatenates dict batches along the sample dimension."""
    return {key: torch.cat([b[key] for b in batches], dim=0) for key in batches[0]}


def make_global_batch(make_batch: Callable[[int, int], Batch]) -> Callable[[int, int], Batch]:
    """Builds ``global_batch(step, world_size)`` from ``make_batch``."""

    def global_batch(step: int, world_size: int) -> Batch:
        check_int("world_size", world_size, 1)
        return _concat_batches([make_batch(step, r) for r in range(world_size)])

    return global_batch
