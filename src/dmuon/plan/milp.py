"""Exact owner assignment as a mixed-integer program (HiGHS via ``scipy.optimize.milp``).

Matrices of one *kind* (same shape and dtype) are interchangeable, so the
program does not pick an owner per matrix. It picks how many batches of each
size each rank runs:

* ``x[k, b, r]`` (integer): batches of ``b`` matrices of kind ``k`` on rank ``r``;
* ``sum_{b, r} b * x[k, b, r] = count[k]`` for every kind;
* ``L[r] = sum_{k, b} cost[k, b] * x[k, b, r] <= T`` for every rank;
* optionally ``sum_{k, b} bytes[k] * b * x[k, b, r] <= cap`` (optimizer state);
* ``T >= `` a combinatorial lower bound (:func:`lower_bound`): HiGHS's LP
  bound is only the mean load, so without it an optimal plan is found but
  rarely proven.

Symmetry: the ranks are identical, so every solution has ``W!`` mirror
images. HiGHS detects this permutation symmetry itself. The explicit "loads
non-increasing" ordering (``symmetry="loads"``) measured worse: on
Qwen2.5-7B at 64 ranks with the analytical costs its best plan after 6 s
was 3.2x the mean load, where the plain model proves LPT's 1.296 optimal in
0.03 s. So it is off by default.

Phase 1 minimizes ``T`` (the makespan). Phase 2 keeps ``T <= T*`` and
minimizes the total time, which can only drop by batching better; it is
skipped when every kind has batch size 1 only (then the total is fixed).

This module is the solver only. :func:`dmuon.plan.balance.balance` decides
when to use it and falls back to LPT.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Hashable, Mapping, Sequence

import numpy as np

# HiGHS must give every rank the same answer for the same input: one thread
# and a fixed seed make its branch-and-bound path reproducible.
_DETERMINISTIC = {"threads": 1, "random_seed": 0}
# Relative slack on T* in phase 2, so rounding in HiGHS cannot make phase 2 infeasible.
PHASE2_TOLERANCE = 1e-7
# Relative MIP gap at which HiGHS stops (its own default): 0.01 %, well below
# the run-to-run noise of any measured cost table.
MIP_REL_GAP = 1e-4


@dataclass(frozen=True)
class Kind:
    """A group of interchangeable matrices: same shape (and dtype), same costs."""

    key: Hashable
    """Label reported in batch lists, e.g. the matrix shape."""
    costs: Mapping[int, float]
    """Cost of one batch of ``b`` matrices, by ``b``; batch 1 must be present."""
    state_bytes: int
    """Optimizer-state bytes one matrix costs its owner (4 * numel for fp32 momentum)."""

    def __post_init__(self) -> None:
        if 1 not in self.costs:
            raise ValueError(f"costs of kind {self.key!r} must include batch size 1")
        for b, c in self.costs.items():
            if not isinstance(b, int) or b < 1:
                raise ValueError(f"costs of kind {self.key!r}: batch sizes must be positive ints, got {b!r}")
            if not (isinstance(c, (int, float)) and math.isfinite(c) and c >= 0):
                raise ValueError(f"costs of kind {self.key!r}: batch {b} has cost {c!r}; need finite >= 0")


def _table(kind: Kind) -> tuple[tuple[int, float], ...]:
    return tuple(sorted((int(b), float(c)) for b, c in kind.costs.items()))


@lru_cache(maxsize=4096)
def _best(table: tuple[tuple[int, float], ...], n: int) -> tuple[float, tuple[int, ...]]:
    # Unbounded "exact cover" knapsack: the cheapest way to run n matrices as
    # batches of the measured sizes. Batch 1 is always present, so every n is
    # reachable. Ties prefer larger batches (fewer launches), then fewer batches.
    cost = [0.0] + [math.inf] * n
    choice = [0] * (n + 1)
    for m in range(1, n + 1):
        for b, c in table:
            if b > m:
                break
            cand = c + cost[m - b]
            if cand < cost[m] or (cand == cost[m] and b > choice[m]):
                cost[m], choice[m] = cand, b
    sizes, m = [], n
    while m > 0:
        sizes.append(choice[m])
        m -= choice[m]
    return cost[n], tuple(sorted(sizes, reverse=True))


def best_partition(kind: Kind, n: int) -> tuple[float, list[int]]:
    """The cheapest split of ``n`` matrices of ``kind`` into measured batch sizes.

    Returns:
        ``(cost, batch_sizes)`` with ``batch_sizes`` summing to ``n``, largest first.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    cost, sizes = _best(_table(kind), n)
    return cost, list(sizes)


