"""The owner's whole work for a batch of matrices, written once.

:class:`dmuon.DMuon`, the profiler (:mod:`dmuon.plan.profile`) and the
gather-then-compute baseline all call :func:`owner_update`, so what is
profiled and priced is by construction what runs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .api import orthogonalize_many
from .autotune import Autotuner
from .config import NSConfig

GROUP_KEYS = {"ns_coefficients": "coefficients", "ns_steps": "steps", "eps": "eps"}
"""Param-group keys (torch.optim.Muon's) that override :class:`NSConfig` fields per group."""


def owner_update(directions: Sequence[torch.Tensor], ns: NSConfig, group: Mapping[str, Any] | None = None,
                 autotuner: Autotuner | None = None) -> list[torch.Tensor]:
    """Newton-Schulz of full 2-D directions (same-shape ones batched as ``ns`` decides).

    Args:
        directions: The owner's full directions, in ``ns.dtype``.
        ns: The NS configuration.
        group: A param group whose ``ns_coefficients``/``ns_steps``/``eps`` override ``ns``.
        autotuner: For ``method="auto"``/``batching="auto"`` (default: the process-wide one).

    Returns:
        The orthogonalized updates, in input order, in ``ns.dtype``.
    """
    settings = ns.kwargs()
    for key, field in GROUP_KEYS.items():
        if group is not None and key in group:
            settings[field] = group[key]
    return orthogonalize_many(directions, autotuner=autotuner, **settings)
