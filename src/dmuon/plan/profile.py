"""Measured owner-side costs: seconds per (matrix shape, batch size), cached on disk.

The analytical model (:mod:`dmuon.plan.cost`) counts FLOPs; a device does not
run them at one rate (small matrices are launch-bound, batches of same-shape
matrices amortize launches, tall and wide shapes differ). This module times
the real owner update for every shape and every batch size that can occur and
keeps the table (a :class:`~dmuon.plan.cost_table.CostTable`), so balancers
see what the optimizer step will see.

One entry is the time of one owner's work for ``b`` same-shape matrices, as
:class:`dmuon.DMuon` runs it: Newton-Schulz for the ``b`` full directions,
already in the NS dtype (they arrive in it), through
:func:`dmuon.ortho.orthogonalize_many` (method and batching from the
autotuner). Momentum and the weight update are not the owner's: every rank
runs them on its own rows of every matrix, whoever owns it.

The cache file (one per device, dtype and NS settings) is
:mod:`dmuon.plan.profile_cache`. With a process group, rank 0 measures and
broadcasts (:func:`dmuon.util.rank0.broadcast_from_rank0`).
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import fields
from typing import Mapping

import torch

from dmuon.ortho.owner import owner_update
from dmuon.ortho.autotune import Autotuner
from dmuon.ortho.config import NSConfig
from dmuon.ortho.timing import device_fingerprint, sync
from dmuon.plan.cost_table import CostTable, analytical_table, load_costs_json, normalize_shapes, table_from_records
from dmuon.plan.profile_cache import SCHEMA_VERSION, cache_header, cache_path, read_cache, write_cache
from dmuon.util.rank0 import broadcast_from_rank0
from dmuon.util.records import positive_int

__all__ = [
    "DEFAULT_MAX_ENTRY_S", "DEFAULT_REPEATS", "NS_KEYS", "SCHEMA_VERSION", "CostTable", "analytical_table",
    "cache_path", "cached_costs", "load_costs_json", "measure_update", "normalize_shapes", "ns_settings",
    "profile_costs", "read_cache", "table_from_records", "write_cache",
]

DEFAULT_REPEATS = 3
# Once an entry's timed runs add up to this many seconds, it stops repeating.
DEFAULT_MAX_ENTRY_S = 0.5
NS_KEYS = tuple(f.name for f in fields(NSConfig))

Shape = tuple[int, int]


def ns_settings(ns_kwargs: Mapping | NSConfig | None) -> tuple[dict, dict]:
    """Validated ``orthogonalize_many`` keywords and their canonical (cache-key) form.

    Args:
        ns_kwargs: An :class:`~dmuon.ortho.config.NSConfig`, or a dict of its
            fields (``method``, ``coefficients``, ``steps``, ``eps``, ``dtype``,
            ``batching``); defaults are DMuon's.

    Raises:
        ValueError: Naming ``ns_kwargs`` for an unknown key or bad value.
    """
    try:
        config = NSConfig.from_mapping(ns_kwargs, "ns_kwargs")
    except ValueError as err:
        message = str(err)
        raise ValueError(message if message.startswith("ns_kwargs") else f"ns_kwargs: {message}") from None
    return config.kwargs(), config.cache_key()


def measure_update(
    shape: Shape,
    batch: int,
    *,
    dtype: torch.dtype,
    ns_kwargs: Mapping,
    device: torch.device,
    repeats: int = DEFAULT_REPEATS,
    max_entry_s: float = DEFAULT_MAX_ENTRY_S,
    autotuner: Autotuner | None = None,
) -> float:
    """Median seconds of an owner's NS for ``batch`` matrices of ``shape`` (after a warm-up).

    The directions come in the NS dtype (``ns_kwargs["dtype"]``, else ``dtype``),
    as the exchange delivers them. The warm-up run also lets the autotuner
    settle its method and batching choices, so they are not timed. Repeats
    stop early once the timed runs add up to ``max_entry_s``.
    """
    gen = torch.Generator(device="cpu").manual_seed(1234 + 7 * batch)
    wire = ns_kwargs.get("dtype", dtype)
    directions = [torch.randn(shape, generator=gen).to(device=device, dtype=wire) for _ in range(batch)]

    ns = NSConfig.from_mapping(ns_kwargs, "ns_kwargs")

    def step() -> None:
        owner_update(directions, ns, autotuner=autotuner)

    step()
    sync(device)
    times: list[float] = []
    while len(times) < repeats and sum(times) < max_entry_s:
        t0 = time.perf_counter()
        step()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _plan_entries(shapes: Mapping[Shape, int], max_batch: int | None) -> list[tuple[Shape, int]]:
    # Batch 1 of every shape first (balancers need it), then growing batches
    # across shapes, so a time budget cuts the least useful entries.
    top = max(shapes.values(), default=0)
    order = []
    for b in range(1, top + 1):
        for s, n in shapes.items():
            if b <= n and (max_batch is None or b <= max_batch):
                order.append((s, b))
    return order


def _profile_local(shapes, dtype, ns_kwargs, cache_dir, device, repeats, max_entry_s, max_batch, budget_s):
    start = time.perf_counter()
    kwargs, ns_key = ns_settings(ns_kwargs)
    device_fp = device_fingerprint(device)
    header = cache_header(device_fp, dtype, ns_key)
    path = cache_path(cache_dir, header)
    cached = read_cache(path, header)
    wanted = _plan_entries(shapes, max_batch)
    todo = [e for e in wanted if e not in cached]
    autotuner = Autotuner(cache_dir=cache_dir) if cache_dir is not None else None
    measured: dict[tuple[Shape, int], float] = {}
    for shape, batch in todo:
        if batch > 1 and budget_s is not None and time.perf_counter() - start > budget_s:
            break
        measured[(shape, batch)] = measure_update(shape, batch, dtype=dtype, ns_kwargs=kwargs, device=device,
                                                  repeats=repeats, max_entry_s=max_entry_s, autotuner=autotuner)
    if measured:
        # Re-read so entries another process added meanwhile are kept.
        write_cache(path, header, {**read_cache(path, header), **measured})
    entries = {e: measured.get(e, cached.get(e)) for e in wanted}
    entries = {e: v for e, v in entries.items() if v is not None}
    return CostTable(entries, unit="seconds", source="measured" if measured else "cache", device=device_fp,
                     profile_seconds=time.perf_counter() - start, measured=len(measured))


def profile_costs(
    shapes_with_counts,
    *,
    dtype: torch.dtype = torch.float32,
    ns_kwargs: Mapping | None = None,
    group=None,
    cache_dir: str | os.PathLike | None = None,
    device: torch.device | str | None = None,
    repeats: int = DEFAULT_REPEATS,
    max_entry_s: float = DEFAULT_MAX_ENTRY_S,
    max_batch: int | None = None,
    budget_s: float | None = None,
) -> CostTable:
    """Measures (or loads) the owner-update cost of every shape at every batch size that can occur.

    With a process group of more than one rank, rank 0 of ``group`` profiles
    and broadcasts the table, so every rank returns the identical table (and
    ranks without a cache agree with rank 0's). Call it on every rank of
    ``group``.

    Args:
        shapes_with_counts: ``{(rows, cols): count}`` or ``((rows, cols), count)``
            pairs; batch sizes ``1..count`` are profiled for each shape.
        dtype: Parameter (and gradient) dtype; momentum is float32 as in DMuon.
        ns_kwargs: ``orthogonalize_many`` keywords (see :func:`ns_settings`);
            part of the cache key.
        group: Process group whose ranks need the table, or ``None``.
        cache_dir: Cache directory (default ``$DMUON_CACHE_DIR`` or
            ``~/.cache/dmuon``); the autotuner used while profiling keeps its
            decisions there too when given.
        device: Device to measure on (default: current CUDA device, else CPU).
        repeats: Timed runs per entry (median); at least 1.
        max_entry_s: Stop repeating an entry once its runs add up to this.
        max_batch: Largest batch size to profile (default: each shape's count).
        budget_s: Stop measuring batches > 1 after this many seconds; batch 1
            of every shape is always measured. ``None``: no budget.

    Returns:
        The :class:`CostTable` (``profile_seconds`` and ``measured`` say what it cost).

    Raises:
        ValueError: For bad arguments (named).
        RuntimeError: On every rank, if profiling failed on rank 0.
    """
    shapes = normalize_shapes(shapes_with_counts)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    if not positive_int(repeats):
        raise ValueError(f"repeats must be a positive int, got {repeats!r}")
    if not (isinstance(max_entry_s, (int, float)) and max_entry_s > 0):
        raise ValueError(f"max_entry_s must be > 0, got {max_entry_s!r}")
    if max_batch is not None and not positive_int(max_batch):
        raise ValueError(f"max_batch must be a positive int or None, got {max_batch!r}")
    if budget_s is not None and not (isinstance(budget_s, (int, float)) and budget_s >= 0):
        raise ValueError(f"budget_s must be >= 0 or None, got {budget_s!r}")
    ns_settings(ns_kwargs)  # validate on every rank before any collective
    device = torch.device(device) if device is not None else _default_device()
    args = (shapes, dtype, ns_kwargs, cache_dir, device, repeats, max_entry_s, max_batch, budget_s)
    return broadcast_from_rank0(lambda: _profile_local(*args), group, "profile_costs: profiling")


def cached_costs(
    shapes_with_counts,
    *,
    dtype: torch.dtype = torch.float32,
    ns_kwargs: Mapping | None = None,
    cache_dir: str | os.PathLike | None = None,
    device: torch.device | str | None = None,
) -> CostTable | None:
    """The cached table for these shapes without measuring; ``None`` unless every shape has batch 1."""
    shapes = normalize_shapes(shapes_with_counts)
    _, ns_key = ns_settings(ns_kwargs)
    device = torch.device(device) if device is not None else _default_device()
    header = cache_header(device_fingerprint(device), dtype, ns_key)
    cached = read_cache(cache_path(cache_dir, header), header)
    entries = {(s, b): v for (s, b), v in cached.items() if s in shapes and b <= shapes[s]}
    table = CostTable(entries, unit="seconds", source="cache", device=header["device"])
    return table if entries and not table.missing(shapes) else None
