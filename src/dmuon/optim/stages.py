"""One optimizer per rank and pipeline group (``DMuon(pp_group=)``, :func:`claim_pipeline_group`, at
construction); the other check of the stages' optimizers, no weight tied across stages split between Muon and
AdamW, is :func:`dmuon.prepare.ties.check_ties_across_stages` (at the first step).
"""

from __future__ import annotations

import weakref
from typing import Any

from torch import nn

_PIPELINE_MODELS: dict[int, tuple[Any, list[weakref.ref]]] = {}
"""Per pipeline group (by id; the group kept, so that its id is never another's), the models of this
rank's optimizers given it (weakly)."""


def claim_pipeline_group(group: Any, model: nn.Module) -> None:
    """Raises when another live optimizer of this rank steps another model part with the same
    ``pp_group``: each would agree with the other stages on its part's norm and NaNs alone, pairing
    with the wrong parts of the other ranks. A new optimizer for the same model (resume) is fine."""
    if group is None:
        return
    models = [m for m in (ref() for ref in _PIPELINE_MODELS.get(id(group), (group, []))[1]) if m is not None]
    if any(m is not model for m in models):
        raise ValueError("pp_group: another DMuon on this rank already steps another model part with this "
                         "pipeline group; with several parts per rank (interleaved or V schedules) build one "
                         "DMuon over all of them: dmuon.DMuon(torch.nn.ModuleList(parts), ..., pp_group=...)")
    _PIPELINE_MODELS[id(group)] = (group, [weakref.ref(m) for m in models] + [weakref.ref(model)])
