"""Owner assignment for a live model: costs for each matrix, then a balancer."""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import torch

from dmuon.plan.balance import (
    DEFAULT_MEMORY_FACTOR, DEFAULT_TIME_LIMIT_S, BalanceResult, balance, canonical,
)
from dmuon.plan.holders import holder_ranks
from dmuon.plan.milp import Kind
from dmuon.plan.plan import MatrixInfo
from dmuon.plan.spread import place_owners
from dmuon.plan.cost_table import CostTable, analytical_table
from dmuon.plan.profile import profile_costs
from dmuon.util.rank0 import broadcast_from_rank0

# Muon keeps one float32 momentum buffer per matrix on its owner.
STATE_BYTES_PER_ELEMENT = 4


def build_kinds(
    shapes: Sequence[tuple[int, int]],
    tables: Mapping[object, CostTable] | CostTable,
    groups: Sequence[object] | None = None,
) -> tuple[list[Kind], list[int]]:
    """Groups matrices into kinds (same shape and group, e.g. dtype) with their cost tables.

    Args:
        shapes: 2-D shape of each matrix, in plan order.
        tables: One table for all matrices, or one per group.
        groups: Group label of each matrix (default: all in one group).

    Returns:
        ``(kinds, items)``: the kinds (keyed by shape, or ``(shape, group)``
        when there are several groups) and each matrix's kind index.

    Raises:
        ValueError: If a table has no batch-1 cost for a shape it must cover.
    """
    groups = list(groups) if groups is not None else [None] * len(shapes)
    several = len(set(groups)) > 1
    counts: dict[tuple, int] = {}
    for shape, g in zip(shapes, groups):
        counts[(tuple(shape), g)] = counts.get((tuple(shape), g), 0) + 1
    index: dict[tuple, int] = {}
    kinds: list[Kind] = []
    items = []
    for shape, g in zip(shapes, groups):
        key = (tuple(shape), g)
        if key not in index:
            table = tables if isinstance(tables, CostTable) else tables[g]
            costs = {b: c for b, c in table.batch_costs(shape).items() if b <= counts[key]}
            if 1 not in costs:
                label = f"shape {shape}" + (f" ({g})" if several else "")
                raise ValueError(f"costs: no batch-1 cost for {label} (table source: {table.source})")
            index[key] = len(kinds)
            kinds.append(Kind(key if several else key[0], costs, STATE_BYTES_PER_ELEMENT * math.prod(shape)))
        items.append(index[key])
    return kinds, items


