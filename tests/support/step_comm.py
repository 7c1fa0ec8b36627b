"""Rank function for ``tests/runtime/test_step_comm.py``: dmuon's counted collectives of one training step."""

from __future__ import annotations

import torch

import dmuon

from support.cases import sharded_oddnet
from support.models import lm_loss, odd_batch


def counted_step(rank: int, world_size: int, mesh_shape: tuple[int, int] | None, ns_dtype: torch.dtype,
                 zero: int = 3, steps: int = 2, return_waves: int | None = None, hsdp: str = "fsdp2",
                 rule: str = "muon", hop_a_spread: int = 8, publication: str | None = None,
                 returns_in_backward: bool = False, blocks: int = 3, apply_updates: str = "in_step") -> dict:
    """Trains OddNet ``steps`` steps under FSDP2 + dmuon and returns the last step's collective log.

    ``publication`` forces the updates' route across replicas (``ShardExchange.publication``);
    ``returns_in_backward``: with ``ns_in_backward``, the updates of the blocks launched first come
    back in backward; ``blocks``: OddNet's.

    Returns:
        ``{"plan_rank", "log", "infos", "blocks_in_backward", "params"}``: this rank's
        plan rank, the ``(level, sent, received)`` of every collective dmuon issued in
        the last step (its backward included), in issue order; each Muon
        matrix's ``(shape, owner, block, rows)`` from the plan; how many
        blocks that step exchanged in backward; and this rank's shard of every
        parameter after the last step.
    """
    model, plan, opt = sharded_oddnet(world_size, zero=zero, mesh_shape=mesh_shape, ns_dtype=ns_dtype, hsdp=hsdp,
                                      rule=rule, blocks=blocks, execution=dmuon.ExecutionConfig(
                                          return_waves=return_waves, hop_a_spread=hop_a_spread,
                                          ns_in_backward=returns_in_backward, returns_in_backward=returns_in_backward,
                                          apply_updates=apply_updates))
    if publication is not None:
        opt.runtime.exchange.publication = publication
    stats = {}
    for step in range(steps):
        loss = lm_loss(model, odd_batch(step, rank))
        loss.backward()
        opt.step()
        opt.zero_grad()
        stats = opt.last_step_stats()
    opt.flush_updates()  # no collective
    return {
        "plan_rank": opt.runtime.topo.rank,
        "log": list(opt.runtime.stats.last_log),
        "collectives": stats["collectives"],
        "infos": [(tuple(i.shape), i.owner, i.block, tuple(i.rows)) for i in plan.infos],
        "blocks": len(plan.blocks),
        "blocks_in_backward": stats["blocks_exchanged_in_backward"],
        "blocks_returned_in_backward": stats["blocks_returned_in_backward"],
        "waves": stats["return_waves"],
        "params": {name: p.to_local().detach().clone() for name, p in model.named_parameters()},
        # With dmuon's replicate level: per FSDP2 group, this rank's bytes of the other parameters'
        # gradient shards (float32), which dmuon all-reduces across replicas.
        "other_bytes": [sum(p.to_local().numel() * 4 for p in g.params if id(p) not in {id(i.param) for i in plan.infos})
                        for g in plan.groups] if plan.replicate_level else [],
    }


def expected_log(collectives, result: dict, replicate: int, replicate_level: bool) -> list[tuple]:
    """What a rank's counted log (:func:`counted_step`'s ``"log"``) must hold: its ``(level, sent,
    received)`` in each of the modelled ``collectives`` it takes part in, in order, and on dmuon's
    replicate level the other parameters' all-reduce across replicas per FSDP2 group (a ring's bytes)."""
    k = result["plan_rank"]
    expected = [(c.level, *c.ranks[k]) for c in collectives if c.ranks[k] is not None]
    if replicate_level:
        expected += [("inter", 2 * (replicate - 1) * b // replicate, 2 * (replicate - 1) * b // replicate)
                     for b in result["other_bytes"] if b]
    return expected


def check_counted_log(collectives, results: list[dict], replicate: int, replicate_level: bool) -> None:
    """Every rank's counted collectives are the modelled ones: in issue order, or on the replicate level
    (where the runtime interleaves the blocks' hops with the reductions) as the same multiset."""
    for r in results:
        expected = expected_log(collectives, r, replicate, replicate_level)
        if replicate_level:
            assert sorted(r["log"]) == sorted(expected), f"plan rank {r['plan_rank']}"
        else:
            assert r["log"] == expected, f"plan rank {r['plan_rank']}"
