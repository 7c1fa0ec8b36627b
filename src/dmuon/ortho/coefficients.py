"""Coefficient schedules for quintic Newton–Schulz iterations.

Every iteration applies the odd matrix polynomial ``p(X) = a X + b (X Xᵀ) X + c (X Xᵀ)² X``
to the current iterate. A *schedule* is the sequence of ``(a, b, c)`` triples used by
the successive iterations; a single triple repeated ``steps`` times is the classic
Muon setting.

Sources of the constants:

* ``KELLER`` — Keller Jordan's Muon reference implementation
  (https://github.com/KellerJordan/Muon), also the default of
  ``torch.optim.Muon``. The triple maximises the slope at zero; it does not converge
  to the polar factor but leaves singular values roughly in ``[0.68, 1.13]``.
* Polar Express — N. Amsel, D. Persson, C. Musco, R. M. Gower, "The Polar Express:
  Optimal Matrix Sign Methods and Their Application to the Muon Algorithm",
  arXiv:2505.16932 (2025), Algorithm 1 (degree 5, lower spectral bound 1e-3). The raw
  table below is copied from the paper; after its last entry the optimal polynomial
  is numerically constant, so that entry repeats for any further iteration. Named
  ``"polar_express"`` (alias ``"polar_express_8"``).
* Polar Express, five steps (``"polar_express_5"``) — the other polynomial sequence
  that KellerJordan/modded-nanogpt (``train_gpt.py``), microsoft/dion
  (``dion/polar_express.py``) and karpathy/nanochat (``nanochat/optim.py``) ship:
  computed with the paper's method for exactly five iterations ("num_iters=5,
  safety_factor=2e-2, cushion=2"), its safety factor already inside the table, and
  run after dividing the input by ``1.02 * ||X||_F`` instead of ``||X||_F``.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Hashable, Sequence
from typing import Union

Coeffs = tuple[float, float, float]
Schedule = list[Coeffs]
CoefficientSpec = Union[Coeffs, Sequence[Sequence[float]], str]

KELLER: Coeffs = (3.4445, -4.7750, 2.0315)

# Raw (unsafeguarded) Polar Express coefficients, Amsel et al. 2025, Algorithm 1.
POLAR_EXPRESS_RAW: tuple[Coeffs, ...] = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
)

POLAR_EXPRESS_SAFETY = 1.01

# The five-step table, quoted exactly from KellerJordan/modded-nanogpt train_gpt.py
# (commit f411b3d, "Computed for num_iters=5, safety_factor=2e-2, cushion=2"); microsoft/dion
# dion/polar_express.py (commit 0a059a4) and karpathy/nanochat nanochat/optim.py hold the same
# numbers. Not the paper's eight-entry table: a different polynomial at every step.
POLAR_EXPRESS_5: tuple[Coeffs, ...] = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)

# modded-nanogpt and dion divide the input by ``||X||_F * (1 + 2e-2) + eps`` (nanochat by 1.01) before
# the five polynomials, so the table's safety margin holds after a bf16 normalisation.
POLAR_EXPRESS_5_NORM_SAFETY = 1.02


def _check_triple(coeffs: Sequence[float], where: str = "coefficients") -> Coeffs:
    if isinstance(coeffs, (str, bytes)) or len(coeffs) != 3:
        raise ValueError(f"{where} must be an (a, b, c) triple, got {coeffs!r}")
    try:
        triple = tuple(float(v) for v in coeffs)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where} must contain numbers, got {coeffs!r}") from exc
    if not all(math.isfinite(v) for v in triple):
        raise ValueError(f"{where} must be finite, got {coeffs!r}")
    return triple  # type: ignore[return-value]


def _check_steps(steps: int) -> int:
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"steps must be a non-negative int, got {steps!r}")
    return steps


def fixed_schedule(coeffs: Sequence[float], steps: int) -> Schedule:
    """Repeats one coefficient triple for every iteration.

    Args:
        coeffs: The ``(a, b, c)`` triple.
        steps: Number of iterations.

    Returns:
        A list of ``steps`` identical triples.

    Raises:
        ValueError: If ``coeffs`` is not a finite triple or ``steps`` is negative.
    """
    return [_check_triple(coeffs)] * _check_steps(steps)


def polar_express_schedule(steps: int, safety: float = POLAR_EXPRESS_SAFETY) -> Schedule:
    """Per-iteration Polar Express coefficients (Amsel et al. 2025).

    The table entries are optimal for singular values in ``[1e-3, 1]``. Following the
    paper's Algorithm 1, every table entry except the final, fixed-point one
    ``(1.875, -1.25, 0.375)`` is replaced by ``(a / s, b / s**3, c / s**5)``, i.e. the
    polynomial ``p(x / s)``, so that singular values slightly above 1 after a
    low-precision normalisation are still mapped near 1. Iterations beyond the table
    repeat the (unscaled) final entry, which the paper notes is the numerically
    converged optimum.

    Args:
        steps: Number of iterations.
        safety: Safety factor ``s >= 1``; ``1.0`` gives the raw table.

    Returns:
        A list of ``steps`` triples.

    Raises:
        ValueError: If ``steps`` is negative or ``safety`` is not a finite number >= 1.
    """
    _check_steps(steps)
    if not (isinstance(safety, (int, float)) and math.isfinite(safety) and safety >= 1.0):
        raise ValueError(f"safety must be a finite number >= 1, got {safety!r}")
    s = float(safety)
    table = [(a / s, b / s**3, c / s**5) for a, b, c in POLAR_EXPRESS_RAW[:-1]]
    table.append(POLAR_EXPRESS_RAW[-1])
    return [table[min(i, len(table) - 1)] for i in range(steps)]


def polar_express_5_schedule(steps: int = 5, norm_safety: float = POLAR_EXPRESS_5_NORM_SAFETY) -> Schedule:
    """The five-step Polar Express schedule of modded-nanogpt and dion (:data:`POLAR_EXPRESS_5`).

    Those libraries divide the input by ``norm_safety * ||X||_F``; every NS path here divides by
    ``||X||_F``, so the division by ``s = norm_safety`` is folded into the first polynomial:
    ``p1(X / s) = (a/s) X + (b/s**3) (X Xᵀ) X + (c/s**5) (X Xᵀ)² X``, the same map in exact
    arithmetic. The other four entries are the table's as they are.

    Args:
        steps: Iterations, at most 5 (fewer: the first ``steps`` entries, as nanochat's
            ``polar_express_coeffs[:ns_steps]``).
        norm_safety: ``s >= 1``: 1.02 as modded-nanogpt and dion, 1.01 as nanochat, 1.0 for the
            bare table.

    Raises:
        ValueError: If ``steps`` is above 5 (the table is computed for exactly five iterations
            and its last entry is no fixed point, so it does not extend) or ``norm_safety`` is not
            a finite number >= 1.
    """
    _check_steps(steps)
    if steps > len(POLAR_EXPRESS_5):
        raise ValueError(f"'polar_express_5' is a five-iteration schedule; steps={steps} (use steps <= 5, or "
                         "'polar_express' for the paper's table, which extends)")
    if not (isinstance(norm_safety, (int, float)) and math.isfinite(norm_safety) and norm_safety >= 1.0):
        raise ValueError(f"norm_safety must be a finite number >= 1, got {norm_safety!r}")
    s = float(norm_safety)
    (a, b, c), *rest = POLAR_EXPRESS_5
    return [(a / s, b / s**3, c / s**5), *rest][:steps]


SCHEDULE_NAMES = ("keller", "polar_express", "polar_express_8", "polar_express_5")
"""The names :func:`resolve_schedule` takes (``"polar_express"`` and ``"polar_express_8"`` are one table)."""


def resolve_schedule(spec: CoefficientSpec, steps: int) -> Schedule:
    """Turns any accepted coefficient specification into an explicit schedule.

    Resolved once per (hashable) specification: the optimizer resolves its
    schedule on every NS call.

    Args:
        spec: One ``(a, b, c)`` triple (repeated ``steps`` times), a sequence of triples
            (its first ``steps`` entries are used), or a name: ``"polar_express"`` (the
            paper's eight-entry table; alias ``"polar_express_8"``), ``"polar_express_5"``
            (modded-nanogpt's and dion's five-step set, at most 5 steps) or ``"keller"``.
        steps: Number of iterations.

    Returns:
        A list of exactly ``steps`` triples.

    Raises:
        ValueError: For an unknown name, malformed triples, or a schedule shorter
            than ``steps``.
    """
    if isinstance(spec, Hashable) and isinstance(steps, Hashable):
        try:
            return list(_resolve_cached(spec, steps))
        except TypeError:  # a tuple holding unhashable items
            pass
    return _resolve(spec, steps)


@functools.lru_cache(maxsize=64)
def _resolve_cached(spec: CoefficientSpec, steps: int) -> tuple[Coeffs, ...]:
    return tuple(_resolve(spec, steps))


def _resolve(spec: CoefficientSpec, steps: int) -> Schedule:
    _check_steps(steps)
    if isinstance(spec, str):
        name = spec.lower().replace("-", "_")
        if name in ("polar_express", "polar_express_8"):
            return polar_express_schedule(steps)
        if name == "polar_express_5":
            return polar_express_5_schedule(steps)
        if name == "keller":
            return fixed_schedule(KELLER, steps)
        raise ValueError(f"unknown coefficient schedule {spec!r}; use one of {', '.join(map(repr, SCHEDULE_NAMES))}")
    if not isinstance(spec, Sequence) or len(spec) == 0:
        raise ValueError(f"coefficients must be a triple, a schedule or a name, got {spec!r}")
    # A flat triple of numbers is a fixed schedule; a sequence of sequences is explicit.
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in spec):
        return fixed_schedule(spec, steps)  # type: ignore[arg-type]
    schedule = [_check_triple(t, f"schedule entry {i}") for i, t in enumerate(spec)]
    if len(schedule) < steps:
        raise ValueError(f"schedule has {len(schedule)} entries but steps={steps}")
    return schedule[:steps]


def schedule_key(schedule: Sequence[Coeffs]) -> str:
    """A short stable fingerprint of a schedule, for cache keys."""
    if isinstance(schedule, tuple):
        try:
            return _schedule_key_cached(schedule)
        except TypeError:
            pass
    return _schedule_key(schedule)


@functools.lru_cache(maxsize=64)
def _schedule_key_cached(schedule: tuple[Coeffs, ...]) -> str:
    return _schedule_key(schedule)


def _schedule_key(schedule: Sequence[Coeffs]) -> str:
    text = ";".join(",".join(repr(float(v)) for v in t) for t in schedule)
    return hashlib.sha1(text.encode()).hexdigest()[:12]
