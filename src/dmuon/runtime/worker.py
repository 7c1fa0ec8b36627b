"""The NS worker: the owners' work on each block launched in backward, on one daemon thread.

:class:`NSWorker` runs, per launch, the owners' work (``StepCallbacks.owner_work``) as soon as the
launch's directions have landed, on the NS stream, and hands the main thread its results ordered
after that work; :class:`DaemonWorker` is the thread under it.

Streams (CUDA; :mod:`dmuon.comm.streams`): the thread enters the plan's device first (Triton
launches on the thread's current device) and runs on the NS stream, not forked from its default
stream (backward's compute): only the exchange's events order NS. It lands the block's exchange
there (after the event of the exchange's creation) and records an event once the owners' work is
enqueued; whoever consumes the results (the return issued in backward, ``step()``) waits for that
event. The worker waits only on an exchange the main thread launched and issues no collective
itself, so every rank's collective order stays the main thread's.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

import torch

from dmuon.comm.streams import Interval, Streams, kept
from dmuon.runtime.callbacks import RowState, StepCallbacks
from dmuon.runtime.owner_work import OwnerWork
from dmuon.util.observe import ranged

if TYPE_CHECKING:
    from dmuon.runtime.launch import Launch


class OwnerResults(NamedTuple):
    """This rank's owner work on one block, computed ahead of the step."""

    updates: dict[int, torch.Tensor]
    """The whole update of each matrix this rank owns."""
    rows: dict[int, torch.Tensor]
    """Their new row states (empty without a row state)."""
    spent: Interval | None
    """The time it took, on the block that paid for it (None on the others of one run)."""


EarlyWork = dict[int, OwnerResults]
"""Per block: this rank's owner results computed ahead of the step."""


class DaemonWorker:
    """A one-thread executor whose thread never keeps the interpreter alive.

    ``concurrent.futures.ThreadPoolExecutor``'s threads are joined when the interpreter exits: a
    rank that raised mid-backward, its worker waiting for a hop the main thread will never issue,
    would then never exit (and hold its peers until their collective timeout). This thread is a
    daemon: the interpreter leaves it where it waits. :meth:`shutdown` stops it once its queue is
    done; a call blocked on the main thread is woken by whoever abandons what it waits for
    (:meth:`dmuon.comm.pending.Pending.abandon`).
    """

    def __init__(self, name: str, initializer: Callable[[], Any] | None = None):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, args=(initializer,), name=name, daemon=True)
        self._thread.start()

    def _run(self, initializer: Callable[[], Any] | None) -> None:
        failed = None
        if initializer is not None:
            try:
                initializer()
            except BaseException as exc:  # noqa: BLE001 - every call fails with it instead of waiting forever
                failed = exc
        while True:
            item = self._queue.get()
            if item is None:
                return
            future, fn, args = item
            if not future.set_running_or_notify_cancel():
                continue
            if failed is not None:
                future.set_exception(failed)
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to whoever takes the result
                future.set_exception(exc)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        future: Future = Future()
        self._queue.put((future, fn, args))
        return future

    def shutdown(self) -> None:
        """Lets the thread end after the calls already submitted (does not wait for it)."""
        self._queue.put(None)

    @property
    def thread(self) -> threading.Thread:
        return self._thread


class NSWorker:
    """The owners' work on each launched block, on a worker thread (``ExecutionConfig.ns_in_backward``).

    Args:
        streams: The runtime's streams (the thread enters their device; the work runs on the NS stream).
        callbacks: The rule: its ``owner_work`` runs here, its row states (a
            :class:`~dmuon.runtime.callbacks.RowState` rule) travel into it.
        work: The owners' batching (per block).
    """

    def __init__(self, streams: Streams, callbacks: StepCallbacks, work: OwnerWork) -> None:
        self.streams = streams
        self.callbacks = callbacks
        self.work = work
        # A daemon: a rank that raises mid-backward exits although its worker waits for a hop never issued.
        self._thread: DaemonWorker | None = DaemonWorker("dmuon-ns", initializer=streams.enter)
        self._early: dict[int, Future] = {}
        self._ns_done: dict[int, Any] = {}
        """Per block: the event on the NS stream after the worker's work on it."""

    def submit(self, launch: "Launch") -> None:
        """Queues the owners' work on ``launch``'s directions (they land on the worker)."""
        assert self._thread is not None, "the NS worker was shut down"
        self._early[launch.block] = self._thread.submit(self._block_work, launch)

    def result(self, block: int) -> OwnerResults:
        """The worker's results for ``block`` (blocking the host until it has enqueued them), ordered
        before the current stream's next work and kept for it."""
        result = self._early[block].result()
        self.streams.wait(self._ns_done[block])
        # Redundant on every path today: the results stay referenced (the worker's futures, then step()'s
        # settled work) past take(), and the NS stream's next allocation follows its landing of the next
        # backward's exchange, whose Pending first waits for the event of its making, on a stream forked
        # (through FSDP2's reduce-scatter stream, which waits for the compute stream) after take() joined
        # dmuon's stream into the compute stream. Kept as every hand-over to another stream is.
        self.streams.keep(kept([result.updates, result.rows]))
        return result

    def take(self) -> EarlyWork:
        """Every block's results since the last call, in block order (:meth:`result` of each)."""
        early = {b: self.result(b) for b in sorted(self._early)}
        self._early.clear()
        self._ns_done.clear()
        return early

    @torch.no_grad()
    @ranged("ns.worker")
    def _block_work(self, launch: "Launch") -> OwnerResults:
        with self.streams.use(self.streams.own("ns"), fork=False):
            full = launch.pending.wait(exposed=False)
            # Landed: row_states() reads what wait() found, it issues nothing.
            rows = launch.pending.row_states() if isinstance(self.callbacks, RowState) else None
            with self.streams.interval() as spent:  # on the NS stream: the device's time there too
                updates, new_rows = self.work.run(self.callbacks.owner_work, sorted(full), full, rows)
            self._ns_done[launch.block] = self.streams.record()
        return OwnerResults(updates, new_rows, spent)

    def shutdown(self) -> None:
        """Lets the thread end after the blocks already queued (a block waiting on an abandoned
        exchange ends with an error)."""
        if self._thread is not None:
            self._thread.shutdown()
            self._thread = None

    @property
    def thread(self) -> threading.Thread | None:
        return None if self._thread is None else self._thread.thread
