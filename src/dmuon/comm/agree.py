"""The agreement's collectives: the elementwise maximum of every rank's flags, and one flag across stages.

What the flags say is :mod:`dmuon.runtime.agreement`'s; here they only travel. Whether a rank enters
either collective depends on the topology alone (the same on every rank), never on the flags.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from dmuon.comm.streams import Streams
from dmuon.comm.topology import Topology


def all_reduce_max(flags: torch.Tensor, topo: Topology, streams: Streams, device: torch.device
                   ) -> Callable[[], torch.Tensor]:
    """Issues the elementwise maximum of ``flags`` over every rank of the mesh (on ``device``, from the
    current stream); the returned function waits for it on that stream and gives the maximum on the host
    (work can go on meanwhile). One rank without loopback: the flags themselves, no collective."""
    if topo.world_size == 1 and not topo.loopback:
        return lambda: flags.cpu()
    flags = flags.to(device)
    flight = streams.issue(
        lambda: dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=topo.mesh_group, async_op=True),
        reads=(flags,), writes=(flags,))

    def wait() -> torch.Tensor:
        flight.wait()
        return flags.cpu()

    return wait


def any_rank(flag: bool, group, device: torch.device) -> bool:
    """Whether ``flag`` is set on any rank of ``group`` (one scalar all-reduce, waited for at once)."""
    seen = torch.tensor([int(flag)], dtype=torch.int32, device=device)
    dist.all_reduce(seen, op=dist.ReduceOp.MAX, group=group)
    return bool(seen.item())


def least_over(values: torch.Tensor, group) -> list[int]:
    """The elementwise minimum of ``values`` (an integer tensor) over every rank of ``group``, on the host
    (one all-reduce from the current stream, waited for at once)."""
    dist.all_reduce(values, op=dist.ReduceOp.MIN, group=group)
    return [int(v) for v in values.tolist()]
