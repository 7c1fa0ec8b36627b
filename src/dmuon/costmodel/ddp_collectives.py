"""dmuon's step under torch's ``DistributedDataParallel``: each return wave's updates to every rank.

:func:`~dmuon.costmodel.collectives.step_collectives` puts these after DDP's all-reduce for the
``"ddp_dmuon"`` strategy.
"""

from __future__ import annotations

import math
from typing import Sequence

from dmuon.costmodel.collective import Collective
from dmuon.plan.ddp import ddp_hops, owner_shares, scatter_parts


def ddp_publish_collectives(shapes: Sequence[Sequence[int]], owners: Sequence[int], world: int,
                            waves: Sequence[Sequence[int]] | None, wire_bytes: int) -> list[Collective]:
    """Under torch's DDP, each wave's updates to every rank by :func:`~dmuon.plan.ddp.ddp_hops`' route: one
    all-gather of the shares padded to the largest, or the scatter's all-to-all evening them out (each rank
    to the ranks whose chunks its updates fall in) and the all-gather of the even chunks (``index`` ``2 w`` and
    ``2 w + 1``). Every rank is its own replica: the ``"inter"`` level."""
    if world == 1:
        return []
    numels = [math.prod(int(d) for d in shape) for shape in shapes]
    out = []
    for w, wave in enumerate(waves if waves is not None else [list(range(len(shapes)))]):
        share = owner_shares(numels, owners, world, wave)
        route, hops = ddp_hops(share, wire_bytes)
        if route == "scatter":
            parts, _ = scatter_parts(share)
            peers = max(max(sum(1 for b in range(world) if b != a and parts[a][b]) for a in range(world)),
                        max(sum(1 for a in range(world) if a != b and parts[a][b]) for b in range(world)))
            out.append(Collective("all_to_all", "inter", "step", None, list(hops[0]), peers,
                                  f"dmuon updates wave {w} (scatter)", "ddp_publish", 2 * w))
        out.append(Collective("all_gather", "inter", "step", None, list(hops[-1]), world - 1,
                              f"dmuon updates wave {w} (all-gather)", "ddp_publish", 2 * w + 1))
    return out
