"""No weight tied across pipeline stages split between Muon and AdamW (``DMuon(pp_group=)``, checked at the
first step, when every stage's values are set).

A weight tied between stages (the embedding on the first stage, the output head on the last) is two
parameters there, one per stage, each routed by its stage's own rule: the embedding to AdamW, the head
to AdamW only when it is named as one (``lm_head``, ``output``, ``head``) or tied to an embedding *on the
same stage*, which a stage split breaks. One copy stepped by Muon and the other by AdamW drift apart
(Megatron-LM #4641). At the first step, the stages compare their embeddings with their Muon matrices
(:func:`check_ties_across_stages`).

What ties the two copies is that they are one weight: the same values (a framework initializes the head
from the embedding, or loads both from one checkpoint entry, and keeps them equal). A shape alone ties
nothing: a vocabulary of 64 and an MLP of 64 x 32 share one. So a Muon matrix is refused only when it
has an embedding's shape, dtype *and values* (a fingerprint of them) on another stage.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from dmuon.comm.setup_collectives import add_over, gather_objects
from dmuon.plan.plan import Plan

_MASK = (1 << 30) - 1


def fingerprint(weight: torch.Tensor) -> int:
    """An order-free digest of ``weight``'s values: the sum of a hash of each element's bits.

    Position-free, so every layout of the same values (any sharding, on any stage) gives the same
    digest, and exact (integer sums wrap nowhere: 30-bit terms, under 2**33 elements), so no reduction
    order changes it. For a DTensor, a collective over each mesh dim it is sharded on (every rank of
    the parameter's mesh calls it, in the same order).
    """
    local = weight.to_local() if isinstance(weight, DTensor) else weight
    flat = local.detach().reshape(-1)
    bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
    x = flat.view(bits).to(torch.int64) & 0xFFFFFFFF
    # Two rounds of a multiply-xorshift mix; each product stays under 2**63 (32-bit by 31-bit).
    x = ((x * 0x7FEB352D) & 0xFFFFFFFF) ^ (x >> 15)
    x = ((x * 0x46B1A3B5) & 0xFFFFFFFF) ^ (x >> 13)
    total = (x & _MASK).sum().reshape(1)
    if isinstance(weight, DTensor):
        for dim, placement in enumerate(weight.placements):
            if placement.is_shard():  # a replicated dim holds the same piece on each rank: counted once
                add_over(total, weight.device_mesh.get_group(dim))
    return int(total.item())


def check_ties_across_stages(model: nn.Module, plan: Plan, group) -> None:
    """Raises ``ValueError`` on every stage when a Muon matrix on some stage is a copy of an
    ``nn.Embedding`` weight on another (the same shape, dtype and values: a head tied across stages,
    which takes AdamW under Muon's convention), naming both.

    Two object all-gathers over ``group``: the names and shapes, then the fingerprints of the weights
    whose shape another stage's matrix or embedding shares (one scalar all-reduce per sharded mesh dim
    of each, over the stage's data-parallel ranks, which all take the same candidates in one order).
    """
    embeddings = {f"{name}.weight" if name else "weight": m.weight
                  for name, m in model.named_modules() if isinstance(m, nn.Embedding)}
    matrices = {}
    for info in plan.infos:
        matrices.setdefault(info.name.split("[")[0], info.param)
    mine = {"embeddings": sorted((name, tuple(w.shape)) for name, w in embeddings.items()),
            "matrices": sorted((name, tuple(p.shape)) for name, p in matrices.items())}
    stages = gather_objects(mine, group)
    me = dist.get_rank(group)
    elsewhere = [s for j, s in enumerate(stages) if j != me]
    # Only the weights a copy could pair: a matrix with another stage's embedding's shape, and back.
    their_embeddings = {shape for s in elsewhere for _, shape in s["embeddings"]}
    their_matrices = {shape for s in elsewhere for _, shape in s["matrices"]}
    candidates = [(name, matrices[name]) for name, shape in mine["matrices"] if shape in their_embeddings]
    candidates += [(name, embeddings[name]) for name, shape in mine["embeddings"] if shape in their_matrices]
    prints = {name: (str(w.dtype), fingerprint(w)) for name, w in candidates}
    everyone = gather_objects(prints, group)
    for k, stage in enumerate(stages):
        for name, shape in stage["matrices"]:
            for j, other in enumerate(stages):
                if j == k:
                    continue
                mine_print = everyone[k].get(name)
                tied = [e for e, s in other["embeddings"]
                        if s == shape and mine_print is not None and everyone[j].get(e) == mine_print]
                if tied:
                    raise ValueError(
                        f"parameter {name!r} (pipeline rank {k}) goes to Muon but is a copy of the embedding "
                        f"{tied[0]!r} on pipeline rank {j} (the shape {shape}, the dtype and the values): a weight "
                        "tied across stages must take one rule on both, and an output head takes AdamW under "
                        "Muon's convention; name it as a head (lm_head, output, head) or leave it out of Muon "
                        "(dmuon.prepare(model, select=...))")
