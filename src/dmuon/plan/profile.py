"""Measured owner-side costs: seconds per (matrix shape, batch size), cached on disk.

The analytical model (:mod:`dmuon.plan.cost`) counts FLOPs; a device does not
run them at one rate (small matrices are launch-bound, batches of same-shape
matrices amortize launches, tall and wide shapes differ). This module times
the real owner update for every shape and every batch size that can occur and
keeps the table, so balancers see what the optimizer step will see.

One entry is the time of one owner's work for ``b`` same-shape matrices, as
:class:`dmuon.DMuon` runs it: Newton-Schulz for the ``b`` full directions,
already in the NS dtype (they arrive in it), through
:func:`dmuon.ortho.orthogonalize_many` (method and batching from the
autotuner). Momentum and the weight update are not the owner's: every rank
runs them on its own rows of every matrix, whoever owns it.

Cache: one JSON file per header (schema, device fingerprint, torch version,
parameter dtype, NS settings) under ``cache_dir``, else ``$DMUON_CACHE_DIR``,
else ``~/.cache/dmuon`` (the autotuner's conventions). A file that does not
parse or whose header differs is ignored and replaced on the next write;
entries that are not finite positive numbers are dropped. Writes go through a
temporary file and ``os.replace``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping

import torch
import torch.distributed as dist

from dmuon.ortho.autotune import Autotuner, default_cache_dir, device_fingerprint
from dmuon.ortho.coefficients import KELLER, resolve_schedule, schedule_key
from dmuon.ortho import orthogonalize_many
from dmuon.plan.cost import update_cost

# 2: entries time NS alone (momentum and the update run on every rank's shards).
SCHEMA_VERSION = 2
DEFAULT_REPEATS = 3
# Once an entry's timed runs add up to this many seconds, it stops repeating.
DEFAULT_MAX_ENTRY_S = 0.5
NS_KEYS = ("method", "coefficients", "steps", "eps", "dtype", "batching")

Shape = tuple[int, int]


@dataclass
class CostTable:
    """Cost of one owner update of ``batch`` matrices of ``shape``: ``table[(shape, batch)]``."""

    entries: dict[tuple[Shape, int], float]
    """``(shape, batch) -> cost``; ``shape`` is the 2-D ``(rows, cols)`` view NS runs on."""
    unit: str = "seconds"
    """``"seconds"`` for measurements, ``"flops"`` for the analytical model."""
    source: str = "measured"
    """Where the numbers came from: ``"measured"``, ``"cache"``, ``"file"`` or ``"analytical"``."""
    device: str = ""
    """Device fingerprint of a measurement (empty otherwise)."""
    profile_seconds: float = 0.0
    """Wall time rank 0 spent measuring and reading/writing the cache (same on every rank)."""
    measured: int = 0
    """Entries measured by this call (0 when everything came from the cache)."""

    def __getitem__(self, key: tuple[Shape, int]) -> float:
        shape, batch = key
        return self.entries[((int(shape[0]), int(shape[1])), int(batch))]

    def __contains__(self, key: object) -> bool:
        try:
            shape, batch = key  # type: ignore[misc]
            return ((int(shape[0]), int(shape[1])), int(batch)) in self.entries
        except (TypeError, ValueError):
            return False

    def __len__(self) -> int:
        return len(self.entries)

    def shapes(self) -> list[Shape]:
        """Shapes with at least one entry, sorted."""
        return sorted({s for s, _ in self.entries})

    def batch_costs(self, shape: Shape) -> dict[int, float]:
        """``batch -> cost`` for one shape (empty if unknown)."""
        shape = (int(shape[0]), int(shape[1]))
        return {b: c for (s, b), c in sorted(self.entries.items()) if s == shape}

    def missing(self, shapes: Iterable[Shape]) -> list[Shape]:
        """Shapes among ``shapes`` without a batch-1 entry (balancers need one)."""
        return sorted({(int(s[0]), int(s[1])) for s in shapes} - {s for s, b in self.entries if b == 1})

    def to_records(self) -> list[dict]:
        """The ``--costs`` file format: ``[{"shape": [m, n], "batch": b, "seconds": t}, ...]``."""
        return [{"shape": [s[0], s[1]], "batch": b, "seconds": c} for (s, b), c in sorted(self.entries.items())]


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def table_from_records(records: object, where: str = "costs") -> CostTable:
    """Builds a table from ``[{"shape": [m, n], "batch": int, "seconds": float}, ...]``.

    Args:
        records: The parsed JSON.
        where: Prefix of error messages (e.g. the file name).

    Raises:
        ValueError: Naming the entry index and field that is malformed or duplicated.
    """
    if not isinstance(records, list):
        raise ValueError(f"{where}: expected a JSON list of cost entries, got {type(records).__name__}")
    allowed = {"shape", "batch", "seconds"}
    entries: dict[tuple[Shape, int], float] = {}
    for i, entry in enumerate(records):
        at = f"{where}: entry {i}"
        if not isinstance(entry, dict):
            raise ValueError(f"{at}: expected an object, got {type(entry).__name__}")
        unknown = sorted(set(entry) - allowed)
        if unknown:
            raise ValueError(f"{at}: unknown field {unknown[0]!r} (allowed: shape, batch, seconds)")
        for key in ("shape", "batch", "seconds"):
            if key not in entry:
                raise ValueError(f"{at}: missing field {key!r}")
        shape, batch, seconds = entry["shape"], entry["batch"], entry["seconds"]
        if not isinstance(shape, list) or len(shape) != 2 or not all(_positive_int(d) for d in shape):
            raise ValueError(f"{at}: field 'shape' must be a list of two positive integers, got {shape!r}")
        if not _positive_int(batch):
            raise ValueError(f"{at}: field 'batch' must be a positive integer, got {batch!r}")
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not (
            math.isfinite(seconds) and seconds > 0
        ):
            raise ValueError(f"{at}: field 'seconds' must be a finite number > 0, got {seconds!r}")
        key = ((shape[0], shape[1]), batch)
        if key in entries:
            raise ValueError(f"{at}: duplicate entry for shape {shape} batch {batch}")
        entries[key] = float(seconds)
    return CostTable(entries, unit="seconds", source="file")


def load_costs_json(path: str | os.PathLike) -> CostTable:
    """Reads a ``--costs`` file (see :func:`table_from_records`).

    Raises:
        FileNotFoundError: If ``path`` does not exist.
        ValueError: For invalid JSON or a malformed entry (index and field named).
    """
    with open(path, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as err:
            raise ValueError(f"{os.fspath(path)}: invalid JSON: {err}") from err
    return table_from_records(data, os.fspath(path))


def normalize_shapes(shapes_with_counts) -> dict[Shape, int]:
    """``{(m, n): count}`` from a mapping or an iterable of ``(shape, count)``; repeats add up.

    Raises:
        ValueError: Naming ``shapes_with_counts`` for a malformed shape or count.
    """
    pairs = shapes_with_counts.items() if isinstance(shapes_with_counts, Mapping) else shapes_with_counts
    out: dict[Shape, int] = {}
    for item in pairs:
        try:
            shape, count = item
            m, n = (int(d) for d in shape)
        except (TypeError, ValueError):
            raise ValueError(f"shapes_with_counts: expected ((rows, cols), count) pairs, got {item!r}") from None
        if m < 1 or n < 1 or not _positive_int(count):
            raise ValueError(f"shapes_with_counts: need positive dims and count, got {item!r}")
        out[(m, n)] = out.get((m, n), 0) + count
    return dict(sorted(out.items()))


def analytical_table(shapes_with_counts, ns_steps: int = 5) -> CostTable:
    """Batch-1 FLOP estimates from :func:`dmuon.plan.cost.update_cost` (linear in the batch)."""
    shapes = normalize_shapes(shapes_with_counts)
    return CostTable({(s, 1): update_cost(s, ns_steps) for s in shapes}, unit="flops", source="analytical")


def ns_settings(ns_kwargs: Mapping | None) -> tuple[dict, dict]:
    """Validated ``orthogonalize_many`` keywords and their canonical (cache-key) form.

    Args:
        ns_kwargs: Any of ``method``, ``coefficients``, ``steps``, ``eps``,
            ``dtype``, ``batching``; defaults are DMuon's (``"auto"``, Keller
            coefficients, 5 steps, 1e-7, bfloat16, ``"auto"``).

    Raises:
        ValueError: Naming ``ns_kwargs`` for an unknown key or bad value.
    """
    given = dict(ns_kwargs or {})
    unknown = sorted(set(given) - set(NS_KEYS))
    if unknown:
        raise ValueError(f"ns_kwargs: unknown key {unknown[0]!r} (allowed: {', '.join(NS_KEYS)})")
    kwargs = {"method": "auto", "coefficients": KELLER, "steps": 5, "eps": 1e-7, "dtype": torch.bfloat16,
              "batching": "auto", **given}
    if not isinstance(kwargs["dtype"], torch.dtype):
        raise ValueError(f"ns_kwargs: 'dtype' must be a torch.dtype, got {kwargs['dtype']!r}")
    try:
        schedule = resolve_schedule(kwargs["coefficients"], kwargs["steps"])
    except (TypeError, ValueError) as err:
        raise ValueError(f"ns_kwargs: {err}") from err
    key = {"method": str(kwargs["method"]), "schedule": schedule_key(schedule), "steps": len(schedule),
           "eps": float(kwargs["eps"]), "dtype": str(kwargs["dtype"]).replace("torch.", ""),
           "batching": str(kwargs["batching"])}
    return kwargs, key


def _header(device_fp: str, dtype: torch.dtype, ns_key: dict) -> dict:
    return {"schema": SCHEMA_VERSION, "kind": "dmuon-owner-update-profile", "device": device_fp,
            "torch": torch.__version__, "dtype": str(dtype).replace("torch.", ""), "ns": ns_key}


def cache_path(cache_dir: str | os.PathLike | None, header: dict) -> Path:
    """The file that holds the table for ``header``."""
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    tag = hashlib.sha1(json.dumps(header, sort_keys=True).encode()).hexdigest()[:12]
    return root / f"plan-profile-{tag}.json"


def _entry_key(shape: Shape, batch: int) -> str:
    return f"{shape[0]}x{shape[1]}|{batch}"


def _parse_key(key: str) -> tuple[Shape, int] | None:
    try:
        dims, batch = key.split("|")
        m, n = dims.split("x")
        out = ((int(m), int(n)), int(batch))
    except ValueError:
        return None
    return out if min(out[0]) > 0 and out[1] > 0 else None


def read_cache(path: Path, header: dict) -> dict[tuple[Shape, int], float]:
    """Entries of a cache file; empty when missing, unreadable or written for another header."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("header") != header or not isinstance(data.get("entries"), dict):
        return {}
    out = {}
    for key, value in data["entries"].items():
        parsed = _parse_key(key)
        if parsed and isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
                and value > 0:
            out[parsed] = float(value)
    return out


