"""run_distributed: results in rank order; a native crash or an exception of a rank fails the call (no retry)."""

from __future__ import annotations

import os
import signal

import pytest
import torch.multiprocessing as mp

from dmuon.util.spawn import run_distributed


def _rank_and_size(rank: int, world_size: int) -> tuple[int, int]:
    return rank, world_size


def _crash_once(rank: int, world_size: int, marker: str) -> int:
    """Rank 1 dies of SIGSEGV the first time (the marker file does not exist yet), then returns."""
    if rank == 1 and not os.path.exists(marker):
        open(marker, "w").close()
        os.kill(os.getpid(), signal.SIGSEGV)
    return rank


def _raise(rank: int, world_size: int) -> int:
    raise ValueError("raised by a rank")


def test_results_come_in_rank_order():
    assert run_distributed(_rank_and_size, 3) == [(0, 3), (1, 3), (2, 3)]


def test_a_native_crash_fails_without_a_retry(tmp_path):
    # The shipped launcher never runs a function twice: the crash fails the call even though a second
    # run would pass (the marker now exists).
    with pytest.raises(mp.ProcessExitedException, match="SIGSEGV"):
        run_distributed(_crash_once, 2, str(tmp_path / "m"))
    assert (tmp_path / "m").exists()


def test_an_exception_fails_the_call():
    with pytest.raises(mp.ProcessRaisedException, match="raised by a rank"):
        run_distributed(_raise, 2)
