"""dmuon.ortho: owner-side orthogonalisation numerics (no torch.distributed).

Public API:

* :func:`orthogonalize` / :func:`orthogonalize_many` — the entry points.
* :func:`newton_schulz` — standard quintic Newton–Schulz (bit-identical to
  ``torch.optim.Muon``'s for bfloat16 2-D input).
* :func:`gram_newton_schulz` — the same iteration in the Gram space.
* Coefficient schedules: :data:`KELLER`, :func:`fixed_schedule`,
  :func:`polar_express_schedule` (the paper's table, ``"polar_express"``),
  :func:`polar_express_5_schedule` (modded-nanogpt's and dion's five steps, ``"polar_express_5"``).
* :class:`Autotuner` — measured, cached method/batching choices.
* :class:`NSConfig` — one validated NS configuration for planning, profiling and running.
"""

from .api import orthogonalize, orthogonalize_many
from .autotune import Autotuner, get_autotuner
from .coefficients import KELLER, fixed_schedule, polar_express_5_schedule, polar_express_schedule, resolve_schedule
from .config import NSConfig
from .gram import gram_newton_schulz
from .newton_schulz import newton_schulz

__all__ = [
    "KELLER",
    "Autotuner",
    "NSConfig",
    "fixed_schedule",
    "get_autotuner",
    "gram_newton_schulz",
    "newton_schulz",
    "orthogonalize",
    "orthogonalize_many",
    "polar_express_5_schedule",
    "polar_express_schedule",
    "resolve_schedule",
]
