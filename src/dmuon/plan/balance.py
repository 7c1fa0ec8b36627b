"""Owner assignment: map each matrix to exactly one rank.

Two levels:

* :func:`round_robin` and :func:`lpt` take one cost per matrix and return owners.
* :func:`balance` takes matrix *kinds* with per-batch-size costs (measured
  tables batch same-shape matrices) and returns a :class:`BalanceResult` with
  owners, the batch sizes each rank should run and batch-aware loads. It is
  where ``"milp"`` and ``"auto"`` live; every balancer is scored with the same
  batch-aware loads, so the numbers compare.
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass, field
from typing import Hashable, Sequence

from dmuon.plan import milp as _milp
from dmuon.plan.batches import split_into_batches
from dmuon.plan.milp import Kind, best_partition

BALANCERS = ("greedy", "lpt", "round_robin", "milp", "auto")
"""Accepted balancer names; ``"greedy"`` is an alias of ``"lpt"``."""
# Above this many variables even "milp" runs LPT: building the model alone
# would take longer than the solve budget.
MILP_MAX_VARIABLES = 200_000
# "auto" solves the MILP up to this many variables (Qwen2.5-7B on 1024 ranks
# with the analytical model has 4097) and runs LPT beyond.
AUTO_MAX_VARIABLES = 20_000
DEFAULT_TIME_LIMIT_S = 10.0
DEFAULT_MEMORY_FACTOR = 1.25


def canonical(balancer: str) -> str:
    """The balancer's canonical name (``"greedy"`` -> ``"lpt"``).

    Raises:
        ValueError: For an unknown name.
    """
    if balancer not in BALANCERS:
        raise ValueError(f"balancer must be one of {BALANCERS}, got {balancer!r}")
    return "lpt" if balancer == "greedy" else balancer


def round_robin(costs: Sequence[float], world_size: int) -> list[int]:
    """Matrix ``i`` goes to rank ``i mod world_size``; the comparison point."""
    return [i % world_size for i in range(len(costs))]


def lpt(
    costs: Sequence[float],
    world_size: int,
    *,
    sizes: Sequence[float] | None = None,
    capacity: float | None = None,
) -> list[int]:
    """Greedy longest-processing-time-first assignment.

    Matrices are taken from the most to the least expensive and each goes to
    the rank with the smallest load so far. Ties break on the lower index and
    the lower rank, so every rank computes the identical assignment.

    With ``sizes`` and ``capacity`` (optimizer-state bytes), a matrix goes to
    the least-loaded rank it still fits on, or to the rank with the fewest
    bytes if it fits nowhere.
    """
    owners = [0] * len(costs)
    order = sorted(range(len(costs)), key=lambda i: (-costs[i], i))
    if sizes is None or capacity is None:
        loads = [(0.0, r) for r in range(world_size)]
        heapq.heapify(loads)
        for i in order:
            load, rank = heapq.heappop(loads)
            owners[i] = rank
            heapq.heappush(loads, (load + costs[i], rank))
        return owners
    load = [0.0] * world_size
    used = [0.0] * world_size
    for i in order:
        fits = [r for r in range(world_size) if used[r] + sizes[i] <= capacity]
        rank = min(fits, key=lambda r: (load[r], r)) if fits else min(range(world_size), key=lambda r: (used[r], r))
        owners[i] = rank
        load[rank] += costs[i]
        used[rank] += sizes[i]
    return owners


def rank_loads(costs: Sequence[float], owners: Sequence[int], world_size: int) -> list[float]:
    """Total cost owned by each rank."""
    loads = [0.0] * world_size
    for cost, owner in zip(costs, owners):
        loads[owner] += cost
    return loads


@dataclass
class BalanceResult:
    """An owner assignment with its batch plan and figures."""

    balancer: str
    """The name that was asked for (canonical: ``"greedy"`` reads ``"lpt"``)."""
    method: str
    """What produced the owners: ``"milp"``, ``"lpt"`` or ``"round_robin"``."""
    owners: list[int]
    """Owner rank of each matrix, in plan order."""
    loads: list[float]
    """Per-rank cost with each rank's matrices of a kind split into the cheapest batches."""
    batches: list[dict[Hashable, list[int]]]
    """Per rank: kind key -> batch sizes to run (largest first); what the runtime should batch."""
    state_bytes: list[int]
    """Optimizer-state bytes owned by each rank."""
    memory_cap: float | None = None
    """Per-rank state limit the MILP honoured (``None``: unconstrained or not the MILP)."""
    status: str = "heuristic"
    """``"optimal"``, ``"time_limit"`` (best found), or ``"heuristic"`` for greedy methods."""
    lower_bound: float = math.nan
    """Proven lower bound on the makespan (MILP only; NaN otherwise)."""
    solve_seconds: float = 0.0
    """Wall time of the balancer."""
    notes: list[str] = field(default_factory=list)
    """Why anything unexpected happened (fallbacks, relaxed memory caps)."""
    kind_keys: list[Hashable] = field(default_factory=list)
    """Kind key (the keys of ``batches``) of each matrix, in plan order."""
    cost_unit: str = "flops"
    """The unit of ``loads`` and the matrices' costs: ``"seconds"`` (measured, or a table of seconds) or
    ``"flops"`` (the analytical model); ``"mixed"`` where tables of both were given."""

    def ns_batches(self, indices: Sequence[int], rank: int) -> list[list[int]]:
        """Splits matrices owned by ``rank`` into the NS batches this result costed it with.

        One batch per kind where the plan has no batches larger than one: all-ones
        plans come from costs without batch sizes (the analytical model) or from
        batching that did not pay, and either way one call per kind lets the NS
        autotuner choose batched or looped itself.
        """
        sizes = {k: v for k, v in self.batches[rank].items() if any(b > 1 for b in v)}
        return split_into_batches(indices, self.kind_keys, sizes)

    @property
    def makespan(self) -> float:
        """The slowest rank's load: the optimizer step waits for it."""
        return max(self.loads) if self.loads else 0.0

    @property
    def mean(self) -> float:
        """Mean load over ranks."""
        return sum(self.loads) / len(self.loads) if self.loads else 0.0

    @property
    def imbalance(self) -> float:
        """Makespan over mean load (1.0 is perfect)."""
        mean = self.mean
        return self.makespan / mean if mean > 0 else 1.0

    def unit_costs(self, kinds: Sequence[Kind], items: Sequence[int]) -> list[float]:
        """Each matrix's share of its rank's batched cost for its kind; sums per rank to ``loads``."""
        counts = _counts(items, self.owners, len(kinds), len(self.loads))
        out = []
        for k, r in zip(items, self.owners):
            if len(kinds[k].costs) == 1:
                out.append(kinds[k].costs[1])  # linear cost: exactly the matrix's own
            else:
                out.append(best_partition(kinds[k], counts[k][r])[0] / counts[k][r])
        return out


