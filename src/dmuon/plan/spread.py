"""The balancers' second objective: spread each block's bytes over different owners.

A block's direction exchange is done when its busiest owner has received its
matrices (and, on HSDP, when the busiest owner replica has received their
column slices), so one owner holding several of a block's largest matrices
makes that block's exchange wait for all of them. The balancers (LPT, MILP)
minimize the slowest rank's NS time and say nothing about blocks. This pass
runs after them and only swaps owners between matrices of the same kind (same
shape and cost table): every rank keeps exactly the matrices-per-kind counts
the balancer gave it, hence its load, its batch plan and its state bytes,
while the bytes each block's exchange waits for go down. Lexicographic:
makespan first (the balancer's), then bytes per block (this pass).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Sequence

from dmuon.plan.balance import BalanceResult, spread_over_replicas
from dmuon.plan.holders import owned_where_held, prefer_holders, spread_kinds


def block_wait_bytes(owners: Sequence[int], blocks: Sequence[int], numels: Sequence[int],
                     replicate: int, shard: int) -> float:
    """Bytes per element the step's direction exchanges wait for, summed over blocks.

    Per block: ``(S-1)/S`` of the most any one rank owns in it (what the busiest
    owner receives inside its replica) plus, with ``R > 1``, ``(R-1)/(R S)`` of
    the most any one replica owns in it (what each rank of the busiest owner
    replica receives across replicas). Elements, not bytes: one wire dtype
    scales every term alike.
    """
    per_rank, per_replica = _owned_per_block(owners, blocks, numels, shard)
    return sum(_block_term(per_rank[b], per_replica[b], replicate, shard) for b in per_rank)


def _owned_per_block(owners: Sequence[int], blocks: Sequence[int], numels: Sequence[int], shard: int):
    """Per block, the elements each rank and each replica owns in it."""
    per_rank: dict[int, dict[int, int]] = defaultdict(lambda: defaultdict(int))
    per_replica: dict[int, dict[int, int]] = defaultdict(lambda: defaultdict(int))
    for owner, block, numel in zip(owners, blocks, numels):
        per_rank[block][owner] += numel
        per_replica[block][owner // shard] += numel
    return per_rank, per_replica


def _block_term(rank_bytes: dict[int, int], replica_bytes: dict[int, int], replicate: int, shard: int) -> float:
    intra = (shard - 1) / shard * max(rank_bytes.values(), default=0)
    inter = (replicate - 1) / (replicate * shard) * max(replica_bytes.values(), default=0)
    return intra + inter


def spread_blocks(owners: Sequence[int], kinds: Sequence[int], blocks: Sequence[int], numels: Sequence[int],
                  replicate: int, shard: int, max_passes: int = 8) -> list[int]:
    """Swaps owners between same-kind matrices of different blocks while that lowers :func:`block_wait_bytes`.

    A pure function of its inputs (every rank computes the same owners).

    Args:
        owners: The balancer's owner of each matrix (plan ranks ``r * S + s``).
        kinds: Each matrix's kind (same kind: same shape and same cost).
        blocks: Each matrix's FSDP2 block.
        numels: Each matrix's element count.
        replicate, shard: The mesh (R x S).
        max_passes: Sweeps over all same-kind pairs; stops early once a sweep changes nothing.

    Returns:
        New owners; per rank, the count of each kind is unchanged.
    """
    if not (len(owners) == len(kinds) == len(blocks) == len(numels)):
        raise ValueError("owners, kinds, blocks and numels must have one entry per matrix")
    owners = list(owners)
    per_rank, per_replica = _owned_per_block(owners, blocks, numels, shard)

    def term(block: int) -> float:
        return _block_term(per_rank[block], per_replica[block], replicate, shard)

    def move(i: int, src: int, dst: int) -> None:
        b, n = blocks[i], numels[i]
        per_rank[b][src] -= n
        per_rank[b][dst] += n
        per_replica[b][src // shard] -= n
        per_replica[b][dst // shard] += n

    by_kind: dict[int, list[int]] = defaultdict(list)
    for i, k in enumerate(kinds):
        by_kind[k].append(i)
    for _ in range(max_passes):
        changed = False
        for members in by_kind.values():
            for x, i in enumerate(members):
                for j in members[x + 1:]:
                    oi, oj = owners[i], owners[j]
                    if oi == oj or blocks[i] == blocks[j]:
                        continue
                    before = term(blocks[i]) + term(blocks[j])
                    move(i, oi, oj)
                    move(j, oj, oi)
                    # A strict decrease of a bounded sum: the sweeps terminate.
                    if term(blocks[i]) + term(blocks[j]) < before * (1 - 1e-12):
                        owners[i], owners[j] = oj, oi
                        changed = True
                    else:
                        move(i, oj, oi)
                        move(j, oi, oj)
        if not changed:
            break
    return owners


def place_owners(result: BalanceResult, items: Sequence[int], blocks: Sequence[int], numels: Sequence[int],
                 replicate: int, holders: Sequence[tuple[int, ...] | None] | None = None) -> BalanceResult:
    """The balancer's owners placed on the mesh: spread over the replicas, then over each block, then
    each matrix that some ranks do not hold onto one that does.

    :func:`~dmuon.plan.balance.spread_over_replicas` relabels whole ranks;
    :func:`spread_blocks` then swaps same-kind matrices (those of ``holders`` aside:
    :func:`~dmuon.plan.holders.spread_kinds`), and :func:`~dmuon.plan.holders.prefer_holders`
    moves the matrices with ``holders`` (:func:`~dmuon.plan.holders.holder_ranks`) within the
    per-rank counts of their kind. All three keep every rank's load, batches and state bytes.
    ``round_robin`` skips the block spreading (its owners are ``i % W``, as documented, the
    comparison point of the balancers), but not the holders: its per-rank counts, hence its loads,
    are still ``i % W``'s, and the holders' bytes are saved under it too.
    """
    result = spread_over_replicas(result, replicate)
    world = len(result.loads)
    if result.method != "round_robin" and world % replicate == 0:
        result.owners = spread_blocks(result.owners, spread_kinds(items, holders), blocks, numels, replicate,
                                      world // replicate)
    if holders is not None and any(h is not None for h in holders):
        result.owners = prefer_holders(result.owners, items, holders)
        on, of = owned_where_held(result.owners, holders)
        result.notes.append(f"holders: {on} of the {of} matrices not held by every rank owned by a rank holding "
                            "rows of them (same counts per kind and rank: loads, batches and state unchanged)")
    return result
