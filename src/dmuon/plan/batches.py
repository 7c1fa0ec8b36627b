"""Splitting an owner's matrices into the NS batches its plan was costed with."""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence


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