def _dtype_label(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _profiled_tables(infos: Sequence[MatrixInfo], shapes: list, dtypes: list, ns_steps: int,
                     ns_kwargs: Mapping | None, group, cache_dir) -> dict[str, CostTable]:
    """One measured :class:`CostTable` per parameter dtype (by its label), each over that dtype's shapes."""
    settings = {"steps": ns_steps, **dict(ns_kwargs or {})}
    device = infos[0].param.device if infos else None
    tables = {}
    # Sorted so every rank issues the profile broadcasts in the same order.
    for dtype in sorted(set(dtypes), key=_dtype_label):
        counts: dict[tuple[int, int], int] = {}
        for s, d in zip(shapes, dtypes):
            if d == dtype:
                counts[s] = counts.get(s, 0) + 1
        tables[_dtype_label(dtype)] = profile_costs(counts, dtype=dtype, ns_kwargs=settings, group=group,
                                                    cache_dir=cache_dir, device=device)
    return tables


# Reads better whole: the length is the public docstring (every argument, the determinism contract).
def assign(
    infos: Sequence[MatrixInfo],
    world_size: int,
    balancer: str,
    *,
    ns_steps: int = 5,
    costs: CostTable | None = None,
    profile: bool = False,
    ns_kwargs: Mapping | None = None,
    group=None,
    time_limit_s: float = DEFAULT_TIME_LIMIT_S,
    memory_factor: float | None = DEFAULT_MEMORY_FACTOR,
    cache_dir=None,
    replicate: int = 1,
) -> BalanceResult:
    """Sets ``cost`` and ``owner`` on every matrix; identical on every rank.

    Costs come from ``costs`` if given, else from a measured profile
    (``profile=True``, see :func:`dmuon.plan.profile.profile_costs`), else
    from the analytical FLOP model. Each matrix's ``cost`` is its share of its
    owner's batched cost, so ``Plan.rank_costs()`` equals the result's loads.

    Determinism: LPT and round-robin are pure functions of the inputs. The
    MILP stops on a wall-clock limit, so with ``group`` rank 0 of the group
    balances and broadcasts the result; without a group every rank solves on
    its own, which agrees only when HiGHS finishes before ``time_limit_s``.

    Args:
        infos: The plan's matrices.
        world_size: Ranks that can own matrices (all ranks of the mesh).
        balancer: Balancer name (see :data:`dmuon.plan.balance.BALANCERS`).
        ns_steps: NS iterations, for the analytical model and the profile's default.
        costs: A cost table covering every matrix shape (batch 1 at least).
        profile: Measure the owner update on this device (cached on disk).
        ns_kwargs: ``orthogonalize_many`` settings to profile with (default:
            DMuon's, with ``steps=ns_steps``).
        group: Process group of the ``world_size`` owner ranks, or ``None``.
        time_limit_s: MILP wall-clock budget.
        memory_factor: MILP per-rank optimizer-state limit over the mean, or ``None``.
        cache_dir: Profile cache directory (default ``$DMUON_CACHE_DIR`` or ``~/.cache/dmuon``).
        replicate: Replicas of an HSDP mesh; the owners are spread over them and
            each block's matrices over different owners (:func:`~dmuon.plan.spread.place_owners`),
            and a matrix whose ``pieces`` leave some ranks without rows (an expert slice) is owned
            by a rank holding rows of it where its kind's per-rank counts allow
            (:func:`~dmuon.plan.holders.prefer_holders`), with every balancer.

    Returns:
        The :class:`~dmuon.plan.balance.BalanceResult` (owners, loads, the
        batch sizes each rank should run, notes).

    Raises:
        ValueError: For an unknown balancer, or costs that miss a shape.
    """
    name = canonical(balancer)
    shapes = [info.matrix_shape for info in infos]
    dtypes = [info.param.dtype for info in infos]
    if costs is not None:
        tables: Mapping[object, CostTable] | CostTable = costs
        labels = None
    elif profile:
        tables = _profiled_tables(infos, shapes, dtypes, ns_steps, ns_kwargs, group, cache_dir)
        labels = [_dtype_label(d) for d in dtypes]
    else:
        tables = analytical_table([(s, 1) for s in shapes], ns_steps)
        labels = None
    kinds, items = build_kinds(shapes, tables, labels)

    def solve() -> BalanceResult:
        return balance(kinds, items, world_size, name, time_limit_s=time_limit_s, memory_factor=memory_factor)

    # The MILP stops on a wall-clock limit, so with a group one rank solves and all follow.
    result = broadcast_from_rank0(solve, group, "assign: balancing") if name in ("milp", "auto") else solve()
    # Matrices some ranks do not hold (expert slices, matrices with fewer rows than shard positions) go
    # to a rank holding their rows where the balancer's counts allow: fewer bytes, the same loads.
    holders = holder_ranks([info.pieces for info in infos], replicate, world_size // replicate) \
        if world_size % replicate == 0 else None
    result = place_owners(result, items, [info.block for info in infos], [info.numel for info in infos], replicate,
                          holders)
    units = {t.unit for t in (tables.values() if isinstance(tables, Mapping) else [tables])}
    result.cost_unit = units.pop() if len(units) == 1 else "mixed"
    if profile and costs is None:
        for label, table in tables.items():
            result.notes.append(f"profile ({label}): {table.measured} entries measured on {table.device} "
                                f"in {table.profile_seconds:.1f} s, the rest from the cache")
    for info, owner, cost in zip(infos, result.owners, result.unit_costs(kinds, items)):
        info.owner = owner
        info.cost = cost
    return result
