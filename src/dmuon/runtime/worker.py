"""The NS worker: one daemon thread that runs submitted calls in order, each behind a Future."""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable


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
