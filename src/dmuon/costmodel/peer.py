"""The all-to-all peer: the Muon design of microsoft/dion's ``Muon`` and torchtitan's DistMuon, as
dmuon's step model and simulation compare against it (:data:`PEER_STRATEGY`).

Its step, from their public code: FSDP2 (on HSDP its native all-reduce); in ``step()`` the matrices
grouped by shape into batches of the shard group's size (:func:`all_to_all_batches`), each batch's
momentum, one all-to-all giving every rank of the replica one whole matrix, NS on it (repeated on
every replica), the all-to-all back and the apply, batches in flight in its ``AsyncRuntime``'s order
(:func:`async_runtime_order`); :func:`peer_collectives` lists its collectives.
"""

from __future__ import annotations

from typing import Sequence

from dmuon.costmodel.collective import Collective, uniform_collective
from dmuon.costmodel.rank_traffic import row_width

PEER_STRATEGY = "dion_all_to_all"
"""The all-to-all design of microsoft/dion's ``Muon`` and torchtitan's DistMuon, a peer
:func:`dmuon.costmodel.collectives.step_collectives` also builds (:func:`peer_collectives`); not in
:func:`dmuon.costmodel.collectives.step_comm`."""


def all_to_all_batches(shapes: Sequence[Sequence[int]], shard: int) -> list[tuple[tuple[int, int], list[int]]]:
    """The peer's (:data:`PEER_STRATEGY`) batches: ``(shape, matrices)`` in the order it runs them.

    microsoft/dion's ``Muon`` (torchtitan's DistMuon) groups the matrices by shape (and
    sharding, dtype, mesh: the same for FSDP2's row shards), in order of first appearance,
    and cuts each group into batches of ``shard`` (its mesh's size; on HSDP the shard sub-mesh),
    the last one padded with dummies up to ``shard``. Shapes are ``(rows, prod(shape[1:]))``.
    """
    groups: dict[tuple[int, int], list[int]] = {}
    for i, shape in enumerate(shapes):
        groups.setdefault((int(shape[0]), row_width(shape)), []).append(i)
    return [(shape, members[k:k + shard]) for shape, members in groups.items()
            for k in range(0, len(members), shard)]


def async_runtime_order(batches: int, max_concurrent: int = 3) -> list[tuple[int, int]]:
    """The host order of the peer's work: ``(segment, batch)`` pairs, as its ``AsyncRuntime`` runs them.

    Each batch is a generator of three segments: 0, the momentum and the all-to-all to the
    owner slices; 1, the wait for it, NS on this rank's matrix and the all-to-all back; 2, the
    wait for that and the update's apply. Each pass of the runtime's loop first starts a new
    batch (segment 0) while fewer than ``max_concurrent`` are running, then runs one segment of
    every batch started earlier, oldest last (the order its list keeps them in).
    """
    if max_concurrent < 1:
        raise ValueError(f"max_concurrent must be >= 1, got {max_concurrent}")
    order: list[tuple[int, int]] = []
    running: list[list[int]] = []  # [batch, next segment], in the runtime's list order
    started = 0
    while started < batches or running:
        now: list[list[int]] = []
        if started < batches and len(running) < max_concurrent:
            order.append((0, started))
            now.append([started, 1])
            started += 1
        for task in running:
            order.append((task[1], task[0]))
            if task[1] < 2:
                now.append([task[0], task[1] + 1])
        running = now
    return order


def peer_collectives(shapes: Sequence[Sequence[int]], replicate: int, shard: int, wire_bytes: int,
                     max_concurrent: int) -> list[Collective]:
    """The peer's step collectives: per batch one all-to-all out and one back on each replica's shard group.

    Each rank holds a ``ceil(rows / S)``-row shard of every matrix of the batch (a dummy's
    too), sends the ``S - 1`` that others orthogonalize and receives ``S - 1`` shards of its
    own; back the same. Every replica does the same (NS repeated per replica).
    """
    world = replicate * shard
    if shard == 1:
        return []
    batches = all_to_all_batches(shapes, shard)
    out: list[Collective] = []
    for segment, k in async_runtime_order(len(batches), max_concurrent):
        if segment == 2:
            continue
        (rows, width), _ = batches[k]
        each = (shard - 1) * -(-rows // shard) * width * wire_bytes
        way = "out" if segment == 0 else "back"
        out.append(uniform_collective("all_to_all", "intra", "step", None, world, each, shard - 1,
                                      f"{PEER_STRATEGY} {way} batch {k}", f"a2a_{way}", k))
    return out
