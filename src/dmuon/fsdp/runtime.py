"""Owner runtime: keeps non-owned matrices in sync with their owners.

Under ZeRO-2 every rank keeps every matrix resident and the owners publish new
values after each step. Under ZeRO-3 a non-owner frees a matrix's storage
after the block's forward and after the matrix's gradient is accumulated, and
re-materializes it from the owners before the block's forward and backward,
prefetching the next block in the direction of travel.

Only public hooks are used: module forward (pre-)hooks, multi-grad hooks on a
block's outputs for "backward is about to enter this block", and
post-accumulate-grad hooks on parameters.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_leaves

from dmuon.comm import CommStats, Exchanger, PendingGather, PendingReduce
from dmuon.comm.topology import Topology
from dmuon.plan.plan import Plan


class OwnerRuntime:
    """Moves matrices between owners and the other ranks for one plan.

    Args:
        plan: The ownership plan.
        topology: The mesh's levels and dmuon's process groups.
    """

    def __init__(self, plan: Plan, topology: Topology) -> None:
        self.plan = plan
        self.stats = CommStats()
        self.exchanger = Exchanger(plan.infos, topology, self.stats)
        self.block_buckets: dict[int, list] = {}
        for bucket in plan.buckets:
            self.block_buckets.setdefault(bucket.block, []).append(bucket)
        # Logical residency, identical on every rank (owners never release their
        # storage, but track the state so all ranks make the same collective calls).
        self.resident = [True] * len(plan.infos)
        # While True (inside full_weights) nothing is freed, even by a step.
        self.pinned = False
        self.pending: dict[int, list[PendingGather]] = {}
        # ZeRO-3: blocks whose backward has begun and whose gradients have not all
        # landed. A forward of such a block is activation checkpointing's
        # recomputation: its weights must stay, and nothing is prefetched.
        self._in_backward: set[int] = set()
        self._grads_landed: dict[int, int] = {}
        # ZeRO-3: the block whose forward finishes last keeps its weights until its
        # gradients land: backward starts with it at once (FSDP2 users get this with
        # reshard_after_forward=False on the last block).
        self.resident_through_backward: int | None = None
        self._hooks: list[Any] = []
        # Overlap state (see enable_overlap).
        self.overlap = False
        self.defer_reduce = False
        self.pending_reduce: dict[int, list[PendingReduce]] = {}
        self.pending_publish: dict[int, list[PendingGather]] = {}
        self._grad_count: dict[int, int] = {}
        self._ready: set[int] = set()
        self._reduce_order: list[int] = []
        self._next_reduce = 0
        self.early_blocks: set[int] = set()
        # Called with (block, pending reductions) right after a block's reduction is
        # launched in backward (DMuon's ns_in_backward starts the owners' NS from it).
        self.on_reduce_launched: Callable[[int, list[PendingReduce]], None] | None = None

    def gathers_per_step(self, index: int) -> int:
        """How often matrix ``index`` is gathered from its owner in a step where it is used."""
        if self.plan.zero == 2:
            return 1
        return 1 if self.plan.infos[index].block == self.resident_through_backward else 2

    def is_owner(self, index: int) -> bool:
        return self.plan.infos[index].owner == self.plan.rank

    # ------------------------------------------------------------------ publish
    def publish(self, bucket, members: list[int]) -> None:
        """Sends the owners' current values of ``members`` to every rank (ZeRO-2)."""
        if not members:
            return
        values = {i: self.plan.infos[i].param.detach() for i in members if self.is_owner(i)}
        pending = self.exchanger.gather_from_owners(bucket, members, values)
        self._scatter_into_params(pending)

    def publish_all(self) -> None:
        """Makes every rank hold the owners' values (used once by ``prepare``)."""
        for bucket in self.plan.buckets:
            self.publish(bucket, bucket.members)

    def _scatter_into_params(self, pending: PendingGather) -> None:
        flat = pending.wait()
        pos = 0
        with torch.no_grad():
            for i in pending.members:
                info = self.plan.infos[i]
                if not self.is_owner(i):
                    self._alloc(i)
                    # ``.data`` has its own version counter: refilling must not
                    # invalidate tensors autograd saved from this parameter.
                    info.param.data.copy_(flat[pos : pos + info.numel].view(info.shape))
                self.resident[i] = True
                pos += info.numel

    # ------------------------------------------------------------------ ZeRO-3
    def _alloc(self, index: int) -> None:
        storage = self.plan.infos[index].param.data.untyped_storage()
        nbytes = self.plan.infos[index].numel * self.plan.infos[index].param.element_size()
        if storage.nbytes() != nbytes:
            storage.resize_(nbytes)

    def free(self, index: int) -> None:
        """Releases a non-owned matrix's storage (ZeRO-3); owners keep theirs."""
        if self.plan.zero == 3 and self.resident[index] and not self.pinned:
            if not self.is_owner(index):
                self.plan.infos[index].param.data.untyped_storage().resize_(0)
            self.resident[index] = False

    def free_block(self, block: int) -> None:
        for i in self.plan.blocks[block].matrices:
            self.free(i)

    def start_gather(self, block: int) -> None:
        """Issues the (async) materialization of ``block`` unless resident or in flight."""
        if block in self.pending or block not in self.block_buckets:
            return
        members = self.plan.blocks[block].matrices
        if all(self.resident[i] for i in members):
            return
        self.pending[block] = [
            self.exchanger.gather_from_owners(
                bucket,
                bucket.members,
                {i: self.plan.infos[i].param.detach() for i in bucket.members if self.is_owner(i)},
                async_op=True,
            )
            for bucket in self.block_buckets[block]
        ]

    def materialize(self, block: int) -> None:
        """Makes ``block``'s matrices resident now, using a prefetch if one is in flight."""
        self.start_gather(block)
        for pending in self.pending.pop(block, []):
            self._scatter_into_params(pending)

    def drain(self) -> None:
        """Completes every in-flight gather and frees all non-owned matrices.

        Called at the start of each optimizer step, so prefetches of blocks that
        were never used cannot leak into the next iteration.
        """
        self.flush_publish()
        for block in sorted(self.pending):
            for pending in self.pending.pop(block):
                pending.wait()
        for i in range(len(self.plan.infos)):
            self.free(i)
        self._in_backward.clear()
        self._grads_landed.clear()

    def install_zero3_hooks(self) -> None:
        """Registers the forward/backward hooks that free and re-materialize blocks."""
        order = [b.index for b in self.plan.blocks if b.index in self.block_buckets]
        if order:
            # The root block (0) wraps the others, so its forward ends last.
            self.resident_through_backward = 0 if order[0] == 0 else order[-1]
        nxt = {b: order[k + 1] for k, b in enumerate(order[:-1])}
        # The root block (0) stays resident from its forward until its gradients
        # land, so no block prefetches it on the way back; its pre-backward hook,
        # the first to fire in backward, prefetches the last block instead.
        prv = {b: order[k - 1] for k, b in enumerate(order) if k > 0 and order[k - 1] != 0}
        if len(order) > 1 and order[0] == 0:
            prv[0] = order[-1]
        for b in order:
            module = self.plan.blocks[b].module
            self._hooks.append(module.register_forward_pre_hook(self._pre_forward(b, nxt.get(b))))
            self._hooks.append(module.register_forward_hook(self._post_forward(b, prv.get(b))))
            for i in self.plan.blocks[b].matrices:
                self._hooks.append(
                    self.plan.infos[i].param.register_post_accumulate_grad_hook(self._after_grad(i))
                )

    def _pre_forward(self, block: int, next_block: int | None):
        def hook(module, args):
            self.materialize(block)
            if next_block is not None and block not in self._in_backward:
                self.start_gather(next_block)

        return hook

    def _post_forward(self, block: int, prev_block: int | None):
        def hook(module, args, output):
            if block in self._in_backward:
                # Recomputed in backward: backward is about to use these weights.
                return output
            if not (block == self.resident_through_backward and torch.is_grad_enabled()):
                self.free_block(block)
            if torch.is_grad_enabled():
                outs = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
                if outs:
                    torch.autograd.graph.register_multi_grad_hook(
                        outs, self._pre_backward(block, prev_block), mode="any"
                    )
            return output

        return hook

    def _pre_backward(self, block: int, prev_block: int | None):
        def hook(grad):
            self._in_backward.add(block)
            self.materialize(block)
            if prev_block is not None:
                self.start_gather(prev_block)

        return hook

    def _after_grad(self, index: int):
        block = self.plan.infos[index].block
        size = len(self.plan.blocks[block].matrices)

        def hook(param):
            self.free(index)
            landed = self._grads_landed.get(block, 0) + 1
            self._grads_landed[block] = landed
            if landed == size:
                self._in_backward.discard(block)
                del self._grads_landed[block]

        return hook

    # ------------------------------------------------------------------ overlap
    def enable_overlap(self) -> None:
        """Reduces each block as soon as its gradients are complete; publishes asynchronously.

        Collective order rule: reductions are launched in one canonical order
        (reverse forward order of the blocks), a block only after every block
        before it in that order has launched, whatever order gradients become
        ready in on each rank. A block that never completes in backward (unused
        this step) stops the early launches; it and every later block are
        reduced in ``step()`` instead, where one all-reduce agrees on which
        matrices have gradients. The requirement, as for FSDP2: a block either
        produces gradients on every rank or on none.
        """
        if self.overlap:
            return
        self.overlap = True
        self._reduce_order = [b.index for b in reversed(self.plan.blocks) if b.index in self.block_buckets]
        for b in self._reduce_order:
            for i in self.plan.blocks[b].matrices:
                self._hooks.append(self.plan.infos[i].param.register_post_accumulate_grad_hook(self._count_grad(i)))
            if self.plan.zero == 2:
                self._hooks.append(self.plan.blocks[b].module.register_forward_pre_hook(self._await_publish(b)))

    def _count_grad(self, index: int):
        block = self.plan.infos[index].block

        def hook(param):
            if param.grad is not None and param.grad.is_sparse:
                raise ValueError(
                    f"parameter {self.plan.infos[index].name!r}: sparse gradients are not supported by Muon"
                )
            if self.defer_reduce:
                return
            count = self._grad_count.get(block, 0) + 1
            self._grad_count[block] = count
            size = len(self.plan.blocks[block].matrices)
            if count > size:
                raise RuntimeError(
                    f"parameter {self.plan.infos[index].name!r} received a second gradient after its block "
                    "was reduced: with overlap=True, run the earlier micro-batches of a gradient "
                    "accumulation inside `with opt.no_sync():`"
                )
            if count == size:
                self._ready.add(block)
                self._launch_ready()

        return hook

    def _launch_ready(self) -> None:
        while self._next_reduce < len(self._reduce_order) and self._reduce_order[self._next_reduce] in self._ready:
            block = self._reduce_order[self._next_reduce]
            infos = self.plan.infos
            self.pending_reduce[block] = [
                self.exchanger.reduce_to_owners(
                    bucket, bucket.members, {i: infos[i].param.grad for i in bucket.members}, async_op=True
                )
                for bucket in self.block_buckets[block]
            ]
            self._next_reduce += 1
            if self.on_reduce_launched is not None:
                self.on_reduce_launched(block, self.pending_reduce[block])

    def collect_reductions(self) -> dict[int, torch.Tensor]:
        """Waits for the reductions launched during backward; resets for the next step.

        Returns:
            ``{matrix index: averaged gradient}`` for the owned matrices of
            every block reduced early (non-owned indices are absent).
        """
        reduced: dict[int, torch.Tensor] = {}
        for block in self._reduce_order[: self._next_reduce]:
            for pending in self.pending_reduce.pop(block):
                reduced.update(pending.wait())
        self.early_blocks = set(self._reduce_order[: self._next_reduce])
        self._grad_count.clear()
        self._ready.clear()
        self._next_reduce = 0
        return reduced

    def publish_async(self, bucket, members: list[int]) -> None:
        """Starts publishing ``members``; the block's next forward waits for it."""
        if not members:
            return
        if self.pinned:
            # Inside full_weights, later writes (a checkpoint load) must not be
            # overwritten by a publication landing afterwards.
            self.publish(bucket, members)
            return
        values = {i: self.plan.infos[i].param.detach() for i in members if self.is_owner(i)}
        pending = self.exchanger.gather_from_owners(bucket, members, values, async_op=True)
        self.pending_publish.setdefault(bucket.block, []).append(pending)

    def _await_publish(self, block: int):
        def hook(module, args):
            for pending in self.pending_publish.pop(block, []):
                self._scatter_into_params(pending)

        return hook

    def flush_publish(self) -> None:
        """Lands every outstanding publication (before reading weights outside a forward)."""
        for block in sorted(self.pending_publish):
            for pending in self.pending_publish.pop(block):
                self._scatter_into_params(pending)

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()


