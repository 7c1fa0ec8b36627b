"""The entry point: :func:`build_workload` by family name and size preset."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from dmuon.bench.models.data import check_int
from dmuon.bench.models.moe import MOE_SIZES, moe_workload
from dmuon.bench.models.qwen2 import QWEN2_SIZES, qwen2_workload
from dmuon.bench.models.vla import VLA_SIZES, check_vla_size, vla_workload
from dmuon.bench.models.workload import Workload

WORKLOAD_NAMES: tuple[str, ...] = ("qwen2", "vla", "moe", "tiny")
"""Names accepted by :func:`build_workload`."""

SIZE_NAMES: tuple[str, ...] = ("tiny", "mini", "small", "medium", "large")
"""Size presets accepted by :func:`build_workload` (``"mini"``: ``qwen2`` only)."""

DEFAULT_SIZES: dict[str, str] = {"qwen2": "mini", "vla": "small", "moe": "small", "tiny": "tiny"}
"""The size each family is built with when none is given."""


def resolve_size(name: str, size: str | None) -> str:
    """The size preset :func:`build_workload` uses for ``name`` and ``size``.

    ``"tiny"`` is always built tiny; ``None`` means the family's
    :data:`DEFAULT_SIZES` entry.

    Raises:
        ValueError: For an unknown workload, or a size the family has no preset for.
    """
    if name not in WORKLOAD_NAMES:
        raise ValueError(f"name must be one of {WORKLOAD_NAMES}, got {name!r}")
    if name == "tiny":
        return "tiny"
    if size is None:
        return DEFAULT_SIZES[name]
    presets = {"vla": VLA_SIZES, "moe": MOE_SIZES}.get(name, QWEN2_SIZES)
    if size not in presets:
        raise ValueError(f"size must be one of {tuple(presets)} for {name!r}, got {size!r}")
    return size


def build_workload(name: str, *, size: str | None = None, seq_len: int | None = None,
                   batch_size: int | None = None, seed: int = 0,
                   dtype: torch.dtype = torch.float32) -> Workload:
    """Builds a benchmark workload with randomly initialised weights.

    The model is built under a forked CPU RNG seeded with ``seed``, so the
    global CPU RNG state is left untouched and every rank building the same workload with
    the same ``seed`` gets bit-identical weights.  Parameters are created on
    the ambient default device (use ``with torch.device("meta"):`` to get
    shapes without allocating).

    Args:
        name: ``"qwen2"``, ``"vla"`` or ``"tiny"`` (the tiny ``qwen2``; ``size``
            is then ignored).
        size: ``"tiny"``, ``"small"``, ``"medium"`` or ``"large"`` (and
            ``"mini"`` for ``qwen2``); see :data:`QWEN2_SIZES` and
            :data:`VLA_SIZES`. ``None``: the family's :data:`DEFAULT_SIZES`.
        seq_len: Overrides the preset's tokens per sample (``qwen2``) or text
            tokens per sample (``vla``).
        batch_size: Overrides the preset's samples per rank per step.
        seed: Non-negative seed for the weights and the synthetic data.
        dtype: Floating-point dtype of the parameters and float inputs.

    Returns:
        The :class:`Workload`.

    Raises:
        ValueError: If an argument is invalid.
    """
    size = resolve_size(name, size)
    for arg, value, low in (("seq_len", seq_len, 2), ("batch_size", batch_size, 1)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < low):
            raise ValueError(f"{arg} must be an int >= {low} or None, got {value!r}")
    check_int("seed", seed, 0)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")

    overrides: dict[str, int] = {}
    if batch_size is not None:
        overrides["batch_size"] = batch_size
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if name == "vla":
            if seq_len is not None:
                overrides["text_len"] = seq_len
            cfg = _replace(VLA_SIZES[size], overrides)
            check_vla_size(cfg)
            return vla_workload(size, cfg, seed, dtype)
        if seq_len is not None:
            overrides["seq_len"] = seq_len
        if name == "moe":
            moe = MOE_SIZES[size]
            return moe_workload(size, replace(moe, decoder=_replace(moe.decoder, overrides)), seed, dtype)
        cfg = _replace(QWEN2_SIZES[size], overrides)
        return qwen2_workload(name, size, cfg, seed, dtype)


def _replace(preset: Any, overrides: dict[str, int]) -> Any:
    """``dataclasses.replace`` that keeps the preset when there is nothing to change."""
    return replace(preset, **overrides) if overrides else preset