def spread_over_replicas(result: BalanceResult, replicate: int) -> BalanceResult:
    """Relabels the ranks so that balancer slot ``k`` lands in replica ``k % replicate``.

    Balancers fill low slots first (LPT's heaviest matrices, and every matrix when
    there are fewer matrices than ranks). On an HSDP mesh, plan rank ``r * S + s``
    sits in replica ``r``, so without this the owners crowd the first replicas and
    their ranks forward every update across nodes. A permutation keeps every load,
    batch plan and state figure as it is, only moved to another rank.
    """
    world = len(result.loads)
    if replicate <= 1 or world % replicate:
        return result
    shard = world // replicate
    rank_of = [(k % replicate) * shard + k // replicate for k in range(world)]
    moved = [0] * world
    for k, r in enumerate(rank_of):
        moved[r] = k

    def permute(per_slot: list) -> list:
        return [per_slot[moved[r]] for r in range(world)]

    result.owners = [rank_of[o] for o in result.owners]
    result.loads = permute(result.loads)
    result.batches = permute(result.batches)
    result.state_bytes = permute(result.state_bytes)
    return result


def _counts(items: Sequence[int], owners: Sequence[int], n_kinds: int, world_size: int) -> list[list[int]]:
    counts = [[0] * world_size for _ in range(n_kinds)]
    for k, r in zip(items, owners):
        counts[k][r] += 1
    return counts


def evaluate(
    kinds: Sequence[Kind], items: Sequence[int], owners: Sequence[int], world_size: int
) -> tuple[list[float], list[dict[Hashable, list[int]]], list[int]]:
    """Batch-aware loads, batch plan and state bytes of an owner assignment."""
    counts = _counts(items, owners, len(kinds), world_size)
    loads = [0.0] * world_size
    batches: list[dict[Hashable, list[int]]] = [{} for _ in range(world_size)]
    state = [0] * world_size
    for k, kind in enumerate(kinds):
        for r in range(world_size):
            n = counts[k][r]
            if n:
                cost, sizes = best_partition(kind, n)
                loads[r] += cost
                batches[r][kind.key] = sizes
                state[r] += n * kind.state_bytes
    return loads, batches, state


def _result(balancer, method, kinds, items, owners, world_size, start, **extra) -> BalanceResult:
    loads, batches, state = evaluate(kinds, items, owners, world_size)
    return BalanceResult(balancer, method, list(owners), loads, batches, state,
                         solve_seconds=time.perf_counter() - start, kind_keys=[kinds[k].key for k in items],
                         **extra)


def balance(
    kinds: Sequence[Kind],
    items: Sequence[int],
    world_size: int,
    balancer: str = "auto",
    *,
    time_limit_s: float = DEFAULT_TIME_LIMIT_S,
    memory_factor: float | None = DEFAULT_MEMORY_FACTOR,
    max_milp_variables: int | None = None,
) -> BalanceResult:
    """Assigns an owner to every matrix with any balancer, batch-aware.

    ``"milp"`` solves the program of :mod:`dmuon.plan.milp` and falls back to
    memory-aware LPT when it has more than ``max_milp_variables`` variables,
    when HiGHS fails or finds nothing in time, or when LPT turns out better
    (possible only when the time limit cut the search); ``"auto"`` is
    ``"milp"`` if small enough, LPT otherwise. ``"lpt"`` and ``"round_robin"``
    ignore the memory limit, as they always have.

    Args:
        kinds: Matrix kinds (shape/dtype with costs per batch size).
        items: Kind index of each matrix, in plan order.
        world_size: Ranks.
        balancer: A name from :data:`BALANCERS`.
        time_limit_s: MILP wall-clock budget (both phases).
        memory_factor: MILP: per-rank optimizer state at most this times the
            mean (raised automatically, with a note, when infeasible); ``None``
            for no limit.
        max_milp_variables: Above this the MILP is not attempted (default:
            :data:`AUTO_MAX_VARIABLES` for ``"auto"``, :data:`MILP_MAX_VARIABLES`
            for ``"milp"``).

    Raises:
        ValueError: For an unknown balancer, a bad world size or item index.
        ImportError: For ``"milp"`` without scipy (``pip install dmuon[milp]``).
    """
    name = canonical(balancer)
    _check_inputs(name, kinds, items, world_size, time_limit_s)
    start = time.perf_counter()
    unit = [kinds[k].costs[1] for k in items]
    if name == "round_robin":
        return _result(name, "round_robin", kinds, items, round_robin(unit, world_size), world_size, start)
    if name == "lpt":
        return _result(name, "lpt", kinds, items, lpt(unit, world_size), world_size, start)
    if max_milp_variables is None:
        max_milp_variables = AUTO_MAX_VARIABLES if name == "auto" else MILP_MAX_VARIABLES
    return _MilpBalance(name, kinds, items, world_size, memory_factor, start).run(time_limit_s, max_milp_variables)


def _check_inputs(name: str, kinds: Sequence[Kind], items: Sequence[int], world_size: int, time_limit_s) -> None:
    """:func:`balance`'s argument checks (``ImportError`` for ``"milp"`` without scipy)."""
    if name == "milp":
        # Asked for by name, the MILP fails without scipy instead of quietly giving LPT ("auto" falls back
        # with a note naming the extra).
        _milp.require_scipy()
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not (isinstance(time_limit_s, (int, float)) and time_limit_s > 0):
        raise ValueError(f"time_limit_s must be > 0, got {time_limit_s!r}")
    bad = [i for i, k in enumerate(items) if not 0 <= k < len(kinds)]
    if bad:
        raise ValueError(f"items: matrix {bad[0]} has kind {items[bad[0]]}, but there are {len(kinds)} kinds")


class _MilpBalance:
    """``"milp"``/``"auto"``: the memory cap, the memory-aware LPT it falls back to (and compares with),
    and the MILP of :mod:`dmuon.plan.milp`."""

    def __init__(self, name: str, kinds: Sequence[Kind], items: Sequence[int], world_size: int,
                 memory_factor: float | None, start: float) -> None:
        self.name, self.kinds, self.items, self.world_size, self.start = name, kinds, items, world_size, start
        self.unit = [kinds[k].costs[1] for k in items]
        self.counts = [sum(1 for k in items if k == j) for j in range(len(kinds))]
        self.cap, self.notes = _milp.memory_cap(kinds, self.counts, world_size, memory_factor)
        self.sizes = [kinds[k].state_bytes for k in items]
        self.bound = _milp.lower_bound(kinds, self.counts, world_size)
        self.greedy_within(self.cap)

    def greedy_within(self, limit: float | None) -> None:
        """Memory-aware LPT under ``limit``: its owners, loads, state, and whether it fits."""
        self.greedy = lpt(self.unit, self.world_size, sizes=self.sizes, capacity=limit)
        self.g_loads, _, self.g_state = evaluate(self.kinds, self.items, self.greedy, self.world_size)
        self.greedy_fits = limit is None or max(self.g_state) <= limit

    def result(self, algorithm: str, owners: list[int], **kw) -> BalanceResult:
        return _result(self.name, algorithm, self.kinds, self.items, owners, self.world_size, self.start,
                       memory_cap=self.cap, **kw)

    def fallback(self, why: str) -> BalanceResult:
        limit = f" (memory cap {self.cap:.4g} B)" if self.cap is not None else ""
        extra_notes = self.notes + [f"{why}; used LPT{limit}"]
        if not self.greedy_fits:
            extra_notes.append(f"LPT exceeds the memory cap: max state {max(self.g_state)} B > {self.cap:.4g} B")
        return self.result("lpt", self.greedy, lower_bound=self.bound, notes=extra_notes)

    def run(self, time_limit_s: float, max_milp_variables: int) -> BalanceResult:
        kinds, counts, world_size = self.kinds, self.counts, self.world_size
        if world_size == 1 or not self.items:
            return self.result("milp", [0] * len(self.items), status="optimal", lower_bound=self.bound,
                               notes=self.notes)
        batching = any(len(_milp.useful_batch_sizes(k, n)) > 1 for k, n in zip(kinds, counts))
        lpt_optimal = self.greedy_fits and max(self.g_loads) <= self.bound * (1 + _milp.MIP_REL_GAP)
        if lpt_optimal and not batching:
            # Nothing left to optimize: the makespan is at its lower bound and,
            # without batching, the total time is the same for every assignment.
            return self.result("lpt", self.greedy, status="optimal", lower_bound=self.bound,
                               notes=self.notes + ["LPT meets the makespan lower bound; MILP not needed"])
        nvars = _milp.variable_count(kinds, counts, world_size)
        if nvars > max_milp_variables:
            return self.fallback(f"MILP would have {nvars} variables > {max_milp_variables}")
        try:
            sol = self.solve(time_limit_s, lpt_optimal)
        except Exception as err:  # noqa: BLE001 - any solver failure must not stop training
            return self.fallback(f"MILP failed ({type(err).__name__}: {err})")
        if isinstance(sol, BalanceResult):
            return sol
        if sol.counts is None:
            return self.fallback(f"MILP found no solution ({sol.status})")
        owners = _milp.owners_from_counts(self.items, sol.counts)
        result = self.result("milp", owners, status=sol.status, lower_bound=sol.lower_bound,
                             notes=self.notes + sol.phases)
        if self.greedy_fits and max(self.g_loads) < result.makespan * (1 - 1e-12):
            return self.fallback(f"MILP stopped ({sol.status}) at makespan {result.makespan:.6g} "
                                 f"> LPT's {max(self.g_loads):.6g}")
        return result

    def solve(self, time_limit_s: float, lpt_optimal: bool):
        """The MILP's solution, or a result when LPT stands; an infeasible memory cap is relaxed to one some
        assignment is known to meet and the MILP runs again in what is left of the time."""
        kinds, counts, world_size = self.kinds, self.counts, self.world_size
        # At the lower bound LPT's makespan is optimal: only the total time is left to the MILP.
        sol = _milp.solve(kinds, counts, world_size, time_limit_s=time_limit_s, cap_bytes=self.cap,
                          known_makespan=max(self.g_loads) if lpt_optimal else None)
        if sol.counts is None and lpt_optimal:
            return self.result("lpt", self.greedy, status="optimal", lower_bound=self.bound,
                               notes=self.notes + sol.phases + ["LPT meets the makespan lower bound"])
        if sol.counts is None and sol.status == "infeasible" and self.cap is not None:
            # Bin packing can be infeasible at any factor; the greedy packing's
            # own maximum is a cap that some assignment is known to meet.
            packed = lpt(self.sizes, world_size)
            _, _, p_state = evaluate(kinds, self.items, packed, world_size)
            self.cap = float(max(self.cap, max(p_state)))
            self.notes.append(f"memory cap infeasible; relaxed to {self.cap:.4g} B (greedy packing of the state bytes)")
            self.greedy_within(self.cap)
            used = time.perf_counter() - self.start
            sol = _milp.solve(kinds, counts, world_size, time_limit_s=max(time_limit_s - used, 0.1),
                              cap_bytes=self.cap)
        return sol