def useful_batch_sizes(kind: Kind, count: int) -> list[int]:
    """Batch sizes up to ``count`` that some split into smaller batches cannot match.

    A batch of ``b`` that costs at least as much as running its matrices as
    smaller batches can be dropped from the program without losing any optimum:
    every solution that uses it has an equally good one without it.
    """
    table = _table(kind)
    keep = []
    for b, c in table:
        if b > count:
            break
        smaller = tuple((bb, cc) for bb, cc in table if bb < b)
        if b == 1 or c < _best(smaller, b)[0]:
            keep.append(b)
    return keep


def variable_count(kinds: Sequence[Kind], counts: Sequence[int], world_size: int) -> int:
    """Number of MILP variables (``x`` plus ``T``) for this problem."""
    return 1 + world_size * sum(len(useful_batch_sizes(k, n)) for k, n in zip(kinds, counts) if n > 0)


def _ceil_bound(values: Sequence[float], counts: Sequence[int], world_size: int) -> float:
    # Among the m items worth at least v each, some rank holds ceil(m / W):
    # max over thresholds of ceil(m / W) * v bounds the per-rank maximum.
    best, m = 0.0, 0
    for v, n in sorted(zip(values, counts), key=lambda t: -t[0]):
        if n > 0:
            m += n
            best = max(best, math.ceil(m / world_size) * v)
    return best


def lower_bound(kinds: Sequence[Kind], counts: Sequence[int], world_size: int) -> float:
    """A makespan no assignment can beat.

    The larger of: the best total split spread evenly over the ranks; the
    cheapest batch any one matrix can run in; and, for the ``m`` matrices
    whose cheapest per-matrix cost is at least ``v``, ``ceil(m / W) * v``.
    """
    active = [(k, n) for k, n in zip(kinds, counts) if n > 0]
    if not active:
        return 0.0
    mean = sum(best_partition(k, n)[0] for k, n in active) / world_size
    single = max(min(c for b, c in k.costs.items() if b <= n) for k, n in active)
    per_item = [min(c / b for b, c in k.costs.items() if b <= n) for k, n in active]
    return max(mean, single, _ceil_bound(per_item, [n for _, n in active], world_size))


def memory_cap(
    kinds: Sequence[Kind], counts: Sequence[int], world_size: int, memory_factor: float | None
) -> tuple[float | None, list[str]]:
    """Per-rank optimizer-state budget: ``memory_factor`` times the mean, raised when provably too tight.

    The cap is raised to the smallest value the pigeonhole argument of
    :func:`lower_bound` allows (at least the largest matrix's state, e.g.
    when there are fewer matrices than ranks), with a note saying so.

    Returns:
        ``(cap_bytes or None, notes)``; ``None`` when ``memory_factor`` is ``None``.

    Raises:
        ValueError: If ``memory_factor`` is below 1 (no assignment could meet it).
    """
    if memory_factor is None:
        return None, []
    if isinstance(memory_factor, bool) or not (isinstance(memory_factor, (int, float)) and memory_factor >= 1.0):
        raise ValueError(f"memory_factor must be a number >= 1 or None, got {memory_factor!r}")
    total = sum(k.state_bytes * n for k, n in zip(kinds, counts))
    cap = memory_factor * total / world_size
    needed = _ceil_bound([float(k.state_bytes) for k in kinds], counts, world_size)
    if needed > cap:
        note = (f"memory cap raised from {memory_factor:g} x mean ({cap:.4g} B) to {needed:.4g} B: "
                "some rank must hold that much state (as many of the largest matrices as ranks allow)")
        return float(needed), [note]
    return cap, []