def write_cache(path: Path, header: dict, entries: Mapping[tuple[Shape, int], float]) -> bool:
    """Atomically replaces ``path``; returns False (and keeps going) if the directory is not writable."""
    payload = {"header": header, "entries": {_entry_key(s, b): v for (s, b), v in sorted(entries.items())}}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(payload, f, indent=1, sort_keys=True)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError:
        # A read-only or full cache directory must not stop training: the
        # table is still returned, just measured again next time.
        return False
    return True


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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

    def step() -> None:
        orthogonalize_many(directions, autotuner=autotuner, **ns_kwargs)

    step()
    _sync(device)
    times: list[float] = []
    while len(times) < repeats and sum(times) < max_entry_s:
        t0 = time.perf_counter()
        step()
        _sync(device)
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
    header = _header(device_fp, dtype, ns_key)
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
    if not _positive_int(repeats):
        raise ValueError(f"repeats must be a positive int, got {repeats!r}")
    if not (isinstance(max_entry_s, (int, float)) and max_entry_s > 0):
        raise ValueError(f"max_entry_s must be > 0, got {max_entry_s!r}")
    if max_batch is not None and not _positive_int(max_batch):
        raise ValueError(f"max_batch must be a positive int or None, got {max_batch!r}")
    if budget_s is not None and not (isinstance(budget_s, (int, float)) and budget_s >= 0):
        raise ValueError(f"budget_s must be >= 0 or None, got {budget_s!r}")
    ns_settings(ns_kwargs)  # validate on every rank before any collective
    device = torch.device(device) if device is not None else _default_device()
    args = (shapes, dtype, ns_kwargs, cache_dir, device, repeats, max_entry_s, max_batch, budget_s)

    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return _profile_local(*args)
    payload: list[object] = [None]
    if dist.get_rank(group) == 0:
        try:
            payload[0] = ("ok", _profile_local(*args))
        except Exception as err:  # noqa: BLE001 - the others must not wait forever
            payload[0] = ("error", f"{type(err).__name__}: {err}")
    dist.broadcast_object_list(payload, src=dist.get_global_rank(group, 0), group=group)
    kind, value = payload[0]  # type: ignore[misc]
    if kind != "ok":
        raise RuntimeError(f"profile_costs: profiling failed on rank 0 of the group: {value}")
    return value  # type: ignore[return-value]


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
    header = _header(device_fingerprint(device), dtype, ns_key)
    cached = read_cache(cache_path(cache_dir, header), header)
    entries = {(s, b): v for (s, b), v in cached.items() if s in shapes and b <= shapes[s]}
    table = CostTable(entries, unit="seconds", source="cache", device=header["device"])
    return table if entries and not table.missing(shapes) else None
