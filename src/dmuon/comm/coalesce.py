"""Uneven all-to-alls on one process group, counted, and several of them issued as one.

On HSDP two exchanges go to the same peers at the same moment of backward: the
column reduce-scatter of a block's gradients and hop A of the block before it
(the direction's column slices to the owner's replica). Across nodes each
collective costs a latency per peer, so :meth:`GroupAllToAll.coalesced` joins
the all-to-alls issued inside it into one ``all_to_all_single`` whose segment
for each peer is every part's segment for that peer, side by side as bytes
(parts of different dtypes travel together; ``all_to_all`` only moves bytes).
On landing each part's receive buffer gets its bytes back, so a part's own
code reads its buffer as if it had been issued alone.

Every rank of the group must issue the same parts in the same order inside
the same ``coalesced()`` block, as with separate collectives.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist

from dmuon.comm.device_streams import active
from dmuon.comm.stats import CommStats
from dmuon.comm.streams import Flight


class _Queued:
    """A queued part's handle: the joined collective's once issued; waiting earlier is a bug in the
    caller (nothing was sent), so it raises instead of returning an unfilled buffer."""

    def __init__(self) -> None:
        self.work = None

    def wait(self) -> bool:
        if self.work is None:
            raise RuntimeError("an all_to_all queued in GroupAllToAll.coalesced() was waited on before the "
                               "block ended and issued it")
        return self.work.wait()


@dataclass
class _Part:
    out: torch.Tensor
    inp: torch.Tensor
    out_splits: list[int]
    in_splits: list[int]
    handle: _Queued
    """The part's handle, given the collective once the block issues it."""


class _JoinedWork:
    """The joined collective's handle: waiting lands it once and hands every part its bytes (on the
    first waiter's stream; a later waiter on another stream waits for an event recorded after the
    copies, and keeps the parts' buffers)."""

    def __init__(self, flight: Flight, recv: torch.Tensor, parts: list[_Part], offsets: list[list[int]]) -> None:
        self._flight = flight
        self._recv = recv
        self._parts = parts
        self._offsets = offsets
        self._done = False
        self._copied = None
        """Event after the copies (None on CPU)."""

    def wait(self) -> bool:
        streams = active()
        if not self._done:
            self._flight.wait()
            for part, starts in zip(self._parts, self._offsets):
                out = part.out.view(-1).view(torch.uint8)
                size = part.out.element_size()
                at = 0
                for start, numel in zip(starts, part.out_splits):
                    out[at:at + numel * size].copy_(self._recv[start:start + numel * size])
                    at += numel * size
            self._recv = None
            self._done = True
            self._copied = streams.record()
        else:
            streams.wait(self._copied)
            streams.keep([part.out for part in self._parts])
        return True


class GroupAllToAll:
    """``all_to_all_single`` on one group, with its bytes counted.

    Args:
        group: The process group.
        size: The group's size.
        level: ``"intra"`` or ``"inter"``, the counters' level.
        stats: Counters (one entry per collective issued).
    """

    def __init__(self, group, size: int, level: str, stats: CommStats) -> None:
        self.group = group
        self.size = size
        self.level = level
        self.stats = stats
        self._batch: list[tuple[_Part, int, int]] | None = None

    def __call__(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int],
                 sent: int, received: int) -> list:
        """Issues (or, inside :meth:`coalesced`, queues) one uneven all-to-all of 1-D contiguous
        buffers; ``sent``/``received``: the bytes it counts. Returns its handles (each has
        ``wait()``; a queued part's works once the block has issued it)."""
        if self._batch is not None:
            handle = _Queued()
            self._batch.append((_Part(out, inp, list(out_splits), list(in_splits), handle), sent, received))
            return [handle]
        return [self._issue(out, inp, out_splits, in_splits, sent, received)]

    def _issue(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int],
               sent: int, received: int):
        self.stats.add(self.level, sent, received)
        return active().issue(
            lambda: dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.group, async_op=True),
            reads=(inp,), writes=(out,))

    @contextlib.contextmanager
    def coalesced(self) -> Iterator[None]:
        """The all-to-alls issued inside go out as one when the block ends (none: nothing is issued)."""
        if self._batch is not None:  # already joining: the outer block issues
            yield
            return
        self._batch = []
        try:
            yield
        except BaseException:
            self._batch = None
            raise
        batch, self._batch = self._batch, None
        if len(batch) == 1:
            (part, sent, received), = batch
            part.handle.work = self._issue(part.out, part.inp, part.out_splits, part.in_splits, sent, received)
        elif batch:
            self._issue_joined([p for p, _, _ in batch], sum(s for _, s, _ in batch), sum(r for _, _, r in batch))

    def _issue_joined(self, parts: list[_Part], sent: int, received: int) -> None:
        peers = range(self.size)
        send_bytes = [[n * p.inp.element_size() for n in p.in_splits] for p in parts]
        recv_bytes = [[n * p.out.element_size() for n in p.out_splits] for p in parts]
        # Per peer q: every part's segment q, in part order.
        send_flat = [p.inp.view(-1).view(torch.uint8) for p in parts]
        send_starts = [[sum(b[:q]) for q in peers] for b in send_bytes]
        send = torch.cat([send_flat[k][send_starts[k][q]:send_starts[k][q] + send_bytes[k][q]]
                          for q in peers for k in range(len(parts))])
        in_splits = [sum(b[q] for b in send_bytes) for q in peers]
        out_splits = [sum(b[q] for b in recv_bytes) for q in peers]
        recv = torch.empty(sum(out_splits), dtype=torch.uint8, device=send.device)
        # Where each part's segment from peer q starts in the joined receive buffer.
        offsets = [[sum(out_splits[:q]) + sum(recv_bytes[j][q] for j in range(k)) for q in peers]
                   for k in range(len(parts))]
        joined = _JoinedWork(self._issue(recv, send, out_splits, in_splits, sent, received), recv, parts, offsets)
        for part in parts:
            part.handle.work = joined
