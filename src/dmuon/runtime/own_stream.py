"""dmuon's own stream in backward: where the launches' waiting work runs, and the compute stream's join.

FSDP2 calls the gradient hooks on its post-reduce stream, and FSDP2's stream never waits for
dmuon. Whatever in a hook waits (landing earlier hops, the returns of ``returns_in_backward``, on
the replicate level a unit's whole work) runs on dmuon's stream instead, forked from the current
one; the compute stream (where the main thread builds and steps) waits for it once, in
``take()``, at the end of backward, or after a pipeline stage's reduction by hand.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from dmuon.comm.streams import Streams


class OwnStream:
    """dmuon's stream in backward and the compute stream that waits for it.

    Args:
        streams: The runtime's streams.
    """

    def __init__(self, streams: Streams) -> None:
        self.streams = streams
        self.compute: Any = streams.current()
        """The stream the main thread computes on (built and stepped there), which waits for the
        reductions landed outside autograd."""
        self._done: Any = None
        """Event on dmuon's stream after the hooks' latest work (None: nothing since the compute stream waited)."""

    def mark_compute(self) -> None:
        """The current stream is the compute stream (the main thread, at ``take()`` or a clip)."""
        self.compute = self.streams.current()

    @contextlib.contextmanager
    def use(self) -> Iterator[None]:
        """Runs the block on dmuon's stream, forked from the current one (FSDP2's, in a hook); the
        compute stream waits for it in :meth:`join`."""
        with self.streams.use(self.streams.own("dmuon")):
            yield
            self._done = self.streams.record()

    def join(self) -> None:
        """The current (compute) stream waits for what the hooks left on dmuon's stream."""
        if self._done is not None:
            # No hand-over depends on this wait alone today: what dmuon's stream produces reaches the compute
            # stream through a Pending (the event of its making or of its result) or a collective landed there
            # (its stream forked from dmuon's at the issue), and dmuon's stream reads the gradients only
            # before issuing the collectives that carry them (landed on the compute stream before step() or a
            # clip reads them). Kept: one wait per backward orders whatever a later hand-over leaves out.
            self.streams.wait(self._done)
            self._done = None

    def join_into_compute(self) -> None:
        """:meth:`join` issued on the compute stream (from a hook, which runs on FSDP2's)."""
        with self.streams.use(self.compute, fork=False):
            self.join()
