"""``examples/train_lm.py`` loaded from its path (examples/ is no package), and its rank function for
:func:`support.spawn.run_distributed`: the script's run in the test process's own ranks, which start
from the forkserver that has torch and dmuon imported already."""

from __future__ import annotations

import importlib.util
import os
import sys

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples",
                      "train_lm.py")


def script():
    """The example as a module (loaded once per process, as ``train_lm``)."""
    if "train_lm" not in sys.modules:
        spec = importlib.util.spec_from_file_location("train_lm", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        sys.modules["train_lm"] = module
        spec.loader.exec_module(module)
    return sys.modules["train_lm"]


def run_rank(rank: int, world_size: int, args) -> dict:
    """The script's ``run_rank`` on this rank: what its ``main`` spawns each rank to do."""
    return script().run_rank(rank, world_size, args)
