"""Test setup: makes ``dmuon.bench`` importable (see ``_bench_import.py``)."""

from __future__ import annotations

import pathlib
import sys

_TESTS = str(pathlib.Path(__file__).resolve().parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

import _bench_import  # noqa: E402

_bench_import.ensure_importable()
