"""Splitting an owner's matrices into the NS batches its plan was costed with."""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence

RETURN_WAVES = 4
"""Update returns per step on an accelerator, each behind one NS batch of every owner
(:func:`return_waves`): enough to overlap the transfers with NS, few enough that the
per-collective latency stays small. On CPU (gloo) the transfers and NS share the same
cores, so there one wave is the default (measured: 4 waves cost the default bench's
optimizer step about 2 ms more on 4 ranks over 2 cores)."""


def default_return_waves(device_type: str) -> int:
    """:data:`RETURN_WAVES` on an accelerator, 1 on CPU."""
    return 1 if device_type == "cpu" else RETURN_WAVES


def split_into_batches(
    indices: Sequence[int],
    kind_of: Sequence[Hashable],
    sizes: Mapping[Hashable, Sequence[int]],
) -> list[list[int]]:
    """Cuts matrices into batches of the sizes the balancer planned for their kind.

    The balancer prices a rank's ``n`` matrices of one kind (shape, dtype) as the
    cheapest split of ``n`` into measured batch sizes; running exactly those batches
    is what makes the measured makespan the real one. When fewer matrices are
    present than planned (a matrix without a gradient this step, or a param group
    holding only part of a kind) the planned batches are filled in order and the
    last one comes up short; more than planned go in one extra batch.

    Args:
        indices: Matrix indices (plan order) to run, in the order to run them.
        kind_of: Kind key of every matrix of the plan, indexed by matrix index.
        sizes: Kind key -> planned batch sizes (largest first). A kind without an
            entry runs as one batch.

    Returns:
        Batches of matrix indices; kinds in order of first appearance.
    """
    by_kind: dict[Hashable, list[int]] = {}
    for i in indices:
        by_kind.setdefault(kind_of[i], []).append(i)
    out: list[list[int]] = []
    for kind, members in by_kind.items():
        planned = sizes.get(kind)
        if not planned:
            out.append(members)
            continue
        pos = 0
        for size in planned:
            if pos >= len(members):
                break
            out.append(members[pos:pos + size])
            pos += size
        if pos < len(members):
            out.append(members[pos:])
    return out


def return_waves(batches_by_rank: Mapping[int, Sequence[Sequence[int]]], ready: Iterable[int],
                 max_waves: int) -> list[list[int]]:
    """The matrices of each update return of a step, pipelined with the owners' NS batches.

    Wave ``k`` holds every owner's ``k``-th batch (the last wave also every later
    batch, so there are at most ``max_waves``); wave 0 also ``ready`` (matrices
    already orthogonalized). Each owner runs its batches of a wave and then
    joins the wave's return, so one wave's transfer overlaps the next wave's NS.

    Args:
        batches_by_rank: Owner rank -> its NS batches in the order it runs them.
        ready: Matrices needing no NS now.
        max_waves: At least 1.

    Returns:
        ``max_waves`` lists of matrix indices (plan order), some possibly empty.
    """
    if max_waves < 1:
        raise ValueError(f"max_waves must be >= 1, got {max_waves}")
    waves: list[set[int]] = [set() for _ in range(max_waves)]
    waves[0].update(ready)
    for batches in batches_by_rank.values():
        for k, batch in enumerate(batches):
            waves[min(k, max_waves - 1)].update(batch)
    return [sorted(w) for w in waves]
