"""One validated Newton-Schulz configuration, shared by planning, profiling, the optimizer and the baseline."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch

from .autotune import METHODS
from .coefficients import KELLER, CoefficientSpec, resolve_schedule, schedule_key

NS_METHODS: tuple[str, ...] = ("auto",) + METHODS
"""Accepted ``method`` values: ``"auto"`` and every method the autotuner can pick."""
NS_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
"""Accepted ``dtype`` values."""
BATCHINGS: tuple[str, ...] = ("auto", "batched", "looped")
"""Accepted ``batching`` values."""
OPTIMIZER_KEYWORDS: dict[str, str] = {"ns_method": "method", "ns_coefficients": "coefficients",
                                      "ns_steps": "steps", "eps": "eps", "ns_dtype": "dtype"}
"""The torch.optim-style NS keywords of ``DMuon`` and the gather baseline, and the field each sets."""


@dataclass(frozen=True)
class NSConfig:
    """How every owner orthogonalizes: one frozen record, checked when built.

    :func:`dmuon.prepare` prices (and with ``profile=True`` measures) the owner
    update with it, :class:`dmuon.DMuon` runs it, and the gather-then-compute
    baseline runs the same, so what is planned is what runs. ``DMuon``'s
    torch.optim-style keywords (``ns_method``, ``ns_coefficients``,
    ``ns_steps``, ``eps``, ``ns_dtype``) build one.
    """

    method: str = "auto"
    """``"standard"`` (torch.optim.Muon's iteration), ``"standard32"`` (the same in float32,
    rounded to ``dtype``), ``"gram"`` (Gram NS) or ``"auto"`` (the fastest that passes the
    accuracy bar, measured per device, shape and batch)."""
    coefficients: CoefficientSpec = KELLER
    """An ``(a, b, c)`` triple, a per-iteration schedule, or a name: ``"polar_express"`` (alias
    ``"polar_express_8"``: the paper's eight-entry table), ``"polar_express_5"`` (modded-nanogpt's
    and dion's five-step set, ``steps <= 5``), ``"keller"``."""
    steps: int = 5
    """Iterations."""
    eps: float = 1e-7
    """Floor of the norm each matrix is divided by."""
    dtype: torch.dtype = torch.bfloat16
    """Dtype NS takes its input in and returns (torch.optim.Muon: bfloat16); directions and
    updates travel in it."""
    batching: str = "auto"
    """Same-shape matrices as one batched call, a loop, or whichever measured faster."""

    def __post_init__(self) -> None:
        if self.method not in NS_METHODS:
            raise ValueError(f"ns method must be one of {NS_METHODS}, got {self.method!r}")
        if self.dtype not in NS_DTYPES:
            raise ValueError(f"ns dtype must be one of {NS_DTYPES}, got {self.dtype!r}")
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or not 0 < self.steps < 100:
            raise ValueError(f"ns steps must be an int in [1, 99], got {self.steps!r}")
        if not (isinstance(self.eps, (int, float)) and self.eps >= 0):
            raise ValueError(f"ns eps must be a number >= 0, got {self.eps!r}")
        if self.batching not in BATCHINGS:
            raise ValueError(f"ns batching must be one of {BATCHINGS}, got {self.batching!r}")
        try:
            resolve_schedule(self.coefficients, self.steps)
        except (TypeError, ValueError) as err:
            raise ValueError(f"ns coefficients: {err}") from err
        if isinstance(self.coefficients, list):
            # Frozen and hashable: a list schedule is kept as nested tuples.
            object.__setattr__(self, "coefficients", tuple(tuple(float(v) for v in t) for t in self.coefficients))

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any] | NSConfig | None, where: str = "ns") -> NSConfig:
        """An ``NSConfig`` from a dict of its fields (an ``NSConfig`` passes through; None: defaults).

        Raises:
            ValueError: Naming ``where`` and the first unknown key.
        """
        if isinstance(values, NSConfig):
            return values
        given = dict(values or {})
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(given) - set(names))
        if unknown:
            raise ValueError(f"{where}: unknown key {unknown[0]!r} (allowed: {', '.join(names)})")
        return cls(**given)

    @classmethod
    def from_keywords(cls, base: NSConfig | None = None, **keywords: Any) -> NSConfig:
        """``base`` (default: the defaults) with the torch.optim-style keywords given (None: unset).

        Raises:
            ValueError: Naming the keyword (``ns_steps: ...``) for a bad value.
        """
        unknown = sorted(set(keywords) - set(OPTIMIZER_KEYWORDS))
        if unknown:
            raise ValueError(f"unknown NS keyword {unknown[0]!r} (allowed: {', '.join(OPTIMIZER_KEYWORDS)})")
        fields_given = {OPTIMIZER_KEYWORDS[k]: v for k, v in keywords.items() if v is not None}
        try:
            return cls.from_mapping({**(base.kwargs() if base is not None else {}), **fields_given})
        except ValueError as err:
            # The message names the field ("ns steps must ..."); say which keyword set it.
            field = str(err).split(" ")[1].rstrip(":") if str(err).startswith("ns ") else ""
            keyword = {v: k for k, v in OPTIMIZER_KEYWORDS.items()}.get(field, "ns")
            raise ValueError(f"{keyword}: {err}") from None

    def kwargs(self) -> dict[str, Any]:
        """The keywords of :func:`dmuon.ortho.orthogonalize_many`."""
        # Shallow (the fields are immutable): asdict's deep copy costs more than an NS call on small matrices.
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def cache_key(self) -> dict[str, Any]:
        """A canonical, JSON-ready form for cache keys (the schedule as a fingerprint)."""
        schedule = resolve_schedule(self.coefficients, self.steps)
        return {"method": self.method, "schedule": schedule_key(schedule), "steps": len(schedule),
                "eps": float(self.eps), "dtype": str(self.dtype).replace("torch.", ""), "batching": self.batching}

    def differences(self, other: NSConfig) -> list[str]:
        """``field: mine != other's`` for every field that differs."""
        return [f"{f.name}: {getattr(self, f.name)!r} != {getattr(other, f.name)!r}"
                for f in fields(self) if getattr(self, f.name) != getattr(other, f.name)]
