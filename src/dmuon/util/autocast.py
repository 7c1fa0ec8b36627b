"""Owner work outside the caller's autocast.

A training loop written wholly inside ``torch.autocast`` (forward, backward and ``step()``) would run
dmuon's own math in the autocast dtype wherever it runs on the caller's thread: Newton-Schulz's
matmuls in ``step()`` in bfloat16 although ``NSConfig.dtype`` says float32, while the same matrices'
NS on the NS worker thread (autocast is thread-local, and the worker never enters it) runs as
configured. A matrix's update would then depend on where its NS ran. Every entry point that runs
owner work on the caller's thread (``step()``, the backward hooks' launches, the next forward's
applies) enters :func:`autocast_off` first, so the optimizer computes as configured everywhere, as
torch's own optimizers do under autocast (their ops are pointwise, which autocast leaves alone).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


@contextlib.contextmanager
def autocast_off(device: torch.device | str | None = None) -> Iterator[None]:
    """Autocast disabled, for the CPU and ``device``'s type, where the caller enabled it (nothing is
    entered otherwise: a hook that runs per parameter pays one flag read per device type)."""
    kinds = ["cpu"]
    if device is not None and torch.device(device).type not in kinds:
        kinds.append(torch.device(device).type)
    enabled = [kind for kind in kinds if torch.is_autocast_enabled(kind)]
    if not enabled:
        yield
        return
    with contextlib.ExitStack() as stack:
        for kind in enabled:
            stack.enter_context(torch.autocast(kind, enabled=False))
        yield