@dataclass
class MilpSolution:
    """What the two-phase solve returned."""

    counts: list[list[int]] | None
    """``counts[k][r]``: matrices of kind ``k`` on rank ``r``; ``None`` when no solution was found."""
    status: str
    """``"optimal"``, ``"time_limit"`` (best found kept), ``"infeasible"`` or ``"failed: ..."``."""
    makespan: float = math.nan
    """Phase-1 makespan of the solution, in cost units."""
    lower_bound: float = math.nan
    """Proven lower bound on the makespan (HiGHS's, or :func:`lower_bound`'s if larger)."""
    seconds: float = 0.0
    """Wall time of both phases."""
    phases: list[str] = field(default_factory=list)
    """One line per phase: status and time, for reports."""


def require_scipy() -> None:
    """Raises an ImportError naming the extra to install when scipy (HiGHS) is missing.

    scipy is an optional dependency: only this solver needs it, so ``pip install dmuon`` leaves it out.
    """
    try:
        import scipy.optimize  # noqa: F401
        import scipy.sparse  # noqa: F401
    except ImportError as exc:
        raise ImportError("the MILP balancer (balancer='milp') needs scipy, which dmuon installs only with "
                          "its milp extra: pip install dmuon[milp]") from exc


def _run(c, integrality, bounds, constraints, time_limit_s: float, mip_rel_gap: float):
    from scipy.optimize import milp

    options = {"time_limit": max(time_limit_s, 0.05), "mip_rel_gap": mip_rel_gap, **_DETERMINISTIC}
    with warnings.catch_warnings():
        # scipy warns that threads/random_seed go to HiGHS verbatim; that is the intent.
        warnings.simplefilter("ignore", RuntimeWarning)
        return milp(c, integrality=integrality, bounds=bounds, constraints=constraints, options=options)


class _Rows:
    """Sparse constraint rows collected as triplets."""

    def __init__(self) -> None:
        self.r: list[int] = []
        self.c: list[int] = []
        self.v: list[float] = []
        self.lo: list[float] = []
        self.hi: list[float] = []

    def add(self, entries, lower: float, upper: float) -> None:
        row = len(self.lo)
        for j, v in entries:
            self.r.append(row)
            self.c.append(j)
            self.v.append(float(v))
        self.lo.append(lower)
        self.hi.append(upper)

    def constraint(self, nvar: int):
        from scipy.optimize import LinearConstraint
        from scipy.sparse import coo_array

        A = coo_array((self.v, (self.r, self.c)), shape=(len(self.lo), nvar)).tocsr()
        return LinearConstraint(A, np.array(self.lo), np.array(self.hi))


