"""Exchanges launched from FSDP2's backward, and the owners' work on a worker thread behind them.

FSDP2 calls each sharded parameter's post-accumulate-grad hooks right after it
has written the block's reduced gradient shard (after its reduce-scatter and,
on HSDP, its all-reduce, averaged and cast to the parameter's dtype). Once
every matrix of the block with ``requires_grad`` has landed, or the next block
starts landing, the block is launched: the optimizer's
:meth:`~dmuon.runtime.StepCallbacks.peek` gives this rank's part of each
direction, and the exchange to the owners starts. The launch is
*speculative*: ``step()`` keeps it only if the direction the optimizer commits
from the final gradients is bit for bit the one sent (a gradient clipped or
edited in between fails that check, and the block is exchanged again in
``step()``), so the result never depends on it.

Collective order: hooks fire in FSDP2's post-backward order, which FSDP2
itself requires to be the same on every rank. On HSDP a block's directions
take two hops (across replicas, then inside the owner's replica); the second
is issued from the main thread when the next block launches (or ``step()``
takes the launches), so the order is ``A(b), B(b), A(b+1), ...`` on every rank.
"""

from __future__ import annotations

import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import torch

from dmuon.comm import Pending, ShardExchange
from dmuon.plan.plan import Plan
from dmuon.runtime.owner_work import OwnerFn, OwnerWork

Directions = Callable[[list[int]], dict[int, torch.Tensor]]
"""Given matrix indices with gradients, this rank's part of their directions (wire dtype)."""


@dataclass
class Launch:
    """A block's direction exchange started in backward."""

    block: int
    members: list[int]
    """Matrices whose gradients had landed, in plan order."""
    sent: dict[int, torch.Tensor]
    """This rank's part of each member's direction, as sent."""
    pending: Pending
    """The exchange; ``wait()`` gives the owned whole directions."""


EarlyWork = dict[int, tuple[dict[int, torch.Tensor], float]]
"""Per block: this rank's owner results computed ahead of the step, and the seconds they took
(on the block that paid for them)."""


class BackwardLaunches:
    """The launches of one runtime: hooks on every matrix, and with ``owner_work`` the NS worker.

    Args:
        plan: The ownership plan.
        exchange: Where launches send.
        peek: The optimizer's directions in backward (state untouched).
        managed: The matrices the optimizer steps now; only those are launched.
        check: Called with a matrix index before its direction is formed (raises on bad gradients).
        owner_work: With ``ns_in_backward``: the owner's work, run per block on a worker thread
            as soon as the block's directions have landed; None: no worker.
        work: The owners' batching (per block when ``owner_work`` is given).
    """

    def __init__(self, plan: Plan, exchange: ShardExchange, peek: Directions, managed: Callable[[], list[int]],
                 check: Callable[[int], None], owner_work: OwnerFn | None, work: OwnerWork) -> None:
        self.plan = plan
        self.exchange = exchange
        self._peek = peek
        self._managed = managed
        self._check = check
        self._owner_work = owner_work
        self._work = work
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dmuon-ns") if owner_work else None
        self._early: dict[int, Future] = {}
        self._landed: dict[int, list[int]] = {}
        self._current: int | None = None
        self._launches: dict[int, Launch] = {}
        self._expected = {
            b.index: sum(1 for i in b.members if plan.infos[i].param.requires_grad) for b in plan.blocks
        }
        self._hooks: list[Any] = [info.param.register_post_accumulate_grad_hook(self._hook(info.index))
                                  for info in plan.infos]

    def _hook(self, index: int):
        # The hook outlives nothing: once these launches (and their runtime) are gone,
        # e.g. replaced by a new optimizer on resume, the hook does nothing.
        launches = weakref.ref(self)

        def hook(param: torch.Tensor) -> None:
            me = launches()
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
        landed = set(self._landed.pop(block))
        if self._current == block:
            self._current = None
        # A matrix outside the optimizer's param groups is not stepped: nothing to send.
        members = [i for i in self._managed() if i in landed]
        if not members:
            return
        # A block's second hop (HSDP: inside the owner's replica) starts once its first has
        # landed, typically while the next block's gradients were computed.
        for earlier in self._launches.values():
            earlier.pending.forward()
        for i in members:
            self._check(i)
        sent = self._peek(members)
        launch = Launch(block, members, sent, self.exchange.send_directions(members, sent))
        self._launches[block] = launch
        if self._worker is not None:
            self._early[block] = self._worker.submit(self._block_work, launch)

    @torch.no_grad()
    def _block_work(self, launch: Launch) -> tuple[dict[int, torch.Tensor], float]:
        # Worker thread: waits only on an exchange the main thread launched and issues
        # no collective itself, so every rank's collective order stays the main thread's.
        assert self._owner_work is not None
        full = launch.pending.wait(exposed=False)
        start = time.perf_counter()
        return self._work.run(self._owner_work, sorted(full), full), time.perf_counter() - start

    def take(self) -> tuple[dict[int, Launch], EarlyWork]:
        """The launches since the last call (a partly landed block launches now), their second
        hops issued, and the worker's results for them (empty without a worker)."""
        if self._current is not None:
            self._launch(self._current)
        launches, self._launches = self._launches, {}
        self._landed.clear()
        for launch in launches.values():
            launch.pending.forward()
        early = {b: f.result() for b, f in sorted(self._early.items())}
        self._early.clear()
        return launches, early

    def close(self) -> None:
        """Removes the hooks and stops the worker."""
        for handle in getattr(self, "_hooks", ()):
            handle.remove()
        self._hooks = []
        if getattr(self, "_worker", None) is not None:
            self._worker.shutdown(wait=False)
            self._worker = None

    def __del__(self) -> None:
        self.close()
