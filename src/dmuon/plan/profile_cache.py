"""The owner-update profile's cache file: its header (the cache key) and its entries.

One JSON file per header (schema, device fingerprint, torch version,
parameter dtype, NS settings) under ``cache_dir``, else ``$DMUON_CACHE_DIR``,
else ``~/.cache/dmuon`` (the conventions of :mod:`dmuon.util.jsoncache`,
shared with the NS autotuner). A file that does not parse or whose header
differs is ignored and replaced on the next write; entries that are not
finite positive numbers are dropped. Writes are atomic.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Mapping

import torch

from dmuon.util.jsoncache import cache_file, read_entries, resolve_cache_dir, write_entries

# 2: entries time NS alone (momentum and the update run on every rank's shards).
SCHEMA_VERSION = 2

Shape = tuple[int, int]


def cache_header(device_fp: str, dtype: torch.dtype, ns_key: dict) -> dict:
    """The header a table measured on ``device_fp`` for ``dtype`` and the NS settings ``ns_key`` is filed under."""
    return {"schema": SCHEMA_VERSION, "kind": "dmuon-owner-update-profile", "device": device_fp,
            "torch": torch.__version__, "dtype": str(dtype).replace("torch.", ""), "ns": ns_key}


def cache_path(cache_dir: str | os.PathLike | None, header: dict) -> Path:
    """The file that holds the table for ``header``."""
    return cache_file(resolve_cache_dir(cache_dir), "plan-profile", json.dumps(header, sort_keys=True), 12)


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
    out = {}
    for key, value in read_entries(path, header).items():
        parsed = _parse_key(key)
        if parsed and isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
                and value > 0:
            out[parsed] = float(value)
    return out


def write_cache(path: Path, header: dict, entries: Mapping[tuple[Shape, int], float]) -> bool:
    """Atomically replaces ``path``; returns False (and keeps going) if the directory is not writable."""
    return write_entries(path, header, {_entry_key(s, b): v for (s, b), v in sorted(entries.items())})
