"""An exchange in flight: the handle every dmuon collective returns, landed once, hop by hop."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from dmuon.comm.device_streams import active
from dmuon.comm.stats import CommStats
from dmuon.comm.streams import kept
from dmuon.util.observe import ranged


@dataclass
class Pending:
    """An exchange in flight; ``wait()`` lands it and returns its result (once computed, kept).

    A multi-hop exchange issued in backward has ``then``: the next hop can only
    start once the previous one has landed, and only the main thread issues
    collectives (every rank must issue them in the same order), so the runtime
    calls :meth:`forward` when it launches the next block and :meth:`issue_all`
    when it enters ``step()``.

    Streams (:mod:`dmuon.comm.streams`): the exchange lands on the stream that first waits
    for it, after that stream has waited for everything its creator had produced when it
    was made (``finish`` reads the creator's buffers too: a local exchange has no
    collective at all). The result is handed to a caller on another stream behind an event
    recorded once it was computed, and kept for that stream.
    """

    works: list
    """Handles of the collectives issued so far."""
    finish: Callable[[], dict[int, torch.Tensor]] = field(repr=False)
    """Turns the landed buffers into the result (may issue a second hop)."""
    stats: CommStats = field(repr=False)
    then: Callable[[], "Pending"] | None = field(default=None, repr=False)
    """Issues the next hop from the landed buffers; its result is this exchange's."""
    result: dict[int, torch.Tensor] | None = field(default=None, repr=False)
    flags: torch.Tensor | None = field(default=None, repr=False)
    """What ``finish`` found of the flags that rode along (see :meth:`dmuon.comm.exchange.ShardExchange.return_updates`)."""
    rows: dict[int, torch.Tensor] | None = field(default=None, repr=False)
    """What ``finish`` found of the row state that rode along (see :meth:`row_states`)."""
    _next: "Pending | None" = field(default=None, repr=False)
    _forwarded: threading.Event = field(default_factory=threading.Event, repr=False)
    _abandoned: bool = field(default=False, repr=False)
    _made: Any = field(default=None, repr=False)
    """Event on the creator's stream when this was made."""
    _ready: Any = field(default=None, repr=False)
    """Event on the landing stream once ``result`` was computed."""

    def __post_init__(self) -> None:
        self._made = active().record()

    @ranged("land")
    def _land(self, exposed: bool) -> None:
        # Host time: on CUDA wait() only enqueues the stream's wait.
        start = time.perf_counter()
        active().wait(self._made)
        for work in self.works:
            work.wait()
        self.works = []
        if exposed:
            self.stats.wait_seconds += time.perf_counter() - start

    def forward(self) -> None:
        """Main thread: advances the exchange by one hop: lands the latest issued hop and issues the
        one after it (nothing once every hop is issued)."""
        if self._next is not None:
            self._next.forward()
        elif self.then is not None:
            self._land(exposed=True)
            self._next = self.then()
            self._forwarded.set()

    def abandon(self) -> None:
        """Main thread, at teardown: no hop will be issued any more; a side thread waiting for the
        next one (:meth:`wait` with ``exposed=False``) raises instead of waiting forever."""
        self._abandoned = True
        if self._next is not None:
            self._next.abandon()
        self._forwarded.set()

    def issued(self) -> bool:
        """Whether every hop has been issued."""
        return self.then is None or (self._next is not None and self._next.issued())

    def issue_all(self) -> None:
        """Main thread: issues every remaining hop (landing each one before it)."""
        while not self.issued():
            self.forward()

    def agreed(self) -> torch.Tensor | None:
        """Lands the exchange; the elementwise maximum over every rank of the flags sent with it
        (``None`` when none were)."""
        self.wait()
        return self._next.agreed() if self._next is not None else self.flags

    def row_states(self) -> dict[int, torch.Tensor]:
        """Lands the exchange; the ``(rows, row_width)`` float32 row state that travelled with each
        matrix of the result (empty without a row state)."""
        self.wait()
        if self._next is not None:
            return self._next.row_states()
        return {} if self.rows is None else self.rows

    def wait(self, exposed: bool = True) -> dict[int, torch.Tensor]:
        """Lands the exchange.

        Args:
            exposed: False when a side thread waits: its time is not counted as
                blocking, and it issues nothing (it waits for the main thread's
                :meth:`forward` instead).
        """
        streams = active()
        if self.result is None:
            if self.then is not None:
                if exposed:
                    self.forward()
                else:
                    self._forwarded.wait()
                    if self._abandoned:
                        raise RuntimeError("the exchange was abandoned before its next hop was issued "
                                           "(the runtime was closed, or its rank raised mid-backward)")
                assert self._next is not None
                self.result = self._next.wait(exposed)
            else:
                self._land(exposed)
                self.result = self.finish()
            self._ready = streams.record()
        else:
            # Computed on another stream (or this one: the wait is then free).
            streams.wait(self._ready)
            streams.keep(kept(self.result) + kept(self.rows))
        return self.result


def no_result() -> dict[int, torch.Tensor]:
    """The result of a hop whose data lands through a later one (or not at all)."""
    return {}
