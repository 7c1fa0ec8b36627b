"""Owner-update cost tables: seconds (or FLOPs) per (matrix shape, batch size), and the ``--costs`` file format.

Balancers read a :class:`CostTable`; :mod:`dmuon.plan.profile` measures one,
:func:`analytical_table` estimates one from :mod:`dmuon.plan.cost`, and
:func:`load_costs_json` reads one from a file.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Iterable, Mapping

from dmuon.plan.cost import update_cost
from dmuon.util.records import check_positive_int, check_shape, iter_records, load_json, positive_int

Shape = tuple[int, int]
_FIELDS = ("shape", "batch", "seconds")


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


def table_from_records(records: object, where: str = "costs") -> CostTable:
    """Builds a table from ``[{"shape": [m, n], "batch": int, "seconds": float}, ...]``.

    Args:
        records: The parsed JSON.
        where: Prefix of error messages (e.g. the file name).

    Raises:
        ValueError: Naming the entry index and field that is malformed or duplicated.
    """
    entries: dict[tuple[Shape, int], float] = {}
    for at, entry in iter_records(records, where, "cost entries", _FIELDS, _FIELDS):
        shape = check_shape(at, entry["shape"])
        batch = check_positive_int(at, "batch", entry["batch"])
        seconds = entry["seconds"]
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not (
            math.isfinite(seconds) and seconds > 0
        ):
            raise ValueError(f"{at}: field 'seconds' must be a finite number > 0, got {seconds!r}")
        key = (shape, batch)
        if key in entries:
            raise ValueError(f"{at}: duplicate entry for shape {list(shape)} batch {batch}")
        entries[key] = float(seconds)
    return CostTable(entries, unit="seconds", source="file")


def load_costs_json(path: str | os.PathLike) -> CostTable:
    """Reads a ``--costs`` file (see :func:`table_from_records`).

    Raises:
        FileNotFoundError: If ``path`` does not exist.
        ValueError: For invalid JSON or a malformed entry (index and field named).
    """
    return table_from_records(load_json(path), os.fspath(path))


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
        if m < 1 or n < 1 or not positive_int(count):
            raise ValueError(f"shapes_with_counts: need positive dims and count, got {item!r}")
        out[(m, n)] = out.get((m, n), 0) + count
    return dict(sorted(out.items()))


def analytical_table(shapes_with_counts, ns_steps: int = 5) -> CostTable:
    """Batch-1 FLOP estimates from :func:`dmuon.plan.cost.update_cost` (linear in the batch)."""
    shapes = normalize_shapes(shapes_with_counts)
    return CostTable({(s, 1): update_cost(s, ns_steps) for s in shapes}, unit="flops", source="analytical")