def solve(
    kinds: Sequence[Kind],
    counts: Sequence[int],
    world_size: int,
    *,
    time_limit_s: float = 10.0,
    cap_bytes: float | None = None,
    mip_rel_gap: float = MIP_REL_GAP,
    symmetry: str = "none",
    known_makespan: float | None = None,
) -> MilpSolution:
    """Solves the two-phase program above.

    Args:
        kinds: The matrix kinds.
        counts: Matrices of each kind.
        world_size: Ranks.
        time_limit_s: Wall-clock budget for both phases together; on expiry the
            best solution found so far is kept.
        cap_bytes: Per-rank optimizer-state limit, or ``None``.
        mip_rel_gap: HiGHS stops once the makespan is proven within this
            relative distance of the optimum.
        symmetry: ``"none"`` or ``"loads"`` (rank loads non-increasing; see
            the module docstring for why it is off by default).
        known_makespan: A makespan already proven optimal and achievable
            within ``cap_bytes`` (e.g. LPT's, at :func:`lower_bound`): phase 1
            is skipped and phase 2 keeps ``T`` at most this.

    Returns:
        The :class:`MilpSolution`.

    Raises:
        ValueError: For mismatched ``kinds``/``counts`` or bad options.
        ImportError: Without scipy (the ``milp`` extra).
    """
    require_scipy()
    if len(kinds) != len(counts):
        raise ValueError(f"counts must have one entry per kind ({len(kinds)}), got {len(counts)}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not time_limit_s > 0:
        raise ValueError(f"time_limit_s must be > 0, got {time_limit_s}")
    if symmetry not in ("none", "loads"):
        raise ValueError(f"symmetry must be 'none' or 'loads', got {symmetry!r}")
    program = _Program(kinds, counts, world_size, cap_bytes, symmetry, mip_rel_gap, time.perf_counter())
    if known_makespan is not None:
        program.phases.append("MILP phase 1 skipped: the makespan is known to be optimal")
        t_star = known_makespan / program.cref
        res = program.phase2(t_star, time_limit_s)
        if res.x is None:
            return program.solution(None, f"failed: {res.message.strip()}", program.bound)
        x, status, proven = res.x, "optimal", known_makespan
    else:
        x, status, t_star, proven = program.phase1_then_2(time_limit_s)
        if x is None:
            return program.solution(None, status, program.bound)
    per_kind = program.counts_of(x)
    if per_kind is None:
        return program.solution(None, "failed: rounded solution does not cover every matrix", program.bound)
    return program.solution(per_kind, status, proven, makespan=t_star * program.cref)


class _Program:
    """The two-phase program of one :func:`solve` call: variables ``x[(k, b), r]`` in kind/batch/rank order,
    then ``T``; costs and bytes scaled to O(1) so HiGHS's absolute tolerances mean the same for seconds and
    FLOPs."""

    def __init__(self, kinds: Sequence[Kind], counts: Sequence[int], world_size: int, cap_bytes: float | None,
                 symmetry: str, mip_rel_gap: float, start: float) -> None:
        self.kinds, self.counts, self.W, self.mip_rel_gap, self.start = kinds, counts, world_size, mip_rel_gap, start
        active = [k for k, n in enumerate(counts) if n > 0]
        self.cols = [(k, b) for k in active for b in useful_batch_sizes(kinds[k], counts[k])]
        self.nx = len(self.cols) * world_size
        self.nvar = self.nx + 1
        self.cref = max((kinds[k].costs[b] for k, b in self.cols), default=1.0) or 1.0
        self.mref = max((kinds[k].state_bytes for k in active), default=1) or 1
        self.cost = [kinds[k].costs[b] / self.cref for k, b in self.cols]
        self.constraint = self._constraint(active, cap_bytes, symmetry)
        self.lb, self.ub = np.zeros(self.nvar), np.empty(self.nvar)
        for c, (k, b) in enumerate(self.cols):
            self.ub[c * world_size:(c + 1) * world_size] = counts[k] // b
        self.bound = lower_bound(kinds, counts, world_size)
        self.lb[self.nx], self.ub[self.nx] = self.bound / self.cref * (1 - 1e-9), np.inf
        self.integrality = np.ones(self.nvar)
        self.integrality[self.nx] = 0
        self.two_phase = any(b > 1 for _, b in self.cols)
        self.objective2 = np.zeros(self.nvar)
        self.objective2[:self.nx] = np.repeat(self.cost, world_size)
        self.phases: list[str] = []

    def _constraint(self, active: list[int], cap_bytes: float | None, symmetry: str):
        """Every matrix placed; ``T`` at least every rank's load; the memory cap; the loads' order."""
        W, cols, cost, nx = self.W, self.cols, self.cost, self.nx
        rows = _Rows()
        for k in active:
            rows.add([(c * W + r, b) for c, (kk, b) in enumerate(cols) if kk == k for r in range(W)],
                     self.counts[k], self.counts[k])
        for r in range(W):
            rows.add([(c * W + r, cost[c]) for c in range(len(cols))] + [(nx, -1.0)], -np.inf, 0.0)
        if cap_bytes is not None:
            for r in range(W):
                rows.add([(c * W + r, self.kinds[k].state_bytes * b / self.mref) for c, (k, b) in enumerate(cols)],
                         -np.inf, cap_bytes / self.mref * (1 + 1e-12))
        if symmetry == "loads":
            for r in range(W - 1):
                rows.add([(c * W + r, cost[c]) for c in range(len(cols))]
                         + [(c * W + r + 1, -cost[c]) for c in range(len(cols))], 0.0, np.inf)
        return rows.constraint(self.nvar)

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def phase2(self, t_max: float, budget: float):
        """The least total time with ``T`` at most ``t_max`` (within the phase-2 tolerance)."""
        from scipy.optimize import Bounds

        ub2 = self.ub.copy()
        ub2[self.nx] = t_max * (1 + PHASE2_TOLERANCE) + 1e-9
        res2 = _run(self.objective2, self.integrality, Bounds(self.lb, ub2), self.constraint, budget, self.mip_rel_gap)
        self.phases.append(f"MILP phase 2 (total time, {self.nvar} variables): {res2.message.strip()} "
                           f"after {self.elapsed():.3f}s")
        return res2

    def phase1_then_2(self, time_limit_s: float):
        """Phase 1 (the makespan), then phase 2 in what is left: ``(x, status, t_star, proven bound)``,
        ``x`` None (with the status) when phase 1 found nothing."""
        from scipy.optimize import Bounds

        # Phase 2 can only shave total time; most of the budget goes to the makespan.
        budget1 = time_limit_s * (0.75 if self.two_phase else 1.0)
        objective = np.zeros(self.nvar)
        objective[self.nx] = 1.0
        res = _run(objective, self.integrality, Bounds(self.lb, self.ub), self.constraint, budget1, self.mip_rel_gap)
        self.phases.append(f"MILP phase 1 (makespan, {self.nvar} variables): {res.message.strip()} "
                           f"after {self.elapsed():.3f}s")
        if res.x is None:
            return None, "infeasible" if res.status == 2 else f"failed: {res.message.strip()}", None, None
        x = res.x
        status = "optimal" if res.status == 0 else "time_limit"
        t_star = float(x[self.nx])
        dual = getattr(res, "mip_dual_bound", None)
        proven = max(self.bound, float(dual) * self.cref) if dual is not None and math.isfinite(dual) else self.bound
        if self.two_phase:
            left = time_limit_s - self.elapsed()
            if left > 0.05:
                res2 = self.phase2(t_star, left)
                if res2.x is not None:
                    x = res2.x
            else:
                self.phases.append("MILP phase 2 skipped: time limit spent")
        return x, status, t_star, proven

    def counts_of(self, x) -> list[list[int]] | None:
        """Per kind, per rank, the matrices ``x`` places (None if rounding lost one)."""
        W = self.W
        n = np.rint(x[:self.nx]).astype(np.int64).reshape(len(self.cols), W)
        per_kind = [[0] * W for _ in self.kinds]
        for c, (k, b) in enumerate(self.cols):
            for r in range(W):
                per_kind[k][r] += b * int(n[c, r])
        if any(sum(per_kind[k]) != self.counts[k] for k in range(len(self.kinds))):
            return None
        return per_kind

    def solution(self, per_kind, status: str, lower: float, **kw) -> MilpSolution:
        return MilpSolution(per_kind, status, lower_bound=lower, seconds=self.elapsed(), phases=self.phases, **kw)


def owners_from_counts(items: Sequence[int], counts: Sequence[Sequence[int]]) -> list[int]:
    """Turns per-kind, per-rank counts into one owner per matrix.

    Matrices of each kind are taken in index order and handed out to ranks in
    rank order, so the result depends only on the counts.

    Args:
        items: Kind index of each matrix, in plan order.
        counts: ``counts[k][r]`` matrices of kind ``k`` for rank ``r``.

    Raises:
        ValueError: If the counts do not match the number of matrices of a kind.
    """
    by_kind: dict[int, list[int]] = {}
    for i, k in enumerate(items):
        by_kind.setdefault(k, []).append(i)
    owners = [-1] * len(items)
    for k, row in enumerate(counts):
        members = by_kind.get(k, [])
        if sum(row) != len(members):
            raise ValueError(f"counts for kind {k} sum to {sum(row)} but there are {len(members)} matrices")
        pos = 0
        for r, n in enumerate(row):
            for i in members[pos:pos + n]:
                owners[i] = r
            pos += n
    return owners
