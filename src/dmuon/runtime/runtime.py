"""The shard runtime: every dmuon collective, issued from FSDP2's backward and from ``step()``.

FSDP2 keeps the weights: storage, mixed precision, the reduce-scatter in
backward and the all-gather in forward. The runtime only moves Muon's
directions from FSDP2's (and TP's) shards to each matrix's owner and the owners'
updates back (:mod:`dmuon.comm.exchange`).

With ``overlap=True`` a block's exchange starts in backward. FSDP2 calls each
sharded parameter's post-accumulate-grad hooks right after it has written the
block's reduced gradient shard (after its reduce-scatter and, on HSDP, its
all-reduce, averaged and cast to the parameter's dtype). Once every matrix of
the block with ``requires_grad`` has landed, or the next block starts landing,
the runtime asks the optimizer for the block's directions and launches the
exchange. The launch is *speculative*: the optimizer checks in ``step()`` that
the direction it would send from the final gradients is bit-for-bit the one
sent (a gradient clipped or edited in between fails that check, and the
block is exchanged again in ``step()``), so the result never depends on it.

Collective order: hooks fire in FSDP2's post-backward order, which FSDP2
itself requires to be the same on every rank; ``step()`` goes through the
blocks in one fixed order. On HSDP a block's directions take two hops (across
replicas, then inside the owner's replica); the second is issued from the
main thread when the next block launches (or ``step()`` takes the launches),
so the order is block by block ``A(b), B(b), A(b+1), ...`` on every rank. dmuon's collectives run on process groups of their
own (:func:`dmuon.comm.topology.from_mesh`), apart from FSDP2's.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from dmuon.comm import CommStats, Pending, ShardExchange, Topology
from dmuon.plan.plan import Plan

DirectionFn = Callable[[list[int]], dict[int, torch.Tensor]]
"""Given matrix indices with gradients, this rank's rows of their directions (wire dtype)."""


@dataclass
class Launch:
    """A block's direction exchange started in backward."""

    block: int
    members: list[int]
    """Matrices whose gradients had landed, in plan order."""
    sent: dict[int, torch.Tensor]
    """This rank's rows of each member's direction, as sent."""
    pending: Pending
    """The exchange; ``wait()`` gives the owned full directions."""


class ShardRuntime:
    """Owns dmuon's collectives for one plan.

    Args:
        plan: The ownership plan.
        topology: The mesh's levels and dmuon's process groups.
        wire_dtype: Dtype of directions and updates on the wire (NS's dtype).
        device: Device of the exchange buffers.
    """

    def __init__(self, plan: Plan, topology: Topology, wire_dtype: torch.dtype, device: torch.device) -> None:
        self.plan = plan
        self.topo = topology
        self.stats = CommStats()
        self.exchange = ShardExchange(plan.infos, topology, self.stats, wire_dtype, device)
        self.device = device
        self._hooks: list[Any] = []
        self._directions: DirectionFn | None = None
        self.on_launch: Callable[[Launch], None] | None = None
        """Called right after a block's exchange is launched in backward (``ns_in_backward``)."""
        self._landed: dict[int, list[int]] = {}
        self._current: int | None = None
        self._launches: dict[int, Launch] = {}
        self._expected = {
            b.index: sum(1 for i in b.members if plan.infos[i].param.requires_grad) for b in plan.blocks
        }

    # ------------------------------------------------------------------ backward
    def enable_overlap(self, directions: DirectionFn) -> None:
        """Launches each block's exchange from FSDP2's backward, with ``directions`` from the optimizer."""
        self._directions = directions
        for info in self.plan.infos:
            self._hooks.append(info.param.register_post_accumulate_grad_hook(self._grad_landed(info.index)))

    def _grad_landed(self, index: int):
        # The hook outlives nothing: once the optimizer (and with it this runtime)
        # is gone, e.g. replaced by a new one on resume, the hook does nothing.
        runtime = weakref.ref(self)

        def hook(param: torch.Tensor) -> None:
            me = runtime()
            if me is not None:
                me._landed_one(index)

        return hook

    def _landed_one(self, index: int) -> None:
        block = self.plan.infos[index].block
        if block in self._launches:
            # A second reduction in one step (accumulation without FSDP2's
            # no-sync): the launch is stale, and step()'s check will redo it.
            return
        if self._current is not None and self._current != block:
            self._launch(self._current)
        self._current = block
        landed = self._landed.setdefault(block, [])
        landed.append(index)
        if len(landed) == self._expected[block]:
            self._launch(block)

    @torch.no_grad()
    def _launch(self, block: int) -> None:
        assert self._directions is not None
        members = sorted(self._landed.pop(block))
        if self._current == block:
            self._current = None
        # A block's second hop (HSDP: inside the owner's replica) starts once its first has
        # landed, typically while the next block's gradients were computed.
        for earlier in self._launches.values():
            earlier.pending.forward()
        sent = self._directions(members)
        launch = Launch(block, members, sent, self.exchange.send_directions(members, sent))
        self._launches[block] = launch
        if self.on_launch is not None:
            self.on_launch(launch)

    def take_launches(self) -> dict[int, Launch]:
        """The exchanges launched in backward since the last call (a partly landed block launches now)."""
        if self._current is not None:
            self._launch(self._current)
        launches, self._launches = self._launches, {}
        self._landed.clear()
        for launch in launches.values():
            launch.pending.forward()
        return launches

    # ---------------------------------------------------------------- agreement
    def agree(self, flags: torch.Tensor) -> torch.Tensor:
        """Elementwise maximum of ``flags`` over every rank (one small collective)."""
        return self.start_agree(flags)()

    def start_agree(self, flags: torch.Tensor) -> Callable[[], torch.Tensor]:
        """Issues :meth:`agree`'s all-reduce and returns what waits for it (work can go on meanwhile)."""
        if self.topo.world_size == 1:
            return lambda: flags.cpu()
        flags = flags.to(self.device)
        work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.topo.world_group, async_op=True)

        def landed() -> torch.Tensor:
            work.wait()
            return flags.cpu()

        return landed

    def __del__(self) -> None:
        for handle in self._hooks:
            handle.remove()