@contextmanager
def full_weights(plan: Plan):
    """Every matrix resident with its owner's value on every rank, inside the block.

    Use it around ``get_model_state_dict`` / ``set_model_state_dict`` (or any
    code that reads or writes the matrices outside forward/backward). On exit
    under ZeRO-3 non-owners free the matrices again; values written inside on
    a non-owner are discarded, so load the same checkpoint on every rank. A
    state dict taken inside aliases the matrices: save or copy it before leaving.
    A collective: call it on every rank.
    """
    runtime = plan.runtime
    runtime.drain()
    for bucket in plan.buckets:
        runtime.publish(bucket, bucket.members)
    runtime.pinned = True
    try:
        yield
    finally:
        runtime.pinned = False
        runtime.drain()
        runtime.stats.reset()


def full_matrices(runtime: OwnerRuntime) -> dict[str, torch.Tensor]:
    """Every matrix's current value from its owner, on every rank (a collective).

    Leaves the parameters (and ZeRO-3 residency) untouched: the values are copies.
    """
    out = {}
    infos = runtime.plan.infos
    runtime.flush_publish()
    for bucket in runtime.plan.buckets:
        values = {i: infos[i].param.detach() for i in bucket.members if runtime.is_owner(i)}
        flat = runtime.exchanger.gather_from_owners(bucket, bucket.members, values).wait()
        pos = 0
        for i in bucket.members:
            out[infos[i].name] = flat[pos : pos + infos[i].numel].view(infos[i].shape).clone()
            pos += infos[i].numel
    return out
