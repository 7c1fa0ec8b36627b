"""NSWorker: the owners' work per launched block on its own thread, its results, its errors and its exit."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from dmuon.comm.pending import Pending, no_result
from dmuon.comm.stats import CommStats
from dmuon.comm.streams import HostStreams
from dmuon.runtime.worker import NSWorker


class Rule:
    """An owner work that doubles each direction, noting the thread it ran on."""

    def __init__(self, fail: bool = False) -> None:
        self.threads: set[int] = set()
        self.fail = fail

    def owner_work(self, indices, directions):
        self.threads.add(threading.get_ident())
        if self.fail:
            raise ValueError("a bad direction")
        return [d * 2 for d in directions]


class OneBatch:
    """The owners' batching: every matrix in one batch."""

    @staticmethod
    def run(work, indices, directions, rows=None):
        return dict(zip(indices, work(indices, [directions[i] for i in indices]))), {}


def _launch(block: int, directions: dict[int, torch.Tensor], then=None) -> SimpleNamespace:
    return SimpleNamespace(block=block, pending=Pending([], lambda: directions, CommStats(), then=then))


def test_each_block_runs_on_the_worker_thread_and_the_step_takes_them_in_block_order():
    rule = Rule()
    worker = NSWorker(HostStreams(), rule, OneBatch())
    try:
        worker.submit(_launch(5, {7: torch.ones(2, 3)}))
        worker.submit(_launch(2, {1: torch.full((3, 3), 3.0), 4: torch.zeros(1, 2)}))
        early = worker.take()
        assert list(early) == [2, 5]
        assert torch.equal(early[5].updates[7], torch.full((2, 3), 2.0))
        assert torch.equal(early[2].updates[1], torch.full((3, 3), 6.0)) and early[2].rows == {}
        assert early[2].spent is not None
        assert rule.threads and threading.get_ident() not in rule.threads  # not on the main thread
        assert worker.take() == {}  # taken once
    finally:
        worker.shutdown()


def test_an_error_in_the_owner_work_reaches_whoever_takes_the_result():
    worker = NSWorker(HostStreams(), Rule(fail=True), OneBatch())
    try:
        worker.submit(_launch(0, {0: torch.ones(2, 2)}))
        with pytest.raises(ValueError, match="a bad direction"):
            worker.result(0)
    finally:
        worker.shutdown()


def test_shutdown_ends_the_thread_and_wakes_a_block_waiting_for_a_hop():
    """CUDA/NCCL rule: only the main thread issues collectives, so the worker waits on the host for
    the main thread to issue a launch's next hop; at teardown that hop never comes. The waiting
    block ends with an error and the thread ends, instead of waiting forever."""
    worker = NSWorker(HostStreams(), Rule(), OneBatch())
    thread = worker.thread
    assert thread is not None and thread.daemon  # a rank that raises exits although its worker waits
    second = Pending([], no_result, CommStats())
    launch = _launch(0, {}, then=lambda: second)
    worker.submit(launch)
    time.sleep(0.2)
    assert thread.is_alive()
    launch.pending.abandon()
    worker.shutdown()
    with pytest.raises(RuntimeError, match="abandoned"):
        worker.result(0)
    thread.join(timeout=5.0)
    assert not thread.is_alive() and worker.thread is None
    with pytest.raises(AssertionError, match="shut down"):
        worker.submit(_launch(1, {}))


def test_the_worker_enters_the_device_and_its_results_are_ordered_after_its_stream(checker):
    """CUDA rule: a new thread starts on device 0 (Triton launches on the thread's current device), so
    the worker enters the device first; the NS stream is not forked from the thread's default stream
    (only the exchange's event orders its inputs), and its results reach another stream only through
    the event the worker records."""
    worker = NSWorker(checker, Rule(), OneBatch())
    try:
        directions = {3: torch.ones(4, 4) * 2}  # made on the compute stream, before the launch's event
        worker.submit(_launch(1, directions))
        updates = worker.result(1).updates
        assert checker.waits[("ns", "compute")] == 1  # the exchange's landing: the event of its making
        assert checker.waits[("compute", "ns")] == 1  # the results: the worker's event
        assert (updates[3] + 1).sum().item() == 80  # read on the compute stream: ordered by that wait
    finally:
        worker.shutdown()
