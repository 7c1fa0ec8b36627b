"""Makes ``dmuon.bench.models`` / ``dmuon.bench.shapes`` importable for tests.

Puts ``src/`` on ``sys.path``.  If importing the ``dmuon`` package fails
(another subpackage mid-edit), ``dmuon`` and ``dmuon.bench`` are registered as
bare namespace modules instead, so these tests, which only need the two
benchmark modules, still run; a warning says so.  Nothing else is registered.
Also used by spawned worker processes, which do not load ``conftest.py``.
"""

from __future__ import annotations

import importlib
import pathlib
import sys
import types
import warnings

_BENCH = pathlib.Path(__file__).resolve().parents[1]
_SRC = _BENCH.parents[1]


def ensure_importable() -> None:
    """Makes ``import dmuon.bench.models`` work (see the module docstring)."""
    if str(_SRC) not in sys.path:
        sys.path.insert(0, str(_SRC))
    try:
        importlib.import_module("dmuon.bench")
    except Exception as err:  # noqa: BLE001 - any failure of other subpackages
        for name in [m for m in sys.modules if m == "dmuon" or m.startswith("dmuon.")]:
            del sys.modules[name]
        for name, path in (("dmuon", _BENCH.parent), ("dmuon.bench", _BENCH)):
            module = types.ModuleType(name)
            module.__path__ = [str(path)]
            sys.modules[name] = module
        warnings.warn(f"importing dmuon failed ({err!r}); using namespace stubs for "
                      "dmuon and dmuon.bench", stacklevel=2)
